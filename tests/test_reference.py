"""The engine against transformers: f32 logits, greedy continuations, int4 error, every kernel."""

from __future__ import annotations

import numpy as np
import pytest

from colibri import Engine
from colibri._engine import available_kernels

from .conftest import run_engine_script


def rel_max(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def rel_fro(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def test_f32_logits_match_transformers(reference, converted):
    eng = Engine(converted(reference.arch, "f32"))
    for prompt, ref in zip(reference.prompts, reference.logits, strict=True):
        ours = eng.logits(prompt)
        assert ours.shape == ref.shape
        assert rel_max(ours, ref) < 1e-4, f"{reference.arch}: prompt of {len(prompt)} tokens"


def test_f32_greedy_generation_matches_transformers(reference, converted):
    eng = Engine(converted(reference.arch, "f32"))
    for prompt, want in zip(reference.prompts, reference.greedy, strict=True):
        got = list(eng.generate(prompt, max_tokens=len(want)))
        assert got == want


# Fixtures whose int4 error is known to exceed the Q4_0 anchor, and why. The anchor is
# transformers' forward pass with Q4_0-rounded weights and f32 activations; colibri's int4 path
# also rounds activations to 8 bits and keeps f16 keys. Against Q4_0 rounding on colibri's own
# engine (the same activations: the engine's `int4_no_worse_than_q4_0_on_every_fixture` and
# `int4_below_q4_0_on_random_shapes`, over 24 prompts) every fixture, these four included,
# lands below 1.0x. On this test's three prompts (43 positions) these tiny random models are
# saturated (every 4-bit rounding leaves logits 0.3-0.9 away from f32), and which rounding lands
# lower is close to chance: measured 2026-12-07, colibri's own Q4_0 rounding scored here lands
# above colibri's int4 on deepseek_v32 (1.030x), qwen3_next (1.041x), glm_moe_dsa_yarn
# (1.021x) and deepseek_v4 (1.006x), and within 0.91-1.05x of this anchor on every fixture.
INT4_ABOVE_Q4_0 = {
    # The DSA fixtures: the indexer's top-k flips under any 4-bit rounding of these tiny random
    # models, so Q4_0 and colibri's int4 both leave the logits nearly uncorrelated with f32
    # (glm_moe_dsa_shared, the fourth, lands below). Relative errors with kv_b_proj split as
    # llama.cpp stores it (issue 31), int4 vs Q4_0 (2026-12-07):
    "glm_moe_dsa_yarn": "DSA top-k flips: int4 0.772 vs Q4_0 0.766 (issue 33)",
    "deepseek_v32": "DSA top-k flips: int4 0.797 vs Q4_0 0.779 (issue 33)",
    "glm_moe_dsa": "DSA top-k flips: int4 0.710 vs Q4_0 0.705 (issue 33)",
    # DeepSeek-V4's tiny random model: the error is spread over every matrix (keeping any one
    # kind f32 moves it 0.39-0.46) and is there without the indexer's selection too (top-k
    # past every entry: int4 0.4395 vs Q4_0 0.4334), so which 4-bit rounding lands lower is
    # again close to chance here (1.7% apart).
    "deepseek_v4": "spread rounding error: int4 0.449 vs Q4_0 0.442 (issue 33)",
}


def test_int4_logit_error_no_worse_than_q4_0(reference, converted, request):
    """The int4 quantizer against Q4_0 on the same matrices: every matrix int4 (`--pure`)."""
    if reference.arch in INT4_ABOVE_Q4_0:
        request.applymarker(pytest.mark.xfail(strict=True, reason=INT4_ABOVE_Q4_0[reference.arch]))
    eng = Engine(converted(reference.arch, "int4-pure"))
    ours = np.concatenate([eng.logits(p) for p in reference.prompts])
    ref = np.concatenate(reference.logits)
    err = rel_fro(ours, ref)
    assert err <= reference.q4_0_rel_error_all, (
        f"{reference.arch}: int4 error {err:.4f} vs Q4_0 anchor {reference.q4_0_rel_error_all:.4f}"
    )


# The table grid above the anchor on this test's 43 positions, measured 2026-12-07 (table vs
# Q4_0 anchor; the linear grid's int4 in brackets). Against colibri's own Q4_0 rounding over
# the engine test's 24 prompts (`int4_no_worse_than_q4_0_on_every_fixture`) the table grid
# lands below Q4_0 on every fixture (0.885-0.984x); on these three prompts the saturated tiny
# models move either way (olmoe 0.788x, glm4_moe 0.791x, qwen3_next_ratios 0.827x below).
TABLE_ABOVE_Q4_0 = {
    "glm_moe_dsa": "DSA top-k flips: table 0.770 vs Q4_0 0.705 (int4 0.710)",
    "glm_moe_dsa_yarn": "DSA top-k flips: table 0.805 vs Q4_0 0.766 (int4 0.772)",
    "deepseek_v32": "DSA top-k flips: table 0.885 vs Q4_0 0.779 (int4 0.797)",
    "deepseek_v4": "spread rounding error: table 0.450 vs Q4_0 0.442 (int4 0.449)",
    "qwen3_next": "3 prompts, saturated: table 0.740 vs Q4_0 0.713 (int4 0.677)",
}


def test_table_grid_logit_error_no_worse_than_q4_0(reference, converted, request):
    """The table grid (`--pure --grid table`: 16 levels denser near zero, the same bits per
    weight) against the same Q4_0 anchor, on every fixture."""
    if reference.arch in TABLE_ABOVE_Q4_0:
        reason = TABLE_ABOVE_Q4_0[reference.arch]
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    eng = Engine(converted(reference.arch, "int4-table"))
    ours = np.concatenate([eng.logits(p) for p in reference.prompts])
    err = rel_fro(ours, np.concatenate(reference.logits))
    assert err <= reference.q4_0_rel_error_all, (
        f"{reference.arch}: table-grid error {err:.4f} vs Q4_0 anchor "
        f"{reference.q4_0_rel_error_all:.4f}"
    )


# The prompt each fixture's kernel check runs (default: the longest), and why not the longest.
KERNEL_PROMPT = {
    # In the int4 model, position 22 of prompt 2 sits on a router near-tie that AVX-512's
    # summation order flips (it still flips with the indexer attending every entry; AVX2 equals
    # scalar there); the compressed entries and windows carry it to every later position
    # (5e-3-1e-2), where other families' caches move them only slightly.
    "deepseek_v4": 1,
}


@pytest.mark.parametrize("kernel", ["avx2", "avx512"])
@pytest.mark.parametrize("quant", ["int4", "int4-table"])
def test_every_kernel_matches_the_scalar_path(reference, converted, kernel, quant):
    if kernel not in available_kernels():
        pytest.skip(f"{kernel} not available on this CPU")
    model = converted(reference.arch, quant)
    prompt = reference.prompts[KERNEL_PROMPT.get(reference.arch, 2)]
    scalar = Engine(model, kernel="scalar").logits(prompt)
    fast = Engine(model, kernel=kernel).logits(prompt)
    # Kernels sum groups in different orders (~1e-7 apart). Where a token's router sits on a
    # near-tie that can flip one expert choice and move that position's logits (and, through
    # its K/V, later ones slightly); so: nearly all positions exact, the typical one at noise.
    per_position = np.abs(fast - scalar).max(axis=1) / np.abs(scalar).max()
    assert np.median(per_position) < 1e-5
    assert (per_position < 1e-4).mean() >= 0.8


def test_f32_kernels_agree(reference, converted):
    model = converted(reference.arch, "f32")
    prompt = reference.prompts[1]
    outs = [Engine(model, kernel=k).logits(prompt) for k in available_kernels()]
    for o in outs[1:]:
        assert rel_max(o, outs[0]) < 1e-5


def test_incremental_decode_equals_full_forward(reference, converted):
    """Logits of tokens fed one by one through the KV cache equal a one-shot forward pass."""
    eng = Engine(converted(reference.arch, "f32"))
    prompt = reference.prompts[1]
    full = eng.logits(prompt + reference.greedy[1][:4])
    # Greedy generation feeds its own tokens back: its picks are the full pass's argmaxes.
    got = list(eng.generate(prompt, max_tokens=5))
    assert got == [int(x) for x in full[len(prompt) - 1 :].argmax(axis=1)]


def test_avx2_kernel_gives_the_same_logits_with_and_without_avx_vnni(reference, converted):
    """AVX-VNNI changes how the AVX2 kernel forms its exact integer dot products, not what they
    are: the logits are the same bits with COLI_AVX_VNNI=0 (decided once per process)."""
    if "avx2" not in available_kernels():
        pytest.skip("avx2 not available on this CPU")
    model = converted(reference.arch, "int4")
    prompt = reference.prompts[2]
    code = (
        "import sys, json; from colibri import Engine; e = Engine(sys.argv[1], kernel='avx2'); "
        f"print(json.dumps(e.info['kernel_avx_vnni'])); print(e.logits({prompt!r}).tobytes().hex())"
    )

    def run(setting: str) -> tuple[bool, bytes]:
        out = run_engine_script(code, model, {"COLI_AVX_VNNI": setting}).stdout
        flag, logits = out.split()
        return flag == "true", bytes.fromhex(logits)

    plain_flag, plain = run("0")
    auto_flag, auto = run("1")
    assert not plain_flag
    assert auto_flag == Engine(model, kernel="avx2").info["kernel_avx_vnni"]
    assert plain == auto
    assert len(plain) == len(prompt) * Engine(model).info["vocab_size"] * 4
