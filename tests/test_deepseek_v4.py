"""DeepSeek-V4: what its layers keep per position, prefix reuse and slot-file restarts across
compressor windows, checkpoints under DeepSeek's own tensor names, and malformed configs refused
by name. (Parity with transformers: tests/test_reference.py runs the fixture like every other.)"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from colibri import convert
from colibri._engine import architectures
from colibri.runtime.engine import Engine

from .conftest import (
    FIXTURES,
    Reference,
    assert_a_slot_file_restart_is_cold,
    conversion_refusal,
    read_safetensors,
    write_safetensors,
)

ARCH = "deepseek_v4"


@pytest.fixture
def v4() -> Reference:
    return Reference(ARCH)


def hf_config() -> dict:
    return json.loads((FIXTURES / ARCH / "hf" / "config.json").read_text())


def entry_width(cfg: dict, kind: str) -> tuple[int, int]:
    """(floats, positions) of the row a layer keeps per compressor window: the entry, and CSA's
    indexer entry after it; a sliding layer keeps none."""
    hd, ihd, rates = cfg["head_dim"], cfg["index_head_dim"], cfg["compress_rates"]
    if kind == "sliding_attention":
        return 0, 1
    if kind == "heavily_compressed_attention":
        return hd, rates[kind]
    return hd + ihd, rates[kind]


def state_width(cfg: dict, kind: str) -> int:
    """Floats of a layer's state: the last sliding_window - 1 keys, and the compressor inputs
    (values and gates) later entries can still read: rate - 1 positions (HCA), 2 * rate - 1
    with the previous window (CSA, its indexer's too)."""
    hd, ihd, rates = cfg["head_dim"], cfg["index_head_dim"], cfg["compress_rates"]
    keys = (cfg["sliding_window"] - 1) * hd
    if kind == "sliding_attention":
        return keys
    if kind == "heavily_compressed_attention":
        return keys + (rates[kind] - 1) * 2 * hd
    return keys + (2 * rates[kind] - 1) * (2 * 2 * hd + 2 * 2 * ihd)


def test_the_cache_keeps_entries_per_window_and_the_window_per_slot(converted):
    cfg = hf_config()
    per_position = sum(w / every for w, every in (entry_width(cfg, k) for k in cfg["layer_types"]))
    state = sum(state_width(cfg, k) for k in cfg["layer_types"])
    # The state's keys and compressor inputs are rounded as the cache stores them, so it is
    # kept in the cache's dtype too: f32 for an f32 model, f16 for an int4 one.
    for quant, width in [("f32", 4), ("int4", 2)]:
        info = Engine(converted(ARCH, quant), threads=1).info
        assert info["kv_bytes_per_token"] == math.ceil(per_position * width)
        assert info["state_bytes_per_slot"] == state * width


def test_the_fixture_spans_compressor_windows_and_indexer_selection(v4):
    cfg = hf_config()
    longest = len(v4.prompts[2])
    rates = cfg["compress_rates"]
    assert longest > cfg["sliding_window"]
    assert longest // rates["heavily_compressed_attention"] >= 2
    assert longest // rates["compressed_sparse_attention"] > cfg["index_topk"]


def test_prefix_reuse_gives_the_tokens_of_a_cold_run(v4, converted):
    for quant in ["f32", "int4"]:
        engine = Engine(converted(ARCH, quant), threads=2, slots=2)
        prompt = v4.prompts[1]
        first = engine.generate(prompt, 6, slot=1)
        out = list(first)
        history = prompt + out[:-1]
        assert engine.slot_info(1)["tokens"] == history
        longer = history + v4.prompts[2][1:20]
        warm = engine.generate(longer, 8, slot=1)
        got = list(warm)
        assert warm.reused_tokens == len(history)
        assert got == list(engine.generate(longer, 8)), quant
        # The same prompt again goes back inside the window (and the compressor windows) to
        # the snapshot taken before its last token.
        same = engine.generate(longer, 8, slot=1)
        assert list(same) == got and same.reused_tokens == len(longer) - 1
        # Leaving the history inside a compressor window (5: CSA windows of 4, HCA of 8), where
        # no snapshot was taken: the slot goes back to the last one before it (the start).
        branch = history[:5] + v4.prompts[0] + v4.prompts[2][3:14]
        again = engine.generate(branch, 5, slot=1)
        assert list(again) == list(engine.generate(branch, 5)) and again.reused_tokens < 5


def test_a_slot_file_restart_gives_the_tokens_of_a_cold_run(v4, converted, tmp_path):
    # Version 3: records of entries per window, state records of the windows.
    assert_a_slot_file_restart_is_cold(
        converted(ARCH, "int4"), tmp_path / "kv", v4.prompts[2], v4.prompts[1][1:9], version=3
    )


def published_names(hf_dir: Path) -> None:
    """Renames the fixture's tensors to the names DeepSeek publishes V4 with (no `model.`
    prefix, `embed.weight`, `hc_head_fn`, ...), as transformers' conversion mapping reads them."""
    header, data = read_safetensors(hf_dir / "model.safetensors")
    renamed = {}
    for name, meta in header.items():
        if name == "__metadata__":
            renamed[name] = meta
            continue
        bare = name.removeprefix("model.")
        bare = {
            "embed_tokens.weight": "embed.weight",
            "hc_head.hc_fn": "hc_head_fn",
            "hc_head.hc_base": "hc_head_base",
            "hc_head.hc_scale": "hc_head_scale",
        }.get(bare, bare)
        renamed[bare] = meta
    assert "layers.0.attn.wq_a.weight" in renamed and "head.weight" in renamed
    (hf_dir / "model.safetensors").unlink()
    write_safetensors(hf_dir / "model-published.safetensors", renamed, data)


def test_a_checkpoint_under_deepseeks_published_names_converts_the_same(tmp_path, converted):
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / ARCH / "hf", hf)
    published_names(hf)
    convert(hf, tmp_path / "out", "f32")
    prompt = Reference(ARCH).prompts[2]
    ours = Engine(tmp_path / "out", threads=1).logits(prompt)
    want = Engine(converted(ARCH, "f32"), threads=1).logits(prompt)
    assert np.array_equal(ours, want)


def test_a_hash_table_naming_an_expert_past_the_last_is_refused(tmp_path):
    """At conversion, before anything is written (found by fuzzing: such a checkpoint once
    converted into a directory that would not load); and at load, in a directory whose stored
    table was changed after conversion."""
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / ARCH / "hf", hf)
    path = hf / "model.safetensors"
    header, data = read_safetensors(path)
    meta = header["model.layers.1.ffn.gate.tid2eid"]
    assert meta["dtype"] == "I64"
    top_k = meta["shape"][1]
    experts = hf_config()["n_routed_experts"]
    at = meta["data_offsets"][0] + 8 * (5 * top_k + 1)  # token 5's second expert
    write_safetensors(path, header, data[:at] + struct.pack("<q", experts) + data[at + 8 :])
    with pytest.raises((ValueError, RuntimeError)) as exc:
        convert(hf, tmp_path / "refused", "f32")
    message = str(exc.value)
    assert "gate.tid2eid" in message and f"expert id below {experts}" in message, message
    assert not (tmp_path / "refused" / "manifest.json").exists()

    out = tmp_path / "out"
    convert(FIXTURES / ARCH / "hf", out, "f32")
    manifest = json.loads((out / "manifest.json").read_text())
    entry = manifest["resident"]["tensors"]["layers.1.hash"]
    assert entry["dtype"] == "f32"
    with open(out / manifest["resident"]["file"], "r+b") as f:
        f.seek(entry["offset"] + 4 * (5 * top_k + 1))
        f.write(struct.pack("<f", float(experts)))
    with pytest.raises((ValueError, RuntimeError, OSError)) as exc:
        Engine(out, threads=1)
    assert "layers.1.hash" in str(exc.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_key_value_heads", 2),
        ("o_groups", 3),
        ("layer_types", ["sliding_attention", "dense", "sliding_attention", "sliding_attention"]),
        ("layer_types", ["sliding_attention"]),
        ("mlp_layer_types", ["hash_moe", "moe", "moe", "topk"]),
        ("scoring_func", "softmax"),
        ("n_shared_experts", 2),
        ("partial_rotary_factor", 0.0625),
        ("swiglu_limit", -1.0),
        ("hc_mult", 0),
        ("index_head_dim", 4),
        ("moe_intermediate_size", None),
    ],
)
def test_a_malformed_config_is_refused_by_name(tmp_path, field, value):
    assert field in conversion_refusal(tmp_path, ARCH, field, value)


def test_the_architecture_is_known_and_chats_as_deepseek_v4():
    from colibri.chat.families import detect_family

    assert dict(architectures())["DeepseekV4ForCausalLM"] == "deepseek_v4"
    family = detect_family("DeepseekV4ForCausalLM", None)
    assert family.name == "deepseek_v4"
    # DeepSeek publishes V4's chat format as code: a checkpoint without a template gets
    # colibri's (tests/test_dsml_templates.py checks it against that code).
    assert family.builtin_template == "deepseek_v4.jinja"
