"""Int4 quality against llama.cpp's 4-bit formats on the same weights (issue 33): perplexity and
the KL divergence of each quantized model's next-token distributions from its own full-precision
model, on the same text, chunks and tokens.

colibri: `colibri eval-ppl` of the int4 conversions with the f32 conversion as `--reference`
(bf16 weights, so f32 holds them exactly): all-int4 (`--pure`, the same bytes as llama.cpp's
Q4_0 `--pure` spends) and the default conversion (attention v and o at 8 bits), plus any
`--keep-f32` / `--q8` variants asked for. llama.cpp: `llama-perplexity` of the bf16 GGUF saving
its logits (`--kl-divergence-base`), then of Q4_0 `--pure` and of Q4_K_M (llama-quantize's
default mix) with `--kl-divergence`. Both tools count alike (chunks of --ctx, the second half of
each scored); the f32 / bf16 rows check that the two tokenize and count the same text alike
(their perplexities agree). The model is the speed benchmark's random OLMoE-1B-7B shape (by
default cut to 4 layers; the cache and setup steps are bench_vs_llamacpp.py's); the text is the
repository's own documentation. Random weights make the perplexity itself meaningless; the KL
from the full-precision model is the quantization's error either way.

Writes benchmarks/results/quality-latest.md. Run: `just bench` (never in tests).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vs_llamacpp import prepare  # noqa: E402
from vs_llamacpp.common import REPO, log, run  # noqa: E402

NUM = r"([-+0-9.eE]+|nan|inf)"


def text_file(cache: Path) -> Path:
    """The repository's Markdown, concatenated in a fixed order."""
    out = cache / "quality-text.txt"
    parts = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    out.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in parts), encoding="utf-8")
    return out


def setup(p: prepare.Paths, threads: int) -> dict[str, Path]:
    """Every model file, made when missing: colibri int4 (--pure), the default conversion (v/o
    at 8 bits) and f32, GGUF bf16, Q4_0, Q4_K_M."""
    prepare.setup_venv(p)
    prepare.setup_llama_src(p)
    prepare.setup_llama_build(p)
    prepare.setup_model(p, 0, p.layers)
    prepare.setup_gguf(p, keep_bf16=True)
    exe = prepare.find_colibri(None)
    if exe is None:
        raise SystemExit("no colibri executable (run `just setup`)")
    prepare.setup_colibri_model(p, exe, False)
    f32 = p.colibri_model.with_name(p.colibri_model.name.replace("-int4", "-f32"))
    if not (f32 / "manifest.json").exists():
        log(f"[setup] colibri convert --quant f32 -> {f32}")
        run([exe, "convert", p.hf, f32, "--quant", "f32"], nice=True)
    default = variant(p, exe, "default", [])
    q4_k_m = p.gguf_q4.with_name(p.gguf_q4.name.replace("q4_0-pure", "q4_k_m"))
    if not q4_k_m.exists():
        log("[setup] GGUF: llama-quantize Q4_K_M")
        tmp = q4_k_m.with_name(q4_k_m.name + ".partial")
        run([p.llama_quantize, p.gguf_bf16, tmp, "Q4_K_M", str(threads)], nice=True)
        os.replace(tmp, q4_k_m)
    return {
        "exe": exe,
        "colibri_int4": p.colibri_model,
        "colibri_default": default,
        "colibri_f32": f32,
        "gguf_bf16": p.gguf_bf16,
        "gguf_q4_0": p.gguf_q4,
        "gguf_q4_k_m": q4_k_m,
    }


def variant(p: prepare.Paths, exe: Path, slug: str, args: list[str]) -> Path:
    """The int4 conversion with the extra `colibri convert` arguments `args` (none: the default
    precisions), made when missing, named by `slug`."""
    model = p.colibri_model.with_name(f"{p.colibri_model.name}-{slug}")
    if not (model / "manifest.json").exists():
        log(f"[setup] colibri convert --quant int4 {' '.join(args)} -> {model}")
        run([exe, "convert", p.hf, model, "--quant", "int4", *args], nice=True)
    return model


def slug_of(patterns: list[str]) -> str:
    return "-".join(re.sub(r"[^A-Za-z0-9]+", "_", x).strip("_") or "all" for x in patterns)


def colibri_eval(exe: Path, model: Path, ref: Path | None, text: Path, a) -> dict:
    cmd = [exe, "eval-ppl", "--model", model, "--text", text, "--ctx", str(a.ctx)]
    cmd += ["--chunks", str(a.chunks), "--threads", str(a.threads), "--json"]
    if ref is not None:
        cmd += ["--reference", ref]
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def grab(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def llama_eval(p: prepare.Paths, model: Path, text: Path, base: Path, a, make_base: bool) -> dict:
    """llama-perplexity on `model`: with make_base, the base run writing its logits to `base`;
    else the KL run against them."""
    exe = p.llama_build / "bin" / "llama-perplexity"
    cmd = [exe, "-m", model, "-c", str(a.ctx), "--chunks", str(a.chunks), "-t", str(a.threads)]
    cmd += ["-b", str(a.ctx)]
    if make_base:
        cmd += ["-f", text, "--kl-divergence-base", base]
    else:
        cmd += ["--kl-divergence-base", base, "--kl-divergence"]
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    log_text = out.stdout + out.stderr
    (p.logs / f"perplexity-{model.name}.log").write_text(log_text)
    if out.returncode != 0:
        raise SystemExit(f"llama-perplexity failed on {model} (log in {p.logs})")
    r = {
        "ppl": grab(rf"Final estimate: PPL = {NUM}", log_text)
        or grab(rf"Mean PPL\(Q\)\s*:\s*{NUM}", log_text),
        "ppl_err": grab(rf"Final estimate: PPL = [-+0-9.eE]+ \+/- {NUM}", log_text),
        "kl_mean": grab(rf"Mean    KLD:\s*{NUM}", log_text),
        "kl_err": grab(rf"Mean    KLD:\s*[-+0-9.eE]+\s*±\s*{NUM}", log_text),
        "kl_p99": grab(rf"99\.0%   KLD:\s*{NUM}", log_text),
        "kl_max": grab(rf"Maximum KLD:\s*{NUM}", log_text),
        "same_top": grab(rf"Same top p:\s*{NUM}", log_text),
    }
    if r["same_top"] is not None:
        r["same_top"] /= 100
    return r


def fmt(x: float | None, digits: int = 6) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path)
    ap.add_argument(
        "--keep-f32",
        nargs="*",
        default=[],
        metavar="PATTERNS",
        help="also measure int4 conversions with these resident matrices kept f32, one "
        "conversion per comma-separated set (e.g. lm_head 'layers.*.v,layers.*.o')",
    )
    ap.add_argument(
        "--q8",
        nargs="*",
        default=[],
        metavar="PATTERNS",
        help="also measure int4 conversions with these resident matrices at 8 bits, one "
        "conversion per comma-separated set (e.g. 'layers.*.v,layers.*.o,lm_head')",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "quality-latest.md")
    a = ap.parse_args(argv)
    cache = a.cache or Path(
        os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
    )
    p = prepare.Paths(cache.expanduser().resolve(), a.layers)
    m = setup(p, a.threads)
    text = text_file(p.cache)
    base = p.cache / f"quality-base-{a.layers}L-{a.ctx}.kld"
    log("[quality] colibri f32, int4 --pure, default (v/o 8-bit)")
    c_f32 = colibri_eval(m["exe"], m["colibri_f32"], None, text, a)
    c_int4 = colibri_eval(m["exe"], m["colibri_int4"], m["colibri_f32"], text, a)
    c_default = colibri_eval(m["exe"], m["colibri_default"], m["colibri_f32"], text, a)
    kept = []
    for spec in a.keep_f32:
        patterns = [x for x in spec.split(",") if x]
        keep = [arg for x in patterns for arg in ("--keep-f32", x)]
        model = variant(p, m["exe"], f"keep-{slug_of(patterns)}", ["--pure", *keep])
        kept.append((f"colibri int4, f32 {' + '.join(patterns)}", model))
    for spec in a.q8:
        patterns = [x for x in spec.split(",") if x]
        eight = [arg for x in patterns for arg in ("--q8", x)]
        model = variant(p, m["exe"], f"q8-{slug_of(patterns)}", eight)
        kept.append((f"colibri int4, 8-bit {' + '.join(patterns)}", model))
    kept_rows = [
        (name, colibri_eval(m["exe"], model, m["colibri_f32"], text, a), c_f32)
        for name, model in kept
    ]
    log("[quality] llama.cpp bf16, Q4_0 --pure, Q4_K_M")
    l_bf16 = llama_eval(p, m["gguf_bf16"], text, base, a, True)
    l_q4_0 = llama_eval(p, m["gguf_q4_0"], text, base, a, False)
    l_q4_k_m = llama_eval(p, m["gguf_q4_k_m"], text, base, a, False)
    rows = [
        ("colibri f32 (reference)", c_f32, None),
        ("colibri int4 --pure", c_int4, c_f32),
        ("colibri default: int4, attention v + o 8-bit", c_default, c_f32),
        *kept_rows,
        ("llama.cpp bf16 (reference)", l_bf16, None),
        ("llama.cpp Q4_0 --pure", l_q4_0, l_bf16),
        ("llama.cpp Q4_K_M", l_q4_k_m, l_bf16),
    ]
    table = [
        "| model | PPL | PPL / its reference | mean KL from its reference | KL p99 | KL max "
        "| same top token |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r, ref in rows:
        ratio = None if ref is None or not r.get("ppl") else r["ppl"] / ref["ppl"]
        kl = r.get("kl_mean")
        kl_s = "–" if kl is None else f"{kl:.6f} ± {fmt(r.get('kl_err'))}"
        same = r.get("same_top")
        table.append(
            f"| {name} | {fmt(r.get('ppl'), 3)} | {fmt(ratio, 5)} | {kl_s} | "
            f"{fmt(r.get('kl_p99'))} | {fmt(r.get('kl_max'))} | "
            f"{'–' if same is None else f'{100 * same:.2f}%'} |"
        )
    k_int4, k_q40, k_qkm = c_int4["kl_mean"], l_q4_0["kl_mean"], l_q4_k_m["kl_mean"]
    k_def = c_default["kl_mean"]
    summary = [
        f"- colibri int4 --pure / llama.cpp Q4_0 mean KL: **{k_int4 / k_q40:.3f}** (target <= 1.0)"
        if k_q40
        else "- llama.cpp Q4_0's KL not read",
        f"- colibri int4 --pure / llama.cpp Q4_K_M mean KL: **{k_int4 / k_qkm:.3f}**"
        if k_qkm
        else "- llama.cpp Q4_K_M's KL not read",
        f"- colibri default (v/o 8-bit) / llama.cpp Q4_K_M mean KL: **{k_def / k_qkm:.3f}**, "
        f"/ int4 --pure: {k_def / k_int4:.3f}"
        if k_qkm
        else "- llama.cpp Q4_K_M's KL not read",
        f"- the references agree: colibri f32 PPL {fmt(c_f32['ppl'], 4)} over "
        f"{c_f32['scored_tokens']} scored tokens of {c_f32['text_tokens']}, llama.cpp bf16 "
        f"{fmt(l_bf16['ppl'], 4)}",
    ]
    out = "\n".join(
        [
            f"## Int4 quality vs llama.cpp: random OLMoE-1B-7B shape, {a.layers} layers "
            "(`bench_quality.py`)",
            "",
            f"Text: the repository's README and docs ({text.stat().st_size:,} bytes); "
            f"{a.chunks} chunks of {a.ctx} tokens, the second half of each scored; each "
            "quantized model against its own full-precision model of the same bf16 weights.",
            "",
            *table,
            "",
            *summary,
            "",
        ]
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(out)
    (a.out.with_suffix(".json")).write_text(
        json.dumps(
            {
                "colibri_f32": c_f32,
                "colibri_int4": c_int4,
                "colibri_default": c_default,
                "colibri_int4_variants": {name: r for name, r, _ in kept_rows},
                "llama_bf16": l_bf16,
                "llama_q4_0": l_q4_0,
                "llama_q4_k_m": l_q4_k_m,
            },
            indent=1,
        )
    )
    print(out)


if __name__ == "__main__":
    main()
