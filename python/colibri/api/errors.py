"""Errors in each protocol's own envelope.

OpenAI: ``{"error": {"message", "type", "param", "code"}}``. Anthropic (``/v1/messages``):
``{"type": "error", "error": {"type", "message"}}``. Anything raised as :class:`ApiError` inside a
route, or produced by the security middleware, goes through :func:`error_response`. A failure
after a stream began (headers sent, status 200) is :func:`stream_failure`, sent in the stream in
each protocol's own event shape.
"""

from __future__ import annotations

import orjson
from starlette.responses import Response

from colibri.errors import ApiError

__all__ = ["ApiError", "error_body", "error_response", "is_anthropic_path", "stream_failure"]

# HTTP status -> OpenAI error type (what the official SDKs expect to see).
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}
# HTTP status -> Anthropic error type.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(path: str, err: ApiError) -> bytes:
    """The JSON error envelope of the protocol that ``path`` belongs to."""
    if is_anthropic_path(path):
        return orjson.dumps(
            {
                "type": "error",
                "error": {
                    "type": _ANTHROPIC_TYPES.get(err.status, "api_error"),
                    "message": err.message,
                },
            }
        )
    return orjson.dumps(
        {
            "error": {
                "message": err.message,
                "type": _OPENAI_TYPES.get(err.status, "invalid_request_error"),
                "param": err.param,
                "code": err.code,
            },
            **err.extra,
        }
    )


def stream_failure(e: Exception) -> ApiError:
    """The error of a generation that failed after its stream began: the response's status is
    already sent, so the routes put this in the stream (each protocol in its own shape)."""
    return ApiError(500, f"generation failed: {type(e).__name__}: {e}", code="internal_error")


def error_response(path: str, err: ApiError) -> Response:
    return Response(
        error_body(path, err),
        status_code=err.status,
        media_type="application/json",
        headers=err.headers,
    )
