//! Small numeric building blocks shared by every family: RMSNorm, rotary embedding, SiLU gating,
//! softmax and causal attention over a KV history. All f32, written to match PyTorch's order of
//! operations closely enough for 1e-4 relative agreement.

use std::ops::Range;

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

#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
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
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 = C1 + C2, C1 with few significant bits so n * C1 is exact.
    const C1: f32 = 0.693_359_4;
    const C2: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding and subtracting it rounds to the nearest integer (|v| < 2^22).
    const MAGIC: f32 = 12_582_912.0;
    const LO: f32 = -87.68; // n >= -126: 2^n is a normal number
    const HI: f32 = 88.37; // n <= 127
    let xc = x.clamp(LO, HI);
    let n = (xc * LOG2E + MAGIC) - MAGIC;
    let r = (xc - n * C1) - n * C2;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5; // Cephes: 5.0000001201e-1, which is 0.5 in f32
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

/// Positions whose scores are computed together in [`attend`] (four independent dot
/// products; `attend_f16` groups them the same way).
pub(crate) const DOTS: usize = 4;
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
            if crate::attend_f16::supported(q.len()) {
                return crate::attend_f16::attend_one(q, keys, values, a.n0, a.scale, out);
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

/// How the dot products and weighted sums of [`attend`] are computed: plain Rust (which the
/// compiler leaves scalar here), or AVX vectors holding the same eight partial sums, so both
/// give the same bits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Simd {
    Portable,
    /// Only chosen on CPUs with AVX (the AVX2 and AVX-512 attention paths).
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx,
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
        for (q, s) in qs.iter().zip(scores.iter_mut()) {
            let top = hi.min(s.len());
            if top > lo {
                score_rows(q, &keys[..(top - lo) * hd], a.scale, &mut s[lo..top], simd);
            }
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

/// `scores[p] = dot(q, keys row p) * scale` for the `scores.len()` rows of `keys`.
#[inline(always)]
fn score_rows(q: &[f32], keys: &[f32], scale: f32, scores: &mut [f32], simd: Simd) {
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

/// `out += weights[p] * values row p`, in position order.
#[inline(always)]
fn accumulate_rows(weights: &[f32], values: &[f32], out: &mut [f32], simd: Simd) {
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

    /// Deterministic test values in [-0.7, 0.7).
    fn wave(i: usize) -> f32 {
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
        assert!(same_bits(&a, &b));
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
