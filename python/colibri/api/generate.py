"""Protocol-independent parts of serving a generation: request helpers, the chat prompt plan,
admission, the held slot, and collecting or streaming the engine's events. The OpenAI and
Anthropic routes are thin encoders on top."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from colibri.api.admission import admit, shared_prefix, until_disconnect
from colibri.api.errors import ApiError
from colibri.api.openai_request import ChatRequest, Sampling
from colibri.api.served import ServedModel
from colibri.api.tooling import plan_tools
from colibri.chat.literal import shield, tokenize_shielded
from colibri.chat.output import Piece, ReasoningState
from colibri.chat.render import ContinuationRefused, render_chat
from colibri.chat.template import TemplateRefused
from colibri.chat.tools import ToolCall
from colibri.generation import Finished, GenerationSpec
from colibri.observability import RequestObserver
from colibri.scheduler import Lease


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from e


def request_id(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def served(request: Request) -> ServedModel:
    return request.app.state.served


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

    async def events(self) -> AsyncIterator[list[Piece] | Finished]:
        """The engine's events; the slot is given back however this ends."""
        outcome = "failed"
        try:
            async for event in self.model.generator.stream(
                self.spec, self.observer, self.lease.slot
            ):
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
            self.observer.end()


class _HeldStreamingResponse(StreamingResponse):
    """A stream that gives its slot back even if it is cancelled before its body started."""

    def __init__(self, reply: Reply, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=_sse_headers(reply))
        self._reply = reply

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._reply.close("cancelled")


def _sse_headers(reply: Reply) -> dict[str, str]:
    return {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **reply.headers}


async def generate_response(
    request: Request,
    model: ServedModel,
    observer: RequestObserver,
    spec: GenerationSpec,
    sampling: Sampling,
    show_reasoning: bool,
    stream_events: Callable[[Reply], AsyncIterator[bytes]],
    json_body: Callable[[Reply], Awaitable[dict[str, Any]]],
) -> Response:
    """Admission, then the reply as SSE or JSON; refusals happen before any header is sent."""
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
    reply = Reply(model, spec, sampling, len(spec.prompt_ids), show_reasoning, lease, observer)
    if sampling.stream:
        return _HeldStreamingResponse(reply, stream_events(reply))
    try:
        body = await until_disconnect(request, json_body(reply))
    finally:
        reply.close("cancelled")  # no-op when the generation already gave the slot back
    return Response(orjson.dumps(body), media_type="application/json", headers=reply.headers)


def chat_spec(
    model: ServedModel, req: ChatRequest, observer: RequestObserver, check_budget: bool = True
) -> GenerationSpec:
    """Renders and tokenizes the conversation and plans stops, reasoning and tools."""
    family = model.family
    if model.template is None:
        raise ApiError(
            400,
            "The served model has no chat template (tokenizer_config.json or "
            "chat_template.jinja); use /v1/completions with a prompt string",
            code="chat_template_missing",
        )
    if req.thinking and not family.reasoning:
        raise ApiError(
            400,
            f"The served model (family '{family.name}') has no reasoning mode: drop "
            "enable_thinking / reasoning_effort",
            code="reasoning_not_supported",
            param="reasoning_effort",
        )
    # What users and tools wrote stays text even where it spells a special token.
    shielded = shield(req.messages, model.engine.special_tokens)
    tooling = plan_tools(dataclasses.replace(req, messages=shielded.messages), family)
    try:
        with observer.span("render"):
            rendered = render_chat(
                model.template,
                family,
                tooling.messages,
                enable_thinking=req.thinking,
                continue_assistant=model.config.continue_assistant,
                tools=tooling.prompt_tools,
                declared_tools=bool(req.tools),
            )
    except ContinuationRefused as e:
        raise ApiError(400, str(e), code="invalid_continuation", param="messages") from e
    except TemplateRefused as e:
        raise ApiError(
            400,
            f"The model's chat template refused these messages: {e}",
            code="template_refused",
            param="messages",
        ) from e
    ids = tokenize_shielded(
        rendered.text, shielded, model.engine.tokenize, model.engine.tokenize_literal
    )
    max_tokens = 1
    if check_budget:
        max_tokens, _ = model.budget(len(ids), req.sampling.max_tokens, "messages")
    stops, ignore_leading, stop_ids = family.chat_stops(
        req.sampling.stops,
        req.sampling.ignore_leading_stop,
        model.engine.eos_token_ids,
        model.engine.token_id,
    )
    reasoning = (
        ReasoningState(
            rendered.in_reasoning,
            rendered.after_reasoning,
            family.open_think,
            family.close_think,
            end_markers=tooling.end_markers,
        )
        if family.reasoning
        else None
    )
    return GenerationSpec(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=req.sampling.temperature,
        top_p=req.sampling.top_p,
        seed=req.sampling.seed,
        stop_token_ids=stop_ids,
        stops=stops,
        ignore_leading_stop=ignore_leading,
        reasoning=reasoning,
        tool_parser=tooling.parser_factory,
    )


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
