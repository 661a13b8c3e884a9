"""docs/API.md's "Adding a model" steps, followed as a newcomer would (issue 35's "done when"):
the two catalog examples of the "Model catalog" section, taken from the document itself with
only their `/models/...` paths pointed at models converted here with `colibri convert` from the
test fixtures (qwen3_moe, olmoe), then served and called through the official openai SDK under
the ids, aliases and names the examples give."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from .server import RunningServer

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).parent / "fixtures"
HELLO = [{"role": "user", "content": "Hello"}]


def catalog_examples() -> tuple[str, str]:
    """The TOML and the JSON example of docs/API.md's "Model catalog" section, verbatim."""
    text = (ROOT / "docs" / "API.md").read_text()
    section = text[text.index("\n## Model catalog\n") :]
    section = section[: section.index("\n## ", 1)]
    toml = re.search(r"```toml\n(.*?)```", section, re.S)
    js = re.search(r"```json\n(\{\"models\".*?)```", section, re.S)
    assert toml and js, "the catalog examples moved: update this test with the document"
    return toml.group(1), js.group(1)


def convert(arch: str, out: Path) -> Path:
    """Step 1, as the document says: `colibri convert HF_DIR OUT_DIR`."""
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "convert", str(FIXTURES / arch / "hf"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert (out / "manifest.json").is_file()
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """The examples' /models directory, holding the two models they name."""
    root = tmp_path_factory.mktemp("models")
    convert("qwen3_moe", root / "qwen3-30b-a3b")
    convert("olmoe", root / "olmoe")
    return root


def test_the_toml_example_adds_a_model_clients_reach_by_its_id_aliases_and_name(models, tmp_path):
    toml, _ = catalog_examples()
    assert 'path = "/models/qwen3-30b-a3b"' in toml
    catalog = tmp_path / "colibri-models.toml"
    catalog.write_text(toml.replace('"/models/', f'"{models}/'))
    srv = RunningServer("--catalog", str(catalog), default_model=True)  # step 3
    try:
        # Step 4: listed, with its id, name and window; pinned: loaded at startup.
        listed = httpx.get(srv.base_url + "/models").json()["data"]
        card = next(c for c in listed if c["id"] == "qwen3-coder")
        assert card["name"] == "Qwen3 30B A3B" and card["task_type"] == "text-generation"
        assert card["max_model_len_source"] == "resident" and card["max_model_len"] == 256
        assert card["tool_calling_configured"] is True  # chat_family qwen3
        # Step 5: a client names it by its id, an alias or its readable name.
        client = openai.OpenAI(base_url=srv.base_url, api_key="local", max_retries=0)
        for label in ("qwen3-coder", "coder", "q3", "Qwen3 30B A3B"):
            r = client.chat.completions.create(model=label, messages=HELLO, max_tokens=3)
            assert r.model == "qwen3-coder" and r.usage.completion_tokens >= 1
        assert client.models.retrieve("coder").id == "qwen3-coder"
    finally:
        srv.stop()


def test_the_json_example_adds_a_scoring_model_loaded_on_first_use(models, tmp_path):
    _, js = catalog_examples()
    catalog = tmp_path / "catalog.json"
    catalog.write_text(js.replace('"/models/', f'"{models}/'))
    entry = json.loads(catalog.read_text())["models"][0]
    assert entry["aliases"] == ["small"] and entry["task_type"] == "scoring"
    srv = RunningServer("--catalog", str(catalog), default_model=True)
    try:
        listed = httpx.get(srv.base_url + "/models").json()["data"]
        assert [c["id"] for c in listed][0] == "colibri-demo"  # the default entry stays first
        card = listed[1]
        assert card["name"] == "olmoe" and card["task_type"] == "scoring"
        assert card["max_model_len_source"] == "configured"  # not pinned: not loaded yet
        r = httpx.post(
            srv.base_url + "/brio",
            json={"model": "small", "question": "Which?", "options": ["yes", "no"]},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["model"] == card["id"]  # its id, derived from the manifest
        after = httpx.get(srv.base_url + f"/models/{card['id']}").json()
        assert after["max_model_len_source"] == "resident"
        client = openai.OpenAI(base_url=srv.base_url, api_key="local", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="small", messages=HELLO, max_tokens=1)
        assert e.value.body["code"] == "model_is_scorer"
    finally:
        srv.stop()
