"""Tool-call parsing per family: the vectors of TOOL-FORMATS.md and more, each run whole, split
at every point, one character at a time, and in random chunks — all must agree exactly."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.chat.families import DEEPSEEK_V3_1, DEEPSEEK_V3_2, GLM, KIMI, QWEN3, Family
from colibri.chat.reasoning import ReasoningSplitter
from colibri.chat.toolcalls import ToolCallParser
from colibri.chat.tools import Tool, ToolCall, ToolSet

TOOLS = ToolSet(
    [
        Tool(
            "get_weather",
            {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "date": {"type": "string"},
                    "location": {"type": "string"},
                    "days": {"type": "integer"},
                },
            },
        ),
        Tool("calculate"),  # no schema: every value is JSON if it parses
        Tool("get_current_date", {"type": "object", "properties": {}}),
        Tool(
            "write_file", {"properties": {"path": {"type": "string"}, "code": {"type": "string"}}}
        ),
    ]
)


@dataclass
class Case:
    name: str
    family: Family
    text: str
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)
    in_reasoning: bool = False
    after_reasoning: bool = False
    salvage: bool = False
    ids: list[str] | None = None  # family-provided ids (Kimi)


def glm_call(name: str, **args: str) -> str:
    pairs = "".join(
        f"\n<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>" for k, v in args.items()
    )
    return f"<tool_call>{name}{pairs}\n</tool_call>"


FS = "｜"  # U+FF5C, DeepSeek's bar
V31_BEGIN, V31_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def v31_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


def dsml(*invokes: str, bar: str = FS) -> str:
    body = "\n".join(invokes)
    return f"<{bar}DSML{bar}function_calls>\n{body}\n</{bar}DSML{bar}function_calls>"


def invoke(name: str, *params: tuple[str, str, str], bar: str = FS) -> str:
    ps = "".join(
        f'<{bar}DSML{bar}parameter name="{k}" string="{s}">{v}</{bar}DSML{bar}parameter>\n'
        for k, s, v in params
    )
    return f'<{bar}DSML{bar}invoke name="{name}">\n{ps}</{bar}DSML{bar}invoke>'


WEATHER_BJ = {"city": "Beijing", "date": "2025-08-01"}
CASES = [
    # --- GLM ---
    Case(
        "glm vector: reasoning, content, call",
        GLM,
        "\n<think>Need weather.</think>\nLet me check.\n"
        + glm_call("get_weather", city="Beijing", date="2025-08-01"),
        reasoning="Need weather.",
        content="Let me check.",
        calls=[("get_weather", WEATHER_BJ)],
    ),
    Case(
        "glm vector: typed values without schema",
        GLM,
        glm_call("calculate", a="42", b="3.14", enabled="true"),
        calls=[("calculate", {"a": 42, "b": 3.14, "enabled": True})],
    ),
    Case(
        "glm 4.7 inline: two calls, one without arguments",
        GLM,
        "<tool_call>get_current_date</tool_call><tool_call>get_weather<arg_key>city</arg_key>"
        "<arg_value>Shanghai</arg_value></tool_call>",
        calls=[("get_current_date", {}), ("get_weather", {"city": "Shanghai"})],
    ),
    Case(
        "glm string argument keeps its spaces",
        GLM,
        glm_call("write_file", path="a.py", code="    indented code    "),
        calls=[("write_file", {"path": "a.py", "code": "    indented code    "})],
    ),
    Case(
        "glm unicode and a multi-line string",
        GLM,
        glm_call("write_file", path="ü/東京.py", code="def f():\n    return '→'\n"),
        calls=[("write_file", {"path": "ü/東京.py", "code": "def f():\n    return '→'\n"})],
    ),
    Case(
        "glm nested JSON argument",
        GLM,
        glm_call("calculate", payload='{"x": [1, {"y": 2}], "s": "t"}', n="-7"),
        calls=[("calculate", {"payload": {"x": [1, {"y": 2}], "s": "t"}, "n": -7})],
    ),
    Case(
        "glm a string-typed number stays a string",
        GLM,
        glm_call("get_weather", city="2025"),
        calls=[("get_weather", {"city": "2025"})],
    ),
    Case(
        "glm text after the call",
        GLM,
        "Sure.\n" + glm_call("get_current_date") + "\nDone.",
        content="Sure.Done.",
        calls=[("get_current_date", {})],
    ),
    Case(
        "glm call inside reasoning ends it",
        GLM,
        "<think>I should look it up" + glm_call("get_weather", city="Rome"),
        reasoning="I should look it up",
        calls=[("get_weather", {"city": "Rome"})],
    ),
    Case(
        "glm prompt opened thinking (4.7)",
        GLM,
        "plan</think>" + glm_call("get_weather", city="Oslo"),
        reasoning="plan",
        calls=[("get_weather", {"city": "Oslo"})],
        in_reasoning=True,
    ),
    Case(
        "glm undeclared tool is text",
        GLM,
        "Hm. " + glm_call("launch_rockets", count="3"),
        content="Hm.\u0020" + glm_call("launch_rockets", count="3"),
    ),
    Case(
        "glm malformed call is text",
        GLM,
        "<tool_call>get_weather\n<arg_key>city</arg_key>oops</tool_call>",
        content="<tool_call>get_weather\n<arg_key>city</arg_key>oops</tool_call>",
    ),
    Case(
        "glm unclosed call is text when strict",
        GLM,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lisbon",
        content="<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lisbon",
    ),
    Case(
        "glm unclosed call salvaged",
        GLM,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lisbon",
        calls=[("get_weather", {"city": "Lisbon"})],
        salvage=True,
    ),
    Case(
        "glm salvage drops a cut-off closing tag",
        GLM,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Lisbon</arg_v",
        calls=[("get_weather", {"city": "Lisbon"})],
        salvage=True,
    ),
    Case(
        "glm a string-or-null property keeps its text",
        GLM,
        glm_call("write_file", path="a", code="123", mode="0644"),
        calls=[("write_file", {"path": "a", "code": "123", "mode": "0644"})],
    ),
    Case(
        "glm look-alikes stay text",
        GLM,
        "Use <tool-call> or <tool_calls> tags; <arg_key>x</arg_key> <tool_call",
        content="Use <tool-call> or <tool_calls> tags; <arg_key>x</arg_key> <tool_call",
    ),
    Case(
        "glm thinking off: answer after the closed block",
        GLM,
        "\nIt is sunny.",
        content="It is sunny.",
        after_reasoning=True,
    ),
    # --- Qwen3 ---
    Case(
        "qwen vector: hermes after reasoning",
        QWEN3,
        '<think>\nUser wants weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>',
        reasoning="User wants weather.",
        calls=[("get_weather", {"city": "Paris"})],
    ),
    Case(
        "qwen two calls with content before",
        QWEN3,
        'Checking both.\n<tool_call>\n{"name": "get_current_date", "arguments": {}}\n</tool_call>'
        '\n<tool_call>\n{"name": "calculate", "arguments": {"expr": [1, 2]}}\n</tool_call>',
        content="Checking both.",
        calls=[("get_current_date", {}), ("calculate", {"expr": [1, 2]})],
    ),
    Case(
        "qwen arguments as a JSON string",
        QWEN3,
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n'
        "</tool_call>",
        calls=[("get_weather", {"city": "Rome"})],
    ),
    Case(
        "qwen unclosed call with complete JSON",
        QWEN3,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kyiv"}}\n',
        calls=[("get_weather", {"city": "Kyiv"})],
    ),
    Case(
        "qwen unclosed call with incomplete JSON is text",
        QWEN3,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ky',
        content='<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ky',
    ),
    Case(
        "qwen invalid JSON is text",
        QWEN3,
        '<tool_call>\n{"name": get_weather}\n</tool_call>',
        content='<tool_call>\n{"name": get_weather}\n</tool_call>',
    ),
    Case(
        "qwen coder XML",
        QWEN3,
        "<tool_call>\n<function=write_file>\n<parameter=path>\nmain.py\n</parameter>\n"
        "<parameter=code>\ndef f():\n    return 1\n</parameter>\n</function>\n</tool_call>",
        calls=[("write_file", {"path": "main.py", "code": "def f():\n    return 1"})],
    ),
    Case(
        "qwen coder XML typed without schema",
        QWEN3,
        "<tool_call>\n<function=calculate>\n<parameter=a>\n42\n</parameter>\n"
        "<parameter=b>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
        calls=[("calculate", {"a": 42, "b": [1, 2]})],
    ),
    # --- DeepSeek V3.1 ---
    Case(
        "deepseek v3.1 two calls",
        DEEPSEEK_V3_1,
        "Let me check."
        + V31_BEGIN
        + v31_call("get_weather", '{"city": "Tokyo"}')
        + v31_call("get_current_date", "{}")
        + V31_END,
        content="Let me check.",
        calls=[("get_weather", {"city": "Tokyo"}), ("get_current_date", {})],
        after_reasoning=True,
    ),
    Case(
        "deepseek v3.1 after thinking",
        DEEPSEEK_V3_1,
        "Need it.</think>" + V31_BEGIN + v31_call("get_weather", '{"city": "Seoul"}') + V31_END,
        reasoning="Need it.",
        calls=[("get_weather", {"city": "Seoul"})],
        in_reasoning=True,
    ),
    Case(
        "deepseek v3.1 unclosed is text",
        DEEPSEEK_V3_1,
        V31_BEGIN + v31_call("get_weather", '{"city": "Seoul"}'),
        content=V31_BEGIN + v31_call("get_weather", '{"city": "Seoul"}'),
    ),
    # --- DeepSeek V3.2 DSML ---
    Case(
        "dsml vector",
        DEEPSEEK_V3_2,
        "Check weather.</think>Let me look.\n\n"
        + dsml(invoke("get_weather", ("location", "true", "杭州"), ("days", "false", "3"))),
        reasoning="Check weather.",
        content="Let me look.",
        calls=[("get_weather", {"location": "杭州", "days": 3})],
        in_reasoning=True,
    ),
    Case(
        "dsml raw string is not stripped",
        DEEPSEEK_V3_2,
        dsml(invoke("write_file", ("path", "true", " a b "), ("code", "true", "x\n"))),
        calls=[("write_file", {"path": " a b ", "code": "x\n"})],
    ),
    Case(
        "dsml a value that mentions the marker keeps its text",
        DEEPSEEK_V3_2,
        dsml(invoke("write_file", ("path", "true", "|DSML| notes.md"))),
        calls=[("write_file", {"path": "|DSML| notes.md"})],
    ),
    Case(
        "dsml ASCII look-alike does not leak",
        DEEPSEEK_V3_2,
        "Ok.\n\n" + dsml(invoke("get_weather", ("location", "true", "Hanoi"), bar="|"), bar="|"),
        content="Ok.",
        calls=[("get_weather", {"location": "Hanoi"})],
    ),
    Case(
        "dsml invalid JSON value is text",
        DEEPSEEK_V3_2,
        dsml(invoke("get_weather", ("days", "false", "three"))),
        content=dsml(invoke("get_weather", ("days", "false", "three"))),
    ),
    # --- Kimi K2 ---
    Case(
        "kimi vector",
        KIMI,
        "I'll check. <|tool_calls_section_begin|> <|tool_call_begin|>\nfunctions.get_weather:0 "
        '<|tool_call_argument_begin|> {"city": "Beijing"} <|tool_call_end|> '
        "<|tool_calls_section_end|>",
        content="I'll check. ",
        calls=[("get_weather", {"city": "Beijing"})],
        ids=["functions.get_weather:0"],
    ),
    Case(
        "kimi two calls, thinking ended by the section",
        KIMI,
        "<think>two lookups<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:3"
        '<|tool_call_argument_begin|>{"city": "Lima"}<|tool_call_end|><|tool_call_begin|>'
        "functions.get_current_date:4<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>",
        reasoning="two lookups",
        calls=[("get_weather", {"city": "Lima"}), ("get_current_date", {})],
        ids=["functions.get_weather:3", "functions.get_current_date:4"],
    ),
]


def run(case: Case, chunks: list[str]) -> tuple[str, str, list[ToolCall]]:
    fmt = case.family.tool_format
    assert fmt is not None
    split = ReasoningSplitter(case.in_reasoning, case.after_reasoning, end_markers=fmt.starts)
    parser = ToolCallParser(fmt, TOOLS, salvage=case.salvage)
    events: list = []

    def route(pieces):
        for kind, text in pieces:
            events.extend(parser.push(text) if kind == "content" else [(kind, text)])

    for chunk in chunks:
        route(split.push(chunk))
    route(split.flush())
    events.extend(parser.finish())
    reasoning = "".join(v for k, v in events if k == "reasoning")
    content = "".join(v for k, v in events if k == "content")
    calls = [v for k, v in events if k == "tool_call"]
    assert all(v for k, v in events if k != "tool_call"), "no empty pieces"
    return reasoning, content, calls


def check(case: Case, result: tuple[str, str, list[ToolCall]]) -> None:
    reasoning, content, calls = result
    assert reasoning == case.reasoning
    assert content == case.content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == case.calls
    for i, c in enumerate(calls):
        assert "".join(c.fragments) == c.arguments
        if case.ids is not None:
            assert c.id == case.ids[i]
        else:
            assert re.fullmatch(r"call_[0-9a-f]{24}", c.id)
    # Markers never leak into content or reasoning of a parsed call.
    for marker in ("<tool_call>", "<arg_key>", "tool▁call", "DSML", "<|tool_call"):
        if case.calls and marker not in case.content:
            assert marker not in content and marker not in reasoning


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_whole(case):
    check(case, run(case, [case.text]))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_split_point(case):
    for i in range(len(case.text) + 1):
        check(case, run(case, [case.text[:i], case.text[i:]]))
    check(case, run(case, list(case.text)))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_random_chunks(data):
    case = data.draw(st.sampled_from(CASES))
    cuts = sorted(data.draw(st.sets(st.integers(0, len(case.text)), max_size=12)))
    chunks = [case.text[a:b] for a, b in zip([0, *cuts], [*cuts, len(case.text)], strict=True)]
    check(case, run(case, chunks))


def test_parallel_tool_calls_false_keeps_the_first_call():
    parser = ToolCallParser(GLM.tool_format, TOOLS, max_calls=1)
    events = parser.push(glm_call("get_current_date") + glm_call("get_weather", city="Rome"))
    events += parser.finish()
    calls = [v for k, v in events if k == "tool_call"]
    assert [c.name for c in calls] == ["get_current_date"] and parser.done


def test_parallel_tool_calls_false_drops_later_calls_of_a_section():
    text = V31_BEGIN + v31_call("get_current_date", "{}") + v31_call("calculate", "{}") + V31_END
    parser = ToolCallParser(DEEPSEEK_V3_1.tool_format, TOOLS, max_calls=1)
    events = parser.push(text) + parser.finish()
    assert [(k, getattr(v, "name", v)) for k, v in events] == [("tool_call", "get_current_date")]


def test_a_section_keeps_its_usable_calls_and_returns_the_rest_as_text():
    bad = v31_call("launch_rockets", "{}")
    text = V31_BEGIN + v31_call("get_current_date", "{}") + bad + V31_END
    parser = ToolCallParser(DEEPSEEK_V3_1.tool_format, TOOLS)
    events = parser.push(text) + parser.finish()
    assert [k for k, _ in events] == ["tool_call", "content"]
    assert events[1] == ("content", bad)


def test_no_declared_tools_means_text():
    parser = ToolCallParser(GLM.tool_format, ToolSet())
    text = glm_call("get_weather", city="Rome")
    assert parser.push(text) + parser.finish() == [("content", text)]
