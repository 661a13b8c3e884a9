"""The report: the weight bytes one decoded token reads (for the bandwidth ceiling), medians with
min/max over the rounds, the engines' ratios and fractions of the ceiling, as markdown."""

from __future__ import annotations

import datetime as dt
import os
import statistics
import subprocess

from .common import REPO
from .machine import cpu_name, mem_total_gb
from .prepare import LLAMA_CPP_PYTHON_VERSION

BITS_PER_WEIGHT = 4.5  # Q4_0: 32 4-bit weights + one f16 scale per block


def bytes_per_decoded_token(cfg: dict, bits: float = BITS_PER_WEIGHT) -> dict:
    """Weight bytes one decode step reads: everything active for one token."""
    h = cfg["hidden_size"]
    inter = cfg["intermediate_size"]
    n_head = cfg["num_attention_heads"]
    kv_dim = h // n_head * cfg["num_key_value_heads"]
    L = cfg["num_hidden_layers"]
    attn = L * (2 * h * h + 2 * kv_dim * h)
    router = L * cfg["num_experts"] * h
    experts = L * cfg["num_experts_per_tok"] * 3 * h * inter
    lm_head = cfg["vocab_size"] * h
    embed_row = h
    active = attn + router + experts + lm_head + embed_row
    total = 2 * cfg["vocab_size"] * h + L * (
        2 * h * h + 2 * kv_dim * h + cfg["num_experts"] * h + cfg["num_experts"] * 3 * h * inter
    )
    return {
        "active_params": active,
        "total_params": total,
        "attn": attn,
        "router": router,
        "experts": experts,
        "lm_head": lm_head,
        "bytes": active * bits / 8,
    }


# ---------------------------------------------------------------- report


def stats(xs: list[float]) -> tuple[float, float, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return statistics.median(xs), min(xs), max(xs)


def fmt(s, digits: int = 1, unit: str = "") -> str:
    if s is None:
        return "n/a"
    med, lo, hi = s
    return f"{med:.{digits}f}{unit} ({lo:.{digits}f}–{hi:.{digits}f})"


def git_rev() -> str:
    try:
        r = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return r.stdout.strip() or "uncommitted"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def build_report(
    a, rounds: list[dict], bpt: dict, colibri_note: str | None, colibri_ver: str | None
) -> str:
    L = {
        k: stats([r["llama"][k] for r in rounds if r.get("llama")])
        for k in ("decode_tok_s", "prefill_tok_s", "peak_rss_mb")
    }
    C = {
        k: stats([r["colibri"][k] for r in rounds if r.get("colibri")])
        for k in ("decode_tok_s", "prefill_tok_s", "peak_rss_mb")
    }
    bw = stats([r["bw"]["gb_s"] for r in rounds if r.get("bw")])
    bw_median = stats(
        [r["bw"]["median_gb_s"] for r in rounds if r.get("bw", {}).get("median_gb_s")]
    )
    gb_per_tok = bpt["bytes"] / 1e9

    def ratio(key: str) -> str:
        if not C[key] or not L[key]:
            return "n/a"
        paired = [
            r["colibri"][key] / r["llama"][key]
            for r in rounds
            if r.get("colibri") and r.get("llama")
        ]
        return f"**{C[key][0] / L[key][0]:.2f}** (per round {min(paired):.2f}–{max(paired):.2f})"

    def of_ceiling(eng: str, key: str = "gb_s") -> str:
        vals = [
            r[eng]["decode_tok_s"] * gb_per_tok / r["bw"][key]
            for r in rounds
            if r.get(eng) and r.get("bw") and r["bw"].get(key)
        ]
        s = stats(vals)
        if not s:
            return "n/a"
        return f"{100 * s[0]:.0f}% ({100 * s[1]:.0f}–{100 * s[2]:.0f}%)"

    def busy_of(eng: str) -> str:
        s = stats([r[eng]["others_cpu"] for r in rounds if r.get(eng)])
        if not s:
            return "n/a"
        return f"{100 * s[0]:.0f}% ({100 * s[1]:.0f}–{100 * s[2]:.0f}%)"

    def round_busy(r: dict) -> float | None:
        xs = [r[k].get("others_cpu") for k in ("bw", "llama", "colibri") if r.get(k)]
        xs = [x for x in xs if x is not None]
        return max(xs) if xs else None

    def depth_rows() -> list[str]:
        cd = stats([r["colibri_depth"]["decode_tok_s"] for r in rounds if r.get("colibri_depth")])
        ld = stats([r["llama_depth"]["decode_tok_s"] for r in rounds if r.get("llama_depth")])
        if not cd and not ld:
            return []
        paired = [
            r["colibri_depth"]["decode_tok_s"] / r["llama_depth"]["decode_tok_s"]
            for r in rounds
            if r.get("colibri_depth") and r.get("llama_depth")
        ]
        ratio_d = (
            f"**{cd[0] / ld[0]:.2f}** (per round {min(paired):.2f}–{max(paired):.2f})"
            if cd and ld and paired
            else "n/a"
        )
        return [
            f"| decode tok/s after a {a.depth}-token context | {fmt(cd, 2)} | {fmt(ld, 2)} | "
            f"{ratio_d} |"
        ]

    worst = max((b for b in map(round_busy, rounds) if b is not None), default=None)
    ceiling = stats([r["bw"]["gb_s"] / gb_per_tok for r in rounds if r.get("bw")])
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    shape = "" if a.layers == 16 else f" ({a.layers} layers)"
    lines = [
        f"## colibri vs llama.cpp: random OLMoE-1B-7B{shape}, {a.threads} threads",
        "",
        f"Median (min–max) over {len(rounds)} alternating rounds. colibri int4 vs llama.cpp "
        f"Q4_0 `--pure` from the same bf16 weights; prefill = {a.prompt_tokens}-token prompt, "
        f"decode = {a.gen_tokens} generated tokens.",
        "",
        "| | colibri int4 | llama.cpp Q4_0 | colibri / llama.cpp |",
        "|---|---|---|---|",
        f"| decode tok/s | {fmt(C['decode_tok_s'], 2)} | {fmt(L['decode_tok_s'], 2)} | "
        f"{ratio('decode_tok_s')} |",
        f"| prefill tok/s ({a.prompt_tokens}-token prompt) | {fmt(C['prefill_tok_s'], 1)} | "
        f"{fmt(L['prefill_tok_s'], 1)} | {ratio('prefill_tok_s')} |",
        *depth_rows(),
        f"| peak RSS, MB | {fmt(C['peak_rss_mb'], 0)} | {fmt(L['peak_rss_mb'], 0)} | |",
        f"| decode as % of bandwidth ceiling | {of_ceiling('colibri')} | {of_ceiling('llama')} | |",
        f"| same, ceiling from the probe's median pass | {of_ceiling('colibri', 'median_gb_s')} | "
        f"{of_ceiling('llama', 'median_gb_s')} | |",
        f"| CPU used by other processes meanwhile | {busy_of('colibri')} | {busy_of('llama')} | |",
        "",
        "| machine and model | |",
        "|---|---|",
        f"| read bandwidth, {a.threads} threads (bandwidth.c, best of {a.bw_passes} passes "
        f"over {a.bw_size_mib} MiB) | {fmt(bw, 1, ' GB/s')} |",
        f"| read bandwidth, median of the {a.bw_passes} passes | {fmt(bw_median, 1, ' GB/s')} |",
        f"| weight bytes read per decoded token at {BITS_PER_WEIGHT} bits/weight | "
        f"{gb_per_tok:.3f} GB "
        f"({bpt['active_params'] / 1e9:.3f}B active of {bpt['total_params'] / 1e9:.2f}B params) |",
        f"| decode ceiling = bandwidth / bytes per token | {fmt(ceiling, 1, ' tok/s')} |",
        "",
        f"{when}; {cpu_name()}, {os.cpu_count()} cores, {mem_total_gb():.0f} GB; "
        f"llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (llama-bench "
        f"`-t {a.threads} -p {a.prompt_tokens} -n {a.gen_tokens} -r {a.reps}`"
        + (f", and `-p 0 -n {a.gen_tokens} -d {a.depth}`" if a.depth else "")
        + "); "
        f"colibri: {colibri_ver or 'n/a'}, repo at {git_rev()}.",
    ]
    if worst is not None and worst > a.max_others:
        lines += [
            "",
            f"**Noisy run:** other processes used up to {worst:.0%} of the CPUs during the "
            "measurements; both engines run 2 threads on 2 cores, so such rounds are slowed "
            "(llama.cpp's spinning thread pool especially). Re-run on an idle machine.",
        ]
    if colibri_note:
        lines += ["", f"**colibri:** {colibri_note}"]
    lines += [
        "",
        "<details><summary>per-round samples</summary>",
        "",
        "| round | order | GB/s | colibri decode | colibri prefill | llama.cpp decode "
        "| llama.cpp prefill | others' CPU (max) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def g(r, eng, k, d=2):
        return f"{r[eng][k]:.{d}f}" if r.get(eng) else "–"

    for i, r in enumerate(rounds):
        lines.append(
            f"| {i + 1} | {r['order']} | {r['bw']['gb_s']:.1f} | "
            f"{g(r, 'colibri', 'decode_tok_s')} | "
            f"{g(r, 'colibri', 'prefill_tok_s', 1)} | {g(r, 'llama', 'decode_tok_s')} | "
            f"{g(r, 'llama', 'prefill_tok_s', 1)} | "
            + ("–" if round_busy(r) is None else f"{round_busy(r):.0%}")
            + " |"
        )
    lines += ["", "</details>", ""]
    return "\n".join(lines)
