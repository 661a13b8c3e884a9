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
          both engines alike
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
]
BITS_PER_WEIGHT = 4.5  # Q4_0: 32 4-bit weights + one f16 scale per block
NICE = ["nice", "-n", "10"]  # heavy setup steps yield to other work; measurements do not


def log(msg: str) -> None:
    print(msg, flush=True)


def run(cmd: list, *, nice: bool = False, log_file: Path | None = None, **kw) -> subprocess.CompletedProcess:
    cmd = [str(c) for c in cmd]
    if nice and shutil.which("nice"):
        cmd = NICE + cmd
    log("  $ " + " ".join(cmd) + (f"  > {log_file}" if log_file else ""))
    if log_file:
        with open(log_file, "w") as f:
            r = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, **kw)
        if r.returncode != 0:
            tail = log_file.read_text(errors="replace").splitlines()[-30:]
            raise SystemExit(f"command failed ({r.returncode}): {' '.join(cmd)}\n--- {log_file} (tail)\n"
                             + "\n".join(tail))
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
        self.llama_src = cache / "src" / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}" / "vendor" / "llama.cpp"
        self.llama_build = cache / f"llama.cpp-build-{LLAMA_CPP_PYTHON_VERSION}"
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
    run([p.py, "-m", "pip", "install", "--progress-bar", "off", "-r", req], nice=True,
        log_file=p.logs / "venv-install.log")
    stamp.write_text(want + "\n")


def setup_llama_src(p: Paths) -> None:
    if (p.llama_src / "CMakeLists.txt").exists() and (p.llama_src / "convert_hf_to_gguf.py").exists():
        log(f"[setup] llama.cpp source: {p.llama_src} (cached)")
        return
    log(f"[setup] llama.cpp source: llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION} sdist from PyPI")
    p.dl.mkdir(parents=True, exist_ok=True)
    sdist = p.dl / f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}.tar.gz"
    if not sdist.exists():
        run([p.py, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", p.dl])
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
    run(["cmake", "-S", p.llama_src, "-B", p.llama_build, *LLAMA_CMAKE_FLAGS], nice=True,
        log_file=p.logs / "llama-cmake.log")
    run(["cmake", "--build", p.llama_build, "-j", str(os.cpu_count() or 2), "--target", *LLAMA_TARGETS],
        nice=True, log_file=p.logs / "llama-build.log")


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
        run([p.py, HERE / "convert_to_gguf.py", p.llama_src, p.hf, "--outfile", tmp, "--outtype", "bf16"],
            nice=True, log_file=p.logs / "convert-gguf.log")
        os.replace(tmp, p.gguf_bf16)
        bf16_stamp.write_text(json.dumps(want, indent=2) + "\n")
    log("[setup] GGUF: llama-quantize --pure Q4_0")
    tmp = p.gguf_q4.with_name(p.gguf_q4.name + ".partial")
    run([p.llama_quantize, "--pure", p.gguf_bf16, tmp, "Q4_0", str(os.cpu_count() or 2)], nice=True,
        log_file=p.logs / "quantize.log")
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
    try:
        r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60)
        return (r.stdout or r.stderr).strip() if r.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
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
    for d in (tmp, p.colibri_model):
        if d.is_dir():
            shutil.rmtree(d)
        elif d.exists():
            d.unlink()
    stamp.unlink(missing_ok=True)
    run([exe, "convert", p.hf, tmp, "--quant", "int4"], nice=True, log_file=p.logs / "colibri-convert.log")
    os.replace(tmp, p.colibri_model)
    stamp.write_text(json.dumps(want, indent=2) + "\n")


# ---------------------------------------------------------------- measurement

def run_with_rss(cmd: list, timeout: float) -> tuple[int, str, str, float]:
    """Run cmd; return (returncode, stdout, stderr, the child's own peak RSS in MB via wait4)."""
    import tempfile
    cmd = [str(c) for c in cmd]
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
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
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    if rc == -9:
        err += f"\n(killed after {timeout:.0f}s)"
    return rc, out, err, (ru.ru_maxrss / 1024.0 if ru else 0.0)


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
    rc, out, err, _ = run_with_rss([p.bandwidth, "-t", threads, "-s", size_mib, "-r", passes, "--json"], 300)
    obj = last_json_object(out) if rc == 0 else None
    if not obj:
        raise SystemExit(f"bandwidth probe failed ({rc}): {err.strip()[-2000:]}")
    return {"gb_s": obj["median_gb_s"], "raw": obj}


def measure_llama(p: Paths, a) -> dict:
    cmd = [p.llama_bench, "-m", p.gguf_q4, "-t", a.threads, "-p", a.prompt_tokens, "-n", a.gen_tokens,
           "-r", a.llama_reps, "-o", "json"]
    rc, out, err, rss = run_with_rss(cmd, 900)
    if rc != 0:
        raise SystemExit(f"llama-bench failed ({rc}):\n{err.strip()[-3000:]}")
    try:
        rows = json.loads(out)
    except ValueError:
        raise SystemExit(f"could not parse llama-bench JSON:\n{out[-2000:]}")
    res = {"peak_rss_mb": rss}
    for row in rows:
        if row.get("n_prompt", 0) > 0 and row.get("n_gen", 0) == 0:
            res["prefill_tok_s"] = float(row["avg_ts"])
        elif row.get("n_gen", 0) > 0 and row.get("n_prompt", 0) == 0:
            res["decode_tok_s"] = float(row["avg_ts"])
    if "prefill_tok_s" not in res or "decode_tok_s" not in res:
        raise SystemExit(f"unexpected llama-bench output:\n{out[-2000:]}")
    return res


def measure_colibri(exe: Path, p: Paths, a) -> dict:
    cmd = [exe, "bench", "--model", p.colibri_model, "--threads", a.threads,
           "--prompt-tokens", a.prompt_tokens, "--gen-tokens", a.gen_tokens, "--json"]
    rc, out, err, rss = run_with_rss(cmd, 900)
    obj = last_json_object(out) if rc == 0 else None
    if not obj or "decode_tok_s" not in obj or "prefill_tok_s" not in obj:
        raise RuntimeError(f"colibri bench failed (exit {rc}):\n{(err or out).strip()[-3000:]}")
    return {"prefill_tok_s": float(obj["prefill_tok_s"]), "decode_tok_s": float(obj["decode_tok_s"]),
            "peak_rss_mb": float(obj.get("peak_rss_mb") or rss), "raw": obj}


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
    total = (2 * cfg["vocab_size"] * h + L * (2 * h * h + 2 * kv_dim * h + cfg["num_experts"] * h
                                               + cfg["num_experts"] * 3 * h * inter))
    return {"active_params": active, "total_params": total, "attn": attn, "router": router,
            "experts": experts, "lm_head": lm_head, "bytes": active * bits / 8}


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
        r = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        return r.stdout.strip() or "uncommitted"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def build_report(a, rounds: list[dict], bpt: dict, colibri_note: str | None, colibri_ver: str | None) -> str:
    L = {k: stats([r["llama"][k] for r in rounds if r.get("llama")]) for k in
         ("decode_tok_s", "prefill_tok_s", "peak_rss_mb")}
    C = {k: stats([r["colibri"][k] for r in rounds if r.get("colibri")]) for k in
         ("decode_tok_s", "prefill_tok_s", "peak_rss_mb")}
    bw = stats([r["bw"]["gb_s"] for r in rounds if r.get("bw")])
    gb_per_tok = bpt["bytes"] / 1e9

    def ratio(key: str) -> str:
        if not C[key] or not L[key]:
            return "n/a"
        paired = [r["colibri"][key] / r["llama"][key] for r in rounds if r.get("colibri") and r.get("llama")]
        return f"**{C[key][0] / L[key][0]:.2f}** (per round {min(paired):.2f}–{max(paired):.2f})"

    def of_ceiling(eng: str) -> str:
        vals = [r[eng]["decode_tok_s"] * gb_per_tok / r["bw"]["gb_s"]
                for r in rounds if r.get(eng) and r.get("bw")]
        s = stats(vals)
        if not s:
            return "n/a"
        return f"{100 * s[0]:.0f}% ({100 * s[1]:.0f}–{100 * s[2]:.0f}%)"

    ceiling = stats([r["bw"]["gb_s"] / gb_per_tok for r in rounds if r.get("bw")])
    when = dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    lines = [
        f"## colibri vs llama.cpp: random OLMoE-1B-7B{'' if a.layers == 16 else f' ({a.layers} layers)'}, "
        f"{a.threads} threads",
        "",
        f"Median (min–max) over {len(rounds)} alternating rounds. colibri int4 vs llama.cpp "
        f"Q4_0 `--pure` from the same bf16 weights; prefill = {a.prompt_tokens}-token prompt, "
        f"decode = {a.gen_tokens} generated tokens.",
        "",
        "| | colibri int4 | llama.cpp Q4_0 | colibri / llama.cpp |",
        "|---|---|---|---|",
        f"| decode tok/s | {fmt(C['decode_tok_s'], 2)} | {fmt(L['decode_tok_s'], 2)} | {ratio('decode_tok_s')} |",
        f"| prefill tok/s ({a.prompt_tokens}-token prompt) | {fmt(C['prefill_tok_s'], 1)} | "
        f"{fmt(L['prefill_tok_s'], 1)} | {ratio('prefill_tok_s')} |",
        f"| peak RSS, MB | {fmt(C['peak_rss_mb'], 0)} | {fmt(L['peak_rss_mb'], 0)} | |",
        f"| decode as % of bandwidth ceiling | {of_ceiling('colibri')} | {of_ceiling('llama')} | |",
        "",
        "| machine and model | |",
        "|---|---|",
        f"| read bandwidth, {a.threads} threads (benchmarks/bandwidth.c) | {fmt(bw, 1, ' GB/s')} |",
        f"| weight bytes read per decoded token at {BITS_PER_WEIGHT} bits/weight | {gb_per_tok:.3f} GB "
        f"({bpt['active_params'] / 1e9:.3f}B active of {bpt['total_params'] / 1e9:.2f}B params) |",
        f"| decode ceiling = bandwidth / bytes per token | {fmt(ceiling, 1, ' tok/s')} |",
        "",
        f"{when}; {cpu_name()}, {os.cpu_count()} cores, {mem_total_gb():.0f} GB; "
        f"llama.cpp from llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} (llama-bench "
        f"`-t {a.threads} -p {a.prompt_tokens} -n {a.gen_tokens} -r {a.llama_reps}`); "
        f"colibri: {colibri_ver or 'n/a'}, repo at {git_rev()}.",
    ]
    if colibri_note:
        lines += ["", f"**colibri not measured:** {colibri_note}"]
    lines += ["", "<details><summary>per-round samples</summary>", "",
              "| round | order | GB/s | colibri decode | colibri prefill | llama.cpp decode | llama.cpp prefill |",
              "|---|---|---|---|---|---|---|"]

    def g(r, eng, k, d=2):
        return f"{r[eng][k]:.{d}f}" if r.get(eng) else "–"

    for i, r in enumerate(rounds):
        lines.append(f"| {i + 1} | {r['order']} | {r['bw']['gb_s']:.1f} | {g(r, 'colibri', 'decode_tok_s')} | "
                     f"{g(r, 'colibri', 'prefill_tok_s', 1)} | {g(r, 'llama', 'decode_tok_s')} | "
                     f"{g(r, 'llama', 'prefill_tok_s', 1)} |")
    lines += ["", "</details>", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="colibri vs llama.cpp speed benchmark (see module docstring)")
    ap.add_argument("--rounds", type=int, default=5, help="alternating A/B rounds (default 5)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--llama-reps", type=int, default=1, help="llama-bench -r per round (default 1)")
    ap.add_argument("--bw-size-mib", type=int, default=1024, help="bandwidth probe buffer (default 1024 MiB)")
    ap.add_argument("--bw-passes", type=int, default=10, help="bandwidth probe passes per round")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "latest.md", help="markdown output path")
    ap.add_argument("--json-out", type=Path, help="also write raw per-round results as JSON")
    ap.add_argument("--cache", type=Path,
                    default=Path(os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")))
    ap.add_argument("--colibri", help="colibri executable (default: REPO/.venv/bin/colibri, then PATH)")
    ap.add_argument("--skip-colibri", action="store_true", help="measure llama.cpp and bandwidth only")
    ap.add_argument("--reconvert-colibri", action="store_true", help="redo colibri convert even if cached")
    ap.add_argument("--setup-only", action="store_true", help="prepare everything, measure nothing")
    ap.add_argument("--keep-bf16-gguf", action="store_true", help="keep the 14 GB bf16 GGUF after quantizing")
    ap.add_argument("--seed", type=int, default=0, help="random model seed")
    ap.add_argument("--layers", type=int, default=16, help="model layers (16 = OLMoE-1B-7B; fewer for a smoke test)")
    a = ap.parse_args(argv)

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
            colibri_note = ("no colibri executable (looked for --colibri, REPO/.venv/bin/colibri, PATH); "
                            "build it and re-run.")
            exe = None
            log(f"[colibri] SKIPPED: {colibri_note}")
        else:
            colibri_ver = colibri_version(exe)
            try:
                setup_colibri_model(p, exe, a.reconvert_colibri)
            except SystemExit as e:  # conversion failed: report, still measure llama.cpp
                colibri_note = f"`colibri convert` failed: {str(e).splitlines()[0]} (see {p.logs}/colibri-convert.log)"
                log(f"[colibri] SKIPPED: {e}")
                exe = None
    log(f"[setup] done in {time.time() - t_setup:.0f}s")
    if a.setup_only:
        return 0

    cfg = json.loads((p.hf / "config.json").read_text())
    bpt = bytes_per_decoded_token(cfg)
    rounds: list[dict] = []
    log(f"[measure] {a.rounds} rounds, {a.threads} threads, prompt {a.prompt_tokens}, gen {a.gen_tokens}")
    retried_convert = False
    for i in range(a.rounds):
        engines = ["llama", "colibri"] if i % 2 == 0 else ["colibri", "llama"]
        if exe is None:
            engines = ["llama"]
        r: dict = {"order": " → ".join("llama.cpp" if e == "llama" else e for e in engines)}
        r["bw"] = measure_bandwidth(p, a.threads, a.bw_size_mib, a.bw_passes)
        for eng in engines:
            if eng == "llama":
                r["llama"] = measure_llama(p, a)
            else:
                try:
                    r["colibri"] = measure_colibri(exe, p, a)
                except RuntimeError as e:
                    if not retried_convert and not a.reconvert_colibri:
                        # a cached conversion may predate a format change: reconvert once, retry
                        retried_convert = True
                        log(f"[colibri] bench failed; reconverting once and retrying:\n{e}")
                        try:
                            setup_colibri_model(p, exe, True)
                            r["colibri"] = measure_colibri(exe, p, a)
                        except (RuntimeError, SystemExit) as e2:
                            e = e2
                    if "colibri" not in r:
                        colibri_note = f"`colibri bench` failed: {str(e).strip()[-500:]}"
                        log(f"[colibri] FAILED, continuing with llama.cpp only:\n{e}")
                        exe = None
        rounds.append(r)
        parts = [f"bw {r['bw']['gb_s']:.1f} GB/s"]
        for eng in ("llama", "colibri"):
            if r.get(eng):
                parts.append(f"{eng} decode {r[eng]['decode_tok_s']:.2f} prefill {r[eng]['prefill_tok_s']:.1f} tok/s")
        log(f"  round {i + 1}/{a.rounds} [{r['order']}]: " + "; ".join(parts))

    report = build_report(a, rounds, bpt, colibri_note, colibri_ver)
    print()
    print(report)
    out = a.out if a.out.is_absolute() else Path.cwd() / a.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    log(f"wrote {out}")
    if a.json_out:
        a.json_out.parent.mkdir(parents=True, exist_ok=True)
        a.json_out.write_text(json.dumps({"rounds": rounds, "bytes_per_token": bpt}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
