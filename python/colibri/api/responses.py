"""OpenAI Responses API: ``POST /v1/responses`` (JSON and named-event SSE) and
``GET /v1/responses/{id}`` for stored responses, on the same chat planning, scheduler and
engine as the other routes (docs/API.md, "Responses API")."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from colibri.api.access_log import record_of
from colibri.api.errors import stream_failure
from colibri.api.http import json_response, read_json, request_id, served
from colibri.api.loading import with_model
from colibri.api.responses_request import (
    REASONING_TAG,
    ResponsesRequest,
    parse_responses,
    previous_id,
)
from colibri.api.sealed import seal
from colibri.chat.output import Piece
from colibri.chat.plan import plan_chat
from colibri.chat.request import Sampling
from colibri.chat.tools import ToolCall
from colibri.errors import ApiError
from colibri.runtime.generation import Finished
from colibri.runtime.reply import Reply, collect_pieces, respond
from colibri.runtime.served import ServedModel

STORE_CAPACITY = 256


class ResponseStore:
    """The last ``capacity`` stored responses: each one's JSON and the conversation a
    follow-up (``previous_response_id``) continues from. In memory: a restart forgets them."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            return self._items.get(response_id)


def _store(request: Request) -> ResponseStore:
    return request.app.state.responses


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404 if param is None else 400,
        f"No stored response with id '{response_id}' (responses are kept in memory, the last "
        f"{STORE_CAPACITY}, and only with store true)",
        code="previous_response_not_found" if param else "response_not_found",
        param=param,
    )


async def get_response(request: Request) -> Response:
    found = _store(request).get(request.path_params["response_id"])
    if found is None:
        raise _not_found(request.path_params["response_id"])
    return json_response(found[0])


async def create_response(request: Request) -> Response:
    data = await read_json(request)
    prev_id = previous_id(data)
    previous = None
    if prev_id is not None:
        found = _store(request).get(prev_id)
        if found is None:
            raise _not_found(prev_id, param="previous_response_id")
        previous = found[1]
    req = parse_responses(data, served(request).config.max_tokens, previous)

    async def answer(model: ServedModel) -> Response:
        observer = model.observe(
            "responses", request_id(request), request.headers, record_of(request.scope)
        )
        try:
            spec = plan_chat(model, req.chat, observer, prompt_param="input")
        except BaseException:
            observer.end()
            raise
        encoder = _ResponsesEncoder(req.chat.sampling, req, _store(request), model.engine.tokenize)
        return await respond(request, model, observer, spec, encoder)

    return await with_model(request, req.chat.model, answer, req.chat.sampling.stream)


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class _Output:
    """The response's output items built from the generated pieces, in order."""

    req: ResponsesRequest
    items: list[dict[str, Any]] = field(default_factory=list)

    def reasoning_item(self) -> dict[str, Any]:
        return {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": []}

    def message_item(self) -> dict[str, Any]:
        return {
            "type": "message",
            "id": _item_id("msg"),
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }

    def call_item(self, call: ToolCall) -> dict[str, Any]:
        item = {
            "type": "function_call",
            "id": _item_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        if call.name in self.req.namespaced:
            item["namespace"], item["name"] = self.req.namespaced[call.name]
        return item

    def finish_item(self, item: dict[str, Any]) -> dict[str, Any]:
        if item["type"] == "reasoning":
            text = "".join(p["text"] for p in item["content"])
            if self.req.include_encrypted_reasoning:
                item["encrypted_content"] = seal(text, REASONING_TAG)
        else:
            item["status"] = "completed"
        return item


def _pieces_to_items(out: _Output, pieces: list[Piece]) -> list[dict[str, Any]]:
    current: dict[str, Any] | None = None
    for kind, value in pieces:
        if isinstance(value, ToolCall):
            if current is not None:
                out.items.append(out.finish_item(current))
                current = None
            item = out.call_item(value)
            item["arguments"] = value.arguments
            out.items.append(out.finish_item(item))
        elif kind == "reasoning":
            if current is None or current["type"] != "reasoning":
                if current is not None:
                    out.items.append(out.finish_item(current))
                current = out.reasoning_item()
                current["content"].append({"type": "reasoning_text", "text": ""})
            current["content"][0]["text"] += value
        else:
            if current is None or current["type"] != "message":
                if current is not None:
                    out.items.append(out.finish_item(current))
                current = out.message_item()
                current["content"].append(_text_part(""))
            current["content"][0]["text"] += value
    if current is not None:
        out.items.append(out.finish_item(current))
    return out.items


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _conversation(req: ResponsesRequest, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation a follow-up continues from: the input and this reply's turn."""
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for item in items:
        if item["type"] == "reasoning":
            turn["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            turn["content"] += item["content"][0]["text"]
        else:
            name = item["name"]
            if item.get("namespace"):
                name = f"{item['namespace']}.{name}"
            turn.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": name, "arguments": json.loads(item["arguments"])},
                }
            )
    return [*req.history, turn]


@dataclass
class _ResponsesEncoder:
    """Responses: a ``response`` object as JSON, or the named-event SSE."""

    sampling: Sampling
    req: ResponsesRequest
    store: ResponseStore
    tokenize: Any
    show_reasoning: bool = True
    id: str = field(default_factory=lambda: _item_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def response(
        self,
        reply: Reply,
        status: str,
        output: list[dict[str, Any]],
        fin: Finished | None = None,
    ) -> dict[str, Any]:
        req = self.req
        body: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": reply.model.id,
            "output": output,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.chat.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning,
            "store": req.store,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "text": {"format": req.text_format},
            "tool_choice": req.tool_choice,
            "tools": req.tools,
            "truncation": "disabled",
            "metadata": req.metadata,
            "usage": None,
        }
        if fin is not None:
            reasoning = "".join(
                item["content"][0]["text"] for item in output if item["type"] == "reasoning"
            )
            body["usage"] = {
                "input_tokens": reply.prompt_tokens,
                "input_tokens_details": {"cached_tokens": fin.cached_tokens},
                "output_tokens": fin.completion_tokens,
                # The reasoning text's tokens (re-tokenized: the engine counts tokens, not kinds).
                "output_tokens_details": {
                    "reasoning_tokens": len(self.tokenize(reasoning)) if reasoning else 0
                },
                "total_tokens": reply.prompt_tokens + fin.completion_tokens,
            }
            if fin.reason == "length":
                body["incomplete_details"] = {"reason": "max_output_tokens"}
            if fin.grammar_incomplete:
                # The output had to follow a grammar (text.format, forced or strict tools).
                body["x_colibri_grammar_incomplete"] = True
        return body

    def finished(self, reply: Reply, items: list[dict[str, Any]], fin: Finished) -> dict:
        status = "incomplete" if fin.reason == "length" else "completed"
        body = self.response(reply, status, items, fin)
        if self.req.store:
            self.store.put(body, _conversation(self.req, items))
        return body

    async def body(self, reply: Reply) -> dict[str, Any]:
        pieces, fin = await collect_pieces(reply)
        return self.finished(reply, _pieces_to_items(_Output(self.req), pieces), fin)

    def events(self, reply: Reply) -> AsyncIterator[bytes]:
        return _Stream(self, reply).run()


class _Stream:
    """The named events of one streamed response, numbered by ``sequence_number``."""

    def __init__(self, encoder: _ResponsesEncoder, reply: Reply) -> None:
        self.encoder = encoder
        self.reply = reply
        self.out = _Output(encoder.req)
        self.seq = 0
        self.current: dict[str, Any] | None = None

    def event(self, event_type: str, /, **data: Any) -> bytes:
        payload = {"type": event_type, "sequence_number": self.seq, **data}
        self.seq += 1
        return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"

    def _index(self) -> int:
        return len(self.out.items)

    def open(self, item: dict[str, Any]) -> list[bytes]:
        out = self.close()
        self.current = item
        events = [self.event("response.output_item.added", output_index=self._index(), item=item)]
        if item["type"] in ("message", "reasoning"):
            part = (
                _text_part("")
                if item["type"] == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self._index(),
                    content_index=0,
                    part=part,
                )
            )
            item["content"] = [dict(part)]
        return out + events

    def close(self) -> list[bytes]:
        item, self.current = self.current, None
        if item is None:
            return []
        index = self._index()
        events = []
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = (
                "response.output_text.done"
                if item["type"] == "message"
                else "response.reasoning_text.done"
            )
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self.event(done, item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], **extra)
            )  # fmt: skip
            events.append(
                self.event("response.content_part.done", item_id=item["id"], output_index=index,
                           content_index=0, part=part)
            )  # fmt: skip
        self.out.finish_item(item)
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        self.out.items.append(item)
        return events

    def text(self, kind: str, text: str) -> list[bytes]:
        want = "reasoning" if kind == "reasoning" else "message"
        events: list[bytes] = []
        if self.current is None or self.current["type"] != want:
            item = self.out.reasoning_item() if want == "reasoning" else self.out.message_item()
            events += self.open(item)
        assert self.current is not None
        self.current["content"][0]["text"] += text
        name = (
            "response.reasoning_text.delta" if want == "reasoning" else "response.output_text.delta"
        )
        extra = {"logprobs": []} if want == "message" else {}
        events.append(
            self.event(name, item_id=self.current["id"], output_index=self._index(),
                       content_index=0, delta=text, **extra)
        )  # fmt: skip
        return events

    def call(self, call: ToolCall) -> list[bytes]:
        item = self.out.call_item(call)
        events = self.open(item)
        for fragment in call.fragments:
            item["arguments"] += fragment
            events.append(
                self.event("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=self._index(), delta=fragment)
            )  # fmt: skip
        events.append(
            self.event("response.function_call_arguments.done", item_id=item["id"],
                       output_index=self._index(), name=item["name"], arguments=item["arguments"])
        )  # fmt: skip
        return events + self.close()

    async def run(self) -> AsyncIterator[bytes]:
        enc, reply = self.encoder, self.reply
        start = enc.response(reply, "in_progress", [])
        yield self.event("response.created", response=start)
        yield self.event("response.in_progress", response=start)
        try:
            async for event in reply.events():
                pieces = event.pieces if isinstance(event, Finished) else event
                for kind, value in pieces:
                    chunks = (
                        self.call(value) if isinstance(value, ToolCall) else self.text(kind, value)
                    )
                    for chunk in chunks:
                        yield chunk
                if isinstance(event, Finished):
                    for chunk in self.close():
                        yield chunk
                    body = enc.finished(reply, self.out.items, event)
                    name = (
                        "response.incomplete"
                        if body["status"] == "incomplete"
                        else "response.completed"
                    )
                    yield self.event(name, response=body)
        except Exception as e:  # headers are sent: the failure goes in the stream
            failed = enc.response(reply, "failed", self.out.items)
            failed["error"] = {"code": "server_error", "message": stream_failure(e).message}
            yield self.event("response.failed", response=failed)
