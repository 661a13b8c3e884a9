"""What the HTTP gateway costs per token: the running server vs the engine alone, same model.

Starts `colibri serve` on a loopback port (default: the built-in model, whose tokens are so cheap
that the gateway's share is as visible as it can be), then alternates rounds of: a greedy
generation of N tokens through the engine in-process, a JSON chat completion and an SSE-streamed
one through the server. Prints medians, the server/engine throughput ratios and the gateway's
time per token. Run: `just bench-server` (never part of `just test`).

With --ttft-tokens N it measures instead the time to first token of a fresh N-token prompt
(random words, a new one each round, so no KV slot shares a prefix with it): the engine
in-process (generate, first token) against a streamed /v1/completions request (to its first
data chunk), the same prompt for both, in alternating order; prints one JSON line
(bench_vs_llamacpp.py --long runs it).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import string
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from colibri.chat.families import detect_family
from colibri.chat.render import render_chat
from colibri.chat.template import ChatTemplate
from colibri.demo.builtin import builtin_model_dir
from colibri.runtime.engine import Engine


@contextmanager
def serving(model: str, threads: int, *extra: str) -> Iterator[str]:
    """`colibri serve` on a free loopback port for as long as the block runs: its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "colibri", "serve", "--port", "0", "--model", model,
         "--threads", str(threads), "--model-id", "m", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = None
        for line in proc.stdout:  # type: ignore[union-attr]
            m = re.search(r"on (http://\S+) ", line)
            if m:
                url = m.group(1)
                break
        assert url, "server did not start"
        yield url
    finally:
        proc.terminate()
        proc.wait()


def random_prompt(engine: Engine, tokens: int, seed: int) -> tuple[str, list[int]]:
    """About `tokens` tokens of seeded random words: the text and its ids as the server's
    /v1/completions tokenizes it."""
    rng = random.Random(seed)
    letters = string.ascii_lowercase
    words = " ".join("".join(rng.choices(letters, k=rng.randint(2, 9))) for _ in range(tokens))
    text = engine.detokenize(engine.tokenize(words, add_special_tokens=True)[:tokens])
    return text, engine.tokenize(text, add_special_tokens=True)


def engine_ttft(engine: Engine, ids: list[int]) -> float:
    t = time.perf_counter()
    stream = engine.generate(ids, 1)
    next(stream)
    dt = time.perf_counter() - t
    stream.close()
    return dt


def server_ttft(http: httpx.Client, url: str, text: str, n_ids: int) -> float:
    """Seconds from sending a streamed completion to its first data chunk (the prefill's
    progress lines are SSE comments); checks that the server counted `n_ids` prompt tokens."""
    body = {"model": "m", "prompt": text, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    t = time.perf_counter()
    dt = None
    usage = None
    with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            dt = dt or time.perf_counter() - t
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"server error: {chunk['error']}")
            usage = chunk.get("usage") or usage
    assert dt is not None, "no data chunk"
    if usage and usage["prompt_tokens"] != n_ids:
        raise RuntimeError(f"server saw {usage['prompt_tokens']} prompt tokens, not {n_ids}")
    return dt


def ttft(model: str, threads: int, tokens: int, rounds: int, server_first: bool) -> dict:
    """Engine alone vs through the server, time to first token of fresh `tokens`-token prompts."""
    with serving(model, threads, "--no-kv-persist", "--quiet") as url:
        engine = Engine(model, threads=threads)
        times: dict[str, list[float]] = {"engine": [], "server": []}
        with httpx.Client(timeout=None) as http:
            warm_text, warm_ids = random_prompt(engine, 128, 0)  # untimed: both sides warm
            engine_ttft(engine, warm_ids)
            server_ttft(http, url, warm_text, len(warm_ids))
            for i in range(rounds):
                text, ids = random_prompt(engine, tokens, i + 1)
                server_now = server_first == (i % 2 == 0)
                sides = ("server", "engine") if server_now else ("engine", "server")
                for side in sides:
                    times[side].append(
                        engine_ttft(engine, ids)
                        if side == "engine"
                        else server_ttft(http, url, text, len(ids))
                    )
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "ttft_tokens": len(ids),
        "engine_ttft_s": med["engine"],
        "server_ttft_s": med["server"],
        "ratio": med["server"] / med["engine"],
        "engine_runs": times["engine"],
        "server_runs": times["server"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model dir (default: built-in)")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--ttft-tokens",
        type=int,
        default=0,
        help="measure the time to first token of a prompt this long instead (see above)",
    )
    ap.add_argument("--server-first", action="store_true", help="--ttft-tokens: server first")
    args = ap.parse_args()
    model = args.model or str(builtin_model_dir())
    if args.ttft_tokens:
        result = ttft(model, args.threads, args.ttft_tokens, args.rounds, args.server_first)
        print(json.dumps(result))
        return 0
    with serving(model, args.threads) as url:
        engine = Engine(model, threads=args.threads)
        messages = [{"role": "user", "content": "Hello"}]
        family = detect_family(engine.info["architecture"], engine.info["chat_template"])
        prompt = render_chat(
            ChatTemplate(engine.info["chat_template"]), family, messages, enable_thinking=False
        ).text
        ids = engine.tokenize(prompt)
        body = {"model": "m", "messages": messages, "max_tokens": args.tokens,
                "stop": ["\u0000never\u0000"]}  # fmt: skip
        rates: dict[str, list[float]] = {"engine": [], "json": [], "stream": []}
        with httpx.Client(timeout=600) as http:
            for _ in range(args.rounds):
                t = time.perf_counter()
                n = sum(1 for _ in engine.generate(ids, args.tokens))
                rates["engine"].append(n / (time.perf_counter() - t))
                for mode in ("json", "stream"):
                    t = time.perf_counter()
                    r = http.post(
                        url + "/v1/chat/completions", json={**body, "stream": mode == "stream"}
                    )
                    r.raise_for_status()
                    dt = time.perf_counter() - t
                    if mode == "json":
                        n = r.json()["usage"]["completion_tokens"]
                    rates[mode].append(n / dt)
        med = {k: statistics.median(v) for k, v in rates.items()}
        result = {
            "tokens": args.tokens,
            "engine_tok_s": med["engine"],
            "json_tok_s": med["json"],
            "stream_tok_s": med["stream"],
            "json_ratio": med["json"] / med["engine"],
            "stream_ratio": med["stream"] / med["engine"],
            "stream_overhead_ms_per_token": 1e3 * (1 / med["stream"] - 1 / med["engine"]),
        }
        print(json.dumps(result, indent=2))
        return 0


if __name__ == "__main__":
    sys.exit(main())
