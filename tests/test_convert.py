"""The converter and loader against broken inputs: every refusal names its problem, nothing crashes.

Each case copies a committed fixture checkpoint into ``tmp_path``, breaks one thing, and runs the
real engine (``colibri.convert`` / ``colibri.Engine``) or the CLI (``python -m colibri convert``).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri import Engine, convert

FIXTURES = Path(__file__).parent / "fixtures"
ERRORS = (RuntimeError, ValueError)


# --- safetensors without a framework: (name -> (dtype, shape, bytes)) in file order ----------


def read_st(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        out[name] = (info["dtype"], info["shape"], data[a:b])
    return out


def write_st(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header, blobs, pos = {}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(data)]}
        blobs.append(data)
        pos += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def f32_values(dtype: str, data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype={"F32": "<f4", "F16": "<f2"}[dtype]).astype(np.float32)


# --- helpers -----------------------------------------------------------------------------------


def checkpoint(tmp_path: Path, arch: str = "olmoe") -> Path:
    """A writable copy of a fixture checkpoint."""
    dst = tmp_path / f"{arch}-hf"
    shutil.copytree(FIXTURES / arch / "hf", dst)
    for f in dst.iterdir():
        f.chmod(0o644)
    return dst


def edit_config(hf: Path, **changes) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    cfg.update(changes)
    (hf / "config.json").write_text(json.dumps(cfg))


def edit_tensors(hf: Path, fn) -> None:
    path = hf / "model.safetensors"
    tensors = read_st(path)
    fn(tensors)
    write_st(path, tensors)


def refused(hf: Path, out: Path, *needles: str) -> str:
    """Converts, expects a refusal whose message contains every needle; nothing is left behind."""
    with pytest.raises(ERRORS) as exc:
        convert(hf, out)
    msg = str(exc.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert not (out / "manifest.json").exists()
    return msg


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args], capture_output=True, text=True, timeout=60
    )


OLMOE_K = "model.layers.1.self_attn.k_proj.weight"


# --- refusals, one broken thing each ----------------------------------------------------------


def test_unsupported_architecture(tmp_path):
    hf = checkpoint(tmp_path)
    edit_config(hf, architectures=["LlamaForCausalLM"])
    refused(hf, tmp_path / "out", "unsupported architecture", "LlamaForCausalLM")


def test_missing_config(tmp_path):
    hf = checkpoint(tmp_path)
    (hf / "config.json").unlink()
    refused(hf, tmp_path / "out", "config.json")


def test_invalid_json_config(tmp_path):
    hf = checkpoint(tmp_path)
    (hf / "config.json").write_text('{"architectures": ["OlmoeForCausalLM"], ')
    refused(hf, tmp_path / "out", "config.json", "invalid JSON")


def test_missing_tokenizer(tmp_path):
    hf = checkpoint(tmp_path)
    (hf / "tokenizer.json").unlink()
    refused(hf, tmp_path / "out", "tokenizer.json")


def test_unsupported_rope_type(tmp_path):
    hf = checkpoint(tmp_path)
    # yarn and linear are read (ops.rs checks them against transformers); dynamic is refused.
    edit_config(hf, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0})
    refused(hf, tmp_path / "out", "dynamic")


def test_missing_field(tmp_path):
    hf = checkpoint(tmp_path)
    cfg = json.loads((hf / "config.json").read_text())
    del cfg["hidden_size"]
    (hf / "config.json").write_text(json.dumps(cfg))
    refused(hf, tmp_path / "out", "hidden_size")


@pytest.mark.parametrize(
    "field,value", [("num_hidden_layers", 2**62), ("hidden_size", 2**64 - 1), ("vocab_size", 0)]
)
def test_absurd_sizes(tmp_path, field, value):
    hf = checkpoint(tmp_path)
    edit_config(hf, **{field: value})
    refused(hf, tmp_path / "out", field)


def test_no_safetensors(tmp_path):
    hf = checkpoint(tmp_path)
    (hf / "model.safetensors").unlink()
    refused(hf, tmp_path / "out", "safetensors")


def test_missing_tensor(tmp_path):
    hf = checkpoint(tmp_path)
    edit_tensors(hf, lambda t: t.pop(OLMOE_K))
    refused(hf, tmp_path / "out", "missing tensor", OLMOE_K)


def test_missing_expert(tmp_path):
    hf = checkpoint(tmp_path)
    name = "model.layers.2.mlp.experts.7.down_proj.weight"
    edit_tensors(hf, lambda t: t.pop(name))
    refused(hf, tmp_path / "out", "missing tensor", name)


def test_wrong_shape(tmp_path):
    hf = checkpoint(tmp_path)

    def transpose(t):
        dtype, shape, data = t[OLMOE_K]
        t[OLMOE_K] = (dtype, shape[::-1], data)

    edit_tensors(hf, transpose)
    refused(hf, tmp_path / "out", OLMOE_K, "shape [72, 24]", "expected [24, 72]")


def test_unexpected_tensor(tmp_path):
    hf = checkpoint(tmp_path)
    name = "model.layers.0.mlp.extra_proj.weight"
    edit_tensors(hf, lambda t: t.update({name: ("F32", [2], b"\0" * 8)}))
    refused(hf, tmp_path / "out", "unexpected tensor", name)


@pytest.mark.parametrize("dtype,size", [("I8", 1), ("F64", 8), ("I32", 4)])
def test_unsupported_dtype(tmp_path, dtype, size):
    hf = checkpoint(tmp_path)

    def retype(t):
        _, shape, _ = t[OLMOE_K]
        t[OLMOE_K] = (dtype, shape, b"\1" * (int(np.prod(shape)) * size))

    edit_tensors(hf, retype)
    refused(hf, tmp_path / "out", OLMOE_K, dtype)


# Non-finite values by dtype: the bit patterns of +inf, -inf and a quiet NaN.
NON_FINITE = {
    "F32": {"inf": 0x7F800000, "-inf": 0xFF800000, "nan": 0x7FC00000},
    "BF16": {"inf": 0x7F80, "-inf": 0xFF80, "nan": 0x7FC0},
    "F16": {"inf": 0x7C00, "-inf": 0xFC00, "nan": 0x7E00},
}


@pytest.mark.parametrize("dtype", sorted(NON_FINITE))
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
@pytest.mark.parametrize(
    "name", [OLMOE_K, "model.layers.2.mlp.experts.3.down_proj.weight"], ids=["resident", "expert"]
)
@pytest.mark.parametrize("quant", ["int4", "f32"])
def test_non_finite_weight_is_refused(tmp_path, dtype, value, name, quant):
    """An inf or NaN weight anywhere (a resident matrix, a routed expert; any float dtype) is
    refused with the tensor, the value and where it is, before a model is written."""
    hf = checkpoint(tmp_path)
    width = 4 if dtype == "F32" else 2

    def poison(t):
        st_dtype, shape, data = t[name]
        values = f32_values(st_dtype, data).copy()
        if dtype == "F32":
            raw = bytearray(values.astype("<f4").tobytes())
        else:
            raw = bytearray(values.astype("<f2" if dtype == "F16" else "<f4").tobytes())
            if dtype == "BF16":  # the top half of each f32
                raw = bytearray(b"".join(raw[i + 2 : i + 4] for i in range(0, len(raw), 4)))
        at = 7
        raw[at * width : (at + 1) * width] = NON_FINITE[dtype][value].to_bytes(width, "little")
        t[name] = (dtype, shape, bytes(raw))

    edit_tensors(hf, poison)
    with pytest.raises(ERRORS) as exc:
        convert(hf, tmp_path / "out", quant)
    msg = str(exc.value)
    for needle in (name, "element 7", "must be finite", value):
        assert needle in msg.replace("NaN", "nan"), f"{needle!r} not in {msg!r}"
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_truncated_safetensors(tmp_path):
    hf = checkpoint(tmp_path)
    path = hf / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    refused(hf, tmp_path / "out", "model.safetensors", "not a valid safetensors file")


def test_corrupt_safetensors_header(tmp_path):
    hf = checkpoint(tmp_path)
    path = hf / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[8:20] = b"not json at!"
    path.write_bytes(bytes(raw))
    refused(hf, tmp_path / "out", "model.safetensors", "not a valid safetensors file")


def test_same_tensor_in_two_shards(tmp_path):
    hf = checkpoint(tmp_path, "qwen3_moe")
    first = hf / "model-00001-of-00002.safetensors"
    second = hf / "model-00002-of-00002.safetensors"
    a, b = read_st(first), read_st(second)
    name = next(iter(a))
    b[name] = a[name]
    write_st(second, b)
    refused(hf, tmp_path / "out", name, "more than one shard")


# --- the CLI: one line on stderr, non-zero exit, no traceback ---------------------------------


def _break_arch(hf: Path) -> None:
    edit_config(hf, architectures=["LlamaForCausalLM"])


def _break_config(hf: Path) -> None:
    (hf / "config.json").unlink()


def _break_json(hf: Path) -> None:
    (hf / "config.json").write_text("{")


def _break_tokenizer(hf: Path) -> None:
    (hf / "tokenizer.json").unlink()


def _break_tensor(hf: Path) -> None:
    edit_tensors(hf, lambda t: t.pop(OLMOE_K))


def _break_file(hf: Path) -> None:
    (hf / "model.safetensors").write_bytes(b"\xff" * 64)


@pytest.mark.parametrize(
    "breakage,needle",
    [
        (_break_arch, "LlamaForCausalLM"),
        (_break_config, "config.json"),
        (_break_json, "invalid JSON"),
        (_break_tokenizer, "tokenizer.json"),
        (_break_tensor, OLMOE_K),
        (_break_file, "not a valid safetensors file"),
    ],
)
def test_cli_reports_one_line(tmp_path, breakage, needle):
    hf = checkpoint(tmp_path)
    breakage(hf)
    r = cli("convert", str(hf), str(tmp_path / "out"))
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(("colibri: ", "colibri convert: ")), r.stderr
    assert needle in lines[0]
    assert "Traceback" not in r.stderr


def test_cli_converts(tmp_path):
    out = tmp_path / "out"
    r = cli("convert", str(FIXTURES / "glm4_moe" / "hf"), str(out), "--quant", "f32")
    assert r.returncode == 0, r.stderr
    assert "Glm4MoeForCausalLM" in r.stdout
    assert (out / "manifest.json").is_file()


# --- successful conversions and the model directory -----------------------------------------


@pytest.fixture(scope="module")
def olmoe_int4(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("olmoe-int4")
    convert(FIXTURES / "olmoe" / "hf", out, "int4")
    return out


def test_manifest_written_last_and_records_aligned(olmoe_int4):
    out = olmoe_int4
    names = {p.name for p in out.iterdir()}
    assert "manifest.json" in names
    assert not any(n.endswith(".tmp") for n in names), names
    m = json.loads((out / "manifest.json").read_text())
    # manifest.json is renamed into place after every other file is complete.
    assert (out / "manifest.json").stat().st_mtime_ns >= max(
        (out / n).stat().st_mtime_ns for n in names - {"manifest.json"}
    )
    x = m["experts"]
    size = (out / x["file"]).stat().st_size
    rs = x["record_size"]
    assert size % 4096 == 0 and rs % 4096 == 0
    cfg = json.loads((FIXTURES / "olmoe" / "hf" / "config.json").read_text())
    assert len(x["layers"]) == cfg["num_hidden_layers"]
    records = 0
    for layer in x["layers"]:
        assert layer["count"] == cfg["num_experts"]
        assert layer["first_record"] == records
        for e in range(layer["count"]):
            assert ((layer["first_record"] + e) * rs) % 4096 == 0
        records += layer["count"]
    assert size == records * rs
    for part in x["parts"].values():
        assert part["offset"] % 64 == 0 and part["offset"] + part["nbytes"] <= rs
    resident_size = (out / m["resident"]["file"]).stat().st_size
    for t in m["resident"]["tensors"].values():
        assert t["offset"] % 64 == 0 and t["offset"] + t["nbytes"] <= resident_size


def test_sharded_bf16_converts(tmp_path):
    hf = FIXTURES / "qwen3_moe" / "hf"
    assert len(list(hf.glob("*.safetensors"))) == 2
    out = tmp_path / "out"
    summary = convert(hf, out, "int4")
    assert summary["architecture"] == "Qwen3MoeForCausalLM"
    eng = Engine(out, threads=1)
    assert eng.logits([1, 2, 3]).shape == (3, eng.info["vocab_size"])


def test_directory_without_manifest_is_refused(olmoe_int4, tmp_path):
    d = tmp_path / "partial"
    shutil.copytree(olmoe_int4, d)
    (d / "manifest.json").unlink()
    with pytest.raises(ERRORS, match="manifest.json not found.*colibri convert"):
        Engine(d)


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(ERRORS, match="not a colibri model directory"):
        Engine(tmp_path)


def test_truncated_experts_is_refused(olmoe_int4, tmp_path):
    d = tmp_path / "cut"
    shutil.copytree(olmoe_int4, d)
    path = d / "experts.bin"
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 4096])
    with pytest.raises(ERRORS, match=r"experts\.bin.*truncated"):
        Engine(d)


def test_missing_resident_file_is_refused(olmoe_int4, tmp_path):
    d = tmp_path / "nores"
    shutil.copytree(olmoe_int4, d)
    (d / "resident.bin").unlink()
    with pytest.raises(ERRORS, match="resident.bin"):
        Engine(d)


def test_corrupt_manifest_is_refused(olmoe_int4, tmp_path):
    d = tmp_path / "badjson"
    shutil.copytree(olmoe_int4, d)
    (d / "manifest.json").write_text("{")
    with pytest.raises(ERRORS, match="invalid manifest"):
        Engine(d)


def test_convert_twice_into_the_same_directory(tmp_path):
    hf = FIXTURES / "glm4_moe" / "hf"
    out = tmp_path / "out"
    convert(hf, out, "f32")
    first = Engine(out, threads=1).logits([1, 5, 9])
    convert(hf, out, "int4")  # over the previous f32 files
    eng = Engine(out, threads=1)
    assert eng.info["quantization"] == "int4"
    second = eng.logits([1, 5, 9])
    assert second.shape == first.shape
    convert(hf, out, "f32")
    np.testing.assert_array_equal(Engine(out, threads=1).logits([1, 5, 9]), first)
    assert not (out / "manifest.json.tmp").exists()


def test_converting_into_the_checkpoint_directory_keeps_its_files(tmp_path):
    hf = checkpoint(tmp_path, "glm4_moe")
    before = (hf / "tokenizer.json").read_bytes()
    convert(hf, hf, "int4")
    assert (hf / "tokenizer.json").read_bytes() == before
    Engine(hf, threads=1).logits([1, 2])


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "glm_moe_dsa"])
def test_mtp_layers_are_skipped_and_listed(tmp_path, family):
    """A published checkpoint's multi-token-prediction layer (DeepSeek-V3's and GLM's layer
    `num_hidden_layers`, with `num_nextn_predict_layers: 1`: its eh_proj, enorm/hnorm, shared
    head and a whole decoder layer under the same prefix) is listed as skipped, not refused,
    and changes nothing."""
    hf = checkpoint(tmp_path, family)
    cfg = json.loads((hf / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    mtp = {
        f"model.layers.{n}.eh_proj.weight": ("F16", [h, 2 * h], b"\0" * (h * 2 * h * 2)),
        f"model.layers.{n}.enorm.weight": ("F16", [h], b"\0" * (h * 2)),
        f"model.layers.{n}.hnorm.weight": ("F16", [h], b"\0" * (h * 2)),
        f"model.layers.{n}.shared_head.norm.weight": ("F16", [h], b"\0" * (h * 2)),
        f"model.layers.{n}.shared_head.head.weight": ("F16", [4, h], b"\0" * (4 * h * 2)),
        f"model.layers.{n}.self_attn.o_proj.weight": ("F16", [h, 4], b"\0" * (4 * h * 2)),
        f"model.layers.{n}.mlp.experts.0.gate_proj.weight": ("F16", [4, h], b"\0" * (4 * h * 2)),
    }
    edit_tensors(hf, lambda t: t.update(mtp))
    edit_config(hf, num_nextn_predict_layers=1)
    out = tmp_path / "out"
    summary = convert(hf, out)
    assert summary["skipped_tensors"] == len(mtp)
    skipped = json.loads((out / "manifest.json").read_text())["skipped_tensors"]
    assert set(skipped) == set(mtp)
    assert all("num_hidden_layers" in reason for reason in skipped.values())
    # ...and the model without them still matches the unmodified checkpoint's conversion.
    ref = tmp_path / "ref"
    convert(FIXTURES / family / "hf", ref)
    a = Engine(out, threads=1).logits([1, 2, 3])
    np.testing.assert_array_equal(a, Engine(ref, threads=1).logits([1, 2, 3]))


def test_f16_weights_are_read_as_f16(tmp_path):
    """The glm fixture mixes f16 weights with an f32 router: values survive an f32 conversion."""
    out = tmp_path / "out"
    convert(FIXTURES / "glm4_moe" / "hf", out, "f32")
    m = json.loads((out / "manifest.json").read_text())
    t = m["resident"]["tensors"]["norm"]
    raw = (out / "resident.bin").read_bytes()[t["offset"] : t["offset"] + t["nbytes"]]
    want = read_st(FIXTURES / "glm4_moe" / "hf" / "model.safetensors")["model.norm.weight"]
    np.testing.assert_array_equal(np.frombuffer(raw, "<f4"), f32_values(want[0], want[2]))


# --- random corruption never crashes the process ----------------------------------------------

_GLM_ST = (FIXTURES / "glm4_moe" / "hf" / "model.safetensors").read_bytes()
_GLM_HEADER_END = 8 + struct.unpack("<Q", _GLM_ST[:8])[0]


@pytest.fixture(scope="module")
def glm_scratch(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("glm-fuzz"), "glm4_moe")


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    edits=st.lists(
        st.tuples(st.integers(0, _GLM_HEADER_END - 1), st.integers(0, 255)), min_size=1, max_size=8
    ),
    cut=st.one_of(st.none(), st.integers(0, len(_GLM_ST))),
)
def test_corrupt_safetensors_never_crashes(glm_scratch, edits, cut):
    raw = bytearray(_GLM_ST)
    for at, byte in edits:
        raw[at] = byte
    if cut is not None:
        raw = raw[:cut]
    (glm_scratch / "model.safetensors").write_bytes(bytes(raw))
    out = glm_scratch.parent / "out"
    try:
        convert(glm_scratch, out, "int4")
        Engine(out, threads=1).logits([1, 2])
    except ERRORS as e:
        assert str(e)


_SIZE_FIELDS = [
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "intermediate_size",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_group",
    "topk_group",
    "n_shared_experts",
    "first_k_dense_replace",
    "max_position_embeddings",
]


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    changes=st.dictionaries(
        st.sampled_from(_SIZE_FIELDS),
        st.one_of(
            st.integers(-(2**64), 2**64 + 5),
            st.sampled_from([0, 1, 2, 2**20, 2**20 + 1, 2**32, 2**63, 2**64 - 1]),
            st.floats(allow_nan=False),
            st.text(max_size=3),
            st.none(),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_random_config_sizes_never_crash(glm_scratch, changes):
    (glm_scratch / "model.safetensors").write_bytes(_GLM_ST)
    cfg = json.loads((FIXTURES / "glm4_moe" / "hf" / "config.json").read_text())
    cfg.update(changes)
    (glm_scratch / "config.json").write_text(json.dumps(cfg))
    out = glm_scratch.parent / "out-cfg"
    try:
        convert(glm_scratch, out, "int4")
        Engine(out, threads=1).logits([1, 2])
    except ERRORS as e:
        assert str(e)


def test_fused_expert_tensors_convert_like_per_expert_ones(tmp_path, converted):
    """transformers 5 keeps experts fused ([E, 2I, H] gate-then-up, [E, H, I]); both layouts
    must give the same model."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    from colibri import Engine

    src = FIXTURES / "olmoe" / "hf"
    hf = tmp_path / "fused"
    shutil.copytree(src, hf)
    weights = load_file(str(src / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for e in range(cfg["num_experts"]):
            g = weights.pop(f"{p}.{e}.gate_proj.weight")
            u = weights.pop(f"{p}.{e}.up_proj.weight")
            gate_up.append(np.concatenate([g, u], axis=0))
            down.append(weights.pop(f"{p}.{e}.down_proj.weight"))
        weights[f"{p}.gate_up_proj"] = np.stack(gate_up)
        weights[f"{p}.down_proj"] = np.stack(down)
    save_file(weights, str(hf / "model.safetensors"))
    out = tmp_path / "out"
    convert(hf, out, "int4")
    ref = converted("olmoe", "int4")
    assert (out / "experts.bin").read_bytes() == (ref / "experts.bin").read_bytes()
    prompt = [1, 5, 9, 33]
    assert np.array_equal(Engine(out).logits(prompt), Engine(ref).logits(prompt))


# --- --keep-f32 ----------------------------------------------------------------------------


def test_keep_f32_leaves_the_named_matrices_at_f32_and_moves_toward_the_reference(
    olmoe_int4, tmp_path
):
    """Matched resident matrices are written f32 (the rest int4, experts int4); the model loads
    and its logits move toward transformers' (the fixture's) with more of it kept."""
    ref = np.load(FIXTURES / "olmoe" / "reference.npz")
    prompt = ref["prompt_2"].tolist()
    want = ref["logits_2"]

    def err(model: Path) -> float:
        got = Engine(model).logits(prompt)
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    out = tmp_path / "keep"
    r = cli(
        "convert",
        str(FIXTURES / "olmoe" / "hf"),
        str(out),
        "--keep-f32",
        "lm_head",
        "--keep-f32",
        "layers.*.v",
    )
    assert r.returncode == 0, r.stderr
    m = json.loads((out / "manifest.json").read_text())
    dtypes = {k: v["dtype"] for k, v in m["resident"]["tensors"].items()}
    assert dtypes["lm_head"] == "f32" and dtypes["layers.0.v"] == "f32"
    assert dtypes["embed"] == "q4" and dtypes["layers.0.q"] == "q4"
    assert {p["dtype"] for p in m["experts"]["parts"].values()} == {"q4"}
    every = tmp_path / "every"
    convert(FIXTURES / "olmoe" / "hf", every, "int4", keep_f32=["*"])
    assert err(every) < err(olmoe_int4)


def test_keep_f32_refuses_a_pattern_that_names_nothing(tmp_path):
    r = cli("convert", str(FIXTURES / "olmoe" / "hf"), str(tmp_path / "o"), "--keep-f32", "lm_hed")
    assert r.returncode != 0 and "`lm_hed` matches no weight matrix" in r.stderr, r.stderr


# --- 8-bit matrices: the default, --q8, --pure ------------------------------------------------


def _dtypes(model: Path) -> dict[str, str]:
    m = json.loads((model / "manifest.json").read_text())
    return {k: v["dtype"] for k, v in m["resident"]["tensors"].items()}


def test_int4_stores_attention_v_and_o_at_8_bits_by_default_and_pure_none(olmoe_int4, tmp_path):
    """The default int4 conversion: every layer's v and o are q8, every other matrix q4, the
    experts q4; `--pure` writes no q8 at all (what every conversion wrote before)."""
    dtypes = _dtypes(olmoe_int4)
    for name, dtype in dtypes.items():
        if name.endswith((".v", ".o")) and name.startswith("layers."):
            assert dtype == "q8", name
        else:
            assert dtype in ("q4", "f32"), name
    assert dtypes["embed"] == "q4" and dtypes["layers.0.q"] == "q4"
    m = json.loads((olmoe_int4 / "manifest.json").read_text())
    assert {p["dtype"] for p in m["experts"]["parts"].values()} == {"q4"}
    pure = tmp_path / "pure"
    r = cli("convert", str(FIXTURES / "olmoe" / "hf"), str(pure), "--pure")
    assert r.returncode == 0, r.stderr
    assert set(_dtypes(pure).values()) == {"q4", "f32"}
    assert (pure / "experts.bin").read_bytes() == (olmoe_int4 / "experts.bin").read_bytes()
    # 34 bytes per 32 weights instead of 18: the default's resident part is larger.
    assert (olmoe_int4 / "resident.bin").stat().st_size > (pure / "resident.bin").stat().st_size
    # An f32 conversion has no 8-bit matrix unless asked.
    f32 = tmp_path / "f32"
    convert(FIXTURES / "olmoe" / "hf", f32, "f32")
    assert set(_dtypes(f32).values()) == {"f32"}


def test_q8_patterns_replace_the_default_and_move_toward_the_reference(tmp_path):
    ref = np.load(FIXTURES / "olmoe" / "reference.npz")
    prompt = ref["prompt_2"].tolist()
    want = ref["logits_2"]

    def err(model: Path) -> float:
        got = Engine(model).logits(prompt)
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    hf = FIXTURES / "olmoe" / "hf"
    out = tmp_path / "named"
    r = cli(
        "convert",
        str(hf),
        str(out),
        "--q8",
        "lm_head",
        "--q8",
        "layers.*.q",
        "--keep-f32",
        "layers.0.q",
    )
    assert r.returncode == 0, r.stderr
    dtypes = _dtypes(out)
    assert dtypes["lm_head"] == "q8" and dtypes["layers.1.q"] == "q8"
    assert dtypes["layers.0.q"] == "f32"  # --keep-f32 wins
    assert dtypes["layers.0.v"] == "q4" and dtypes["layers.0.o"] == "q4"  # no default
    pure, every = tmp_path / "pure", tmp_path / "every"
    convert(hf, pure, "int4", q8=())
    convert(hf, every, "int4", q8=["*"])
    assert set(_dtypes(every).values()) == {"q8", "f32"}
    assert err(every) < err(pure) / 2


def test_q8_refuses_a_pattern_that_names_nothing_and_pure_with_q8(tmp_path):
    hf = str(FIXTURES / "olmoe" / "hf")
    r = cli("convert", hf, str(tmp_path / "o"), "--q8", "layers.*.vv")
    assert r.returncode != 0 and "--q8 `layers.*.vv` matches no weight matrix" in r.stderr
    assert not (tmp_path / "o" / "manifest.json").exists()
    r = cli("convert", hf, str(tmp_path / "p"), "--q8", "lm_head", "--pure")
    assert r.returncode != 0 and "not allowed with argument" in r.stderr, r.stderr


def test_table_grid_stores_every_int4_matrix_as_q4t_but_mla_kv_b(olmoe_int4, tmp_path):
    """`--grid table`: the int4 matrices (resident and experts) are q4t, the same bytes per
    weight as q4; the 8-bit default and f32 vectors are untouched; MLA's kv_b halves, whose
    unrounded products read the linear grid only, stay q4. The models load and generate."""
    hf = FIXTURES / "olmoe" / "hf"
    table = tmp_path / "table"
    r = cli("convert", str(hf), str(table), "--grid", "table")
    assert r.returncode == 0, r.stderr
    want = {k: {"q4": "q4t"}.get(v, v) for k, v in _dtypes(olmoe_int4).items()}
    assert _dtypes(table) == want
    m = json.loads((table / "manifest.json").read_text())
    assert {p["dtype"] for p in m["experts"]["parts"].values()} == {"q4t"}
    for part in ("resident.bin", "experts.bin"):
        a, b = (olmoe_int4 / part).read_bytes(), (table / part).read_bytes()
        assert len(a) == len(b) and a != b, part
    assert len(list(Engine(table).generate([1, 2, 3], max_tokens=4))) == 4
    mla = tmp_path / "mla"
    r = cli("convert", str(FIXTURES / "deepseek_v3" / "hf"), str(mla), "--pure", "--grid", "table")
    assert r.returncode == 0, r.stderr
    dtypes = _dtypes(mla)
    kv_b = {k for k in dtypes if k.endswith((".kv_b_uk_t", ".kv_b_uv"))}
    assert kv_b and {dtypes[k] for k in kv_b} == {"q4"}
    assert {v for k, v in dtypes.items() if k not in kv_b} == {"q4t", "f32"}
    assert len(list(Engine(mla).generate([1, 2, 3], max_tokens=4))) == 4


def test_table_grid_refuses_f32_and_q4_0_rounding(tmp_path):
    hf = str(FIXTURES / "olmoe" / "hf")
    for extra, message in [
        (["--quant", "f32"], "the table grid applies to an int4 conversion"),
        (["--q4-0-rounding"], "the table grid applies to an int4 conversion"),
    ]:
        out = tmp_path / extra[-1].strip("-")
        r = cli("convert", hf, str(out), "--grid", "table", *extra)
        assert r.returncode != 0 and message in r.stderr, r.stderr
        assert not out.exists()
    r = cli("convert", hf, str(tmp_path / "x"), "--grid", "cubic")
    assert r.returncode != 0 and "invalid choice: 'cubic'" in r.stderr, r.stderr


def test_q4_0_rounding_keeps_the_layout_and_loses_to_the_search(tmp_path):
    """`--q4-0-rounding`: llama.cpp Q4_0's max-abs scales in colibri's layout (the same bytes
    per weight and the same kernels, so the same speed: docs/PERFORMANCE.md), measurably
    further from the checkpoint than the error-minimising search."""
    ref = np.load(FIXTURES / "olmoe" / "reference.npz")
    hf = str(FIXTURES / "olmoe" / "hf")
    searched, q4_0 = tmp_path / "searched", tmp_path / "q4_0"
    assert cli("convert", hf, str(searched), "--pure").returncode == 0
    r = cli("convert", hf, str(q4_0), "--pure", "--q4-0-rounding")
    assert r.returncode == 0, r.stderr
    assert _dtypes(q4_0) == _dtypes(searched)
    for part in ("resident.bin", "experts.bin"):
        a, b = (searched / part).read_bytes(), (q4_0 / part).read_bytes()
        assert len(a) == len(b) and a != b, part

    def err(model: Path) -> float:
        got = np.concatenate([Engine(model).logits(ref[f"prompt_{i}"].tolist()) for i in (1, 2)])
        want = np.concatenate([ref[f"logits_{i}"] for i in (1, 2)])
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    assert err(searched) < err(q4_0)
    text = tmp_path / "calib.txt"
    text.write_text("Some calibration text.\n" * 20)
    r = cli("convert", hf, str(tmp_path / "c"), "--q4-0-rounding", "--calibration", str(text))
    assert r.returncode != 0 and "Q4_0 rounding applies to a plain int4" in r.stderr, r.stderr
    assert not (tmp_path / "c").exists()
