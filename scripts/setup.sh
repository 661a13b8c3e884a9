#!/usr/bin/env bash
# Sets up everything colibri needs from a fresh clone: a virtualenv in .venv with the build and
# test tools, and the package itself installed in development mode with a release-built engine.
# Idempotent and quick when nothing changed. Needs python3 (3.11+) and a Rust toolchain (cargo).
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v cargo >/dev/null 2>&1; then
  [ -x "$HOME/.cargo/bin/cargo" ] && export PATH="$HOME/.cargo/bin:$PATH"
fi
command -v cargo >/dev/null || { echo "setup: cargo (Rust) is required" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.colibri-tools
want="$(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check \
    "maturin>=1.9,<2"
  echo "$want" > "$stamp"
fi
# Builds the Rust engine in release mode and installs colibri (editable) into .venv.
VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --release -E dev -q
.venv/bin/python -c "import colibri._engine"
# The dashboard's npm packages and the browser of its tests.
scripts/setup-web.sh
