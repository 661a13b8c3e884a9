#!/usr/bin/env python3
"""Concurrent decode through the server: aggregate and per-stream tok/s of 1, 2, 4 and 8
streams on the OLMoE-1B-7B-shaped int4 model of `bench_vs_llamacpp.py` (same cache), with
every expert resident and at a 25% expert budget, against llama-server (`--parallel N -cb`,
Q4_0 --pure, same weights) in the same run.

Each measurement sends N /v1/completions requests at once (different prompts of ~32 tokens,
greedy, exactly `--tokens` tokens each: the random model's tokens are mostly text-less, so no
stream timestamps; llama-server is told `ignore_eos`). Aggregate tok/s = all requests' tokens /
the wall time from the first start to the last end; a stream's tok/s = its tokens / its own
time (both include the short prompt's prefill, alike for both engines). Rounds alternate colibri
and llama-server (the machine drifts); medians are reported.

Issue 36's targets: 4 streams >= 2.5x the single-stream aggregate resident, >= 3x at the 25%
budget; no stream below 50% of the single-stream speed at 4 streams.

    python3 benchmarks/bench_concurrent.py                 # 16-layer model, 3 rounds
    python3 benchmarks/bench_concurrent.py --layers 4      # the --long mode's 4-layer model
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench_vs_llamacpp as base  # noqa: E402  (setup steps and idle detection)
from vs_llamacpp.common import log, run  # noqa: E402
from vs_llamacpp.prepare import LLAMA_CMAKE_FLAGS, LONG_CONTEXT, MODEL_CONTEXT  # noqa: E402

STREAMS = (1, 2, 4, 8)


def prompt(i: int) -> str:
    words = ["river", "stone", "light", "market", "engine", "garden", "winter", "signal"]
    return " ".join(words[(i * 3 + k * 5) % len(words)] + str(k * 7 + i) for k in range(16))


def ensure_llama_server(p: base.Paths) -> Path:
    """llama-server from the bench's llama.cpp tree (the same flags, its server turned on)."""
    exe = p.llama_build / "bin" / "llama-server"
    if exe.exists():
        return exe
    log("[setup] llama-server (same tree and flags as llama-bench)")
    flags = [f for f in LLAMA_CMAKE_FLAGS if not f.startswith("-DLLAMA_BUILD_SERVER")]
    run(
        ["cmake", "-S", p.llama_src, "-B", p.llama_build, *flags, "-DLLAMA_BUILD_SERVER=ON"],
        nice=True,
        log_file=p.logs / "llama-server-cmake.log",
    )
    run(
        ["cmake", "--build", p.llama_build, "-j", str(os.cpu_count() or 2), "--target",
         "llama-server"],
        nice=True,
        log_file=p.logs / "llama-server-build.log",
    )  # fmt: skip
    return exe


@contextmanager
def server(cmd: list[str], ready: str, url: str, timeout: float = 600) -> Iterator[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            lines.append(line)
            m = re.search(ready, line)
            if m:
                url = url or m.group(1)
                break
            if time.monotonic() > deadline:
                break
        else:
            raise SystemExit("server exited:\n" + "".join(lines[-30:]))
        threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
        # llama-server logs its address before the model is loaded: wait for /health.
        for _ in range(int(timeout)):
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def one_request(url: str, body: dict, out: list[tuple[float, float, int]]) -> None:
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=1800)
    r.raise_for_status()
    out.append((t0, time.perf_counter(), int(r.json()["usage"]["completion_tokens"])))


def measure(url: str, n: int, tokens: int, salt: int, extra: dict) -> dict:
    """N requests at once: aggregate tok/s (all their tokens over the wall time from the first
    start to the last end) and each one's tok/s (its tokens over its own time)."""
    results: list[list[tuple[float, float, int]]] = [[] for _ in range(n)]
    threads = []
    for i in range(n):
        body = {"model": "m", "prompt": prompt(salt * 8 + i), "max_tokens": tokens,
                "temperature": 0, **extra}  # fmt: skip
        threads.append(threading.Thread(target=one_request, args=(url, body, results[i])))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r[0] for r in results if r]
    if len(done) != n or any(k != tokens for _, _, k in done):
        raise SystemExit(f"requests ended early or failed: {done}")
    wall = max(e for _, e, _ in done) - min(s for s, _, _ in done)
    return {
        "aggregate": n * tokens / wall,
        "per_stream": [k / (e - s) for s, e, k in done],
        "wall_s": wall,
    }


def colibri_cmd(model: Path, threads: int, ram_gb: float | None) -> list[str]:
    """The server; ``ram_gb``: its expert cache (the --ram-gb budget is that plus the model's
    resident weights and KV slots, which come first)."""
    cmd = [sys.executable, "-m", "colibri", "serve", "--model", str(model), "--port", "0",
           "--threads", str(threads), "--kv-slots", str(max(STREAMS)), "--no-kv-persist",
           "--model-id", "m", "--quiet"]  # fmt: skip
    if ram_gb is None:
        return cmd
    from colibri.runtime.budget import plan_model

    fixed = plan_model(model, max(STREAMS), None).fixed
    return cmd + ["--ram-gb", f"{ram_gb + fixed / 1e9:.6f}"]


def llama_cmd(exe: Path, gguf: Path, threads: int, n: int, port: int) -> list[str]:
    # Each of the n sequences gets the context a colibri slot has (-c is shared by them).
    return [str(exe), "-m", str(gguf), "-t", str(threads), "--parallel", str(n), "-cb",
            "-c", str(n * 1024), "--port", str(port), "--host", "127.0.0.1",
            "--no-webui"]  # fmt: skip


def fmt_row(name: str, n: int, runs: list[dict], single: float | None) -> str:
    agg = statistics.median(r["aggregate"] for r in runs)
    slowest = statistics.median(min(r["per_stream"]) for r in runs)
    ratio = f"{agg / single:.2f}x" if single else "—"
    low = f"{slowest / single:.0%}" if single else "—"
    return f"| {name} | {n} | {agg:.1f} | {ratio} | {slowest:.1f} | {low} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per stream")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.25, help="expert RAM share, 0..1")
    ap.add_argument("--no-llama", action="store_true", help="colibri only")
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--wait-idle", type=float, default=120)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "concurrent-latest.md")
    a = ap.parse_args(argv)
    cache = a.cache or Path(
        os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
    )
    # The 4-layer model exists at the long mode's context only.
    p = base.Paths(cache, a.layers, MODEL_CONTEXT if a.layers == 16 else LONG_CONTEXT)
    model = base.ensure_colibri_model(p, None if a.layers == 16 else p.colibri_model)
    manifest = json.loads((model / "manifest.json").read_text())
    experts_bytes = (model / manifest["experts"]["file"]).stat().st_size
    budget_gb = a.budget * experts_bytes / 1e9
    llama = None if a.no_llama else ensure_llama_server(p)
    placements = {"resident": None, f"{a.budget:.0%} budget": budget_gb}
    results: dict[tuple[str, int], list[dict]] = {}
    for r in range(a.rounds):
        order = ["colibri", "llama"] if r % 2 == 0 else ["llama", "colibri"]
        for engine in order:
            if engine == "llama":
                if llama is None:
                    continue
                for n in STREAMS:
                    port = 18800 + n
                    cmd = llama_cmd(llama, p.gguf_q4, a.threads, n, port)
                    with server(cmd, r"listening on", f"http://127.0.0.1:{port}") as url:
                        eos = {"ignore_eos": True}
                        measure(url, n, 8, 99, eos)  # warm-up
                        base.wait_for_idle(a.wait_idle, 0.15)
                        res = measure(url, n, a.tokens, r, eos)
                        results.setdefault(("llama-server", n), []).append(res)
                        log(f"round {r + 1} llama-server n={n}: {res['aggregate']:.1f} tok/s")
                continue
            for name, ram in placements.items():
                cmd = colibri_cmd(model, a.threads, ram)
                with server(cmd, r"on (http://\S+) ", "") as url:
                    measure(url, 1, 8, 99, {})  # warm-up: page cache, expert cache
                    for n in STREAMS:
                        base.wait_for_idle(a.wait_idle, 0.15)
                        res = measure(url, n, a.tokens, r, {})
                        results.setdefault((f"colibri {name}", n), []).append(res)
                        log(f"round {r + 1} colibri {name} n={n}: {res['aggregate']:.1f} tok/s")
    rows = []
    verdicts = []
    for name in [*(f"colibri {k}" for k in placements), "llama-server"]:
        if (name, 1) not in results:
            continue
        single = statistics.median(x["aggregate"] for x in results[(name, 1)])
        for n in STREAMS:
            rows.append(fmt_row(name, n, results[(name, n)], single))
        four = statistics.median(x["aggregate"] for x in results[(name, 4)]) / single
        slow = statistics.median(min(x["per_stream"]) for x in results[(name, 4)]) / single
        if name.startswith("colibri"):
            target = 2.5 if name.endswith("resident") else 3.0
            verdicts.append(
                f"{name}: 4 streams {four:.2f}x one (target >= {target}: "
                f"{'met' if four >= target else 'missed'}); slowest stream {slow:.0%} of one "
                f"(target >= 50%: {'met' if slow >= 0.5 else 'missed'})"
            )
    if ("llama-server", 4) in results and ("colibri resident", 4) in results:
        c4 = statistics.median(x["aggregate"] for x in results[("colibri resident", 4)])
        l4 = statistics.median(x["aggregate"] for x in results[("llama-server", 4)])
        verdicts.append(f"4 streams, colibri resident / llama-server: {c4 / l4:.2f}x")
    out = "\n".join(
        [
            f"## Concurrent decode: {model.name}, {a.threads} threads",
            "",
            f"{a.rounds} rounds, {a.tokens} tokens per stream after a ~32-token prompt, greedy; "
            "tok/s from request start to end (medians). Budget: "
            f"{budget_gb:.2f} GB of {experts_bytes / 1e9:.2f} GB of experts.",
            "",
            "| engine | streams | aggregate tok/s | vs 1 stream | slowest stream tok/s "
            "| slowest vs 1 |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            *(f"- {v}" for v in verdicts),
            "",
            time.strftime("%Y-%m-%d %H:%M"),
            "",
        ]
    )
    print(out)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
