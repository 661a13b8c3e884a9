#!/usr/bin/env python3
"""Tiered experts: decode speed under expert-cache budgets, against the disk-bound limit.

On the random OLMoE-1B-7B-shaped int4 model of `bench_vs_llamacpp.py` (same cache dir), in
alternating rounds (the machine is shared and drifts):

- the disk's random-record read bandwidth (O_DIRECT, one layer's 8 records in flight, through
  the store's own read path);
- decode and prefill tok/s with every expert resident (no cache: the default), and with expert
  caches of 100%, 50%, 25% and 6.25% of the experts, each cold (first turn, empty cache) and warm
  (second turn on what the cache kept); reads with O_DIRECT (no page cache), and for 25% also
  through the page cache (file cached by the OS: warm);
- prefetch (router look-ahead) on vs off at 25% and 6.25%;
- the ratio of achieved decode speed to the disk-bound limit
  1 / (bytes missed per decoded token / disk bandwidth + 1 / resident decode tok/s);
- hit rates of global vs per-layer LRU on routing traces (`expert_bench policy`).

It drives `cargo run --release --example expert_bench` (crates/engine/examples/expert_bench.rs),
which prints JSON. Decode steps are fed a fixed pseudo-random token stream (the random model's
greedy output repeats one token, which would route every step to the same experts); every
configuration must produce the same argmax tokens (checked: results never depend on placement).

    python3 benchmarks/bench_experts.py                  # 3 rounds, table to stdout + --out
    python3 benchmarks/bench_experts.py --rounds 1 --tokens 16 --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bench_vs_llamacpp as base  # noqa: E402  (setup steps and idle detection)

EXAMPLE = REPO / "target" / "release" / "examples" / "expert_bench"

# (name, expert_bench arguments); budgets are fractions of the experts file.
CONFIGS = [
    ("resident", []),
    ("cache 100%", ["--ram-frac", "1.0", "--direct"]),
    ("cache 50%", ["--ram-frac", "0.5", "--direct"]),
    ("cache 25%", ["--ram-frac", "0.25", "--direct"]),
    ("cache 25%, page cache", ["--ram-frac", "0.25"]),
    ("cache 25% + prefetch", ["--ram-frac", "0.25", "--direct", "--prefetch"]),
    ("cache 6.25%", ["--ram-frac", "0.0625", "--direct"]),
    ("cache 6.25% + prefetch", ["--ram-frac", "0.0625", "--direct", "--prefetch"]),
    # 3/4 of the budget pinned by the routing heat (routing-heat.json, saved by earlier runs).
    ("cache 6.25%, 3/4 pinned", ["--ram-frac", "0.0625", "--pin-frac", "0.75", "--direct"]),
]
QUICK = {
    "resident",
    "cache 100%",
    "cache 50%",
    "cache 25%",
    "cache 6.25%",
    "cache 6.25%, 3/4 pinned",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build() -> None:
    log("[setup] cargo build --release --example expert_bench")
    subprocess.run(
        ["cargo", "build", "--release", "-q", "-p", "colibri-engine", "--example", "expert_bench"],
        cwd=REPO,
        check=True,
    )


def bench(args: list[str], timeout: float = 1800) -> tuple[dict, float | None]:
    """Runs expert_bench; returns its JSON and the CPU share other processes took meanwhile."""
    c0 = base.cpu_times()
    t0 = time.monotonic()
    r = subprocess.run(
        [str(EXAMPLE), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if r.returncode != 0:
        raise SystemExit(f"expert_bench {' '.join(args)} failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    # expert_bench's own CPU: children's rusage since the last call.
    ru = os.times()
    own = ru.children_user + ru.children_system - bench.last_children
    bench.last_children = ru.children_user + ru.children_system
    _ = t0
    return res, base.others_cpu(c0, base.cpu_times(), own)


bench.last_children = 0.0


def med(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, d=1, unit=""):
    return "-" if x is None else f"{x:.{d}f}{unit}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--model", type=Path, default=None, help="a converted colibri int4 model dir")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decode steps per turn")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="only the main budgets, no prefetch")
    ap.add_argument("--wait-idle", type=float, default=120)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "experts-latest.md")
    a = ap.parse_args(argv)

    cache = a.cache or Path(
        os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
    )
    model = base.ensure_colibri_model(base.Paths(cache, 16), a.model)
    build()
    configs = [c for c in CONFIGS if not a.quick or c[0] in QUICK]
    common = ["--threads", a.threads, "--tokens", a.tokens, "--prompt", a.prompt, "--rounds", 2]
    common = [str(x) for x in common]

    log(f"[policy] global vs per-layer LRU on routing traces ({model})")
    policy, _ = bench(["policy", str(model), "--tokens", "256"])

    rows: dict[str, list[dict]] = {name: [] for name, _ in configs}
    disk: list[float] = []
    busy: list[float] = []
    tokens: dict[str, list[int]] = {}
    for rnd in range(a.rounds):
        base.wait_for_idle(a.wait_idle, 0.15)
        d, b = bench(["disk", str(model), "--reads", "256", "--depth", "8"])
        disk.append(d["gb_s"])
        log(f"[round {rnd + 1}] disk {d['gb_s']:.2f} GB/s ({d['io']}, O_DIRECT {d['direct_io']})")
        order = configs if rnd % 2 == 0 else configs[::-1]
        for name, extra in order:
            res, b = bench(["run", str(model), *common, *extra])
            if b is not None:
                busy.append(b)
            res["others_cpu"] = b
            res["disk_gb_s"] = d["gb_s"]
            rows[name].append(res)
            tokens[name] = res["tokens"]
            cold, warm = res["rounds"][0], res["rounds"][-1]
            log(
                f"  {name:24s} cold decode {cold['decode_tok_s']:6.2f}  warm decode "
                f"{warm['decode_tok_s']:6.2f} tok/s  hit {warm['decode_hit_rate']:.3f}  "
                f"miss {warm['decode_bytes_per_token'] / 1e6:6.1f} MB/tok  "
                f"others {fmt(b and b * 100, 0, '%')}"
            )

    same = len({json.dumps(t) for t in tokens.values()}) == 1
    # Resident compute per token: the resident decode of the same round.
    res_tok = [r["rounds"][-1]["decode_tok_s"] for r in rows["resident"]]

    def limit(r: dict, rnd: int, which: int) -> float:
        x = r["rounds"][which]
        return 1.0 / (x["decode_bytes_per_token"] / (r["disk_gb_s"] * 1e9) + 1.0 / res_tok[rnd])

    lines = []
    lines.append(
        f"Median over {a.rounds} alternating rounds; {a.prompt}-token prompt, {a.tokens} decode "
        f"steps per turn, {a.threads} threads; O_DIRECT reads unless noted. Cold = first turn "
        "(empty cache), warm = second turn. Limit = 1 / (bytes missed per decoded token / disk "
        "bandwidth + 1 / resident decode tok/s), per round."
    )
    lines.append("")
    lines.append(
        "| configuration | prefill tok/s (cold) | decode tok/s cold | decode tok/s warm | "
        "warm hit rate | MB read / decoded token (warm) | I/O wait, % of warm decode | "
        "limit tok/s (warm) | achieved / limit (cold) | achieved / limit (warm) |"
    )
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for name, _ in configs:
        rs = rows[name]
        if not rs:
            continue
        cold = [r["rounds"][0] for r in rs]
        warm = [r["rounds"][-1] for r in rs]
        lim_w = [limit(r, i, -1) for i, r in enumerate(rs)]
        ratio_c = [r["rounds"][0]["decode_tok_s"] / limit(r, i, 0) for i, r in enumerate(rs)]
        ratio_w = [r["rounds"][-1]["decode_tok_s"] / limit(r, i, -1) for i, r in enumerate(rs)]
        io_share = [w["decode_io_wait_s"] / w["decode_s"] * 100 for w in warm]
        lines.append(
            f"| {name} | {fmt(med([c['prefill_tok_s'] for c in cold]))} "
            f"| {fmt(med([c['decode_tok_s'] for c in cold]), 2)} "
            f"| {fmt(med([w['decode_tok_s'] for w in warm]), 2)} "
            f"| {fmt(med([w['decode_hit_rate'] for w in warm]), 3)} "
            f"| {fmt(med([w['decode_bytes_per_token'] / 1e6 for w in warm]), 1)} "
            f"| {fmt(med(io_share), 0, '%')} "
            f"| {fmt(med(lim_w), 2)} "
            f"| {fmt(med(ratio_c) and med(ratio_c) * 100, 0, '%')} "
            f"| {fmt(med(ratio_w) and med(ratio_w) * 100, 0, '%')} |"
        )
    lines.append("")
    lines.append(
        f"Disk read bandwidth (random 3.5 MB expert records, O_DIRECT, 8 in flight, io_uring): "
        f"{fmt(med(disk), 2)} GB/s (min {fmt(min(disk), 2)}, max {fmt(max(disk), 2)}). "
        f"Other processes' CPU during the runs: median {fmt(med(busy) and med(busy) * 100, 0)}%, "
        f"max {fmt(busy and max(busy) * 100, 0)}%. "
        f"Argmax tokens identical across all configurations: **{'yes' if same else 'NO'}**."
    )
    pf = [
        (n, r["rounds"][-1])
        for n in ("cache 25% + prefetch", "cache 6.25% + prefetch")
        for r in rows.get(n, [])
    ]
    if pf:
        recall = med([x["prefetch_recall"] for _, x in pf])
        used = sum(x["prefetch_used"] for _, x in pf)
        reads = sum(x["prefetch_reads"] for _, x in pf)
        lines.append(
            f"Prefetch: look-ahead recall {fmt(recall and recall * 100, 0)}% of routed experts; "
            f"{used} of {reads} prefetched records were used "
            f"({fmt(reads and used / reads * 100, 0)}%)."
        )
    lines.append("")
    lines.append(
        "Cache hit rate by policy (simulated on routing traces: `model` = this model's decode "
        f"routing over {policy['tokens']} tokens, `synthetic` = per-layer Zipf skew 0.2-1.4 with "
        "40% token-to-token expert reuse):"
    )
    lines.append("")
    lines.append(
        "| trace | cache (share of experts) | global LRU (default) | per-layer LRU "
        "| frequency insertion always | default, 2nd half only "
        "| 3/4 pinned by 1st-half heat + default, 2nd half |"
    )
    lines.append("|---|---|---|---|---|---|---|")
    for r in policy["rows"]:
        lines.append(
            f"| {r['trace']} | {r['cache_frac'] * 100:g}% | {r['global_lru']:.3f} "
            f"| {r['per_layer_lru']:.3f} | {r['global_lru_freq']:.3f} "
            f"| {r['global_lru_second_half']:.3f} | {r['pinned_global_lru']:.3f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    (a.out.with_suffix(".json")).write_text(
        json.dumps({"rows": rows, "disk_gb_s": disk, "policy": policy}, indent=1)
    )
    log(f"written to {a.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
