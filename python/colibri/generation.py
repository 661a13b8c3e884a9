"""Runs generations on the engine, one at a time, as async streams of output pieces.

The engine computes each token with the GIL released, on one dedicated thread; the event loop
stays free to serve other requests (health, listing, queued clients). Closing a stream (a client
that went away) stops the computation after the token in flight.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from colibri.chat.output import OutputPipeline, Piece, ReasoningState
from colibri.chat.toolcalls import ToolCallParser
from colibri.engine import Engine


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


@dataclass
class Finished:
    """The last event of a stream: why it ended and how many tokens the engine produced."""

    reason: str  # "stop" | "length" | "tool_calls"
    completion_tokens: int
    pieces: list[Piece] = field(default_factory=list)


def _next_token(stream: Any) -> int | None:
    return next(stream, None)


class Generator:
    """The one engine of the server and the serial queue in front of it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colibri-engine")
        self._lock = asyncio.Lock()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    async def stream(self, spec: GenerationSpec) -> AsyncIterator[list[Piece] | Finished]:
        """Yields lists of pieces as they become final, then one :class:`Finished`."""
        loop = asyncio.get_running_loop()
        out = OutputPipeline(
            self.engine.detokenize,
            spec.stops,
            spec.ignore_leading_stop,
            spec.reasoning,
            spec.tool_parser() if spec.tool_parser is not None else None,
        )
        stop_ids = set(spec.stop_token_ids)
        async with self._lock:
            tokens = self.engine.generate(
                spec.prompt_ids,
                spec.max_tokens,
                spec.temperature,
                spec.top_p,
                sorted(stop_ids),
                spec.seed,
            )
            count = 0
            reason = "length"
            try:
                while True:
                    token = await loop.run_in_executor(self._thread, _next_token, tokens)
                    if token is None:
                        break
                    count += 1
                    if token in stop_ids:
                        reason = "stop"
                        break
                    pieces = out.push_token(token)
                    if pieces:
                        yield pieces
                    if out.stopped:
                        reason = "stop"
                        break
            finally:
                tokens.close()
        pieces = out.finish()
        if out.stopped:  # a stop can complete only in what was held back at the end
            reason = "stop"
        if out.tool_calls:
            reason = "tool_calls"
        yield Finished(reason, count, pieces)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
