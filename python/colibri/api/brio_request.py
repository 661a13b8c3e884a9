"""``POST /v1/brio`` request bodies, validated field by field (docs/API.md, "Closed-set
scoring"): exactly one form (``options``, ``questions`` or ``schema``), the state as text or
chat messages, and the scoring settings. Every refusal is a 400 naming the field at fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from colibri.api.validate import Body, bad
from colibri.scoring.prompts import FORMATS, messages_state

MIN_OPTIONS = 2
MAX_OPTIONS = 64
MAX_QUESTIONS = 64
MAX_FIELDS = 64
NORMALIZE = ("sum", "mean")


@dataclass(frozen=True)
class BrioQuestion:
    question: str | None
    options: list[str]
    normalize: str


@dataclass(frozen=True)
class BrioRequest:
    model: str
    form: str  # "options" | "questions" | "schema"
    state: str
    normalize: str
    cache_slot: int | None
    # options form: one question (or none) and its options; questions form: each question.
    questions: list[BrioQuestion]
    # schema form: the fields in order with their allowed values, and the task.
    fields: list[tuple[str, list[str]]]
    task: str | None
    # "chat", "text", or None: the model's default (runtime/scoring.py prompt_format).
    prompt_format: str | None = None


def _options(value: Any, param: str) -> list[str]:
    if not isinstance(value, list):
        raise bad(f"'{param}' must be an array of strings", param=param)
    if not MIN_OPTIONS <= len(value) <= MAX_OPTIONS:
        raise bad(
            f"'{param}' must hold {MIN_OPTIONS} to {MAX_OPTIONS} options, got {len(value)}",
            param=param,
        )
    seen: set[str] = set()
    for i, v in enumerate(value):
        if not isinstance(v, str) or not v.strip():
            raise bad(f"'{param}[{i}]' must be a non-empty string", param=param)
        if v in seen:
            raise bad(f"'{param}' lists {v!r} twice; options must be distinct", param=param)
        seen.add(v)
    return list(value)


def _normalize(value: Any, param: str, default: str) -> str:
    if value is None:
        return default
    if value not in NORMALIZE:
        raise bad(f"'{param}' must be 'sum' or 'mean', got {value!r}", param=param)
    return str(value)


def _messages(value: Any) -> str:
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty array of messages", param="messages")
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"'messages[{i}]' must be an object with a role", param=f"messages.{i}")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                    raise bad(
                        f"'messages[{i}].content[{j}]' must be a text part with a string 'text'",
                        param=f"messages.{i}.content.{j}.text",
                    )
        elif not isinstance(content, str):
            raise bad(
                f"'messages[{i}].content' must be a string or an array of text parts",
                param=f"messages.{i}.content",
            )
    return messages_state(value)


def _questions(value: Any, normalize: str) -> list[BrioQuestion]:
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_QUESTIONS:
        raise bad(
            f"'questions' must be an array of 1 to {MAX_QUESTIONS} questions", param="questions"
        )
    out = []
    for i, q in enumerate(value):
        where = f"questions[{i}]"
        body = Body(q, where=f"'{where}'")
        text = body.raw("question")
        if not isinstance(text, str) or not text.strip():
            raise bad(f"'{where}.question' must be a non-empty string", param=f"{where}.question")
        options = _options(body.raw("options"), f"{where}.options")
        norm = _normalize(body.raw("normalize"), f"{where}.normalize", normalize)
        body.finish()
        out.append(BrioQuestion(text, options, norm))
    return out


def _schema(value: Any) -> list[tuple[str, list[str]]]:
    if not isinstance(value, dict) or not 1 <= len(value) <= MAX_FIELDS:
        raise bad(
            f"'schema' must be an object of 1 to {MAX_FIELDS} fields, each a list of values",
            param="schema",
        )
    fields = []
    for name, values in value.items():
        if not name.strip() or any(c in name for c in '"\\\n'):
            raise bad(
                f"schema field name {name!r} must be non-empty without quotes, backslashes or "
                "newlines",
                param=f"schema.{name}",
            )
        fields.append((name, _options(values, f"schema.{name}")))
    return fields


def parse_brio(data: Any) -> BrioRequest:
    body = Body(data)
    model = body.string("model", required=True)
    assert model is not None
    forms = [f for f in ("options", "questions", "schema") if body.present(f)]
    if len(forms) != 1:
        raise bad(
            "give exactly one of 'options', 'questions' or 'schema'"
            + (f" (got {', '.join(forms)})" if forms else ""),
            param="options",
        )
    form = forms[0]
    state_value = body.raw("state")
    if state_value is not None and not isinstance(state_value, str):
        raise bad("'state' must be a string", param="state")
    messages = body.raw("messages")
    if state_value is not None and messages is not None:
        raise bad("give 'state' or 'messages', not both", param="state")
    state = _messages(messages) if messages is not None else (state_value or "")
    question = body.string("question")
    normalize = _normalize(body.raw("normalize"), "normalize", "sum")
    cache_slot = body.integer("cache_slot", minimum=0)
    task = body.string("task")
    prompt_format = body.raw("prompt_format")
    if prompt_format is not None and prompt_format not in FORMATS:
        raise bad("'prompt_format' must be 'chat' or 'text'", param="prompt_format")
    questions: list[BrioQuestion] = []
    fields: list[tuple[str, list[str]]] = []
    if form == "options":
        options = _options(body.raw("options"), "options")
        if not state and not (question and question.strip()):
            raise bad(
                "the options form needs a 'state', 'messages' or a 'question' to read the "
                "options after",
                param="state",
            )
        questions = [BrioQuestion(question or None, options, normalize)]
    else:
        if not state:
            raise bad(f"the {form} form needs a 'state' (or 'messages')", param="state")
        if question is not None:
            raise bad(f"'question' belongs to the options form, not {form}", param="question")
        if form == "questions":
            questions = _questions(body.raw("questions"), normalize)
        else:
            fields = _schema(body.raw("schema"))
    if task is not None and form != "schema":
        raise bad("'task' belongs to the schema form", param="task")
    body.finish()
    return BrioRequest(
        model, form, state, normalize, cache_slot, questions, fields, task, prompt_format
    )
