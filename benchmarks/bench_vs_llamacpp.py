#!/usr/bin/env python3
"""colibri vs llama.cpp speed benchmark on a random OLMoE-1B-7B-shaped model (or, with
``--arch deepseek_v3``, a DeepSeek-V3-shaped one: MLA, llama.cpp's DeepSeek2 path).

One run does everything, idempotently (each step is skipped when its output is
already in the cache, ~/.cache/colibri-bench by default):

  setup   1. a Python venv (cache/venv) from benchmarks/requirements-bench.txt
          2. llama.cpp, from the tree vendored in the llama-cpp-python sdist on
             PyPI, built with GGML_NATIVE (llama-bench, llama-quantize)
          3. benchmarks/bandwidth.c compiled with -O3 -march=native
          4. the random bf16 HF checkpoint (make_random_moe.py, seeded)
          5. GGUF: convert_hf_to_gguf.py --outtype bf16, then
             llama-quantize --pure ... Q4_0
          6. colibri convert HF_DIR OUT_DIR --quant int4   (if colibri is found)
  measure N rounds; each round measures the machine's read bandwidth, then
          llama.cpp and colibri one after the other, the order swapping every
          round (A/B, B/A, ...), so that slow drift of a noisy machine hits
          both engines alike; then both again decoding after --depth tokens
          of context (default 1024; llama-bench -d), where reading the KV
          history starts to matter as much as the weights
  report  medians with min/max per metric, colibri/llama.cpp ratios, the
          decode ceiling (bandwidth / bytes read per decoded token) and each
          engine's fraction of it; printed and written as markdown (--out)

Only the Python standard library is needed to run this file; it uses python3,
cmake, a C/C++ compiler and network access to PyPI for the setup.

    python3 benchmarks/bench_vs_llamacpp.py                # full run
    python3 benchmarks/bench_vs_llamacpp.py --setup-only   # warm the cache
    python3 benchmarks/bench_vs_llamacpp.py --rounds 9 --out docs/bench.md

This file is the command line and the alternating rounds; the steps are the modules of
benchmarks/vs_llamacpp/ (its __init__ lists them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# vs_llamacpp/ is found also when this file is loaded by its path (tests/test_bench_probe.py).
sys.path.insert(0, str(HERE))

from vs_llamacpp.common import log  # noqa: E402
from vs_llamacpp.long import run_long  # noqa: E402
from vs_llamacpp.machine import (  # noqa: E402
    Quiet,
    cpu_cache_bytes,
    cpu_times,  # noqa: F401  (bench_experts.py uses it from here, as does others_cpu)
    others_cpu,  # noqa: F401
    probe_size_mib,
    wait_for_idle,  # noqa: F401  (bench_experts.py uses it from here)
)
from vs_llamacpp.measure import (  # noqa: E402
    measure_bandwidth,
    measure_colibri,
    measure_llama,
    measure_llama_depth,
)
from vs_llamacpp.prepare import (  # noqa: E402
    ARCH_PREFIX,
    LONG_CONTEXT,
    MODEL_CONTEXT,
    Paths,
    colibri_runs,
    ensure_colibri_model,  # noqa: F401  (bench_experts.py and bench_scoring.py use it)
    setup_all,
    setup_colibri_model,
)
from vs_llamacpp.report import (  # noqa: E402
    build_report,
    bytes_per_decoded_token,
    kv_bytes_per_token,
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="colibri vs llama.cpp speed benchmark (see module docstring)"
    )
    ap.add_argument("--rounds", type=int, help="alternating A/B rounds (default 5, with --long 2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument(
        "--depth",
        type=int,
        default=1024,
        help="also measure decode after this many tokens of context (llama-bench -d; "
        "colibri: a prompt that long); 0 = skip (default 1024)",
    )
    ap.add_argument(
        "--reps",
        type=int,
        help="repetitions per engine per round, median taken (llama-bench -r, colibri --repeat; "
        "default 3, with --long 1)",
    )
    ap.add_argument(
        "--bw-size-mib",
        type=int,
        default=0,
        help="bandwidth probe buffer in MiB (default 0: 8x the CPU caches, at least 1024)",
    )
    ap.add_argument("--bw-passes", type=int, default=10, help="bandwidth probe passes per round")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=180,
        help="before each round, wait up to this many seconds for other processes to go "
        "quiet (default 180; 0 = never wait)",
    )
    ap.add_argument(
        "--max-others",
        type=float,
        default=0.25,
        help="re-measure an engine when other processes took more than this fraction of "
        "the CPUs during its run (default 0.25)",
    )
    ap.add_argument("--retries", type=int, default=2, help="re-measurements per engine per round")
    ap.add_argument(
        "--max-wait-total",
        type=float,
        default=1200,
        help="total seconds the whole run may spend waiting for quiet and re-measuring "
        "(default 1200); after that it measures straight through and flags noisy rounds",
    )
    ap.add_argument(
        "--idle-threshold",
        type=float,
        default=0.15,
        help="'quiet' = other processes use at most this fraction of all CPUs (default 0.15)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="markdown output path (default benchmarks/results/latest.md, with --long "
        "long-latest.md)",
    )
    ap.add_argument("--json-out", type=Path, help="also write raw per-round results as JSON")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(
            os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
        ),
    )
    ap.add_argument(
        "--colibri", help="colibri executable (default: REPO/.venv/bin/colibri, then PATH)"
    )
    ap.add_argument(
        "--skip-colibri", action="store_true", help="measure llama.cpp and bandwidth only"
    )
    ap.add_argument(
        "--reconvert-colibri", action="store_true", help="redo colibri convert even if cached"
    )
    ap.add_argument("--setup-only", action="store_true", help="prepare everything, measure nothing")
    ap.add_argument(
        "--keep-bf16-gguf", action="store_true", help="keep the 14 GB bf16 GGUF after quantizing"
    )
    ap.add_argument(
        "--long",
        action="store_true",
        help="the long-prompt mode instead: prefill at each of --lengths, decode after "
        "--long-depth, time to first token through the server (vs_llamacpp/long.py)",
    )
    ap.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[512, 2048, 8192, 16384, 32768],
        help="--long: prompt lengths, comma-separated (default 512,2048,8192,16384,32768)",
    )
    ap.add_argument(
        "--long-depth",
        type=int,
        default=16384,
        help="--long: decode after a prompt this long, and the server's time to first token "
        "for it (default 16384; 0 = skip both)",
    )
    ap.add_argument(
        "--ttft-reps",
        type=int,
        default=2,
        help="--long: time-to-first-token samples per side per round, the order alternating "
        "(default 2; single runs here vary by ~10%%, twice the target's 5%%)",
    )
    ap.add_argument(
        "--context",
        type=int,
        help="the random model's max_position_embeddings, with its own cached files "
        f"(default {MODEL_CONTEXT}; with --long the largest of --lengths and 32768)",
    )
    ap.add_argument("--seed", type=int, default=0, help="random model seed")
    ap.add_argument(
        "--layers",
        type=int,
        default=16,
        help="model layers (16 = OLMoE-1B-7B; fewer for a smoke test)",
    )
    ap.add_argument(
        "--arch",
        choices=sorted(ARCH_PREFIX),
        default="olmoe",
        help="the random model's shape (make_random_moe.py --arch; default olmoe)",
    )
    a = ap.parse_args(argv)
    a.bw_size_mib = probe_size_mib(a.bw_size_mib, cpu_cache_bytes())

    if a.context is None:
        a.context = max(LONG_CONTEXT, *a.lengths) if a.long else MODEL_CONTEXT
    if a.long and max(a.lengths) > a.context:
        ap.error(f"--lengths up to {max(a.lengths)} need a --context of at least that")
    if a.rounds is None:
        a.rounds = 2 if a.long else 5
    if a.reps is None:
        a.reps = 1 if a.long else 3
    if a.out is None:
        name = "long-latest.md" if a.long else "latest.md"
        a.out = HERE / "results" / (name if a.arch == "olmoe" else f"{a.arch}-{name}")
    p = Paths(a.cache.expanduser().resolve(), a.layers, a.context, a.arch)
    exe, colibri_note, colibri_ver = setup_all(p, a)
    if a.setup_only:
        return 0
    if a.long:
        rounds, report = run_long(a, p, exe, colibri_note, colibri_ver)
        write_results(a, report, {"rounds": rounds})
        return 0

    cfg = json.loads((p.hf / "config.json").read_text())
    bpt = bytes_per_decoded_token(cfg)
    rounds: list[dict] = []
    log(
        f"[measure] {a.rounds} rounds, {a.threads} threads, "
        f"prompt {a.prompt_tokens}, gen {a.gen_tokens}"
    )
    retried_convert = False
    colibri_failures = 0
    colibri_errors: list[str] = []
    quiet = Quiet(a)
    settle, clean = quiet.settle, quiet.clean

    for i in range(a.rounds):
        engines = ["llama", "colibri"] if i % 2 == 0 else ["colibri", "llama"]
        if exe is None:
            engines = ["llama"]
        r: dict = {"order": " → ".join("llama.cpp" if e == "llama" else e for e in engines)}
        r["idle_before"] = settle()
        r["bw"] = clean(
            lambda: measure_bandwidth(p, a.threads, a.bw_size_mib, a.bw_passes), "bandwidth"
        )
        for eng in engines:
            if eng == "llama":
                r["llama"] = clean(lambda: measure_llama(p, a), "llama.cpp")
            else:
                try:
                    r["colibri"] = clean(lambda x=exe: measure_colibri(x, p, a), "colibri")
                    colibri_failures = 0
                except RuntimeError as e:
                    err = e
                    if not colibri_runs(exe):
                        # colibri itself is broken (e.g. being rebuilt): not the model's fault
                        log(f"[colibri] does not start; round {i + 1} without it:\n{e}")
                    elif not retried_convert and not a.reconvert_colibri:
                        # a cached conversion may predate a format change: reconvert once, retry
                        retried_convert = True
                        log(f"[colibri] bench failed; reconverting once and retrying:\n{e}")
                        try:
                            setup_colibri_model(p, exe, True)
                            r["colibri"] = clean(lambda x=exe: measure_colibri(x, p, a), "colibri")
                            colibri_failures = 0
                        except (RuntimeError, SystemExit) as e2:
                            err = e2
                    if "colibri" not in r:
                        colibri_failures += 1
                        colibri_errors.append(f"round {i + 1}: {str(err).strip()[-500:]}")
                        if colibri_failures >= 2:
                            log("[colibri] failed twice in a row; continuing with llama.cpp only")
                            exe = None
        if a.depth:
            for eng in engines:
                if eng == "llama":
                    r["llama_depth"] = clean(lambda: measure_llama_depth(p, a), "llama.cpp -d")
                elif exe is not None:
                    try:
                        r["colibri_depth"] = clean(
                            lambda x=exe: measure_colibri(x, p, a, a.depth), "colibri depth"
                        )
                    except RuntimeError as e:
                        colibri_errors.append(f"round {i + 1} at depth {a.depth}: {e}"[-500:])
        rounds.append(r)
        parts = [f"bw {r['bw']['gb_s']:.1f} GB/s"]
        for eng in ("llama", "colibri"):
            if r.get(eng):
                parts.append(
                    f"{eng} decode {r[eng]['decode_tok_s']:.2f} "
                    f"prefill {r[eng]['prefill_tok_s']:.1f} tok/s"
                )
        for eng in ("llama_depth", "colibri_depth"):
            if r.get(eng):
                parts.append(f"{eng} decode {r[eng]['decode_tok_s']:.2f}")
        busy = [r[k]["others_cpu"] for k in ("bw", "llama", "colibri") if r.get(k)]
        busy = [b for b in busy if b is not None]
        if busy:
            parts.append(f"other processes {max(busy):.0%} CPU")
        log(f"  round {i + 1}/{a.rounds} [{r['order']}]: " + "; ".join(parts))

    if colibri_errors:
        failed = "; ".join(colibri_errors)
        colibri_note = (
            colibri_note + " " if colibri_note else ""
        ) + f"`colibri bench` failed: {failed}"
    report = build_report(a, rounds, bpt, colibri_note, colibri_ver, kv_bytes_per_token(cfg))
    write_results(a, report, {"rounds": rounds, "bytes_per_token": bpt})
    return 0


def write_results(a: argparse.Namespace, report: str, raw: dict) -> None:
    """Print the markdown report and write it to --out (and the raw results to --json-out)."""
    print()
    print(report)
    out = a.out if a.out.is_absolute() else Path.cwd() / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    log(f"wrote {out}")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps(raw, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
