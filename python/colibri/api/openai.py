"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from colibri.api.access_log import record_of
from colibri.api.errors import ApiError, error_body, stream_failure
from colibri.api.http import json_response, models, read_json, request_id, served
from colibri.api.loading import with_model
from colibri.api.openai_request import parse_chat, parse_completion
from colibri.chat.plan import plan_chat
from colibri.chat.request import ChatRequest, Sampling
from colibri.chat.tools import ToolCall
from colibri.runtime.catalog import CatalogEntry
from colibri.runtime.generation import Finished, GenerationSpec, Progress
from colibri.runtime.reply import Reply, collect, respond
from colibri.runtime.served import ServedModel


def model_card(entry: CatalogEntry, model: ServedModel | None, context: int | None) -> dict:
    """One ``/v1/models`` entry: OpenAI's fields and seed 003's (``max_model_len`` is the window
    the engine runs when loaded, the manifest's when not, null when neither is known)."""
    if model is not None:
        window, source = model.context_length, "resident"
        tools = model.family.tool_format is not None
    else:
        window = entry.configured_window(context)
        source = "configured" if window is not None else None
        tools = entry.tool_calling_configured
    return {
        "id": entry.id,
        "object": "model",
        "created": entry.created,
        "owned_by": "colibri",
        "name": entry.name,
        "task_type": entry.task_type,
        "max_model_len": window,
        "max_model_len_source": source,
        "model_config_id": entry.model_config_id,
        "tool_calling_configured": True if tools else None,
        "supports_tool_calls": None,
    }


async def list_models(request: Request) -> Response:
    catalog = models(request)
    cards = [model_card(e, catalog.loaded(e.id), catalog.context) for e in catalog.entries]
    # Jev's clients (the /v1/systemone contract) read "models" beside OpenAI's "data".
    jev = [
        {
            "name": e.id,
            "description": f"colibri serving {e.architecture}",
            "release_date": time.strftime("%Y-%m-%d", time.gmtime(e.created)),
        }
        for e in catalog.entries
    ]
    return json_response({"object": "list", "data": cards, "models": jev})


async def get_model(request: Request) -> Response:
    catalog = models(request)
    entry = catalog.resolve(request.path_params["model"])
    return json_response(model_card(entry, catalog.loaded(entry.id), catalog.context))


def _usage(prompt_tokens: int, fin: Finished) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


def _usage_chunk(reply: Reply, cid: str, obj: str, fin: Finished) -> bytes:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices."""
    return _sse(
        {
            "id": cid,
            "object": obj,
            "created": reply.created,
            "model": reply.model.id,
            "choices": [],
            "usage": _usage(reply.prompt_tokens, fin),
        }
    )


def _progress(reply: Reply, cid: str, obj: str, event: Progress) -> bytes:
    """A prefill step done: an SSE comment (every client skips it; it shows the stream is
    alive), and with ``stream_options.x_colibri_progress`` a chunk with no choices."""
    out = f": prefill {event.done}/{event.total}\n\n".encode()
    if reply.sampling.progress_chunks:
        out += _sse(
            {
                "id": cid,
                "object": obj,
                "created": reply.created,
                "model": reply.model.id,
                "choices": [],
                "x_colibri_progress": {
                    "prompt_tokens": event.total,
                    "prompt_tokens_done": event.done,
                },
            }
        )
    return out


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


async def chat_completions(request: Request) -> Response:
    req = parse_chat(await read_json(request), served(request).config.max_tokens)

    async def answer(model: ServedModel) -> Response:
        observer = model.observe(
            "chat.completions", request_id(request), request.headers, record_of(request.scope)
        )
        try:
            spec = plan_chat(model, req, observer)
        except BaseException:
            observer.end()
            raise
        return await respond(request, model, observer, spec, _ChatEncoder(req.sampling, req))

    return await with_model(request, req.model, answer, req.sampling.stream)


@dataclass
class _ChatEncoder:
    """Chat completions: ``chat.completion`` JSON or ``chat.completion.chunk`` SSE."""

    sampling: Sampling
    req: ChatRequest

    @property
    def show_reasoning(self) -> bool:
        return self.req.include_reasoning

    def events(self, reply: Reply) -> AsyncIterator[bytes]:
        return _chat_events(reply)

    async def body(self, reply: Reply) -> dict[str, Any]:
        return await _chat_json(reply, thinking=self.req.thinking)


async def _chat_json(reply: Reply, thinking: bool) -> dict[str, Any]:
    texts, calls, fin = await collect(reply)
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
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": fin.reason,
                **_grammar_flag(fin),
            }
        ],
        "usage": _usage(reply.prompt_tokens, fin),
    }


def _grammar_flag(fin: Finished) -> dict[str, Any]:
    """``x_colibri_grammar_incomplete: true`` on a choice whose output had to follow a grammar
    (response_format, forced or strict tools) and ended before completing it."""
    return {"x_colibri_grammar_incomplete": True} if fin.grammar_incomplete else {}


async def _chat_events(reply: Reply) -> AsyncIterator[bytes]:
    cid = "chatcmpl-" + secrets.token_hex(12)
    usage_key = {"usage": None} if reply.sampling.include_usage else {}

    def chunk(
        delta: dict[str, Any], finish: str | None = None, extra: dict[str, Any] | None = None
    ) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return _sse(
            {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": reply.created,
                "model": reply.model.id,
                "choices": [{**choice, **(extra or {})}],
                **usage_key,
            }
        )

    yield chunk({"role": "assistant", "content": ""})
    calls = 0
    try:
        async for event in reply.events(progress=True):
            if isinstance(event, Progress):
                yield _progress(reply, cid, "chat.completion.chunk", event)
                continue
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
                yield chunk({}, event.reason, _grammar_flag(event))
                if reply.sampling.include_usage:
                    yield _usage_chunk(reply, cid, "chat.completion.chunk", event)
    except Exception as e:  # headers are sent: the error goes in the stream, then it ends
        yield b"data: " + error_body("/v1/chat/completions", stream_failure(e)) + b"\n\n"
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


async def completions(request: Request) -> Response:
    req = parse_completion(await read_json(request), default_max_tokens=16)

    async def answer(model: ServedModel) -> Response:
        observer = model.observe(
            "completions", request_id(request), request.headers, record_of(request.scope)
        )
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
        return await respond(request, model, observer, spec, _CompletionEncoder(req.sampling))

    return await with_model(request, req.model, answer, req.sampling.stream)


@dataclass
class _CompletionEncoder:
    """Legacy completions: ``text_completion`` JSON or SSE; no reasoning split."""

    sampling: Sampling
    show_reasoning: bool = False

    def events(self, reply: Reply) -> AsyncIterator[bytes]:
        return _completion_events(reply)

    async def body(self, reply: Reply) -> dict[str, Any]:
        return await _completion_json(reply)


async def _completion_json(reply: Reply) -> dict[str, Any]:
    texts, _, fin = await collect(reply)
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


async def _completion_events(reply: Reply) -> AsyncIterator[bytes]:
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
        async for event in reply.events(progress=True):
            if isinstance(event, Progress):
                yield _progress(reply, cid, "text_completion", event)
                continue
            pieces = event.pieces if isinstance(event, Finished) else event
            for _, text in pieces:
                yield chunk(text)
            if isinstance(event, Finished):
                yield chunk("", event.reason)
                if reply.sampling.include_usage:
                    yield _usage_chunk(reply, cid, "text_completion", event)
    except Exception as e:  # headers are sent: the error goes in the stream, then it ends
        yield b"data: " + error_body("/v1/completions", stream_failure(e)) + b"\n\n"
    yield _DONE
