"""The OpenAI API end to end: the real server (real engine, built-in model) on a loopback port,
driven by the official `openai` SDK, and by raw HTTP where the SDK cannot reach."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest
from openai import OpenAI

from colibri.chat.families import GLM
from colibri.chat.render import render_chat
from colibri.chat.stops import apply_stops
from colibri.chat.template import ChatTemplate
from colibri.demo.builtin import CHAT_TEMPLATE, builtin_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer, builtin_prompt_ids

MODEL = "colibri-builtin"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server():
    srv = RunningServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """The same model in-process: the oracle for prompts, token counts and greedy outputs."""
    return Engine(builtin_model_dir(), threads=1)


def greedy_text(engine: Engine, ids: list[int], n: int) -> str:
    return engine.detokenize(list(engine.generate(ids, n, stop_token_ids=engine.eos_token_ids)))


def chat(client: OpenAI, **kw):
    kw.setdefault("model", MODEL)
    kw.setdefault("messages", HELLO)
    return client.chat.completions.create(**kw)


def stream_chat(client: OpenAI, **kw):
    """(content, reasoning, finish_reason, usage, chunks) of a streamed chat completion."""
    chunks = list(chat(client, stream=True, **kw))
    content = reasoning = ""
    finish = usage = None
    for c in chunks:
        if c.usage is not None:
            usage = c.usage
        for ch in c.choices:
            content += ch.delta.content or ""
            reasoning += (ch.delta.model_extra or {}).get("reasoning") or ""
            finish = ch.finish_reason or finish
    return content, reasoning, finish, usage, chunks


# --- listing -------------------------------------------------------------------------------


def test_models_list_and_retrieve(client, engine):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    card = client.models.retrieve(MODEL)
    assert card.object == "model" and card.owned_by == "colibri" and card.created > 0
    assert card.model_extra["max_model_len"] == engine.info["context_length"]
    assert card.model_extra["max_model_len_source"] == "resident"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["code"] == "model_not_found"


# --- chat and completions --------------------------------------------------------------------


def test_chat_json_is_the_engines_greedy_answer(client, engine):
    r = chat(client, max_tokens=24)
    ids = builtin_prompt_ids(engine, HELLO)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == greedy_text(engine, ids, 24)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == len(ids) + 24


def test_chat_stream_matches_json(client):
    full = chat(client, max_completion_tokens=30).choices[0].message.content
    content, _, finish, usage, chunks = stream_chat(
        client, max_completion_tokens=30, stream_options={"include_usage": True}
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert content == full and finish == "length"
    assert usage.completion_tokens == 30
    # The usage chunk comes last and has no choices; no usage before it.
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    _, _, _, no_usage, _ = stream_chat(client, max_tokens=3)
    assert no_usage is None


def test_both_token_limits_are_ceilings(client):
    r = chat(client, max_tokens=9, max_completion_tokens=5)
    assert r.usage.completion_tokens == 5


def test_completions_json_and_stream(client, engine):
    ids = engine.tokenize("The capital of France is", add_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt="The capital of France is")
    assert r.object == "text_completion"
    assert r.choices[0].text == greedy_text(engine, ids, 16)  # OpenAI's default budget
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens == len(ids)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The capital of France is",
            max_tokens=10,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == greedy_text(engine, ids, 10)
    assert chunks[-1].usage.completion_tokens == 10
    assert [ch.finish_reason for c in chunks for ch in c.choices][-1] == "length"


def test_budget_is_clamped_to_the_context(client, engine):
    ctx = engine.info["context_length"]
    messages = [{"role": "user", "content": "x" * (ctx - 30)}]
    n_prompt = len(builtin_prompt_ids(engine, messages))
    r = chat(client, messages=messages, max_tokens=10_000)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == ctx - n_prompt


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_over_the_context_is_refused_before_streaming(client, engine, stream):
    messages = [{"role": "user", "content": "x" * engine.info["context_length"]}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=messages, stream=stream)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="y" * 5000, stream=stream)


# --- stops -----------------------------------------------------------------------------------


def test_stop_spanning_tokens_and_chunks(client):
    text = chat(client, max_tokens=40).choices[0].message.content
    stop = text[12:16]  # four one-character tokens: the stop spans four stream chunks
    want = text[: text.index(stop)]
    r = chat(client, max_tokens=40, stop=stop)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "stop"
    content, _, finish, _, chunks = stream_chat(client, max_tokens=40, stop=[stop, "\u00a7\u00a7"])
    assert content == want and finish == "stop"
    assert all(stop not in (ch.delta.content or "") for c in chunks for ch in c.choices)


def test_stop_in_legacy_completions(client):
    base = client.completions.create(model=MODEL, prompt="abc", max_tokens=30).choices[0].text
    stop = base[5:8]
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, stop=[stop])
    assert r.choices[0].text == base[: base.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_ignore_leading_stop(client):
    text = chat(client, max_tokens=30).choices[0].message.content
    lead = text[:2]
    r = chat(client, max_tokens=30, stop=[lead])
    assert r.choices[0].message.content == "" and r.choices[0].finish_reason == "stop"
    r = chat(client, max_tokens=30, stop=[lead], extra_body={"x_colibri_ignore_leading_stop": True})
    want, stopped = apply_stops(text, [lead], ignore_leading=True)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason == ("stop" if stopped else "length")


# --- continuation ----------------------------------------------------------------------------


def test_trailing_assistant_turn_is_continued(client, engine):
    messages = [*HELLO, {"role": "assistant", "content": "Sure, here it"}]
    rendered = render_chat(ChatTemplate(CHAT_TEMPLATE), GLM, messages, enable_thinking=False)
    assert rendered.continued and rendered.text.endswith("\nSure, here it")
    ids = engine.tokenize(rendered.text)
    r = chat(client, messages=messages, max_tokens=12)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == greedy_text(engine, ids, 12)


def test_continuation_refusals(client):
    for messages in (
        [*HELLO, {"role": "assistant", "content": "ends in space "}],
        [*HELLO, {"role": "assistant", "content": "ends in newline\n"}],
    ):
        with pytest.raises(openai.BadRequestError) as e:
            chat(client, messages=messages)
        assert e.value.body["code"] == "invalid_continuation"


# --- reasoning -------------------------------------------------------------------------------


def test_thinking_switch_changes_the_prompt(client, engine):
    off = chat(client, max_tokens=4)
    on = chat(client, max_tokens=4, extra_body={"enable_thinking": True})
    effort = chat(client, max_tokens=4, reasoning_effort="low")
    none = chat(client, max_tokens=4, reasoning_effort="none")
    assert off.usage.prompt_tokens == len(builtin_prompt_ids(engine, HELLO, thinking=False))
    assert on.usage.prompt_tokens == len(builtin_prompt_ids(engine, HELLO, thinking=True))
    assert effort.usage.prompt_tokens == on.usage.prompt_tokens
    assert none.usage.prompt_tokens == off.usage.prompt_tokens
    # Thinking on: the reasoning fields are there (this model never writes a think block).
    extra = on.choices[0].message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"] == ""
    assert "reasoning" not in (off.choices[0].message.model_extra or {})


# --- refusals --------------------------------------------------------------------------------

REFUSED = [
    (
        "image",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        "unsupported_content",
    ),
    (
        "audio",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
                    ],
                }
            ]
        },
        "unsupported_content",
    ),
    ("logprobs", {"logprobs": True}, "unsupported_parameter"),
    ("top_logprobs", {"top_logprobs": 2}, "unsupported_parameter"),
    ("frequency_penalty", {"frequency_penalty": 0.5}, "unsupported_parameter"),
    ("presence_penalty", {"presence_penalty": -0.5}, "unsupported_parameter"),
    ("repetition_penalty", {"repetition_penalty": 1.2}, "unsupported_parameter"),
    ("logit_bias", {"logit_bias": {"12": 5}}, "unsupported_parameter"),
    ("n", {"n": 2}, "unsupported_parameter"),
    ("five stops", {"stop": ["a", "b", "c", "d", "e"]}, "invalid_request"),
    ("empty stop", {"stop": [""]}, "invalid_request"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_role"),
    ("tool_choice without tools", {"tool_choice": "required"}, "invalid_request"),
    (
        "tool_choice undeclared",
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}},
        },
        "invalid_request",
    ),
    (
        "duplicate tool",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {}}},
                {"type": "function", "function": {"name": "f", "parameters": {}}},
            ]
        },
        "invalid_request",
    ),
    ("tool type", {"tools": [{"type": "retrieval"}]}, "unsupported_parameter"),
    (
        "tool name",
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        "invalid_request",
    ),
    (
        "strict tool whose schema cannot be enforced",
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "strict": True,
                        "parameters": {"type": "object", "properties": {"x": {"not": {}}}},
                    },
                }
            ]
        },
        "unsupported_schema",
    ),
    ("functions", {"functions": [{"name": "f"}]}, "invalid_request"),
    (
        "tool_calls on a user turn",
        {"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1"}]}]},
        "invalid_request",
    ),
    (
        "bad history arguments",
        {
            "messages": [
                *HELLO,
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": "c1",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{x"},
                        }
                    ],
                },
            ]
        },
        "invalid_request",
    ),
    ("response_format type", {"response_format": {"type": "yaml"}}, "invalid_request"),
    (
        "response_format schema keyword",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}},
            }
        },
        "unsupported_schema",
    ),
    ("unknown field", {"top_k": 5}, "unknown_parameter"),
    ("max_tokens type", {"max_tokens": "many"}, "invalid_request"),
    ("max_tokens zero", {"max_tokens": 0}, "invalid_request"),
    ("temperature range", {"temperature": 3}, "invalid_request"),
    ("temperature type", {"temperature": "hot"}, "invalid_request"),
    ("messages type", {"messages": "hello"}, "invalid_request"),
    ("empty messages", {"messages": []}, "invalid_request"),
    ("stream_options alone", {"stream_options": {"include_usage": True}}, "unsupported_parameter"),
    ("bad reasoning_effort", {"reasoning_effort": "maximal"}, "invalid_request"),
    ("prediction type", {"prediction": {"type": "diff", "content": "x"}}, "unsupported_parameter"),
    ("prediction content", {"prediction": {"type": "content"}}, "invalid_request"),
]


@pytest.mark.parametrize("body,code", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_with_openai_error_shape(server, body, code):
    payload = {"model": MODEL, "messages": HELLO, **body}
    r = httpx.post(server.base_url + "/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == code and err["message"]


def test_refusals_reach_the_sdk_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, n=2)
    assert e.value.body["param"] == "n"


@pytest.mark.parametrize(
    "raw", [b"{not json", b"[1, 2]", b'"text"', b""], ids=["malformed", "array", "string", "empty"]
)
def test_malformed_bodies(server, raw):
    for route in ("/chat/completions", "/completions"):
        r = httpx.post(
            server.base_url + route, content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] in ("invalid_json", "invalid_request")


def test_completion_refusals(server):
    for body, param in (
        ({"prompt": [1, 2, 3]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "logprobs": 2}, "logprobs"),
        ({"prompt": ""}, "prompt"),
    ):
        r = httpx.post(server.base_url + "/completions", json={"model": MODEL, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="gpt-4o")
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x")


def test_unknown_route_and_method(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.base_url + "/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


def test_seed_makes_sampling_reproducible(client):
    a = chat(client, max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    b = chat(client, max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content


# --- serving ---------------------------------------------------------------------------------


def test_health_is_public(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_concurrent_requests_are_served_one_at_a_time(client):
    want = chat(client, max_tokens=50).choices[0].message.content
    results: list[str] = []

    def worker() -> None:
        results.append(chat(client, max_tokens=50).choices[0].message.content)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [want] * 4


def test_client_disconnect_frees_the_engine(server, client):
    with httpx.stream(
        "POST",
        server.base_url + "/chat/completions",
        json={"model": MODEL, "messages": HELLO, "max_tokens": 2000, "stream": True},
    ) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
    # The abandoned generation must not hold the engine for its remaining ~2000 tokens.
    r = chat(client, max_tokens=5, timeout=20)
    assert r.usage.completion_tokens == 5


READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read",
        "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        "strict": False,
    },
}


@pytest.mark.parametrize(
    "shape",
    [
        # pi 0.73 (openai JS SDK): store false, max_completion_tokens, strict false tools,
        # text parts, usage in the stream.
        {"store": False, "max_completion_tokens": 8, "tools": [READ_TOOL],
         "stream_options": {"include_usage": True},
         "messages": [{"role": "system", "content": "You are pi."},
                      {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]},
        # opencode 1.18 (AI SDK openai-compatible): max_tokens, tool_choice auto, and a tool
        # round trip with an empty assistant content beside its calls.
        {"max_tokens": 8, "tool_choice": "auto", "tools": [READ_TOOL],
         "stream_options": {"include_usage": True},
         "messages": [{"role": "system", "content": "You are opencode."}, *HELLO,
                      {"role": "assistant", "content": "", "tool_calls": [
                          {"id": "call_1", "type": "function",
                           "function": {"name": "read", "arguments": '{"path": "README.md"}'}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "# Demo"}]},
        # aider 0.86 (LiteLLM): temperature 0, no max_tokens (the context's room applies).
        {"temperature": 0, "max_tokens": 8,
         "messages": [{"role": "system", "content": "Act as an expert developer."}, *HELLO]},
        # OpenAI SDK fields with no effect on the output here, checked and accepted.
        {"max_tokens": 8, "prompt_cache_key": "session-1", "safety_identifier": "u-1",
         "user": "u-1", "stream_options": {"include_usage": True, "include_obfuscation": False},
         "prediction": {"type": "content", "content": [{"type": "text", "text": "Hi"}]},
         "messages": [{"role": "developer", "content": "Be brief."}, *HELLO]},
    ],
    ids=["pi", "opencode", "aider", "accepted-no-ops"],
)  # fmt: skip
def test_what_coding_clients_send_is_accepted(client, shape):
    content, _, finish, usage, _ = stream_chat(client, **shape)
    assert finish == "length" and content
    if "stream_options" in shape:
        assert usage.completion_tokens == 8
