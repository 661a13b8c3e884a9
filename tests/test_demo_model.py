"""The packaged demo model through `colibri serve` with no --model, driven by the official SDKs:
what a user of a fresh install sees (issue 5's end-to-end checks)."""

from __future__ import annotations

import json
import random

import anthropic
import pytest
from openai import OpenAI

from colibri.demo.builtin import demo_model_dir
from colibri.demo.data import TOOLS
from colibri.demo.preamble import agent_preamble

from .server import RunningServer

pytestmark = pytest.mark.skipif(demo_model_dir() is None, reason="no demo model in the package")
WEATHER = TOOLS["get_weather"]


@pytest.fixture(scope="module")
def server():
    srv = RunningServer(default_model=True)
    assert srv.model_id == "colibri-demo"
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


def ask(client, content, **kw):
    kw.setdefault("max_tokens", 80)
    return client.chat.completions.create(
        model="colibri-demo", messages=[{"role": "user", "content": content}], **kw
    )


def test_a_greeting_ends_its_turn(client):
    r = ask(client, "Hello")
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason == "stop"
    # The implicit GLM role-marker stops end the turn: no invented next turn, no markers.
    assert "<|" not in text
    assert r.usage.completion_tokens < 80


def test_a_sum_with_its_reasoning_apart(client):
    a, b = 37, 48  # the example of the issue
    r = ask(client, f"What is {a} + {b}?", extra_body={"enable_thinking": True})
    message = r.choices[0].message
    reasoning = message.model_extra["reasoning"]
    assert message.content.strip().rstrip(".") == str(a + b)
    assert reasoning and str(a + b) in reasoning
    for text in (message.content, reasoning):
        assert "<think>" not in text and "</think>" not in text
    # Thinking off: the trace is not in the reply (the model's answer without its trace is
    # less reliable; see demo/model/CARD.md).
    plain = ask(client, f"What is {a} + {b}?")
    assert "reasoning" not in (plain.choices[0].message.model_extra or {})
    assert plain.choices[0].message.content.strip()


def test_a_tool_call_parsed_in_both_modes(client):
    r = ask(client, "What's the weather in Lisbon?", tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and args["city"]
    assert not choice.message.content  # no markup leaked into content
    chunks = list(
        client.chat.completions.create(
            model="colibri-demo",
            messages=[{"role": "user", "content": "What's the weather in Lisbon?"}],
            tools=[WEATHER],
            max_tokens=80,
            stream=True,
        )
    )
    deltas = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tool_call_and_a_sum_at_the_end_of_a_12k_token_agent_preamble(client):
    """An agent's first turn: a ~12k-token system prompt and tool catalog (a synthetic coding
    agent's, ``colibri.demo.preamble``, the weather tool among ~30 others), then the question.
    The model (fine-tuned on such preambles, its CARD.md) calls the tool with the city, and
    sums."""
    pre = agent_preamble(random.Random("test-demo-12k"), 24000, [WEATHER])
    system = {"role": "system", "content": pre["system"]}
    r = client.chat.completions.create(
        model="colibri-demo",
        messages=[system, {"role": "user", "content": "What's the weather in Lisbon?"}],
        tools=pre["tools"],
        max_tokens=80,
    )
    assert r.usage.prompt_tokens > 11000
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Lisbon"}
    r = client.chat.completions.create(
        model="colibri-demo",
        messages=[system, {"role": "user", "content": "What is 37 + 48?"}],
        tools=pre["tools"],
        max_tokens=80,
        extra_body={"enable_thinking": True},
    )
    assert r.choices[0].message.content.strip() == "85"


def test_anthropic_tool_use(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    fn = WEATHER["function"]
    tool = {"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
    m = client.messages.create(
        model="colibri-demo",
        max_tokens=80,
        tools=[tool],
        messages=[{"role": "user", "content": "What's the weather in Lisbon?"}],
    )
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input.get("city"), str)


def test_readme_main_command_and_curl_answer(server):
    """The README's first command serves this model, and its curl example answers."""
    import re
    import shlex
    from pathlib import Path

    import httpx

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)```", readme, flags=re.S)
    assert blocks[0].strip().endswith("colibri serve")
    curl = next(b for b in blocks if b.startswith("curl "))
    argv = shlex.split(curl.replace("\\\n", " "))
    url = next(a for a in argv if a.startswith("http://127.0.0.1:8000/"))
    body = json.loads(argv[argv.index("-d") + 1])
    r = httpx.post(url.replace("http://127.0.0.1:8000", server.url), json=body)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["model"] == body["model"] == "colibri-demo"
    assert reply["choices"][0]["message"]["content"]


def test_eval_demo_reports_tool_calls_by_city_source_and_tool(tmp_path, capsys):
    """`colibri eval-demo` through the real engine on the packaged model: the table, the JSON,
    and the tool tasks split by where the city comes from and by the tool asked for."""
    from colibri.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval-demo", "--n", "8", "--tasks", "arith", "tool_call", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "tool_call" in table and "real" in table and "no city" in table
    result = json.loads(out.read_text())
    call = result["tasks"]["tool_call"]
    sources = call["by_source"]
    assert sum(s["n"] for s in sources.values()) == call["n"] == 8
    assert sum(s["correct"] for s in sources.values()) == call["correct"]
    assert "by_source" not in result["tasks"]["arith"]
    # ... and split by the tool the prompt asks for.
    tools = call["by_tool"]
    assert set(tools) <= {"get_weather", "get_time", "convert_currency"}
    assert sum(t["n"] for t in tools.values()) == 8
    assert sum(t["correct"] for t in tools.values()) == call["correct"]
    assert "get_weather" in table and "by_tool" not in result["tasks"]["arith"]
    # The shipped model is far above chance on both (its card: 99% and 99% on 200 prompts).
    assert result["tasks"]["arith"]["correct"] >= 6 and call["correct"] >= 5
