//! What a 16-level table in place of int4's linear grid would cost the AVX2 kernel (issue 33).
//!
//! A non-uniform table of 16 levels (one f16 scale per 32 weights, the same 4.5 bits a weight)
//! rounds Gaussian weights with 0.73-0.81x Q4_0's squared error where colibri's linear grid
//! reaches 0.887x (`benchmarks/int4_table_headroom.py`). Its kernel looks each nibble up
//! (`pshufb`) and, without VNNI, must widen its i16 sums more often: the levels' range bounds
//! how many `maddubs` pairs an i16 lane can add before overflowing (linear 0..15: eight; a
//! 5-bit table 0..31: four; a 6-bit table 0..63: two). Or the levels stay signed and small and
//! the sign moves onto the activations (`psignb`, per token: the "signed" forms). This
//! measures the integer inner loop of the engine's AVX2 kernel (one row, four tokens a tile, as
//! the prefill, from cache; one token, as the decode, streamed past the L3) in each form on
//! random data, each form its own monomorphised loop, thread CPU time, median of rounds,
//! alternated. Measured 2026-12-07 (AMD EPYC, AVX2 without VNNI), docs/PERFORMANCE.md.
//!
//!     cargo run --release --example table_bench [ROUNDS]
#![allow(clippy::needless_range_loop)]

mod common;

use std::arch::x86_64::*;

/// How many `maddubs` results an i16 lane adds before one widening `madd`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Form {
    Linear,
    Table5,
    Table6,
    /// Signed levels, |level| <= 16, applied by the sign trick: `maddubs(|w|, sign(a, w))`
    /// pairs are at most 2 * 16 * 127 = 4064, so eight add up in an i16 lane as the linear
    /// grid's do; two `psignb` a dword pair and two more lookups.
    Signed5,
    /// The same with |level| <= 32: four pairs an i16 lane.
    Signed6,
}

/// Dots of `rows` rows (each `groups` groups of 32 nibbles, laid out as the engine's blocks:
/// per 16 groups, four 64-byte chunks whose half h holds one dword of each of 8 groups) with
/// `T` activation vectors; returns a checksum so nothing is optimised away.
///
/// # Safety
/// The CPU has AVX2 and FMA; `w` holds `rows * groups * 16` bytes, each `a[t]` `groups * 32`.
#[target_feature(enable = "avx2,fma")]
unsafe fn dots<const F: u8, const T: usize>(
    w: &[u8],
    rows: usize,
    groups: usize,
    a: [&[i8]; T],
) -> f32 {
    let form = FORMS[F as usize].0;
    // SAFETY: every load below is inside `w` or an activation vector (contract, block math).
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        // An unsigned table in the levels' range (values only shape the cost, not the timing).
        let table = match form {
            Form::Linear => _mm256_setzero_si256(),
            Form::Table5 => _mm256_setr_epi8(
                0, 3, 6, 8, 10, 12, 14, 15, 16, 17, 19, 21, 23, 25, 28, 31, 0, 3, 6, 8, 10, 12, 14,
                15, 16, 17, 19, 21, 23, 25, 28, 31,
            ),
            Form::Table6 => _mm256_setr_epi8(
                0, 6, 11, 16, 20, 23, 26, 29, 32, 35, 38, 41, 45, 49, 54, 60, 0, 6, 11, 16, 20, 23,
                26, 29, 32, 35, 38, 41, 45, 49, 54, 60,
            ),
            Form::Signed5 => _mm256_setr_epi8(
                -16, -13, -10, -8, -6, -4, -2, -1, 0, 1, 3, 5, 7, 9, 12, 16, -16, -13, -10, -8, -6,
                -4, -2, -1, 0, 1, 3, 5, 7, 9, 12, 16,
            ),
            Form::Signed6 => _mm256_setr_epi8(
                -32, -26, -21, -16, -12, -9, -6, -3, 0, 3, 6, 9, 13, 17, 22, 28, -32, -26, -21,
                -16, -12, -9, -6, -3, 0, 3, 6, 9, 13, 17, 22, 28,
            ),
        };
        let signed = matches!(form, Form::Signed5 | Form::Signed6);
        let magnitude = _mm256_abs_epi8(table);
        let ones = _mm256_set1_epi16(1);
        let mut sum = _mm256_setzero_ps();
        let nb = groups / 16;
        for r in 0..rows {
            let q = w.as_ptr().add(r * groups * 16);
            let mut acc = [_mm256_setzero_ps(); T];
            for c in 0..nb {
                for h in 0..2 {
                    let mut lanes = [_mm256_setzero_si256(); T];
                    let mut part = [_mm256_setzero_si256(); T];
                    for k in 0..4 {
                        let v = _mm256_loadu_si256(q.add(c * 256 + k * 64 + h * 32).cast());
                        let nlo = _mm256_and_si256(v, m4);
                        let nhi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        let (mut wlo, mut whi) = (nlo, nhi);
                        let (mut slo, mut shi) = (nlo, nhi);
                        if signed {
                            wlo = _mm256_shuffle_epi8(magnitude, nlo);
                            whi = _mm256_shuffle_epi8(magnitude, nhi);
                            slo = _mm256_shuffle_epi8(table, nlo);
                            shi = _mm256_shuffle_epi8(table, nhi);
                        } else if !matches!(form, Form::Linear) {
                            wlo = _mm256_shuffle_epi8(table, nlo);
                            whi = _mm256_shuffle_epi8(table, nhi);
                        }
                        let aoff = c * 512 + k * 128 + h * 32;
                        for t in 0..T {
                            let ap = a[t].as_ptr();
                            let mut alo = _mm256_loadu_si256(ap.add(aoff).cast());
                            let mut ahi = _mm256_loadu_si256(ap.add(aoff + 64).cast());
                            if signed {
                                alo = _mm256_sign_epi8(alo, slo);
                                ahi = _mm256_sign_epi8(ahi, shi);
                            }
                            let p = _mm256_add_epi16(
                                _mm256_maddubs_epi16(wlo, alo),
                                _mm256_maddubs_epi16(whi, ahi),
                            );
                            let widen = match form {
                                Form::Linear | Form::Signed5 => false,
                                Form::Table5 | Form::Signed6 => k == 1,
                                Form::Table6 => true,
                            };
                            part[t] = _mm256_add_epi16(part[t], p);
                            if widen {
                                lanes[t] =
                                    _mm256_add_epi32(lanes[t], _mm256_madd_epi16(part[t], ones));
                                part[t] = _mm256_setzero_si256();
                            }
                        }
                    }
                    for t in 0..T {
                        if !matches!(form, Form::Table6) {
                            lanes[t] = _mm256_add_epi32(lanes[t], _mm256_madd_epi16(part[t], ones));
                        }
                        acc[t] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(lanes[t]),
                            _mm256_set1_ps(1e-3),
                            acc[t],
                        );
                    }
                }
            }
            for t in 0..T {
                sum = _mm256_add_ps(sum, acc[t]);
            }
        }
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), sum);
        out.iter().sum()
    }
}

/// The forms measured, in the order `dots`' `F` indexes them.
const FORMS: [(Form, &str); 5] = [
    (Form::Linear, "linear 0..15"),
    (Form::Table5, "table 0..31"),
    (Form::Table6, "table 0..63"),
    (Form::Signed5, "signed |16|"),
    (Form::Signed6, "signed |32|"),
];

/// `dots` specialised for form `i` (each its own monomorphised loop, no form branches).
///
/// # Safety
/// As `dots`.
unsafe fn dots_of<const T: usize>(
    i: usize,
    w: &[u8],
    rows: usize,
    groups: usize,
    a: [&[i8]; T],
) -> f32 {
    // SAFETY: forwarded contract.
    unsafe {
        match i {
            0 => dots::<0, T>(w, rows, groups, a),
            1 => dots::<1, T>(w, rows, groups, a),
            2 => dots::<2, T>(w, rows, groups, a),
            3 => dots::<3, T>(w, rows, groups, a),
            _ => dots::<4, T>(w, rows, groups, a),
        }
    }
}

fn random_bytes(n: usize, seed: &mut u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            (*seed >> 24) as u8
        })
        .collect()
}

fn main() {
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    let rounds: usize = std::env::args().nth(1).map_or(9, |s| s.parse().unwrap());
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let groups = 4096 / 32;
    // From cache: 256 rows (512 KB of nibbles) x 4 tokens, many passes (the prefill's case).
    let hot_rows = 256;
    let hot = random_bytes(hot_rows * groups * 16, &mut seed);
    // Streamed: 16384 rows (32 MB, past the L3) x 1 token (the decode's case).
    let cold_rows = 16384;
    let cold = random_bytes(cold_rows * groups * 16, &mut seed);
    let acts: Vec<Vec<i8>> = (0..4)
        .map(|_| {
            random_bytes(groups * 32, &mut seed)
                .into_iter()
                .map(|b| (b as i8).max(-127))
                .collect()
        })
        .collect();
    let a4 = [&acts[0][..], &acts[1][..], &acts[2][..], &acts[3][..]];
    let forms = FORMS;
    let mut hot_t = vec![Vec::new(); forms.len()];
    let mut cold_t = vec![Vec::new(); forms.len()];
    let mut check = 0.0f32;
    for _ in 0..rounds {
        for i in 0..forms.len() {
            let t0 = common::thread_cpu_time();
            for _ in 0..20 {
                // SAFETY: AVX2 and FMA checked above; sizes as the contract says.
                check += unsafe { dots_of::<4>(i, &hot, hot_rows, groups, a4) };
            }
            hot_t[i].push((common::thread_cpu_time() - t0) / 20.0);
            let t0 = common::thread_cpu_time();
            // SAFETY: as above.
            check += unsafe { dots_of::<1>(i, &cold, cold_rows, groups, [a4[0]]) };
            cold_t[i].push(common::thread_cpu_time() - t0);
        }
    }
    let base_hot = common::median(hot_t[0].clone());
    let base_cold = common::median(cold_t[0].clone());
    println!("{rounds} rounds, one thread, thread CPU time, medians (checksum {check:e})");
    for (i, (_, name)) in forms.iter().enumerate() {
        let h = common::median(hot_t[i].clone());
        let c = common::median(cold_t[i].clone());
        println!(
            "  {name:13} from cache x4 tokens {:7.3} ms ({:.3}x)   \
             streamed x1 token {:7.3} ms ({:.3}x)",
            h * 1e3,
            h / base_hot,
            c * 1e3,
            c / base_cold
        );
    }
}
