"""The interface every tool-call format implements."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from colibri.chat.tools import ParsedCall, ToolSet

# What a complete block yields: each call's raw text with the call read from it, or None where
# the text is not a valid call (it is then returned to the client as text).
Parsed = list[tuple[str, ParsedCall | None]]


class ToolFormat:
    name: str = ""
    # Markers that open a call block.
    starts: tuple[str, ...] = ()
    # Markers that close one (the first found after the start ends the block).
    ends: tuple[str, ...] = ()
    # Whitespace between content and a following call is part of the format, not content.
    trim_before: bool = True

    def block_end(self, block: str) -> int | None:
        """Index just past the end of the block that ``block`` starts with, or None if open."""
        best = None
        for end in self.ends:
            i = block.find(end, 1)
            if i >= 0 and (best is None or i + len(end) < best):
                best = i + len(end)
        return best

    def parse(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        """The calls of a complete block; None if the block is malformed as a whole."""
        raise NotImplementedError

    def recover(self, block: str, tools: ToolSet, salvage: bool) -> Parsed | None:
        """A block still open at the end of the output: its calls if unambiguous, else None."""
        return None


def strip_markers(block: str, start: Sequence[str], end: Sequence[str]) -> str | None:
    """The inside of a block with one of the start markers and one of the end markers."""
    for s in start:
        if block.startswith(s):
            block = block[len(s) :]
            break
    else:
        return None
    for e in end:
        if block.endswith(e):
            return block[: -len(e)]
    return None


def json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def scan(pattern: re.Pattern[str], text: str) -> list[re.Match[str]] | None:
    """Consecutive matches of ``pattern`` covering ``text`` with only whitespace between them
    and around them; None if anything else is there."""
    matches = []
    pos = 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return matches
        m = pattern.match(text, pos)
        if m is None:
            return None
        matches.append(m)
        pos = m.end()
