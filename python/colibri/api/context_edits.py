"""Anthropic context editing (``context_management.edits``), applied to the conversation before
it is rendered, as Anthropic's API applies it before the prompt reaches the model.

Two strategies are applied: ``clear_thinking_20251015`` (drop the reasoning of all but the last
N assistant turns that have any) and ``clear_tool_uses_20250919`` (once a trigger is crossed,
replace the results, and optionally the inputs, of all but the last N tool uses with a
placeholder). ``compact_20260112`` needs the model to write a summary and is refused by name.
The client keeps the full history; the edits change only what the model reads.

Edits work on the chat-shaped messages (OpenAI shape: assistant ``tool_calls`` and
``reasoning_content``, ``tool`` messages) that the Anthropic request was translated to; an
Anthropic assistant message is one chat assistant message, so "assistant turn" means the same
in both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from colibri.api.validate import Body, bad

CLEAR_THINKING = "clear_thinking_20251015"
CLEAR_TOOL_USES = "clear_tool_uses_20250919"
COMPACT = "compact_20260112"
# What the model reads in place of a cleared tool result (and of cleared tool inputs).
CLEARED_RESULT = "[tool result cleared to save context]"
CLEARED_INPUT = "{}"
# Anthropic's documented defaults for clear_tool_uses.
DEFAULT_TRIGGER_TOKENS = 100_000
DEFAULT_KEEP_TOOL_USES = 3


@dataclass(frozen=True)
class ClearThinking:
    keep: int | None  # thinking turns kept, counted from the end; None: all


@dataclass(frozen=True)
class ClearToolUses:
    trigger: tuple[str, int] = ("input_tokens", DEFAULT_TRIGGER_TOKENS)
    keep: int = DEFAULT_KEEP_TOOL_USES
    clear_at_least: int = 0
    exclude_tools: frozenset[str] = frozenset()
    clear_inputs: bool | frozenset[str] = False  # every tool's inputs, or these tools' inputs


Edit = ClearThinking | ClearToolUses


@dataclass
class EditedConversation:
    messages: list[dict[str, Any]]
    applied: list[dict[str, Any]] = field(default_factory=list)
    original_tokens: int | None = None  # prompt tokens before the edits, when counted


def _typed(raw: Any, kinds: tuple[str, ...], where: str) -> tuple[str, int | None]:
    """A ``{"type": KIND, "value": N}`` object (``value`` absent only for the kind "all")."""
    if not isinstance(raw, dict):
        raise bad(f"'{where}' must be an object with 'type' and 'value'", "context_management")
    obj = Body(raw, where=f"'{where}'")
    kind = obj.string("type", required=True) or ""
    if kind not in kinds:
        raise bad(
            f"'{where}.type' must be {' or '.join(kinds)}, got '{kind}'", "context_management"
        )
    value = obj.integer("value", minimum=0)
    if value is None and kind != "all":
        raise bad(
            f"'{where}.value' is required", "context_management", "missing_required_parameter"
        )
    obj.finish()
    return kind, value


def _names(raw: Any, where: str) -> frozenset[str]:
    if not isinstance(raw, list) or not all(isinstance(n, str) for n in raw):
        raise bad(f"'{where}' must be an array of tool names", "context_management")
    return frozenset(raw)


def _clear_thinking(edit: Body, where: str) -> ClearThinking:
    raw = edit.raw("keep")
    edit.finish()
    if raw is None:
        return ClearThinking(keep=1)  # Anthropic's default: the last thinking turn
    if raw == "all":
        return ClearThinking(keep=None)
    _, value = _typed(raw, ("thinking_turns", "all"), f"{where}.keep")
    return ClearThinking(keep=value)


def _clear_tool_uses(edit: Body, where: str) -> ClearToolUses:
    def typed(key: str, kinds: tuple[str, ...]) -> tuple[str, int] | None:
        raw = edit.raw(key)
        if raw is None:
            return None
        kind, value = _typed(raw, kinds, f"{where}.{key}")
        assert value is not None
        return kind, value

    trigger = typed("trigger", ("input_tokens", "tool_uses"))
    keep = typed("keep", ("tool_uses",))
    at_least = typed("clear_at_least", ("input_tokens",))
    exclude = edit.raw("exclude_tools")
    inputs_raw = edit.raw("clear_tool_inputs")
    edit.finish()
    inputs: bool | frozenset[str] = False
    if isinstance(inputs_raw, bool):
        inputs = inputs_raw
    elif inputs_raw is not None:
        inputs = _names(inputs_raw, f"{where}.clear_tool_inputs")
    defaults = ClearToolUses()
    return ClearToolUses(
        trigger=trigger or defaults.trigger,
        keep=keep[1] if keep else defaults.keep,
        clear_at_least=at_least[1] if at_least else 0,
        exclude_tools=(
            _names(exclude, f"{where}.exclude_tools") if exclude is not None else frozenset()
        ),
        clear_inputs=inputs,
    )


def parse_context_management(raw: Any) -> list[Edit]:
    """The edits of a ``context_management`` object, validated; unknown strategies refused."""
    body = Body(raw, where="'context_management'")
    edits_raw = body.array("edits")
    body.finish()
    edits: list[Edit] = []
    for i, item in enumerate(edits_raw or []):
        where = f"context_management.edits[{i}]"
        edit = Body(item, where=f"'{where}'")
        kind = edit.string("type", required=True)
        if kind == CLEAR_THINKING:
            edits.append(_clear_thinking(edit, where))
        elif kind == CLEAR_TOOL_USES:
            edits.append(_clear_tool_uses(edit, where))
        elif kind == COMPACT:
            raise bad(
                f"'{where}': the context edit '{COMPACT}' (server-side compaction) needs the "
                f"model to summarise the conversation, which colibri does not do; use "
                f"'{CLEAR_TOOL_USES}' / '{CLEAR_THINKING}', or compact on the client",
                "context_management",
                "unsupported_parameter",
            )
        else:
            raise bad(
                f"'{where}.type' is '{kind}': colibri applies the context edits "
                f"'{CLEAR_THINKING}' and '{CLEAR_TOOL_USES}'",
                "context_management",
                "unsupported_parameter",
            )
    return edits


def _thinking_turns(messages: list[dict[str, Any]]) -> list[int]:
    return [
        i for i, m in enumerate(messages) if m["role"] == "assistant" and m.get("reasoning_content")
    ]


def _apply_clear_thinking(
    messages: list[dict[str, Any]], edit: ClearThinking
) -> tuple[list[dict[str, Any]], int]:
    turns = _thinking_turns(messages)
    if edit.keep is None or len(turns) <= edit.keep:
        return messages, 0
    cleared = turns[: len(turns) - edit.keep]
    out = list(messages)
    for i in cleared:
        message = dict(out[i])
        del message["reasoning_content"]
        out[i] = message
    return out, len(cleared)


def _tool_uses(messages: list[dict[str, Any]]) -> list[tuple[int, int, str, str]]:
    """Every tool use in order: (assistant message index, call index, call id, tool name)."""
    uses = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            for j, call in enumerate(m.get("tool_calls") or []):
                uses.append((i, j, call["id"], call["function"]["name"]))
    return uses


def _clear_uses(
    messages: list[dict[str, Any]], edit: ClearToolUses
) -> tuple[list[dict[str, Any]], int]:
    """The conversation with every clearable use but the last ``keep`` cleared, and how many."""
    uses = [u for u in _tool_uses(messages) if u[3] not in edit.exclude_tools]
    doomed = uses[: max(0, len(uses) - edit.keep)]
    if not doomed:
        return messages, 0
    out = [dict(m) for m in messages]
    ids = {call_id for _, _, call_id, _ in doomed}
    for i, j, _, name in doomed:
        if edit.clear_inputs is True or (
            isinstance(edit.clear_inputs, frozenset) and name in edit.clear_inputs
        ):
            calls = [dict(c) for c in out[i]["tool_calls"]]
            calls[j] = {
                **calls[j],
                "function": {**calls[j]["function"], "arguments": CLEARED_INPUT},
            }
            out[i]["tool_calls"] = calls
    for m in out:
        if m["role"] == "tool" and m.get("tool_call_id") in ids:
            m["content"] = CLEARED_RESULT
    return out, len(doomed)


def _triggered(edit: ClearToolUses, tokens: int, messages: list[dict[str, Any]]) -> bool:
    kind, value = edit.trigger
    if kind == "input_tokens":
        return tokens > value
    return len(_tool_uses(messages)) > value


def apply_edits(
    messages: list[dict[str, Any]], edits: list[Edit], count: Callable[[list[dict[str, Any]]], int]
) -> EditedConversation:
    """Applies ``edits`` in order; ``count`` gives a conversation's prompt tokens (rendered with
    the served template), so cleared tokens are exact."""
    if not edits:
        return EditedConversation(messages)
    tokens = count(messages)
    result = EditedConversation(messages, original_tokens=tokens)
    for edit in edits:
        if isinstance(edit, ClearThinking):
            edited, turns = _apply_clear_thinking(result.messages, edit)
            if not turns:
                continue
            after = count(edited)
            report = {"type": CLEAR_THINKING, "cleared_thinking_turns": turns}
        else:
            if not _triggered(edit, tokens, result.messages):
                continue
            edited, uses = _clear_uses(result.messages, edit)
            if not uses:
                continue
            after = count(edited)
            if tokens - after < edit.clear_at_least:
                continue  # Anthropic: edit only when at least this many tokens go
            report = {"type": CLEAR_TOOL_USES, "cleared_tool_uses": uses}
        report["cleared_input_tokens"] = max(0, tokens - after)
        result.messages, tokens = edited, after
        result.applied.append(report)
    return result
