"""``POST /v1/rank``: the CLM rank route on the scoring engine. Each candidate answer is read
after the context and question; the reply ranks them by probability (a softmax of their
log-probabilities over the temperature), best first (docs/API.md, "Ranking")."""

from __future__ import annotations

import math
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from colibri.api.access_log import record_of
from colibri.api.http import request_id
from colibri.api.loading import model_for
from colibri.api.systemone_request import as_text, invalid, parse_json
from colibri.errors import ApiError
from colibri.runtime.scoring import Scorer, run_scoring
from colibri.scoring.maths import ranked, softmax
from colibri.scoring.prompts import FORMATS, question_read
from colibri.scoring.tokens import check_prompt, fitted_tokens, prompt_format, read_tokens

MAX_CANDIDATES = 256
# Tokens one request may make the engine read: the prompt once and every answer (seed 003).
MAX_TOKENS = 32768
# Refusals a client must not retry as they are (seed 003: 413 and 400 carry this header).
NO_RETRY = {"x-should-retry": "false"}


def _too_many(message: str, code: str) -> ApiError:
    return ApiError(413, message, code=code, headers=NO_RETRY)


def _parse(data: Any) -> tuple[str | None, str, str | None, list[str], float, str | None]:
    if not isinstance(data, dict):
        raise invalid("the request body must be a JSON object", [])
    for key in data:
        if key not in ("model", "context", "question", "answers", "temperature", "prompt_format"):
            raise invalid(f"unknown or unsupported parameter {key!r}", [key])
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("must be a string", ["model"])
    context = data.get("context")
    if context is not None and not isinstance(context, str | dict | list):
        raise invalid("must be a string, an object or an array", ["context"])
    question = data.get("question")
    if question is not None and not isinstance(question, str):
        raise invalid("must be a string", ["question"])
    answers = data.get("answers")
    if not isinstance(answers, list) or not answers:
        raise invalid("'answers' must be a non-empty array of strings", ["answers"])
    if len(answers) > MAX_CANDIDATES:
        raise _too_many(
            f"{len(answers)} candidates; at most {MAX_CANDIDATES} per request",
            "clm_too_many_candidates",
        )
    for i, a in enumerate(answers):
        if not isinstance(a, str) or not a.strip():
            raise invalid("an answer must be a non-empty string", ["answers", i])
    t = data.get("temperature", 1.0)
    if t is None:
        t = 1.0
    if isinstance(t, bool) or not isinstance(t, int | float) or not 0 < t <= 100:
        raise invalid("'temperature' must be a number in (0, 100]", ["temperature"])
    fmt = data.get("prompt_format")
    if fmt is not None and fmt not in FORMATS:
        raise invalid("must be 'chat' or 'text'", ["prompt_format"])
    text = as_text(context) if context is not None else ""
    q = question.strip() if question else None
    return model, text, q or None, list(answers), float(t), fmt


async def rank(request: Request) -> Response:
    started = time.perf_counter()
    name, context, question, answers, temperature, requested = _parse(
        parse_json(await request.body())
    )
    try:
        # No model: the default one.
        model = await model_for(request, name, generation=False)
    except ApiError as e:
        if e.status < 500:
            e.headers.update(NO_RETRY)
        raise
    fmt = prompt_format(model, requested)
    if not context and not question:
        raise invalid("give a 'context' or a 'question' to rank the answers after", ["question"])
    read = question_read(context, question)
    try:
        affinity, option_ids = read_tokens(model, read, answers, fmt)
        read_total = len(affinity) + sum(len(o) for o in option_ids)
        if read_total > MAX_TOKENS:
            raise _too_many(
                f"the context and answers are {read_total} tokens; at most {MAX_TOKENS} per "
                "request",
                "too_many_tokens",
            )
        check_prompt(model, read, answers, fmt)
    except ApiError as e:
        e.headers.update(NO_RETRY)
        raise
    observer = model.observe("rank", request_id(request), request.headers, record_of(request.scope))

    async def work(scorer: Scorer) -> list[float]:
        reads = await scorer.read(answers, fitted_tokens(model, read, answers, fmt))
        scores = [r.logprob for r in reads]
        if not all(math.isfinite(s) for s in scores):
            raise ApiError(502, "the engine gave no log-probabilities", code="engine_error")
        return softmax(scores, temperature)

    done = await run_scoring(request, model, observer, None, affinity, work)
    probs = done.value
    body = {
        "model": model.id,
        "ranked": [
            {"rank": k + 1, "candidate": answers[i], "prob": probs[i]}
            for k, i in enumerate(ranked(probs))
        ],
    }
    latency = (time.perf_counter() - started) * 1e3
    return Response(
        orjson.dumps(body),
        media_type="application/json",
        headers={**done.headers, "X-CLM-Latency-Ms": f"{latency:.1f}"},
    )
