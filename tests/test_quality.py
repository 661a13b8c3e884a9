"""Perplexity and KL divergence (colibri.quality, `colibri eval-ppl`): the formulas, the chunking
llama-perplexity uses, and the figures of the real engine against transformers' own logits."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from colibri import Engine
from colibri.quality import chunks, evaluate, kl_divergence, log_softmax

from .conftest import ARCHS, FIXTURES

logit_rows = arrays(
    np.float32,
    st.tuples(st.integers(1, 4), st.integers(2, 40)),
    elements=st.floats(-30, 30, width=32),
)


@settings(max_examples=200, deadline=None)
@given(logit_rows, st.floats(-50, 50))
def test_log_softmax_is_normalised_and_shift_free(x, shift):
    lp = log_softmax(x)
    assert np.allclose(np.exp(lp).sum(axis=-1), 1.0, atol=1e-12)
    assert np.allclose(log_softmax(x.astype(np.float64) + shift), lp, atol=1e-9)
    # Each entry against a direct evaluation in Python floats.
    row = [float(v) for v in x[0]]
    top = max(row)
    total = math.fsum(math.exp(v - top) for v in row)
    for j, v in enumerate(row):
        assert lp[0, j] == pytest.approx(v - top - math.log(total), abs=1e-9)


@settings(max_examples=200, deadline=None)
@given(logit_rows, st.data())
def test_kl_is_zero_only_against_itself_and_never_negative(x, data):
    other = data.draw(arrays(np.float32, x.shape, elements=st.floats(-30, 30, width=32)))
    p, q = log_softmax(x), log_softmax(other)
    assert np.allclose(kl_divergence(p, p), 0.0, atol=1e-12)
    kl = kl_divergence(p, q)
    assert (kl >= -1e-12).all()
    # Direct sum of p log(p/q) per row.
    for i in range(x.shape[0]):
        pi, qi = np.exp(p[i]), np.exp(q[i])
        want = math.fsum(
            float(a * (math.log(a) - math.log(b))) for a, b in zip(pi, qi, strict=True) if a > 0
        )
        assert kl[i] == pytest.approx(want, rel=1e-6, abs=1e-9)


@given(st.integers(0, 200), st.integers(1, 50))
def test_chunks_are_whole_and_in_order(n, ctx):
    tokens = list(range(n))
    got = list(chunks(tokens, ctx))
    assert len(got) == n // ctx
    assert [t for c in got for t in c] == tokens[: len(got) * ctx]


class _Reference:
    """transformers' logits of one fixture prompt (reference.npz), as a model of that prompt."""

    def __init__(self, prompt: list[int], logits: np.ndarray) -> None:
        self.prompt, self._logits = prompt, logits

    def logits(self, ids: list[int]) -> np.ndarray:
        assert ids == self.prompt
        return self._logits


@pytest.mark.parametrize("arch", ARCHS)
def test_the_engine_scores_a_prompt_as_transformers_does(arch, converted):
    """The f32 engine's perplexity on a fixture prompt equals the one from transformers' logits,
    and its KL from them is f32 rounding; int4 moves both."""
    z = np.load(FIXTURES / arch / "reference.npz")
    prompt = max((z[k].tolist() for k in z.files if k.startswith("prompt_")), key=len)
    i = next(i for i in range(3) if z[f"prompt_{i}"].tolist() == prompt)
    ref = _Reference(prompt, z[f"logits_{i}"])
    ctx = len(prompt)
    want = evaluate(ref, prompt, ctx)
    f32 = evaluate(Engine(converted(arch, "f32")), prompt, ctx, reference=ref)
    assert f32.scored_tokens == want.scored_tokens == ctx - ctx // 2 - 1
    assert f32.ppl == pytest.approx(want.ppl, rel=1e-4)
    assert f32.kl_mean is not None and f32.kl_mean < 1e-6
    assert f32.same_top == 1.0
    int4 = evaluate(Engine(converted(arch, "int4")), prompt, ctx, reference=ref)
    assert int4.kl_mean is not None and int4.kl_mean > 1e-5
    assert int4.ppl != pytest.approx(want.ppl, rel=1e-4)


def _eval_ppl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", "eval-ppl", "--threads", "1", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_eval_ppl_cli_reports_llama_perplexity_figures(converted, tmp_path):
    f32, int4 = converted("olmoe", "f32"), converted("olmoe", "int4")
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    n_tokens = len(Engine(f32).tokenize(text.read_text(encoding="utf-8")))
    big = _eval_ppl("--model", str(f32), "--text", str(text))  # --ctx 512 by default
    assert big.returncode == 2 and "above the model's context (256)" in big.stderr, big.stderr
    short = tmp_path / "short.txt"
    short.write_text("The quick brown fox.", encoding="utf-8")
    few = _eval_ppl("--model", str(f32), "--text", str(short), "--ctx", "64")
    assert few.returncode == 2 and "fewer than one chunk of 64" in few.stderr, few.stderr
    ctx = 32
    same = _eval_ppl(
        "--model",
        str(f32),
        "--reference",
        str(f32),
        "--text",
        str(text),
        "--ctx",
        str(ctx),
        "--json",
    )
    assert same.returncode == 0, same.stderr
    r = json.loads(same.stdout)
    assert r["text_tokens"] == n_tokens
    assert r["chunks"] == n_tokens // ctx
    assert r["scored_tokens"] == r["chunks"] * (ctx - ctx // 2 - 1)
    assert r["kl_mean"] == 0.0 and r["same_top"] == 1.0
    assert math.isfinite(r["ppl"]) and r["ppl"] > 1
    q = _eval_ppl(
        "--model",
        str(int4),
        "--reference",
        str(f32),
        "--text",
        str(text),
        "--ctx",
        str(ctx),
        "--chunks",
        "2",
    )
    assert q.returncode == 0, q.stderr
    assert "PPL" in q.stdout and "KL from" in q.stdout and f"2 chunks of {ctx}" in q.stdout
    bad = _eval_ppl("--model", str(f32), "--text", str(tmp_path / "missing.txt"))
    assert bad.returncode == 2 and "missing.txt" in bad.stderr
