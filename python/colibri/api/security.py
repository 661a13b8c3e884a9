"""Security middleware: Host check, CORS, request body limit and API key.

:func:`security_middleware` assembles them, outermost first::

    HostCheck -> CORS -> BodyLimit -> ApiKey -> app

The Host check comes first so a DNS-rebound page learns nothing, not even CORS headers. CORS sits
outside the other two so a preflight is answered before any key check and the 401/413 errors still
carry the headers a browser needs to read them. Every refusal uses the protocol's own error envelope
(:func:`colibri.api.errors.error_response`).
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Iterable

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .access_log import note_error
from .errors import ApiError, error_response
from .web import is_page_path

DEFAULT_MAX_BODY_BYTES = 12_517_376

# The Vite dev server of the web UI and the origins a Tauri desktop shell loads pages from.
DEFAULT_CORS_ORIGINS = (
    "http://localhost:5173",
    "http://127.0.0.1:5173",
    "tauri://localhost",
    "http://tauri.localhost",
    "https://tauri.localhost",
)

CORS_ALLOW_METHODS = ("GET", "POST", "OPTIONS")
# What the official OpenAI and Anthropic JS SDKs send from a browser; a preflight asking for any
# header outside this list (and the CORS-safelisted ones) is refused.
CORS_ALLOW_HEADERS = (
    "authorization",
    "content-type",
    "x-api-key",
    "anthropic-version",
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "x-request-id",
    "x-stainless-arch",
    "x-stainless-helper-method",
    "x-stainless-lang",
    "x-stainless-os",
    "x-stainless-package-version",
    "x-stainless-retry-count",
    "x-stainless-runtime",
    "x-stainless-runtime-version",
    "x-stainless-timeout",
    # W3C trace context, from browser OpenTelemetry instrumentation (joins the caller's trace).
    "traceparent",
    "tracestate",
)
CORS_EXPOSE_HEADERS = (
    "x-request-id",
    "x-colibri-queue-wait-ms",
    "retry-after",
    "x-should-retry",
)

_LOCALHOST = "localhost"
_LOCALHOST_SUFFIX = ".localhost"


# --- shared helpers ------------------------------------------------------------------------------


def _header_values(scope: Scope, name: bytes) -> list[bytes]:
    """Every value of header ``name`` (lower case) in an HTTP scope, raw bytes."""
    return [value for key, value in scope["headers"] if key.lower() == name]


async def _refuse(scope: Scope, receive: Receive, send: Send, err: ApiError) -> None:
    """Answer with ``err`` in the envelope of the protocol the path belongs to.

    A refusal sent before the request's body was read says ``Connection: close``: the server
    drops the connection after it (the unread body would be taken for the next request), and a
    client that saw the header does not send its next request down a connection about to close
    (without it, a keep-alive client's next request could meet the close: "server disconnected
    without sending a response")."""
    note_error(scope, err)
    has_body = any(v.strip() != b"0" for v in _header_values(scope, b"content-length")) or bool(
        _header_values(scope, b"transfer-encoding")
    )

    async def send_closing(message: dict) -> None:
        if has_body and message["type"] == "http.response.start":
            message = {**message, "headers": [*message["headers"], (b"connection", b"close")]}
        await send(message)

    await error_response(scope["path"], err)(scope, receive, send_closing)


# --- host names ----------------------------------------------------------------------------------


def _is_port(text: str) -> bool:
    # An empty port ("localhost:") is legal in a URI authority and means the default port.
    return text == "" or (len(text) <= 5 and text.isascii() and text.isdigit())


def _canonical(name: str) -> str:
    """An IP address in its one standard spelling (``::0001`` -> ``::1``); other names as given."""
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def host_name(value: str) -> str | None:
    """The name in a Host header value or bind address: no port, no brackets, lower case.

    ``None`` when the value is malformed (it then matches nothing).
    """
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        rest = value[end + 1 :]
        if end == -1 or (rest and not (rest[0] == ":" and _is_port(rest[1:]))):
            return None
        name = value[1:end]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None  # brackets hold only IPv6 literals
    elif value.count(":") == 1:
        name, port = value.split(":")
        if not _is_port(port):
            return None
    else:
        # No colon: a bare name. Several: an unbracketed IPv6 address, which a Host header never
        # carries but a bind address ("::1") does.
        name = value
    # "localhost." is the fully qualified spelling of "localhost".
    name = name.removesuffix(".")
    return _canonical(name) if name else None


def _is_loopback_ip(name: str) -> bool:
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    # ::ffff:127.0.0.1 is IPv4 loopback written as IPv6; ``is_loopback`` alone says False.
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def _is_loopback_name(name: str) -> bool:
    """``localhost``, a name under ``.localhost`` (RFC 6761), 127.0.0.0/8 or ``::1``."""
    return (
        name == _LOCALHOST
        or (name.endswith(_LOCALHOST_SUFFIX) and len(name) > len(_LOCALHOST_SUFFIX))
        or _is_loopback_ip(name)
    )


def is_loopback_host(host: str) -> bool:
    """Whether the bind address ``host`` only listens on this machine (``0.0.0.0`` does not)."""
    name = host_name(host)
    return name is not None and _is_loopback_name(name)


def allowed_host_names(hosts: Iterable[str]) -> frozenset[str]:
    """The names of ``--allowed-host`` / ``COLI_ALLOWED_HOSTS``, normalised like a Host header.

    Raises ``ValueError`` for a wildcard or a malformed entry; empty entries are skipped.
    """
    names: set[str] = set()
    for entry in hosts:
        entry = entry.strip()
        if not entry:
            continue
        if "*" in entry:
            raise ValueError(
                f"allowed host {entry!r}: wildcards are not supported, list each name exactly"
            )
        name = host_name(entry)
        if name is None:
            raise ValueError(f"allowed host {entry!r} is not a valid host name or address")
        names.add(name)
    return frozenset(names)


# --- Host check ----------------------------------------------------------------------------------


class HostCheckMiddleware:
    """Refuses requests whose Host header is not this machine or an allowed name.

    A DNS-rebinding page reaches the server under the attacker's own domain name, so its requests
    carry that name as Host; only loopback names and the operator's explicit list get through.
    """

    def __init__(self, app: ASGIApp, allowed_hosts: Iterable[str] = ()) -> None:
        self.app = app
        self.allowed = allowed_host_names(allowed_hosts)

    def is_allowed(self, host: str) -> bool:
        name = host_name(host)
        return name is not None and (_is_loopback_name(name) or name in self.allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # A request without any Host header passes: only HTTP/1.0 and hand-made clients omit it,
        # while browsers - the vehicle of DNS rebinding - always send one.
        for raw in _header_values(scope, b"host"):
            host = raw.decode("latin-1")
            if not self.is_allowed(host):
                await _refuse(scope, receive, send, self._not_allowed(host))
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _not_allowed(host: str) -> ApiError:
        name = host_name(host) or host
        return ApiError(
            403,
            f"Host {host!r} is not allowed. If this server is meant to be reached under that "
            f"name, start it with --allowed-host {name} or add it to COLI_ALLOWED_HOSTS.",
            code="host_not_allowed",
        )


# --- API key -------------------------------------------------------------------------------------


def _presented_keys(scope: Scope) -> list[bytes]:
    """The keys a request offers, from ``Authorization: Bearer KEY`` and ``x-api-key: KEY``."""
    keys = []
    for name, value in scope["headers"]:
        name = name.lower()
        if name == b"authorization":
            parts = value.strip().split(None, 1)
            if len(parts) == 2 and parts[0].lower() == b"bearer":
                keys.append(parts[1].strip())
        elif name == b"x-api-key":
            keys.append(value.strip())
    return keys


def _key_bytes(api_key: str | None) -> bytes | None:
    # An empty key would be matched by an empty "x-api-key:" header: refuse it outright.
    if api_key == "":
        raise ValueError("api_key must be a non-empty string, or None for no key")
    return api_key.encode("utf-8") if api_key is not None else None


def _is_exempt(scope: Scope) -> bool:
    """Requests that pass without a key: the health probe, CORS preflights and the web
    dashboard's static files (a page load carries no key; the page's API calls do)."""
    method = scope["method"]
    # OPTIONS is a CORS preflight; the CORS layer outside answers it, browsers never send a key.
    if method == "OPTIONS":
        return True
    # /health stays public; the route reads state["authenticated"] to decide how much to show.
    path = scope["path"]
    return method in ("GET", "HEAD") and (path == "/health" or is_page_path(path))


class ApiKeyMiddleware:
    """Requires the API key on every request except /health and preflights, when a key is set.

    Records ``scope["state"]["authenticated"]`` for every request (True when no key is set).
    """

    def __init__(self, app: ASGIApp, api_key: str | None) -> None:
        self.app = app
        self.key = _key_bytes(api_key)

    def is_authenticated(self, scope: Scope) -> bool:
        if self.key is None:
            return True
        key = self.key
        return any(hmac.compare_digest(offered, key) for offered in _presented_keys(scope))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authenticated = self.is_authenticated(scope)
        scope.setdefault("state", {})["authenticated"] = authenticated
        if authenticated or _is_exempt(scope):
            await self.app(scope, receive, send)
            return
        await _refuse(scope, receive, send, _invalid_api_key())


def _invalid_api_key() -> ApiError:
    return ApiError(
        401,
        "Missing or invalid API key. Send it as 'Authorization: Bearer <key>' "
        "or in the 'x-api-key' header.",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


# --- body limit ----------------------------------------------------------------------------------


class _BodyTooLarge(Exception):
    """Raised by the wrapped ``receive`` once the body passes the limit."""


def _content_length(scope: Scope) -> int | None:
    """The declared body length, ``None`` if not declared; ``ValueError`` if malformed."""
    values = {value.strip() for value in _header_values(scope, b"content-length")}
    if not values:
        return None
    if len(values) > 1:
        raise ValueError("conflicting Content-Length headers")
    (value,) = values
    if not value.isdigit():  # bytes.isdigit is ASCII-only; int() alone would accept "+1", "1_0"
        raise ValueError("Content-Length is not a non-negative integer")
    return int(value)


class BodyLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` without ever holding more than that in memory.

    A declared Content-Length over the limit is refused before the app runs; an undeclared
    (chunked) body is counted as it is read and cut off the moment it passes the limit.
    """

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"Request body exceeds the maximum size of {self.max_bytes} bytes",
            code="request_too_large",
            # The same body will never fit: SDKs that read this header do not retry it.
            headers={"x-should-retry": "false"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            declared = _content_length(scope)
        except ValueError:
            err = ApiError(400, "Malformed Content-Length header", code="invalid_request")
            await _refuse(scope, receive, send, err)
            return
        if declared is not None and declared > self.max_bytes:
            await _refuse(scope, receive, send, self._too_large())
            return
        await self._call_counting(scope, receive, send)

    async def _call_counting(self, scope: Scope, receive: Receive, send: Send) -> None:
        received = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal received
            if received > self.max_bytes:  # the app caught the first refusal and read on
                raise _BodyTooLarge
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise _BodyTooLarge
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _BodyTooLarge:
            # Once the status line is out nothing can be said any more: ending here leaves the
            # response incomplete, and the server closes the connection.
            if not started:
                await _refuse(scope, receive, send, self._too_large())


# --- assembly ------------------------------------------------------------------------------------


def cors_allow_origins(extra: Iterable[str]) -> list[str]:
    """The default origins plus ``extra`` (exact origins), or ``["*"]`` if ``extra`` has "*"."""
    # Browsers send an Origin without a trailing slash; forgive one in the configuration.
    cleaned = [origin.strip().rstrip("/") for origin in extra if origin.strip()]
    if "*" in cleaned:
        return ["*"]
    return list(dict.fromkeys([*DEFAULT_CORS_ORIGINS, *cleaned]))


def security_middleware(
    *,
    api_key: str | None,
    allowed_hosts: Iterable[str],
    cors_origins: Iterable[str],
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> list[Middleware]:
    """The security stack for ``Starlette(middleware=...)``, outermost first.

    The options are checked here, at startup, rather than when Starlette first builds the stack.
    """
    hosts = sorted(allowed_host_names(allowed_hosts))
    _key_bytes(api_key)
    if max_body_bytes < 0:
        raise ValueError("max_body_bytes must be >= 0")
    return [
        Middleware(HostCheckMiddleware, allowed_hosts=hosts),
        Middleware(
            CORSMiddleware,
            allow_origins=cors_allow_origins(cors_origins),
            allow_methods=CORS_ALLOW_METHODS,
            allow_headers=CORS_ALLOW_HEADERS,
            expose_headers=CORS_EXPOSE_HEADERS,
            allow_credentials=False,
        ),
        Middleware(BodyLimitMiddleware, max_bytes=max_body_bytes),
        Middleware(ApiKeyMiddleware, api_key=api_key),
    ]
