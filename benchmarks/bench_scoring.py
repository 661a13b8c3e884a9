#!/usr/bin/env python3
"""Scoring cost: a three-question /v1/systemone-shaped request over a 1,000-token state
against one prefill of the state alone, on the random OLMoE-1B-7B-shaped int4 model of
`bench_vs_llamacpp.py` (same cache dir), in process through `colibri.Engine.score`.

Issue 34's target: the whole request's engine time <= 1.15x the state's prefill (the options
must cost almost nothing: the state is prefilled once, the questions' own tokens together in
one batched pass, the options after them). Alternating rounds (the machine is shared and
drifts); each round uses a fresh slot state (a state no slot has seen), so nothing is reused
from an earlier round.

    python3 benchmarks/bench_scoring.py            # 3 rounds, table to stdout + --out
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_vs_llamacpp as base  # noqa: E402  (setup steps and idle detection)

from colibri import Engine  # noqa: E402
from colibri.api.systemone_request import parse_systemone  # noqa: E402
from colibri.scoring.prompts import question_prompt  # noqa: E402

QUESTIONS = {
    "urgent": {"type": "noul", "instructions": "Is this ticket urgent?"},
    "team": {
        "type": "choice",
        "criteria": {"web": "the website", "database": "storage", "billing": "invoices"},
    },
    "severity": {"type": "score", "criteria": ["minor", "small", "medium", "major", "critical"]},
}


def state_text(engine: Engine, tokens: int, salt: int) -> str:
    """Plain words until the state is `tokens` tokens long (salted: no slot has seen it)."""
    words = [f"w{(i * 7919 + salt) % 5000}" for i in range(tokens * 2)]
    lo, hi = 1, len(words)
    while lo < hi:  # the longest prefix of words within `tokens` tokens
        mid = (lo + hi + 1) // 2
        if len(engine.tokenize_literal(" ".join(words[:mid]))) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(words[:lo])


def options_tokens(engine: Engine, prompt: str, options: list[str]) -> list[list[int]]:
    n = len(engine.tokenize_literal(prompt))
    return [engine.tokenize_literal(prompt + " " + o)[n:] for o in options]


def one_round(engine: Engine, tokens: int, salt: int) -> tuple[float, float]:
    """(seconds of the state's prefill alone, seconds of the three-question request)."""
    state = state_text(engine, tokens, salt)
    req = parse_systemone({"state": state, "questions": QUESTIONS})
    context = engine.tokenize_literal(f"Context:\n{req.state}\n\n")
    t0 = time.perf_counter()
    # A one-token option costs no forward pass: this is the state's prefill alone.
    engine.score(context, [[context[0]]]).run()
    alone = time.perf_counter() - t0
    t0 = time.perf_counter()
    # As the route reads them: every question in one scoring (the state once, the questions'
    # own tokens together in one batched pass).
    questions = []
    for q in req.questions:
        prompt = question_prompt(req.state, q.text)
        questions.append(
            (engine.tokenize_literal(prompt), options_tokens(engine, prompt, q.options))
        )
    engine.score_many(questions, slot=0).run()
    request = time.perf_counter() - t0
    return alone, request


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--state-tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, help="a colibri model dir (default: the bench's)")
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--wait-idle", type=float, default=120)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "scoring-latest.md")
    a = ap.parse_args(argv)
    cache = a.cache or Path(
        os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
    )
    model = base.ensure_colibri_model(base.Paths(cache, 16), a.model)
    engine = Engine(model, threads=a.threads, slots=1)
    one_round(engine, 64, 999)  # warm-up: page cache, allocations
    ratios, rows = [], []
    for r in range(a.rounds):
        base.wait_for_idle(a.wait_idle, 0.15)
        alone, request = one_round(engine, a.state_tokens, r)
        ratios.append(request / alone)
        rows.append(f"| {r + 1} | {alone:.2f} | {request:.2f} | {request / alone:.3f} |")
        print(rows[-1], flush=True)
    med = statistics.median(ratios)
    verdict = "met" if med <= 1.15 else "missed"
    out = "\n".join(
        [
            f"## Scoring: a 3-question systemone request over a {a.state_tokens}-token state",
            "",
            f"Model: {model.name}, {a.threads} threads, {a.rounds} rounds. "
            "Engine time of the whole request (state prefilled once, each question and its "
            "options after it) over one prefill of the state alone.",
            "",
            "| round | state prefill alone, s | whole request, s | ratio |",
            "|---|---|---|---|",
            *rows,
            "",
            f"Median ratio **{med:.3f}** (target <= 1.15: **{verdict}**). "
            f"{time.strftime('%Y-%m-%d %H:%M')}",
            "",
        ]
    )
    print(out)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(out)


if __name__ == "__main__":
    main()
