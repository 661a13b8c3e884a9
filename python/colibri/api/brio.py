"""``POST /v1/brio``: closed-set scoring. The caller's options are read after a prompt and
chosen by the model's own log-probabilities, with a normalised entropy that says how sure it
is; nothing is generated (docs/API.md, "Closed-set scoring")."""

from __future__ import annotations

import logging
import math
import secrets
import time
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from colibri.api.access_log import record_of
from colibri.api.brio_request import BrioQuestion, BrioRequest, parse_brio
from colibri.api.http import read_json, request_id
from colibri.api.loading import model_for
from colibri.errors import ApiError
from colibri.runtime.scoring import Scorer, Usage, run_scoring
from colibri.runtime.served import ServedModel
from colibri.scoring.maths import OptionRead, entropy, ranked, softmax
from colibri.scoring.prompts import question_read, schema_read, value_continuation
from colibri.scoring.tokens import check_prompt, fitted_tokens, prompt_format

log = logging.getLogger("colibri.scoring")


def _check_before_admission(model: ServedModel, req: BrioRequest, fmt: str) -> list[int]:
    """Every prompt with its longest option must fit the context (for a schema, each cell with
    the longest values of the fields before it). Returns the first prompt's context tokens
    (the slot whose history shares most with them is chosen)."""
    first: list[int] | None = None
    for q in req.questions:
        context = check_prompt(model, question_read(req.state, q.question), q.options, fmt)
        first = first or context
    chosen: list[tuple[str, Any]] = []
    for name, values in req.fields:
        read = schema_read(req.state, req.task, chosen, name)
        context = check_prompt(model, read, [value_continuation(v) for v in values], fmt)
        first = first or context
        chosen.append((name, max(values, key=len)))
    assert first is not None
    return first


def _choices(reads: list[OptionRead], normalize: str) -> tuple[list[dict[str, Any]], float]:
    """The options by probability (highest first) and the normalised entropy."""
    if not reads or any(not math.isfinite(r.logprob) for r in reads):
        raise ApiError(
            502, "the engine gave no log-probabilities for the options", code="engine_error"
        )
    if normalize == "mean" and len({r.tokens for r in reads}) > 1:
        log.warning(
            "normalize=mean with unequal option token counts: %s",
            ", ".join(f"{r.option!r}={r.tokens}" for r in reads),
        )
    probs = softmax([r.score(normalize) for r in reads])
    choices = [
        {
            "option": reads[i].option,
            "p": probs[i],
            "logprob": reads[i].logprob,
            "mean_logprob": reads[i].mean_logprob,
            "tokens": reads[i].tokens,
        }
        for i in ranked(probs)
    ]
    return choices, entropy(probs)


async def _answers(
    scorer: Scorer, state: str, questions: list[BrioQuestion], fmt: str
) -> list[dict[str, Any]]:
    """Each question's answer, all read in one engine scoring (the state's KV once, the
    questions' own tokens together)."""
    asked = [
        (q.options, fitted_tokens(scorer.model, question_read(state, q.question), q.options, fmt))
        for q in questions
    ]
    out = []
    for q, reads in zip(questions, await scorer.read_many(asked), strict=True):
        choices, h = _choices(reads, q.normalize)
        out.append(
            {
                "answer": choices[0]["option"],
                "entropy": h,
                "normalize": q.normalize,
                "choices": choices,
            }
        )
    return out


async def _schema(scorer: Scorer, req: BrioRequest, fmt: str) -> dict[str, Any]:
    chosen: list[tuple[str, Any]] = []
    fields = []
    for name, values in req.fields:
        read = schema_read(req.state, req.task, chosen, name)
        continuations = [value_continuation(v) for v in values]
        tokens = fitted_tokens(scorer.model, read, continuations, fmt)
        reads = await scorer.read(continuations, tokens)
        choices, h = _choices(
            [OptionRead(v, r.logprob, r.tokens) for v, r in zip(values, reads, strict=True)],
            req.normalize,
        )
        best = choices[0]
        fields.append(
            {
                "field": name,
                "value": best["option"],
                "p": best["p"],
                "entropy": h,
                "choices": choices,
            }
        )
        chosen.append((name, best["option"]))
    return {"json": dict(chosen), "fields": fields, "normalize": req.normalize}


async def _run(scorer: Scorer, req: BrioRequest, fmt: str) -> dict[str, Any]:
    if req.form == "schema":
        return {"object": "brio.schema", **await _schema(scorer, req, fmt)}
    answers = await _answers(scorer, req.state, list(req.questions), fmt)
    if req.form == "options":
        return {"object": "brio.choice", **answers[0]}
    return {
        "object": "brio.answers",
        "answers": [
            {"question": q.question, **a} for q, a in zip(req.questions, answers, strict=True)
        ],
    }


def _usage(u: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": 0,
        "read_tokens": u.read_tokens,
        "total_tokens": u.prompt_tokens + u.read_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


async def brio(request: Request) -> Response:
    req = parse_brio(await read_json(request))
    model = await model_for(request, req.model, generation=False)
    fmt = prompt_format(model, req.prompt_format)
    affinity = _check_before_admission(model, req, fmt)
    observer = model.observe("brio", request_id(request), request.headers, record_of(request.scope))

    async def work(scorer: Scorer) -> dict[str, Any]:
        return await _run(scorer, req, fmt)

    done = await run_scoring(request, model, observer, req.cache_slot, affinity, work)
    body = {
        **done.value,
        "prompt_format": fmt,
        "id": f"brio-{secrets.token_hex(12)}",
        "created": int(time.time()),
        "model": model.id,
        "usage": _usage(done.usage),
    }
    return Response(orjson.dumps(body), media_type="application/json", headers=done.headers)
