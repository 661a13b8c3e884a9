"""The long-prompt mode (bench_vs_llamacpp.py --long): per round, in alternating engine order,
prefill alone at each of --lengths, decode after a --long-depth-token prompt, each engine
process's peak RSS, and colibri's time to first token for a --long-depth-token prompt through
`colibri serve` vs the engine alone."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from .common import log
from .machine import Quiet
from .measure import (
    measure_colibri,
    measure_llama_depth,
    measure_llama_prefill,
    measure_ttft,
)
from .prepare import Paths, colibri_python, colibri_runs, setup_colibri_model
from .report import build_long_report


def run_long(
    a, p: Paths, exe: Path | None, note: str | None, ver: str | None
) -> tuple[list[dict], str]:
    """Measure --rounds rounds; the raw rounds and the markdown report.

    A round is, for each length, both engines' prefill; then both engines' decode after
    --long-depth (colibri's comes from its prefill run at that length when it is one of
    --lengths: `colibri bench` decodes after its prompt); then the server's time to first
    token. A failed measurement is reported and skipped, the run goes on; when colibri's very
    first one fails, its model is reconverted once (the cached conversion may predate a format
    change) and the measurement retried, as in the short mode.
    """
    quiet = Quiet(a)
    py = colibri_python(exe) if exe else None
    depth = a.long_depth
    errors: list[str] = []
    rounds: list[dict] = []
    if exe and not py:
        errors.append(f"TTFT not measured: no Python interpreter in {exe}'s #! line")

    def timed(fn: Callable[[], dict], what: str) -> dict | None:
        t0 = time.monotonic()
        try:
            res = quiet.clean(fn, what)
        except (RuntimeError, SystemExit) as e:  # one failure (e.g. out of memory) ends no run
            log(f"  {what} FAILED:\n{e}")
            errors.append(f"{what}: {str(e).strip()[-500:]}")
            return None
        res["wall_s"] = time.monotonic() - t0  # with re-measuring and waiting for quiet
        extra = f" (this run {res['run_s']:.0f}s)" if res["attempts"] > 1 else ""
        extra += f", peak RSS {res['peak_rss_mb']:.0f} MB" if res.get("peak_rss_mb") else ""
        busy = res.get("others_cpu")
        extra += f", other processes {busy:.0%} CPU" if busy is not None else ""
        log(f"  {what}: {res['wall_s']:.0f}s{extra}")
        return res

    colibri_ok = [a.reconvert_colibri]  # a measurement succeeded (or it was just reconverted)

    def colibri(fn: Callable[[], dict], what: str) -> dict | None:
        res = timed(fn, what)
        if res is None and not colibri_ok[0] and exe and colibri_runs(exe):
            colibri_ok[0] = True
            log("[colibri] its first run failed; reconverting the model once and retrying")
            try:
                setup_colibri_model(p, exe, True)
            except SystemExit as e:
                errors.append(f"colibri convert: {str(e).strip()[-500:]}")
                return None
            res = timed(fn, what)
            if res:
                errors.pop()  # the failure before the reconversion
        colibri_ok[0] = colibri_ok[0] or res is not None
        return res

    log(
        f"[measure --long] {a.rounds} rounds, {a.threads} threads, prompts {a.lengths}, "
        f"decode {a.gen_tokens} tokens after {depth}, reps {a.reps}"
    )
    for i in range(a.rounds):
        engines = ["llama", "colibri"] if i % 2 == 0 else ["colibri", "llama"]
        if exe is None:
            engines = ["llama"]
        r: dict = {"order": " → ".join("llama.cpp" if e == "llama" else e for e in engines)}
        log(f"  round {i + 1}/{a.rounds} [{r['order']}]")
        r["idle_before"] = quiet.settle()
        r["prefill"] = {}
        for n in a.lengths:
            row = r["prefill"][str(n)] = {}
            for eng in engines:
                if eng == "llama":
                    res = timed(lambda n=n: measure_llama_prefill(p, a, n), f"llama.cpp pp{n}")
                else:
                    gen = a.gen_tokens if n == depth else 0
                    res = colibri(
                        lambda n=n, gen=gen: measure_colibri(exe, p, a, n, gen), f"colibri pp{n}"
                    )
                if res:
                    row[eng] = res
                    log(f"    {eng} prefill {n}: {res['prefill_tok_s']:.1f} tok/s")
        if depth:
            for eng in engines:
                if eng == "llama":
                    res = timed(lambda: measure_llama_depth(p, a, depth), f"llama.cpp tg@{depth}")
                elif str(depth) in r["prefill"]:
                    res = r["prefill"][str(depth)].get("colibri")
                else:
                    res = colibri(lambda: measure_colibri(exe, p, a, depth), f"colibri tg@{depth}")
                if res:
                    r[f"{eng}_depth"] = res
                    log(f"    {eng} decode after {depth}: {res['decode_tok_s']:.2f} tok/s")
            if py:
                first = i % 2 == 1  # the server first every other round
                res = colibri(lambda s=first: measure_ttft(py, p, a, depth, s), f"TTFT {depth}")
                if res:
                    r["ttft"] = res
                    log(
                        f"    time to first token: engine {res['engine_ttft_s']:.2f}s, "
                        f"server {res['server_ttft_s']:.2f}s ({res['ratio']:.3f}x)"
                    )
        rounds.append(r)
    if errors:
        note = (note + " " if note else "") + "Failed: " + "; ".join(errors)
    return rounds, build_long_report(a, rounds, note, ver)
