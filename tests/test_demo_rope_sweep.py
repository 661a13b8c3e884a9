"""RoPE-scaled variants of the demo model (``colibri.demo.rope_sweep``): only the config changes,
and the engine runs them at the larger context. The sweep measured that scaling alone carries
the short-context model no further than ~3k tokens (docs/PERFORMANCE.md); the shipped model is
that model fine-tuned on agent preambles with YaRN x16 (its CARD.md), and the sweep scores it
past the base's 2,048-token context."""

from __future__ import annotations

import json
from pathlib import Path

from colibri.demo import rope_sweep
from colibri.runtime.engine import Engine


def _manifest(d: Path) -> dict:
    return json.loads((d / "manifest.json").read_text("utf-8"))


def test_a_variant_changes_only_the_context_and_rope_of_the_config(tmp_path):
    ctx, rope = rope_sweep.VARIANTS["yarn16"]
    d = rope_sweep.write_variant(tmp_path / "yarn16", ctx, rope)
    src = rope_sweep.DEFAULT_MODEL
    a, b = _manifest(src), _manifest(d)
    assert b["config"]["max_position_embeddings"] == 32768
    assert b["config"]["rope_parameters"]["rope_type"] == "yarn"
    for key in ("max_position_embeddings", "rope_parameters"):
        a["config"].pop(key)
        b["config"].pop(key)
    assert a == b
    for f in ("resident.bin", "experts.bin", "tokenizer.json", "tokenizer_config.json"):
        assert (src / f).read_bytes() == (d / f).read_bytes()
    info = Engine(d).info
    assert info["context_length"] == 32768 == info["model_context_length"]
    # Written again over itself: replaced, not merged.
    rope_sweep.write_variant(d, 4096, rope)
    assert Engine(d).info["context_length"] == 4096


def test_the_shipped_model_answers_past_its_base_context(tmp_path):
    rows = rope_sweep.sweep(tmp_path, ["orig"], [0, 3000], n=4, tasks=["arith"])
    got = {(r["variant"], r["preamble"]): r for r in rows}
    # Short prompts and the end of a ~3k-token agent preamble, past the 2,048 positions of
    # the model it was fine-tuned from (which answered nothing after 1.4k tokens).
    assert got[("orig", 0)]["correct"] >= 3
    assert got[("orig", 3000)]["preamble_tokens"] > 2048
    assert got[("orig", 3000)]["correct"] >= 3
    table = rope_sweep.format_table(rows)
    assert table.splitlines()[0].startswith("| variant | short | ")
    assert "| orig | " in table


def test_the_command_line_prints_the_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert (
        rope_sweep.main(
            [
                "--out",
                str(tmp_path),
                "--variants",
                "yarn4",
                "--preambles",
                "0",
                "--n",
                "2",
                "--tasks",
                "capital",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert [(r["variant"], r["preamble"], r["n"]) for r in rows] == [("yarn4", 0, 2)]
    assert rows[0]["tasks"] == {"capital": rows[0]["accuracy"]}
    assert "| yarn4 | " in capsys.readouterr().out
