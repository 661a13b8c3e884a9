//! Int4 and 8-bit weights times f32 activations, the activations not rounded ("exact").
//!
//! The int4 and 8-bit kernels round each group of 32 activations to 8 bits before their
//! integer dot products. That rounding falls on a product's input, so two computations that
//! are equal in exact arithmetic but multiply by a weight at different points (MLA's absorbed
//! form `(W_uk^T q) . c` and its expanded form `q . (W_uk c)`) round different values and
//! disagree by ~1% of the logits, where with f32 inputs they agree to f32 rounding. These
//! products keep the inputs f32: each weight row is dequantized (`(q - 8) * scale` or
//! `q * scale`, both exact in f32: a 4- or 8-bit integer times an f16) and the f32 kernel
//! takes the dot products.
//!
//! Both formats keep a block of 16 groups (a row's last block: the `m` groups left) as runs
//! of one dword of every group: 8-bit value `j` of group `i` at `v(j) * 4m + 4i + j % 4` with
//! `v(j) = (j % 16 / 4) * 2 + j / 16`, and int4's nibble byte `j` (0..16) at `(j / 4) * 4m +
//! 4i + j % 4` holding values `j` (low nibble) and `j + 16` (high). Read low nibbles then high
//! ones, the int4 runs are the 8-bit runs in the same order. So a row is dequantized in that
//! stored order by one sequential pass, and the activations are permuted into it once per
//! product ([`StoredActs`]): a dot product does not see a permutation applied to both sides.

use std::ops::Range;

use half::f16;

use super::q4::{BLOCK_GROUPS, BLOCK_NIBBLES};
use super::q8w::{value_offset, BLOCK_VALUES};
use super::{
    check_kernel, f32_matmul_raw, q4_padded_cols, Kernel, OutView, Q4Matrix, Q8Matrix, GROUP,
};

/// Activations permuted into the weights' stored order: `n` rows of `kp` values (`kp` the
/// columns padded to whole groups; padding zero).
#[derive(Clone, Debug, Default)]
pub struct StoredActs {
    pub x: Vec<f32>,
    pub n: usize,
    pub kp: usize,
}

impl StoredActs {
    /// `x`: `n` rows of `cols` values.
    pub fn new(x: &[f32], n: usize, cols: usize) -> StoredActs {
        assert_eq!(x.len(), n * cols, "StoredActs: x is not n x cols");
        let kp = q4_padded_cols(cols);
        let groups = kp / GROUP;
        let at: Vec<usize> = (0..cols)
            .map(|c| value_offset(groups, c / GROUP, c % GROUP))
            .collect();
        let mut out = vec![0.0f32; n * kp];
        if cols > 0 {
            for (src, dst) in x.chunks_exact(cols).zip(out.chunks_exact_mut(kp)) {
                for (&v, &p) in src.iter().zip(&at) {
                    dst[p] = v;
                }
            }
        }
        StoredActs { x: out, n, kp }
    }
}

/// The f32 scales of a row's groups (`f16` little-endian pairs).
fn row_scales(bytes: &[u8], out: &mut Vec<f32>) {
    out.clear();
    out.extend(
        bytes
            .chunks_exact(2)
            .map(|s| f16::from_le_bytes([s[0], s[1]]).to_f32()),
    );
}

/// Calls `f(b, run, scales)` for each block `b` of a row whose groups' scales are `scales`:
/// `run` is the block's bytes per dword run (`4m`), and byte `x` of a run belongs to group
/// `x / 4`, whose scale is `scales[x]` of the slice given.
#[inline(always)]
fn for_each_block(scales: &[f32], mut f: impl FnMut(usize, usize, &[f32])) {
    let groups = scales.len();
    let mut bs = [0.0f32; 4 * BLOCK_GROUPS];
    for b in 0..groups.div_ceil(BLOCK_GROUPS) {
        let g0 = b * BLOCK_GROUPS;
        let run = 4 * (groups - g0).min(BLOCK_GROUPS);
        for (x, s) in bs[..run].iter_mut().enumerate() {
            *s = scales[g0 + x / 4];
        }
        f(b, run, &bs[..run]);
    }
}

/// An int4 row (its nibbles, its groups' scales) dequantized in stored order into `out` (`kp`).
#[inline(always)]
fn q4_row_stored(scales: &[f32], nib: &[u8], out: &mut [f32]) {
    for_each_block(scales, |b, run, bs| {
        let nb = &nib[b * BLOCK_NIBBLES..b * BLOCK_NIBBLES + 4 * run];
        let ob = &mut out[b * BLOCK_VALUES..b * BLOCK_VALUES + 8 * run];
        for (bytes, pair) in nb.chunks_exact(run).zip(ob.chunks_exact_mut(2 * run)) {
            let (lo, hi) = pair.split_at_mut(run);
            for x in 0..run {
                let q = bytes[x];
                lo[x] = ((q & 15) as i32 - 8) as f32 * bs[x];
                hi[x] = ((q >> 4) as i32 - 8) as f32 * bs[x];
            }
        }
    });
}

/// An 8-bit row (its values, its groups' scales) dequantized in stored order into `out`.
#[inline(always)]
fn q8_row_stored(scales: &[f32], vals: &[u8], out: &mut [f32]) {
    for_each_block(scales, |b, run, bs| {
        let vb = &vals[b * BLOCK_VALUES..b * BLOCK_VALUES + 8 * run];
        let ob = &mut out[b * BLOCK_VALUES..b * BLOCK_VALUES + 8 * run];
        for (v, o) in vb.chunks_exact(run).zip(ob.chunks_exact_mut(run)) {
            for x in 0..run {
                o[x] = v[x] as i8 as f32 * bs[x];
            }
        }
    });
}

/// Which stored-order dequantization a row takes.
#[derive(Clone, Copy)]
enum Format {
    Q4,
    Q8,
}

/// The same loops compiled for the kernel's instruction set (they vectorise).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn row_stored_avx512(f: Format, scales: &[f32], bytes: &[u8], out: &mut [f32]) {
    match f {
        Format::Q4 => q4_row_stored(scales, bytes, out),
        Format::Q8 => q8_row_stored(scales, bytes, out),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn row_stored_avx2(f: Format, scales: &[f32], bytes: &[u8], out: &mut [f32]) {
    match f {
        Format::Q4 => q4_row_stored(scales, bytes, out),
        Format::Q8 => q8_row_stored(scales, bytes, out),
    }
}

fn row_stored(k: Kernel, f: Format, scales: &[f32], bytes: &[u8], out: &mut [f32]) {
    match k {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the caller checked that the CPU has kernel `k`'s instruction set.
        Kernel::Avx512Vnni => unsafe { row_stored_avx512(f, scales, bytes, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Kernel::Avx2 => unsafe { row_stored_avx2(f, scales, bytes, out) },
        _ => match f {
            Format::Q4 => q4_row_stored(scales, bytes, out),
            Format::Q8 => q8_row_stored(scales, bytes, out),
        },
    }
}

/// Rows dequantized at a time: a few rows' f32 values stay in L1 while every token reads them.
const CHUNK_ROWS: usize = 8;

/// The rows of `out`: `out[t][r] = W[r] . x[t]`, each row of `w` given by `row(r)` as (its
/// scale bytes, its value bytes).
fn exact_into<'w>(
    k: Kernel,
    f: Format,
    kp: usize,
    row: impl Fn(usize) -> (&'w [u8], &'w [u8]),
    x: &StoredActs,
    out: OutView,
) {
    check_kernel(k);
    assert_eq!(
        x.kp, kp,
        "exact product: activations of {} columns, weights of {kp}",
        x.kp
    );
    assert_eq!(
        x.n, out.n,
        "exact product: {} activation rows, output of {}",
        x.n, out.n
    );
    let rows: Range<usize> = out.rows();
    if rows.is_empty() || x.n == 0 {
        return;
    }
    let mut scratch = vec![0.0f32; CHUNK_ROWS.min(rows.len()) * kp];
    let mut scales = Vec::with_capacity(kp / GROUP);
    for start in rows.clone().step_by(CHUNK_ROWS) {
        let len = CHUNK_ROWS.min(rows.end - start);
        for (i, dst) in scratch.chunks_exact_mut(kp).take(len).enumerate() {
            let (s, v) = row(start + i);
            row_scales(s, &mut scales);
            row_stored(k, f, &scales, v, dst);
        }
        // SAFETY: `scratch` holds `len` rows of `kp` values and `x.x` `x.n` rows of `kp`; the
        // kernel writes `ptr + start + t * stride + i` for `t < x.n`, `i < len`, which is
        // element `(t, start + i)` of the view, a row inside `rows`, which the view borrows
        // mutably (its constructor checked the buffer's length for every such element).
        unsafe {
            f32_matmul_raw(
                k,
                &scratch,
                kp,
                &x.x,
                x.n,
                out.ptr.add(start),
                out.stride,
                0..len,
            )
        }
    }
}

/// `out[t][r] = W[r] . x[t]` for the view's rows of int4 `w`, the activations f32.
pub fn q4_exact_into<'w>(k: Kernel, w: &Q4Matrix<'w>, x: &StoredActs, out: OutView) {
    let kp = w.groups() * GROUP;
    exact_into(
        k,
        Format::Q4,
        kp,
        |r| (w.row_scales(r), w.row_nibbles(r)),
        x,
        out,
    );
}

/// `out[t][r] = W[r] . x[t]` for the view's rows of 8-bit `w`, the activations f32.
pub fn q8_exact_into<'w>(k: Kernel, w: &Q8Matrix<'w>, x: &StoredActs, out: OutView) {
    let kp = w.groups() * GROUP;
    exact_into(
        k,
        Format::Q8,
        kp,
        |r| (w.row_scales(r), w.row_values(r)),
        x,
        out,
    );
}
