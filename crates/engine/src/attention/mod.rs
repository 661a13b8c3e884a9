//! Attention over a KV history: consecutive query positions of one head attending causally
//! over its kv head's keys and values (f32 or f16 rows). `attend` picks the path: the fused
//! f16 decode (`f16_decode.rs`: one query, widened in registers) or the buffered block path
//! here (chunks of rows read once for every query of a block; AVX2 / AVX-512 / portable), whose
//! dot products and weighted sums are in `rows.rs`. Every path gives the same bits.

mod f16_decode;
mod rows;

use std::ops::Range;

#[cfg(target_arch = "x86_64")]
use crate::ops::widen_checked;
use crate::ops::{softmax, widen_portable};
use rows::{accumulate_rows, score_rows, score_rows_pair, Simd};

/// A kv head's history: `n` rows of `head_dim` values, one per position, contiguous.
#[derive(Clone, Copy)]
pub enum HeadRows<'a> {
    F32(&'a [f32]),
    /// Half the bytes to stream; widened to f32 a chunk at a time (exactly), so the arithmetic
    /// is the f32 path's on the rounded values.
    F16(&'a [half::f16]),
}

/// What a block of query positions of one head attends over: its kv head's history.
pub struct AttendArgs<'a> {
    pub keys: HeadRows<'a>,
    pub values: HeadRows<'a>,
    /// Positions the first query of the block sees (at least 1); query `j` sees `n0 + j`.
    pub n0: usize,
    pub scale: f32,
}

/// Positions read (and widened from f16) at a time: 16 KiB of f32 at head_dim 128, so a chunk
/// stays in L1 while every query of a block uses it.
const CHUNK: usize = 32;

/// Consecutive query positions of one head attending causally over its kv head: query `j`
/// (`qs[j]`, `head_dim` values) sees the first `a.n0 + j` positions, and `out[j * head_dim..]`
/// receives the softmax-weighted sum of their values.
///
/// Each key and value chunk is read (and widened) once for the whole block instead of once per
/// query, which is what makes long prompts cheaper. Every query's arithmetic is the same as on
/// its own (the same chunks, the same four-position groups, the same order), so a query gives
/// the same bits in any block, and prefill agrees with decode bit for bit.
///
/// Compiled three times (plain x86-64, AVX2+FMA, AVX-512) and chosen at run time. The AVX2 and
/// AVX-512 paths compute the dot products and the weighted sum with explicit AVX vectors (see
/// [`Simd`]), the plain one in portable Rust: the same arithmetic in the same order, so every
/// path gives the same bits.
pub fn attend(qs: &[&[f32]], a: &AttendArgs, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // Decode over an f16 history: widened in registers, nothing to share between queries.
        if let ([q], HeadRows::F16(keys), HeadRows::F16(values)) = (qs, a.keys, a.values) {
            if f16_decode::supported(q.len()) {
                return f16_decode::attend_one(q, keys, values, a.n0, a.scale, out);
            }
        }
        let f16c = std::arch::is_x86_feature_detected!("f16c");
        if std::arch::is_x86_feature_detected!("avx512f") && f16c {
            // SAFETY: the CPU has AVX-512F and F16C (checked just above).
            return unsafe { attend_avx512(qs, a, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && f16c
        {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
            return unsafe { attend_avx2(qs, a, out) };
        }
    }
    attend_generic(qs, a, out, widen_portable, Simd::Portable)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn attend_avx512(qs: &[&[f32]], a: &AttendArgs, out: &mut [f32]) {
    attend_generic(qs, a, out, widen_checked, Simd::Avx)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(qs: &[&[f32]], a: &AttendArgs, out: &mut [f32]) {
    attend_generic(qs, a, out, widen_checked, Simd::Avx)
}

/// Rows `rows` of a head's history as f32: borrowed, or widened into `wide`.
#[inline(always)]
fn chunk_rows<'a>(
    src: HeadRows<'a>,
    rows: Range<usize>,
    wide: &'a mut [f32],
    widen: fn(&[half::f16], &mut [f32]),
) -> &'a [f32] {
    match src {
        HeadRows::F32(x) => &x[rows],
        HeadRows::F16(x) => {
            let wide = &mut wide[..rows.len()];
            widen(&x[rows], wide);
            wide
        }
    }
}

#[inline(always)]
fn attend_generic(
    qs: &[&[f32]],
    a: &AttendArgs,
    out: &mut [f32],
    widen: fn(&[half::f16], &mut [f32]),
    simd: Simd,
) {
    let Some(q0) = qs.first() else { return };
    let hd = q0.len();
    debug_assert!(a.n0 >= 1 && out.len() == qs.len() * hd);
    let seen = |j: usize| a.n0 + j;
    let last = seen(qs.len() - 1);
    let mut scores: Vec<Vec<f32>> = (0..qs.len()).map(|j| vec![0.0f32; seen(j)]).collect();
    let mut wide = vec![0.0f32; CHUNK * hd];
    out.fill(0.0);
    for lo in (0..last).step_by(CHUNK) {
        let hi = (lo + CHUNK).min(last);
        let keys = chunk_rows(a.keys, lo * hd..hi * hd, &mut wide, widen);
        // Two queries at a time where both see the whole chunk (every key row loaded once for
        // both); each query's dot products are the same arithmetic either way.
        let mut j = 0;
        while j < qs.len() {
            if j + 1 < qs.len() && scores[j].len() >= hi {
                let (first, rest) = scores.split_at_mut(j + 1);
                let pair = [&mut first[j][lo..hi], &mut rest[0][lo..hi]];
                score_rows_pair([qs[j], qs[j + 1]], keys, a.scale, pair, simd);
                j += 2;
                continue;
            }
            let s = &mut scores[j];
            let top = hi.min(s.len());
            if top > lo {
                score_rows(
                    qs[j],
                    &keys[..(top - lo) * hd],
                    a.scale,
                    &mut s[lo..top],
                    simd,
                );
            }
            j += 1;
        }
    }
    for s in scores.iter_mut() {
        softmax(s);
    }
    for lo in (0..last).step_by(CHUNK) {
        let hi = (lo + CHUNK).min(last);
        let values = chunk_rows(a.values, lo * hd..hi * hd, &mut wide, widen);
        for (s, o) in scores.iter().zip(out.chunks_exact_mut(hd)) {
            let top = hi.min(s.len());
            if top > lo {
                accumulate_rows(&s[lo..top], &values[..(top - lo) * hd], o, simd);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::widen_portable;

    /// Deterministic test values in [-0.7, 0.7).
    pub(super) fn wave(i: usize) -> f32 {
        ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.7
    }

    /// One query on its own: `attend` with a block of one.
    fn attend_one(q: &[f32], keys: HeadRows, values: HeadRows, n: usize) -> Vec<f32> {
        let mut out = vec![0.0; q.len()];
        let a = AttendArgs {
            keys,
            values,
            n0: n,
            scale: 0.2,
        };
        attend(&[q], &a, &mut out);
        out
    }

    /// `attend` (the path this CPU takes) against the portable path, bit for bit.
    fn assert_paths_agree(keys: &[f32], values: &[f32], q: &[f32], n: usize, scale: f32) {
        let a = AttendArgs {
            keys: HeadRows::F32(keys),
            values: HeadRows::F32(values),
            n0: n,
            scale,
        };
        let (mut o1, mut o2) = (vec![0.0; q.len()], vec![0.0; q.len()]);
        attend(&[q], &a, &mut o1);
        attend_generic(&[q], &a, &mut o2, widen_portable, Simd::Portable);
        assert_eq!(o1, o2, "hd {} n {n}", q.len());
    }

    #[test]
    fn attend_paths_give_identical_bits() {
        let (n, hd) = (37, 24);
        let keys: Vec<f32> = (0..n * hd).map(wave).collect();
        let values: Vec<f32> = (0..n * hd).map(|i| wave(i + 3)).collect();
        let q: Vec<f32> = (0..hd).map(|i| wave(i * 13)).collect();
        assert_paths_agree(&keys, &values, &q, n, 0.2);
        // Attending over identical values gives those values (the weights sum to one).
        let same: Vec<f32> = (0..n * hd).map(|i| wave(i % hd)).collect();
        let o = attend_one(&q, HeadRows::F32(&keys), HeadRows::F32(&same), n);
        for (d, v) in o.iter().enumerate() {
            assert!((v - wave(d)).abs() < 1e-5, "dim {d}: {v} vs {}", wave(d));
        }
    }

    #[test]
    fn vector_and_portable_attention_agree_bit_for_bit_at_real_head_sizes() {
        // 64 and 128 take the register-resident weighted sum; 24 the general one.
        for hd in [24, 64, 128] {
            for n in [1, 5, 32, 77] {
                let keys: Vec<f32> = (0..n * hd).map(|i| wave(i * 3)).collect();
                let values: Vec<f32> = (0..n * hd).map(|i| wave(i + 11)).collect();
                let q: Vec<f32> = (0..hd).map(|i| wave(i * 13)).collect();
                assert_paths_agree(&keys, &values, &q, n, 0.125);
            }
        }
    }

    #[test]
    fn f16_rows_attend_exactly_as_their_f32_widening() {
        use half::f16;
        let hd = 24;
        let q: Vec<f32> = (0..hd).map(|i| wave(i * 13)).collect();
        // Lengths around the chunk and the four-position groups.
        for n in [1, 3, 31, 32, 33, 70, 130] {
            let k16: Vec<f16> = (0..n * hd).map(|i| f16::from_f32(wave(i))).collect();
            let v16: Vec<f16> = (0..n * hd).map(|i| f16::from_f32(wave(i + 3))).collect();
            let k32: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
            let v32: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
            let o1 = attend_one(&q, HeadRows::F16(&k16), HeadRows::F16(&v16), n);
            let o2 = attend_one(&q, HeadRows::F32(&k32), HeadRows::F32(&v32), n);
            assert_eq!(o1, o2, "n {n}");
        }
    }

    /// At the general head size and at the two with register-resident weighted sums.
    /// Causal softmax attention in f64, one query at a time: the reference.
    fn reference(q: &[f32], keys: &[f32], values: &[f32], n: usize, scale: f32) -> Vec<f64> {
        let hd = q.len();
        let scores: Vec<f64> = (0..n)
            .map(|p| {
                let k = &keys[p * hd..(p + 1) * hd];
                q.iter()
                    .zip(k)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>()
                    * scale as f64
            })
            .collect();
        let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
        let total: f64 = w.iter().sum();
        (0..hd)
            .map(|d| {
                (0..n)
                    .map(|p| w[p] * values[p * hd + d] as f64)
                    .sum::<f64>()
                    / total
            })
            .collect()
    }

    /// Random shapes against the f64 reference: histories of 1 to 3000 positions, head sizes
    /// 64/96/128/192 (and an odd one), blocks of 1 to 16 queries at any offset, f32 and f16
    /// rows, scores up to ~±8 before the softmax. Every output stays within 2e-5 of the
    /// reference's largest value (measured worst 2.7e-6; printed with `--nocapture`).
    #[test]
    fn attention_matches_an_f64_reference_on_random_shapes() {
        use half::f16;
        use rand::{RngExt, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(0xa77e);
        let mut worst = 0.0f64;
        for case in 0..40 {
            let hd = [64, 96, 128, 192, 40][case % 5];
            let n = if case % 4 == 0 {
                rng.random_range(1..=3000)
            } else {
                rng.random_range(1..=300)
            };
            let b = rng.random_range(1..=16usize).min(n);
            let n0 = n + 1 - b; // the block's last query sees all n positions
            let mut draw = |len: usize, amp: f32| -> Vec<f32> {
                (0..len).map(|_| rng.random_range(-amp..amp)).collect()
            };
            let keys = draw(n * hd, 1.0);
            let values = draw(n * hd, 1.0);
            let queries = draw(b * hd, 1.0);
            let scale = 8.0 / (hd as f32).sqrt() / 4.0;
            for f16_rows in [false, true] {
                let (k16, v16): (Vec<f16>, Vec<f16>) = (
                    keys.iter().map(|&x| f16::from_f32(x)).collect(),
                    values.iter().map(|&x| f16::from_f32(x)).collect(),
                );
                // The reference sees what the kernel sees: f16 rows widen exactly.
                let (kr, vr): (Vec<f32>, Vec<f32>) = if f16_rows {
                    (
                        k16.iter().map(|x| x.to_f32()).collect(),
                        v16.iter().map(|x| x.to_f32()).collect(),
                    )
                } else {
                    (keys.clone(), values.clone())
                };
                let a = AttendArgs {
                    keys: if f16_rows {
                        HeadRows::F16(&k16)
                    } else {
                        HeadRows::F32(&keys)
                    },
                    values: if f16_rows {
                        HeadRows::F16(&v16)
                    } else {
                        HeadRows::F32(&values)
                    },
                    n0,
                    scale,
                };
                let qs: Vec<&[f32]> = queries.chunks_exact(hd).collect();
                let mut out = vec![f32::NAN; b * hd];
                attend(&qs, &a, &mut out);
                for (j, q) in qs.iter().enumerate() {
                    let want = reference(q, &kr, &vr, n0 + j, scale);
                    let peak = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
                    for (d, w) in want.iter().enumerate() {
                        let err = (out[j * hd + d] as f64 - w).abs() / peak;
                        worst = worst.max(err);
                        assert!(
                            err < 2e-5,
                            "hd {hd} n {n} block {b} query {j} dim {d}: {err}"
                        );
                    }
                }
            }
        }
        println!("attention vs f64 reference: worst relative error {worst:.2e}");
    }

    #[test]
    fn a_block_of_queries_gives_each_query_its_own_bits() {
        for hd in [20, 64, 128] {
            block_of_queries_gives_each_query_its_own_bits(hd);
        }
    }

    fn block_of_queries_gives_each_query_its_own_bits(hd: usize) {
        use half::f16;
        let total = 140;
        let k32: Vec<f32> = (0..total * hd).map(wave).collect();
        let v32: Vec<f32> = (0..total * hd).map(|i| wave(i + 5)).collect();
        let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v32.iter().map(|&x| f16::from_f32(x)).collect();
        let queries: Vec<Vec<f32>> = (0..12)
            .map(|j| (0..hd).map(|i| wave(i * 13 + j * 71)).collect())
            .collect();
        // Blocks starting before, at and after chunk and four-position boundaries.
        for (n0, b) in [
            (1, 1),
            (1, 12),
            (3, 5),
            (29, 8),
            (31, 2),
            (32, 7),
            (60, 12),
            (128, 12),
        ] {
            for f16_rows in [false, true] {
                let keys = |n: usize| {
                    if f16_rows {
                        HeadRows::F16(&k16[..n * hd])
                    } else {
                        HeadRows::F32(&k32[..n * hd])
                    }
                };
                let values = |n: usize| {
                    if f16_rows {
                        HeadRows::F16(&v16[..n * hd])
                    } else {
                        HeadRows::F32(&v32[..n * hd])
                    }
                };
                let last = n0 + b - 1;
                let qs: Vec<&[f32]> = queries[..b].iter().map(|q| q.as_slice()).collect();
                let a = AttendArgs {
                    keys: keys(last),
                    values: values(last),
                    n0,
                    scale: 0.2,
                };
                let mut out = vec![f32::NAN; b * hd];
                attend(&qs, &a, &mut out);
                let mut portable = vec![f32::NAN; b * hd];
                attend_generic(&qs, &a, &mut portable, widen_portable, Simd::Portable);
                assert_eq!(
                    out, portable,
                    "hd {hd} n0 {n0} b {b}: against the portable path"
                );
                for (j, q) in qs.iter().enumerate() {
                    let n = n0 + j;
                    let alone = attend_one(q, keys(n), values(n), n);
                    assert_eq!(
                        &out[j * hd..(j + 1) * hd],
                        alone,
                        "hd {hd} n0 {n0} b {b} j {j}"
                    );
                }
            }
        }
    }
}
