"""Prometheus metrics and OpenTelemetry traces.

Metrics: scheduler gauges and counters are read from the scheduler's own numbers at scrape time
(collection never touches a slot); the expert store's counters (read busy time, I/O wait) are
read from the engine at scrape time, one short look under the store's lock; histograms and the
other engine figures are observed as requests run. Labels never carry prompts, paths or request
ids.

Traces: one span per request with children for admission, render, prefill and decode, exported
over OTLP when the standard ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``…_TRACES_ENDPOINT``) is set;
otherwise the no-op tracer, whose spans cost next to nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from colibri.runtime.scheduler import Scheduler

BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# W3C trace context (`traceparent`, `tracestate`) of incoming requests.
_TRACE_CONTEXT = TraceContextTextMapPropagator()

_GAUGES = {
    "active": "Requests admitted to a KV slot and not finished",
    "queued": "Requests waiting for a KV slot",
    "capacity": "KV slots",
    "max_active": "Requests that may hold a KV slot at once (they step together)",
    "max_queue": "Limit of waiting requests",
}
_COUNTERS = {
    "admitted": "Requests admitted to a KV slot",
    "completed": "Admitted requests that returned normally",
    "failed": "Admitted requests that raised an error (cancellations excluded)",
    "rejected": "Requests refused because the queue was full",
    "timed_out": "Requests that waited longer than the queue timeout",
    "cancelled": "Requests whose client went away, before admission or while generating",
}

# The expert store's counters (Engine.store_stats()), read at scrape time: metric name ->
# (field, help). 0 for a model whose experts are all resident (it never reads them).
_STORE_COUNTERS = {
    "colibri_engine_expert_read_busy_seconds": (
        "read_busy_s",
        "Read busy time: wall-clock seconds during which at least one expert read from disk was "
        "in flight (overlapping reads count once)",
    ),
    "colibri_engine_expert_io_wait_seconds": (
        "io_wait_s",
        "Seconds the engine's compute stood blocked waiting for expert reads; read busy time "
        "minus this is the reading overlapped with compute",
    ),
}

StoreStats = Callable[[], Mapping[str, Any] | None]

# Every catalog model now: (id, state, RAM bytes), as /health's `models` says them.
ModelStates = Callable[[], Iterable[tuple[str, str, int]]]
MODEL_STATES = ("loaded", "loading", "cold", "failed")


class _SchedulerCollector(Collector):
    """The scheduler figures of every model, read at scrape time: one family per name, one
    sample per model (``model`` label). A model's counters go on through its unloads and
    reloads (what its earlier schedulers counted is carried); its gauges are there while it is
    loaded."""

    def __init__(self, hub: MetricsHub) -> None:
        self._hub = hub

    def collect(self) -> Iterator[Any]:
        attached = {m: s.snapshot() for m, s in self._hub.schedulers().items()}
        carried = self._hub.carried()
        for name, doc in _GAUGES.items():
            family = GaugeMetricFamily(f"colibri_scheduler_{name}", doc, labels=["model"])
            for model, snap in attached.items():
                family.add_metric([model], snap[name])
            yield family
        models = [*attached, *(m for m in carried if m not in attached)]
        for name, doc in _COUNTERS.items():
            family = CounterMetricFamily(f"colibri_scheduler_{name}", doc, labels=["model"])
            for model in models:
                value = carried.get(model, {}).get(name, 0)
                family.add_metric([model], value + attached.get(model, {}).get(name, 0))
            yield family

    def describe(self) -> Iterator[Any]:
        return iter(())  # nothing to check at registration; collect() is cheap anyway


def _store_counters(stats: StoreStats | None) -> dict[str, float]:
    """The store counters of one engine now (zeros without an expert cache)."""
    got = (stats() if stats is not None else None) or {}
    return {name: float(got.get(field, 0.0)) for name, (field, _) in _STORE_COUNTERS.items()}


class _StoreCollector(Collector):
    """The expert store's counters of every model, read from its engine at scrape time (one
    short look under the store's lock, as /health takes). What an unloaded engine counted is
    carried, so a model's counters go on through unloads and reloads."""

    def __init__(self, hub: MetricsHub) -> None:
        self._hub = hub

    def collect(self) -> Iterator[Any]:
        now = {m: _store_counters(stats) for m, stats in self._hub.store_sources().items()}
        carried = self._hub.carried_store()
        models = [*now, *(m for m in carried if m not in now)]
        for name, (_, doc) in _STORE_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["model"])
            for model in models:
                value = carried.get(model, {}).get(name, 0.0) + now.get(model, {}).get(name, 0.0)
                family.add_metric([model], value)
            yield family

    def describe(self) -> Iterator[Any]:
        return iter(())


class _ModelCollector(Collector):
    """Each catalog model's state and RAM, read at scrape time from what /health reads: a
    series for every model of the catalog (cold ones too), also while it is not loaded."""

    def __init__(self, hub: MetricsHub) -> None:
        self._hub = hub

    def collect(self) -> Iterator[Any]:
        source = self._hub.model_states
        if source is None:
            return
        rows = list(source())
        state = GaugeMetricFamily(
            "colibri_model_state",
            "1 for the model's state, 0 for the three others (loaded, loading, cold, or failed: "
            "its last load or its engine failed)",
            labels=["model", "state"],
        )
        ram = GaugeMetricFamily(
            "colibri_model_ram_bytes",
            "What the model counts against --ram-gb while loaded (its fixed part and expert "
            "cache), as /health's ram_bytes",
            labels=["model"],
        )
        for model, now, ram_bytes in rows:
            for name in MODEL_STATES:
                state.add_metric([model, name], 1.0 if name == now else 0.0)
            ram.add_metric([model], float(ram_bytes))
        yield state
        yield ram

    def describe(self) -> Iterator[Any]:
        return iter(())


class MetricsHub:
    """The server's one Prometheus registry. Every metric carries a ``model`` label (the
    model's id), also with a single model, so a family's series always have the same label
    names (Prometheus' rule) and a query keeps working when models are added. Each served
    model observes through its own :class:`Metrics` (:meth:`attach`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._schedulers: dict[str, Scheduler] = {}
        self._carried: dict[str, dict[str, int]] = {}
        self._stores: dict[str, StoreStats | None] = {}
        self._carried_store: dict[str, dict[str, float]] = {}
        self.registry.register(_SchedulerCollector(self))
        self.registry.register(_StoreCollector(self))
        self.registry.register(_ModelCollector(self))
        # Set by the app (`watch_models`): the catalog's states for colibri_model_*.
        self.model_states: ModelStates | None = None
        r = self.registry
        model = ["model"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(f"colibri_scheduler_{name}", doc, model, buckets=BUCKETS, registry=r)

        self.queue_wait = hist("queue_wait_seconds", "Wait until admission (admitted requests)")
        self.slot_duration = hist("slot_duration_seconds", "Slot occupancy until release")
        self.first_output = hist(
            "first_output_seconds", "Engine-call start to the first non-empty text or tool output"
        )
        self.engine_call = hist("engine_call_seconds", "Duration of each finished engine call")
        self.prompt_tokens = Counter(
            "colibri_engine_prompt_tokens",
            "Prompt tokens the engine prefilled (reused KV not counted)",
            model,
            registry=r,
        )
        self.generated_tokens = Counter(
            "colibri_engine_generated_tokens", "Tokens the engine generated", model, registry=r
        )
        self.prefill_rate = Gauge(
            "colibri_engine_last_prefill_tokens_per_second",
            "Prefill speed of the last engine call",
            model,
            registry=r,
        )
        self.decode_rate = Gauge(
            "colibri_engine_last_decode_tokens_per_second",
            "Decode speed of the last engine call",
            model,
            registry=r,
        )
        self.batch_size = Histogram(
            "colibri_engine_batch_size",
            "Generations run together in each batched engine step",
            model,
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
            registry=r,
        )
        self.request_timeouts = Counter(
            "colibri_request_timeouts",
            "Requests not streamed cut at --request-timeout (504, or 503 while still queued)",
            model,
            registry=r,
        )
        per_slot = ["model", "slot"]
        self.kv_tokens = Gauge(
            "colibri_engine_kv_tokens", "Tokens in each KV slot's context", per_slot, registry=r
        )
        self.kv_bytes_per_token = Gauge(
            "colibri_engine_kv_bytes_per_token",
            "KV memory per token of context",
            model,
            registry=r,
        )
        self.state_bytes_per_slot = Gauge(
            "colibri_engine_state_bytes_per_slot",
            "Fixed-size state per KV slot (linear attention, DeepSeek-V4's windows; 0 without), "
            "one copy",
            model,
            registry=r,
        )
        self.prefill_done = Gauge(
            "colibri_engine_prefill_tokens_done",
            "Prompt tokens with KV so far in the slot's prefill in progress (0: none)",
            per_slot,
            registry=r,
        )
        self.prefill_total = Gauge(
            "colibri_engine_prefill_tokens",
            "Prompt tokens of the slot's prefill in progress (0: none)",
            per_slot,
            registry=r,
        )

    def attach(
        self, model: str, scheduler: Scheduler, store_stats: StoreStats | None = None
    ) -> Metrics:
        """The metrics of the model ``model`` (its id) scheduled by ``scheduler``, whose engine's
        expert-store counters ``store_stats`` gives (``Engine.store_stats``; None: no engine,
        zeros): its series appear now; a model loaded again continues its counters and
        histograms."""
        self.detach(model)
        self._schedulers[model] = scheduler
        self._stores[model] = store_stats
        view = Metrics(scheduler, model, self)
        for slot in range(scheduler.capacity):
            for gauge in (self.kv_tokens, self.prefill_done, self.prefill_total):
                gauge.labels(model=model, slot=str(slot)).set(0)
        return view

    def detach(self, model: str) -> None:
        """``model`` was unloaded: its gauges go (they described an engine that is gone), its
        scheduler's counters are carried for the next load, counters and histograms stay."""
        scheduler = self._schedulers.pop(model, None)
        if scheduler is None:
            return
        kept_store = self._carried_store.setdefault(model, {})
        for name, value in _store_counters(self._stores.pop(model, None)).items():
            kept_store[name] = kept_store.get(name, 0.0) + value
        snap = scheduler.snapshot()
        kept = self._carried.setdefault(model, {})
        for name in _COUNTERS:
            kept[name] = kept.get(name, 0) + snap[name]
        for slot in range(scheduler.capacity):
            for gauge in (self.kv_tokens, self.prefill_done, self.prefill_total):
                with contextlib.suppress(KeyError):
                    gauge.remove(model, str(slot))
        for gauge in (
            self.prefill_rate,
            self.decode_rate,
            self.kv_bytes_per_token,
            self.state_bytes_per_slot,
        ):
            with contextlib.suppress(KeyError):
                gauge.remove(model)

    def schedulers(self) -> dict[str, Scheduler]:
        return dict(self._schedulers)

    def carried(self) -> dict[str, dict[str, int]]:
        return {model: dict(counts) for model, counts in self._carried.items()}

    def store_sources(self) -> dict[str, StoreStats | None]:
        return dict(self._stores)

    def carried_store(self) -> dict[str, dict[str, float]]:
        return {model: dict(counts) for model, counts in self._carried_store.items()}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _PerSlot:
    """A per-slot gauge of one model: ``.labels(slot=...)`` as on the gauge itself."""

    def __init__(self, gauge: Gauge, model: str) -> None:
        self._gauge = gauge
        self._model = model

    def labels(self, slot: str) -> Gauge:
        return self._gauge.labels(model=self._model, slot=slot)


class Metrics:
    """What one served model observes: the hub's metrics with its ``model`` label bound.
    ``hub``: the server's (None: a registry of this model's own, for a server of one model or
    a test, reading the engine's expert-store counters from ``store_stats``)."""

    def __init__(
        self,
        scheduler: Scheduler,
        model: str = "model",
        hub: MetricsHub | None = None,
        store_stats: StoreStats | None = None,
    ):
        if hub is None:
            hub = MetricsHub()
            hub.attach(model, scheduler, store_stats)
        self.hub = hub
        self.model = model
        bound = {"model": model}
        self.queue_wait = hub.queue_wait.labels(**bound)
        self.slot_duration = hub.slot_duration.labels(**bound)
        self.first_output = hub.first_output.labels(**bound)
        self.engine_call = hub.engine_call.labels(**bound)
        self.prompt_tokens = hub.prompt_tokens.labels(**bound)
        self.generated_tokens = hub.generated_tokens.labels(**bound)
        self.prefill_rate = hub.prefill_rate.labels(**bound)
        self.decode_rate = hub.decode_rate.labels(**bound)
        self.batch_size = hub.batch_size.labels(**bound)
        self.kv_bytes_per_token = hub.kv_bytes_per_token.labels(**bound)
        self.state_bytes_per_slot = hub.state_bytes_per_slot.labels(**bound)
        self.request_timeouts = hub.request_timeouts.labels(**bound)
        self.kv_tokens = _PerSlot(hub.kv_tokens, model)
        self.prefill_done = _PerSlot(hub.prefill_done, model)
        self.prefill_total = _PerSlot(hub.prefill_total, model)

    def detach(self) -> None:
        """The model was unloaded (see :meth:`MetricsHub.detach`)."""
        self.hub.detach(self.model)

    def exposition(self) -> bytes:
        """The whole server's metrics (every model's)."""
        return self.hub.exposition()


def make_tracer(exporter: Any | None = None) -> Tracer:
    """The OTLP-exporting tracer when OTEL env vars (or ``exporter``) say so, else a no-op one."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if exporter is None and not endpoint:
        return trace.NoOpTracer()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(
        resource=Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "colibri")})
    )
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("colibri")


@dataclass
class AccessRecord:
    """What the access log says about one request beyond its method, path, status and
    duration: filled as the request runs (by the error handlers and the RequestObserver) and
    written once the response has finished (api/access_log.py). Never the prompt, the output,
    an error's message or a key."""

    request_id: str | None = None
    model: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    queue_wait_ms: float | None = None
    finish_reason: str | None = None
    # For a refusal or an error response: the ApiError's stable ``code`` and ``param``.
    code: str | None = None
    param: str | None = None


class RequestObserver:
    """Spans and metric observations of one generation request."""

    def __init__(
        self,
        tracer: Tracer,
        metrics: Metrics,
        name: str,
        model: str,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        record: AccessRecord | None = None,
    ) -> None:
        """``headers``: the request's, so a W3C ``traceparent`` from the caller makes this
        request's spans part of the caller's trace (ignored when absent or malformed).
        ``record``: the request's access-log record, filled with the model, token counts,
        queue wait and finish reason (none: nothing recorded)."""
        self._tracer = tracer
        self._metrics = metrics
        self._record = record
        if record is not None:
            record.model = model
        attributes = {"colibri.model": model}
        if request_id is not None:
            attributes["colibri.request_id"] = request_id  # spans only, never metric labels
        parent = _TRACE_CONTEXT.extract(headers) if headers is not None else None
        self.root: Span = tracer.start_span(name, context=parent, attributes=attributes)
        self._ctx = trace.set_span_in_context(self.root)
        self._engine_start = 0.0
        self._first_token: float | None = None
        self._first_output = False
        self._prefill: Span | None = None
        self._decode: Span | None = None
        self._prompt_tokens = 0
        self._prefilled = 0
        self._slot = 0
        self._engine_finished = False

    @contextmanager
    def span(self, name: str, **attributes: Any) -> Iterator[Span]:
        span = self._tracer.start_span(name, context=self._ctx, attributes=attributes)
        try:
            yield span
        finally:
            span.end()

    def admitted(self, slot: int, wait_s: float) -> None:
        self._slot = slot
        self.root.set_attribute("colibri.slot", slot)
        self.root.set_attribute("colibri.queue_wait_ms", round(wait_s * 1e3, 3))
        self._metrics.queue_wait.observe(wait_s)
        if self._record is not None:
            self._record.queue_wait_ms = round(wait_s * 1e3, 1)

    def engine_started(self, prompt_tokens: int) -> None:
        self._engine_start = time.perf_counter()
        self._prompt_tokens = prompt_tokens
        self.root.set_attribute("colibri.prompt_tokens", prompt_tokens)
        if self._record is not None:
            self._record.prompt_tokens = prompt_tokens
        self._prefill = self._tracer.start_span(
            "prefill", context=self._ctx, attributes={"colibri.prompt_tokens": prompt_tokens}
        )

    def prefill_progress(self, done: int, total: int) -> None:
        """A part of the prompt's prefill is done (``done`` of ``total`` tokens have KV)."""
        self._metrics.prefill_done.labels(slot=str(self._slot)).set(done)
        self._metrics.prefill_total.labels(slot=str(self._slot)).set(total)
        if self._prefill is not None:
            self._prefill.add_event("progress", {"colibri.prompt_tokens_done": done})

    def _prefill_ended(self) -> None:
        self._metrics.prefill_done.labels(slot=str(self._slot)).set(0)
        self._metrics.prefill_total.labels(slot=str(self._slot)).set(0)

    def token(self, reused: int = 0) -> None:
        """A generated token; ``reused`` (known at the first one): prompt tokens taken from the
        slot's history, which were not prefilled."""
        if self._first_token is None:
            self._prefill_ended()
            self._first_token = time.perf_counter()
            self._prompt_done(reused)
            if self._prefill is not None:
                self._prefill.end()
            self._decode = self._tracer.start_span("decode", context=self._ctx)
        self._metrics.generated_tokens.inc()

    def output(self) -> None:
        """A non-empty piece of text or a tool call reached the response."""
        if not self._first_output:
            self._first_output = True
            self._metrics.first_output.observe(time.perf_counter() - self._engine_start)

    def engine_finished(self, reason: str, completion_tokens: int, error: str | None) -> None:
        self._engine_finished = True
        end = time.perf_counter()
        self._prefill_ended()
        self._metrics.engine_call.observe(end - self._engine_start)
        self._metrics.kv_tokens.labels(slot=str(self._slot)).set(
            self._prompt_tokens + completion_tokens
        )
        if self._first_token is not None:
            prefill_s = self._first_token - self._engine_start
            if prefill_s > 0:
                self._metrics.prefill_rate.set(self._prefilled / prefill_s)
            if completion_tokens > 1 and end > self._first_token:
                self._metrics.decode_rate.set((completion_tokens - 1) / (end - self._first_token))
        for span in (self._prefill, self._decode):
            if span is not None and span.is_recording():
                span.end()
        self.root.set_attribute("colibri.completion_tokens", completion_tokens)
        self.root.set_attribute("colibri.finish_reason", reason)
        if self._record is not None:
            self._record.completion_tokens = completion_tokens
            self._record.finish_reason = reason
        if error is not None:
            self.root.set_status(Status(StatusCode.ERROR, error))

    def scored(self, reused: int, reason: str, error: str | None) -> None:
        """A scoring engine call ended (``reason`` "scored", "cancelled" or "error"): its
        context's prefill counted like a prompt's, the call's duration observed."""
        self._prompt_done(reused)
        self.engine_finished(reason, 0, error)

    def _prompt_done(self, reused: int) -> None:
        """The prompt is in the slot: ``reused`` of its tokens came from the slot's history,
        the rest were prefilled."""
        self._prefilled = self._prompt_tokens - reused
        self._metrics.prompt_tokens.inc(self._prefilled)
        self.root.set_attribute("colibri.cached_tokens", reused)
        if self._record is not None:
            self._record.cached_tokens = reused
        if self._prefill is not None:
            self._prefill.set_attribute("colibri.prefilled_tokens", self._prefilled)

    def end(self, outcome: str | None = None) -> None:
        """Ends the request's trace. ``outcome`` "cancelled" (the client went away) is the
        finish reason when the engine never reported one: a stream dropped before its first
        engine step still logs why it ended."""
        if outcome == "cancelled" and not self._engine_finished:
            self.root.set_attribute("colibri.finish_reason", outcome)
            if self._record is not None:
                self._record.finish_reason = outcome
        self.root.end()
