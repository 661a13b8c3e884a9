//! Attention over a KV history: consecutive query positions of one head (or of several heads
//! that read the same history, `AttendArgs::share` per position) attending causally over its
//! kv head's keys and values (f32 or f16 rows). One kernel (`flash.rs`: tiles of the
//! history, online softmax), written over sixteen-lane vectors (`lanes.rs`) and compiled for
//! AVX-512, AVX2 + FMA and plain Rust, chosen at run time; every path gives the same bits, and
//! a query gives the same bits in a prefill block as decoding alone.

mod flash;
mod lanes;

/// A kv head's history: `n` rows of `dim` values, one per position, contiguous.
#[derive(Clone, Copy)]
pub enum HeadRows<'a> {
    F32(&'a [f32]),
    /// Half the bytes to stream; widened to f32 exactly, so the arithmetic is the f32 path's
    /// on the rounded values.
    F16(&'a [half::f16]),
}

/// What a block of query positions of one head attends over: its kv head's history.
pub struct AttendArgs<'a> {
    pub keys: HeadRows<'a>,
    pub values: HeadRows<'a>,
    /// Positions the first query of the block sees (at least 1); query `j` sees
    /// `n0 + j / share`.
    pub n0: usize,
    /// Consecutive queries at one position: heads that read the same history (GQA's group,
    /// every head of MLA) attend together, so its rows are read (and widened) once for all of
    /// them. 1 for one head's block of positions.
    pub share: usize,
    pub scale: f32,
}

/// The compiled forms of the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Kernel {
    /// The fastest form this CPU runs.
    pub fn best() -> Kernel {
        Kernel::available().pop().unwrap_or(Kernel::Portable)
    }

    /// Every form this CPU runs, slowest first.
    pub fn available() -> Vec<Kernel> {
        let mut k = vec![Kernel::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                k.push(Kernel::Avx2);
                if has!("avx512f") {
                    k.push(Kernel::Avx512);
                }
            }
        }
        k
    }
}

/// Consecutive query positions (of one head, or of `a.share` heads per position) attending
/// causally over one kv head: query `j` (`qs[j]`, the key size each) sees the first
/// `a.n0 + j / a.share` positions, and `out[j * vd..]`
/// receives the softmax-weighted sum of their values (`vd = out.len() / qs.len()`, the value
/// size, which may differ from the key size).
pub fn attend(qs: &[&[f32]], a: &AttendArgs, out: &mut [f32]) {
    attend_on(Kernel::best(), qs, a, out)
}

/// [`attend`] with a chosen form of the kernel.
///
/// # Panics
/// If this CPU cannot run `kernel` (see [`Kernel::available`]), or the shapes disagree.
pub fn attend_on(kernel: Kernel, qs: &[&[f32]], a: &AttendArgs, out: &mut [f32]) {
    assert!(
        Kernel::available().contains(&kernel),
        "{kernel:?} not on this CPU"
    );
    match kernel {
        // SAFETY: the plain form needs no CPU feature.
        Kernel::Portable => unsafe { flash::attend_tiles::<lanes::Portable>(qs, a, out) },
        // SAFETY: the CPU has the form's features (asserted above).
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx2 => unsafe { attend_avx2(qs, a, out) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Kernel::Avx512 => unsafe { attend_avx512(qs, a, out) },
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn attend_avx512(qs: &[&[f32]], a: &AttendArgs, out: &mut [f32]) {
    // SAFETY: the CPU has the features enabled here (the caller checked).
    unsafe { flash::attend_tiles::<lanes::Avx512>(qs, a, out) }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(qs: &[&[f32]], a: &AttendArgs, out: &mut [f32]) {
    // SAFETY: as above.
    unsafe { flash::attend_tiles::<lanes::Avx2>(qs, a, out) }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            share: 1,
            scale: 0.2,
        };
        attend(&[q], &a, &mut out);
        out
    }

    /// Every form of the kernel this CPU runs gives the portable form's bits.
    fn assert_kernels_agree(qs: &[&[f32]], a: &AttendArgs, vd: usize) -> Vec<f32> {
        let mut want = vec![f32::NAN; qs.len() * vd];
        attend_on(Kernel::Portable, qs, a, &mut want);
        for k in Kernel::available() {
            let mut got = vec![f32::NAN; qs.len() * vd];
            attend_on(k, qs, a, &mut got);
            assert_eq!(got, want, "{k:?}: kd {} vd {vd} n0 {}", qs[0].len(), a.n0);
        }
        want
    }

    #[test]
    fn attending_over_identical_values_gives_those_values() {
        let (n, hd) = (37, 24);
        let keys: Vec<f32> = (0..n * hd).map(wave).collect();
        let q: Vec<f32> = (0..hd).map(|i| wave(i * 13)).collect();
        // The weights sum to one.
        let same: Vec<f32> = (0..n * hd).map(|i| wave(i % hd)).collect();
        let o = attend_one(&q, HeadRows::F32(&keys), HeadRows::F32(&same), n);
        for (d, v) in o.iter().enumerate() {
            assert!((v - wave(d)).abs() < 1e-5, "dim {d}: {v} vs {}", wave(d));
        }
    }

    #[test]
    fn every_kernel_gives_the_same_bits() {
        use half::f16;
        // Head sizes with and without a tail past the sixteen lanes, key and value sizes apart
        // (MLA), histories around the tile and the four-key groups, blocks of 1 to 5.
        for (kd, vd) in [(24, 24), (64, 64), (128, 128), (192, 128), (40, 72)] {
            for n in [1, 5, 31, 32, 33, 77, 130] {
                let keys: Vec<f32> = (0..n * kd).map(|i| wave(i * 3)).collect();
                let values: Vec<f32> = (0..n * vd).map(|i| wave(i + 11)).collect();
                let k16: Vec<f16> = keys.iter().map(|&x| f16::from_f32(x)).collect();
                let v16: Vec<f16> = values.iter().map(|&x| f16::from_f32(x)).collect();
                let queries: Vec<Vec<f32>> = (0..5)
                    .map(|j| (0..kd).map(|i| wave(i * 13 + j * 29)).collect())
                    .collect();
                for b in [1, 2, 5] {
                    let b = b.min(n);
                    let qs: Vec<&[f32]> = queries[..b].iter().map(|q| q.as_slice()).collect();
                    for f16_rows in [false, true] {
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
                            n0: n + 1 - b,
                            share: 1,
                            scale: 0.125,
                        };
                        assert_kernels_agree(&qs, &a, vd);
                    }
                }
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
        let vd = values.len() / n.max(1);
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
        (0..vd)
            .map(|d| {
                (0..n)
                    .map(|p| w[p] * values[p * vd + d] as f64)
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
            // MLA's shape: keys of 192, values of 128.
            let vd = if hd == 192 { 128 } else { hd };
            let keys = draw(n * hd, 1.0);
            let values = draw(n * vd, 1.0);
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
                    share: 1,
                    scale,
                };
                let qs: Vec<&[f32]> = queries.chunks_exact(hd).collect();
                let mut out = vec![f32::NAN; b * vd];
                attend(&qs, &a, &mut out);
                for (j, q) in qs.iter().enumerate() {
                    let seen = n0 + j;
                    let want = reference(q, &kr, &vr[..seen * vd], seen, scale);
                    let peak = want.iter().fold(1e-30f64, |m, x| m.max(x.abs()));
                    for (d, w) in want.iter().enumerate() {
                        let err = (out[j * vd + d] as f64 - w).abs() / peak;
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
                    share: 1,
                    scale: 0.2,
                };
                let out = assert_kernels_agree(&qs, &a, hd);
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

    /// Heads sharing one history (`share` queries per position, GQA's group or every head of
    /// MLA, whose values are its keys' own rows) give each query the bits it gets alone, on
    /// every kernel, f32 and f16 rows, for one position (decode) and a block of positions.
    #[test]
    fn heads_sharing_a_history_attend_as_each_alone() {
        use half::f16;
        let hd = 40;
        let total = 100;
        let k32: Vec<f32> = (0..total * hd).map(|i| wave(i * 3 + 1)).collect();
        let v32: Vec<f32> = (0..total * hd).map(|i| wave(i + 11)).collect();
        let k16: Vec<f16> = k32.iter().map(|&x| f16::from_f32(x)).collect();
        let v16: Vec<f16> = v32.iter().map(|&x| f16::from_f32(x)).collect();
        let queries: Vec<Vec<f32>> = (0..48)
            .map(|j| (0..hd).map(|i| wave(i * 17 + j * 53)).collect())
            .collect();
        for (n0, positions, share) in [(1, 1, 16), (33, 1, 8), (64, 1, 3), (30, 3, 4), (95, 2, 5)] {
            for f16_rows in [false, true] {
                // Values that are the keys' own rows, and values of their own.
                for own_values in [false, true] {
                    let rows = |n: usize, v: bool| match (f16_rows, v && own_values) {
                        (true, true) => HeadRows::F16(&v16[..n * hd]),
                        (true, false) => HeadRows::F16(&k16[..n * hd]),
                        (false, true) => HeadRows::F32(&v32[..n * hd]),
                        (false, false) => HeadRows::F32(&k32[..n * hd]),
                    };
                    let b = positions * share;
                    let last = n0 + positions - 1;
                    let qs: Vec<&[f32]> = queries[..b].iter().map(|q| q.as_slice()).collect();
                    let a = AttendArgs {
                        keys: rows(last, false),
                        values: rows(last, true),
                        n0,
                        share,
                        scale: 0.2,
                    };
                    let out = assert_kernels_agree(&qs, &a, hd);
                    for (j, q) in qs.iter().enumerate() {
                        let n = n0 + j / share;
                        let alone = attend_one(q, rows(n, false), rows(n, true), n);
                        assert_eq!(
                            &out[j * hd..(j + 1) * hd],
                            alone,
                            "n0 {n0} share {share} j {j} f16 {f16_rows} own values {own_values}"
                        );
                    }
                }
            }
        }
    }
}
