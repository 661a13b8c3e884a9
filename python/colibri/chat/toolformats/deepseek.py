"""DeepSeek calls: V3.1 tool-call tokens and V3.2 "DSML" markup. Always strict.

V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>``
(repeated) then ``<｜tool▁calls▁end｜>``.
V3.2: ``<｜DSML｜function_calls>`` holding ``<｜DSML｜invoke name="N">`` elements with
``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` children; string="true"
values are raw text, string="false" values JSON. V4: the same inside ``<｜DSML｜tool_calls>``.
Either family's parser reads both block names (a model trained on one may write the other's);
the grammar of a forced call writes the family's own. The bars are U+FF5C; an ASCII ``|DSML|``
look-alike, which the models sometimes write, is read the same so it never leaks into content.
"""

from __future__ import annotations

import json
import re

from colibri.chat.toolformats.base import Parsed, ToolFormat, json_object, scan, strip_markers
from colibri.chat.tools import ParsedCall, ToolSet, dumps

_CALLS_BEGIN, _CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.S)


class DeepSeekV31(ToolFormat):
    name = "deepseek_v31"
    starts = (_CALLS_BEGIN,)
    ends = (_CALLS_END,)

    def parse(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        inner = strip_markers(block, self.starts, self.ends)
        calls = scan(_CALL, inner) if inner is not None else None
        if not calls:
            return None
        out: Parsed = []
        for m in calls:
            name, args = m.group(1).strip(), json_object(m.group(2).strip())
            call = None
            if name and args is not None:
                call = ParsedCall(name, args, fragments=(dumps(args),))
            out.append((m.group(0), call))
        return out


_BAR = "｜"
_DSML = f"{_BAR}DSML{_BAR}"
# The block names: V3.2's, then V4's. Both families read both; the forced-call grammar
# (chat/grammar.py, by format name) writes the family's own.
_BLOCKS = ("function_calls", "tool_calls")
_OPENS = tuple(f"<{_DSML}{b}>" for b in _BLOCKS)
_CLOSES = tuple(f"</{_DSML}{b}>" for b in _BLOCKS)
_INVOKE = re.compile(rf'<{_DSML}invoke name="([^"]+)">(.*?)</{_DSML}invoke>', re.S)
_PARAM = re.compile(
    rf'<{_DSML}parameter name="([^"]+)" string="(true|false)">(.*?)</{_DSML}parameter>', re.S
)


def _fullwidth(text: str) -> str:
    """ASCII look-alike markers in their real form; only tag openings are rewritten, so a
    parameter value that mentions |DSML| keeps its text."""
    return text.replace("<|DSML|", f"<{_DSML}").replace("</|DSML|", f"</{_DSML}")


class Dsml(ToolFormat):
    starts = _OPENS + tuple(m.replace(_BAR, "|") for m in _OPENS)
    ends = _CLOSES + tuple(m.replace(_BAR, "|") for m in _CLOSES)

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        inner = strip_markers(_fullwidth(block), _OPENS, _CLOSES)
        invokes = scan(_INVOKE, inner) if inner is not None else None
        if not invokes:
            return None
        out: Parsed = []
        for inv in invokes:
            out.append((inv.group(0), self._invoke(inv)))
        return out

    @staticmethod
    def _invoke(inv: re.Match[str]) -> ParsedCall | None:
        params = scan(_PARAM, inv.group(2))
        if params is None:
            return None
        arguments = {}
        for p in params:
            key, is_string, raw = p.group(1), p.group(2) == "true", p.group(3)
            if is_string:
                arguments[key] = raw
                continue
            try:
                arguments[key] = json.loads(raw)
            except ValueError:
                return None
        return ParsedCall(inv.group(1), arguments)


DEEPSEEK_V31 = DeepSeekV31()
DSML = Dsml("dsml")
DSML_V4 = Dsml("dsml_v4")
