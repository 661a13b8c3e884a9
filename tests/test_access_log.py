"""The access log (one line per request on stderr, text or JSON, off with --quiet) and two
servers on one machine (--no-kv-persist takes no slot-file lock; a conflict says what to do)."""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from colibri.api.access_log import AccessLogMiddleware, format_text
from colibri.demo.builtin import builtin_model_dir
from colibri.observability import AccessRecord, Metrics, RequestObserver, make_tracer
from colibri.runtime.scheduler import Scheduler

from .server import RunningServer

MODEL = "colibri-builtin"
# Text that must never reach the log, whatever the request's fate.
SECRET_PROMPT = "the-secret-prompt-zebra-4711"
KEY = "sk-access-log-test-key"

_TEXT_LINE = re.compile(
    r"^(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z) (?P<method>\S+) "
    r'(?P<path>"(?:[^"\\]|\\.)*"|\S+) '
    r"(?P<status>\d{3}) (?P<duration_ms>\d+\.\d)ms(?P<rest>( .*)?)$"
)
_PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_text(line: str) -> dict | None:
    """A text access-log line as a dict (values as strings), None for any other line."""
    m = _TEXT_LINE.match(line.rstrip("\n"))
    if m is None:
        return None
    fields = {k: m.group(k) for k in ("time", "method", "path", "status", "duration_ms")}
    if fields["path"].startswith('"'):
        fields["path"] = json.loads(fields["path"])
    for key, value in _PAIR.findall(m.group("rest") or ""):
        fields[key] = json.loads(value) if value.startswith('"') else value
    return fields


def parse_json(line: str) -> dict | None:
    if not line.startswith("{"):
        return None
    return json.loads(line)


def access_lines(srv: RunningServer, parse=parse_text) -> list[dict]:
    return [f for f in (parse(line) for line in list(srv.log)) if f is not None]


def line_for(srv: RunningServer, request_id: str, parse=parse_text, timeout: float = 15) -> dict:
    """The access-log line of the request ``request_id`` (waits for it: streams log at the end)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [f for f in access_lines(srv, parse) if f.get("request_id") == request_id]
        if found:
            assert len(found) == 1, found
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no access line for {request_id}:\n" + "".join(srv.log))
        time.sleep(0.05)


def chat_body(model: str = MODEL, **extra: object) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
        "max_tokens": 4,
        **extra,
    }


@pytest.fixture(scope="module")
def server():
    srv = RunningServer()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_refused_request_names_code_and_field_not_the_prompt(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": SECRET_PROMPT}],
            extra_body={"bogus_knob": SECRET_PROMPT},
        )
    rid = info.value.response.headers["x-request-id"]
    line = line_for(server, rid)
    assert line["method"] == "POST" and line["path"] == "/v1/chat/completions"
    assert line["status"] == "400"
    assert line["code"] == "unknown_parameter" and line["param"] == "bogus_knob"
    assert SECRET_PROMPT not in "".join(server.log)


def test_chat_logs_status_and_token_counts(server, http):
    r = http.post("/v1/chat/completions", json=chat_body(), headers={"x-request-id": "chat-1"})
    assert r.status_code == 200
    usage = r.json()["usage"]
    line = line_for(server, "chat-1")
    assert line["status"] == "200" and line["model"] == MODEL
    assert int(line["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(line["completion_tokens"]) == usage["completion_tokens"] == 4
    assert int(line["cached_tokens"]) == usage["prompt_tokens_details"]["cached_tokens"]
    assert line["finish_reason"] == "length"
    assert float(line["queue_wait_ms"]) >= 0
    assert "code" not in line and "param" not in line
    assert SECRET_PROMPT not in "".join(server.log)


def test_stream_logs_at_its_end_with_its_token_counts(server, http):
    body = chat_body(max_tokens=6, stream=True, stream_options={"include_usage": True})
    headers = {"x-request-id": "stream-1"}
    with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        datas = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    usage = json.loads(datas[-2])["usage"]
    line = line_for(server, "stream-1")
    assert line["status"] == "200"
    assert int(line["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(line["completion_tokens"]) == usage["completion_tokens"] == 6
    assert line["finish_reason"] == "length"


def test_a_client_gone_mid_stream_logs_499(server, http):
    body = chat_body(max_tokens=100_000, stream=True)
    with http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "gone-1"}):
        pass  # closed after the headers: the server sees the disconnect while generating
    line = line_for(server, "gone-1")
    assert line["status"] == "499" and line["code"] == "client_gone"
    assert line["finish_reason"] == "cancelled"


def _observer(record: AccessRecord) -> RequestObserver:
    metrics = Metrics(Scheduler(1, 0, 10))
    return RequestObserver(make_tracer(), metrics, "chat", MODEL, record=record)


def test_a_request_cancelled_before_its_first_engine_step_logs_cancelled():
    # A client can go away between the stream's headers and the engine's first step (the
    # race the streamed 499 test above can hit): the line still says why the request ended.
    record = AccessRecord()
    observer = _observer(record)
    observer.admitted(0, 0.0)
    observer.end("cancelled")
    assert record.finish_reason == "cancelled"
    # The engine's own reason wins when it reported one, and a plain end adds none.
    finished = AccessRecord()
    observer = _observer(finished)
    observer.engine_started(5)
    observer.engine_finished("length", 3, None)
    observer.end("cancelled")
    assert (finished.finish_reason, finished.completion_tokens) == ("length", 3)
    refused = AccessRecord()
    _observer(refused).end()
    assert refused.finish_reason is None


def test_requests_without_a_body_route_are_logged(server, http):
    for path, status in (("/health", 200), ("/v1/models", 200), ("/metrics", 200)):
        rid = f"plain-{path.strip('/').replace('/', '-')}"
        assert http.get(path, headers={"x-request-id": rid}).status_code == status
        line = line_for(server, rid)
        assert (line["method"], line["path"], line["status"]) == ("GET", path, str(status))
        assert "model" not in line and "code" not in line
    http.get("/nowhere", headers={"x-request-id": "plain-404"})
    line = line_for(server, "plain-404")
    assert line["status"] == "404" and line["code"] == "not_found"
    http.post("/v1/models", headers={"x-request-id": "plain-405"})
    assert line_for(server, "plain-405")["code"] == "method_not_allowed"


def test_anthropic_messages_are_logged_with_their_tokens(server, http):
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    r = http.post("/v1/messages", json=body, headers={"x-request-id": "msg-1"})
    assert r.status_code == 200
    line = line_for(server, "msg-1")
    assert line["status"] == "200" and line["model"] == MODEL
    usage = r.json()["usage"]
    # Anthropic's input_tokens leave out the tokens read from the slot's history.
    cached = usage.get("cache_read_input_tokens") or 0
    assert int(line["prompt_tokens"]) == usage["input_tokens"] + cached
    assert int(line["cached_tokens"]) == cached
    assert int(line["completion_tokens"]) == 3


def test_a_line_is_always_one_line(server, http):
    # A percent-encoded newline in the path is quoted, not written out.
    http.get("/bad%0Afake%20line", headers={"x-request-id": "nl-1"})
    line = line_for(server, "nl-1")
    assert line["path"] == "/bad\nfake line" and line["status"] == "404"


def test_json_lines_and_a_401_without_the_key():
    srv = RunningServer("--api-key", KEY, "--log-format", "json")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            wrong = {"authorization": "Bearer not-the-" + KEY, "x-request-id": "auth-1"}
            r = http.post("/v1/chat/completions", json=chat_body(), headers=wrong)
            assert r.status_code == 401
            ok = {"authorization": f"Bearer {KEY}", "x-request-id": "auth-2"}
            r = http.post("/v1/chat/completions", json=chat_body(), headers=ok)
            assert r.status_code == 200
        refused = line_for(srv, "auth-1", parse_json)
        assert refused["status"] == 401 and refused["code"] == "invalid_api_key"
        assert refused["param"] is None and refused["model"] is None
        served = line_for(srv, "auth-2", parse_json)
        assert served["status"] == 200 and served["model"] == MODEL
        assert served["completion_tokens"] == 4 and served["prompt_tokens"] > 0
        assert served["code"] is None
        lines = access_lines(srv, parse_json)
        assert {tuple(f) for f in lines} == {
            (
                "time",
                "method",
                "path",
                "status",
                "duration_ms",
                "request_id",
                "model",
                "prompt_tokens",
                "cached_tokens",
                "completion_tokens",
                "queue_wait_ms",
                "finish_reason",
                "code",
                "param",
            )
        }
        log = "".join(srv.log)
        assert KEY not in log and SECRET_PROMPT not in log
    finally:
        srv.stop()


def test_quiet_logs_no_request():
    srv = RunningServer("--quiet")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200
            r = http.post("/v1/chat/completions", json=chat_body(bogus_knob=1))
            assert r.status_code == 400
        time.sleep(0.3)
        assert access_lines(srv) == [] and access_lines(srv, parse_json) == []
    finally:
        srv.stop()


# --- the write never fails a request ---------------------------------------------------------


class _Broken(io.StringIO):
    def write(self, s: str) -> int:
        raise BrokenPipeError("stderr is gone")


def test_a_failing_log_write_never_reaches_the_request():
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    async def hello(request):
        return PlainTextResponse("hello")

    app = AccessLogMiddleware(Starlette(routes=[Route("/", hello)]), stream=_Broken())
    with TestClient(app) as client:
        r = client.get("/")
    assert r.status_code == 200 and r.text == "hello"


def test_an_app_that_raises_is_logged_as_500():
    from starlette.testclient import TestClient

    async def broken(scope, receive, send):
        raise RuntimeError("boom " + SECRET_PROMPT)

    out = io.StringIO()
    app = AccessLogMiddleware(broken, log_format="json", stream=out)
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: only the request
    assert client.get("/x").status_code == 500
    (line,) = out.getvalue().splitlines()
    fields = json.loads(line)
    assert fields["status"] == 500 and fields["code"] == "internal_error"
    assert fields["path"] == "/x" and SECRET_PROMPT not in line


def test_text_format_quotes_what_would_break_a_line():
    fields = {
        "time": "2026-01-01T00:00:00.000Z",
        "method": "GET",
        "path": '/a b"c',
        "status": 404,
        "duration_ms": 1.31,
        "request_id": "r",
        "model": None,
        "code": "not_found",
        "param": "x=y\n",
    }
    assert format_text(fields) == (
        '2026-01-01T00:00:00.000Z GET "/a b\\"c" 404 1.3ms request_id=r code=not_found '
        'param="x=y\\n"'
    )
    assert AccessRecord().code is None


# --- two servers on one machine --------------------------------------------------------------


def _default_kv_dir(cache: Path) -> Path:
    """The KV directory `colibri serve` picks for the built-in model with COLI_CACHE_DIR=cache."""
    from colibri import cli

    args = argparse.Namespace(no_kv_persist=False, kv_dir=None)
    model_dir = builtin_model_dir()  # where the servers' --model points, under the real cache
    old = os.environ.get("COLI_CACHE_DIR")
    os.environ["COLI_CACHE_DIR"] = str(cache)
    try:
        return cli._kv_dir(args, model_dir)
    finally:
        if old is None:
            os.environ.pop("COLI_CACHE_DIR", None)
        else:
            os.environ["COLI_CACHE_DIR"] = old


def _serve_and_fail(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """`colibri serve` expected to refuse to start (it exits before serving)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("COLI_KV_DIR", "COLI_API_KEY")}
    full_env.update(env)
    cmd = [sys.executable, "-m", "colibri", "serve", "--model", str(builtin_model_dir())]
    cmd += ["--port", "0", "--threads", "2", *args]
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=60)


def test_second_server_beside_a_first_on_the_same_model(tmp_path):
    cache = tmp_path / "cache"
    env = {"COLI_CACHE_DIR": str(cache)}
    kv = _default_kv_dir(cache)
    # The first server holds the default KV directory's slot files.
    first = RunningServer("--kv-dir", str(kv), env=env)
    try:
        assert (kv / "slot-0.kv").is_file()
        # A second one without persistence takes no lock and serves.
        second = RunningServer("--no-kv-persist", env=env)
        try:
            body = chat_body(second.model_id)
            r = httpx.post(second.base_url + "/chat/completions", json=body, timeout=60)
            assert r.status_code == 200
        finally:
            second.stop()
        # A third one on the same (default) directory is refused, and told what to do.
        third = _serve_and_fail(env)
        assert third.returncode == 2, third.stderr
        message = third.stderr
        assert "the slot file is in use by another process" in message
        assert f"(pid {first.proc.pid})" in message
        assert str(kv) in message and "--kv-dir DIR" in message and "--no-kv-persist" in message
        # The first server is unharmed.
        body = chat_body(first.model_id)
        r = httpx.post(first.base_url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200
    finally:
        first.stop()
    # Free again once the first server is gone.
    second = RunningServer("--kv-dir", str(kv), env=env)
    second.stop()
