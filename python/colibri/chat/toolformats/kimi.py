"""Kimi K2 calls: a section of calls whose ids (``functions.NAME:IDX``) the model writes itself.

``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{JSON}<|tool_call_end|>…<|tool_calls_section_end|>``, whitespace tolerated between markers. The id
is returned verbatim: the model reads it back in the tool result.
"""

from __future__ import annotations

import re

from colibri.chat.toolformats.base import Parsed, ToolFormat, json_object, scan, strip_markers
from colibri.chat.tools import ParsedCall, ToolSet, dumps

_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^\s<]+)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>",
    re.S,
)
_ID = re.compile(r"(?:functions\.)?([^\s:]+):\d+")


class KimiK2(ToolFormat):
    name = "kimi_k2"
    # Both spellings occur in the wild.
    starts = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    ends = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    # Content before the section is kept verbatim, trailing space included.
    trim_before = False

    def parse(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        inner = strip_markers(block, self.starts, self.ends)
        calls = scan(_CALL, inner) if inner is not None else None
        if not calls:
            return None
        out: Parsed = []
        for m in calls:
            ident = _ID.fullmatch(m.group(1))
            args = json_object(m.group(2).strip())
            call = None
            if ident is not None and args is not None:
                call = ParsedCall(ident.group(1), args, id=m.group(1), fragments=(dumps(args),))
            out.append((m.group(0), call))
        return out


KIMI_K2 = KimiK2()
