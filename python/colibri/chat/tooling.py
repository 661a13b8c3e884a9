"""How a chat request's tools shape the prompt and the output parsing (OpenAI semantics)."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from colibri.chat.families import GLM, Family
from colibri.chat.request import ChatRequest
from colibri.chat.toolcalls import ToolCallParser
from colibri.chat.tools import Tool, ToolSet
from colibri.errors import ApiError


@dataclass(frozen=True)
class ToolPlan:
    messages: list[dict[str, Any]]
    prompt_tools: list[dict[str, Any]] | None
    end_markers: tuple[str, ...]
    parser_factory: Callable[[], ToolCallParser] | None


def _instruction(req: ChatRequest) -> str | None:
    """The hint for ``required`` and named choices; for formats with a tool grammar
    (chat/grammar.py) the call is also forced on the token stream."""
    if req.tool_choice == "required":
        return "You must call at least one of the available tools in your reply."
    if req.tool_choice == "function":
        return f"You must call the tool `{req.tool_choice_name}` in your reply."
    return None


def _with_system_note(messages: list[dict[str, Any]], note: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=(messages[0]["content"] + "\n\n" + note).lstrip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def _history_for(family: Family, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant tool calls as the family's template expects their arguments."""
    if family.arguments_as_mapping:
        return messages
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {
                    **c,
                    "function": {**c["function"], "arguments": _dumps(c["function"]["arguments"])},
                }
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def salvage_enabled() -> bool:
    return os.environ.get("COLI_TOOL_SALVAGE", "0") == "1"


def plan_tools(req: ChatRequest, family: Family) -> ToolPlan:
    if (req.tools_active or req.has_tool_history) and family.tool_format is None:
        raise ApiError(
            400,
            f"The served model (family '{family.name}') has no tool calling: remove 'tools', "
            "'tool_choice' and tool messages (or send tool_choice 'none')",
            code="tools_not_supported",
            param="tools",
        )
    messages = _history_for(family, req.messages)
    if not req.tools_active or family.tool_format is None:
        return ToolPlan(messages, None, (), None)
    declared = [
        t
        for t in req.tools
        if req.tool_choice != "function" or t["function"]["name"] == req.tool_choice_name
    ]
    note = _instruction(req)
    if note is not None:
        messages = _with_system_note(messages, note)
    toolset = ToolSet(Tool(t["function"]["name"], t["function"]["parameters"]) for t in declared)
    factory = functools.partial(
        ToolCallParser,
        family.tool_format,
        toolset,
        salvage=family is GLM and salvage_enabled(),
        max_calls=None if req.parallel_tool_calls else 1,
    )
    # A deferred tool is listed only when the request names it (the model must see its schema).
    listed = [
        t
        for t in declared
        if t["function"]["name"] not in req.deferred_tools or req.tool_choice == "function"
    ]
    return ToolPlan(messages, listed, family.tool_format.starts, factory)
