"""Several models behind one server (issue 35): `colibri serve --catalog FILE --models-dir DIR`
on the demo model (the default entry), the random built-in model under two entries (one of them
scoring-only) and two converted fixtures (qwen3_moe, olmoe), through the official SDKs. Names
resolve in one order on every route (id, the model's own name, alias, readable name), 409 when
a step matches several, 404 when none does, each in its protocol's envelope; `/v1/models` says
`configured` before a model is loaded and `resident` after; each model loads on first use into
its own KV directory; a model that cannot load is a 503 naming the problem while the others
keep serving. (The resolution order as a property: tests/test_catalog.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from colibri.demo.builtin import builtin_model_dir
from colibri.runtime.catalog import stable_id

from .server import RunningServer

# The two entries of the built-in model share its own name, "colibri-builtin".
BUILTIN, SCORER = "builtin-a", "scorer-c"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def models(converted, tmp_path_factory) -> dict[str, Path]:
    """The fixtures' converted directories: qwen3_moe in the catalog file, olmoe (and a
    broken model) under --models-dir."""
    root = tmp_path_factory.mktemp("catalog")
    qwen = converted("qwen3_moe", "int4")
    models_dir = root / "models"
    models_dir.mkdir()
    shutil.copytree(converted("olmoe", "int4"), models_dir / "olmoe-small")
    # A manifest whose data files are gone: listed, and refused when loaded.
    broken = models_dir / "zz-broken"
    broken.mkdir()
    shutil.copy(qwen / "manifest.json", broken / "manifest.json")
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["config"]["max_position_embeddings"] = 128  # another id than qwen's
    (broken / "manifest.json").write_text(json.dumps(manifest))
    return {"root": root, "qwen": qwen, "olmoe": models_dir / "olmoe-small", "dir": models_dir}


@pytest.fixture(scope="module")
def server(models):
    catalog = models["root"] / "catalog.toml"
    catalog.write_text(
        f'[[models]]\nid = "{BUILTIN}"\nname = "shared"\npath = "{builtin_model_dir()}"\n'
        'aliases = ["alpha", "dup"]\n'
        # An alias that is another entry's id and one that is another's readable name.
        f'[[models]]\nname = "shared"\npath = "{models["qwen"]}"\n'
        f'aliases = ["dup", "{BUILTIN}", "scorer"]\n'
        f'[[models]]\nid = "{SCORER}"\nname = "scorer"\npath = "{builtin_model_dir()}"\n'
        'task_type = "scoring"\npinned = true\n'
    )
    srv = RunningServer(
        "--catalog",
        str(catalog),
        "--models-dir",
        str(models["dir"]),
        default_model=True,
        env={"COLI_SSE_PING_S": "0.002"},
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ids(models) -> dict[str, str]:
    def derived(path: Path) -> str:
        return stable_id((path / "manifest.json").read_bytes())

    return {
        "qwen": derived(models["qwen"]),
        "olmoe": derived(models["olmoe"]),
        "broken": derived(models["dir"] / "zz-broken"),
    }


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="any", max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="any", max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def cards(oai) -> dict[str, dict]:
    """The listing as the server sent it (the SDK's objects add fields of their own)."""
    listed = oai.models.with_raw_response.list().http_response.json()
    assert [m.id for m in oai.models.list().data] == [c["id"] for c in listed["data"]]
    return {c["id"]: c for c in listed["data"]}


def test_the_catalog_is_listed_default_first_with_seed_003s_fields(oai, ids, server):
    listed = cards(oai)
    assert list(listed) == [
        "colibri-demo",
        BUILTIN,
        ids["qwen"],
        SCORER,
        ids["olmoe"],
        ids["broken"],
    ]
    assert server.model_id == "colibri-demo"
    fields = {
        "id",
        "object",
        "created",
        "owned_by",
        "name",
        "task_type",
        "max_model_len",
        "max_model_len_source",
        "model_config_id",
        "tool_calling_configured",
        "supports_tool_calls",
    }
    for card in listed.values():
        assert set(card) == fields, card
        assert card["object"] == "model" and card["owned_by"] == "colibri"
        assert card["created"] > 0 and card["supports_tool_calls"] is None
    demo, builtin, qwen, scorer = (
        listed[i] for i in ("colibri-demo", BUILTIN, ids["qwen"], SCORER)
    )
    assert demo["name"] == "colibri-demo" and demo["max_model_len_source"] == "resident"
    assert demo["max_model_len"] == 32768 and demo["tool_calling_configured"] is True
    assert (builtin["name"], qwen["name"], scorer["name"]) == ("shared", "shared", "scorer")
    assert listed[ids["olmoe"]]["name"] == "olmoe-small"
    assert scorer["task_type"] == "scoring" and builtin["task_type"] == "text-generation"
    # Pinned: loaded at startup.
    assert scorer["max_model_len_source"] == "resident"
    # One directory, one configuration; another model, another.
    assert builtin["model_config_id"] == scorer["model_config_id"] != qwen["model_config_id"]
    # Qwen3 and GLM have tool-call parsers; OLMoE none (null, never false).
    assert qwen["tool_calling_configured"] is True
    assert listed[ids["olmoe"]]["tool_calling_configured"] is None


def test_a_cold_model_is_configured_then_resident_in_its_own_kv_dir(oai, ids, server):
    before = oai.models.retrieve(ids["olmoe"]).model_dump()
    assert (before["max_model_len"], before["max_model_len_source"]) == (256, "configured")
    r = oai.completions.create(model=ids["olmoe"], prompt="Hello", max_tokens=3)
    assert r.model == ids["olmoe"] and r.usage.completion_tokens >= 1
    after = oai.models.retrieve(ids["olmoe"]).model_dump()
    assert (after["max_model_len"], after["max_model_len_source"]) == (256, "resident")
    kv = Path(server.kv_dir)
    assert (kv / ids["olmoe"]).is_dir() and (kv / SCORER).is_dir()
    assert (kv / "colibri-demo").is_dir()


def test_resolution_order_on_openai_routes(oai, ids):
    def model_of(label: str) -> str:
        return oai.completions.create(model=label, prompt="Hi", max_tokens=1).model

    assert model_of(BUILTIN) == BUILTIN  # an id, though another entry has it as an alias
    assert model_of("alpha") == BUILTIN  # an alias
    assert model_of("scorer") == ids["qwen"]  # an alias before another entry's readable name
    assert model_of(ids["qwen"]) == ids["qwen"]
    assert model_of("olmoe-small") == ids["olmoe"]  # its own (directory) name
    chat = oai.chat.completions.create(model="alpha", messages=HELLO, max_tokens=2)
    assert chat.model == BUILTIN
    assert oai.models.retrieve("alpha").id == BUILTIN


@pytest.mark.parametrize(
    ("label", "candidates"),
    [
        ("dup", (BUILTIN, "qwen")),  # an alias of two entries
        ("shared", (BUILTIN, "qwen")),  # a readable name of two
        ("colibri-builtin", (BUILTIN, SCORER)),  # the model's own name, two entries
    ],
)
def test_an_ambiguous_label_is_409_naming_the_ids_on_every_route(
    oai, claude, http, ids, label, candidates
):
    want = {ids.get(c, c) for c in candidates}

    def named(message: str) -> set[str]:
        return {i for i in (BUILTIN, SCORER, *ids.values(), "colibri-demo") if f"'{i}'" in message}

    calls = [
        lambda: oai.chat.completions.create(model=label, messages=HELLO, max_tokens=1),
        lambda: oai.completions.create(model=label, prompt="Hi", max_tokens=1),
        lambda: oai.models.retrieve(label),
        lambda: oai.responses.create(model=label, input="Hi", max_output_tokens=16),
    ]
    for call in calls:
        with pytest.raises(openai.ConflictError) as e:
            call()
        assert e.value.body["code"] == "ambiguous_model" and e.value.body["param"] == "model"
        assert named(e.value.body["message"]) == want
    for call in (
        lambda: claude.messages.create(model=label, messages=HELLO, max_tokens=1),
        lambda: claude.messages.count_tokens(model=label, messages=HELLO),
    ):
        with pytest.raises(anthropic.ConflictError) as ae:
            call()
        body = ae.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "ambiguous" in body["error"]["message"]
        assert named(body["error"]["message"]) == want
    scoring = [
        ("/v1/brio", {"state": "s", "options": ["a", "b"]}),
        ("/v1/rank", {"question": "q", "answers": ["a", "b"]}),
        ("/v1/systemone", {"state": "s", "questions": {"q": {"type": "noul"}}}),
    ]
    for path, body in scoring:
        r = http.post(path, json={"model": label, **body})
        assert r.status_code == 409, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "ambiguous_model" and named(err["message"]) == want


def test_an_unknown_model_is_404_in_each_protocols_envelope(oai, claude, http):
    for call in (
        lambda: oai.chat.completions.create(model="nope", messages=HELLO, max_tokens=1),
        lambda: oai.completions.create(model="nope", prompt="Hi", max_tokens=1),
        lambda: oai.models.retrieve("nope"),
        lambda: oai.responses.create(model="nope", input="Hi"),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["code"] == "model_not_found"
        assert "'colibri-demo'" in e.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as ae:
        claude.messages.create(model="nope", messages=HELLO, max_tokens=1)
    assert ae.value.body["error"]["type"] == "not_found_error"
    assert "'nope' does not exist" in ae.value.body["error"]["message"]
    for path, body in (
        ("/v1/brio", {"state": "s", "options": ["a", "b"]}),
        ("/v1/rank", {"question": "q", "answers": ["a", "b"]}),
    ):
        r = http.post(path, json={"model": "nope", **body})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    # The Jev contract: /v1/systemone answers an unknown name with the default model.
    r = http.post(
        "/v1/systemone",
        json={"model": "jev-latest", "state": "s", "questions": {"q": {"type": "noul"}}},
    )
    assert r.status_code == 200 and r.json()["model"] == "colibri-demo"


def test_each_route_serves_the_model_it_names(claude, http, ids):
    m = claude.messages.create(model="alpha", messages=HELLO, max_tokens=2)
    assert m.model == BUILTIN
    assert claude.messages.count_tokens(model=ids["qwen"], messages=HELLO).input_tokens > 0
    r = http.post("/v1/brio", json={"model": SCORER, "state": "s", "options": ["a", "b"]})
    assert r.status_code == 200 and r.json()["model"] == SCORER
    r = http.post("/v1/rank", json={"model": "alpha", "question": "q", "answers": ["a", "b"]})
    assert r.status_code == 200 and r.json()["model"] == BUILTIN
    r = http.post("/v1/rank", json={"question": "q", "answers": ["a", "b"]})
    assert r.status_code == 200 and r.json()["model"] == "colibri-demo"  # no model: default
    r = http.post(
        "/v1/systemone",
        json={"model": SCORER, "state": "s", "questions": {"q": {"type": "noul"}}},
    )
    assert r.status_code == 200 and r.json()["model"] == SCORER


def test_a_scoring_model_generates_no_text(oai, claude):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=SCORER, messages=HELLO, max_tokens=1)
    assert e.value.body["code"] == "model_is_scorer" and "/v1/brio" in e.value.body["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="scorer-c", messages=HELLO, max_tokens=1)


def test_a_model_that_cannot_load_is_503_naming_it_and_the_others_keep_serving(oai, ids, http):
    for _ in range(2):  # each request tries again, and fails the same way
        with pytest.raises(openai.InternalServerError) as e:
            oai.completions.create(model=ids["broken"], prompt="Hi", max_tokens=1)
        assert e.value.status_code == 503
        assert e.value.body["code"] == "model_load_failed"
        message = e.value.body["message"]
        assert f"'{ids['broken']}'" in message and "zz-broken" in message
        # The problem itself, in the engine's words: the file the model lacks.
        assert "failed to load" in message
        assert "resident.bin: No such file or directory" in message, message
    assert oai.models.retrieve(ids["broken"]).model_dump()["max_model_len_source"] == "configured"
    r = oai.chat.completions.create(model="colibri-demo", messages=HELLO, max_tokens=4)
    assert r.model == "colibri-demo" and r.choices[0].message.content
    # Every other model keeps being served, a cold one loading as usual.
    r = oai.completions.create(model=ids["qwen"], prompt="Hi", max_tokens=2)
    assert r.model == ids["qwen"] and r.usage.completion_tokens >= 1
    health = http.get("/health").json()
    states = {m["id"]: m["state"] for m in health["models"]}
    assert states[ids["broken"]] == "failed" and states[ids["qwen"]] == "loaded"
    # The server serves the others: degraded, not down (tests/test_server_ram_budget.py).
    assert health["status"] == "degraded" and http.get("/health").status_code == 200


def test_a_stream_names_the_model_it_resolved(oai, ids):
    stream = oai.chat.completions.create(
        model=ids["qwen"], messages=HELLO, max_tokens=3, stream=True
    )
    chunks = list(stream)
    assert chunks and {c.model for c in chunks} == {ids["qwen"]}


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", "serve", "--port", "0", "--no-kv-persist", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_bad_catalog_stops_the_server_at_startup_naming_the_problem(tmp_path, models):
    bad = tmp_path / "cat.json"
    bad.write_text(json.dumps([{"path": str(models["qwen"]), "colour": "red"}]))
    r = _serve("--catalog", str(bad))
    assert r.returncode == 2 and "unknown field(s) colour" in r.stderr, r.stderr
    r = _serve("--models-dir", str(tmp_path / "none"))
    assert r.returncode == 2 and "is not a directory" in r.stderr, r.stderr
    dup = tmp_path / "dup.json"
    dup.write_text(json.dumps([{"path": str(models["qwen"])}, {"path": str(models["qwen"])}]))
    r = _serve("--catalog", str(dup))
    assert r.returncode == 2 and "two catalog entries have the id" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory):
    """The demo model and the built-in model under three ids, with a --ram-gb that holds the
    demo model and two of the others (each: its files and its KV at full context; the rule of
    docs/API.md "RAM budget" gives the demo model all its experts, as the on-demand share wants
    more, and the on-demand share the rest)."""
    from colibri.demo.builtin import default_model_dir
    from colibri.runtime.engine import Engine

    def ram(path: Path) -> int:
        info = Engine(path, threads=1).info
        files = sum((path / n).stat().st_size for n in ("resident.bin", "experts.bin"))
        return files + info["context_length"] * info["kv_bytes_per_token"]

    budget = ram(default_model_dir()) + 2 * ram(builtin_model_dir()) + 20_000
    catalog = tmp_path_factory.mktemp("budget") / "catalog.json"
    entries = [{"id": i, "path": str(builtin_model_dir())} for i in ("x", "y", "z")]
    catalog.write_text(json.dumps(entries))
    srv = RunningServer(
        "--catalog", str(catalog), "--ram-gb", str(budget / 1e9), default_model=True
    )
    yield srv
    srv.stop()


def test_the_ram_budget_unloads_the_model_used_longest_ago(budget_server):
    client = openai.OpenAI(base_url=budget_server.base_url, api_key="any", max_retries=0)

    def use(model: str) -> None:
        assert client.completions.create(model=model, prompt="Hi", max_tokens=1).model == model

    def sources() -> dict[str, str]:
        listed = client.models.with_raw_response.list().http_response.json()["data"]
        return {c["id"]: c["max_model_len_source"] for c in listed}

    use("x")
    use("y")
    use("x")  # y is now the one used longest ago
    use("z")
    assert sources() == {
        "colibri-demo": "resident",
        "x": "resident",
        "y": "configured",
        "z": "resident",
    }
    health = httpx.get(budget_server.url + "/health").json()
    assert health["models_unloaded"] == 1
    assert {m["id"]: m["state"] for m in health["models"]}["y"] == "cold"
    assert (
        sum(m["ram_bytes"] for m in health["models"] if m["state"] == "loaded")
        <= health["ram_budget_bytes"]
    )
    use("y")  # loads again (its slot files were let go), and x goes
    assert sources()["x"] == "configured" and health["ram_budget_bytes"] > 0
    # The metrics of an unloaded model: its gauges go, its counters stay, and continue when it
    # loads again.
    series = {
        (s.name, s.labels.get("model")): s.value
        for family in text_string_to_metric_families(httpx.get(budget_server.url + "/metrics").text)
        for s in family.samples
    }
    assert series[("colibri_scheduler_admitted_total", "y")] == 2  # one before, one after
    assert series[("colibri_scheduler_completed_total", "x")] == 2  # x is unloaded now
    assert series[("colibri_scheduler_capacity", "y")] == 1
    assert ("colibri_scheduler_capacity", "x") not in series
    assert ("colibri_engine_kv_bytes_per_token", "x") not in series
    assert series[("colibri_scheduler_queue_wait_seconds_count", "x")] == 2
    assert series[("colibri_engine_generated_tokens_total", "y")] == 2
