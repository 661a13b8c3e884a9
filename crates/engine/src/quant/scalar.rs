//! Portable reference kernels (the oracle for the SIMD ones).

use std::ops::Range;

use super::q4::nibble_offset;
use super::q8::{qs_offset, TokenActs};
use super::{Grid, Q4Matrix, Q8Acts};

/// Exact integer dot product of int4 group `g` of a row's nibbles `nib` (a row of `groups`
/// groups) with activation group `g` on `grid`, as the SIMD kernels compute it: the unsigned
/// `level + offset` products, then the offset's `-offset * sum(a)`.
#[inline]
pub(crate) fn group_dot(nib: &[u8], groups: usize, grid: Grid, a: &TokenActs, g: usize) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        let b = nib[nibble_offset(groups, g, j)];
        s += grid.unsigned(b & 15) as i32 * a.qs[qs_offset(g, j)] as i32
            + grid.unsigned(b >> 4) as i32 * a.qs[qs_offset(g, j + 16)] as i32;
    }
    s + a.corr[g] * (grid.offset() / 8)
}

/// Dot of row `r` of `w` with activation vector `a`: per group the exact integer sum times
/// (weight scale * activation scale), accumulated in f32 in group order.
pub(crate) fn q4_row_dot(w: &Q4Matrix, r: usize, a: &TokenActs) -> f32 {
    let nib = w.row_nibbles(r);
    let mut acc = 0.0f32;
    for g in 0..w.groups() {
        let s = group_dot(nib, w.groups(), w.grid(), a, g);
        acc += s as f32 * (w.scale(r, g) * a.dexp[g]);
    }
    acc
}

/// # Safety
/// `out + t * out_stride + r` is valid for writes for `t < x.n()`, `r in rows`; shapes agree
/// (`rows.end <= w.rows`, `x.cols() == w.cols`).
pub(crate) unsafe fn q4_rows(
    w: &Q4Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    debug_assert!(x.padded_groups() >= w.groups());
    for t in 0..x.n() {
        let a = x.token(t);
        for r in rows.clone() {
            let v = q4_row_dot(w, r, &a);
            // SAFETY: (t, r) is in the range the caller guarantees writable.
            unsafe { *out.wrapping_add(t * out_stride + r) = v };
        }
    }
}

/// f32 dot product with 8 independent accumulators (then a pairwise sum).
#[inline]
pub(crate) fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ta.iter().zip(tb) {
        tail += x * y;
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// # Safety
/// `w.len() >= rows.end * cols`, `x.len() >= n * cols`, and `out + t * out_stride + r` is valid
/// for writes for `t < n`, `r in rows`.
pub(crate) unsafe fn f32_rows(
    w: &[f32],
    cols: usize,
    x: &[f32],
    n: usize,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    for r in rows {
        let wr = &w[r * cols..(r + 1) * cols];
        for t in 0..n {
            let v = dot_f32(wr, &x[t * cols..(t + 1) * cols]);
            // SAFETY: (t, r) is in the range the caller guarantees writable.
            unsafe { *out.wrapping_add(t * out_stride + r) = v };
        }
    }
}
