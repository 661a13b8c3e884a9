"""How close could 4.5 bits a weight get with 16 levels that are not evenly spaced? (issue 33)

colibri's int4 keeps one f16 scale per 32 values on the linear grid -8..7, the scale chosen by
an error-minimising search: on Gaussian groups 0.887 of Q4_0's squared error, and a finer search
gains nothing (`scale_search_headroom.py`). The format bounds it. A table of 16 integer levels
spaced closer near zero (where Gaussian-like weights are dense) keeps the bytes (a nibble and
the f16 scale per 32) and changes only the kernel, which looks each nibble up (`pshufb`). The
levels' integer range decides what the AVX2 kernel without VNNI pays: looked up offset to
unsigned bytes (as the linear grid's nibbles are), `maddubs` pair sums of levels up to 31 let
four add up in an i16 lane before a widening `madd`, up to 63 two (the linear grid: eight).
`examples/table_bench.rs` measures those kernels (and the sign trick, which is slower).

This scores the two tables the engine's logit comparison uses (`LEVELS_5_BIT`, `LEVELS_6_BIT`)
and, for each range, a table derived here by coordinate descent on the squared error of
training groups (Gaussian and Student-t with 5 degrees of freedom) starting from the normal
quantiles: each table's squared error relative to Q4_0's on fresh groups, Gaussian
(the random benchmark models' weights) and Student-t with 4 degrees of freedom (heavier tails,
like trained weights). Each group's scale is searched as colibri's is (candidates around the
largest value, both signs, nearest level, least-squares refit in f16, twice).

    .venv/bin/python benchmarks/int4_table_headroom.py [GROUPS]
"""

from __future__ import annotations

import sys
from statistics import NormalDist

import numpy as np

from colibri import _engine

GROUP = 32

# The two tables the engine's logit comparison rounds with (crates/engine/src/convert/rounding.rs).
LEVELS_5_BIT = [-16, -13, -10, -8, -6, -4, -2, -1, 0, 1, 3, 5, 7, 9, 12, 15]
LEVELS_6_BIT = [-32, -26, -21, -16, -12, -9, -6, -3, 0, 3, 6, 9, 13, 17, 22, 28]


def colibri_int4(w: np.ndarray, rtn: bool) -> np.ndarray:
    """``w`` (groups x 32) through colibri's quantizer (``rtn``: Q4_0's rounding), dequantized."""
    rows = w.shape[0]
    q = _engine.quantize_q4(np.ascontiguousarray(w, "<f4").tobytes(), rows, GROUP, rtn=rtn)
    return np.frombuffer(_engine.dequantize_q4(q, rows, GROUP), "<f4").reshape(rows, GROUP)


def table_error(w: np.ndarray, table: np.ndarray, steps: int = 24) -> float:
    """Summed squared error of ``w`` (groups x 32) rounded to ``table`` with a searched f16
    scale per group."""
    table = np.sort(table.astype(np.float32))
    mids = (table[1:] + table[:-1]) / 2
    amax = np.abs(w).max(axis=1)
    top = np.abs(table).max()
    best = np.full(len(w), np.inf)
    for f in np.linspace(0.7, 1.25, steps):
        for sign in (1.0, -1.0):
            d = sign * amax / top * f
            for _ in range(2):
                q = table[np.searchsorted(mids, w / d[:, None])]
                sqq = (q * q).sum(axis=1)
                d = ((w * q).sum(axis=1) / np.maximum(sqq, 1e-30)).astype(np.float16)
                d = np.where(d == 0, 1e-8, d.astype(np.float32))
            best = np.minimum(best, ((w - q * d[:, None]) ** 2).sum(axis=1))
    return float(best.sum())


def derive_table(train: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """16 distinct integers in lo..hi, from the normal quantiles by coordinate descent."""
    quantiles = np.array([NormalDist().inv_cdf((i + 0.5) / 16) for i in range(16)])
    table = np.clip(np.round(quantiles / -quantiles[0] * -lo), lo, hi)
    table[np.argmin(np.abs(table))] = 0.0  # zero exactly representable (padding, zero groups)
    current = table_error(train, table)
    for _ in range(4):
        improved = False
        for i in range(16):
            for delta in (-1.0, 1.0):
                trial = table.copy()
                trial[i] += delta
                if not lo <= trial[i] <= hi or len(set(trial)) < 16 or 0.0 not in trial:
                    continue
                err = table_error(train, trial)
                if err < current:
                    current, table, improved = err, trial, True
        if not improved:
            break
    return np.sort(table)


def main() -> None:
    groups = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    rng = np.random.default_rng(5)
    train = np.concatenate(
        [rng.standard_normal((1500, GROUP)), rng.standard_t(5, (750, GROUP))]
    ).astype(np.float32)
    tests = {
        "Gaussian": np.random.default_rng(0).standard_normal((groups, GROUP)),
        "Student-t (4)": np.random.default_rng(1).standard_t(4, (groups, GROUP)),
    }
    tables = {
        "linear -8..7 (colibri's grid)": np.arange(-8, 8, dtype=np.float32),
        "LEVELS_5_BIT (rounding.rs)": np.array(LEVELS_5_BIT, np.float32),
        "LEVELS_6_BIT (rounding.rs)": np.array(LEVELS_6_BIT, np.float32),
        "derived in -16..15 (5 bits)": derive_table(train, -16, 15),
        "derived in -32..31 (6 bits)": derive_table(train, -32, 31),
    }
    print(f"{groups} groups of {GROUP} each; squared error relative to Q4_0's")
    print("| format | levels | " + " | ".join(tests) + " |")
    print("|---|---|" + "---|" * len(tests))
    q4_0 = {}
    for name, w in tests.items():
        w = w.astype(np.float32)
        tests[name] = w
        q4_0[name] = float(((w - colibri_int4(w, rtn=True)) ** 2).sum())
    ours = [
        float(((w - colibri_int4(w, rtn=False)) ** 2).sum()) / q4_0[name]
        for name, w in tests.items()
    ]
    print("| colibri int4 (its quantizer) | -8..7 | " + " | ".join(f"{r:.3f}" for r in ours) + " |")
    for name, table in tables.items():
        rel = [table_error(w, table) / q4_0[n] for n, w in tests.items()]
        levels = " ".join(str(int(v)) for v in table)
        print(f"| {name} | {levels} | " + " | ".join(f"{r:.3f}" for r in rel) + " |")


if __name__ == "__main__":
    main()
