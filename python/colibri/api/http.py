"""Request helpers every route uses: the JSON body, the JSON answer, the request id, the
served models of the app and the one a request names."""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from colibri.errors import ApiError
from colibri.runtime.models import ModelSet
from colibri.runtime.served import ServedModel


def json_response(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


async def read_json(request: Request) -> Any:
    raw = await request.body()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"The request body is not valid JSON: {e}", code="invalid_json") from e


def request_id(request: Request) -> str | None:
    return request.scope.get("state", {}).get("request_id")


def served(request: Request) -> ServedModel:
    return request.app.state.served


def models(request: Request) -> ModelSet:
    return request.app.state.models
