"""Anthropic context edits (api/context_edits.py) on chat-shaped conversations."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.api.context_edits import (
    CLEARED_INPUT,
    CLEARED_RESULT,
    ClearThinking,
    ClearToolUses,
    apply_edits,
    parse_context_management,
)
from colibri.api.errors import ApiError


def count(messages) -> int:
    """A stand-in for the rendered prompt's length: characters of everything the template
    would read (the server passes the real token count)."""
    return len(json.dumps(messages))


def conversation(turns: list[tuple[bool, list[str]]]) -> list[dict]:
    """user, then per turn an assistant message (with reasoning or not, calling these tools)
    and the tools' results."""
    messages: list[dict] = [{"role": "system", "content": "sys"}, {"role": "user", "content": "go"}]
    n = 0
    for thinks, tools in turns:
        calls = []
        for name in tools:
            calls.append(
                {"id": f"call_{n}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps({"path": f"f{n}" * 5})}}
            )  # fmt: skip
            n += 1
        message: dict = {"role": "assistant", "content": "ok"}
        if thinks:
            message["reasoning_content"] = "let me think " * 4
        if calls:
            message["tool_calls"] = calls
        messages.append(message)
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "result " * 20})
    return messages


def test_parse_claude_codes_edit_and_defaults():
    assert parse_context_management(
        {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    ) == [ClearThinking(keep=None)]
    assert parse_context_management({"edits": [{"type": "clear_thinking_20251015"}]}) == [
        ClearThinking(keep=1)
    ]
    assert parse_context_management(
        {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "all"}}]}
    ) == [ClearThinking(keep=None)]
    (edit,) = parse_context_management({"edits": [{"type": "clear_tool_uses_20250919"}]})
    assert edit == ClearToolUses(trigger=("input_tokens", 100_000), keep=3)
    (edit,) = parse_context_management(
        {"edits": [{
            "type": "clear_tool_uses_20250919",
            "trigger": {"type": "tool_uses", "value": 4},
            "keep": {"type": "tool_uses", "value": 1},
            "clear_at_least": {"type": "input_tokens", "value": 50},
            "exclude_tools": ["Write"],
            "clear_tool_inputs": ["Read"],
        }]}
    )  # fmt: skip
    assert edit == ClearToolUses(
        trigger=("tool_uses", 4),
        keep=1,
        clear_at_least=50,
        exclude_tools=frozenset({"Write"}),
        clear_inputs=frozenset({"Read"}),
    )
    assert parse_context_management({}) == []


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"edits": [{"type": "compact_20260112"}]}, "compact_20260112"),
        ({"edits": [{"type": "clear_everything_2030"}]}, "clear_everything_2030"),
        ({"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}, "keep"),
        ({"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "turns"}}]}, "type"),
        ({"edits": [{"type": "clear_tool_uses_20250919", "keep": {"type": "tool_uses"}}]}, "value"),
        ({"edits": [{"type": "clear_tool_uses_20250919", "exclude_tools": "Bash"}]}, "exclude"),
        ({"edits": [{"type": "clear_tool_uses_20250919", "frob": 1}]}, "frob"),
        ({"edits": [], "frob": 1}, "frob"),
        ({"edits": "all"}, "edits"),
    ],
)
def test_bad_edits_are_refused_by_name(raw, needle):
    with pytest.raises(ApiError) as e:
        parse_context_management(raw)
    assert e.value.status == 400 and needle in str(e.value)


def test_clear_thinking_keeps_the_last_turns():
    messages = conversation([(True, []), (False, []), (True, []), (True, [])])
    edited = apply_edits(messages, [ClearThinking(keep=1)], count)
    thinking = [m for m in edited.messages if m.get("reasoning_content")]
    assert len(thinking) == 1 and thinking[0] is messages[-1]
    (report,) = edited.applied
    assert report["type"] == "clear_thinking_20251015" and report["cleared_thinking_turns"] == 2
    assert report["cleared_input_tokens"] == count(messages) - count(edited.messages) > 0
    assert edited.original_tokens == count(messages)
    assert "reasoning_content" in messages[2]  # the client's history is not changed
    assert apply_edits(messages, [ClearThinking(keep=None)], count).applied == []
    assert apply_edits(messages, [ClearThinking(keep=3)], count).applied == []


def test_clear_tool_uses_on_trigger():
    messages = conversation([(False, ["Read", "Bash"]), (False, ["Read"]), (False, ["Write"])])
    low = ClearToolUses(trigger=("input_tokens", 10), keep=1)
    edited = apply_edits(messages, [low], count)
    results = [m["content"] for m in edited.messages if m["role"] == "tool"]
    assert results[:3] == [CLEARED_RESULT] * 3 and results[3] != CLEARED_RESULT
    (report,) = edited.applied
    assert report["cleared_tool_uses"] == 3 and report["cleared_input_tokens"] > 0
    # Inputs stay unless asked; the last kept use is untouched.
    calls = [c for m in edited.messages for c in m.get("tool_calls") or []]
    assert all(c["function"]["arguments"] != CLEARED_INPUT for c in calls)
    # Not triggered: nothing changes.
    high = ClearToolUses(trigger=("input_tokens", 10**9), keep=1)
    assert apply_edits(messages, [high], count).messages == messages
    by_uses = ClearToolUses(trigger=("tool_uses", 4), keep=0)
    assert apply_edits(messages, [by_uses], count).applied == []
    by_uses = ClearToolUses(trigger=("tool_uses", 3), keep=0)
    assert apply_edits(messages, [by_uses], count).applied[0]["cleared_tool_uses"] == 4


def test_clear_tool_uses_exclusions_inputs_and_minimum():
    messages = conversation([(False, ["Read", "Write"]), (False, ["Read"]), (False, ["Bash"])])
    edit = ClearToolUses(
        trigger=("tool_uses", 0),
        keep=1,
        exclude_tools=frozenset({"Write"}),
        clear_inputs=frozenset({"Read"}),
    )
    edited = apply_edits(messages, [edit], count)
    by_id = {m["tool_call_id"]: m["content"] for m in edited.messages if m["role"] == "tool"}
    assert by_id == {
        "call_0": CLEARED_RESULT,
        "call_1": "result " * 20,  # excluded tool
        "call_2": CLEARED_RESULT,
        "call_3": "result " * 20,  # the one kept
    }
    args = {
        c["id"]: c["function"]["arguments"]
        for m in edited.messages
        for c in m.get("tool_calls") or []
    }
    assert args["call_0"] == args["call_2"] == CLEARED_INPUT  # Read inputs cleared
    assert args["call_1"] != CLEARED_INPUT and args["call_3"] != CLEARED_INPUT
    # Less than clear_at_least would go: the edit is not applied at all.
    greedy = ClearToolUses(trigger=("tool_uses", 0), keep=1, clear_at_least=10**6)
    assert apply_edits(messages, [greedy], count).messages == messages


def test_no_edits_counts_nothing():
    calls = []
    edited = apply_edits([{"role": "user", "content": "x"}], [], lambda m: calls.append(m) or 0)
    assert calls == [] and edited.applied == [] and edited.original_tokens is None


turns = st.lists(
    st.tuples(st.booleans(), st.lists(st.sampled_from(["Read", "Bash", "Write"]), max_size=3)),
    max_size=8,
)
edits = st.lists(
    st.one_of(
        st.builds(ClearThinking, keep=st.one_of(st.none(), st.integers(0, 5))),
        st.builds(
            ClearToolUses,
            trigger=st.tuples(st.sampled_from(["input_tokens", "tool_uses"]), st.integers(0, 3000)),
            keep=st.integers(0, 5),
            clear_at_least=st.integers(0, 500),
            exclude_tools=st.frozensets(st.sampled_from(["Read", "Bash", "Write"])),
            clear_inputs=st.one_of(st.booleans(), st.frozensets(st.sampled_from(["Read"]))),
        ),
    ),
    max_size=3,
)


@settings(max_examples=200, deadline=None)
@given(turns, edits)
def test_edits_keep_the_conversations_shape(turns, edits):
    """Whatever the edits: the same messages in the same order with the same roles, ids and
    tool names; the tokens reported cleared add up to the difference; nothing grows."""
    messages = conversation(turns)
    snapshot = json.dumps(messages)
    edited = apply_edits(messages, edits, count)
    assert json.dumps(messages) == snapshot  # the input is never modified
    assert [m["role"] for m in edited.messages] == [m["role"] for m in messages]
    for before, after in zip(messages, edited.messages, strict=True):
        assert before.get("tool_call_id") == after.get("tool_call_id")
        names = lambda m: [(c["id"], c["function"]["name"]) for c in m.get("tool_calls") or []]  # noqa: E731
        assert names(before) == names(after)
    if edits:
        cleared = sum(r["cleared_input_tokens"] for r in edited.applied)
        assert cleared == count(messages) - count(edited.messages) >= 0
    # Each strategy leaves at least the last `keep` of what it clears (the smallest keep of its
    # edits, when several are applied one after another).
    keeps = [e.keep for e in edits if isinstance(e, ClearThinking) and e.keep is not None]
    if keeps:
        kept = [m for m in edited.messages if m.get("reasoning_content")]
        assert len(kept) >= min(min(keeps), sum(1 for t in turns if t[0]))
    keeps = [e.keep for e in edits if isinstance(e, ClearToolUses)]
    if keeps and min(keeps):
        last = [m for m in messages if m["role"] == "tool"][-min(keeps) :]
        assert all(m in edited.messages for m in last)
