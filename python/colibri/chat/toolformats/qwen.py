"""Qwen3 calls: hermes JSON, and the Qwen3-Coder XML style, in ``<tool_call>`` blocks.

Hermes: ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``.
Coder: ``<tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n</function>\\n``
``</tool_call>``.
"""

from __future__ import annotations

import re

from colibri.chat.toolformats.base import Parsed, ToolFormat, json_object, scan, strip_markers
from colibri.chat.tools import ParsedCall, ToolSet, dumps

_START, _END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^\s<>]+)>(.*)</function>\s*$", re.S)
_PARAM = re.compile(r"<parameter=([^\s<>]+)>(.*?)</parameter>", re.S)


def _hermes(inner: str) -> ParsedCall | None:
    obj = json_object(inner.strip())
    if obj is None or not isinstance(obj.get("name"), str) or set(obj) - {"name", "arguments"}:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], args, fragments=(dumps(args),))


def _unframe(value: str) -> str:
    """A Coder parameter value without the newline that frames it on each side."""
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _coder(inner: str, tools: ToolSet) -> ParsedCall | None:
    m = _FUNCTION.match(inner)
    if m is None:
        return None
    name = m.group(1)
    params = scan(_PARAM, m.group(2))
    if params is None:
        return None
    arguments = {
        p.group(1): tools.typed_value(name, p.group(1), _unframe(p.group(2))) for p in params
    }
    return ParsedCall(name, arguments)


class Qwen3(ToolFormat):
    name = "qwen3"
    starts = (_START,)
    ends = (_END,)

    def parse(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        inner = strip_markers(block, self.starts, self.ends)
        if inner is None:
            return None
        head = inner.lstrip()
        call = _coder(inner, tools) if head.startswith("<function=") else _hermes(inner)
        return [(block, call)]

    def recover(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        """A hermes call running to the end of output is kept if its JSON is complete."""
        call = _hermes(block[len(_START) :])
        return [(block, call)] if call is not None else None


QWEN3_CALLS = Qwen3()
