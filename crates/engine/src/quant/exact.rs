//! Int4 and 8-bit weights times f32 activations, the activations not rounded ("exact").
//!
//! The int4 and 8-bit kernels round each group of 32 activations to 8 bits before their
//! integer dot products. That rounding falls on a product's input, so two computations that
//! are equal in exact arithmetic but multiply by a weight at different points (MLA's absorbed
//! form `(W_uk^T q) . c` and its expanded form `q . (W_uk c)`) round different values and
//! disagree by ~1% of the logits, where with f32 inputs they agree to f32 rounding. These
//! products keep the inputs f32 and multiply them by the weights' integers widened to f32
//! (exact), each group's sum then scaled by its f16 scale.
//!
//! Both formats keep a block of 16 groups (a row's last block: the `m` groups left) as runs
//! of one dword of every group: 8-bit value `j` of group `i` at `v(j) * 4m + 4i + j % 4` with
//! `v(j) = (j % 16 / 4) * 2 + j / 16`, and int4's nibble byte `j` (0..16) at `(j / 4) * 4m +
//! 4i + j % 4` holding values `j` (low nibble) and `j + 16` (high). Read low nibbles then high
//! ones, the int4 runs are the 8-bit runs in the same order. So a row is read in that stored
//! order by one sequential pass, and the activations are permuted into it once per product
//! ([`StoredActs`]): a dot product does not see a permutation applied to both sides.
//!
//! Each (row, token) is summed in one fixed order whatever the number of tokens: per block,
//! lane `x` of a run (group `x / 4`) accumulates the block's eight runs in order, then each
//! group's four lanes are added and scaled. So a product's results do not depend on how many
//! tokens it takes (a prompt cut into passes gives the bits of one pass), as with the 8-bit
//! kernels' exact integer sums. A block's weights are widened to f32 once for every token.

use half::f16;

use super::q4::{BLOCK_GROUPS, BLOCK_NIBBLES};
use super::q8w::{value_offset, BLOCK_VALUES};
use super::{check_kernel, q4_padded_cols, Kernel, OutView, Q4Matrix, Q8Matrix, GROUP};

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

/// The f32 scales of a block's groups (`f16` little-endian pairs) into `out`.
fn block_scales(bytes: &[u8], out: &mut [f32; BLOCK_GROUPS]) {
    for (o, s) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_le_bytes([s[0], s[1]]).to_f32();
    }
}

/// [`block_scales`] with F16C (the half crate converts one by one in software here, which
/// cost more than a short row's products).
///
/// # Safety
/// The CPU has F16C and AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn block_scales_f16c(bytes: &[u8], out: &mut [f32; BLOCK_GROUPS]) {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let mut pad = [0u8; 2 * BLOCK_GROUPS];
    pad[..bytes.len()].copy_from_slice(bytes);
    // SAFETY: `pad` holds 32 bytes (16 halves) and `out` 16 floats; unaligned loads and stores.
    unsafe {
        for h in 0..2 {
            let v = _mm_loadu_si128(pad.as_ptr().add(16 * h).cast());
            _mm256_storeu_ps(out.as_mut_ptr().add(8 * h), _mm256_cvtph_ps(v));
        }
    }
}

/// How a row stores its values.
#[derive(Clone, Copy)]
enum Format {
    Q4,
    Q8,
}

/// Block `b`'s weights (without their scales) as f32, in stored order, into `q` (`8 * run`
/// values): int4 `q - 8` (its nibble runs low then high), 8-bit `q`. Exact small integers.
#[inline(always)]
fn widen_block(f: Format, bytes: &[u8], b: usize, run: usize, q: &mut [f32; BLOCK_VALUES]) {
    match f {
        Format::Q4 => {
            let nib = &bytes[b * BLOCK_NIBBLES..b * BLOCK_NIBBLES + 4 * run];
            for (k, src) in nib.chunks_exact(run).enumerate() {
                let (lo, hi) = q[2 * k * run..(2 * k + 2) * run].split_at_mut(run);
                for x in 0..run {
                    lo[x] = ((src[x] & 15) as i32 - 8) as f32;
                    hi[x] = ((src[x] >> 4) as i32 - 8) as f32;
                }
            }
        }
        Format::Q8 => {
            let vals = &bytes[b * BLOCK_VALUES..b * BLOCK_VALUES + 8 * run];
            for (d, &v) in q.iter_mut().zip(vals) {
                *d = v as i8 as f32;
            }
        }
    }
}

/// One block's lanes for one token: lane `x` sums `q x` over the block's eight runs, in order.
#[inline(always)]
fn block_lanes<const RUN: usize>(q: &[f32], xs: &[f32], lanes: &mut [f32; 64]) {
    let mut acc = [0.0f32; RUN];
    for v in 0..8 {
        let w: &[f32; RUN] = q[v * RUN..(v + 1) * RUN].try_into().unwrap();
        let a: &[f32; RUN] = xs[v * RUN..(v + 1) * RUN].try_into().unwrap();
        for x in 0..RUN {
            acc[x] += w[x] * a[x];
        }
    }
    for (l, a) in lanes.iter_mut().zip(acc) {
        *l = a;
    }
}

/// [`widen_block`] then [`block_lanes`] for one token, without the widened copy: the same
/// values summed in the same order, so the same bits (a decode step's one token).
#[inline(always)]
fn block_lanes_fused<const RUN: usize>(
    f: Format,
    bytes: &[u8],
    b: usize,
    xs: &[f32],
    lanes: &mut [f32; 64],
) {
    let mut acc = [0.0f32; RUN];
    match f {
        Format::Q4 => {
            for k in 0..4 {
                let at = b * BLOCK_NIBBLES + k * RUN;
                let src: &[u8; RUN] = bytes[at..at + RUN].try_into().unwrap();
                let lo: &[f32; RUN] = xs[2 * k * RUN..(2 * k + 1) * RUN].try_into().unwrap();
                let hi: &[f32; RUN] = xs[(2 * k + 1) * RUN..(2 * k + 2) * RUN].try_into().unwrap();
                for x in 0..RUN {
                    acc[x] += ((src[x] & 15) as i32 - 8) as f32 * lo[x];
                }
                for x in 0..RUN {
                    acc[x] += ((src[x] >> 4) as i32 - 8) as f32 * hi[x];
                }
            }
        }
        Format::Q8 => {
            for v in 0..8 {
                let at = b * BLOCK_VALUES + v * RUN;
                let src: &[u8; RUN] = bytes[at..at + RUN].try_into().unwrap();
                let a: &[f32; RUN] = xs[v * RUN..(v + 1) * RUN].try_into().unwrap();
                for x in 0..RUN {
                    acc[x] += src[x] as i8 as f32 * a[x];
                }
            }
        }
    }
    for (l, a) in lanes.iter_mut().zip(acc) {
        *l = a;
    }
}

/// `block_lanes` for a run length known only at run time (the same sums).
#[inline(always)]
fn block_lanes_any(run: usize, q: &[f32], xs: &[f32], lanes: &mut [f32; 64]) {
    for x in 0..run {
        let mut a = 0.0f32;
        for v in 0..8 {
            a += q[v * run + x] * xs[v * run + x];
        }
        lanes[x] = a;
    }
}

/// `out[t][r]` for the view's rows and every token of `x`.
#[inline(always)]
fn rows_into<'w>(
    f: Format,
    row: &impl Fn(usize) -> (&'w [u8], &'w [u8]),
    x: &StoredActs,
    out: &mut OutView,
    widen: impl Fn(&[u8], &mut [f32; BLOCK_GROUPS]),
) {
    let groups = x.kp / GROUP;
    let mut scales = [0.0f32; BLOCK_GROUPS];
    let mut totals = vec![0.0f32; x.n];
    let mut q = [0.0f32; BLOCK_VALUES];
    let mut lanes = [0.0f32; 64];
    for r in out.rows() {
        let (s, v) = row(r);
        totals.fill(0.0);
        for b in 0..groups.div_ceil(BLOCK_GROUPS) {
            let g0 = b * BLOCK_GROUPS;
            let m = (groups - g0).min(BLOCK_GROUPS);
            let run = 4 * m;
            widen(&s[2 * g0..2 * (g0 + m)], &mut scales);
            let fused = x.n == 1 && matches!(m, 16 | 8 | 4);
            if !fused {
                widen_block(f, v, b, run, &mut q);
            }
            for (t, total) in totals.iter_mut().enumerate() {
                let xs = &x.x[t * x.kp + b * BLOCK_VALUES..];
                match (fused, m) {
                    (true, 16) => block_lanes_fused::<64>(f, v, b, xs, &mut lanes),
                    (true, 8) => block_lanes_fused::<32>(f, v, b, xs, &mut lanes),
                    (true, _) => block_lanes_fused::<16>(f, v, b, xs, &mut lanes),
                    (false, 16) => block_lanes::<64>(&q, xs, &mut lanes),
                    (false, 8) => block_lanes::<32>(&q, xs, &mut lanes),
                    (false, 4) => block_lanes::<16>(&q, xs, &mut lanes),
                    _ => block_lanes_any(run, &q, xs, &mut lanes),
                }
                // In a register, not through `total` (a store and reload per group otherwise).
                let mut sum = *total;
                for (i, four) in lanes[..run].chunks_exact(4).enumerate() {
                    sum += scales[i] * (four[0] + four[1] + four[2] + four[3]);
                }
                *total = sum;
            }
        }
        for (t, &total) in totals.iter().enumerate() {
            out.set(t, r, total);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_into_avx512<'w>(
    f: Format,
    row: &impl Fn(usize) -> (&'w [u8], &'w [u8]),
    x: &StoredActs,
    out: &mut OutView,
) {
    // SAFETY: this function's features include F16C and AVX.
    rows_into(f, row, x, out, |b, o| unsafe { block_scales_f16c(b, o) })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_into_avx2<'w>(
    f: Format,
    row: &impl Fn(usize) -> (&'w [u8], &'w [u8]),
    x: &StoredActs,
    out: &mut OutView,
) {
    // SAFETY: this function's features include F16C and AVX.
    rows_into(f, row, x, out, |b, o| unsafe { block_scales_f16c(b, o) })
}

/// The rows of `out`: `out[t][r] = W[r] . x[t]`, each row of `w` given by `row(r)` as (its
/// scale bytes, its value bytes). The same loops compiled for the kernel's instruction set
/// (they vectorise) give the same sums in the same order: the kernels agree to the bit.
fn exact_into<'w>(
    k: Kernel,
    f: Format,
    kp: usize,
    row: impl Fn(usize) -> (&'w [u8], &'w [u8]),
    x: &StoredActs,
    mut out: OutView,
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
    if out.rows().is_empty() || x.n == 0 {
        return;
    }
    match k {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: check_kernel above: the CPU has kernel `k`'s instruction set (F16C included:
        // `Kernel::available`).
        Kernel::Avx512Vnni => unsafe { rows_into_avx512(f, &row, x, &mut out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above.
        Kernel::Avx2 => unsafe { rows_into_avx2(f, &row, x, &mut out) },
        _ => rows_into(f, &row, x, &mut out, block_scales),
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
