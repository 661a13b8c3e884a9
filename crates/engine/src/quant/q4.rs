//! The int4 format: layout arithmetic, quantization, dequantization (see the module doc of
//! `quant` for the layout).

use std::mem::MaybeUninit;

use half::f16;
use rayon::prelude::*;

use super::QuantError;

/// Weights per scale group.
pub const GROUP: usize = 32;

/// `cols` rounded up to a multiple of [`GROUP`].
pub fn q4_padded_cols(cols: usize) -> usize {
    cols.div_ceil(GROUP) * GROUP
}

/// Bytes of one row: its `q4_padded_cols(cols) / 32` f16 scales, then its nibbles (18 bytes
/// per group of 32 weights). Row `r` of a matrix starts at `r * q4_row_bytes(cols)`.
pub fn q4_row_bytes(cols: usize) -> usize {
    q4_padded_cols(cols) / GROUP * 18
}

/// Total bytes of a `rows x cols` int4 matrix.
pub fn q4_byte_len(rows: usize, cols: usize) -> usize {
    rows * q4_row_bytes(cols)
}

/// `(row bytes, total bytes)`, or `None` on overflow.
fn checked_layout(rows: usize, cols: usize) -> Option<(usize, usize)> {
    let kp = cols.checked_next_multiple_of(GROUP)?;
    let row = (kp / GROUP).checked_mul(18)?;
    Some((row, rows.checked_mul(row)?))
}

/// How a stored 4-bit code `q` (0..16) maps to a multiple of its group's scale.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Grid {
    /// `q - 8`: the evenly spaced levels -8..=7 (dtype `q4`).
    #[default]
    Linear,
    /// `TABLE_LEVELS[q]`: 16 levels in -16..=15, denser near zero (dtype `q4t`). Gaussian
    /// weights round to it with 0.80x Q4_0's squared error and heavy-tailed ones with 0.62x,
    /// where the linear grid's search reaches 0.89x and 0.92x
    /// (`benchmarks/int4_table_headroom.py`, docs/PERFORMANCE.md).
    Table,
}

/// The table grid's levels: llama.cpp's IQ4_NL table scaled to -16..=15, then moved level by
/// level to lower the squared error of Gaussian and Student-t groups. Code 8 is 0, as in the
/// linear grid, so padding reads as zero either way.
pub const TABLE_LEVELS: [i8; 16] = [-16, -13, -10, -8, -6, -4, -2, -1, 0, 1, 3, 5, 7, 9, 12, 15];

impl Grid {
    /// The level of code `q` (0..16).
    #[inline(always)]
    pub fn level(self, q: u8) -> i32 {
        match self {
            Grid::Linear => i32::from(q) - 8,
            Grid::Table => i32::from(TABLE_LEVELS[usize::from(q & 15)]),
        }
    }

    /// The kernels multiply the unsigned `level + offset` (0..16 linear, 0..32 table) with the
    /// signed activations and add `-offset * sum(a)`: the activations' precomputed
    /// `-8 * sum(a)` times `offset / 8`.
    #[inline(always)]
    pub fn offset(self) -> i32 {
        match self {
            Grid::Linear => 8,
            Grid::Table => 16,
        }
    }

    /// The unsigned value the kernels multiply for code `q`: `level(q) + offset()`.
    #[inline(always)]
    pub fn unsigned(self, q: u8) -> u8 {
        (self.level(q) + self.offset()) as u8
    }
}

/// [`Grid::unsigned`] of the table grid's 16 codes: the SIMD kernels' lookup table.
pub(crate) const TABLE_UNSIGNED: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        t[i] = (TABLE_LEVELS[i] as i32 + 16) as u8;
        i += 1;
    }
    t
};

/// Column weights of a group under the plain squared error. The functions below take the
/// weights and a `W` switch: `W = false` is the plain error and never reads the weights (the
/// multiplications cost ~15% of the quantizer's time); with `W` every weighted sum multiplies
/// by the weight first (`(w * a) * b`), and a product with 1.0 is exact, so these weights give
/// the plain quantizer's bytes either way (tested).
pub(super) const ONES: [f32; GROUP] = [1.0; GROUP];

/// `w * a` when weighted, else `a` (the same value when `w` is 1).
#[inline(always)]
pub(super) fn weigh<const W: bool>(w: f32, a: f32) -> f32 {
    if W {
        w * a
    } else {
        a
    }
}

/// The group's weighted squared error `sum w (x - (q-8) d)^2`.
#[inline(always)]
fn group_err<const W: bool>(x: &[f32; GROUP], q: &[u8; GROUP], d: f32, wt: &[f32; GROUP]) -> f32 {
    let mut e = [0.0f32; 8];
    for k in 0..GROUP / 8 {
        for l in 0..8 {
            let r = x[k * 8 + l] - (q[k * 8 + l] as f32 - 8.0) * d;
            e[l] += weigh::<W>(wt[k * 8 + l], r * r);
        }
    }
    e.iter().sum()
}

/// Quantizes with inverse scale `is` (round half up, clamp to 0..=15) and returns
/// `(sum w*x*(q-8), sum w*(q-8)^2)`. Written to auto-vectorize (8 lanes of partial sums).
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
        let mut qi = [0i32; 8];
        for l in 0..8 {
            // max/min return the non-NaN operand, so t is in [0, 15] whatever x and is are
            // (clamp would propagate a NaN).
            #[allow(clippy::manual_clamp)]
            let t = (x[k * 8 + l] * is + 8.5).max(0.0).min(15.0);
            // SAFETY: t is a finite value in [0, 15], representable as i32.
            qi[l] = unsafe { t.to_int_unchecked::<i32>() };
        }
        for l in 0..8 {
            q[k * 8 + l] = qi[l] as u8;
            let c = qi[l] as f32 - 8.0;
            let w = wt[k * 8 + l];
            sxq[l] += weigh::<W>(w, x[k * 8 + l]) * c;
            sqq[l] += weigh::<W>(w, c) * c;
        }
    }
    (sxq.iter().sum(), sqq.iter().sum())
}

/// Target positions (in units of the step) of the group's largest-magnitude weight tried by the
/// scale search: negative ones put it on the -8 side (like Q4_0), positive ones on the +7 side;
/// beyond the ends it is clipped. (A denser set of 41 between -10 and +8.5 gained < 0.1%.)
const CANDIDATES: [f32; 16] = [
    -8.75, -8.5, -8.25, -7.75, -7.5, -7.25, -7.0, -6.75, -6.5, 6.5, 6.75, 7.0, 7.25, 7.5, 7.75, 8.0,
];

/// Q4_0 round-to-nearest of one group, as llama.cpp does it: `d = max / -8` (max = the value of
/// largest magnitude), `q = min(15, trunc(x / d + 8.5))`, `d` stored as f16.
#[inline(always)]
fn rtn_group(x: &[f32; GROUP], q: &mut [u8; GROUP]) -> f16 {
    let (m, _) = largest(x);
    let d = m / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    for (qi, &v) in q.iter_mut().zip(x) {
        // `as i32` truncates toward zero and saturates; with the clamp that equals floor().
        *qi = ((v * id + 8.5) as i32).clamp(0, 15) as u8;
    }
    f16::from_f32(d)
}

/// A group that is exactly `q * s` for integers `q` in `-8..=7` and an `s` that an f16 holds
/// (the weights of an int4 checkpoint, dequantized: compressed-tensors' packed int4): those
/// nibbles and that scale, found from the group's largest-magnitude value `m = q_m s`, trying
/// `|q_m|` from 8 down (the source's own scale first; a coarser one that also fits gives the
/// same values). Zero error, which no search beats; a group off every such grid (any trained or
/// random float weights) fails at its first few values, a few operations per candidate.
#[inline(always)]
fn on_grid(x: &[f32; GROUP], m: f32, q: &mut [u8; GROUP]) -> Option<f16> {
    'scale: for k in (1..=8u8).rev() {
        if k == 8 && m > 0.0 {
            continue; // +8 is not a nibble
        }
        let s = m.abs() / f32::from(k);
        let d = f16::from_f32(s);
        if s == 0.0 || d.to_f32() != s {
            continue;
        }
        for (qi, &v) in q.iter_mut().zip(x) {
            // v = q s exactly makes v / s exactly q (a correctly rounded division).
            let t = v / s;
            if t != t.round() || !(-8.0..=7.0).contains(&t) || t * s != v {
                continue 'scale;
            }
            *qi = (t as i32 + 8) as u8;
        }
        return Some(d);
    }
    None
}

/// The value of largest magnitude in `x` (the first such) and that magnitude: `(m, |m|)`.
#[inline(always)]
pub(super) fn largest(x: &[f32; GROUP]) -> (f32, f32) {
    let (mut amax, mut m) = (0.0f32, 0.0f32);
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            m = v;
        }
    }
    (m, amax)
}

/// A candidate quantization of a group: estimated squared error, scale, codes.
struct Cand {
    err: f64,
    d: f16,
    q: [u8; GROUP],
}

/// Rounds with inverse scale `is` (`round` returns `(sum w x l, sum w l^2)` over the levels
/// `l` it chose), refits the scale and keeps the result if it beats `best` (`sxx` is
/// `sum w x^2`).
#[inline(always)]
fn consider(
    sxx: f64,
    is: f32,
    round: &mut impl FnMut(f32, &mut [u8; GROUP]) -> (f32, f32),
    best: &mut Option<Cand>,
) {
    let mut q = [0u8; GROUP];
    let (sxq, sqq) = round(is, &mut q);
    if sqq > 0.0 {
        let d = f16::from_f32(sxq / sqq);
        let df = d.to_f32() as f64;
        let err = sxx - 2.0 * df * sxq as f64 + df * df * sqq as f64;
        // (An f16 overflow gives a non-finite error: skipped.)
        if err.is_finite() && best.as_ref().is_none_or(|b| err < b.err) {
            *best = Some(Cand { err, d, q });
        }
    }
}

/// The scale search of both grids, for a group whose largest-magnitude value is `m`: for each
/// candidate position `c` of `m` (in units of the step) the codes are rounded with inverse
/// scale `c / m` by `round` (into its codes; it returns `(sum w x l, sum w l^2)` over their
/// levels `l`), the scale refit by weighted least squares (in f16) and the error evaluated in
/// closed form; two rounds of re-rounding with the best scale follow. The winner's scale and
/// codes, if any candidate gave a finite error; the caller checks it against its baseline.
#[inline(always)]
pub(super) fn search_scale<const W: bool>(
    x: &[f32; GROUP],
    wt: &[f32; GROUP],
    m: f32,
    candidates: &[f32],
    mut round: impl FnMut(f32, &mut [u8; GROUP]) -> (f32, f32),
) -> Option<(f16, [u8; GROUP])> {
    let sxx: f64 = x
        .iter()
        .zip(wt)
        .map(|(&v, &w)| {
            let v2 = (v as f64) * (v as f64);
            if W {
                (w as f64) * v2
            } else {
                v2
            }
        })
        .sum();
    let mut best: Option<Cand> = None;
    for &c in candidates {
        consider(sxx, c / m, &mut round, &mut best);
    }
    // Two rounds of alternating refinement: re-round with the best scale, refit the scale.
    for _ in 0..2 {
        let d = best.as_ref().map_or(0.0, |b| b.d.to_f32());
        if d == 0.0 || !d.is_finite() {
            break;
        }
        consider(sxx, 1.0 / d, &mut round, &mut best);
    }
    best.map(|b| (b.d, b.q))
}

/// Quantizes one group, minimising the squared error weighted per column by `wt` (non-negative;
/// read only when `W`; without, the plain error) over a small set of scales: for each candidate step the nibbles
/// are rounded, the scale refit by weighted least squares (in f16), and the error evaluated in
/// closed form; two rounds of re-rounding with the best scale follow. The winner is checked
/// against Q4_0 round-to-nearest by direct weighted error, so a group is never worse than RTN
/// under the same weights.
#[inline(always)]
fn quantize_group<const W: bool>(x: &[f32; GROUP], wt: &[f32; GROUP], q: &mut [u8; GROUP]) -> f16 {
    let (m, amax) = largest(x);
    if amax == 0.0 || !amax.is_finite() {
        // All zero (or not finite: give up on the group rather than emit NaN scales).
        q.fill(8);
        return f16::ZERO;
    }
    if let Some(d) = on_grid(x, m, q) {
        return d;
    }
    let best = search_scale::<W>(x, wt, m, &CANDIDATES, |is, q| quant_sums::<W>(x, wt, is, q));
    let rtn_d = rtn_group(x, q);
    let rtn_e = group_err::<W>(x, q, rtn_d.to_f32(), wt);
    match best {
        Some((d, bq)) if group_err::<W>(x, &bq, d.to_f32(), wt) < rtn_e => {
            *q = bq;
            d
        }
        _ => rtn_d,
    }
}

/// Groups per nibble block: the kernels take 16 groups (256 nibble bytes) at a time, one i32
/// lane per group.
pub const BLOCK_GROUPS: usize = 16;

/// Offset within a row's nibbles of nibble byte `j` (0..16) of group `g`, in a row of `groups`
/// groups. The nibbles go in blocks of 16 groups (the last block may have fewer, `m`); within
/// a block, the four bytes `4k..4k + 4` of every group come together, group after group:
/// byte `j` of the block's group `i` is at `(j / 4) * 4m + 4i + j % 4`. So 64 bytes hold
/// one dword of each of 16 groups, and a vector's i32 lane `i` always belongs to group `i`.
#[inline(always)]
pub(crate) fn nibble_offset(groups: usize, g: usize, j: usize) -> usize {
    let b = g / BLOCK_GROUPS;
    let m = (groups - b * BLOCK_GROUPS).min(BLOCK_GROUPS);
    b * BLOCK_GROUPS * 16 + (j / 4) * 4 * m + (g % BLOCK_GROUPS) * 4 + j % 4
}

/// Bytes of nibbles per block of 16 groups.
pub(crate) const BLOCK_NIBBLES: usize = BLOCK_GROUPS * 16;

/// Row `r`'s blocks as (nibbles, scales) pointers: block `c < full` in place, the last partial
/// block (if any) from zero-filled copies with the full-block spacing (zero scales make the
/// padding groups contribute nothing; the activations are zero there as well).
pub(crate) struct RowBlocks {
    nib: *const u8,
    sc: *const u8,
    full: usize,
    /// The partial last block's copy (256 bytes of nibbles, then 32 of scales), or null.
    tail: *const u8,
}

/// Room for a row's partial last block: its nibbles at the full-block spacing, then its
/// scales, zero-padded. Written only for rows that have one, so tiles of rows without one
/// neither zero nor copy it (the caller's buffer stays uninitialised; [`RowBlocks`] itself is
/// a few pointers, cheap to build per tile).
pub(crate) type TailBuf = MaybeUninit<[u8; BLOCK_NIBBLES + BLOCK_GROUPS * 2]>;

impl RowBlocks {
    /// # Safety
    /// `row` points at the `groups * 18` readable bytes of one row; `tail` outlives the uses
    /// of the pointers [`RowBlocks::block`] returns.
    #[inline(always)]
    pub(crate) unsafe fn new(row: *const u8, groups: usize, tail: &mut TailBuf) -> Self {
        let full = groups / BLOCK_GROUPS;
        let m = groups - full * BLOCK_GROUPS;
        let nib = row.wrapping_add(groups * 2);
        let mut b = RowBlocks {
            nib,
            sc: row,
            full,
            tail: std::ptr::null(),
        };
        if m > 0 {
            let t = tail
                .write([0; BLOCK_NIBBLES + BLOCK_GROUPS * 2])
                .as_mut_ptr();
            // SAFETY: the partial block's nibbles are bytes [full*256, groups*16) of the row's
            // nibbles, dword k of its m groups at full*256 + k*4m (4m bytes); its scales are
            // bytes [full*32, groups*2); the buffer holds 4 x 64 + 32 bytes.
            unsafe {
                for k in 0..4 {
                    std::ptr::copy_nonoverlapping(
                        nib.add(full * BLOCK_NIBBLES + k * 4 * m),
                        t.add(k * 64),
                        4 * m,
                    );
                }
                std::ptr::copy_nonoverlapping(row.add(full * 32), t.add(BLOCK_NIBBLES), 2 * m);
            }
            b.tail = t;
        }
        b
    }

    /// Block `c`'s nibbles (256 bytes, dword `k` at `k * 64`) and scales (16 f16), for `c`
    /// below the row's `groups.div_ceil(16)` blocks (so a block past the full ones is the
    /// partial one `new` copied).
    #[inline(always)]
    pub(crate) fn block(&self, c: usize) -> (*const u8, *const u8) {
        if c < self.full {
            (
                self.nib.wrapping_add(c * BLOCK_NIBBLES),
                self.sc.wrapping_add(c * 32),
            )
        } else {
            (self.tail, self.tail.wrapping_add(BLOCK_NIBBLES))
        }
    }
}

/// Reorders one row's nibble bytes (`groups * 16`) from format v2 (each group's 16 bytes
/// together) to v3 ([`nibble_offset`]) into `out`. A pure permutation: no value changes.
pub(crate) fn v2_nibbles_to_v3(groups: usize, v2: &[u8], out: &mut [u8]) {
    assert!(v2.len() == groups * 16 && out.len() == groups * 16);
    for g in 0..groups {
        for j in (0..16).step_by(4) {
            let at = nibble_offset(groups, g, j);
            out[at..at + 4].copy_from_slice(&v2[g * 16 + j..g * 16 + j + 4]);
        }
    }
}

/// The inverse of [`v2_nibbles_to_v3`] (for tests of the upgrade).
#[cfg(test)]
pub(crate) fn v3_nibbles_to_v2(groups: usize, v3: &[u8], out: &mut [u8]) {
    assert!(v3.len() == groups * 16 && out.len() == groups * 16);
    for g in 0..groups {
        for j in (0..16).step_by(4) {
            let at = nibble_offset(groups, g, j);
            out[g * 16 + j..g * 16 + j + 4].copy_from_slice(&v3[at..at + 4]);
        }
    }
}

/// Packs group `g`'s 32 nibbles (`q`, each 0..16) into the row's nibble bytes `nrow`: byte
/// `j` holds element `j` (low nibble) and element `j + 16` (high nibble).
#[inline(always)]
pub(super) fn pack_group(q: &[u8; GROUP], groups: usize, g: usize, nrow: &mut [u8]) {
    for j in (0..GROUP / 2).step_by(4) {
        let at = nibble_offset(groups, g, j);
        for i in 0..4 {
            nrow[at + i] = q[j + i] | (q[j + i + GROUP / 2] << 4);
        }
    }
}

/// How a quantizer rounds each group.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Rounder {
    /// Q4_0's max-abs round-to-nearest on the linear grid.
    Q4_0,
    /// The scale search on the linear grid ([`quantize_group`]).
    Linear,
    /// The scale search on the table grid (`q4_table::quantize_group`).
    Table,
}

/// Quantizes one row (`wrow`: `cols` floats) into its bytes (`out`: scales, then nibbles);
/// with `weights` (`cols` floats) the search minimises the error weighted by them.
#[inline(always)]
fn quantize_row(wrow: &[f32], out: &mut [u8], how: Rounder, weights: Option<&[f32]>) {
    let cols = wrow.len();
    let (srow, nrow) = out.split_at_mut(out.len() / 9);
    let mut x = [0.0f32; GROUP];
    let mut wt = ONES;
    let mut q = [0u8; GROUP];
    let groups = srow.len() / 2;
    for g in 0..groups {
        let lo = g * GROUP;
        let hi = (lo + GROUP).min(cols);
        x.fill(0.0);
        x[..hi - lo].copy_from_slice(&wrow[lo..hi]);
        if let Some(w) = weights {
            // Padding columns hold zeros, which every scale represents exactly.
            wt.fill(0.0);
            wt[..hi - lo].copy_from_slice(&w[lo..hi]);
        }
        let d = match (how, weights) {
            (Rounder::Q4_0, _) => rtn_group(&x, &mut q),
            (Rounder::Linear, None) => quantize_group::<false>(&x, &wt, &mut q),
            (Rounder::Linear, Some(_)) => quantize_group::<true>(&x, &wt, &mut q),
            (Rounder::Table, None) => super::q4_table::quantize_group::<false>(&x, &wt, &mut q),
            (Rounder::Table, Some(_)) => super::q4_table::quantize_group::<true>(&x, &wt, &mut q),
        };
        pack_group(&q, groups, g, nrow);
        srow[g * 2..g * 2 + 2].copy_from_slice(&d.to_le_bytes());
    }
}

/// The same code compiled for AVX2 (8-wide auto-vectorization). Bit-identical results: Rust
/// never contracts or reorders float operations, so only the instruction selection differs.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn quantize_row_avx2(wrow: &[f32], out: &mut [u8], how: Rounder, weights: Option<&[f32]>) {
    quantize_row(wrow, out, how, weights)
}

/// Per-column weights of each row of a matrix being quantized: `f(r)` is row `r`'s (`cols`
/// non-negative finite floats), or `None` for the plain squared error.
pub type RowWeights<'a> = &'a (dyn Fn(usize) -> Option<&'a [f32]> + Sync);

fn quantize_with(
    w: &[f32],
    rows: usize,
    cols: usize,
    how: Rounder,
    weights: Option<RowWeights>,
) -> Vec<u8> {
    assert_eq!(
        w.len(),
        rows * cols,
        "quantize_q4: w has {} floats, not {rows}x{cols}",
        w.len()
    );
    let (row, len) = checked_layout(rows, cols).expect("quantize_q4: shape too large");
    let mut out = vec![0u8; len];
    if rows == 0 || cols == 0 {
        return out;
    }
    #[cfg(target_arch = "x86_64")]
    let avx2 = is_x86_feature_detected!("avx2");
    out.par_chunks_mut(row)
        .zip(w.par_chunks(cols))
        .enumerate()
        .for_each(|(r, (orow, wrow))| {
            let wr = weights.and_then(|f| f(r));
            if let Some(wr) = wr {
                assert_eq!(
                    wr.len(),
                    cols,
                    "quantize_q4: row {r} has {} weights",
                    wr.len()
                );
                debug_assert!(wr.iter().all(|v| v.is_finite() && *v >= 0.0));
            }
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU has AVX2 (detected above).
                unsafe { quantize_row_avx2(wrow, orow, how, wr) };
                return;
            }
            quantize_row(wrow, orow, how, wr);
        });
    out
}

/// Quantizes `w` (`rows x cols`, row-major) to the int4 layout, choosing each group's scale to
/// minimise the squared error (never worse than Q4_0 round-to-nearest). Parallel over rows.
pub fn quantize_q4(w: &[f32], rows: usize, cols: usize) -> Vec<u8> {
    quantize_with(w, rows, cols, Rounder::Linear, None)
}

/// [`quantize_q4`] minimising, for each row `r` that `weights(r)` gives weights for, the
/// squared error weighted per column (`sum_j w_j (x_j - q_j d)^2`: importance statistics,
/// `colibri convert --calibration`); never worse than Q4_0 round-to-nearest under the same
/// weights. Rows without weights come out as [`quantize_q4`] makes them.
pub fn quantize_q4_weighted(w: &[f32], rows: usize, cols: usize, weights: RowWeights) -> Vec<u8> {
    quantize_with(w, rows, cols, Rounder::Linear, Some(weights))
}

/// Plain llama.cpp Q4_0 round-to-nearest into the same layout (a baseline for comparisons).
pub fn quantize_q4_0_rtn(w: &[f32], rows: usize, cols: usize) -> Vec<u8> {
    quantize_with(w, rows, cols, Rounder::Q4_0, None)
}

/// Quantizes `w` to the same layout on the table grid ([`Grid::Table`]), each group's scale
/// searched to minimise the squared error, weighted per column by `weights(r)` where it gives
/// weights (importance statistics) and plain elsewhere; never worse than the table's max-abs
/// rounding under the same weights. Parallel over rows.
pub fn quantize_q4_table(
    w: &[f32],
    rows: usize,
    cols: usize,
    weights: Option<RowWeights>,
) -> Vec<u8> {
    quantize_with(w, rows, cols, Rounder::Table, weights)
}

/// An int4 matrix borrowed from a byte buffer (any alignment), its codes read on `grid`.
#[derive(Clone, Copy)]
pub struct Q4Matrix<'a> {
    pub rows: usize,
    pub cols: usize,
    grid: Grid,
    bytes: &'a [u8],
    kp: usize,
    row_bytes: usize,
}

impl std::fmt::Debug for Q4Matrix<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Q4Matrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("grid", &self.grid)
            .finish_non_exhaustive()
    }
}

impl<'a> Q4Matrix<'a> {
    /// A matrix on the linear grid; checks that `bytes` has exactly `q4_byte_len(rows, cols)`
    /// bytes.
    pub fn new(bytes: &'a [u8], rows: usize, cols: usize) -> Result<Self, QuantError> {
        Self::on_grid(bytes, rows, cols, Grid::Linear)
    }

    /// A matrix whose codes are read on `grid` (the same layout for both grids).
    pub fn on_grid(
        bytes: &'a [u8],
        rows: usize,
        cols: usize,
        grid: Grid,
    ) -> Result<Self, QuantError> {
        let (row, len) = checked_layout(rows, cols).ok_or(QuantError::Shape { rows, cols })?;
        if bytes.len() != len {
            return Err(QuantError::Length {
                rows,
                cols,
                expected: len,
                actual: bytes.len(),
            });
        }
        Ok(Q4Matrix {
            rows,
            cols,
            grid,
            bytes,
            kp: q4_padded_cols(cols),
            row_bytes: row,
        })
    }

    /// How the stored codes map to levels.
    pub fn grid(&self) -> Grid {
        self.grid
    }

    /// The whole buffer.
    pub fn bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Groups of 32 per row.
    pub fn groups(&self) -> usize {
        self.kp / GROUP
    }

    /// Bytes per row (`q4_row_bytes(cols)`): the row's scales, then its nibbles.
    pub fn row_stride(&self) -> usize {
        self.row_bytes
    }

    /// All bytes of row `r`: `groups() * 2` bytes of scales, then `groups() * 16` of nibbles.
    pub fn row(&self, r: usize) -> &'a [u8] {
        &self.bytes[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    /// Nibbles of row `r`: `groups() * 16` bytes.
    pub fn row_nibbles(&self, r: usize) -> &'a [u8] {
        &self.row(r)[self.groups() * 2..]
    }

    /// Scales of row `r`: `groups()` little-endian f16, as `groups() * 2` bytes.
    pub fn row_scales(&self, r: usize) -> &'a [u8] {
        &self.row(r)[..self.groups() * 2]
    }

    /// Scale of group `g` of row `r`.
    pub fn scale(&self, r: usize, g: usize) -> f32 {
        let s = self.row_scales(r);
        f16::from_le_bytes([s[2 * g], s[2 * g + 1]]).to_f32()
    }

    /// Dequantizes row `r` into `out` (`out.len() == cols`).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "dequantize_row: row {r} of {}", self.rows);
        assert_eq!(out.len(), self.cols, "dequantize_row: out.len() != cols");
        let nib = self.row_nibbles(r);
        let groups = self.groups();
        let mut buf = [0.0f32; GROUP];
        for (g, chunk) in out.chunks_mut(GROUP).enumerate() {
            let d = self.scale(r, g);
            // A group's 16 bytes are four dwords, a block's group count of dwords apart.
            let first = nibble_offset(groups, g, 0);
            let apart = nibble_offset(groups, g, 4) - first;
            for k in 0..4 {
                let dword = &nib[first + k * apart..first + k * apart + 4];
                for (i, &b) in dword.iter().enumerate() {
                    buf[4 * k + i] = self.grid.level(b & 15) as f32 * d;
                    buf[4 * k + i + 16] = self.grid.level(b >> 4) as f32 * d;
                }
            }
            chunk.copy_from_slice(&buf[..chunk.len()]);
        }
    }

    /// The whole matrix as f32, `rows x cols` row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        if self.cols > 0 {
            for (r, row) in out.chunks_mut(self.cols).enumerate() {
                self.dequantize_row(r, row);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{gauss, rel_err};

    #[test]
    fn layout_lengths() {
        assert_eq!(q4_padded_cols(0), 0);
        assert_eq!(q4_padded_cols(1), 32);
        assert_eq!(q4_padded_cols(64), 64);
        assert_eq!(q4_padded_cols(72), 96);
        // 72 cols: 3 groups, 3 * 2 scale bytes + 3 * 16 nibble bytes per row.
        assert_eq!(q4_row_bytes(72), 54);
        assert_eq!(q4_byte_len(3, 72), 3 * 54);
        assert_eq!(q4_byte_len(2048, 1024), 2048 * 512 + 2048 * 32 * 2);
        assert_eq!(q4_row_bytes(2048), 64 * 18);
        assert_eq!(q4_byte_len(0, 100), 0);
        assert!(checked_layout(usize::MAX / 2, 64).is_none());
    }

    #[test]
    fn new_checks_length_and_accepts_any_alignment() {
        let w = gauss(5 * 40, 1);
        let bytes = quantize_q4(&w, 5, 40);
        assert_eq!(bytes.len(), q4_byte_len(5, 40));
        assert!(matches!(
            Q4Matrix::new(&bytes[1..], 5, 40),
            Err(QuantError::Length { .. })
        ));
        // 41 pads to 64 like 40: same layout.
        assert!(Q4Matrix::new(&bytes, 5, 41).is_ok());
        assert!(matches!(
            Q4Matrix::new(&bytes, 6, 40),
            Err(QuantError::Length { .. })
        ));
        assert!(matches!(
            Q4Matrix::new(&[], usize::MAX, 64),
            Err(QuantError::Shape { .. })
        ));
        let reference = Q4Matrix::new(&bytes, 5, 40).unwrap().dequantize();
        for shift in 1..4 {
            let mut buf = vec![0u8; bytes.len() + shift];
            buf[shift..].copy_from_slice(&bytes);
            let m = Q4Matrix::new(&buf[shift..], 5, 40).unwrap();
            assert_eq!(m.dequantize(), reference);
        }
    }

    #[test]
    fn roundtrip_error_bounds() {
        for &(rows, cols) in &[(1, 32), (3, 72), (17, 40), (8, 200), (64, 256)] {
            let w = gauss(rows * cols, (rows * 1000 + cols) as u64);
            let bytes = quantize_q4(&w, rows, cols);
            let m = Q4Matrix::new(&bytes, rows, cols).unwrap();
            let d = m.dequantize();
            let mut row = vec![0.0; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut row);
                assert_eq!(row, d[r * cols..(r + 1) * cols]);
                for (g, (wg, dg)) in w[r * cols..(r + 1) * cols]
                    .chunks(GROUP)
                    .zip(row.chunks(GROUP))
                    .enumerate()
                {
                    let amax = wg.iter().fold(0.0f32, |a, &v| a.max(v.abs()));
                    let s = m.scale(r, g).abs();
                    assert!(s <= amax / 6.0 + 1e-6, "scale {s} for amax {amax}");
                    for (&a, &b) in wg.iter().zip(dg) {
                        // Each weight is within one step of the grid, clipping included.
                        assert!((a - b).abs() <= amax / 6.0, "{a} vs {b} (amax {amax})");
                    }
                }
            }
            let e = rel_err(&d, &w);
            assert!(e < 0.12, "{rows}x{cols}: relative error {e}");
        }
    }

    #[test]
    fn never_worse_than_q4_0_rtn() {
        let (rows, cols) = (256, 1024);
        let mut tot = (0.0, 0.0);
        for seed in 0..3 {
            let w = gauss(rows * cols, 100 + seed);
            let ours = Q4Matrix::new(&quantize_q4(&w, rows, cols), rows, cols)
                .unwrap()
                .dequantize();
            let rtn = Q4Matrix::new(&quantize_q4_0_rtn(&w, rows, cols), rows, cols)
                .unwrap()
                .dequantize();
            let (eo, er) = (rel_err(&ours, &w), rel_err(&rtn, &w));
            // Per group as well: the search includes the RTN choice.
            for (g, ((wg, og), rg)) in w
                .chunks(GROUP)
                .zip(ours.chunks(GROUP))
                .zip(rtn.chunks(GROUP))
                .enumerate()
            {
                let e =
                    |d: &[f32]| -> f32 { wg.iter().zip(d).map(|(a, b)| (a - b) * (a - b)).sum() };
                assert!(e(og) <= e(rg) * (1.0 + 1e-5) + 1e-12, "group {g}");
            }
            assert!(eo <= er, "ours {eo} > rtn {er}");
            tot.0 += eo / 3.0;
            tot.1 += er / 3.0;
        }
        println!(
            "relative Frobenius error on N(0,1) {rows}x{cols} (mean of 3): ours {:.5}, Q4_0 RTN {:.5}",
            tot.0, tot.1
        );
        assert!(tot.0 < tot.1 * 0.97, "search should measurably beat RTN");
    }

    /// Weights of all ones are the plain squared error, byte for byte (the weighted path
    /// multiplies by them exactly; the plain path skips the multiplications).
    #[test]
    fn weights_of_ones_are_the_plain_quantizer() {
        for &(rows, cols) in &[(3, 72), (17, 40), (8, 1024)] {
            let w = gauss(rows * cols, (rows + cols) as u64);
            let ones = vec![1.0f32; cols];
            let f = |_: usize| Some(ones.as_slice());
            assert_eq!(
                quantize_q4_weighted(&w, rows, cols, &f),
                quantize_q4(&w, rows, cols)
            );
            let none = |_: usize| None;
            assert_eq!(
                quantize_q4_weighted(&w, rows, cols, &none),
                quantize_q4(&w, rows, cols)
            );
        }
    }

    /// Under any non-negative column weights the weighted search is never worse than Q4_0's
    /// max-abs rounding by the same weighted error, on groups of every kind: Gaussian, all
    /// zero, constant, one outlier, subnormal; weights with zeros and wide ranges.
    #[test]
    fn weighted_never_worse_than_max_abs_under_the_same_weights() {
        let groups = 400;
        let cols = groups * GROUP;
        let mut w = gauss(cols, 9);
        let u = gauss(cols, 10);
        for g in 0..groups {
            let x = &mut w[g * GROUP..(g + 1) * GROUP];
            match g % 5 {
                1 => x.fill(0.0),
                2 => x.fill(u[g] * 3.0),
                3 => x[(g * 7) % GROUP] = 40.0 * u[g].signum(),
                4 => x.iter_mut().for_each(|v| *v *= 1e-39),
                _ => {}
            }
        }
        let wt: Vec<f32> = u
            .iter()
            .enumerate()
            .map(|(i, &v)| if i % 7 == 0 { 0.0 } else { (3.0 * v).exp() })
            .collect();
        let f = |_: usize| Some(wt.as_slice());
        let ours = Q4Matrix::new(&quantize_q4_weighted(&w, 1, cols, &f), 1, cols)
            .unwrap()
            .dequantize();
        let rtn = Q4Matrix::new(&quantize_q4_0_rtn(&w, 1, cols), 1, cols)
            .unwrap()
            .dequantize();
        let err = |d: &[f32], g: usize| -> f64 {
            (g * GROUP..(g + 1) * GROUP)
                .map(|i| wt[i] as f64 * ((w[i] - d[i]) as f64).powi(2))
                .sum()
        };
        let (mut tot_o, mut tot_r) = (0.0, 0.0);
        for g in 0..groups {
            let (eo, er) = (err(&ours, g), err(&rtn, g));
            assert!(eo <= er * (1.0 + 1e-5) + 1e-37, "group {g}: {eo} > {er}");
            tot_o += eo;
            tot_r += er;
        }
        assert!(tot_o < 0.95 * tot_r, "{tot_o} vs {tot_r}");
    }

    /// Weights of an int4 checkpoint (integers -8..=7 times an f16-exact scale per group of
    /// 32, any largest magnitude, partial last groups) quantize back to exactly themselves,
    /// plain and weighted; off-grid weights keep the search's result.
    #[test]
    fn groups_on_an_int4_grid_come_back_exactly() {
        let (rows, cols) = (24, 200);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let mut w = vec![0.0f32; rows * cols];
        for r in 0..rows {
            for g in 0..cols.div_ceil(GROUP) {
                // Scales a bf16 holds (8-bit mantissa), over a wide range of exponents.
                let s = half::bf16::from_f32((next() % 1000 + 1) as f32 * 1e-5).to_f32();
                let top = 1 + (next() % 8) as i32; // the group's largest |q|: 1..=8
                for c in g * GROUP..((g + 1) * GROUP).min(cols) {
                    let q = (next() % (2 * top as u64 + 1)) as i32 - top;
                    w[r * cols + c] = q.clamp(-8, 7) as f32 * s;
                }
            }
        }
        let weights = vec![1.5f32; cols];
        for bytes in [
            quantize_q4(&w, rows, cols),
            quantize_q4_weighted(&w, rows, cols, &|_| Some(&weights[..])),
        ] {
            let back = Q4Matrix::new(&bytes, rows, cols).unwrap().dequantize();
            assert_eq!(back, w);
        }
        // Float weights off every grid (Gaussian) never take the shortcut: the search decides.
        let g = gauss(4096 * GROUP, 3);
        for x in g.chunks_exact(GROUP) {
            let x: &[f32; GROUP] = x.try_into().unwrap();
            let m = *x.iter().max_by(|a, b| a.abs().total_cmp(&b.abs())).unwrap();
            assert_eq!(on_grid(x, m, &mut [0; GROUP]), None);
        }
    }

    /// Each widened value is its own nibble (by `nibble_offset`, byte `j`'s low half column
    /// `j`, its high half column `j + 16`) minus 8, times its group's scale: rows of one to 40
    /// groups (full and partial blocks of 16) and partial last groups.
    #[test]
    fn dequantize_row_reads_each_nibble_where_the_layout_puts_it() {
        for cols in [1, 31, 32, 64, 480, 512, 520, 1280] {
            let rows = 3;
            let w = gauss(rows * cols, cols as u64);
            let bytes = quantize_q4(&w, rows, cols);
            let m = Q4Matrix::new(&bytes, rows, cols).unwrap();
            let mut row = vec![0.0; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut row);
                let nib = m.row_nibbles(r);
                for (c, &v) in row.iter().enumerate() {
                    let (g, i) = (c / GROUP, c % GROUP);
                    let b = nib[nibble_offset(m.groups(), g, i % 16)];
                    let q = if i < 16 { b & 15 } else { b >> 4 };
                    let want = (q as f32 - 8.0) * m.scale(r, g);
                    assert_eq!(v.to_bits(), want.to_bits(), "cols {cols} row {r} col {c}");
                }
            }
        }
    }

    #[test]
    fn zero_rows_and_padding_are_zero() {
        let (rows, cols) = (3, 72);
        let mut w = gauss(rows * cols, 7);
        w[cols..2 * cols].fill(0.0); // row 1 all zero
        let bytes = quantize_q4(&w, rows, cols);
        let m = Q4Matrix::new(&bytes, rows, cols).unwrap();
        let mut row = vec![1.0; cols];
        m.dequantize_row(1, &mut row);
        assert!(row.iter().all(|&v| v == 0.0));
        assert!(m.row_scales(1).iter().all(|&b| b == 0));
        // Padding columns 72..96 of every row hold q = 8 (weight 0).
        for r in 0..rows {
            let nib = m.row_nibbles(r);
            for j in 0..16 {
                assert_eq!(
                    nib[nibble_offset(3, 2, j)] >> 4,
                    8,
                    "row {r} col {}",
                    64 + 16 + j
                );
            }
            for j in 8..16 {
                assert_eq!(
                    nib[nibble_offset(3, 2, j)] & 15,
                    8,
                    "row {r} col {}",
                    64 + j
                );
            }
        }
        // Each row is one stream: its scales, then its nibbles.
        for r in 0..rows {
            let row = &bytes[r * 54..(r + 1) * 54];
            assert_eq!(m.row(r), row);
            assert_eq!(m.row_scales(r), &row[..6]);
            assert_eq!(m.row_nibbles(r), &row[6..]);
            for g in 0..3 {
                let d = f16::from_le_bytes([row[2 * g], row[2 * g + 1]]).to_f32();
                assert_eq!(m.scale(r, g), d);
            }
        }
        // An all-zero matrix dequantizes to zeros.
        let z = quantize_q4(&vec![0.0; 17 * 40], 17, 40);
        assert!(Q4Matrix::new(&z, 17, 40)
            .unwrap()
            .dequantize()
            .iter()
            .all(|&v| v == 0.0));
    }

    #[test]
    fn nibble_order_within_group() {
        // Weights j - 8 for j in 0..16 then 7 - j: exactly representable with scale 1.
        let mut w = vec![0.0f32; 32];
        for j in 0..16 {
            w[j] = j as f32 - 8.0;
            w[j + 16] = 7.0 - j as f32;
        }
        let b = quantize_q4(&w, 1, 32);
        let m = Q4Matrix::new(&b, 1, 32).unwrap();
        assert_eq!(m.dequantize(), w);
        let nib = m.row_nibbles(0);
        let s = m.scale(0, 0);
        for j in 0..16 {
            let lo = (nib[j] & 15) as f32 - 8.0;
            let hi = (nib[j] >> 4) as f32 - 8.0;
            assert_eq!(lo * s, w[j]);
            assert_eq!(hi * s, w[j + 16]);
        }
    }

    #[test]
    fn nibble_blocks_interleave_dwords_of_16_groups() {
        // Every nibble byte of every group has its own place, and rows of 16, 17, 44 and 48
        // groups (one partial block of 1 and 12 groups) are laid out as the docs say.
        for groups in [1, 3, 16, 17, 44, 48] {
            let mut seen = vec![false; groups * 16];
            for g in 0..groups {
                let (b, i) = (g / 16, g % 16);
                let m = (groups - b * 16).min(16);
                for j in 0..16 {
                    let at = nibble_offset(groups, g, j);
                    assert_eq!(at, b * 256 + (j / 4) * 4 * m + 4 * i + j % 4);
                    assert!(!seen[at], "{groups} groups: {g}/{j} collides");
                    seen[at] = true;
                }
            }
            assert!(seen.iter().all(|&v| v));
        }
        // Weight k of group g, exactly representable, comes back from its place.
        let (rows, cols) = (2, 17 * 32);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 5 + i / 32) % 16) as f32 - 8.0)
            .collect();
        let b = quantize_q4(&w, rows, cols);
        let m = Q4Matrix::new(&b, rows, cols).unwrap();
        for r in 0..rows {
            let nib = m.row_nibbles(r);
            for c in 0..cols {
                let (g, e) = (c / 32, c % 32);
                let byte = nib[nibble_offset(17, g, e % 16)];
                let q = if e < 16 { byte & 15 } else { byte >> 4 };
                assert_eq!((q as f32 - 8.0) * m.scale(r, g), w[r * cols + c], "{r}/{c}");
            }
        }
    }
}
