"""A table-grid conversion (`colibri convert --grid table`: every int4 matrix `q4t` but MLA's
`kv_b`) served end to end: DeepSeek-V3's fixture under DeepSeek V3.1's template through `colibri
serve` and the official SDKs. The server's greedy reply is the in-process engine's greedy
continuation of the same prompt, a streamed reply is the plain one, a forced tool call comes
back valid, and Anthropic's route serves the same model."""

from __future__ import annotations

import json
import shutil

import anthropic
import jsonschema
import pytest
from openai import OpenAI

from colibri import Engine, convert

from .conftest import FIXTURES
from .server import RunningServer, model_with_template
from .test_server_mla import WEATHER, WEATHER_SCHEMA, chat_template


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("table-grid")
    hf = tmp / "hf"
    shutil.copytree(FIXTURES / "deepseek_v3" / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    cfg["max_position_embeddings"] = 4096  # room for a tool preamble, as test_server_mla
    (hf / "config.json").write_text(json.dumps(cfg))
    convert(hf, tmp / "table", "int4", grid="table")
    manifest = json.loads((tmp / "table" / "manifest.json").read_text())
    dtypes = {t["dtype"] for t in manifest["resident"]["tensors"].values()}
    assert "q4t" in dtypes and {p["dtype"] for p in manifest["experts"]["parts"].values()} == {
        "q4t"
    }
    model = model_with_template(tmp / "table", tmp / "model", chat_template("deepseek_v31"))
    srv = RunningServer("--model", str(model))
    yield model, srv
    srv.stop()


def test_the_served_greedy_reply_is_the_engines(served):
    """The completions route's greedy text is the in-process engine's greedy continuation of
    the same tokens; the chat route streams what it answers plainly."""
    model, srv = served
    c = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    text = "The capital of France is"
    r = c.completions.create(model=srv.model_id, prompt=text, max_tokens=12, temperature=0)
    eng = Engine(model)
    prompt = eng.tokenize(text, add_special_tokens=True)
    assert r.usage is not None and r.usage.prompt_tokens == len(prompt)
    want = list(eng.generate(prompt, max_tokens=r.usage.completion_tokens))
    assert r.choices[0].text == eng.detokenize(want)
    messages = [{"role": "user", "content": "Name a prime number."}]
    plain = c.chat.completions.create(
        model=srv.model_id, messages=messages, max_tokens=16, temperature=0
    )
    stream = c.chat.completions.create(
        model=srv.model_id, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == (plain.choices[0].message.content or "")


def test_info_counts_the_table_grid_matrices(served):
    """`/v1/colibri/info` says how many matrices each dtype stores: the routed experts and the
    other int4 matrices `q4t`, MLA's `kv_b_uk_t` `q4`, the 8-bit default (o, `kv_b_uv`) `q8`."""
    import httpx

    model, srv = served
    counts = httpx.get(f"{srv.url}/v1/colibri/info").json()["matrix_dtypes"]
    manifest = json.loads((model / "manifest.json").read_text())
    layers = manifest["config"]["num_hidden_layers"]
    experts = sum(layer["count"] for layer in manifest["experts"]["layers"])
    # kv_b_uk_t of every layer (kv_b_uv is among the default's 8-bit matrices)
    assert counts["q4"] == layers
    assert counts["q4t"] >= 3 * experts and counts["q8"] >= layers
    assert sum(counts.values()) == 3 * experts + sum(
        len(t["shape"]) == 2 for t in manifest["resident"]["tensors"].values()
    )


def test_a_forced_call_is_valid_on_both_routes(served):
    _, srv = served
    c = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
    r = c.chat.completions.create(
        model=srv.model_id,
        messages=[{"role": "user", "content": "Weather in Lima for 2 days?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=4000,
        temperature=1.0,
        seed=0,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    m = claude.messages.create(
        model=srv.model_id,
        max_tokens=4000,
        messages=[{"role": "user", "content": "Weather in Tokyo for 5 days?"}],
        tools=[
            {
                "name": "get_weather",
                "description": "The weather forecast for a city.",
                "input_schema": WEATHER_SCHEMA,
                "strict": True,
            }
        ],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and m.stop_reason == "tool_use", m
    for use in uses:
        jsonschema.validate(use.input, WEATHER_SCHEMA)
