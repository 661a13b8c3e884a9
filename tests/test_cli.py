"""The `colibri` command line, run as a user would (a subprocess of this interpreter)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from colibri.demo.builtin import builtin_name

from .conftest import FIXTURES


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "colibri", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def test_generate_without_model_uses_the_packaged_demo_model(tmp_path):
    env = {"COLI_CACHE_DIR": str(tmp_path / "cache"), "COLI_MODEL": ""}
    first = run("generate", "--prompt", "Hello", "--max-tokens", "8", env=env)
    assert first.returncode == 0, first.stderr
    assert not (tmp_path / "cache" / "models").exists(), "nothing built: the model ships"
    again = run("generate", "--prompt", "Hello", "--max-tokens", "8", env=env)
    assert again.returncode == 0 and again.stdout == first.stdout, "deterministic"


def build_random_model(cache: Path) -> Path:
    code = "from colibri.demo.builtin import builtin_model_dir; print(builtin_model_dir())"
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLI_CACHE_DIR": str(cache)},
    )
    assert r.returncode == 0, r.stderr
    return Path(r.stdout.strip())


def test_random_model_is_built_once_and_reproducibly(tmp_path):
    a, b = build_random_model(tmp_path / "a"), build_random_model(tmp_path / "b")
    assert a.name == b.name == builtin_name()
    assert (a / "resident.bin").read_bytes() == (b / "resident.bin").read_bytes()
    assert build_random_model(tmp_path / "a") == a  # cached


def test_generate_prints_the_greedy_continuation(converted):
    from colibri import Engine

    model = converted("olmoe", "f32")
    eng = Engine(model)
    prompt = "Hello, world!"
    ids = eng.tokenize(prompt)
    want = eng.detokenize(t for t in eng.generate(ids, max_tokens=10) if t not in eng.eos_token_ids)
    r = run("generate", "--model", str(model), "--prompt", prompt, "--max-tokens", "10")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"


def test_convert_then_bench_json(tmp_path):
    out = tmp_path / "m"
    r = run("convert", str(FIXTURES / "qwen3_moe" / "hf"), str(out))
    assert r.returncode == 0, r.stderr
    assert "Qwen3MoeForCausalLM" in r.stdout
    b = run(
        "bench",
        "--model",
        str(out),
        "--prompt-tokens",
        "16",
        "--gen-tokens",
        "4",
        "--repeat",
        "1",
        "--json",
    )
    assert b.returncode == 0, b.stderr
    res = json.loads(b.stdout)
    assert res["prefill_tok_s"] > 0 and res["decode_tok_s"] > 0 and res["peak_rss_mb"] > 0
    assert res["kernel"] in ("scalar", "avx2", "avx512")
    assert res["kernel_prefetch"] in ("l1", "l2", "off")
    assert res["kernel_prefetch_decode"] in ("l1", "l2", "off")


def test_missing_model_directory_is_a_one_line_error(tmp_path):
    r = run("generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    assert r.returncode != 0
    assert r.stderr.startswith("colibri: ") and "Traceback" not in r.stderr


def test_coli_kernel_environment_override_selects_each_path():
    from colibri._engine import available_kernels

    for name in available_kernels():
        r = subprocess.run(
            [
                sys.executable,
                "-c",
                "from colibri._engine import default_kernel; print(default_kernel())",
            ],
            capture_output=True,
            text=True,
            env={**os.environ, "COLI_KERNEL": name},
        )
        assert r.stdout.strip() == name, r.stderr
    bad = subprocess.run(
        [
            sys.executable,
            "-c",
            "from colibri._engine import default_kernel; print(default_kernel())",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "COLI_KERNEL": "bogus"},
    )
    assert bad.returncode == 0 and "COLI_KERNEL" in bad.stderr, "unknown value: one warning line"


def run_on_a_terminal(*args: str) -> str:
    """`colibri ARGS` with a pseudo-terminal as stdin/stdout/stderr; everything it printed."""
    import pty

    parent, child = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "colibri", *args],
        stdin=child,
        stdout=child,
        stderr=child,
        env=os.environ.copy(),
    )
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(parent, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=120) == 0
    os.close(parent)
    return b"".join(chunks).decode(errors="replace")


def test_convert_shows_progress_on_a_terminal(tmp_path):
    """On a terminal the converter reports progress; piped, it prints only the summary."""
    out = run_on_a_terminal("convert", str(FIXTURES / "glm4_moe" / "hf"), str(tmp_path / "m"))
    assert "converting 100%" in out and "converted Glm4MoeForCausalLM" in out
    piped = run("convert", str(FIXTURES / "glm4_moe" / "hf"), str(tmp_path / "m2"))
    assert piped.returncode == 0 and "converting" not in piped.stderr


def v3_nibble_order(groups: int) -> np.ndarray:
    """Where format v3 keeps each nibble byte of a row (docs/FORMATS.md), indexed by its v2
    position (group g's 16 bytes together at g * 16): blocks of 16 groups, byte j of the
    block's group i at (j // 4) * 4m + 4i + j % 4."""
    order = np.empty(groups * 16, dtype=np.int64)
    for g in range(groups):
        b, i = divmod(g, 16)
        m = min(16, groups - 16 * b)
        for j in range(16):
            order[g * 16 + j] = b * 256 + (j // 4) * 4 * m + 4 * i + j % 4
    return order


def write_v2(v3: Path, v2: Path) -> None:
    """The v3 model directory `v3` stored as format v2 would have stored it."""
    shutil.copytree(v3, v2)
    manifest = json.loads((v3 / "manifest.json").read_text())

    def back(buf: np.ndarray, entries) -> None:
        for e in entries:
            if e["dtype"] != "q4":
                continue
            rows, cols = e["shape"]
            groups = -(-cols // 32)
            m = buf[e["offset"] : e["offset"] + e["nbytes"]].reshape(rows, groups * 18)
            m[:, groups * 2 :] = m[:, groups * 2 :][:, v3_nibble_order(groups)]

    res = np.fromfile(v3 / manifest["resident"]["file"], dtype=np.uint8)
    back(res, manifest["resident"]["tensors"].values())
    res.tofile(v2 / manifest["resident"]["file"])
    x = manifest["experts"]
    recs = np.fromfile(v3 / x["file"], dtype=np.uint8).reshape(-1, x["record_size"])
    for rec in recs:
        back(rec, x["parts"].values())
    recs.tofile(v2 / x["file"])
    manifest["version"] = 2
    (v2 / "manifest.json").write_text(json.dumps(manifest))


def test_upgrade_reencodes_a_v2_directory_losslessly(tmp_path, converted):
    v3 = converted("glm4_moe", "int4")
    v2 = tmp_path / "v2"
    write_v2(v3, v2)
    assert (v2 / "resident.bin").read_bytes() != (v3 / "resident.bin").read_bytes()
    refused = run("generate", "--model", str(v2), "--prompt", "Hi", "--max-tokens", "2")
    assert refused.returncode != 0 and "colibri upgrade" in refused.stderr
    up = tmp_path / "up"
    r = run("upgrade", str(v2), str(up))
    assert r.returncode == 0, r.stderr
    assert "int4 matrices re-encoded" in r.stdout
    for f in ("resident.bin", "experts.bin", "tokenizer.json"):
        assert (up / f).read_bytes() == (v3 / f).read_bytes(), f
    a = run("generate", "--model", str(up), "--prompt", "Hello", "--max-tokens", "6")
    b = run("generate", "--model", str(v3), "--prompt", "Hello", "--max-tokens", "6")
    assert a.returncode == 0 and a.stdout == b.stdout
    # Again, or into a directory that exists: a one-line error naming the reason.
    again = run("upgrade", str(up), str(tmp_path / "x"))
    assert again.returncode != 0 and "already format v3" in again.stderr
    exists = run("upgrade", str(v2), str(up))
    assert exists.returncode != 0 and "already exists" in exists.stderr
    assert "Traceback" not in again.stderr + exists.stderr
    assert "upgrading" not in r.stderr  # piped: the summary only
    shown = run_on_a_terminal("upgrade", str(v2), str(tmp_path / "up2"))
    assert "upgrading 100%" in shown and "int4 matrices re-encoded" in shown
