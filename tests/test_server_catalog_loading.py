"""Catalog models loading on first use while requests wait (issue 35, seed 003): every load is
made 2 s slow on purpose (``COLI_LOAD_DELAY_S``, the loader's test hook) under a 1 s
``--ready-timeout``. A request that is not streamed gets 503 ``no_warm_replica`` with a
Retry-After, and a retry after it succeeds; the official openai SDK (max_retries=2) gets through
on its own; a stream started during the load gets keepalives (SSE comments, Anthropic pings)
and then its answer; a load that fails is an error event in the stream; each load's time is
kept beside the model's KV files."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from colibri.demo.builtin import builtin_model_dir

from .server import RunningServer

DELAY_S, READY_S = 2.0, 1.0
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(converted, tmp_path_factory):
    root = tmp_path_factory.mktemp("catalog-loading")
    broken = root / "broken"
    broken.mkdir()
    qwen = converted("qwen3_moe", "int4")
    (broken / "manifest.json").write_bytes((qwen / "manifest.json").read_bytes())
    builtin = str(builtin_model_dir())
    entries = [
        {"id": "slow", "path": builtin},
        {"id": "qwen", "path": str(qwen)},
        {"id": "olmoe", "path": str(converted("olmoe", "int4"))},
        {"id": "b-anthropic", "path": builtin},
        {"id": "b-anthropic-sdk", "path": builtin},
        {"id": "b-responses", "path": builtin},
        {"id": "broken", "path": str(broken)},
    ]
    (root / "catalog.json").write_text(json.dumps({"models": entries}))
    srv = RunningServer(
        "--catalog",
        str(root / "catalog.json"),
        "--ready-timeout",
        str(READY_S),
        default_model=True,
        env={"COLI_LOAD_DELAY_S": str(DELAY_S), "COLI_SSE_PING_S": "0.25"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def card(http: httpx.Client, model: str) -> dict:
    r = http.get(f"/v1/models/{model}")
    assert r.status_code == 200, r.text
    return r.json()


def test_a_cold_request_gets_503_retry_after_and_a_retry_then_succeeds(http, server):
    assert card(http, "slow")["max_model_len_source"] == "configured"
    body = {"model": "slow", "prompt": "Hello", "max_tokens": 2}
    t0 = time.monotonic()
    r = http.post("/v1/completions", json=body)
    waited = time.monotonic() - t0
    assert r.status_code == 503, r.text
    assert READY_S - 0.1 <= waited < DELAY_S, waited  # the ready timeout, not the load
    err = r.json()["error"]
    assert err["code"] == "no_warm_replica" and err["type"] == "server_error"
    assert "'slow' was not ready within 1 s" in err["message"]
    assert '"stream": true' in err["message"]
    retry = int(r.headers["retry-after"])
    assert 1 <= retry <= 60
    time.sleep(retry)
    r = http.post("/v1/completions", json=body)  # the load went on after the 503
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "slow"
    assert card(http, "slow")["max_model_len_source"] == "resident"
    # Measured (the test hook's delay is not the model's) and kept beside its KV files.
    kept = json.loads((Path(server.kv_dir) / "slow" / "load-times.json").read_text())
    assert len(kept["seconds"]) == 1 and 0 <= kept["seconds"][0] < 60


def test_the_openai_sdk_waits_out_a_load_with_its_own_retries(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="any", max_retries=2)
    t0 = time.monotonic()
    r = client.completions.create(model="qwen", prompt="Hello", max_tokens=2)
    assert r.model == "qwen" and r.usage.completion_tokens >= 1
    assert time.monotonic() - t0 >= DELAY_S


def test_a_stream_started_during_a_load_gets_keepalives_then_the_answer(http):
    body = {"model": "olmoe", "prompt": "Hello", "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    keepalives = [line for line in lines if line == ": loading model olmoe"]
    assert len(keepalives) >= 3, lines  # every 0.25 s for 2 s
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert data and all(d["model"] == "olmoe" for d in data)
    assert lines[-1] == "data: [DONE]"
    assert lines.index(keepalives[-1]) < lines.index(next(x for x in lines if x[:6] == "data: "))


def test_an_anthropic_stream_during_a_load_gets_pings_then_the_message(http, server):
    body = {"model": "b-anthropic", "messages": HELLO, "max_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    first = events.index("message_start")
    assert first >= 3 and set(events[:first]) == {"ping"}, events
    assert events[-1] == "message_stop"
    client = anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)
    with client.messages.stream(model="b-anthropic-sdk", messages=HELLO, max_tokens=3) as stream:
        message = stream.get_final_message()
    assert message.model == "b-anthropic-sdk" and message.usage.output_tokens == 3


def test_a_responses_stream_during_a_load(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="any", max_retries=0)
    events = list(
        client.responses.create(
            model="b-responses", input="Hello", max_output_tokens=16, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"  # the built-in model never ends
    assert events[-1].response.model == "b-responses"


def test_a_load_that_fails_is_an_error_in_the_stream_and_a_503_otherwise(http):
    body = {"model": "broken", "prompt": "Hello", "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    errors = [json.loads(line[6:]) for line in lines if line.startswith('data: {"error"')]
    assert len(errors) == 1 and errors[0]["error"]["code"] == "model_load_failed"
    assert "'broken'" in errors[0]["error"]["message"] and lines[-1] == "data: [DONE]"
    with http.stream(
        "POST",
        "/v1/messages",
        json={"model": "broken", "messages": HELLO, "max_tokens": 2, "stream": True},
    ) as r:
        text = r.read().decode()
    assert "event: error" in text and "overloaded_error" in text and "failed to load" in text
    # Not streamed: a 503 naming it (after the test hook's delay and the failed load).
    r = http.post("/v1/completions", json={"model": "broken", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 503
    assert r.json()["error"]["code"] in ("model_load_failed", "no_warm_replica")
