//! The inner loops of the buffered attention path: scores (four interleaved dot products at a
//! time) and the weighted sum of value rows, in portable Rust or with AVX vectors holding the
//! same partial sums (the same bits); the lane sums the fused f16 decode shares.

use crate::ops::dot;

/// Positions whose scores are computed together in [`super::attend`] (four independent dot
/// products; `f16_decode` groups them the same way).
pub(crate) const DOTS: usize = 4;
/// How many positions ahead [`super::attend`] asks for the key and value rows it will read.
const PREFETCH_AHEAD: usize = 8;

/// `dot(q, k)` for each of `DOTS` rows `k`, interleaved: the same arithmetic per row as
/// [`dot`] (so the same bits), with independent accumulator chains.
#[inline(always)]
fn dots(q: &[f32], k: [&[f32]; DOTS]) -> [f32; DOTS] {
    let mut acc = [[0.0f32; 8]; DOTS];
    let chunks = q.len() / 8;
    for c in 0..chunks {
        for (acc, k) in acc.iter_mut().zip(&k) {
            for j in 0..8 {
                acc[j] += q[c * 8 + j] * k[c * 8 + j];
            }
        }
    }
    std::array::from_fn(|r| {
        let mut s: f32 = acc[r].iter().sum();
        for i in chunks * 8..q.len() {
            s += q[i] * k[r][i];
        }
        s
    })
}

/// Hints the cache to fetch rows `[start, start + len)` of `data` that lie inside it (a hint
/// only: it never changes a result).
#[inline(always)]
fn prefetch_rows(data: &[f32], starts: impl Iterator<Item = usize>, len: usize) {
    #[cfg(target_arch = "x86_64")]
    for start in starts {
        if start + len <= data.len() {
            for off in (0..len).step_by(16) {
                // SAFETY: `start + off < data.len()`, so the pointer is inside `data`; a
                // prefetch reads nothing architecturally and cannot fault.
                unsafe {
                    std::arch::x86_64::_mm_prefetch(
                        data.as_ptr().add(start + off) as *const i8,
                        std::arch::x86_64::_MM_HINT_T0,
                    )
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (data, starts, len);
}

/// How the dot products and weighted sums of [`super::attend`] are computed: plain Rust (which the
/// compiler leaves scalar here), or AVX vectors holding the same eight partial sums, so both
/// give the same bits.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Simd {
    Portable,
    /// Only chosen on CPUs with AVX (the AVX2 and AVX-512 attention paths).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx,
}

/// `scores[p] = dot(q, keys row p) * scale` for the `scores.len()` rows of `keys`.
#[inline(always)]
pub(super) fn score_rows(q: &[f32], keys: &[f32], scale: f32, scores: &mut [f32], simd: Simd) {
    let hd = q.len();
    let row = |p: usize| p * hd;
    // Four positions at a time: four independent dot products keep the FMA units busy and four
    // rows in flight from memory (each position's arithmetic is exactly `dot`'s).
    let mut p = 0;
    while p + DOTS <= scores.len() {
        prefetch_rows(
            keys,
            (p + PREFETCH_AHEAD..p + PREFETCH_AHEAD + DOTS).map(row),
            hd,
        );
        let k: [&[f32]; DOTS] = std::array::from_fn(|r| &keys[row(p + r)..row(p + r) + hd]);
        let d = match simd {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Simd::Avx` is only passed by the attention paths that checked for AVX;
            // every row holds q.len() values.
            Simd::Avx => unsafe { dots_avx(q, k) },
            _ => dots(q, k),
        };
        for (s, d) in scores[p..p + DOTS].iter_mut().zip(d) {
            *s = d * scale;
        }
        p += DOTS;
    }
    for (s, p) in scores[p..].iter_mut().zip(p..) {
        *s = dot(q, &keys[row(p)..row(p) + hd]) * scale;
    }
}

/// [`score_rows`] for two queries over the same rows: each key row is loaded once for both
/// (with AVX); every score is the same arithmetic as [`score_rows`]'s, so the same bits.
#[inline(always)]
pub(super) fn score_rows_pair(
    q: [&[f32]; 2],
    keys: &[f32],
    scale: f32,
    scores: [&mut [f32]; 2],
    simd: Simd,
) {
    let [s0, s1] = scores;
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx && q[0].len() == q[1].len() && s0.len() == s1.len() {
        let hd = q[0].len();
        let row = |p: usize| p * hd;
        let mut p = 0;
        while p + DOTS <= s0.len() {
            prefetch_rows(
                keys,
                (p + PREFETCH_AHEAD..p + PREFETCH_AHEAD + DOTS).map(row),
                hd,
            );
            let k: [&[f32]; DOTS] = std::array::from_fn(|r| &keys[row(p + r)..row(p + r) + hd]);
            // SAFETY: `Simd::Avx` is only passed by the attention paths that checked for AVX;
            // every row holds hd values.
            let [d0, d1] = unsafe { dots_avx_pair(q, k) };
            for ((a, b), (x, y)) in s0[p..p + DOTS]
                .iter_mut()
                .zip(s1[p..p + DOTS].iter_mut())
                .zip(d0.into_iter().zip(d1))
            {
                *a = x * scale;
                *b = y * scale;
            }
            p += DOTS;
        }
        for p in p..s0.len() {
            s0[p] = dot(q[0], &keys[row(p)..row(p) + hd]) * scale;
            s1[p] = dot(q[1], &keys[row(p)..row(p) + hd]) * scale;
        }
        return;
    }
    let n = s0.len() * q[0].len();
    score_rows(q[0], &keys[..n], scale, s0, simd);
    let n = s1.len() * q[1].len();
    score_rows(q[1], &keys[..n], scale, s1, simd);
}

/// `out += weights[p] * values row p`, in position order.
#[inline(always)]
pub(super) fn accumulate_rows(weights: &[f32], values: &[f32], out: &mut [f32], simd: Simd) {
    debug_assert!(values.len() >= weights.len() * out.len());
    #[cfg(target_arch = "x86_64")]
    if simd == Simd::Avx {
        // SAFETY: `Simd::Avx` is only passed by the attention paths that checked for AVX;
        // `accumulate_rows_avx` checks the lengths itself.
        match out.len() {
            64 => return unsafe { accumulate_rows_avx::<8>(weights, values, out) },
            128 => return unsafe { accumulate_rows_avx::<16>(weights, values, out) },
            _ => {}
        }
    }
    let _ = simd;
    accumulate_rows_any(weights, values, out)
}

/// [`dots`] with AVX: lane `j` of each vector is partial sum `j` (product, then sum, as
/// there), and the lanes are summed in the same order, so the bits are [`dot`]'s.
///
/// # Safety
/// The CPU has AVX; every `k[r]` holds at least `q.len()` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn dots_avx(q: &[f32], k: [&[f32]; DOTS]) -> [f32; DOTS] {
    use std::arch::x86_64::*;
    let chunks = q.len() / 8;
    assert!(k.iter().all(|k| k.len() >= q.len()));
    let mut acc = [_mm256_setzero_ps(); DOTS];
    for c in 0..chunks {
        // SAFETY: c * 8 + 8 <= q.len() <= k[r].len(); unaligned loads.
        let x = unsafe { _mm256_loadu_ps(q.as_ptr().add(c * 8)) };
        for (acc, k) in acc.iter_mut().zip(&k) {
            // SAFETY: as above.
            let y = unsafe { _mm256_loadu_ps(k.as_ptr().add(c * 8)) };
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(x, y));
        }
    }
    // SAFETY: the CPU has AVX (contract).
    let mut sums = unsafe { lane_sums(&acc) };
    for (s, k) in sums.iter_mut().zip(&k) {
        for i in chunks * 8..q.len() {
            *s += q[i] * k[i];
        }
    }
    sums
}

/// [`dots_avx`] for two queries against the same `DOTS` rows, each key vector loaded once:
/// per query the same products, sums and lane order, so the same bits.
///
/// # Safety
/// The CPU has AVX; both queries have the same length and every `k[r]` holds that many values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn dots_avx_pair(q: [&[f32]; 2], k: [&[f32]; DOTS]) -> [[f32; DOTS]; 2] {
    use std::arch::x86_64::*;
    let hd = q[0].len();
    let chunks = hd / 8;
    assert!(q[1].len() == hd && k.iter().all(|k| k.len() >= hd));
    let mut acc = [[_mm256_setzero_ps(); DOTS]; 2];
    for c in 0..chunks {
        // SAFETY: c * 8 + 8 <= hd <= k[r].len() and q[i].len(); unaligned loads.
        let y: [__m256; DOTS] =
            std::array::from_fn(|r| unsafe { _mm256_loadu_ps(k[r].as_ptr().add(c * 8)) });
        for (acc, q) in acc.iter_mut().zip(&q) {
            // SAFETY: as above.
            let x = unsafe { _mm256_loadu_ps(q.as_ptr().add(c * 8)) };
            for (a, y) in acc.iter_mut().zip(&y) {
                *a = _mm256_add_ps(*a, _mm256_mul_ps(x, *y));
            }
        }
    }
    std::array::from_fn(|i| {
        // SAFETY: the CPU has AVX (contract).
        let mut sums = unsafe { lane_sums(&acc[i]) };
        for (s, k) in sums.iter_mut().zip(&k) {
            for d in chunks * 8..hd {
                *s += q[i][d] * k[d];
            }
        }
        sums
    })
}

/// Each vector's eight lanes summed in lane order, `((l0 + l1) + l2) + ... + l7`: the bits of
/// `lanes.iter().sum()` (whose fold starts at -0.0, and `-0.0 + x` is exactly `x`). Four
/// vectors are transposed so that their sums run side by side, four lanes at a time, instead
/// of one shuffle-and-add chain per vector (prompt attention +4%, decode attention over an
/// L2-resident history +10-30%, from DRAM level, on Zen 4). Other counts sum one by one.
///
/// # Safety
/// The CPU has AVX.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
#[inline]
pub(crate) unsafe fn lane_sums<const R: usize>(acc: &[std::arch::x86_64::__m256; R]) -> [f32; R] {
    use std::arch::x86_64::*;
    let mut out = [0.0f32; R];
    if R != 4 {
        for (o, a) in out.iter_mut().zip(acc) {
            let mut lanes = [0.0f32; 8];
            // SAFETY: `lanes` has room for 8 floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
            *o = lanes.iter().sum();
        }
        return out;
    }
    // Rows 0-1 and 2-3 interleaved, then u[j]: lane j (low half) and lane j + 4 (high half)
    // of the four rows.
    let (t0, t1) = (
        _mm256_unpacklo_ps(acc[0], acc[1]),
        _mm256_unpackhi_ps(acc[0], acc[1]),
    );
    let (t2, t3) = (
        _mm256_unpacklo_ps(acc[2], acc[3]),
        _mm256_unpackhi_ps(acc[2], acc[3]),
    );
    let u = [
        _mm256_shuffle_ps::<0x44>(t0, t2),
        _mm256_shuffle_ps::<0xEE>(t0, t2),
        _mm256_shuffle_ps::<0x44>(t1, t3),
        _mm256_shuffle_ps::<0xEE>(t1, t3),
    ];
    let mut s = _mm256_castps256_ps128(u[0]);
    for u in &u[1..] {
        s = _mm_add_ps(s, _mm256_castps256_ps128(*u));
    }
    for u in &u {
        s = _mm_add_ps(s, _mm256_extractf128_ps::<1>(*u));
    }
    // SAFETY: R == 4 here, so `out` has room for the 4 floats.
    unsafe { _mm_storeu_ps(out.as_mut_ptr(), s) };
    out
}

/// [`accumulate_rows`] for a head of `8 * V` values with AVX: the running sums stay in `V`
/// registers across positions (product, then sum, in position order: the same bits).
///
/// # Safety
/// The CPU has AVX; `out.len() == 8 * V`; `values` holds `weights.len()` rows of `8 * V`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn accumulate_rows_avx<const V: usize>(weights: &[f32], values: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    let hd = 8 * V;
    assert!(out.len() == hd && values.len() >= weights.len() * hd);
    // SAFETY (all loads and stores below): `out` holds hd values and row p of `values` the hd
    // values from p * hd (asserted just above); unaligned accesses.
    let mut acc: [__m256; V] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_ps(out.as_ptr().add(i * 8)) });
    for (p, &w) in weights.iter().enumerate() {
        let row = unsafe { values.as_ptr().add(p * hd) };
        let wv = _mm256_set1_ps(w);
        for (i, acc) in acc.iter_mut().enumerate() {
            let v = unsafe { _mm256_loadu_ps(row.add(i * 8)) };
            *acc = _mm256_add_ps(*acc, _mm256_mul_ps(wv, v));
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(i * 8), *acc) };
    }
}

#[inline(always)]
fn accumulate_rows_any(weights: &[f32], values: &[f32], out: &mut [f32]) {
    let hd = out.len();
    for (p, &w) in weights.iter().enumerate() {
        let start = p * hd;
        prefetch_rows(values, std::iter::once(start + PREFETCH_AHEAD * hd), hd);
        for (o, &x) in out.iter_mut().zip(&values[start..start + hd]) {
            *o += w * x;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::tests::wave;

    /// Lane sums of four vectors (transposed) and of other counts, against the scalar sum, on
    /// values that make the order and the sign of zero visible.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn lane_sums_are_the_scalar_sums_bit_for_bit() {
        use std::arch::x86_64::{__m256, _mm256_loadu_ps};
        let special = [
            0.0,
            -0.0,
            1e30,
            -1e30,
            1.0,
            3e-39,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            1e-7,
        ];
        let value = |i: usize| {
            if i.is_multiple_of(3) {
                special[i / 3 % special.len()]
            } else {
                wave(i * 7) * [1.0, 1e8, 1e-8][i % 4 % 3]
            }
        };
        let scalar = |l: &[f32]| l.iter().sum::<f32>();
        if !std::arch::is_x86_feature_detected!("avx") {
            return;
        }
        for case in 0..500 {
            let rows: Vec<[f32; 8]> = (0..4)
                .map(|r| std::array::from_fn(|j| value(case * 31 + r * 8 + j)))
                .collect();
            // SAFETY (the loads and calls): 8 floats per row; AVX detected above the loop.
            let v: [__m256; 4] =
                std::array::from_fn(|r| unsafe { _mm256_loadu_ps(rows[r].as_ptr()) });
            let four = unsafe { lane_sums(&v) };
            let one = unsafe { lane_sums(&[v[2]]) };
            for (r, row) in rows.iter().enumerate() {
                let want = scalar(row);
                assert!(
                    four[r].to_bits() == want.to_bits() || (four[r].is_nan() && want.is_nan()),
                    "case {case} row {r}: {:?} -> {} vs {want}",
                    row,
                    four[r]
                );
            }
            assert!(one[0].to_bits() == scalar(&rows[2]).to_bits() || one[0].is_nan());
        }
    }

    #[test]
    fn interleaved_dots_are_dot_bit_for_bit() {
        for len in [1, 7, 8, 24, 128, 131] {
            let q: Vec<f32> = (0..len).map(|i| wave(i * 13)).collect();
            let rows: Vec<Vec<f32>> = (0..DOTS)
                .map(|r| (0..len).map(|i| wave(i + 101 * r)).collect())
                .collect();
            let got = dots(&q, std::array::from_fn(|r| rows[r].as_slice()));
            for (g, row) in got.iter().zip(&rows) {
                assert_eq!(g.to_bits(), dot(&q, row).to_bits(), "len {len}");
            }
        }
    }
}
