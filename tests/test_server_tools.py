"""Tools through the running server with the official SDK: declaration, tool_choice, history,
refusals, and each family's template (rendering paths on the engine's built-in weights).

The built-in random model never writes a call; replies with real `tool_calls` are tested against
the trained demo model (tests/test_demo_model.py)."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI

from colibri.api.openai_request import parse_chat
from colibri.chat.families import detect_family
from colibri.chat.render import render_chat
from colibri.chat.template import ChatTemplate
from colibri.chat.tooling import plan_tools
from colibri.demo.builtin import CHAT_TEMPLATE, builtin_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer, family_template, model_with_template

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
DATE = {"type": "function", "function": {"name": "get_current_date", "parameters": {}}}
ASK = [{"role": "user", "content": "Weather in Lisbon?"}]
HISTORY = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "Lisbon"})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 21}'},
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(builtin_model_dir(), threads=1)


def expected_prompt_tokens(engine: Engine, template: str, body: dict) -> int:
    """What the server must have rendered, computed with the same public pieces in-process."""
    req = parse_chat({"model": "m", **body}, None)
    family = detect_family("Glm4MoeForCausalLM", template)
    plan = plan_tools(req, family)
    rendered = render_chat(
        ChatTemplate(template),
        family,
        plan.messages,
        enable_thinking=False,
        tools=plan.prompt_tools,
    )
    return len(engine.tokenize(rendered.text))


@pytest.fixture(scope="module")
def glm_server():
    srv = RunningServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(glm_server) -> OpenAI:
    return OpenAI(base_url=glm_server.base_url, api_key="x", max_retries=0)


def test_tools_go_into_the_prompt(client, engine):
    body = {"messages": ASK, "tools": [WEATHER, DATE]}
    r = client.chat.completions.create(model="colibri-builtin", max_tokens=4, **body)
    assert r.usage.prompt_tokens == expected_prompt_tokens(engine, CHAT_TEMPLATE, body)
    assert r.usage.prompt_tokens > expected_prompt_tokens(engine, CHAT_TEMPLATE, {"messages": ASK})
    assert r.choices[0].finish_reason == "length"  # the random model writes no call
    assert r.choices[0].message.tool_calls is None
    stream = client.chat.completions.create(
        model="colibri-builtin", messages=ASK, max_tokens=4, stream=True, tools=[WEATHER]
    )
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "choice",
    ["none", "auto", "required", {"type": "function", "function": {"name": "get_current_date"}}],
    ids=["none", "auto", "required", "named"],
)
def test_tool_choice_shapes_the_prompt(client, engine, choice):
    body = {"messages": ASK, "tools": [WEATHER, DATE], "tool_choice": choice}
    r = client.chat.completions.create(model="colibri-builtin", max_tokens=2, **body)
    want = expected_prompt_tokens(engine, CHAT_TEMPLATE, body)
    assert r.usage.prompt_tokens == want
    if choice == "none":
        assert want == expected_prompt_tokens(engine, CHAT_TEMPLATE, {"messages": ASK})


def test_tool_choice_named_declares_only_that_tool():
    req = parse_chat(
        {
            "model": "m",
            "messages": ASK,
            "tools": [WEATHER, DATE],
            "tool_choice": {"type": "function", "function": {"name": "get_current_date"}},
        },
        None,
    )
    plan = plan_tools(req, detect_family("Glm4MoeForCausalLM", CHAT_TEMPLATE))
    assert [t["function"]["name"] for t in plan.prompt_tools] == ["get_current_date"]
    assert "`get_current_date`" in plan.messages[0]["content"]


def test_tool_history_is_rendered(client, engine):
    body = {"messages": HISTORY, "tools": [WEATHER]}
    r = client.chat.completions.create(model="colibri-builtin", max_tokens=3, **body)
    assert r.usage.prompt_tokens == expected_prompt_tokens(engine, CHAT_TEMPLATE, body)


def test_continuation_with_tools_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="colibri-builtin",
            messages=[*ASK, {"role": "assistant", "content": "Let me"}],
            tools=[WEATHER],
        )
    assert e.value.body["code"] == "invalid_continuation"


def test_family_without_tools_refuses_them():
    srv = RunningServer("--chat-family", "olmoe")
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        for kw in ({"tools": [WEATHER]}, {"tools": [WEATHER], "tool_choice": "required"}):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model="colibri-builtin", messages=ASK, max_tokens=2, **kw
                )
            assert e.value.body["code"] == "tools_not_supported"
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="colibri-builtin", messages=HISTORY, max_tokens=2)
        # Declared but switched off: nothing to refuse.
        r = client.chat.completions.create(
            model="colibri-builtin", messages=ASK, max_tokens=2, tools=[WEATHER], tool_choice="none"
        )
        assert r.choices[0].finish_reason == "length"
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "name", ["qwen3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "kimi_k2"]
)
def test_family_templates_render_tools_and_history(name, engine, tmp_path):
    template = family_template(name)
    model = model_with_template(builtin_model_dir(), tmp_path / name, template)
    srv = RunningServer("--model", str(model), "--model-id", name)
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        history = json.loads(json.dumps(HISTORY))
        if name == "kimi_k2":
            history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = (
                "functions.get_weather:0"
            )
        body = {"messages": history, "tools": [WEATHER, DATE]}
        r = client.chat.completions.create(model=name, max_tokens=3, **body)
        assert r.usage.prompt_tokens == expected_prompt_tokens(engine, template, body)
    finally:
        srv.stop()
