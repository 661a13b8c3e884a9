#!/usr/bin/env python3
"""colibri vs llama.cpp speed benchmark on a random OLMoE-1B-7B-shaped model.

One run does everything, idempotently (each step is skipped when its output is
already in the cache, ~/.cache/colibri-bench by default):

  setup   1. a Python venv (cache/venv) from benchmarks/requirements-bench.txt
          2. llama.cpp, from the tree vendored in the llama-cpp-python sdist on
             PyPI, built with GGML_NATIVE (llama-bench, llama-quantize)
          3. benchmarks/bandwidth.c compiled with -O3 -march=native
          4. the random bf16 HF checkpoint (make_random_olmoe.py, seeded)
          5. GGUF: convert_hf_to_gguf.py --outtype bf16, then
             llama-quantize --pure ... Q4_0
          6. colibri convert HF_DIR OUT_DIR --quant int4   (if colibri is found)
  measure N rounds; each round measures the machine's read bandwidth, then
          llama.cpp and colibri one after the other, the order swapping every
          round (A/B, B/A, ...), so that slow drift of a noisy machine hits
          both engines alike; then both again decoding after --depth tokens
          of context (default 1024; llama-bench -d), where reading the KV
          history starts to matter as much as the weights
  report  medians with min/max per metric, colibri/llama.cpp ratios, the
          decode ceiling (bandwidth / bytes read per decoded token) and each
          engine's fraction of it; printed and written as markdown (--out)

Only the Python standard library is needed to run this file; it uses python3,
cmake, a C/C++ compiler and network access to PyPI for the setup.

    python3 benchmarks/bench_vs_llamacpp.py                # full run
    python3 benchmarks/bench_vs_llamacpp.py --setup-only   # warm the cache
    python3 benchmarks/bench_vs_llamacpp.py --rounds 9 --out docs/bench.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the sdist whose vendor/llama.cpp we build
LLAMA_TARGETS = ["llama-bench", "llama-quantize"]
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
BITS_PER_WEIGHT = 4.5  # Q4_0: 32 4-bit weights + one f16 scale per block
NICE = ["nice", "-n", "10"]  # heavy setup steps yield to other work; measurements do not


def log(msg: str) -> None:
    print(msg, flush=True)


def run(
    cmd: list, *, nice: bool = False, log_file: Path | None = None, **kw
) -> subprocess.CompletedProcess:
    cmd = [str(c) for c in cmd]
    if nice and shutil.which("nice"):
        cmd = NICE + cmd
    log("  $ " + " ".join(cmd) + (f"  > {log_file}" if log_file else ""))
    if log_file:
        with open(log_file, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
        if r.returncode != 0:
            tail = log_file.read_text(errors="replace").splitlines()[-30:]
            raise SystemExit(
                f"command failed ({r.returncode}): {' '.join(cmd)}\n--- {log_file} (tail)\n"
                + "\n".join(tail)
            )
        return r
    return subprocess.run(cmd, check=True, **kw)


def file_sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- setup steps


class Paths:
    def __init__(self, cache: Path, layers: int):
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
        suffix = "" if layers == 16 else f"-{layers}L"
        models = cache / "models"
        self.hf = models / f"olmoe-random{suffix}-hf"
        self.gguf_bf16 = models / f"olmoe-random{suffix}-bf16.gguf"
        self.gguf_q4 = models / f"olmoe-random{suffix}-q4_0-pure.gguf"
        self.colibri_model = models / f"olmoe-random{suffix}-colibri-int4"


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
    if p.llama_bench.exists() and p.llama_quantize.exists():
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
    # make_random_olmoe.py itself skips when the checkpoint is complete
    log(f"[setup] random OLMoE checkpoint: {p.hf}")
    run([p.py, HERE / "make_random_olmoe.py", p.hf, "--seed", seed, "--layers", layers], nice=True)


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
        first = exe.read_text(errors="replace").split("\n", 1)[0]
        if first.startswith("#!") and "python" in first:
            code = "from importlib.metadata import version; print('colibri', version('colibri'))"
            py = first[2:].strip().split()[0]
            r = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=60)
            if r.returncode == 0:
                return r.stdout.strip()
    except (OSError, UnicodeDecodeError, subprocess.TimeoutExpired):
        pass
    return "unknown"


def setup_colibri_model(p: Paths, exe: Path, force: bool) -> None:
    hf_stamp = read_json(p.hf / "colibri_bench_complete.json")
    want = {"hf": hf_stamp, "colibri": colibri_version(exe), "quant": "int4"}
    stamp = p.colibri_model.with_name(p.colibri_model.name + ".stamp.json")
    if not force and p.colibri_model.exists() and read_json(stamp) == want:
        log(f"[setup] colibri int4 model: {p.colibri_model} (cached)")
        return
    log(f"[setup] colibri convert --quant int4 -> {p.colibri_model}")
    p.logs.mkdir(parents=True, exist_ok=True)
    tmp = p.colibri_model.with_name(p.colibri_model.name + ".partial")
    remove_path(tmp)
    run(
        [exe, "convert", p.hf, tmp, "--quant", "int4"],
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


# ---------------------------------------------------------------- measurement


def cpu_times() -> tuple[int, int] | None:
    """(busy, total) jiffies over all CPUs from /proc/stat, or None off Linux."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    total = sum(f[:8])  # user nice system idle iowait irq softirq steal
    return total - f[3] - f[4], total


def others_cpu(before, after, own_cpu_s: float = 0.0) -> float | None:
    """Fraction of all CPUs used by other processes between two cpu_times() samples."""
    if not before or not after or after[1] <= before[1]:
        return None
    own = own_cpu_s * os.sysconf("SC_CLK_TCK")
    return max(0.0, (after[0] - before[0] - own) / (after[1] - before[1]))


def wait_for_idle(max_wait: float, threshold: float) -> float | None:
    """Wait (up to max_wait s) until other processes use <= threshold of the CPUs.

    Returns the last 1-second busy fraction seen.
    """
    t0 = time.monotonic()
    said = -1e9
    while True:
        c0 = cpu_times()
        time.sleep(1.0)
        busy = others_cpu(c0, cpu_times())
        if busy is None or busy <= threshold:
            return busy
        waited = time.monotonic() - t0
        if waited >= max_wait:
            log(f"  machine still busy ({busy:.0%} CPU) after {waited:.0f}s; measuring anyway")
            return busy
        if waited - said >= 15:
            log(f"  waiting for the machine to go idle (other processes: {busy:.0%} CPU)")
            said = waited


def run_with_rss(cmd: list, timeout: float) -> dict:
    """Run cmd to completion, reaping it with wait4.

    Returns rc, out, err, the child's own peak RSS (rss_mb) and the share of the
    CPUs that other processes used meanwhile (others_cpu: the machine's busy time
    minus the child's own CPU time, over the wall time of all CPUs).
    """
    import tempfile

    cmd = [str(c) for c in cmd]
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        c0 = cpu_times()
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, text=True)
        deadline = time.monotonic() + timeout
        rc, ru = None, None
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                rc = os.waitstatus_to_exitcode(status)
                proc.returncode = rc
                break
            if time.monotonic() > deadline:
                proc.kill()
                _, status, ru = os.wait4(proc.pid, 0)
                proc.returncode = rc = -9
                break
            time.sleep(0.05)
        c1 = cpu_times()
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    if rc == -9:
        err += f"\n(killed after {timeout:.0f}s)"
    own = (ru.ru_utime + ru.ru_stime) if ru else 0.0
    return {
        "rc": rc,
        "out": out,
        "err": err,
        "rss_mb": ru.ru_maxrss / 1024.0 if ru else 0.0,
        "others_cpu": others_cpu(c0, c1, own),
    }


def last_json_object(text: str):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    try:
        return json.loads(text)
    except ValueError:
        return None


def measure_bandwidth(p: Paths, threads: int, size_mib: int, passes: int) -> dict:
    r = run_with_rss([p.bandwidth, "-t", threads, "-s", size_mib, "-r", passes, "--json"], 300)
    obj = last_json_object(r["out"]) if r["rc"] == 0 else None
    if not obj:
        raise SystemExit(f"bandwidth probe failed ({r['rc']}): {r['err'].strip()[-2000:]}")
    # best pass: interference only ever lowers bandwidth, and the ceiling is what the
    # memory system can deliver (each pass streams the whole buffer, 8x the caches)
    # (the median pass is kept too: a second, less optimistic ceiling)
    return {
        "gb_s": obj["max_gb_s"],
        "median_gb_s": obj["median_gb_s"],
        "others_cpu": r["others_cpu"],
        "raw": obj,
    }


def median_ts(row: dict) -> float:
    """Median over llama-bench's repetitions (its avg_ts is the mean)."""
    samples = row.get("samples_ts") or [row["avg_ts"]]
    return float(statistics.median(samples))


def run_llama_bench(p: Paths, a, args: list, timeout: int) -> tuple[list[dict], dict]:
    """llama-bench on the Q4_0 model with `args` (its test sizes): its JSON rows and the run."""
    cmd = [p.llama_bench, "-m", p.gguf_q4, "-t", a.threads, *args, "-r", a.reps, "-o", "json"]
    r = run_with_rss(cmd, timeout)
    if r["rc"] != 0:
        raise SystemExit(f"llama-bench failed ({r['rc']}):\n{r['err'].strip()[-3000:]}")
    try:
        return json.loads(r["out"]), r
    except ValueError:
        raise SystemExit(f"could not parse llama-bench JSON:\n{r['out'][-2000:]}") from None


def measure_llama(p: Paths, a) -> dict:
    rows, r = run_llama_bench(p, a, ["-p", a.prompt_tokens, "-n", a.gen_tokens], 900)
    res = {"peak_rss_mb": r["rss_mb"], "others_cpu": r["others_cpu"]}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            res["prefill_tok_s"] = median_ts(row)
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            res["decode_tok_s"] = median_ts(row)
    if "prefill_tok_s" not in res or "decode_tok_s" not in res:
        raise SystemExit(f"unexpected llama-bench output:\n{r['out'][-2000:]}")
    return res


def measure_llama_depth(p: Paths, a) -> dict:
    """Decode after --depth tokens of context (llama-bench fills the depth once, untimed)."""
    rows, r = run_llama_bench(p, a, ["-p", 0, "-n", a.gen_tokens, "-d", a.depth], 1800)
    rows = [row for row in rows if row.get("n_gen", 0) > 0]
    if not rows:
        raise SystemExit(f"unexpected llama-bench output:\n{r['out'][-2000:]}")
    return {"decode_tok_s": median_ts(rows[0]), "others_cpu": r["others_cpu"]}


def measure_colibri(exe: Path, p: Paths, a, prompt_tokens: int | None = None) -> dict:
    """`colibri bench`; its decode runs after the prompt, so a `prompt_tokens` of --depth
    measures decode at that depth."""
    cmd = [
        exe,
        "bench",
        "--model",
        p.colibri_model,
        "--threads",
        a.threads,
        "--prompt-tokens",
        prompt_tokens or a.prompt_tokens,
        "--gen-tokens",
        a.gen_tokens,
        "--repeat",
        a.reps,
        "--json",
    ]
    r = run_with_rss(cmd, 1800)
    obj = last_json_object(r["out"]) if r["rc"] == 0 else None
    if not obj or "decode_tok_s" not in obj or "prefill_tok_s" not in obj:
        msg = (r["err"] or r["out"]).strip()[-3000:]
        raise RuntimeError(f"colibri bench failed (exit {r['rc']}):\n{msg}")
    return {
        "prefill_tok_s": float(obj["prefill_tok_s"]),
        "decode_tok_s": float(obj["decode_tok_s"]),
        "peak_rss_mb": float(obj.get("peak_rss_mb") or r["rss_mb"]),
        "others_cpu": r["others_cpu"],
        "raw": obj,
    }


# ---------------------------------------------------------------- model arithmetic


def bytes_per_decoded_token(cfg: dict, bits: float = BITS_PER_WEIGHT) -> dict:
    """Weight bytes one decode step reads: everything active for one token."""
    h = cfg["hidden_size"]
    inter = cfg["intermediate_size"]
    n_head = cfg["num_attention_heads"]
    kv_dim = h // n_head * cfg["num_key_value_heads"]
    L = cfg["num_hidden_layers"]
    attn = L * (2 * h * h + 2 * kv_dim * h)
    router = L * cfg["num_experts"] * h
    experts = L * cfg["num_experts_per_tok"] * 3 * h * inter
    lm_head = cfg["vocab_size"] * h
    embed_row = h
    active = attn + router + experts + lm_head + embed_row
    total = 2 * cfg["vocab_size"] * h + L * (
        2 * h * h + 2 * kv_dim * h + cfg["num_experts"] * h + cfg["num_experts"] * 3 * h * inter
    )
    return {
        "active_params": active,
        "total_params": total,
        "attn": attn,
        "router": router,
        "experts": experts,
        "lm_head": lm_head,
        "bytes": active * bits / 8,
    }


# ---------------------------------------------------------------- report


def stats(xs: list[float]) -> tuple[float, float, float] | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return statistics.median(xs), min(xs), max(xs)


def fmt(s, digits: int = 1, unit: str = "") -> str:
    if s is None:
        return "n/a"
    med, lo, hi = s
    return f"{med:.{digits}f}{unit} ({lo:.{digits}f}–{hi:.{digits}f})"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_cache_bytes(cpu_dir: Path = Path("/sys/devices/system/cpu")) -> int:
    """Total size of every distinct CPU cache (each L1/L2 of each core, each shared L3
    once), from sysfs; 0 when the kernel does not say."""
    seen: set[tuple[str, ...]] = set()
    total = 0
    for d in sorted(cpu_dir.glob("cpu[0-9]*/cache/index[0-9]*")):
        try:
            key = tuple((d / f).read_text().strip() for f in ("level", "type", "shared_cpu_list"))
            size = (d / "size").read_text().strip()
        except OSError:
            continue
        if key in seen:
            continue
        seen.add(key)
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size.rstrip("KMGkmg")
        total += int(digits) * unit if digits.isdigit() else 0
    return total


def probe_size_mib(requested: int, cache_bytes: int) -> int:
    """The bandwidth probe's buffer: what was asked for, or (0, the default) 8x all the
    CPU caches, in whole GiB and never below 1 GiB. STREAM asks for at least 4x so that
    no pass is served from cache; these VMs report L3s of up to 480 MB whose replacement
    policy keeps part of a 1 GiB stream between passes (its best pass read 10-15% above
    an 8 GiB one's, measured in alternation), so twice that margin."""
    if requested > 0:
        return requested
    gib = -(-8 * cache_bytes // (1 << 30))
    return max(1, gib) * 1024


def mem_total_gb() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return int(line.split()[1]) / 1024**2
    except OSError:
        pass
    return 0.0


def git_rev() -> str:
    try:
        r = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return r.stdout.strip() or "uncommitted"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def build_report(
    a, rounds: list[dict], bpt: dict, colibri_note: str | None, colibri_ver: str | None
) -> str:
    L = {
        k: stats([r["llama"][k] for r in rounds if r.get("llama")])
        for k in ("decode_tok_s", "prefill_tok_s", "peak_rss_mb")
    }
    C = {
        k: stats([r["colibri"][k] for r in rounds if r.get("colibri")])
        for k in ("decode_tok_s", "prefill_tok_s", "peak_rss_mb")
    }
    bw = stats([r["bw"]["gb_s"] for r in rounds if r.get("bw")])
    bw_median = stats(
        [r["bw"]["median_gb_s"] for r in rounds if r.get("bw", {}).get("median_gb_s")]
    )
    gb_per_tok = bpt["bytes"] / 1e9

    def ratio(key: str) -> str:
        if not C[key] or not L[key]:
            return "n/a"
        paired = [
            r["colibri"][key] / r["llama"][key]
            for r in rounds
            if r.get("colibri") and r.get("llama")
        ]
        return f"**{C[key][0] / L[key][0]:.2f}** (per round {min(paired):.2f}–{max(paired):.2f})"

    def of_ceiling(eng: str, key: str = "gb_s") -> str:
        vals = [
            r[eng]["decode_tok_s"] * gb_per_tok / r["bw"][key]
            for r in rounds
            if r.get(eng) and r.get("bw") and r["bw"].get(key)
        ]
        s = stats(vals)
        if not s:
            return "n/a"
        return f"{100 * s[0]:.0f}% ({100 * s[1]:.0f}–{100 * s[2]:.0f}%)"

    def busy_of(eng: str) -> str:
        s = stats([r[eng]["others_cpu"] for r in rounds if r.get(eng)])
        if not s:
            return "n/a"
        return f"{100 * s[0]:.0f}% ({100 * s[1]:.0f}–{100 * s[2]:.0f}%)"

    def round_busy(r: dict) -> float | None:
        xs = [r[k].get("others_cpu") for k in ("bw", "llama", "colibri") if r.get(k)]
        xs = [x for x in xs if x is not None]
        return max(xs) if xs else None

    def depth_rows() -> list[str]:
        cd = stats([r["colibri_depth"]["decode_tok_s"] for r in rounds if r.get("colibri_depth")])
        ld = stats([r["llama_depth"]["decode_tok_s"] for r in rounds if r.get("llama_depth")])
        if not cd and not ld:
            return []
        paired = [
            r["colibri_depth"]["decode_tok_s"] / r["llama_depth"]["decode_tok_s"]
            for r in rounds
            if r.get("colibri_depth") and r.get("llama_depth")
        ]
        ratio_d = (
            f"**{cd[0] / ld[0]:.2f}** (per round {min(paired):.2f}–{max(paired):.2f})"
            if cd and ld and paired
            else "n/a"
        )
        return [
            f"| decode tok/s after a {a.depth}-token context | {fmt(cd, 2)} | {fmt(ld, 2)} | "
            f"{ratio_d} |"
        ]

    worst = max((b for b in map(round_busy, rounds) if b is not None), default=None)
    ceiling = stats([r["bw"]["gb_s"] / gb_per_tok for r in rounds if r.get("bw")])
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    shape = "" if a.layers == 16 else f" ({a.layers} layers)"
    lines = [
        f"## colibri vs llama.cpp: random OLMoE-1B-7B{shape}, {a.threads} threads",
        "",
        f"Median (min–max) over {len(rounds)} alternating rounds. colibri int4 vs llama.cpp "
        f"Q4_0 `--pure` from the same bf16 weights; prefill = {a.prompt_tokens}-token prompt, "
        f"decode = {a.gen_tokens} generated tokens.",
        "",
        "| | colibri int4 | llama.cpp Q4_0 | colibri / llama.cpp |",
        "|---|---|---|---|",
        f"| decode tok/s | {fmt(C['decode_tok_s'], 2)} | {fmt(L['decode_tok_s'], 2)} | "
        f"{ratio('decode_tok_s')} |",
        f"| prefill tok/s ({a.prompt_tokens}-token prompt) | {fmt(C['prefill_tok_s'], 1)} | "
        f"{fmt(L['prefill_tok_s'], 1)} | {ratio('prefill_tok_s')} |",
        *depth_rows(),
        f"| peak RSS, MB | {fmt(C['peak_rss_mb'], 0)} | {fmt(L['peak_rss_mb'], 0)} | |",
        f"| decode as % of bandwidth ceiling | {of_ceiling('colibri')} | {of_ceiling('llama')} | |",
        f"| same, ceiling from the probe's median pass | {of_ceiling('colibri', 'median_gb_s')} | "
        f"{of_ceiling('llama', 'median_gb_s')} | |",
        f"| CPU used by other processes meanwhile | {busy_of('colibri')} | {busy_of('llama')} | |",
        "",
        "| machine and model | |",
        "|---|---|",
        f"| read bandwidth, {a.threads} threads (bandwidth.c, best of {a.bw_passes} passes "
        f"over {a.bw_size_mib} MiB) | {fmt(bw, 1, ' GB/s')} |",
        f"| read bandwidth, median of the {a.bw_passes} passes | {fmt(bw_median, 1, ' GB/s')} |",
        f"| weight bytes read per decoded token at {BITS_PER_WEIGHT} bits/weight | "
        f"{gb_per_tok:.3f} GB "
        f"({bpt['active_params'] / 1e9:.3f}B active of {bpt['total_params'] / 1e9:.2f}B params) |",
        f"| decode ceiling = bandwidth / bytes per token | {fmt(ceiling, 1, ' tok/s')} |",
        "",
        f"{when}; {cpu_name()}, {os.cpu_count()} cores, {mem_total_gb():.0f} GB; "
        f"llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (llama-bench "
        f"`-t {a.threads} -p {a.prompt_tokens} -n {a.gen_tokens} -r {a.reps}`"
        + (f", and `-p 0 -n {a.gen_tokens} -d {a.depth}`" if a.depth else "")
        + "); "
        f"colibri: {colibri_ver or 'n/a'}, repo at {git_rev()}.",
    ]
    if worst is not None and worst > a.max_others:
        lines += [
            "",
            f"**Noisy run:** other processes used up to {worst:.0%} of the CPUs during the "
            "measurements; both engines run 2 threads on 2 cores, so such rounds are slowed "
            "(llama.cpp's spinning thread pool especially). Re-run on an idle machine.",
        ]
    if colibri_note:
        lines += ["", f"**colibri:** {colibri_note}"]
    lines += [
        "",
        "<details><summary>per-round samples</summary>",
        "",
        "| round | order | GB/s | colibri decode | colibri prefill | llama.cpp decode "
        "| llama.cpp prefill | others' CPU (max) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def g(r, eng, k, d=2):
        return f"{r[eng][k]:.{d}f}" if r.get(eng) else "–"

    for i, r in enumerate(rounds):
        lines.append(
            f"| {i + 1} | {r['order']} | {r['bw']['gb_s']:.1f} | "
            f"{g(r, 'colibri', 'decode_tok_s')} | "
            f"{g(r, 'colibri', 'prefill_tok_s', 1)} | {g(r, 'llama', 'decode_tok_s')} | "
            f"{g(r, 'llama', 'prefill_tok_s', 1)} | "
            + ("–" if round_busy(r) is None else f"{round_busy(r):.0%}")
            + " |"
        )
    lines += ["", "</details>", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="colibri vs llama.cpp speed benchmark (see module docstring)"
    )
    ap.add_argument("--rounds", type=int, default=5, help="alternating A/B rounds (default 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument(
        "--depth",
        type=int,
        default=1024,
        help="also measure decode after this many tokens of context (llama-bench -d; "
        "colibri: a prompt that long); 0 = skip (default 1024)",
    )
    ap.add_argument(
        "--reps",
        type=int,
        default=3,
        help="repetitions per engine per round, median taken (llama-bench -r, colibri --repeat)",
    )
    ap.add_argument(
        "--bw-size-mib",
        type=int,
        default=0,
        help="bandwidth probe buffer in MiB (default 0: 8x the CPU caches, at least 1024)",
    )
    ap.add_argument("--bw-passes", type=int, default=10, help="bandwidth probe passes per round")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=180,
        help="before each round, wait up to this many seconds for other processes to go "
        "quiet (default 180; 0 = never wait)",
    )
    ap.add_argument(
        "--max-others",
        type=float,
        default=0.25,
        help="re-measure an engine when other processes took more than this fraction of "
        "the CPUs during its run (default 0.25)",
    )
    ap.add_argument("--retries", type=int, default=2, help="re-measurements per engine per round")
    ap.add_argument(
        "--max-wait-total",
        type=float,
        default=1200,
        help="total seconds the whole run may spend waiting for quiet and re-measuring "
        "(default 1200); after that it measures straight through and flags noisy rounds",
    )
    ap.add_argument(
        "--idle-threshold",
        type=float,
        default=0.15,
        help="'quiet' = other processes use at most this fraction of all CPUs (default 0.15)",
    )
    ap.add_argument(
        "--out", type=Path, default=HERE / "results" / "latest.md", help="markdown output path"
    )
    ap.add_argument("--json-out", type=Path, help="also write raw per-round results as JSON")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(
            os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
        ),
    )
    ap.add_argument(
        "--colibri", help="colibri executable (default: REPO/.venv/bin/colibri, then PATH)"
    )
    ap.add_argument(
        "--skip-colibri", action="store_true", help="measure llama.cpp and bandwidth only"
    )
    ap.add_argument(
        "--reconvert-colibri", action="store_true", help="redo colibri convert even if cached"
    )
    ap.add_argument("--setup-only", action="store_true", help="prepare everything, measure nothing")
    ap.add_argument(
        "--keep-bf16-gguf", action="store_true", help="keep the 14 GB bf16 GGUF after quantizing"
    )
    ap.add_argument("--seed", type=int, default=0, help="random model seed")
    ap.add_argument(
        "--layers",
        type=int,
        default=16,
        help="model layers (16 = OLMoE-1B-7B; fewer for a smoke test)",
    )
    a = ap.parse_args(argv)
    a.bw_size_mib = probe_size_mib(a.bw_size_mib, cpu_cache_bytes())

    p = Paths(a.cache.expanduser().resolve(), a.layers)
    p.cache.mkdir(parents=True, exist_ok=True)
    t_setup = time.time()
    setup_venv(p)
    setup_llama_src(p)
    setup_llama_build(p)
    setup_bandwidth(p)
    setup_model(p, a.seed, a.layers)
    setup_gguf(p, a.keep_bf16_gguf)

    colibri_note = None
    colibri_ver = None
    exe = None
    if a.skip_colibri:
        colibri_note = "skipped (--skip-colibri)."
    else:
        exe = find_colibri(a.colibri)
        if exe is None or not exe.exists():
            colibri_note = (
                "no colibri executable (looked for --colibri, REPO/.venv/bin/colibri, PATH); "
                "build it and re-run."
            )
            exe = None
            log(f"[colibri] SKIPPED: {colibri_note}")
        elif not colibri_runs(exe):
            colibri_note = f"`{exe} --help` fails (broken or mid-rebuild?); fix it and re-run."
            log(f"[colibri] SKIPPED: {colibri_note}")
            exe = None
        else:
            colibri_ver = colibri_version(exe)
            try:
                setup_colibri_model(p, exe, a.reconvert_colibri)
            except SystemExit as e:  # conversion failed: report, still measure llama.cpp
                colibri_note = (
                    f"`colibri convert` failed: {str(e).splitlines()[0]} "
                    f"(see {p.logs}/colibri-convert.log)"
                )
                log(f"[colibri] SKIPPED: {e}")
                exe = None
    log(f"[setup] done in {time.time() - t_setup:.0f}s")
    if a.setup_only:
        return 0

    cfg = json.loads((p.hf / "config.json").read_text())
    bpt = bytes_per_decoded_token(cfg)
    rounds: list[dict] = []
    log(
        f"[measure] {a.rounds} rounds, {a.threads} threads, "
        f"prompt {a.prompt_tokens}, gen {a.gen_tokens}"
    )
    retried_convert = False
    colibri_failures = 0
    colibri_errors: list[str] = []
    wait_budget = [a.max_wait_total]  # seconds of waiting/re-measuring left for the whole run

    def settle() -> float | None:
        """Wait for an idle machine, within the per-wait and whole-run budgets."""
        limit = min(a.wait_idle, wait_budget[0])
        if limit <= 0:
            return None
        t0 = time.monotonic()
        busy = wait_for_idle(limit, a.idle_threshold)
        wait_budget[0] -= time.monotonic() - t0
        return busy

    def clean(measure, what: str) -> dict:
        """Measure; while other processes took > --max-others of the CPUs meanwhile,
        wait for quiet and measure again (--retries times), keeping the cleanest."""
        best = None
        for attempt in range(1 + a.retries):
            t0 = time.monotonic()
            res = measure()
            if attempt:
                wait_budget[0] -= time.monotonic() - t0
            res["attempts"] = attempt + 1
            busy = res.get("others_cpu")
            if best is None or (busy or 0) < (best.get("others_cpu") or 0):
                best = res
            if busy is None or busy <= a.max_others or attempt == a.retries:
                break
            if wait_budget[0] <= 0:
                log(f"  {what}: other processes took {busy:.0%} CPU (no waiting budget left)")
                break
            log(f"  {what}: other processes took {busy:.0%} CPU meanwhile; re-measuring")
            settle()
        return best

    for i in range(a.rounds):
        engines = ["llama", "colibri"] if i % 2 == 0 else ["colibri", "llama"]
        if exe is None:
            engines = ["llama"]
        r: dict = {"order": " → ".join("llama.cpp" if e == "llama" else e for e in engines)}
        r["idle_before"] = settle()
        r["bw"] = clean(
            lambda: measure_bandwidth(p, a.threads, a.bw_size_mib, a.bw_passes), "bandwidth"
        )
        for eng in engines:
            if eng == "llama":
                r["llama"] = clean(lambda: measure_llama(p, a), "llama.cpp")
            else:
                try:
                    r["colibri"] = clean(lambda x=exe: measure_colibri(x, p, a), "colibri")
                    colibri_failures = 0
                except RuntimeError as e:
                    err = e
                    if not colibri_runs(exe):
                        # colibri itself is broken (e.g. being rebuilt): not the model's fault
                        log(f"[colibri] does not start; round {i + 1} without it:\n{e}")
                    elif not retried_convert and not a.reconvert_colibri:
                        # a cached conversion may predate a format change: reconvert once, retry
                        retried_convert = True
                        log(f"[colibri] bench failed; reconverting once and retrying:\n{e}")
                        try:
                            setup_colibri_model(p, exe, True)
                            r["colibri"] = clean(lambda x=exe: measure_colibri(x, p, a), "colibri")
                            colibri_failures = 0
                        except (RuntimeError, SystemExit) as e2:
                            err = e2
                    if "colibri" not in r:
                        colibri_failures += 1
                        colibri_errors.append(f"round {i + 1}: {str(err).strip()[-500:]}")
                        if colibri_failures >= 2:
                            log("[colibri] failed twice in a row; continuing with llama.cpp only")
                            exe = None
        if a.depth:
            for eng in engines:
                if eng == "llama":
                    r["llama_depth"] = clean(lambda: measure_llama_depth(p, a), "llama.cpp -d")
                elif exe is not None:
                    try:
                        r["colibri_depth"] = clean(
                            lambda x=exe: measure_colibri(x, p, a, a.depth), "colibri depth"
                        )
                    except RuntimeError as e:
                        colibri_errors.append(f"round {i + 1} at depth {a.depth}: {e}"[-500:])
        rounds.append(r)
        parts = [f"bw {r['bw']['gb_s']:.1f} GB/s"]
        for eng in ("llama", "colibri"):
            if r.get(eng):
                parts.append(
                    f"{eng} decode {r[eng]['decode_tok_s']:.2f} "
                    f"prefill {r[eng]['prefill_tok_s']:.1f} tok/s"
                )
        for eng in ("llama_depth", "colibri_depth"):
            if r.get(eng):
                parts.append(f"{eng} decode {r[eng]['decode_tok_s']:.2f}")
        busy = [r[k]["others_cpu"] for k in ("bw", "llama", "colibri") if r.get(k)]
        busy = [b for b in busy if b is not None]
        if busy:
            parts.append(f"other processes {max(busy):.0%} CPU")
        log(f"  round {i + 1}/{a.rounds} [{r['order']}]: " + "; ".join(parts))

    if colibri_errors:
        failed = "; ".join(colibri_errors)
        colibri_note = (
            colibri_note + " " if colibri_note else ""
        ) + f"`colibri bench` failed: {failed}"
    report = build_report(a, rounds, bpt, colibri_note, colibri_ver)
    print()
    print(report)
    out = a.out if a.out.is_absolute() else Path.cwd() / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    log(f"wrote {out}")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(
            json.dumps({"rounds": rounds, "bytes_per_token": bpt}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
