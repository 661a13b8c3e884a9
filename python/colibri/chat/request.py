"""A chat request as every protocol's parser leaves it: the conversation in the OpenAI-shaped
messages the chat templates read, the sampling settings, reasoning and the declared tools. The
API layer builds it (api/openai_request.py, api/anthropic_request.py); chat planning
(chat/plan.py) turns it into the engine's generation spec."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


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
    cache_slot: int | None = None
    # Stream prefill progress as chunks (OpenAI's stream_options.x_colibri_progress).
    progress_chunks: bool = False


@dataclass
class ChatRequest:
    model: str
    messages: list[dict[str, Any]]
    sampling: Sampling
    thinking: bool
    include_reasoning: bool
    # The effort the client asked of the reasoning (OpenAI reasoning_effort, Anthropic
    # output_config.effort), passed to templates that have a setting for it (DeepSeek-V4).
    reasoning_effort: str | None = None
    # Declared tools as the template receives them (OpenAI shape), and how they may be used.
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: str = "auto"  # "auto" | "none" | "required" | "function"
    tool_choice_name: str | None = None
    parallel_tool_calls: bool = True
    # Declared tools whose definitions stay out of the prompt until the client reveals them
    # (Anthropic's defer_loading): callable and parsed, not listed to the model.
    deferred_tools: frozenset[str] = frozenset()
    # Declared tools whose arguments must follow their parameters schema (``strict``).
    strict_tools: frozenset[str] = frozenset()
    # The JSON schema the answer must follow (OpenAI response_format, Anthropic
    # output_config.format), and the request field it came from (blamed when it is refused).
    output_schema: dict[str, Any] | None = None
    output_param: str = "response_format"

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def has_tool_history(self) -> bool:
        return any(m.get("tool_calls") or m["role"] == "tool" for m in self.messages)
