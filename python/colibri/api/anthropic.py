"""Anthropic Messages API: ``POST /v1/messages`` (JSON and named-event SSE) and
``POST /v1/messages/count_tokens``, on the same engine, scheduler and chat pipeline as the
OpenAI routes. Errors use Anthropic's envelope (api/errors.py picks it from the path)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from colibri.api.access_log import record_of
from colibri.api.anthropic_request import (
    MessagesRequest,
    beta_features,
    parse_messages,
    signature,
    to_anthropic_id,
)
from colibri.api.context_edits import EditedConversation, apply_edits
from colibri.api.errors import error_body, stream_failure
from colibri.api.http import json_response, read_json, request_id, served
from colibri.api.keepalive import PING_INTERVAL_S
from colibri.api.loading import model_for, with_model
from colibri.chat.output import Piece
from colibri.chat.plan import plan_chat
from colibri.chat.request import Sampling
from colibri.chat.tools import ToolCall
from colibri.observability import RequestObserver
from colibri.runtime.generation import Finished, GenerationSpec
from colibri.runtime.reply import Reply, collect_pieces, respond
from colibri.runtime.served import ServedModel


def _stop_reason(fin: Finished, client_stops: list[str]) -> tuple[str, str | None]:
    if fin.reason == "tool_calls":
        return "tool_use", None
    if fin.reason == "length":
        return "max_tokens", None
    if fin.stop_sequence is not None and fin.stop_sequence in client_stops:
        return "stop_sequence", fin.stop_sequence
    return "end_turn", None


def _usage(reply: Reply, fin: Finished) -> dict[str, int]:
    # Anthropic counts cache reads apart: input_tokens is the part that was prefilled.
    return {
        "input_tokens": reply.prompt_tokens - fin.cached_tokens,
        "output_tokens": fin.completion_tokens,
        "cache_read_input_tokens": fin.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": to_anthropic_id(call.id),
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _plan(
    model: ServedModel,
    req: MessagesRequest,
    observer: RequestObserver,
    request: Request,
    check_budget: bool = True,
) -> tuple[GenerationSpec, EditedConversation | None]:
    """The generation spec, after the request's context edits (if it sent any)."""
    known, unknown = beta_features(request.headers.get("anthropic-beta"))
    if known or unknown:
        observer.root.set_attribute("colibri.anthropic_beta", known)
        if unknown:
            observer.root.set_attribute("colibri.anthropic_beta_unknown", unknown)
    chat = req.chat
    edited = None
    if req.edits is not None:

        def count(messages: list[dict[str, Any]]) -> int:
            variant = dataclasses.replace(chat, messages=messages)
            return len(plan_chat(model, variant, observer, check_budget=False).prompt_ids)

        with observer.span("context_edits"):
            edited = apply_edits(chat.messages, req.edits, count)
        chat = dataclasses.replace(chat, messages=edited.messages)
    return plan_chat(model, chat, observer, check_budget=check_budget), edited


def _context_management(edited: EditedConversation | None) -> dict[str, Any]:
    """The reply's ``context_management`` (only when the request sent one)."""
    if edited is None:
        return {}
    return {"context_management": {"applied_edits": edited.applied}}


async def messages(request: Request) -> Response:
    req = parse_messages(await read_json(request), served(request).config.max_tokens)
    chat = req.chat

    async def answer(model: ServedModel) -> Response:
        observer = model.observe(
            "messages", request_id(request), request.headers, record_of(request.scope)
        )
        try:
            spec, edited = _plan(model, req, observer, request)
        except BaseException:
            observer.end()
            raise
        encoder = _MessagesEncoder(
            chat.sampling,
            list(chat.sampling.stops),
            _context_management(edited),
            req.omit_thinking,
        )
        return await respond(request, model, observer, spec, encoder)

    return await with_model(request, chat.model, answer, chat.sampling.stream)


@dataclass
class _MessagesEncoder:
    """Anthropic messages: a ``message`` JSON or the named-event SSE."""

    sampling: Sampling
    client_stops: list[str]
    extra: dict[str, Any]  # top-level fields of the reply beyond the message's own
    omit_thinking: bool
    show_reasoning: bool = True

    def events(self, reply: Reply) -> AsyncIterator[bytes]:
        return _events(reply, self.client_stops, self.extra, self.omit_thinking)

    async def body(self, reply: Reply) -> dict[str, Any]:
        pieces, fin = await collect_pieces(reply)
        stop_reason, stop_sequence = _stop_reason(fin, self.client_stops)
        return {
            "id": "msg_" + secrets.token_hex(12),
            "type": "message",
            "role": "assistant",
            "model": reply.model.id,
            "content": _content_blocks(pieces, self.omit_thinking),
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": _usage(reply, fin),
            **_grammar_flag(fin),
            **self.extra,
        }


def _grammar_flag(fin: Finished) -> dict[str, Any]:
    """``x_colibri_grammar_incomplete: true`` when the output had to follow a grammar
    (output_config.format, forced or strict tools) and ended before completing it (the stop
    reason is then ``max_tokens``)."""
    return {"x_colibri_grammar_incomplete": True} if fin.grammar_incomplete else {}


def _content_blocks(pieces: list[Piece], omit_thinking: bool) -> list[dict[str, Any]]:
    """The reply's content blocks in output order, as the stream shows them: neighbouring
    pieces of one kind make one block, each tool call its own block. With ``omit_thinking``
    a thinking block's text is empty and only its signature carries it."""
    blocks: list[dict[str, Any]] = []
    for kind, value in pieces:
        if isinstance(value, ToolCall):
            blocks.append(_tool_use(value))
        elif kind == "reasoning":
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += value
            else:
                blocks.append({"type": "thinking", "thinking": value})
        elif blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += value
        else:
            blocks.append({"type": "text", "text": value})
    for block in blocks:
        if block["type"] == "thinking":
            block["signature"] = signature(block["thinking"])
            if omit_thinking:
                block["thinking"] = ""
    return blocks or [{"type": "text", "text": ""}]


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps({"type": name, **data}) + b"\n\n"


class _Blocks:
    """Opens and closes content blocks as the kind of output changes."""

    def __init__(self, omit_thinking: bool) -> None:
        self.omit_thinking = omit_thinking
        self.index = -1
        self.kind: str | None = None
        self.thinking = ""

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            delta = {"type": "signature_delta", "signature": signature(self.thinking)}
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        out.append(_event("content_block_stop", {"index": self.index}))
        self.kind = None
        return out

    def open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.index += 1
        self.kind = kind
        self.thinking = ""
        out.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        return out

    def text(self, kind: str, text: str) -> list[bytes]:
        out: list[bytes] = []
        if kind == "reasoning":
            if self.kind != "thinking":
                out += self.open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self.thinking += text
            if self.omit_thinking:
                return out  # the signature delta at the block's end carries the text
            delta = {"type": "thinking_delta", "thinking": text}
        else:
            if self.kind != "text":
                out += self.open("text", {"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": text}
        out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def tool(self, call: ToolCall) -> list[bytes]:
        block = {**_tool_use(call), "input": {}}
        out = self.open("tool_use", block)
        for fragment in call.fragments:
            delta = {"type": "input_json_delta", "partial_json": fragment}
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out + self.close()


async def _with_pings(events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """The events, with ``None`` inserted whenever nothing came for PING_INTERVAL_S."""
    iterator = aiter(events)
    pending: asyncio.Future[Any] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(iterator))
            done, _ = await asyncio.wait({pending}, timeout=PING_INTERVAL_S)
            if not done:
                yield None
                continue
            try:
                item = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            yield item
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        await iterator.aclose()


async def _events(
    reply: Reply, client_stops: list[str], extra: dict[str, Any], omit_thinking: bool
) -> AsyncIterator[bytes]:
    model = reply.model
    message = {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": model.id,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": reply.prompt_tokens - reply.expected_cached(),
            "output_tokens": 0,
            "cache_read_input_tokens": reply.expected_cached(),
            "cache_creation_input_tokens": 0,
        },
    }
    yield _event("message_start", {"message": message})
    yield _event("ping", {})
    blocks = _Blocks(omit_thinking)
    try:
        async for event in _with_pings(reply.events()):
            if event is None:
                yield _event("ping", {})
                continue
            pieces = event.pieces if isinstance(event, Finished) else event
            for kind, value in pieces:
                chunks = (
                    blocks.tool(value) if isinstance(value, ToolCall) else blocks.text(kind, value)
                )
                for chunk in chunks:
                    yield chunk
            if isinstance(event, Finished):
                for chunk in blocks.close():
                    yield chunk
                stop_reason, stop_sequence = _stop_reason(event, client_stops)
                delta = {
                    "stop_reason": stop_reason,
                    "stop_sequence": stop_sequence,
                    **_grammar_flag(event),
                }
                usage = _usage(reply, event)
                yield _event("message_delta", {"delta": delta, "usage": usage, **extra})
                yield _event("message_stop", {})
    except Exception as e:  # headers are sent: the error goes in the stream as an event
        yield b"event: error\ndata: " + error_body("/v1/messages", stream_failure(e)) + b"\n\n"


async def count_tokens(request: Request) -> Response:
    req = parse_messages(
        await read_json(request), served(request).config.max_tokens, count_only=True
    )
    model = await model_for(request, req.chat.model)
    observer = model.observe(
        "count_tokens", request_id(request), request.headers, record_of(request.scope)
    )
    try:
        spec, edited = _plan(model, req, observer, request, check_budget=False)
    finally:
        observer.end()
    answer: dict[str, Any] = {"input_tokens": len(spec.prompt_ids)}
    if edited is not None:
        original = edited.original_tokens
        answer["context_management"] = {
            "original_input_tokens": len(spec.prompt_ids) if original is None else original
        }
    return json_response(answer)
