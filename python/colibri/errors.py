"""The one refusal type every layer raises: a status, a message a person can act on, a stable
code and the parameter at fault. The API layer (api/errors.py) puts it in each protocol's
envelope; chat planning and admission raise it without knowing the protocol."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """A request refused with a status, a message a person can act on, and a stable code."""

    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        # Top-level members beside the OpenAI envelope's "error" (e.g. a 422's "detail").
        self.extra = extra or {}
