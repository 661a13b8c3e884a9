"""Stop strings: cut generated text at the first stop string, in one piece or while streaming.

Text arrives in arbitrary chunks (detokenized tokens), so a stop string may be split across
chunks. ``StopFilter`` holds back only what could still turn into a stop string and gives the
same total result as ``apply_stops`` whatever the chunking.
"""

from __future__ import annotations

from collections.abc import Sequence


def _is_blank(text: str) -> bool:
    """Whether ``text`` is empty or whitespace only."""
    return not text or text.isspace()


def _check_stops(stops: Sequence[str]) -> tuple[str, ...]:
    if isinstance(stops, str):
        # A bare string would be taken as a list of one-character stops.
        raise TypeError("stops must be a sequence of strings, not a string")
    checked = tuple(stops)
    for stop in checked:
        if not isinstance(stop, str) or not stop:
            raise ValueError(f"stop strings must be non-empty strings, got {stop!r}")
    return checked


def _earliest_match(text: str, stops: Sequence[str]) -> tuple[int, int] | None:
    """(start, length) of the stop that starts first in ``text``; the longest one on a tie."""
    best: tuple[int, int] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        if best is None or start < best[0] or (start == best[0] and len(stop) > best[1]):
            best = (start, len(stop))
    return best


def apply_stops(text: str, stops: Sequence[str], ignore_leading: bool = False) -> tuple[str, bool]:
    """Non-streaming reference: (text kept, whether a stop matched).

    The kept text is everything before the earliest stop string. With ``ignore_leading``, a
    match preceded only by whitespace (since the start or the previous such match) is removed
    and the text goes on.
    """
    stops = _check_stops(stops)
    kept: list[str] = []
    rest = text
    while (match := _earliest_match(rest, stops)) is not None:
        start, length = match
        before = rest[:start]
        kept.append(before)
        # Once non-whitespace was kept, ``before`` can no longer be blank: the first test is
        # enough to tell a leading match from a real stop.
        if not (ignore_leading and _is_blank(before)):
            return "".join(kept), True
        rest = rest[start + length :]
    kept.append(rest)
    return "".join(kept), False


class StopFilter:
    """Streaming counterpart of ``apply_stops``.

    ``push`` returns the text that can no longer be part of a stop string; a suffix that is a
    proper prefix of some stop is held back until the next chunk (or ``flush``) settles it.
    """

    def __init__(self, stops: Sequence[str], ignore_leading: bool = False) -> None:
        self._stops = _check_stops(stops)
        self._prefixes = frozenset(s[:n] for s in self._stops for n in range(1, len(s)))
        self._longest_prefix = max((len(s) - 1 for s in self._stops), default=0)
        # True while every character emitted so far (outside discarded matches) is whitespace.
        self._leading = ignore_leading
        self._pending = ""
        self._stopped = False
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        """A stop string matched; the caller ends generation."""
        return self._stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the text (None until one did)."""
        return self._matched

    @property
    def pending(self) -> str:
        """Text received but not emitted yet (always shorter than the longest stop)."""
        return self._pending

    def push(self, text: str) -> str:
        """Take the next chunk; return the text that is safe to emit now ("" once stopped)."""
        if self._stopped:
            return ""
        if not self._stops:
            return text
        self._pending += text
        return self._drain(final=False)

    def flush(self) -> str:
        """End of generation: return the held-back text.

        The held text can still complete a match that was waiting on a longer or earlier
        candidate (stops ``"abcd"`` and ``"bc"`` on ``"abc"``), so ``stopped`` may turn true here.
        """
        if self._stopped:
            return ""
        return self._drain(final=True)

    def _drain(self, final: bool) -> str:
        """Emit what is settled in the pending text, resolving matches as they become certain."""
        out: list[str] = []
        pending = self._pending
        while True:
            # Nothing at or after ``hold`` may be emitted: it could begin a stop string.
            hold = len(pending) if final else self._partial_start(pending)
            match = _earliest_match(pending, self._stops)
            if match is not None:
                start, length = match
                discard = self._leading and _is_blank(pending[:start])
                # A match is certain when no candidate starting earlier is still open. One
                # starting at the same place only matters when discarding, where a longer
                # stop (say "abc" over "ab") would remove more text.
                if start < hold or (start == hold and not discard):
                    out.append(pending[:start])
                    if discard:
                        pending = pending[start + length :]
                        continue
                    self._stopped = True
                    self._matched = pending[start : start + length]
                    pending = ""
                    break
            out.append(pending[:hold])
            pending = pending[hold:]
            break
        self._pending = pending
        emitted = "".join(out)
        if not _is_blank(emitted):
            self._leading = False
        return emitted

    def _partial_start(self, text: str) -> int:
        """Start of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        for size in range(min(len(text), self._longest_prefix), 0, -1):
            if text[-size:] in self._prefixes:
                return len(text) - size
        return len(text)
