"""The one RAM budget (``--ram-gb``, issue 35) and per-model states in ``/health``, through the
real server.

Budget: every loaded model's fixed part (resident weights, KV slots at full context) and expert
cache count against ``--ram-gb``; loading a cold model unloads the one used longest ago, never
one that is generating, never the default; each expert cache gets what the rule leaves it
(docs/API.md, "RAM budget"), as ``/v1/colibri/info`` shows. The expected sizes are worked out
here from the model files and a loaded engine's own figures, not from the server's arithmetic.

Health: a model that fails to load (a damaged copy of the built-in model in tmp) or whose engine
fails (its experts file cut short while it runs on a small expert cache) makes the server
``degraded``: the public ``/health`` counts it ``failed`` without naming anything, the
authenticated one lists it with the message, and the other models keep serving."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from colibri.demo.builtin import builtin_model_dir, default_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer

KEY = "k-budget"
AUTH = {"Authorization": f"Bearer {KEY}"}


def fixed_of(path: Path, slots: int = 1) -> int:
    """A model's fixed part from its files and a loaded engine's figures: resident weights and
    KV slots at full context (these models have no linear-attention state)."""
    info = Engine(path, threads=1).info
    assert info["state_bytes_per_slot"] == 0
    return size(path, "resident.bin") + slots * info["context_length"] * info["kv_bytes_per_token"]


def size(path: Path, name: str) -> int:
    return (path / name).stat().st_size


def record_of(path: Path) -> int:
    return json.loads((path / "manifest.json").read_text())["experts"]["record_size"]


def gb(n: int) -> str:
    """``n`` bytes as --ram-gb (a few bytes over: the decimal string never rounds them away)."""
    return repr((n + 8) / 1e9)


def serve_catalog(root: Path, entries: list[dict], ram: str, *extra: str) -> RunningServer:
    (root / "catalog.json").write_text(json.dumps(entries))
    return RunningServer(
        "--catalog", str(root / "catalog.json"), "--ram-gb", ram, *extra, default_model=True
    )


def states(http: httpx.Client) -> dict[str, str]:
    return {m["id"]: m["state"] for m in http.get("/health").json()["models"]}


def use(client: openai.OpenAI, model: str) -> None:
    assert client.completions.create(model=model, prompt="Hi", max_tokens=1).model == model


# --- the budget unloads the least recently used model, never the generating one ---------------


@pytest.fixture(scope="module")
def lru(tmp_path_factory):
    """The demo model (default) and the built-in model under x, y, z, with a budget that holds
    the demo model whole and two of the others whole."""
    demo, builtin = default_model_dir(), builtin_model_dir()
    whole = fixed_of(builtin) + size(builtin, "experts.bin")
    experts_demo = size(demo, "experts.bin")
    # The rule: after the demo model's fixed part, the demo model and the models loaded on
    # demand share equally; the demo model wants its experts, the others 3 x whole; with
    # 2 x whole >= the demo model's experts, the demo model takes them all and the rest (two
    # wholes) is the on-demand share.
    assert 2 * whole >= experts_demo
    budget = fixed_of(demo) + experts_demo + 2 * whole + 100
    entries = [{"id": i, "path": str(builtin)} for i in ("x", "y", "z")]
    srv = serve_catalog(tmp_path_factory.mktemp("lru"), entries, gb(budget), "--quiet")
    yield srv, budget, whole
    srv.stop()


def held_stream(url: str, model: str) -> socket.socket:
    """A streamed completion of ``model`` whose client reads nothing more after the response
    starts: a 1 KiB receive window, so the server's writes (and the generation that feeds
    them) stall until the client reads. The model is generating all that time."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.connect((host, int(port)))
    body = json.dumps({"model": model, "prompt": "Go", "max_tokens": 1500, "stream": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: " + f"{host}:{port}".encode()
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip
    assert sock.recv(64).startswith(b"HTTP/1.1 200")
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    sock.settimeout(60)
    data = b""
    while b"data: [DONE]" not in data:
        chunk = sock.recv(1 << 16)
        assert chunk, data[-500:]
        data += chunk
    sock.close()
    return data


def active(http: httpx.Client, model: str) -> int:
    return http.get("/health", params={"model": model}).json()["active"]


def test_the_budget_unloads_the_model_used_longest_ago_and_never_a_generating_one(lru):
    srv, budget, whole = lru
    client = openai.OpenAI(base_url=srv.base_url, api_key="any", max_retries=0)
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        use(client, "x")
        use(client, "y")
        assert states(http) == {"colibri-demo": "loaded", "x": "loaded", "y": "loaded", "z": "cold"}
        stream = held_stream(srv.url, "x")  # x generates from now on ...
        assert active(http, "x") == 1
        use(client, "y")  # ... and y is used after it: x is the one used longest ago
        use(client, "z")  # room for z: x is generating, so y goes
        assert states(http) == {"colibri-demo": "loaded", "x": "loaded", "y": "cold", "z": "loaded"}
        assert active(http, "x") == 1
        health = http.get("/health").json()
        assert health["models_unloaded"] == 1 and health["status"] == "ok"
        # x's generation went on through all of it, to its end.
        text = read_to_end(stream).decode(errors="replace")
        assert '"finish_reason":"length"' in text.replace(" ", ""), text[-500:]
        deadline = time.monotonic() + 30
        while active(http, "x") and time.monotonic() < deadline:
            time.sleep(0.05)
        use(client, "y")  # now x, idle, is the one used longest ago
        assert states(http) == {"colibri-demo": "loaded", "x": "cold", "y": "loaded", "z": "loaded"}
        health = http.get("/health").json()
        assert health["models_unloaded"] == 2
        assert health["ram_budget_bytes"] == pytest.approx(budget, abs=10)
        ram = {m["id"]: m["ram_bytes"] for m in health["models"]}
        assert ram["y"] == ram["z"] == whole  # each whole: its fixed part and every expert
        loaded = [m["ram_bytes"] for m in health["models"] if m["state"] == "loaded"]
        assert sum(loaded) <= health["ram_budget_bytes"]
        # /metrics says the same of every model (a scrape, while nothing changes).
        metrics = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(http.get("/metrics").text)
            for s in f.samples
        }
        for m in health["models"]:
            key = ("colibri_model_state", (("model", m["id"]), ("state", m["state"])))
            assert metrics[key] == 1.0, m
            assert metrics[("colibri_model_ram_bytes", (("model", m["id"]),))] == m["ram_bytes"]
        assert sum(v for (name, _), v in metrics.items() if name == "colibri_model_state") == 4


# --- the expert caches get what the budget leaves them ------------------------------------------


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """The demo model (default) and ``fragile``, a copy of the built-in model in tmp, under a
    budget whose rest after the fixed parts neither holds whole: both get an equal share. And
    ``toobig`` (the demo model again), whose fixed part alone is more than that share."""
    root = tmp_path_factory.mktemp("tight")
    fragile = root / "fragile"
    shutil.copytree(builtin_model_dir(), fragile)
    demo = default_model_dir()
    fixed_d, fixed_f, rec_f = fixed_of(demo), fixed_of(fragile), record_of(fragile)
    # After the demo model's fixed part, room = 2 x (fragile's fixed part + 2 records): the demo
    # model's share (half) is less than its experts, fragile's share leaves it two records.
    room = 2 * (fixed_f + 2 * rec_f)
    assert (
        room // 2 < size(demo, "experts.bin") and fixed_f + size(fragile, "experts.bin") > room // 2
    )
    budget = fixed_d + room
    assert fixed_d > room // 2 + 8
    entries = [{"id": "fragile", "path": str(fragile)}, {"id": "toobig", "path": str(demo)}]
    srv = serve_catalog(root, entries, gb(budget), "--api-key", KEY)
    yield srv, budget, fragile, room
    srv.stop()


def test_each_expert_cache_fits_in_what_the_budget_leaves_it(tight):
    srv, budget, fragile, _ = tight
    demo = default_model_dir()
    line = next(x for x in srv.log if "RAM budget" in x)
    assert line.startswith("colibri: RAM budget ") and "colibri-demo" in line, line
    assert "left for the models loaded on demand" in line, line
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    use(client, "fragile")
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
        caches = {
            m: http.get("/v1/colibri/info", params={"model": m}).json()["expert_cache"]
            for m in ("colibri-demo", "fragile")
        }
        health = http.get("/health").json()
    total = health["ram_budget_bytes"]
    assert total == pytest.approx(budget, abs=10)
    # The rule, by hand: what the demo model's fixed part leaves is shared in two halves (each
    # wants more than half); the smaller claimant takes the lower half.
    room = total - fixed_of(demo)
    wants = {"colibri-demo": size(demo, "experts.bin")}
    # The on-demand share wants both of its models whole.
    wants["fragile"] = fixed_of(fragile) + size(fragile, "experts.bin")
    wants["fragile"] += fixed_of(demo) + size(demo, "experts.bin")
    low = min(wants, key=wants.__getitem__)
    share = {m: room // 2 if m == low else room - room // 2 for m in wants}
    cache = {"colibri-demo": share["colibri-demo"], "fragile": share["fragile"] - fixed_of(fragile)}
    assert caches["fragile"]["slots"] == 2  # its share less its own fixed part: two records
    assert caches["colibri-demo"]["slots"] == cache["colibri-demo"] // record_of(demo)
    ram = {m["id"]: m["ram_bytes"] for m in health["models"] if m["state"] == "loaded"}
    assert ram == {
        "colibri-demo": fixed_of(demo) + share["colibri-demo"],
        "fragile": share["fragile"],
    }
    assert sum(ram.values()) <= total
    for m, c in caches.items():
        assert c["slots"] * c["record_size"] <= cache[m]  # within what the budget left it


def test_an_engine_that_fails_on_another_model_makes_the_server_degraded(tight):
    """fragile runs on two cached records; its experts file cut short, its next misses cannot
    be read: its engine fails. The default model keeps serving; /health says so."""
    srv, _, fragile, _ = tight
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    use(client, "fragile")
    with open(fragile / "experts.bin", "r+b") as f:
        f.truncate(0)
    with pytest.raises(openai.APIError):
        client.completions.create(model="fragile", prompt="Tell me more", max_tokens=50)
    public = httpx.get(srv.url + "/health")
    assert public.status_code == 200
    assert public.json() == {
        "status": "degraded",
        "models_by_state": {"loaded": 1, "loading": 0, "cold": 1, "failed": 1},
    }
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
        health = http.get("/health").json()
        assert health["status"] == "degraded" and health["model"] == "colibri-demo"
        (entry,) = [m for m in health["models"] if m["id"] == "fragile"]
        assert entry["state"] == "failed" and entry["error"].startswith("the engine failed: ")
        r = http.get("/health", params={"model": "fragile"})
        assert r.status_code == 503 and r.json()["state"] == "failed"
        assert r.json()["status"] == "error" and r.json()["error"]
    r = client.completions.create(model="colibri-demo", prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_a_model_that_can_never_fit_the_budget_fails_to_load_saying_why(tight):
    srv = tight[0]
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="toobig", prompt="Hi", max_tokens=1)
    assert e.value.status_code == 503 and e.value.body["code"] == "model_load_failed"
    message = e.value.body["message"]
    assert (
        message.startswith("The model 'toobig' (")
        and "failed to load: it needs at least" in message
    )
    assert "resident weights" in message and "KV" in message and "--ram-gb" in message
    assert "beside the models never unloaded (the default and pinned ones)" in message
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
        models = {m["id"]: m for m in http.get("/health").json()["models"]}
    assert models["toobig"]["state"] == "failed" and models["toobig"]["error"] == message
    assert models["colibri-demo"]["state"] == "loaded"  # nothing was unloaded for it


# --- a model that fails to load is visible in the public /health -----------------------------


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """The demo model (default), the built-in model as ``ok``, and ``broken``: a copy of the
    built-in model in tmp whose resident weights are cut short (its load fails)."""
    root = tmp_path_factory.mktemp("broken")
    damaged = root / "damaged-model"
    shutil.copytree(builtin_model_dir(), damaged)
    with open(damaged / "resident.bin", "r+b") as f:
        f.truncate(100)
    entries = [
        {"id": "ok", "path": str(builtin_model_dir())},
        {"id": "broken", "path": str(damaged)},
    ]
    (root / "catalog.json").write_text(json.dumps(entries))
    srv = RunningServer(
        "--catalog", str(root / "catalog.json"), "--api-key", KEY, default_model=True
    )
    yield srv, damaged
    srv.stop()


def test_a_model_that_fails_to_load_is_failed_in_health_until_a_load_succeeds(broken):
    srv, damaged = broken
    client = openai.OpenAI(base_url=srv.base_url, api_key=KEY, max_retries=0)
    public = httpx.get(srv.url + "/health").json()
    assert public == {
        "status": "ok",
        "models_by_state": {"loaded": 1, "loading": 0, "cold": 2, "failed": 0},
    }
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="broken", prompt="Hi", max_tokens=1)
    assert e.value.body["code"] == "model_load_failed"
    message = e.value.body["message"]
    use(client, "ok")  # the others keep serving
    r = httpx.get(srv.url + "/health")
    assert r.status_code == 200
    assert r.json() == {
        "status": "degraded",
        "models_by_state": {"loaded": 2, "loading": 0, "cold": 0, "failed": 1},
    }
    # Nothing that names the model, its directory or the problem reaches a caller without the key.
    for secret in ("broken", str(damaged), "damaged-model", "resident", KEY):
        assert secret not in r.text
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
        health = http.get("/health").json()
        assert health["status"] == "degraded" and health["ram_budget_bytes"] is None
        models = {m["id"]: m for m in health["models"]}
        assert models["broken"]["state"] == "failed"
        assert models["broken"]["error"] == message  # what its requests get
        assert "failed to load" in message and "past the end of the resident file" in message
        assert "error" not in models["ok"] and models["ok"]["state"] == "loaded"
        assert health["models_by_state"]["failed"] == 1
        named = http.get("/health", params={"model": "broken"})
        assert named.status_code == 503
        assert named.json() == {
            "status": "error",
            "model": "broken",
            "state": "failed",
            "error": message,
        }
        # Repaired, the next request loads it: failed no more, the server ok again.
        shutil.copyfile(builtin_model_dir() / "resident.bin", damaged / "resident.bin")
        use(client, "broken")
        health = http.get("/health").json()
        assert health["status"] == "ok" and states(http)["broken"] == "loaded"
        assert "error" not in {m["id"]: m for m in health["models"]}["broken"]
    assert httpx.get(srv.url + "/health").json()["status"] == "ok"


# --- startup: the one budget, its report, refusals and the old flag --------------------------


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--port", "0", "--no-kv-persist", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_budget_the_startup_models_cannot_fit_stops_the_server_with_the_numbers():
    builtin = builtin_model_dir()
    need = fixed_of(builtin) + record_of(builtin)
    r = serve("--model", str(builtin), "--ram-gb", gb(need - 1000))
    assert r.returncode == 2, r.stderr
    assert "colibri serve: --ram-gb" in r.stderr and "is too small" in r.stderr, r.stderr
    assert "resident weights" in r.stderr and "KV" in r.stderr
    assert f"give --ram-gb {-(-need // 10**6) / 1000:g} or more" in r.stderr, r.stderr


def test_both_budget_flags_at_once_is_a_usage_error_naming_the_one_to_keep():
    r = serve("--ram-gb", "4", "--models-ram-gb", "20")
    assert r.returncode == 2
    assert "--models-ram-gb is replaced by --ram-gb" in r.stderr, r.stderr
    assert "--ram-gb 20 to keep the models' limit" in r.stderr


def test_the_old_flag_still_works_with_a_warning(tmp_path):
    builtin = builtin_model_dir()
    budget = fixed_of(builtin) + 3 * record_of(builtin)
    srv = RunningServer("--models-ram-gb", gb(budget), "--api-key", KEY)
    try:
        log = "".join(srv.log)
        assert "--models-ram-gb (COLI_MODELS_RAM_GB) is deprecated" in log, log
        assert "colibri: RAM budget" in log
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as http:
            assert http.get("/health").json()["ram_budget_bytes"] == pytest.approx(budget, abs=10)
            cache = http.get("/v1/colibri/info").json()["expert_cache"]
            assert cache["slots"] == 3  # one model: what the budget leaves after its fixed part
    finally:
        srv.stop()
