"""The Python API contract: Engine, tokenize/detokenize, logits, generate, info."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import Engine

from .conftest import FIXTURES, run_engine_script


@pytest.fixture(scope="module")
def glm(converted) -> Engine:
    return Engine(converted("glm4_moe", "int4"))


def test_info_describes_the_model(glm):
    info = glm.info
    assert info["architecture"] == "Glm4MoeForCausalLM"
    assert info["vocab_size"] == 509
    assert info["context_length"] == 256
    assert info["quantization"] == "int4"
    assert info["kernel"] in ("scalar", "avx2", "avx512")
    assert info["kernel_prefetch"] in ("l1", "l2", "off")
    assert info["kernel_prefetch_decode"] == _decode_prefetch_default()


def _decode_prefetch_default() -> str:
    # No software prefetch in the one-token loops on AMD CPUs, L2 elsewhere (quant::prefetch).
    cpuinfo = Path("/proc/cpuinfo").read_text()
    return "off" if "AuthenticAMD" in cpuinfo else "l2"


@pytest.mark.parametrize("level", ["l1", "l2", "L2 ", "off"])
def test_kernel_prefetch_override_reaches_the_engine(converted, level):
    # The greedy tokens must not depend on the level (a prefetch is only a hint).
    model = converted("glm4_moe", "int4")
    code = (
        "import json, sys; from colibri import Engine; e = Engine(sys.argv[1]); "
        "print(json.dumps([e.info['kernel_prefetch'], e.info['kernel_prefetch_decode'], "
        "list(e.generate([1, 2, 3], 8))]))"
    )
    got_level, got_decode, tokens = json.loads(
        run_engine_script(code, model, {"COLI_KERNEL_PREFETCH": level}).stdout
    )
    assert got_level == got_decode == level.strip().lower()
    assert tokens == list(Engine(model).generate([1, 2, 3], 8))


def test_kernel_prefetch_unknown_value_warns_and_runs(converted):
    model = converted("glm4_moe", "int4")
    code = (
        "import sys; from colibri import Engine; i = Engine(sys.argv[1]).info; "
        "print(i['kernel_prefetch'], i['kernel_prefetch_decode'])"
    )
    out = run_engine_script(code, model, {"COLI_KERNEL_PREFETCH": "l3"})
    assert out.stdout.split() == ["l2", _decode_prefetch_default()]  # the defaults
    assert "COLI_KERNEL_PREFETCH=l3: unknown level (expected l1|l2|off)" in out.stderr


def test_tokenize_matches_the_hf_tokenizer(glm):
    cases = json.loads((FIXTURES / "glm4_moe" / "tokenizer_cases.json").read_text())
    for case in cases["encode"]:
        assert glm.tokenize(case["text"]) == case["ids"], case["text"]
        assert glm.detokenize(case["ids"]) == case["text"]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_detokenize_inverts_tokenize(glm, text):
    assert glm.detokenize(glm.tokenize(text)) == text


def test_logits_shape_and_dtype(glm):
    out = glm.logits([1, 17, 42])
    assert out.shape == (3, 509) and out.dtype == np.float32
    assert np.isfinite(out).all()


def test_logits_of_empty_or_out_of_vocab_input_is_refused(glm):
    with pytest.raises(ValueError):
        glm.logits([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        glm.logits([1, 509])


def test_generate_respects_max_tokens(glm):
    assert len(list(glm.generate([1, 2, 3], max_tokens=7))) == 7
    assert list(glm.generate([1, 2, 3], max_tokens=0)) == []


def test_generate_stops_at_a_stop_token_and_yields_it(glm):
    free = list(glm.generate([1, 30, 40], max_tokens=8))
    stop = free[3]
    first = free.index(stop)
    got = list(glm.generate([1, 30, 40], max_tokens=8, stop_token_ids=[stop]))
    assert got == free[: first + 1]


def test_generate_is_deterministic_greedy_and_seeded(glm):
    a = list(glm.generate([1, 5], max_tokens=6))
    assert a == list(glm.generate([1, 5], max_tokens=6))
    s1 = list(glm.generate([1, 5], max_tokens=12, temperature=1.0, seed=7))
    s2 = list(glm.generate([1, 5], max_tokens=12, temperature=1.0, seed=7))
    assert s1 == s2


def test_generation_stops_at_the_context_length(glm):
    ctx = glm.info["context_length"]
    prompt = [7] * (ctx - 3)
    assert len(list(glm.generate(prompt, max_tokens=50))) == 4


def test_prompt_longer_than_the_context_is_refused(glm):
    with pytest.raises(ValueError, match="context length"):
        next(glm.generate([7] * 300, max_tokens=1))


def test_bad_sampling_options_are_refused(glm):
    with pytest.raises(ValueError):
        glm.generate([1], max_tokens=1, top_p=0.0)
    with pytest.raises(ValueError):
        glm.generate([1], max_tokens=1, temperature=-1.0)


def test_closed_generation_yields_nothing_more(glm):
    it = glm.generate([1, 2], max_tokens=50)
    next(it)
    it.close()
    assert list(it) == []


def test_generation_releases_the_gil(converted):
    """Another Python thread keeps running while tokens are computed. Only the ticks counted
    while an engine call runs are kept: with the GIL held there they would be none (the main
    thread never returns to Python during the call), whatever the machine's load; released,
    the ticker runs whenever it gets a core (under a load of 10 on 2 cores the old count of
    all ticks over 0.3 s fell to 91, while these stay in the hundreds)."""
    eng = Engine(converted("olmoe", "f32"), threads=1)
    ticks = 0
    done = threading.Event()

    def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            time.sleep(0)

    t = threading.Thread(target=ticker)
    t.start()
    in_calls = 0
    busy = 0.0
    prompt = [(i * 7 + 1) % eng.info["vocab_size"] for i in range(200)]
    try:
        while busy < 0.3:
            stream = eng.generate(prompt, max_tokens=1)
            before, t0 = ticks, time.perf_counter()
            next(stream)  # the whole prefill and the first token: one engine call
            busy += time.perf_counter() - t0
            in_calls += ticks - before
            stream.close()
    finally:
        done.set()
        t.join()
    assert in_calls > 50, (in_calls, busy)


def test_engine_refuses_a_directory_that_is_not_a_model(tmp_path):
    with pytest.raises(RuntimeError, match="not a colibri model directory"):
        Engine(tmp_path)


def test_unknown_kernel_is_refused(converted):
    with pytest.raises(ValueError, match="unknown kernel"):
        Engine(converted("olmoe", "int4"), kernel="neon9000")


def test_a_corrupt_tokenizer_is_named(converted, tmp_path):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(converted("olmoe", "int4"), model)
    (model / "tokenizer.json").write_text("{ not json")
    with pytest.raises(RuntimeError, match="tokenizer.json"):
        Engine(model)


def test_concurrent_generations_on_one_engine_match_sequential_ones(glm):
    prompts = [[1, 2, 3], [1, 40, 41, 42], [7], [1, 100, 200]]
    want = [list(glm.generate(p, max_tokens=12)) for p in prompts]
    got: list[list[int]] = [[] for _ in prompts]

    def run(i: int) -> None:
        got[i] = list(glm.generate(prompts[i], max_tokens=12))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want


def test_kv_dtype_follows_the_weights_and_the_override(converted, monkeypatch):
    monkeypatch.delenv("COLI_KV_DTYPE", raising=False)
    int4 = Engine(converted("glm4_moe", "int4"))
    f32 = Engine(converted("glm4_moe", "f32"))
    assert int4.info["kv_dtype"] == "f16" and f32.info["kv_dtype"] == "f32"
    monkeypatch.setenv("COLI_KV_DTYPE", "f32")
    wide = Engine(converted("glm4_moe", "int4"))
    assert wide.info["kv_dtype"] == "f32"
    assert wide.info["kv_bytes_per_token"] == 2 * int4.info["kv_bytes_per_token"]
    # f16 keys and values move the logits far less than int4 weights do (relative, Frobenius:
    # ~2% against ~46% on this random fixture; ~3e-4 with f32 weights).
    ids = int4.tokenize("The quick brown fox jumps over the lazy dog, again and again.")
    a, b, ref = int4.logits(ids), wide.logits(ids), f32.logits(ids)

    def rel(x, y):
        return float(np.linalg.norm(x - y) / np.linalg.norm(y))

    assert not np.array_equal(a, b)
    assert rel(a, b) < 0.1 * rel(b, ref)
    monkeypatch.setenv("COLI_KV_DTYPE", "bf16")
    with pytest.raises(Exception, match="COLI_KV_DTYPE"):
        Engine(converted("glm4_moe", "int4"))


def test_long_prompts_run_in_chunks_with_the_same_results(converted, monkeypatch):
    model = converted("qwen3_moe", "int4")
    monkeypatch.delenv("COLI_PREFILL_CHUNK", raising=False)
    whole = Engine(model)
    assert whole.info["prefill_chunk"] == 512
    monkeypatch.setenv("COLI_PREFILL_CHUNK", "7")
    chunked = Engine(model)
    assert chunked.info["prefill_chunk"] == 7
    ids = [(i * 31 + 3) % whole.info["vocab_size"] for i in range(60)]
    assert np.array_equal(whole.logits(ids), chunked.logits(ids))
    assert list(whole.generate(ids, 12)) == list(chunked.generate(ids, 12))


def test_prefill_chunk_setting_that_is_not_a_number_warns_and_runs(converted):
    model = converted("qwen3_moe", "int4")
    code = (
        "import sys; from colibri import Engine; print(Engine(sys.argv[1]).info['prefill_chunk'])"
    )
    out = run_engine_script(code, model, {"COLI_PREFILL_CHUNK": "0"})
    assert out.stdout.strip() == "512"
    assert "COLI_PREFILL_CHUNK=0: expected a number of positions >= 1" in out.stderr
