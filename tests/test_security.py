"""The security middleware: Host check, API key, CORS and body limit, alone and as one stack."""

from __future__ import annotations

import asyncio
import ipaddress
from collections.abc import Iterator, Sequence

import httpx
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.provisional import domains
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from starlette.types import Message, Receive, Scope, Send

from colibri.api.security import (
    DEFAULT_CORS_ORIGINS,
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    HostCheckMiddleware,
    is_loopback_host,
    security_middleware,
)

KEY = "sk-test-123"
LIMIT = 100
VITE = "http://localhost:5173"


# --- a tiny app behind the full stack ------------------------------------------------------------


class App:
    """A Starlette app wrapped in the security stack, remembering which routes ran."""

    def __init__(self, **options: object) -> None:
        self.calls: list[str] = []
        settings = {
            "api_key": KEY,
            "allowed_hosts": (),
            "cors_origins": (),
            "max_body_bytes": LIMIT,
            **options,
        }
        self.app = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/v1/chat/completions", self.echo, methods=["POST"]),
                Route("/v1/messages", self.echo, methods=["POST"]),
            ],
            middleware=security_middleware(**settings),  # type: ignore[arg-type]
        )

    async def health(self, request: Request) -> JSONResponse:
        self.calls.append(request.url.path)
        return JSONResponse({"authenticated": request.state.authenticated})

    async def echo(self, request: Request) -> JSONResponse:
        body = await request.body()
        self.calls.append(request.url.path)
        return JSONResponse({"length": len(body)})

    def client(self, host: str = "127.0.0.1") -> TestClient:
        return TestClient(self.app, base_url=f"http://{host}")


@pytest.fixture
def app() -> App:
    return App()


@pytest.fixture
def client(app: App) -> TestClient:
    return app.client()


def bearer(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def preflight(origin: str, headers: str = "authorization, content-type") -> dict[str, str]:
    return {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": headers,
    }


def openai_error(response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def anthropic_error(response) -> dict:
    body = response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    return body["error"]


# --- driving one middleware with raw ASGI messages -----------------------------------------------


class Echo:
    """A raw ASGI app that reads the whole body, then answers 200 with its length."""

    def __init__(self, *, start_first: bool = False) -> None:
        self.called = False
        self.start_first = start_first

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.called = True
        if scope["type"] != "http":
            return
        if self.start_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        if not self.start_first:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})


def http_scope(
    headers: Sequence[tuple[bytes, bytes]] = ((b"host", b"127.0.0.1"),),
    path: str = "/v1/chat/completions",
    method: str = "POST",
) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": list(headers),
    }


class Exchange:
    """One request driven through an ASGI app: the chunks read and the messages sent."""

    def __init__(self, app, scope: Scope, chunks: Sequence[bytes] = (b"",)) -> None:
        self.requests = [
            {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
            for i, chunk in enumerate(chunks)
        ]
        self.read = 0
        self.sent: list[Message] = []
        asyncio.run(app(scope, self.receive, self.send))

    async def receive(self) -> Message:
        if self.read < len(self.requests):
            self.read += 1
            return self.requests[self.read - 1]
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        self.sent.append(message)

    @property
    def status(self) -> int:
        return self.sent[0]["status"]

    @property
    def json(self) -> dict:
        return orjson.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


# --- Host check ----------------------------------------------------------------------------------

LOOPBACK_HOSTS = [
    "127.0.0.1",
    "127.0.0.1:8000",
    "127.9.8.7:1",
    "localhost",
    "LOCALHOST:8000",
    "localhost.",
    "app.localhost:5173",
    "[::1]",
    "[::1]:8000",
    "[0:0:0:0:0:0:0:1]:80",
    "[::ffff:127.0.0.1]:8000",
]
FOREIGN_HOSTS = [
    "evil.com",
    "evil.com:8000",
    "localhost.evil.com",
    "127.0.0.1.evil.com",
    "evillocalhost",
    ".localhost",
    "0.0.0.0:8000",
    "[::]:8000",
    "192.168.1.5",
    "[::1",
    "[::1]x",
    "[::1]:80:80",
    "[localhost]",
    "localhost:http",
    "localhost:8000:1",
    "",
]


@pytest.mark.parametrize("host", LOOPBACK_HOSTS)
def test_loopback_hosts_are_allowed(client: TestClient, host: str):
    r = client.get("/health", headers={"host": host})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", FOREIGN_HOSTS)
def test_other_hosts_are_refused(app: App, client: TestClient, host: str):
    r = client.get("/health", headers={"host": host})
    assert r.status_code == 403
    err = openai_error(r)
    assert err["code"] == "host_not_allowed" and err["type"] == "permission_error"
    assert repr(host) in err["message"]
    assert "--allowed-host" in err["message"] and "COLI_ALLOWED_HOSTS" in err["message"]
    assert app.calls == []


def test_refused_host_gets_no_cors_headers(client: TestClient):
    r = client.post("/v1/chat/completions", headers={"host": "evil.com", "Origin": VITE})
    assert r.status_code == 403
    assert "access-control-allow-origin" not in r.headers


def test_refused_host_on_messages_gets_the_anthropic_envelope(client: TestClient):
    r = client.post("/v1/messages", headers={"host": "evil.com"})
    assert r.status_code == 403
    assert anthropic_error(r)["type"] == "permission_error"


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        ("myhost.lan", True),
        ("MyHost.LAN:8000", True),
        ("sub.myhost.lan", False),
        ("myhost.lan.evil.com", False),
        ("myhost", False),
        ("192.168.1.5:8000", True),
        ("192.168.1.6", False),
        ("[fe80::1]:8000", True),
        ("[fe80:0::0001]", True),
    ],
)
def test_allowed_hosts_match_exactly(host: str, allowed: bool):
    app = App(allowed_hosts=["myhost.lan", " 192.168.1.5 ", "[fe80::1]", ""])
    r = app.client().get("/health", headers={"host": host})
    assert r.status_code == (200 if allowed else 403)


@pytest.mark.parametrize("entry", ["*", "*.example.com", "[::1", "host:port"])
def test_wildcard_or_malformed_allowed_host_is_a_startup_error(entry: str):
    with pytest.raises(ValueError, match="allowed host"):
        security_middleware(api_key=None, allowed_hosts=[entry], cors_origins=())


def test_request_without_host_header_passes():
    inner = Echo()
    exchange = Exchange(HostCheckMiddleware(inner), http_scope(headers=[]))
    assert exchange.status == 200 and inner.called


def test_every_host_header_must_be_allowed():
    headers = [(b"host", b"localhost"), (b"host", b"evil.com")]
    inner = Echo()
    exchange = Exchange(HostCheckMiddleware(inner), http_scope(headers=headers))
    assert exchange.status == 403 and not inner.called


@pytest.mark.parametrize(
    "middleware",
    [
        lambda app: HostCheckMiddleware(app),
        lambda app: ApiKeyMiddleware(app, api_key=KEY),
        lambda app: BodyLimitMiddleware(app, max_bytes=0),
    ],
)
def test_non_http_scopes_pass_straight_through(middleware):
    inner = Echo()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}}

    async def receive() -> Message:
        return {"type": "lifespan.startup"}

    async def send(message: Message) -> None:
        pass

    asyncio.run(middleware(inner)(scope, receive, send))
    assert inner.called
    assert "state" not in scope


# --- API key -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        bearer(),
        {"Authorization": f"bearer {KEY}"},
        {"Authorization": f"BEARER   {KEY} "},
        {"x-api-key": KEY},
        {"Authorization": "Bearer wrong", "x-api-key": KEY},
    ],
)
def test_the_key_is_accepted_in_either_header(app: App, client: TestClient, headers):
    r = client.post("/v1/chat/completions", content=b"{}", headers=headers)
    assert r.status_code == 200 and r.json() == {"length": 2}
    assert app.calls == ["/v1/chat/completions"]


@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong"),
        bearer(KEY + "x"),
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer"},
        {"x-api-key": "wrong"},
        {"x-api-key": ""},
    ],
)
def test_missing_or_wrong_key_is_refused(app: App, client: TestClient, headers):
    r = client.post("/v1/chat/completions", content=b"{}", headers=headers)
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    err = openai_error(r)
    assert err == {
        "message": err["message"],
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
    assert "Authorization: Bearer" in err["message"] and "x-api-key" in err["message"]
    assert app.calls == []


def test_missing_key_on_messages_gets_the_anthropic_envelope(client: TestClient):
    r = client.post("/v1/messages", content=b"{}")
    assert r.status_code == 401
    err = anthropic_error(r)
    assert err["type"] == "authentication_error"
    assert "x-api-key" in err["message"]


def test_health_is_public_and_tells_whether_the_caller_is_authenticated(client: TestClient):
    assert client.get("/health").json() == {"authenticated": False}
    assert client.get("/health", headers=bearer()).json() == {"authenticated": True}
    assert client.get("/health", headers={"x-api-key": "wrong"}).json() == {"authenticated": False}
    assert client.head("/health").status_code == 200


def test_only_get_and_head_health_are_public(client: TestClient):
    assert client.post("/health").status_code == 401
    assert client.get("/health/").status_code == 401
    assert client.get("/healthz").status_code == 401


def test_without_a_key_everything_passes():
    app = App(api_key=None)
    client = app.client()
    assert client.post("/v1/messages", content=b"abc").json() == {"length": 3}
    assert client.get("/health").json() == {"authenticated": True}


def test_an_empty_key_is_a_startup_error():
    with pytest.raises(ValueError, match="api_key"):
        security_middleware(api_key="", allowed_hosts=(), cors_origins=())


def test_non_ascii_key_is_compared_as_utf8():
    key = "clé-ünïcode"
    scope = http_scope(headers=[(b"x-api-key", key.encode("utf-8"))])
    assert Exchange(ApiKeyMiddleware(Echo(), api_key=key), scope).status == 200
    scope = http_scope(headers=[(b"x-api-key", key.encode("latin-1"))])
    assert Exchange(ApiKeyMiddleware(Echo(), api_key=key), scope).status == 401


def test_authenticated_flag_is_set_and_existing_state_kept():
    scope = http_scope(headers=[(b"authorization", f"Bearer {KEY}".encode())])
    scope["state"] = {"engine": "kept"}
    Exchange(ApiKeyMiddleware(Echo(), api_key=KEY), scope)
    assert scope["state"] == {"engine": "kept", "authenticated": True}


# --- CORS ----------------------------------------------------------------------------------------


def test_preflight_from_the_dev_server_needs_no_key(app: App, client: TestClient):
    r = client.options("/v1/chat/completions", headers=preflight(VITE))
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == VITE
    assert "POST" in r.headers["access-control-allow-methods"]
    assert app.calls == []


@pytest.mark.parametrize("origin", DEFAULT_CORS_ORIGINS)
def test_default_origins_are_allowed(client: TestClient, origin: str):
    r = client.options("/v1/messages", headers=preflight(origin))
    assert r.headers["access-control-allow-origin"] == origin


def test_preflight_accepts_the_sdk_headers(client: TestClient):
    sdk_headers = (
        "anthropic-version, anthropic-beta, anthropic-dangerous-direct-browser-access, x-api-key, "
        "content-type, x-stainless-arch, x-stainless-lang, x-stainless-os, "
        "x-stainless-package-version, x-stainless-retry-count, x-stainless-runtime, "
        "x-stainless-runtime-version, x-stainless-timeout, x-stainless-helper-method, "
        "x-request-id, traceparent, tracestate"
    )
    r = client.options("/v1/messages", headers=preflight(VITE, sdk_headers))
    assert r.status_code == 200, r.text


def test_preflight_refuses_unknown_headers_and_methods(client: TestClient):
    r = client.options("/v1/messages", headers=preflight(VITE, "x-something-else"))
    assert r.status_code == 400
    r = client.options(
        "/v1/messages", headers={**preflight(VITE), "Access-Control-Request-Method": "DELETE"}
    )
    assert r.status_code == 400


def test_preflight_from_a_foreign_origin_gets_no_allow_origin(client: TestClient):
    r = client.options("/v1/chat/completions", headers=preflight("https://evil.example"))
    assert "access-control-allow-origin" not in r.headers
    r = client.post("/v1/chat/completions", headers={"Origin": "https://evil.example", **bearer()})
    assert r.status_code == 200
    assert "access-control-allow-origin" not in r.headers


def test_extra_origins_are_exact():
    client = App(cors_origins=["https://app.example/"]).client()
    r = client.options("/v1/messages", headers=preflight("https://app.example"))
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = client.options("/v1/messages", headers=preflight("https://sub.app.example"))
    assert "access-control-allow-origin" not in r.headers
    r = client.options("/v1/messages", headers=preflight(VITE))
    assert r.headers["access-control-allow-origin"] == VITE


def test_star_allows_every_origin():
    client = App(cors_origins=["*"]).client()
    r = client.options("/v1/messages", headers=preflight("https://anything.example"))
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in r.headers


def test_errors_carry_cors_headers_for_an_allowed_origin(client: TestClient):
    r = client.post("/v1/chat/completions", headers={"Origin": VITE})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == VITE
    exposed = r.headers["access-control-expose-headers"]
    assert {"x-request-id", "x-colibri-queue-wait-ms", "retry-after", "x-should-retry"} <= set(
        exposed.split(", ")
    )
    r = client.post("/v1/chat/completions", content=b"x" * (LIMIT + 1), headers={"Origin": VITE})
    assert r.status_code == 413
    assert r.headers["access-control-allow-origin"] == VITE


def test_stack_order_and_cors_options():
    stack = security_middleware(
        api_key=None, allowed_hosts=["b", "a"], cors_origins=["http://x.example", VITE]
    )
    assert [m.cls for m in stack] == [
        HostCheckMiddleware,
        CORSMiddleware,
        BodyLimitMiddleware,
        ApiKeyMiddleware,
    ]
    cors = stack[1].kwargs
    assert list(cors["allow_origins"]) == [*DEFAULT_CORS_ORIGINS, "http://x.example"]
    assert set(cors["allow_methods"]) == {"GET", "POST", "OPTIONS"}
    assert cors["allow_credentials"] is False


# --- body limit ----------------------------------------------------------------------------------


def test_body_at_the_limit_passes(client: TestClient):
    r = client.post("/v1/chat/completions", content=b"x" * LIMIT, headers=bearer())
    assert r.status_code == 200 and r.json() == {"length": LIMIT}


def test_declared_oversized_body_is_refused_before_the_app_runs(app: App, client: TestClient):
    r = client.post("/v1/chat/completions", content=b"x" * (LIMIT + 1), headers=bearer())
    assert r.status_code == 413
    err = openai_error(r)
    assert err["code"] == "request_too_large"
    assert err["message"] == f"Request body exceeds the maximum size of {LIMIT} bytes"
    assert app.calls == []


def test_declared_length_is_refused_without_reading_the_body():
    inner = Echo()
    scope = http_scope(headers=[(b"content-length", b"101")])
    exchange = Exchange(BodyLimitMiddleware(inner, max_bytes=LIMIT), scope, [b"x" * 101])
    assert exchange.status == 413 and not inner.called and exchange.read == 0


def test_streamed_oversized_body_is_refused(app: App, client: TestClient):
    def chunks() -> Iterator[bytes]:
        for _ in range(5):
            yield b"x" * 30

    r = client.post("/v1/messages", content=chunks(), headers=bearer())
    assert r.status_code == 413
    err = anthropic_error(r)
    assert err["type"] == "request_too_large"
    assert str(LIMIT) in err["message"]
    assert app.calls == []


def test_streamed_body_is_cut_off_as_soon_as_it_passes_the_limit():
    exchange = Exchange(BodyLimitMiddleware(Echo(), max_bytes=LIMIT), http_scope(), [b"x" * 40] * 5)
    assert exchange.status == 413
    assert exchange.read == 3, "stops at the chunk that crosses the limit"
    assert exchange.json["error"]["code"] == "request_too_large"


def test_streamed_body_within_the_limit_passes():
    exchange = Exchange(
        BodyLimitMiddleware(Echo(), max_bytes=LIMIT), http_scope(), [b"x" * 50, b"x" * 50]
    )
    assert exchange.status == 200 and exchange.sent[1]["body"] == b"100"


def test_oversized_body_after_the_response_started_just_stops():
    exchange = Exchange(
        BodyLimitMiddleware(Echo(start_first=True), max_bytes=LIMIT), http_scope(), [b"x" * 101]
    )
    assert [m["type"] for m in exchange.sent] == ["http.response.start"]
    assert exchange.status == 200


@pytest.mark.parametrize(
    "values", [[b"abc"], [b"-1"], [b"+5"], [b"1_0"], [b" "], [b"5", b"6"], [b"\xd9\xa1"]]
)
def test_malformed_content_length_is_a_bad_request(values: list[bytes]):
    inner = Echo()
    scope = http_scope(headers=[(b"content-length", v) for v in values])
    exchange = Exchange(BodyLimitMiddleware(inner, max_bytes=LIMIT), scope)
    assert exchange.status == 400 and not inner.called
    err = exchange.json["error"]
    assert err["code"] == "invalid_request" and err["type"] == "invalid_request_error"


def test_repeated_equal_content_length_is_fine():
    scope = http_scope(headers=[(b"content-length", b"3"), (b"content-length", b"3")])
    exchange = Exchange(BodyLimitMiddleware(Echo(), max_bytes=LIMIT), scope, [b"abc"])
    assert exchange.status == 200


# --- loopback bind addresses ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost", "LocalHost", "::ffff:127.0.0.1"]
)
def test_loopback_bind_addresses(host: str):
    assert is_loopback_host(host)


@pytest.mark.parametrize(
    "host", ["0.0.0.0", "::", "", "192.168.0.10", "10.0.0.1", "example.com", "localhost.example"]
)
def test_non_loopback_bind_addresses(host: str):
    assert not is_loopback_host(host)


# --- property tests of the Host parser -----------------------------------------------------------

ALLOWED = ["myhost.lan", "192.168.1.5"]
GUARD = HostCheckMiddleware(Echo(), allowed_hosts=ALLOWED)

ports = st.one_of(st.just(""), st.integers(0, 65535).map(lambda p: f":{p}"))


def random_case(draw, text: str) -> str:
    flips = draw(st.lists(st.booleans(), min_size=len(text), max_size=len(text)))
    return "".join(c.upper() if flip else c for c, flip in zip(text, flips, strict=True))


def is_loopback_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


@st.composite
def foreign_hosts(draw) -> str:
    name = draw(
        st.one_of(
            domains().filter(lambda d: "localhost" not in d.lower() and d.lower() not in ALLOWED),
            st.ip_addresses(v=4)
            .filter(lambda ip: not is_loopback_ip(ip) and str(ip) not in ALLOWED)
            .map(str),
            st.ip_addresses(v=6)
            .filter(lambda ip: not is_loopback_ip(ip))
            .map(lambda ip: f"[{ip}]"),
        )
    )
    return random_case(draw, name) + draw(ports)


@st.composite
def loopback_hosts(draw) -> str:
    label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", fullmatch=True)
    name = draw(
        st.one_of(
            st.just("localhost"),
            label.map(lambda s: f"{s}.localhost"),
            st.tuples(*[st.integers(0, 255)] * 3).map(lambda t: "127." + ".".join(map(str, t))),
            st.just("[::1]"),
            st.just("[::ffff:127.0.0.1]"),
        )
    )
    return random_case(draw, name) + draw(ports)


@given(foreign_hosts())
def test_any_host_neither_allowed_nor_loopback_is_refused(host: str):
    assert not GUARD.is_allowed(host)


@given(loopback_hosts())
def test_loopback_forms_with_any_port_are_accepted(host: str):
    assert GUARD.is_allowed(host)


@given(st.text())
def test_a_foreign_domain_suffix_is_never_accepted(prefix: str):
    assert not GUARD.is_allowed(prefix + ".evil.com")
    assert not GUARD.is_allowed(prefix + ".myhost.lan")


def test_a_refused_request_with_a_body_closes_its_connection_cleanly():
    """A 401 sent before the body is read says Connection: close, so a keep-alive client's next
    request goes down a fresh connection instead of meeting the close (found as a CI flake)."""
    from .server import RunningServer

    srv = RunningServer("--api-key", KEY)
    body = {"model": "colibri-builtin", "messages": [{"role": "user", "content": "hi"}]}
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            for _ in range(20):
                r = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
                assert r.status_code == 401
                assert r.headers["connection"] == "close"
                r = http.post(
                    "/v1/chat/completions", json={**body, "max_tokens": 1}, headers=bearer()
                )
                assert r.status_code == 200
                # Without a body nothing is left unread: the connection is kept.
                r = http.get("/v1/models")
                assert r.status_code == 401 and "close" not in r.headers.get("connection", "")
    finally:
        srv.stop()
