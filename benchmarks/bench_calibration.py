"""Importance-weighted int4 (issue 33 item 3): the KL divergence from the f32 model and the
perplexity of int4 conversions made with and without `colibri convert --calibration`, on the
committed fixtures and on any Hugging Face checkpoints given.

For each checkpoint: `colibri convert` to f32 (the reference), int4 `--pure` and the default
int4 (attention v/o at 8 bits), each without and with `--calibration CAL`; then `colibri
eval-ppl` of every int4 directory against the f32 one on EVAL. The calibration and evaluation
texts are distinct. Default texts: the repository's docs/*.md split file by file, every other
file (from the first) the calibration text and the rest with README.md the evaluation text
(same kind of text, no shared passage). `--demo-texts N`: instead, N conversations of the demo
model's training recipe rendered with its chat template, seed 11 for the calibration text and
seed 12 for the evaluation text (for the demo model and models trained like it); such a model
was trained on its answers only (the loss is taken on the text after each generation prompt),
so its prompts' tokens are noise to it and dominate a whole-text perplexity: `--demo-answers M`
also scores M fresh conversations (seed 13) on the answer tokens alone (the training's mask:
the KL and NLL of each position predicting a generated token). The fixtures
are tiny random models: their perplexity means nothing, the KL from their f32 model is the
quantization's error all the same.

Writes benchmarks/results/calibration-latest.md (and .json). Run by hand (never in tests):

    .venv/bin/python benchmarks/bench_calibration.py [--hf DIR ...] [--no-fixtures]
        [--calibration-text FILE] [--eval-text FILE] [--ctx 512] [--chunks 16]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from vs_llamacpp.machine import cpu_name  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"
ARCHS = ["olmoe", "qwen3_moe", "glm4_moe", "deepseek_v3", "qwen3_next", "kimi_linear"]
VARIANTS = [
    ("int4 --pure", ["--pure"], False),
    ("int4 --pure --calibration", ["--pure"], True),
    ("int4 (v/o 8-bit)", [], False),
    ("int4 (v/o 8-bit) --calibration", [], True),
]


def colibri(*args: object, capture: bool = True) -> str:
    cmd = [sys.executable, "-m", "colibri", *map(str, args)]
    r = subprocess.run(cmd, capture_output=capture, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr}")
    return r.stdout


def default_texts(work: Path) -> tuple[Path, Path]:
    docs = sorted((REPO / "docs").glob("*.md"))
    cal, ev = work / "calibration.txt", work / "eval.txt"
    cal.write_text("\n\n".join(p.read_text(encoding="utf-8") for p in docs[0::2]))
    ev.write_text(
        "\n\n".join(p.read_text(encoding="utf-8") for p in [REPO / "README.md", *docs[1::2]])
    )
    return cal, ev


def demo_texts(work: Path, n: int) -> tuple[Path, Path]:
    from colibri.chat.template import ChatTemplate, special_tokens_of
    from colibri.demo import data as demo_data

    cfg_path = REPO / "python" / "colibri" / "demo" / "model" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    template = ChatTemplate(cfg["chat_template"], special_tokens_of(cfg))
    out = []
    for name, seed in (("calibration-demo.txt", 11), ("eval-demo.txt", 12)):
        rng = random.Random(seed)
        convs = [demo_data.train_conversation(rng) for _ in range(n)]
        p = work / name
        p.write_text(
            "".join(
                template.render(c["messages"], add_generation_prompt=False, tools=c["tools"])
                for c in convs
            ),
            encoding="utf-8",
        )
        out.append(p)
    return out[0], out[1]


def context_of(model: Path) -> int:
    """The model's own context length, from its manifest."""
    from colibri import _engine

    return int(_engine.memory_plan(str(model))["context_length"])


def answer_sets(n: int) -> list[tuple[list[int], list[int]]]:
    """`n` demo conversations (seed 13) as token ids and the training's mask of answer tokens."""
    from tokenizers import Tokenizer

    sys.path.insert(0, str(REPO / "scripts"))
    from demo_training.batches import encode_conversation
    from demo_training.repo import TEMPLATE_PATH, chat_template, demo_data

    model = REPO / "python" / "colibri" / "demo" / "model"
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    template = chat_template.ChatTemplate(TEMPLATE_PATH.read_text(encoding="utf-8"))
    rng = random.Random(13)
    return [encode_conversation(tok, template, demo_data.train_conversation(rng)) for _ in range(n)]


def answer_quality(f32: Path, model: Path, sets, threads: int) -> dict:
    """KL(f32 || model), NLL and same-top rate at the positions predicting answer tokens."""
    import numpy as np

    from colibri import Engine
    from colibri.quality import kl_divergence, log_softmax

    ref, m = Engine(f32, threads=threads), Engine(model, threads=threads)
    kls, nlls, same = [], [], 0
    for ids, mask in sets:
        pos = np.array([t for t in range(len(ids) - 1) if mask[t + 1] > 0])
        lr, lm = log_softmax(ref.logits(ids)[pos]), log_softmax(m.logits(ids)[pos])
        target = np.asarray(ids)[pos + 1]
        kls.append(kl_divergence(lr, lm))
        nlls.append(-lm[np.arange(len(pos)), target])
        same += int((lr.argmax(-1) == lm.argmax(-1)).sum())
    kl, nll = np.concatenate(kls), np.concatenate(nlls)
    return {
        "answer_tokens": len(kl),
        "answer_kl_mean": float(kl.mean()),
        "answer_kl_err": float(kl.std(ddof=1) / np.sqrt(len(kl))),
        "answer_ppl": float(np.exp(nll.mean())),
        "answer_same_top": same / len(kl),
    }


def measure(name: str, hf: Path, work: Path, cal: Path, ev: Path, a) -> list[dict]:
    d = work / name
    f32 = d / "f32"
    if not (f32 / "manifest.json").exists():
        colibri("convert", hf, f32, "--quant", "f32")
    ctx = min(a.ctx, context_of(f32))
    rows = []
    for label, args, calibrated in VARIANTS:
        out = d / label.replace(" ", "_").replace("/", "").replace("(", "").replace(")", "")
        t0 = time.perf_counter()
        if not (out / "manifest.json").exists():
            extra = ["--calibration", cal, "--threads", a.threads] if calibrated else []
            colibri("convert", hf, out, "--quant", "int4", *args, *extra)
        conv_s = time.perf_counter() - t0
        r = json.loads(
            colibri(
                "eval-ppl",
                "--model",
                out,
                "--reference",
                f32,
                "--text",
                ev,
                "--ctx",
                ctx,
                "--chunks",
                a.chunks,
                "--threads",
                a.threads,
                "--json",
            )
        )
        r.update(model=name, variant=label, convert_s=conv_s)
        if a.answer_sets:
            r.update(answer_quality(f32, out, a.answer_sets, a.threads))
            print(
                f"{name:12s} {label:34s} answers: KL {r['answer_kl_mean']:.6f} +/- "
                f"{r['answer_kl_err']:.6f} PPL {r['answer_ppl']:.4f} same-top "
                f"{100 * r['answer_same_top']:.2f}% ({r['answer_tokens']} tokens)",
                flush=True,
            )
        print(
            f"{name:12s} {label:34s} KL {r['kl_mean']:.6f} +/- {r['kl_err']:.6f} "
            f"PPL {r['ppl']:.4f} same-top {100 * r['same_top']:.2f}%",
            flush=True,
        )
        rows.append(r)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", type=Path, nargs="*", default=[], help="more checkpoints to measure")
    ap.add_argument("--no-fixtures", action="store_true")
    ap.add_argument("--archs", nargs="*", default=ARCHS)
    ap.add_argument("--calibration-text", type=Path)
    ap.add_argument("--eval-text", type=Path)
    ap.add_argument("--demo-texts", type=int, metavar="N", help="demo conversations as texts")
    ap.add_argument(
        "--demo-answers", type=int, metavar="M", help="score M demo conversations' answers"
    )
    ap.add_argument(
        "--calibration-chars",
        type=int,
        default=50_000,
        help="cut the calibration text to this many characters (the f32 model runs all of it, "
        "twice per checkpoint)",
    )
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, help="keep conversions here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=HERE / "results" / "calibration-latest.md")
    a = ap.parse_args(argv)
    work = a.work or Path(tempfile.mkdtemp(prefix="colibri-calib-"))
    work.mkdir(parents=True, exist_ok=True)
    cal, ev = demo_texts(work, a.demo_texts) if a.demo_texts else default_texts(work)
    a.answer_sets = answer_sets(a.demo_answers) if a.demo_answers else None
    cal, ev = a.calibration_text or cal, a.eval_text or ev
    text = cal.read_text(encoding="utf-8")
    if len(text) > a.calibration_chars:
        cal = work / f"{cal.stem}-{a.calibration_chars}.txt"
        cal.write_text(text[: a.calibration_chars], encoding="utf-8")
    models = [] if a.no_fixtures else [(x, FIXTURES / x / "hf") for x in a.archs]
    models += [(p.name, p) for p in a.hf]
    rows = [r for name, hf in models for r in measure(name, hf, work, cal, ev, a)]
    table = [
        "| model | int4 variant | mean KL from f32 | KL p99 | same top | PPL (f32 PPL) |",
        "|---|---|---|---|---|---|",
    ]
    f32_ppl = {}
    for name, _ in models:
        f32_ppl[name] = json.loads(
            colibri(
                "eval-ppl",
                "--model",
                work / name / "f32",
                "--text",
                ev,
                "--ctx",
                min(a.ctx, context_of(work / name / "f32")),
                "--chunks",
                a.chunks,
                "--threads",
                a.threads,
                "--json",
            )
        )["ppl"]
    for r in rows:
        table.append(
            f"| {r['model']} | {r['variant']} | {r['kl_mean']:.6f} ± {r['kl_err']:.6f} | "
            f"{r['kl_p99']:.5f} | {100 * r['same_top']:.2f}% | {r['ppl']:.4f} "
            f"({f32_ppl[r['model']]:.4f}) |"
        )
    if a.answer_sets:
        table += [
            "",
            "On the answer tokens alone (`--demo-answers`):",
            "",
            "| model | int4 variant | answer tokens | mean KL from f32 | same top | PPL |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            table.append(
                f"| {r['model']} | {r['variant']} | {r['answer_tokens']} | "
                f"{r['answer_kl_mean']:.6f} ± {r['answer_kl_err']:.6f} | "
                f"{100 * r['answer_same_top']:.2f}% | {r['answer_ppl']:.4f} |"
            )
    ratios = []
    for name, _ in models:
        by = {r["variant"]: r["kl_mean"] for r in rows if r["model"] == name}
        ratios.append(
            f"- {name}: calibrated / plain mean KL: --pure "
            f"**{by['int4 --pure --calibration'] / by['int4 --pure']:.3f}**, default "
            f"**{by['int4 (v/o 8-bit) --calibration'] / by['int4 (v/o 8-bit)']:.3f}**"
        )
    text = "\n".join(
        [
            "## Importance-weighted int4 (`bench_calibration.py`)",
            "",
            f"Machine: {cpu_name()}, {os.cpu_count()} cores, {a.threads} threads. "
            f"Calibration text {cal.name} ({cal.stat().st_size:,} bytes), evaluation text "
            f"{ev.name} ({ev.stat().st_size:,} bytes); at most {a.chunks} chunks of "
            f"min({a.ctx}, the model's context) tokens, the second half of each scored.",
            "",
            *table,
            "",
            *ratios,
            "",
        ]
    )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(text)
    a.out.with_suffix(".json").write_text(json.dumps({"rows": rows, "f32_ppl": f32_ppl}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
