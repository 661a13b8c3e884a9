"""Kimi-style checkpoints for the tests: a fixture's weights with the tokenizer published as
tiktoken files (tests/fixtures/tiktoken/, made by scripts/make_tiktoken_fixture.py), and
tiktoken itself on the same files, the reference colibri's conversion is held to."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from .conftest import read_safetensors, write_safetensors

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


def kimi_k25_checkpoint(weights: Path, dst: Path, ranks: int) -> Path:
    """``kimi_checkpoint`` in the form Kimi K2.5 and later are published in: the text model of
    a ``KimiK25ForConditionalGeneration`` (its config as ``text_config``, its tensors under
    ``language_model.``) beside a vision tower and a projector (two small made-up tensors)."""
    kimi_checkpoint(weights, dst, ranks)
    text = json.loads((dst / "config.json").read_text())
    del text["architectures"]
    text["model_type"] = "kimi_k2"
    wrapper = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "media_placeholder_token_id": ranks + 21,
        "tie_word_embeddings": False,
        "vision_config": {"patch_size": 14, "mm_hidden_size": 8},
        "text_config": text,
    }
    (dst / "config.json").write_text(json.dumps(wrapper, indent=2))
    for path in sorted(dst.glob("*.safetensors")):
        header, data = read_safetensors(path)
        renamed = {
            k if k == "__metadata__" else f"language_model.{k}": v for k, v in header.items()
        }
        for name, shape in (
            ("vision_tower.patch_embed.proj.weight", [8, 6]),
            ("mm_projector.proj.0.weight", [8, 8]),
        ):
            size = 4 * shape[0] * shape[1]
            renamed[name] = {
                "dtype": "F32",
                "shape": shape,
                "data_offsets": [len(data), len(data) + size],
            }
            data += struct.pack(f"<{size // 4}f", *([0.125] * (size // 4)))
        write_safetensors(path, renamed, data)
    return dst
