//! Small numeric building blocks shared by every family: RMSNorm, rotary embedding, SiLU gating,
//! softmax and causal attention over a KV history. All f32, written to match PyTorch's order of
//! operations closely enough for 1e-4 relative agreement.

/// `x * rsqrt(mean(x^2) + eps) * weight`, in place, over each `weight.len()`-sized row of `x`.
pub fn rms_norm(x: &mut [f32], weight: &[f32], eps: f32) {
    let d = weight.len();
    for row in x.chunks_exact_mut(d) {
        let ss: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let inv = 1.0 / ((ss / d as f64) as f32 + eps).sqrt();
        for (v, w) in row.iter_mut().zip(weight) {
            *v = *w * (*v * inv);
        }
    }
}

/// Rotary tables for one position: `cos`/`sin` of length `rotary_dim / 2`.
pub struct Rope {
    inv_freq: Vec<f32>,
}

/// Cosines and sines of one position's rotation angles (`rotary_dim / 2` each).
pub struct RopeAngles {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    pub fn new(rotary_dim: usize, theta: f64) -> Rope {
        let inv_freq = (0..rotary_dim / 2)
            .map(|i| {
                // Same as transformers: computed in f32 from an f32 exponent.
                let exp = (2 * i) as f32 / rotary_dim as f32;
                1.0f32 / (theta as f32).powf(exp)
            })
            .collect();
        Rope { inv_freq }
    }

    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }

    /// Rotates the first `rotary_dim` values of each `head_dim`-sized head in `x`
    /// (rotate-half pairing: element i with i + rotary_dim/2), at position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        self.apply_angles(x, head_dim, &self.angles(pos));
    }

    /// The rotation of position `pos`, to apply to many heads (and layers) with
    /// [`Rope::apply_angles`].
    pub fn angles(&self, pos: usize) -> RopeAngles {
        let (cos, sin) = self
            .inv_freq
            .iter()
            .map(|&f| {
                let a = pos as f32 * f;
                (a.cos(), a.sin())
            })
            .unzip();
        RopeAngles { cos, sin }
    }

    /// [`Rope::apply`] with the position's angles computed once beforehand.
    pub fn apply_angles(&self, x: &mut [f32], head_dim: usize, angles: &RopeAngles) {
        let half = self.half();
        let (cos, sin) = (&angles.cos, &angles.sin);
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let a = head[i];
                let b = head[i + half];
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * *u;
    }
}

pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    for v in x.iter_mut() {
        *v /= sum;
    }
}

#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: vectorises, and stays close to a pairwise-summed reference.
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Positions whose scores are computed together in [`attend`].
const DOTS: usize = 4;
/// How many positions ahead [`attend`] asks for the key and value rows it will read.
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

/// A kv head's history: `n` rows of `head_dim` values, one per position, contiguous.
#[derive(Clone, Copy)]
pub enum HeadRows<'a> {
    F32(&'a [f32]),
    /// Half the bytes to stream; widened to f32 a chunk at a time (exactly), so the arithmetic
    /// is the f32 path's on the rounded values.
    F16(&'a [half::f16]),
}

/// What one query head needs to attend: its kv head's history.
pub struct AttendArgs<'a> {
    pub keys: HeadRows<'a>,
    pub values: HeadRows<'a>,
    pub n: usize,
    pub scale: f32,
}

/// Positions widened from f16 at a time (16 KiB of f32 at head_dim 128: stays in L1).
const F16_CHUNK: usize = 32;

/// One query head attending causally over `a.n` cached positions: `out` (`q.len()` values) is
/// the softmax-weighted sum of the values. `scores` is scratch of at least `a.n`.
///
/// Compiled three times (plain x86-64, AVX2+FMA, AVX-512) and chosen at run time: the same
/// arithmetic in the same order, so every path gives the same bits; the wide ones only let the
/// compiler use wider registers for the dot products and the weighted sum.
pub fn attend(q: &[f32], a: &AttendArgs, scores: &mut [f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f16c = std::arch::is_x86_feature_detected!("f16c");
        if std::arch::is_x86_feature_detected!("avx512f") && f16c {
            // SAFETY: the CPU has AVX-512F and F16C (checked just above).
            return unsafe { attend_avx512(q, a, scores, out) };
        }
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && f16c
        {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked just above).
            return unsafe { attend_avx2(q, a, scores, out) };
        }
    }
    attend_generic(q, a, scores, out, widen_portable)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma,f16c")]
unsafe fn attend_avx512(q: &[f32], a: &AttendArgs, scores: &mut [f32], out: &mut [f32]) {
    attend_generic(q, a, scores, out, widen_checked)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attend_avx2(q: &[f32], a: &AttendArgs, scores: &mut [f32], out: &mut [f32]) {
    attend_generic(q, a, scores, out, widen_checked)
}

/// `dst[i] = src[i]` widened (exact): the `half` crate's conversion.
fn widen_portable(src: &[half::f16], dst: &mut [f32]) {
    half::slice::HalfFloatSliceExt::convert_to_f32_slice(src, dst);
}

/// `dst[i] = src[i]` widened with F16C's `vcvtph2ps`, eight at a time (exact, like
/// [`widen_portable`]). Only reached from the attention paths chosen after detecting F16C.
#[cfg(target_arch = "x86_64")]
fn widen_checked(src: &[half::f16], dst: &mut [f32]) {
    if std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has F16C and AVX (F16C implies AVX; checked just above).
        unsafe { widen_f16c(src, dst) }
    } else {
        widen_portable(src, dst)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn widen_f16c(src: &[half::f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = src.len().min(dst.len());
    let whole = n / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 <= n, so 16 bytes of `src` and 32 of `dst` from i are in bounds;
        // unaligned loads and stores.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    for i in whole..n {
        dst[i] = src[i].to_f32();
    }
}

#[inline(always)]
fn attend_generic(
    q: &[f32],
    a: &AttendArgs,
    scores: &mut [f32],
    out: &mut [f32],
    widen: fn(&[half::f16], &mut [f32]),
) {
    let hd = q.len();
    let scores = &mut scores[..a.n];
    out.fill(0.0);
    match (a.keys, a.values) {
        (HeadRows::F32(keys), HeadRows::F32(values)) => {
            score_rows(q, &keys[..a.n * hd], a.scale, scores);
            softmax(scores);
            accumulate_rows(scores, &values[..a.n * hd], out);
        }
        (HeadRows::F16(keys), HeadRows::F16(values)) => {
            let mut wide = vec![0.0f32; F16_CHUNK * hd];
            for (c, s) in scores.chunks_mut(F16_CHUNK).enumerate() {
                let rows = c * F16_CHUNK * hd..(c * F16_CHUNK + s.len()) * hd;
                let wide = &mut wide[..rows.len()];
                widen(&keys[rows], wide);
                score_rows(q, wide, a.scale, s);
            }
            softmax(scores);
            for (c, w) in scores.chunks(F16_CHUNK).enumerate() {
                let rows = c * F16_CHUNK * hd..(c * F16_CHUNK + w.len()) * hd;
                let wide = &mut wide[..rows.len()];
                widen(&values[rows], wide);
                accumulate_rows(w, wide, out);
            }
        }
        _ => unreachable!("keys and values of one cache share a dtype"),
    }
}

/// `scores[p] = dot(q, keys row p) * scale` for the `scores.len()` rows of `keys`.
#[inline(always)]
fn score_rows(q: &[f32], keys: &[f32], scale: f32, scores: &mut [f32]) {
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
        for (s, d) in scores[p..p + DOTS].iter_mut().zip(dots(q, k)) {
            *s = d * scale;
        }
        p += DOTS;
    }
    for (s, p) in scores[p..].iter_mut().zip(p..) {
        *s = dot(q, &keys[row(p)..row(p) + hd]) * scale;
    }
}

/// `out += weights[p] * values row p`, in position order.
#[inline(always)]
fn accumulate_rows(weights: &[f32], values: &[f32], out: &mut [f32]) {
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

    #[test]
    fn rms_norm_unit_weight_gives_unit_rms() {
        let mut x = vec![1.0, -2.0, 3.0, 4.0];
        rms_norm(&mut x, &[1.0; 4], 0.0);
        let ms: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-5);
    }

    #[test]
    fn rope_at_position_zero_is_identity_and_preserves_norm() {
        let rope = Rope::new(4, 10000.0);
        let mut x = vec![0.5, -1.0, 2.0, 0.25, 7.0, 8.0];
        let orig = x.clone();
        rope.apply(&mut x, 6, 0);
        assert_eq!(x, orig);
        rope.apply(&mut x, 6, 17);
        let n0: f32 = orig[..4].iter().map(|v| v * v).sum();
        let n1: f32 = x[..4].iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        assert_eq!(&x[4..], &orig[4..], "dims past rotary_dim pass through");
    }

    /// Deterministic test values in [-0.7, 0.7).
    fn wave(i: usize) -> f32 {
        ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 0.7
    }

    #[test]
    fn attend_paths_give_identical_bits() {
        let (n, hd) = (37, 24);
        let keys: Vec<f32> = (0..n * hd).map(wave).collect();
        let values: Vec<f32> = (0..n * hd).map(|i| wave(i + 3)).collect();
        let q: Vec<f32> = (0..hd).map(|i| wave(i * 13)).collect();
        let a = AttendArgs {
            keys: HeadRows::F32(&keys),
            values: HeadRows::F32(&values),
            n,
            scale: 0.2,
        };
        let (mut s1, mut s2) = (vec![0.0; n], vec![0.0; n]);
        let (mut o1, mut o2) = (vec![0.0; hd], vec![0.0; hd]);
        attend(&q, &a, &mut s1, &mut o1);
        attend_generic(&q, &a, &mut s2, &mut o2, widen_portable);
        assert_eq!(o1, o2);
        let w: f32 = s2.iter().sum();
        assert!((w - 1.0).abs() < 1e-5);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16c_widening_is_exact_for_every_half() {
        if !std::arch::is_x86_feature_detected!("f16c") {
            return;
        }
        let all: Vec<half::f16> = (0..=u16::MAX).map(half::f16::from_bits).collect();
        let (mut a, mut b) = (vec![0.0f32; all.len()], vec![0.0f32; all.len()]);
        widen_checked(&all, &mut a);
        widen_portable(&all, &mut b);
        for (x, y) in a.iter().zip(&b) {
            assert!(x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()));
        }
    }

    #[test]
    fn f16_rows_attend_exactly_as_their_f32_widening() {
        use half::f16;
        let hd = 24;
        let q: Vec<f32> = (0..hd).map(|i| wave(i * 13)).collect();
        // Lengths around the widening chunk and the four-position groups.
        for n in [1, 3, 31, 32, 33, 70, 130] {
            let k16: Vec<f16> = (0..n * hd).map(|i| f16::from_f32(wave(i))).collect();
            let v16: Vec<f16> = (0..n * hd).map(|i| f16::from_f32(wave(i + 3))).collect();
            let k32: Vec<f32> = k16.iter().map(|x| x.to_f32()).collect();
            let v32: Vec<f32> = v16.iter().map(|x| x.to_f32()).collect();
            let half = AttendArgs {
                keys: HeadRows::F16(&k16),
                values: HeadRows::F16(&v16),
                n,
                scale: 0.2,
            };
            let full = AttendArgs {
                keys: HeadRows::F32(&k32),
                values: HeadRows::F32(&v32),
                n,
                scale: 0.2,
            };
            let (mut s1, mut s2) = (vec![0.0; n], vec![0.0; n]);
            let (mut o1, mut o2) = (vec![0.0; hd], vec![0.0; hd]);
            attend(&q, &half, &mut s1, &mut o1);
            attend(&q, &full, &mut s2, &mut o2);
            assert_eq!(o1, o2, "n {n}");
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

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -100.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
