"""The MLA, sparse-attention and linear-attention families served end to end (Qwen3-Next under
Qwen3's template, its DeltaNet state resumed across turns): DeepSeek-V3's fixture (MLA) under
DeepSeek V3.1's chat template, GLM-5's (glm_moe_dsa: MLA + the DSA indexer) under GLM's, and
DeepSeek-V3.2's (DSA) and DeepSeek-V4's (compressed attention, hyper-connections) with no
template, under colibri's built-in ones (DSML tool calls), and Kimi K2's shape (DeepSeek-V3's
architecture with Kimi's tokenizer as tiktoken files, Kimi's tool-call sections), each through
`colibri serve` and the
official SDKs. A streamed reply and a plain one agree token for token; a forced call comes back
valid in the family's own syntax (the grammar writes it: the weights are random) and its result
goes back in for a second turn; Anthropic's route serves the same model. (Parity with
transformers: test_reference.py; slots and slot files: test_mla.py, test_dsa.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import anthropic
import jsonschema
import pytest
from openai import OpenAI

from colibri import convert

from .conftest import FIXTURES
from .kimi_tokenizer import kimi_checkpoint, kimi_k25_checkpoint
from .server import RunningServer, model_with_template

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

# fixture -> the chat template it is served with
SERVED = {
    "deepseek_v3": "deepseek_v31",
    "glm_moe_dsa": "glm",
    # DeepSeek publishes V3.2's and V4's chat formats as code, not templates: served with none,
    # the gateway uses its built-in one (V4's DSML calls sit in tool_calls blocks).
    "deepseek_v32": None,
    "deepseek_v4": None,
    # Qwen3-Next (gated DeltaNet + gated attention) in Qwen3's XML.
    "qwen3_next": "qwen3",
    # Kimi Linear (Kimi Delta Attention + MLA) in Kimi K2's tool-call sections.
    "kimi_linear": "kimi_k2",
    # Kimi K2: DeepSeek-V3's architecture with Kimi's tokenizer as Moonshot publishes it
    # (tiktoken files, no tokenizer.json: the conversion writes one) and tool-call sections.
    "kimi_k2": "kimi_k2",
    # Kimi K2.5 and later: the same text model inside a KimiK25ForConditionalGeneration, a
    # vision tower beside it; colibri converts and serves the text model alone.
    "kimi_k25": "kimi_k2",
}
# Served entries whose weights are another fixture's.
WEIGHTS = {"kimi_k2": "deepseek_v3", "kimi_k25": "deepseek_v3"}

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": WEATHER_SCHEMA,
        "strict": True,
    },
}


def chat_template(name: str | None) -> str | None:
    if name is None:
        return None
    if name == "glm":
        from colibri.demo.builtin import CHAT_TEMPLATE

        return CHAT_TEMPLATE
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.fixture(scope="module", params=list(SERVED))
def served(request, tmp_path_factory):
    arch = request.param
    tmp = tmp_path_factory.mktemp(f"served-{arch}")
    hf = tmp / "hf"
    weights = FIXTURES / WEIGHTS.get(arch, arch) / "hf"
    if arch == "kimi_k2":
        kimi_checkpoint(weights, hf, 440)  # 463 tokens: 440 ranks, 23 special
    elif arch == "kimi_k25":
        kimi_k25_checkpoint(weights, hf, 440)
    else:
        shutil.copytree(weights, hf)
    # The fixtures' 256 positions hold no tool preamble in a 463-token vocabulary; default rope
    # does not depend on the length, so the weights compute the same.
    cfg = json.loads((hf / "config.json").read_text())
    cfg.get("text_config", cfg)["max_position_embeddings"] = 4096
    (hf / "config.json").write_text(json.dumps(cfg))
    convert(hf, tmp / "int4", "int4")
    model = model_with_template(tmp / "int4", tmp / "model", chat_template(SERVED[arch]))
    srv = RunningServer("--model", str(model))
    yield arch, srv
    srv.stop()


def openai_client(srv: RunningServer) -> OpenAI:
    return OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)


def test_a_streamed_reply_is_the_plain_reply(served):
    arch, srv = served
    c = openai_client(srv)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = c.chat.completions.create(
        model=srv.model_id, messages=messages, max_tokens=24, temperature=0
    )
    stream = c.chat.completions.create(
        model=srv.model_id,
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert plain.choices[0].finish_reason in ("stop", "length")
    assert (text, finish) == (
        plain.choices[0].message.content or "",
        plain.choices[0].finish_reason,
    )
    assert usage is not None and plain.usage is not None
    assert usage.prompt_tokens == plain.usage.prompt_tokens > 10
    assert usage.completion_tokens == plain.usage.completion_tokens > 0


def test_info_names_the_family_and_where_its_template_comes_from(served):
    import httpx

    arch, srv = served
    info = httpx.get(f"{srv.url}/v1/colibri/info").json()
    family = SERVED[arch] or arch  # served with no template: the architecture's family
    assert info["chat_family"] == family
    assert info["chat_template"] == ("builtin" if SERVED[arch] is None else "model")


@pytest.mark.parametrize("served", ["deepseek_v4"], indirect=True)
def test_v4_takes_the_effort_asked_of_its_reasoning(served):
    """DeepSeek-V4's template opens thinking mode with an effort line: OpenAI's
    reasoning_effort and Anthropic's output_config.effort pick it (low: none, high, max)."""
    arch, srv = served
    c = openai_client(srv)
    messages = [{"role": "user", "content": "Hi"}]

    def prompt_tokens(effort: str) -> int:
        r = c.chat.completions.create(
            model=srv.model_id,
            messages=messages,
            max_tokens=1,
            extra_body={"reasoning_effort": effort},
        )
        assert r.usage is not None
        return r.usage.prompt_tokens

    low, medium, high, xhigh = (prompt_tokens(e) for e in ("low", "medium", "high", "xhigh"))
    assert low == medium < high < xhigh
    claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    r = claude.messages.create(
        model=srv.model_id,
        max_tokens=1,
        messages=messages,
        extra_body={"output_config": {"effort": "max"}},
    )
    u = r.usage  # Anthropic's input_tokens leave out what the prefix cache read
    assert u.input_tokens + (u.cache_read_input_tokens or 0) == xhigh


def test_a_forced_call_is_valid_and_its_result_goes_back_in(served):
    arch, srv = served
    c = openai_client(srv)
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    for seed in range(3):
        r = c.chat.completions.create(
            model=srv.model_id,
            messages=messages,
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            # The grammar leaves a think block free and ends the output only after the call; a
            # random model that opens one closes it when it happens to sample `</think>`.
            max_tokens=4000,
            temperature=1.0,
            seed=seed,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", (arch, choice, r.usage)
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)
    # The call and its result in the history: the family's template renders them, and the model
    # answers (anything: its weights are random) without an error.
    history = messages + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"forecast": "sunny"}'},
    ]
    r = c.chat.completions.create(
        model=srv.model_id, messages=history, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage is not None and r.usage.prompt_tokens > 0


def test_anthropic_forced_tool_use_is_valid(served):
    arch, srv = served
    claude = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    r = claude.messages.create(
        model=srv.model_id,
        max_tokens=600,
        messages=[{"role": "user", "content": "Weather in Lima?"}],
        tools=[{"name": "get_weather", "input_schema": WEATHER_SCHEMA, "strict": True}],
        tool_choice={
            "type": "tool",
            "name": "get_weather",
            # DeepSeek-V4's and Qwen3-Next's random weights, left to choose, open call after
            # call until max_tokens (each one valid): here one call is asked for, and must close.
            "disable_parallel_tool_use": arch in ("deepseek_v4", "qwen3_next", "kimi_linear"),
        },
    )
    assert r.stop_reason == "tool_use", (arch, [b.model_dump() for b in r.content])
    # Parallel use is not disabled, so the forced call may come more than once: every one valid.
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses, (arch, r)
    for use in uses:
        assert use.name == "get_weather"
        jsonschema.validate(use.input, WEATHER_SCHEMA)


def test_the_state_per_slot_is_in_health_and_metrics(served):
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from .test_linear_attention import hf_config, layout

    arch, srv = served
    health = httpx.get(srv.url + "/health").json()
    metrics = {
        (s.name, s.labels.get("model")): s.value
        for family in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
        for s in family.samples
    }
    state = metrics[("colibri_engine_state_bytes_per_slot", srv.model_id)]
    assert health["state_bytes_per_slot"] == state
    if arch in ("qwen3_next", "kimi_linear"):  # a linear-attention hybrid: a state per slot
        lay = layout(hf_config(arch))
        assert state == lay.linear.count(True) * lay.state_floats * 4 > 0
    elif arch == "deepseek_v4":  # the windows of keys and pending compressor inputs, f16
        from . import test_deepseek_v4 as v4

        cfg = v4.hf_config()
        assert state == sum(v4.state_width(cfg, k) for k in cfg["layer_types"]) * 2 > 0
    else:
        assert state == 0
