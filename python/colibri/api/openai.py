"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from colibri.api.admission import admit, until_disconnect
from colibri.api.errors import ApiError, error_body
from colibri.api.openai_request import ChatRequest, Sampling, parse_chat, parse_completion
from colibri.api.served import ServedModel
from colibri.api.tooling import plan_tools
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


def served(request: Request) -> ServedModel:
    return request.app.state.served


async def list_models(request: Request) -> Response:
    return json_response({"object": "list", "data": [served(request).model_card()]})


async def get_model(request: Request) -> Response:
    model = served(request)
    model.check_model(request.path_params["model"])
    return json_response(model.model_card())


def _usage(prompt_tokens: int, fin: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


class _Reply:
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
            self.model.scheduler.release(self.lease, outcome)
            self.observer.end()


async def _generate(
    request: Request,
    model: ServedModel,
    observer: RequestObserver,
    spec: GenerationSpec,
    sampling: Sampling,
    show_reasoning: bool,
    stream_events: Callable[[_Reply], AsyncIterator[bytes]],
    json_body: Callable[[_Reply], Awaitable[dict[str, Any]]],
) -> Response:
    """Admission, then the reply as SSE or JSON; refusals happen before any header is sent."""
    try:
        lease = await admit(request, model, sampling.cache_slot, observer)
    except BaseException:
        observer.end()
        raise
    reply = _Reply(model, spec, sampling, len(spec.prompt_ids), show_reasoning, lease, observer)
    if sampling.stream:
        return _stream(stream_events(reply), reply.headers)
    body = await until_disconnect(request, json_body(reply))
    return Response(orjson.dumps(body), media_type="application/json", headers=reply.headers)


async def chat_completions(request: Request) -> Response:
    model = served(request)
    req = parse_chat(await read_json(request), model.config.max_tokens)
    model.check_model(req.model)
    observer = model.observe("chat.completions")
    try:
        spec = _chat_spec(model, req, observer)
    except BaseException:
        observer.end()
        raise
    return await _generate(
        request,
        model,
        observer,
        spec,
        req.sampling,
        req.include_reasoning,
        _chat_events,
        lambda reply: _chat_json(reply, thinking=req.thinking),
    )


def _chat_spec(model: ServedModel, req: ChatRequest, observer: RequestObserver) -> GenerationSpec:
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
    tooling = plan_tools(req, family)
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
    ids = model.engine.tokenize(rendered.text)
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


async def _collect(reply: _Reply) -> tuple[dict[str, str], list[ToolCall], Finished]:
    texts = {"content": "", "reasoning": ""}
    calls: list[ToolCall] = []
    finished: Finished | None = None
    # Run the stream to its end (not just to the Finished event) so the slot is released as
    # a completed request.
    async for event in reply.events():
        pieces = event.pieces if isinstance(event, Finished) else event
        for kind, value in pieces:
            if isinstance(value, ToolCall):
                calls.append(value)
            else:
                texts[kind] += value
        if isinstance(event, Finished):
            finished = event
    if finished is None:
        raise RuntimeError("generation ended without a finish event")
    return texts, calls, finished


async def _chat_json(reply: _Reply, thinking: bool) -> dict[str, Any]:
    texts, calls, fin = await _collect(reply)
    message: dict[str, Any] = {"role": "assistant", "content": texts["content"]}
    if calls:
        message["content"] = texts["content"] or None
        message["tool_calls"] = [c.to_openai() for c in calls]
    if reply.show_reasoning and (thinking or texts["reasoning"]):
        message["reasoning"] = message["reasoning_content"] = texts["reasoning"]
    return {
        "id": "chatcmpl-" + secrets.token_hex(12),
        "object": "chat.completion",
        "created": reply.created,
        "model": reply.model.id,
        "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": fin.reason}
        ],
        "usage": _usage(reply.prompt_tokens, fin),
    }


def _stream(events: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers},
    )


async def _chat_events(reply: _Reply) -> AsyncIterator[bytes]:
    cid = "chatcmpl-" + secrets.token_hex(12)
    usage_key = {"usage": None} if reply.sampling.include_usage else {}

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": reply.created,
                "model": reply.model.id,
                "choices": [
                    {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                ],
                **usage_key,
            }
        )

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for event in reply.events():
            pieces = event.pieces if isinstance(event, Finished) else event
            for kind, value in pieces:
                if isinstance(value, ToolCall):
                    for delta in _tool_call_deltas(calls, value):
                        yield chunk(delta)
                    calls += 1
                elif kind == "content":
                    yield chunk({"content": value})
                elif reply.show_reasoning:
                    yield chunk({"reasoning": value, "reasoning_content": value})
            if isinstance(event, Finished):
                yield chunk({}, event.reason)
                if reply.sampling.include_usage:
                    yield _sse(
                        {
                            "id": cid,
                            "object": "chat.completion.chunk",
                            "created": reply.created,
                            "model": reply.model.id,
                            "choices": [],
                            "usage": _usage(reply.prompt_tokens, event),
                        }
                    )
    except Exception as e:  # headers are sent: the error goes in the stream, then it ends
        yield b"data: " + error_body("/v1/chat/completions", _internal(e)) + b"\n\n"
    yield _DONE


def _tool_call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """The id and name once, then the argument fragments (their concatenation is exact)."""
    head = {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
    deltas = [{"tool_calls": [head]}]
    for fragment in call.fragments:
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
    return deltas


def _internal(e: Exception) -> ApiError:
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}", code="internal_error")


async def completions(request: Request) -> Response:
    model = served(request)
    req = parse_completion(await read_json(request), default_max_tokens=16)
    model.check_model(req.model)
    observer = model.observe("completions")
    try:
        ids = model.engine.tokenize(req.prompt, add_special_tokens=True)
        if not ids:
            raise ApiError(400, "'prompt' is empty", code="empty_prompt", param="prompt")
        max_tokens, _ = model.budget(len(ids), req.sampling.max_tokens, "prompt")
    except BaseException:
        observer.end()
        raise
    spec = GenerationSpec(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=req.sampling.temperature,
        top_p=req.sampling.top_p,
        seed=req.sampling.seed,
        stop_token_ids=model.engine.eos_token_ids,
        stops=req.sampling.stops,
        ignore_leading_stop=req.sampling.ignore_leading_stop,
    )
    return await _generate(
        request,
        model,
        observer,
        spec,
        req.sampling,
        False,
        _completion_events,
        _completion_json,
    )


async def _completion_json(reply: _Reply) -> dict[str, Any]:
    texts, _, fin = await _collect(reply)
    return {
        "id": "cmpl-" + secrets.token_hex(12),
        "object": "text_completion",
        "created": reply.created,
        "model": reply.model.id,
        "choices": [
            {"text": texts["content"], "index": 0, "logprobs": None, "finish_reason": fin.reason}
        ],
        "usage": _usage(reply.prompt_tokens, fin),
    }


async def _completion_events(reply: _Reply) -> AsyncIterator[bytes]:
    cid = "cmpl-" + secrets.token_hex(12)
    usage_key = {"usage": None} if reply.sampling.include_usage else {}

    def chunk(text: str, finish: str | None = None, **extra: Any) -> bytes:
        choices = [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]
        return _sse(
            {
                "id": cid,
                "object": "text_completion",
                "created": reply.created,
                "model": reply.model.id,
                "choices": choices,
                **usage_key,
                **extra,
            }
        )

    try:
        async for event in reply.events():
            pieces = event.pieces if isinstance(event, Finished) else event
            for _, text in pieces:
                yield chunk(text)
            if isinstance(event, Finished):
                yield chunk("", event.reason)
                if reply.sampling.include_usage:
                    yield _sse(
                        {
                            "id": cid,
                            "object": "text_completion",
                            "created": reply.created,
                            "model": reply.model.id,
                            "choices": [],
                            "usage": _usage(reply.prompt_tokens, event),
                        }
                    )
    except Exception as e:  # headers are sent: the error goes in the stream, then it ends
        yield b"data: " + error_body("/v1/completions", _internal(e)) + b"\n\n"
    yield _DONE
