"""One measurement each: a command run to completion with its peak RSS and the CPU others took
meanwhile, the machine's read bandwidth (bandwidth.c), llama-bench on the Q4_0 model (with and
without a context depth, and prefill alone at one prompt length), ``colibri bench`` on the int4
model, and the time to first token through ``colibri serve`` vs the engine alone
(bench_server_overhead.py --ttft-tokens)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from .common import HERE
from .machine import cpu_times, others_cpu
from .prepare import Paths


def run_with_rss(cmd: list, timeout: float) -> dict:
    """Run cmd to completion, reaping it with wait4.

    Returns rc, out, err, the child's own peak RSS (rss_mb) and the share of the
    CPUs that other processes used meanwhile (others_cpu: the machine's busy time
    minus the child's own CPU time, over the wall time of all CPUs).
    """
    import tempfile

    cmd = [str(c) for c in cmd]
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        c0 = cpu_times()
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True)
        deadline = time.monotonic() + timeout
        rc, ru = None, None
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rc = os.waitstatus_to_exitcode(status)
                proc.returncode = rc
                break
            if time.monotonic() > deadline:
                proc.kill()
                _, status, ru = os.wait4(proc.pid, 0)
                proc.returncode = rc = -9
                break
            time.sleep(0.05)
        c1 = cpu_times()
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    if rc == -9:
        err += f"\n(killed after {timeout:.0f}s)"
    own = (ru.ru_utime + ru.ru_stime) if ru else 0.0
    return {
        "rc": rc,
        "out": out,
        "err": err,
        "rss_mb": ru.ru_maxrss / 1024.0 if ru else 0.0,
        "others_cpu": others_cpu(c0, c1, own),
    }


def last_json_object(text: str):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    try:
        return json.loads(text)
    except ValueError:
        return None


def measure_bandwidth(p: Paths, threads: int, size_mib: int, passes: int) -> dict:
    r = run_with_rss([p.bandwidth, "-t", threads, "-s", size_mib, "-r", passes, "--json"], 300)
    obj = last_json_object(r["out"]) if r["rc"] == 0 else None
    if not obj:
        raise SystemExit(f"bandwidth probe failed ({r['rc']}): {r['err'].strip()[-2000:]}")
    # best pass: interference only ever lowers bandwidth, and the ceiling is what the
    # memory system can deliver (each pass streams the whole buffer, 8x the caches)
    # (the median pass is kept too: a second, less optimistic ceiling)
    return {
        "gb_s": obj["max_gb_s"],
        "median_gb_s": obj["median_gb_s"],
        "others_cpu": r["others_cpu"],
        "raw": obj,
    }


def median_ts(row: dict) -> float:
    """Median over llama-bench's repetitions (its avg_ts is the mean)."""
    samples = row.get("samples_ts") or [row["avg_ts"]]
    return float(statistics.median(samples))


def run_llama_bench(p: Paths, a, args: list, timeout: int) -> tuple[list[dict], dict]:
    """llama-bench on the Q4_0 model with `args` (its test sizes): its JSON rows and the run."""
    cmd = [p.llama_bench, "-m", p.gguf_q4, "-t", a.threads, *args, "-r", a.reps, "-o", "json"]
    r = run_with_rss(cmd, timeout)
    if r["rc"] != 0:
        raise SystemExit(f"llama-bench failed ({r['rc']}):\n{r['err'].strip()[-3000:]}")
    try:
        return json.loads(r["out"]), r
    except ValueError:
        raise SystemExit(f"could not parse llama-bench JSON:\n{r['out'][-2000:]}") from None


def first_row(rows: list[dict], field: str, r: dict) -> dict:
    """llama-bench's first JSON row with a positive `field` (n_prompt or n_gen)."""
    for row in rows:
        if row.get(field, 0) > 0:
            return row
    raise SystemExit(f"unexpected llama-bench output:\n{r['out'][-2000:]}")


def measure_llama(p: Paths, a) -> dict:
    rows, r = run_llama_bench(p, a, ["-p", a.prompt_tokens, "-n", a.gen_tokens], 900)
    res = {"peak_rss_mb": r["rss_mb"], "others_cpu": r["others_cpu"]}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            res["prefill_tok_s"] = median_ts(row)
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            res["decode_tok_s"] = median_ts(row)
    if "prefill_tok_s" not in res or "decode_tok_s" not in res:
        raise SystemExit(f"unexpected llama-bench output:\n{r['out'][-2000:]}")
    return res


def long_timeout(tokens: int, reps: int) -> float:
    """Seconds a run prefilling `tokens` (its warm-up and `reps` timed passes) may take:
    enough for 5 tok/s, at least 30 minutes."""
    return max(1800.0, 900 + (reps + 1) * tokens / 5)


def measure_llama_depth(p: Paths, a, depth: int | None = None) -> dict:
    """Decode after `depth` (default --depth) tokens of context (llama-bench fills the depth
    once, untimed)."""
    depth = depth or a.depth
    rows, r = run_llama_bench(
        p, a, ["-p", 0, "-n", a.gen_tokens, "-d", depth], long_timeout(depth, 1)
    )
    row = first_row(rows, "n_gen", r)
    return {
        "decode_tok_s": median_ts(row),
        "peak_rss_mb": r["rss_mb"],
        "others_cpu": r["others_cpu"],
    }


def measure_llama_prefill(p: Paths, a, tokens: int) -> dict:
    """Prefill alone of a `tokens`-token prompt (llama-bench -p N -n 0, after its untimed
    warm-up pass of the same length)."""
    rows, r = run_llama_bench(p, a, ["-p", tokens, "-n", 0], long_timeout(tokens, a.reps))
    row = first_row(rows, "n_prompt", r)
    return {
        "prefill_tok_s": median_ts(row),
        "peak_rss_mb": r["rss_mb"],
        "others_cpu": r["others_cpu"],
        "flash_attn": row.get("flash_attn"),
    }


def measure_colibri(
    exe: Path, p: Paths, a, prompt_tokens: int | None = None, gen_tokens: int | None = None
) -> dict:
    """`colibri bench` (an untimed warm-up pass of the same prompt length first); its decode
    runs after the prompt, so a `prompt_tokens` of --depth measures decode at that depth, and
    a `gen_tokens` of 0 only prefill."""
    prompt_tokens = prompt_tokens or a.prompt_tokens
    cmd = [
        exe,
        "bench",
        "--model",
        p.colibri_model,
        "--threads",
        a.threads,
        "--prompt-tokens",
        prompt_tokens,
        "--gen-tokens",
        a.gen_tokens if gen_tokens is None else gen_tokens,
        "--repeat",
        a.reps,
        "--json",
    ]
    r = run_with_rss(cmd, long_timeout(prompt_tokens, a.reps))
    obj = last_json_object(r["out"]) if r["rc"] == 0 else None
    if not obj or "decode_tok_s" not in obj or "prefill_tok_s" not in obj:
        msg = (r["err"] or r["out"]).strip()[-3000:]
        raise RuntimeError(f"colibri bench failed (exit {r['rc']}):\n{msg}")
    return {
        "prefill_tok_s": float(obj["prefill_tok_s"]),
        "decode_tok_s": float(obj["decode_tok_s"]),
        "peak_rss_mb": float(obj.get("peak_rss_mb") or r["rss_mb"]),
        "kv_bytes_per_token": obj.get("kv_bytes_per_token"),
        "others_cpu": r["others_cpu"],
        "raw": obj,
    }


def measure_ttft(py: Path, p: Paths, a, tokens: int, server_first: bool) -> dict:
    """Time to first token for a fresh `tokens`-token prompt, through `colibri serve`
    (/v1/completions, streamed) vs the engine alone, from bench_server_overhead.py run by
    colibri's own Python (`py`)."""
    cmd = [
        py,
        HERE / "bench_server_overhead.py",
        "--model",
        p.colibri_model,
        "--threads",
        a.threads,
        "--ttft-tokens",
        tokens,
        "--rounds",
        a.ttft_reps,
        *(["--server-first"] if server_first else []),
    ]
    r = run_with_rss(cmd, 2 * long_timeout(tokens, a.ttft_reps))
    obj = last_json_object(r["out"]) if r["rc"] == 0 else None
    if not obj or "server_ttft_s" not in obj:
        msg = (r["err"] or r["out"]).strip()[-3000:]
        raise RuntimeError(f"bench_server_overhead.py --ttft-tokens failed ({r['rc']}):\n{msg}")
    return {**obj, "others_cpu": r["others_cpu"]}
