"""The OpenAI Responses API (`/v1/responses`) through the running server on the demo model, with
the official `openai` SDK (`client.responses.create` / `.stream` / `.retrieve`) and raw HTTP for
refusals and event payloads."""

from __future__ import annotations

import json

import httpx
import openai
import orjson
import pytest
from openai import OpenAI

from .server import RunningServer

MODEL = "colibri-demo"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
LISBON = json.dumps({"city": "Lisbon", "temperature_c": 21, "condition": "sunny"})


@pytest.fixture(scope="module")
def server():
    srv = RunningServer("--no-kv-persist", default_model=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def test_a_sum_is_answered_and_stored(client):
    r = client.responses.create(model=MODEL, input="What is 37 + 48?")
    assert r.object == "response" and r.status == "completed" and r.model == MODEL
    assert r.id.startswith("resp_") and r.output_text == "85"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    u = r.usage
    assert u.input_tokens > 0 and u.output_tokens > 0
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert client.responses.retrieve(r.id).output_text == "85"
    unstored = client.responses.create(model=MODEL, input="What is 37 + 48?", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_instructions_and_messages(client):
    r = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input=[
            {"role": "developer", "content": "No tools are needed."},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "What is the capital of Portugal?"}]},
        ],
    )  # fmt: skip
    assert "Lisbon" in r.output_text and r.instructions == "Answer briefly."


def test_reasoning_item_and_its_sealed_copy(client):
    r = client.responses.create(
        model=MODEL,
        input="What is 37 + 48?",
        reasoning={"effort": "low"},
        include=["reasoning.encrypted_content"],
    )
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and message.type == "message"
    text = reasoning.content[0].text
    assert "37 + 48 = 85" in text and r.output_text == "85"
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert reasoning.encrypted_content

    def prompt_tokens(item: dict) -> int:
        follow = client.responses.create(
            model=MODEL,
            store=False,
            max_output_tokens=1,
            input=[
                {"role": "user", "content": "What is 37 + 48?"},
                item,
                {"role": "assistant", "content": [{"type": "output_text", "text": "85"}]},
                {"role": "user", "content": "And 10 + 20?"},
            ],
        )
        return follow.usage.input_tokens

    # The reasoning comes back from its sealed copy as from its text (codex sends the copy).
    sealed = {"type": "reasoning", "id": reasoning.id, "summary": [],
              "encrypted_content": reasoning.encrypted_content}  # fmt: skip
    plain = {"type": "reasoning", "id": reasoning.id, "summary": [],
             "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip
    assert prompt_tokens(sealed) == prompt_tokens(plain)


def test_function_call_round_trip_with_previous_response_id(client):
    first = client.responses.create(
        model=MODEL, input="What's the weather in Lisbon?", tools=[WEATHER]
    )
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Lisbon"} and call.call_id
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": LISBON}],
    )
    assert "21" in second.output_text and "Lisbon" in second.output_text
    assert second.previous_response_id == first.id
    # The follow-up's prompt starts with the first turn's: its KV is reused from the slot.
    assert second.usage.input_tokens_details.cached_tokens > first.usage.input_tokens // 2
    # The same conversation sent whole (store false, as codex does) gives the same answer.
    whole = client.responses.create(
        model=MODEL,
        store=False,
        tools=[WEATHER],
        input=[
            {"role": "user", "content": "What's the weather in Lisbon?"},
            {"type": "function_call", "id": call.id, "call_id": call.call_id,
             "name": "get_weather", "arguments": call.arguments, "status": "completed"},
            {"type": "function_call_output", "call_id": call.call_id, "output": LISBON},
        ],
    )  # fmt: skip
    assert whole.output_text == second.output_text


def test_stream_reassembles_to_the_json_reply(client, server):
    kw = dict(model=MODEL, input="What is 37 + 48?", reasoning={"effort": "low"})
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    plain = client.responses.create(**kw)
    assert [i.type for i in final.output] == [i.type for i in plain.output]
    assert final.output_text == plain.output_text == "85"
    assert final.output[0].content[0].text == plain.output[0].content[0].text
    names = [e.type for e in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for kind in ("reasoning_text", "output_text"):
        first_delta = names.index(f"response.{kind}.delta")
        assert names.index("response.output_item.added") < first_delta
        assert first_delta < names.index(f"response.{kind}.done")
    # A streamed call: its arguments arrive as deltas, then done, inside its item.
    with client.responses.stream(
        model=MODEL, input="What's the weather in Lisbon?", tools=[WEATHER]
    ) as stream:
        names = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in names
    assert "response.function_call_arguments.done" in names
    assert json.loads(final.output[0].arguments) == {"city": "Lisbon"}


def test_max_output_tokens_makes_an_incomplete_response(server, client):
    r = client.responses.create(model=MODEL, input="What is 37 + 48?",
                                reasoning={"effort": "low"}, max_output_tokens=3)  # fmt: skip
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "stream": True}
    with httpx.stream("POST", server.base_url + "/responses", json=body) as resp:
        names = [line[7:] for line in resp.iter_lines() if line.startswith("event: ")]
    assert names[-1] == "response.incomplete"


def test_a_codex_shaped_request(client, server):
    """What codex 0.171 sends (captured), in a prompt the demo context holds: developer items,
    a namespace of functions, the hosted web_search tool, encrypted reasoning asked for, item
    ids, prompt_cache_key, client_metadata, store false."""
    body = {
        "model": MODEL,
        "stream": False,
        "input": [
            {"type": "message", "id": "msg_1", "role": "developer",
             "content": [{"type": "input_text", "text": "You are a coding agent."}]},
            {"type": "message", "id": "msg_2", "role": "user",
             "content": [{"type": "input_text", "text": "What is 37 + 48?"}]},
        ],
        "tools": [
            {**WEATHER, "strict": False},
            {"type": "namespace", "name": "agents", "description": "Sub-agents",
             "tools": [{"type": "function", "name": "spawn", "description": "Start one",
                        "parameters": {"type": "object", "properties": {}}, "strict": False}]},
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"thread_id": "thread-1"},
    }  # fmt: skip
    r = httpx.post(server.base_url + "/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["store"] is False and out["reasoning"] == {"effort": None, "summary": "auto"}
    assert [i["type"] for i in out["output"]][-1] in ("message", "function_call")
    # A call into a namespace comes back with its namespace, and goes back in the same way.
    history = body["input"] + [
        {"type": "function_call", "call_id": "call_1", "namespace": "agents", "name": "spawn",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "started"},
    ]  # fmt: skip
    r = httpx.post(server.base_url + "/responses", json={**body, "input": history}, timeout=120)
    assert r.status_code == 200, r.text


REFUSED = [
    ("unknown field", {"frobnicate": 1}, 400, "unknown_parameter"),
    ("json schema keyword", {"text": {"format": {"type": "json_schema", "name": "x",
     "schema": {"type": "array", "uniqueItems": True}}}}, 400, "unsupported_schema"),
    ("text format type", {"text": {"format": {"type": "yaml"}}}, 400, "invalid_request"),
    ("truncation auto", {"truncation": "auto"}, 400, "unsupported_parameter"),
    ("background", {"background": True}, 400, "unsupported_parameter"),
    ("logprobs include", {"include": ["message.output_text.logprobs"]}, 400,
     "unsupported_parameter"),
    ("file search", {"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, 400,
     "unsupported_tool"),
    ("image", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}, 400,
     "unsupported_content"),
    ("bad role", {"input": [{"role": "critic", "content": "x"}]}, 400, "invalid_role"),
    ("missing input", {"input": None}, 400, "missing_required_parameter"),
    ("unknown previous", {"previous_response_id": "resp_nope"}, 400,
     "previous_response_not_found"),
    ("unknown model", {"model": "nope"}, 404, "model_not_found"),
]  # fmt: skip


@pytest.mark.parametrize("extra,status,code", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refusals(server, extra, status, code):
    body = {k: v for k, v in {"model": MODEL, "input": "Hi", **extra}.items() if v is not None}
    r = httpx.post(server.base_url + "/responses", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]


def test_unknown_response_is_not_found(server):
    r = httpx.get(server.base_url + "/responses/resp_nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"


def test_stream_event_payloads(server):
    body = {"model": MODEL, "input": "What is 37 + 48?", "stream": True}
    with httpx.stream("POST", server.base_url + "/responses", json=body) as r:
        lines = list(r.iter_lines())
    names = [line[7:] for line in lines if line.startswith("event: ")]
    datas = [orjson.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in datas] == names
    created, done = datas[0]["response"], datas[-1]["response"]
    assert created["status"] == "in_progress" and created["output"] == []
    assert done["status"] == "completed" and done["id"] == created["id"]
    text = "".join(d["delta"] for d in datas if d["type"] == "response.output_text.delta")
    assert text == done["output"][0]["content"][0]["text"] == "85"


def test_stream_identities(server):
    """Structural checks (after llama.cpp's Responses compatibility tests): one response id
    through the lifecycle, every part and delta names an item added before it at its index,
    each item is done with the id it was added with, and the final output lists them."""
    body = {"model": MODEL, "input": "What is 37 + 48?", "stream": True,
            "reasoning": {"effort": "low"}}  # fmt: skip
    with httpx.stream("POST", server.base_url + "/responses", json=body) as r:
        datas = [orjson.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    ids = {d["response"]["id"] for d in datas if "response" in d}
    assert len(ids) == 1 and ids.pop().startswith("resp_")
    added: dict[int, str] = {}
    for d in datas:
        if d["type"] == "response.output_item.added":
            assert d["output_index"] not in added
            added[d["output_index"]] = d["item"]["id"]
        elif "item_id" in d:
            assert added[d["output_index"]] == d["item_id"]
        elif d["type"] == "response.output_item.done":
            assert added[d["output_index"]] == d["item"]["id"]
    final = datas[-1]["response"]["output"]
    assert [item["id"] for item in final] == [added[i] for i in sorted(added)]
    assert final[0]["id"].startswith("rs_") and final[1]["id"].startswith("msg_")
