"""The request timeout of a catalog server (issue 35, seed 003): a non-streamed answer that
outlasts ``--request-timeout`` is 504 with ``x-should-retry: false`` in each protocol's
envelope, and its generation is stopped on the server (the slot given back, counted as
cancelled, never completed or failed); a request still waiting for a busy model's slot then is
503 ``resident_capacity_full`` with Retry-After; a stream is never cut; a load wait ends at the
request's deadline when that comes before ``--ready-timeout``. The slow generation is real: the
random built-in model (it never ends on its own) with a 65,536-token window, whose 10,000-token
answer takes ~5 s on two idle cores, against a 1.5 s limit."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from colibri.cli import _request_timeout
from colibri.demo.builtin import builtin_model_dir

from .server import RunningServer, long_window_builtin

LIMIT_S = 1.5
LONG = 10_000  # tokens: ~5 s, and every step a little slower than the last
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("request-timeout")
    long = str(long_window_builtin(root))
    entries = [
        {"id": "long", "path": long, "pinned": True},
        {"id": "busy", "path": long, "pinned": True},
        {"id": "cold", "path": str(builtin_model_dir())},
    ]
    (root / "catalog.json").write_text(json.dumps(entries))
    srv = RunningServer(
        "--catalog",
        str(root / "catalog.json"),
        "--request-timeout",
        str(LIMIT_S),
        default_model=True,
        env={"COLI_LOAD_DELAY_S": "4"},
    )
    yield srv
    srv.stop()


def health(srv: RunningServer, model: str) -> dict:
    r = httpx.get(srv.url + "/health", params={"model": model})
    assert r.status_code == 200, r.text
    return r.json()


def idle(srv: RunningServer, model: str, timeout: float = 5.0) -> dict:
    """The model's /health once no request holds its slot (at most ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        h = health(srv, model)
        if h["active"] == 0 or time.monotonic() > deadline:
            return h
        time.sleep(0.02)


def timeouts_counted(srv: RunningServer, model: str) -> float:
    text = httpx.get(srv.url + "/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "colibri_request_timeouts":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels["model"] == model:
                    return s.value
    return 0.0


def test_a_long_answer_not_streamed_is_504_and_its_generation_stops(server):
    before = health(server, "long")
    client = openai.OpenAI(base_url=server.base_url, api_key="any", max_retries=2)
    t0 = time.monotonic()
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="long", messages=HELLO, max_tokens=LONG)
    took = time.monotonic() - t0
    assert e.value.status_code == 504
    # One try: x-should-retry false stops the SDK's two retries (each would take as long).
    assert LIMIT_S <= took < LIMIT_S + 2.5, took
    assert e.value.response.headers["x-should-retry"] == "false"
    assert e.value.body["code"] == "request_timeout"
    assert e.value.body["type"] == "server_error"
    message = e.value.body["message"]
    assert "'long'" in message and f"{LIMIT_S:g} s (--request-timeout)" in message
    assert '"stream": true' in message
    # Stopped on the server: the slot is free at once, counted as cancelled.
    after = idle(server, "long")
    assert after["active"] == 0
    assert after["admitted"] == before["admitted"] + 1
    assert after["cancelled"] == before["cancelled"] + 1
    assert (after["completed"], after["failed"]) == (before["completed"], before["failed"])
    assert timeouts_counted(server, "long") == 1
    # The freed slot serves the next request.
    r = client.chat.completions.create(model="long", messages=HELLO, max_tokens=4)
    assert r.usage.completion_tokens == 4
    assert health(server, "long")["completed"] == before["completed"] + 1


def test_the_anthropic_envelope_of_the_504(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=2)
    before = health(server, "long")
    with pytest.raises(anthropic.APIStatusError) as e:
        client.messages.create(model="long", messages=HELLO, max_tokens=LONG)
    assert e.value.status_code == 504
    assert e.value.response.headers["x-should-retry"] == "false"
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "timeout_error"
    assert "--request-timeout" in e.value.body["error"]["message"]
    after = idle(server, "long")
    assert after["admitted"] == before["admitted"] + 1  # one try, not three
    assert after["cancelled"] == before["cancelled"] + 1 and after["active"] == 0


def test_a_responses_request_is_cut_the_same_way(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="any", max_retries=2)
    before = health(server, "long")
    with pytest.raises(openai.InternalServerError) as e:
        client.responses.create(model="long", input="Hello", max_output_tokens=LONG)
    assert e.value.status_code == 504 and e.value.body["code"] == "request_timeout"
    after = idle(server, "long")
    assert after["admitted"] == before["admitted"] + 1  # one try
    assert after["cancelled"] == before["cancelled"] + 1 and after["active"] == 0


def test_a_scoring_request_is_cut_the_same_way(server):
    """A 20,000-token state to prefill (~8 s, in steps of ~0.5 s) before two options are read:
    504 at the limit, the slot given back after the step in flight."""
    before = health(server, "long")
    t0 = time.monotonic()
    r = httpx.post(
        server.base_url + "/brio",
        json={
            "model": "long",
            "state": "the cat sat on the mat. " * 2500,
            "question": "Where did the cat sit?",
            "options": ["on the mat", "on the hat"],
        },
        timeout=60,
    )
    assert r.status_code == 504, r.text[:500]
    assert time.monotonic() - t0 < LIMIT_S + 2.5
    assert r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "request_timeout"
    after = idle(server, "long")
    assert after["active"] == 0 and after["cancelled"] == before["cancelled"] + 1
    assert (after["completed"], after["failed"]) == (before["completed"], before["failed"])


def test_a_stream_is_never_cut(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="any", max_retries=0)
    stream = client.chat.completions.create(
        model="long", messages=HELLO, max_tokens=LONG, stream=True
    )
    t0 = time.monotonic()
    chunks = 0
    with stream:
        for _ in stream:
            chunks += 1
            if time.monotonic() - t0 > LIMIT_S + 1.5:
                break  # still streaming well past the limit
    assert time.monotonic() - t0 > LIMIT_S + 1.5 and chunks > 100
    assert idle(server, "long")["active"] == 0  # closing the stream stopped it


def test_a_request_queued_behind_a_busy_slot_is_503_busy_at_the_deadline(server):
    """One KV slot: a stream holds it past the limit; a non-streamed request waits for it."""
    held = threading.Event()

    def hold() -> None:
        body = {"model": "busy", "messages": HELLO, "max_tokens": LONG, "stream": True}
        with httpx.stream("POST", server.base_url + "/chat/completions", json=body) as r:
            t0 = time.monotonic()
            for _ in r.iter_lines():
                held.set()
                if time.monotonic() - t0 > LIMIT_S + 1.0:
                    break

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        before = health(server, "busy")
        r = httpx.post(
            server.base_url + "/chat/completions",
            json={"model": "busy", "messages": HELLO, "max_tokens": 4},
            timeout=30,
        )
    finally:
        holder.join(30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "resident_capacity_full"
    assert r.headers["retry-after"] == "2"
    assert "had no free KV slot within 1.5 s" in r.json()["error"]["message"]
    after = idle(server, "busy")
    assert after["admitted"] == before["admitted"]  # never admitted: left the queue
    assert after["cancelled"] >= before["cancelled"] + 1


def test_a_load_wait_ends_at_the_deadline_before_the_ready_timeout(server):
    """--ready-timeout is 300 s, the load takes 4 s (the loader's test hook): the 503 comes at
    the 1.5 s deadline, with the load's Retry-After."""
    t0 = time.monotonic()
    r = httpx.post(
        server.base_url + "/completions",
        json={"model": "cold", "prompt": "Hi", "max_tokens": 1},
        timeout=30,
    )
    took = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "no_warm_replica"
    assert LIMIT_S - 0.2 <= took < LIMIT_S + 1.5, took
    assert 1 <= int(r.headers["retry-after"]) <= 5


def test_the_default_limit_is_on_with_a_catalog_and_off_for_one_model():
    assert _request_timeout(None, several=True) == 300.0
    assert _request_timeout(None, several=False) is None
    assert _request_timeout(0.0, several=True) is None  # 0: off
    assert _request_timeout(20.0, several=False) == 20.0  # asked for: on for one model too


def test_one_model_served_alone_honours_an_explicit_limit(tmp_path):
    srv = RunningServer(
        "--model", str(long_window_builtin(tmp_path)), "--request-timeout", str(LIMIT_S)
    )
    try:
        r = httpx.post(
            srv.base_url + "/completions",
            json={"model": "long", "prompt": "Hi", "max_tokens": LONG},
            timeout=30,
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert idle(srv, "long")["cancelled"] == 1
    finally:
        srv.stop()
