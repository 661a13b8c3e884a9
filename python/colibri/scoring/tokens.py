"""The tokens scoring reads: a prompt in its form (the plain text, or the model's chat
template) and each option after it, and the refusal of what does not fit the context."""

from __future__ import annotations

from collections.abc import Sequence

from colibri.chat.literal import shield, tokenize_shielded
from colibri.chat.render import ContinuationRefused, render_chat
from colibri.chat.template import TemplateRefused
from colibri.errors import ApiError
from colibri.runtime.admission import shared_prefix
from colibri.runtime.served import ServedModel
from colibri.scoring.prompts import Read

# The assistant reply rendered to find where a reply starts in the chat form (no template
# rewrites a plain letter).
_PROBE = "x"


def prompt_format(model: ServedModel, requested: str | None) -> str:
    """The form prompts are read in: as requested, else "chat" when the model has a chat
    template (what a chat model was trained on), else "text"."""
    if requested is not None:
        return requested
    return "chat" if model.template is not None else "text"


def _chat_sequences(
    model: ServedModel, read: Read, options: Sequence[str]
) -> tuple[list[int], list[list[int]]] | None:
    """The chat form's tokens: the conversation up to the assistant's reply so far, and that
    followed by each option; None when the template cannot put text at the start of a reply
    (the caller falls back to the text form)."""
    if model.template is None:
        return None
    engine = model.engine
    specials = engine.special_tokens
    messages = [{"role": "system", "content": read.system}] if read.system else []
    messages.append({"role": "user", "content": read.user})
    shielded = shield(messages, specials)
    try:
        rendered = render_chat(
            model.template,
            model.family,
            [*shielded.messages, {"role": "assistant", "content": _PROBE}],
            enable_thinking=False,
        )
    except (ContinuationRefused, TemplateRefused):
        return None
    if not rendered.continued or not rendered.text.endswith(_PROBE):
        return None
    head = rendered.text[: -len(_PROBE)]

    def tokens(tail: str) -> list[int]:
        # The reply is the caller's text: where it spells a special token, it stays text.
        if any(s in tail for s in specials):
            return tokenize_shielded(
                head, shielded, engine.tokenize, engine.tokenize_literal
            ) + engine.tokenize_literal(tail)
        return tokenize_shielded(head + tail, shielded, engine.tokenize, engine.tokenize_literal)

    return tokens(read.reply), [tokens(read.reply + o) for o in options]


def read_tokens(
    model: ServedModel, read: Read, options: Sequence[str], fmt: str
) -> tuple[list[int], list[list[int]]]:
    """The context's tokens and each option's, in form ``fmt``. Each option's sequence is the
    tokenization of the whole text up to and with it (text read literally: a special token's
    string in what the caller wrote is ordinary text); the context is the part every sequence
    and the prompt alone share, so a tokenizer that merges across the boundary (``Answer:`` +
    `` Lisbon``) is read as it would tokenize the whole text."""
    chat = _chat_sequences(model, read, options) if fmt == "chat" else None
    if chat is not None:
        base, fulls = chat
    else:
        literal = model.engine.tokenize_literal
        base = literal(read.text)
        fulls = [literal(read.text + read.continuation(o)) for o in options]
    n = len(base)
    for f in fulls:
        n = min(n, shared_prefix(base, f), len(f) - 1)
    if n < 1:
        raise ApiError(400, "nothing to read the options after: the prompt is empty")
    return base[:n], [f[n:] for f in fulls]


def fitted_tokens(
    model: ServedModel, read: Read, options: Sequence[str], fmt: str
) -> tuple[list[int], list[list[int]]]:
    """:func:`read_tokens`, refused when the prompt with its longest option does not fit the
    context."""
    context, option_ids = read_tokens(model, read, options, fmt)
    check_fits(model, len(context) + max((len(o) for o in option_ids), default=0))
    return context, option_ids


def check_prompt(model: ServedModel, read: Read, options: Sequence[str], fmt: str) -> list[int]:
    """Refuses (before admission) a prompt whose longest option would not fit the context;
    returns the prompt's context tokens."""
    return fitted_tokens(model, read, options, fmt)[0]


def check_fits(model: ServedModel, tokens: int) -> None:
    """A prompt and its longest option must fit the context (never silently truncated)."""
    if tokens > model.context_length:
        raise ApiError(
            400,
            f"This model's maximum context length is {model.context_length} tokens. However, "
            f"a prompt with its longest option is {tokens} tokens. Shorten the state or the "
            "options.",
            code="context_length_exceeded",
        )
