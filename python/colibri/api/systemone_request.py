"""``POST /v1/systemone`` request bodies (the Jev question contract): a state and up to 64
named questions of three types, validated field by field. Every refusal is a 422 in the OpenAI
envelope plus Jev's ``detail: [{loc, msg, type}]`` (docs/API.md, "Question scoring")."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson

from colibri.errors import ApiError
from colibri.scoring.prompts import FORMATS

MAX_QUESTIONS = 64
MAX_LABELS = 255
TYPES = ("noul", "choice", "score")
NORMALIZE = ("sum", "mean")


def invalid(message: str, loc: list[str | int]) -> ApiError:
    """A 422 naming the field at ``loc`` (path inside the body) both ways: ``param`` as
    ``questions.q.criteria[1]`` and Jev's ``detail[0].loc`` as ``["body", "questions", "q",
    "criteria", 1]``."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else (f".{part}" if param else part)
    return ApiError(
        422,
        message,
        code="invalid_request",
        param=param or None,
        extra={"detail": [{"loc": ["body", *loc], "msg": message, "type": "value_error"}]},
    )


def parse_json(raw: bytes) -> Any:
    """The body as JSON, or a 422 (the Jev and CLM contracts refuse bad JSON with 422)."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise invalid(f"the request body is not valid JSON: {e}", []) from e


def as_text(value: Any) -> str:
    """A string stripped; an object or array as pretty JSON (indent 2, non-ASCII kept)."""
    if isinstance(value, str):
        return value.strip()
    return json.dumps(value, indent=2, ensure_ascii=False)


@dataclass(frozen=True)
class Question:
    id: str
    type: str
    # The question's text (without "Question: " and "Answer:"), its options in order, and
    # (score) the criteria as sent, for the legend.
    text: str
    options: list[str]
    legend: list[Any]


@dataclass(frozen=True)
class SystemoneRequest:
    model: str | None
    state: str
    questions: list[Question]
    normalize: str
    prefix: str | None
    cache_slot: int | None
    prompt_format: str | None = None


def _optional_text(value: Any, loc: list[str | int]) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid("must be a string", loc)
    return value.strip() or None


def _noul(qid: str, instructions: str | None, criteria: Any) -> Question:
    loc: list[str | int] = ["questions", qid, "criteria"]
    if criteria is not None and not isinstance(criteria, dict):
        raise invalid("noul criteria must be an object with 'true' and/or 'false'", loc)
    criteria = criteria or {}
    for key in criteria:
        if key not in ("true", "false"):
            raise invalid(f"unknown noul criterion {key!r} (true, false)", [*loc, key])
    true = _optional_text(criteria.get("true"), [*loc, "true"])
    false = _optional_text(criteria.get("false"), [*loc, "false"])
    text = instructions or "Is this true?"
    if true:
        text += f"\nyes: {true}"
    if false:
        text += f"\nno: {false}"
    return Question(qid, "noul", text + "\nAnswer yes or no.", ["yes", "no"], [])


def _choice(qid: str, instructions: str | None, criteria: Any) -> Question:
    loc: list[str | int] = ["questions", qid, "criteria"]
    if not isinstance(criteria, dict) or not 1 <= len(criteria) <= MAX_LABELS:
        raise invalid(f"choice criteria must be an object of 1 to {MAX_LABELS} labels", loc)
    lines = []
    for label, desc in criteria.items():
        if not label.strip():
            raise invalid("a choice label must not be blank", [*loc, label])
        d = _optional_text(desc, [*loc, label])
        lines.append(f"- {label}: {d}" if d else f"- {label}")
    text = instructions or "Which of the following applies?"
    text += "\nOptions:\n" + "\n".join(lines) + "\nAnswer with one of the options."
    return Question(qid, "choice", text, list(criteria), [])


def _score(qid: str, instructions: str | None, criteria: Any) -> Question:
    loc: list[str | int] = ["questions", qid, "criteria"]
    if not isinstance(criteria, list) or not 1 <= len(criteria) <= MAX_LABELS:
        raise invalid(f"score criteria must be an array of 1 to {MAX_LABELS} levels", loc)
    lines = []
    for i, level in enumerate(criteria):
        if level is not None and not isinstance(level, str):
            raise invalid("a score level must be a string or null", [*loc, i])
        d = (level or "").strip()
        lines.append(f"{i + 1}: {d or f'level {i + 1}'}")
    text = instructions or "Rate this on the scale below."
    text += "\nScale:\n" + "\n".join(lines) + "\nAnswer with the number."
    options = [str(k) for k in range(1, len(criteria) + 1)]
    return Question(qid, "score", text, options, list(criteria))


def _question(qid: str, value: Any) -> Question:
    if not qid.strip():
        raise invalid("a question id must not be blank", ["questions", qid])
    if not isinstance(value, dict):
        raise invalid("a question must be an object with a 'type'", ["questions", qid])
    for key in value:
        if key not in ("type", "instructions", "criteria"):
            raise invalid(f"unknown question field {key!r}", ["questions", qid, key])
    kind = value.get("type")
    if kind not in TYPES:
        raise invalid(
            f"type must be one of {', '.join(TYPES)}, got {kind!r}", ["questions", qid, "type"]
        )
    instructions = _optional_text(value.get("instructions"), ["questions", qid, "instructions"])
    make = {"noul": _noul, "choice": _choice, "score": _score}[kind]
    return make(qid, instructions, value.get("criteria"))


def parse_systemone(data: Any) -> SystemoneRequest:
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", [])
    for key in data:
        if key not in (
            "model",
            "state",
            "questions",
            "normalize",
            "pin_state",
            "prefix",
            "cache_slot",
        ):
            raise invalid(f"unknown or unsupported parameter {key!r}", [key])
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("must be a string", ["model"])
    if "state" not in data or not isinstance(data["state"], str | dict | list):
        raise invalid("'state' is required: a string, an object or an array", ["state"])
    questions = data.get("questions")
    if not isinstance(questions, dict) or not 1 <= len(questions) <= MAX_QUESTIONS:
        raise invalid(
            f"'questions' must be an object of 1 to {MAX_QUESTIONS} questions", ["questions"]
        )
    normalize = data.get("normalize") or "sum"
    if normalize not in NORMALIZE:
        raise invalid("must be 'sum' or 'mean'", ["normalize"])
    pin_state = data.get("pin_state")
    if pin_state is not None and not isinstance(pin_state, bool):
        raise invalid("must be a boolean", ["pin_state"])
    prefix = data.get("prefix")
    if prefix is not None and (not isinstance(prefix, str) or not prefix.strip()):
        raise invalid("must be a non-empty string", ["prefix"])
    fmt = data.get("prompt_format")
    if fmt is not None and fmt not in FORMATS:
        raise invalid("must be 'chat' or 'text'", ["prompt_format"])
    slot = data.get("cache_slot")
    if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or slot < 0):
        raise invalid("must be an integer >= 0", ["cache_slot"])
    return SystemoneRequest(
        model,
        as_text(data["state"]),
        [_question(qid, q) for qid, q in questions.items()],
        str(normalize),
        prefix,
        slot,
        fmt,
    )
