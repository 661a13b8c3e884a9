//! The 8-bit weight format (`q8`): layout arithmetic, quantization, dequantization, and the
//! scalar reference kernel (the int8 x int8 dot the SIMD kernels must reproduce exactly).
//!
//! # Layout
//!
//! A `[rows, cols]` matrix, each row padded with zero weights to `kp = ceil(cols / 32) * 32`.
//! Each row is one contiguous run of `kp/32 * 34` bytes, its scales first, then its values; row
//! `r` starts at `r * kp/32 * 34`, and the matrix is `rows * kp/32 * 34` bytes, nothing else:
//!
//! ```text
//! row r:
//!   [scales: kp/32 f16, little-endian]   group g at + g*2
//!   [values: kp i8]                      from + kp/32*2, in blocks of 16 groups (512 bytes;
//!                                        a row's last block has the m groups left)
//! ```
//!
//! The weight is `q * scale`, `q` in -127..=127 (Q8_0's 8.5 bits per weight). Within a block of
//! `m` groups, value `j` (0..32) of the block's group `i` is at `v(j) * 4m + 4i + j % 4` with
//! `v(j) = (j % 16 / 4) * 2 + j / 16`: eight runs of one dword of every group, in the order of
//! the activations' 64-byte vectors (`q8::qs_offset`), so with `m = 16` a block is byte for byte
//! the shape of an activation block and vector `k` of the weights multiplies vector `k` of the
//! activations, i32 lane `i` staying with group `i`.
//!
//! # Kernels
//!
//! A group's dot is `dw * da * sum(q * a)`, the sum exact in i32. `dpbusd` multiplies unsigned
//! by signed bytes, so the AVX-512 and AVX-VNNI kernels feed it `q ^ 0x80` (= `q + 128`, 1..=255)
//! and start each lane at `-128 * sum(a)`, which is 16 times the activations' precomputed int4
//! offset `-8 * sum(a)` (`corr`); AVX2 without VNNI uses `maddubs(|q|, sign(a, q))` (at most
//! 2 * 127 * 127 per i16, no saturation). Either way the lane holds the same exact integer.

use half::f16;
use rayon::prelude::*;

use super::q4::BLOCK_GROUPS;
use super::q8::{qs_offset, TokenActs};
use super::{Q8Acts, QuantError, GROUP};

/// Bytes of one group: an f16 scale and 32 values.
const GROUP_BYTES: usize = 2 + GROUP;
/// Value bytes per block of 16 groups.
pub(crate) const BLOCK_VALUES: usize = BLOCK_GROUPS * GROUP;

/// Bytes of one row: its `ceil(cols / 32)` f16 scales, then its values (34 bytes per group).
pub fn q8_row_bytes(cols: usize) -> usize {
    cols.div_ceil(GROUP) * GROUP_BYTES
}

/// Total bytes of a `rows x cols` 8-bit matrix.
pub fn q8_byte_len(rows: usize, cols: usize) -> usize {
    rows * q8_row_bytes(cols)
}

/// `(row bytes, total bytes)`, or `None` on overflow.
fn checked_layout(rows: usize, cols: usize) -> Option<(usize, usize)> {
    let row = cols.div_ceil(GROUP).checked_mul(GROUP_BYTES)?;
    Some((row, rows.checked_mul(row)?))
}

/// Offset within a row's values of value `j` (0..32) of group `g`, in a row of `groups` groups
/// (see the module doc).
#[inline(always)]
pub(crate) fn value_offset(groups: usize, g: usize, j: usize) -> usize {
    let b = g / BLOCK_GROUPS;
    let m = (groups - b * BLOCK_GROUPS).min(BLOCK_GROUPS);
    let v = (j % 16 / 4) * 2 + j / 16;
    b * BLOCK_VALUES + v * 4 * m + (g % BLOCK_GROUPS) * 4 + j % 4
}

/// Symmetric round-to-nearest of one group, as llama.cpp's Q8_0: scale `amax / 127` stored as
/// f16, values rounded with the stored scale and clamped to ±127. A group whose scale is zero
/// (all zero, or below f16's range) or not finite is stored as zeros.
fn quantize_group(x: &[f32; GROUP], q: &mut [i8; GROUP]) -> f16 {
    let amax = x.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
    let d = f16::from_f32(amax / 127.0);
    let df = d.to_f32();
    if df == 0.0 || !df.is_finite() {
        q.fill(0);
        return f16::ZERO;
    }
    let id = 1.0 / df;
    for (qi, &v) in q.iter_mut().zip(x) {
        // `as` saturates (and maps NaN to 0); the clamp keeps -128 out.
        *qi = ((v * id).round() as i32).clamp(-127, 127) as i8;
    }
    d
}

/// Quantizes one row (`wrow`: `cols` floats) into its bytes (`out`: scales, then values).
fn quantize_row(wrow: &[f32], out: &mut [u8]) {
    let cols = wrow.len();
    let groups = out.len() / GROUP_BYTES;
    let (srow, vrow) = out.split_at_mut(groups * 2);
    let mut x = [0.0f32; GROUP];
    let mut q = [0i8; GROUP];
    for g in 0..groups {
        let lo = g * GROUP;
        let hi = (lo + GROUP).min(cols);
        x.fill(0.0);
        x[..hi - lo].copy_from_slice(&wrow[lo..hi]);
        let d = quantize_group(&x, &mut q);
        for (j, &v) in q.iter().enumerate() {
            vrow[value_offset(groups, g, j)] = v as u8;
        }
        srow[g * 2..g * 2 + 2].copy_from_slice(&d.to_le_bytes());
    }
}

/// Quantizes `w` (`rows x cols`, row-major) to the 8-bit layout. Parallel over rows.
pub fn quantize_q8(w: &[f32], rows: usize, cols: usize) -> Vec<u8> {
    assert_eq!(
        w.len(),
        rows * cols,
        "quantize_q8: w has {} floats, not {rows}x{cols}",
        w.len()
    );
    let (row, len) = checked_layout(rows, cols).expect("quantize_q8: shape too large");
    let mut out = vec![0u8; len];
    if rows == 0 || cols == 0 {
        return out;
    }
    out.par_chunks_mut(row)
        .zip(w.par_chunks(cols))
        .for_each(|(orow, wrow)| quantize_row(wrow, orow));
    out
}

/// An 8-bit matrix borrowed from a byte buffer (any alignment).
#[derive(Clone, Copy)]
pub struct Q8Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    bytes: &'a [u8],
    groups: usize,
    row_bytes: usize,
}

impl std::fmt::Debug for Q8Matrix<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q8Matrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish_non_exhaustive()
    }
}

impl<'a> Q8Matrix<'a> {
    /// Checks that `bytes` has exactly `q8_byte_len(rows, cols)` bytes.
    pub fn new(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self, QuantError> {
        let (row, len) = checked_layout(rows, cols).ok_or(QuantError::Shape { rows, cols })?;
        if bytes.len() != len {
            return Err(QuantError::Length {
                rows,
                cols,
                expected: len,
                actual: bytes.len(),
            });
        }
        Ok(Q8Matrix {
            rows,
            cols,
            bytes,
            groups: cols.div_ceil(GROUP),
            row_bytes: row,
        })
    }

    /// Groups of 32 per row.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Bytes per row (`q8_row_bytes(cols)`): the row's scales, then its values.
    pub fn row_stride(&self) -> usize {
        self.row_bytes
    }

    /// All bytes of row `r`: `groups() * 2` bytes of scales, then `groups() * 32` values.
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.bytes[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Values of row `r` (`groups() * 32` bytes, i8 each).
    pub fn row_scales(&self, r: usize) -> &'a [u8] {
        &self.row(r)[..self.groups * 2]
    }

    pub fn row_values(&self, r: usize) -> &'a [u8] {
        &self.row(r)[self.groups * 2..]
    }

    /// Scale of group `g` of row `r`.
    pub fn scale(&self, r: usize, g: usize) -> f32 {
        let s = &self.row(r)[2 * g..2 * g + 2];
        f16::from_le_bytes([s[0], s[1]]).to_f32()
    }

    /// Dequantizes row `r` into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "dequantize_row: row {r} of {}", self.rows);
        assert_eq!(out.len(), self.cols, "dequantize_row: out.len() != cols");
        let vals = self.row_values(r);
        for (c, o) in out.iter_mut().enumerate() {
            let (g, j) = (c / GROUP, c % GROUP);
            *o = vals[value_offset(self.groups, g, j)] as i8 as f32 * self.scale(r, g);
        }
    }

    /// The whole matrix as f32, `rows x cols` row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols > 0 {
            for (r, row) in out.chunks_mut(self.cols).enumerate() {
                self.dequantize_row(r, row);
            }
        }
        out
    }
}

/// Row `r`'s blocks as (values, scales) pointers: block `c < full` in place, the last partial
/// block (if any) from a zero-filled copy with the full-block spacing (zero values and scales
/// make the padding groups contribute nothing; the activations are zero there as well).
pub(crate) struct RowBlocks8 {
    vals: *const u8,
    sc: *const u8,
    full: usize,
    /// The partial last block's copy (512 bytes of values, then 32 of scales), or null.
    tail: *const u8,
}

/// Room for a row's partial last block (see [`RowBlocks8`]); written only for rows that have
/// one.
pub(crate) type TailBuf8 = std::mem::MaybeUninit<[u8; BLOCK_VALUES + BLOCK_GROUPS * 2]>;

impl RowBlocks8 {
    /// # Safety
    /// `row` points at the `groups * 34` readable bytes of one row; `tail` outlives the uses
    /// of the pointers [`RowBlocks8::block`] returns.
    #[inline(always)]
    pub(crate) unsafe fn new(row: *const u8, groups: usize, tail: &mut TailBuf8) -> Self {
        let full = groups / BLOCK_GROUPS;
        let m = groups - full * BLOCK_GROUPS;
        let vals = row.wrapping_add(groups * 2);
        let mut b = RowBlocks8 {
            vals,
            sc: row,
            full,
            tail: std::ptr::null(),
        };
        if m > 0 {
            let t = tail
                .write([0; BLOCK_VALUES + BLOCK_GROUPS * 2])
                .as_mut_ptr();
            // SAFETY: the partial block's values are bytes [full*512, groups*32) of the row's
            // values, run v of its m groups at full*512 + v*4m (4m bytes); its scales are bytes
            // [full*32, groups*2); the buffer holds 8 x 64 + 32 bytes.
            unsafe {
                for v in 0..8 {
                    std::ptr::copy_nonoverlapping(
                        vals.add(full * BLOCK_VALUES + v * 4 * m),
                        t.add(v * 64),
                        4 * m,
                    );
                }
                std::ptr::copy_nonoverlapping(row.add(full * 32), t.add(BLOCK_VALUES), 2 * m);
            }
            b.tail = t;
        }
        b
    }

    /// Block `c`'s values (512 bytes, run `v` at `v * 64`) and scales (16 f16), for `c` below
    /// the row's `groups.div_ceil(16)` blocks.
    #[inline(always)]
    pub(crate) fn block(&self, c: usize) -> (*const u8, *const u8) {
        if c < self.full {
            (
                self.vals.wrapping_add(c * BLOCK_VALUES),
                self.sc.wrapping_add(c * 32),
            )
        } else {
            (self.tail, self.tail.wrapping_add(BLOCK_VALUES))
        }
    }
}

/// Exact integer dot of group `g` of a row's values `vals` (a row of `groups` groups) with
/// activation group `g`.
#[inline]
pub(crate) fn group_dot(vals: &[u8], groups: usize, a: &TokenActs, g: usize) -> i32 {
    (0..GROUP)
        .map(|j| vals[value_offset(groups, g, j)] as i8 as i32 * a.qs[qs_offset(g, j)] as i32)
        .sum()
}

/// Dot of row `r` of `w` with activation vector `a`: per group the exact integer sum times
/// (weight scale * activation scale), accumulated in f32 in group order.
pub(crate) fn q8_row_dot(w: &Q8Matrix, r: usize, a: &TokenActs) -> f32 {
    let vals = w.row_values(r);
    let mut acc = 0.0f32;
    for g in 0..w.groups() {
        let s = group_dot(vals, w.groups(), a, g);
        acc += s as f32 * (w.scale(r, g) * a.dexp[g]);
    }
    acc
}

/// The scalar kernel.
///
/// # Safety
/// `out + t * out_stride + r` is valid for writes for `t < x.n()`, `r in rows`; shapes agree
/// (`rows.end <= w.rows`, `x.cols() == w.cols`).
pub(crate) unsafe fn q8_rows_scalar(
    w: &Q8Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: std::ops::Range<usize>,
) {
    debug_assert!(x.padded_groups() >= w.groups());
    for t in 0..x.n() {
        let a = x.token(t);
        for r in rows.clone() {
            let v = q8_row_dot(w, r, &a);
            // SAFETY: (t, r) is in the range the caller guarantees writable.
            unsafe { *out.wrapping_add(t * out_stride + r) = v };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::gauss;

    #[test]
    fn layout_lengths() {
        assert_eq!(q8_row_bytes(0), 0);
        assert_eq!(q8_row_bytes(1), 34);
        assert_eq!(q8_row_bytes(72), 3 * 34);
        assert_eq!(q8_byte_len(3, 72), 3 * 102);
        assert_eq!(q8_byte_len(2048, 1024), 2048 * (1024 + 64));
        assert!(checked_layout(usize::MAX / 2, 64).is_none());
        assert!(matches!(
            Q8Matrix::new(&[], usize::MAX, 64),
            Err(QuantError::Shape { .. })
        ));
        let b = quantize_q8(&gauss(5 * 40, 1), 5, 40);
        assert!(matches!(
            Q8Matrix::new(&b[1..], 5, 40),
            Err(QuantError::Length { .. })
        ));
        assert!(Q8Matrix::new(&b, 5, 64).is_ok());
    }

    #[test]
    fn value_blocks_follow_the_activation_vectors() {
        // Every value of every group has its own place; whole blocks are the activations'
        // layout byte for byte; rows of 1, 3, 16, 17, 44, 48 groups.
        for groups in [1, 3, 16, 17, 44, 48] {
            let mut seen = vec![false; groups * 32];
            for g in 0..groups {
                let (b, i) = (g / 16, g % 16);
                let m = (groups - b * 16).min(16);
                for j in 0..32 {
                    let at = value_offset(groups, g, j);
                    let v = (j % 16 / 4) * 2 + j / 16;
                    assert_eq!(at, b * 512 + v * 4 * m + 4 * i + j % 4);
                    if m == 16 {
                        assert_eq!(at, qs_offset(g, j));
                    }
                    assert!(!seen[at], "{groups} groups: {g}/{j} collides");
                    seen[at] = true;
                }
            }
            assert!(seen.iter().all(|&v| v));
        }
    }

    #[test]
    fn roundtrip_is_within_half_a_step_and_exact_on_the_grid() {
        for &(rows, cols) in &[(1, 32), (3, 72), (17, 40), (8, 200), (5, 544), (2, 1)] {
            let mut w = gauss(rows * cols, (rows * 1000 + cols) as u64);
            // An outlier, a zero row and a constant row.
            w[0] *= 40.0;
            if rows > 2 {
                w[cols..2 * cols].fill(0.0);
                w[2 * cols..3 * cols].fill(-0.75);
            }
            let bytes = quantize_q8(&w, rows, cols);
            let m = Q8Matrix::new(&bytes, rows, cols).unwrap();
            let d = m.dequantize();
            for r in 0..rows {
                for (g, (wg, dg)) in w[r * cols..(r + 1) * cols]
                    .chunks(GROUP)
                    .zip(d[r * cols..(r + 1) * cols].chunks(GROUP))
                    .enumerate()
                {
                    let s = m.scale(r, g);
                    let amax = wg.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
                    assert!((s - amax / 127.0).abs() <= amax / 127.0 * 1e-3 + 1e-12);
                    for (&a, &b) in wg.iter().zip(dg) {
                        // Half a step, plus the clamp when the f16 scale rounded down.
                        assert!(
                            (a - b).abs() <= s * 0.5 + amax * 1e-3,
                            "{a} vs {b} (scale {s})"
                        );
                    }
                }
            }
            if rows > 2 {
                assert!(d[cols..2 * cols].iter().all(|&v| v == 0.0));
                // 0.75 / 127 is not an f16: within the scale's rounding of -0.75.
                assert!(d[2 * cols..3 * cols]
                    .iter()
                    .all(|&v| (v + 0.75).abs() < 1e-3));
            }
        }
        // Values on the grid come back exactly; padding columns are zero.
        let w: Vec<f32> = (0..2 * 72)
            .map(|i| ((i * 37) % 255) as f32 - 127.0)
            .collect();
        let m_bytes = quantize_q8(&w, 2, 72);
        let m = Q8Matrix::new(&m_bytes, 2, 72).unwrap();
        for r in 0..2 {
            let vals = m.row_values(r);
            for c in 72..96 {
                assert_eq!(vals[value_offset(3, c / 32, c % 32)], 0);
            }
        }
        let back = m.dequantize();
        for (g, (a, b)) in w.chunks(32).zip(back.chunks(32)).enumerate() {
            if a.iter().any(|&v| v.abs() == 127.0) {
                assert_eq!(a, b, "group {g}");
            }
        }
    }

    #[test]
    fn non_finite_and_tiny_groups_become_zero() {
        let mut w = vec![0.5f32; 4 * 32];
        w[3] = f32::INFINITY;
        w[32 + 5] = f32::NAN;
        w[64..96].fill(1e-9); // scale below f16's subnormals
        let m_bytes = quantize_q8(&w, 1, 128);
        let m = Q8Matrix::new(&m_bytes, 1, 128).unwrap();
        let d = m.dequantize();
        assert!(d[..32].iter().all(|&v| v == 0.0));
        assert!(d[64..96].iter().all(|&v| v == 0.0));
        // A NaN inside a finite group: max ignores it, the NaN itself becomes 0.
        assert_eq!(d[32 + 5], 0.0);
        assert!((d[32] - 0.5).abs() < 0.01);
        assert!(d[96..].iter().all(|&v| (v - 0.5).abs() < 0.01));
    }
}
