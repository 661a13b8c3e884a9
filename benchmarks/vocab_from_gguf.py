#!/usr/bin/env python3
"""Write a Hugging Face ``tokenizer.json`` from one of llama.cpp's vocab-only GGUF files.

The grammar benchmark needs a real 50k-token byte-level BPE vocabulary (the cost of a token mask
grows with the vocabulary and depends on its tokens' shapes), and nothing may be downloaded. The
llama.cpp source package the speed benchmark already fetches carries vocab-only GGUFs of real
tokenizers under ``vendor/llama.cpp/models``; ``ggml-vocab-mpt.gguf`` is GPT-NeoX-20B's
tokenizer, the one OLMoE's is derived from. Tokens, ids and merges are taken as they are; the
padding entries past ``--max-id`` are dropped so the vocabulary fits the random model's embedding.

Run with the benchmark venv (numpy) and llama.cpp's vendored gguf-py on the path:

    PYTHONPATH=LLAMA_CPP/gguf-py python vocab_from_gguf.py GGUF OUT_DIR [--max-id 50276]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import gguf  # llama.cpp's gguf-py (from the vendored source tree)
from tokenizers import Tokenizer

NORMAL, CONTROL, USER_DEFINED = 1, 3, 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-id", type=int, default=50276, help="last token id kept")
    args = ap.parse_args()

    reader = gguf.GGUFReader(args.gguf)
    fields = reader.fields
    if fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise SystemExit(f"{args.gguf}: not a byte-level BPE vocabulary")
    tokens = fields["tokenizer.ggml.tokens"].contents()[: args.max_id + 1]
    types = fields["tokenizer.ggml.token_type"].contents()[: args.max_id + 1]
    merges = [m.split(" ", 1) for m in fields["tokenizer.ggml.merges"].contents()]

    # Normal and control tokens are the BPE model's vocabulary; user-defined ones (NeoX's runs of
    # spaces, kept decoded in GGUF) are added tokens at their own ids, as in the original file.
    vocab = {
        tok: i
        for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
        if kind != USER_DEFINED
    }
    added = [
        {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": kind == USER_DEFINED, "special": kind == CONTROL}
        for i, (tok, kind) in enumerate(zip(tokens, types, strict=True))
        if kind in (CONTROL, USER_DEFINED)
    ]  # fmt: skip
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    doc = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {"type": "BPE", "vocab": vocab, "merges": merges, "dropout": None,
                  "unk_token": None, "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False))
    specials = [a["content"] for a in added if a["special"]]
    check = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    text = 'Hello, world! {"color": "red", "n": 17}'
    assert check.decode(check.encode(text).ids) == text, "round trip"
    print(
        json.dumps({"vocab": check.get_vocab_size(), "specials": specials, "merges": len(merges)})
    )


if __name__ == "__main__":
    main()
