"""OpenAI request bodies -> validated internal requests (chat and legacy completions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibri.api.validate import Body, bad, refuse_unless

MAX_STOPS = 4
_ROLES = ("system", "developer", "user", "assistant", "tool")
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stops: list[str]
    ignore_leading_stop: bool
    stream: bool
    include_usage: bool


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling
    thinking: bool
    include_reasoning: bool


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
    n = body.integer("n")
    refuse_unless(n in (None, 1), "only n=1 is supported (one choice per request)", "n")
    stream = bool(body.boolean("stream"))
    include_usage = False
    options = body.obj("stream_options")
    if options is not None:
        refuse_unless(stream, "'stream_options' is only allowed with stream=true", "stream_options")
        include_usage = bool(options.boolean("include_usage"))
        options.finish()
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
    return Sampling(
        max_tokens=max_tokens,
        temperature=0.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        seed=seed,
        stops=stops,
        ignore_leading_stop=ignore_leading,
        stream=stream,
        include_usage=include_usage,
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
    if role == "tool" or msg.present("tool_calls") or msg.present("function_call"):
        raise bad(
            "tool messages and tool_calls are not supported yet by this server",
            param="messages",
            code="tools_not_supported",
        )
    content = msg.raw("content")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role}
    if content is None:
        raise bad(f"'{param}.content' is required", param="messages")
    out["content"] = _text_content(content, f"{param}.content")
    name = msg.string("name")
    if name is not None:
        out["name"] = name
    if role == "assistant":
        # Reasoning of an earlier turn, under either name; the template decides what to keep.
        reasoning = msg.string("reasoning_content")
        reasoning = msg.string("reasoning") if reasoning is None else reasoning
        if reasoning is not None:
            out["reasoning_content"] = reasoning
        refusal = msg.raw("refusal")
        if refusal is not None:
            raise bad(f"'{param}.refusal' is not supported", param="messages")
    msg.finish()
    return out


def _refuse_tools(body: Body) -> None:
    tools = body.array("tools")
    choice = body.raw("tool_choice")
    body.boolean("parallel_tool_calls")  # meaningful only with tools, which are refused below
    functions = body.array("functions")
    function_call = body.raw("function_call")
    if tools or functions or function_call is not None or choice not in (None, "none"):
        raise bad(
            "tool calling is not supported yet by this server (tools, tool_choice, functions)",
            param="tools",
            code="tools_not_supported",
        )


def _response_format(body: Body) -> None:
    fmt = body.obj("response_format")
    if fmt is None:
        return
    kind = fmt.string("type", required=True)
    refuse_unless(
        kind == "text",
        f"response_format type '{kind}' is not supported (no constrained decoding yet)",
        "response_format",
    )
    fmt.finish()


def parse_chat(data: Any, default_max_tokens: int | None) -> ChatRequest:
    body = Body(data)
    model = body.string("model", required=True) or ""
    raw_messages = body.array("messages")
    if not raw_messages:
        raise bad("'messages' must be a non-empty array", param="messages")
    messages = [_message(m, i) for i, m in enumerate(raw_messages)]
    sampling = _sampling(body, default_max_tokens)
    _refuse_tools(body)
    _response_format(body)
    logprobs = body.boolean("logprobs")
    refuse_unless(not logprobs, "'logprobs' is not supported", "logprobs")
    refuse_unless(
        body.raw("top_logprobs") is None, "'top_logprobs' is not supported", "top_logprobs"
    )
    store = body.boolean("store")
    refuse_unless(not store, "'store' is not supported: nothing is stored", "store")
    body.obj("metadata")  # only meaningful with store; accepted
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
