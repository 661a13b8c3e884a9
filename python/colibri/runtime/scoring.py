"""Scoring requests on the engine: one KV slot held for the whole request (so the state shared
by its questions is prefilled once), options read after prompts as the engine's log-probs,
refusals (a failed engine, a full queue) before anything is computed. The tokens come from
``scoring/tokens.py``."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from starlette.requests import Request

from colibri.errors import ApiError
from colibri.observability import RequestObserver
from colibri.runtime.admission import ClientGone, DeadlineExceeded, admit, until_disconnect
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


class Scorer:
    """Reads options after prompts in one held slot (see :func:`run_scoring`)."""

    def __init__(self, model: ServedModel, lease: Lease, observer: RequestObserver) -> None:
        self.model = model
        self.lease = lease
        self.observer = observer
        self.usage = Usage()

    async def read(
        self, options: Sequence[str], tokens: tuple[list[int], list[list[int]]]
    ) -> list[OptionRead]:
        """Each option's log-probability after the prompt: ``tokens`` are the prompt's and each
        option's (``scoring.tokens.fitted_tokens``)."""
        return (await self.read_many([(options, tokens)]))[0]

    async def read_many(
        self, questions: Sequence[tuple[Sequence[str], tuple[list[int], list[list[int]]]]]
    ) -> list[list[OptionRead]]:
        """:meth:`read` for several questions in one engine scoring: the start their prompts
        share (the state) is prefilled once and their own parts run together."""
        scored = await self.model.generator.score_many(
            [tokens for _, tokens in questions], self.observer, self.lease.slot
        )
        u = self.usage
        u.prompt_tokens = max(u.prompt_tokens, *(len(t[0]) for _, t in questions))
        u.read_tokens += sum(n for _, n in scored.scores)
        u.cached_tokens = max(u.cached_tokens, scored.cached_tokens)
        u.engine_calls += 1
        reads = iter(scored.scores)
        return [
            [OptionRead(option, *next(reads)) for option in options] for options, _ in questions
        ]


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
    affinity: list[int] | None,
    work: Callable[[Scorer], Awaitable[T]],
) -> Timed[T]:
    """Admits the request to a KV slot (``cache_slot``, else the free slot whose history
    shares most with ``affinity``, the tokens the request's first prompt starts with), runs
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
        lease = await admit(request, model, cache_slot, observer, affinity)
    except BaseException:
        observer.end()
        raise
    scorer = Scorer(model, lease, observer)
    outcome = "cancelled"
    try:
        value = await until_disconnect(request, work(scorer))
        outcome = "completed"
    except (ClientGone, DeadlineExceeded):
        raise  # "cancelled"
    except Exception:
        outcome = "failed"
        raise
    finally:
        model.scheduler.release(lease, outcome)
        observer.end()
    return Timed(value, lease.queue_wait_s, time.perf_counter() - started, scorer.usage)
