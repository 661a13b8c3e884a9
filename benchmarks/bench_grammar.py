"""Decode speed with a grammar (a JSON schema) against the same generation unconstrained, on the
demo model (or --model DIR): tok/s, and the mask's cost per token (time computing it, time a step
waited for it after its forward pass). Run by `just bench`, never by `just test`.

`--olmoe`: the speed benchmark's random OLMoE-1B-7B-shaped int4 model (made if missing) with a
real 50k-token vocabulary, GPT-NeoX-20B's (OLMoE's tokenizer is derived from it), read from the
vocab-only GGUF in the llama.cpp source package the benchmark fetches (`vocab_from_gguf.py`): the
mask's cost grows with the vocabulary, and the demo model's is 8k.

The mask is computed on another thread during the forward pass; COLI_GRAMMAR_OVERLAP=0 (read once
per process) computes it after the pass, so each setting runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

# Structure-heavy (keys, enums, bounded integers, separators): every token's mask is computed
# in a grammar state with many branches, not inside a long string.
SCHEMA = {
    "type": "array",
    "minItems": 12,
    "items": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "n": {"type": "integer", "minimum": 0, "maximum": 999},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "n", "ok"],
        "additionalProperties": False,
    },
}


def _run(model: str, tokens: int, repeats: int) -> dict[str, float]:
    """In this process: the best of `repeats` unconstrained and constrained generations."""
    from colibri.chat import grammar as g
    from colibri.runtime.engine import Engine, Grammar

    engine = Engine(model, threads=int(os.environ.get("BENCH_THREADS", "2")))
    glm = "[gMASK]" in engine.special_tokens  # the demo model's chat form; else plain text
    prompt = engine.tokenize(
        "[gMASK]<sop><|user|>\nHello<|assistant|>\n<think></think>" if glm else "Hello"
    )
    text = g.with_reasoning(
        g.json_body(SCHEMA), g.special_markers(engine.special_tokens), None, None, False, True
    )
    grammar = Grammar("lark", text, end_ids=tuple(engine.eos_token_ids))
    best: dict[str, float] = {}
    # Interleaved, so a change in the machine's load hits both alike; the best run of each.
    for _ in range(repeats):
        for name, gr in (("free", None), ("json", grammar)):
            # No stop tokens: the free run takes the whole budget; the constrained one ends where
            # the model closes the object (tok/s is per token either way).
            stream = engine.generate(prompt, tokens, 0.0, 1.0, [], None, None, gr)
            first = next(stream)
            t0 = time.perf_counter()
            count = 1 + sum(1 for _ in stream)
            dt = time.perf_counter() - t0
            stats = stream.mask_stats() or {}
            stream.close()
            rate = (count - 1) / dt
            if rate > best.get(f"{name}_tok_s", 0.0):
                best[f"{name}_tok_s"] = rate
                best[f"{name}_tokens"] = count
                if stats:
                    best["mask_compute_us"] = 1e6 * stats["compute_s"] / max(stats["masks"], 1)
                    best["mask_wait_us"] = 1e6 * stats["wait_s"] / max(stats["masks"], 1)
                    best["consume_us"] = 1e6 * stats["consume_s"] / max(stats["masks"], 1)
            del first
    return best


def olmoe_with_neox_vocab() -> Path:
    """The benchmark's 16-layer OLMoE-shaped int4 model beside GPT-NeoX's tokenizer: a directory of
    hard links to its weights (no copy) with the 50k-token tokenizer.json written in."""
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    import bench_vs_llamacpp as base
    from vs_llamacpp import prepare

    cache = Path(os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench"))
    p = base.Paths(cache, 16)
    src = base.ensure_colibri_model(p, None)
    prepare.setup_llama_src(p)
    out = src.with_name(src.name + "-neox-vocab")
    manifest = src / "manifest.json"
    if out.exists() and (out / "manifest.json").stat().st_ino == manifest.stat().st_ino:
        return out
    out.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "routing-heat.json") and f.is_file():
            (out / f.name).unlink(missing_ok=True)
            os.link(f, out / f.name)
    prepare.setup_venv(p)  # numpy and tokenizers for the GGUF reader
    subprocess.run(
        [str(p.py), str(here / "vocab_from_gguf.py"),
         str(p.llama_src / "models" / "ggml-vocab-mpt.gguf"), str(out)],
        env={**os.environ, "PYTHONPATH": str(p.llama_src / "gguf-py")}, check=True,
    )  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", help="model directory (default: the demo model)")
    ap.add_argument(
        "--olmoe", action="store_true", help="the OLMoE-shaped model with a 50k vocabulary"
    )
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model = args.model
    if args.olmoe and not args.child:
        model = str(olmoe_with_neox_vocab())
    if model is None:
        from colibri.demo.builtin import demo_model_dir

        found = demo_model_dir()
        if found is None:
            sys.exit("no demo model in the package: pass --model")
        model = str(found)
    if args.child:
        print(json.dumps(_run(model, args.tokens, args.repeats)))
        return
    rows = {}
    for overlap in ("1", "0"):
        out = subprocess.run(
            [sys.executable, str(Path(__file__)), "--child", "--model", model,
             "--tokens", str(args.tokens), "--repeats", str(args.repeats)],
            env={**os.environ, "COLI_GRAMMAR_OVERLAP": overlap},
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        rows[overlap] = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"model {model}, {args.tokens} tokens, best of {args.repeats}")
    print(
        "| mask | free tok/s | json tok/s (tokens) | ratio | mask compute us/token "
        "| wait us/token | consume us/token |"
    )
    print("|---|---|---|---|---|---|---|")
    for overlap, r in rows.items():
        print(
            f"| {'overlapped' if overlap == '1' else 'after the pass'} | {r['free_tok_s']:.0f} "
            f"| {r['json_tok_s']:.0f} ({r['json_tokens']:.0f}) "
            f"| {r['json_tok_s'] / r['free_tok_s']:.3f} "
            f"| {r.get('mask_compute_us', 0):.0f} | {r.get('mask_wait_us', 0):.0f} "
            f"| {r.get('consume_us', 0):.0f} |"
        )


if __name__ == "__main__":
    main()
