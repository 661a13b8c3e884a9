"""Scoring requests on the engine: one KV slot held for the whole request (so the state shared
by its questions is prefilled once), options read after prompts as the engine's log-probs,
refusals (context length, a failed engine, a full queue) before anything is computed."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from starlette.requests import Request

from colibri.errors import ApiError
from colibri.observability import RequestObserver
from colibri.runtime.admission import admit, until_disconnect
from colibri.runtime.scheduler import Lease
from colibri.runtime.served import ServedModel
from colibri.scoring.maths import OptionRead

T = TypeVar("T")


@dataclass
class Usage:
    """Tokens a scoring request used: the longest prompt it read options after, the option
    tokens read, and the prompt tokens whose KV came from the slot's history."""

    prompt_tokens: int = 0
    read_tokens: int = 0
    cached_tokens: int = 0
    engine_calls: int = 0


def read_tokens(
    model: ServedModel, prompt: str, options: Sequence[str], joiner: str
) -> tuple[list[int], list[list[int]]]:
    """The prompt's tokens and each option's: the tokens of ``prompt + joiner + option`` after
    the prompt's own, or, where the tokenizer merges across that boundary, the continuation
    ``joiner + option`` tokenized alone. Text is read literally (a special token's string in it
    is ordinary text)."""
    engine = model.engine
    context = engine.tokenize_literal(prompt)
    n = len(context)
    out = []
    for option in options:
        full = engine.tokenize_literal(prompt + joiner + option)
        out.append(full[n:] if full[:n] == context else engine.tokenize_literal(joiner + option))
    return context, out


def check_prompt(
    model: ServedModel, prompt: str, options: Sequence[str], joiner: str = " "
) -> None:
    """Refuses (before admission) a prompt whose longest option would not fit the context."""
    context, option_ids = read_tokens(model, prompt, options, joiner)
    check_fits(model, len(context) + max((len(o) for o in option_ids), default=0))


class Scorer:
    """Reads options after prompts in one held slot (see :func:`run_scoring`)."""

    def __init__(self, model: ServedModel, lease: Lease, observer: RequestObserver) -> None:
        self.model = model
        self.lease = lease
        self.observer = observer
        self.usage = Usage()

    async def read(
        self, prompt: str, options: Sequence[str], joiner: str = " "
    ) -> list[OptionRead]:
        """Each option's log-probability after ``prompt`` (the option follows ``joiner``)."""
        context, option_ids = read_tokens(self.model, prompt, options, joiner)
        check_fits(self.model, len(context) + max((len(o) for o in option_ids), default=0))
        scored = await self.model.generator.score(
            context, option_ids, self.observer, self.lease.slot
        )
        u = self.usage
        u.prompt_tokens = max(u.prompt_tokens, len(context))
        u.read_tokens += sum(n for _, n in scored.scores)
        u.cached_tokens = max(u.cached_tokens, scored.cached_tokens)
        u.engine_calls += 1
        return [
            OptionRead(option, logprob, n)
            for option, (logprob, n) in zip(options, scored.scores, strict=True)
        ]


def check_fits(model: ServedModel, tokens: int) -> None:
    """A prompt and its longest option must fit the context (never silently truncated)."""
    if tokens > model.context_length:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.context_length} tokens. However, "
            f"a prompt with its longest option is {tokens} tokens. Shorten the state or the "
            "options.",
            code="context_length_exceeded",
        )


@dataclass(frozen=True)
class Timed(Generic[T]):
    """A scoring request's result with its slot's queue wait and the time it took."""

    value: T
    queue_wait_s: float
    elapsed_s: float
    usage: Usage

    @property
    def headers(self) -> dict[str, str]:
        return {
            "x-colibri-queue-wait-ms": f"{self.queue_wait_s * 1e3:.1f}",
            "x-colibri-elapsed-ms": f"{self.elapsed_s * 1e3:.1f}",
        }


async def run_scoring(
    request: Request,
    model: ServedModel,
    observer: RequestObserver,
    cache_slot: int | None,
    affinity: str,
    work: Callable[[Scorer], Awaitable[T]],
) -> Timed[T]:
    """Admits the request to a KV slot (``cache_slot``, else the free slot whose history
    shares most with ``affinity``, the text every prompt of the request starts with), runs
    ``work`` with a :class:`Scorer` on it, and gives the slot back however it ends. A client
    that disconnects stops the work after the engine step in flight."""
    started = time.perf_counter()
    try:
        if model.generator.dead:
            raise ApiError(
                503,
                f"the engine failed and cannot score: {model.generator.dead}; restart the server",
                code="engine_failed",
            )
        prefix = model.engine.tokenize_literal(affinity) if affinity else None
        lease = await admit(request, model, cache_slot, observer, prefix)
    except BaseException:
        observer.end()
        raise
    scorer = Scorer(model, lease, observer)
    outcome = "cancelled"
    try:
        value = await until_disconnect(request, work(scorer))
        outcome = "completed"
    except Exception:
        outcome = "failed"
        raise
    finally:
        model.scheduler.release(lease, outcome)
        observer.end()
    return Timed(value, lease.queue_wait_s, time.perf_counter() - started, scorer.usage)
