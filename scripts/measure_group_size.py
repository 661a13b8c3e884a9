#!/usr/bin/env python3
"""Measure the quality side of the int4 group-size / layout choice on real weights.

Run by hand, never by CI. Needs only numpy:

    python3 scripts/measure_group_size.py [options] WEIGHTS [WEIGHTS ...]

WEIGHTS are `.safetensors` files (F32 / F16 / BF16 tensors) or `.gguf` files. From a GGUF only
tensors stored as F32, F16, BF16, Q8_0 or Q6_K are used (dequantized to f32 first); tensors
already on a grid of 5 bits or fewer (Q4_K, Q5_0, ...) are skipped and listed, since
re-quantizing them to int4 would measure the old grid, not the weights.

For every 2-D weight matrix `[rows, cols]` (a linear layer's `[out, in]`; groups run along a
row, i.e. along the input dimension, as in colibri's layout) and every group size G it computes
the relative Frobenius error ||W_q - W|| / ||W|| of:

* `search`  colibri's scale search (a faithful numpy port of `quantize_group` in
            crates/engine/src/quant/q4.rs, generalised to any G that is a multiple of 8:
            16 candidate steps, least-squares refit in f16, two re-rounding rounds, fallback
            to RTN); 4 + 16/G bits per weight;
* `rtn`     llama.cpp Q4_0 round-to-nearest (d = max / -8, q = clamp(trunc(x/d + 8.5)));
            4 + 16/G bits per weight;
* `asym`    llama.cpp Q4_1 min/max (d = (max-min)/15, m = min, q = trunc((x-m)/d + 0.5),
            d and m in f16); 4 + 32/G bits per weight;

and the relative error of the matrix-vector product ||W_q x - W x|| / ||W x|| on a few
activation vectors: i.i.d. Gaussian ones, and Gaussian ones with a few fixed outlier channels
scaled up (as LLM hidden states have).

Rows of very tall matrices (embeddings) are sub-sampled evenly to --max-rows.

Aggregates per method and G: the median over matrices and the mean weighted by element count,
for linear layers, for embeddings and for all matrices. `--json` writes everything, per matrix.

Optional, and the one part that needs torch + transformers: `--e2e-sentence-model DIR` also
quantizes a sentence-transformers (BERT-style) model end to end and reports the matvec error on
each linear layer's real input activations and 1 - cos of the sentence embeddings. Results and
commands: docs/group-size.md. At G = 32 the `search` and `rtn` ports give the same nibbles and
f16 scales as quantize_q4 / quantize_q4_0_rtn, bit for bit (checked against the Rust code).
"""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
import time
from pathlib import Path

import numpy as np

F32 = np.float32
F16 = np.float16

# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def _bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(F32)


def load_safetensors(path: Path):
    """Yields (name, f32 array) for every 2-D tensor of a .safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    for name, meta in header.items():
        if name == "__metadata__" or len(meta["shape"]) != 2:
            continue
        lo, hi = meta["data_offsets"]
        raw = data[lo:hi]
        dt = meta["dtype"]
        if dt == "F32":
            a = raw.view("<f4").astype(F32)
        elif dt == "F16":
            a = raw.view("<f2").astype(F32)
        elif dt == "BF16":
            a = _bf16_to_f32(raw.view("<u2"))
        else:
            print(f"  skip {name}: dtype {dt}", file=sys.stderr)
            continue
        yield name, a.reshape(meta["shape"])


# GGML type ids and (block elements, block bytes).
_GGML = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    8: ("Q8_0", 32, 34),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
_GGML_NAMES = {
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    15: "Q8_K",
}


def _dequant_q8_0(raw: np.ndarray) -> np.ndarray:
    b = raw.reshape(-1, 34)
    d = b[:, :2].copy().view("<f2").astype(F32)
    q = b[:, 2:].copy().view(np.int8).astype(F32)
    return (d * q).reshape(-1)


def _dequant_q6_k(raw: np.ndarray) -> np.ndarray:
    # block_q6_K: ql[128], qh[64], scales[16] (int8), d (f16); 256 weights.
    b = raw.reshape(-1, 210)
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 64).astype(np.int32)
    qh = b[:, 128:192].reshape(nb, 2, 32).astype(np.int32)
    sc = b[:, 192:208].copy().view(np.int8).reshape(nb, 2, 8).astype(F32)
    d = b[:, 208:210].copy().view("<f2").astype(F32).reshape(nb, 1, 1)
    q1 = (ql[:, :, :32] & 0xF) | (((qh >> 0) & 3) << 4)
    q2 = (ql[:, :, 32:] & 0xF) | (((qh >> 2) & 3) << 4)
    q3 = (ql[:, :, :32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[:, :, 32:] >> 4) | (((qh >> 6) & 3) << 4)
    q = np.stack([q1, q2, q3, q4], axis=2).astype(F32) - 32.0  # [nb, 2, 4, 32]
    # scale index for element l of quarter j in half n: n*8 + j*2 + l//16
    s = sc.reshape(nb, 2, 4, 2)  # [nb, half, quarter, l//16]
    s = np.repeat(s, 16, axis=3)  # [nb, 2, 4, 32]
    return (d.reshape(nb, 1, 1, 1) * s * q).reshape(-1)


def load_gguf(path: Path):
    """Yields (name, f32 array) for every 2-D tensor of a GGUF file of a usable type."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    mv = memoryview(buf)
    pos = 0

    def rd(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, mv, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def rstr():
        nonlocal pos
        n = rd("Q")
        s = bytes(mv[pos : pos + n]).decode("utf-8", "replace")
        pos += n
        return s

    scalar = {
        0: "B",
        1: "b",
        2: "H",
        3: "h",
        4: "I",
        5: "i",
        6: "f",
        7: "?",
        10: "Q",
        11: "q",
        12: "d",
    }

    def rval(t):
        if t in scalar:
            return rd(scalar[t])
        if t == 8:
            return rstr()
        if t == 9:
            et, n = rd("I"), rd("Q")
            return [rval(et) for _ in range(n)]
        raise ValueError(f"unknown GGUF value type {t}")

    if bytes(mv[:4]) != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4
    version = rd("I")
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} unsupported")
    n_tensors, n_kv = rd("Q"), rd("Q")
    align = 32
    for _ in range(n_kv):
        key = rstr()
        val = rval(rd("I"))
        if key == "general.alignment":
            align = int(val)
    infos = []
    for _ in range(n_tensors):
        name = rstr()
        nd = rd("I")
        dims = [rd("Q") for _ in range(nd)]
        infos.append((name, dims, rd("I"), rd("Q")))
    data_start = (pos + align - 1) // align * align
    skipped: dict[str, list[str]] = {}
    for name, dims, t, off in infos:
        if len(dims) != 2:
            continue
        shape = (int(dims[1]), int(dims[0]))  # ne[0] is the contiguous (column) dimension
        if t not in _GGML:
            skipped.setdefault(_GGML_NAMES.get(t, f"type{t}"), []).append(name)
            continue
        kind, be, bb = _GGML[t]
        n = shape[0] * shape[1]
        raw = buf[data_start + off : data_start + off + n // be * bb]
        if kind == "F32":
            a = raw.view("<f4").astype(F32)
        elif kind == "F16":
            a = raw.view("<f2").astype(F32)
        elif kind == "BF16":
            a = _bf16_to_f32(raw.view("<u2"))
        elif kind == "Q8_0":
            a = _dequant_q8_0(np.asarray(raw))
        else:
            a = _dequant_q6_k(np.asarray(raw))
        yield f"{name} [{kind}]", a.reshape(shape)
    for kind, names in skipped.items():
        print(
            f"  skipped {len(names)} {kind} tensors (already <= 5-bit): "
            f"{', '.join(sorted(names)[:3])}{', ...' if len(names) > 3 else ''}",
            file=sys.stderr,
        )


def load(path: Path):
    if path.suffix == ".gguf":
        return load_gguf(path)
    if path.suffix == ".safetensors":
        return load_safetensors(path)
    raise ValueError(f"{path}: expected .safetensors or .gguf")


# ---------------------------------------------------------------------------------------------
# Quantizers. Each takes groups X [n, G] (f32) and returns the dequantized groups [n, G] (f32).
# ---------------------------------------------------------------------------------------------

# q4.rs CANDIDATES: target positions (in steps) of the largest-magnitude weight.
CANDIDATES = [
    -8.75,
    -8.5,
    -8.25,
    -7.75,
    -7.5,
    -7.25,
    -7.0,
    -6.75,
    -6.5,
    6.5,
    6.75,
    7.0,
    7.25,
    7.5,
    7.75,
    8.0,
]


def _lane_sum(p: np.ndarray) -> np.ndarray:
    """sum over a group as q4.rs does it: 8 f32 lanes over k, then the lanes in order."""
    n, g = p.shape
    p3 = p.reshape(n, g // 8, 8)
    acc = p3[:, 0, :].copy()
    for k in range(1, g // 8):
        acc += p3[:, k, :]
    s = acc[:, 0].copy()
    for lane in range(1, 8):
        s += acc[:, lane]
    return s


def _absmax_signed(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(amax, m): the largest |x| of each group and the value holding it (first on ties)."""
    ax = np.abs(x)
    idx = np.argmax(ax, axis=1)
    m = x[np.arange(x.shape[0]), idx]
    return np.abs(m), m


def _group_err(x, q, d):
    """q4.rs group_err: f32 squared error of (q-8)*d, 8-lane sums."""
    r = x - (q.astype(F32) - F32(8.0)) * d[:, None]
    return _lane_sum(r * r)


def _rtn_q(x, m):
    """q4.rs rtn_group: (q, f16 scale)."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = m / F32(-8.0)
        idv = np.where(d != 0, F32(1.0) / np.where(d != 0, d, F32(1.0)), F32(0.0)).astype(F32)
        t = x * idv[:, None] + F32(8.5)
    t = np.nan_to_num(t, nan=0.0, posinf=15.0, neginf=0.0)
    q = np.clip(np.trunc(t), 0, 15).astype(np.uint8)
    return q, d.astype(F16)


def quant_rtn(x: np.ndarray) -> np.ndarray:
    _, m = _absmax_signed(x)
    q, d = _rtn_q(x, m)
    return (q.astype(F32) - F32(8.0)) * d.astype(F32)[:, None]


def _quant_sums(x, is_):
    """q4.rs quant_sums: round half up with inverse scale is_, clamp; (q, sum x*c, sum c*c)."""
    with np.errstate(invalid="ignore", over="ignore"):
        t = x * is_[:, None] + F32(8.5)
    t = np.fmin(np.fmax(t, F32(0.0)), F32(15.0))  # NaN-ignoring like Rust max/min
    q = t.astype(np.int32)  # t in [0, 15]: truncation == floor
    c = q.astype(F32) - F32(8.0)
    return q.astype(np.uint8), _lane_sum(x * c), _lane_sum(c * c)


def quant_search_q(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q4.rs quantize_group, vectorised over groups: (q [n,G] uint8, scales [n] f16)."""
    n, g = x.shape
    amax, m = _absmax_signed(x)
    live = (amax != 0) & np.isfinite(amax)
    sxx = np.zeros(n, np.float64)
    for j in range(g):  # sequential f64 sum, as the Rust iterator does
        sxx += x[:, j].astype(np.float64) ** 2
    best_err = np.full(n, np.inf)
    best_d = np.zeros(n, F16)
    best_q = np.full((n, g), 8, np.uint8)
    has = np.zeros(n, bool)

    def consider(is_, mask):
        q, sxq, sqq = _quant_sums(x, is_)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            d = (sxq / sqq).astype(F16)
            df = d.astype(np.float64)
            err = sxx - 2.0 * df * sxq.astype(np.float64) + df * df * sqq.astype(np.float64)
        ok = mask & (sqq > 0) & np.isfinite(err) & (~has | (err < best_err))
        best_err[ok] = err[ok]
        best_d[ok] = d[ok]
        best_q[ok] = q[ok]
        has[ok] = True

    safe_m = np.where(live, m, F32(1.0))
    for c in CANDIDATES:
        with np.errstate(divide="ignore", over="ignore"):
            is_ = (F32(c) / safe_m).astype(F32)
        consider(is_, live)
    active = live.copy()
    for _ in range(2):
        d = np.where(has, best_d.astype(F32), F32(0.0))
        active &= (d != 0) & np.isfinite(d)
        with np.errstate(divide="ignore"):
            is_ = (F32(1.0) / np.where(active, d, F32(1.0))).astype(F32)
        consider(is_, active)
    rq, rd = _rtn_q(x, m)
    with np.errstate(over="ignore", invalid="ignore"):
        rtn_e = _group_err(x, rq, rd.astype(F32))
        b_e = _group_err(x, best_q, best_d.astype(F32))
    use = has & (b_e < rtn_e)
    q = np.where(use[:, None], best_q, rq)
    d = np.where(use, best_d, rd)
    q[~live] = 8
    d[~live] = 0
    return q, d


def quant_search(x: np.ndarray) -> np.ndarray:
    q, d = quant_search_q(x)
    return (q.astype(F32) - F32(8.0)) * d.astype(F32)[:, None]


def quant_asym(x: np.ndarray) -> np.ndarray:
    """llama.cpp quantize_row_q4_1_ref: d = (max-min)/15, q = trunc((x-min)/d + 0.5)."""
    mn = x.min(axis=1)
    mx = x.max(axis=1)
    d = (mx - mn) / F32(15.0)
    with np.errstate(divide="ignore"):
        idv = np.where(d != 0, F32(1.0) / np.where(d != 0, d, F32(1.0)), F32(0.0)).astype(F32)
    q = np.minimum(np.trunc((x - mn[:, None]) * idv[:, None] + F32(0.5)), 15).astype(F32)
    return q * d.astype(F16).astype(F32)[:, None] + mn.astype(F16).astype(F32)[:, None]


METHODS = {"search": (quant_search, 16), "rtn": (quant_rtn, 16), "asym": (quant_asym, 32)}


def quantize_matrix(w: np.ndarray, g: int, fn, chunk_elems: int = 1 << 21) -> np.ndarray:
    """Quantizes rows of w in groups of g along the row (zero-padded), returns dequantized w."""
    rows, cols = w.shape
    kp = -(-cols // g) * g
    out = np.empty((rows, cols), F32)
    step = max(1, chunk_elems // kp)
    for r0 in range(0, rows, step):
        blk = w[r0 : r0 + step]
        if kp != cols:
            blk = np.concatenate([blk, np.zeros((blk.shape[0], kp - cols), F32)], axis=1)
        deq = fn(np.ascontiguousarray(blk, dtype=F32).reshape(-1, g))
        out[r0 : r0 + step] = deq.reshape(blk.shape[0], kp)[:, :cols]
    return out


# ---------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------


def activations(cols: int, n: int, n_outliers: int, outlier_scale: float, seed: int):
    """[cols, n] Gaussian vectors and the same with n_outliers fixed channels scaled up."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((cols, n)).astype(F32)
    xo = x.copy()
    ch = rng.choice(cols, size=min(n_outliers, cols), replace=False)
    xo[ch] *= F32(outlier_scale)
    return x, xo


def e2e_sentence_model(
    model_dir: Path, groups, methods, max_sentences: int, text_files: list[Path]
) -> int:
    """Optional end-to-end check on a sentence-transformers BERT-style model directory (needs
    torch + transformers, unlike the rest of this script): quantizes every nn.Linear weight and
    the word embeddings, and reports (a) the matvec error on the REAL inputs of each linear layer
    (captured from the f32 model), (b) 1 - cos between the quantized and f32 sentence
    embeddings (mean pooling, L2-normalised), (c) the Spearman correlation between the
    quantized and f32 pairwise-similarity matrices. Sentences: real English text, from
    text_files (HTML tags stripped) or else the model's own README.md."""
    import torch  # noqa: PLC0415 (optional dependency)
    from transformers import AutoModel, AutoTokenizer  # noqa: PLC0415

    torch.manual_seed(0)
    srcs = list(text_files) or [model_dir / "README.md"]
    sents = []
    for src in srcs:
        text = src.read_text(encoding="utf-8", errors="replace")
        text = re.sub(r"<(script|style)\b.*?</\1>", " ", text, flags=re.S | re.I)
        text = re.sub(r"<[^>]+>|&[a-z#0-9]+;", " ", text)  # HTML tags and entities
        text = re.sub(r"https?://\S+|[`*#|>\[\]()]", " ", text)
        for para in re.split(r"\n\s*\n", text):  # paragraphs, hard-wrapped lines joined
            for part in re.split(r"(?<=[.!?;])\s+", " ".join(para.split())):
                if len(part.split()) >= 6 and sum(c.isalpha() for c in part) > 0.7 * len(part):
                    sents.append(part[:400])
    if len(sents) > max_sentences:  # evenly spaced over the text
        sents = [sents[i] for i in np.linspace(0, len(sents) - 1, max_sentences).astype(int)]
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, add_pooling_layer=False).float().eval()
    batch = tok(sents, padding=True, truncation=True, max_length=128, return_tensors="pt")
    mask = batch["attention_mask"].bool()
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    emb = model.get_input_embeddings()
    orig = {n: m.weight.detach().clone() for n, m in linears.items()}
    orig_emb = emb.weight.detach().clone()
    acts = {}

    def hook(name):
        def f(_m, inp, _out):
            acts[name] = inp[0].detach()[mask].double()  # real tokens only

        return f

    def embed(capture=False):
        hs = [linears[n].register_forward_hook(hook(n)) for n in linears] if capture else []
        with torch.no_grad():
            out = model(**batch).last_hidden_state
        for h in hs:
            h.remove()
        m = batch["attention_mask"].unsqueeze(-1).float()
        e = (out * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(e, dim=-1).double().numpy()

    def spearman(a, b):
        iu = np.triu_indices(a.shape[0], 1)
        ra = np.argsort(np.argsort(a[iu])).astype(np.float64)
        rb = np.argsort(np.argsort(b[iu])).astype(np.float64)
        return float(np.corrcoef(ra, rb)[0, 1])

    ref = embed(capture=True)
    ref_sim = ref @ ref.T
    print(
        f"\n## end to end: {model_dir}, {len(sents)} sentences from "
        f"{', '.join(p.name for p in srcs)}, "
        f"{int(mask.sum())} tokens, {len(linears)} linear layers + word embeddings"
    )
    print(
        "| method | G | bits/w | real-input matvec err (median) | (wmean) | 1 - cos (mean) |"
        " 1 - cos (max) | sim Spearman |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for meth in methods:
        fn, scale_bits = METHODS[meth]
        for g in groups:
            errs, wts = [], []
            for n, lin in linears.items():
                w = orig[n].numpy().astype(F32)
                wq = quantize_matrix(w, g, fn)
                x = acts[n]
                e = torch.from_numpy((wq - w).astype(np.float64))
                y = x @ orig[n].double().T
                errs.append(float(torch.linalg.norm(x @ e.T) / torch.linalg.norm(y)))
                wts.append(w.size)
                lin.weight.data = torch.from_numpy(wq)
            emb.weight.data = torch.from_numpy(quantize_matrix(orig_emb.numpy().astype(F32), g, fn))
            out = embed()
            cos = np.sum(out * ref, axis=1)
            bits = 4 + scale_bits / g
            print(
                f"| {meth} | {g} | {bits:.2f} | {np.median(errs):.4f} | "
                f"{np.average(errs, weights=wts):.4f} | {np.mean(1 - cos):.5f} | "
                f"{np.max(1 - cos):.5f} | {spearman(out @ out.T, ref_sim):.4f} |"
            )
            for n, lin in linears.items():
                lin.weight.data = orig[n].clone()
            emb.weight.data = orig_emb.clone()
    return 0


def is_embedding(name: str) -> bool:
    return bool(re.search(r"embed|token_embd|wte|wpe|lm_head|output\.weight", name))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("weights", nargs="*", type=Path)
    ap.add_argument(
        "--e2e-sentence-model",
        type=Path,
        metavar="DIR",
        help="also run the end-to-end check on this sentence-transformers model "
        "directory (needs torch + transformers)",
    )
    ap.add_argument(
        "--sentences",
        type=int,
        default=128,
        help="sentences for --e2e-sentence-model (default 128)",
    )
    ap.add_argument(
        "--text",
        type=Path,
        metavar="FILE",
        action="append",
        default=[],
        help="text or HTML file to take those sentences from, repeatable "
        "(default: the model's README.md)",
    )
    ap.add_argument(
        "--groups",
        default="16,32,64,128",
        help="comma-separated group sizes, multiples of 8 (default 16,32,64,128)",
    )
    ap.add_argument("--methods", default="search,rtn,asym")
    ap.add_argument(
        "--max-rows",
        type=int,
        default=16384,
        help="sub-sample taller matrices to this many evenly spaced rows",
    )
    ap.add_argument(
        "--min-dim",
        type=int,
        default=64,
        help="skip matrices with a dimension below this (default 64)",
    )
    ap.add_argument("--vectors", type=int, default=8, help="activation vectors per kind")
    ap.add_argument("--outliers", type=int, default=4, help="outlier channels per matrix")
    ap.add_argument("--outlier-scale", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write all results (per matrix) here")
    args = ap.parse_args()
    groups = [int(s) for s in args.groups.split(",")]
    methods = args.methods.split(",")
    for g in groups:
        if g % 8:
            ap.error(f"group size {g} is not a multiple of 8")

    per_matrix = []
    t0 = time.time()
    mi = 0
    for path in args.weights:
        print(f"{path}", file=sys.stderr)
        for name, w in load(path):
            rows, cols = w.shape
            if min(rows, cols) < args.min_dim:
                print(f"  skip {name} {rows}x{cols}: below --min-dim", file=sys.stderr)
                continue
            sub = ""
            if rows > args.max_rows:
                idx = np.linspace(0, rows - 1, args.max_rows).round().astype(np.int64)
                w = np.asarray(w[idx])
                sub = f" (rows sub-sampled {args.max_rows}/{rows})"
            w = np.ascontiguousarray(w, dtype=F32)
            wn = float(np.linalg.norm(w.astype(np.float64)))
            if wn == 0 or not np.isfinite(wn):
                continue
            x, xo = activations(
                cols, args.vectors, args.outliers, args.outlier_scale, args.seed + mi
            )
            mi += 1
            y = w.astype(np.float64) @ x
            yo = w.astype(np.float64) @ xo
            rec = {
                "file": str(path),
                "name": name,
                "rows": rows,
                "cols": cols,
                "rows_used": w.shape[0],
                "embedding": is_embedding(name),
                "results": {},
            }
            for meth in methods:
                fn, scale_bits = METHODS[meth]
                for g in groups:
                    wq = quantize_matrix(w, g, fn)
                    e = (wq - w).astype(np.float64)
                    kp = -(-cols // g) * g
                    rec["results"][f"{meth}/{g}"] = {
                        "bits": (kp * 4 + kp // g * scale_bits) / cols,
                        "rel_err": float(np.linalg.norm(e)) / wn,
                        "mv_gauss": float(
                            np.mean(np.linalg.norm(e @ x, axis=0) / np.linalg.norm(y, axis=0))
                        ),
                        "mv_outlier": float(
                            np.mean(np.linalg.norm(e @ xo, axis=0) / np.linalg.norm(yo, axis=0))
                        ),
                    }
            r32 = rec["results"].get("search/32") or next(iter(rec["results"].values()))
            print(
                f"  {name} {rows}x{cols}{sub}: rel_err@32 {r32['rel_err']:.4f} "
                f"[{time.time() - t0:.0f}s]",
                file=sys.stderr,
            )
            per_matrix.append(rec)
    if not args.weights and args.e2e_sentence_model:
        return e2e_sentence_model(
            args.e2e_sentence_model, groups, methods, args.sentences, args.text
        )
    if not per_matrix:
        print("no usable 2-D matrices", file=sys.stderr)
        return 1

    def aggregate(recs):
        out = {}
        for key in recs[0]["results"]:
            wts = np.array([r["rows_used"] * r["cols"] for r in recs], np.float64)
            row = {"bits": recs[0]["results"][key]["bits"]}
            for f in ("rel_err", "mv_gauss", "mv_outlier"):
                v = np.array([r["results"][key][f] for r in recs])
                row[f + "_median"] = float(np.median(v))
                row[f + "_wmean"] = float(np.sum(v * wts) / np.sum(wts))
            out[key] = row
        return out

    subsets = {
        "linear": [r for r in per_matrix if not r["embedding"]],
        "embedding": [r for r in per_matrix if r["embedding"]],
        "all": per_matrix,
    }
    summary = {k: aggregate(v) for k, v in subsets.items() if v}
    for k, agg in summary.items():
        n = len(subsets[k])
        el = sum(r["rows_used"] * r["cols"] for r in subsets[k])
        print(f"\n## {k}: {n} matrices, {el / 1e6:.1f}M weights measured")
        print(
            "| method | G | bits/w | rel err median | rel err wmean | matvec gauss (wmean)"
            " | matvec outlier (wmean) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for key, row in agg.items():
            meth, g = key.split("/")
            print(
                f"| {meth} | {g} | {row['bits']:.2f} | {row['rel_err_median']:.4f} | "
                f"{row['rel_err_wmean']:.4f} | {row['mv_gauss_wmean']:.4f} | "
                f"{row['mv_outlier_wmean']:.4f} |"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "summary": summary,
                    "matrices": per_matrix,
                },
                indent=1,
            )
        )
    if args.e2e_sentence_model:
        e2e_sentence_model(args.e2e_sentence_model, groups, methods, args.sentences, args.text)
    print(f"\n[{time.time() - t0:.0f}s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
