"""Where Kimi's tokenizer cuts a long text before encoding it, reproduced.

The tokenizer module Kimi checkpoints ship (``tokenization_kimi.TikTokenTokenizer``) encodes
each text between special tokens (transformers hands it those segments) in windows of
400,000 characters, each window cut again wherever a run of whitespace or of non-whitespace
(``str.isspace``) grows past 25,000 characters, and encodes every piece on its own (a guard
against a tiktoken limit). A piece boundary splits what would have been one token, so a model
trained on that tokenizer saw such texts cut there; colibri cuts them in the same places.
"""

from __future__ import annotations

import re
from typing import Any

# Kimi's module's two constants.
WINDOW = 400_000
MAX_RUN = 25_000

# In str patterns, `\s` is exactly `str.isspace` (tested over every code point).
_RUN = re.compile(r"\s+|\S+")
_LONG_RUN = re.compile(rf"\s{{{MAX_RUN + 1}}}|\S{{{MAX_RUN + 1}}}")


def tokenizer_module(tokenizer_config: dict[str, Any]) -> str | None:
    """The module name ``auto_map.AutoTokenizer`` points at (``tokenization_kimi`` for
    ``"tokenization_kimi.TikTokenTokenizer"`` or ``"repo--tokenization_kimi.X"``), or None."""
    entry = (tokenizer_config.get("auto_map") or {}).get("AutoTokenizer")
    name = entry[0] if isinstance(entry, list) and entry else entry
    if not isinstance(name, str):
        return None
    module = name.rsplit("--", 1)[-1].rsplit(".", 1)[0]
    return module.rsplit(".", 1)[-1]


def cuts_long_texts(tokenizer_config: dict[str, Any]) -> bool:
    """Whether the checkpoint's tokenizer cuts long texts as this module describes."""
    return tokenizer_module(tokenizer_config) == "tokenization_kimi"


def needs_cuts(text: str) -> bool:
    """Whether :func:`pieces` would cut ``text`` (a segment with no special tokens)."""
    return len(text) > MAX_RUN and (len(text) > WINDOW or _LONG_RUN.search(text) is not None)


def pieces(text: str, window: int = WINDOW, max_run: int = MAX_RUN) -> list[str]:
    """``text`` cut as Kimi's module cuts it: windows of ``window`` characters, each cut at
    every ``max_run`` characters into a run (counted from the run's start in its window). The
    pieces join back to ``text``; an empty text has none."""
    out: list[str] = []
    for w in range(0, len(text), window):
        part = text[w : w + window]
        start = 0
        for run in _RUN.finditer(part):
            for cut in range(run.start() + max_run, run.end(), max_run):
                out.append(part[start:cut])
                start = cut
        out.append(part[start:])
    return out
