"""A generation's reply, whatever the protocol: admission to a KV slot, the held slot, and the
engine's events collected (JSON) or streamed (SSE) through the protocol's :class:`Encoder`.
Refusals happen before any header is sent."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from colibri.chat.output import Piece
from colibri.chat.request import Sampling
from colibri.chat.tools import ToolCall
from colibri.errors import ApiError
from colibri.observability import RequestObserver
from colibri.runtime.admission import admit, shared_prefix, until_disconnect
from colibri.runtime.generation import Finished, GenerationSpec, Progress
from colibri.runtime.scheduler import Lease
from colibri.runtime.served import ServedModel


class Reply:
    """Everything a response needs besides the generated pieces, and the held slot."""

    def __init__(
        self,
        model: ServedModel,
        spec: GenerationSpec,
        sampling: Sampling,
        prompt_tokens: int,
        show_reasoning: bool,
        lease: Lease,
        observer: RequestObserver,
    ) -> None:
        self.model = model
        self.spec = spec
        self.sampling = sampling
        self.prompt_tokens = prompt_tokens
        self.show_reasoning = show_reasoning
        self.lease = lease
        self.observer = observer
        self.created = int(time.time())

    @property
    def headers(self) -> dict[str, str]:
        return {"x-colibri-queue-wait-ms": f"{self.lease.queue_wait_s * 1e3:.1f}"}

    async def events(self, progress: bool = False) -> AsyncIterator[Any]:
        """The engine's events: lists of pieces, then :class:`Finished`, with
        :class:`Progress` during the prefill when ``progress``. The slot is given back however
        this ends."""
        outcome = "failed"
        try:
            async for event in self.model.generator.stream(
                self.spec, self.observer, self.lease.slot
            ):
                if progress or not isinstance(event, Progress):
                    yield event
            outcome = "completed"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self.close(outcome)

    def expected_cached(self) -> int:
        """Prompt tokens the slot's history will supply (the engine's own rule: the shared
        prefix, but at least one prompt token is computed)."""
        history = self.model.engine.slot_info(self.lease.slot)["tokens"]
        prompt = self.spec.prompt_ids
        return min(shared_prefix(history, prompt), len(prompt) - 1)

    def close(self, outcome: str) -> None:
        """Gives the slot back and ends the trace; once (later calls do nothing)."""
        if not self.lease.released:
            self.model.scheduler.release(self.lease, outcome)
            self.observer.end(outcome)


class _HeldStreamingResponse(StreamingResponse):
    """A stream that gives its slot back even if it is cancelled before its body started."""

    def __init__(self, reply: Reply, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_sse_headers(reply))
        self._reply = reply

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()

    def release(self) -> None:
        """Gives the slot back when the stream was not sent whole (no-op otherwise); for a
        caller that sends the body itself (api/loading.py)."""
        self._reply.close("cancelled")


def _sse_headers(reply: Reply) -> dict[str, str]:
    return {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **reply.headers}


class Encoder(Protocol):
    """How one protocol answers a generation: its sampling settings (``stream`` picks SSE or
    JSON), whether reasoning text is shown, and the two encodings of the engine's events."""

    sampling: Sampling
    show_reasoning: bool

    def events(self, reply: Reply) -> AsyncIterator[bytes]:
        """The SSE byte stream (headers are sent before the first event)."""
        ...

    async def body(self, reply: Reply) -> dict[str, Any]:
        """The JSON reply, once the generation has finished."""
        ...


async def respond(
    request: Request,
    model: ServedModel,
    observer: RequestObserver,
    spec: GenerationSpec,
    encoder: Encoder,
) -> Response:
    """Admission, then the reply as SSE or JSON; refusals happen before any header is sent."""
    sampling = encoder.sampling
    try:
        if model.generator.dead:
            raise ApiError(
                503,
                f"the engine failed and cannot generate: {model.generator.dead}; restart the "
                "server",
                code="engine_failed",
            )
        lease = await admit(request, model, sampling.cache_slot, observer, spec.prompt_ids)
    except BaseException:
        observer.end()
        raise
    reply = Reply(
        model, spec, sampling, len(spec.prompt_ids), encoder.show_reasoning, lease, observer
    )
    if sampling.stream:
        return _HeldStreamingResponse(reply, encoder.events(reply))
    try:
        body = await until_disconnect(request, encoder.body(reply))
    finally:
        reply.close("cancelled")  # no-op when the generation already gave the slot back
    return Response(orjson.dumps(body), media_type="application/json", headers=reply.headers)


async def collect_pieces(reply: Reply) -> tuple[list[Piece], Finished]:
    """Every piece in output order and the finish event. Runs the stream to its end (not just
    to the finish event) so the slot is released as a completed request."""
    pieces: list[Piece] = []
    finished: Finished | None = None
    async for event in reply.events():
        pieces += event.pieces if isinstance(event, Finished) else event
        if isinstance(event, Finished):
            finished = event
    if finished is None:
        raise RuntimeError("generation ended without a finish event")
    return pieces, finished


async def collect(reply: Reply) -> tuple[dict[str, str], list[ToolCall], Finished]:
    """The reply's text by kind, its tool calls, and the finish event."""
    pieces, finished = await collect_pieces(reply)
    texts = {"content": "", "reasoning": ""}
    calls: list[ToolCall] = []
    for kind, value in pieces:
        if isinstance(value, ToolCall):
            calls.append(value)
        else:
            texts[kind] += value
    return texts, calls, finished
