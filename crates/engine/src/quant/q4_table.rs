//! The table grid's quantizer ([`Grid::Table`]): per group of 32, the f16 scale whose rounding
//! to [`TABLE_LEVELS`] minimises the (weighted) squared error, by the linear grid's search
//! (`q4::search_scale`: candidate scales, each with its codes rounded and its scale refit by
//! least squares, the error in closed form; then two rounds of re-rounding with the best
//! scale) over this grid's candidates and rounding. The winner is checked against the table's max-abs rounding (the
//! group's largest-magnitude value on the -16 end, or on the +15 end) by direct error, so a
//! group never ends worse than that.

// Eight lanes of partial sums indexed by lane, as in `q4`, so the loops auto-vectorize.
#![allow(clippy::needless_range_loop)]

use half::f16;

use super::q4::{largest, search_scale, weigh, Grid, GROUP, TABLE_LEVELS};

/// `NEAREST[k]`: the code of the level nearest to `t` for `floor(2t) = k - 32` (`k` in 0..63;
/// `2t` clamped to -32..=30 first, beyond which the ends are nearest). The midpoints between
/// neighbouring levels are multiples of 0.5, so `floor(2t)` decides; a tie goes to the upper
/// level.
const NEAREST: [u8; 63] = {
    let mut t = [0u8; 63];
    let mut k = 0;
    while k < 63 {
        let u = k as i32 - 32;
        let mut code = 0;
        let mut i = 0;
        while i < 15 {
            // Twice the midpoint between levels i and i + 1.
            if TABLE_LEVELS[i] as i32 + TABLE_LEVELS[i + 1] as i32 <= u {
                code = i + 1;
            }
            i += 1;
        }
        t[k] = code as u8;
        k += 1;
    }
    t
};

/// Target positions (in units of the scale) of the group's largest-magnitude value tried by the
/// search: on the -16 end (negative) or the +15 end, a little inside or beyond (clipped).
const CANDIDATES: [f32; 17] = [
    -18.0, -17.5, -17.0, -16.5, -16.0, -15.5, -15.0, -14.5, -14.0, 13.5, 14.0, 14.5, 15.0, 15.5,
    16.0, 16.5, 17.0,
];

/// The code of the level nearest to `x * is`.
#[inline(always)]
fn nearest(x: f32, is: f32) -> u8 {
    // max/min return the non-NaN operand, so u is in [0, 62] whatever x and is are.
    #[allow(clippy::manual_clamp)]
    let u = (x * is * 2.0 + 32.0).max(0.0).min(62.0);
    // SAFETY: u is a finite value in [0, 62], representable as i32.
    NEAREST[unsafe { u.to_int_unchecked::<i32>() } as usize]
}

/// The group's weighted squared error `sum w (x - level(q) d)^2`.
#[inline(always)]
fn group_err<const W: bool>(x: &[f32; GROUP], q: &[u8; GROUP], d: f32, wt: &[f32; GROUP]) -> f32 {
    let mut e = [0.0f32; 8];
    for k in 0..GROUP / 8 {
        for l in 0..8 {
            let i = k * 8 + l;
            let r = x[i] - Grid::Table.level(q[i]) as f32 * d;
            e[l] += weigh::<W>(wt[i], r * r);
        }
    }
    e.iter().sum()
}

/// Rounds with inverse scale `is` into `q` and returns `(sum w x l, sum w l^2)` over the
/// levels `l`.
#[inline(always)]
fn quant_sums<const W: bool>(
    x: &[f32; GROUP],
    wt: &[f32; GROUP],
    is: f32,
    q: &mut [u8; GROUP],
) -> (f32, f32) {
    let mut sxq = [0.0f32; 8];
    let mut sqq = [0.0f32; 8];
    for k in 0..GROUP / 8 {
        for l in 0..8 {
            let i = k * 8 + l;
            q[i] = nearest(x[i], is);
            let c = Grid::Table.level(q[i]) as f32;
            sxq[l] += weigh::<W>(wt[i], x[i]) * c;
            sqq[l] += weigh::<W>(wt[i], c) * c;
        }
    }
    (sxq.iter().sum(), sqq.iter().sum())
}

/// The table's max-abs rounding: `m`, the value of largest magnitude, on the level `end`
/// (-16 or 15); the scale in f16.
#[inline(always)]
fn max_abs(x: &[f32; GROUP], m: f32, end: f32, q: &mut [u8; GROUP]) -> f16 {
    let d = f16::from_f32(m / end);
    let df = d.to_f32();
    let is = if df != 0.0 && df.is_finite() {
        1.0 / df
    } else {
        0.0
    };
    for (qi, &v) in q.iter_mut().zip(x) {
        *qi = nearest(v, is);
    }
    d
}

/// Quantizes one group on the table grid into codes `q` and returns its scale, minimising the
/// squared error weighted per column by `wt` (read only when `W`).
#[inline(always)]
pub(super) fn quantize_group<const W: bool>(
    x: &[f32; GROUP],
    wt: &[f32; GROUP],
    q: &mut [u8; GROUP],
) -> f16 {
    let (m, amax) = largest(x);
    if amax == 0.0 || !amax.is_finite() {
        // All zero (or not finite: give up on the group rather than emit NaN scales).
        q.fill(8);
        return f16::ZERO;
    }
    let best = search_scale::<W>(x, wt, m, &CANDIDATES, |is, q| quant_sums::<W>(x, wt, is, q));
    // The max-abs roundings, by direct error (the search's errors are estimates in f64).
    let mut alt = [0u8; GROUP];
    let d_lo = max_abs(x, m, -16.0, q);
    let d_hi = max_abs(x, m, 15.0, &mut alt);
    let (mut d, mut e) = (d_lo, group_err::<W>(x, q, d_lo.to_f32(), wt));
    let e_hi = group_err::<W>(x, &alt, d_hi.to_f32(), wt);
    if e_hi < e || !e.is_finite() {
        (d, e) = (d_hi, e_hi);
        *q = alt;
    }
    match best {
        Some((bd, bq)) if group_err::<W>(x, &bq, bd.to_f32(), wt) < e || !e.is_finite() => {
            *q = bq;
            bd
        }
        _ => d,
    }
}

/// The table's max-abs rounding of one group (for tests: the baseline the search must not
/// lose to): the better of the largest value on either end, by weighted error.
#[cfg(test)]
pub(super) fn max_abs_group<const W: bool>(
    x: &[f32; GROUP],
    wt: &[f32; GROUP],
    q: &mut [u8; GROUP],
) -> f16 {
    let (m, _) = largest(x);
    if m == 0.0 || !m.is_finite() {
        q.fill(8);
        return f16::ZERO;
    }
    let mut alt = [0u8; GROUP];
    let d_lo = max_abs(x, m, -16.0, q);
    let d_hi = max_abs(x, m, 15.0, &mut alt);
    if group_err::<W>(x, &alt, d_hi.to_f32(), wt) < group_err::<W>(x, q, d_lo.to_f32(), wt) {
        *q = alt;
        d_hi
    } else {
        d_lo
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::q4::ONES;
    use crate::quant::{quantize_q4, quantize_q4_0_rtn, quantize_q4_table, Q4Matrix};
    use crate::testutil::gauss;

    fn sq_err(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum()
    }

    #[test]
    fn nearest_is_the_nearest_level() {
        for i in -700..700 {
            let t = i as f32 / 20.0;
            let code = nearest(t, 1.0);
            let got = (t - Grid::Table.level(code) as f32).abs();
            for (c, &l) in TABLE_LEVELS.iter().enumerate() {
                assert!(
                    got <= (t - l as f32).abs(),
                    "{t}: code {code}, but {c} is nearer"
                );
            }
        }
    }

    /// The errors the design measured: below Q4_0's and the linear grid's search, on Gaussian
    /// and heavy-tailed (Student-t, 4 degrees) weights.
    #[test]
    fn table_rounds_closer_than_q4_0_and_the_linear_grid() {
        let (rows, cols) = (128, 256);
        let gaussian = gauss(rows * cols, 11);
        // Student-t with 4 degrees of freedom: a Gaussian over the root of a chi-square / 4.
        let chi = gauss(rows * cols * 4, 12);
        let heavy: Vec<f32> = gaussian
            .iter()
            .enumerate()
            .map(|(i, &z)| {
                let c: f32 = chi[4 * i..4 * i + 4].iter().map(|v| v * v).sum();
                z / (c / 4.0).sqrt().max(1e-3)
            })
            .collect();
        for (what, w, most) in [("gaussian", &gaussian, 0.82), ("t4", &heavy, 0.66)] {
            let deq = |bytes: Vec<u8>, grid| {
                Q4Matrix::on_grid(&bytes, rows, cols, grid)
                    .unwrap()
                    .dequantize()
            };
            let q4_0 = sq_err(w, &deq(quantize_q4_0_rtn(w, rows, cols), Grid::Linear));
            let linear = sq_err(w, &deq(quantize_q4(w, rows, cols), Grid::Linear)) / q4_0;
            let table = sq_err(w, &deq(quantize_q4_table(w, rows, cols, None), Grid::Table)) / q4_0;
            println!("{what}: of Q4_0's squared error, linear {linear:.4}, table {table:.4}");
            assert!(
                table < most && table < linear,
                "{what}: table {table}, linear {linear}"
            );
        }
    }

    /// Every group is at most as far off as the table's max-abs rounding.
    #[test]
    fn search_never_loses_to_max_abs() {
        let w = gauss(32 * 400, 5);
        for (i, g) in w.chunks_exact(GROUP).enumerate() {
            let mut x: [f32; GROUP] = g.try_into().unwrap();
            if i % 7 == 0 {
                x[i % GROUP] *= 20.0; // one outlier
            }
            let (mut q, mut base) = ([0u8; GROUP], [0u8; GROUP]);
            let d = quantize_group::<false>(&x, &ONES, &mut q);
            let db = max_abs_group::<false>(&x, &ONES, &mut base);
            let e = group_err::<false>(&x, &q, d.to_f32(), &ONES);
            let eb = group_err::<false>(&x, &base, db.to_f32(), &ONES);
            assert!(e <= eb, "group {i}: {e} > max-abs {eb}");
        }
    }
}
