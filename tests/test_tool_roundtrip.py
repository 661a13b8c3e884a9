"""Round trips per family: a conversation with tool calls and results is rendered through the
family's template, the assistant turn is parsed back by the gateway's parser, and the rebuilt
conversation renders to exactly the same prompt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from colibri.api.openai_request import parse_chat
from colibri.chat.families import (
    DEEPSEEK_V3_1,
    DEEPSEEK_V3_2,
    DEEPSEEK_V4,
    GLM,
    KIMI,
    QWEN3,
    detect_family,
)
from colibri.chat.reasoning import ReasoningSplitter
from colibri.chat.render import render_chat
from colibri.chat.template import ChatTemplate
from colibri.chat.toolcalls import ToolCallParser
from colibri.chat.tooling import plan_tools
from colibri.chat.tools import Tool, ToolSet
from colibri.demo.builtin import CHAT_TEMPLATE

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_current_date", "description": "Today", "parameters": {}},
    },
]
# (family, template, assistant turn start, turn end, prompt ended after a closed think block)
FAMILIES = {
    "glm": (GLM, CHAT_TEMPLATE, "<|assistant|>", "<|observation|>", False),
    "qwen3": (
        QWEN3,
        (TEMPLATES / "qwen3.jinja").read_text(),
        "<|im_start|>assistant\n",
        "<|im_end|>",
        False,
    ),  # fmt: skip
    "deepseek_v31": (
        DEEPSEEK_V3_1,
        (TEMPLATES / "deepseek_v31.jinja").read_text(),
        "<｜Assistant｜></think>",
        "<｜end▁of▁sentence｜>",
        True,
    ),  # fmt: skip
    # DeepSeek publishes V3.2's and V4's chat formats as code: colibri's built-in templates.
    "deepseek_v32": (
        DEEPSEEK_V3_2,
        DEEPSEEK_V3_2.builtin_template_source(),
        "<｜Assistant｜></think>",
        "<｜end▁of▁sentence｜>",
        True,
    ),  # fmt: skip
    "deepseek_v4": (
        DEEPSEEK_V4,
        DEEPSEEK_V4.builtin_template_source(),
        "<｜Assistant｜></think>",
        "<｜end▁of▁sentence｜>",
        True,
    ),  # fmt: skip
    "kimi_k2": (
        KIMI,
        (TEMPLATES / "kimi_k2.jinja").read_text(),
        "<|im_assistant|>assistant<|im_middle|>",
        "<|im_end|>",
        False,
    ),  # fmt: skip
}


def conversation(family_name: str, content: str) -> list[dict]:
    kimi = family_name == "kimi_k2"
    ids = (
        ["functions.get_weather:0", "functions.get_current_date:1"]
        if kimi
        else ["call_0123456789abcdef01234567", "call_89abcdef0123456789abcdef"]
    )
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in São Paulo for 3 days, and the date?"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": ids[0],
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": json.dumps({"city": "São Paulo", "days": 3}),
                    },
                },
                {
                    "id": ids[1],
                    "type": "function",
                    "function": {"name": "get_current_date", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": ids[0], "content": '{"temp_c": 24}'},
        {"role": "tool", "tool_call_id": ids[1], "content": "2026-11-30"},
        {"role": "user", "content": "Thanks!"},
    ]


def render(family_name: str, messages: list[dict]) -> str:
    family, source, *_ = FAMILIES[family_name]
    req = parse_chat({"model": "m", "messages": messages, "tools": TOOLS}, None)
    plan = plan_tools(req, family)
    rendered = render_chat(
        ChatTemplate(source), family, plan.messages, enable_thinking=False, tools=plan.prompt_tools
    )
    return rendered.text


def parse_turn(family_name: str, text: str):
    family, _, _, _, after = FAMILIES[family_name]
    fmt = family.tool_format
    split = ReasoningSplitter(False, after, end_markers=fmt.starts)
    tools = ToolSet(Tool(t["function"]["name"], t["function"]["parameters"]) for t in TOOLS)
    parser = ToolCallParser(fmt, tools)
    events = []
    for kind, piece in split.push(text) + split.flush():
        events += parser.push(piece) if kind == "content" else [(kind, piece)]
    events += parser.finish()
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "tool_call"]
    return content, calls


@pytest.mark.parametrize("content", ["", "Let me check both."])
@pytest.mark.parametrize("family_name", sorted(FAMILIES))
def test_round_trip(family_name, content):
    family, source, start, end, _ = FAMILIES[family_name]
    assert detect_family("OlmoeForCausalLM", source) is family
    messages = conversation(family_name, content)
    first = render(family_name, messages)
    i = first.index(start) + len(start)
    turn = first[i : first.index(end, i)]
    parsed_content, calls = parse_turn(family_name, turn)
    assert parsed_content == content
    original = messages[2]["tool_calls"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        (o["function"]["name"], json.loads(o["function"]["arguments"])) for o in original
    ]
    if family_name == "kimi_k2":
        assert [c.id for c in calls] == [o["id"] for o in original]
    rebuilt = [
        *messages[:2],
        {"role": "assistant", "content": parsed_content, "tool_calls": [
            {**c.to_openai(), "id": o["id"]} for c, o in zip(calls, original, strict=True)
        ]},
        *messages[3:],
    ]  # fmt: skip
    assert render(family_name, rebuilt) == first
