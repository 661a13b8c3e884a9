//! Decode attention over an f16 history with AVX and F16C: one query of one head, keys and
//! values widened in registers as they are read (`vcvtph2ps`) instead of a chunk at a time
//! into a buffer, with a software prefetch running ahead of both streams.
//!
//! At long contexts decoding reads more history than weights (OLMoE-1B-7B at 1k positions:
//! 136 MB a token of f16 keys and values against 663 MB of int4 weights), and the buffered
//! path read it at 7-9 GB/s on one thread. The arithmetic is exactly [`super::attend`]'s
//! (the same eight partial sums per dot, summed in the same order; the weighted sum in position
//! order, product then sum), so the bits are the same as every other attention path.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::f16;

use super::rows::{lane_sums, DOTS};
use crate::ops::softmax;

/// How far ahead of the reads the history is prefetched (one group of four 128-dim rows:
/// measured best of 0.5-16 KiB, +3% over the hardware prefetcher alone).
const AHEAD_BYTES: usize = 1024;

/// Whether [`attend_one`] serves this head size on this CPU.
pub fn supported(head_dim: usize) -> bool {
    (head_dim == 64 || head_dim == 128)
        && std::arch::is_x86_feature_detected!("avx")
        && std::arch::is_x86_feature_detected!("f16c")
}

/// `out` = softmax(`q . keys[p] * scale` over `p < n`) weighted sum of `values[p]`: the
/// attention of one query over `n` positions of an f16 history (`n * head_dim` values each).
///
/// # Panics
/// If [`supported`] is false for `q.len()`, or a length disagrees.
pub fn attend_one(q: &[f32], keys: &[f16], values: &[f16], n: usize, scale: f32, out: &mut [f32]) {
    attend_one_with(q, keys, values, n, scale, out, true)
}

/// [`attend_one`] with the AVX-512 register file if `avx512` and the CPU has it, else without.
fn attend_one_with(
    q: &[f32],
    keys: &[f16],
    values: &[f16],
    n: usize,
    scale: f32,
    out: &mut [f32],
    avx512: bool,
) {
    let hd = q.len();
    assert!(
        supported(hd),
        "attend_one: head_dim {hd} or CPU not supported"
    );
    assert!(n >= 1 && keys.len() >= n * hd && values.len() >= n * hd && out.len() == hd);
    let avx512 = avx512
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512vl");
    // SAFETY: AVX and F16C are present (`supported`), AVX-512 F/VL when `avx512`; the lengths
    // are asserted just above; `hd` is 64 or 128.
    unsafe {
        match (hd, avx512) {
            (64, false) => attend_avx::<8>(q, keys, values, n, scale, out),
            (128, false) => attend_avx::<16>(q, keys, values, n, scale, out),
            (64, true) => attend_avx512::<8>(q, keys, values, n, scale, out),
            _ => attend_avx512::<16>(q, keys, values, n, scale, out),
        }
    }
}

#[target_feature(enable = "avx,f16c")]
unsafe fn attend_avx<const V: usize>(
    q: &[f32],
    keys: &[f16],
    values: &[f16],
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    // SAFETY: forwarded contract.
    unsafe { attend_body::<V>(q, keys, values, n, scale, out) }
}

/// The same code with 32 vector registers (the weighted sum of 128 dims keeps 16 running sums
/// in registers without spilling).
#[target_feature(enable = "avx,f16c,avx512f,avx512vl")]
unsafe fn attend_avx512<const V: usize>(
    q: &[f32],
    keys: &[f16],
    values: &[f16],
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    // SAFETY: forwarded contract.
    unsafe { attend_body::<V>(q, keys, values, n, scale, out) }
}

/// # Safety
/// The CPU has AVX and F16C; `q.len() == out.len() == 8 * V`; `keys` and `values` hold at
/// least `n * 8 * V` values.
#[inline(always)]
unsafe fn attend_body<const V: usize>(
    q: &[f32],
    keys: &[f16],
    values: &[f16],
    n: usize,
    scale: f32,
    out: &mut [f32],
) {
    let hd = 8 * V;
    let row_bytes = hd * 2;
    let mut scores = vec![0.0f32; n];
    // SAFETY (all loads below): row p < n of keys/values spans p*hd..(p+1)*hd, inside the
    // slices (contract); prefetches are hints and cannot fault.
    unsafe {
        let qv: [__m256; V] = std::array::from_fn(|c| _mm256_loadu_ps(q.as_ptr().add(c * 8)));
        let kbase = keys.as_ptr().cast::<u8>();
        let mut p = 0;
        while p + DOTS <= n {
            prefetch(
                kbase,
                p * row_bytes + AHEAD_BYTES,
                DOTS * row_bytes,
                n * row_bytes,
            );
            let rows: [*const f16; DOTS] = std::array::from_fn(|r| keys.as_ptr().add((p + r) * hd));
            let d = dots::<DOTS, V>(&qv, rows);
            for (s, d) in scores[p..p + DOTS].iter_mut().zip(d) {
                *s = d * scale;
            }
            p += DOTS;
        }
        while p < n {
            let [d] = dots::<1, V>(&qv, [keys.as_ptr().add(p * hd)]);
            scores[p] = d * scale;
            p += 1;
        }
        softmax(&mut scores);
        let vbase = values.as_ptr().cast::<u8>();
        let mut acc = [_mm256_setzero_ps(); V];
        for (p, &w) in scores.iter().enumerate() {
            if p % DOTS == 0 {
                prefetch(
                    vbase,
                    p * row_bytes + AHEAD_BYTES,
                    DOTS * row_bytes,
                    n * row_bytes,
                );
            }
            let row = values.as_ptr().add(p * hd);
            let wv = _mm256_set1_ps(w);
            for (i, acc) in acc.iter_mut().enumerate() {
                let v = _mm256_cvtph_ps(_mm_loadu_si128(row.add(i * 8).cast()));
                *acc = _mm256_add_ps(*acc, _mm256_mul_ps(wv, v));
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            _mm256_storeu_ps(out.as_mut_ptr().add(i * 8), *acc);
        }
    }
}

/// Prefetches `[from, from + len)` of a stream of `total` bytes at `base`, the part inside it.
#[inline(always)]
fn prefetch(base: *const u8, from: usize, len: usize, total: usize) {
    let end = (from + len).min(total);
    let mut off = from;
    while off < end {
        // SAFETY: a prefetch is a hint: it reads nothing architecturally and cannot fault;
        // the address is inside the stream anyway (off < total).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off).cast()) };
        off += 64;
    }
}

/// `dot(q, row r)` for `R` rows of `8 * V` f16 values: lane `j` of each sum is partial sum `j`
/// of `ops::dot` (product, then sum, chunk by chunk), and the lanes are summed in order, so the
/// bits are `ops::dot`'s on the widened rows.
///
/// # Safety
/// The CPU has AVX and F16C; every row holds `8 * V` readable values.
#[inline(always)]
unsafe fn dots<const R: usize, const V: usize>(q: &[__m256; V], rows: [*const f16; R]) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    for (c, x) in q.iter().enumerate() {
        for (acc, row) in acc.iter_mut().zip(&rows) {
            // SAFETY: c * 8 + 8 <= 8 * V values of the row (contract); unaligned load.
            let y = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(row.add(c * 8).cast())) };
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(*x, y));
        }
    }
    // SAFETY: the CPU has AVX (contract).
    unsafe { lane_sums(&acc) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{attend, AttendArgs, HeadRows};

    fn wave(i: usize) -> f32 {
        ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.7
    }

    /// Every path of `attention::attend` on the f32 widening of the same history (a block of one
    /// query over f32 rows takes the buffered path, not this module).
    #[test]
    fn fused_f16_decode_gives_the_buffered_paths_bits() {
        for hd in [64, 128] {
            if !supported(hd) {
                return;
            }
            // Around the four-position groups, the 32-position chunks and the prefetch reach.
            for n in [1, 2, 3, 4, 5, 31, 32, 33, 64, 77, 130, 515] {
                let k16: Vec<f16> = (0..n * hd).map(|i| f16::from_f32(wave(i * 3))).collect();
                let v16: Vec<f16> = (0..n * hd).map(|i| f16::from_f32(wave(i + 11))).collect();
                let k32: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
                let v32: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
                let q: Vec<f32> = (0..hd).map(|i| wave(i * 13)).collect();
                let mut want = vec![0.0; hd];
                let a = AttendArgs {
                    keys: HeadRows::F32(&k32),
                    values: HeadRows::F32(&v32),
                    n0: n,
                    scale: 0.125,
                };
                attend(&[&q], &a, &mut want);
                for avx512 in [false, true] {
                    let mut got = vec![f32::NAN; hd];
                    attend_one_with(&q, &k16, &v16, n, 0.125, &mut got, avx512);
                    assert_eq!(got, want, "hd {hd} n {n} avx512 {avx512}");
                }
            }
        }
    }
}
