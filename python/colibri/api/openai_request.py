"""OpenAI request bodies -> validated internal requests (chat and legacy completions)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from colibri.api.validate import Body, bad, refuse_unless
from colibri.chat.request import ChatRequest, Sampling

MAX_STOPS = 4
_ROLES = ("system", "developer", "user", "assistant", "tool")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class CompletionRequest:
    model: str
    prompt: str
    sampling: Sampling


def _stops(body: Body) -> list[str]:
    raw = body.raw("stop")
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or an array of strings", param="stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"'stop' takes at most {MAX_STOPS} sequences, got {len(stops)}", param="stop")
    if any(s == "" for s in stops):
        raise bad("'stop' sequences must not be empty", param="stop")
    return stops


def _sampling(body: Body, default_max_tokens: int | None) -> Sampling:
    """Fields shared by chat and completions."""
    limits = [
        v
        for v in (body.integer("max_tokens", minimum=1), body.integer("max_completion_tokens", 1))
        if v is not None
    ]
    # Both are ceilings: honour the smaller when a client sends both.
    max_tokens = min(limits) if limits else default_max_tokens
    temperature = body.number("temperature", 0.0, 2.0)
    top_p = body.number("top_p", 0.0, 1.0, exclusive_min=True)
    seed = body.integer("seed")
    if seed is not None:
        seed &= (1 << 64) - 1  # any integer is a valid seed; the sampler takes 64 bits
    n = body.integer("n")
    refuse_unless(n in (None, 1), "only n=1 is supported (one choice per request)", "n")
    stream = bool(body.boolean("stream"))
    include_usage = progress_chunks = False
    options = body.obj("stream_options")
    if options is not None:
        refuse_unless(stream, "'stream_options' is only allowed with stream=true", "stream_options")
        include_usage = bool(options.boolean("include_usage"))
        progress_chunks = bool(options.boolean("x_colibri_progress"))
        options.boolean("include_obfuscation")  # random padding against length side channels:
        options.finish()  # a loopback server adds none, whatever is asked
    for key in ("frequency_penalty", "presence_penalty"):
        value = body.number(key, -2.0, 2.0)
        refuse_unless(not value, f"'{key}' is not supported (token penalties)", key)
    repetition = body.number("repetition_penalty", 0.0, 100.0)
    refuse_unless(
        repetition in (None, 1.0), "'repetition_penalty' is not supported", "repetition_penalty"
    )
    logit_bias = body.obj("logit_bias")
    refuse_unless(
        logit_bias is None or logit_bias.is_empty(), "'logit_bias' is not supported", "logit_bias"
    )
    stops = _stops(body)
    ignore_leading = bool(body.boolean("x_colibri_ignore_leading_stop"))
    body.string("user")  # an end-user id for abuse tracking: accepted, nothing to do locally
    body.string("safety_identifier")  # user's successor in OpenAI's API: the same
    body.string("prompt_cache_key")  # a cache routing hint: prefix reuse here is automatic
    cache_slot = body.integer("cache_slot")
    return Sampling(
        max_tokens=max_tokens,
        temperature=0.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stops=stops,
        ignore_leading_stop=ignore_leading,
        stream=stream,
        include_usage=include_usage,
        cache_slot=cache_slot,
        progress_chunks=progress_chunks,
    )


def _text_content(content: Any, param: str) -> str:
    """A message's content as plain text: a string, or an array of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{param}' must be a string or an array of content parts", param=param)
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise bad(f"'{param}[{i}]' must be a content part object with a 'type'", param=param)
        kind = part["type"]
        if kind != "text":
            what = {"image_url": "image", "input_audio": "audio", "file": "file"}.get(kind, kind)
            raise bad(
                f"{what} content is not supported: the served model reads text only "
                f"('{param}[{i}]' has type '{kind}')",
                param=param,
                code="unsupported_content",
            )
        part_body = Body(part, where=f"'{param}[{i}]'")
        part_body.raw("type")
        texts.append(part_body.string("text", required=True) or "")
        part_body.finish()
    # Several text parts are separate paragraphs of one message.
    return "\n".join(texts)


_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def _history_call(raw: Any, param: str) -> dict[str, Any]:
    """An assistant ``tool_calls`` entry; its arguments string must be a JSON object."""
    call = Body(raw, where=param)
    call_id = call.string("id", required=True)
    kind = call.string("type") or "function"
    refuse_unless(kind == "function", f"'{param}.type' must be 'function'", "messages")
    fn = call.obj("function")
    if fn is None:
        raise bad(f"'{param}.function' is required", param="messages")
    name = fn.string("name", required=True) or ""
    arguments = fn.raw("arguments")
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise bad(f"'{param}.function.arguments' is not valid JSON", param="messages") from None
    else:
        parsed = arguments
    if not isinstance(parsed, dict):
        raise bad(f"'{param}.function.arguments' must be a JSON object", param="messages")
    fn.finish()
    call.finish()
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": parsed}}


def _message(raw: Any, i: int) -> dict[str, Any]:
    param = f"messages[{i}]"
    msg = Body(raw, where=param)
    role = msg.string("role", required=True)
    if role not in _ROLES:
        raise bad(
            f"'{param}.role' is '{role}'; expected one of {', '.join(_ROLES)}",
            param="messages",
            code="invalid_role",
        )
    if msg.present("function_call"):
        raise bad(
            f"'{param}.function_call' is the deprecated functions API; use tool_calls",
            param="messages",
        )
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    content = msg.raw("content")
    calls = msg.array("tool_calls")
    if calls and role != "assistant":
        raise bad(f"'{param}.tool_calls' is only allowed on assistant messages", param="messages")
    if calls:
        out["tool_calls"] = [
            _history_call(c, f"{param}.tool_calls[{j}]") for j, c in enumerate(calls)
        ]
    if content is None and not calls:
        raise bad(f"'{param}.content' is required", param="messages")
    out["content"] = _text_content(content, f"{param}.content") if content is not None else ""
    name = msg.string("name")
    if name is not None:
        out["name"] = name
    if role == "tool":
        out["tool_call_id"] = msg.string("tool_call_id", required=True)
    if role == "assistant":
        # Reasoning of an earlier turn, under either name; the template decides what to keep.
        # colibri's own replies carry both names with the same text; either is accepted.
        reasoning_content, reasoning = msg.string("reasoning_content"), msg.string("reasoning")
        reasoning = reasoning_content if reasoning_content is not None else reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        refusal = msg.raw("refusal")
        if refusal is not None:
            raise bad(f"'{param}.refusal' is not supported", param="messages")
    msg.finish()
    return out


def _tool(raw: Any, i: int) -> dict[str, Any]:
    param = f"tools[{i}]"
    tool = Body(raw, where=param)
    kind = tool.string("type", required=True)
    refuse_unless(kind == "function", f"'{param}.type' must be 'function', got '{kind}'", "tools")
    fn = tool.obj("function")
    if fn is None:
        raise bad(f"'{param}.function' is required", param="tools")
    name = fn.string("name", required=True) or ""
    if not _TOOL_NAME.match(name):
        raise bad(
            f"'{param}.function.name' must be 1-64 letters, digits, '_', '-' or '.', got {name!r}",
            param="tools",
        )
    out: dict[str, Any] = {"name": name}
    description = fn.string("description")
    if description is not None:
        out["description"] = description
    parameters = fn.obj("parameters")
    out["parameters"] = parameters.raw_dict() if parameters is not None else {}
    if fn.boolean("strict"):
        out["strict"] = True
    fn.finish()
    tool.finish()
    return {"type": "function", "function": out}


def _tool_choice(body: Body, names: list[str]) -> tuple[str, str | None]:
    raw = body.raw("tool_choice")
    if raw is None:
        return "auto", None
    if raw in ("auto", "none", "required"):
        if raw == "required" and not names:
            raise bad("tool_choice 'required' needs tools", param="tool_choice")
        return raw, None
    if not isinstance(raw, dict):
        raise bad(
            f"'tool_choice' must be 'auto', 'none', 'required' or "
            f'{{"type": "function", "function": {{"name": ...}}}}, got {raw!r}',
            param="tool_choice",
        )
    choice = Body(raw, where="'tool_choice'")
    kind = choice.string("type", required=True)
    fn = choice.obj("function")
    if kind != "function" or fn is None:
        raise bad(
            "'tool_choice' must be 'auto', 'none', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    name = fn.string("name", required=True) or ""
    fn.finish()
    choice.finish()
    if name not in names:
        raise bad(f"tool_choice names '{name}', which is not in 'tools'", param="tool_choice")
    return "function", name


def _tools(body: Body) -> tuple[list[dict[str, Any]], str, str | None, bool]:
    functions = body.array("functions")
    function_call = body.raw("function_call")
    if functions or function_call is not None:
        raise bad(
            "'functions' and 'function_call' are the deprecated functions API; use 'tools' "
            "and 'tool_choice'",
            param="functions",
        )
    tools = [_tool(t, i) for i, t in enumerate(body.array("tools") or [])]
    strict = frozenset(t["function"]["name"] for t in tools if t["function"].pop("strict", False))
    names = [t["function"]["name"] for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad(f"tool '{duplicate}' is declared twice", param="tools")
    choice, name = _tool_choice(body, names)
    parallel = body.boolean("parallel_tool_calls")
    return tools, choice, name, parallel is not False, strict


_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def _response_format(body: Body) -> dict[str, Any] | None:
    """The JSON schema the answer must follow (None: free text). ``json_object`` is any JSON
    object; ``json_schema`` is enforced whether ``strict`` is true or not."""
    fmt = body.obj("response_format")
    if fmt is None:
        return None
    kind = fmt.string("type", required=True)
    schema: dict[str, Any] | None = None
    if kind == "json_object":
        schema = {"type": "object"}
    elif kind == "json_schema":
        spec = fmt.obj("json_schema")
        if spec is None:
            raise bad("'response_format.json_schema' is required", param="response_format")
        name = spec.string("name", required=True) or ""
        if not _SCHEMA_NAME.match(name):
            raise bad(
                "'response_format.json_schema.name' must be 1-64 letters, digits, '_' or '-', "
                f"got {name!r}",
                param="response_format",
            )
        spec.string("description")
        spec.boolean("strict")
        raw = spec.obj("schema")
        schema = raw.raw_dict() if raw is not None else {}
        spec.finish()
    elif kind != "text":
        raise bad(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got '{kind}'",
            param="response_format",
        )
    fmt.finish()
    return schema


def _prediction(body: Body) -> None:
    """Predicted Outputs: the expected reply, which only lets a server skip ahead. The reply is
    the same with or without it; colibri does not use it (yet), so it is checked and accepted."""
    prediction = body.obj("prediction")
    if prediction is None:
        return
    kind = prediction.string("type", required=True)
    refuse_unless(kind == "content", "'prediction.type' must be 'content'", "prediction")
    content = prediction.raw("content")
    if content is None:
        raise bad("'prediction.content' is required", param="prediction")
    _text_content(content, "prediction.content")
    prediction.finish()


def parse_chat(data: Any, default_max_tokens: int | None) -> ChatRequest:
    body = Body(data)
    model = body.string("model", required=True) or ""
    raw_messages = body.array("messages")
    if not raw_messages:
        raise bad("'messages' must be a non-empty array", param="messages")
    messages = [_message(m, i) for i, m in enumerate(raw_messages)]
    sampling = _sampling(body, default_max_tokens)
    tools, tool_choice, tool_choice_name, parallel, strict_tools = _tools(body)
    output_schema = _response_format(body)
    logprobs = body.boolean("logprobs")
    refuse_unless(not logprobs, "'logprobs' is not supported", "logprobs")
    refuse_unless(
        body.raw("top_logprobs") is None, "'top_logprobs' is not supported", "top_logprobs"
    )
    store = body.boolean("store")
    refuse_unless(not store, "'store' is not supported: nothing is stored", "store")
    body.obj("metadata")  # only meaningful with store; accepted
    _prediction(body)
    enable_thinking = body.boolean("enable_thinking")
    effort = body.string("reasoning_effort")
    if effort is not None and effort not in _EFFORTS:
        raise bad(
            f"'reasoning_effort' must be one of {', '.join(_EFFORTS)}", param="reasoning_effort"
        )
    include_reasoning = body.boolean("include_reasoning")
    body.finish()
    if enable_thinking is not None:
        thinking = enable_thinking
    else:
        thinking = effort is not None and effort != "none"
    return ChatRequest(
        model=model,
        messages=messages,
        sampling=sampling,
        thinking=thinking,
        include_reasoning=include_reasoning is not False,
        reasoning_effort=effort if thinking else None,
        tools=tools,
        tool_choice=tool_choice,
        tool_choice_name=tool_choice_name,
        parallel_tool_calls=parallel,
        strict_tools=strict_tools,
        output_schema=output_schema,
        output_param="response_format",
    )


def parse_completion(data: Any, default_max_tokens: int) -> CompletionRequest:
    body = Body(data)
    model = body.string("model", required=True) or ""
    prompt = body.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad(
            "'prompt' must be a string (token arrays and batches of prompts are not supported)",
            param="prompt",
        )
    sampling = _sampling(body, default_max_tokens)
    echo = body.boolean("echo")
    refuse_unless(not echo, "'echo' is not supported", "echo")
    refuse_unless(body.raw("suffix") is None, "'suffix' is not supported", "suffix")
    best_of = body.integer("best_of")
    refuse_unless(best_of in (None, 1), "only best_of=1 is supported", "best_of")
    logprobs = body.raw("logprobs")
    refuse_unless(logprobs in (None, 0, False), "'logprobs' is not supported", "logprobs")
    body.finish()
    return CompletionRequest(model=model, prompt=prompt, sampling=sampling)
