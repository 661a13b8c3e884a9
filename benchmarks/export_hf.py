#!/usr/bin/env python3
"""Write a colibri model directory back out as a Hugging Face checkpoint (f32 tensors as
stored, int4 ones dequantized: an int4 model's weights alone, for scoring them without the
int4 kernels' 8-bit activations).

For measurements that need the same weights in another tool (issue 33: llama.cpp's converter
makes its GGUF from an HF checkpoint), when the only full-precision copy of a model is a colibri
f32 conversion (the demo model fine-tuned off its int4 grid, `bench_calibration.py`). The
families with plain GQA attention and an MLP / MoE feed-forward (OLMoE, Qwen3-MoE, GLM-4.5's
`glm4_moe`, the demo model's family) map name for name; any other tensor name is refused.
`--check` converts the written checkpoint with `colibri convert --quant f32` again and requires
every tensor to come back bit for bit.

    .venv/bin/python benchmarks/export_hf.py F32_MODEL_DIR OUT_HF_DIR [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from demo_training.weights import LAYER_NAMES, TOP_NAMES  # noqa: E402

FAMILIES = {"olmoe", "qwen3_moe", "glm4_moe"}


def checkpoint_name(name: str) -> str:
    if name in TOP_NAMES:
        return TOP_NAMES[name]
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if m is None or m.group(2) not in LAYER_NAMES:
        raise SystemExit(f"export_hf: no checkpoint name for tensor {name!r}")
    return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}"


def f32_array(blob: bytes, entry: dict, base: int = 0) -> np.ndarray:
    """The tensor's values: f32 as stored, int4 dequantized by the engine (its own numbers)."""
    start = base + entry["offset"]
    if entry["dtype"] in ("q4", "q4t"):
        from colibri import _engine

        rows, cols = entry["shape"]
        grid = "table" if entry["dtype"] == "q4t" else "linear"
        raw = _engine.dequantize_q4(blob[start : start + entry["nbytes"]], rows, cols, grid)
        return np.frombuffer(raw, dtype="<f4").reshape(rows, cols).copy()
    if entry["dtype"] != "f32":
        raise SystemExit(f"export_hf: a {entry['dtype']} tensor: export an f32 or int4 model")
    arr = np.frombuffer(blob, dtype="<f4", count=entry["nbytes"] // 4, offset=start)
    return arr.reshape(entry["shape"]).copy()


def tensors_of(model: Path) -> dict[str, np.ndarray]:
    man = json.loads((model / "manifest.json").read_text())
    if man["config"].get("model_type") not in FAMILIES:
        raise SystemExit(f"export_hf: {man['config'].get('model_type')!r} is not one of {FAMILIES}")
    res = man["resident"]
    blob = (model / res["file"]).read_bytes()
    out = {checkpoint_name(n): f32_array(blob, e) for n, e in res["tensors"].items()}
    ex = man.get("experts")
    if ex:
        blob = (model / ex["file"]).read_bytes()
        for group in ex["layers"]:
            for e in range(group["count"]):
                base = (group["first_record"] + e) * ex["record_size"]
                for part, entry in ex["parts"].items():
                    key = f"model.layers.{group['layer']}.mlp.experts.{e}.{part}_proj.weight"
                    out[key] = f32_array(blob, entry, base)
    return out


def export(model: Path, out: Path) -> None:
    man = json.loads((model / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors_of(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(man["config"])
    # Converters written before transformers 5 read `rope_scaling`; 5.x writes `rope_parameters`.
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and rp.get("rope_type", "default") != "default":
        config.setdefault("rope_scaling", rp)
        config.setdefault("rope_theta", rp.get("rope_theta"))
        config.setdefault("partial_rotary_factor", rp.get("partial_rotary_factor"))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model / f).exists():
            shutil.copy(model / f, out / f)


def check(model: Path, out: Path) -> None:
    """The written checkpoint converts back to the same tensors, bit for bit."""
    with tempfile.TemporaryDirectory() as tmp:
        back = Path(tmp) / "back"
        cmd = [sys.executable, "-m", "colibri", "convert", str(out), str(back), "--quant", "f32"]
        subprocess.run(cmd, check=True, capture_output=True)
        a, b = tensors_of(model), tensors_of(back)
        if a.keys() != b.keys():
            raise SystemExit(f"export_hf: tensors differ: {sorted(a.keys() ^ b.keys())[:5]}")
        for k in a:
            if a[k].tobytes() != b[k].tobytes():
                raise SystemExit(f"export_hf: {k} changed in the round trip")
    print(f"round trip: {len(a)} tensors bit-identical")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="an f32 (or int4) colibri model directory")
    ap.add_argument("out", type=Path, help="the Hugging Face checkpoint directory to write")
    ap.add_argument("--check", action="store_true", help="convert back and compare every tensor")
    a = ap.parse_args()
    export(a.model, a.out)
    if a.check:
        check(a.model, a.out)


if __name__ == "__main__":
    main()
