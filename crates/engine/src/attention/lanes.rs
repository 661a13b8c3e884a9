//! Sixteen f32 lanes, the unit of the attention kernel's arithmetic, three ways: plain Rust
//! arrays, two AVX2 registers, one AVX-512 register. Every operation is lane-wise IEEE (a fused
//! multiply-add rounds once on every backend) and [`Lanes::sum`] adds the lanes in one fixed
//! tree, so the three give the same bits and the kernel written once over [`Lanes`] does too.

use half::f16;

/// Lanes per vector of the kernel.
pub(super) const LANES: usize = 16;

/// Sixteen f32 lanes.
///
/// # Safety
/// Implementations for vector registers may only be used on a CPU with their features
/// (the kernel's entry points check them); every pointer must be valid for 16 values.
pub(super) trait Lanes: Copy {
    /// How many values of this type fit the machine's vector registers: AVX2's sixteen 256-bit
    /// registers hold eight (two each); AVX-512's thirty-two 512-bit ones hold thirty-two. The
    /// kernel blocks its queries and rows so that a loop's running sums and loads fit (spilled
    /// sums cost a store and a load per multiply-add); the blocking never changes a result.
    const LIVE: usize;
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    unsafe fn load(p: *const f32) -> Self;
    /// Sixteen f16 values widened exactly.
    unsafe fn load_f16(p: *const f16) -> Self;
    unsafe fn store(self, p: *mut f32);
    /// `self * b + c`, rounded once.
    unsafe fn mul_add(self, b: Self, c: Self) -> Self;
    unsafe fn mul(self, b: Self) -> Self;
    unsafe fn add(self, b: Self) -> Self;
    /// The largest lane (order does not matter: the maximum of the same values is the same,
    /// up to the sign of a zero, which no caller can tell apart).
    unsafe fn max_all(self) -> f32;
    /// The lane-wise maximum (of numbers; which operand a NaN comparison yields may differ
    /// between backends, and then the attention's result is NaN on every one).
    unsafe fn maximum(self, b: Self) -> Self;
    /// The lanes summed as a tree: lane `j` plus lane `j + 8`, then `j + 4`, `j + 2`, `j + 1`
    /// (the order of [`tree_sum`]).
    unsafe fn sum(self) -> f32;
    /// [`Lanes::sum`] of four vectors (the same tree each, so the same bits), the vector
    /// backends adding their lanes side by side.
    #[inline(always)]
    unsafe fn sums4(v: [Self; 4]) -> [f32; 4] {
        // SAFETY: the CPU has the features (contract).
        unsafe { [v[0].sum(), v[1].sum(), v[2].sum(), v[3].sum()] }
    }
    /// The first two steps of [`Lanes::sum`]'s tree (lane j + 8, then j + 4) for four
    /// vectors: lanes `4i..4i + 4` of the result hold the four partial sums of `v[i]`.
    #[inline(always)]
    unsafe fn reduce4(v: [Self; 4]) -> Self {
        let mut out = [0.0f32; LANES];
        for (o, v) in out.chunks_exact_mut(4).zip(v) {
            let mut a = [0.0f32; LANES];
            // SAFETY: `a` and `out` hold sixteen values; the CPU has the features (contract).
            unsafe { v.store(a.as_mut_ptr()) };
            for (j, o) in o.iter_mut().enumerate() {
                *o = (a[j] + a[j + 8]) + (a[j + 4] + a[j + 12]);
            }
        }
        // SAFETY: as above.
        unsafe { Self::load(out.as_ptr()) }
    }
    /// The tree's last two steps (lane j + 2, then j + 1) for sixteen sums at once: lane
    /// `4i + m` of the result finishes the partial sums in lanes `4i..4i + 4` of `e[m]`
    /// ([`Lanes::reduce4`]'s output), so sixteen scores come out as one vector in lane order
    /// when `e[m]` holds the scores `m`, `m + 4`, `m + 8`, `m + 12`.
    #[inline(always)]
    unsafe fn finish16(e: [Self; 4]) -> Self {
        let mut out = [0.0f32; LANES];
        for (m, e) in e.into_iter().enumerate() {
            let mut y = [0.0f32; LANES];
            // SAFETY: sixteen values; the CPU has the features (contract).
            unsafe { e.store(y.as_mut_ptr()) };
            for (i, y) in y.chunks_exact(4).enumerate() {
                out[4 * i + m] = (y[0] + y[2]) + (y[1] + y[3]);
            }
        }
        // SAFETY: as above.
        unsafe { Self::load(out.as_ptr()) }
    }
    unsafe fn sub(self, b: Self) -> Self;
    /// The lane-wise minimum (of numbers, as [`Lanes::maximum`]).
    unsafe fn minimum(self, b: Self) -> Self;
    /// `2^n` per lane, for lanes holding whole numbers `n` in -126..=127.
    unsafe fn pow2(self) -> Self;
    /// [`crate::ops::exp`]'s special cases: per lane, 0 where `x` is below its range, infinity
    /// where above, `x` where it is NaN, else `self`.
    unsafe fn exp_specials(self, x: Self) -> Self;
}

/// [`crate::ops::exp`] on every lane, the same operations in the same order (so the same
/// bits): sixteen at once where the scalar loop would not vectorize.
///
/// # Safety
/// The CPU has `L`'s features.
#[inline(always)]
pub(super) unsafe fn exp<L: Lanes>(x: L) -> L {
    use crate::ops::exp_consts::*;
    // SAFETY (every call): the CPU has L's features (contract).
    unsafe {
        let xc = x.minimum(L::splat(HI)).maximum(L::splat(LO));
        let magic = L::splat(MAGIC);
        let n = xc.mul(L::splat(LOG2E)).add(magic).sub(magic);
        let r = xc.sub(n.mul(L::splat(C1))).sub(n.mul(L::splat(C2)));
        let mut p = L::splat(POLY[0]);
        for &c in &POLY[1..] {
            p = p.mul(r).add(L::splat(c));
        }
        let y = p.mul(r.mul(r)).add(r).add(L::splat(1.0));
        y.mul(n.pow2()).exp_specials(x)
    }
}

/// The reference order of [`Lanes::sum`].
#[inline(always)]
pub(super) fn tree_sum(mut a: [f32; LANES]) -> f32 {
    let mut w = LANES / 2;
    while w >= 1 {
        for j in 0..w {
            a[j] += a[j + w];
        }
        w /= 2;
    }
    a[0]
}

/// Plain Rust: what any CPU computes (`f32::mul_add` is a fused multiply-add everywhere).
#[derive(Clone, Copy)]
pub(super) struct Portable([f32; LANES]);

impl Lanes for Portable {
    const LIVE: usize = 32;
    #[inline(always)]
    unsafe fn zero() -> Self {
        Portable([0.0; LANES])
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        Portable([x; LANES])
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> Self {
        // SAFETY: `p` is valid for 16 values (trait contract).
        Portable(std::array::from_fn(|i| unsafe { *p.add(i) }))
    }
    #[inline(always)]
    unsafe fn load_f16(p: *const f16) -> Self {
        // SAFETY: as above.
        Portable(std::array::from_fn(|i| unsafe { (*p.add(i)).to_f32() }))
    }
    #[inline(always)]
    unsafe fn store(self, p: *mut f32) {
        for (i, v) in self.0.into_iter().enumerate() {
            // SAFETY: as above.
            unsafe { *p.add(i) = v };
        }
    }
    #[inline(always)]
    unsafe fn mul_add(self, b: Self, c: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i].mul_add(b.0[i], c.0[i])))
    }
    #[inline(always)]
    unsafe fn mul(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] * b.0[i]))
    }
    #[inline(always)]
    unsafe fn add(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] + b.0[i]))
    }
    #[inline(always)]
    unsafe fn max_all(self) -> f32 {
        self.0.into_iter().fold(f32::NEG_INFINITY, f32::max)
    }
    #[inline(always)]
    unsafe fn maximum(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i].max(b.0[i])))
    }
    #[inline(always)]
    unsafe fn sum(self) -> f32 {
        tree_sum(self.0)
    }
    #[inline(always)]
    unsafe fn sub(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i] - b.0[i]))
    }
    #[inline(always)]
    unsafe fn minimum(self, b: Self) -> Self {
        Portable(std::array::from_fn(|i| self.0[i].min(b.0[i])))
    }
    #[inline(always)]
    unsafe fn pow2(self) -> Self {
        Portable(std::array::from_fn(|i| {
            f32::from_bits((((self.0[i] as i32) + 127) as u32) << 23)
        }))
    }
    #[inline(always)]
    unsafe fn exp_specials(self, x: Self) -> Self {
        use crate::ops::exp_consts::{HI, LO};
        Portable(std::array::from_fn(|i| match x.0[i] {
            x if x.is_nan() => x,
            x if x < LO => 0.0,
            x if x > HI => f32::INFINITY,
            _ => self.0[i],
        }))
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{Avx2, Avx512};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{f16, Lanes};
    use std::arch::x86_64::*;

    /// The last three steps of the tree (lanes j + 4, j + 2, j + 1) on eight lanes.
    ///
    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    unsafe fn sum8(r8: __m256) -> f32 {
        let r4 = _mm_add_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps::<1>(r8));
        let r2 = _mm_add_ps(r4, _mm_movehl_ps(r4, r4));
        _mm_cvtss_f32(_mm_add_ss(r2, _mm_shuffle_ps::<1>(r2, r2)))
    }

    /// [`sum8`] of four registers at once: the tree's steps j + 4, j + 2 and j + 1 each done
    /// for all four side by side (lane j + w added to lane j, as in [`super::tree_sum`]).
    ///
    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    unsafe fn sums4_8(r: [__m256; 4]) -> [f32; 4] {
        // j + 4: each register's high half added to its low half, two registers per result
        // (r0 | r1 and r2 | r3 in the two 128-bit halves); j + 2: per half
        // [a0 + a2, a1 + a3, b0 + b2, b1 + b3] for a of t01, b of t23.
        let u = halves_in_blocks(halves_pair(r[0], r[1]), halves_pair(r[2], r[3]));
        // j + 1: lane 0 of each half holds t01's sum, lane 1 t23's.
        let s = _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(u, u),
            _mm256_shuffle_ps::<0b11_01_11_01>(u, u),
        );
        let mut out = [0.0f32; 8];
        // SAFETY: `out` holds eight values.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
        [out[0], out[4], out[1], out[5]]
    }

    /// [`Lanes::finish16`] on eight lanes (two 128-bit blocks of partial sums per register):
    /// lane `4i + m` of the result finishes block `i` of `e[m]`.
    ///
    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    unsafe fn finish8(e: [__m256; 4]) -> __m256 {
        // j + 2, then j + 1 (see `halves_in_blocks`).
        let f0 = halves_in_blocks(e[0], e[1]);
        let f1 = halves_in_blocks(e[2], e[3]);
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(f0, f1),
            _mm256_shuffle_ps::<0b11_01_11_01>(f0, f1),
        )
    }

    /// Per 128-bit block `[a0 + a2, a1 + a3, b0 + b2, b1 + b3]`.
    ///
    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    unsafe fn halves_in_blocks(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    }

    /// `[a's low half + its high half, b's low half + its high half]` (128-bit halves).
    ///
    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    unsafe fn halves_pair(a: __m256, b: __m256) -> __m256 {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    }

    /// The largest of eight lanes.
    ///
    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    unsafe fn max8(r8: __m256) -> f32 {
        let r4 = _mm_max_ps(_mm256_castps256_ps128(r8), _mm256_extractf128_ps::<1>(r8));
        let r2 = _mm_max_ps(r4, _mm_movehl_ps(r4, r4));
        _mm_cvtss_f32(_mm_max_ss(r2, _mm_shuffle_ps::<1>(r2, r2)))
    }

    /// `2^n` for eight lanes of whole numbers in -126..=127.
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    unsafe fn pow2_8(n: __m256) -> __m256 {
        let biased = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
        _mm256_castsi256_ps(_mm256_slli_epi32::<23>(biased))
    }

    /// [`Lanes::exp_specials`] on eight lanes.
    ///
    /// # Safety
    /// The CPU has AVX.
    #[inline(always)]
    unsafe fn exp_specials8(e: __m256, x: __m256) -> __m256 {
        use crate::ops::exp_consts::{HI, LO};
        let below = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(LO));
        let e = _mm256_blendv_ps(e, _mm256_setzero_ps(), below);
        let above = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(HI));
        let e = _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), above);
        _mm256_blendv_ps(e, x, _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x))
    }

    /// Lanes 0-7 and 8-15 in two AVX registers (with FMA and F16C).
    #[derive(Clone, Copy)]
    pub(in crate::attention) struct Avx2(__m256, __m256);

    // SAFETY (every method): only used on CPUs with AVX2, FMA and F16C, with pointers valid
    // for 16 values (trait contract); unaligned accesses.
    impl Lanes for Avx2 {
        const LIVE: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx2(_mm256_setzero_ps(), _mm256_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx2(_mm256_set1_ps(x), _mm256_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { Avx2(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))) }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const f16) -> Self {
            unsafe {
                Avx2(
                    _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                    _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())),
                )
            }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe {
                _mm256_storeu_ps(p, self.0);
                _mm256_storeu_ps(p.add(8), self.1);
            }
        }
        #[inline(always)]
        unsafe fn mul_add(self, b: Self, c: Self) -> Self {
            Avx2(
                _mm256_fmadd_ps(self.0, b.0, c.0),
                _mm256_fmadd_ps(self.1, b.1, c.1),
            )
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            Avx2(_mm256_mul_ps(self.0, b.0), _mm256_mul_ps(self.1, b.1))
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            Avx2(_mm256_add_ps(self.0, b.0), _mm256_add_ps(self.1, b.1))
        }
        #[inline(always)]
        unsafe fn max_all(self) -> f32 {
            unsafe { max8(_mm256_max_ps(self.0, self.1)) }
        }
        #[inline(always)]
        unsafe fn maximum(self, b: Self) -> Self {
            Avx2(_mm256_max_ps(self.0, b.0), _mm256_max_ps(self.1, b.1))
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            unsafe { sum8(_mm256_add_ps(self.0, self.1)) }
        }
        #[inline(always)]
        unsafe fn sums4(v: [Self; 4]) -> [f32; 4] {
            let [a, b, c, d] = v;
            unsafe {
                sums4_8([
                    _mm256_add_ps(a.0, a.1),
                    _mm256_add_ps(b.0, b.1),
                    _mm256_add_ps(c.0, c.1),
                    _mm256_add_ps(d.0, d.1),
                ])
            }
        }
        #[inline(always)]
        unsafe fn reduce4(v: [Self; 4]) -> Self {
            let [a, b, c, d] = v;
            unsafe {
                Avx2(
                    halves_pair(_mm256_add_ps(a.0, a.1), _mm256_add_ps(b.0, b.1)),
                    halves_pair(_mm256_add_ps(c.0, c.1), _mm256_add_ps(d.0, d.1)),
                )
            }
        }
        #[inline(always)]
        unsafe fn finish16(e: [Self; 4]) -> Self {
            let [a, b, c, d] = e;
            unsafe { Avx2(finish8([a.0, b.0, c.0, d.0]), finish8([a.1, b.1, c.1, d.1])) }
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            Avx2(_mm256_sub_ps(self.0, b.0), _mm256_sub_ps(self.1, b.1))
        }
        #[inline(always)]
        unsafe fn minimum(self, b: Self) -> Self {
            Avx2(_mm256_min_ps(self.0, b.0), _mm256_min_ps(self.1, b.1))
        }
        #[inline(always)]
        unsafe fn pow2(self) -> Self {
            unsafe { Avx2(pow2_8(self.0), pow2_8(self.1)) }
        }
        #[inline(always)]
        unsafe fn exp_specials(self, x: Self) -> Self {
            unsafe { Avx2(exp_specials8(self.0, x.0), exp_specials8(self.1, x.1)) }
        }
    }

    /// The tree's first step on sixteen lanes: lane j + 8 added to lane j.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    unsafe fn halves(x: __m512) -> __m256 {
        let lo = _mm512_castps512_ps256(x);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(x)));
        _mm256_add_ps(lo, hi)
    }

    /// `[a's blocks 0 + 2, 1 + 3, b's blocks 0 + 2, 1 + 3]` (128-bit blocks).
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    unsafe fn blocks_apart(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
            _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
        )
    }

    /// [`halves_in_blocks`] on four 128-bit blocks.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    unsafe fn halves_in_blocks16(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm512_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    }

    /// Sixteen lanes in one AVX-512 register.
    #[derive(Clone, Copy)]
    pub(in crate::attention) struct Avx512(__m512);

    // SAFETY (every method): only used on CPUs with AVX-512F, AVX2, FMA and F16C, with
    // pointers valid for 16 values (trait contract); unaligned accesses.
    impl Lanes for Avx512 {
        const LIVE: usize = 32;
        #[inline(always)]
        unsafe fn zero() -> Self {
            Avx512(_mm512_setzero_ps())
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            Avx512(_mm512_set1_ps(x))
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> Self {
            unsafe { Avx512(_mm512_loadu_ps(p)) }
        }
        #[inline(always)]
        unsafe fn load_f16(p: *const f16) -> Self {
            unsafe { Avx512(_mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))) }
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32) {
            unsafe { _mm512_storeu_ps(p, self.0) }
        }
        #[inline(always)]
        unsafe fn mul_add(self, b: Self, c: Self) -> Self {
            Avx512(_mm512_fmadd_ps(self.0, b.0, c.0))
        }
        #[inline(always)]
        unsafe fn mul(self, b: Self) -> Self {
            Avx512(_mm512_mul_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn add(self, b: Self) -> Self {
            Avx512(_mm512_add_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn maximum(self, b: Self) -> Self {
            Avx512(_mm512_max_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn max_all(self) -> f32 {
            let lo = _mm512_castps512_ps256(self.0);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
            unsafe { max8(_mm256_max_ps(lo, hi)) }
        }
        #[inline(always)]
        unsafe fn sum(self) -> f32 {
            unsafe { sum8(halves(self.0)) }
        }
        #[inline(always)]
        unsafe fn sums4(v: [Self; 4]) -> [f32; 4] {
            unsafe {
                sums4_8([
                    halves(v[0].0),
                    halves(v[1].0),
                    halves(v[2].0),
                    halves(v[3].0),
                ])
            }
        }
        #[inline(always)]
        unsafe fn reduce4(v: [Self; 4]) -> Self {
            unsafe {
                // j + 8: [a's blocks 0 + 2, 1 + 3, b's 0 + 2, 1 + 3] (128-bit blocks).
                let t01 = blocks_apart(v[0].0, v[1].0);
                let t23 = blocks_apart(v[2].0, v[3].0);
                // j + 4: [v0's blocks 0 + 1, v1's, v2's, v3's].
                Avx512(_mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(t01, t23),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(t01, t23),
                ))
            }
        }
        #[inline(always)]
        unsafe fn finish16(e: [Self; 4]) -> Self {
            unsafe {
                // As `finish8`, on four blocks.
                let f0 = halves_in_blocks16(e[0].0, e[1].0);
                let f1 = halves_in_blocks16(e[2].0, e[3].0);
                Avx512(_mm512_add_ps(
                    _mm512_shuffle_ps::<0b10_00_10_00>(f0, f1),
                    _mm512_shuffle_ps::<0b11_01_11_01>(f0, f1),
                ))
            }
        }
        #[inline(always)]
        unsafe fn sub(self, b: Self) -> Self {
            Avx512(_mm512_sub_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn minimum(self, b: Self) -> Self {
            Avx512(_mm512_min_ps(self.0, b.0))
        }
        #[inline(always)]
        unsafe fn pow2(self) -> Self {
            let n = _mm512_add_epi32(_mm512_cvttps_epi32(self.0), _mm512_set1_epi32(127));
            Avx512(_mm512_castsi512_ps(_mm512_slli_epi32::<23>(n)))
        }
        #[inline(always)]
        unsafe fn exp_specials(self, x: Self) -> Self {
            use crate::ops::exp_consts::{HI, LO};
            let (e, x) = (self.0, x.0);
            let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(LO));
            let e = _mm512_mask_blend_ps(below, e, _mm512_setzero_ps());
            let above = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(HI));
            let e = _mm512_mask_blend_ps(above, e, _mm512_set1_ps(f32::INFINITY));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
            Avx512(_mm512_mask_blend_ps(nan, e, x))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every f16 widens to the `half` crate's f32 (bit for bit, NaN payloads included), and
    /// the tree sum and maximum agree with the portable ones, on every backend this CPU has.
    fn backend_is_exact<L: Lanes>() {
        let all: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut got = [0.0f32; LANES];
        for chunk in all.chunks_exact(LANES) {
            // SAFETY: 16 values each; the caller checked the CPU.
            unsafe { L::load_f16(chunk.as_ptr()).store(got.as_mut_ptr()) };
            for (g, h) in got.iter().zip(chunk) {
                assert_eq!(g.to_bits(), h.to_f32().to_bits(), "{:#06x}", h.to_bits());
            }
            let finite: Vec<f32> = chunk
                .iter()
                .map(|h| h.to_f32())
                .filter(|x| x.is_finite())
                .collect();
            if finite.len() == LANES {
                let a: [f32; LANES] = finite.try_into().unwrap();
                // SAFETY: as above.
                let (sum, max) = unsafe {
                    let v = L::load(a.as_ptr());
                    (v.sum(), v.max_all())
                };
                assert_eq!(sum.to_bits(), tree_sum(a).to_bits());
                // Four at once, each its own tree: the lanes rotated by 0, 3, 6, 9.
                let rot: [[f32; LANES]; 4] =
                    std::array::from_fn(|k| std::array::from_fn(|i| a[(i + 3 * k) % LANES]));
                // SAFETY: as above.
                let sums = unsafe { L::sums4(rot.map(|r| L::load(r.as_ptr()))) };
                for (got, r) in sums.iter().zip(rot) {
                    assert_eq!(got.to_bits(), tree_sum(r).to_bits());
                }
                assert_eq!(max, a.iter().copied().fold(f32::NEG_INFINITY, f32::max));
                // Sixteen at once, score 4i + m from e[m]'s block i: the lanes rotated by r.
                let rots: [[f32; LANES]; LANES] =
                    std::array::from_fn(|r| std::array::from_fn(|i| a[(i + 5 * r) % LANES]));
                // SAFETY: as above.
                let all = unsafe {
                    let e: [L; 4] = std::array::from_fn(|m| {
                        L::reduce4(std::array::from_fn(|i| L::load(rots[4 * i + m].as_ptr())))
                    });
                    let mut all = [0.0f32; LANES];
                    L::finish16(e).store(all.as_mut_ptr());
                    all
                };
                for (got, r) in all.iter().zip(rots) {
                    assert_eq!(got.to_bits(), tree_sum(r).to_bits());
                }
            }
        }
    }

    /// The sixteen-lane exp gives `ops::exp`'s bits on a sweep of every exponent's range
    /// (each f32 bit pattern with a stride, so all signs, exponents and the specials).
    fn exp_is_exact<L: Lanes>() {
        let mut xs: Vec<f32> = (0..=u32::MAX).step_by(4099).map(f32::from_bits).collect();
        let specials = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -87.68,
            88.37,
        ];
        xs.extend(specials);
        xs.extend((-2000..2000).map(|i| i as f32 * 0.05));
        xs.resize(xs.len().next_multiple_of(LANES), 1.0);
        let mut got = [0.0f32; LANES];
        for chunk in xs.chunks_exact(LANES) {
            // SAFETY: 16 values each; the caller checked the CPU.
            unsafe { exp(L::load(chunk.as_ptr())).store(got.as_mut_ptr()) };
            for (g, &x) in got.iter().zip(chunk) {
                let want = crate::ops::exp(x);
                assert!(
                    g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                    "exp({x:e}): {g:e}, scalar {want:e}"
                );
            }
        }
    }

    #[test]
    fn every_backend_computes_exp_exactly() {
        exp_is_exact::<Portable>();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                exp_is_exact::<Avx2>();
            }
            if has!("avx512f") && has!("f16c") {
                exp_is_exact::<Avx512>();
            }
        }
    }

    #[test]
    fn every_backend_widens_sums_and_maximises_exactly() {
        backend_is_exact::<Portable>();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx2") && has!("fma") && has!("f16c") {
                backend_is_exact::<Avx2>();
            }
            if has!("avx512f") && has!("f16c") {
                backend_is_exact::<Avx512>();
            }
        }
    }
}
