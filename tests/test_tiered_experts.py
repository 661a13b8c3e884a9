"""Tiered experts through the Python API and the server: results never depend on placement,
and the per-turn profile reports where the time and the bytes went."""

from __future__ import annotations

import os

import httpx
import pytest
from openai import OpenAI

from colibri.demo.builtin import builtin_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer

PROFILE_KEYS = {
    "io_wait_s",
    "expert_matmul_s",
    "attention_s",
    "lm_head_s",
    "other_s",
    "bytes_read",
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


def test_resident_model_reads_nothing_and_reports_its_turn(model_dir):
    engine = Engine(model_dir, threads=2)
    ids = engine.tokenize("Hello world")
    greedy(engine, ids, 10)
    p = engine.last_profile()
    assert p["bytes_read"] == 0 and p["cache_hit_rate"] == 1.0
    assert p["prefill_tokens"] == len(ids) and p["decode_tokens"] == 9
    assert engine.store_stats() is None
    routed = engine.last_routed_experts()
    assert len(routed) == engine.info["num_layers"] and any(routed)


def test_profile_endpoint_and_serve_flags():
    srv = RunningServer("--ram-gb", "0.0001", "--api-key", "k")
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
    finally:
        srv.stop()


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
