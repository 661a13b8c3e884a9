"""`colibri serve` options end to end: API key, Host allowlist, CORS, body limit, model alias,
bind safety, continuation switch, chat-family override and reasoning split."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from openai import OpenAI

from colibri.demo.builtin import CHAT_TEMPLATE, builtin_model_dir
from colibri.runtime.engine import Engine

from .server import RunningServer, model_with_template, think_open_template

KEY = "s3cret-key"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def secured():
    srv = RunningServer(
        "--api-key", KEY, "--model-id", "my-model", "--allowed-host", "llm.example.com",
        "--cors-origin", "https://ui.example",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_key_is_required(secured):
    bad = OpenAI(base_url=secured.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.models.list()
    assert e.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="my-model", messages=HELLO, max_tokens=2)
    r = httpx.post(secured.base_url + "/completions", json={"model": "my-model", "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_key_by_bearer_and_x_api_key(secured):
    good = OpenAI(base_url=secured.base_url, api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["my-model"]
    r = good.chat.completions.create(model="my-model", messages=HELLO, max_tokens=3)
    assert r.model == "my-model" and r.usage.completion_tokens == 3
    r = httpx.get(secured.base_url + "/models", headers={"x-api-key": KEY})
    assert r.status_code == 200


def test_alias_and_directory_name_both_name_the_model(secured):
    good = OpenAI(base_url=secured.base_url, api_key=KEY, max_retries=0)
    assert good.models.retrieve("my-model").id == "my-model"
    # The model's own id stays valid next to the alias.
    assert good.models.retrieve("colibri-builtin").id == "my-model"
    r = good.chat.completions.create(model="colibri-builtin", messages=HELLO, max_tokens=2)
    assert r.model == "my-model"
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="other", messages=HELLO, max_tokens=2)


def test_health_shows_details_only_with_the_key(secured):
    public = httpx.get(secured.url + "/health").json()
    assert public == {"status": "ok"}
    private = httpx.get(secured.url + "/health", headers={"authorization": f"Bearer {KEY}"}).json()
    assert private["status"] == "ok" and private["model"] == "my-model"


def test_host_header_allowlist(secured):
    auth = {"x-api-key": KEY}
    for host, status in (
        ("evil.example", 403),
        ("llm.example.com.evil.example", 403),
        ("localhost.evil.example", 403),
        ("llm.example.com", 200),
        ("llm.example.com:8443", 200),
        ("localhost:1234", 200),
        ("127.0.0.1", 200),
        ("[::1]:80", 200),
    ):
        r = httpx.get(secured.base_url + "/models", headers={**auth, "host": host})
        assert r.status_code == status, host
        if status == 403:
            assert r.json()["error"]["code"] == "host_not_allowed"


def test_cors_preflight_and_origins(secured):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(
            secured.base_url + "/chat/completions",
            headers={
                "origin": origin,
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )

    for origin in ("http://localhost:5173", "http://127.0.0.1:5173", "tauri://localhost",
                   "https://ui.example"):  # fmt: skip
        r = preflight(origin)
        assert r.status_code == 200, origin
        assert r.headers["access-control-allow-origin"] == origin
    r = preflight("https://evil.example")
    assert "access-control-allow-origin" not in r.headers
    # Errors carry CORS headers so a browser client can read them.
    r = httpx.get(secured.base_url + "/models", headers={"origin": "http://localhost:5173"})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == "http://localhost:5173"


def test_body_limit(secured):
    big = b'{"model": "my-model", "prompt": "' + b"x" * 12_517_376 + b'"}'
    r = httpx.post(
        secured.base_url + "/completions",
        content=big,
        headers={"x-api-key": KEY, "content-type": "application/json"},
    )
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"
    assert "12517376" in r.json()["error"]["message"]


def test_non_loopback_bind_without_key_refuses_to_start():
    proc = subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--host", "0.0.0.0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in __import__("os").environ.items() if k != "COLI_API_KEY"},
    )
    assert proc.returncode == 2
    assert "without an API key" in proc.stderr


# --- chat behaviour switches ------------------------------------------------------------------


def test_continuation_can_be_switched_off():
    srv = RunningServer(env={"COLI_CONTINUE_ASSISTANT": "0"})
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        messages = [*HELLO, {"role": "assistant", "content": "Sure"}]
        engine = Engine(builtin_model_dir(), threads=1)
        from colibri.chat.template import ChatTemplate

        folded = ChatTemplate(CHAT_TEMPLATE).render(
            messages, add_generation_prompt=True, enable_thinking=False
        )
        r = client.chat.completions.create(model="colibri-builtin", messages=messages, max_tokens=2)
        assert r.usage.prompt_tokens == len(engine.tokenize(folded))
        # Trailing whitespace is no problem when nothing is continued.
        messages[-1]["content"] = "Sure "
        r = client.chat.completions.create(model="colibri-builtin", messages=messages, max_tokens=2)
        assert r.choices[0].finish_reason == "length"
    finally:
        srv.stop()


def test_family_without_reasoning_refuses_thinking():
    srv = RunningServer("--chat-family", "olmoe")
    try:
        client = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        for extra in ({"reasoning_effort": "high"}, {"extra_body": {"enable_thinking": True}}):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(
                    model="colibri-builtin", messages=HELLO, max_tokens=2, **extra
                )
            assert e.value.body["code"] == "reasoning_not_supported"
        r = client.chat.completions.create(
            model="colibri-builtin", messages=HELLO, max_tokens=4, reasoning_effort="none"
        )
        assert "reasoning" not in (r.choices[0].message.model_extra or {})
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    model = model_with_template(
        builtin_model_dir(), tmp_path_factory.mktemp("m") / "glm47", think_open_template()
    )
    srv = RunningServer("--model", str(model), "--model-id", "glm")
    yield srv
    srv.stop()


def test_reasoning_is_returned_apart_from_the_answer(thinking_server):
    client = OpenAI(base_url=thinking_server.base_url, api_key="x", max_retries=0)
    plain = client.chat.completions.create(model="glm", messages=HELLO, max_tokens=20)
    on = client.chat.completions.create(
        model="glm", messages=HELLO, max_tokens=20, extra_body={"enable_thinking": True}
    )
    extra = on.choices[0].message.model_extra
    # The prompt opened <think> and this model never closes it: everything is reasoning.
    assert on.choices[0].message.content == ""
    assert extra["reasoning"] == extra["reasoning_content"] != ""
    assert extra["reasoning"] == extra["reasoning"].strip()
    assert plain.choices[0].message.content != ""
    # Streaming: reasoning deltas under both names, no content.
    chunks = list(
        client.chat.completions.create(
            model="glm", messages=HELLO, max_tokens=20, stream=True, reasoning_effort="medium"
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = "".join((d.model_extra or {}).get("reasoning") or "" for d in deltas)
    alias = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert streamed == alias == extra["reasoning"]
    assert "".join(d.content or "" for d in deltas) == ""
    # include_reasoning: false leaves the trace out.
    hidden = client.chat.completions.create(
        model="glm",
        messages=HELLO,
        max_tokens=20,
        extra_body={"enable_thinking": True, "include_reasoning": False},
    )
    assert "reasoning" not in (hidden.choices[0].message.model_extra or {})
    assert hidden.choices[0].message.content == ""


def test_continuation_inside_reasoning_and_after_it(thinking_server):
    client = OpenAI(base_url=thinking_server.base_url, api_key="x", max_retries=0)
    inside = [*HELLO, {"role": "assistant", "content": "<think>Let me see"}]
    r = client.chat.completions.create(model="glm", messages=inside, max_tokens=10)
    assert r.choices[0].message.content == ""
    assert r.choices[0].message.model_extra["reasoning"] != ""
    after = [*HELLO, {"role": "assistant", "content": "<think>ok</think>The answer is"}]
    r = client.chat.completions.create(model="glm", messages=after, max_tokens=10)
    assert r.choices[0].message.content != ""
    assert not (r.choices[0].message.model_extra or {}).get("reasoning")


def test_bad_serve_flags_fail_fast():
    for extra, message in (
        (["--api-key", ""], "--api-key is empty"),
        (["--max-tokens", "0"], "must be at least 1"),
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "colibri", "serve", "--port", "0", *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert message in proc.stderr


def test_allowed_hosts_from_flag_and_environment_add_up():
    srv = RunningServer("--allowed-host", "a.example", env={"COLI_ALLOWED_HOSTS": "b.example"})
    try:
        for host, status in (("a.example", 200), ("b.example", 200), ("c.example", 403)):
            r = httpx.get(srv.url + "/v1/models", headers={"host": host})
            assert r.status_code == status, host
    finally:
        srv.stop()


def test_kv_slots_that_cannot_fit_memory_are_refused():
    from colibri.server import StartupRefused, check_kv_memory

    check_kv_memory(2, 2048, 512)  # a few MB: fits
    with pytest.raises(StartupRefused, match="--kv-slots 16 needs up to"):
        check_kv_memory(16, 1 << 30, 1 << 20)


def test_an_unexpected_error_is_a_500_in_the_protocol_shape_with_cors(monkeypatch):
    """Fault injection: the engine raising where no one expects it. The 500 still carries the
    CORS and request-id headers (Starlette's own last-resort handler sits outside them)."""
    from starlette.testclient import TestClient

    from colibri.api.app import create_app
    from colibri.runtime.served import ServedModel, ServerConfig

    served = ServedModel(
        Engine(builtin_model_dir(), threads=1), ServerConfig(model_id="m"), 0, None
    )

    def broken() -> list:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(served.engine, "profiles", broken)
    client = TestClient(
        create_app(served), base_url="http://127.0.0.1", raise_server_exceptions=False
    )
    origin = "http://localhost:5173"
    r = client.get("/v1/colibri/profile", headers={"Origin": origin})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert "injected fault" in r.json()["error"]["message"]
    assert r.headers["access-control-allow-origin"] == origin
    assert r.headers["x-request-id"]
    assert client.get("/health").json()["status"] == "ok"  # and the server goes on
