"""Special-token strings inside what users and tools wrote stay text.

A chat prompt is rendered to text and tokenized with the model's special tokens recognised, so
the template's own ``<|user|>`` becomes the turn marker the model was trained on. The same
string inside a user message, a system prompt or a tool result (a pasted chat template, a web
page a tool fetched) must not: it would open a turn the caller did not send. Before rendering,
:func:`shield` replaces every special-token string in those messages by a placeholder that no
message contains; after rendering, :func:`tokenize_shielded` tokenizes the template's text as
usual and each placeholder as the plain text of the string it stands for.

Assistant messages are left alone: they are the model's own output, and templates read markers
in them (``</think>`` splits a reasoning block off a replayed turn).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

# Roles whose text is never template markup.
SHIELDED_ROLES = frozenset({"system", "developer", "user", "tool"})
# Placeholders are built from private-use characters: `open` + index + `close`.
_PRIVATE_USE = range(0xE000, 0xF8FF)


@dataclass(frozen=True)
class Shielded:
    """Messages with placeholders, and what each placeholder stands for."""

    messages: list[dict[str, Any]]
    literals: list[str]
    open: str
    close: str

    def markers(self) -> re.Pattern[str]:
        """Matches a placeholder; group 1 is its index into ``literals``."""
        return re.compile(re.escape(self.open) + r"(\d+)" + re.escape(self.close))


def _texts(value: Any) -> Iterable[str]:
    """Every string in a message, nested ones (tool-call arguments) included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _texts(v)
    elif isinstance(value, list):
        for v in value:
            yield from _texts(v)


def _free_pair(messages: list[dict[str, Any]]) -> tuple[str, str]:
    """Two private-use characters that occur in no message (so placeholders are unambiguous)."""
    used = {c for text in _texts(messages) for c in text if ord(c) in _PRIVATE_USE}
    free = (chr(c) for c in _PRIVATE_USE if chr(c) not in used)
    return next(free), next(free)


@functools.lru_cache(maxsize=8)
def _pattern(specials: tuple[str, ...]) -> re.Pattern[str]:
    # Longest first, so a special that contains another is matched whole.
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def shield(messages: list[dict[str, Any]], specials: Collection[str]) -> Shielded:
    """Replaces the special-token strings in the content of system, user and tool messages."""
    specials = [s for s in specials if s]
    if not any(
        m.get("role") in SHIELDED_ROLES
        and isinstance(m.get("content"), str)
        and any(s in m["content"] for s in specials)
        for m in messages
    ):
        return Shielded(messages, [], "", "")
    open_, close = _free_pair(messages)
    pattern = _pattern(tuple(specials))
    literals: list[str] = []

    def replace(match: re.Match[str]) -> str:
        literals.append(match.group(0))
        return f"{open_}{len(literals) - 1}{close}"

    out = []
    for m in messages:
        if m.get("role") in SHIELDED_ROLES and isinstance(m.get("content"), str):
            m = {**m, "content": pattern.sub(replace, m["content"])}
        out.append(m)
    return Shielded(out, literals, open_, close)


def tokenize_shielded(
    text: str,
    shielded: Shielded,
    tokenize: Callable[[str], list[int]],
    tokenize_literal: Callable[[str], list[int]],
) -> list[int]:
    """Token ids of rendered ``text``: template text with special tokens recognised, each
    placeholder as the plain text it stands for. A placeholder the template dropped or altered
    leaves nothing behind (templates may trim or omit a message)."""
    if not shielded.literals:
        return tokenize(text)
    ids: list[int] = []
    pos = 0
    for m in shielded.markers().finditer(text):
        if m.start() > pos:
            ids += tokenize(text[pos : m.start()])
        ids += tokenize_literal(shielded.literals[int(m.group(1))])
        pos = m.end()
    if pos < len(text):
        ids += tokenize(text[pos:])
    return ids


def unshield(text: str, shielded: Shielded) -> str:
    """``text`` with each placeholder back as the string it stands for."""
    if not shielded.literals:
        return text
    return shielded.markers().sub(lambda m: shielded.literals[int(m.group(1))], text)
