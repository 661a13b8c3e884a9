"""Admission, /health, /metrics, request ids and tracing through the running server."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import openai
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from .server import RunningServer

MODEL = "colibri-builtin"
HELLO = [{"role": "user", "content": "Hello"}]
# Tokens a slot-holding request generates: ~0.19 s of the built-in model on two threads, ~0.36 s
# on the one engine thread the small-queue server gets (the holders must outlast the arrivals
# the tests line up behind them, and the engine keeps getting faster).
LONG = 1900
# The running generation of the shutdown test (see there).
GRACEFUL = 600


def metrics(srv: RunningServer, **headers: str) -> dict[str, float]:
    r = httpx.get(srv.url + "/metrics", headers=headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            # Every series names its model (one model here: the key leaves it out).
            labels = dict(sample.labels)
            if family.name.startswith("colibri_"):
                assert labels.pop("model") == srv.model_id, sample
            key = sample.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                if labels
                else ""
            )
            out[key] = sample.value
    return out


def health(srv: RunningServer) -> dict:
    return httpx.get(srv.url + "/health").json()


def wait_idle(srv: RunningServer, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = health(srv)
        if h["active"] == 0 and h["queued"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


@pytest.fixture(scope="module")
def small_queue():
    srv = RunningServer("--max-queue", "2", "--kv-slots", "1", "--threads", "1")
    yield srv
    srv.stop()


def wait_for(srv: RunningServer, active: int, queued: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        h = health(srv)
        if (h["active"], h["queued"]) == (active, queued):
            return
        assert time.monotonic() < deadline, h
        time.sleep(0.005)


def test_concurrent_streams_against_a_small_queue(small_queue):
    client = OpenAI(base_url=small_queue.base_url, api_key="x", max_retries=0)
    before = metrics(small_queue)
    results: dict[int, object] = {}
    finished: list[int] = []

    def worker(i: int) -> None:
        try:
            stream = client.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=LONG, stream=True
            )
            n = sum(1 for c in stream for ch in c.choices if ch.delta.content)
            results[i] = n
            finished.append(i)
        except openai.RateLimitError as e:
            results[i] = e

    # Arrivals one after the other, each seen by the server before the next: 0 runs, 1 and 2
    # wait (the queue holds 2), 3..5 find it full.
    threads = []
    for i, (active, queued) in enumerate([(1, 0), (1, 1), (1, 2)]):
        threads.append(threading.Thread(target=worker, args=(i,)))
        threads[-1].start()
        wait_for(small_queue, active, queued)
    for i in range(3, 6):
        worker(i)  # refused at once, before any header
    for t in threads:
        t.join()
    rejected = [i for i, r in results.items() if isinstance(r, openai.RateLimitError)]
    assert sorted(rejected) == [3, 4, 5]
    for i in rejected:
        err = results[i]
        assert err.status_code == 429 and err.body["code"] == "queue_full"
        assert err.response.headers["retry-after"] == "2"
    assert finished == [0, 1, 2]  # FIFO
    h = wait_idle(small_queue)
    after = metrics(small_queue)
    assert h["rejected"] - before["colibri_scheduler_rejected_total"] == 3
    assert (
        after["colibri_scheduler_admitted_total"] - before["colibri_scheduler_admitted_total"] == 3
    )
    assert after["colibri_scheduler_completed_total"] == h["completed"]
    assert after["colibri_scheduler_rejected_total"] == h["rejected"]
    assert after["colibri_scheduler_queue_wait_seconds_count"] == h["admitted"]
    assert after["colibri_scheduler_active"] == 0 and after["colibri_scheduler_capacity"] == 1
    assert after["colibri_engine_generated_tokens_total"] >= 3 * LONG


def test_disconnect_mid_stream_frees_the_slot(small_queue):
    before = health(small_queue)
    with httpx.stream(
        "POST",
        small_queue.base_url + "/chat/completions",
        json={"model": MODEL, "messages": HELLO, "max_tokens": LONG, "stream": True},
    ) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    h = wait_idle(small_queue, timeout=5)
    assert h["cancelled"] == before["cancelled"] + 1
    assert h["completed"] == before["completed"]


def test_request_ids_and_queue_wait_header(small_queue):
    r = httpx.post(
        small_queue.base_url + "/chat/completions",
        json={"model": MODEL, "messages": HELLO, "max_tokens": 2},
        headers={"x-request-id": "abc-123"},
    )
    assert r.headers["x-request-id"] == "abc-123"
    assert float(r.headers["x-colibri-queue-wait-ms"]) >= 0
    for resp in (
        httpx.get(small_queue.url + "/nope"),
        httpx.get(small_queue.url + "/health", headers={"host": "evil.example"}),
        httpx.post(small_queue.base_url + "/completions", json={"model": "x", "prompt": "a"}),
    ):
        assert len(resp.headers["x-request-id"]) == 32
        assert "x-colibri-queue-wait-ms" not in resp.headers
    weird = httpx.get(small_queue.url + "/health", headers={"x-request-id": "bad id\x7f"})
    assert weird.headers["x-request-id"] != "bad id\x7f"


def test_queue_timeout_and_slot_pinning():
    srv = RunningServer("--kv-slots", "2", "--max-queue", "0", "--queue-timeout", "0.3")
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=2, extra_body={"cache_slot": 2}
            )
        assert e.value.body["code"] == "invalid_cache_slot"
        # Slot 0 busy with a long request; no queue: a request pinned to 0 is refused at once
        # even though slot 1 is free, and an any-slot request takes slot 1.
        long = threading.Thread(
            target=lambda: client.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=LONG, extra_body={"cache_slot": 0}
            )
        )
        long.start()
        wait_for(srv, active=1, queued=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=2, extra_body={"cache_slot": 0}
            )
        assert e.value.body["code"] == "queue_full"
        r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert r.usage.completion_tokens == 2
        long.join()
    finally:
        srv.stop()
    # The holder must outlast the queued request's timeout: one engine thread and the whole
    # context (max_tokens is clamped to what the context leaves: ~0.4 s on this machine kind,
    # against a 0.05 s timeout).
    srv = RunningServer(
        "--kv-slots", "1", "--max-queue", "1", "--queue-timeout", "0.05", "--threads", "1"
    )
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        long = threading.Thread(
            target=lambda: client.chat.completions.create(
                model=MODEL, messages=HELLO, max_tokens=4096
            )
        )
        long.start()
        wait_for(srv, active=1, queued=0)
        with pytest.raises(openai.RateLimitError) as e:
            client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2)
        assert e.value.body["code"] == "queue_timeout"
        long.join()
        assert health(srv)["timed_out"] == 1
    finally:
        srv.stop()


def test_metrics_need_the_key_when_one_is_set():
    srv = RunningServer("--api-key", "k")
    try:
        assert httpx.get(srv.url + "/metrics").status_code == 401
        m = metrics(srv, authorization="Bearer k")
        assert m["colibri_scheduler_max_queue"] == 8
        assert health(srv) == {"status": "ok"}  # public health: no snapshot
    finally:
        srv.stop()


def test_spans_per_request(tmp_path):
    """The app in-process on a loopback port, with an in-memory span exporter."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from colibri.api.app import create_app
    from colibri.demo.builtin import builtin_model_dir
    from colibri.runtime.engine import Engine
    from colibri.runtime.served import ServedModel, ServerConfig

    exporter = InMemorySpanExporter()
    served = ServedModel(
        Engine(builtin_model_dir(), threads=1), ServerConfig(model_id=MODEL), 0, exporter
    )
    app = create_app(served)
    stop = threading.Event()

    # Bind our own socket so the port is known.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]

    async def main_fd() -> None:
        config = Config()
        config.bind = [f"fd://{sock.fileno()}"]
        config.accesslog = None
        trigger = asyncio.Event()

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.05)
            trigger.set()

        watcher = asyncio.ensure_future(watch())
        await serve(app, config, shutdown_trigger=trigger.wait)
        await watcher

    thread = threading.Thread(target=lambda: asyncio.run(main_fd()), daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                httpx.get(url + "/health")
                break
            except httpx.TransportError:
                time.sleep(0.05)
        r = httpx.post(
            url + "/v1/chat/completions",
            json={"model": MODEL, "messages": HELLO, "max_tokens": 5},
        )
        assert r.status_code == 200
        # A caller's W3C trace context: the request's spans join the caller's trace.
        r = httpx.post(
            url + "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            headers={"traceparent": f"00-{CALLER_TRACE:032x}-{CALLER_SPAN:016x}-01"},
        )
        assert r.status_code == 200
    finally:
        stop.set()
        thread.join(timeout=10)
    finished = exporter.get_finished_spans()
    first = next(s for s in finished if s.name == "chat.completions").context.trace_id
    spans = {s.name: s for s in finished if s.context.trace_id == first}
    assert {"chat.completions", "admission", "render", "prefill", "decode"} <= set(spans)
    root = spans["chat.completions"]
    assert root.attributes["colibri.model"] == MODEL
    assert root.attributes["colibri.completion_tokens"] == 5
    assert root.attributes["colibri.finish_reason"] == "length"
    assert root.attributes["colibri.slot"] == 0
    for child in ("admission", "render", "prefill", "decode"):
        assert spans[child].parent.span_id == root.context.span_id
    assert root.parent is None  # no traceparent sent: a trace of its own
    joined = {s.name: s for s in finished if s.context.trace_id == CALLER_TRACE}
    assert {"completions", "admission", "prefill", "decode"} <= set(joined)
    assert joined["completions"].parent.span_id == CALLER_SPAN
    assert joined["completions"].parent.is_remote
    assert joined["decode"].parent.span_id == joined["completions"].context.span_id


CALLER_TRACE = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CALLER_SPAN = 0x00F067AA0BA902B7


def test_streams_abandoned_at_any_moment_never_leak_a_slot(small_queue):
    """Clients that hang up right after sending (before, during or after the first chunk)."""
    body = {"model": MODEL, "messages": HELLO, "max_tokens": 50, "stream": True}
    for i in range(20):
        with socket.create_connection((small_queue.url.split("//")[1].split(":")[0],
                                       int(small_queue.url.rsplit(":", 1)[1]))) as s:  # fmt: skip
            payload = httpx.Request("POST", small_queue.base_url + "/chat/completions", json=body)
            head = "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            head += "Content-Type: application/json\r\n"
            head += f"Content-Length: {len(payload.content)}\r\nConnection: close\r\n\r\n"
            s.sendall(head.encode() + payload.content)
            if i % 2:
                s.recv(64)
    h = wait_idle(small_queue, timeout=10)
    assert h["active"] == 0 and h["queued"] == 0
    r = httpx.post(small_queue.base_url + "/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 200


def test_shutdown_refuses_waiters_clearly():
    # One engine thread (a slower holder) and all three requests sent together from a warmed-up
    # client: lined up one by one, a fast holder could finish before the last arrival was seen.
    srv = RunningServer("--max-queue", "4", "--threads", "1")
    client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)
    results: dict[int, object] = {}

    def worker(i: int) -> None:
        try:
            # Long enough for the other two to be seen queued, short enough to end within
            # the 10 s grace period on a loaded machine (1900 tokens did not, at load ~10).
            r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=GRACEFUL)
            results[i] = r.choices[0].finish_reason
        except openai.APIStatusError as e:
            results[i] = (e.status_code, e.body.get("code") if isinstance(e.body, dict) else None)
        except openai.APIConnectionError:
            results[i] = "connection"

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    wait_for(srv, active=1, queued=2)
    srv.proc.terminate()
    for t in threads:
        t.join(timeout=30)
    srv.stop()
    # The running generation finishes within the grace period; the two still waiting for a slot
    # get a clear 503, never a broken response.
    outcomes = sorted(results.values(), key=str)
    assert outcomes == [(503, "server_shutting_down")] * 2 + ["length"], results
