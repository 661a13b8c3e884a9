"""Split a model's raw output into reasoning (inside ``<think>…</think>``) and content.

``split_reasoning`` works on the whole output; ``ReasoningSplitter`` does the same on a stream
of chunks, where tags may be split anywhere, and gives the same result whatever the chunking.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, auto

REASONING = "reasoning"
CONTENT = "content"


def _check_tags(open_tag: str, close_tag: str) -> None:
    if not open_tag or not close_tag:
        raise ValueError("open_tag and close_tag must be non-empty")


def split_reasoning(
    text: str,
    in_reasoning: bool,
    strip_content_start: bool = False,
    open_tag: str = "<think>",
    close_tag: str = "</think>",
    end_markers: Sequence[str] = (),
) -> tuple[str, str]:
    """Non-streaming reference: (reasoning, content).

    ``in_reasoning`` means the prompt already opened the think block. Otherwise reasoning only
    happens when the output opens with ``open_tag`` (after optional whitespace). An
    ``end_markers`` string (a tool-call marker) inside reasoning ends it too, and stays in the
    content: models do start calls without closing their thoughts.
    """
    _check_tags(open_tag, close_tag)
    if not in_reasoning:
        head = text.lstrip()
        if not head.startswith(open_tag):
            return "", head if strip_content_start else text
        text = head[len(open_tag) :]
    found = _reasoning_end(text, close_tag, end_markers)
    if found is None:
        return text.strip(), ""
    end, skip = found
    return text[:end].strip(), text[end + skip :].lstrip()


def _reasoning_end(text: str, close_tag: str, end_markers: Sequence[str]) -> tuple[int, int] | None:
    """(index, length to drop) of what ends reasoning first: the close tag (dropped) or an end
    marker (kept, so the tool parser sees it)."""
    best: tuple[int, int] | None = None
    for tag, skip in ((close_tag, len(close_tag)), *((m, 0) for m in end_markers)):
        i = text.find(tag)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, skip)
    return best


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class _Phase(Enum):
    START = auto()  # not in reasoning yet; an opening tag may still come
    REASONING = auto()
    CONTENT = auto()


class _Pieces:
    """Ordered output pieces; skips empty text and merges neighbours of the same kind."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.items and self.items[-1][0] == kind:
            self.items[-1] = (kind, self.items[-1][1] + text)
        else:
            self.items.append((kind, text))


class ReasoningSplitter:
    """Streaming counterpart of ``split_reasoning``.

    ``push`` returns ordered ``("reasoning" | "content", piece)`` pairs with non-empty pieces.
    Held back are only a suffix that may still become a tag and whitespace whose fate (strip
    or keep) is not known yet.
    """

    def __init__(
        self,
        in_reasoning: bool,
        strip_content_start: bool = False,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
        end_markers: Sequence[str] = (),
    ) -> None:
        _check_tags(open_tag, close_tag)
        self._open_tag = open_tag
        self._close_tag = close_tag
        self._end_markers = tuple(m for m in end_markers if m)
        self._phase = _Phase.REASONING if in_reasoning else _Phase.START
        self._pending = ""
        self._reasoning_started = False  # leading whitespace of reasoning is dropped until then
        # Content is verbatim except at its very start after a close tag, or at the start of
        # the output when the prompt ended with a closed (empty) think block.
        self._strip_content = strip_content_start

    def push(self, text: str) -> list[tuple[str, str]]:
        """Take the next chunk; return the pieces that are settled now."""
        pieces = _Pieces()
        self._pending += text
        self._advance(pieces, final=False)
        return pieces.items

    def flush(self) -> list[tuple[str, str]]:
        """End of output: return what was held back (a partial tag is plain text)."""
        pieces = _Pieces()
        self._advance(pieces, final=True)
        return pieces.items

    def _advance(self, pieces: _Pieces, final: bool) -> None:
        # Each phase consumes what it can and either hands the rest on to the next phase or
        # keeps it pending and returns.
        while True:
            if self._phase is _Phase.START:
                if not self._start(final):
                    return
            elif self._phase is _Phase.REASONING:
                if not self._reasoning(pieces, final):
                    return
            else:
                self._content(pieces)
                return

    def _start(self, final: bool) -> bool:
        """Decide between reasoning and content; False while the output may still open a tag."""
        head = self._pending.lstrip()
        if head.startswith(self._open_tag):
            self._pending = head[len(self._open_tag) :]
            self._phase = _Phase.REASONING
            return True
        if not final and (not head or self._open_tag.startswith(head)):
            return False
        self._phase = _Phase.CONTENT
        return True

    def _reasoning(self, pieces: _Pieces, final: bool) -> bool:
        """Emit settled reasoning; True once the close tag was consumed."""
        pending = self._pending
        found = _reasoning_end(pending, self._close_tag, self._end_markers)
        if found is not None:
            end, skip = found
            self._emit_reasoning(pieces, pending[:end])
            self._pending = pending[end + skip :]
            self._phase = _Phase.CONTENT
            self._strip_content = True
            return True
        if final:
            self._emit_reasoning(pieces, pending)
            self._pending = ""
            return False
        held = max(_partial_tag_len(pending, t) for t in (self._close_tag, *self._end_markers))
        partial = len(pending) - held
        settled = pending[:partial]
        body = settled.rstrip()
        self._emit_reasoning(pieces, body)
        # Trailing whitespace waits: it is kept only if more reasoning follows. It stays in
        # the pending text (rather than aside) so a tag search still sees the raw stream.
        self._pending = pending[len(body) :]
        return False

    def _emit_reasoning(self, pieces: _Pieces, text: str) -> None:
        """Emit a reasoning span whose end is final: strip its trailing whitespace."""
        text = text.rstrip()
        if not self._reasoning_started:
            text = text.lstrip()
        if text:
            self._reasoning_started = True
            pieces.add(REASONING, text)

    def _content(self, pieces: _Pieces) -> None:
        text = self._pending
        self._pending = ""
        if self._strip_content:
            text = text.lstrip()
            if text:
                self._strip_content = False
        pieces.add(CONTENT, text)
