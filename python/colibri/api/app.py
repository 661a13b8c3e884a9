"""The Starlette application: routes, protocol-shaped errors, security middleware."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from colibri.api import anthropic, brio, openai, rank, responses, systemone, web
from colibri.api.access_log import AccessLogMiddleware, note_error
from colibri.api.errors import ApiError, error_response
from colibri.api.http import json_response
from colibri.api.request_id import RequestIdMiddleware
from colibri.api.security import security_middleware
from colibri.observability import CONTENT_TYPE
from colibri.runtime.admission import ClientGone, DeadlineExceeded, client_gone_response
from colibri.runtime.catalog import CatalogEntry
from colibri.runtime.models import ModelSet, single_model
from colibri.runtime.served import ServedModel

log = logging.getLogger("colibri.server")


def _authenticated(request: Request) -> bool:
    return bool(request.scope.get("state", {}).get("authenticated", False))


def _named(request: Request) -> tuple[CatalogEntry, ServedModel | None]:
    """The catalog entry the ``model`` query parameter names (the resolution order of every
    route: 404 unknown, 409 ambiguous), the default one when it is absent, and its loaded
    model (None when it is not loaded: these endpoints never load a model)."""
    catalog: ModelSet = request.app.state.models
    label = request.query_params.get("model")
    entry = catalog.default if label is None else catalog.resolve(label)
    return entry, catalog.loaded(entry.id)


def _loaded(request: Request) -> ServedModel:
    """The loaded model the ``model`` query parameter names (default: the default model); a
    model that is not loaded is 409 ``model_not_loaded`` (it is not loaded for this)."""
    entry, model = _named(request)
    if model is None:
        state = request.app.state.models.state(entry.id)
        raise ApiError(
            409,
            f"The model '{entry.id}' is not loaded ({state}): it has no engine to describe yet; "
            "it loads on its first generation or scoring request (GET /health lists every "
            "model's state)",
            code="model_not_loaded",
            param="model",
        )
    return model


def _overall(catalog: ModelSet, served: ServedModel) -> str:
    """The server's status: ``error`` once the default model's engine has failed (nothing is
    served by default), ``degraded`` while another model is failed (its last load, or its
    engine; the others are served), else ``ok``."""
    if served.generator.dead:
        return "error"
    failed = any(catalog.status(e.id)[0] == "failed" for e in catalog.entries[1:])
    return "degraded" if failed else "ok"


async def health(request: Request) -> Response:
    """Liveness and each model's state. Public: the server's status and, with a catalog, how
    many models are in each state (no model names, paths or messages). For an authenticated
    caller (or when no key is set): the scheduler snapshot of the model ``?model=`` names
    (default: the default model) and, with a catalog, every model's state with the message of a
    failed one. 503 once the default model's engine has failed, or the model named has failed."""
    catalog: ModelSet = request.app.state.models
    served: ServedModel = request.app.state.served
    overall = _overall(catalog, served)
    if not _authenticated(request):  # the query is not read: no catalog names for anyone
        body: dict = {"status": overall}
        if len(catalog.entries) > 1:
            body["models_by_state"] = _by_state(catalog)
        return json_response(body, status=503 if overall == "error" else 200)
    entry, model = _named(request)
    named = request.query_params.get("model") is not None
    if model is None:  # nothing to report but its state: never figures it does not have
        state, error = catalog.status(entry.id)
        body = {"status": "error" if error else "ok", "model": entry.id, "state": state}
        if error:
            body["error"] = error
        return json_response(body, status=503 if error else 200)
    dead = model.generator.dead
    status = "error" if dead else overall if not named or entry is catalog.default else "ok"
    body = {"status": status, "model": model.id, "state": "failed" if dead else "loaded"}
    body.update(model.scheduler.snapshot())
    body["context_length"] = model.engine.info.get("context_length")
    body["kv_bytes_per_token"] = model.engine.info.get("kv_bytes_per_token")
    body["state_bytes_per_slot"] = model.engine.info.get("state_bytes_per_slot", 0)
    body["ram_budget_bytes"] = catalog.budget_bytes
    body["prefill"] = [
        {"slot": slot, "prompt_tokens": total, "prompt_tokens_done": done}
        for slot, done, total in model.generator.prefilling.values()
    ]
    if dead:
        body["error"] = dead
    if len(catalog.entries) > 1:
        body["models"] = [_model_state(catalog, e) for e in catalog.entries]
        body["models_by_state"] = _by_state(catalog)
        body["models_ram_budget_bytes"] = catalog.budget_bytes  # its old name (deprecated)
        body["models_unloaded"] = catalog.unloads
    return json_response(body, status=503 if dead else 200)


def _by_state(catalog: ModelSet) -> dict[str, int]:
    """How many catalog models are in each state (what the public /health says of them)."""
    counts = dict.fromkeys(("loaded", "loading", "cold", "failed"), 0)
    for e in catalog.entries:
        counts[catalog.status(e.id)[0]] += 1
    return counts


def _model_rows(catalog: ModelSet) -> list[tuple[str, str, int]]:
    """Each model's id, state and RAM bytes, as /health says them (for /metrics)."""
    return [(e.id, catalog.status(e.id)[0], catalog.footprint(e)) for e in catalog.entries]


def _model_state(catalog: ModelSet, entry: CatalogEntry) -> dict:
    state, error = catalog.status(entry.id)
    item: dict = {"id": entry.id, "state": state, "ram_bytes": catalog.footprint(entry)}
    if error:
        item["error"] = error
    return item


async def metrics(request: Request) -> Response:
    """Prometheus text exposition 0.0.4 of every model (each series with its ``model`` label;
    the API key middleware guards it like generation)."""
    model: ServedModel = request.app.state.served
    return Response(model.metrics.exposition(), media_type=CONTENT_TYPE)


async def profile(request: Request) -> Response:
    """Where the engine of the model ``?model=`` names (default: the default model) spent its
    last turns (dashboard's profiling and live-routing views). Behind the API key like
    generation."""
    model = _loaded(request)
    engine = model.engine
    return json_response(
        {
            "model": model.id,
            "turns": engine.profiles(),
            "last_routed_experts": engine.last_routed_experts(),
            "expert_cache": engine.store_stats(),
        }
    )


_INFO_FIELDS = (
    "architecture",
    "quantization",
    "matrix_dtypes",
    "hidden_size",
    "num_layers",
    "num_experts",
    "experts_per_token",
    "vocab_size",
    "context_length",
    "model_context_length",
    "kv_dtype",
    "kv_bytes_per_token",
    "state_bytes_per_slot",
    "kernel",
    "kernel_prefetch",
    "kernel_prefetch_decode",
    "kernel_avx_vnni",
    "threads",
    "prefill_chunk",
)


async def info(request: Request) -> Response:
    """What the served model is and how the engine runs it (the dashboard's System page).
    Behind the API key like generation."""
    model = _loaded(request)
    engine = model.engine
    body = {
        "model": model.id,
        "chat_family": model.family.name,
        "chat_template": model.template_origin,
    }
    body.update({name: engine.info.get(name) for name in _INFO_FIELDS})
    body["kv_slots"] = model.config.kv_slots
    body["expert_cache"] = engine.store_stats()
    return json_response(body)


async def experts(request: Request) -> Response:
    """The routing map (the dashboard's Brain page): per MoE layer, how often the router chose
    each expert (the engine's routing heat), the experts of the last generation and where each
    expert is now (pinned, RAM cache, disk, or resident). Behind the API key like generation.
    ``?model=``: as for the profile."""
    model = _loaded(request)
    engine = model.engine
    heat = engine.routing_heat()
    routed = engine.last_routed_experts()
    tiers = engine.expert_tiers()
    layers = [
        {
            "layer": int(entry["layer"]),
            "counts": [int(c) for c in entry["counts"]],
            "routed": sorted(routed[entry["layer"]]) if entry["layer"] < len(routed) else [],
            "tiers": tiers.get(int(entry["layer"]), ""),
        }
        for entry in heat.get("layers", [])
    ]
    snap = model.scheduler.snapshot()
    return json_response(
        {
            "model": model.id,
            "experts": int(heat.get("experts", 0)),
            "layers": layers,
            "placement": "resident" if engine.store_stats() is None else "cached",
            # Admitted generations that have ended: a new value, a new last turn.
            "turns": snap["admitted"] - snap["active"],
        }
    )


async def _client_gone(request: Request, exc: Exception) -> Response:
    note_error(request.scope, ApiError(499, "client gone", code="client_gone"))
    return client_gone_response()


async def _deadline_exceeded(request: Request, exc: Exception) -> Response:
    """504 for a request not streamed whose answer outlasted --request-timeout (seed 003):
    its generation was cancelled (slot given back), and a retry would take as long, so the
    SDKs are told not to retry."""
    assert isinstance(exc, DeadlineExceeded)
    deadline = exc.deadline
    served: ServedModel = request.app.state.served
    served.metrics.hub.request_timeouts.labels(model=deadline.model).inc()
    err = ApiError(
        504,
        f"The model '{deadline.model}' did not finish this request within "
        f"{deadline.limit:g} s (--request-timeout) and it was stopped; a retry would take as "
        'long: send it with "stream": true, or ask for fewer tokens',
        code="request_timeout",
        headers={"x-should-retry": "false"},
    )
    note_error(request.scope, err)
    return error_response(request.url.path, err)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    note_error(request.scope, exc)
    return error_response(request.url.path, exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = {
        404: f"No route {request.method} {request.url.path}; see docs/API.md",
        405: f"Method {request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    err = ApiError(exc.status_code, message, code=code)
    note_error(request.scope, err)
    return error_response(request.url.path, err)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    err = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
    note_error(request.scope, err)
    return error_response(request.url.path, err)


class InternalErrorMiddleware:
    """The 500 for an exception escaping a route, answered inside the middleware stack.

    Starlette's handler for ``Exception`` runs outside every middleware, so its response would
    miss the CORS headers (a browser client would see a CORS failure instead of the error).
    Innermost, this answers first; once a response has started it can only re-raise.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_tracked)
        except Exception as exc:
            if started:
                raise
            response = await _unexpected(Request(scope), exc)
            await response(scope, receive, send)


def create_app(served: ServedModel, models: ModelSet | None = None) -> ASGIApp:
    """The ASGI app: the Starlette routes inside the access log (unless ``--quiet``), inside the
    request-id layer (outermost, so even a response from Starlette's last-resort error handler
    carries an id, and every access-log line has one). ``served``: the default model (health,
    metrics, the dashboard's pages); ``models``: the catalog (default: ``served`` alone)."""
    app: ASGIApp = _starlette_app(served, models or single_model(served))
    if served.config.access_log:
        app = AccessLogMiddleware(app, served.config.log_format)
    return RequestIdMiddleware(app)


def _starlette_app(served: ServedModel, models: ModelSet) -> Starlette:
    config = served.config
    served.metrics.hub.model_states = lambda: _model_rows(models)
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/v1/colibri/profile", profile, methods=["GET"]),
        Route("/v1/colibri/info", info, methods=["GET"]),
        Route("/v1/colibri/experts", experts, methods=["GET"]),
        Route("/v1/models", openai.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", openai.get_model, methods=["GET"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
        Route("/v1/responses", responses.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.get_response, methods=["GET"]),
        Route("/v1/brio", brio.brio, methods=["POST"]),
        Route("/v1/systemone", systemone.systemone, methods=["POST"]),
        Route("/v1/rank", rank.rank, methods=["POST"]),
        *web.routes(),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        models.close()  # waiters get a clear 503 instead of hanging at shutdown

    app = Starlette(
        lifespan=lifespan,
        routes=routes,
        middleware=[
            *security_middleware(
                api_key=config.api_key,
                allowed_hosts=config.allowed_hosts,
                cors_origins=config.cors_origins,
            ),
            Middleware(InternalErrorMiddleware),
        ],
        exception_handlers={
            ApiError: _api_error,
            ClientGone: _client_gone,
            DeadlineExceeded: _deadline_exceeded,
            HTTPException: _http_error,
            Exception: _unexpected,
        },
    )
    app.state.served = served
    app.state.models = models
    app.state.responses = responses.ResponseStore()
    return app
