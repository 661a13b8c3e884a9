"""Kimi-style checkpoints for the tests: a fixture's weights with the tokenizer published as
tiktoken files (tests/fixtures/tiktoken/, made by scripts/make_tiktoken_fixture.py), and
tiktoken itself on the same files, the reference colibri's conversion is held to."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

TIKTOKEN = Path(__file__).parent / "fixtures" / "tiktoken"
FILES = ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py")


def split_pattern(module: Path) -> str:
    """The ``pat_str`` of a tokenizer module (the fixture's stand-in: safe to import)."""
    spec = importlib.util.spec_from_file_location("kimi_tokenizer_fixture", module)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.TikTokenTokenizer.pat_str


def tiktoken_dir(dst: Path, ranks: int | None = None) -> Path:
    """The fixture's tokenizer files in ``dst``: with ``ranks``, the table cut to its first
    ``ranks`` tokens (a valid table: every token is made of lower ranks) and the special tokens
    numbered from there."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy(TIKTOKEN / name, dst / name)
    if ranks is not None:
        lines = (TIKTOKEN / "tiktoken.model").read_text().splitlines()
        (dst / "tiktoken.model").write_text("\n".join(lines[:ranks]) + "\n")
        cfg = json.loads((TIKTOKEN / "tokenizer_config.json").read_text())
        base = len(lines)
        cfg["added_tokens_decoder"] = {
            str(int(i) - base + ranks): tok for i, tok in cfg["added_tokens_decoder"].items()
        }
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def kimi_checkpoint(weights: Path, dst: Path, ranks: int) -> Path:
    """A copy of the checkpoint ``weights`` whose tokenizer is the fixture's tiktoken files
    (``ranks`` tokens, then the special tokens) instead of a tokenizer.json."""
    shutil.copytree(weights, dst, ignore=shutil.ignore_patterns("tokenizer*.json"))
    return tiktoken_dir(dst, ranks)


def reference(tokenizer_dir: Path, vocab: int) -> tiktoken.Encoding:
    """tiktoken over the directory's files, with the special tokens Kimi's module gives it: the
    ids from the last rank on, named by added_tokens_decoder or reserved (up to ``vocab``)."""
    ranks = load_tiktoken_bpe(str(tokenizer_dir / "tiktoken.model"))
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    named = {int(i): t["content"] for i, t in cfg["added_tokens_decoder"].items()}
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(len(ranks), vocab)}
    return tiktoken.Encoding(
        name="kimi-fixture",
        pat_str=split_pattern(tokenizer_dir / "tokenization_kimi.py"),
        mergeable_ranks=ranks,
        special_tokens=specials,
    )
