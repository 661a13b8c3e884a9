"""Speed of two conversions of one checkpoint, paired (issue 33).

`--compare mixed` (the default): the default conversion (attention v and o at 8 bits) against
all-int4 (`--pure`). `--compare scales`: all-int4 with colibri's error-minimising scales against
all-int4 rounded as llama.cpp's Q4_0 (`--q4-0-rounding`), item 1's before and after (the same
bytes and kernels: the ratio should be 1 within the noise). `--compare grid`: all-int4 on the
table grid (`--grid table`: a lookup per code in the kernels) against the linear grid.

Both conversions of the speed benchmark's random OLMoE-1B-7B shape (by default cut to 4 layers;
the cache and setup steps are bench_vs_llamacpp.py's; the extra conversions bench_quality.py's)
loaded in one process, each round giving both the same fresh random prompt in alternating
order: prefill tok/s (prompt to the first token) and decode tok/s (the tokens after it). Prints
per-round ratios and their medians; writes benchmarks/results/mixed-precision-latest.md
(`scales`: scales-speed-latest.md). Run: `just bench` (never in tests).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_quality  # noqa: E402  (the default conversion)
from vs_llamacpp import prepare  # noqa: E402

from colibri import Engine  # noqa: E402

# --compare -> (baseline label, its conversion flags or None for the speed benchmark's own
# `--pure` model, candidate label, its flags, title, results file)
COMPARISONS = {
    "mixed": (
        "int4 --pure",
        None,
        "default",
        [],
        "Default (v/o 8-bit) vs all-int4",
        "mixed-precision-latest.md",
    ),
    "grid": (
        "linear grid",
        None,
        "table grid",
        ["--pure", "--grid", "table"],
        "The table grid vs the linear grid, both all-int4",
        "grid-speed-latest.md",
    ),
    "scales": (
        "Q4_0 rounding",
        ["--pure", "--q4-0-rounding"],
        "searched scales",
        None,
        "Error-minimising scales vs Q4_0 rounding, both all-int4",
        "scales-speed-latest.md",
    ),
}


def one_turn(engine: Engine, prompt: list[int], gen: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of one generation."""
    stream = engine.generate(prompt, max_tokens=gen + 1)
    t0 = time.perf_counter()
    next(stream)
    t1 = time.perf_counter()
    n = sum(1 for _ in stream)
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), n / (t2 - t1)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--compare", choices=sorted(COMPARISONS), default="mixed")
    ap.add_argument("--out", type=Path, help="default: benchmarks/results/<the comparison's>")
    a = ap.parse_args(argv)
    base, base_flags, cand, cand_flags, title, results = COMPARISONS[a.compare]
    out_path = a.out or HERE / "results" / results
    cache = a.cache or Path(
        os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
    )
    p = prepare.Paths(cache.expanduser().resolve(), a.layers)
    prepare.setup_model(p, 0, p.layers)
    exe = prepare.find_colibri(None)
    if exe is None:
        raise SystemExit("no colibri executable (run `just setup`)")
    prepare.setup_colibri_model(p, exe, False)

    def model(flags: list[str] | None) -> Path:
        if flags is None:
            return p.colibri_model
        return bench_quality.variant(
            p, exe, "-".join(f.strip("-") for f in flags) or "default", flags
        )

    models = {base: model(base_flags), cand: model(cand_flags)}
    engines = {name: Engine(path, threads=a.threads) for name, path in models.items()}
    vocab = engines[base].info["vocab_size"]
    rng = random.Random(0)
    for e in engines.values():  # one untimed turn each: caches, pages, pools warm
        one_turn(e, [rng.randrange(vocab) for _ in range(16)], 4)
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for r in range(a.rounds):
        prompt = [rng.randrange(vocab) for _ in range(a.prompt_tokens)]
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for name in order:
            rows[name].append(one_turn(engines[name], prompt, a.gen_tokens))
        print(
            f"round {r}: "
            + ", ".join(
                f"{n} prefill {rows[n][-1][0]:.1f} decode {rows[n][-1][1]:.2f}" for n in engines
            ),
            flush=True,
        )
    pre = [c[0] / b[0] for c, b in zip(rows[cand], rows[base], strict=True)]
    dec = [c[1] / b[1] for c, b in zip(rows[cand], rows[base], strict=True)]
    med = {n: [statistics.median(x[k] for x in rows[n]) for k in (0, 1)] for n in engines}
    out = "\n".join(
        [
            f"## {title}: random OLMoE-1B-7B shape, {a.layers} layers "
            f"(`bench_mixed_precision.py --compare {a.compare}`)",
            "",
            f"{a.rounds} rounds alternating, {a.threads} threads, prompt {a.prompt_tokens} "
            f"tokens, {a.gen_tokens} decoded; kernel {engines[base].info['kernel']}.",
            "",
            f"| | {base} | {cand} | {cand} / {base} (median of rounds) | range |",
            "|---|---|---|---|---|",
            f"| prefill tok/s | {med[base][0]:.1f} | {med[cand][0]:.1f} | "
            f"**{statistics.median(pre):.3f}** | {min(pre):.3f}-{max(pre):.3f} |",
            f"| decode tok/s | {med[base][1]:.2f} | {med[cand][1]:.2f} | "
            f"**{statistics.median(dec):.3f}** | {min(dec):.3f}-{max(dec):.3f} |",
            "",
        ]
    )
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(out)
    print(out)


if __name__ == "__main__":
    main()
