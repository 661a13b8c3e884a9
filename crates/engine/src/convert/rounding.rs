//! Weights rounded as a 4-bit format would round them, kept at f32 (a measurement aid, issue 33).
//!
//! An f32 conversion with [`super::Precisions::rounded_as`] set stores every matrix the int4
//! format would take already rounded, so formats compare on their weights alone (f32
//! activations, the same engine) before any kernel exists for them: Q4_0's max-abs rounding,
//! colibri's int4, or a table of 16 levels that need not be evenly spaced (one f16 scale per
//! 32 values, as both others; `random_shapes_tests::format_rounding_against_q4_0` runs the
//! comparison).

use half::f16;

use crate::quant::{self, Q4Matrix, GROUP};

/// 16 levels in -16..15 (stored offset by 16 they fit 5 bits): the table grid's
/// (`quant::TABLE_LEVELS`, which `benchmarks/int4_table_headroom.py` scores) as f32.
pub const LEVELS_5_BIT: [f32; 16] = {
    let mut l = [0.0f32; 16];
    let mut i = 0;
    while i < 16 {
        l[i] = quant::TABLE_LEVELS[i] as f32;
        i += 1;
    }
    l
};

/// 16 levels in -32..31 (6 bits offset: two pairs per i16 lane): IQ4_NL's table scaled and
/// rounded.
pub const LEVELS_6_BIT: [f32; 16] = [
    -32., -26., -21., -16., -12., -9., -6., -3., 0., 3., 6., 9., 13., 17., 22., 28.,
];

/// How [`round_matrix`] rounds each group of 32.
#[derive(Clone, Debug, PartialEq)]
pub enum Rounding {
    /// llama.cpp's Q4_0: max-abs scale, nearest level of -8..7.
    Q4_0,
    /// colibri's int4: the same levels, the scale chosen by error (`quant::quantize_q4`).
    Int4,
    /// The nearest of these levels (sorted, 0 among them) under a scale searched per group.
    Levels(Vec<f32>),
}

/// `w` (`rows x cols`, row-major) with each group of 32 along a row rounded as `how` does.
pub fn round_matrix(w: &[f32], rows: usize, cols: usize, how: &Rounding) -> Vec<f32> {
    let via_q4 = |bytes: Vec<u8>| {
        Q4Matrix::new(&bytes, rows, cols)
            .expect("the quantizer's own layout")
            .dequantize()
    };
    match how {
        Rounding::Q4_0 => via_q4(quant::quantize_q4_0_rtn(w, rows, cols)),
        Rounding::Int4 => via_q4(quant::quantize_q4(w, rows, cols)),
        Rounding::Levels(levels) => {
            let mut out = w.to_vec();
            for row in out.chunks_mut(cols) {
                for group in row.chunks_mut(GROUP) {
                    round_group_to_levels(group, levels);
                }
            }
            out
        }
    }
}

/// Candidate scales per sign: the group's largest magnitude over the outermost level's, times
/// factors spread over 0.7..1.25 (each refit twice).
const SCALE_STEPS: usize = 24;

/// Rounds `x` in place to `levels` (sorted) times one f16 scale: for each candidate scale
/// (both signs, so an asymmetric table meets the group's largest value with either end), the
/// nearest levels, the scale refit by least squares in f16, twice; the least squared error
/// wins. Zero groups stay zero.
fn round_group_to_levels(x: &mut [f32], levels: &[f32]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let top = levels.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || top == 0.0 {
        return;
    }
    let nearest = |v: f32| {
        let i = levels.partition_point(|&l| l < v);
        match (i.checked_sub(1).map(|j| levels[j]), levels.get(i)) {
            (Some(lo), Some(&hi)) => {
                if v - lo <= hi - v {
                    lo
                } else {
                    hi
                }
            }
            (Some(lo), None) => lo,
            (None, Some(&hi)) => hi,
            (None, None) => 0.0,
        }
    };
    let mut best = (f64::INFINITY, 0.0f32, vec![0.0f32; x.len()]);
    let mut q = vec![0.0f32; x.len()];
    for step in 0..SCALE_STEPS {
        let factor = 0.7 + 0.55 * step as f32 / (SCALE_STEPS - 1) as f32;
        for sign in [1.0f32, -1.0] {
            let mut d = sign * amax / top * factor;
            for _ in 0..2 {
                for (qi, &v) in q.iter_mut().zip(x.iter()) {
                    *qi = nearest(v / d);
                }
                let qq: f64 = q.iter().map(|&l| f64::from(l) * f64::from(l)).sum();
                let xq: f64 = q
                    .iter()
                    .zip(x.iter())
                    .map(|(&l, &v)| f64::from(l * v))
                    .sum();
                let refit = f16::from_f64(xq / qq.max(f64::MIN_POSITIVE)).to_f32();
                if refit == 0.0 || !refit.is_finite() {
                    break;
                }
                d = refit;
            }
            let err: f64 = q
                .iter()
                .zip(x.iter())
                .map(|(&l, &v)| f64::from(v - l * d).powi(2))
                .sum();
            if err < best.0 {
                best = (err, d, q.clone());
            }
        }
    }
    for (v, &l) in x.iter_mut().zip(&best.2) {
        *v = l * best.1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::gauss;

    fn sq_err(a: &[f32], b: &[f32]) -> f64 {
        a.iter().zip(b).map(|(x, y)| f64::from(x - y).powi(2)).sum()
    }

    /// The linear levels through the table search land where colibri's int4 search does, and
    /// a table denser near zero below both, on Gaussian weights (the weight errors
    /// `benchmarks/int4_table_headroom.py` reports).
    #[test]
    fn levels_rounding_orders_as_measured() {
        let (rows, cols) = (64, 256);
        let w = gauss(rows * cols, 7);
        let err = |how: &Rounding| sq_err(&w, &round_matrix(&w, rows, cols, how));
        let q4_0 = err(&Rounding::Q4_0);
        let int4 = err(&Rounding::Int4) / q4_0;
        let linear = err(&Rounding::Levels((-8..8).map(|v| v as f32).collect())) / q4_0;
        let five = err(&Rounding::Levels(LEVELS_5_BIT.to_vec())) / q4_0;
        let six = err(&Rounding::Levels(LEVELS_6_BIT.to_vec())) / q4_0;
        assert!((0.86..0.91).contains(&int4), "int4 {int4}");
        assert!((linear - int4).abs() < 0.01, "linear {linear} int4 {int4}");
        assert!(five < 0.84 && six < five, "5-bit {five} 6-bit {six}");
    }

    /// Partial groups (a row not a multiple of 32), zero groups and levels that are exactly
    /// representable come back as the rules say.
    #[test]
    fn levels_rounding_edges() {
        let levels = vec![-4.0, -1.0, 0.0, 1.0, 4.0];
        // A row of 40: one whole group and a partial one of 8; the second row all zero.
        let mut w = vec![0.0f32; 80];
        for (i, v) in w[..40].iter_mut().enumerate() {
            *v = [-4.0, -1.0, 0.0, 1.0, 4.0][i % 5] * 0.5;
        }
        let r = round_matrix(&w, 2, 40, &Rounding::Levels(levels));
        assert_eq!(
            r, w,
            "values on the levels (scale 0.5, an f16) come back exactly"
        );
        assert!(r[40..].iter().all(|&v| v == 0.0));
    }
}
