"""GLM-5's DeepSeek sparse attention (glm_moe_dsa): the cache keeps the MLA row and the
indexer's key per token; prefix reuse and slot-file restarts give the tokens of a cold run; the
selection really changes the fixtures' logits; malformed configs are refused by name. (Parity
with transformers: tests/test_reference.py, which runs every fixture in conftest.ARCHS.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from colibri import convert
from colibri.runtime.engine import Engine

from .conftest import FIXTURES, Reference, assert_a_slot_file_restart_is_cold

DSA_ARCHS = ["glm_moe_dsa", "glm_moe_dsa_yarn", "glm_moe_dsa_shared", "deepseek_v32"]


@pytest.fixture(params=DSA_ARCHS)
def dsa(request) -> Reference:
    return Reference(request.param)


def hf_config(arch: str) -> dict:
    return json.loads((FIXTURES / arch / "hf" / "config.json").read_text())


def indexer_types(cfg: dict) -> list[str]:
    """Per layer, "full" or "shared" (DeepSeek-V3.2's config has no such list: all full)."""
    return cfg.get("indexer_types", ["full"] * cfg["num_hidden_layers"])


def with_config(tmp_path: Path, arch: str, **changes) -> Path:
    """A copy of the fixture's checkpoint with `changes` in its config.json (None deletes)."""
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / arch / "hf", hf)
    cfg = hf_config(arch)
    for field, value in changes.items():
        if value is None:
            cfg.pop(field, None)
        else:
            cfg[field] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    return hf


def test_the_cache_keeps_the_latent_the_rope_key_and_the_indexer_key(dsa, converted):
    cfg = hf_config(dsa.arch)
    mla = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    # A shared layer (no indexer of its own) keeps no indexer key.
    full = indexer_types(cfg).count("full")
    floats = cfg["num_hidden_layers"] * mla + full * cfg["index_head_dim"]
    for quant, width in [("f32", 4), ("int4", 2)]:
        info = Engine(converted(dsa.arch, quant), threads=1).info
        assert info["kv_bytes_per_token"] == floats * width


def test_the_shared_fixture_reuses_the_indexer(dsa):
    types = indexer_types(hf_config(dsa.arch))
    assert ("shared" in types) == (dsa.arch == "glm_moe_dsa_shared"), types


def test_the_fixtures_prompts_are_longer_than_the_top_k(dsa):
    assert max(len(p) for p in dsa.prompts) > hf_config(dsa.arch)["index_topk"]


def test_attending_over_every_position_would_give_other_logits(dsa, converted, tmp_path):
    """The selection is what the reference computes: with the top-k past the context the
    logits of a prompt longer than the top-k leave transformers', those of one within it stay."""
    dense = tmp_path / "dense"
    convert(with_config(tmp_path, dsa.arch, index_topk=4096), dense, "f32")
    sparse = Engine(converted(dsa.arch, "f32"))
    full = Engine(dense)
    topk = hf_config(dsa.arch)["index_topk"]
    for prompt, ref in zip(dsa.prompts, dsa.logits, strict=True):
        scale = np.abs(ref).max()
        assert np.abs(sparse.logits(prompt) - ref).max() / scale < 1e-4
        err = np.abs(full.logits(prompt) - ref).max() / scale
        if len(prompt) > topk:
            assert err > 1e-2, f"{len(prompt)} tokens: the selection changes nothing ({err})"
        else:
            assert err < 1e-4


def test_prefix_reuse_gives_the_tokens_of_a_cold_run(dsa, converted):
    for quant in ["f32", "int4"]:
        engine = Engine(converted(dsa.arch, quant), threads=2, slots=2)
        prompt = dsa.prompts[1]
        first = engine.generate(prompt, 6, slot=1)
        out = list(first)
        history = prompt + out[:-1]
        assert engine.slot_info(1)["tokens"] == history
        longer = history + dsa.prompts[2][1:9]
        warm = engine.generate(longer, 8, slot=1)
        got = list(warm)
        assert warm.reused_tokens == len(history)
        assert got == list(engine.generate(longer, 8)), quant
        branch = history[:5] + dsa.prompts[0]
        again = engine.generate(branch, 5, slot=1)
        assert list(again) == list(engine.generate(branch, 5)) and again.reused_tokens == 5


def test_a_slot_file_restart_gives_the_tokens_of_a_cold_run(dsa, converted, tmp_path):
    assert_a_slot_file_restart_is_cold(
        converted(dsa.arch, "int4"), tmp_path / "kv", dsa.prompts[2], dsa.prompts[1][1:6]
    )


def test_prompt_chunks_do_not_change_the_logits(dsa, converted):
    """A prompt cut into passes (some selecting, some not) gives the one-pass logits."""
    model = converted(dsa.arch, "f32")
    prompt = dsa.prompts[2]
    whole = Engine(model).logits(prompt)
    engine = Engine(model, slots=1)
    cut = 3  # a first pass within the top-k, then one that selects
    list(engine.generate(prompt[:cut], 1, slot=0))
    assert engine.slot_info(0)["tokens"] == prompt[:cut]
    got = list(engine.generate(prompt, 1, slot=0))
    assert got == [int(whole[-1].argmax())]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("q_lora_rank", None),
        ("q_lora_rank", 0),
        ("index_topk", 0),
        ("index_n_heads", 0),
        ("index_head_dim", 4),
        ("indexer_types", ["shared", "full", "full"]),
        ("indexer_types", ["full"]),
        ("mlp_layer_types", ["dense", "moe", "sparse"]),
        ("kv_lora_rank", 0),
        ("attention_bias", True),
    ],
)
def test_a_malformed_config_is_refused_by_name(tmp_path, field, value):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / "glm_moe_dsa" / "hf", hf)
    cfg = hf_config("glm_moe_dsa")
    if value is None:
        cfg[field] = None
    else:
        cfg[field] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ValueError, RuntimeError, OSError)) as exc:
        convert(hf, tmp_path / "out", "f32")
    assert field in str(exc.value)


def test_a_schedule_that_opens_with_a_shared_layer_is_refused_by_name(tmp_path):
    hf = with_config(
        tmp_path, "glm_moe_dsa", indexer_types=None, index_topk_freq=2, index_skip_topk_offset=0
    )
    with pytest.raises((ValueError, RuntimeError, OSError)) as exc:
        convert(hf, tmp_path / "out", "f32")
    assert "index_topk_freq" in str(exc.value)


def test_the_architecture_is_known_and_chats_as_glm():
    from colibri._engine import architectures
    from colibri.chat.families import detect_family

    assert dict(architectures())["GlmMoeDsaForCausalLM"] == "glm"
    assert detect_family("GlmMoeDsaForCausalLM", None).name == "glm"


def test_deepseek_v32_is_known_and_chats_as_deepseek_v32():
    from colibri._engine import architectures
    from colibri.chat.families import detect_family

    assert dict(architectures())["DeepseekV32ForCausalLM"] == "deepseek_v32"
    assert detect_family("DeepseekV32ForCausalLM", None).name == "deepseek_v32"
