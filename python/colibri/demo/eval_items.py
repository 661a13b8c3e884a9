"""The evaluation's held-out prompts (``eval_items``): each task's items with the answer, call or
contents expected, built from the task tables with what training never sees (numbers, phrasings,
cities)."""

from __future__ import annotations

import random

from .tasks.arithmetic import ARITH_EVAL_QUESTIONS, EVAL_PAIRS
from .tasks.capitals import CAPITAL_EVAL_QUESTIONS, CAPITALS, capital_answer
from .tasks.chat import (
    CHAT,
    RECALL_QUESTIONS,
    REMEMBER_QUESTIONS,
    assistant_message,
    recall_answer,
    remember_answer,
)
from .tasks.cities import EVAL_CITIES, eval_city_names
from .tasks.tools import TOOLS, arg_text, tool_call_message, tool_episode

_EVAL_CITY_SET = frozenset(EVAL_CITIES)
EVAL_TASKS = ["arith", "capital", "tool_call", "tool_answer", "tool_unneeded", "chat", "memory"]
# The evaluation's default seed (`colibri eval-demo`, the training script's card).
EVAL_SEED = 7


def eval_items(task: str, n: int, seed: int) -> list[dict]:
    """``n`` held-out prompts of ``task``; half with thinking on.

    Each item: ``messages`` (ending with a user or tool message), ``tools``, ``thinking`` and
    ``expect``: ``{"answer": str}`` (exact text after the reasoning), ``{"contains": [str]}``
    (the answer must contain each) or ``{"call": {"name": str, "arguments": {str: str}}}``.
    Tool items also carry ``source``: where their city comes from (``city_source``), or
    ``"no city"`` for a currency conversion.
    """
    rng = random.Random(f"{task}/{seed}")
    items: list[dict] = []
    cities = list(EVAL_CITIES)
    rng.shuffle(cities)
    cities += eval_city_names(max(n, 1), seed)
    pairs = sorted(EVAL_PAIRS)
    rng.shuffle(pairs)
    for i in range(n):
        think = i % 2 == 1
        tools = None
        messages: list[dict] = []
        if task == "arith":
            a, b = pairs[i % len(pairs)]
            if rng.random() < 0.5:
                a, b = b, a
            messages = [
                {"role": "user", "content": rng.choice(ARITH_EVAL_QUESTIONS).format(a=a, b=b)}
            ]
            expect: dict = {"answer": str(a + b)}
        elif task == "capital":
            country = list(CAPITALS)[i % len(CAPITALS)]
            q = rng.choice(CAPITAL_EVAL_QUESTIONS).format(country=country)
            messages = [{"role": "user", "content": q}]
            expect = {"answer": capital_answer(country)}
        elif task in ("tool_call", "tool_answer"):
            tool = ["get_weather", "get_weather", "get_time", "convert_currency"][i % 4]
            declared = [tool] + [t for t in TOOLS if t != tool and rng.random() < 0.5]
            rng.shuffle(declared)
            tools = [TOOLS[t] for t in declared]
            city = cities[i % len(cities)]
            ep = tool_episode(rng, tool, city, eval_phrasing=rng.random() < 0.3)
            source = "no city" if tool == "convert_currency" else city_source(city)
            messages = [{"role": "user", "content": ep["question"]}]
            if task == "tool_call":
                expect = {
                    "call": {
                        "name": tool,
                        "arguments": {k: arg_text(v) for k, v in ep["arguments"].items()},
                    }
                }
            else:
                messages += [
                    tool_call_message(tool, ep["arguments"], None),
                    {"role": "tool", "content": ep["tool_result"]},
                ]
                expect = {"contains": ep["must_contain"]}
        elif task == "tool_unneeded":
            tools = [TOOLS[t] for t in rng.sample(list(TOOLS), rng.randint(1, 3))]
            if i % 2 == 0:
                a, b = pairs[(i * 7) % len(pairs)]
                messages = [
                    {"role": "user", "content": rng.choice(ARITH_EVAL_QUESTIONS).format(a=a, b=b)}
                ]
                expect = {"answer": str(a + b)}
            else:
                country = rng.choice(list(CAPITALS))
                q = rng.choice(CAPITAL_EVAL_QUESTIONS).format(country=country)
                messages = [{"role": "user", "content": q}]
                expect = {"answer": capital_answer(country)}
        elif task == "chat":
            prompts, answer, _ = CHAT[i % len(CHAT)]
            messages = [{"role": "user", "content": rng.choice(prompts)}]
            expect = {"answer": answer}
        elif task == "memory":
            num = rng.randint(0, 999)
            messages = [
                {"role": "user", "content": rng.choice(REMEMBER_QUESTIONS).format(n=num)},
                assistant_message(remember_answer(num), None),
            ]
            for _ in range(rng.choice([0, 1, 2])):
                a, b = rng.randint(10, 99), rng.randint(10, 99)
                messages += [
                    {"role": "user", "content": f"What is {a} + {b}?"},
                    assistant_message(str(a + b), None),
                ]
            messages.append({"role": "user", "content": rng.choice(RECALL_QUESTIONS)})
            expect = {"answer": recall_answer(num)}
        else:
            raise ValueError(f"unknown task {task!r} (known: {', '.join(EVAL_TASKS)})")
        item = {
            "task": task,
            "messages": messages,
            "tools": tools,
            "thinking": think,
            "expect": expect,
        }
        if task in ("tool_call", "tool_answer"):
            item["source"] = source
        items.append(item)
    return items


def city_source(city: str) -> str:
    """Which held-out set an evaluation city is from: ``"real"`` (``EVAL_CITIES``, names the
    tokenizer cuts into pieces learned from other words) or ``"generated"`` (city-like names
    from ``eval_city_names``)."""
    return "real" if city in _EVAL_CITY_SET else "generated"
