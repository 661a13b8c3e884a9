"""Reference prompts for colibri's built-in DeepSeek-V3.2 and V4 chat templates.

DeepSeek publishes these models' chat formats as Python (``encoding_dsv32.py`` and V4's
encoding module) instead of a Jinja template. This script renders a set of conversations with
that code, as vLLM ships it (``vllm/tokenizers/deepseek_v32_encoding.py`` and
``deepseek_v4_encoding.py``; vLLM 0.34.0 made the committed file), and writes
``tests/fixtures/templates/dsml_cases.json``: each conversation in the OpenAI request shape a
client sends, with the prompt the reference renders for it. ``tests/test_dsml_templates.py``
renders the same requests through the gateway and the built-in templates and compares.

The reference modules are not dependencies of colibri or its tests; fetch them once:

    pip download vllm==0.34.0 --no-deps -d /tmp/vllm
    unzip -j /tmp/vllm/vllm-*.whl 'vllm/tokenizers/deepseek_v*_encoding.py' -d /tmp/dsml
    python scripts/make_dsml_template_cases.py --encodings /tmp/dsml

How a request reaches the reference (what colibri's templates do too, docs/FORMATS.md):
- the request's tools join the first system message; without one, an empty system message is
  put first (vLLM's V4 wrapper; its V3.2 wrapper always puts a new one first);
- ``enable_thinking`` picks thinking mode; V4's effort: unset -> ``high`` (vLLM's default with
  thinking on), ``minimal``/``low``/``medium`` -> ``low``, ``high`` -> ``high``, ``xhigh`` ->
  ``max``; with ``tool_choice: "none"`` no tools reach the prompt;
- a tool definition is ``name``, ``description``, ``parameters`` (what the gateway passes on).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "templates" / "dsml_cases.json"


def function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool definition as the gateway passes it on (name, description, parameters)."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


WEATHER = function(
    "get_weather",
    "The forecast for a city.",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "units": {"type": "string", "enum": ["metric", "imperial"]},
        },
        "required": ["city"],
    },
)
SEARCH = function(
    "search",
    "Searches the notes «quoted» and 'plain'.",
    {
        "type": "object",
        "properties": {
            "query": {"type": "string"},
            "filters": {"type": "object"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "exact": {"type": "boolean"},
            "limit": {"type": ["integer", "null"]},
        },
    },
)
CLOCK = function("clock", "The time now.", {})


def call(id: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": id,
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)},
    }


def tool(id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": id, "content": content}


SYSTEM = {"role": "system", "content": "You are terse."}
ASK = {"role": "user", "content": "Weather in São Paulo for 3 days, and the time?"}
TWO_CALLS = {
    "role": "assistant",
    "content": "Checking.",
    "reasoning_content": "Two tools: weather and clock.",
    "tool_calls": [
        call("call_a", "get_weather", {"city": "São Paulo", "days": 3, "units": "metric"}),
        call("call_b", "clock", {}),
    ],
}
SEARCH_CALL = {
    "role": "assistant",
    "content": "",
    "reasoning_content": "Search with every kind of argument.",
    "tool_calls": [
        call(
            "call_s",
            "search",
            {
                "query": 'a "quoted" <b>term</b>\nover lines',
                "filters": {"year": 2026, "lang": ["pt", "en"], "draft": False},
                "tags": ["x", "ÿ"],
                "exact": True,
                "limit": None,
            },
        ),
    ],
}

# name -> (messages, tools, tool_choice)
CONVERSATIONS: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]], str]] = {
    "one_user": ([{"role": "user", "content": "Hello"}], [], "auto"),
    "system_user": ([SYSTEM, {"role": "user", "content": "Hello"}], [], "auto"),
    "history": (
        [
            SYSTEM,
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
            {"role": "user", "content": "And 3+3?"},
        ],
        [],
        "auto",
    ),
    "two_users_in_a_row": (
        [{"role": "user", "content": "First."}, {"role": "user", "content": "Second."}],
        [],
        "auto",
    ),
    "late_system": (
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!", "reasoning_content": "Greet."},
            {"role": "system", "content": "Answer in French from now on."},
            {"role": "user", "content": "Thanks"},
        ],
        [],
        "auto",
    ),
    "tools_no_system": ([{"role": "user", "content": "What time is it?"}], [CLOCK], "auto"),
    "tools_with_system": ([SYSTEM, ASK], [WEATHER, CLOCK, SEARCH], "auto"),
    "calls_and_results": (
        [SYSTEM, ASK, TWO_CALLS, tool("call_a", '{"temp_c": 24}'), tool("call_b", "10:42")],
        [WEATHER, CLOCK],
        "auto",
    ),
    "results_out_of_order": (
        [SYSTEM, ASK, TWO_CALLS, tool("call_b", "10:42"), tool("call_a", '{"temp_c": 24}')],
        [WEATHER, CLOCK],
        "auto",
    ),
    "results_then_user": (
        [
            ASK,
            TWO_CALLS,
            tool("call_a", '{"temp_c": 24}'),
            tool("call_b", "10:42"),
            {"role": "user", "content": "Also: is it raining?"},
        ],
        [WEATHER, CLOCK],
        "auto",
    ),
    "every_argument_kind": (
        [SYSTEM, {"role": "user", "content": "Find my notes."}, SEARCH_CALL, tool("call_s", "[]")],
        [SEARCH],
        "auto",
    ),
    "two_rounds_then_answer_then_user": (
        [
            SYSTEM,
            ASK,
            TWO_CALLS,
            tool("call_a", '{"temp_c": 24}'),
            tool("call_b", "10:42"),
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Search too.",
                "tool_calls": [call("call_c", "search", {"query": "rain"})],
            },
            tool("call_c", "none found"),
            {
                "role": "assistant",
                "content": "24 °C, 10:42, no rain noted.",
                "reasoning_content": "Summarise.",
            },
            {"role": "user", "content": "Tomorrow?"},
        ],
        [WEATHER, CLOCK, SEARCH],
        "auto",
    ),
    "history_with_tools_switched_off": (
        [SYSTEM, ASK, TWO_CALLS, tool("call_a", "sunny"), tool("call_b", "noon")],
        [WEATHER, CLOCK],
        "none",
    ),
}

# V4's renderings: (thinking, the effort as the request names it); V3.2's: thinking off, on.
MODES_V4 = [
    (False, None),
    (True, None),
    (True, "low"),
    (True, "medium"),
    (True, "high"),
    (True, "xhigh"),
]
EFFORT_V4 = {
    None: "high",
    "minimal": "low",
    "low": "low",
    "medium": "low",
    "high": "high",
    "xhigh": "max",
}


def load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_messages(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The request's messages as the reference reads them: reasoning under ``reasoning`` (vLLM's
    key), tools on the first system message."""
    out = copy.deepcopy(messages)
    for m in out:
        if "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
    if tools:
        host = next((m for m in out if m["role"] == "system"), None)
        if host is None:
            host = {"role": "system"}
            out.insert(0, host)
        host["tools"] = tools
    return out


def case(
    family: str,
    name: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]],
    tool_choice: str,
    thinking: bool,
    effort: str | None,
    expected: str,
) -> dict[str, Any]:
    """A fixture entry: the request a client sends, and the reference's prompt for it."""
    request: dict[str, Any] = {"messages": messages, "enable_thinking": thinking}
    if tools:
        request["tools"] = tools
        request["tool_choice"] = tool_choice
    if effort is not None:
        request["reasoning_effort"] = effort
    return {"family": family, "name": name, "request": request, "expected": expected}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encodings", type=Path, required=True, help="dir with the two modules")
    args = ap.parse_args()
    v32 = load(args.encodings / "deepseek_v32_encoding.py", "dsv32")
    v4 = load(args.encodings / "deepseek_v4_encoding.py", "dsv4")
    cases = []
    for name, (messages, tools, tool_choice) in CONVERSATIONS.items():
        prompt_tools = tools if tool_choice != "none" else []
        ref = reference_messages(messages, prompt_tools)
        for thinking in (False, True):
            mode = "thinking" if thinking else "chat"
            expected = v32.encode_messages(
                copy.deepcopy(ref), thinking_mode=mode, drop_thinking=ref[-1]["role"] == "user"
            )
            cases.append(
                case("deepseek_v32", name, messages, tools, tool_choice, thinking, None, expected)
            )
        for thinking, effort in MODES_V4:
            mode = "thinking" if thinking else "chat"
            expected = v4.encode_messages(
                copy.deepcopy(ref),
                thinking_mode=mode,
                drop_thinking=True,
                reasoning_effort=EFFORT_V4[effort] if thinking else None,
            )
            cases.append(
                case("deepseek_v4", name, messages, tools, tool_choice, thinking, effort, expected)
            )
    OUT.write_text(json.dumps(cases, ensure_ascii=False, indent=1) + "\n", "utf-8")
    print(f"{len(cases)} cases -> {OUT}")


if __name__ == "__main__":
    main()
