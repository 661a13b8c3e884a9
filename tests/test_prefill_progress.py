"""Prefill progress a client can see, and a prefill that stops between its steps (issue 30).

A long prompt prefills in steps; OpenAI streams carry an SSE comment per step (and, when asked,
a chunk with ``x_colibri_progress``), /health and /metrics show the prefill in progress, and a
client that disconnects mid-prefill frees its slot at once while the steps done stay in the
slot for a retry.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from .server import RunningServer

MODEL = "colibri-builtin"


def long_prompt(animal: str) -> list[dict]:
    """~1.7k tokens on the built-in model's tokenizer (its context is 2048), different from the
    start for each animal (the one slot's history is reused where a prompt shares it)."""
    return [{"role": "user", "content": f"the quick brown {animal} jumps over the lazy dog. " * 38}]


COMMENT = re.compile(r"^: prefill (\d+)/(\d+)$")


@pytest.fixture(scope="module")
def server():
    # Steps of 16 positions: a ~1.7k-token prompt takes ~100 steps, so a test can act during it.
    srv = RunningServer("--kv-slots", "1", "--threads", "1", env={"COLI_PREFILL_CHUNK": "16"})
    yield srv
    srv.stop()


def _stream_body(animal: str, **extra) -> dict:
    messages = long_prompt(animal)
    return {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": True, **extra}


def _wait_idle(srv: RunningServer, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(srv.url + "/health").json()
        if h["active"] == 0 and h["queued"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.02)


def test_streams_carry_a_progress_comment_per_prefill_step(server):
    comments, usage = [], None
    with httpx.stream(
        "POST",
        server.base_url + "/chat/completions",
        json=_stream_body("fox", stream_options={"include_usage": True}),
        timeout=60,
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if m := COMMENT.match(line):
                comments.append((int(m[1]), int(m[2])))
            elif line.startswith("data: {"):
                assert "x_colibri_progress" not in line  # chunks only when asked
                if '"usage":{' in line:
                    usage = json.loads(line[6:])["usage"]
    assert usage is not None
    total = usage["prompt_tokens"]
    assert len(comments) >= total // 16 - 2, comments[:5]
    assert all(t == total for _, t in comments)
    done = [d for d, _ in comments]
    assert (
        done == sorted(set(done))
        and 0 < done[0] <= 16 + usage["prompt_tokens_details"]["cached_tokens"]
    )
    assert done[-1] < total


def test_progress_chunks_when_asked_through_the_sdk(server):
    client = OpenAI(base_url=server.base_url, api_key="x")
    stream = client.chat.completions.create(
        model=MODEL,
        messages=long_prompt("cat"),
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True, "x_colibri_progress": True},  # type: ignore
        extra_body={"cache_slot": 0},
    )
    progress, text, usage = [], "", None
    for chunk in stream:
        extra = chunk.model_extra or {}
        if "x_colibri_progress" in extra:
            assert chunk.choices == []
            progress.append(extra["x_colibri_progress"])
        elif chunk.usage is not None:
            usage = chunk.usage
        else:
            text += chunk.choices[0].delta.content or ""
    assert usage is not None and usage.completion_tokens == 2
    assert progress, "no progress chunks"
    assert {p["prompt_tokens"] for p in progress} == {usage.prompt_tokens}
    done = [p["prompt_tokens_done"] for p in progress]
    assert done == sorted(set(done)) and done[-1] < usage.prompt_tokens


def test_completions_streams_show_progress_too(server):
    with httpx.stream(
        "POST",
        server.base_url + "/completions",
        json={
            "model": MODEL,
            "prompt": long_prompt("ant")[0]["content"],
            "max_tokens": 1,
            "stream": True,
        },
        timeout=60,
    ) as r:
        assert r.status_code == 200
        comments = [line for line in r.iter_lines() if COMMENT.match(line)]
    assert len(comments) > 3


def test_a_disconnect_mid_prefill_frees_the_slot_and_keeps_the_steps_done(server):
    # Another prompt first, so the slot's history shares nothing useful with the long one.
    client = OpenAI(base_url=server.base_url, api_key="x")
    client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )
    before = _wait_idle(server, 5)
    seen = 0
    mid_prefill = None
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json=_stream_body("owl"), timeout=60
    ) as r:
        for line in r.iter_lines():
            if m := COMMENT.match(line):
                seen = int(m[1])
                if seen >= 160:
                    mid_prefill = httpx.get(server.url + "/health").json()
                    break
    closed = time.monotonic()
    h = _wait_idle(server, 1.0)  # the slot is free within a second of the disconnect
    assert time.monotonic() - closed < 1.0
    assert h["cancelled"] == before["cancelled"] + 1
    assert h["prefill"] == []
    assert mid_prefill is not None
    for p in mid_prefill["prefill"]:  # shown while it ran (if it had not ended by then)
        assert p["slot"] == 0 and p["prompt_tokens_done"] <= p["prompt_tokens"]
    # The steps done stayed in the slot: the same prompt again reuses at least those.
    again = client.chat.completions.create(model=MODEL, messages=long_prompt("owl"), max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens >= seen


def test_metrics_show_the_prefill_gauges(server):
    r = httpx.get(server.url + "/metrics")
    names = {m.name for m in text_string_to_metric_families(r.text)}
    assert {"colibri_engine_prefill_tokens_done", "colibri_engine_prefill_tokens"} <= names
    values = {
        s.name: s.value
        for m in text_string_to_metric_families(r.text)
        for s in m.samples
        if s.name.startswith("colibri_engine_prefill_tokens")
    }
    assert values and all(v == 0 for v in values.values())  # nothing prefills when idle
