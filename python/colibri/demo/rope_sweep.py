"""Can the demo model's context be extended by RoPE scaling alone, without training? Measured.

    python -m colibri.demo.rope_sweep --out /tmp/rope                  # every variant, 0/1.5k/3k
    python -m colibri.demo.rope_sweep --out /tmp/rope --variants yarn16 --preambles 0 12000 --n 10

Each variant is a copy of a model directory (the shipped demo model by default) whose manifest
differs in two config fields only: ``max_position_embeddings`` and ``rope_parameters`` (linear
or YaRN scaling as transformers computes them, which the engine follows; or the plain RoPE with a
larger context). The weights are the same bytes. Each variant is then scored by
:func:`colibri.demo.eval.evaluate` on short prompts (``0``) and at the end of agent preambles of
the asked lengths (``colibri.demo.preamble``), and the table printed: overall accuracy over the
seven tasks, and per task.

The findings (2026-12-06, docs/PERFORMANCE.md) were measured on the short-context demo model
(context 2048, trained on conversations of at most 1,024 tokens; the model shipped until commit
d7e091a): no variant answered at the end of a 4.5k-token preamble, so an agent's 12k-28k-token
first request needed training at long context. The shipped model is that model fine-tuned on
agent preambles with YaRN x16 (its CARD.md); its "orig" row here is that model as shipped.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from colibri.demo import eval as demo_eval

DEFAULT_MODEL = demo_eval.DEFAULT_MODEL
_BASE = {"partial_rotary_factor": 0.5, "rope_theta": 10000.0}


def _yarn(factor: float, original: int = 2048, **extra: float) -> dict[str, Any]:
    return {
        **_BASE,
        "rope_type": "yarn",
        "factor": float(factor),
        "original_max_position_embeddings": original,
        **extra,
    }


# name -> (max_position_embeddings, rope_parameters). "orig" is the model as shipped.
VARIANTS: dict[str, tuple[int, dict[str, Any]] | None] = {
    "orig": None,
    "none32k": (32768, {**_BASE, "rope_type": "default"}),
    "linear2": (32768, {**_BASE, "rope_type": "linear", "factor": 2.0}),
    "linear16": (32768, {**_BASE, "rope_type": "linear", "factor": 16.0}),
    "ntk4": (32768, {**_BASE, "rope_type": "default", "rope_theta": 10000.0 * 4 ** (16 / 14)}),
    "yarn2": (32768, _yarn(2)),
    "yarn4": (32768, _yarn(4)),
    "yarn8": (32768, _yarn(8)),
    "yarn16": (32768, _yarn(16)),
    "yarn32": (32768, _yarn(32)),
    "yarn64": (32768, _yarn(64)),
    "yarn16_af1": (32768, _yarn(16, attention_factor=1.0)),
    "yarn32_af1": (32768, _yarn(32, attention_factor=1.0)),
    "yarn16_af2": (32768, _yarn(16, attention_factor=2.0)),
    "yarn16_o1k": (32768, _yarn(16, original=1024)),
    "yarn16_bs11": (32768, _yarn(16, beta_slow=11.0)),
    "yarn16_bf2_bs1.5": (32768, _yarn(16, beta_fast=2.0, beta_slow=1.5)),
}


def write_variant(
    dst: str | Path,
    max_positions: int,
    rope_parameters: dict[str, Any],
    src: str | Path = DEFAULT_MODEL,
) -> Path:
    """A copy of the model directory ``src`` at ``dst`` (replaced if present) whose manifest's
    config has ``max_position_embeddings`` and ``rope_parameters`` set as given; every other
    byte of the model is the original's."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("routing-heat.json"))
    manifest = json.loads((dst / "manifest.json").read_text("utf-8"))
    manifest["config"]["max_position_embeddings"] = max_positions
    manifest["config"]["rope_parameters"] = rope_parameters
    (dst / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n", "utf-8")
    return dst


def sweep(
    out: str | Path,
    variants: list[str],
    preambles: list[int],
    n: int,
    tasks: list[str] | None = None,
    src: str | Path = DEFAULT_MODEL,
    threads: int | None = None,
) -> list[dict[str, Any]]:
    """Scores each variant (written under ``out``) at each preamble length (0: short prompts).
    Returns one row per (variant, preamble): ``{"variant", "preamble", "preamble_tokens",
    "accuracy", "correct", "n", "tasks": {task: accuracy}, "seconds"}``."""
    rows = []
    for name in variants:
        spec = VARIANTS[name]
        model = Path(src) if spec is None else write_variant(Path(out) / name, *spec, src=src)
        for pre in preambles:
            r = demo_eval.evaluate(model, n, tasks=tasks, threads=threads, preamble_tokens=pre)
            correct = sum(t["correct"] for t in r["tasks"].values())
            total = sum(t["n"] for t in r["tasks"].values())
            rows.append(
                {
                    "variant": name,
                    "preamble": pre,
                    "preamble_tokens": round(r.get("preamble_tokens", 0)),
                    "accuracy": correct / max(1, total),
                    "correct": correct,
                    "n": total,
                    "tasks": {k: t["accuracy"] for k, t in r["tasks"].items()},
                    "seconds": r["seconds"],
                }
            )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    """Variants down, preamble lengths across: overall accuracy (correct/n)."""
    pres = sorted({r["preamble"] for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    cell = {(r["variant"], r["preamble"]): r for r in rows}
    head = ["variant"] + [
        "short"
        if p == 0
        else f"{max(r['preamble_tokens'] for r in rows if r['preamble'] == p)} tok preamble"
        for p in pres
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        vals = []
        for p in pres:
            r = cell.get((name, p))
            vals.append(
                "" if r is None else f"{r['accuracy'] * 100:.1f}% ({r['correct']}/{r['n']})"
            )
        lines.append("| " + " | ".join([name] + vals) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m colibri.demo.rope_sweep", description=__doc__)
    ap.add_argument("--out", required=True, help="directory for the variants' model copies")
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="the model to vary")
    ap.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--preambles", nargs="*", type=int, default=[0, 1500, 3000])
    ap.add_argument("--n", type=int, default=10, help="prompts per task")
    ap.add_argument("--tasks", nargs="*")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = sweep(
        args.out, args.variants, args.preambles, args.n, args.tasks, args.model, args.threads
    )
    print(format_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
