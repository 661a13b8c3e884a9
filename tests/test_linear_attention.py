"""The linear-attention hybrids, Qwen3-Next (gated DeltaNet + gated attention) and Kimi Linear
(Kimi Delta Attention + MLA without positions): the linear layers' fixed-size state in slots (no
per-position KV), prefix reuse from state snapshots and slot-file restarts give the tokens of a
cold run, the state in version-2 slot files, and malformed configs refused by name. (Parity
with transformers: tests/test_reference.py.)"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from colibri._engine import architectures
from colibri.runtime.engine import Engine

from .conftest import FIXTURES, Reference, assert_a_slot_file_restart_is_cold, conversion_refusal

HYBRIDS = ["qwen3_next", "qwen3_next_ratios", "kimi_linear", "kimi_linear_lora"]


@pytest.fixture(params=HYBRIDS)
def qn(request) -> Reference:
    return Reference(request.param)


def hf_config(arch: str) -> dict:
    return json.loads((FIXTURES / arch / "hf" / "config.json").read_text())


@dataclass
class Layout:
    """What a hybrid's config says its layers keep, computed from config.json alone."""

    linear: list[bool]
    # Values per token of one full-attention layer (keys and values, or MLA's latent + rope key).
    kv_values_per_token: int
    # Floats of one linear layer's state: the convolution window, then every head's S.
    state_floats: int


def layout(cfg: dict) -> Layout:
    n = cfg["num_hidden_layers"]
    if cfg["model_type"] == "kimi_linear":
        lin = cfg.get("linear_attn_config") or {}
        if "layer_types" in cfg:
            linear = [t == "linear_attention" for t in cfg["layer_types"]]
        else:
            linear = [i + 1 in lin["kda_layers"] for i in range(n)]
        heads = lin.get("num_heads", cfg.get("linear_num_heads"))
        hd = lin.get("head_dim", cfg.get("linear_head_dim"))
        conv = lin.get("short_conv_kernel_size", cfg.get("linear_conv_kernel_dim"))
        return Layout(
            linear,
            cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"],
            (conv - 1) * 3 * heads * hd + heads * hd * hd,
        )
    if "layer_types" in cfg:
        linear = [t == "linear_attention" for t in cfg["layer_types"]]
    else:
        every = cfg.get("full_attention_interval", 4)
        linear = [(i + 1) % every != 0 for i in range(n)]
    nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    hk, hv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    channels = 2 * nk * hk + nv * hv
    return Layout(
        linear,
        2 * cfg["num_key_value_heads"] * cfg["head_dim"],
        (cfg["linear_conv_kernel_dim"] - 1) * channels + nv * hk * hv,
    )


def test_only_the_full_attention_layers_keep_kv_per_position(qn, converted):
    lay = layout(hf_config(qn.arch))
    full = lay.linear.count(False)
    assert 0 < full < len(lay.linear)
    for quant, width in [("f32", 4), ("int4", 2)]:
        info = Engine(converted(qn.arch, quant), threads=1).info
        assert info["kv_bytes_per_token"] == full * lay.kv_values_per_token * width


def test_the_state_per_slot_is_reported_and_counted_at_startup(qn, converted):
    lay = layout(hf_config(qn.arch))
    info = Engine(converted(qn.arch, "int4"), threads=1).info
    assert info["state_bytes_per_slot"] == lay.linear.count(True) * lay.state_floats * 4
    from colibri import cli

    line = cli.kv_report(2, info)
    assert f"(2 slot(s) x 5 copies x {info['state_bytes_per_slot']} bytes)" in line


def test_prefix_reuse_gives_the_tokens_of_a_cold_run(qn, converted):
    for quant in ["f32", "int4"]:
        engine = Engine(converted(qn.arch, quant), threads=2, slots=2)
        prompt = qn.prompts[1]
        first = engine.generate(prompt, 6, slot=1)
        out = list(first)
        history = prompt + out[:-1]
        assert engine.slot_info(1)["tokens"] == history
        # The next turn continues the history: its state resumes from the end-of-turn snapshot.
        longer = history + qn.prompts[2][1:12]
        warm = engine.generate(longer, 8, slot=1)
        got = list(warm)
        assert warm.reused_tokens == len(history)
        assert got == list(engine.generate(longer, 8)), quant
        # Leaving the history part way through the first prompt: no snapshot there, so the
        # state goes back to the last one before it (the start) and the prompt is recomputed.
        branch = history[:5] + qn.prompts[0]
        again = engine.generate(branch, 5, slot=1)
        assert list(again) == list(engine.generate(branch, 5))
        assert again.reused_tokens < 5


def test_a_slot_file_restart_gives_the_tokens_of_a_cold_run(qn, converted, tmp_path):
    # The file is version 2 (state records beside the position records).
    assert_a_slot_file_restart_is_cold(
        converted(qn.arch, "int4"), tmp_path / "kv", qn.prompts[2], qn.prompts[1][1:6], version=2
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("linear_num_value_heads", 3),
        ("layer_types", ["linear_attention", "sliding", "full_attention", "linear_attention"]),
        ("layer_types", ["linear_attention"]),
        ("attention_bias", True),
        ("num_experts", None),
        ("mlp_only_layers", "1"),
    ],
)
def test_a_malformed_qwen3_next_config_is_refused_by_name(tmp_path, field, value):
    assert field in conversion_refusal(tmp_path, "qwen3_next", field, value)


@pytest.mark.parametrize(
    ("arch", "field", "value", "named"),
    [
        ("kimi_linear", "layer_types", ["linear_attention", "mla"], "layer_types"),
        ("kimi_linear", "mlp_layer_types", ["dense", "moe", "dense", "sparse", "sparse"], "mlp"),
        ("kimi_linear", "mla_use_nope", False, "mla_use_nope"),
        ("kimi_linear", "attention_bias", True, "attention_bias"),
        ("kimi_linear", "num_experts", None, "`num_experts`"),
        ("kimi_linear", "num_expert_group", 3, "num_expert_group 3"),
        ("kimi_linear", "q_lora_rank", 0, "q_lora_rank"),
        (
            "kimi_linear_lora",
            "linear_attn_config",
            {"full_attn_layers": [3, 4], "kda_layers": [1]},
            "layer 2",
        ),
        (
            "kimi_linear_lora",
            "linear_attn_config",
            {"full_attn_layers": [3, 4], "kda_layers": [1, 2, 9]},
            "kda_layers",
        ),
        (
            "kimi_linear_lora",
            "linear_attn_config",
            {"full_attn_layers": [1, 3, 4], "kda_layers": [1, 2]},
            "twice",
        ),
    ],
)
def test_a_malformed_kimi_linear_config_is_refused_by_name(tmp_path, arch, field, value, named):
    assert named in conversion_refusal(tmp_path, arch, field, value)


def test_the_architectures_are_known_and_chat_in_their_families():
    from colibri.chat.families import detect_family

    assert dict(architectures())["Qwen3NextForCausalLM"] == "qwen3"
    assert detect_family("Qwen3NextForCausalLM", None).name == "qwen3"
    assert dict(architectures())["KimiLinearForCausalLM"] == "kimi_k2"
    assert detect_family("KimiLinearForCausalLM", None).name == "kimi_k2"
