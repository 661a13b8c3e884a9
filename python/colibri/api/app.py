"""The Starlette application: routes, protocol-shaped errors, security middleware."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from colibri.api import openai
from colibri.api.errors import ApiError, error_response
from colibri.api.security import security_middleware
from colibri.api.served import ServedModel

log = logging.getLogger("colibri.server")


async def health(request: Request) -> Response:
    """Public liveness; details only for an authenticated caller (or when no key is set)."""
    body: dict = {"status": "ok"}
    if request.scope.get("state", {}).get("authenticated", False):
        model: ServedModel = request.app.state.served
        body.update(model=model.id, busy=model.generator.busy)
    return openai.json_response(body)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = {
        404: f"No route {request.method} {request.url.path}; see docs/API.md",
        405: f"Method {request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    return error_response(request.url.path, ApiError(exc.status_code, message, code=code))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
    return error_response(request.url.path, err)


def create_app(served: ServedModel) -> Starlette:
    config = served.config
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", openai.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", openai.get_model, methods=["GET"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes,
        middleware=security_middleware(
            api_key=config.api_key,
            allowed_hosts=config.allowed_hosts,
            cors_origins=config.cors_origins,
        ),
        exception_handlers={
            ApiError: _api_error,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.served = served
    return app
