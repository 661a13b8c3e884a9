"""A request for a model of the catalog, whether or not it is loaded (seed 003).

Loaded: the route answers at once. Not loaded, not streamed: the request waits for the load up
to the ready timeout, then gets 503 ``no_warm_replica`` with ``Retry-After`` (the load goes
on). Not loaded, streamed: the stream starts at once and is kept alive while the model loads
(an SSE comment, or Anthropic's ``ping`` event, every ``COLI_SSE_PING_S`` seconds), up to the
stream's ceiling; then the route's own stream follows in the same response. A refusal after
the stream began (the load failed, the request does not fit the model) is an error event in the
protocol's shape.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from colibri.api.errors import error_body, is_anthropic_path
from colibri.api.http import models
from colibri.api.keepalive import PING_INTERVAL_S
from colibri.errors import ApiError
from colibri.runtime.admission import ClientGone, Deadline, set_deadline
from colibri.runtime.catalog import CatalogEntry
from colibri.runtime.models import ModelSet
from colibri.runtime.served import ServedModel

Answer = Callable[[ServedModel], Awaitable[Response]]


def entry_for(request: Request, label: str | None, generation: bool = True) -> CatalogEntry:
    """The catalog entry ``label`` names (runtime/catalog.py ``resolve``: 404 unknown, 409
    ambiguous); None: the default one. ``generation``: the route generates text, which a
    scoring-only entry refuses."""
    catalog = models(request)
    entry = catalog.default if label is None else catalog.resolve(label)
    if generation and entry.task_type == "scoring":
        raise ApiError(
            400,
            f"The model '{entry.id}' is a scoring model (task_type scoring): it generates no "
            "text; call it through /v1/brio, /v1/systemone or /v1/rank",
            code="model_is_scorer",
            param="model",
        )
    return entry


def _arm(request: Request, catalog: ModelSet, entry: CatalogEntry) -> float | None:
    """Gives a request that is not streamed its deadline when the server has a request
    timeout (``--request-timeout``: counted from the request's arrival); the seconds it may
    still wait for a load (the ready timeout, or less when the deadline comes first)."""
    limit = catalog.request_timeout
    if not limit:
        return None
    arrived = request.scope.get("state", {}).get("arrived", time.monotonic())
    deadline = Deadline(arrived + limit, limit, entry.id)
    set_deadline(request, deadline)
    return max(0.0, min(catalog.ready_timeout, deadline.at - time.monotonic()))


async def model_for(request: Request, label: str | None, generation: bool = True) -> ServedModel:
    """The served model ``label`` names, loaded if it was not (a non-streamed wait: at most
    the ready timeout, and within the request's deadline)."""
    catalog = models(request)
    entry = entry_for(request, label, generation)
    return await catalog.get(entry, timeout=_arm(request, catalog, entry))


async def with_model(request: Request, label: str | None, answer: Answer, stream: bool) -> Response:
    """``answer`` with the generating model ``label`` names; a stream starts before the model
    is loaded and is kept alive meanwhile."""
    catalog = models(request)
    entry = entry_for(request, label)
    model = catalog.ready(entry)
    if model is not None or not stream:
        wait = None if stream else _arm(request, catalog, entry)
        model = model or await catalog.get(entry, timeout=wait)
        with catalog.hold(entry.id):  # until admitted (then its slot keeps the model loaded)
            return await answer(model)
    ceiling = catalog.stream_ceiling(entry, label or entry.id)
    return StreamingResponse(
        _while_loading(request, catalog, entry, ceiling, answer),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _keepalive(path: str, entry: CatalogEntry) -> bytes:
    if is_anthropic_path(path):
        return b'event: ping\ndata: {"type": "ping"}\n\n'
    return f": loading model {entry.id}\n\n".encode()


def _error_event(path: str, err: ApiError) -> bytes:
    if is_anthropic_path(path):
        return b"event: error\ndata: " + error_body(path, err) + b"\n\n"
    if path == "/v1/responses":
        event = {"type": "error", "code": err.code, "message": err.message, "param": err.param}
        return b"event: error\ndata: " + orjson.dumps(event) + b"\n\n"
    return b"data: " + error_body(path, err) + b"\n\ndata: [DONE]\n\n"


async def _while_loading(
    request: Request, catalog: ModelSet, entry: CatalogEntry, ceiling: float, answer: Answer
) -> AsyncIterator[bytes]:
    path = request.url.path
    pending = catalog.start(entry)
    deadline = time.monotonic() + ceiling
    while not pending.done():
        left = deadline - time.monotonic()
        if left <= 0:
            yield _error_event(path, catalog.not_ready(entry, ceiling))
            return
        # Never cancels the load: asyncio.wait leaves its futures alone.
        await asyncio.wait({pending}, timeout=min(PING_INTERVAL_S, left))
        if not pending.done():
            yield _keepalive(path, entry)
    try:
        with catalog.hold(entry.id):
            response = await answer(pending.result())
    except ApiError as e:
        yield _error_event(path, e)
        return
    except ClientGone:
        return
    body = getattr(response, "body_iterator", None)
    if body is None:  # a JSON answer (not expected for a stream): sent as one event
        yield b"data: " + bytes(response.body) + b"\n\n"
        return
    try:
        async for chunk in body:
            yield chunk if isinstance(chunk, bytes) else str(chunk).encode()
    finally:
        release = getattr(response, "release", None)
        if release is not None:
            release()
