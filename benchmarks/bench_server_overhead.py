"""What the HTTP gateway costs per token: the running server vs the engine alone, same model.

Starts `colibri serve` on a loopback port (default: the built-in model, whose tokens are so cheap
that the gateway's share is as visible as it can be), then alternates rounds of: a greedy
generation of N tokens through the engine in-process, a JSON chat completion and an SSE-streamed
one through the server. Prints medians, the server/engine throughput ratios and the gateway's
time per token. Run: `just bench-server` (never part of `just test`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

import httpx

from colibri.chat.families import detect_family
from colibri.chat.render import render_chat
from colibri.chat.template import ChatTemplate
from colibri.demo.builtin import builtin_model_dir
from colibri.runtime.engine import Engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="model dir (default: built-in)")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = args.model or str(builtin_model_dir())
    proc = subprocess.Popen(
        [sys.executable, "-m", "colibri", "serve", "--port", "0", "--model", model,
         "--threads", str(args.threads), "--model-id", "m"],
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
    finally:
        proc.terminate()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
