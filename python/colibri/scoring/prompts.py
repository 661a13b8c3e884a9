"""What scoring reads before each option, in the two forms a model can be asked in.

The text form is the contract's plain prompt: a state prefix, then a question ending in
``Answer:``, then each option after a space. The chat form asks the same through the model's
own chat template, for models trained on chat: the state as the system message, the question
as the user's, each option as the start of the assistant's reply (after the text the template
puts before a reply). Either way the state and each question are shared by every option (and
the state by every question), so the engine computes them once per slot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

FORMATS = ("chat", "text")
# The chat form's user message for a schema without a task.
SCHEMA_REQUEST = "Fill in the JSON object."


@dataclass(frozen=True)
class Read:
    """One prompt the options are read after, in both forms."""

    # Text form: the prompt, and what goes between it and each option.
    text: str
    joiner: str
    # Chat form: the system message (None: none), the user message, and the assistant's
    # reply so far (the options continue it).
    system: str | None
    user: str
    reply: str = ""

    def continuation(self, option: str) -> str:
        """An option as the text form reads it after the prompt."""
        return self.joiner + option


def state_prefix(state: str) -> str:
    """``Context:\\n{state}\\n\\n``, or nothing for an empty state."""
    return f"Context:\n{state}\n\n" if state else ""


def question_prompt(state: str, question: str | None) -> str:
    """The text form's prompt: the state prefix, ``Question: {q}\\n`` when there is a question,
    then ``Answer:``."""
    q = f"Question: {question}\n" if question else ""
    return f"{state_prefix(state)}{q}Answer:"


def question_read(state: str, question: str | None) -> Read:
    """A question after a state (either may be empty, not both)."""
    if question:
        return Read(question_prompt(state, question), " ", state or None, question)
    return Read(question_prompt(state, None), " ", None, state)


def _open_object(chosen: Sequence[tuple[str, Any]], field: str) -> str:
    done = "".join(
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}, "
        for k, v in chosen
    )
    return f'{{{done}{json.dumps(field, ensure_ascii=False)}: "'


def schema_cell_prompt(
    state: str, task: str | None, chosen: Sequence[tuple[str, Any]], field: str
) -> str:
    """The text form's prompt for one field of a schema: the state prefix, ``Task: {task}\\n``,
    then the JSON object so far (earlier fields with the values already chosen) open at this
    field's string value."""
    t = f"Task: {task}\n" if task else ""
    return f"{state_prefix(state)}{t}{_open_object(chosen, field)}"


def schema_read(
    state: str, task: str | None, chosen: Sequence[tuple[str, Any]], field: str
) -> Read:
    """One field of a schema; in the chat form the reply is the JSON object so far."""
    return Read(
        schema_cell_prompt(state, task, chosen, field),
        "",
        state or None,
        task or SCHEMA_REQUEST,
        _open_object(chosen, field),
    )


def value_continuation(value: str) -> str:
    """A schema value as the rest of the open JSON string it fills: escaped, then closed."""
    return json.dumps(value, ensure_ascii=False)[1:]


def messages_state(messages: Sequence[Mapping[str, Any]]) -> str:
    """Chat messages as a state: one ``role: text`` line per message (text parts joined)."""
    lines = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        lines.append(f"{m.get('role')}: {content}")
    return "\n".join(lines)
