//! Small numeric building blocks shared by every family: RMSNorm, rotary embedding, SiLU gating,
//! softmax, dot products and f16 <-> f32 conversion (attention over a KV history is in
//! `attention/`, which builds on these; nothing here uses it). All f32, written to match
//! PyTorch's order of operations closely enough for 1e-4 relative agreement.

use crate::config::RopeScaling;

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

/// LayerNorm over each `weight.len()`-wide row of `x` (torch's `nn.LayerNorm`: the mean and
/// biased variance of the row, `(x - mean) / sqrt(var + eps) * weight + bias`).
pub fn layer_norm(x: &mut [f32], weight: &[f32], bias: &[f32], eps: f32) {
    let d = weight.len();
    for row in x.chunks_exact_mut(d) {
        let mean = (row.iter().map(|&v| v as f64).sum::<f64>() / d as f64) as f32;
        let var: f64 = row
            .iter()
            .map(|&v| {
                let c = (v - mean) as f64;
                c * c
            })
            .sum::<f64>()
            / d as f64;
        let inv = 1.0 / (var as f32 + eps).sqrt();
        for ((v, w), b) in row.iter_mut().zip(weight).zip(bias) {
            *v = (*v - mean) * inv * *w + *b;
        }
    }
}

/// Rotary frequencies (`rotary_dim / 2`), scaled as the config says, and the factor cos and
/// sin are multiplied by (YaRN's attention factor; 1 otherwise).
pub struct Rope {
    inv_freq: Vec<f32>,
    attention_factor: f32,
}

/// Cosines and sines of one position's rotation angles (`rotary_dim / 2` each).
pub struct RopeAngles {
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Rope {
    /// Unscaled RoPE.
    pub fn new(rotary_dim: usize, theta: f64) -> Rope {
        Rope::scaled(rotary_dim, theta, &RopeScaling::None)
    }

    /// RoPE with `scaling`, computed as transformers' `modeling_rope_utils` does (in f32 where
    /// it computes in f32, in f64 where it computes with Python floats).
    pub fn scaled(rotary_dim: usize, theta: f64, scaling: &RopeScaling) -> Rope {
        // base ** (arange(0, dim, 2) / dim) in f32, as transformers computes it.
        let pos_freqs: Vec<f32> = (0..rotary_dim / 2)
            .map(|i| (theta as f32).powf((2 * i) as f32 / rotary_dim as f32))
            .collect();
        let (inv_freq, attention_factor) = match *scaling {
            RopeScaling::None => (pos_freqs.iter().map(|&p| 1.0 / p).collect(), 1.0),
            RopeScaling::Linear { factor } => (
                pos_freqs
                    .iter()
                    .map(|&p| (1.0 / p) / factor as f32)
                    .collect(),
                1.0,
            ),
            RopeScaling::Yarn {
                factor,
                original_max_positions,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let dim = rotary_dim as f64;
                let correction_dim = |rotations: f64| {
                    dim * (original_max_positions / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001; // as transformers: no division by zero
                }
                let inv: Vec<f32> = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let extrapolation = 1.0 / p;
                        let interpolation = 1.0 / (factor as f32 * p);
                        let ramp = ((i as f32 - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                        let keep = 1.0 - ramp;
                        interpolation * (1.0 - keep) + extrapolation * keep
                    })
                    .collect();
                (inv, attention_factor as f32)
            }
        };
        Rope {
            inv_freq,
            attention_factor,
        }
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
                (
                    a.cos() * self.attention_factor,
                    a.sin() * self.attention_factor,
                )
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

impl Rope {
    /// Rotates the last `2 * half()` values of each `head_dim`-sized head in `x` as interleaved
    /// pairs `(2i, 2i + 1)` by the position's angles, or back by them (`inverse`: the rotation
    /// by minus the angles), as DeepSeek-V4 rotates its queries, keys and outputs.
    pub fn apply_interleaved_tail(
        &self,
        x: &mut [f32],
        head_dim: usize,
        angles: &RopeAngles,
        inverse: bool,
    ) {
        let half = self.half();
        let sign = if inverse { -1.0 } else { 1.0 };
        let (cos, sin) = (&angles.cos, &angles.sin);
        for head in x.chunks_exact_mut(head_dim) {
            let tail = &mut head[head_dim - 2 * half..];
            for i in 0..half {
                let (a, b) = (tail[2 * i], tail[2 * i + 1]);
                let s = sign * sin[i];
                tail[2 * i] = a * cos[i] - b * s;
                tail[2 * i + 1] = b * cos[i] + a * s;
            }
        }
    }
}

/// `silu(min(gate, limit)) * clamp(up, -limit, limit)` into `gate` (DeepSeek-V4's clamped
/// SwiGLU), or [`silu_mul`] without a limit.
pub fn swiglu(gate: &mut [f32], up: &[f32], limit: Option<f32>) {
    match limit {
        None => silu_mul(gate, up),
        Some(l) => {
            gate.iter_mut().for_each(|g| *g = g.min(l));
            let up: Vec<f32> = up.iter().map(|u| u.clamp(-l, l)).collect();
            silu_mul(gate, &up)
        }
    }
}

/// `1 / (1 + e^-x)` (libm's exp).
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `ln(1 + e^x)`, `x` itself above 20 (as torch's softplus).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Divides `x` by its root mean square (plus `eps`), without a weight.
pub fn rms_norm_unweighted(x: &mut [f32], eps: f32) {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// The constants of [`exp`] (the attention kernel's sixteen-lane exp uses them too).
pub(crate) mod exp_consts {
    pub const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = C1 + C2, C1 with few significant bits so n * C1 is exact.
    pub const C1: f32 = 0.693_359_4;
    pub const C2: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer (|v| < 2^22).
    pub const MAGIC: f32 = 12_582_912.0;
    pub const LO: f32 = -87.68; // n >= -126: 2^n is a normal number
    pub const HI: f32 = 88.37; // n <= 127
    /// Cephes' polynomial, highest power first (its 5.0000001201e-1 is 0.5 in f32).
    pub const POLY: [f32; 6] = [
        1.987_569_1e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
}

/// `e^x` within 1-2 ulp of the correctly rounded value (range reduction by ln 2 in two parts,
/// then Cephes' degree-5 minimax polynomial for `expf`), written without branches so that
/// loops over it vectorize: libm's `expf`, one call per value, was ~2% of a 1024-token prefill's
/// samples (softmax over every position, SiLU over every expert's hidden values), and this one
/// made that prefill 1-6% faster. `exp(0) == 1`
/// exactly; results below ~8.6e-39 flush to 0; above `e^88.37` the result is infinite; NaN
/// stays NaN. Only IEEE adds and multiplies (Rust never fuses them), so every target gives
/// the same bits.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    use exp_consts::*;
    let xc = x.clamp(LO, HI);
    let n = (xc * LOG2E + MAGIC) - MAGIC;
    let r = (xc - n * C1) - n * C2;
    let mut p = POLY[0];
    for c in &POLY[1..] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    let scale = f32::from_bits((((n as i32) + 127) as u32) << 23);
    let e = y * scale;
    let e = if x < LO { 0.0 } else { e };
    let e = if x > HI { f32::INFINITY } else { e };
    if x.is_nan() {
        x
    } else {
        e
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    match VectorWidth::get() {
        // SAFETY: the CPU has the features (`VectorWidth::get` checked them).
        #[cfg(target_arch = "x86_64")]
        VectorWidth::Avx512 => unsafe { silu_mul_avx512(gate, up) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        VectorWidth::Avx2 => unsafe { silu_mul_avx2(gate, up) },
        VectorWidth::Baseline => silu_mul_body(gate, up),
    }
}

#[inline(always)]
fn silu_mul_body(gate: &mut [f32], up: &[f32]) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = silu(*g) * *u;
    }
}

pub fn softmax(x: &mut [f32]) {
    match VectorWidth::get() {
        // SAFETY: the CPU has the features (`VectorWidth::get` checked them).
        #[cfg(target_arch = "x86_64")]
        VectorWidth::Avx512 => unsafe { softmax_avx512(x) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        VectorWidth::Avx2 => unsafe { softmax_avx2(x) },
        VectorWidth::Baseline => softmax_body(x),
    }
}

#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // The exponentials vectorize; the sum stays in position order.
    for v in x.iter_mut() {
        *v = exp(*v - max);
    }
    let sum: f32 = x.iter().fold(0.0, |s, &v| s + v);
    for v in x.iter_mut() {
        *v /= sum;
    }
}

/// The widest vectors the element-wise loops (SiLU, softmax) are compiled for on this CPU
/// (the crate's baseline is SSE2: 4 lanes). The loops use only IEEE adds, multiplies,
/// divides, min/max and conversions, which give the same bits at any width (Rust never fuses
/// or reorders them), so this changes speed only.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum VectorWidth {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Baseline,
}

impl VectorWidth {
    fn get() -> VectorWidth {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                return VectorWidth::Avx512;
            }
            if std::arch::is_x86_feature_detected!("avx2") {
                return VectorWidth::Avx2;
            }
        }
        VectorWidth::Baseline
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) {
    silu_mul_body(gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) {
    silu_mul_body(gate, up)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_avx512(x: &mut [f32]) {
    softmax_body(x)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_avx2(x: &mut [f32]) {
    softmax_body(x)
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

/// `dst[i] = f16(src[i])`, rounded to nearest even exactly as `half::f16::from_f32`; with F16C's
/// `vcvtps2ph` eight at a time where the CPU has it. (The half crate's slice conversion runs in
/// software here; it made appending one token's keys and values ~14 µs per layer of an
/// OLMoE-7B-shaped decode.)
pub fn narrow_to_f16(src: &[f32], dst: &mut [half::f16]) {
    assert_eq!(src.len(), dst.len(), "narrow_to_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") {
        // SAFETY: the CPU has F16C (which implies AVX), checked just above.
        unsafe { narrow_f16c(src, dst) };
        return;
    }
    narrow_portable(src, dst);
}

fn narrow_portable(src: &[f32], dst: &mut [half::f16]) {
    half::slice::HalfFloatSliceExt::convert_from_f32_slice(dst, src);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn narrow_f16c(src: &[f32], dst: &mut [half::f16]) {
    use std::arch::x86_64::{
        __m128i, _mm256_cvtps_ph, _mm256_loadu_ps, _mm_storeu_si128, _MM_FROUND_TO_NEAREST_INT,
    };
    let n = src.len().min(dst.len());
    let whole = n / 8 * 8;
    for i in (0..whole).step_by(8) {
        // SAFETY: i + 8 <= n, so 32 bytes of `src` and 16 of `dst` from i are in bounds;
        // unaligned loads and stores.
        unsafe {
            let h =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
    }
    for i in whole..n {
        dst[i] = half::f16::from_f32(src[i]);
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn layer_norm_is_torchs() {
        // torch.nn.functional.layer_norm([1, 2, 3, 6], (4,), [1, 2, 0.5, 1], [0, 1, 0, -1], 1e-6)
        let mut x = [1.0f32, 2.0, 3.0, 6.0];
        layer_norm(&mut x, &[1.0, 2.0, 0.5, 1.0], &[0.0, 1.0, 0.0, -1.0], 1e-6);
        let want = [-1.069_044_8, -0.069_044_83, 0.0, 0.603_567_24];
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{x:?}");
        }
    }

    use super::*;

    #[test]
    fn rms_norm_unit_weight_gives_unit_rms() {
        let mut x = vec![1.0, -2.0, 3.0, 4.0];
        rms_norm(&mut x, &[1.0; 4], 0.0);
        let ms: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!((ms - 1.0).abs() < 1e-5);
    }

    /// Scaled RoPE (linear, YaRN with its defaults and variants, partial rotary) against
    /// transformers' own frequencies and rotations (tests/fixtures/rope, made by
    /// scripts/make_rope_fixtures.py).
    #[test]
    fn scaled_rope_matches_transformers() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/fixtures/rope/cases.json"
        );
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = fixture["cases"].as_object().unwrap();
        assert!(cases.len() >= 6);
        for (name, case) in cases {
            let c = crate::config::ModelConfig::from_hf(&case["config"]).unwrap();
            let rope = Rope::scaled(c.rotary_dim, c.rope_theta, &c.rope_scaling);
            let floats = |v: &serde_json::Value| -> Vec<f32> {
                v.as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap() as f32)
                    .collect()
            };
            let want = floats(&case["inv_freq"]);
            assert_eq!(rope.inv_freq.len(), want.len(), "{name}");
            for (i, (a, b)) in rope.inv_freq.iter().zip(&want).enumerate() {
                assert!(
                    (a - b).abs() <= 2e-7 * b.abs(),
                    "{name}: inv_freq[{i}] {a} vs {b}"
                );
            }
            let af = case["attention_factor"].as_f64().unwrap() as f32;
            assert!((rope.attention_factor - af).abs() < 1e-6, "{name}: {af}");
            let positions = case["positions"].as_array().unwrap();
            for (j, p) in positions.iter().enumerate() {
                let angles = rope.angles(p.as_u64().unwrap() as usize);
                for (got, key) in [(&angles.cos, "cos"), (&angles.sin, "sin")] {
                    let want = floats(&case[key][j]);
                    let worst = got
                        .iter()
                        .zip(&want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0f32, f32::max);
                    // The same f32 angles; libm's and PyTorch's vectorised cos/sin differ by a
                    // few ulp of the argument's range reduction at 1e5 radians.
                    assert!(worst < 1e-5, "{name}: {key} at {p}: off by {worst}");
                }
            }
        }
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

    /// Inputs for the element-wise loops: ordinary values, both signs of zero, tiny and huge
    /// magnitudes (the exponential's clamps), infinities and a NaN; an odd length for the tails.
    fn elementwise_inputs(seed: u32) -> Vec<f32> {
        let mut v: Vec<f32> = (0..1021u32)
            .map(|i| {
                let h = (i ^ seed).wrapping_mul(2_654_435_761);
                let magnitude = f32::from_bits(0x3c00_0000 + (h >> 6) % 0x0600_0000);
                if h & 1 == 0 {
                    magnitude
                } else {
                    -magnitude
                }
            })
            .collect();
        let special = [
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            88.0,
            89.0,
            -87.5,
            -120.0,
            f32::INFINITY,
        ];
        v[..special.len()].copy_from_slice(&special);
        v[500] = f32::NEG_INFINITY;
        v[700] = f32::NAN;
        v
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()))
    }

    #[test]
    fn every_vector_width_gives_the_baseline_bits() {
        for seed in [1, 2, 3] {
            let (x, up) = (elementwise_inputs(seed), elementwise_inputs(seed + 10));
            // Softmax without the infinities and the NaN (they make every output NaN).
            let finite: Vec<f32> = x
                .iter()
                .map(|v| if v.is_finite() { *v } else { 1.5 })
                .collect();
            let silu_want = {
                let mut g = x.clone();
                silu_mul_body(&mut g, &up);
                g
            };
            let softmax_want = {
                let mut s = finite.clone();
                softmax_body(&mut s);
                s
            };
            let mut g = x.clone();
            silu_mul(&mut g, &up);
            assert!(same_bits(&g, &silu_want), "silu_mul, seed {seed}");
            let mut s = finite.clone();
            softmax(&mut s);
            assert!(same_bits(&s, &softmax_want), "softmax, seed {seed}");
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") {
                assert_ne!(VectorWidth::get(), VectorWidth::Baseline);
                let mut g = x.clone();
                // SAFETY: the CPU has AVX2 (checked just above).
                unsafe { silu_mul_avx2(&mut g, &up) };
                assert!(same_bits(&g, &silu_want), "silu_mul avx2, seed {seed}");
                let mut s = finite.clone();
                // SAFETY: as above.
                unsafe { softmax_avx2(&mut s) };
                assert!(same_bits(&s, &softmax_want), "softmax avx2, seed {seed}");
            }
        }
    }

    #[test]
    fn f16_narrowing_matches_the_half_crate_bit_for_bit() {
        // Every 97th f32 bit pattern (all exponents, signs and many mantissas: rounding ties,
        // subnormal results, overflow to infinity, NaNs), plus edge values; lengths that are
        // not a multiple of 8 exercise the tail.
        let mut src: Vec<f32> = (0..=u32::MAX / 97)
            .map(|i| f32::from_bits(i * 97))
            .collect();
        src.extend([
            0.0,
            -0.0,
            65504.0,
            65520.0,
            -65520.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            5.960_464_5e-8,
            2.980_232_2e-8,
            1.0 + 1.0 / 2048.0,
        ]);
        src.push(0.1);
        let mut a = vec![half::f16::ZERO; src.len()];
        let mut b = vec![half::f16::ZERO; src.len()];
        narrow_to_f16(&src, &mut a);
        narrow_portable(&src, &mut b);
        for ((x, y), s) in a.iter().zip(&b).zip(&src) {
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "{s:e} ({:#x}): {:#x} vs {:#x}",
                s.to_bits(),
                x.to_bits(),
                y.to_bits()
            );
        }
    }

    /// Distance in units in the last place between two finite f32 of the same sign.
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm_and_exact_at_zero() {
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(-0.0), 1.0);
        assert_eq!(exp(-200.0), 0.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(200.0), f32::INFINITY);
        assert!(exp(f32::NAN).is_nan());
        let mut worst = 0;
        // Every 61st f32 in [-87.3, 88.3] (normal results: the flushed and overflowing ends
        // are checked above).
        let (lo, hi) = (-87.3f32, 88.3f32);
        let mut bits = 0u32;
        while bits < u32::MAX - 61 {
            let x = f32::from_bits(bits);
            bits += 61;
            if !(lo..=hi).contains(&x) {
                continue;
            }
            let (got, want) = (exp(x), x.exp());
            let u = ulps(got, want);
            assert!(u <= 2, "exp({x:e}) = {got:e}, libm {want:e} ({u} ulp)");
            worst = worst.max(u);
        }
        assert!(worst >= 1, "the comparison ran");
    }

    #[test]
    fn silu_matches_its_definition() {
        for i in -400..400 {
            let x = i as f32 * 0.05;
            let want = x as f64 / (1.0 + (-(x as f64)).exp());
            assert!(
                (silu(x) as f64 - want).abs() <= 1e-6 * want.abs().max(1e-3),
                "silu({x})"
            );
        }
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = vec![1.0, 2.0, 3.0, -100.0];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }
}
