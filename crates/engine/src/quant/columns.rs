//! An int4 or 8-bit matrix read down its columns: `out = W^T x`, the activations f32 and
//! unrounded.
//!
//! MLA's absorbed query `W_uk^T q_nope` multiplies each head's `W_uk^T` (`kv_lora_rank` rows
//! of `qk_nope_head_dim`: on DeepSeek-V3 512 rows of four groups) by the head's query. Row by
//! row ([`super::q4_exact_into`]) every output ends in a reduction across lanes and groups,
//! and with rows of four groups that per-row work is most of the product. Read down the
//! columns instead, the output is a sum of `W^T`'s columns (the rows of `W_uk`) scaled by the
//! query: each output stays in its own lane and no reduction is left. The value product
//! `W_uv lat` (128 rows of 512 on DeepSeek-V3) is read the same way: its per-head inputs need
//! no permutation into a row's stored order then. [`Columns`] holds the matrix's own values
//! (int4 nibbles or 8-bit values, and scales, copied: nothing requantized) in that order.
//!
//! The arithmetic, per output `j` (a row of `W`) and token, in this fixed order: for each
//! group `G` of the columns, `t = fma(x_i, w_ij, t)` over the group's columns `i` in order from
//! `t = 0`, then `o = fma(s_Gj, t, o)` from `o = 0` (`w_ij` the stored integer: int4's `q - 8`
//! or the 8-bit value; `s_Gj` the f16 scale of row `j`'s group `G`). The AVX2 kernel computes exactly that, eight outputs to a
//! vector, so it gives the scalar reference's bits, and each token its own bits whatever the
//! others (a prompt cut into passes gives the bits of one pass).

use super::q4::nibble_offset;
use super::q8w::value_offset;
use super::{check_kernel, Kernel, Q4Matrix, Q8Matrix, GROUP};
use crate::linear::WeightRef;

/// Outputs the AVX2 kernel keeps in registers at once: eight vectors of eight.
const TILE: usize = 64;

/// The stored integers, by tiles of 64 rows (the last padded with weight 0): per tile, for
/// each column `i` in order, the tile's 64 values of that column, so the kernel reads a tile's
/// bytes front to back. Within a column's run the values sit where shifts alone widen them:
/// the kernel reads the run as 32-bit words and takes the same field of every word, rows
/// `8k..8k + 8` in order (no lane-crossing shuffle, which this kind of CPU issues one a cycle).
#[derive(Clone, Debug)]
enum Values {
    /// 32 bytes a column: word `l` (of eight), nibble `k` (bits `4k..4k + 4`) holds row
    /// `8k + l`'s weight as a signed 4-bit integer (the stored `q - 8`).
    Q4(Vec<u8>),
    /// 64 bytes a column, two halves `h` of eight words: word `l`'s byte `k` holds row
    /// `32h + 8k + l`.
    Q8(Vec<i8>),
}

/// A `rows x cols` int4 or 8-bit matrix stored by columns (see [`Values`]); per column group
/// `G`, the f32 scales of every row's group `G`.
#[derive(Clone, Debug)]
pub struct Columns {
    rows: usize,
    cols: usize,
    /// Rows padded to whole tiles.
    rows_p: usize,
    values: Values,
    /// `cols / 32` (rounded up) runs of `rows_p` scales (padding rows 0).
    scale: Vec<f32>,
}

impl Columns {
    /// The values of `w` by columns; `None` for an f32 matrix (its products take no
    /// scales and read its rows).
    pub fn new(w: &WeightRef) -> Option<Columns> {
        match w {
            WeightRef::F32(_) => None,
            WeightRef::Q4(m) => Some(Columns::from_q4(m)),
            WeightRef::Q8(m) => Some(Columns::from_q8(m)),
        }
    }

    fn from_q4(m: &Q4Matrix) -> Columns {
        assert_eq!(
            m.grid(),
            super::Grid::Linear,
            "columns read the linear grid only"
        );
        let (rows, cols) = (m.rows, m.cols);
        let groups = m.groups();
        // Padding rows hold weight 0.
        let mut nib = vec![0u8; cols * rows.next_multiple_of(TILE) / 2];
        let scale = copy_by_columns(
            rows,
            cols,
            groups,
            |j, g| m.scale(j, g),
            |j, g, v, k| {
                let byte = m.row_nibbles(j)[nibble_offset(groups, g, k % 16)];
                let q = if k < 16 { byte & 15 } else { byte >> 4 };
                // The weight q - 8 as a signed nibble.
                let (at, shift) = nibble_at(cols, v, j);
                nib[at] |= (q.wrapping_sub(8) & 15) << shift;
            },
        );
        Columns::with(rows, cols, Values::Q4(nib), scale)
    }

    fn from_q8(m: &Q8Matrix) -> Columns {
        let (rows, cols) = (m.rows, m.cols);
        let groups = m.groups();
        let mut vals = vec![0i8; cols * rows.next_multiple_of(TILE)];
        let scale = copy_by_columns(
            rows,
            cols,
            groups,
            |j, g| m.scale(j, g),
            |j, g, v, k| {
                vals[byte_at(cols, v, j)] = m.row_values(j)[value_offset(groups, g, k)] as i8;
            },
        );
        Columns::with(rows, cols, Values::Q8(vals), scale)
    }

    fn with(rows: usize, cols: usize, values: Values, scale: Vec<f32>) -> Columns {
        Columns {
            rows,
            cols,
            rows_p: rows.next_multiple_of(TILE),
            values,
            scale,
        }
    }

    /// Outputs per token (`W`'s rows).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Inputs per token (`W`'s columns).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Bytes this copy holds.
    pub fn bytes(&self) -> usize {
        let values = match &self.values {
            Values::Q4(v) => v.len(),
            Values::Q8(v) => v.len(),
        };
        values + std::mem::size_of_val(&self.scale[..])
    }

    /// Bytes the copy of a `rows x cols` matrix holds (8-bit `q8`, else int4).
    pub fn bytes_of(rows: usize, cols: usize, q8: bool) -> usize {
        let rows_p = rows.next_multiple_of(TILE);
        let values = if q8 { cols * rows_p } else { cols * rows_p / 2 };
        values + 4 * cols.div_ceil(GROUP) * rows_p
    }

    /// `w_ij`: the stored integer of row `j`, column `i`.
    fn weight(&self, i: usize, j: usize) -> f32 {
        match &self.values {
            Values::Q4(nib) => {
                let (at, shift) = nibble_at(self.cols, i, j);
                // Sign-extended from the nibble's top bit.
                (((nib[at] >> shift) << 4) as i8 >> 4) as f32
            }
            Values::Q8(vals) => vals[byte_at(self.cols, i, j)] as f32,
        }
    }
}

/// Walks a `rows x cols` matrix of `groups` groups a value at a time, `put(j, g, v, k)` for
/// row `j`, column `v` (index `k` in its group `g`), and gives its scales by columns: per
/// group, every row's `scale(j, g)` (padding rows 0).
fn copy_by_columns(
    rows: usize,
    cols: usize,
    groups: usize,
    scale: impl Fn(usize, usize) -> f32,
    mut put: impl FnMut(usize, usize, usize, usize),
) -> Vec<f32> {
    let rows_p = rows.next_multiple_of(TILE);
    let mut out = vec![0.0f32; groups * rows_p];
    for j in 0..rows {
        for g in 0..groups {
            out[g * rows_p + j] = scale(j, g);
            for v in g * GROUP..((g + 1) * GROUP).min(cols) {
                put(j, g, v, v - g * GROUP);
            }
        }
    }
    out
}

/// Where the int4 weight of row `j`, column `i` of a matrix of `cols` columns is: its byte,
/// and the shift of its nibble in that byte (little-endian words, [`Values::Q4`]).
fn nibble_at(cols: usize, i: usize, j: usize) -> (usize, u32) {
    let (k, l) = (j % TILE / 8, j % 8);
    let at = (j / TILE) * cols * (TILE / 2) + i * (TILE / 2) + 4 * l + k / 2;
    (at, 4 * (k % 2) as u32)
}

/// Where the 8-bit value of row `j`, column `i` of a matrix of `cols` columns is
/// ([`Values::Q8`]).
fn byte_at(cols: usize, i: usize, j: usize) -> usize {
    let (h, k, l) = (j % TILE / 32, j % 32 / 8, j % 8);
    (j / TILE) * cols * TILE + i * TILE + 32 * h + 4 * l + k
}

/// `out[t][j] = sum_i W[j][i] x[t][i]` for every token of `x` (`n x cols`, unrounded) into
/// `out` (`n x rows`), in the module's order.
pub fn columns_exact_into(k: Kernel, w: &Columns, x: &[f32], n: usize, out: &mut [f32]) {
    check_kernel(k);
    assert_eq!(x.len(), n * w.cols, "columns product: x is not n x cols");
    assert_eq!(
        out.len(),
        n * w.rows,
        "columns product: out is not n x rows"
    );
    if w.cols == 0 {
        out.fill(0.0);
        return;
    }
    let mut buf = vec![0.0f32; w.rows_p];
    for (x, out) in x
        .chunks_exact(w.cols)
        .zip(out.chunks_exact_mut(w.rows.max(1)))
    {
        #[cfg(target_arch = "x86_64")]
        if k != Kernel::Scalar {
            // SAFETY: check_kernel above: both vector kernels include AVX2 and FMA.
            unsafe {
                match &w.values {
                    Values::Q4(nib) => avx2::token::<false>(w, nib, x, &mut buf),
                    Values::Q8(vals) => {
                        avx2::token::<true>(w, bytemuck::cast_slice(vals), x, &mut buf)
                    }
                }
            };
            out.copy_from_slice(&buf[..w.rows]);
            continue;
        }
        token(w, x, &mut buf);
        out.copy_from_slice(&buf[..w.rows]);
    }
}

/// One token's outputs (`rows_p` of them, padding included): the scalar reference.
fn token(w: &Columns, x: &[f32], out: &mut [f32]) {
    for (j, o) in out.iter_mut().enumerate() {
        let mut acc = 0.0f32;
        for (g, xs) in x.chunks(GROUP).enumerate() {
            let mut t = 0.0f32;
            for (k, &xi) in xs.iter().enumerate() {
                t = xi.mul_add(w.weight(g * GROUP + k, j), t);
            }
            acc = w.scale[g * w.rows_p + j].mul_add(t, acc);
        }
        *o = acc;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{Columns, GROUP, TILE};

    /// Field `k` of every 32-bit word of `v` as an f32: the word shifted left by `LEFT`, then
    /// arithmetically right by `RIGHT` (sign-extending the field).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn field<const LEFT: i32, const RIGHT: i32>(v: __m256i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_srai_epi32::<RIGHT>(_mm256_slli_epi32::<LEFT>(v)))
    }

    /// A column's 64 weights of one tile (rows `8k..8k + 8` in vector `k`) from its stored
    /// bytes at `p`: 64 8-bit values (`Q8`) or 32 bytes of int4 nibbles ([`super::Values`]).
    ///
    /// # Safety
    /// The CPU has AVX2; `p` points to the column's bytes in the tile (64 or 32 readable).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weights<const Q8: bool>(p: *const u8) -> [__m256; 8] {
        if Q8 {
            // SAFETY: 64 bytes readable from `p` (the caller).
            let (a, b) = unsafe {
                (
                    _mm256_loadu_si256(p.cast()),
                    _mm256_loadu_si256(p.add(32).cast()),
                )
            };
            let bytes = |v| {
                [
                    field::<24, 24>(v),
                    field::<16, 24>(v),
                    field::<8, 24>(v),
                    field::<0, 24>(v),
                ]
            };
            let (a, b) = (bytes(a), bytes(b));
            std::array::from_fn(|q| if q < 4 { a[q] } else { b[q - 4] })
        } else {
            // SAFETY: 32 bytes readable from `p` (the caller).
            let v = unsafe { _mm256_loadu_si256(p.cast()) };
            [
                field::<28, 28>(v),
                field::<24, 28>(v),
                field::<20, 28>(v),
                field::<16, 28>(v),
                field::<12, 28>(v),
                field::<8, 28>(v),
                field::<4, 28>(v),
                field::<0, 28>(v),
            ]
        }
    }

    /// [`super::token`] in AVX2 + FMA, a tile of 64 outputs at a time in eight registers;
    /// `bytes` the matrix's stored values (`Q8`: 8-bit, else int4 nibbles).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn token<const Q8: bool>(
        w: &Columns,
        bytes: &[u8],
        x: &[f32],
        out: &mut [f32],
    ) {
        let per_col = if Q8 { TILE } else { TILE / 2 };
        assert!(x.len() == w.cols && out.len() == w.rows_p);
        assert!(bytes.len() >= w.cols * w.rows_p / TILE * per_col);
        assert!(w.scale.len() >= w.cols.div_ceil(GROUP) * w.rows_p);
        for tile in 0..w.rows_p / TILE {
            let base = tile * w.cols * per_col;
            let mut o = [_mm256_setzero_ps(); 8];
            for (g, xs) in x.chunks(GROUP).enumerate() {
                let mut t = [_mm256_setzero_ps(); 8];
                for (k, &xi) in xs.iter().enumerate() {
                    let xi = _mm256_set1_ps(xi);
                    let at = base + (g * GROUP + k) * per_col;
                    // SAFETY: the tile's run of this column is `per_col` bytes from `at`,
                    // inside `bytes` (asserted size above).
                    let wv = unsafe { weights::<Q8>(bytes.as_ptr().add(at)) };
                    for (t, wv) in t.iter_mut().zip(wv) {
                        *t = _mm256_fmadd_ps(xi, wv, *t);
                    }
                }
                for (q, (o, t)) in o.iter_mut().zip(t).enumerate() {
                    let j = tile * TILE + 8 * q;
                    // SAFETY: group g's scales are `rows_p` long, `j + 8 <= rows_p`.
                    let s = unsafe { _mm256_loadu_ps(w.scale.as_ptr().add(g * w.rows_p + j)) };
                    *o = _mm256_fmadd_ps(s, t, *o);
                }
            }
            for (q, o) in o.into_iter().enumerate() {
                let j = tile * TILE + 8 * q;
                // SAFETY: `j + 8 <= rows_p = out.len()` (asserted).
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(j), o) };
            }
        }
    }
}
