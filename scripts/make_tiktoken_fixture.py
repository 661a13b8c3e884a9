"""Makes tests/fixtures/tiktoken/: a tokenizer published the way Moonshot's Kimi checkpoints
publish theirs (no tokenizer.json; `tiktoken.model`, the split pattern in the tokenizer's Python
module named by tokenizer_config.json's `auto_map`, special tokens numbered after the ranks).

    .venv/bin/python scripts/make_tiktoken_fixture.py [--ranks 2048]

The ranks are a byte-level BPE trained here on the repository's docs plus a few lines in other
scripts (so that merges of multi-byte characters exist), pre-split with a simple pattern: any
valid rank table serves, since the tests compare colibri's conversion of it with tiktoken on
the same table. `tokenization_kimi.py` is this project's stand-in for Kimi's module: it holds
only the assignment colibri reads, `pat_str`, with Kimi's split pattern as its tokenizer module
defines it. A prefix of the table is a valid table too (every token is made of lower ranks), so
tests cut it to fit a fixture model's vocabulary.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "tiktoken"

# Kimi's split pattern (its tokenizer module's `pat_str`), one alternative per line.
PATTERN_PARTS = [
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",  # noqa: E501
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
]

# Special tokens after the ranks, in Kimi's order of names (the rest are reserved names).
SPECIALS = [
    "[BOS]",
    "[EOS]",
    "<|im_end|>",
    "<|im_user|>",
    "<|im_assistant|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "[EOT]",
    "<|im_system|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
]

MULTILINGUAL = """
自然语言处理是人工智能的一个分支。模型在本地运行，专家从磁盘读取。
日本語の文章もここにあります。カタカナとひらがな、そして漢字。
Русский текст для проверки кириллицы: модель отвечает быстро.
Ελληνικά γράμματα, çà et là des accents, Straße und Größe, naïve café.
한국어 문장도 조금 있습니다. العربية أيضا. עברית גם.
emoji 😀🎉 and symbols ∑∫√ — “quotes” ‘single’ … « guillemets »
"""


def training_text() -> str:
    docs = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
    return "".join(p.read_text(encoding="utf-8") for p in docs) + MULTILINGUAL * 20


def train(text: str, n_ranks: int) -> list[bytes]:
    """Byte-level BPE: the 256 bytes (rank = byte), then the most frequent adjacent pair of
    each round merged (ties: the pair first seen), until `n_ranks` tokens."""
    words = collections.Counter(re.findall(r" ?\w+| ?[^\w\s]+|\s+", text))
    seqs = {w: [bytes([b]) for b in w.encode()] for w in words}
    pairs: collections.Counter[tuple[bytes, bytes]] = collections.Counter()
    where: dict[tuple[bytes, bytes], set[str]] = collections.defaultdict(set)
    for w, s in seqs.items():
        for p in zip(s, s[1:], strict=False):
            pairs[p] += words[w]
            where[p].add(w)
    ranks = [bytes([b]) for b in range(256)]
    known = set(ranks)
    while len(ranks) < n_ranks and pairs:
        (a, b), count = max(pairs.items(), key=lambda kv: kv[1])
        if count <= 0:
            break
        merged = a + b
        if merged not in known:
            ranks.append(merged)
            known.add(merged)
        for w in list(where[(a, b)]):
            s, n = seqs[w], words[w]
            for p in zip(s, s[1:], strict=False):
                pairs[p] -= n
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
            for p in zip(out, out[1:], strict=False):
                pairs[p] += n
                where[p].add(w)
        del pairs[(a, b)]
    return ranks


def module_source() -> str:
    parts = "\n".join(
        f'            r"""{p}""",' + ("  # noqa: E501" if len(p) > 70 else "")
        for p in PATTERN_PARTS
    )
    return (
        '"""colibri test fixture: a stand-in for the tokenizer module a Kimi checkpoint ships.\n\n'
        "colibri reads one thing from such a module without running it: the split pattern\n"
        "assigned to `pat_str` (here Kimi's). Made by scripts/make_tiktoken_fixture.py.\n"
        '"""\n\n\n'
        "class TikTokenTokenizer:\n"
        "    num_reserved_special_tokens = 256\n\n"
        '    pat_str = "|".join(\n'
        "        [\n"
        f"{parts}\n"
        "        ]\n"
        "    )\n"
    )


def tokenizer_config(n_ranks: int) -> dict:
    return {
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "bos_token": "[BOS]",
        "eos_token": "[EOS]",
        "added_tokens_decoder": {
            str(n_ranks + i): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for i, name in enumerate(SPECIALS)
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2048)
    a = ap.parse_args()
    ranks = train(training_text(), a.ranks)
    OUT.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(t).decode()} {r}" for r, t in enumerate(ranks)]
    (OUT / "tiktoken.model").write_text("\n".join(lines) + "\n")
    (OUT / "tokenization_kimi.py").write_text(module_source())
    (OUT / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(len(ranks)), indent=2) + "\n"
    )
    print(f"{OUT}: {len(ranks)} ranks, {len(SPECIALS)} named special tokens")


if __name__ == "__main__":
    main()
