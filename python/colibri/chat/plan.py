"""Chat planning: a chat request rendered with the model's own template, tokenized (what users
and tools wrote stays text), its budget checked, and its stops, reasoning and tool parsing
planned: the generation spec the runtime runs. Refusals (no template, a mode the family lacks, a
continuation or template refusal, a prompt the context cannot hold) come before any admission."""

from __future__ import annotations

import dataclasses

from colibri.chat import grammar as g
from colibri.chat.families import Family
from colibri.chat.literal import shield, tokenize_shielded
from colibri.chat.output import ReasoningState
from colibri.chat.render import ContinuationRefused, RenderedPrompt, render_chat
from colibri.chat.request import ChatRequest
from colibri.chat.template import TemplateRefused
from colibri.chat.tooling import plan_tools
from colibri.errors import ApiError
from colibri.observability import RequestObserver
from colibri.runtime.engine import Grammar
from colibri.runtime.generation import GenerationSpec
from colibri.runtime.served import ServedModel


def plan_chat(
    model: ServedModel,
    req: ChatRequest,
    observer: RequestObserver,
    check_budget: bool = True,
    prompt_param: str = "messages",
) -> GenerationSpec:
    """Renders and tokenizes the conversation and plans stops, reasoning and tools.
    ``prompt_param``: the field a prompt too long for the context is blamed on."""
    family = model.family
    if model.template is None:
        raise ApiError(
            400,
            "The served model has no chat template (tokenizer_config.json or "
            "chat_template.jinja); use /v1/completions with a prompt string",
            code="chat_template_missing",
        )
    if req.thinking and not family.reasoning:
        raise ApiError(
            400,
            f"The served model (family '{family.name}') has no reasoning mode: drop "
            "enable_thinking / reasoning_effort",
            code="reasoning_not_supported",
            param="reasoning_effort",
        )
    # What users and tools wrote stays text even where it spells a special token.
    shielded = shield(req.messages, model.engine.special_tokens)
    tooling = plan_tools(dataclasses.replace(req, messages=shielded.messages), family)
    try:
        with observer.span("render"):
            rendered = render_chat(
                model.template,
                family,
                tooling.messages,
                enable_thinking=req.thinking,
                continue_assistant=model.config.continue_assistant,
                tools=tooling.prompt_tools,
                declared_tools=bool(req.tools),
                reasoning_effort=req.reasoning_effort,
            )
    except ContinuationRefused as e:
        raise ApiError(400, str(e), code="invalid_continuation", param="messages") from e
    except TemplateRefused as e:
        raise ApiError(
            400,
            f"The model's chat template refused these messages: {e}",
            code="template_refused",
            param="messages",
        ) from e
    ids = tokenize_shielded(
        rendered.text, shielded, model.engine.tokenize, model.engine.tokenize_literal
    )
    max_tokens = 1
    if check_budget:
        max_tokens, _ = model.budget(len(ids), req.sampling.max_tokens, prompt_param)
    stops, ignore_leading, stop_ids = family.chat_stops(
        req.sampling.stops,
        req.sampling.ignore_leading_stop,
        model.engine.eos_token_ids,
        model.engine.token_id,
    )
    reasoning = (
        ReasoningState(
            rendered.in_reasoning,
            rendered.after_reasoning,
            family.open_think,
            family.close_think,
            end_markers=tooling.end_markers,
        )
        if family.reasoning
        else None
    )
    return GenerationSpec(
        prompt_ids=ids,
        max_tokens=max_tokens,
        temperature=req.sampling.temperature,
        top_p=req.sampling.top_p,
        seed=req.sampling.seed,
        stop_token_ids=stop_ids,
        stops=stops,
        ignore_leading_stop=ignore_leading,
        reasoning=reasoning,
        tool_parser=tooling.parser_factory,
        grammar=plan_grammar(model, req, family, rendered),
    )


def plan_grammar(
    model: ServedModel, req: ChatRequest, family: Family, rendered: RenderedPrompt
) -> Grammar | None:
    """The grammar the output must follow (chat/grammar.py), compiled once here so a schema
    llguidance refuses is a 400 before admission; None when the output is free."""
    tools_active = req.tools_active and family.tool_format is not None
    declared = [
        t
        for t in req.tools
        if req.tool_choice != "function" or t["function"]["name"] == req.tool_choice_name
    ]
    strict = req.strict_tools & {t["function"]["name"] for t in declared}
    forced = req.tool_choice in ("required", "function")
    want_tools = tools_active and (forced or bool(strict))
    if req.output_schema is None and not want_tools:
        return None
    engine = model.engine
    markers = g.special_markers(engine.special_tokens)

    def wrap(body: str) -> str:
        return g.with_reasoning(
            body,
            markers,
            family.open_think if family.reasoning else None,
            family.close_think if family.reasoning else None,
            rendered.in_reasoning,
            rendered.after_reasoning,
        )

    answer = None if req.output_schema is None else g.json_body(req.output_schema)
    param, what = req.output_param, "The JSON schema"
    if tools_active and (want_tools or answer is not None):
        fmt = family.tool_format
        assert fmt is not None
        tools = g.GrammarTools(
            {t["function"]["name"]: t["function"]["parameters"] for t in declared},
            frozenset(strict),
            forced,
            req.parallel_tool_calls,
        )
        try:
            text = g.tool_grammar(fmt.name, tools, markers, wrap, None if forced else answer)
        except g.GrammarRefused as e:
            raise ApiError(400, str(e), code="unsupported_schema", param="tools") from e
        if answer is None or forced:
            param, what = "tools", "The tools' parameters schemas"
    else:
        assert answer is not None
        text = wrap(answer)
    g.compile_checked(engine.check_grammar, text, param, what)
    return Grammar("lark", text, end_ids=tuple(engine.eos_token_ids))
