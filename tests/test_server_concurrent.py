"""Concurrent generation through the running server: the active requests step together in one
batched engine step (docs/API.md, "Admission", "Side by side"), and each gets the answer it gets
alone."""

from __future__ import annotations

import subprocess
import sys
import threading

import httpx
import pytest
from openai import OpenAI

from colibri.demo.builtin import builtin_model_dir

from .server import RunningServer
from .test_server_scheduler import health, metrics, wait_idle

MODEL = "colibri-builtin"
# Long enough that four streams overlap for many steps on the fast built-in model.
TOKENS = 300
PROMPTS = [
    "Tell me about rivers.",
    "Write a poem about the sea and the wind, please",
    "What is 37 + 48?",
    "Hi",
]


@pytest.fixture(scope="module")
def srv():
    s = RunningServer("--kv-slots", "4", "--no-kv-persist")
    yield s
    s.stop()


def client(srv: RunningServer) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)


def streamed(srv: RunningServer, prompt: str, stop_after: int | None = None) -> str:
    """The streamed reply's text (the first ``stop_after`` chunks, then a disconnect)."""
    stream = client(srv).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
    )
    text = []
    for i, chunk in enumerate(stream):
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if stop_after is not None and i + 1 >= stop_after:
            stream.response.close()
            break
    return "".join(text)


def together(srv: RunningServer, stop_after: dict[int, int]) -> dict[int, str]:
    """Every prompt streamed at once (each after a barrier); ``stop_after[i]``: prompt i's
    client disconnects after that many chunks."""
    barrier = threading.Barrier(len(PROMPTS))
    out: dict[int, str] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            out[i] = streamed(srv, PROMPTS[i], stop_after.get(i))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def batched_steps(m: dict[str, float]) -> tuple[float, float]:
    """(steps, steps of more than one generation) the engine's batch histogram counted."""
    return m["colibri_engine_batch_size_count"], (
        m["colibri_engine_batch_size_count"] - m["colibri_engine_batch_size_bucket{le=1.0}"]
    )


def test_four_concurrent_streams_get_their_answers_alone(srv):
    alone = [streamed(srv, p) for p in PROMPTS]
    assert len(set(alone)) == len(PROMPTS), "the prompts should give different replies"
    before = metrics(srv)
    got = together(srv, {})
    after = metrics(srv)
    assert [got[i] for i in range(len(PROMPTS))] == alone
    (steps_after, shared_after), (steps_before, shared_before) = (
        batched_steps(after),
        batched_steps(before),
    )
    steps, shared = steps_after - steps_before, shared_after - shared_before
    # Four replies of TOKENS tokens: alone that is 4 * TOKENS steps (and a prefill each).
    assert shared > TOKENS / 2, (steps, shared)
    assert steps < 3 * TOKENS, (steps, shared)
    h = wait_idle(srv)
    assert h["max_active"] == h["capacity"] == 4
    # Each stream's profile is its own, and adds up.
    turns = httpx.get(srv.url + "/v1/colibri/profile").json()["turns"][-len(PROMPTS) :]
    for t in turns:
        assert t["decode_tokens"] == TOKENS - 1, t
        parts = sum(t[k] for k in ("io_wait_s", "expert_matmul_s", "attention_s", "lm_head_s"))
        total = t["prefill_s"] + t["decode_s"]
        assert parts + t["other_s"] == pytest.approx(total, rel=1e-6, abs=1e-6), t
        assert parts <= total * (1 + 1e-9), t


def test_one_disconnect_leaves_the_other_streams_intact(srv):
    alone = [streamed(srv, p) for p in PROMPTS]
    before = health(srv)
    got = together(srv, {1: 5})
    for i in (0, 2, 3):
        assert got[i] == alone[i], i
    assert alone[1].startswith(got[1]) and len(got[1]) < len(alone[1])
    after = wait_idle(srv)
    delta = {k: after[k] - before[k] for k in ("admitted", "completed", "cancelled", "failed")}
    assert delta == {"admitted": 4, "completed": 3, "cancelled": 1, "failed": 0}, delta
    assert after["active"] == after["queued"] == 0
    # The server goes on serving, exactly.
    assert streamed(srv, PROMPTS[1]) == alone[1]


def test_max_active_bounds_the_requests_that_run_at_once():
    s = RunningServer("--kv-slots", "3", "--max-active", "1", "--no-kv-persist")
    try:
        got = together(s, {})
        assert len(got) == len(PROMPTS)
        m = metrics(s)
        assert m["colibri_engine_batch_size_count"] == m["colibri_engine_batch_size_bucket{le=1.0}"]
        h = wait_idle(s)
        assert (h["max_active"], h["capacity"], h["admitted"]) == (1, 3, 4)
    finally:
        s.stop()


def test_more_active_than_slots_is_refused_at_start():
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "colibri",
            "serve",
            "--model",
            str(builtin_model_dir()),
            "--kv-slots",
            "2",
            "--max-active",
            "3",
            "--no-kv-persist",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert "--max-active 3 is more than the 2 KV slots" in p.stderr
