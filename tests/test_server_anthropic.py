"""The Anthropic Messages API through the running server with the official `anthropic` SDK."""

from __future__ import annotations

import anthropic
import httpx
import orjson
import pytest

from colibri.api.anthropic_request import from_anthropic_id, to_anthropic_id
from colibri.demo.builtin import builtin_model_dir

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
    ("output format type", {"output_config": {"format": {"type": "yaml"}}}),
    ("output format keyword", {"output_config": {"format": {"type": "json_schema",
        "schema": {"type": "object", "if": {}}}}}),
    ("missing max_tokens", {"max_tokens": None}),
    ("temperature range", {"temperature": 1.5}),
    ("bad role", {"messages": [{"role": "tool", "content": "x"}]}),
    ("unknown field", {"frobnicate": True}),
    ("compaction edit", {"context_management": {"edits": [{"type": "compact_20260112"}]}}),
    ("unknown edit", {"context_management": {"edits": [{"type": "clear_all_2099"}]}}),
    ("thinking display", {"thinking": {"type": "adaptive", "display": "loud"}}),
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
        # display "omitted": the text travels in the signature only, and comes back from it.
        omitted = {**thinking, "display": "omitted"}
        m = client.messages.create(model="glm", max_tokens=12, messages=HELLO, thinking=omitted)
        assert m.content[0].thinking == "" and m.content[0].signature == block.signature
        with client.messages.stream(
            model="glm", max_tokens=12, messages=HELLO, thinking=omitted
        ) as stream:
            kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        assert "thinking_delta" not in kinds and "signature_delta" in kinds
        assert final.content[0].thinking == "" and final.content[0].signature == block.signature

        def replayed(block_text: str) -> int:
            turn = {"type": "thinking", "thinking": block_text, "signature": block.signature}
            messages = [
                *HELLO,
                {"role": "assistant", "content": [turn, {"type": "text", "text": "Hi."}]},
                {"role": "user", "content": "Again?"},
            ]
            return client.messages.count_tokens(
                model="glm", messages=messages, thinking=thinking
            ).input_tokens

        assert replayed("") == replayed(block.thinking) != replayed("x")
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


CLAUDE_CODE_TOOLS = [
    {
        "name": name,
        "description": f"{name} a path",
        "input_schema": {
            "type": "object",
            "properties": {"arg": {"type": "string"}},
            "required": ["arg"],
            "additionalProperties": False,
            "$schema": "http://json-schema.org/draft-07/schema#",
        },
    }
    for name in ("Bash", "Read", "Edit")
]
CLAUDE_CODE_TOOLS[-1]["cache_control"] = {"type": "ephemeral"}


def test_claude_codes_first_request(client):
    """A request shaped as Claude Code 2.1 sends its first turn (beta route, its betas among
    them one this server has never heard of, context_management, adaptive thinking with the
    display omitted, effort, metadata, cache_control on system, content and tools, a system
    turn inside messages, a max_tokens above the context): accepted and answered, streamed and
    not, with max_tokens lowered to the room the context leaves."""
    kw = dict(
        model=MODEL,
        max_tokens=32000,
        betas=[
            "claude-code-20250219",
            "interleaved-thinking-2025-05-14",
            "context-management-2025-06-27",
            "a-beta-from-the-future-2099-01-01",
        ],
        context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        thinking={"type": "adaptive", "display": "omitted"},
        output_config={"effort": "high"},
        metadata={"user_id": "user_abc_account_def_session_0123"},
        system=[
            {"type": "text", "text": "You are Claude.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "system", "content": "Environment: linux."},
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>none</system-reminder>"},
                {"type": "text", "text": "What is 37 + 48?",
                 "cache_control": {"type": "ephemeral"}},
            ]},
        ],
        tools=CLAUDE_CODE_TOOLS,
    )  # fmt: skip
    counted = client.beta.messages.count_tokens(
        **{k: v for k, v in kw.items() if k not in ("max_tokens", "metadata")}
    )
    assert counted.context_management.original_input_tokens == counted.input_tokens
    room = 2048 - counted.input_tokens
    with client.beta.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == room
    assert final.context_management.applied_edits == []
    m = client.beta.messages.create(**kw, stream=False, timeout=600)
    assert m.usage.output_tokens == room and m.context_management.applied_edits == []
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == counted.input_tokens


def test_context_edits_shrink_the_prompt(client):
    """clear_thinking and clear_tool_uses change what the model reads, by the tokens they
    report; the client's history is taken as sent."""
    history = [{"role": "user", "content": "Weather in Lisbon and Porto?"}]
    for i, city in enumerate(("Lisbon", "Porto", "Faro")):
        history += [
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": f"I should look up {city} first. " * 3,
                 "signature": "sig"},
                {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather",
                 "input": {"city": city}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{i}",
                 "content": f"{city}: 21 degrees and sunny, light wind from the north. " * 4},
            ]},
        ]  # fmt: skip
    base = dict(model=MODEL, messages=history, tools=[WEATHER])
    full = client.beta.messages.count_tokens(**base).input_tokens
    edits = [
        {"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 1}},
        {"type": "clear_tool_uses_20250919", "trigger": {"type": "tool_uses", "value": 1},
         "keep": {"type": "tool_uses", "value": 1}},
    ]  # fmt: skip
    counted = client.beta.messages.count_tokens(**base, context_management={"edits": edits})
    assert counted.context_management.original_input_tokens == full > counted.input_tokens
    m = client.beta.messages.create(**base, max_tokens=3, context_management={"edits": edits})
    thinking, tools = m.context_management.applied_edits
    assert thinking.type == "clear_thinking_20251015" and thinking.cleared_thinking_turns == 2
    assert tools.type == "clear_tool_uses_20250919" and tools.cleared_tool_uses == 2
    cleared = thinking.cleared_input_tokens + tools.cleared_input_tokens
    assert thinking.cleared_input_tokens > 0 and tools.cleared_input_tokens > 0
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == full - cleared
    assert full - cleared == counted.input_tokens


def test_deferred_tools_are_declared_but_not_listed(client):
    """defer_loading (Claude Code's tool search): the tool is not rendered into the prompt
    unless tool_choice names it, yet its calls are parsed like any declared tool's."""
    from colibri.api.anthropic_request import parse_messages
    from colibri.chat.families import GLM
    from colibri.chat.tooling import plan_tools

    hidden = {**WEATHER, "name": "get_time", "defer_loading": True}
    plain = client.beta.messages.count_tokens(model=MODEL, messages=HELLO, tools=[WEATHER])
    deferred = client.beta.messages.count_tokens(
        model=MODEL, messages=HELLO, tools=[WEATHER, hidden]
    )
    listed = client.beta.messages.count_tokens(
        model=MODEL, messages=HELLO, tools=[WEATHER, {**hidden, "defer_loading": False}]
    )
    named = client.beta.messages.count_tokens(
        model=MODEL,
        messages=HELLO,
        tools=[WEATHER, hidden],
        tool_choice={"type": "tool", "name": "get_time"},
    )
    assert plain.input_tokens == deferred.input_tokens < listed.input_tokens
    assert named.input_tokens > deferred.input_tokens
    body = {"model": MODEL, "max_tokens": 5, "messages": HELLO, "tools": [WEATHER, hidden]}
    plan = plan_tools(parse_messages(body, None).chat, GLM)
    assert [t["function"]["name"] for t in plan.prompt_tools] == ["get_weather"]
    parser = plan.parser_factory()
    text = "<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>Faro</arg_value>\n</tool_call>"
    parser.push(text)
    parser.finish()
    assert [c.name for c in parser.calls] == ["get_time"]
