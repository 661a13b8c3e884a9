"""Anthropic Messages request bodies -> the internal chat request.

The Anthropic shape (system, content blocks, tool_use / tool_result, thinking, tool_choice) is
translated to the OpenAI-shaped conversation the rest of the gateway works on, then validated by
the same code as ``/v1/chat/completions`` — one set of rules for both protocols.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from colibri.api.context_edits import Edit, parse_context_management
from colibri.api.openai_request import parse_chat
from colibri.api.sealed import seal, unseal
from colibri.api.validate import Body, bad, refuse_unless
from colibri.chat.request import ChatRequest

_THINKING = ("enabled", "disabled", "adaptive", "between_tools")
_EFFORTS = ("low", "medium", "high", "xhigh", "max")
# Anthropic tool_use ids must match this; ids a family writes itself (Kimi's
# "functions.NAME:IDX") are carried inside a reversible wrapper.
_ANTHROPIC_ID = re.compile(r"^[a-zA-Z0-9_-]+$")
_WRAPPED = "toolu_colibri_"


def to_anthropic_id(call_id: str) -> str:
    if _ANTHROPIC_ID.match(call_id) and not call_id.startswith(_WRAPPED):
        return call_id
    return _WRAPPED + call_id.encode().hex()


def from_anthropic_id(tool_id: str) -> str:
    """The family's own id back from a wrapped one; any other id is returned as is."""
    if tool_id.startswith(_WRAPPED):
        try:
            inner = bytes.fromhex(tool_id[len(_WRAPPED) :]).decode()
        except ValueError:
            return tool_id
        if inner and to_anthropic_id(inner) == tool_id:
            return inner
    return tool_id


# `anthropic-beta` values the clients colibri is tested with send, and what they mean here.
# None gates anything: what colibri implements is on without a header, what it lacks is refused
# by the body's fields, whatever the header says. Unknown values are ignored (not refused), so
# a client newer than this list keeps working.
KNOWN_BETAS = {
    "claude-code-20250219": "Claude Code's own marker: nothing to do",
    "oauth-2025-04-20": "Claude subscription login: the key is checked as any other",
    "interleaved-thinking-2025-05-14": "thinking between tool calls: the family's own format",
    "context-management-2025-06-27": "context_management edits: applied",
    "fine-grained-tool-streaming-2025-05-14": "tool input streamed as it is parsed: as always",
    "prompt-caching-2024-07-31": "cache_control: prefix reuse is automatic",
    "token-counting-2024-11-01": "count_tokens: served",
    "token-efficient-tools-2025-02-19": "tool call format: the family's own",
    "effort-2025-11-24": "output_config.effort: turns reasoning on",
    "advanced-tool-use-2025-11-20": "defer_loading: deferred tools are callable, not listed",
    "mid-conversation-tool-changes-2026-07-01": "tools may change: each request renders its own",
    "thinking-token-count-2026-05-13": "usage: output_tokens counts thinking as well",
    "structured-outputs-2025-11-13": "output_config.format and strict tools: enforced by grammar",
    "output-128k-2025-02-19": "long outputs: bounded by the context",
    "context-1m-2025-08-07": "1M context: the served model's context applies",
    "model-context-window-exceeded-2025-08-26": "context overflow: 400 before generation",
    "thinking-display-updates-2026-08-18": "thinking.display: accepted, thinking is always shown",
}


def beta_features(header: str | None) -> tuple[list[str], list[str]]:
    """The ``anthropic-beta`` header's comma-separated values: (known, unknown)."""
    values = [v.strip() for v in (header or "").split(",") if v.strip()]
    return [v for v in values if v in KNOWN_BETAS], [v for v in values if v not in KNOWN_BETAS]


_SIGNATURE_TAG = b"colibri-thinking-v2\0"
_DISPLAYS = ("summarized", "omitted", "updates")


def signature(thinking: str) -> str:
    """A thinking block's signature: the thinking text itself, sealed (api/sealed.py), so a
    client that got the block with its text omitted (``thinking.display: "omitted"``) and sends
    it back gets the same history rendered as the model wrote it."""
    return seal(thinking, _SIGNATURE_TAG)


def thinking_from_signature(sig: str) -> str | None:
    """The text a colibri signature carries, or None for any other signature."""
    return unseal(sig, _SIGNATURE_TAG)


@dataclass
class MessagesRequest:
    chat: ChatRequest
    thinking: bool
    # thinking.display "omitted": thinking blocks carry their signature, not their text
    omit_thinking: bool = False
    # context_management.edits, applied to chat.messages before rendering; None: not sent
    edits: list[Edit] | None = None


def _text_blocks(value: Any, param: str) -> str:
    """A string, or text blocks (cache_control / citations on them are accepted)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad(f"'{param}' must be a string or an array of text blocks", param=param)
    texts = []
    for i, raw in enumerate(value):
        block = Body(raw, where=f"'{param}[{i}]'")
        kind = block.string("type", required=True)
        if kind != "text":
            raise bad(
                f"'{param}[{i}]' is a '{kind}' block; only text is accepted here",
                param=param,
                code="unsupported_content",
            )
        texts.append(block.string("text", required=True) or "")
        block.raw("cache_control")
        block.raw("citations")
        block.finish()
    return "\n".join(texts)


def _blocks(content: Any, param: str) -> list[Body]:
    if isinstance(content, str):
        return [Body({"type": "text", "text": content}, where=param)]
    if not isinstance(content, list):
        raise bad(f"'{param}' must be a string or an array of content blocks", param=param)
    return [Body(raw, where=f"'{param}[{i}]'") for i, raw in enumerate(content)]


def _unsupported_block(kind: str, param: str) -> Exception:
    what = {"image": "image", "document": "document", "search_result": "search result"}.get(kind)
    if what:
        return bad(
            f"{what} blocks are not supported: the served model reads text only ({param})",
            param=param,
            code="unsupported_content",
        )
    return bad(f"unknown or unsupported content block type '{kind}' ({param})", param=param)


def _user(content: Any, param: str) -> list[dict[str, Any]]:
    """A user turn: its tool results (as tool messages) first, then its text."""
    tools, texts = [], []
    for block in _blocks(content, param):
        kind = block.string("type", required=True)
        block.raw("cache_control")
        if kind == "text":
            texts.append(block.string("text", required=True))
            block.raw("citations")
        elif kind == "tool_result":
            tool_id = block.string("tool_use_id", required=True) or ""
            text = _text_blocks(block.raw("content") or "", f"{param}.content")
            if block.boolean("is_error"):
                text = "Error: " + text
            tools.append(
                {"role": "tool", "tool_call_id": from_anthropic_id(tool_id), "content": text}
            )
        else:
            raise _unsupported_block(kind or "", param)
        block.finish()
    out = list(tools)
    if texts:
        out.append({"role": "user", "content": "\n".join(t or "" for t in texts)})
    return out


def _assistant(content: Any, param: str) -> dict[str, Any]:
    texts, calls, thoughts = [], [], []
    for block in _blocks(content, param):
        kind = block.string("type", required=True)
        block.raw("cache_control")
        if kind == "text":
            texts.append(block.string("text", required=True) or "")
            block.raw("citations")
        elif kind == "tool_use":
            tool_id = block.string("id", required=True) or ""
            name = block.string("name", required=True)
            arguments = block.obj("input")
            calls.append(
                {
                    "id": from_anthropic_id(tool_id),
                    "type": "function",
                    "function": {
                        "name": name,
                        "arguments": arguments.raw_dict() if arguments is not None else {},
                    },
                }
            )
        elif kind == "thinking":
            text = block.string("thinking")
            sig = block.string("signature")
            if text is None:
                raise bad(f"'{param}': a thinking block needs 'thinking'", param=param)
            if not text and sig:  # sent back from a reply whose thinking display was omitted
                text = thinking_from_signature(sig) or ""
            thoughts.append(text)
        elif kind == "redacted_thinking":
            block.string("data")  # encrypted elsewhere; nothing a local model can read
        else:
            raise _unsupported_block(kind or "", param)
        block.finish()
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = [
            {
                **c,
                "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])},
            }
            for c in calls
        ]
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    return message


def _tools(raw: list[Any] | None) -> tuple[list[dict[str, Any]], frozenset[str]]:
    """The tools in chat shape, and the names of those declared with ``defer_loading``."""
    tools, deferred = [], set()
    for i, item in enumerate(raw or []):
        tool = Body(item, where=f"'tools[{i}]'")
        kind = tool.string("type")
        if kind not in (None, "custom"):
            raise bad(
                f"'tools[{i}]' has the Anthropic-defined type '{kind}' (server tools and versioned "
                "built-in tools such as bash or text editor), which this server cannot run or "
                "describe to the model; declare it as a custom tool with a name and input_schema",
                param="tools",
                code="unsupported_tool",
            )
        name = tool.string("name", required=True)
        fn: dict[str, Any] = {"name": name}
        description = tool.string("description")
        if description is not None:
            fn["description"] = description
        schema = tool.obj("input_schema")
        if schema is None:
            raise bad(f"'tools[{i}].input_schema' is required", param="tools")
        fn["parameters"] = schema.raw_dict()
        tool.raw("cache_control")
        if tool.boolean("defer_loading"):
            deferred.add(name or "")
        if tool.boolean("strict"):
            fn["strict"] = True  # the arguments follow input_schema (chat/grammar.py)
        tool.finish()
        tools.append({"type": "function", "function": fn})
    return tools, frozenset(deferred)


def _tool_choice(raw: Any) -> tuple[Any, bool]:
    """(OpenAI tool_choice, parallel_tool_calls)."""
    if raw is None:
        return None, True
    choice = Body(raw, where="'tool_choice'")
    kind = choice.string("type", required=True)
    parallel = not choice.boolean("disable_parallel_tool_use")
    if kind == "auto":
        out: Any = "auto"
    elif kind == "any":
        out = "required"
    elif kind == "none":
        out = "none"
    elif kind == "tool":
        out = {"type": "function", "function": {"name": choice.string("name", required=True)}}
    else:
        raise bad(
            f"'tool_choice.type' must be auto, any, none or tool, got '{kind}'",
            param="tool_choice",
        )
    choice.finish()
    return out, parallel


def _output_format(config: Body) -> dict[str, Any] | None:
    """``output_config.format``: ``{"type": "json_schema", "schema": {...}}``, the JSON schema
    the answer follows (enforced by grammar)."""
    fmt = config.obj("format")
    if fmt is None:
        return None
    kind = fmt.string("type", required=True)
    if kind != "json_schema":
        raise bad(
            f"'output_config.format.type' must be 'json_schema', got '{kind}'", "output_config"
        )
    schema = fmt.obj("schema")
    if schema is None:
        raise bad("'output_config.format.schema' is required", "output_config")
    fmt.finish()
    return schema.raw_dict()


def _thinking(body: Body) -> tuple[bool, bool, dict[str, Any] | None, str | None]:
    """(reasoning on, thinking text omitted from the reply, the output's JSON schema, the
    effort asked of the reasoning)."""
    thinking = body.obj("thinking")
    effort = None
    output_schema = None
    config = body.obj("output_config")
    if config is not None:
        effort = config.string("effort")
        if effort is not None and effort not in _EFFORTS:
            raise bad(
                f"'output_config.effort' must be one of {', '.join(_EFFORTS)}", "output_config"
            )
        output_schema = _output_format(config)
        config.finish()
    if thinking is None:
        return effort is not None, False, output_schema, effort
    kind = thinking.string("type", required=True)
    if kind not in _THINKING:
        raise bad(f"'thinking.type' must be one of {', '.join(_THINKING)}", param="thinking")
    # budget_tokens and display are accepted; the reply's max_tokens bounds thinking and answer.
    thinking.integer("budget_tokens", minimum=1)
    display = thinking.string("display")
    if display is not None and display not in _DISPLAYS:
        raise bad(f"'thinking.display' must be one of {', '.join(_DISPLAYS)}", param="thinking")
    thinking.finish()
    return kind != "disabled", display == "omitted", output_schema, effort


def parse_messages(
    data: Any, default_max_tokens: int | None, count_only: bool = False
) -> MessagesRequest:
    body = Body(data)
    model = body.string("model", required=True) or ""
    max_tokens = body.integer("max_tokens", minimum=1)
    if max_tokens is None and not count_only:
        raise bad("'max_tokens' is required", param="max_tokens", code="missing_required_parameter")
    raw_messages = body.array("messages")
    if not raw_messages:
        raise bad("'messages' must be a non-empty array", param="messages")
    system_parts = []
    if body.present("system"):
        system_parts.append(_text_blocks(body.raw("system"), "system"))
    else:
        body.raw("system")
    messages: list[dict[str, Any]] = []
    for i, raw in enumerate(raw_messages):
        msg = Body(raw, where=f"'messages[{i}]'")
        role = msg.string("role", required=True)
        content = msg.raw("content")
        if content is None:
            raise bad(f"'messages[{i}].content' is required", param="messages")
        param = f"messages[{i}].content"
        if role == "system":  # recent clients send these inside messages: fold, in order
            system_parts.append(_text_blocks(content, param))
        elif role == "user":
            messages.extend(_user(content, param))
        elif role == "assistant":
            messages.append(_assistant(content, param))
        else:
            raise bad(f"'messages[{i}].role' must be user or assistant, got '{role}'", "messages")
        msg.finish()
    if system_parts:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system_parts)})
    temperature = body.number("temperature", 0.0, 1.0)
    top_p = body.number("top_p", 0.0, 1.0, exclusive_min=True)
    refuse_unless(body.raw("top_k") is None, "'top_k' is not supported", "top_k")
    stops = body.array("stop_sequences")
    stream = body.boolean("stream")
    tools, deferred = _tools(body.array("tools"))
    tool_choice, parallel = _tool_choice(body.raw("tool_choice"))
    thinking, omit_thinking, output_schema, effort = _thinking(body)
    body.obj("metadata")  # user_id for abuse tracking: nothing to do locally
    body.raw("service_tier")
    body.raw("speed")
    body.raw("cache_control")  # prefix reuse is automatic (KV slots)
    raw_edits = body.raw("context_management")
    edits = parse_context_management(raw_edits) if raw_edits is not None else None
    cache_slot = body.integer("cache_slot")
    body.finish()
    openai_body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "stop": stops,
        "stream": stream,
        "tools": tools or None,
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "enable_thinking": thinking,
        "cache_slot": cache_slot,
    }
    chat = dataclasses.replace(
        parse_chat(openai_body, default_max_tokens),
        deferred_tools=deferred,
        output_schema=output_schema,
        output_param="output_config",
        reasoning_effort=effort if thinking else None,
    )
    return MessagesRequest(chat=chat, thinking=thinking, omit_thinking=omit_thinking, edits=edits)
