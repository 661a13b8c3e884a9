"""GLM-4.5/4.6 (newline style) and GLM-4.7 (inline style) calls.

``<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``; 4.7 has no
newlines; a call without arguments is ``<tool_call>NAME</tool_call>``.
"""

from __future__ import annotations

import re

from colibri.chat.toolformats.base import Parsed, ToolFormat, scan, strip_markers
from colibri.chat.tools import ParsedCall, ToolSet

_START, _END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"\s*([^\s<>]+)")
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GlmXml(ToolFormat):
    name = "glm"
    starts = (_START,)
    ends = (_END,)

    def parse(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        inner = strip_markers(block, self.starts, self.ends)
        if inner is None:
            return None
        call = self._call(inner, tools)
        return [(block, call)]

    def _call(self, inner: str, tools: ToolSet) -> ParsedCall | None:
        m = _NAME.match(inner)
        if m is None:
            return None
        name = m.group(1)
        pairs = scan(_PAIR, inner[m.end() :])
        if pairs is None:
            return None
        arguments = {}
        for pair in pairs:
            key = pair.group(1).strip()
            if not key:
                return None
            arguments[key] = tools.typed_value(name, key, pair.group(2))
        return ParsedCall(name, arguments)

    def recover(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        """Only with COLI_TOOL_SALVAGE: close an unclosed trailing call (and its last value)."""
        if not salvage:
            return None
        fixed = block.rstrip()
        # A closing tag cut off mid-way ("</arg_v") is dropped before the tags are completed.
        for tag in ("</arg_value>", "</tool_call>"):
            for size in range(len(tag) - 1, 0, -1):
                if fixed.endswith(tag[:size]):
                    fixed = fixed[:-size]
                    break
        if fixed.count("<arg_value>") > fixed.count("</arg_value>"):
            fixed += "</arg_value>"
        parsed = self.parse(fixed + _END, tools, salvage)
        if parsed is None or parsed[0][1] is None:
            return None
        return [(block, parsed[0][1])]


GLM_XML = GlmXml()
