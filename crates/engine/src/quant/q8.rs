//! Activations quantized to 8 bits per group of 32, in the order the kernels read them.
//!
//! Per activation vector, with `gp` = groups rounded up to a multiple of 16 (the padding groups
//! are all zero), in blocks of 16 groups that mirror the int4 nibble blocks (`q4::nibble_offset`):
//! * `qs`: `gp * 32` i8; block `b` is 512 bytes, and value `j` of its group `i` sits at
//!   `(j % 16 / 4) * 128 + (j / 16) * 64 + 4i + j % 4`: for each dword `k` of the weights'
//!   nibble bytes, 64 bytes of the values the low nibbles multiply (values `4k..4k + 4` of the 16
//!   groups), then 64 of the values the high nibbles multiply (`16 + 4k..`);
//! * `corr`: 1 i32 per group, `-8 * sum(q of the group)` (undoes the int4 offset);
//! * `dexp`: 1 f32 per group, the group's scale.
//!
//! The kernels reduce each group in one i32 lane, which is why the values are interleaved by
//! dword. All three arrays start 64-byte aligned, and so does every vector within them.

use super::q4::BLOCK_GROUPS;
use super::GROUP;

/// 64 bytes, 64-byte aligned: the allocation unit of [`AVec`].
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// Plain numeric types that any bit pattern (and all-zero) is valid for.
///
/// # Safety
/// Implementors have no padding, no invalid bit patterns and alignment <= 64.
unsafe trait Pod: Copy {}
// SAFETY: i8, i32 and f32 have no padding and no invalid bit patterns; alignment <= 4.
unsafe impl Pod for i8 {}
// SAFETY: as above.
unsafe impl Pod for i32 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}

/// A 64-byte aligned, zero-initialised growable array of `T`.
struct AVec<T: Pod> {
    lines: Vec<Line>,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Pod> AVec<T> {
    fn new() -> Self {
        AVec {
            lines: Vec::new(),
            len: 0,
            _t: std::marker::PhantomData,
        }
    }

    /// Sets the length to `len` elements; the contents are unspecified (but valid) afterwards.
    fn set_len(&mut self, len: usize) {
        let bytes = len * std::mem::size_of::<T>();
        let nl = bytes.div_ceil(64);
        if self.lines.len() < nl {
            self.lines.resize(nl, Line([0; 64]));
        }
        self.len = len;
    }

    fn as_slice(&self) -> &[T] {
        // SAFETY: `lines` holds at least len * size_of::<T>() initialised bytes (set_len), its
        // pointer is 64-byte aligned >= align_of::<T>() (Pod), and any bytes are a valid T.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        // SAFETY: as in as_slice, and `&mut self` gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

/// `n` activation vectors of `cols` values each, quantized to i8 per group of 32 with an f32
/// scale per group (plus the per-group sums the int4 kernels need). Reuses its allocation.
pub struct Q8Acts {
    n: usize,
    cols: usize,
    /// Groups per vector, padded to a multiple of 16.
    gp: usize,
    qs: AVec<i8>,
    corr: AVec<i32>,
    dexp: AVec<f32>,
}

impl Default for Q8Acts {
    fn default() -> Self {
        Self::new()
    }
}

/// Borrowed data of one activation vector (see the module doc for the layout).
#[derive(Clone, Copy)]
pub(crate) struct TokenActs<'a> {
    pub qs: &'a [i8],
    pub corr: &'a [i32],
    pub dexp: &'a [f32],
}

impl Q8Acts {
    pub fn new() -> Self {
        Q8Acts {
            n: 0,
            cols: 0,
            gp: 0,
            qs: AVec::new(),
            corr: AVec::new(),
            dexp: AVec::new(),
        }
    }

    /// Number of activation vectors.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Values per activation vector.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Groups per vector as stored (a multiple of 16, covering `cols`).
    pub(crate) fn padded_groups(&self) -> usize {
        self.gp
    }

    /// Quantizes `x` (`n x cols`, row-major).
    pub fn quantize(&mut self, x: &[f32], n: usize, cols: usize) {
        self.quantize_with(group_quantizer(), x, n, cols)
    }

    /// [`Q8Acts::quantize`] with whole groups taken by `by` (every one gives the same bits).
    fn quantize_with(&mut self, by: GroupQuantizer, x: &[f32], n: usize, cols: usize) {
        assert_eq!(
            x.len(),
            n * cols,
            "Q8Acts::quantize: x has {} floats, not {n}x{cols}",
            x.len()
        );
        let groups = cols.div_ceil(GROUP);
        let gp = groups.next_multiple_of(BLOCK_GROUPS);
        self.n = n;
        self.cols = cols;
        self.gp = gp;
        self.qs.set_len(n * gp * GROUP);
        self.corr.set_len(n * gp);
        self.dexp.set_len(n * gp);
        if n == 0 || gp == 0 {
            return;
        }
        let qs = self.qs.as_mut_slice();
        let corr = self.corr.as_mut_slice();
        let dexp = self.dexp.as_mut_slice();
        // Whole groups with the kernel's vectors (the same bits, tested): the scalar loop took
        // ~2 ns a value, ~1.5% of a decode step and ~3% of a 64-token prefill.
        let full = if by == GroupQuantizer::Scalar {
            0
        } else {
            cols / GROUP
        };
        for t in 0..n {
            let xt = &x[t * cols..(t + 1) * cols];
            let qs = &mut qs[t * gp * GROUP..(t + 1) * gp * GROUP];
            let corr = &mut corr[t * gp..(t + 1) * gp];
            let dexp = &mut dexp[t * gp..(t + 1) * gp];
            #[cfg(target_arch = "x86_64")]
            if full > 0 {
                let whole = &xt[..full * GROUP];
                // SAFETY: `by` is only a vector quantizer on a CPU with its features
                // (`group_quantizer`, or the tests' `available`); `full` whole groups of `xt`
                // and their places in qs/corr/dexp are in bounds (sizes set just above).
                unsafe {
                    match by {
                        GroupQuantizer::Avx512 => quantize_groups_avx512(whole, qs, corr, dexp),
                        GroupQuantizer::Avx2 => quantize_groups_avx2(whole, qs, corr, dexp),
                        GroupQuantizer::Scalar => {}
                    }
                }
            }
            quantize_groups_scalar(xt, full..gp, qs, corr, dexp);
        }
    }

    /// Becomes the vectors `rows` of `src`, in that order: exactly what quantizing those rows
    /// of its input would give (each vector is quantized on its own), without redoing it.
    pub fn gather(&mut self, src: &Q8Acts, rows: &[usize]) {
        let (gp, n) = (src.gp, rows.len());
        self.n = n;
        self.cols = src.cols;
        self.gp = gp;
        self.qs.set_len(n * gp * GROUP);
        self.corr.set_len(n * gp);
        self.dexp.set_len(n * gp);
        let (qs, corr, dexp) = (
            self.qs.as_mut_slice(),
            self.corr.as_mut_slice(),
            self.dexp.as_mut_slice(),
        );
        for (t, &r) in rows.iter().enumerate() {
            assert!(r < src.n, "Q8Acts::gather: row {r} of {}", src.n);
            let from = src.token(r);
            qs[t * gp * GROUP..(t + 1) * gp * GROUP].copy_from_slice(from.qs);
            corr[t * gp..(t + 1) * gp].copy_from_slice(from.corr);
            dexp[t * gp..(t + 1) * gp].copy_from_slice(from.dexp);
        }
    }

    /// The data of vector `t`.
    pub(crate) fn token(&self, t: usize) -> TokenActs<'_> {
        let gp = self.gp;
        TokenActs {
            qs: &self.qs.as_slice()[t * gp * GROUP..(t + 1) * gp * GROUP],
            corr: &self.corr.as_slice()[t * gp..(t + 1) * gp],
            dexp: &self.dexp.as_slice()[t * gp..(t + 1) * gp],
        }
    }

    /// Quantized value `j` of group `g` of vector `t` (j < 32).
    pub(crate) fn q_at(a: &TokenActs, g: usize, j: usize) -> i8 {
        a.qs[qs_offset(g, j)]
    }

    /// Vector `t` dequantized (`cols` values): what the kernels actually multiply with.
    pub fn dequantize(&self, t: usize) -> Vec<f32> {
        assert!(t < self.n);
        let a = self.token(t);
        (0..self.cols)
            .map(|c| Self::q_at(&a, c / GROUP, c % GROUP) as f32 * a.dexp[c / GROUP])
            .collect()
    }
}

/// Offset in a vector's `qs` of value `j` (0..32) of group `g` (see the module doc).
#[inline(always)]
pub(crate) fn qs_offset(g: usize, j: usize) -> usize {
    (g / BLOCK_GROUPS) * BLOCK_GROUPS * GROUP
        + (j % 16 / 4) * 128
        + (j / 16) * 64
        + (g % BLOCK_GROUPS) * 4
        + j % 4
}

/// 1.5 * 2^23: adding and subtracting it rounds |v| < 2^22 to nearest, ties to even.
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Groups `groups` of one vector `xt` (`cols` values; groups past them are zero padding),
/// quantized with [`quantize_group`] and stored in the vector's `qs`, `corr` and `dexp`.
fn quantize_groups_scalar(
    xt: &[f32],
    groups: std::ops::Range<usize>,
    qs: &mut [i8],
    corr: &mut [i32],
    dexp: &mut [f32],
) {
    let cols = xt.len();
    let mut buf = [0.0f32; GROUP];
    for g in groups {
        let lo = (g * GROUP).min(cols);
        let hi = ((g + 1) * GROUP).min(cols);
        if lo == hi {
            // Padding past the columns: what quantizing 32 zeros gives, without the work (a
            // 128-wide vector, MLA's per-head input, has 12 such groups of its 16).
            store_group(g, &[0; GROUP], 0, 0.0, qs, corr, dexp);
            continue;
        }
        buf.fill(0.0);
        buf[..hi - lo].copy_from_slice(&xt[lo..hi]);
        let (q, d) = quantize_group(&buf);
        let sum: i32 = q.iter().map(|&v| v as i32).sum();
        store_group(g, &q, sum, d, qs, corr, dexp);
    }
}

/// Stores group `g` in a vector's layout: its values `q` (four at a time, each dword in its
/// place in the block), the offset of its values' sum `-8 * sum` and its scale `d`.
#[inline(always)]
fn store_group(
    g: usize,
    q: &[i8; GROUP],
    sum: i32,
    d: f32,
    qs: &mut [i8],
    corr: &mut [i32],
    dexp: &mut [f32],
) {
    for j in (0..GROUP).step_by(4) {
        let at = qs_offset(g, j);
        qs[at..at + 4].copy_from_slice(&q[j..j + 4]);
    }
    corr[g] = -8 * sum;
    dexp[g] = d;
}

/// The whole groups of `x` a vector quantizer takes, each checked up front to have its places
/// in `qs`, `corr` and `dexp` (a short buffer fails before any group is stored).
#[cfg(target_arch = "x86_64")]
fn checked_groups(x: &[f32], qs: &[i8], corr: &[i32], dexp: &[f32]) -> usize {
    let groups = x.len() / GROUP;
    assert!(qs.len() >= groups.div_ceil(BLOCK_GROUPS) * BLOCK_GROUPS * GROUP);
    assert!(corr.len() >= groups && dexp.len() >= groups);
    groups
}

/// What takes [`Q8Acts::quantize`]'s whole groups.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the vector ones are x86 only
enum GroupQuantizer {
    Scalar,
    Avx2,
    Avx512,
}

/// The process kernel's vectors (so `COLI_KERNEL=scalar` keeps the quantization scalar too).
fn group_quantizer() -> GroupQuantizer {
    static BY: std::sync::OnceLock<GroupQuantizer> = std::sync::OnceLock::new();
    *BY.get_or_init(|| match super::kernel() {
        #[cfg(target_arch = "x86_64")]
        super::Kernel::Avx512Vnni if std::arch::is_x86_feature_detected!("avx512f") => {
            GroupQuantizer::Avx512
        }
        // Both x86 kernels need AVX2 (`Kernel::available`).
        #[cfg(target_arch = "x86_64")]
        super::Kernel::Avx2 | super::Kernel::Avx512Vnni => GroupQuantizer::Avx2,
        _ => GroupQuantizer::Scalar,
    })
}

/// [`quantize_group`] for each 32-value group of `x` (a whole number of groups), stored as
/// [`Q8Acts::quantize`] stores them, with AVX2: as [`quantize_groups_avx512`], the same
/// operations on the same values (the multiply and the add of the rounding kept apart, as the
/// scalar code computes them), so the same bits.
///
/// # Safety
/// The CPU has AVX2; `qs`, `corr` and `dexp` hold the layout of `x.len() / 32` groups.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn quantize_groups_avx2(x: &[f32], qs: &mut [i8], corr: &mut [i32], dexp: &mut [f32]) {
    use std::arch::x86_64::*;
    let groups = checked_groups(x, qs, corr, dexp);
    let (magic, lo, hi) = (
        _mm256_set1_ps(ROUND_MAGIC),
        _mm256_set1_ps(-127.0),
        _mm256_set1_ps(127.0),
    );
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    // packs works within 128-bit halves: this puts the packed dwords back in value order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for g in 0..groups {
        // SAFETY: group g's 32 values are in `x` (g < groups); unaligned loads.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(x.as_ptr().add(g * GROUP + 8 * i)) });
        // |v| with NaN lanes as 0: f32::max in the scalar fold ignores NaNs.
        let a = v.map(|v| {
            let a = _mm256_and_ps(v, abs_mask);
            _mm256_and_ps(a, _mm256_cmp_ps::<_CMP_ORD_Q>(a, a))
        });
        let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let q = v.map(|v| {
            let r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(v, idv), magic), magic);
            let number = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            let r = _mm256_min_ps(_mm256_max_ps(r, lo), hi);
            // Whole numbers in -127..=127 convert exactly; NaN lanes become 0.
            _mm256_and_si256(_mm256_cvtps_epi32(r), number)
        });
        let s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)));
        let words = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let mut bytes = [0i8; GROUP];
        // SAFETY: `bytes` has 32 bytes; an unaligned store.
        unsafe {
            _mm256_storeu_si256(
                bytes.as_mut_ptr().cast(),
                _mm256_permutevar8x32_epi32(words, order),
            )
        };
        store_group(g, &bytes, sum, d, qs, corr, dexp);
    }
}

/// [`quantize_group`] for each 32-value group of `x` (a whole number of groups), stored as
/// [`Q8Acts::quantize`] stores them: the same operations on the same values (the maximum of
/// the absolute values ignoring NaNs, `amax / 127` and its inverse in scalar code, the
/// round-half-even of `v * id` by the same constant, NaN to 0), so the same bits.
///
/// # Safety
/// The CPU has AVX-512F; `qs`, `corr` and `dexp` hold the layout of `x.len() / 32` groups.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn quantize_groups_avx512(x: &[f32], qs: &mut [i8], corr: &mut [i32], dexp: &mut [f32]) {
    use std::arch::x86_64::*;
    let groups = checked_groups(x, qs, corr, dexp);
    let (magic, lo, hi) = (
        _mm512_set1_ps(ROUND_MAGIC),
        _mm512_set1_ps(-127.0),
        _mm512_set1_ps(127.0),
    );
    for g in 0..groups {
        // SAFETY: group g's 32 values are in `x` (g < groups); unaligned loads.
        let (v0, v1) = unsafe {
            (
                _mm512_loadu_ps(x.as_ptr().add(g * GROUP)),
                _mm512_loadu_ps(x.as_ptr().add(g * GROUP + 16)),
            )
        };
        // |v| with NaN lanes as 0: f32::max in the scalar fold ignores NaNs.
        let (a0, a1) = (_mm512_abs_ps(v0), _mm512_abs_ps(v1));
        let a0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(a0, a0), a0);
        let a1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(a1, a1), a1);
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let idv = _mm512_set1_ps(id);
        let round = |v: __m512| {
            let r = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(v, idv), magic), magic);
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(r, r);
            let r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
            _mm512_maskz_cvtps_epi32(!nan, r)
        };
        let (q0, q1) = (round(v0), round(v1));
        let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        // Values 0..16 and 16..32 as bytes.
        let mut bytes = [0i8; GROUP];
        // SAFETY: `bytes` has 32 bytes, two 16-byte unaligned stores.
        unsafe {
            _mm_storeu_si128(bytes.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128(bytes.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(q1));
        }
        store_group(g, &bytes, sum, d, qs, corr, dexp);
    }
}

/// Symmetric 8-bit quantization of one group: scale `amax / 127`, round to nearest (even).
fn quantize_group(x: &[f32; GROUP]) -> ([i8; GROUP], f32) {
    let amax = x.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i8; GROUP];
    for (qi, &v) in q.iter_mut().zip(x) {
        let r = (v * id + ROUND_MAGIC) - ROUND_MAGIC;
        *qi = r.clamp(-127.0, 127.0) as i8;
    }
    (q, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scalar layout of `x` (`n` vectors of `cols`): every group with the scalar code.
    fn scalar_reference(x: &[f32], n: usize, cols: usize) -> (Vec<i8>, Vec<i32>, Vec<u32>) {
        let gp = cols.div_ceil(GROUP).next_multiple_of(BLOCK_GROUPS);
        let (mut qs, mut corr, mut dexp) = (
            vec![0i8; n * gp * GROUP],
            vec![0i32; n * gp],
            vec![0f32; n * gp],
        );
        for t in 0..n {
            quantize_groups_scalar(
                &x[t * cols..(t + 1) * cols],
                0..gp,
                &mut qs[t * gp * GROUP..(t + 1) * gp * GROUP],
                &mut corr[t * gp..(t + 1) * gp],
                &mut dexp[t * gp..(t + 1) * gp],
            );
        }
        (qs, corr, dexp.iter().map(|v| v.to_bits()).collect())
    }

    #[test]
    fn vector_quantization_gives_the_scalar_bits() {
        // Rounding ties (k + 0.5 steps), zero groups, NaN and infinite values, tiny and huge
        // magnitudes, and a partial last group (cols = 100).
        let special = [
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            1e-30,
            -3e38,
            0.5,
            -1.5,
            2.5,
            127.0,
            -127.0,
            63.5,
        ];
        for (n, cols) in [(3, 2048), (2, 100), (1, 32), (4, 1024)] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| match i % 97 {
                    0..=12 => special[i % 97],
                    13..=40 => 0.0,
                    _ => ((i * 7919 % 1000) as f32 - 500.0) * (1.0 + (i % 7) as f32) * 0.125,
                })
                .collect();
            every_quantizer_gives_the_scalar_bits(&x, n, cols);
        }
    }

    /// Each group quantizer this CPU runs stores `x` (`n x cols`) as the scalar code does.
    fn every_quantizer_gives_the_scalar_bits(x: &[f32], n: usize, cols: usize) {
        let (qs, corr, dexp) = scalar_reference(x, n, cols);
        for by in available() {
            let mut a = Q8Acts::new();
            a.quantize_with(by, x, n, cols);
            assert_eq!(a.qs.as_slice(), qs.as_slice(), "qs, {by:?} {n}x{cols}");
            assert_eq!(
                a.corr.as_slice(),
                corr.as_slice(),
                "corr, {by:?} {n}x{cols}"
            );
            let bits: Vec<u32> = a.dexp.as_slice().iter().map(|v| v.to_bits()).collect();
            assert_eq!(bits, dexp, "dexp, {by:?} {n}x{cols}");
        }
    }

    /// The group quantizers this CPU runs.
    fn available() -> Vec<GroupQuantizer> {
        let mut by = vec![GroupQuantizer::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2") {
                by.push(GroupQuantizer::Avx2);
            }
            if std::arch::is_x86_feature_detected!("avx512f") {
                by.push(GroupQuantizer::Avx512);
            }
        }
        by
    }

    /// Random groups, NaN and infinities among them, at every scale from subnormal to huge:
    /// each vector quantizer gives the scalar bits.
    #[test]
    fn vector_quantization_gives_the_scalar_bits_on_random_groups() {
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let (n, cols) = (64, 320);
        for _ in 0..20 {
            let x: Vec<f32> = (0..n * cols)
                .map(|_| {
                    let r = next();
                    match r % 50 {
                        0 => f32::NAN,
                        1 => f32::INFINITY,
                        2 => f32::NEG_INFINITY,
                        3 => 0.0,
                        // Any finite bit pattern: subnormals, ties, huge values.
                        _ => {
                            let v = f32::from_bits((r >> 32) as u32);
                            if v.is_finite() {
                                v
                            } else {
                                1.0
                            }
                        }
                    }
                })
                .collect();
            every_quantizer_gives_the_scalar_bits(&x, n, cols);
        }
    }

    #[test]
    fn gathered_rows_are_the_rows_quantized_alone() {
        let (n, cols) = (7, 300);
        let x: Vec<f32> = (0..n * cols)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        let mut all = Q8Acts::new();
        all.quantize(&x, n, cols);
        let rows = [5, 0, 5, 3];
        let mut got = Q8Acts::new();
        got.gather(&all, &rows);
        let picked: Vec<f32> = rows
            .iter()
            .flat_map(|&r| x[r * cols..(r + 1) * cols].to_vec())
            .collect();
        let mut want = Q8Acts::new();
        want.quantize(&picked, rows.len(), cols);
        assert_eq!((got.n(), got.cols()), (want.n(), want.cols()));
        assert_eq!(got.qs.as_slice(), want.qs.as_slice());
        assert_eq!(got.corr.as_slice(), want.corr.as_slice());
        let bits = |a: &Q8Acts| {
            a.dexp
                .as_slice()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<_>>()
        };
        assert_eq!(bits(&got), bits(&want));
    }

    #[test]
    fn q8_awkward_cols_roundtrip_and_layout() {
        let mut a = Q8Acts::new();
        for &(n, cols) in &[
            (1, 72),
            (3, 40),
            (5, 200),
            (8, 32),
            (2, 1),
            (4, 300),
            (1, 1024),
        ] {
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * (1.0 + (i % 13) as f32))
                .collect();
            a.quantize(&x, n, cols);
            assert_eq!((a.n(), a.cols()), (n, cols));
            let gp = a.padded_groups();
            assert_eq!(gp % 16, 0);
            assert!(gp * GROUP >= cols);
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let d = a.dequantize(t);
                let tok = a.token(t);
                for (g, (xg, dg)) in xt.chunks(GROUP).zip(d.chunks(GROUP)).enumerate() {
                    let amax = xg.iter().fold(0.0f32, |m, &v| m.max(v.abs()));
                    let scale = tok.dexp[g];
                    assert!((scale - amax / 127.0).abs() <= 1e-6 * amax);
                    for (&u, &v) in xg.iter().zip(dg) {
                        assert!((u - v).abs() <= scale * 0.5 * (1.0 + 1e-5), "{u} vs {v}");
                    }
                    let sum: i32 = (0..GROUP).map(|j| Q8Acts::q_at(&tok, g, j) as i32).sum();
                    assert_eq!(tok.corr[g], -8 * sum);
                    // Each value has its own place in the block.
                    for j in 0..GROUP {
                        let at = qs_offset(g, j);
                        assert_eq!(at / 512, g / 16);
                        assert_eq!((at % 128) / 64, j / 16);
                        assert_eq!((at % 64) / 4, g % 16);
                    }
                }
                // Everything past cols is zero: padding columns and padding groups.
                for c in cols..gp * GROUP {
                    assert_eq!(Q8Acts::q_at(&tok, c / GROUP, c % GROUP), 0, "col {c}");
                }
                for g in cols.div_ceil(GROUP)..gp {
                    assert_eq!(tok.corr[g], 0);
                    assert_eq!(tok.dexp[g], 0.0);
                }
                assert_eq!(tok.qs.as_ptr() as usize % 64, 0);
                assert_eq!(tok.corr.as_ptr() as usize % 64, 0);
                assert_eq!(tok.dexp.as_ptr() as usize % 64, 0);
            }
        }
        // Empty input.
        a.quantize(&[], 0, 64);
        assert_eq!(a.n(), 0);
        let x = vec![0.0; 3 * 50];
        a.quantize(&x, 3, 50);
        assert!(a.dequantize(2).iter().all(|&v| v == 0.0));
    }
}
