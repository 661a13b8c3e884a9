"""The Anthropic Messages API through the running server with the official `anthropic` SDK."""

from __future__ import annotations

import anthropic
import httpx
import orjson
import pytest

from colibri.api.anthropic_request import from_anthropic_id, to_anthropic_id
from colibri.builtin import builtin_model_dir

from .server import RunningServer, model_with_template, think_open_template

MODEL = "colibri-builtin"
HELLO = [{"role": "user", "content": "Hello"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def server():
    srv = RunningServer(env={"COLI_SSE_PING_S": "0.002"})
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)


def create(client, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("max_tokens", 12)
    kw.setdefault("messages", HELLO)
    return client.messages.create(**kw)


def text_of(message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def test_create_plain_system_multi_turn(client):
    m = create(client)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 12
    assert text_of(m)
    with_system = create(client, system="Be brief.")
    with_blocks = create(client, system=[{"type": "text", "text": "Be brief."}])
    in_messages = create(
        client, messages=[{"role": "system", "content": "Be brief."}, *HELLO]
    )  # recent clients send system turns inside messages: folded into the system prompt
    assert text_of(with_system) == text_of(with_blocks) == text_of(in_messages)
    n = lambda m: m.usage.input_tokens + m.usage.cache_read_input_tokens  # noqa: E731
    assert n(with_system) == n(with_blocks) == n(in_messages) > n(m)
    multi = create(
        client,
        messages=[
            *HELLO,
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": "?"},
        ],
    )
    assert n(multi) > n(m)


def test_count_tokens_equals_usage(client):
    for kw in ({}, {"system": "Be brief."}, {"tools": [WEATHER]}):
        counted = client.messages.count_tokens(model=MODEL, messages=HELLO, **kw).input_tokens
        m = create(client, **kw)
        assert counted == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_stream_reassembles_to_the_json_reply(client):
    whole = create(client, max_tokens=20)
    with client.messages.stream(model=MODEL, max_tokens=20, messages=HELLO) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and "content_block_stop" in kinds
    assert text_of(final) == text_of(whole) and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 20


def test_continuation_of_a_trailing_assistant_turn(client):
    m = create(client, messages=[*HELLO, {"role": "assistant", "content": "Sure, here"}])
    plain = create(client)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > (
        plain.usage.input_tokens + plain.usage.cache_read_input_tokens
    )
    with pytest.raises(anthropic.BadRequestError):
        create(client, messages=[*HELLO, {"role": "assistant", "content": "trailing "}])


def test_stop_sequences(client):
    text = text_of(create(client, max_tokens=30))
    stop = text[10:13]
    m = create(client, max_tokens=30, stop_sequences=[stop])
    assert text_of(m) == text[: text.index(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_tools_and_tool_history(client):
    history = [
        *HELLO,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {
                    "type": "tool_use",
                    "id": "toolu_01",
                    "name": "get_weather",
                    "input": {"city": "Lisbon"},
                },  # fmt: skip
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 C"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    for choice in ({"type": "auto"}, {"type": "any"}, {"type": "none"},
                   {"type": "tool", "name": "get_weather"}):  # fmt: skip
        m = create(client, tools=[WEATHER], tool_choice=choice, messages=history)
        assert m.stop_reason == "max_tokens"  # the random model writes no call
    err = create(
        client,
        tools=[WEATHER],
        messages=[
            *history[:2],
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "is_error": True,
                 "content": [{"type": "text", "text": "timeout"}]}]},
        ],
    )  # fmt: skip
    assert err.usage.output_tokens == 12


def test_kimi_ids_round_trip_through_anthropic_ids():
    kimi = "functions.get_weather:0"
    wrapped = to_anthropic_id(kimi)
    assert wrapped != kimi and from_anthropic_id(wrapped) == kimi
    assert all(ch.isalnum() or ch in "_-" for ch in wrapped)
    assert to_anthropic_id("call_abc123") == "call_abc123"
    assert from_anthropic_id("toolu_01") == "toolu_01"


REFUSED = [
    ("top_k", {"top_k": 5}),
    ("image", {"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
    ("document", {"messages": [{"role": "user", "content": [{"type": "document", "source": {
        "type": "text", "media_type": "text/plain", "data": "x"}}]}]}),
    ("unknown block", {"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}),
    ("server tool", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]}),
    ("structured output", {"output_config": {"format": {"type": "json_schema", "schema": {}}}}),
    ("missing max_tokens", {"max_tokens": None}),
    ("temperature range", {"temperature": 1.5}),
    ("bad role", {"messages": [{"role": "tool", "content": "x"}]}),
    ("unknown field", {"frobnicate": True}),
]  # fmt: skip


@pytest.mark.parametrize("extra", [r[1] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refusals_use_anthropics_envelope(server, extra):
    body = {"model": MODEL, "max_tokens": 5, "messages": HELLO, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": "x"})
    assert r.status_code == 400, r.text
    data = r.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert data["error"]["message"]


def test_unknown_model_is_not_found(client):
    with pytest.raises(anthropic.NotFoundError) as e:
        create(client, model="not-a-served-model")
    assert e.value.body["error"]["type"] == "not_found_error"


def test_pings_during_a_long_prefill(server):
    """Pings keep idle-timeout clients alive while the prompt is being prefilled."""
    body = {
        "model": MODEL,
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": "x" * 1900}],
    }
    events = []
    with httpx.stream("POST", server.url + "/v1/messages", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[len("event: ") :])
    first_block = events.index("content_block_start")
    assert events[0] == "message_start"
    assert events[1:first_block].count("ping") >= 2
    assert events[-1] == "message_stop"


def test_stream_event_payloads(server):
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": HELLO}
    with httpx.stream("POST", server.url + "/v1/messages", json=body) as r:
        datas = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start = datas[0]
    assert start["type"] == "message_start" and start["message"]["content"] == []
    deltas = [d for d in datas if d["type"] == "content_block_delta"]
    assert all(d["delta"]["type"] == "text_delta" for d in deltas)
    end = [d for d in datas if d["type"] == "message_delta"][0]
    assert end["delta"]["stop_reason"] == "max_tokens" and end["usage"]["output_tokens"] == 4


def test_thinking_blocks(tmp_path):
    model = model_with_template(builtin_model_dir(), tmp_path / "glm47", think_open_template())
    srv = RunningServer("--model", str(model), "--model-id", "glm")
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        thinking = {"type": "enabled", "budget_tokens": 1024}
        m = client.messages.create(model="glm", max_tokens=12, messages=HELLO, thinking=thinking)
        assert [b.type for b in m.content] == ["thinking"]
        block = m.content[0]
        assert block.thinking and block.signature
        with client.messages.stream(
            model="glm", max_tokens=12, messages=HELLO, thinking=thinking
        ) as stream:
            final = stream.get_final_message()
        assert final.content[0].thinking == block.thinking
        assert final.content[0].signature == block.signature
        # Thinking blocks in history are accepted.
        history = [
            *HELLO,
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hm", "signature": block.signature},
                {"type": "text", "text": "Hi."}]},
            {"role": "user", "content": "Again?"},
        ]  # fmt: skip
        again = client.messages.create(model="glm", max_tokens=4, messages=history)
        assert again.usage.output_tokens == 4
        off = client.messages.create(
            model="glm", max_tokens=4, messages=HELLO, thinking={"type": "disabled"}
        )
        assert off.content[0].type == "text"
    finally:
        srv.stop()
    srv = RunningServer("--chat-family", "olmoe")
    try:
        client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(
                model=MODEL, max_tokens=4, messages=HELLO, thinking={"type": "enabled",
                "budget_tokens": 1024}
            )  # fmt: skip
        with pytest.raises(anthropic.BadRequestError):
            client.messages.create(model=MODEL, max_tokens=4, messages=HELLO, tools=[WEATHER])
    finally:
        srv.stop()


def test_auth_with_x_api_key_or_bearer():
    srv = RunningServer("--api-key", "sekret")
    try:
        good = anthropic.Anthropic(base_url=srv.url, api_key="sekret", max_retries=0)
        assert create(good).usage.output_tokens == 12
        bearer = anthropic.Anthropic(base_url=srv.url, auth_token="sekret", max_retries=0)
        assert create(bearer).usage.output_tokens == 12
        bad = anthropic.Anthropic(base_url=srv.url, api_key="nope", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as e:
            create(bad)
        assert e.value.body["error"]["type"] == "authentication_error"
    finally:
        srv.stop()
