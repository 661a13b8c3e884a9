"""Per-model observability of a catalog server (issue 35, deliverable 6): every series of
``/metrics`` carries a ``model`` label (the scheduler's names of seed 000 unchanged, one family
per name, the same label names on every series of a family); ``/health``, ``/v1/colibri/profile``,
``/v1/colibri/info`` and ``/v1/colibri/experts`` take ``?model=`` resolved as every route
resolves a model (default model when absent) and never load one; each model has its own KV
slots and slot files, also two entries of one model directory. The server: the demo model
(default), the random built-in model under the ids ``a`` and ``b`` (``b`` with the alias
``bee``, both named ``twin``), with an API key and two KV slots."""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from colibri.demo.builtin import builtin_model_dir

from .server import RunningServer

KEY = "k-metrics"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Seed 000's scheduler metrics, by name and type.
SEED_000 = {
    "colibri_scheduler_active": "gauge",
    "colibri_scheduler_queued": "gauge",
    "colibri_scheduler_capacity": "gauge",
    "colibri_scheduler_max_queue": "gauge",
    "colibri_scheduler_admitted": "counter",
    "colibri_scheduler_completed": "counter",
    "colibri_scheduler_failed": "counter",
    "colibri_scheduler_rejected": "counter",
    "colibri_scheduler_timed_out": "counter",
    "colibri_scheduler_cancelled": "counter",
    "colibri_scheduler_queue_wait_seconds": "histogram",
    "colibri_scheduler_slot_duration_seconds": "histogram",
    "colibri_scheduler_first_output_seconds": "histogram",
    "colibri_scheduler_engine_call_seconds": "histogram",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog-metrics")
    builtin = str(builtin_model_dir())
    entries = [
        {"id": "a", "path": builtin, "name": "twin"},
        {"id": "b", "path": builtin, "name": "twin", "aliases": ["bee"]},
    ]
    (root / "catalog.json").write_text(json.dumps(entries))
    srv = RunningServer(
        "--catalog",
        str(root / "catalog.json"),
        "--api-key",
        KEY,
        "--kv-slots",
        "2",
        default_model=True,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0)


def scrape(http: httpx.Client) -> dict[str, object]:
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, sample: str, **labels: str) -> float | None:
    """The value of the series ``sample`` with ``labels`` (None: no such series)."""
    for family in families.values():
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def test_every_series_has_a_model_label_and_each_family_one_label_set(http, oai):
    oai.completions.create(model="colibri-demo", prompt="Hi", max_tokens=2)
    oai.completions.create(model="a", prompt="Hi", max_tokens=3)
    families = scrape(http)
    for name, kind in SEED_000.items():
        assert families[name].type == kind, name
    for family in families.values():
        if not family.name.startswith("colibri_"):
            continue
        label_sets = {
            frozenset(k for k in s.labels if k != "le")
            for s in family.samples
            if not s.name.endswith("_created")
        }
        assert len(label_sets) <= 1, (family.name, label_sets)
        for s in family.samples:
            assert "model" in s.labels, (family.name, s)
    engine = [f for f in families.values() if not f.name.startswith("colibri_model_")]
    models = {s.labels["model"] for f in engine for s in f.samples if s.labels}
    assert models == {"colibri-demo", "a"}  # b is not loaded: no engine series of its own yet
    # ... but the catalog's series describe it: its state (one of four set), its RAM.
    for model, now in (("colibri-demo", "loaded"), ("a", "loaded"), ("b", "cold")):
        for state in ("loaded", "loading", "cold", "failed"):
            got = value(families, "colibri_model_state", model=model, state=state)
            assert got == (1.0 if state == now else 0.0), (model, state, got)
        assert value(families, "colibri_model_ram_bytes", model=model) > 0
    assert value(families, "colibri_scheduler_capacity", model="a") == 2
    assert value(families, "colibri_engine_kv_tokens", model="a", slot="1") == 0


def test_a_cold_model_is_described_by_its_state_and_never_loaded_for_it(http):
    for label in ("b", "bee"):
        r = http.get("/health", params={"model": label})
        assert r.status_code == 200
        assert r.json() == {"status": "ok", "model": "b", "state": "cold"}
    for path in ("/v1/colibri/profile", "/v1/colibri/info", "/v1/colibri/experts"):
        r = http.get(path, params={"model": "bee"})
        assert r.status_code == 409, (path, r.text)
        assert r.json()["error"]["code"] == "model_not_loaded"
        assert "'b' is not loaded (cold)" in r.json()["error"]["message"]
    assert http.get("/health", params={"model": "b"}).json()["state"] == "cold"


def test_each_model_counts_its_own_requests(http, oai):
    def counts() -> list[float]:
        f = scrape(http)
        return [
            value(f, "colibri_scheduler_admitted_total", model=m) or 0.0
            for m in ("colibri-demo", "a", "b")
        ]

    before = counts()
    oai.completions.create(model="a", prompt="Hi", max_tokens=2)
    oai.completions.create(model="bee", prompt="Hi", max_tokens=2)
    oai.completions.create(model="bee", prompt="Hello there", max_tokens=3)
    after = counts()
    assert [x - y for x, y in zip(after, before, strict=True)] == [0, 1, 2]
    f = scrape(http)
    generated = value(f, "colibri_engine_generated_tokens_total", model="b")
    assert generated == 5  # b's own two replies, nothing of a's


def test_health_and_the_engine_pages_describe_the_model_named(http):
    h = http.get("/health", params={"model": "bee"}).json()
    assert h["model"] == "b" and h["state"] == "loaded" and h["capacity"] == 2
    assert h["admitted"] == h["completed"] == 2 and "models" in h
    default = http.get("/health").json()
    assert default["model"] == "colibri-demo" and default["state"] == "loaded"
    assert default["admitted"] == 1  # the demo model's own count
    profile = http.get("/v1/colibri/profile", params={"model": "bee"}).json()
    assert profile["model"] == "b" and len(profile["turns"]) == 2
    assert http.get("/v1/colibri/profile").json()["model"] == "colibri-demo"
    info = http.get("/v1/colibri/info", params={"model": "b"}).json()
    assert info["model"] == "b" and info["kv_slots"] == 2 and info["context_length"] == 2048
    experts = http.get("/v1/colibri/experts", params={"model": "b"}).json()
    assert experts["model"] == "b" and experts["turns"] == 2
    # Resolved as on every route: unknown 404, ambiguous 409, each naming the problem.
    for path in ("/health", "/v1/colibri/profile", "/v1/colibri/info", "/v1/colibri/experts"):
        r = http.get(path, params={"model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", path
        r = http.get(path, params={"model": "twin"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "ambiguous_model", path
        assert "'a'" in r.json()["error"]["message"] and "'b'" in r.json()["error"]["message"]


def test_the_public_health_reads_no_model_name(server):
    r = httpx.get(server.url + "/health", params={"model": "nope"})
    assert r.status_code == 200
    # How many models are in each state, never which (tests/test_server_ram_budget.py).
    assert r.json()["status"] == "ok" and set(r.json()) == {"status", "models_by_state"}
    assert sum(r.json()["models_by_state"].values()) == 3
    words = {*r.json(), r.json()["status"], *r.json()["models_by_state"]}
    assert words == {"status", "ok", "models_by_state", "loaded", "loading", "cold", "failed"}
    r = httpx.get(server.url + "/v1/colibri/profile", params={"model": "a"})
    assert r.status_code == 401


def test_two_entries_of_one_directory_never_share_a_slot_or_its_file(server, oai):
    prompt = "A sentence only model a has seen before, long enough to be worth reusing."
    oai.completions.create(model="a", prompt=prompt, max_tokens=1)
    again = oai.completions.create(model="a", prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # a's slot kept it
    other = oai.completions.create(model="b", prompt=prompt, max_tokens=1)
    cached = other.usage.prompt_tokens_details
    assert cached is None or cached.cached_tokens == 0  # b's slots never saw it

    # Both generate at once: neither waits for, nor locks out, the other's slot files.
    errors: list[BaseException] = []

    def run(model: str) -> None:
        try:
            r = oai.completions.create(model=model, prompt="Go", max_tokens=200)
            assert r.model == model and r.usage.completion_tokens == 200
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(m,)) for m in ("a", "b", "a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors

    kv = Path(server.kv_dir)
    files = [p for p in kv.rglob("slot-*.kv")]
    owners = Counter(p.relative_to(kv).parts[0] for p in files)
    assert owners == {"colibri-demo": 2, "a": 2, "b": 2}, sorted(map(str, files))
    resolved = [p.resolve() for p in files]
    assert len(set(resolved)) == len(resolved)
    # Nothing is written at the top of --kv-dir: each model keeps to its own directory.
    assert {p.name for p in kv.iterdir()} == {"colibri-demo", "a", "b"}
