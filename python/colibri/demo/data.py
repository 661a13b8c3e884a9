"""Synthetic conversations that the built-in demo model is trained and evaluated on.

Pure Python (no torch, no engine): ``scripts/train_demo_model.py`` samples training
conversations from here and ``colibri.demo.eval`` samples held-out prompts, so both see exactly
the same formats. Every function takes its randomness from a ``random.Random`` or a seed, so a seed
gives the same data on any machine.

This module builds the training conversations (``train_conversation``, its task mix and
shares); the tables of each task are in ``tasks/`` (``capitals``, ``arithmetic``, ``cities``,
``tools``, ``chat``), the names strung from tokenizer pieces in ``name_pieces`` and the
evaluation's prompts in ``eval_items``. The demo data is used through this module: it also
exports the names of those that the training script, the evaluation and the tests use
(``__all__``).

A conversation is a dict ``{"messages": [...], "tools": [...] | None, "thinking": [bool, ...],
"kinds": [str, ...]}`` in the OpenAI shape the chat template renders (``thinking`` has one flag
per assistant message: whether that turn was generated with thinking on; a thinking turn carries
``reasoning_content``; ``kinds`` names each assistant message's task, one of ``TURN_KINDS``, so
training can log the loss of each task apart).

What is held out of training, so the evaluation measures generalisation:
- arithmetic: 10% of the unordered pairs of 2-digit numbers (``EVAL_PAIRS``);
- lookups: the table is fixed, so the question phrasings are held out (``CAPITAL_EVAL_QUESTIONS``);
- tool calls: the evaluation's cities (real ones from ``EVAL_CITIES`` and generated names from
  another seed) never occur in training, whose cities come from ``TRAIN_CITIES``, the capitals,
  ``train_city_pool()``, names strung from tokenizer pieces and near misses of known names
  (both from ``NamePieces``, which refuses the evaluation's names); a few question phrasings are
  held out too.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

from .eval_items import EVAL_SEED, EVAL_TASKS, eval_items
from .name_pieces import PIECE_NAME_P, NamePieces
from .tasks.arithmetic import ARITH_TRAIN_QUESTIONS, EVAL_PAIRS, addition_trace, is_eval_pair
from .tasks.capitals import (
    CAPITAL_EVAL_QUESTIONS,
    CAPITAL_TRAIN_QUESTIONS,
    CAPITALS,
    REVERSE_QUESTIONS,
    capital_answer,
    capital_trace,
    reverse_answer,
)
from .tasks.chat import (
    CHAT,
    RECALL_QUESTIONS,
    REMEMBER_QUESTIONS,
    SYSTEM_PROMPTS,
    assistant_message,
    recall_answer,
    remember_answer,
)
from .tasks.cities import (
    EVAL_CITIES,
    TRAIN_CITIES,
    all_train_cities,
    eval_city_names,
    train_city_pool,
)
from .tasks.tools import (
    NO_TOOL_ANSWERS,
    TIME_EVAL_QUESTIONS,
    TIME_TRAILING_QUESTIONS,
    TOOLS,
    WEATHER_EVAL_QUESTIONS,
    WEATHER_TRAILING_QUESTIONS,
    arg_text,
    tool_call_message,
    tool_episode,
)

__all__ = [
    # built here
    "ARITH_THINK_P",
    "COPY_DRILL_QUESTIONS",
    "ECHO_QUESTIONS",
    "EPISODE_COUNTS",
    "TOOL_THINK_P",
    "TRAIN_MIX",
    "TURN_KINDS",
    "corpus_texts",
    "train_conversation",
    "train_mix",
    # from eval_items, name_pieces and tasks/
    "CAPITALS",
    "CAPITAL_EVAL_QUESTIONS",
    "CAPITAL_TRAIN_QUESTIONS",
    "EVAL_CITIES",
    "EVAL_PAIRS",
    "EVAL_SEED",
    "EVAL_TASKS",
    "PIECE_NAME_P",
    "TIME_EVAL_QUESTIONS",
    "TIME_TRAILING_QUESTIONS",
    "TOOLS",
    "WEATHER_EVAL_QUESTIONS",
    "WEATHER_TRAILING_QUESTIONS",
    "NamePieces",
    "addition_trace",
    "all_train_cities",
    "arg_text",
    "eval_city_names",
    "eval_items",
    "is_eval_pair",
    "tool_call_message",
]

# (task, weight) for one episode of a training conversation.
TRAIN_MIX = [
    ("arith", 38),
    ("capital", 9),
    ("reverse", 1),
    ("tool", 32),
    ("no_tool", 2),
    ("chat", 3),
    ("memory", 4),
    ("tool_unneeded", 7),
    ("echo", 4),
]


def train_mix(arith: int | None = None) -> list[tuple[str, int]]:
    """``TRAIN_MIX`` with the addition episodes' weight set to ``arith`` (None: as it is)."""
    if arith is not None and arith < 0:
        raise ValueError(f"the addition weight must be >= 0, got {arith}")
    return [(t, arith if t == "arith" and arith is not None else w) for t, w in TRAIN_MIX]


# A name to say back (training only): short episodes that are nothing but a copy, the skill the
# tool calls need for cities never seen in training.
ECHO_QUESTIONS = [
    "Please repeat this name exactly: {name}",
    "Say the name {name} back to me.",
    "Echo this place name: {name}",
]
# Names to say back, strung from tokenizer pieces (``NamePieces.drill``): a real city fails
# where one of its pieces is one the model copied too rarely ("Incheon" -> "Imoneyon": "nch"),
# even in a bare echo; with ~15 pieces copied a step, each piece is practised ~30 times in a
# run. A drill copies 5-10 pieces in ~40 tokens. No "please" and no "name" in them: with
# "Please repeat these names exactly" in 15% of the episodes (run 21), the held-out "Please name
# the capital of Japan." came out as "The capital of" and nothing more.
COPY_DRILL_QUESTIONS = [
    "Repeat after me: {names}",
    "Copy this list exactly: {names}",
]
# Share of tool-call turns trained with thinking on (calls without thinking copy the city straight
# from the question, the harder case: more of those).
TOOL_THINK_P = 0.4
# Share of addition turns (and other bare-number answers) trained with thinking on.
ARITH_THINK_P = 0.25
# Episodes per conversation. Several per conversation amortise the prompt that only conditions
# (tool declarations are ~340 tokens for all three tools) over more trained answers.
EPISODE_COUNTS = [1, 2, 2, 3, 3, 4, 4, 5]


def _train_pair(rng: random.Random) -> tuple[int, int]:
    while True:
        a = rng.randint(10, 99) if rng.random() < 0.9 else rng.randint(0, 99)
        b = rng.randint(10, 99) if rng.random() < 0.9 else rng.randint(0, 99)
        if not is_eval_pair(a, b):
            return a, b


def _train_city(rng: random.Random, pieces: NamePieces | None) -> str:
    if pieces is not None and rng.random() < pieces.share:
        return pieces.name(rng)
    # No draw at all when off: the stream stays what it was before near misses.
    if pieces is not None and pieces.near_miss > 0 and rng.random() < pieces.near_miss:
        return pieces.near_miss_name(rng)
    r = rng.random()
    if r < 0.15:
        return rng.choice(TRAIN_CITIES)
    if r < 0.2:
        return rng.choice(list(CAPITALS.values()))
    return rng.choice(train_city_pool())


def _simple_turn(rng: random.Random, task: str, think: bool) -> tuple[str, str, str]:
    """(question, answer, trace) of a one-turn task."""
    if task == "arith":
        a, b = _train_pair(rng)
        q = rng.choice(ARITH_TRAIN_QUESTIONS).format(a=a, b=b)
        return q, str(a + b), addition_trace(a, b)
    if task == "capital":
        country = rng.choice(list(CAPITALS))
        q = rng.choice(CAPITAL_TRAIN_QUESTIONS).format(country=country)
        return q, capital_answer(country), capital_trace(country)
    if task == "reverse":
        capital = rng.choice(list(CAPITALS.values()))
        q = rng.choice(REVERSE_QUESTIONS).format(capital=capital)
        return q, reverse_answer(capital), reverse_answer(capital)
    prompts, answer, trace = rng.choice(CHAT)
    return rng.choice(prompts), answer, trace


# What an assistant message of a training conversation answers (``kinds`` of the conversation).
TURN_KINDS = [
    "arith",
    "capital",
    "reverse",
    "chat",
    "memory",
    "echo",
    "drill",
    "no_tool",
    "tool_call",
    "tool_answer",
]


def train_conversation(
    rng: random.Random,
    pieces: NamePieces | None = None,
    trailing: bool = False,
    mix: Sequence[tuple[str, int]] = TRAIN_MIX,
    tool_extra: int = 0,
    episodes: int | None = None,
) -> dict:
    """One training conversation of 1-5 episodes (``episodes`` when given; more with
    ``tool_extra``); tools declared in about two thirds of them.

    With ``pieces``, a share of the cities (``pieces.share``) are strung from tokenizer pieces.
    ``trailing`` adds tool phrasings with words after the city. ``mix`` weighs the episodes'
    tasks (``TRAIN_MIX``, or ``train_mix``'s reweighting of it). ``tool_extra`` more episodes
    join a conversation that declares tools, and it then never stops at a call: the
    declarations (~270 tokens, half of all the tokens, never trained on) are amortised over
    more trained answers. A call's own targets are the same whether a result follows or not.
    ``episodes`` (for long prompts, ``preamble``) replaces the draw of the count, so the
    default stream is unchanged."""
    if tool_extra < 0:
        raise ValueError(f"tool_extra must be >= 0, got {tool_extra}")
    if episodes is not None and episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    tasks, weights = zip(*mix, strict=True)

    def draw(n: int) -> list[str]:
        drawn = [rng.choices(tasks, weights)[0] for _ in range(n)]
        # No draw at all when off: the stream stays what it was before copy drills.
        if pieces is not None and pieces.drill > 0:
            drawn = ["drill" if rng.random() < pieces.drill else t for t in drawn]
        return drawn

    drawn = draw(rng.choice(EPISODE_COUNTS) if episodes is None else episodes)
    wants_tool = "tool" in drawn or "tool_unneeded" in drawn
    tools: list[dict] | None = None
    declared: list[str] = []
    if wants_tool or rng.random() < 0.1:
        declared = rng.sample(list(TOOLS), rng.randint(1, 3))
        tools = [TOOLS[t] for t in declared]
        drawn += draw(tool_extra)
    messages: list[dict] = []
    thinking: list[bool] = []
    kinds: list[str] = []
    if rng.random() < 0.15:
        messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})

    def say(question: str, answer: str, trace: str, kind: str) -> None:
        # A bare sum is the hardest answer to learn (no trace to compute it in): more of those.
        think = rng.random() < (ARITH_THINK_P if answer.isdigit() else 0.5)
        messages.append({"role": "user", "content": question})
        messages.append(assistant_message(answer, trace if think else None))
        thinking.append(think)
        kinds.append(kind)

    for task in drawn:
        if task == "tool" and declared:
            tool = rng.choice(declared)
            ep = tool_episode(
                rng, tool, _train_city(rng, pieces), eval_phrasing=False, trailing=trailing
            )
            think = rng.random() < TOOL_THINK_P
            messages.append({"role": "user", "content": ep["question"]})
            messages.append(
                tool_call_message(ep["tool"], ep["arguments"], ep["trace"] if think else None)
            )
            thinking.append(think)
            kinds.append("tool_call")
            if rng.random() < 0.75 or tool_extra:
                messages.append({"role": "tool", "content": ep["tool_result"]})
                think = rng.random() < 0.5
                messages.append(
                    assistant_message(ep["answer"], ep["result_trace"] if think else None)
                )
                thinking.append(think)
                kinds.append("tool_answer")
            else:
                break  # the conversation ends on the call
        elif task in ("tool", "no_tool"):
            # A tool request with the tool not declared: say so instead of calling it.
            missing = [t for t in TOOLS if t not in declared]
            if not missing:
                continue
            tool = rng.choice(missing)
            ep = tool_episode(
                rng, tool, _train_city(rng, pieces), eval_phrasing=False, trailing=trailing
            )
            say(ep["question"], NO_TOOL_ANSWERS[tool], "There is no tool for this.", "no_tool")
        elif task == "memory":
            n = rng.randint(0, 999)
            say(
                rng.choice(REMEMBER_QUESTIONS).format(n=n),
                remember_answer(n),
                f"The user gives me the number {n}.",
                "memory",
            )
            for _ in range(rng.choice([0, 1, 1, 2])):
                sub = rng.choice(["arith", "capital", "chat"])
                say(*_simple_turn(rng, sub, False), sub)
            recall = f"The user said {n} earlier."
            say(rng.choice(RECALL_QUESTIONS), recall_answer(n), recall, "memory")
        elif task == "echo":
            name = _train_city(rng, pieces)
            question = rng.choice(ECHO_QUESTIONS).format(name=name)
            say(question, name, f"The name is {name}.", "echo")
        elif task == "drill" and pieces is not None:
            names = ", ".join(pieces.name(rng) for _ in range(rng.randint(2, 4)))
            question = rng.choice(COPY_DRILL_QUESTIONS).format(names=names)
            say(question, names, f"The names are {names}.", "drill")
        elif task == "tool_unneeded":
            sub = rng.choice(["arith", "capital", "chat"])
            say(*_simple_turn(rng, sub, False), sub)
        else:
            say(*_simple_turn(rng, task, False), task)
    if not thinking:
        say(*_simple_turn(rng, "chat", False), "chat")
    return {"messages": messages, "tools": tools, "thinking": thinking, "kinds": kinds}


def corpus_texts(rng: random.Random, n: int) -> list[str]:
    """Raw strings (questions, answers, traces, tool results) for training the tokenizer."""
    out: list[str] = []
    for _ in range(n):
        conv = train_conversation(rng)
        for m in conv["messages"]:
            out.append(m.get("content") or "")
            out.append(m.get("reasoning_content") or "")
            for tc in m.get("tool_calls") or []:
                f = tc["function"]
                out.append(f["name"])
                out += [k + " " + arg_text(v) for k, v in f["arguments"].items()]
        if conv["tools"]:
            out += [json.dumps(t, ensure_ascii=False) for t in conv["tools"]]
    return [t for t in out if t]
