"""The output side of one generation: token ids -> text -> stops -> reasoning/content pieces."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from colibri.chat.detok import IncrementalDetokenizer
from colibri.chat.reasoning import ReasoningSplitter
from colibri.chat.stops import StopFilter

Piece = tuple[str, str]  # ("content" | "reasoning", text)


@dataclass(frozen=True)
class ReasoningState:
    """Where the output starts relative to a think block, and the family's tags."""

    in_reasoning: bool
    after_reasoning: bool
    open_tag: str = "<think>"
    close_tag: str = "</think>"


class OutputPipeline:
    """Feeds generated token ids through the detokenizer, the stop filter and (for reasoning
    families) the reasoning splitter, in that order; yields ordered pieces."""

    def __init__(
        self,
        decode: Callable[[list[int]], str],
        stops: Sequence[str] = (),
        ignore_leading_stop: bool = False,
        reasoning: ReasoningState | None = None,
    ) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self._stops = StopFilter(stops, ignore_leading=ignore_leading_stop)
        self._split = (
            ReasoningSplitter(
                reasoning.in_reasoning,
                strip_content_start=reasoning.after_reasoning,
                open_tag=reasoning.open_tag,
                close_tag=reasoning.close_tag,
            )
            if reasoning is not None
            else None
        )

    @property
    def stopped(self) -> bool:
        """A stop string matched: the caller ends generation."""
        return self._stops.stopped

    def push_token(self, token: int) -> list[Piece]:
        return self._route(self._stops.push(self._detok.push(token)))

    def finish(self) -> list[Piece]:
        """End of output: everything still held back, in order."""
        pieces = self._route(self._stops.push(self._detok.flush()))
        pieces += self._route(self._stops.flush())
        if self._split is not None:
            pieces += self._split.flush()
        return pieces

    def _route(self, text: str) -> list[Piece]:
        if not text:
            return []
        if self._split is None:
            return [("content", text)]
        return self._split.push(text)
