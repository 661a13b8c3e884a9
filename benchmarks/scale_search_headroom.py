"""How much closer to the weights could a finer scale search bring colibri's int4? (issue 33)

colibri's int4 keeps one f16 scale per 32 symmetric 4-bit values and chooses it by a search: 16
candidate steps around the group's largest value, each rounded and refit by least squares, then
two rounds of re-rounding (`quant::q4::quantize_group`). This measures, on Gaussian groups, the
squared error of that quantizer and of an exhaustive-looking search (400 candidate steps, each
refit the same way, in NumPy) relative to Q4_0's max-abs round-to-nearest. If the 400-candidate
search were much lower, the search would be what limits the int4's distance from Q4_0; it is
not (2026-12-07: 0.887 and 0.885 of Q4_0's error).

    .venv/bin/python benchmarks/scale_search_headroom.py [GROUPS]
"""

from __future__ import annotations

import sys

import numpy as np

from colibri import _engine

GROUP = 32


def colibri_int4(w: np.ndarray, rtn: bool) -> np.ndarray:
    """``w`` (groups x 32) through colibri's quantizer (``rtn``: Q4_0's rounding), dequantized."""
    rows = w.shape[0]
    q = _engine.quantize_q4(np.ascontiguousarray(w, "<f4").tobytes(), rows, GROUP, rtn=rtn)
    return np.frombuffer(_engine.dequantize_q4(q, rows, GROUP), "<f4").reshape(rows, GROUP)


def fine_search(w: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Per group, the least squared error over candidate inverse scales ``step / max`` (``max``
    the value of largest magnitude): round to -8..7, refit the scale by least squares, f16."""
    m = w[np.arange(len(w)), np.abs(w).argmax(axis=1)]
    best = np.full(len(w), np.inf)
    for step in steps:
        q = np.clip(np.round(w * (step / m)[:, None]), -8, 7)
        sqq = (q * q).sum(axis=1)
        d = np.where(sqq > 0, (w * q).sum(axis=1) / np.maximum(sqq, 1e-30), 0.0)
        d = d.astype(np.float16).astype(np.float32)
        best = np.minimum(best, ((w - q * d[:, None]) ** 2).sum(axis=1))
    return best


def main() -> None:
    groups = int(sys.argv[1]) if len(sys.argv) > 1 else 20000
    w = np.random.default_rng(0).standard_normal((groups, GROUP)).astype(np.float32)
    q4_0 = float(((w - colibri_int4(w, rtn=True)) ** 2).sum())
    ours = float(((w - colibri_int4(w, rtn=False)) ** 2).sum())
    steps = np.concatenate([np.linspace(-9.5, -4.0, 200), np.linspace(4.0, 9.5, 200)])
    fine = float(fine_search(w, steps).sum())
    print(f"{groups} Gaussian groups of {GROUP}, squared error relative to Q4_0's:")
    print(f"  colibri int4 (16 candidates + 2 refinements): {ours / q4_0:.3f}")
    print(f"  400 candidates, each refit:                    {fine / q4_0:.3f}")


if __name__ == "__main__":
    main()
