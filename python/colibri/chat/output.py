"""The output side of one generation: token ids -> text -> stops -> reasoning/content pieces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from colibri.chat.detok import IncrementalDetokenizer
from colibri.chat.reasoning import ReasoningSplitter
from colibri.chat.stops import StopFilter
from colibri.chat.toolcalls import ToolCallParser
from colibri.chat.tools import ToolCall

# ("content" | "reasoning", text) or ("tool_call", ToolCall), in output order.
Piece = tuple[str, "str | ToolCall"]


@dataclass(frozen=True)
class ReasoningState:
    """Where the output starts relative to a think block, and the family's tags."""

    in_reasoning: bool
    after_reasoning: bool
    open_tag: str = "<think>"
    close_tag: str = "</think>"
    # Tool-call markers: one seen inside reasoning ends it (the call is not lost in thoughts).
    end_markers: tuple[str, ...] = ()


class OutputPipeline:
    """Feeds generated token ids through the detokenizer, the stop filter, (for reasoning
    families) the reasoning splitter and (with tools) the tool-call parser, in that order;
    yields ordered pieces."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: Sequence[str] = (),
        ignore_leading_stop: bool = False,
        reasoning: ReasoningState | None = None,
        tool_parser: ToolCallParser | None = None,
    ) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self._stops = StopFilter(stops, ignore_leading=ignore_leading_stop)
        self._split = (
            ReasoningSplitter(
                reasoning.in_reasoning,
                strip_content_start=reasoning.after_reasoning,
                open_tag=reasoning.open_tag,
                close_tag=reasoning.close_tag,
                end_markers=reasoning.end_markers,
            )
            if reasoning is not None
            else None
        )

        self._tools = tool_parser

    @property
    def stopped(self) -> bool:
        """A stop string matched, or the tool-call limit was reached: generation ends."""
        return self._stops.stopped or (self._tools is not None and self._tools.done)

    @property
    def stop_sequence(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._stops.matched

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self._tools.calls if self._tools is not None else []

    def push_token(self, token: int) -> list[Piece]:
        return self._route(self._stops.push(self._detok.push(token)))

    def finish(self) -> list[Piece]:
        """End of output: everything still held back, in order."""
        pieces = self._route(self._stops.push(self._detok.flush()))
        pieces += self._route(self._stops.flush())
        if self._split is not None:
            pieces += self._parse_tools(self._split.flush())
        if self._tools is not None:
            pieces += self._tools.finish()
        return pieces

    def _route(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self._split is None:
            return self._parse_tools([("content", text)])
        return self._parse_tools(self._split.push(text))

    def _parse_tools(self, pieces: list[tuple[str, str]]) -> list[Piece]:
        if self._tools is None:
            return list(pieces)
        out: list[Piece] = []
        for kind, text in pieces:
            if kind == "content":
                out += self._tools.push(text)
            else:
                out.append((kind, text))
        return out
