"""Grammars for constrained decoding: what the output of a chat request must look like, as a Lark
grammar llguidance compiles against the model's tokenizer (the engine masks every token to it).

- ``response_format`` json_object / json_schema (Anthropic ``output_config.format``): the answer
  is one JSON value of the schema, compact (no free whitespace, so a model cannot pad forever).
- forced tool calls (``tool_choice`` required / named, Anthropic any / tool) and ``strict`` tools:
  the family's tool-call syntax, with each strict tool's arguments following its schema.
- ``auto`` with strict tools: free text, or text then valid calls.

Reasoning stays free: the grammar starts with the family's think block where the output may
(or, when the prompt opened one, must) begin with it; the constraint applies after it closes.
Family markers that are special tokens of the tokenizer are written as llguidance's ``<name>``
token references, so they match the token itself, never its text spelled in pieces.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from colibri.errors import ApiError

# The JSON the grammar allows: no whitespace outside strings (llguidance's JSON options).
_COMPACT = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarTools:
    """The tools a grammar may call: name -> parameters schema, and which of them are strict."""

    schemas: dict[str, dict[str, Any]]
    strict: frozenset[str]
    # The output must contain a call (required / named / any / tool).
    forced: bool
    parallel: bool


@dataclass(frozen=True)
class Markers:
    """How the grammar writes the family's markers: a token reference when the marker is one
    special token, else its text as a literal."""

    special: frozenset[str]

    def __call__(self, text: str) -> str:
        if text in self.special:
            return text
        return _lit(text)


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def json_body(schema: dict[str, Any]) -> str:
    """The Lark expression of one compact JSON value following ``schema``."""
    return "%json " + json.dumps({**schema, "x-guidance": _COMPACT}, ensure_ascii=False)


def with_reasoning(
    body: str,
    marker: Markers,
    open_think: str | None,
    close_think: str | None,
    in_reasoning: bool,
    after_reasoning: bool,
) -> str:
    """The whole grammar: free reasoning first where the output may (or must) begin with it,
    then ``body`` (a Lark expression), after at most one newline."""
    lines = [f"body: {body}", 'NL: "\\n"']
    if open_think is None or close_think is None or after_reasoning:
        lines.insert(0, "start: NL? body")
        return "\n".join(lines) + "\n"
    if close_think in marker.special:
        # A special token cannot extend the text before it: a greedy lexeme ends there.
        think = f"THINK? {close_think}"
        lines.append("THINK: /(?s:.+)/")
    else:
        # Text markers: a lazy lexeme that ends at the first close marker, which it includes
        # (a greedy one would read the marker as more thinking and never end).
        think = "think"
        lines.append(f"think[suffix={_lit(close_think)}]: /(?s:.*)/")
    if in_reasoning:
        lines.insert(0, f"start: {think} NL? body")
    else:
        lines.insert(0, f"start: NL? ({marker(open_think)} {think} NL?)? body")
    return "\n".join(lines) + "\n"


class GrammarRefused(ValueError):
    """The request's schema or tools cannot be written as a grammar; the message says why."""


# ---------------------------------------------------------------------------------------------
# Tool calls per family format


def _argument_value(schema: Any, where: str) -> tuple[bool, str]:
    """(raw, the Lark expression) of one argument value where a family writes a ``string``
    property as its raw text (GLM, DeepSeek's DSML) and anything else as JSON (how
    chat/toolformats reads them back). Raw text cannot contain ``<``: the closing marker starts
    with it."""
    if not isinstance(schema, dict):
        return False, json_body({})
    kind = schema.get("type")
    if isinstance(kind, list) and "string" in kind:
        raise GrammarRefused(
            f"{where}: a type list with 'string' cannot be told apart from text in this "
            "family's raw argument values; use one type"
        )
    if kind != "string":
        return False, json_body(schema)
    if "enum" in schema or "const" in schema:
        values = schema.get("enum", [schema.get("const")])
        if not all(isinstance(v, str) and "<" not in v for v in values):
            raise GrammarRefused(f"{where}: enum values must be strings without '<'")
        return True, "(" + " | ".join(_lit(v) for v in values) + ")"
    unsupported = sorted(set(schema) & {"pattern", "format"})
    if unsupported:
        raise GrammarRefused(
            f"{where}: '{unsupported[0]}' on a string argument is not supported for this "
            "family's raw argument values"
        )
    low = int(schema.get("minLength", 0))
    high = schema.get("maxLength")
    if low == 0 and high is None:
        return True, "/[^<]*/"
    return True, "/[^<]{" + f"{low}," + ("" if high is None else str(int(high))) + "}/"


def _strict_arguments(
    name: str, schema: dict[str, Any], pair: Callable[[str, Any, str], str], bad: str
) -> tuple[list[str], bool]:
    """A strict call's arguments as (one expression per argument, whether any is required):
    required arguments in the order given, then optional ones, each at most once (optional
    ones marked ``?``). ``pair(key, schema, where)`` writes one; a key containing a character of
    ``bad`` (or empty) cannot be written."""
    props = schema.get("properties") or {}
    if not isinstance(props, dict):
        raise GrammarRefused(f"tool '{name}': 'properties' must be an object")
    required = [k for k in schema.get("required") or [] if k in props]
    missing = [k for k in schema.get("required") or [] if k not in props]
    if missing:
        raise GrammarRefused(f"tool '{name}': required argument '{missing[0]}' has no schema")
    parts = []
    for key in required + [k for k in props if k not in required]:
        if not key or any(c in key for c in bad):
            raise GrammarRefused(f"tool '{name}': argument name {key!r} cannot be written")
        item = pair(key, props[key], f"tool '{name}' argument '{key}'")
        parts.append(f"({item})" + ("" if key in required else "?"))
    return parts, bool(required)


def _glm_call(rule: str, name: str, schema: dict[str, Any], strict: bool, m: Markers) -> list[str]:
    """``<tool_call>NAME`` then ``\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>`` per
    argument, ``\\n</tool_call>`` (no newline when there are no arguments)."""
    head = f"{m('<tool_call>')} {_lit(name)}"
    end = m("</tool_call>")

    def pair(key: str, value: str) -> str:
        return (
            f'"\\n" {m("<arg_key>")} {key} {m("</arg_key>")} "\\n" '
            f"{m('<arg_value>')} {value} {m('</arg_value>')}"
        )

    if not strict:
        free = pair("/[^<\\n]+/", "/[^<]*/")
        return [f'{rule}: {head} ({free})* "\\n"? {end}']
    parts, required = _strict_arguments(
        name, schema, lambda k, v, where: pair(_lit(k), _argument_value(v, where)[1]), "<\n"
    )
    if not parts:
        return [f"{rule}: {head} {end}"]
    if not required:
        return [f'{rule}: {head} ({" ".join(parts)} "\\n")? {end}']
    return [f'{rule}: {head} {" ".join(parts)} "\\n" {end}']


def _json_call(rule: str, name: str, schema: dict[str, Any], strict: bool, m: Markers) -> list[str]:
    """Qwen3 (hermes): ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``."""
    args = schema if strict else {"type": "object"}
    call = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": args},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }
    return [f'{rule}: {m("<tool_call>")} "\\n" {json_body(call)} "\\n" {m("</tool_call>")}']


def _deepseek_v31_call(
    rule: str, name: str, schema: dict[str, Any], strict: bool, m: Markers
) -> list[str]:
    """DeepSeek V3.1: ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{JSON}<｜tool▁call▁end｜>``."""
    args = json_body(schema if strict else {"type": "object"})
    return [
        f"{rule}: {m('<｜tool▁call▁begin｜>')} {_lit(name)} {m('<｜tool▁sep｜>')} {args} "
        f"{m('<｜tool▁call▁end｜>')}"
    ]


def _kimi_k2_call(
    rule: str, name: str, schema: dict[str, Any], strict: bool, m: Markers
) -> list[str]:
    """Kimi K2: ``<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{JSON}
    <|tool_call_end|>``. The index is the model's own (conversation-wide in Kimi's template):
    digits, not checked."""
    args = json_body(schema if strict else {"type": "object"})
    return [
        f"{rule}: {m('<|tool_call_begin|>')} {_lit(f'functions.{name}:')} /[0-9]{{1,4}}/ "
        f"{m('<|tool_call_argument_begin|>')} {args} {m('<|tool_call_end|>')}"
    ]


_DSML = "｜DSML｜"  # DeepSeek V3.2's and V4's tag prefix (fullwidth bars)
_NL = _lit("\n")


def _dsml_call(rule: str, name: str, schema: dict[str, Any], strict: bool, m: Markers) -> list[str]:
    """DeepSeek V3.2's and V4's DSML: ``<｜DSML｜invoke name="NAME">`` and a newline, then per
    argument ``<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`` and a
    newline (a string property's raw text, anything else JSON), ``</｜DSML｜invoke>``."""
    if '"' in name:
        raise GrammarRefused(f"tool name {name!r} cannot be written in DSML")
    open_param = _lit(f'<{_DSML}parameter name="')
    close_param = _lit(f"</{_DSML}parameter>")

    def param(key: str, raw: bool, value: str) -> str:
        flag = _lit(f'" string="{"true" if raw else "false"}">')
        return f"{open_param} {key} {flag} {value} {close_param} {_NL}"

    head = f"{_lit(f'<{_DSML}invoke name=' + json.dumps(name, ensure_ascii=False) + '>')} {_NL}"
    end = _lit(f"</{_DSML}invoke>")
    if not strict:
        key = '/[^"\\n]+/'
        free = f"({param(key, True, '/[^<]*/')}) | ({param(key, False, json_body({}))})"
        return [f"{rule}: {head} ({free})* {end}"]

    def pair(key: str, value: Any, where: str) -> str:
        raw, expr = _argument_value(value, where)
        return param(_lit(key), raw, expr)

    parts, _ = _strict_arguments(name, schema, pair, '"<\n')
    return [f"{rule}: {head} {' '.join(parts)} {end}"]


@dataclass(frozen=True)
class _CallSyntax:
    """How a family writes its calls: one call's rules (rule name, tool name, parameters
    schema, strict, markers), the markers around all of a reply's calls, and what stands
    between two calls."""

    call: Callable[[str, str, dict[str, Any], bool, Markers], list[str]]
    section: tuple[str, str] | None = None
    between: str = "NL?"


_SYNTAX: dict[str, _CallSyntax] = {
    "glm": _CallSyntax(_glm_call),
    "qwen3": _CallSyntax(_json_call),
    "deepseek_v31": _CallSyntax(
        _deepseek_v31_call, ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"), ""
    ),
    # The section's lines are separated by newlines (the reply's text before it by a blank line);
    # V3.2 names the section function_calls, V4 tool_calls.
    "dsml": _CallSyntax(_dsml_call, (f"<{_DSML}function_calls>", f"</{_DSML}function_calls>"), _NL),
    "dsml_v4": _CallSyntax(_dsml_call, (f"<{_DSML}tool_calls>", f"</{_DSML}tool_calls>"), _NL),
    "kimi_k2": _CallSyntax(
        _kimi_k2_call, ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"), ""
    ),
}


def tool_calls_body(format_name: str, tools: GrammarTools, m: Markers) -> tuple[str, list[str]]:
    """(the Lark expression of the calls, the rules it uses)."""
    syntax = _SYNTAX.get(format_name)
    if syntax is None:
        raise GrammarRefused(
            f"forced and strict tool calls are not available for the '{format_name}' "
            "tool-call format"
        )
    rules: list[str] = []
    names = []
    for i, (name, schema) in enumerate(tools.schemas.items()):
        rules += syntax.call(f"call_{i}", name, schema, name in tools.strict, m)
        names.append(f"call_{i}")
    rules.append("call: " + " | ".join(names))
    calls = f"call ({syntax.between} call)*" if tools.parallel else "call"
    if syntax.section is not None:
        begin, end = syntax.section
        sep = "" if syntax.between == "" else f" {syntax.between}"
        calls = f"{m(begin)}{sep} {calls}{sep} {m(end)}"
    return calls, rules


def tool_grammar(
    format_name: str,
    tools: GrammarTools,
    m: Markers,
    wrap: Callable[[str], str],
    answer: str | None = None,
) -> str:
    """The grammar of a reply with tools: calls only when forced; else free text (or
    ``answer``, the response format's body) or text then calls."""
    calls, rules = tool_calls_body(format_name, tools, m)
    if tools.forced:
        body = calls
    elif answer is not None:
        body = f"({answer}) | {calls}"
    else:
        body = f"TEXT | TEXT? {calls}"
        rules.append("TEXT: /(?s:.+)/")
    return wrap(body) + "\n".join(rules) + "\n"


def compile_checked(check: Callable[[str, str], None], grammar: str, param: str, what: str) -> None:
    """Compiles ``grammar`` against the model's tokenizer; a refusal is a 400 naming llguidance's
    reason (an unsupported JSON-schema keyword among them)."""
    try:
        check("lark", grammar)
    except ValueError as e:
        raise ApiError(
            400,
            f"{what} cannot be enforced: {_reason(str(e))}",
            code="unsupported_schema",
            param=param,
        ) from e


def _reason(message: str) -> str:
    """llguidance's message without its position prefix and the listing of our grammar."""
    text = re.sub(r"^at \d+\(\d+\): ", "", " ".join(message.split()))
    listing = text.find(" 1 | ")
    if listing > 0:
        text = text[:listing]
    return text[:600]


def special_markers(special_tokens: Sequence[str]) -> Markers:
    return Markers(frozenset(special_tokens))
