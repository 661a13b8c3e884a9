"""Evaluation of the demo model through the real engine: exact-match accuracy per task.

    python -m colibri.demo.eval --model DIR [--n 200] [--seed 7] [--json OUT]
    python -m colibri.demo.eval --model DIR --n 30 --preamble-tokens 12000   # long prompts

Prompts are held-out items of :mod:`colibri.demo.data` (numbers, phrasings and cities training
never saw), rendered with the model's own chat template and decoded greedily until one of the
model's EOS ids. An output counts only if its whole shape is right: with thinking on it must open
with ``\\n<think>…</think>``, an answer must end with ``<|user|>`` (or ``<|endoftext|>``), a tool
call with ``<|observation|>``.

With ``--preamble-tokens N`` the same items are asked at the end of a ~N-token agent preamble
(``colibri.demo.preamble``: a coding agent's instructions and tool catalog, the three demo tools
declared among the agent's), so the tasks measure what an agent's first turn needs; each
``--preamble-group`` consecutive items of a task share one preamble, whose prefill the engine's
KV slot reuses.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from colibri.chat.template import ChatTemplate
from colibri.demo import data as demo_data
from colibri.demo import preamble as demo_preamble

DEFAULT_MODEL = Path(__file__).parent / "model"
ANSWER_ENDS = ("<|user|>", "<|endoftext|>")
_CALL = re.compile(
    r"<tool_call>(?P<name>[^\n<]+)(?P<args>(?:\n<arg_key>[^<]*</arg_key>\n<arg_value>.*?</arg_value>)*)"
    r"\n</tool_call>",
    re.DOTALL,
)
_ARG = re.compile(r"\n<arg_key>([^<]*)</arg_key>\n<arg_value>(.*?)</arg_value>", re.DOTALL)


def split_output(text: str, thinking: bool) -> tuple[str | None, str] | None:
    """(reasoning, rest) of a generated text, or None if the think block is malformed.
    With thinking off the prompt already closed the think block, so there is no reasoning."""
    if not thinking:
        return None, text
    if not text.startswith("\n<think>") or "</think>" not in text:
        return None
    reasoning, rest = text[len("\n<think>") :].split("</think>", 1)
    return reasoning, rest


def parse_call(rest: str) -> dict[str, Any] | None:
    """The single tool call ``rest`` consists of (GLM-4.5 newline style), or None."""
    if not rest.endswith("<|observation|>"):
        return None
    body = rest[: -len("<|observation|>")]
    m = _CALL.fullmatch(body.removeprefix("\n"))
    if m is None or not body.startswith("\n"):
        return None
    return {"name": m.group("name"), "arguments": dict(_ARG.findall(m.group("args")))}


def parse_answer(rest: str) -> str | None:
    """The plain answer ``rest`` consists of (leading newline, then text, then an end marker)."""
    for end in ANSWER_ENDS:
        if rest.endswith(end):
            body = rest[: -len(end)]
            if not body.startswith("\n"):
                return None
            body = body[1:]
            if "<" in body and re.search(r"<\|?/?[a-z_]+\|?>", body):
                return None  # a stray marker inside the answer
            return body.strip()
    return None


def score(item: dict, text: str) -> bool:
    parts = split_output(text, item["thinking"])
    if parts is None:
        return False
    _, rest = parts
    expect = item["expect"]
    if "call" in expect:
        return parse_call(rest) == expect["call"]
    answer = parse_answer(rest)
    if answer is None:
        return False
    if "answer" in expect:
        return answer == expect["answer"]
    return all(s in answer for s in expect["contains"])


def _count(tallies: dict[str, list[int]], key: str, ok: bool) -> None:
    """One more scored item under ``key``: ``tallies[key]`` is [correct, n]."""
    tally = tallies.setdefault(key, [0, 0])
    tally[0] += ok
    tally[1] += 1


def evaluate(
    model_dir: str | Path = DEFAULT_MODEL,
    n_per_task: int = 200,
    seed: int = demo_data.EVAL_SEED,
    tasks: list[str] | None = None,
    threads: int | None = None,
    max_tokens: int = 96,
    preamble_tokens: int = 0,
    preamble_group: int = 10,
) -> dict:
    """Accuracy per task on ``n_per_task`` held-out prompts (half with thinking on).

    Returns ``{"model": dir, "quantization": ..., "tasks": {task: {"accuracy", "n", "correct",
    "accuracy_thinking", "accuracy_no_thinking", "failures": [first few {"prompt", "output",
    "expect"}]}}, "seconds": ...}``; the tool tasks add ``"by_source": {source: {"correct",
    "n", "accuracy"}}``, split by where the city comes from (real, generated, no city), and
    the tool-call task ``"by_tool"`` in the same shape, split by the tool the prompt asks for
    (a wrong tool shows there, a badly copied city in ``by_source``).

    With ``preamble_tokens`` > 0, every prompt opens with an agent preamble of about that many
    tokens (``preamble.long_eval_items``); the result then has ``"preamble_tokens"``, the
    mean length of the preambles (their rendered system turn), and ``"prompt_tokens_max"``.
    """
    from colibri.runtime.engine import Engine

    engine = Engine(model_dir, threads=threads)
    source = engine.info.get("chat_template")
    if not source:
        raise RuntimeError(f"{model_dir}: the model has no chat template")
    template = ChatTemplate(source)
    stops = engine.eos_token_ids
    t0 = time.time()
    out: dict[str, Any] = {
        "model": str(model_dir),
        "quantization": engine.info["quantization"],
        "tasks": {},
    }

    def count(pre: dict) -> int:
        system = [{"role": "system", "content": pre["system"]}]
        return len(
            engine.tokenize(
                template.render(system, add_generation_prompt=False, tools=pre["tools"])
            )
        )

    pre_lens: list[int] = []
    longest = 0
    for task in tasks or demo_data.EVAL_TASKS:
        if preamble_tokens > 0:
            items = demo_preamble.long_eval_items(
                task, n_per_task, seed, preamble_tokens, count, preamble_group
            )
        else:
            items = demo_data.eval_items(task, n_per_task, seed)
        by_mode = {True: [0, 0], False: [0, 0]}  # thinking -> [correct, n]
        by_source: dict[str, list[int]] = {}  # city source -> [correct, n] (tool tasks)
        by_tool: dict[str, list[int]] = {}  # expected tool -> [correct, n] (tool calls)
        failures = []
        for item in items:
            prompt = template.render(
                item["messages"],
                add_generation_prompt=True,
                tools=item["tools"],
                enable_thinking=item["thinking"],
            )
            ids = engine.tokenize(prompt)
            longest = max(longest, len(ids))
            room = min(max_tokens, int(engine.info["context_length"]) - len(ids))
            text = ""
            if room > 0:
                # Long prompts share their preamble with the items around them: KV slot 0
                # keeps it (only the rest of the prompt is prefilled).
                slot = 0 if preamble_tokens > 0 else None
                text = engine.detokenize(
                    engine.generate(ids, room, stop_token_ids=stops, slot=slot)
                )
            if "preamble_tokens" in item:
                pre_lens.append(item["preamble_tokens"])
            ok = score(item, text)
            by_mode[item["thinking"]][0] += ok
            by_mode[item["thinking"]][1] += 1
            if "source" in item:
                _count(by_source, item["source"], ok)
            if "call" in item["expect"]:
                _count(by_tool, item["expect"]["call"]["name"], ok)
            if not ok and len(failures) < 10:
                failures.append(
                    {
                        "prompt": item["messages"][-1]["content"],
                        "output": text,
                        "thinking": item["thinking"],
                        "expect": item["expect"],
                    }
                )
        correct = by_mode[True][0] + by_mode[False][0]
        out["tasks"][task] = {
            "accuracy": correct / max(1, len(items)),
            "n": len(items),
            "correct": correct,
            "accuracy_thinking": by_mode[True][0] / max(1, by_mode[True][1]),
            "accuracy_no_thinking": by_mode[False][0] / max(1, by_mode[False][1]),
            "failures": failures,
        }
        for key, tallies in (("by_source", by_source), ("by_tool", by_tool)):
            if tallies:
                out["tasks"][task][key] = {
                    k: {"correct": c, "n": n, "accuracy": c / n} for k, (c, n) in tallies.items()
                }
    if pre_lens:
        out["preamble_tokens"] = sum(pre_lens) / len(pre_lens)
        out["prompt_tokens_max"] = longest
    out["seconds"] = time.time() - t0
    return out


def format_table(result: dict) -> str:
    head = f"{result['model']} ({result['quantization']})"
    if "preamble_tokens" in result:
        head += (
            f", after an agent preamble of {result['preamble_tokens']:.0f} tokens on average"
            f" (longest prompt {result['prompt_tokens_max']})"
        )
    lines = [head, "task               accuracy     n   thinking on / off"]
    for task, r in result["tasks"].items():
        lines.append(
            f"{task:<18} {r['accuracy'] * 100:7.1f}% {r['n']:5d}   "
            f"{r['accuracy_thinking'] * 100:5.1f}% / {r['accuracy_no_thinking'] * 100:5.1f}%"
        )
        for key in ("by_source", "by_tool"):
            for part, b in sorted(r.get(key, {}).items()):
                lines.append(f"  {part:<16} {b['accuracy'] * 100:7.1f}% {b['n']:5d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m colibri.demo.eval", description=__doc__)
    ap.add_argument("--model", default=str(DEFAULT_MODEL), help="colibri model directory")
    ap.add_argument("--n", type=int, default=200, help="prompts per task")
    ap.add_argument("--seed", type=int, default=demo_data.EVAL_SEED)
    ap.add_argument("--tasks", nargs="*", choices=demo_data.EVAL_TASKS)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--json", help="also write the full result (with failures) here")
    ap.add_argument("--show-failures", action="store_true")
    ap.add_argument(
        "--preamble-tokens",
        type=int,
        default=0,
        help="ask every prompt at the end of an agent preamble of about this many tokens",
    )
    ap.add_argument(
        "--preamble-group",
        type=int,
        default=10,
        help="consecutive prompts of a task that share one preamble",
    )
    args = ap.parse_args(argv)
    result = evaluate(
        args.model,
        args.n,
        args.seed,
        args.tasks,
        args.threads,
        preamble_tokens=args.preamble_tokens,
        preamble_group=args.preamble_group,
    )
    print(format_table(result))
    if args.show_failures:
        for task, r in result["tasks"].items():
            for f in r["failures"]:
                print(task, json.dumps(f, ensure_ascii=False))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
