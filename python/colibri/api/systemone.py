"""``POST /v1/systemone``: the Jev question contract on the scoring engine. Each question
(yes/no ``noul``, ``choice`` among labels, ``score`` on a scale) is asked after the state and
answered from the model's log-probabilities of its options (docs/API.md, "Question scoring")."""

from __future__ import annotations

import secrets
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from colibri.api.access_log import record_of
from colibri.api.http import models, request_id
from colibri.api.loading import model_for
from colibri.api.systemone_request import Question, SystemoneRequest, parse_json, parse_systemone
from colibri.errors import ApiError
from colibri.runtime.scoring import Scorer, run_scoring
from colibri.runtime.served import ServedModel
from colibri.scoring.maths import confidence, softmax
from colibri.scoring.prompts import Read, question_read
from colibri.scoring.tokens import check_prompt, fitted_tokens, prompt_format


def _read(req: SystemoneRequest, q: Question) -> Read:
    lead = f"{req.prefix}\n\n" if req.prefix else ""
    read = question_read(req.state, q.text)
    # The prefix leads both forms: the text prompt, and the system message (or, with no
    # state, a system message of its own).
    system = f"{lead}{read.system}" if read.system else (req.prefix or None)
    return Read(lead + read.text, read.joiner, system, read.user)


def _answer(q: Question, probs: list[float]) -> dict[str, Any]:
    """The question's answer from its options' probabilities (6 decimals)."""
    if q.type == "noul":
        return {"type": "noul", "noul": round(probs[0], 6)}
    conf = round(confidence(probs), 6)
    if q.type == "choice":
        best = max(range(len(probs)), key=lambda i: (probs[i], -i))  # first label on ties
        return {
            "type": "choice",
            "choice": q.options[best],
            "probabilities": {
                label: round(p, 6) for label, p in zip(q.options, probs, strict=True)
            },
            "confidence": conf,
        }
    return {
        "type": "score",
        "score": round(sum(i * p for i, p in enumerate(probs)), 6),
        "legend": {str(i): level for i, level in enumerate(q.legend)},
        "probabilities": {str(i): round(p, 6) for i, p in enumerate(probs)},
        "confidence": conf,
    }


async def _scored(
    scorer: Scorer, req: SystemoneRequest, questions: list[Question], fmt: str
) -> dict[str, list[float]]:
    """Every question's option probabilities, read in one engine scoring (the state's KV once,
    the questions' own tokens together)."""
    asked = [
        (q.options, fitted_tokens(scorer.model, _read(req, q), q.options, fmt)) for q in questions
    ]
    out = {}
    for q, reads in zip(questions, await scorer.read_many(asked), strict=True):
        scores = [r.score(req.normalize) for r in reads]
        if any(s != s for s in scores):  # NaN
            raise ApiError(502, "the engine gave no log-probabilities", code="engine_error")
        out[q.id] = softmax(scores)
    return out


async def _model(request: Request, label: str | None) -> ServedModel:
    """The model ``label`` names; a label that names none is the default model (Jev clients
    send "jev-latest"; the reply names the id that answered). An ambiguous one is still 409."""
    catalog = models(request)
    if label is None:
        return await model_for(request, None, generation=False)
    try:
        catalog.resolve(label)
    except ApiError as e:
        if e.code != "model_not_found":
            raise
        return await model_for(request, None, generation=False)
    return await model_for(request, label, generation=False)


async def systemone(request: Request) -> Response:
    req = parse_systemone(parse_json(await request.body()))
    model = await _model(request, req.model)
    fmt = prompt_format(model, req.prompt_format)
    engine_questions = [q for q in req.questions if len(q.options) > 1]
    contexts = [check_prompt(model, _read(req, q), q.options, fmt) for q in engine_questions]
    observer = model.observe(
        "systemone", request_id(request), request.headers, record_of(request.scope)
    )

    async def work(scorer: Scorer) -> dict[str, list[float]]:
        return await _scored(scorer, req, engine_questions, fmt)

    if engine_questions:
        done = await run_scoring(request, model, observer, req.cache_slot, contexts[0], work)
        probs, usage, headers = done.value, done.usage, done.headers
    else:
        # One-label questions only: answered without the engine.
        observer.end()
        probs, usage, headers = {}, None, {}
    answers = {q.id: _answer(q, probs.get(q.id, [1.0])) for q in req.questions}
    rid = f"req_{secrets.token_hex(16)}"
    body = {
        "id": rid,
        "model": model.id,
        "provider": "colibri",
        "answers": answers,
        "usage": {
            "input_tokens": usage.prompt_tokens if usage else 0,
            "output_tokens": usage.read_tokens if usage else 0,
            "cost": 0,
        },
    }
    return Response(
        orjson.dumps(body),
        media_type="application/json",
        headers={**headers, "x-typesafe-request-id": rid},
    )
