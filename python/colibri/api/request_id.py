"""Every response carries an ``x-request-id``: the client's own (when it is a sane token) or a
fresh one, so a log line, a trace and a client report can be matched."""

from __future__ import annotations

import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_SANE = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == b"x-request-id"), None)
        rid = given if given is not None and _SANE.match(given) else uuid.uuid4().hex.encode()
        state = scope.setdefault("state", {})
        state["request_id"] = rid.decode()
        state["arrived"] = time.monotonic()  # a --request-timeout counts from here

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
