"""Streaming tool-call parsing over a family's format (chat/toolformats/).

Content is emitted as soon as it cannot be the start of a call; a call is emitted only once its
block is complete and valid, so a streamed reply and a whole one always agree exactly (a
half-streamed call can never turn out to be text). Calls to tools that were not declared, and
malformed blocks, come back as text: nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from colibri.chat.toolformats import ToolFormat
from colibri.chat.tools import ParsedCall, ToolCall, ToolSet, finish_call

Event = tuple[str, "str | ToolCall"]  # ("content", text) | ("tool_call", ToolCall)


def _partial_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for size in range(min(len(text), len(marker) - 1), best, -1):
            if marker.startswith(text[-size:]):
                best = size
                break
    return best


@dataclass
class _State:
    buf: str = ""
    in_block: bool = False
    # Whitespace right after a call belongs to the format, not to the content.
    after_call: bool = False
    # Whitespace trimmed before the open block: given back if the block turns out to be text.
    gap: str = ""


class ToolCallParser:
    def __init__(
        self,
        fmt: ToolFormat,
        tools: ToolSet,
        salvage: bool = False,
        max_calls: int | None = None,
    ) -> None:
        self._fmt = fmt
        self._tools = tools
        self._salvage = salvage
        self._max_calls = max_calls
        self._state = _State()
        self.calls: list[ToolCall] = []

    @property
    def done(self) -> bool:
        """The call limit (``parallel_tool_calls: false``) is reached: generation can end."""
        return self._max_calls is not None and len(self.calls) >= self._max_calls

    def push(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._state.buf += text
        self._advance(out, final=False)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        self._advance(out, final=True)
        return out

    def _content(self, out: list[Event], text: str) -> None:
        s = self._state
        if s.after_call:
            text = text.lstrip()
        if text:
            s.after_call = False
            if out and out[-1][0] == "content":
                out[-1] = ("content", str(out[-1][1]) + text)
            else:
                out.append(("content", text))

    def _advance(self, out: list[Event], final: bool) -> None:
        s, fmt = self._state, self._fmt
        while s.buf:
            if not s.in_block:
                found = [(i, m) for m in fmt.starts if (i := s.buf.find(m)) >= 0]
                if found:
                    start = min(found)[0]
                    before = s.buf[:start]
                    kept = before.rstrip() if fmt.trim_before else before
                    self._content(out, kept)
                    s.gap = before[len(kept) :]
                    s.buf, s.in_block = s.buf[start:], True
                    continue
                if final:
                    self._content(out, s.buf)
                    s.buf = ""
                    return
                settled = len(s.buf) - _partial_len(s.buf, fmt.starts)
                if fmt.trim_before:
                    # Trailing whitespace waits: dropped if a call follows, kept otherwise.
                    settled = len(s.buf[:settled].rstrip())
                self._content(out, s.buf[:settled])
                s.buf = s.buf[settled:]
                return
            end = fmt.block_end(s.buf)
            if end is None:
                if final:
                    parsed = fmt.recover(s.buf, self._tools, self._salvage)
                    self._emit(out, s.buf, parsed)
                    s.buf, s.in_block = "", False
                return
            block, s.buf = s.buf[:end], s.buf[end:]
            s.in_block = False
            self._emit(out, block, fmt.parse(block, self._tools, self._salvage))

    def _usable(self, call: ParsedCall | None) -> bool:
        return call is not None and self._tools.get(call.name) is not None

    def _emit(self, out: list[Event], block: str, parsed: list | None) -> None:
        """Calls of a finished block; a block with no usable call is returned whole as text."""
        s = self._state
        if parsed is None or not any(self._usable(call) for _, call in parsed) or self.done:
            self._content(out, s.gap + block)
            s.gap = ""
            return
        for raw, call in parsed:
            if self.done:
                # parallel_tool_calls: false — the client takes one call; more calls written in
                # the same block are dropped rather than leaked into content as markup.
                break
            if self._usable(call):
                tool_call = finish_call(call)
                self.calls.append(tool_call)
                out.append(("tool_call", tool_call))
                s.after_call, s.gap = True, ""
            else:
                self._content(out, s.gap + raw)
                s.gap = ""
        s.gap = ""
