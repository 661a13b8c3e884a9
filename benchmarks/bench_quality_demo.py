"""colibri's int4 against llama.cpp's Q4_0 and Q4_K_M on a trained model (issue 33), all scored by
`colibri eval-ppl` on the same tokens.

The model: the demo model fine-tuned off its int4 grid (`bench_calibration.py` says how; the
shipped demo was trained quantization-aware, so its f32 weights sit on the int4 grid and would
measure nothing), given as its f32 colibri conversion (`--f32-model`, exported back to a Hugging
Face checkpoint by export_hf.py, checked bit for bit) or as a checkpoint (`--hf`).

llama.cpp's rows: its converter makes the f32 GGUF from that checkpoint, `llama-imatrix` the
importance matrix from the calibration text, `llama-quantize` Q4_0 (`--pure` and its default mix)
and Q4_K_M, each without and with the imatrix. Its tokenizer cannot split this model's text as
the model's own does (the demo tokenizer's pre-tokenizer regex is none of llama.cpp's), so
`llama-perplexity` would score other tokens; instead each GGUF's weights are dequantized by
gguf_to_hf.py and scored by colibri's f32 engine, on exactly colibri's tokens. That leaves out
llama.cpp's 8-bit activations (colibri's int4 rows keep theirs): it can only flatter llama.cpp,
so colibri's all-int4 weights are scored that way too ("weights only": dequantized by
export_hf.py, run by the f32 engine) to compare the quantizers alone.
The imatrix sees llama.cpp's tokens of the calibration text (statistics per input column: the
split matters little there).

colibri's rows: `colibri convert` int4 `--pure`, the default (attention v/o at 8 bits), each
on the linear grid and on the table grid (`--grid table`), without and with `--calibration`
(the same calibration text).

Every row: mean KL from the f32 model and perplexity on the whole evaluation text (demo
conversations, seed 12) and on the answer tokens of 100 fresh conversations (seed 13: what the
model was trained to predict); bits per weight over the weight matrices. Writes
benchmarks/results/quality-demo-latest.md (and .json). Run by hand (never in tests):

    .venv/bin/python benchmarks/bench_quality_demo.py --f32-model DIR [--cache DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_calibration import answer_quality, answer_sets, colibri, demo_texts  # noqa: E402
from vs_llamacpp import prepare  # noqa: E402
from vs_llamacpp.common import log, run  # noqa: E402
from vs_llamacpp.machine import cpu_name  # noqa: E402

LLAMA = [  # label, llama-quantize type, extra flags, imatrix
    ("llama.cpp Q4_0 --pure", "Q4_0", ["--pure"], False),
    ("llama.cpp Q4_0 --pure --imatrix", "Q4_0", ["--pure"], True),
    ("llama.cpp Q4_0", "Q4_0", [], False),
    ("llama.cpp Q4_K_M", "Q4_K_M", [], False),
    ("llama.cpp Q4_K_M --imatrix", "Q4_K_M", [], True),
]
COLIBRI = [  # label, convert flags, calibrated
    ("colibri int4 --pure", ["--pure"], False),
    ("colibri int4 --pure --calibration", ["--pure"], True),
    ("colibri int4 --pure --grid table", ["--pure", "--grid", "table"], False),
    ("colibri int4 --pure --grid table --calibration", ["--pure", "--grid", "table"], True),
    ("colibri default (v/o 8-bit)", [], False),
    ("colibri default --calibration", [], True),
    ("colibri default --grid table", ["--grid", "table"], False),
    ("colibri default --grid table --calibration", ["--grid", "table"], True),
    # llama.cpp's default mixes keep the output matrix at 6-8 bits: the same choice in colibri.
    ("colibri int4, lm_head 8-bit", ["--q8", "lm_head"], False),
    (
        "colibri v/o + lm_head 8-bit",
        ["--q8", "lm_head", "--q8", "layers.*.v", "--q8", "layers.*.o"],
        False,
    ),
    (
        "colibri v/o + lm_head 8-bit --calibration",
        ["--q8", "lm_head", "--q8", "layers.*.v", "--q8", "layers.*.o"],
        True,
    ),
    # llama.cpp's Q4_0 mix on a model of 8 experts: k, v and the output matrix at 8 bits.
    (
        "colibri k/v + lm_head 8-bit (Q4_0's mix)",
        ["--q8", "lm_head", "--q8", "layers.*.k", "--q8", "layers.*.v"],
        False,
    ),
]


def slug(label: str) -> str:
    return label.replace(" ", "_").replace("/", "").replace("(", "").replace(")", "")


def colibri_bits(model: Path) -> float:
    """Bits per weight over the weight matrices (resident and experts) of a colibri directory."""
    man = json.loads((model / "manifest.json").read_text())
    bits = weights = 0
    for e in man["resident"]["tensors"].values():
        if len(e["shape"]) >= 2:
            bits, weights = bits + 8 * e["nbytes"], weights + e["shape"][0] * e["shape"][1]
    ex = man.get("experts")
    if ex:
        n = sum(g["count"] for g in ex["layers"])
        for e in ex["parts"].values():
            bits, weights = bits + 8 * n * e["nbytes"], weights + n * e["shape"][0] * e["shape"][1]
    return bits / weights


def evaluate(model: Path, f32: Path, ev: Path, a) -> dict:
    r = json.loads(
        colibri(
            "eval-ppl",
            "--model",
            model,
            "--reference",
            f32,
            "--text",
            ev,
            "--ctx",
            a.ctx,
            "--chunks",
            a.chunks,
            "--threads",
            a.threads,
            "--json",
        )
    )
    r.update(answer_quality(f32, model, a.answer_sets, a.threads))
    return r


def llama_models(
    p: prepare.Paths, hf: Path, work: Path, cal: Path
) -> list[tuple[str, Path, float]]:
    """Each llama.cpp variant's weights as a colibri f32 directory, and its bits per weight."""
    bin_ = p.llama_build / "bin"
    f32_gguf, imatrix = work / "f32.gguf", work / "imatrix.gguf"
    if not f32_gguf.exists():
        run(
            [
                p.py,
                HERE / "convert_to_gguf.py",
                p.llama_src,
                hf,
                "--outfile",
                f32_gguf,
                "--outtype",
                "f32",
            ],
            log_file=work / "convert-gguf.log",
        )
    if not imatrix.exists():
        run(
            [
                bin_ / "llama-imatrix",
                "-m",
                f32_gguf,
                "-f",
                cal,
                "-c",
                "512",
                "-t",
                "2",
                "-o",
                imatrix,
            ],
            log_file=work / "imatrix.log",
        )
    out = []
    for label, qtype, flags, with_imatrix in LLAMA:
        d = work / slug(label)
        gguf, back = d.with_suffix(".gguf"), d.with_name(d.name + "-hf")
        extra = ["--imatrix", imatrix] if with_imatrix else []
        run(
            [bin_ / "llama-quantize", *extra, *flags, f32_gguf, gguf, qtype, "2"],
            log_file=work / f"{d.name}.quantize.log",
        )
        info = (
            subprocess.run(
                [p.py, HERE / "gguf_to_hf.py", p.llama_src, gguf, f32_gguf, hf, back],
                check=True,
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        if not (d / "manifest.json").exists():
            colibri("convert", back, d, "--quant", "f32")
        out.append((label, d, json.loads(info)["bits_per_weight"]))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--f32-model", type=Path, help="the model's f32 colibri conversion")
    src.add_argument("--hf", type=Path, help="the model's Hugging Face checkpoint")
    ap.add_argument("--demo-texts", type=int, default=400, metavar="N")
    ap.add_argument("--demo-answers", type=int, default=100, metavar="M")
    ap.add_argument("--calibration-chars", type=int, default=50_000)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, help="the llama.cpp benchmark cache")
    ap.add_argument("--work", type=Path, help="keep every file here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "quality-demo-latest.md")
    a = ap.parse_args(argv)
    cache = a.cache or Path(
        os.environ.get("COLIBRI_BENCH_CACHE", Path.home() / ".cache" / "colibri-bench")
    )
    p = prepare.Paths(cache, 4)
    prepare.setup_venv(p)
    prepare.setup_llama_src(p)
    prepare.setup_llama_build(p)
    work = a.work or Path(tempfile.mkdtemp(prefix="colibri-quality-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    hf = a.hf
    if hf is None:
        hf = work / "hf"
        subprocess.run(
            [sys.executable, HERE / "export_hf.py", a.f32_model, hf, "--check"], check=True
        )
    cal, ev = demo_texts(work, a.demo_texts)
    text = cal.read_text(encoding="utf-8")[: a.calibration_chars]
    cal = work / f"calibration-{a.calibration_chars}.txt"
    cal.write_text(text, encoding="utf-8")
    a.answer_sets = answer_sets(a.demo_answers)

    f32 = work / "colibri-f32"
    if not (f32 / "manifest.json").exists():
        colibri("convert", hf, f32, "--quant", "f32")
    models = [("f32", f32, 32.0)]
    for label, flags, calibrated in COLIBRI:
        d = work / slug(label)
        if not (d / "manifest.json").exists():
            extra = ["--calibration", cal, "--threads", a.threads] if calibrated else []
            colibri("convert", hf, d, "--quant", "int4", *flags, *extra)
        models.append((label, d, colibri_bits(d)))
    # colibri's int4 weights alone (dequantized, scored by the f32 engine like llama.cpp's).
    for label in (
        "colibri int4 --pure",
        "colibri int4 --pure --calibration",
        "colibri int4 --pure --grid table",
    ):
        d = work / slug(label)
        back, f32_of = d.with_name(d.name + "-weights-hf"), d.with_name(d.name + "-weights")
        if not (f32_of / "manifest.json").exists():
            subprocess.run([sys.executable, HERE / "export_hf.py", d, back], check=True)
            colibri("convert", back, f32_of, "--quant", "f32")
        models.append((f"{label}, weights only", f32_of, colibri_bits(d)))
    models += llama_models(p, hf, work, cal)

    rows = []
    for label, d, bits in models:
        r = evaluate(d, f32, ev, a)
        r.update(variant=label, bits_per_weight=bits)
        log(
            f"{label:34s} {bits:5.2f} bpw  KL {r['kl_mean']:.6f}  PPL {r['ppl']:.4f}  "
            f"answers: KL {r['answer_kl_mean']:.6f} PPL {r['answer_ppl']:.5f}"
        )
        rows.append(r)
    base = rows[0]
    table = [
        "| model | bits / weight | mean KL, whole text | PPL / f32's | same top | "
        "mean KL, answers | answer PPL - f32's | answers' same top |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        table.append(
            f"| {r['variant']} | {r['bits_per_weight']:.2f} | {r['kl_mean']:.5f} ± "
            f"{r['kl_err']:.5f} | {r['ppl'] / base['ppl']:.4f} | {100 * r['same_top']:.2f}% | "
            f"{r['answer_kl_mean']:.5f} ± {r['answer_kl_err']:.5f} | "
            f"{r['answer_ppl'] - base['answer_ppl']:+.5f} | {100 * r['answer_same_top']:.2f}% |"
        )
    doc = "\n".join(
        [
            "## int4 vs llama.cpp on the demo model (`bench_quality_demo.py`)",
            "",
            f"Machine: {cpu_name()}, {os.cpu_count()} cores, {a.threads} threads. Evaluation text "
            f"{ev.stat().st_size:,} bytes ({a.chunks} chunks of {a.ctx} tokens, the second half "
            f"of each scored); answers: {base['answer_tokens']} tokens of {a.demo_answers} "
            f"conversations; calibration {len(text):,} characters. f32 perplexity "
            f"{base['ppl']:.2f} (whole text), {base['answer_ppl']:.5f} (answers).",
            "",
            *table,
            "",
        ]
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(doc)
    a.out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    print(doc)


if __name__ == "__main__":
    main()
