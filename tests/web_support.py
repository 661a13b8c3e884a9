"""What the dashboard's tests need from the machine: web/'s npm packages and Debian's chromium.

scripts/setup-web.sh installs both. Missing on a developer's machine, the tests that need them
are skipped with the reason; missing in CI (CI=true), they fail: CI must run them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WEB = ROOT / "web"
CHROMIUM = Path("/usr/bin/chromium")


def need(ok: bool, what: str) -> None:
    if ok:
        return
    message = f"{what} (scripts/setup-web.sh installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def need_node_packages() -> None:
    need(shutil.which("npm") is not None, "npm not found")
    need((WEB / "node_modules" / ".bin" / "vite").exists(), "web/node_modules is not installed")


def need_chromium() -> None:
    need(CHROMIUM.is_file() and os.access(CHROMIUM, os.X_OK), f"no {CHROMIUM}")
