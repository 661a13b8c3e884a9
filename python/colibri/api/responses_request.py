"""OpenAI Responses request bodies -> the internal chat request.

``input`` (a string, or items: messages with text parts, ``function_call``,
``function_call_output`` and ``reasoning`` items), ``instructions``, tools (functions, namespaces
of functions) and the sampling fields are translated to the OpenAI-chat shape and validated by
the same code as ``/v1/chat/completions``. A conversation continued with
``previous_response_id`` starts from the stored response's conversation (its instructions are
not carried over, as in OpenAI's API).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from colibri.api.openai_request import parse_chat
from colibri.api.sealed import unseal
from colibri.api.validate import Body, bad, refuse_unless
from colibri.chat.request import ChatRequest

REASONING_TAG = b"colibri-reasoning-v1\0"
_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_SUMMARIES = ("auto", "concise", "detailed")
_INCLUDES = ("reasoning.encrypted_content",)
# Hosted tools run by OpenAI's servers; colibri cannot run them, so they are not offered to the
# model (a client such as codex declares web_search on every request).
_HOSTED = ("web_search", "web_search_preview", "web_search_2025_08_26")


@dataclass
class ResponsesRequest:
    chat: ChatRequest
    # The conversation without the instructions: what a follow-up continues from.
    history: list[dict[str, Any]]
    instructions: str | None
    store: bool
    previous_response_id: str | None
    include_encrypted_reasoning: bool
    reasoning: dict[str, Any]  # echoed in the response: {"effort", "summary"}
    max_output_tokens: int | None
    tool_choice: Any  # echoed as sent (default "auto")
    tools: list[dict[str, Any]]  # echoed as sent
    metadata: dict[str, Any] = field(default_factory=dict)
    hosted_tools: list[str] = field(default_factory=list)  # declared, not offered to the model
    # flattened name -> (namespace, name) for functions declared inside a namespace
    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    # text.format, echoed as sent (default {"type": "text"})
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})


def _parts_text(content: Any, param: str, kinds: tuple[str, ...]) -> str:
    """A string, or content parts of the given kinds (their texts joined with newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{param}' must be a string or an array of content parts", param="input")
    texts = []
    for i, raw in enumerate(content):
        part = Body(raw, where=f"'{param}[{i}]'")
        kind = part.string("type", required=True) or ""
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad(
                f"{kind} parts are not supported: the served model reads text only "
                f"('{param}[{i}]')",
                param="input",
                code="unsupported_content",
            )
        if kind not in kinds:
            raise bad(
                f"'{param}[{i}].type' is '{kind}'; expected {' or '.join(kinds)}", param="input"
            )
        texts.append(part.string("text", required=True) or "")
        part.raw("annotations")  # output_text of an earlier turn: citations, none here
        part.raw("logprobs")
        part.finish()
    return "\n".join(texts)


class _Conversation:
    """Chat messages built item by item: consecutive calls join one assistant turn, and a
    reasoning item goes to the assistant turn that follows it."""

    def __init__(self, start: list[dict[str, Any]]) -> None:
        self.messages = [dict(m) for m in start]
        self._reasoning: list[str] = []

    def _assistant(self) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or self._reasoning:
            last = {"role": "assistant", "content": ""}
            if self._reasoning:
                last["reasoning_content"] = "\n".join(self._reasoning)
                self._reasoning = []
            self.messages.append(last)
        return last

    def message(self, role: str, text: str) -> None:
        if role == "assistant":
            turn = self._assistant()
            if turn.get("tool_calls") or turn["content"]:
                turn = {"role": "assistant", "content": ""}
                self.messages.append(turn)
            turn["content"] = text
        else:
            self.messages.append({"role": role, "content": text})

    def call(self, call: dict[str, Any]) -> None:
        self._assistant().setdefault("tool_calls", []).append(call)

    def output(self, call_id: str, text: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def reasoning(self, text: str) -> None:
        self._reasoning.append(text)


def _input_items(raw: Any, conv: _Conversation) -> None:
    if isinstance(raw, str):
        conv.message("user", raw)
        return
    if not isinstance(raw, list) or not raw:
        raise bad("'input' must be a string or a non-empty array of items", param="input")
    for i, item_raw in enumerate(raw):
        param = f"input[{i}]"
        item = Body(item_raw, where=f"'{param}'")
        kind = item.string("type") or "message"
        item.string("id")  # ids of earlier items: not needed to rebuild the conversation
        item.string("status")
        if kind == "message":
            role = item.string("role", required=True) or ""
            if role not in ("user", "assistant", "system", "developer"):
                raise bad(f"'{param}.role' is '{role}'", param="input", code="invalid_role")
            kinds = ("output_text",) if role == "assistant" else ("input_text",)
            content = item.raw("content")
            if content is None:
                raise bad(f"'{param}.content' is required", param="input")
            conv.message("system" if role == "developer" else role, _parts_text(
                content, f"{param}.content", kinds
            ))  # fmt: skip
        elif kind == "function_call":
            name = item.string("name", required=True) or ""
            namespace = item.string("namespace")
            conv.call(
                {
                    "id": item.string("call_id", required=True),
                    "type": "function",
                    "function": {
                        "name": f"{namespace}.{name}" if namespace else name,
                        "arguments": item.string("arguments", required=True),
                    },
                }
            )
        elif kind == "function_call_output":
            call_id = item.string("call_id", required=True) or ""
            output = item.raw("output")
            if output is None:
                raise bad(f"'{param}.output' is required", param="input")
            conv.output(call_id, _parts_text(output, f"{param}.output", ("input_text",)))
        elif kind == "reasoning":
            texts = []
            content = item.array("content") or []
            for j, part in enumerate(content):
                texts.append(_parts_text([part], f"{param}.content[{j}]", ("reasoning_text",)))
            item.array("summary")  # summaries of a reasoning we keep whole
            sealed = item.string("encrypted_content")
            if not texts and sealed:
                texts.append(unseal(sealed, REASONING_TAG) or "")
            if texts:
                conv.reasoning("\n".join(texts))
        else:
            raise bad(
                f"'{param}.type' is '{kind}': colibri reads message, function_call, "
                "function_call_output and reasoning items",
                param="input",
            )
        item.finish()


def _function(tool: Body, name: str, where: str) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name}
    description = tool.string("description")
    if description is not None:
        fn["description"] = description
    parameters = tool.obj("parameters")
    fn["parameters"] = parameters.raw_dict() if parameters is not None else {}
    if tool.boolean("strict"):
        fn["strict"] = True  # the arguments follow parameters (chat/grammar.py)
    return {"type": "function", "function": fn}


def _tools(raw: list[Any] | None, req_hosted: list[str], namespaced: dict) -> list[dict]:
    tools = []
    for i, item in enumerate(raw or []):
        where = f"tools[{i}]"
        tool = Body(item, where=f"'{where}'")
        kind = tool.string("type", required=True) or ""
        if kind == "function":
            tools.append(_function(tool, tool.string("name", required=True) or "", where))
        elif kind == "namespace":
            ns = tool.string("name", required=True) or ""
            tool.string("description")
            for j, inner_raw in enumerate(tool.array("tools") or []):
                inner = Body(inner_raw, where=f"'{where}.tools[{j}]'")
                inner_kind = inner.string("type", required=True)
                refuse_unless(
                    inner_kind == "function",
                    f"'{where}.tools[{j}].type' must be 'function'",
                    "tools",
                )
                name = inner.string("name", required=True) or ""
                namespaced[f"{ns}.{name}"] = (ns, name)
                tools.append(_function(inner, f"{ns}.{name}", f"{where}.tools[{j}]"))
                inner.finish()
        elif kind in _HOSTED:
            req_hosted.append(kind)
            tool.raw_dict()  # its options configure a search colibri does not run
        else:
            raise bad(
                f"'{where}.type' is '{kind}': colibri runs function tools (and namespaces of "
                "them); hosted tools other than web search are refused",
                param="tools",
                code="unsupported_tool",
            )
        tool.finish()
    return tools


def _tool_choice(raw: Any) -> Any:
    if raw is None or raw in ("auto", "none", "required"):
        return raw
    choice = Body(raw, where="'tool_choice'")
    kind = choice.string("type", required=True)
    if kind != "function":
        raise bad(
            "'tool_choice' must be 'auto', 'none', 'required' or "
            '{"type": "function", "name": ...}',
            param="tool_choice",
        )
    name = choice.string("name", required=True)
    choice.finish()
    return {"type": "function", "function": {"name": name}}


def _reasoning(body: Body) -> tuple[bool, dict[str, Any]]:
    raw = body.obj("reasoning")
    if raw is None:
        return False, {"effort": None, "summary": None}
    effort = raw.string("effort")
    if effort is not None and effort not in _EFFORTS:
        raise bad(f"'reasoning.effort' must be one of {', '.join(_EFFORTS)}", param="reasoning")
    summary = raw.string("summary")
    if summary is not None and summary not in _SUMMARIES:
        raise bad(f"'reasoning.summary' must be one of {', '.join(_SUMMARIES)}", "reasoning")
    raw.string("generate_summary")  # the deprecated name of summary
    raw.finish()
    # Asking for reasoning (an effort, or summaries of it) turns it on; effort "none" off.
    return effort != "none", {"effort": effort, "summary": summary}


def _text(body: Body) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """(chat's response_format, text.format as sent). ``json_schema``'s fields sit in
    ``text.format`` itself (``name``, ``schema``, ``strict``, ``description``)."""
    text = body.obj("text")
    echo: dict[str, Any] = {"type": "text"}
    response_format = None
    if text is None:
        return None, echo
    fmt = text.obj("format")
    if fmt is not None:
        kind = fmt.string("type", required=True)
        if kind == "json_object":
            response_format = {"type": "json_object"}
        elif kind == "json_schema":
            spec = {"name": fmt.string("name", required=True)}
            for key, value in (
                ("description", fmt.string("description")),
                ("strict", fmt.boolean("strict")),
                ("schema", fmt.obj("schema")),
            ):
                if value is not None:
                    spec[key] = value.raw_dict() if isinstance(value, Body) else value
            response_format = {"type": "json_schema", "json_schema": spec}
        elif kind != "text":
            raise bad(
                f"'text.format.type' must be text, json_object or json_schema, got '{kind}'",
                param="text",
            )
        fmt.finish()
        echo = fmt.raw_dict()
    verbosity = text.string("verbosity")
    refuse_unless(
        verbosity in (None, "medium"), "'text.verbosity' other than medium is not supported", "text"
    )
    text.finish()
    return response_format, echo


def parse_responses(
    data: Any, default_max_tokens: int | None, previous: list[dict[str, Any]] | None
) -> ResponsesRequest:
    """``previous``: the stored conversation of ``previous_response_id`` (looked up by the
    caller once the id is known, see :func:`previous_id`)."""
    body = Body(data)
    model = body.string("model", required=True) or ""
    instructions = body.string("instructions")
    previous_response_id = body.string("previous_response_id")
    conv = _Conversation(previous or [])
    raw_input = body.raw("input")
    if raw_input is None:
        raise bad("'input' is required", param="input", code="missing_required_parameter")
    _input_items(raw_input, conv)
    if conv._reasoning:
        raise bad("a reasoning item must be followed by the assistant turn it belongs to", "input")
    hosted: list[str] = []
    namespaced: dict[str, tuple[str, str]] = {}
    raw_tools = body.array("tools")
    tools = _tools(raw_tools, hosted, namespaced)
    raw_choice = body.raw("tool_choice")
    thinking, reasoning = _reasoning(body)
    response_format, text_format = _text(body)
    include = body.array("include") or []
    for value in include:
        refuse_unless(
            value in _INCLUDES,
            f"'include' value {value!r} is not supported (only {', '.join(_INCLUDES)})",
            "include",
        )
    store = body.boolean("store")
    max_output_tokens = body.integer("max_output_tokens", minimum=1)
    truncation = body.string("truncation")
    refuse_unless(
        truncation in (None, "disabled"),
        "'truncation' 'auto' is not supported: a prompt the context cannot hold is refused",
        "truncation",
    )
    refuse_unless(
        body.raw("max_tool_calls") is None, "'max_tool_calls' is not supported", "max_tool_calls"
    )
    refuse_unless(not body.boolean("background"), "'background' is not supported", "background")
    refuse_unless(
        body.raw("conversation") is None,
        "'conversation' is not supported; use previous_response_id",
        "conversation",
    )
    refuse_unless(
        body.raw("prompt") is None, "'prompt' (stored prompt templates) is not supported", "prompt"
    )
    refuse_unless(
        body.integer("top_logprobs") in (None, 0), "'top_logprobs' is not supported", "top_logprobs"
    )
    metadata = body.obj("metadata")
    body.obj("client_metadata")  # codex's turn metadata: nothing to do locally
    body.string("prompt_cache_key")  # a cache routing hint: prefix reuse is automatic
    body.string("user")
    body.string("safety_identifier")
    body.raw("service_tier")
    stream_options = body.obj("stream_options")
    if stream_options is not None:
        stream_options.boolean("include_obfuscation")  # no padding is ever added
        stream_options.finish()
    openai_body: dict[str, Any] = {
        "model": model,
        "temperature": body.raw("temperature"),
        "top_p": body.raw("top_p"),
        "stream": body.raw("stream"),
        "max_tokens": max_output_tokens,
        "parallel_tool_calls": body.raw("parallel_tool_calls"),
        "cache_slot": body.raw("cache_slot"),
        "response_format": response_format,
    }
    body.finish()
    history = conv.messages
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    if not messages:
        raise bad("'input' holds no message", param="input")
    openai_body.update(
        messages=messages,
        tools=tools or None,
        tool_choice=_tool_choice(raw_choice),
        enable_thinking=thinking,
    )
    chat = replace(parse_chat(openai_body, default_max_tokens), output_param="text")
    return ResponsesRequest(
        chat=chat,
        history=history,
        instructions=instructions,
        store=store is not False,
        previous_response_id=previous_response_id,
        include_encrypted_reasoning="reasoning.encrypted_content" in include,
        reasoning=reasoning,
        max_output_tokens=max_output_tokens,
        tool_choice=raw_choice if raw_choice is not None else "auto",
        tools=list(raw_tools or []),
        metadata=metadata.raw_dict() if metadata is not None else {},
        hosted_tools=hosted,
        namespaced=namespaced,
        text_format=text_format,
    )


def previous_id(data: Any) -> str | None:
    """The ``previous_response_id`` of a body, before it is parsed (the stored conversation
    must be known to parse the rest)."""
    if isinstance(data, dict):
        value = data.get("previous_response_id")
        if value is None or isinstance(value, str):
            return value
        raise bad("'previous_response_id' must be a string", param="previous_response_id")
    return None
