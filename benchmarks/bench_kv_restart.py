"""Time to first token for a long prompt: cold, versus after a server restart with a warm slot
file (issue 7's benchmark; target: warm <= 5% of cold).

Starts `colibri serve` with a fresh KV directory, sends a ~N-token conversation to slot 0 and
measures the time to the first streamed token (cold: the whole prompt is prefilled), stops the
server, starts it again on the same KV directory, sends the same conversation plus a short new
user turn and measures again (warm: only the new turn is prefilled). Rounds alternate on fresh
directories; prints medians and the warm/cold ratio as JSON. Run: `just bench-kv`.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time

import httpx


def start(model: str | None, kv_dir: str, threads: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "colibri", "serve", "--port", "0", "--kv-dir", kv_dir,
           "--threads", str(threads), "--model-id", "m"]  # fmt: skip
    if model:
        cmd += ["--model", model]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:  # type: ignore[union-attr]
        m = re.search(r"on (http://\S+) ", line)
        if m:
            return proc, m.group(1)
    raise RuntimeError("server did not start")


def ttft(url: str, messages: list[dict]) -> tuple[float, int]:
    """Seconds to the first content chunk, and the cached tokens the reply reports."""
    body = {"model": "m", "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}, "cache_slot": 0}  # fmt: skip
    t0 = time.perf_counter()
    first = None
    cached = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
            for ch in chunk.get("choices", []):
                if ch["delta"].get("content") and first is None:
                    first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0), cached


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model dir (default: built-in)")
    ap.add_argument("--prompt-chars", type=int, default=1900, help="size of the long turn")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa " * 1000)[
        : args.prompt_chars
    ]
    convo = [{"role": "user", "content": words}]
    cold, warm, cached = [], [], []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as kv:
            proc, url = start(args.model, kv, args.threads)
            try:
                t, _ = ttft(url, convo)
                cold.append(t)
            finally:
                proc.terminate()
                proc.wait()
            proc, url = start(args.model, kv, args.threads)
            try:
                t, c = ttft(url, [*convo, {"role": "assistant", "content": "Noted."},
                                  {"role": "user", "content": "Go on."}])  # fmt: skip
                warm.append(t)
                cached.append(c)
            finally:
                proc.terminate()
                proc.wait()
    result = {
        "prompt_chars": args.prompt_chars,
        "cold_ttft_s": statistics.median(cold),
        "warm_ttft_s": statistics.median(warm),
        "warm_over_cold": statistics.median(warm) / statistics.median(cold),
        "cached_tokens_after_restart": cached,
        "cold_runs": cold,
        "warm_runs": warm,
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
