"""The texts scoring reads: a state prefix, then a question ending in ``Answer:``, then each
option after a space. The state and each question prefix are shared by every option (and the
state by every question), so the engine computes them once per slot."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any


def state_prefix(state: str) -> str:
    """``Context:\\n{state}\\n\\n``, or nothing for an empty state."""
    return f"Context:\n{state}\n\n" if state else ""


def question_prompt(state: str, question: str | None) -> str:
    """The prompt an option is read after: the state prefix, ``Question: {q}\\n`` when there is
    a question, then ``Answer:``."""
    q = f"Question: {question}\n" if question else ""
    return f"{state_prefix(state)}{q}Answer:"


def schema_cell_prompt(
    state: str, task: str | None, chosen: Sequence[tuple[str, Any]], field: str
) -> str:
    """The prompt for one field of a schema: the state prefix, ``Task: {task}\\n``, then the
    JSON object so far (earlier fields with the values already chosen) open at this field's
    string value."""
    t = f"Task: {task}\n" if task else ""
    done = "".join(
        f"{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}, "
        for k, v in chosen
    )
    return f'{state_prefix(state)}{t}{{{done}{json.dumps(field, ensure_ascii=False)}: "'


def messages_state(messages: Sequence[Mapping[str, Any]]) -> str:
    """Chat messages as a state: one ``role: text`` line per message (text parts joined)."""
    lines = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        lines.append(f"{m.get('role')}: {content}")
    return "\n".join(lines)
