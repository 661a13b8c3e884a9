"""From a conversation to the prompt text: template rendering, continuation, reasoning state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibri.chat.families import Family
from colibri.chat.template import ChatTemplate

# Marks where the final assistant turn's text ends when rendering a continuation. Invisible
# separator characters around a name: no template strips or rewrites it.
_CONTINUE_MARK = "\u2063colibri-continue\u2063"


class ContinuationRefused(ValueError):
    """A trailing assistant turn that cannot be continued faithfully."""


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    # The prompt ends inside the final assistant turn (that turn is being continued).
    continued: bool
    # The output starts inside a <think> block (the prompt opened one and did not close it).
    in_reasoning: bool
    # The prompt ends right after a closed think block: the answer follows directly.
    after_reasoning: bool


def render_chat(
    template: ChatTemplate,
    family: Family,
    messages: list[dict[str, Any]],
    *,
    enable_thinking: bool,
    continue_assistant: bool = True,
    tools: list[dict[str, Any]] | None = None,
    declared_tools: bool = False,
    reasoning_effort: str | None = None,
) -> RenderedPrompt:
    """Renders ``messages`` (contents already plain strings or None).

    A list ending in a non-empty assistant turn continues that turn when ``continue_assistant``;
    otherwise (or when the template cannot express an open turn) the turn is kept as a completed
    one and a fresh generation cue follows. ``tools`` go into the prompt; ``declared_tools`` says
    the request declared some even if they are left out (``tool_choice: "none"``);
    ``reasoning_effort`` reaches templates that read it (DeepSeek-V4's).
    """
    # Templates name the switch differently: GLM/Qwen `enable_thinking`, DeepSeek `thinking`.
    extra = {
        "enable_thinking": enable_thinking,
        "thinking": enable_thinking,
        "reasoning_effort": reasoning_effort,
    }
    last = messages[-1] if messages else None
    if (
        continue_assistant
        and last is not None
        and last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
        and last["content"]
    ):
        text = last["content"]
        if tools or declared_tools or any(m.get("tool_calls") for m in messages):
            raise ContinuationRefused(
                "a trailing assistant message is continued, which cannot be combined with tools "
                "or tool_calls; end the conversation with a user or tool message instead"
            )
        if text != text.rstrip():
            raise ContinuationRefused(
                "the trailing assistant message ends in whitespace, which the chat template "
                "would strip: the model would continue from different text than the one sent. "
                "Remove the trailing whitespace"
            )
        marked = [*messages[:-1], {**last, "content": text + _CONTINUE_MARK}]
        rendered = template.render(marked, add_generation_prompt=False, tools=tools, **extra)
        if rendered.count(_CONTINUE_MARK) == 1:
            prompt = rendered[: rendered.index(_CONTINUE_MARK)]
            return _with_reasoning_state(prompt, family, continued=True)
        # The template has no open-turn shape (it rewrote or dropped the text): fold instead.
    prompt = template.render(messages, add_generation_prompt=True, tools=tools, **extra)
    return _with_reasoning_state(prompt, family, continued=False)


def _with_reasoning_state(prompt: str, family: Family, continued: bool) -> RenderedPrompt:
    in_reasoning = after_reasoning = False
    if family.reasoning:
        # Only the final assistant turn counts: earlier text (a user quoting "<think>") does not.
        start = prompt.rfind(family.assistant_marker)
        turn = prompt[start:] if start >= 0 else ""
        opened, closed = turn.rfind(family.open_think), turn.rfind(family.close_think)
        in_reasoning = opened > closed
        after_reasoning = closed >= 0 and turn.rstrip().endswith(family.close_think)
    return RenderedPrompt(prompt, continued, in_reasoning, after_reasoning)
