"""Incremental detokenization: text appears as soon as it is final, never half a character."""

from __future__ import annotations

from collections.abc import Callable


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of text pieces.

    Decoding token by token is wrong for byte-level tokenizers (a character may span tokens) and
    for SentencePiece ones (a piece's leading space depends on its left neighbour), so each step
    decodes a short window that starts a few tokens back and emits only what the new token added.
    Text ending in U+FFFD (an incomplete UTF-8 sequence) is held until the sequence completes.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # tokens before this index have been emitted

    def push(self, token: int) -> str:
        self._ids.append(token)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held (an incomplete character decodes as U+FFFD: never lost)."""
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return after[len(before) :]
