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

    /// Lanes 0-7 and 8-15 in two AVX registers (with FMA and F16C).
    #[derive(Clone, Copy)]
    pub(in crate::attention) struct Avx2(__m256, __m256);

    // SAFETY (every method): only used on CPUs with AVX2, FMA and F16C, with pointers valid
    // for 16 values (trait contract); unaligned accesses.
    impl Lanes for Avx2 {
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
    }

    /// Sixteen lanes in one AVX-512 register.
    #[derive(Clone, Copy)]
    pub(in crate::attention) struct Avx512(__m512);

    // SAFETY (every method): only used on CPUs with AVX-512F, AVX2, FMA and F16C, with
    // pointers valid for 16 values (trait contract); unaligned accesses.
    impl Lanes for Avx512 {
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
            let lo = _mm512_castps512_ps256(self.0);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
            unsafe { sum8(_mm256_add_ps(lo, hi)) }
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
                assert_eq!(max, a.iter().copied().fold(f32::NEG_INFINITY, f32::max));
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
