"""Admission of a generation request: a KV slot from the scheduler, refusals as HTTP 429 before
any response header, and a client that disconnects while waiting or generating."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import Response

from colibri.errors import ApiError
from colibri.observability import RequestObserver
from colibri.runtime.scheduler import Cancelled, Lease, QueueFull, QueueTimeout, SchedulerClosed
from colibri.runtime.served import ServedModel

T = TypeVar("T")
RETRY_AFTER_S = 2


class ClientGone(Exception):
    """The client disconnected; nobody will read a response."""


@dataclass(frozen=True)
class Deadline:
    """When a request that is not streamed must have its answer (``--request-timeout``):
    ``at`` on the monotonic clock, ``limit`` seconds after the request arrived, for ``model``
    (its id)."""

    at: float
    limit: float
    model: str


# Where a request's deadline is kept (its ASGI scope's state).
_DEADLINE = "colibri_deadline"


def set_deadline(request: Request, deadline: Deadline) -> None:
    request.scope.setdefault("state", {})[_DEADLINE] = deadline


def deadline_of(request: Request) -> Deadline | None:
    return request.scope.get("state", {}).get(_DEADLINE)


class DeadlineExceeded(Exception):
    """A request not streamed reached its deadline after admission: its work was cancelled
    (the slot given back as cancelled); the app answers 504 (api/app.py)."""

    def __init__(self, deadline: Deadline) -> None:
        super().__init__(f"no answer within {deadline.limit:g} s")
        self.deadline = deadline


def client_gone_response() -> Response:
    # Nobody reads it; 499 is the conventional "client closed request" status in access logs.
    return Response(status_code=499)


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was already read, so only
    ``http.disconnect`` can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Runs ``work``; if the client disconnects first, cancels it and raises ClientGone; if
    the request's deadline (:func:`set_deadline`) comes first, cancels it and raises
    DeadlineExceeded, unless the work finished as the cancellation reached it (its answer
    then stands)."""
    deadline = deadline_of(request)
    timeout = None if deadline is None else max(0.0, deadline.at - time.monotonic())
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait(
            {task, watcher}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    if watcher in done or deadline is None:
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientGone()
    try:
        return await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # this request itself is being cancelled, not timed out
        raise DeadlineExceeded(deadline) from None


def shared_prefix(history: list[int], prompt: list[int]) -> int:
    """How many leading tokens ``prompt`` shares with a slot's ``history``."""
    shared = 0
    for a, b in zip(history, prompt, strict=False):
        if a != b:
            break
        shared += 1
    return shared


def prefix_chooser(model: ServedModel, prompt: list[int]):
    """Picks the free slot where the prompt saves the most prefill for the least history lost:
    tokens shared with the slot's history minus the history it would discard. A fresh
    conversation thus takes an empty slot instead of evicting another one over a few shared
    template tokens."""

    def choose(free: list[int]) -> int:
        def score(slot: int) -> tuple[int, int]:
            history = model.engine.slot_info(slot)["tokens"]
            shared = shared_prefix(history, prompt)
            lost = len(history) - shared
            return (shared - lost, -len(history))

        return max(free, key=score)

    return choose


async def admit(
    request: Request,
    model: ServedModel,
    slot: int | None,
    observer: RequestObserver,
    prompt: list[int] | None = None,
) -> Lease:
    scheduler = model.scheduler
    try:
        scheduler.check_slot(slot)
    except ValueError as e:
        raise ApiError(400, str(e), code="invalid_cache_slot", param="cache_slot") from e
    with observer.span("admission"):
        try:
            choose = prefix_chooser(model, prompt) if prompt and scheduler.capacity > 1 else None
            lease = await until_disconnect(request, scheduler.acquire(slot, choose=choose))
        except (QueueFull, QueueTimeout) as e:
            raise ApiError(
                429, str(e), code=e.code, headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from e
        except SchedulerClosed as e:
            raise ApiError(503, str(e), code=e.code) from e
        except Cancelled as e:
            raise ClientGone() from e
        except DeadlineExceeded as e:  # still waiting for a slot: busy, retry soon (seed 003)
            model.metrics.request_timeouts.inc()
            raise ApiError(
                503,
                f"The model '{model.id}' had no free KV slot within {e.deadline.limit:g} s "
                "(--request-timeout): every slot is busy; retry after Retry-After seconds",
                code="resident_capacity_full",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from e
    observer.admitted(lease.slot, lease.queue_wait_s)
    return lease
