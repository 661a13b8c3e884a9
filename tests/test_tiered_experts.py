"""Tiered experts through the Python API and the server: results never depend on placement,
and the per-turn profile reports where the time and the bytes went."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from colibri.demo.builtin import builtin_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer, ram_gb_for, routing_heat_json

PROFILE_KEYS = {
    "io_wait_s",
    "expert_matmul_s",
    "attention_s",
    "lm_head_s",
    "other_s",
    "bytes_read",
    "read_busy_s",
    "cache_hit_rate",
    "prefill_tok_s",
    "decode_tok_s",
}


def experts_bytes(model_dir) -> int:
    return os.path.getsize(model_dir / "experts.bin")


@pytest.fixture(
    scope="module", params=["builtin", "glm4_moe", "olmoe", "deepseek_v3", "glm_moe_dsa"]
)
def model_dir(request, converted):
    if request.param == "builtin":
        return builtin_model_dir()
    return converted(request.param, "int4")


def greedy(engine: Engine, ids: list[int], n: int = 24) -> list[int]:
    stream = engine.generate(ids, n)
    out = list(stream)
    stream.close()
    return out


@pytest.mark.parametrize(
    "budget,prefetch,direct_io,io",
    [
        (0.5, False, False, "auto"),
        (0.5, True, False, "pread"),
        (0.0, False, False, "auto"),  # the smallest budget the store allows
        (0.0, True, True, "uring"),
        (0.25, False, True, "pread"),
    ],
)
def test_greedy_tokens_never_depend_on_placement(model_dir, budget, prefetch, direct_io, io,
                                                monkeypatch):  # fmt: skip
    resident = Engine(model_dir, threads=2)
    ids = resident.tokenize("The quick brown fox jumps over the lazy dog. " * 3)
    want = greedy(resident, ids)
    monkeypatch.setenv("COLI_IO", io)
    gb = budget * experts_bytes(model_dir) / 1e9
    tiered = Engine(model_dir, threads=2, ram_gb=gb, prefetch=prefetch, direct_io=direct_io)
    assert greedy(tiered, ids) == want
    profile = tiered.last_profile()
    assert PROFILE_KEYS <= set(profile)
    assert profile["bytes_read"] > 0 and 0 <= profile["cache_hit_rate"] < 1
    stats = tiered.store_stats()
    assert stats is not None and stats["reads"] > 0
    # Reads took time: the turn's read busy time is some of the store's, never more.
    assert 0 < profile["read_busy_s"] <= stats["read_busy_s"]


def test_resident_model_reads_nothing_and_reports_its_turn(model_dir):
    engine = Engine(model_dir, threads=2)
    ids = engine.tokenize("Hello world")
    greedy(engine, ids, 10)
    p = engine.last_profile()
    assert p["bytes_read"] == 0 and p["cache_hit_rate"] == 1.0 and p["read_busy_s"] == 0
    assert p["prefill_tokens"] == len(ids) and p["decode_tokens"] == 9
    assert engine.store_stats() is None
    routed = engine.last_routed_experts()
    assert len(routed) == engine.info["num_layers"] and any(routed)


def test_profile_endpoint_and_serve_flags():
    # The smallest expert cache: the budget leaves one record after the model's resident
    # weights and KV.
    record = 4096
    srv = RunningServer("--ram-gb", ram_gb_for(builtin_model_dir(), record), "--api-key", "k")
    try:
        client = OpenAI(base_url=srv.base_url, api_key="k", max_retries=0)
        r = client.chat.completions.create(
            model="colibri-builtin", messages=[{"role": "user", "content": "Hi"}], max_tokens=8
        )
        cold = Engine(builtin_model_dir(), threads=2)
        assert r.usage.completion_tokens == 8
        assert httpx.get(srv.url + "/v1/colibri/profile").status_code == 401
        data = httpx.get(srv.url + "/v1/colibri/profile", headers={"x-api-key": "k"}).json()
        assert PROFILE_KEYS <= set(data["turns"][-1])
        assert data["turns"][-1]["bytes_read"] > 0
        assert data["expert_cache"]["reads"] > 0
        assert len(data["last_routed_experts"]) == cold.info["num_layers"]
        # Read busy time, per turn and the store's since it opened (its pinned load included).
        turn, cache = data["turns"][-1], data["expert_cache"]
        assert 0 < turn["read_busy_s"] <= cache["read_busy_s"]
        assert cache["io_wait_s"] >= 0
        # /metrics: the store's counters as counters with the model label, read at scrape time
        # (so never below what the profile said just before).
        text = httpx.get(srv.url + "/metrics", headers={"x-api-key": "k"}).text
        busy = metric(text, "colibri_engine_expert_read_busy_seconds_total", "colibri-builtin")
        wait = metric(text, "colibri_engine_expert_io_wait_seconds_total", "colibri-builtin")
        assert busy >= cache["read_busy_s"] > 0
        assert wait >= cache["io_wait_s"]
    finally:
        srv.stop()


def metric(text: str, name: str, model: str) -> float:
    """The value of the series ``name{model=...}`` in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == {"model": model}:
                return float(s.value)
    raise AssertionError(f"no {name}{{model={model!r}}} in /metrics")


def test_a_resident_model_reports_zero_read_busy_time_in_metrics():
    srv = RunningServer("--no-kv-persist")
    try:
        r = httpx.post(
            srv.base_url + "/chat/completions",
            json={"model": srv.model_id, "messages": [{"role": "user", "content": "Hi"}],
                  "max_tokens": 4},
            timeout=60,
        )  # fmt: skip
        assert r.status_code == 200
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "colibri_engine_expert_read_busy_seconds_total", srv.model_id) == 0
        assert metric(text, "colibri_engine_expert_io_wait_seconds_total", srv.model_id) == 0
        assert httpx.get(srv.url + "/v1/colibri/profile").json()["turns"][-1]["read_busy_s"] == 0
    finally:
        srv.stop()


def test_store_counters_in_metrics_go_on_through_an_unload():
    """The hub reads each engine's counters at scrape time and carries an unloaded engine's,
    so a model's counter never goes back when it loads again (a new engine starts at 0)."""
    from colibri.observability import MetricsHub
    from colibri.runtime.scheduler import Scheduler

    hub = MetricsHub()
    stats = {"read_busy_s": 1.5, "io_wait_s": 0.25}
    hub.attach("m", Scheduler(1, 0, 10), lambda: stats)
    hub.attach("r", Scheduler(1, 0, 10), lambda: None)  # every expert resident
    text = hub.exposition().decode()
    assert metric(text, "colibri_engine_expert_read_busy_seconds_total", "m") == 1.5
    assert metric(text, "colibri_engine_expert_io_wait_seconds_total", "m") == 0.25
    assert metric(text, "colibri_engine_expert_read_busy_seconds_total", "r") == 0
    hub.detach("m")
    stats = {"read_busy_s": 0.5, "io_wait_s": 0.0}  # what the reloaded engine counts
    text = hub.exposition().decode()
    assert metric(text, "colibri_engine_expert_read_busy_seconds_total", "m") == 1.5
    hub.attach("m", Scheduler(1, 0, 10), lambda: stats)
    text = hub.exposition().decode()
    assert metric(text, "colibri_engine_expert_read_busy_seconds_total", "m") == 2.0
    assert metric(text, "colibri_engine_expert_io_wait_seconds_total", "m") == 0.25


def test_streams_stepped_together_under_the_smallest_budget_are_exact(model_dir):
    """Generations stepped together over an expert cache far smaller than their steps'
    experts (each unique expert read once per step) give each one's tokens alone."""
    small = Engine(model_dir, threads=2, ram_gb=0.0, slots=3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
    alone = [greedy(small, p, 10) for p in prompts]
    gens = [small.generate(p, 10, slot=i) for i, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    while True:
        results = small.step_many(gens)
        if all(r is None for r in results):
            break
        for o, r in zip(out, results, strict=True):
            if isinstance(r, int):
                o.append(r)
    assert out == alone


def _counts(srv: RunningServer) -> dict[int, list[int]]:
    body = httpx.get(srv.url + "/v1/colibri/experts").json()
    return {x["layer"]: x["counts"] for x in body["layers"]}


def _chat(srv: RunningServer, max_tokens: int = 8) -> None:
    r = httpx.post(
        srv.base_url + "/chat/completions",
        json={"model": srv.model_id, "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": max_tokens},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 200, r.text


def _saved(path: Path, deadline_s: float = 10) -> dict[int, list[int]]:
    end = time.monotonic() + deadline_s
    while not path.is_file():
        assert time.monotonic() < end, f"{path} never written"
        time.sleep(0.05)
    return {x["layer"]: x["counts"] for x in json.loads(path.read_text())["layers"]}


def test_the_heat_lives_beside_the_slot_files_and_an_old_one_is_taken_from_the_model_dir(
    tmp_path,
):
    """The server never writes into the model directory (the package's own for the demo model):
    the heat is kept in the KV directory; a file an older version left in the model directory
    is read while the KV directory has none, and left as it was."""
    model = tmp_path / "model"
    shutil.copytree(builtin_model_dir(), model, ignore=shutil.ignore_patterns("routing-heat*"))
    old = {1: [5, 900, 3, 0, 700, 1, 2, 4]}
    (model / "routing-heat.json").write_text(routing_heat_json(old))
    before = (model / "routing-heat.json").read_bytes()
    kv = tmp_path / "kv"
    srv = RunningServer("--model", str(model), "--kv-dir", str(kv))
    try:
        assert _counts(srv) == old  # the old file, read once
        _chat(srv)
        grown = _counts(srv)
        assert sum(grown[1]) > sum(old[1])
        # Saved at the first turn's end, beside the slot file; the model directory untouched.
        assert _saved(kv / "routing-heat.json") == grown
        assert (kv / "slot-0.kv").is_file()
        assert (model / "routing-heat.json").read_bytes() == before
        shipped = {p.name for p in builtin_model_dir().iterdir()} - {"routing-heat.json"}
        assert {p.name for p in model.iterdir()} == shipped | {"routing-heat.json"}
    finally:
        srv.stop()
    # From now on the KV directory's heat is the one read, whatever the model directory holds.
    (model / "routing-heat.json").write_text(routing_heat_json({1: [1] * 8}))
    srv = RunningServer("--model", str(model), "--kv-dir", str(kv))
    try:
        assert _counts(srv) == grown
    finally:
        srv.stop()


def test_without_a_kv_directory_the_heat_is_counted_in_memory_only(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(builtin_model_dir(), model, ignore=shutil.ignore_patterns("routing-heat*"))
    srv = RunningServer("--model", str(model), "--no-kv-persist")
    try:
        _chat(srv)
        assert sum(_counts(srv)[1]) > 0
        time.sleep(0.5)
        assert not (model / "routing-heat.json").exists()
        assert not list(model.glob("routing-heat*"))
    finally:
        srv.stop()


def test_the_experts_endpoint_says_where_every_expert_is(tmp_path):
    """A cache of 5 records over the built-in model's 8 experts (one MoE layer, top-2), 2 of
    them pinned by the heat in the KV directory: before a turn the two hottest are pinned and
    the rest on disk; after it the LRU part holds the last experts the turn used."""
    info = Engine(builtin_model_dir(), threads=1).info
    record = 4096
    assert os.path.getsize(builtin_model_dir() / "experts.bin") == 8 * record
    kv = tmp_path / "kv"
    kv.mkdir()
    (kv / "routing-heat.json").write_text(routing_heat_json({1: [5, 900, 3, 0, 700, 1, 2, 4]}))
    ram, pin = ram_gb_for(builtin_model_dir(), 5.5 * record), str(2.5 * record / 1e9)
    srv = RunningServer("--kv-dir", str(kv), "--ram-gb", ram, "--pin-gb", pin)
    try:
        body = httpx.get(srv.url + "/v1/colibri/experts").json()
        assert body["placement"] == "cached" and body["experts"] == info["num_experts"] == 8
        (layer,) = body["layers"]
        assert layer["tiers"] == "dpddpddd"  # experts 1 and 4: the hottest two
        cache = httpx.get(srv.url + "/v1/colibri/profile").json()["expert_cache"]
        assert (cache["slots"], cache["pinned"]) == (5, 2)
        _chat(srv, 12)
        body = httpx.get(srv.url + "/v1/colibri/experts").json()
        (layer,) = body["layers"]
        tiers, routed = layer["tiers"], set(layer["routed"])
        assert len(tiers) == 8 and set(tiers) <= {"p", "c", "d"}
        assert [e for e, t in enumerate(tiers) if t == "p"] == [1, 4]
        cached = {e for e, t in enumerate(tiers) if t == "c"}
        # Only experts the turn used were read, and the 3 LRU slots keep 3 of them (fewer only
        # when the turn used fewer outside the pinned ones).
        assert cached <= routed - {1, 4}
        assert len(cached) == min(3, len(routed - {1, 4}))
        assert {e for e, t in enumerate(tiers) if t == "d"} == set(range(8)) - cached - {1, 4}
    finally:
        srv.stop()
