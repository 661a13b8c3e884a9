"""colibri's built-in DeepSeek-V3.2 and V4 chat templates against DeepSeek's published encoding
code: every request of tests/fixtures/templates/dsml_cases.json (made by
scripts/make_dsml_template_cases.py from that code) goes through the gateway's request parsing,
tool planning and rendering, and must give the reference prompt to the character."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.api.openai_request import parse_chat
from colibri.chat.families import DEEPSEEK_V3_2, DEEPSEEK_V4, FAMILIES, detect_family
from colibri.chat.render import render_chat
from colibri.chat.template import ChatTemplate, TemplateRefused
from colibri.chat.toolcalls import ToolCallParser
from colibri.chat.tooling import plan_tools
from colibri.chat.tools import Tool, ToolSet

CASES = json.loads(
    (Path(__file__).parent / "fixtures" / "templates" / "dsml_cases.json").read_text("utf-8")
)


def rendered(family_name: str, request: dict) -> str:
    family = FAMILIES[family_name]
    req = parse_chat({"model": "m", **request}, None)
    plan = plan_tools(req, family)
    source = family.builtin_template_source()
    assert source is not None
    return render_chat(
        ChatTemplate(source),
        family,
        plan.messages,
        enable_thinking=req.thinking,
        tools=plan.prompt_tools,
        declared_tools=bool(req.tools),
        reasoning_effort=req.reasoning_effort,
    ).text


def case_id(case: dict) -> str:
    effort = case["request"].get("reasoning_effort")
    mode = "think" if case["request"]["enable_thinking"] else "chat"
    return f"{case['family']}-{case['name']}-{mode}" + (f"-{effort}" if effort else "")


def test_the_cases_cover_both_families_and_both_modes():
    assert {c["family"] for c in CASES} == {"deepseek_v32", "deepseek_v4"}
    assert {c["request"]["enable_thinking"] for c in CASES} == {True, False}
    assert len(CASES) >= 100


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_builtin_template_renders_the_reference_prompt(case):
    assert rendered(case["family"], case["request"]) == case["expected"]


def test_families_are_told_apart_by_their_templates_and_architectures():
    v32, v4 = DEEPSEEK_V3_2.builtin_template_source(), DEEPSEEK_V4.builtin_template_source()
    assert detect_family("", v32) is DEEPSEEK_V3_2
    assert detect_family("", v4) is DEEPSEEK_V4
    assert detect_family("DeepseekV32ForCausalLM", None) is DEEPSEEK_V3_2
    assert detect_family("DeepseekV4ForCausalLM", None) is DEEPSEEK_V4


def test_a_trailing_assistant_turn_is_continued_not_closed():
    request = {
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "assistant", "content": "The colour is"},
        ],
        "enable_thinking": False,
    }
    assert rendered("deepseek_v4", request).endswith(
        "<｜User｜>Name a colour.<｜Assistant｜></think>The colour is"
    )
    assert rendered("deepseek_v32", request).endswith(
        "<｜User｜>Name a colour.<｜Assistant｜></think>The colour is"
    )


def test_v32_refuses_a_tool_result_that_answers_no_call():
    request = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "tool", "tool_call_id": "call_x", "content": "stray"},
        ],
        "enable_thinking": False,
    }
    with pytest.raises(TemplateRefused, match="must answer a tool call"):
        rendered("deepseek_v32", request)


@pytest.mark.parametrize("family", [DEEPSEEK_V3_2, DEEPSEEK_V4])
@pytest.mark.parametrize("block", ["function_calls", "tool_calls"])
def test_either_dsml_block_name_is_read_as_calls(family, block):
    """A V4 model writes tool_calls blocks, a V3.2 model function_calls: each family's parser
    reads both, so a call never leaks into the reply's text."""
    tools = ToolSet([Tool("clock", {"type": "object"})])
    out = (
        f'Sure.\n\n<｜DSML｜{block}>\n<｜DSML｜invoke name="clock">\n'
        f'<｜DSML｜parameter name="zone" string="true">UTC</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜{block}>"
    )
    parser = ToolCallParser(family.tool_format, tools)
    events = parser.push(out) + parser.finish()
    calls = [v for k, v in events if k == "tool_call"]
    text = "".join(v for k, v in events if k == "content")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("clock", {"zone": "UTC"})]
    assert text == "Sure."


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=8,
)
# What a string argument may hold and still be read back: anything but DSML's own closing tag
# (the format has no escaping; a model never writes one inside a value either).
STRING_VALUES = st.text(max_size=40).filter(lambda s: "DSML" not in s)
ARGUMENTS = st.dictionaries(
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,11}", fullmatch=True),
    STRING_VALUES | JSON_VALUES.filter(lambda v: not isinstance(v, str)),
    max_size=5,
)


@pytest.mark.parametrize("family", [DEEPSEEK_V3_2, DEEPSEEK_V4])
@settings(max_examples=60, deadline=None)
@given(arguments=ARGUMENTS)
def test_any_arguments_rendered_in_history_read_back_the_same(family, arguments):
    """A call in the history, rendered by the built-in template, is what the family's parser
    reads back: every JSON value, and string values kept raw (no escaping either way)."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "act", "arguments": json.dumps(arguments)},
    }
    request = {
        "messages": [
            {"role": "user", "content": "Go."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "done"},
        ],
        "tools": [{"type": "function", "function": {"name": "act", "parameters": {}}}],
        "enable_thinking": False,
    }
    prompt = rendered(family.name, request)
    start = prompt.index("<｜User｜>Go.<｜Assistant｜></think>") + len(
        "<｜User｜>Go.<｜Assistant｜></think>"
    )
    turn = prompt[start : prompt.index("<｜end▁of▁sentence｜>", start)]
    parser = ToolCallParser(family.tool_format, ToolSet([Tool("act")]))
    events = parser.push(turn) + parser.finish()
    calls = [v for k, v in events if k == "tool_call"]
    assert [k for k, v in events if k == "content" and v] == []
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("act", arguments)]
