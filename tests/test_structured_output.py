"""Constrained decoding through `colibri serve` on the demo model with the official SDKs:
response_format (json_object, json_schema), forced and strict tool calls, Anthropic
output_config.format and forced tools. The demo model was never trained on JSON: whatever it
writes under a grammar is valid because the engine masks every token, not because it knows."""

from __future__ import annotations

import json
import random
from typing import Any

import anthropic
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai import OpenAI

from colibri.demo.builtin import demo_model_dir
from colibri.demo.data import TOOLS

from .server import RunningServer

pytestmark = pytest.mark.skipif(demo_model_dir() is None, reason="no demo model in the package")
WEATHER = TOOLS["get_weather"]
MODEL = "colibri-demo"


@pytest.fixture(scope="module")
def server():
    srv = RunningServer(default_model=True)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=server.base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


# ---------------------------------------------------------------------------------------------
# Schemas of the supported subset


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "enum", "integer", "number", "boolean", "null"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "Lisbon", "a b", 'x"y', 3, None], 3)}
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 200)}
    if kind == "number":
        # A step bounds the digits: with free precision the demo model (which has never seen
        # JSON) tends to write digits until the budget runs out (flagged, tested below).
        low = rng.randint(-40, 40) / 4
        step = rng.choice([0.25, 0.5, 2])
        return {"type": "number", "minimum": low, "maximum": low + 5, "multipleOf": step}
    return {"type": kind}


def random_schema(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    """An object of 1-4 properties: leaves, arrays of leaves, nested objects (depth <= 2)."""
    props: dict[str, Any] = {}
    for i in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.2 and depth < 2:
            value = random_schema(rng, depth + 1)
        elif roll < 0.4:
            value = {"type": "array", "items": _leaf(rng), "minItems": rng.randint(0, 2)}
            value["maxItems"] = value["minItems"] + rng.randint(0, 2)
        else:
            value = _leaf(rng)
        props[f"{rng.choice(['name', 'city', 'n', 'ok', 'tags', 'inner'])}_{i}"] = value
    required = [k for k in props if rng.random() < 0.7]
    return {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": False,
    }


SCHEMAS = [random_schema(random.Random(seed)) for seed in range(50)]
PROMPTS = ["What is 37 + 48?", "Hello", "Weather in Lisbon?", "What is the capital of Peru?"]


def structured(client: OpenAI, schema: dict[str, Any], prompt: str, **kw: Any):
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": prompt}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        },
        **kw,
    )


def test_fifty_schemas_validate(client):
    done = 0
    for i, schema in enumerate(SCHEMAS):
        r = structured(client, schema, PROMPTS[i % len(PROMPTS)], seed=i, temperature=0.7)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (schema, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)
        done += 1
    assert done == 50


def test_fifty_schemas_validate_streamed(client):
    done = 0
    for i, schema in enumerate(SCHEMAS):
        stream = structured(client, schema, PROMPTS[i % len(PROMPTS)], stream=True, seed=100 + i)
        text, finish = "", None
        for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)
        done += 1
    assert done == 50


def test_json_object_is_an_object(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        response_format={"type": "json_object"},
        max_tokens=120,
    )
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # a free object may run past the budget: then it says so
        assert choice.finish_reason == "length"
        assert choice.model_extra["x_colibri_grammar_incomplete"] is True


def test_reasoning_stays_free_and_the_answer_follows_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 200}},
        "required": ["sum"],
        "additionalProperties": False,
    }
    r = structured(
        client, schema, "What is 37 + 48?", extra_body={"enable_thinking": True}, max_tokens=200
    )
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    # The trace is the model's own (trained: the digits carried), not JSON.
    assert "37 + 48 = 85" in message.model_extra["reasoning"]
    assert json.loads(message.content)["sum"] in range(201)


def test_an_unsupported_keyword_is_a_400_naming_it(client):
    schema = {"type": "object", "unevaluatedProperties": False}
    with pytest.raises(openai.BadRequestError) as e:
        structured(client, schema, "Hello")
    err = e.value.body
    assert "unevaluatedProperties" in err["message"]
    assert "%json" not in err["message"]  # llguidance's reason, not a listing of our grammar
    assert err["param"] == "response_format"
    assert err["type"] == "invalid_request_error"


def test_an_unsatisfiable_schema_is_refused_or_ends_length(client):
    for schema in (
        {"type": "string", "minLength": 40},  # cannot fit in 8 tokens
        {"allOf": [{"type": "string"}, {"type": "integer"}]},  # no value at all
    ):
        try:
            r = structured(client, schema, "Hello", max_tokens=8)
        except openai.BadRequestError as e:
            assert e.body["code"] == "unsupported_schema", e.body
            continue
        choice = r.choices[0]
        assert choice.finish_reason == "length", choice
        assert choice.model_extra["x_colibri_grammar_incomplete"] is True


# A hypothesis strategy over the same subset: every output that completes validates.
_leaves = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-1000, 1000),
        st.integers(0, 1000),
    ),
    st.builds(
        lambda lo: {"type": "number", "minimum": lo, "exclusiveMaximum": lo + 1},
        st.integers(-100, 100),
    ),
    st.just({"type": "boolean"}),
    st.lists(st.text('abcxyz "\\', max_size=4), min_size=1, max_size=4, unique=True).map(
        lambda v: {"enum": v}
    ),
)
_schemas = st.recursive(
    _leaves,
    lambda inner: st.one_of(
        st.builds(
            lambda items, n: {"type": "array", "items": items, "maxItems": n},
            inner,
            st.integers(0, 3),
        ),
        st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), inner, min_size=1, max_size=3).map(
            lambda props: {
                "type": "object",
                "properties": props,
                "required": sorted(props)[:1],
                "additionalProperties": False,
            }
        ),
    ),
    max_leaves=6,
)


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(schema=_schemas, seed=st.integers(0, 2**31))
def test_random_schemas_every_completed_output_validates(client, schema, seed):
    r = structured(client, schema, "Hello", max_tokens=120, seed=seed, temperature=1.0)
    choice = r.choices[0]
    if choice.finish_reason == "stop":
        jsonschema.validate(json.loads(choice.message.content), schema)
    else:
        assert choice.finish_reason == "length"
        assert choice.model_extra["x_colibri_grammar_incomplete"] is True


# ---------------------------------------------------------------------------------------------
# Tools

CONVERT = TOOLS["convert_currency"]


def _calls(client: OpenAI, prompt: str, tools: list[dict[str, Any]], **kw: Any):
    kw.setdefault("max_tokens", 120)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], tools=tools, **kw
    )
    return r.choices[0]


def _schema_of(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(t["function"]["parameters"] for t in tools if t["function"]["name"] == name)


def test_forced_tool_choice_gives_a_valid_call_every_time(client):
    tools = [WEATHER, CONVERT]
    prompts = ["Hello", "What is 12 + 30?", "What is the capital of Chile?", "Say Tokyo back"]
    for i in range(50):
        choice_kw: Any = (
            "required"
            if i % 2
            else {"type": "function", "function": {"name": tools[i % 4 // 2]["function"]["name"]}}
        )
        c = _calls(client, prompts[i % 4], tools, tool_choice=choice_kw, seed=i)
        assert c.finish_reason == "tool_calls", c
        calls = c.message.tool_calls
        assert calls, c
        for call in calls:
            if isinstance(choice_kw, dict):
                assert call.function.name == choice_kw["function"]["name"]
            jsonschema.validate(
                json.loads(call.function.arguments), _schema_of(tools, call.function.name)
            )


def _strict(tool: dict[str, Any], parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {**tool["function"], "parameters": parameters, "strict": True},
    }


STRICT_CONVERT = _strict(
    CONVERT,
    {
        "type": "object",
        "properties": {
            # A step bounds the digits (a random model writes digits while it may).
            "amount": {"type": "number", "minimum": 1, "maximum": 1000, "multipleOf": 0.5},
            "from_currency": {"enum": ["EUR", "USD", "JPY"]},
            "to_currency": {"type": "string", "enum": ["EUR", "USD", "JPY"]},
        },
        "required": ["amount", "from_currency", "to_currency"],
        "additionalProperties": False,
    },
)


def test_strict_tool_arguments_validate(client):
    tools = [STRICT_CONVERT]
    schema = _schema_of(tools, "convert_currency")
    for i, prompt in enumerate(["Convert 50 EUR to USD", "Hello", "Convert 3 dollars to yen"]):
        c = _calls(client, prompt, tools, tool_choice="required", seed=i, temperature=0.8)
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), schema)


def test_auto_with_strict_tools_is_text_or_a_valid_call(client):
    tools = [STRICT_CONVERT, _strict(WEATHER, WEATHER["function"]["parameters"])]
    seen = set()
    for i, prompt in enumerate(["Weather in Lisbon?", "Hello", "Convert 50 EUR to USD"]):
        c = _calls(client, prompt, tools, seed=i)
        assert c.finish_reason in ("stop", "tool_calls"), c
        for call in c.message.tool_calls or []:
            jsonschema.validate(
                json.loads(call.function.arguments), _schema_of(tools, call.function.name)
            )
        seen.add(c.finish_reason)
    assert "tool_calls" in seen  # the weather question is one the model answers with a call


def test_a_strict_argument_the_format_cannot_write_is_a_400(client):
    bad = _strict(WEATHER, {"type": "object", "properties": {"city": {"type": ["string", "null"]}}})
    with pytest.raises(openai.BadRequestError) as e:
        _calls(client, "Hello", [bad])
    assert e.value.body["param"] == "tools"
    assert "city" in e.value.body["message"]


# ---------------------------------------------------------------------------------------------
# Anthropic


def test_anthropic_output_format_validates(claude):
    for i, schema in enumerate(SCHEMAS[:10]):
        r = claude.messages.create(
            model=MODEL,
            max_tokens=200,
            messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
        )
        assert r.stop_reason == "end_turn", r
        jsonschema.validate(json.loads(r.content[0].text), schema)


def test_anthropic_forced_tools_give_valid_calls(claude):
    tool = {
        "name": "convert_currency",
        "description": "Convert money",
        "input_schema": STRICT_CONVERT["function"]["parameters"],
        "strict": True,
    }
    weather = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    for i, choice in enumerate([{"type": "any"}, {"type": "tool", "name": "get_weather"}] * 5):
        r = claude.messages.create(
            model=MODEL,
            max_tokens=120,
            messages=[{"role": "user", "content": ["Hello", "What is 2 + 2?"][i % 2]}],
            tools=[tool, weather],
            tool_choice=choice,
        )
        assert r.stop_reason == "tool_use", r
        uses = [b for b in r.content if b.type == "tool_use"]
        assert uses
        for use in uses:
            if choice["type"] == "tool":
                assert use.name == "get_weather"
            schema = tool["input_schema"] if use.name == tool["name"] else weather["input_schema"]
            jsonschema.validate(use.input, schema)


# ---------------------------------------------------------------------------------------------
# A random-weight model: nothing but the grammar makes its output valid (the built-in model's
# vocabulary is bytes plus GLM's specials: a call takes ~200 tokens, its markers as text for the
# qwen3 template)


@pytest.mark.parametrize("family", ["glm", "qwen3", "deepseek_v31", "deepseek_v32", "kimi_k2"])
def test_a_random_model_writes_a_valid_forced_call_in_the_family_syntax(family, tmp_path):

    from .server import family_template, long_window_builtin, model_with_template

    args: tuple[str, ...] = ()
    if family != "glm":  # the built-in model's weights under another family's template
        template = family_template(family)
        if family == "kimi_k2":
            # Kimi's template has no switch for thinking, so a reply may open a think block,
            # which these weights never close (free text, by design): its thinking-off form
            # (the block closed in the prompt, as DeepSeek's template writes it).
            gen = "<|im_middle|>{% endif %}"
            assert gen in template
            template = template.replace(gen, "<|im_middle|><think></think>{% endif %}")
        # The long-window copy: DeepSeek-V3.2's tool preamble alone is ~1,700 tokens of this
        # byte-level vocabulary, which left the built-in 2,048 too few for a call.
        base = long_window_builtin(tmp_path)
        args = ("--model", str(model_with_template(base, tmp_path / "m", template)))
    srv = RunningServer(*args)
    try:
        c = OpenAI(base_url=srv.base_url, api_key="x", max_retries=0)
        schema = STRICT_CONVERT["function"]["parameters"]
        # DeepSeek's and Kimi's markers are long text in this vocabulary: a call takes ~400 tokens.
        budget = 400 if family in ("glm", "qwen3") else 800
        messages = [{"role": "user", "content": "Hello"}]
        for seed in range(5):
            parallel = seed == 4  # one reply may hold several calls: each one valid
            r = c.chat.completions.create(
                model=srv.model_id,
                messages=messages,
                tools=[STRICT_CONVERT],
                tool_choice="required",
                parallel_tool_calls=parallel,
                max_tokens=budget * (3 if parallel else 1),
                temperature=1.0,
                seed=seed,
            )
            choice = r.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            calls = choice.message.tool_calls
            assert calls and (parallel or len(calls) == 1), calls
            for call in calls:
                assert call.function.name == "convert_currency"
                jsonschema.validate(json.loads(call.function.arguments), schema)
        # And a JSON answer under auto with tools: the schema's JSON, or a valid call.
        answer = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                  "required": ["ok"], "additionalProperties": False}  # fmt: skip
        for seed in range(3):
            r = c.chat.completions.create(
                model=srv.model_id,
                messages=[{"role": "user", "content": "Hello"}],
                tools=[STRICT_CONVERT],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": answer},
                },  # fmt: skip
                max_tokens=budget,
                temperature=1.0,
                seed=seed,
            )
            choice = r.choices[0]
            if choice.finish_reason == "tool_calls":
                for call in choice.message.tool_calls:
                    jsonschema.validate(json.loads(call.function.arguments), schema)
            else:
                assert choice.finish_reason == "stop", choice
                jsonschema.validate(json.loads(choice.message.content), answer)
    finally:
        srv.stop()


@pytest.mark.parametrize(
    ("suffix", "in_reasoning", "after_reasoning"),
    [("<think>", True, False), ("", False, False), ("<think></think>", False, True)],
    ids=["prompt opened a think block", "the model may open one", "thinking off"],
)
def test_the_grammar_starts_after_the_think_block(suffix, in_reasoning, after_reasoning):
    """In the engine: the think block is free text in the model's own words, then the JSON."""
    from colibri.chat import grammar as g
    from colibri.runtime.engine import Engine, Grammar

    engine = Engine(demo_model_dir(), threads=2)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
              "maximum": 999}}, "required": ["n"], "additionalProperties": False}  # fmt: skip
    text = g.with_reasoning(
        g.json_body(schema),
        g.special_markers(engine.special_tokens),
        "<think>",
        "</think>",
        in_reasoning,
        after_reasoning,
    )
    prompt = engine.tokenize(f"[gMASK]<sop><|user|>\nWhat is 37 + 48?<|assistant|>{suffix}")
    eos = tuple(engine.eos_token_ids)
    stream = engine.generate(prompt, 150, grammar=Grammar("lark", text, end_ids=eos))
    out = engine.detokenize(list(stream))
    assert stream.grammar_state == "satisfied"
    answer = out.rsplit("</think>", 1)[-1] if "</think>" in out else out
    jsonschema.validate(json.loads(answer), schema)
    if in_reasoning:
        # Trained: the trace of the sum, unconstrained.
        assert "37 + 48 = 85" in out.split("</think>")[0]
    if after_reasoning:
        assert "<think>" not in out and "</think>" not in out


def test_responses_text_format_validates(server):
    client = OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    for i, schema in enumerate(SCHEMAS[:5]):
        r = client.responses.create(
            model=MODEL,
            input=PROMPTS[i % len(PROMPTS)],
            max_output_tokens=200,
            text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        )
        assert r.status == "completed", r
        assert r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(
        model=MODEL,
        input="Hello",
        max_output_tokens=120,
        tools=[{**STRICT_CONVERT["function"], "type": "function"}],
        tool_choice="required",
    )
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), STRICT_CONVERT["function"]["parameters"])


def test_an_unfinished_grammar_is_flagged_in_streams(client, claude):
    schema = {"type": "string", "minLength": 40}
    stream = structured(client, schema, "Hello", max_tokens=8, stream=True)
    last = [c for c in stream if c.choices][-1].choices[0]
    assert last.finish_reason == "length"
    assert last.model_extra["x_colibri_grammar_incomplete"] is True
    with claude.messages.stream(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": "Hello"}],
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    ) as s:
        deltas = [e for e in s if e.type == "message_delta"]
    assert deltas[-1].delta.stop_reason == "max_tokens"
    assert deltas[-1].delta.model_extra["x_colibri_grammar_incomplete"] is True


@pytest.mark.parametrize(
    ("prop", "word"),
    [
        ({"type": "string", "pattern": "^[A-Z]+$"}, "pattern"),
        ({"type": "string", "format": "date"}, "format"),
        ({"type": ["string", "integer"]}, "type list"),
        ({"enum": ["a<b"], "type": "string"}, "enum"),
    ],
)
def test_glm_strict_arguments_it_cannot_write_are_refused_by_name(prop, word):
    from colibri.chat import grammar as g

    tools = g.GrammarTools(
        {"f": {"type": "object", "properties": {"x": prop}, "required": ["x"]}},
        frozenset({"f"}),
        forced=True,
        parallel=False,
    )
    with pytest.raises(g.GrammarRefused, match=word):
        g.tool_grammar("glm", tools, g.special_markers(()), lambda body: f"start: {body}\n")
