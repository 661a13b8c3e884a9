"""Scoring requests on the engine: one KV slot held for the whole request (so the state shared
by its questions is prefilled once), options read after prompts as the engine's log-probs,
refusals (context length, a failed engine, a full queue) before anything is computed."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from starlette.requests import Request

from colibri.chat.literal import shield, tokenize_shielded
from colibri.chat.render import ContinuationRefused, render_chat
from colibri.chat.template import TemplateRefused
from colibri.errors import ApiError
from colibri.observability import RequestObserver
from colibri.runtime.admission import ClientGone, admit, shared_prefix, until_disconnect
from colibri.runtime.scheduler import Lease
from colibri.runtime.served import ServedModel
from colibri.scoring.maths import OptionRead
from colibri.scoring.prompts import Read

T = TypeVar("T")


@dataclass
class Usage:
    """Tokens a scoring request used: the longest prompt it read options after, the option
    tokens read, and the prompt tokens whose KV came from the slot's history."""

    prompt_tokens: int = 0
    read_tokens: int = 0
    cached_tokens: int = 0
    engine_calls: int = 0


# The assistant reply rendered to find where a reply starts in the chat form (no template
# rewrites a plain letter).
_PROBE = "x"


def prompt_format(model: ServedModel, requested: str | None) -> str:
    """The form prompts are read in: as requested, else "chat" when the model has a chat
    template (what a chat model was trained on), else "text"."""
    if requested is not None:
        return requested
    return "chat" if model.template is not None else "text"


def _chat_sequences(
    model: ServedModel, read: Read, options: Sequence[str]
) -> tuple[list[int], list[list[int]]] | None:
    """The chat form's tokens: the conversation up to the assistant's reply so far, and that
    followed by each option; None when the template cannot put text at the start of a reply
    (the caller falls back to the text form)."""
    if model.template is None:
        return None
    engine = model.engine
    specials = engine.special_tokens
    messages = [{"role": "system", "content": read.system}] if read.system else []
    messages.append({"role": "user", "content": read.user})
    shielded = shield(messages, specials)
    try:
        rendered = render_chat(
            model.template,
            model.family,
            [*shielded.messages, {"role": "assistant", "content": _PROBE}],
            enable_thinking=False,
        )
    except (ContinuationRefused, TemplateRefused):
        return None
    if not rendered.continued or not rendered.text.endswith(_PROBE):
        return None
    head = rendered.text[: -len(_PROBE)]

    def tokens(tail: str) -> list[int]:
        # The reply is the caller's text: where it spells a special token, it stays text.
        if any(s in tail for s in specials):
            return tokenize_shielded(
                head, shielded, engine.tokenize, engine.tokenize_literal
            ) + engine.tokenize_literal(tail)
        return tokenize_shielded(head + tail, shielded, engine.tokenize, engine.tokenize_literal)

    return tokens(read.reply), [tokens(read.reply + o) for o in options]


def read_tokens(
    model: ServedModel, read: Read, options: Sequence[str], fmt: str
) -> tuple[list[int], list[list[int]]]:
    """The context's tokens and each option's, in form ``fmt``. Each option's sequence is the
    tokenization of the whole text up to and with it (text read literally: a special token's
    string in what the caller wrote is ordinary text); the context is the part every sequence
    and the prompt alone share, so a tokenizer that merges across the boundary (``Answer:`` +
    `` Lisbon``) is read as it would tokenize the whole text."""
    chat = _chat_sequences(model, read, options) if fmt == "chat" else None
    if chat is not None:
        base, fulls = chat
    else:
        literal = model.engine.tokenize_literal
        base = literal(read.text)
        fulls = [literal(read.text + read.continuation(o)) for o in options]
    n = len(base)
    for f in fulls:
        n = min(n, shared_prefix(base, f), len(f) - 1)
    if n < 1:
        raise ApiError(400, "nothing to read the options after: the prompt is empty")
    return base[:n], [f[n:] for f in fulls]


def fitted_tokens(
    model: ServedModel, read: Read, options: Sequence[str], fmt: str
) -> tuple[list[int], list[list[int]]]:
    """:func:`read_tokens`, refused when the prompt with its longest option does not fit the
    context."""
    context, option_ids = read_tokens(model, read, options, fmt)
    check_fits(model, len(context) + max((len(o) for o in option_ids), default=0))
    return context, option_ids


def check_prompt(model: ServedModel, read: Read, options: Sequence[str], fmt: str) -> list[int]:
    """Refuses (before admission) a prompt whose longest option would not fit the context;
    returns the prompt's context tokens."""
    return fitted_tokens(model, read, options, fmt)[0]


class Scorer:
    """Reads options after prompts in one held slot (see :func:`run_scoring`)."""

    def __init__(self, model: ServedModel, lease: Lease, observer: RequestObserver) -> None:
        self.model = model
        self.lease = lease
        self.observer = observer
        self.usage = Usage()

    async def read(self, read: Read, options: Sequence[str], fmt: str) -> list[OptionRead]:
        """Each option's log-probability after ``read``'s prompt in form ``fmt``."""
        context, option_ids = fitted_tokens(self.model, read, options, fmt)
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
    except ClientGone:
        raise  # "cancelled"
    except Exception:
        outcome = "failed"
        raise
    finally:
        model.scheduler.release(lease, outcome)
        observer.end()
    return Timed(value, lease.queue_wait_s, time.perf_counter() - started, scorer.usage)
