//! An int4 matrix read down its columns: `out = W^T x`, the activations f32 and unrounded.
//!
//! MLA's absorbed query `W_uk^T q_nope` multiplies each head's `W_uk^T` (`kv_lora_rank` rows
//! of `qk_nope_head_dim`: on DeepSeek-V3 512 rows of four groups) by the head's query. Row by
//! row ([`super::q4_exact_into`]) every output ends in a reduction across lanes and groups,
//! and with rows of four groups that per-row work is most of the product. Read down the
//! columns instead, the output is a sum of `W^T`'s columns (the rows of `W_uk`) scaled by the
//! query: each output stays in its own lane and no reduction is left. [`Q4Columns`] holds the
//! matrix's own values (nibbles and scales copied, nothing requantized) in that order.
//!
//! The arithmetic, per output `j` (a row of `W`) and token, in this fixed order: for each
//! group `G` of the columns, `t = fma(x_i, w_ij, t)` over the group's columns `i` in order from
//! `t = 0`, then `o = fma(s_Gj, t, o)` from `o = 0` (`w_ij` the integer `q - 8`, `s_Gj` the
//! f16 scale of row `j`'s group `G`). The AVX2 kernel computes exactly that, eight outputs to a
//! vector, so it gives the scalar reference's bits, and each token its own bits whatever the
//! others (a prompt cut into passes gives the bits of one pass).

use super::q4::nibble_offset;
use super::{check_kernel, Kernel, Q4Matrix, GROUP};

/// Outputs per chunk of stored nibbles: one byte holds outputs `b` (low nibble) and `b + 16`.
const CHUNK: usize = 32;
/// Outputs the AVX2 kernel keeps in registers at once (two chunks).
const TILE: usize = 64;

/// An int4 matrix of `rows x cols` stored by columns, in tiles of 64 rows (the last padded
/// with `q = 8`): per tile, for each column `i` in order, 32 bytes, two chunks of 32 rows, byte
/// `b` of a chunk holding row `b` in its low nibble and row `b + 16` in its high one (so the
/// kernel reads a tile's bytes front to back); and per column group `G`, the f32 scales of
/// every row's group `G`.
#[derive(Clone, Debug)]
pub struct Q4Columns {
    rows: usize,
    cols: usize,
    /// Rows padded to whole tiles.
    rows_p: usize,
    /// `rows_p / 64` tiles of `cols` runs of 32 bytes.
    nib: Vec<u8>,
    /// `cols / 32` (rounded up) runs of `rows_p` scales (padding rows 0).
    scale: Vec<f32>,
}

impl Q4Columns {
    /// The values of `m`, by columns.
    pub fn new(m: &Q4Matrix) -> Q4Columns {
        let (rows, cols) = (m.rows, m.cols);
        let groups = m.groups();
        let rows_p = rows.next_multiple_of(TILE);
        // Padding rows hold q = 8 (weight 0) in both nibbles.
        let mut nib = vec![0x88u8; cols * rows_p / 2];
        let mut scale = vec![0.0f32; groups * rows_p];
        for j in 0..rows {
            let row = m.row_nibbles(j);
            let b = j % CHUNK;
            for g in 0..groups {
                scale[g * rows_p + j] = m.scale(j, g);
                for v in g * GROUP..((g + 1) * GROUP).min(cols) {
                    let k = v - g * GROUP;
                    let byte = row[nibble_offset(groups, g, k % 16)];
                    let q = if k < 16 { byte & 15 } else { byte >> 4 };
                    let at = &mut nib[nibble_at(cols, v, j)];
                    *at = if b < 16 {
                        (*at & 0xf0) | q
                    } else {
                        (*at & 0x0f) | (q << 4)
                    };
                }
            }
        }
        Q4Columns {
            rows,
            cols,
            rows_p,
            nib,
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

    /// `w_ij`: the integer `q - 8` of row `j`, column `i`.
    fn weight(&self, i: usize, j: usize) -> f32 {
        let byte = self.nib[nibble_at(self.cols, i, j)];
        let q = if j % CHUNK < 16 { byte & 15 } else { byte >> 4 };
        (q as i32 - 8) as f32
    }
}

/// Where the byte holding row `j`, column `i` of a matrix of `cols` columns is.
fn nibble_at(cols: usize, i: usize, j: usize) -> usize {
    (j / TILE) * cols * (TILE / 2) + i * (TILE / 2) + (j % TILE) / CHUNK * 16 + j % 16
}

/// `out[t][j] = sum_i W[j][i] x[t][i]` for every token of `x` (`n x cols`, unrounded) into
/// `out` (`n x rows`), in the module's order.
pub fn q4_columns_exact_into(k: Kernel, w: &Q4Columns, x: &[f32], n: usize, out: &mut [f32]) {
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
            unsafe { avx2::token(w, x, &mut buf) };
            out.copy_from_slice(&buf[..w.rows]);
            continue;
        }
        token(w, x, &mut buf);
        out.copy_from_slice(&buf[..w.rows]);
    }
}

/// One token's outputs (`rows_p` of them, padding included): the scalar reference.
fn token(w: &Q4Columns, x: &[f32], out: &mut [f32]) {
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

    use super::{Q4Columns, CHUNK, GROUP, TILE};

    /// [`super::token`] in AVX2 + FMA, a tile of 64 outputs at a time in eight registers.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn token(w: &Q4Columns, x: &[f32], out: &mut [f32]) {
        assert!(x.len() == w.cols && out.len() == w.rows_p);
        assert!(w.nib.len() >= w.cols * w.rows_p / 2);
        assert!(w.scale.len() >= w.cols.div_ceil(GROUP) * w.rows_p);
        let low = _mm_set1_epi8(0x0f);
        let eight = _mm_set1_epi8(8);
        for tile in 0..w.rows_p / TILE {
            let mut o = [_mm256_setzero_ps(); 8];
            for (g, xs) in x.chunks(GROUP).enumerate() {
                let mut t = [_mm256_setzero_ps(); 8];
                for (k, &xi) in xs.iter().enumerate() {
                    let xi = _mm256_set1_ps(xi);
                    let at = super::nibble_at(w.cols, g * GROUP + k, tile * TILE);
                    for c in 0..2 {
                        // SAFETY: the tile's run of this column is 32 bytes from `at`, inside
                        // `nib` (asserted size above).
                        let b = unsafe { _mm_loadu_si128(w.nib.as_ptr().add(at + 16 * c).cast()) };
                        let lo = _mm_sub_epi8(_mm_and_si128(b, low), eight);
                        let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low), eight);
                        let v = [lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)];
                        for (q, v) in v.into_iter().enumerate() {
                            let wv = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
                            let t = &mut t[4 * c + q];
                            *t = _mm256_fmadd_ps(xi, wv, *t);
                        }
                    }
                }
                for (q, (o, t)) in o.iter_mut().zip(t).enumerate() {
                    let j = tile * TILE + q / 4 * CHUNK + q % 4 * 8;
                    // SAFETY: group g's scales are `rows_p` long, `j + 8 <= rows_p`.
                    let s = unsafe { _mm256_loadu_ps(w.scale.as_ptr().add(g * w.rows_p + j)) };
                    *o = _mm256_fmadd_ps(s, t, *o);
                }
            }
            for (q, o) in o.into_iter().enumerate() {
                let j = tile * TILE + q / 4 * CHUNK + q % 4 * 8;
                // SAFETY: `j + 8 <= rows_p = out.len()` (asserted).
                unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(j), o) };
            }
        }
    }
}
