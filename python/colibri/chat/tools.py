"""Declared tools and parsed tool calls, independent of any family's text format."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict[str, Any] = field(default_factory=dict)

    def property_type(self, key: str) -> Any:
        props = self.parameters.get("properties")
        if isinstance(props, dict) and isinstance(props.get(key), dict):
            return props[key].get("type")
        return None


class ToolSet:
    """The tools a request declared (after ``tool_choice`` narrowed them)."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools = {t.name: t for t in tools}

    def __bool__(self) -> bool:
        return bool(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def typed_value(self, tool: str, key: str, raw: str) -> Any:
        """An argument's value from its text: a ``string`` property keeps the raw text
        unstripped; anything else is JSON if it parses, else the text."""
        declared = self._tools.get(tool)
        kind = declared.property_type(key) if declared else None
        # A union that allows a string (["string", "null"]) keeps the text too: parsing it
        # could turn the string "123" into a number the caller did not ask for.
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            return raw
        try:
            return json.loads(raw.strip())
        except ValueError:
            return raw


@dataclass(frozen=True)
class ParsedCall:
    """A call as read from the model's text, before it is checked against the declared tools."""

    name: str
    arguments: dict[str, Any]
    # The family's own id when the format carries one (Kimi: functions.NAME:IDX).
    id: str | None = None
    # Argument JSON split the way it is streamed: one fragment per argument when the format
    # names arguments one by one. "".join(fragments) is the arguments string exactly.
    fragments: tuple[str, ...] = ()


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object
    fragments: tuple[str, ...]

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def argument_fragments(arguments: dict[str, Any]) -> tuple[str, ...]:
    """The JSON of ``arguments`` split after each key/value pair."""
    if not arguments:
        return ("{}",)
    parts = []
    for i, (key, value) in enumerate(arguments.items()):
        parts.append(("{" if i == 0 else ", ") + dumps(key) + ": " + dumps(value))
    parts[-1] += "}"
    return tuple(parts)


def finish_call(parsed: ParsedCall) -> ToolCall:
    fragments = parsed.fragments or argument_fragments(parsed.arguments)
    arguments = "".join(fragments)
    return ToolCall(
        id=parsed.id or "call_" + secrets.token_hex(12),
        name=parsed.name,
        arguments=arguments,
        fragments=fragments,
    )
