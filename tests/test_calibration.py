"""Importance-weighted int4 (`colibri convert --calibration`, issue 33 item 3): the weighted
quantizer against max-abs scaling, the statistics the real engine records on a real (fixture)
model against a NumPy computation of the same activations, the manifest's record, unchanged
bytes without a calibration, and the refusals."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from colibri import Engine, _engine, convert
from colibri.runtime.engine import CALIBRATION_CTX

from .conftest import FIXTURES

GROUP = 32
TINY = float(np.float32(1e-39))  # subnormal in f32
TINY_W = float(np.float32(1e-30))

# --- the weighted quantizer ----------------------------------------------------------------


def _weighted_errors(x: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per group: the weighted squared error of the weighted search and of Q4_0's max-abs
    round-to-nearest, on one row `x` with column weights `w` (float64 sums)."""
    cols = len(x)
    raw, wb = x.astype("<f4").tobytes(), w.astype("<f4").tobytes()
    out = []
    for rtn in (False, True):
        q = _engine.quantize_q4(raw, 1, cols, None if rtn else wb, rtn)
        d = np.frombuffer(_engine.dequantize_q4(q, 1, cols), "<f4").astype(np.float64)
        e = w.astype(np.float64) * (x.astype(np.float64) - d) ** 2
        out.append(np.add.reduceat(e, np.arange(0, cols, GROUP)))
    return out[0], out[1]


def _group(kind: str, draw) -> list[float]:
    f = st.floats(-1e3, 1e3, width=32, allow_subnormal=True)
    if kind == "random":
        return draw(st.lists(f, min_size=GROUP, max_size=GROUP))
    if kind == "zeros":
        return [0.0] * GROUP
    if kind == "constant":
        return [draw(f)] * GROUP
    if kind == "outlier":
        small = draw(st.lists(st.floats(-1, 1, width=32), min_size=GROUP, max_size=GROUP))
        small[draw(st.integers(0, GROUP - 1))] = draw(st.sampled_from([-1, 1])) * draw(
            st.floats(10, 1e3, width=32)
        )
        return small
    # subnormal magnitudes
    return draw(st.lists(st.floats(-TINY, TINY, width=32), min_size=GROUP, max_size=GROUP))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_weighted_error_never_exceeds_max_abs_scalings(data):
    kinds = data.draw(
        st.lists(
            st.sampled_from(["random", "zeros", "constant", "outlier", "subnormal"]),
            min_size=1,
            max_size=3,
        )
    )
    x = np.array([v for k in kinds for v in _group(k, data.draw)], dtype=np.float32)
    wk = st.one_of(st.just(0.0), st.floats(0, 1e4, width=32), st.floats(0, TINY_W, width=32))
    w = np.array(data.draw(st.lists(wk, min_size=len(x), max_size=len(x))), dtype=np.float32)
    ours, rtn = _weighted_errors(x, w)
    # Both are evaluated in f32 inside the quantizer; allow its rounding.
    assert (ours <= rtn * (1 + 1e-5) + 1e-37).all(), (kinds, ours, rtn)


def test_weights_move_the_error_to_unimportant_columns():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(64 * GROUP).astype(np.float32)
    w = np.where(rng.random(x.size) < 0.25, 100.0, 1.0).astype(np.float32)
    raw = x.tobytes()
    plain = np.frombuffer(
        _engine.dequantize_q4(_engine.quantize_q4(raw, 1, x.size), 1, x.size), "<f4"
    )
    weighted = np.frombuffer(
        _engine.dequantize_q4(_engine.quantize_q4(raw, 1, x.size, w.tobytes()), 1, x.size),
        "<f4",
    )
    important = w > 1

    def err(d, m):
        return float(((x - d)[m].astype(np.float64) ** 2).sum())

    assert err(weighted, important) < 0.8 * err(plain, important)
    assert err(weighted, ~important) > err(plain, ~important)
    # Weights of all ones are the plain quantizer, byte for byte.
    ones = np.ones(x.size, np.float32).tobytes()
    assert _engine.quantize_q4(raw, 1, x.size, ones) == _engine.quantize_q4(raw, 1, x.size)


def test_quantize_helper_refuses_bad_weights():
    raw = np.zeros(GROUP, np.float32).tobytes()
    with pytest.raises(ValueError, match="finite"):
        _engine.quantize_q4(raw, 1, GROUP, np.full(GROUP, np.nan, np.float32).tobytes())
    with pytest.raises(ValueError, match="weights"):
        _engine.quantize_q4(raw, 1, GROUP, b"\0" * 8)


# --- conversions ------------------------------------------------------------------------------

# sha256 of resident.bin / experts.bin of fixture conversions made by the quantizer before
# calibration existed (commit 9dba44d): a conversion without --calibration must not change.
UNCHANGED = {
    ("olmoe", "default"): (
        "490dcf63b8d4af0327f82e18687cc032e7809d452adb58218f9c0038e82b5000",
        "bc9b55975e29041f820fe07185b7a118726ce0fe7a21fc8b67a5388281d9fbd7",
    ),
    ("olmoe", "pure"): (
        "7320deb30def56e8796209ff00cbe4abc5186bbdaf90288b8a4dba838d0bd21a",
        "bc9b55975e29041f820fe07185b7a118726ce0fe7a21fc8b67a5388281d9fbd7",
    ),
    # (resident.bin held a derived `kv_b_uk` per layer for a while, issue 31; the expanded MLA
    # prefill now makes it from `kv_b_uk_t` per pass, and the file is the one before it.)
    ("deepseek_v3", "pure"): (
        "b88cac3dcb10bd34991cce37c70bca3facc09fe9047184caba5b0a7c586c6525",
        "4ec33336c1d39f7e558c7ec1879d501fe6f7053cae5e814ebbbb1e064d1d9e5a",
    ),
}


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("arch,kind", sorted(UNCHANGED))
def test_without_calibration_the_bytes_are_unchanged(arch, kind, tmp_path):
    out = tmp_path / "m"
    convert(FIXTURES / arch / "hf", out, "int4", q8=() if kind == "pure" else None)
    assert (_sha(out / "resident.bin"), _sha(out / "experts.bin")) == UNCHANGED[(arch, kind)]
    manifest = json.loads((out / "manifest.json").read_text())
    assert "calibration" not in manifest["quantization"]


def _calibration_text(tmp_path: Path) -> Path:
    # Fixture tokenizers are byte-level BPE: any text tokenizes.
    p = tmp_path / "calib.txt"
    p.write_text(
        "The quick brown fox jumps over the lazy dog. 12 + 30 = 42.\n"
        "Lisbon is the capital of Portugal; the weather there is sunny.\n" * 6,
        encoding="utf-8",
    )
    return p


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def test_calibrated_conversion_records_the_text_and_weights_the_error(tmp_path):
    text = _calibration_text(tmp_path)
    hf = FIXTURES / "olmoe" / "hf"
    out, plain, f32 = tmp_path / "cal", tmp_path / "plain", tmp_path / "f32"
    summary = convert(hf, out, "int4", q8=(), calibration=text)
    convert(hf, plain, "int4", q8=())
    convert(hf, f32, "f32")
    cal = json.loads((out / "manifest.json").read_text())["quantization"]["calibration"]
    ref = Engine(f32)
    n_tokens = len(ref.tokenize(text.read_text(encoding="utf-8"), add_special_tokens=True))
    assert cal == {
        "sha256": hashlib.sha256(text.read_bytes()).hexdigest(),
        "tokens": n_tokens,
        "ctx": min(CALIBRATION_CTX, ref.info["context_length"]),
    }
    assert summary["calibration"] == cal
    assert (out / "experts.bin").read_bytes() != (plain / "experts.bin").read_bytes()
    # No temporary f32 directory left beside the output.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cal", "calib.txt", "f32", "plain"]

    # The statistics, recorded by the engine on the f32 model, against NumPy: the first
    # layer's attention input is the normed embedding of each token.
    ids = ref.tokenize(text.read_text(encoding="utf-8"), add_special_tokens=True)
    ctx = cal["ctx"]
    imp = ref._model.collect_importance([ids[i : i + ctx] for i in range(0, len(ids), ctx)])
    assert imp.tokens == len(ids) > ctx
    m = json.loads((f32 / "manifest.json").read_text())
    resident = (f32 / "resident.bin").read_bytes()

    def tensor(name: str) -> np.ndarray:
        t = m["resident"]["tensors"][name]
        a = np.frombuffer(resident, "<f4", count=t["nbytes"] // 4, offset=t["offset"])
        return a.reshape(t["shape"])

    h = _rms_norm(tensor("embed")[ids], tensor("layers.0.attn_norm"), m["config"]["rms_norm_eps"])
    want = (h * h).mean(axis=0)
    ((first, rows, got),) = imp.resident("layers.0.q")
    assert (first, rows) == (0, tensor("layers.0.q").shape[0])
    np.testing.assert_allclose(got, want, rtol=1e-4)
    # Every routed expert's gate and up saw the same rows; down saw its own hidden space.
    cfg = m["config"]
    for layer in range(cfg["num_hidden_layers"]):
        for e in range(cfg["num_experts"]):
            gate, up, down = (imp.expert(layer, e, p) for p in range(3))
            assert gate is not None and gate == up
            assert down is None or len(down) == cfg["intermediate_size"]
    routed = sum(imp.expert(0, e, 2) is not None for e in range(cfg["num_experts"]))
    assert routed >= cfg["num_experts_per_tok"]

    # The conversion minimised the weighted error: on each int4 matrix the calibrated bytes
    # have a lower error weighted by these statistics than the plain ones.
    def dequant(d: Path, name: str) -> np.ndarray:
        man = json.loads((d / "manifest.json").read_text())
        t = man["resident"]["tensors"][name]
        raw = (d / "resident.bin").read_bytes()[t["offset"] : t["offset"] + t["nbytes"]]
        return np.frombuffer(_engine.dequantize_q4(raw, *t["shape"]), "<f4").reshape(t["shape"])

    def werr(d: Path, name: str) -> float:
        ((_, _, s),) = imp.resident(name)
        return float(((tensor(name) - dequant(d, name)).astype(np.float64) ** 2 * s).sum())

    for name in ("layers.0.q", "layers.1.o", "lm_head"):
        assert werr(out, name) < werr(plain, name), name
    # And it loads and runs.
    assert np.isfinite(Engine(out).logits(ids[:8])).all()


def test_the_cli_converts_with_a_calibration(tmp_path):
    text = _calibration_text(tmp_path)
    out = tmp_path / "m"
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "convert", str(FIXTURES / "glm4_moe" / "hf"), str(out)]
        + ["--calibration", str(text), "--threads", "2"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "int4 error weighted by" in r.stdout and "sha256" in r.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"]["calibration"]["tokens"] > 0


@pytest.mark.parametrize(
    "content,needle",
    [
        (None, "not found"),
        (b"", "is empty"),
        (b" \n\t\n", "is empty"),
        (b"caf\xe9 au lait", "not UTF-8"),
    ],
)
def test_bad_calibration_files_are_refused_before_any_output(tmp_path, content, needle):
    path = tmp_path / "calib.txt"
    if content is not None:
        path.write_bytes(content)
    out = tmp_path / "m"
    with pytest.raises(ValueError, match=needle) as e:
        convert(FIXTURES / "olmoe" / "hf", out, "int4", calibration=path)
    assert str(path) in str(e.value)
    assert not out.exists()
    r = subprocess.run(
        [sys.executable, "-m", "colibri", "convert", str(FIXTURES / "olmoe" / "hf"), str(out)]
        + ["--calibration", str(path)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and needle in r.stderr, r.stderr


def test_a_directory_is_not_a_calibration_file(tmp_path):
    with pytest.raises(ValueError, match="calibration file"):
        convert(FIXTURES / "olmoe" / "hf", tmp_path / "m", "int4", calibration=tmp_path)


def test_calibration_needs_int4_and_an_f32_model(tmp_path, converted):
    text = _calibration_text(tmp_path)
    with pytest.raises(ValueError, match="int4"):
        convert(FIXTURES / "olmoe" / "hf", tmp_path / "m", "f32", calibration=text)
    engine = Engine(converted("olmoe", "int4"))
    with pytest.raises(ValueError, match="f32 conversion"):
        engine._model.collect_importance([[1, 2, 3]])
    f32 = Engine(converted("olmoe", "f32"))
    with pytest.raises(ValueError, match="no calibration tokens"):
        f32._model.collect_importance([[]])


def test_statistics_of_another_model_are_refused(tmp_path, converted):
    imp = Engine(converted("glm4_moe", "f32"))._model.collect_importance([[1, 2, 3, 4]])
    with pytest.raises(ValueError, match="do not fit this checkpoint"):
        _engine.convert_checkpoint(
            str(FIXTURES / "olmoe" / "hf"), str(tmp_path / "m"), "int4", False, [], None, imp
        )
    assert not (tmp_path / "m").exists()


def test_mla_row_blocks_keep_statistics_per_head(tmp_path, converted):
    # DeepSeek-V3's absorbed attention multiplies each head's row block of kv_b_uk_t by that
    # head's query: one segment per head, covering the matrix.
    engine = Engine(converted("deepseek_v3", "f32"))
    imp = engine._model.collect_importance([list(range(1, 40))])
    segs = imp.resident("layers.0.kv_b_uk_t")
    cfg = json.loads((converted("deepseek_v3", "f32") / "manifest.json").read_text())["config"]
    heads, rank = cfg["num_attention_heads"], cfg["kv_lora_rank"]
    assert [(f, r) for f, r, _ in segs] == [(h * rank, rank) for h in range(heads)]
    assert len({tuple(s) for _, _, s in segs}) == heads  # each head its own inputs
    shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v4", "kimi_linear", "glm_moe_dsa"])
def test_every_layer_kind_converts_with_a_calibration(arch, tmp_path):
    # Gated shared experts and linear attention (Qwen3-Next, Kimi Linear), hyper-connections
    # and the grouped output projection's row blocks (DeepSeek-V4), the DSA indexer.
    out = tmp_path / "m"
    summary = convert(FIXTURES / arch / "hf", out, "int4", calibration=_calibration_text(tmp_path))
    assert summary["calibration"]["tokens"] > 0
    engine = Engine(out)
    assert np.isfinite(engine.logits(engine.tokenize("The weather in Lisbon"))).all()
