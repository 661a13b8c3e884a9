"""Field-by-field validation of a JSON request body, with errors a client can act on.

Every field a request may carry is read through a :class:`Body`; whatever is left unread at the
end is an unknown field and refused by name (nothing is silently ignored).
"""

from __future__ import annotations

from typing import Any

from colibri.api.errors import ApiError


def bad(message: str, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, code=code, param=param)


def _type_name(value: Any) -> str:
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "an array",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)


class Body:
    """A JSON object whose fields are taken one by one."""

    def __init__(self, data: Any, where: str = "body") -> None:
        if not isinstance(data, dict):
            raise bad(f"the request {where} must be a JSON object, not {_type_name(data)}")
        self._data = data
        self._unread = set(data)
        self._where = where

    def _take(self, key: str) -> Any:
        self._unread.discard(key)
        return self._data.get(key)

    def raw_dict(self) -> dict[str, Any]:
        """The whole object, taken as is (e.g. a JSON schema): nothing in it is unknown."""
        self._unread.clear()
        return self._data

    def is_empty(self) -> bool:
        return not self._data

    def present(self, key: str) -> bool:
        return self._data.get(key) is not None

    def raw(self, key: str) -> Any:
        return self._take(key)

    def _fail(self, key: str, want: str, value: Any) -> ApiError:
        return bad(f"'{key}' must be {want}, got {_type_name(value)}", param=key)

    def string(self, key: str, required: bool = False) -> str | None:
        v = self._take(key)
        if v is None:
            if required:
                raise bad(f"'{key}' is required", param=key, code="missing_required_parameter")
            return None
        if not isinstance(v, str):
            raise self._fail(key, "a string", v)
        return v

    def boolean(self, key: str) -> bool | None:
        v = self._take(key)
        if v is None:
            return None
        if not isinstance(v, bool):
            raise self._fail(key, "a boolean", v)
        return v

    def integer(
        self, key: str, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        v = self._take(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int):
            raise self._fail(key, "an integer", v)
        if minimum is not None and v < minimum:
            raise bad(f"'{key}' must be at least {minimum}, got {v}", param=key)
        if maximum is not None and v > maximum:
            raise bad(f"'{key}' must be at most {maximum}, got {v}", param=key)
        return v

    def number(
        self, key: str, minimum: float, maximum: float, exclusive_min: bool = False
    ) -> float | None:
        v = self._take(key)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self._fail(key, "a number", v)
        low_ok = v > minimum if exclusive_min else v >= minimum
        if not low_ok or v > maximum:
            low = "(" if exclusive_min else "["
            raise bad(f"'{key}' must be in {low}{minimum}, {maximum}], got {v}", param=key)
        return float(v)

    def obj(self, key: str) -> Body | None:
        v = self._take(key)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._fail(key, "an object", v)
        return Body(v, where=f"'{key}'")

    def array(self, key: str) -> list[Any] | None:
        v = self._take(key)
        if v is None:
            return None
        if not isinstance(v, list):
            raise self._fail(key, "an array", v)
        return v

    def finish(self) -> None:
        """Refuses whatever field was not read: an unknown or unsupported parameter. A field
        sent as null counts as absent (SDKs often serialise unset fields that way)."""
        unread = sorted(k for k in self._unread if self._data[k] is not None)
        if unread:
            key = unread[0]
            scope = "" if self._where == "body" else f" in {self._where}"
            raise bad(
                f"unknown or unsupported parameter '{key}'{scope}; see docs/API.md for what "
                "colibri accepts",
                param=key,
                code="unknown_parameter",
            )


def refuse_unless(ok: bool, message: str, param: str, code: str = "unsupported_parameter") -> None:
    if not ok:
        raise bad(message, param=param, code=code)
