"""The served models of a catalog: which entries are loaded, and loading one on first use.

Each entry gets its own engine, KV slots, scheduler and slot files (a ServedModel) the first
time a request names it; the default entry (and pinned ones) are loaded at startup. A load
runs in a worker thread, so the server keeps answering meanwhile; requests for a model being
loaded wait for that one load. A load that fails is a 503 ``model_load_failed`` naming the
problem, and the next request tries again; the other models are served as before.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from colibri.errors import ApiError
from colibri.runtime.catalog import CatalogEntry, make_entry, resolve
from colibri.runtime.served import ServedModel

log = logging.getLogger("colibri.server")

Loader = Callable[[CatalogEntry], ServedModel]


class ModelSet:
    def __init__(
        self,
        entries: Sequence[CatalogEntry],
        loader: Loader,
        loaded: dict[str, ServedModel],
        context: int | None = None,
    ) -> None:
        """``entries``: the catalog, the default entry first; ``loaded``: the models already
        loaded at startup, by id; ``context``: ``--context`` (what a cold start asks for)."""
        self.entries = tuple(entries)
        self.default = self.entries[0]
        self._loader = loader
        self._loaded = dict(loaded)
        self._loading: dict[str, asyncio.Future[ServedModel]] = {}
        self.context = context

    def resolve(self, label: str) -> CatalogEntry:
        return resolve(self.entries, label)

    def loaded(self, entry_id: str) -> ServedModel | None:
        return self._loaded.get(entry_id)

    def all_loaded(self) -> list[ServedModel]:
        return list(self._loaded.values())

    async def get(self, entry: CatalogEntry) -> ServedModel:
        """The served model of ``entry``, loading it first if it is not loaded."""
        model = self._loaded.get(entry.id)
        if model is not None:
            return model
        pending = self._loading.get(entry.id)
        if pending is None:
            pending = asyncio.get_running_loop().create_future()
            self._loading[entry.id] = pending
            asyncio.get_running_loop().create_task(self._load(entry, pending))
        # A client gone while its model loads does not cancel the load.
        return await asyncio.shield(pending)

    async def _load(self, entry: CatalogEntry, done: asyncio.Future[ServedModel]) -> None:
        log.info("loading model %s from %s", entry.id, entry.path)
        try:
            model = await asyncio.to_thread(self._loader, entry)
        except Exception as e:  # any load failure: the requests get a 503 naming it
            log.warning("model %s failed to load: %s", entry.id, e)
            done.set_exception(
                ApiError(
                    503,
                    f"The model '{entry.id}' ({entry.path}) failed to load: {e}",
                    code="model_load_failed",
                )
            )
            done.exception()  # retrieved: no "never retrieved" warning when nobody waits
        else:
            self._loaded[entry.id] = model
            done.set_result(model)
        finally:
            self._loading.pop(entry.id, None)

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
