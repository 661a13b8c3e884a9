"""Chat templates: the model's own Jinja template, rendered in a sandbox.

The environment mirrors what Hugging Face's ``apply_chat_template`` gives templates (trimmed
blocks, ``loopcontrols``, ``tojson`` without ASCII escaping, ``raise_exception``, ``strftime_now``)
so a checkpoint's template renders here exactly as its authors tested it. The sandbox keeps a
template from reaching Python internals: templates ship with downloaded checkpoints.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from colibri.runtime.long_texts import tokenizer_module


class TemplateRefused(ValueError):
    """The template rejected the conversation (``raise_exception``) or failed to render it."""


def _raise_exception(message: str) -> None:
    raise TemplateRefused(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _sorted_keys(value: Any) -> Any:
    """``value`` with the keys of every mapping in it sorted, recursively."""
    if isinstance(value, dict):
        return {k: _sorted_keys(value[k]) for k in sorted(value)}
    if isinstance(value, list):
        return [_sorted_keys(v) for v in value]
    return value


def sorts_tool_keys(tokenizer_config: dict[str, Any]) -> bool:
    """Whether the checkpoint's tokenizer sorts the keys of the tool definitions before its
    template renders them: Kimi's tokenizer module (``tokenization_kimi``, named by
    ``auto_map``) does, recursively, in its ``apply_chat_template``, so its models saw tools
    that way."""
    return tokenizer_module(tokenizer_config) == "tokenization_kimi"


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may refer to; with
    ``sort_tool_keys`` the tool definitions reach it with their keys sorted
    (:func:`sorts_tool_keys`)."""

    def __init__(
        self,
        source: str,
        special_tokens: dict[str, str] | None = None,
        *,
        sort_tool_keys: bool = False,
    ) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the model's chat template does not compile: {e}") from e
        self.source = source
        self._special = dict(special_tokens or {})
        self.sort_tool_keys = sort_tool_keys

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        context = dict(self._special)
        context.update(extra)
        if tools is not None and self.sort_tool_keys:
            tools = _sorted_keys(tools)
        try:
            return self._template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except TemplateRefused:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            raise TemplateRefused(f"{type(e).__name__}: {e}") from e


def special_tokens_of(tokenizer_config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``, ``eos_token`` … as plain strings (tokenizer_config may wrap them in dicts)."""
    out: dict[str, str] = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        value = tokenizer_config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out
