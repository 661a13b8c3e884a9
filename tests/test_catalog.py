"""The model catalog without a server (runtime/catalog.py): catalog files (JSON and TOML) and
their refusals, --models-dir scans, stable ids, and the resolution order as a property over
random catalogs. The served behaviour is tests/test_server_catalog.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from colibri.errors import ApiError
from colibri.runtime.catalog import (
    CatalogEntry,
    CatalogError,
    dir_name,
    make_entry,
    merge,
    read_catalog,
    resolve,
    scan_models_dir,
    stable_id,
)


def fake_model(path: Path, architecture: str = "Qwen3MoeForCausalLM", ctx: int | None = 4096):
    """A directory with a manifest only (the catalog reads nothing else)."""
    path.mkdir(parents=True)
    config = {"vocab_size": 10} | ({"max_position_embeddings": ctx} if ctx else {})
    manifest = {
        "format": "colibri-model",
        "version": 3,
        "architecture": architecture,
        "config": config,
        "quantization": {"type": "int4", "group_size": 32},
    }
    (path / "manifest.json").write_text(json.dumps(manifest))
    return path


def test_entry_of_a_directory_comes_from_its_manifest(tmp_path):
    entry = make_entry(fake_model(tmp_path / "qwen-small"))
    raw = (tmp_path / "qwen-small" / "manifest.json").read_bytes()
    assert entry.id == stable_id(raw)
    assert len(entry.id) == 36 and entry.id.count("-") == 4
    assert entry.model_name == entry.name == "qwen-small"
    assert entry.configured_context == 4096
    assert entry.configured_window(None) == 4096 and entry.configured_window(1000) == 1000
    assert entry.tool_calling_configured  # qwen3 has a tool-call parser
    assert entry.task_type == "text-generation" and not entry.pinned


def test_the_id_stays_when_the_directory_moves_and_the_config_id_is_shared(tmp_path):
    a = make_entry(fake_model(tmp_path / "a"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    b = make_entry(tmp_path / "b")
    assert a.id == b.id and a.model_config_id == b.model_config_id
    other = make_entry(fake_model(tmp_path / "c", ctx=8192))
    assert other.id != a.id and other.model_config_id != a.model_config_id


def test_no_declared_context_is_none_never_invented(tmp_path):
    entry = make_entry(fake_model(tmp_path / "m", architecture="OlmoeForCausalLM", ctx=None))
    assert entry.configured_context is None and entry.configured_window(512) is None
    assert not entry.tool_calling_configured


def test_a_directory_without_a_manifest_is_refused_by_name(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(CatalogError, match="half is not a colibri model directory"):
        make_entry(tmp_path / "half")


def test_catalog_json_and_toml_read_the_same(tmp_path):
    fake_model(tmp_path / "models" / "q")
    fake_model(tmp_path / "models" / "o", architecture="OlmoeForCausalLM")
    items = [
        {"id": "coder", "name": "Coder", "path": "models/q", "aliases": ["c", "qwen"]},
        {"path": str(tmp_path / "models" / "o"), "task_type": "scoring", "pinned": True},
    ]
    (tmp_path / "cat.json").write_text(json.dumps({"models": items}))
    (tmp_path / "cat.toml").write_text(
        '[[models]]\nid = "coder"\nname = "Coder"\npath = "models/q"\naliases = ["c", "qwen"]\n'
        f'[[models]]\npath = "{tmp_path / "models" / "o"}"\ntask_type = "scoring"\n'
        "pinned = true\n"
    )
    from_json, from_toml = read_catalog(tmp_path / "cat.json"), read_catalog(tmp_path / "cat.toml")
    assert from_json == from_toml
    coder, scorer = from_json
    assert (coder.id, coder.name, coder.model_name, coder.aliases) == (
        "coder",
        "Coder",
        "q",
        ("c", "qwen"),
    )
    assert coder.path == tmp_path / "models" / "q"
    assert scorer.task_type == "scoring" and scorer.pinned and scorer.name == "o"


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ({"path": "m", "colour": "red"}, "unknown field.*colour"),
        ({"name": "x"}, "'path' .* is required"),
        ({"path": "m", "task_type": "chat"}, "'task_type' must be one of"),
        ({"path": "m", "pinned": "yes"}, "'pinned' must be true or false"),
        ({"path": "m", "aliases": "a"}, "'aliases' must be a list"),
        ({"path": "m", "aliases": ["has space"]}, "'aliases' must be a non-empty string"),
        ({"path": "m", "id": ""}, "'id' must be a non-empty string"),
        ({"path": "m", "id": "has space"}, "'id' must be a non-empty string without spaces"),
        ({"path": "m", "name": " padded"}, "'name' must be .* without control characters"),
        ({"path": "m", "name": "tab\there"}, "'name' must be .* without control characters"),
        ({"path": "m", "name": 3}, "'name' must be a non-empty string"),
        ({"path": "m", "chat_family": "nope"}, "'chat_family' must be one of"),
        ({"path": "missing"}, "model 0: .*missing is not a colibri model directory"),
        ("m", "model 0 is not an object"),
    ],
)
def test_a_bad_catalog_entry_is_refused_naming_the_field(tmp_path, item, message):
    fake_model(tmp_path / "m")
    (tmp_path / "cat.json").write_text(json.dumps([item]))
    with pytest.raises(CatalogError, match=message):
        read_catalog(tmp_path / "cat.json")


def test_a_refusal_names_the_file_and_the_entry_once(tmp_path):
    (tmp_path / "cat.json").write_text(json.dumps([{"path": "m", "id": "a b"}]))
    with pytest.raises(CatalogError) as e:
        read_catalog(tmp_path / "cat.json")
    assert str(e.value).count("model 0") == 1 and str(e.value).count("--catalog") == 1


def test_a_readable_name_and_a_path_may_have_spaces(tmp_path):
    """docs/API.md's example names a model "Qwen3 30B A3B"; model directories may live under
    a folder with a space in its name."""
    fake_model(tmp_path / "My Models" / "q")
    (tmp_path / "cat.json").write_text(
        json.dumps([{"path": "My Models/q", "id": "q", "name": "Qwen3 30B A3B"}])
    )
    (entry,) = read_catalog(tmp_path / "cat.json")
    assert entry.name == "Qwen3 30B A3B" and entry.path == tmp_path / "My Models" / "q"
    assert resolve([entry], "Qwen3 30B A3B") is entry


def test_a_catalog_file_that_does_not_parse_is_refused(tmp_path):
    (tmp_path / "cat.toml").write_text("[[models]\n")
    with pytest.raises(CatalogError, match="does not parse"):
        read_catalog(tmp_path / "cat.toml")
    (tmp_path / "cat.json").write_text('{"models": {}}')
    with pytest.raises(CatalogError, match="expected a list of models"):
        read_catalog(tmp_path / "cat.json")
    with pytest.raises(CatalogError, match="No such file"):
        read_catalog(tmp_path / "absent.json")


def test_models_dir_finds_each_model_directory(tmp_path):
    fake_model(tmp_path / "b")
    fake_model(tmp_path / "a", ctx=100)
    (tmp_path / "not-a-model").mkdir()
    assert [e.name for e in scan_models_dir(tmp_path)] == ["a", "b"]
    assert [e.name for e in scan_models_dir(tmp_path / "a")] == ["a"]
    with pytest.raises(CatalogError, match="holds no colibri model"):
        scan_models_dir(tmp_path / "not-a-model")
    with pytest.raises(CatalogError, match="is not a directory"):
        scan_models_dir(tmp_path / "nothing")


def test_merge_drops_a_scanned_directory_already_served_and_refuses_a_duplicate_id(tmp_path):
    default = make_entry(fake_model(tmp_path / "d" / "demo"), id="colibri-demo")
    other = make_entry(fake_model(tmp_path / "d" / "other", ctx=1))
    assert merge([default], scan_models_dir(tmp_path / "d")) == [default, other]
    shutil.copytree(tmp_path / "d" / "other", tmp_path / "copy")
    with pytest.raises(CatalogError, match="two catalog entries have the id"):
        merge([default, other, make_entry(tmp_path / "copy")])
    # An id of its own resolves it.
    assert len(merge([default, other, make_entry(tmp_path / "copy", id="copy")])) == 3


def _entry(i: str, model_name: str, name: str, aliases: tuple[str, ...]) -> CatalogEntry:
    return CatalogEntry(id=i, model_name=model_name, name=name, path=Path("/m"), aliases=aliases)


_LABELS = st.sampled_from(["a", "b", "c", "d", "e"])


@st.composite
def catalogs(draw) -> list[CatalogEntry]:
    ids = draw(st.lists(st.sampled_from(["a", "b", "c", "x", "y"]), min_size=1, unique=True))
    return [
        _entry(
            i,
            draw(_LABELS),
            draw(_LABELS),
            tuple(draw(st.lists(_LABELS, max_size=3, unique=True))),
        )
        for i in ids
    ]


def _steps(e: CatalogEntry) -> list[set[str]]:
    return [{e.id}, {e.model_name}, set(e.aliases), {e.name}]


@settings(max_examples=300, deadline=None)
@given(catalogs(), st.sampled_from(["a", "b", "c", "d", "e", "x", "y", "z"]))
def test_resolution_takes_the_first_step_with_a_match(entries, label):
    # The reference: the first of (id, model name, alias, readable name) any entry matches.
    first = next(
        (
            [e for e in entries if label in _steps(e)[step]]
            for step in range(4)
            if any(label in _steps(e)[step] for e in entries)
        ),
        [],
    )
    if len(first) == 1:
        assert resolve(entries, label) is first[0]
        return
    with pytest.raises(ApiError) as err:
        resolve(entries, label)
    if not first:
        assert (err.value.status, err.value.code) == (404, "model_not_found")
        assert f"'{label}' does not exist" in err.value.message
    else:
        assert (err.value.status, err.value.code) == (409, "ambiguous_model")
        named = {e.id for e in entries if f"'{e.id}'" in err.value.message}
        assert named == {e.id for e in first}
    assert err.value.param == "model"


@settings(max_examples=200, deadline=None)
@given(catalogs())
def test_an_id_always_names_its_own_entry(entries):
    for entry in entries:
        assert resolve(entries, entry.id) is entry


def test_an_id_becomes_one_directory_name_of_its_own():
    assert dir_name("colibri-demo") == "colibri-demo"
    assert dir_name("3f2c9a1e-0b1c-4d2e-8f00-123456789abc").count("-") == 4
    odd = ["org/model", "org_model", "../up", "a b", ".hidden", "x" * 300]
    names = [dir_name(i) for i in odd]
    assert len(set(names)) == len(odd) and "org_model" in names
    for name in names:
        assert "/" not in name and not name.startswith(".") and len(name) <= 97


@settings(max_examples=500, deadline=None)
@given(st.text(min_size=1, max_size=80), st.text(min_size=1, max_size=80))
def test_two_ids_never_share_a_kv_directory(a, b):
    """A model's slot files live in --kv-dir/dir_name(id): distinct ids, distinct names, also
    for an id spelled like another's digested name."""
    assume(a != b)
    assert dir_name(a) != dir_name(b)
    if dir_name(a) != a:  # digested: an id spelled like that name gets another one
        assert dir_name(dir_name(a)) != dir_name(a)
    for name in (dir_name(a), dir_name(b)):
        assert name not in (".", "..") and "/" not in name and "\x00" not in name
        assert 1 <= len(name) <= 97


def test_an_id_spelled_like_a_digested_name_keeps_its_own_directory():
    digested = dir_name("org/model")
    assert digested != "org/model"
    assert dir_name(digested) != digested or len(digested) > 64
    assert dir_name(digested) != dir_name("org/model")
