"""The catalog's RAM budget (runtime/models.py ModelSet) with real engines: the random built-in
model under several ids, each loaded for real (own engine, scheduler, slot files). Every model
counts 100 units against the budget so the tests can say exactly what fits. The model used
longest ago goes first; never the default entry, a pinned one, or one holding a KV slot
(generating); a load that finds only busy models waits (503 resident_capacity_full to a
request that times out meanwhile) and goes on once one is free; a model that can never fit
fails to load with the numbers. (Through the server: tests/test_server_catalog_loading.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri.demo.builtin import builtin_model_dir
from colibri.errors import ApiError
from colibri.runtime.catalog import CatalogEntry, make_entry
from colibri.runtime.engine import Engine
from colibri.runtime.models import ModelSet
from colibri.runtime.served import ServedModel, ServerConfig

UNIT = 100


@pytest.fixture
def catalog(tmp_path):
    """``catalog(budget_units, sizes={id: units})`` -> a ModelSet of the default entry "d"
    (loaded), a pinned entry "p" (loaded) and a, b, c (cold); each model's slot files in
    tmp_path/<id>."""

    def make(units: int, sizes: dict[str, int] | None = None) -> ModelSet:
        sizes = sizes or {}
        path = builtin_model_dir()

        def load(entry: CatalogEntry) -> ServedModel:
            engine = Engine(path, threads=1, kv_dir=tmp_path / entry.id)
            return ServedModel(engine, ServerConfig(model_id=entry.id), 0)

        entries = [make_entry(path, id="d"), make_entry(path, id="p", pinned=True)]
        entries += [make_entry(path, id=i) for i in ("a", "b", "c", "huge")]
        loaded = {e.id: load(e) for e in entries[:2]}
        return ModelSet(
            entries,
            load,
            loaded,
            budget_bytes=units * UNIT,
            footprint=lambda entry, model: sizes.get(entry.id, 1) * UNIT,
        )

    return make


def entry(models: ModelSet, entry_id: str) -> CatalogEntry:
    return models.resolve(entry_id)


def loaded(models: ModelSet) -> set[str]:
    return {e.id for e in models.entries if models.state(e.id) == "loaded"}


def test_the_model_used_longest_ago_is_unloaded_to_make_room(catalog):
    models = catalog(4)  # d, p and two more

    async def scenario() -> None:
        a = await models.get(entry(models, "a"))
        await models.get(entry(models, "b"))
        assert loaded(models) == {"d", "p", "a", "b"}
        await models.get(entry(models, "a"))  # a used again: b is now the oldest
        await models.get(entry(models, "c"))
        assert loaded(models) == {"d", "p", "a", "c"} and models.unloads == 1
        # An unloaded model loads again (its slot files were let go with its engine).
        await models.get(entry(models, "b"))
        assert loaded(models) == {"d", "p", "c", "b"}
        assert a.scheduler.snapshot()["active"] == 0  # the unloaded one took no request
        models.close()

    asyncio.run(scenario())


def test_a_generating_model_is_never_unloaded(catalog):
    models = catalog(4)

    async def scenario() -> None:
        b = await models.get(entry(models, "b"))
        await models.get(entry(models, "a"))
        lease = await b.scheduler.acquire()  # b holds a KV slot: it is generating
        await models.get(entry(models, "a"))
        await models.get(entry(models, "c"))  # b is the oldest, but busy: a goes
        assert loaded(models) == {"d", "p", "b", "c"}
        b.scheduler.release(lease, "completed")
        models.close()

    asyncio.run(scenario())


def test_a_load_waits_while_every_candidate_is_busy(catalog):
    models = catalog(4)

    async def scenario() -> None:
        a = await models.get(entry(models, "a"))
        b = await models.get(entry(models, "b"))
        leases = [await a.scheduler.acquire(), await b.scheduler.acquire()]
        with pytest.raises(ApiError) as e:
            await models.get(entry(models, "c"), timeout=0.3)
        assert e.value.status == 503 and e.value.code == "resident_capacity_full"
        assert e.value.headers["Retry-After"] == "2"
        assert models.state("c") == "loading"
        b.scheduler.release(leases[1], "completed")  # b is done: it can go, and c loads
        await models.get(entry(models, "c"), timeout=30)
        assert loaded(models) == {"d", "p", "a", "c"}
        a.scheduler.release(leases[0], "completed")
        models.close()

    asyncio.run(scenario())


def test_a_model_bigger_than_the_budget_fails_to_load_with_the_numbers(catalog):
    models = catalog(4, sizes={"huge": 3})  # d and p are kept: 2 units left

    async def scenario() -> None:
        with pytest.raises(ApiError) as e:
            await models.get(entry(models, "huge"))
        assert e.value.status == 503 and e.value.code == "model_load_failed"
        assert "needs about 0.000 GB" in e.value.message and "--ram-gb" in e.value.message
        assert loaded(models) == {"d", "p"}  # nothing was unloaded for it
        # Failed, with the message its requests got, until a request tries again.
        assert models.status("huge") == ("failed", e.value.message)
        await models.get(entry(models, "a"))  # the others still load
        assert models.status("a") == ("loaded", None) and models.state("huge") == "failed"
        again = models.start(entry(models, "huge"))
        assert models.status("huge") == ("loading", None)
        with pytest.raises(ApiError):
            await again
        assert models.state("huge") == "failed"
        models.close()

    asyncio.run(scenario())


def test_load_times_are_kept_per_model_beside_its_kv_files(tmp_path):
    path = builtin_model_dir()
    entries = [make_entry(path, id="d"), make_entry(path, id="a")]

    def load(e: CatalogEntry) -> ServedModel:
        return ServedModel(Engine(path, threads=1), ServerConfig(model_id=e.id), 0)

    def state_dir(e: CatalogEntry) -> Path:
        return tmp_path / e.id

    models = ModelSet(entries, load, {"d": load(entries[0])}, state_dir=state_dir)
    assert models.retry_after(entries[1]) == 1  # never loaded: its (tiny) files, at least 1 s
    asyncio.run(models.get(entries[1]))
    assert (tmp_path / "a" / "load-times.json").is_file()
    again = ModelSet(entries, load, {"d": load(entries[0])}, state_dir=state_dir)
    assert again.measured("a") == models.measured("a") and len(models.measured("a")) == 1
    assert again.retry_after(entries[0]) == 0  # loaded


def test_requests_for_one_cold_model_share_one_load(tmp_path):
    path = builtin_model_dir()
    entries = [make_entry(path, id="d"), make_entry(path, id="a")]
    loads: list[str] = []

    def load(e: CatalogEntry) -> ServedModel:
        loads.append(e.id)
        return ServedModel(Engine(path, threads=1), ServerConfig(model_id=e.id), 0)

    models = ModelSet(entries, load, {"d": load(entries[0])})

    async def scenario() -> list[ServedModel]:
        return list(await asyncio.gather(*(models.get(entries[1]) for _ in range(4))))

    got = asyncio.run(scenario())
    assert loads == ["d", "a"] and all(m is got[0] for m in got)
    assert len(models.measured("a")) == 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=1e5, allow_nan=False), max_size=8))
def test_a_streams_wait_for_a_load_has_seed_003s_ceiling(times):
    """20 minutes for an id, an alias or a readable name; for the model's own name 1.25 times
    its worst measured load (the times kept beside its KV files), at least 2 minutes."""
    import json
    import tempfile

    path = builtin_model_dir()
    entry = make_entry(path, id="e", name="Readable", aliases=("al",))
    with tempfile.TemporaryDirectory() as state:
        (Path(state) / "load-times.json").write_text(json.dumps({"seconds": times}))
        models = ModelSet([entry], lambda e: None, {}, state_dir=lambda e: Path(state))
        for label in ("e", "al", "Readable"):
            assert models.stream_ceiling(entry, label) == 1200.0
        own = models.stream_ceiling(entry, entry.model_name)
    assert entry.model_name == "colibri-builtin"
    assert own == (max(120.0, 1.25 * max(times)) if times else 120.0)
