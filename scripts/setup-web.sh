#!/usr/bin/env bash
# What the web dashboard (web/) needs to be built and tested: its npm packages, exactly as
# web/package-lock.json pins them (`npm ci`, skipped while the lock file is unchanged), and
# Debian's chromium for the browser tests (tests/test_web_browser.py), installed with apt-get
# when this runs as root. Called by scripts/setup.sh. `pip install colibri` needs none of it:
# the built dashboard is committed in python/colibri/_web.
set -euo pipefail
cd "$(dirname "$0")/.."

strict=0
[ "${CI:-}" = "true" ] && strict=1

if ! command -v npm >/dev/null 2>&1; then
  echo "setup-web: npm (Node.js 20.19+) not found: the dashboard's build and tests cannot run" >&2
  [ "$strict" = 1 ] && exit 1
  exit 0
fi

stamp=web/node_modules/.colibri-lock
want="$(sha256sum web/package-lock.json | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  (cd web && npm ci --no-audit --no-fund --loglevel=error)
  echo "$want" > "$stamp"
fi

if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup-web: installing Debian's chromium for the browser tests" >&2
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null
  else
    echo "setup-web: no /usr/bin/chromium: the browser tests will be skipped" \
      "(install it: apt-get install chromium)" >&2
    [ "$strict" = 1 ] && exit 1
  fi
fi
exit 0
