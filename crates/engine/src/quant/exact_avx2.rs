//! The exact products of `exact.rs` in AVX2 + F16C: the same sums in the same order, so the
//! bits of its scalar reference (also the AVX-512 kernel's path: these products are short
//! rows whose cost is per row, not per byte).
//!
//! A block of `m` groups keeps its runs of `4m` lanes in `V = m / 2` vectors: lane `x` of
//! vector `j` is lane `8j + x` of the run. Each lane's eight products (one per run) are added
//! by the scalar code's tree (`exact::lane_sum`; multiplies and adds rounded as there, no fused
//! multiply-add). Two horizontal adds of four such vectors (eight groups) give each group's
//! `(l0 + l1) + (l2 + l3)` in the lanes `exact::OCTET_LANE` names; the groups' scales, permuted
//! to match, multiply them into the row's eight totals, reduced at the row's end by the scalar
//! code's tree. A product whose rows end in a block of an odd number of groups (`cols / 32`
//! odd past the last multiple of 16) takes the scalar reference instead ([`takes`]).

use std::arch::x86_64::*;

use super::exact::{Format, StoredActs};
use super::q4::{BLOCK_GROUPS, BLOCK_NIBBLES};
use super::q8w::BLOCK_VALUES;
use super::{OutView, GROUP};

/// Whether this kernel takes rows of `groups` groups: every block's group count even.
pub(super) fn takes(groups: usize) -> bool {
    (groups % BLOCK_GROUPS).is_multiple_of(2)
}

/// `exact::lane_sum`'s tree built as the runs come: `s` the sum of runs `2k` and `2k + 1`,
/// `prev` the last such sum, `half` the first half's; the lane sums once `k = 3`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn grow(k: usize, s: __m256, prev: &mut __m256, half: &mut __m256) -> __m256 {
    match k {
        0 | 2 => {
            *prev = s;
            s
        }
        1 => {
            *half = _mm256_add_ps(*prev, s);
            *half
        }
        _ => _mm256_add_ps(*half, _mm256_add_ps(*prev, s)),
    }
}

/// Eight int8 weights widened to f32.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn widen(w: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(w))
}

/// `T` tokens' lanes `8j..8j + 8` and, when `TWO`, `8j + 8..8j + 16` of int4 block `nib`: its
/// four nibble runs of `run` bytes, lane run `2k` the low nibbles of nibble run `k`, `2k + 1`
/// the high ones; each token's activations `xs[t]` in stored order. The weights are widened
/// once for the `T` tokens.
///
/// # Safety
/// AVX2; `nib` holds `4 run` bytes and each `xs[t]` `8 run` floats, `8j + 8` (`+ 16` when
/// `TWO`) <= `run`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_lanes<const T: usize, const TWO: bool>(
    nib: *const u8,
    xs: [*const f32; T],
    run: usize,
    j: usize,
) -> [[__m256; 2]; T] {
    let low = _mm_set1_epi8(0x0f);
    let eight = _mm_set1_epi8(8);
    let zero = _mm256_setzero_ps();
    let mut out = [[zero; 2]; T];
    let (mut prev, mut half) = ([[zero; 2]; T], [[zero; 2]; T]);
    for k in 0..4 {
        // SAFETY: inside the ranges the caller gives.
        let b = unsafe {
            let at = nib.add(k * run + 8 * j).cast();
            if TWO {
                _mm_loadu_si128(at)
            } else {
                _mm_loadl_epi64(at)
            }
        };
        let lo = _mm_sub_epi8(_mm_and_si128(b, low), eight);
        let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), low), eight);
        let w = [
            (widen(lo), widen(hi)),
            (widen(_mm_srli_si128(lo, 8)), widen(_mm_srli_si128(hi, 8))),
        ];
        for t in 0..T {
            for (i, &(wl, wh)) in w.iter().enumerate().take(1 + usize::from(TWO)) {
                // SAFETY: inside the `xs` ranges the caller gives.
                let (xl, xh) = unsafe {
                    let at = xs[t].add(8 * (j + i));
                    (
                        _mm256_loadu_ps(at.add(2 * k * run)),
                        _mm256_loadu_ps(at.add((2 * k + 1) * run)),
                    )
                };
                let s = _mm256_add_ps(_mm256_mul_ps(wl, xl), _mm256_mul_ps(wh, xh));
                out[t][i] = grow(k, s, &mut prev[t][i], &mut half[t][i]);
            }
        }
    }
    out
}

/// `T` tokens' lanes of int4 block `nib` (`32V` bytes), activations `xs[t]` (`64V` floats).
///
/// # Safety
/// AVX2; the ranges as said.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_block<const V: usize, const T: usize>(
    nib: *const u8,
    xs: [*const f32; T],
) -> [[__m256; V]; T] {
    let mut acc = [[_mm256_setzero_ps(); V]; T];
    let mut j = 0;
    // SAFETY: lanes `8j..8j + 16` (or `+ 8`) are inside the block.
    unsafe {
        while j + 2 <= V {
            let l = q4_lanes::<T, true>(nib, xs, 8 * V, j);
            for t in 0..T {
                (acc[t][j], acc[t][j + 1]) = (l[t][0], l[t][1]);
            }
            j += 2;
        }
        if j < V {
            let l = q4_lanes::<T, false>(nib, xs, 8 * V, j);
            for t in 0..T {
                acc[t][j] = l[t][0];
            }
        }
    }
    acc
}

/// `T` tokens' lanes of 8-bit block `vals` (eight runs of `8V` bytes).
///
/// # Safety
/// AVX2; `vals` holds `64V` bytes and each `xs[t]` `64V` floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::needless_range_loop)] // `j` is also the vector's offset in each run
unsafe fn q8_block<const V: usize, const T: usize>(
    vals: *const u8,
    xs: [*const f32; T],
) -> [[__m256; V]; T] {
    let run = 8 * V;
    let zero = _mm256_setzero_ps();
    let mut acc = [[zero; V]; T];
    for j in 0..V {
        let (mut prev, mut half) = ([zero; T], [zero; T]);
        for k in 0..4 {
            let (v0, v1) = (2 * k * run + 8 * j, (2 * k + 1) * run + 8 * j);
            // SAFETY: inside the ranges the caller gives.
            let (w0, w1) = unsafe {
                (
                    widen(_mm_loadl_epi64(vals.add(v0).cast())),
                    widen(_mm_loadl_epi64(vals.add(v1).cast())),
                )
            };
            for t in 0..T {
                // SAFETY: inside the ranges the caller gives.
                let s = unsafe {
                    _mm256_add_ps(
                        _mm256_mul_ps(w0, _mm256_loadu_ps(xs[t].add(v0))),
                        _mm256_mul_ps(w1, _mm256_loadu_ps(xs[t].add(v1))),
                    )
                };
                acc[t][j] = grow(k, s, &mut prev[t], &mut half[t]);
            }
        }
    }
    acc
}

/// A block's `2V` scaled group sums added to the row's totals `t`; `scales` the block's f16
/// scales (`4V` bytes).
///
/// # Safety
/// AVX2 and F16C; `scales` holds `4V` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn fold<const V: usize>(acc: &[__m256; V], scales: *const u8, mut t: __m256) -> __m256 {
    let m = 2 * V;
    // Scale lanes in `exact::OCTET_LANE`'s order: [s0, s2, s4, s6, s1, s3, s5, s7].
    let perm = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    let zero = _mm256_setzero_ps();
    for o in 0..m.div_ceil(8) {
        let a = |i: usize| if 4 * o + i < V { acc[4 * o + i] } else { zero };
        let g = _mm256_hadd_ps(_mm256_hadd_ps(a(0), a(1)), _mm256_hadd_ps(a(2), a(3)));
        // The octet's `c` halves (`c` even: whole dwords), the rest zero.
        let c = (m - 8 * o).min(8) as i32;
        let mask = _mm_setr_epi32(
            -i32::from(c > 0),
            -i32::from(c > 2),
            -i32::from(c > 4),
            -i32::from(c > 6),
        );
        // SAFETY: the mask loads the octet's `2c` bytes only, inside `scales`.
        let h = unsafe { _mm_maskload_epi32(scales.add(16 * o).cast(), mask) };
        let s = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(h), perm);
        t = _mm256_add_ps(t, _mm256_mul_ps(s, g));
    }
    t
}

/// `((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7))`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn row_total(t: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

/// Calls `$body` with `V` the const generic for a block of `$m` (even) groups.
macro_rules! with_v {
    ($m:expr, $body:ident :: < _, $t:literal > ( $($arg:expr),* )) => {
        match $m / 2 {
            1 => $body::<1, $t>($($arg),*),
            2 => $body::<2, $t>($($arg),*),
            3 => $body::<3, $t>($($arg),*),
            4 => $body::<4, $t>($($arg),*),
            5 => $body::<5, $t>($($arg),*),
            6 => $body::<6, $t>($($arg),*),
            7 => $body::<7, $t>($($arg),*),
            _ => $body::<8, $t>($($arg),*),
        }
    };
}

/// Block `b` (`2V` groups) of one row for `T` tokens, added to their totals `t`.
///
/// # Safety
/// AVX2 and F16C; `s` and `v` the row's scale and value bytes, `b` one of its blocks of `2V`
/// groups, `xs[i]` token `i`'s activations from the block's start (`64V` floats).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn block<const V: usize, const T: usize>(
    f: Format,
    (s, v): (&[u8], &[u8]),
    b: usize,
    xs: [&[f32]; T],
    t: &mut [__m256; T],
) {
    let scales = s[2 * b * BLOCK_GROUPS..][..4 * V].as_ptr();
    let xs = xs.map(|x| x[..64 * V].as_ptr());
    // SAFETY: the ranges are checked by the slicing here.
    unsafe {
        let acc = match f {
            Format::Q4 => q4_block::<V, T>(v[b * BLOCK_NIBBLES..][..32 * V].as_ptr(), xs),
            Format::Q8 => q8_block::<V, T>(v[b * BLOCK_VALUES..][..64 * V].as_ptr(), xs),
        };
        for (ti, a) in t.iter_mut().zip(&acc) {
            *ti = fold::<V>(a, scales, *ti);
        }
    }
}

/// `out[t][r]` for the view's rows and every token of `x` ([`takes`] the rows' groups).
///
/// Tokens go two at a time (each block's weights widened once for both), a last odd one
/// alone; their totals stay in registers through the row's blocks (through memory, a
/// 32-byte store read back as two halves stalls store forwarding).
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows_into<'w>(
    f: Format,
    row: &impl Fn(usize) -> (&'w [u8], &'w [u8]),
    x: &StoredActs,
    out: &mut OutView,
) {
    let groups = x.kp / GROUP;
    assert!(takes(groups));
    let blocks = groups.div_ceil(BLOCK_GROUPS);
    let block_groups = |b: usize| (groups - b * BLOCK_GROUPS).min(BLOCK_GROUPS);
    let acts = |tok: usize, b: usize| &x.x[tok * x.kp + b * BLOCK_VALUES..];
    for r in out.rows() {
        let bytes = row(r);
        let mut tok = 0;
        while tok + 2 <= x.n {
            let mut t = [_mm256_setzero_ps(); 2];
            for b in 0..blocks {
                let xs = [acts(tok, b), acts(tok + 1, b)];
                // SAFETY: this function's features; block `b` has that many (even) groups.
                unsafe { with_v!(block_groups(b), block::<_, 2>(f, bytes, b, xs, &mut t)) };
            }
            out.set(tok, r, row_total(t[0]));
            out.set(tok + 1, r, row_total(t[1]));
            tok += 2;
        }
        if tok < x.n {
            let mut t = [_mm256_setzero_ps()];
            for b in 0..blocks {
                let xs = [acts(tok, b)];
                // SAFETY: as above.
                unsafe { with_v!(block_groups(b), block::<_, 1>(f, bytes, b, xs, &mut t)) };
            }
            out.set(tok, r, row_total(t[0]));
        }
    }
}
