#!/usr/bin/env python3
"""Run llama.cpp's convert_hf_to_gguf.py on the random benchmark checkpoint.

The converter identifies a BPE tokenizer's pre-tokenizer by hashing how it
tokenizes a probe string, and refuses tokenizers it does not know. The
benchmark model's tokenizer is a small byte-level BPE trained locally (see
make_random_moe.py), so its hash is unknown; it uses the GPT-2 pre-tokenizer
regex, so we tell the converter "gpt-2" for it. Nothing else is changed: the
vendored converter runs unmodified otherwise.

Usage (with a Python that has torch, numpy, transformers, ...):

    python convert_to_gguf.py LLAMA_CPP_DIR HF_DIR --outfile OUT.gguf --outtype bf16
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    llama_dir = Path(sys.argv[1]).resolve()
    sys.path.insert(0, str(llama_dir))
    sys.argv = [str(llama_dir / "convert_hf_to_gguf.py")] + sys.argv[2:]

    import convert_hf_to_gguf  # noqa: E402  (inserts the vendored gguf-py into sys.path)
    from conversion import base  # noqa: E402

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            base.logger.warning(
                "unrecognized pre-tokenizer hash: using 'gpt-2' (byte-level BPE, GPT-2 regex)"
            )
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    convert_hf_to_gguf.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
