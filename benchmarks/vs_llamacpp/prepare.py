"""The benchmark's setup steps, each skipped when its output is already in the cache: the venv,
llama.cpp's source (vendored in the llama-cpp-python sdist) and build, the bandwidth probe, the
random checkpoint (OLMoE- or DeepSeek-V3-shaped), its Q4_0 GGUF, and colibri's int4 conversion
(with the colibri executable found and checked)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from .common import HERE, REPO, log, run

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist whose vendor/llama.cpp we build
LLAMA_TARGETS = ["llama-bench", "llama-quantize", "llama-perplexity", "llama-imatrix"]
MODEL_CONTEXT = 4096  # the random configs' max_position_embeddings (make_random_moe.py)
LONG_CONTEXT = 32768  # the long-prompt mode's (bench_vs_llamacpp.py --long)
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
LLAMA_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_OPENSSL=OFF",  # (LLAMA_CURL in older trees; deprecated and gone here)
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    # Everything -march=native gives except AMX: llama.cpp's AMX path crashes on machines of
    # this kind (SIGSEGV in ggml_backend_amx_mul_mat at the first prompt, the unfixed upstream
    # issue ggml-org/llama.cpp#20824). GCC keeps explicit -mno-* flags over -march's defaults.
    f"-DCMAKE_C_FLAGS={NO_AMX}",
    f"-DCMAKE_CXX_FLAGS={NO_AMX}",
]


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# The random model's file names per --arch of make_random_moe.py.
ARCH_PREFIX = {
    "olmoe": "olmoe-random",
    "deepseek_v3": "deepseek-v3-random",
    "qwen3_next": "qwen3-next-random",
}


class Paths:
    """The cache's files. The model's are named after its shape: the architecture, a layer
    count other than 16 and a context other than MODEL_CONTEXT (which changes config.json and
    so every conversion) each get their own files."""

    def __init__(self, cache: Path, layers: int, context: int = MODEL_CONTEXT, arch: str = "olmoe"):
        self.cache = cache
        self.venv = cache / "venv"
        self.py = self.venv / "bin" / "python"
        self.dl = cache / "dl"
        self.llama_src = (
            cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
        )
        self.llama_build = cache / f"llama.cpp-build-{LLAMA_CPP_PYTHON_VERSION}-noamx"
        self.llama_bench = self.llama_build / "bin" / "llama-bench"
        self.llama_quantize = self.llama_build / "bin" / "llama-quantize"
        self.bandwidth = cache / "bin" / "bandwidth"
        self.logs = cache / "logs"
        suffix = ("" if layers == 16 else f"-{layers}L") + (
            "" if context == MODEL_CONTEXT else f"-ctx{context}"
        )
        self.context = context
        self.layers = layers
        self.arch = arch
        self.models = models = cache / "models"
        name = ARCH_PREFIX[arch] + suffix
        self.hf = models / f"{name}-hf"
        self.gguf_bf16 = models / f"{name}-bf16.gguf"
        self.gguf_q4 = models / f"{name}-q4_0-pure.gguf"
        self.colibri_model = models / f"{name}-colibri-int4"


def setup_venv(p: Paths) -> None:
    req = HERE / "requirements-bench.txt"
    stamp = p.venv / "colibri-bench-stamp.txt"
    want = file_sha(req)
    if p.py.exists() and stamp.exists() and stamp.read_text().strip() == want:
        log(f"[setup] venv: {p.venv} (cached)")
        return
    log(f"[setup] venv: installing {req.name} into {p.venv} (torch is large; several minutes)")
    if not p.py.exists():
        run([sys.executable, "-m", "venv", p.venv])
    p.logs.mkdir(parents=True, exist_ok=True)
    run(
        [p.py, "-m", "pip", "install", "--progress-bar", "off", "-r", req],
        nice=True,
        log_file=p.logs / "venv-install.log",
    )
    stamp.write_text(want + "\n")


def setup_llama_src(p: Paths) -> None:
    if (p.llama_src / "CMakeLists.txt").exists() and (
        p.llama_src / "convert_hf_to_gguf.py"
    ).exists():
        log(f"[setup] llama.cpp source: {p.llama_src} (cached)")
        return
    log(f"[setup] llama.cpp source: llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist from PyPI")
    p.dl.mkdir(parents=True, exist_ok=True)
    sdist = p.dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        run(
            [
                p.py,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
                "-d",
                p.dl,
            ]
        )
    dest = p.cache / "src"
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tf:
        kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tf.extractall(dest, **kw)
    if not (p.llama_src / "CMakeLists.txt").exists():
        raise SystemExit(f"no vendor/llama.cpp in {sdist}")


def setup_llama_build(p: Paths) -> None:
    if all((p.llama_build / "bin" / t).exists() for t in LLAMA_TARGETS):
        log(f"[setup] llama.cpp build: {p.llama_build} (cached)")
        return
    log("[setup] llama.cpp build (GGML_NATIVE; ~15 min on 2 cores)")
    p.logs.mkdir(parents=True, exist_ok=True)
    run(
        ["cmake", "-S", p.llama_src, "-B", p.llama_build, *LLAMA_CMAKE_FLAGS],
        nice=True,
        log_file=p.logs / "llama-cmake.log",
    )
    run(
        [
            "cmake",
            "--build",
            p.llama_build,
            "-j",
            str(os.cpu_count() or 2),
            "--target",
            *LLAMA_TARGETS,
        ],
        nice=True,
        log_file=p.logs / "llama-build.log",
    )


def setup_bandwidth(p: Paths) -> None:
    src = HERE / "bandwidth.c"
    stamp = p.bandwidth.with_suffix(".src-sha")
    want = file_sha(src)
    if p.bandwidth.exists() and stamp.exists() and stamp.read_text().strip() == want:
        log(f"[setup] bandwidth probe: {p.bandwidth} (cached)")
        return
    log("[setup] bandwidth probe: compiling benchmarks/bandwidth.c")
    p.bandwidth.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    run([cc, "-O3", "-march=native", "-pthread", src, "-o", p.bandwidth])
    stamp.write_text(want + "\n")


def setup_model(p: Paths, seed: int, layers: int) -> None:
    # make_random_moe.py itself skips when the checkpoint is complete, and hard-links the
    # shards of a sibling with the same weights (another context length) instead of writing them
    log(f"[setup] random {p.arch} checkpoint: {p.hf}")
    siblings = [d for d in sorted(p.models.glob(f"{ARCH_PREFIX[p.arch]}*-hf")) if d != p.hf]
    run(
        [
            p.py,
            HERE / "make_random_moe.py",
            p.hf,
            "--arch",
            p.arch,
            "--seed",
            seed,
            "--layers",
            layers,
            "--max-position-embeddings",
            p.context,
            *[x for d in siblings for x in ("--weights-from", d)],
        ],
        nice=True,
    )


def setup_gguf(p: Paths, keep_bf16: bool) -> None:
    hf_stamp = read_json(p.hf / "colibri_bench_complete.json")
    want = {"hf": hf_stamp, "llama_cpp_python": LLAMA_CPP_PYTHON_VERSION, "quant": "Q4_0 --pure"}
    stamp = p.gguf_q4.with_name(p.gguf_q4.name + ".stamp.json")
    if p.gguf_q4.exists() and read_json(stamp) == want:
        log(f"[setup] GGUF Q4_0 --pure: {p.gguf_q4} (cached)")
        return
    p.logs.mkdir(parents=True, exist_ok=True)
    bf16_stamp = p.gguf_bf16.with_name(p.gguf_bf16.name + ".stamp.json")
    if not (p.gguf_bf16.exists() and read_json(bf16_stamp) == want):
        log("[setup] GGUF: convert_hf_to_gguf.py --outtype bf16")
        tmp = p.gguf_bf16.with_name(p.gguf_bf16.name + ".partial")
        run(
            [
                p.py,
                HERE / "convert_to_gguf.py",
                p.llama_src,
                p.hf,
                "--outfile",
                tmp,
                "--outtype",
                "bf16",
                # A random model has no multi-token-prediction layers; llama.cpp's Qwen3-Next
                # converter expects them unless told (harmless for the other architectures).
                *(["--no-mtp"] if p.arch == "qwen3_next" else []),
            ],
            nice=True,
            log_file=p.logs / "convert-gguf.log",
        )
        os.replace(tmp, p.gguf_bf16)
        bf16_stamp.write_text(json.dumps(want, indent=2) + "\n")
    log("[setup] GGUF: llama-quantize --pure Q4_0")
    tmp = p.gguf_q4.with_name(p.gguf_q4.name + ".partial")
    run(
        [p.llama_quantize, "--pure", p.gguf_bf16, tmp, "Q4_0", str(os.cpu_count() or 2)],
        nice=True,
        log_file=p.logs / "quantize.log",
    )
    os.replace(tmp, p.gguf_q4)
    stamp.write_text(json.dumps(want, indent=2) + "\n")
    if not keep_bf16:
        p.gguf_bf16.unlink(missing_ok=True)
        bf16_stamp.unlink(missing_ok=True)


def setup_all(p: Paths, a) -> tuple[Path | None, str | None, str | None]:
    """Every setup step, for the options of bench_vs_llamacpp.py (a): the colibri executable
    to measure (None: skipped or broken), a note on why it is missing, and its version."""
    p.cache.mkdir(parents=True, exist_ok=True)
    t_setup = time.time()
    setup_venv(p)
    setup_llama_src(p)
    setup_llama_build(p)
    setup_bandwidth(p)
    setup_model(p, a.seed, a.layers)
    setup_gguf(p, a.keep_bf16_gguf)
    note, ver, exe = None, None, None
    if a.skip_colibri:
        note = "skipped (--skip-colibri)."
    else:
        exe = find_colibri(a.colibri)
        if exe is None or not exe.exists():
            note = (
                "no colibri executable (looked for --colibri, REPO/.venv/bin/colibri, PATH); "
                "build it and re-run."
            )
            exe = None
            log(f"[colibri] SKIPPED: {note}")
        elif not colibri_runs(exe):
            note = f"`{exe} --help` fails (broken or mid-rebuild?); fix it and re-run."
            log(f"[colibri] SKIPPED: {note}")
            exe = None
        else:
            ver = colibri_version(exe)
            try:
                setup_colibri_model(p, exe, a.reconvert_colibri)
            except SystemExit as e:  # conversion failed: report, still measure llama.cpp
                note = (
                    f"`colibri convert` failed: {str(e).splitlines()[0]} "
                    f"(see {p.logs}/colibri-convert.log)"
                )
                log(f"[colibri] SKIPPED: {e}")
                exe = None
    log(f"[setup] done in {time.time() - t_setup:.0f}s")
    return exe, note, ver


def find_colibri(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    cand = REPO / ".venv" / "bin" / "colibri"
    if cand.exists():
        return cand
    w = shutil.which("colibri")
    return Path(w) if w else None


def colibri_version(exe: Path) -> str:
    """`colibri --version`, else the installed package's version (for a Python entry point).

    It goes into the converted model's stamp. A rebuild of the same version reuses
    the cached conversion (reconverting takes ~15 min); if `colibri bench` then fails
    on it, the model is reconverted once automatically (--reconvert-colibri forces it).
    """
    try:
        r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        if r.returncode == 0 and r.stdout.strip():
            return r.stdout.strip()
        py = colibri_python(exe)
        if py:
            code = "from importlib.metadata import version; print('colibri', version('colibri'))"
            r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                return r.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def colibri_python(exe: Path) -> Path | None:
    """The Python interpreter of a colibri entry point script (its #! line), which imports
    colibri; None for anything else."""
    try:
        first = exe.read_text(errors="replace").split("\n", 1)[0]
    except (OSError, UnicodeDecodeError):
        return None
    if first.startswith("#!") and "python" in first:
        return Path(first[2:].strip().split()[0])
    return None


def ensure_colibri_model(p: Paths, model: Path | None) -> Path:
    """``model``, or the bench's own int4 model (made if missing: the random checkpoint and its
    conversion, nothing of llama.cpp): for the benchmarks that measure colibri alone."""
    model = model or p.colibri_model
    if not (model / "manifest.json").exists():
        exe = find_colibri(None)
        if exe is None:
            raise SystemExit(f"no model at {model} and no colibri executable to convert one")
        setup_venv(p)
        setup_model(p, 0, p.layers)
        setup_colibri_model(p, exe, False)
    return model


def setup_colibri_model(p: Paths, exe: Path, force: bool) -> None:
    hf_stamp = read_json(p.hf / "colibri_bench_complete.json")
    want = {"hf": hf_stamp, "colibri": colibri_version(exe), "quant": "int4"}
    stamp = p.colibri_model.with_name(p.colibri_model.name + ".stamp.json")
    if not force and p.colibri_model.exists() and read_json(stamp) == want:
        log(f"[setup] colibri int4 model: {p.colibri_model} (cached)")
        return
    # --pure: every matrix int4, as the Q4_0 --pure GGUF it is compared with (and as every
    # conversion was before 8-bit matrices; the default, v/o at 8 bits, is bench_quality.py's
    # and bench_mixed_precision.py's).
    log(f"[setup] colibri convert --quant int4 --pure -> {p.colibri_model}")
    p.logs.mkdir(parents=True, exist_ok=True)
    tmp = p.colibri_model.with_name(p.colibri_model.name + ".partial")
    remove_path(tmp)
    run(
        [exe, "convert", p.hf, tmp, "--quant", "int4", "--pure"],
        nice=True,
        log_file=p.logs / "colibri-convert.log",
    )
    # the previous conversion is only replaced once the new one is complete
    stamp.unlink(missing_ok=True)
    remove_path(p.colibri_model)
    os.replace(tmp, p.colibri_model)
    stamp.write_text(json.dumps(want, indent=2) + "\n")


def remove_path(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def colibri_runs(exe: Path) -> bool:
    """Does the colibri executable start at all (e.g. not mid-rebuild)?"""
    try:
        r = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
        return r.returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False
