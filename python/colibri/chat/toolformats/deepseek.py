"""DeepSeek calls: V3.1 tool-call tokens and V3.2 "DSML" markup. Always strict.

V3.1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>``
(repeated) then ``<｜tool▁calls▁end｜>``.
V3.2: ``<｜DSML｜function_calls>`` holding ``<｜DSML｜invoke name="N">`` elements with
``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` children; string="true"
values are raw text, string="false" values JSON. The bars are U+FF5C; an ASCII ``|DSML|``
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
_DSML_START = f"<{_BAR}DSML{_BAR}function_calls>"
_DSML_END = f"</{_BAR}DSML{_BAR}function_calls>"
_INVOKE = re.compile(
    rf'<{_BAR}DSML{_BAR}invoke name="([^"]+)">(.*?)</{_BAR}DSML{_BAR}invoke>', re.S
)
_PARAM = re.compile(
    rf'<{_BAR}DSML{_BAR}parameter name="([^"]+)" string="(true|false)">(.*?)'
    rf"</{_BAR}DSML{_BAR}parameter>",
    re.S,
)


def _fullwidth(text: str) -> str:
    """ASCII look-alike markers in their real form; only tag openings are rewritten, so a
    parameter value that mentions |DSML| keeps its text."""
    return text.replace("<|DSML|", f"<{_BAR}DSML{_BAR}").replace("</|DSML|", f"</{_BAR}DSML{_BAR}")


class Dsml(ToolFormat):
    name = "dsml"
    starts = (_DSML_START, _DSML_START.replace(_BAR, "|"))
    ends = (_DSML_END, _DSML_END.replace(_BAR, "|"))

    def parse(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        inner = strip_markers(_fullwidth(block), (_DSML_START,), (_DSML_END,))
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
DSML = Dsml()
