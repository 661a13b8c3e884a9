#!/usr/bin/env python3
"""A llama.cpp-quantized GGUF's weights, dequantized, as a Hugging Face checkpoint.

To measure llama.cpp's quantization formats on exactly colibri's tokens (issue 33): when
llama.cpp cannot tokenize a model's text as its own tokenizer does (the demo model's
pre-tokenizer regex is none of those llama.cpp knows), `llama-perplexity` would score other
tokens. Instead every tensor of the quantized GGUF is dequantized with llama.cpp's own gguf-py
and written under its checkpoint name, so `colibri convert --quant f32` and `colibri eval-ppl`
score llama.cpp's weights on the same tokens, chunks and positions as colibri's own int4. What
this leaves out is llama.cpp's 8-bit quantization of the activations (colibri's int4 rows
include theirs), which can only flatter llama.cpp's rows.

Names are matched by value, not by a table: each tensor of the f32 GGUF that llama.cpp's
converter made from `HF_DIR` equals one checkpoint tensor (stacked experts: one slice per
expert), bit for bit. Run with a Python that has numpy and safetensors, and llama.cpp's gguf-py
on the path (the benchmark venv):

    python gguf_to_hf.py LLAMA_CPP_DIR QUANT.gguf F32.gguf HF_DIR OUT_DIR

Prints the quantized file's bits per weight over its weight matrices as JSON on the last line.
"""

from __future__ import annotations

import json
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np


def main() -> int:
    if len(sys.argv) != 6:
        print(__doc__, file=sys.stderr)
        return 2
    llama, quant, f32, hf, out = map(Path, sys.argv[1:])
    sys.path.insert(0, str(llama / "gguf-py"))
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import load_file, save_file

    ref = {}
    for f in sorted(hf.glob("*.safetensors")):
        ref.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    by_bytes: dict[bytes, list[str]] = defaultdict(list)
    for k in sorted(ref):
        by_bytes[ref[k].tobytes()].append(k)

    # gguf name (and expert index, or -1) -> checkpoint name, from the f32 file's values.
    names: dict[tuple[str, int], str] = {}
    taken: dict[bytes, int] = defaultdict(int)
    for t in GGUFReader(str(f32)).tensors:
        arr = np.asarray(t.data, dtype=np.float32)
        slices = [(e, arr[e]) for e in range(arr.shape[0])] if arr.ndim == 3 else [(-1, arr)]
        for e, a in slices:
            key = a.tobytes()
            if taken[key] >= len(by_bytes.get(key, [])):
                raise SystemExit(f"gguf_to_hf: {t.name}[{e}] equals no checkpoint tensor")
            # Tensors with equal values pair up in name order (unquantized norms of ones, say).
            names[(t.name, e)] = by_bytes[key][taken[key]]
            taken[key] += 1
    if len(names) != len(ref):
        raise SystemExit(f"gguf_to_hf: {len(ref) - len(names)} checkpoint tensors not in the GGUF")

    tensors, bits, weights = {}, 0, 0
    for t in GGUFReader(str(quant)).tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32)
        if arr.ndim >= 2:
            bits += 8 * int(t.n_bytes)
            weights += int(t.n_elements)
        slices = [(e, arr[e]) for e in range(arr.shape[0])] if arr.ndim == 3 else [(-1, arr)]
        for e, a in slices:
            name = names[(t.name, e)]
            tensors[name] = np.ascontiguousarray(a.reshape(ref[name].shape))
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in hf.iterdir():
        if f.suffix != ".safetensors" and f.is_file() and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    print(json.dumps({"bits_per_weight": bits / weights, "tensors": len(tensors)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
