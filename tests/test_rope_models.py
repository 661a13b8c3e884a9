"""Whole models with scaled RoPE against transformers: the committed reference checkpoints with
YaRN (qwen3_moe) and linear scaling (glm4_moe, partial rotary) in their config, on a 120-token
prompt (fixtures by scripts/make_rope_fixtures.py)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from colibri import Engine, convert

from .conftest import FIXTURES


def rel_max(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("case", ["qwen3_moe_yarn", "glm4_moe_linear"])
def test_scaled_rope_models_match_transformers(case, tmp_path):
    data = np.load(FIXTURES / "rope" / f"{case}.npz")
    arch, rope = str(data["arch"]), json.loads(str(data["rope"]))
    prompt, ref = data["prompt"].tolist(), data["logits"]
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / arch / "hf", hf)
    config = json.loads((hf / "config.json").read_text())
    plain = dict(config)
    config["rope_parameters"] = rope
    (hf / "config.json").write_text(json.dumps(config))
    convert(hf, tmp_path / "scaled", "f32")
    ours = Engine(tmp_path / "scaled", threads=2).logits(prompt)
    assert rel_max(ours, ref) < 1e-4, case
    # The scaling matters here: the same weights without it are far from the reference.
    (hf / "config.json").write_text(json.dumps(plain))
    convert(hf, tmp_path / "plain", "f32")
    unscaled = Engine(tmp_path / "plain", threads=2).logits(prompt)
    assert rel_max(unscaled, ref) > 1e-2, case
