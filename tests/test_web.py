"""The web dashboard as the package ships and serves it: the committed build is web/'s build,
it is in the sdist and the wheel, `colibri serve` serves it at / without shadowing the APIs,
the API key still guards every API, and `colibri web` opens a browser on it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import httpx
import pytest

from colibri.api.web import CONTENT_SECURITY_POLICY, WEB_DIR

from .server import RunningServer
from .web_support import ROOT, WEB, need_node_packages

KEY = "web-key-1"


def _tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_the_committed_dashboard_is_the_build_of_web(tmp_path):
    """python/colibri/_web is what `npm run build` makes of web/ now (rebuild and commit it
    after changing web/: `cd web && npm run build`)."""
    need_node_packages()
    out = tmp_path / "web-build"
    subprocess.run(
        ["npx", "vite", "build", "--logLevel", "error"],
        cwd=WEB,
        env={**os.environ, "COLIBRI_WEB_OUT_DIR": str(out)},
        check=True,
        timeout=300,
    )
    built, committed = _tree(out), _tree(WEB_DIR)
    assert "index.html" in built
    assert sorted(built) == sorted(committed), "stale python/colibri/_web: run `npm run build`"
    for name, data in built.items():
        assert committed[name] == data, f"{name} differs from the build of web/"


def test_the_dashboard_is_in_the_sdist_and_the_wheel(tmp_path):
    """Installing from either needs no Node: the built files are package data."""
    maturin = Path(sys.executable).parent / "maturin"
    subprocess.run([maturin, "sdist", "-o", tmp_path], cwd=ROOT, check=True, timeout=300)
    (sdist,) = tmp_path.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
    want = [f"python/colibri/_web/{name}" for name in _tree(WEB_DIR)]
    for name in want:
        assert any(n.endswith(name) for n in names), f"{name} not in the sdist"
    # The wheel, for this interpreter: the same build configuration as `maturin develop`'s, so
    # cargo finds the engine built already (another interpreter would rebuild it, twice).
    subprocess.run(
        [maturin, "build", "--release", "-i", sys.executable, "-o", tmp_path, "-q"],
        cwd=ROOT,
        check=True,
        timeout=1800,
    )
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        inside = set(z.namelist())
        for name in _tree(WEB_DIR):
            assert f"colibri/_web/{name}" in inside, f"{name} not in the wheel"
        assert z.read("colibri/_web/index.html") == (WEB_DIR / "index.html").read_bytes()


@pytest.fixture(scope="module")
def keyed():
    srv = RunningServer("--api-key", KEY)
    yield srv
    srv.stop()


def test_the_page_and_its_files_are_served_at_the_root(keyed):
    page = httpx.get(keyed.url + "/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert page.headers["cache-control"] == "no-cache"
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert page.headers["x-frame-options"] == "DENY"
    assets = re.findall(r'(?:src|href)="\./(assets/[^"]+)"', page.text)
    assert any(a.endswith(".js") for a in assets) and any(a.endswith(".css") for a in assets)
    for asset in assets:
        r = httpx.get(f"{keyed.url}/{asset}")
        assert r.status_code == 200
        assert r.content == (WEB_DIR / asset).read_bytes()
        assert "immutable" in r.headers["cache-control"]
    assert httpx.head(keyed.url + "/").status_code == 200
    # The ready output names the page.
    deadline = time.monotonic() + 5
    while not any("web dashboard at" in line for line in keyed.log):
        assert time.monotonic() < deadline, "".join(keyed.log)
        time.sleep(0.05)
    assert any(f"colibri: web dashboard at {keyed.url}/" in line for line in keyed.log)


def test_the_key_still_guards_every_api_and_nothing_is_shadowed(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}
    # Public: the page, its files, the health status.
    assert httpx.get(keyed.url + "/health").json() == {"status": "ok"}
    # Everything else needs the key, as before the dashboard.
    for path in (
        "/v1/models",
        "/metrics",
        "/v1/colibri/profile",
        "/v1/colibri/info",
        "/v1/colibri/experts",
        "/index.html",
        "/nope",
    ):
        r = httpx.get(keyed.url + path)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(keyed.url + "/", json={})
    assert r.status_code == 401
    # With it: the APIs answer as ever; unknown paths are the API's 404, not the page.
    assert httpx.get(keyed.url + "/v1/models", headers=auth).json()["data"][0]["id"]
    assert httpx.get(keyed.url + "/metrics", headers=auth).status_code == 200
    assert "capacity" in httpx.get(keyed.url + "/health", headers=auth).json()
    for path in ("/nope", "/assets/nope.js", "/v1/nope", "/index.html"):
        r = httpx.get(keyed.url + path, headers=auth)
        assert r.status_code == 404, path
        assert r.json()["error"]["code"] == "not_found"
    r = httpx.post(keyed.url + "/", headers=auth, json={})
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    # The Host check covers the page too (DNS rebinding).
    r = httpx.get(keyed.url + "/", headers={"Host": "evil.example"})
    assert r.status_code == 403


def test_the_engine_info_endpoint_describes_the_served_model(keyed):
    from colibri.demo.builtin import builtin_model_dir
    from colibri.runtime.engine import Engine

    r = httpx.get(keyed.url + "/v1/colibri/info", headers={"x-api-key": KEY})
    assert r.status_code == 200
    info = r.json()
    engine = Engine(builtin_model_dir(), threads=2)
    assert info["model"] == keyed.model_id
    assert info["chat_family"] == "glm"
    assert info["chat_template"] == "model"
    for name in ("architecture", "quantization", "num_layers", "num_experts", "kernel"):
        assert info[name] == engine.info[name], name
    assert info["threads"] == 2 and info["kv_slots"] == 1
    assert info["expert_cache"] is None  # every expert resident without --ram-gb


def test_the_experts_endpoint_maps_routing_heat_and_the_last_turn(keyed):
    auth = {"Authorization": f"Bearer {KEY}"}

    def get() -> dict:
        r = httpx.get(keyed.url + "/v1/colibri/experts", headers=auth)
        assert r.status_code == 200
        return r.json()

    before = get()
    r = httpx.post(
        keyed.base_url + "/chat/completions",
        headers=auth,
        json={"model": keyed.model_id, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 8},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200
    after = get()
    assert after["turns"] == before["turns"] + 1
    assert after["placement"] == "resident"
    experts = after["experts"]
    assert experts > 0 and after["layers"]
    for layer in after["layers"]:
        assert len(layer["counts"]) == experts
        assert layer["routed"] and all(0 <= e < experts for e in layer["routed"])
        assert layer["routed"] == sorted(set(layer["routed"]))
        assert layer["tiers"] == "r" * experts  # every expert resident: no --ram-gb
    # The turn's selections were counted: 8 tokens and a prompt, top-k experts each.
    grew = sum(sum(x["counts"]) for x in after["layers"]) - sum(
        sum(x["counts"]) for x in before["layers"]
    )
    assert grew > 0


def test_colibri_web_opens_the_dashboard_in_a_browser(tmp_path):
    """$BROWSER is how Python's webbrowser finds the user's browser: here a script that writes
    down the address it was given."""
    seen = tmp_path / "opened.txt"
    browser = tmp_path / "browser.sh"
    browser.write_text(f'#!/bin/sh\nprintf "%s" "$1" > {seen}\n')
    browser.chmod(0o755)
    srv = RunningServer(command="web", env={"BROWSER": str(browser)})
    try:
        deadline = time.monotonic() + 20
        while not seen.exists() or not seen.read_text():
            assert time.monotonic() < deadline, "no browser was opened:\n" + "".join(srv.log)
            time.sleep(0.05)
        url = seen.read_text()
        assert url == srv.url + "/"
        assert httpx.get(url).status_code == 200
    finally:
        srv.stop()


def test_colibri_web_no_browser_only_serves(tmp_path):
    seen = tmp_path / "opened.txt"
    browser = tmp_path / "browser.sh"
    browser.write_text(f"#!/bin/sh\ntouch {seen}\n")
    browser.chmod(0o755)
    srv = RunningServer("--no-browser", command="web", env={"BROWSER": str(browser)})
    try:
        assert httpx.get(srv.url + "/").status_code == 200
        time.sleep(1)
        assert not seen.exists()
    finally:
        srv.stop()
