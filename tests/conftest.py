"""Shared fixtures: the committed reference checkpoints, converted once per test session."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from colibri import convert

FIXTURES = Path(__file__).parent / "fixtures"
ARCHS = [
    "olmoe",
    "qwen3_moe",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v3_noqlora",
    "glm_moe_dsa",
    "glm_moe_dsa_yarn",
    "glm_moe_dsa_shared",
    "deepseek_v32",
    "deepseek_v4",
    "qwen3_next",
    "qwen3_next_ratios",
    "kimi_linear",
    "kimi_linear_lora",
]


class Reference:
    """One architecture's HF checkpoint and transformers' outputs for it."""

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self.hf_dir = FIXTURES / arch / "hf"
        data = np.load(FIXTURES / arch / "reference.npz")
        self.prompts = [data[f"prompt_{i}"].tolist() for i in range(3)]
        self.logits = [data[f"logits_{i}"] for i in range(3)]
        self.greedy = [data[f"greedy_{i}"].tolist() for i in range(3)]
        self.q4_0_rel_error = float(data["q4_0_rel_error"])
        self.q4_0_rel_error_all = float(data["q4_0_rel_error_all"])


@pytest.fixture(scope="session", params=ARCHS)
def reference(request) -> Reference:
    return Reference(request.param)


@pytest.fixture(scope="session")
def converted(tmp_path_factory):
    """``converted(arch, quant)`` -> path of that fixture converted (cached per session);
    ``quant`` "int4" is the default conversion (attention v and o at 8 bits), "int4-pure" every
    matrix int4 (``colibri convert --pure``), "int4-table" every matrix int4 on the table grid
    (``--pure --grid table``)."""
    cache: dict[tuple[str, str], Path] = {}

    def get(arch: str, quant: str) -> Path:
        key = (arch, quant)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"{arch}-{quant}")
            if quant == "int4-pure":
                convert(FIXTURES / arch / "hf", out, "int4", q8=())
            elif quant == "int4-table":
                convert(FIXTURES / arch / "hf", out, "int4", q8=(), grid="table")
            else:
                convert(FIXTURES / arch / "hf", out, quant)
            cache[key] = out
        return cache[key]

    return get


def run_engine_script(code: str, model: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """Runs `code` (with the model path as sys.argv[1]) in a fresh interpreter with `env` added
    to the environment: engine settings read from it are decided once per process."""
    return subprocess.run(
        [sys.executable, "-c", code, str(model)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def conversion_refusal(tmp_path: Path, arch: str, field: str, value: object) -> str:
    """The error converting fixture ``arch`` gives with config field ``field`` set to ``value``
    (``None``: removed); the conversion must be refused."""
    hf = tmp_path / "hf"
    shutil.copytree(FIXTURES / arch / "hf", hf)
    cfg = json.loads((hf / "config.json").read_text())
    if value is None:
        del cfg[field]
    else:
        cfg[field] = value
    (hf / "config.json").write_text(json.dumps(cfg))
    with pytest.raises((ValueError, RuntimeError, OSError)) as exc:
        convert(hf, tmp_path / "out", "f32")
    return str(exc.value)


def assert_a_slot_file_restart_is_cold(
    model: Path, kv: Path, prompt: list[int], follow: list[int], version: int | None = None
) -> None:
    """Generates after ``prompt`` in slot 0 with its slot file in ``kv``, starts the engine again
    from the file, and checks that the slot's history came back and that continuing it with
    ``follow`` reuses all of it and gives the tokens of a cold run. ``version``: the file's
    format version, which then also holds state records (``KVST``)."""
    from colibri.runtime.engine import Engine

    engine = Engine(model, threads=2, kv_dir=kv)
    stream = engine.generate(prompt, 7, slot=0)
    out = list(stream)
    stream.close()
    history = engine.slot_info(0)["tokens"]
    assert history == prompt + out[:-1]
    del stream, engine
    if version is not None:
        raw = (kv / "slot-0.kv").read_bytes()
        assert raw[:8] == b"CLBKVSLT" and struct.unpack("<I", raw[8:12])[0] == version
        assert b"KVST" in raw
    restarted = Engine(model, threads=1, kv_dir=kv)
    assert restarted.slot_info(0)["tokens"] == history
    longer = history + follow
    warm = restarted.generate(longer, 6, slot=0)
    got = list(warm)
    assert warm.reused_tokens == len(history)
    assert got == list(Engine(model, threads=1).generate(longer, 6))


def read_safetensors(path: Path) -> tuple[dict, bytes]:
    """A safetensors file's header and data block (bf16 has no numpy dtype, so the tests edit
    the file's own bytes: a header of names, dtypes, shapes and offsets, then the data)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_safetensors(path: Path, header: dict, data: bytes) -> None:
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
