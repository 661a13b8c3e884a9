"""What writing a long prefill to its KV slot file costs (issue 30, item 3: at most 3%).

Two engines on the same int4 model in one process, each with one KV slot: one keeps its slot in
memory (no --kv-dir), the other persists it to a slot file (appends from the background writer,
fsync at the end of the turn). Each round gives both the same fresh random prompt of N tokens
(nothing shared with the slot's history, so all of it is prefilled and written), in alternating
order, and times the prefill (to the first token) and the whole turn (one token, so the turn's
end and its fsync are in it). Prints the per-round ratios persisted / in memory and their
medians; writes benchmarks/results/slot-append-latest.md. Run: `just bench` (never in tests).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_vs_llamacpp as base  # noqa: E402  (setup steps and idle detection)

from colibri import Engine  # noqa: E402

TARGET = 1.03


def one_turn(engine: Engine, prompt: list[int]) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end of the turn) in slot 0."""
    t0 = time.perf_counter()
    tokens = engine.generate(prompt, max_tokens=1, slot=0)
    next(tokens)
    first = time.perf_counter() - t0
    for _ in tokens:
        pass
    return first, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="the bench model's layers (default 4)")
    ap.add_argument("--model", type=Path, help="a colibri model dir (default: the bench's)")
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--wait-idle", type=float, default=120)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "slot-append-latest.md")
    a = ap.parse_args(argv)
    cache = a.cache or Path(
        os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
    )
    model = base.ensure_colibri_model(base.Paths(cache, a.layers), a.model)
    kv_dir = tempfile.mkdtemp(prefix="colibri-bench-kv-")
    engines = {
        "memory": Engine(model, threads=a.threads, slots=1),
        "file": Engine(model, threads=a.threads, slots=1, kv_dir=kv_dir),
    }
    vocab = engines["memory"].info["vocab_size"]
    for e in engines.values():
        one_turn(e, [5, 6, 7] * 20)  # warm-up: page cache, allocations, the slot file
    rows, summary = [], []
    for n in a.tokens:
        prefill_ratios, turn_ratios = [], []
        for r in range(a.rounds):
            prompt = random.Random(n * 1000 + r).choices(range(100, vocab - 100), k=n)
            order = ["memory", "file"] if r % 2 == 0 else ["file", "memory"]
            got = {}
            for name in order:
                base.wait_for_idle(a.wait_idle, 0.15)
                got[name] = one_turn(engines[name], prompt)
            (pm, tm), (pf, tf) = got["memory"], got["file"]
            prefill_ratios.append(pf / pm)
            turn_ratios.append(tf / tm)
            rows.append(
                f"| {n} | {r + 1} | {pm:.3f} | {pf:.3f} | {pf / pm:.3f} | {tm:.3f} | {tf:.3f} "
                f"| {tf / tm:.3f} |"
            )
            print(rows[-1], flush=True)
        mp, mt = statistics.median(prefill_ratios), statistics.median(turn_ratios)
        verdict = "met" if mp <= TARGET else "missed"
        summary.append(
            f"- {n} tokens: prefill with the slot file / in memory, median **{mp:.3f}** "
            f"({min(prefill_ratios):.3f}-{max(prefill_ratios):.3f}; target <= {TARGET}: "
            f"{verdict}); the whole turn incl. its fsync {mt:.3f}"
        )
    info = engines["memory"].info
    out = "\n".join(
        [
            "## KV slot file: the cost of appending a long prefill (`bench_slot_append.py`)",
            "",
            f"{info['architecture']} ({model.name}), {a.threads} threads, {a.rounds} rounds per "
            "length, the two engines alternating; times in seconds.",
            "",
            "| tokens | round | prefill, memory | prefill, file | ratio | turn, memory "
            "| turn, file | ratio |",
            "|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            *summary,
            "",
        ]
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(out)
    print(out)


if __name__ == "__main__":
    main()
