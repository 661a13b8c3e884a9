"""The `colibri` command line, run as a user would (a subprocess of this interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from colibri.builtin import builtin_name

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
    code = "from colibri.builtin import builtin_model_dir; print(builtin_model_dir())"
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
    assert res["kernel_prefetch"] in ("l1", "l2")


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


def test_convert_shows_progress_on_a_terminal(tmp_path):
    """On a terminal the converter reports progress; piped, it prints only the summary."""
    import pty

    parent, child = pty.openpty()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "colibri",
            "convert",
            str(FIXTURES / "glm4_moe" / "hf"),
            str(tmp_path / "m"),
        ],
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
    out = b"".join(chunks).decode(errors="replace")
    assert "converting 100%" in out and "converted Glm4MoeForCausalLM" in out
    piped = run("convert", str(FIXTURES / "glm4_moe" / "hf"), str(tmp_path / "m2"))
    assert piped.returncode == 0 and "converting" not in piped.stderr
