"""The served models of a catalog: which entries are loaded, and loading one on first use.

Each entry gets its own engine, KV slots, scheduler and slot files (a ServedModel) the first
time a request names it; the default entry (and pinned ones) are loaded at startup. A load
runs in a worker thread, so the server keeps answering meanwhile; requests for a model being
loaded wait for that one load, at most the ready timeout: then 503 ``no_warm_replica`` with
``Retry-After`` = the rest of the predicted load time (runtime/loadtime.py), and the load goes
on. A load that fails is a 503 ``model_load_failed`` naming the problem, and the model is
``failed`` (with that message) in /health until the next request tries again; the other models
are served as before.

With the RAM budget (``--ram-gb``, runtime/budget.py), a load first makes room: the models used
longest ago are unloaded until the new one fits, never the default entry, a pinned one, or one
that is generating or about to (a held slot, a queued request, a request between resolution and
admission). While no model can make room the load waits, and a request that times out meanwhile
gets 503 ``resident_capacity_full``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from colibri.errors import ApiError
from colibri.runtime.catalog import CatalogEntry, make_entry, resolve
from colibri.runtime.loadtime import LoadTimes
from colibri.runtime.served import ServedModel

log = logging.getLogger("colibri.server")

Loader = Callable[[CatalogEntry], ServedModel]
# The RAM a model takes (when loaded: measured, else estimated from its files).
Footprint = Callable[[CatalogEntry, ServedModel | None], int]
# Retry-After while a load waits for room (models busy): a few seconds.
BUSY_RETRY_S = 2

# A stream's wait for its model (seed 003): 20 minutes when it named an id, an alias or a
# readable name; for the model's own name 1.25x the worst measured load, at least 2 minutes.
STREAM_CEILING_S = 1200.0
OWN_NAME_FLOOR_S = 120.0


def _load_delay() -> float:
    """``COLI_LOAD_DELAY_S``: seconds every load on first use waits before it starts (a test
    hook: a slow load on a small model)."""
    try:
        return max(0.0, float(os.environ.get("COLI_LOAD_DELAY_S", "0")))
    except ValueError:
        return 0.0


class ModelSet:
    def __init__(
        self,
        entries: Sequence[CatalogEntry],
        loader: Loader,
        loaded: dict[str, ServedModel],
        context: int | None = None,
        ready_timeout: float = 300.0,
        state_dir: Callable[[CatalogEntry], Path | None] = lambda entry: None,
        budget_bytes: int | None = None,
        footprint: Footprint | None = None,
        request_timeout: float | None = None,
        refusal: Callable[[CatalogEntry], str | None] | None = None,
    ) -> None:
        """``entries``: the catalog, the default entry first; ``loaded``: the models already
        loaded at startup, by id; ``context``: ``--context`` (what a cold start asks for);
        ``ready_timeout``: how long a non-streamed request waits for its model;
        ``state_dir``: where an entry's load times are kept (its KV directory);
        ``budget_bytes``: the RAM every loaded model may take together (None: no limit), each
        one's ``footprint``; ``request_timeout``: seconds a request that is not streamed may
        take from its arrival to its answer (None: no limit; api/loading.py); ``refusal``: why
        an entry can never fit the budget, in the budget's words (None: it can; the check by
        footprints below still applies)."""
        self.entries = tuple(entries)
        self.default = self.entries[0]
        self._loader = loader
        self._loaded = dict(loaded)
        self._loading: dict[str, asyncio.Future[ServedModel]] = {}
        self._started: dict[str, float] = {}
        self._times = {e.id: LoadTimes(state_dir(e)) for e in self.entries}
        self.context = context
        self.ready_timeout = ready_timeout
        self.request_timeout = request_timeout
        self._delay = _load_delay()
        self.budget_bytes = budget_bytes
        self._footprint = footprint or (lambda entry, model: 0)
        self._refusal = refusal or (lambda entry: None)
        self._last_used = {entry_id: time.monotonic() for entry_id in self._loaded}
        self._holds: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._waiting_room: set[str] = set()
        # The message of each entry's last failed load (cleared when a load starts again).
        self._failed: dict[str, str] = {}
        self.unloads = 0

    def resolve(self, label: str) -> CatalogEntry:
        return resolve(self.entries, label)

    def loaded(self, entry_id: str) -> ServedModel | None:
        return self._loaded.get(entry_id)

    def state(self, entry_id: str) -> str:
        """``loaded``, ``loading``, ``failed`` (its last load failed; the next request tries
        again) or ``cold``."""
        if entry_id in self._loaded:
            return "loaded"
        if entry_id in self._loading:
            return "loading"
        return "failed" if entry_id in self._failed else "cold"

    def status(self, entry_id: str) -> tuple[str, str | None]:
        """What /health says of a model: its ``state``, with ``failed`` also for a loaded model
        whose engine has failed, and the error message of a failed one."""
        model = self._loaded.get(entry_id)
        if model is not None:
            dead = model.generator.dead
            return ("failed", f"the engine failed: {dead}") if dead else ("loaded", None)
        state = self.state(entry_id)
        return state, self._failed.get(entry_id) if state == "failed" else None

    def measured(self, entry_id: str) -> list[float]:
        """The measured load times of ``entry_id``, oldest first (the last few)."""
        return list(self._times[entry_id].seconds)

    def footprint(self, entry: CatalogEntry) -> int:
        return self._footprint(entry, self._loaded.get(entry.id))

    def ready(self, entry: CatalogEntry) -> ServedModel | None:
        """The loaded model of ``entry`` (now its most recent use), or None."""
        model = self._loaded.get(entry.id)
        if model is not None:
            self._last_used[entry.id] = time.monotonic()
        return model

    @contextlib.contextmanager
    def hold(self, entry_id: str) -> Iterator[None]:
        """While held, the model is not unloaded (a request between resolution and admission;
        once admitted, its slot keeps it)."""
        self._holds[entry_id] = self._holds.get(entry_id, 0) + 1
        try:
            yield
        finally:
            self._holds[entry_id] -= 1

    def start(self, entry: CatalogEntry) -> asyncio.Future[ServedModel]:
        """The load of ``entry``: the one in progress, else a new one."""
        pending = self._loading.get(entry.id)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = loop.create_future()
            self._loading[entry.id] = pending
            self._failed.pop(entry.id, None)
            self._started[entry.id] = time.monotonic()
            loop.create_task(self._load(entry, pending))
        return pending

    async def get(self, entry: CatalogEntry, timeout: float | None = None) -> ServedModel:
        """The served model of ``entry``, loading it first if it is not loaded; waiting at most
        ``timeout`` seconds (None: the ready timeout) for a load, then 503 ``no_warm_replica``
        with ``Retry-After``. A client gone while its model loads does not stop the load."""
        model = self.ready(entry)
        if model is not None:
            return model
        pending = self.start(entry)
        limit = self.ready_timeout if timeout is None else timeout
        # asyncio.wait never cancels what it waits for: the load goes on past the timeout.
        done, _ = await asyncio.wait({pending}, timeout=limit)
        if done or (pending.done() and pending.exception() is not None):
            return pending.result()
        raise self.not_ready(entry, limit)

    def not_ready(self, entry: CatalogEntry, waited: float) -> ApiError:
        """503 for a request that waited ``waited`` s for ``entry``: ``no_warm_replica`` while
        it loads, ``resident_capacity_full`` while its load waits for busy models to finish."""
        if entry.id in self._waiting_room:
            return ApiError(
                503,
                f"The model '{entry.id}' was not ready within {waited:g} s: the RAM budget is "
                "taken by models that are generating; retry after Retry-After seconds",
                code="resident_capacity_full",
                headers={"Retry-After": str(BUSY_RETRY_S)},
            )
        retry = self.retry_after(entry)
        return ApiError(
            503,
            f"The model '{entry.id}' was not ready within {waited:g} s: it is loading (about "
            f"{retry} s more); retry after Retry-After seconds, or send the request with "
            '"stream": true to wait for it',
            code="no_warm_replica",
            headers={"Retry-After": str(retry)},
        )

    def retry_after(self, entry: CatalogEntry) -> int:
        """Seconds until ``entry`` should be ready: the rest of its predicted load time counted
        from when the load started, at least 1; 0 when it is loaded (it came up just now)."""
        if entry.id in self._loaded:
            return 0
        predicted = self._times[entry.id].predict(entry.path) + self._delay
        started = self._started.get(entry.id, time.monotonic())
        return max(1, math.ceil(predicted - (time.monotonic() - started)))

    def stream_ceiling(self, entry: CatalogEntry, label: str) -> float:
        """How long a stream may wait for ``entry`` to load when it named it ``label``."""
        if label == entry.id or label != entry.model_name:
            return STREAM_CEILING_S
        worst = self._times[entry.id].worst()
        return max(OWN_NAME_FLOOR_S, 1.25 * worst) if worst is not None else OWN_NAME_FLOOR_S

    def _idle(self, entry_id: str) -> bool:
        snap = self._loaded[entry_id].scheduler.snapshot()
        return snap["active"] == 0 and snap["queued"] == 0 and not self._holds.get(entry_id)

    def _kept(self, entry: CatalogEntry) -> bool:
        """Never unloaded: the default entry (health, metrics and the dashboard read it) and
        pinned ones."""
        return entry.pinned or entry is self.default

    def _used_bytes(self) -> int:
        loaded = sum(self.footprint(e) for e in self.entries if e.id in self._loaded)
        return loaded + sum(self._reserved.values())

    async def _make_room(self, entry: CatalogEntry) -> None:
        """Unloads the idle models used longest ago until ``entry`` fits the budget; waits
        while the only ones that could go are busy. Refuses a model that can never fit."""
        if self.budget_bytes is None:
            return
        reason = self._refusal(entry)
        if reason is not None:
            raise ValueError(reason)
        need = self.footprint(entry)
        kept = sum(self.footprint(e) for e in self.entries if self._kept(e) and e.id != entry.id)
        if kept + need > self.budget_bytes:
            raise ValueError(
                f"it needs about {need / 1e9:.3f} GB and the models never unloaded (the default "
                f"and pinned ones) take {kept / 1e9:.3f} GB of the {self.budget_bytes / 1e9:.3f} "
                "GB of --ram-gb"
            )
        try:
            while self._used_bytes() + need > self.budget_bytes:
                idle = [
                    e
                    for e in self.entries
                    if e.id in self._loaded and not self._kept(e) and self._idle(e.id)
                ]
                if idle:
                    self._unload(min(idle, key=lambda e: self._last_used.get(e.id, 0.0)))
                    continue
                self._waiting_room.add(entry.id)
                await asyncio.sleep(0.05)
        finally:
            self._waiting_room.discard(entry.id)
        self._reserved[entry.id] = need

    def _unload(self, entry: CatalogEntry) -> None:
        model = self._loaded.pop(entry.id)
        log.info("unloading model %s (used longest ago) to make room", entry.id)
        model.scheduler.close()
        model.generator.close()
        model.metrics.detach()  # its gauges go; its counters go on when it loads again
        del model
        gc.collect()  # the engine's memory and slot-file locks go now, not at some later time
        self.unloads += 1

    def _load_now(self, entry: CatalogEntry) -> ServedModel:
        if self._delay:
            time.sleep(self._delay)
        t0 = time.monotonic()
        model = self._loader(entry)
        self._times[entry.id].record(time.monotonic() - t0)
        return model

    async def _load(self, entry: CatalogEntry, done: asyncio.Future[ServedModel]) -> None:
        log.info("loading model %s from %s", entry.id, entry.path)
        try:
            await self._make_room(entry)
            model = await asyncio.to_thread(self._load_now, entry)
        except Exception as e:  # any load failure: the requests get a 503 naming it
            log.warning("model %s failed to load: %s", entry.id, e)
            message = f"The model '{entry.id}' ({entry.path}) failed to load: {e}"
            self._failed[entry.id] = message
            done.set_exception(ApiError(503, message, code="model_load_failed"))
            done.exception()  # retrieved: no "never retrieved" warning when nobody waits
        else:
            self._loaded[entry.id] = model
            self._last_used[entry.id] = time.monotonic()
            done.set_result(model)
        finally:
            self._loading.pop(entry.id, None)
            self._reserved.pop(entry.id, None)

    def close(self) -> None:
        """Waiters of every loaded model get a clear 503 instead of hanging at shutdown."""
        for model in self._loaded.values():
            model.scheduler.close()


def single_model(served: ServedModel) -> ModelSet:
    """The catalog of a server with one model, loaded: ``served`` under its id, its
    directory's name and its aliases."""
    entry = make_entry(served.engine.path, id=served.id, aliases=served.config.aliases)
    return ModelSet([entry], _no_loader, {entry.id: served})


def _no_loader(entry: CatalogEntry) -> ServedModel:
    raise RuntimeError(f"no loader for {entry.id}")
