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
    if cfg["model_type"] == "deepseek_v3":
        return deepseek_v3_bytes_per_decoded_token(cfg, bits)
    if cfg["model_type"] == "qwen3_next":
        return qwen3_next_bytes_per_decoded_token(cfg, bits)
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


def deepseek_v3_bytes_per_decoded_token(cfg: dict, bits: float) -> dict:
    """The same for DeepSeek-V3's shape: MLA projections in every layer, dense MLPs in the
    first ``first_k_dense_replace`` layers, the router, top-k routed and the shared experts in
    the others."""
    h, heads, L = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    q = q_lora * h + heads * (nope + rope) * q_lora if q_lora else heads * (nope + rope) * h
    attn = L * (q + (kv_lora + rope) * h + heads * (nope + v) * kv_lora + h * heads * v)
    dense_layers = min(L, cfg["first_k_dense_replace"])
    moe_layers = L - dense_layers
    expert = 3 * h * cfg["moe_intermediate_size"]
    n_experts = cfg["n_routed_experts"]
    dense = dense_layers * 3 * h * cfg["intermediate_size"]
    router = moe_layers * n_experts * h
    shared = moe_layers * cfg["n_shared_experts"] * expert
    experts = moe_layers * cfg["num_experts_per_tok"] * expert
    lm_head = cfg["vocab_size"] * h
    active = attn + dense + router + shared + experts + lm_head + h
    total = 2 * cfg["vocab_size"] * h + attn + dense + router + shared
    total += moe_layers * n_experts * expert
    return {
        "active_params": active,
        "total_params": total,
        "attn": attn,
        "router": router,
        "experts": experts + shared + dense,
        "lm_head": lm_head,
        "bytes": active * bits / 8,
    }


def qwen3_next_bytes_per_decoded_token(cfg: dict, bits: float) -> dict:
    """The same for Qwen3-Next's shape: gated attention every `full_attention_interval`-th
    layer, gated DeltaNet projections in the others, the router, top-k routed and the shared
    experts in every layer."""
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    full = sum((i + 1) % cfg["full_attention_interval"] == 0 for i in range(L))
    attn = full * (2 * heads * hd * h + 2 * kv * hd * h + h * heads * hd)
    attn += (L - full) * ((2 * kd + 2 * vd) * h + 2 * cfg["linear_num_value_heads"] * h + h * vd)
    expert = 3 * h * cfg["moe_intermediate_size"]
    n_experts = cfg["num_experts"]
    router = L * (n_experts + 1) * h
    shared = L * 3 * h * cfg["shared_expert_intermediate_size"]
    experts = L * cfg["num_experts_per_tok"] * expert
    lm_head = cfg["vocab_size"] * h
    active = attn + router + shared + experts + lm_head + h
    total = 2 * cfg["vocab_size"] * h + attn + router + shared + L * n_experts * expert
    return {
        "active_params": active,
        "total_params": total,
        "attn": attn,
        "router": router,
        "experts": experts + shared,
        "lm_head": lm_head,
        "bytes": active * bits / 8,
    }


def kv_bytes_per_token(cfg: dict, dtype_bytes: int = 2) -> dict | None:
    """For an MLA model: the latent's size per token (what its cache should hold: c_kv and the
    rope key, every layer) and what GQA of the same width would cache (every head's key and
    value); None for other models."""
    if "kv_lora_rank" not in cfg:
        return None
    L, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    rope = cfg["qk_rope_head_dim"]
    latent = L * (cfg["kv_lora_rank"] + rope) * dtype_bytes
    gqa = L * heads * (cfg["qk_nope_head_dim"] + rope + cfg["v_head_dim"]) * dtype_bytes
    return {"latent": latent, "gqa": gqa}


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


MODEL_NAMES = {
    "olmoe": "OLMoE-1B-7B",
    "deepseek_v3": "DeepSeek-V3-shaped (MLA, kv_lora_rank 512, 64 experts top-6 + 1 shared)",
    "qwen3_next": "Qwen3-Next-shaped (gated DeltaNet x3 + gated attention x1, 64 experts top-10 "
    "+ a gated shared expert)",
}


def per_round(paired: list[float]) -> str:
    """The per-round ratios' range and median: on a VM whose state flips between rounds the
    ratio of the two engines' medians can come from different states, the per-round median
    from pairs measured minutes apart."""
    return (
        f"per round {min(paired):.2f}–{max(paired):.2f}, "
        f"their median {statistics.median(paired):.2f}"
    )


def build_report(
    a,
    rounds: list[dict],
    bpt: dict,
    colibri_note: str | None,
    colibri_ver: str | None,
    kv: dict | None = None,
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
        return f"**{C[key][0] / L[key][0]:.2f}** ({per_round(paired)})"

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
            f"**{cd[0] / ld[0]:.2f}** ({per_round(paired)})" if cd and ld and paired else "n/a"
        )

        return [
            f"| decode tok/s after a {a.depth}-token context | {fmt(cd, 2)} | {fmt(ld, 2)} | "
            f"{ratio_d} |"
        ]

    def kv_rows() -> list[str]:
        if kv is None:
            return []
        measured = next(
            (
                r["colibri"]["kv_bytes_per_token"]
                for r in rounds
                if r.get("colibri", {}).get("kv_bytes_per_token")
            ),
            None,
        )
        rows = [
            f"| KV cache per token of context, the latent (c_kv + rope key, f16, every layer) | "
            f"{kv['latent']:,} bytes |",
            f"| same, GQA of the same width (every head's key and value, f16) | "
            f"{kv['gqa']:,} bytes ({kv['gqa'] / kv['latent']:.1f}x the latent) |",
        ]
        if measured:
            rows.append(
                f"| colibri's KV per token (`kv_bytes_per_token`) | {measured:,} bytes "
                f"({measured / kv['latent']:.2f}x the latent) |"
            )
        return rows

    worst = max((b for b in map(round_busy, rounds) if b is not None), default=None)
    ceiling = stats([r["bw"]["gb_s"] / gb_per_tok for r in rounds if r.get("bw")])
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    shape = "" if a.layers == 16 else f" ({a.layers} layers)"
    lines = [
        f"## colibri vs llama.cpp: random {MODEL_NAMES[a.arch]}{shape}, {a.threads} threads",
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
        *kv_rows(),
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


# ---------------------------------------------------------------- the long-prompt report

# The targets for the long-prompt mode (issue 30).
PREFILL_RATIO_TARGET = 1.5  # colibri prefill / llama.cpp's, at every length
PREFILL_KEEP_TARGET = 0.5  # colibri prefill at KEEP_AT tokens / at KEEP_FROM tokens
KEEP_FROM, KEEP_AT = 512, 16384
DECODE_RATIO_TARGET = 1.3  # colibri decode / llama.cpp's, after --long-depth tokens
TTFT_RATIO_TARGET = 1.05  # time to first token through the server / the engine alone's


def paired(rounds: list[dict], get) -> tuple[float, float, float, list[float]] | None:
    """For get(round) -> (colibri, llama.cpp) or None: the ratio of the medians, the range of
    the per-round ratios, and those ratios."""
    pairs = [x for x in map(get, rounds) if x and x[0] is not None and x[1] is not None]
    if not pairs:
        return None
    per = [c / lo for c, lo in pairs]
    return (
        statistics.median(c for c, _ in pairs) / statistics.median(lo for _, lo in pairs),
        min(per),
        max(per),
        per,
    )


def fmt_ratio(s, digits: int = 2) -> str:
    if not s:
        return "n/a"
    return f"**{s[0]:.{digits}f}** (per round {s[1]:.{digits}f}–{s[2]:.{digits}f})"


def build_long_report(a, rounds: list[dict], note: str | None, ver: str | None) -> str:
    depth = a.long_depth

    def pre(n: int, eng: str, key: str = "prefill_tok_s"):
        return [
            (r["prefill"].get(str(n), {}).get(eng) or {}).get(key) for r in rounds
        ]  # one per round, None where not measured

    def pair_at(n: int):
        def get(r: dict):
            row = r["prefill"].get(str(n), {})
            if "colibri" in row and "llama" in row:
                return row["colibri"]["prefill_tok_s"], row["llama"]["prefill_tok_s"]
            return None

        return paired(rounds, get)

    base = stats(pre(min(a.lengths), "colibri"))
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    shape = "" if a.layers == 16 else f", {a.layers} layers"
    lines = [
        f"## colibri vs llama.cpp, long prompts: random {MODEL_NAMES[a.arch]} (context {a.context}"
        f"{shape}), {a.threads} threads",
        "",
        f"Median (min–max) over {len(rounds)} alternating rounds. colibri int4 vs llama.cpp "
        "Q4_0 `--pure` from the same bf16 weights; prefill = a prompt of N random tokens, "
        "prefill only, each engine after its own untimed warm-up pass of the same length. "
        "Peak RSS = the engine process's `ru_maxrss`.",
        "",
        "| prompt tokens | colibri prefill tok/s | llama.cpp prefill tok/s | colibri / llama.cpp "
        f"| colibri vs its {min(a.lengths)} | colibri peak RSS, MB | llama.cpp peak RSS, MB |",
        "|---|---|---|---|---|---|---|",
    ]
    ratios: dict[int, tuple | None] = {}
    for n in a.lengths:
        c = stats(pre(n, "colibri"))
        ratios[n] = pair_at(n)
        keep = f"{100 * c[0] / base[0]:.0f}%" if c and base else "n/a"
        lines.append(
            f"| {n} | {fmt(c, 1)} | {fmt(stats(pre(n, 'llama')), 1)} | {fmt_ratio(ratios[n])} | "
            f"{keep} | {fmt(stats(pre(n, 'colibri', 'peak_rss_mb')), 0)} | "
            f"{fmt(stats(pre(n, 'llama', 'peak_rss_mb')), 0)} |"
        )

    def dep(eng: str, key: str = "decode_tok_s"):
        return [(r.get(f"{eng}_depth") or {}).get(key) for r in rounds]

    decode = paired(
        rounds,
        lambda r: (
            (r["colibri_depth"]["decode_tok_s"], r["llama_depth"]["decode_tok_s"])
            if r.get("colibri_depth") and r.get("llama_depth")
            else None
        ),
    )
    ttft = [r["ttft"] for r in rounds if r.get("ttft")]
    ttft_ratio = paired(
        rounds,
        lambda r: (
            (r["ttft"]["server_ttft_s"], r["ttft"]["engine_ttft_s"]) if r.get("ttft") else None
        ),
    )
    if depth:
        lines.append(
            f"| decode tok/s after {depth} ({a.gen_tokens} tokens) | "
            f"{fmt(stats(dep('colibri')), 2)} | {fmt(stats(dep('llama')), 2)} | "
            f"{fmt_ratio(decode)} | | "
            f"{fmt(stats(dep('colibri', 'peak_rss_mb')), 0)} | "
            f"{fmt(stats(dep('llama', 'peak_rss_mb')), 0)} |"
        )
        tokens = f"{ttft[0]['ttft_tokens']}-token" if ttft else f"{depth}-token"
        lines += [
            "",
            f"| time to first token, fresh {tokens} prompt | engine alone | through "
            "`colibri serve` (streamed /v1/completions) | server / engine |",
            "|---|---|---|---|",
            f"| seconds | {fmt(stats([t['engine_ttft_s'] for t in ttft]), 2)} | "
            f"{fmt(stats([t['server_ttft_s'] for t in ttft]), 2)} | {fmt_ratio(ttft_ratio, 3)} |",
        ]

    keep_from, keep_at = stats(pre(KEEP_FROM, "colibri")), stats(pre(KEEP_AT, "colibri"))
    keep = keep_at[0] / keep_from[0] if keep_from and keep_at else None
    at = {n: r[0] for n, r in ratios.items() if r}  # ratio of medians per measured length
    worst = min(at, key=lambda n: at[n]) if at else None
    every = len(at) == len(a.lengths)

    def target(label: str, shown: str | None, ok: bool) -> str:
        result = "n/a (not measured)" if shown is None else ("**met**" if ok else "**missed**")
        return f"| {label} | {shown or 'n/a'} | {result} |"

    lines += [
        "",
        "| target (issue 30) | measured (ratio of medians) | |",
        "|---|---|---|",
        target(
            f"prefill ≥ {PREFILL_RATIO_TARGET}x llama.cpp at every length "
            f"({', '.join(map(str, a.lengths))})",
            None
            if worst is None
            else f"lowest {at[worst]:.2f}x, at {worst}" + ("" if every else " (not every length)"),
            every and min(at.values()) >= PREFILL_RATIO_TARGET,
        ),
        target(
            f"colibri prefill at {KEEP_AT} ≥ {PREFILL_KEEP_TARGET:.0%} of its {KEEP_FROM}-token "
            "figure",
            None if keep is None else f"{keep:.0%}",
            keep is not None and keep >= PREFILL_KEEP_TARGET,
        ),
        target(
            f"decode after {depth} ≥ {DECODE_RATIO_TARGET}x llama.cpp",
            None if not decode else f"{decode[0]:.2f}x",
            bool(decode) and decode[0] >= DECODE_RATIO_TARGET,
        ),
        target(
            f"time to first token for a {depth}-token prompt through the server within "
            f"{TTFT_RATIO_TARGET - 1:.0%} of the engine alone",
            None if not ttft_ratio else f"{ttft_ratio[0]:.3f}x",
            bool(ttft_ratio) and ttft_ratio[0] <= TTFT_RATIO_TARGET,
        ),
    ]
    if depth and depth != KEEP_AT:
        lines += ["", f"(The issue's targets are at {KEEP_AT} tokens; this run used {depth}.)"]

    fa = {  # llama-bench's JSON says -1 for its default, auto (on where the backend has it)
        {-1: "auto", 0: "off", 1: "on"}.get(row["llama"].get("flash_attn"), "n/a")
        for r in rounds
        for row in r["prefill"].values()
        if row.get("llama")
    }
    lines += [
        "",
        f"{when}; {cpu_name()}, {os.cpu_count()} cores, {mem_total_gb():.0f} GB; "
        f"llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (`llama-bench -t {a.threads} "
        f"-p N -n 0 -r {a.reps}`"
        + (f" and `-p 0 -n {a.gen_tokens} -d {depth}`" if depth else "")
        + f", flash attention {'/'.join(sorted(fa)) or 'n/a'}); colibri: `colibri bench "
        f"--threads {a.threads} --prompt-tokens N --gen-tokens 0 --repeat {a.reps}`"
        + (
            f" (at {depth}: `--gen-tokens {a.gen_tokens}`: decode after the prompt)"
            if depth
            else ""
        )
        + f"; {ver or 'n/a'}, repo at {git_rev()}"
        + (
            f"; time to first token: the median of {a.ttft_reps} samples per side per round, "
            "the order alternating (`bench_server_overhead.py --ttft-tokens`)."
            if depth
            else "."
        ),
    ]
    busy = [
        m.get("others_cpu")
        for r in rounds
        for m in [
            *(x for row in r["prefill"].values() for x in row.values()),
            r.get("llama_depth"),
            r.get("ttft"),
        ]
        if m and m.get("others_cpu") is not None
    ]
    if busy and max(busy) > a.max_others:
        lines += [
            "",
            f"**Noisy run:** other processes used up to {max(busy):.0%} of the CPUs during the "
            "measurements (both engines run 2 threads on 2 cores). Re-run on an idle machine.",
        ]
    if note:
        lines += ["", f"**colibri:** {note}"]

    def cell(m: dict | None, key: str, d: int) -> str:
        return "–" if not m else f"{m[key]:.{d}f} ({m['run_s']:.0f}s)"

    lines += [
        "",
        "<details><summary>per-round samples (tok/s, and the wall time of the run kept, with its "
        "warm-up and model load)</summary>",
        "",
        "| round | order | measurement | colibri | llama.cpp | colibri / llama.cpp |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        rows = [(f"prefill {n}", row.get("colibri"), row.get("llama"), "prefill_tok_s", 1)
                for n, row in ((int(k), v) for k, v in r["prefill"].items())]  # fmt: skip
        if depth:
            rows.append(
                (f"decode after {depth}", r.get("colibri_depth"), r.get("llama_depth"),
                 "decode_tok_s", 2)
            )  # fmt: skip
        for what, c, ll, key, d in rows:
            ratio = f"{c[key] / ll[key]:.2f}" if c and ll else "–"
            lines.append(
                f"| {i + 1} | {r['order']} | {what} | {cell(c, key, d)} | {cell(ll, key, d)} "
                f"| {ratio} |"
            )
        if r.get("ttft"):
            t = r["ttft"]
            lines.append(
                f"| {i + 1} | {r['order']} | TTFT, s (engine / server) | "
                f"{t['engine_ttft_s']:.2f} / {t['server_ttft_s']:.2f} ({t['run_s']:.0f}s) | "
                f"| {t['ratio']:.3f} |"
            )
    lines += ["", "</details>", ""]
    return "\n".join(lines)
