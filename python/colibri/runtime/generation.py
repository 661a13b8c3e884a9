"""Runs generations on the engine as async streams of output pieces.

The engine computes with the GIL released, on one dedicated thread; the event loop stays free
to serve other requests (health, listing, queued clients). Admission (which requests run, in
which KV slot) is the scheduler's job; generations admitted to different slots step together,
one batched engine step for all of them (runtime/batcher.py; a step is one token, or a part of a
long prompt's prefill of about half a second). Closing a stream (a client that went away) stops
its computation after the step in flight, without disturbing the others; the prefill steps done
stay in the slot's history.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from colibri.chat.output import OutputPipeline, Piece, ReasoningState
from colibri.chat.toolcalls import ToolCallParser
from colibri.observability import RequestObserver
from colibri.runtime.batcher import Batcher
from colibri.runtime.engine import Engine, Grammar


@dataclass(frozen=True)
class GenerationSpec:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: Sequence[int] = ()
    stops: Sequence[str] = ()
    ignore_leading_stop: bool = False
    reasoning: ReasoningState | None = None
    # Makes a fresh tool-call parser for each generation (None: no tools declared).
    tool_parser: Callable[[], ToolCallParser] | None = None
    # Constrains the output (response_format, forced or strict tool calls; chat/grammar.py).
    grammar: Grammar | None = None


@dataclass
class Finished:
    """The last event of a stream: why it ended and how many tokens the engine produced."""

    reason: str  # "stop" | "length" | "tool_calls"
    completion_tokens: int
    pieces: list[Piece] = field(default_factory=list)
    # Prompt tokens whose KV came from the slot's history (not prefilled again).
    cached_tokens: int = 0
    # The stop string that ended the output (client or implicit), if one did.
    stop_sequence: str | None = None
    # The output had to follow a grammar and ended before completing it (the reason is then
    # "length": the output is not valid).
    grammar_incomplete: bool = False


@dataclass(frozen=True)
class Progress:
    """A part of the prompt's prefill is done: ``done`` of its ``total`` tokens have KV
    (tokens reused from the slot's history included)."""

    done: int
    total: int


@dataclass(frozen=True)
class Scored:
    """A scoring's result: ``(logprob, tokens)`` per option, and the context tokens whose KV
    came from the slot's history."""

    scores: list[tuple[float, int]]
    cached_tokens: int


class Generator:
    """The one engine of the server and the thread it computes on."""

    def __init__(self, engine: Engine, on_batch: Callable[[int], None] | None = None) -> None:
        """``on_batch(n)``: called before each batched engine step of ``n`` generations."""
        self.engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-engine")
        self._batcher = Batcher(engine, self._thread, on_batch)
        # Set when the engine failed in a way no request explains (health reports it).
        self.dead: str | None = None
        # Prefills in progress, by stream: (slot or None for a private history, done, total).
        self.prefilling: dict[int, tuple[int | None, int, int]] = {}

    async def stream(
        self,
        spec: GenerationSpec,
        observer: RequestObserver | None = None,
        slot: int | None = None,
    ) -> AsyncIterator[list[Piece] | Progress | Finished]:
        """Yields :class:`Progress` while a long prompt prefills, lists of pieces as they
        become final, then one :class:`Finished`."""
        out = OutputPipeline(
            self.engine.detokenize,
            spec.stops,
            spec.ignore_leading_stop,
            spec.reasoning,
            spec.tool_parser() if spec.tool_parser is not None else None,
        )
        stop_ids = set(spec.stop_token_ids)
        tokens = self.engine.generate(
            spec.prompt_ids,
            spec.max_tokens,
            spec.temperature,
            spec.top_p,
            sorted(stop_ids),
            spec.seed,
            slot,
            spec.grammar,
        )
        if observer is not None:
            observer.engine_started(len(spec.prompt_ids))
        self._batcher.join(tokens)
        count = 0
        reason = "length"
        error: str | None = None
        try:
            while True:
                try:
                    step = await self._batcher.step(tokens)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
                    self.dead = error
                    raise
                if isinstance(step, tuple):
                    self.prefilling[id(tokens)] = (slot, *step)
                    if observer is not None:
                        observer.prefill_progress(*step)
                    yield Progress(*step)
                    continue
                self.prefilling.pop(id(tokens), None)
                if step is None:
                    break
                token = step
                count += 1
                if observer is not None:
                    observer.token(tokens.reused_tokens or 0)
                if token in stop_ids:
                    reason = "stop"
                    break
                pieces = out.push_token(token)
                if pieces:
                    if observer is not None:
                        observer.output()
                    yield pieces
                if out.stopped:
                    reason = "stop"
                    break
            pieces = out.finish()
            if out.stopped:  # a stop can complete only in what was held back at the end
                reason = "stop"
            if out.tool_calls:
                reason = "tool_calls"
            grammar_incomplete = False
            if spec.grammar is not None:
                state = tokens.grammar_state
                if state == "satisfied" and reason == "length":
                    reason = "stop"  # the grammar completed: the engine ended the output
                elif state != "satisfied":
                    # Never a complete-looking reply from an unfinished grammar (a stop string
                    # that cut it short included).
                    reason, grammar_incomplete = "length", True
            if pieces and observer is not None:
                observer.output()
        except BaseException:
            reason = "cancelled" if error is None else "error"
            raise
        finally:
            self._batcher.leave(tokens)
            self.prefilling.pop(id(tokens), None)
            tokens.close()
            if observer is not None:
                observer.engine_finished(reason, count, error)
        yield Finished(
            reason,
            count,
            pieces,
            tokens.reused_tokens or 0,
            out.stop_sequence,
            grammar_incomplete,
        )

    async def score(
        self,
        context: list[int],
        options: list[list[int]],
        observer: RequestObserver | None = None,
        slot: int | None = None,
    ) -> Scored:
        """The options' ``(logprob, tokens)`` after ``context`` (see :meth:`Engine.score`)."""
        return await self.score_many([(context, options)], observer, slot)

    async def score_many(
        self,
        questions: list[tuple[list[int], list[list[int]]]],
        observer: RequestObserver | None = None,
        slot: int | None = None,
    ) -> Scored:
        """Every question's options' ``(logprob, tokens)``, in order (see
        :meth:`Engine.score_many`), computed step by step on the engine thread like a
        generation: a long shared start prefills in parts (other slots' generations step in
        between), then the questions' rests, then the options in rounds. Cancelling the caller
        stops it after the step in flight."""
        scoring = self.engine.score_many(questions, slot)
        if observer is not None:
            observer.engine_started(scoring.context_tokens)
        error: str | None = None
        reason = "cancelled"
        try:
            while True:
                try:
                    step = await self._batcher.step_alone(scoring)
                except Exception as e:
                    error = f"{type(e).__name__}: {e}"
                    self.dead = error
                    reason = "error"
                    raise
                if isinstance(step, tuple):
                    self.prefilling[id(scoring)] = (slot, *step)
                    if observer is not None:
                        observer.prefill_progress(*step)
                    continue
                self.prefilling.pop(id(scoring), None)
                if step is None:
                    break
            reason = "scored"
        finally:
            self.prefilling.pop(id(scoring), None)
            scoring.close()
            if observer is not None:
                observer.scored(scoring.reused_tokens or 0, reason, error)
        return Scored(scoring.scores, scoring.reused_tokens or 0)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
