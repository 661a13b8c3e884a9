"""The access log: one line per HTTP request on stderr, written once the response has finished.

:class:`AccessLogMiddleware` sits just inside the request-id layer, so it knows the request's id
and sees every response (security refusals, 404s, health and metrics included). It keeps an
:class:`~colibri.observability.AccessRecord` in ``scope["state"]`` (:func:`record_of`) that the
error handlers fill with the refusal's ``code`` and ``param`` (:func:`note_error`) and the
request's ``RequestObserver`` (each route passes it the record) with the model, token counts,
queue wait and finish reason. A streamed reply's line comes at the end of the stream, with its
token counts and the stream's whole duration.

Formats (docs/API.md, "Access log"): ``text``, one human-readable line of ``key=value`` pairs
after the time, method, path, status and duration; ``json``, one JSON object per line. A line
never holds the prompt, the output, an error's message text or a key.
"""

from __future__ import annotations

import asyncio
import sys
import time
from datetime import UTC, datetime
from typing import Any, Literal, TextIO

import orjson
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from colibri.api.errors import ApiError
from colibri.observability import AccessRecord

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = ("text", "json")

# The status logged for a client that went away before its response was complete (nginx's).
CLIENT_GONE = 499
_STATE_KEY = "access_log"
# Longest path or param written (a 404 on a megabyte of path stays one readable line).
_MAX_VALUE = 512


def record_of(scope: Scope) -> AccessRecord | None:
    """The access-log record of the request ``scope`` belongs to (None: no access log)."""
    record = scope.get("state", {}).get(_STATE_KEY)
    return record if isinstance(record, AccessRecord) else None


def note_error(scope: Scope, err: ApiError) -> None:
    """Records the error response's ``code`` and ``param`` (never its message)."""
    record = record_of(scope)
    if record is not None:
        record.code = err.code
        record.param = err.param


class AccessLogMiddleware:
    """Writes one access-log line per HTTP request after its response has finished."""

    def __init__(
        self, app: ASGIApp, log_format: LogFormat = "text", stream: TextIO | None = None
    ) -> None:
        if log_format not in LOG_FORMATS:
            raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}")
        self.app = app
        self.log_format = log_format
        self._stream = stream  # None: sys.stderr at the time of writing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started_at = time.time()
        t0 = time.perf_counter()
        state = scope.setdefault("state", {})
        record = AccessRecord(request_id=state.get("request_id"))
        state[_STATE_KEY] = record
        status: int | None = None
        finished = False
        gone = False

        async def watching_receive() -> Message:
            nonlocal gone
            message = await receive()
            if message["type"] == "http.disconnect" and not finished:
                gone = True
            return message

        async def watching_send(message: Message) -> None:
            nonlocal status, finished
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)

        try:
            await self.app(scope, watching_receive, watching_send)
        except (asyncio.CancelledError, ClientDisconnect):
            gone = True
            raise
        except Exception:
            status = 500
            record.code = record.code or "internal_error"
            raise
        finally:
            if gone and not finished:
                status = CLIENT_GONE
                record.code = record.code or "client_gone"
            duration_ms = (time.perf_counter() - t0) * 1e3
            self._write(scope, started_at, status, duration_ms, record)

    def _write(
        self,
        scope: Scope,
        started_at: float,
        status: int | None,
        duration_ms: float,
        record: AccessRecord,
    ) -> None:
        """Writes the line; a failure (closed stderr, a broken pipe) is swallowed."""
        try:
            fields = access_fields(scope, started_at, status, duration_ms, record)
            line = format_json(fields) if self.log_format == "json" else format_text(fields)
            stream = self._stream if self._stream is not None else sys.stderr
            stream.write(line + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 - the log must never fail a request
            pass


def _clip(value: str) -> str:
    return value if len(value) <= _MAX_VALUE else value[:_MAX_VALUE] + "..."


def access_fields(
    scope: Scope,
    started_at: float,
    status: int | None,
    duration_ms: float,
    record: AccessRecord,
) -> dict[str, Any]:
    """The fields of one line, in their order. A status of None (the app sent nothing and
    raised nothing) is logged as 500: the server closed the connection without an answer."""
    when = datetime.fromtimestamp(started_at, UTC)
    code, param = record.code, record.param
    if status is not None and status < 400:
        code = param = None  # a success has no error code, whatever was noted on the way
    return {
        "time": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z",
        "method": _clip(str(scope.get("method", ""))),
        "path": _clip(str(scope.get("path", ""))),
        "status": 500 if status is None else status,
        "duration_ms": round(duration_ms, 1),
        "request_id": record.request_id,
        "model": record.model,
        "prompt_tokens": record.prompt_tokens,
        "cached_tokens": record.cached_tokens,
        "completion_tokens": record.completion_tokens,
        "queue_wait_ms": record.queue_wait_ms,
        "finish_reason": record.finish_reason,
        "code": code,
        "param": None if param is None else _clip(param),
    }


def format_json(fields: dict[str, Any]) -> str:
    """One JSON object; every field present, ``null`` when unknown."""
    return orjson.dumps(fields).decode()


def _text_value(value: Any) -> str:
    """A value as written in a text line: quoted (JSON string escapes) when it is empty or
    holds a space, a quote, ``=`` or a control character, so a line is always one line."""
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' "=\\'):
        return text
    return orjson.dumps(text).decode()


def format_text(fields: dict[str, Any]) -> str:
    """``TIME METHOD PATH STATUS DURATIONms key=value...``; unknown fields are left out."""
    head = [
        fields["time"],
        _text_value(fields["method"]),
        _text_value(fields["path"]),
        str(fields["status"]),
        f"{fields['duration_ms']:.1f}ms",
    ]
    skip = {"time", "method", "path", "status", "duration_ms"}
    pairs = [
        f"{key}={_text_value(value)}"
        for key, value in fields.items()
        if key not in skip and value is not None
    ]
    return " ".join(head + pairs)
