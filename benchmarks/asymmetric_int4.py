"""Would an offset per group (asymmetric int4, `w = q * d + m`) pay? Issue 33 item 1's "offset/min
if the format gains one", measured on the weights before any kernel work: the relative squared
error of colibri's int4 (symmetric, one f16 scale per 32 weights, error-minimising search: 4.5
bits per weight) against an asymmetric format with an f16 scale and an f16 minimum per 32 (Q4_1's
layout and bits: 5.0 per weight; scale and minimum chosen by alternating least squares from
several starting ranges, as llama.cpp's K-quants do) and against colibri's own symmetric int4
with groups of 16 (the same 5.0 bits per weight spent on scales instead).

Weights: Gaussian, Student-t with 4 degrees of freedom (heavier tails), and the weight matrices
of any f32 colibri model directories given (`colibri convert --quant f32`).

    .venv/bin/python benchmarks/asymmetric_int4.py [MODEL_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from colibri import _engine

GROUP = 32


def symmetric(w: np.ndarray) -> np.ndarray:
    """colibri's int4 of `w` (rows x cols), dequantized."""
    rows, cols = w.shape
    q = _engine.quantize_q4(np.ascontiguousarray(w, "<f4").tobytes(), rows, cols)
    return np.frombuffer(_engine.dequantize_q4(q, rows, cols), "<f4").reshape(rows, cols)


def symmetric16(w: np.ndarray) -> np.ndarray:
    """Symmetric int4 with groups of 16: each 16 weights padded with 16 zeros into a group of
    32 (zeros are exact at any scale, so the search sees only the 16)."""
    rows, cols = w.shape
    g = w.reshape(rows, cols // 16, 16)
    padded = np.concatenate([g, np.zeros_like(g)], axis=-1).reshape(rows, cols * 2)
    d = symmetric(padded).reshape(rows, cols // 16, 32)[:, :, :16]
    return d.reshape(rows, cols)


def f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float64)


def asymmetric(w: np.ndarray, rounds: int = 4) -> np.ndarray:
    """`q * d + m`, q in 0..15, d and m f16 per group of 32: from the min/max range and from
    ranges shrunk by up to 20% at either end, `rounds` of rounding and least-squares refits of
    (d, m) each; the least error per group is kept."""
    x = w.reshape(-1, GROUP).astype(np.float64)
    lo0, hi0 = x.min(axis=1), x.max(axis=1)
    best = None
    best_err = np.full(len(x), np.inf)
    for a in (0.0, 0.05, 0.1, 0.2):
        for b in (0.0, 0.05, 0.1, 0.2):
            span = hi0 - lo0
            lo, hi = lo0 + a * span, hi0 - b * span
            d = f16(np.maximum(hi - lo, 1e-30) / 15)
            m = f16(lo)
            for _ in range(rounds):
                q = np.clip(np.rint((x - m[:, None]) / np.where(d == 0, 1, d)[:, None]), 0, 15)
                # Least squares of x ~ q d + m per group.
                n = GROUP
                sq, sqq = q.sum(1), (q * q).sum(1)
                sx, sxq = x.sum(1), (x * q).sum(1)
                det = n * sqq - sq * sq
                ok = det > 0
                d = np.where(ok, f16((n * sxq - sq * sx) / np.where(ok, det, 1)), d)
                m = np.where(ok, f16((sx - d * sq) / n), m)
            q = np.clip(np.rint((x - m[:, None]) / np.where(d == 0, 1, d)[:, None]), 0, 15)
            y = q * d[:, None] + m[:, None]
            err = ((x - y) ** 2).sum(1)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best = y if best is None else np.where(better[:, None], y, best)
    return best.reshape(w.shape)


def rel(w: np.ndarray, d: np.ndarray) -> float:
    w = w.astype(np.float64)
    return float(((w - d) ** 2).sum() / (w * w).sum())


def matrices(model: Path):
    m = json.loads((model / "manifest.json").read_text())
    buf = (model / "resident.bin").read_bytes()
    for name, t in m["resident"]["tensors"].items():
        if t["dtype"] == "f32" and len(t["shape"]) == 2 and t["shape"][1] % GROUP == 0:
            if "router" in name or t["shape"][0] < 2:
                continue
            a = np.frombuffer(buf, "<f4", count=t["nbytes"] // 4, offset=t["offset"])
            yield name, a.reshape(t["shape"])


def report(label: str, ws: list[np.ndarray]) -> None:
    e = np.array(
        [[rel(w, symmetric(w)), rel(w, asymmetric(w)), rel(w, symmetric16(w))] for w in ws]
    )
    n = sum(w.size for w in ws)
    weights = np.array([w.size for w in ws]) / n
    s, a, s16 = (weights[:, None] * e).sum(0)
    print(
        f"| {label} | {n:,} | {s:.5f} | {a:.5f} ({a / s:.3f}x) | {s16:.5f} ({s16 / s:.3f}x) |",
        flush=True,
    )


def main() -> None:
    print(
        "| weights | count | symmetric /32 (4.5 bpw) | asymmetric /32 (5.0 bpw) "
        "| symmetric /16 (5.0 bpw) |"
    )
    print("|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    report("Gaussian", [rng.standard_normal((256, 2048)).astype(np.float32)])
    report("Student-t, 4 dof", [rng.standard_t(4, (256, 2048)).astype(np.float32)])
    for model in map(Path, sys.argv[1:]):
        report(f"{model} (every f32 matrix)", [w for _, w in matrices(model)])


if __name__ == "__main__":
    main()
