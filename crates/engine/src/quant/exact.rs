//! Int4 and 8-bit weights times f32 activations, the activations not rounded ("exact").
//!
//! The int4 and 8-bit kernels round each group of 32 activations to 8 bits before their
//! integer dot products. That rounding falls on a product's input, so two computations that
//! are equal in exact arithmetic but multiply by a weight at different points (MLA's absorbed
//! form `(W_uk^T q) . c` and its expanded form `q . (W_uk c)`) round different values and
//! disagree by ~1% of the logits, where with f32 inputs they agree to f32 rounding. These
//! products keep the inputs f32 and multiply them by the weights' integers widened to f32
//! (exact), each group's sum then scaled by its f16 scale.
//!
//! Both formats keep a block of 16 groups (a row's last block: the `m` groups left) as runs
//! of one dword of every group: 8-bit value `j` of group `i` at `v(j) * 4m + 4i + j % 4` with
//! `v(j) = (j % 16 / 4) * 2 + j / 16`, and int4's nibble byte `j` (0..16) at `(j / 4) * 4m +
//! 4i + j % 4` holding values `j` (low nibble) and `j + 16` (high). Read low nibbles then high
//! ones, the int4 runs are the 8-bit runs in the same order. So a row is read in that stored
//! order by one sequential pass, and the activations are permuted into it once per product
//! ([`StoredActs`]): a dot product does not see a permutation applied to both sides.
//!
//! Each (row, token) is summed in one fixed order whatever the number of tokens and the
//! kernel, an eight-lane machine's: per block, lane `x` of a run (group `x / 4`) sums its
//! eight runs' products by [`lane_sum`]'s tree; each group's four lanes are added pairwise,
//! `(l0 + l1) + (l2 + l3)`, and scaled; the block's groups, eight at a time, are added to the
//! row's eight totals, group `g` of an octet to total [`OCTET_LANE`]`[g]` (absent groups add
//! `0 * 0`); the row's value is `((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7))`. Those are
//! the AVX2 kernel's horizontal adds and final reduction (`exact_avx2.rs`), so it gives the
//! bits of [`rows_into`] here, the scalar reference. So a product's results do not depend on
//! how many tokens it takes (a prompt cut into passes gives the bits of one pass), as with the
//! 8-bit kernels' exact integer sums. The scalar reference widens a block's weights to f32
//! once for every token, the AVX2 kernel in registers once per two tokens.

use half::f16;

use super::q4::{BLOCK_GROUPS, BLOCK_NIBBLES};
use super::q8w::{value_offset, BLOCK_VALUES};
use super::{check_kernel, q4_padded_cols, Kernel, OutView, Q4Matrix, Q8Matrix, GROUP};

/// Activations permuted into the weights' stored order: `n` rows of `kp` values (`kp` the
/// columns padded to whole groups; padding zero).
#[derive(Clone, Debug, Default)]
pub struct StoredActs {
    pub x: Vec<f32>,
    pub n: usize,
    pub kp: usize,
}

impl StoredActs {
    /// `x`: `n` rows of `cols` values.
    pub fn new(x: &[f32], n: usize, cols: usize) -> StoredActs {
        assert_eq!(x.len(), n * cols, "StoredActs: x is not n x cols");
        let kp = q4_padded_cols(cols);
        let groups = kp / GROUP;
        let mut out = vec![0.0f32; n * kp];
        if cols > 0 {
            for (src, dst) in x.chunks_exact(cols).zip(out.chunks_exact_mut(kp)) {
                // Each group's values by fours: values 4c..4c+4 are consecutive in both orders
                // (`value_offset`), at the start of their run's dword of the group.
                for (g, vals) in src.chunks(GROUP).enumerate() {
                    for (c, four) in vals.chunks(4).enumerate() {
                        let at = value_offset(groups, g, 4 * c);
                        dst[at..at + four.len()].copy_from_slice(four);
                    }
                }
            }
        }
        StoredActs { x: out, n, kp }
    }
}

/// The f32 scales of a block's groups (`f16` little-endian pairs) into `out`.
fn block_scales(bytes: &[u8], out: &mut [f32; BLOCK_GROUPS]) {
    for (o, s) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        *o = f16::from_le_bytes([s[0], s[1]]).to_f32();
    }
}

/// How a row stores its values.
#[derive(Clone, Copy)]
pub(super) enum Format {
    Q4,
    Q8,
}

/// Block `b`'s weights (without their scales) as f32, in stored order, into `q` (`8 * run`
/// values): int4 `q - 8` (its nibble runs low then high), 8-bit `q`. Exact small integers.
#[inline(always)]
pub(super) fn widen_block(f: Format, bytes: &[u8], b: usize, run: usize, q: &mut [f32]) {
    match f {
        Format::Q4 => {
            let nib = &bytes[b * BLOCK_NIBBLES..b * BLOCK_NIBBLES + 4 * run];
            for (k, src) in nib.chunks_exact(run).enumerate() {
                let (lo, hi) = q[2 * k * run..(2 * k + 2) * run].split_at_mut(run);
                for x in 0..run {
                    lo[x] = ((src[x] & 15) as i32 - 8) as f32;
                    hi[x] = ((src[x] >> 4) as i32 - 8) as f32;
                }
            }
        }
        Format::Q8 => {
            let vals = &bytes[b * BLOCK_VALUES..b * BLOCK_VALUES + 8 * run];
            for (d, &v) in q.iter_mut().zip(vals) {
                *d = v as i8 as f32;
            }
        }
    }
}

/// The sum of a lane's eight products, one per run: `((p0 + p1) + (p2 + p3)) + ((p4 + p5) +
/// (p6 + p7))` (a tree: three dependent adds, not eight).
#[inline(always)]
fn lane_sum(p: [f32; 8]) -> f32 {
    ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
}

/// One block's lanes for one token, its weights widened into `q` (runs of `run` lanes).
#[inline(always)]
fn block_lanes(run: usize, q: &[f32], xs: &[f32], lanes: &mut [f32; 64]) {
    for (x, lane) in lanes[..run].iter_mut().enumerate() {
        *lane = lane_sum(std::array::from_fn(|v| q[v * run + x] * xs[v * run + x]));
    }
}

/// Where group `g` of an octet lands among a row's eight totals: the lanes of AVX2's two
/// horizontal adds of four vectors of two groups each, `[g0, g2, g4, g6, g1, g3, g5, g7]`.
const OCTET_LANE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// Adds a block's `m` scaled group sums to a row's eight totals (see the module doc).
#[inline(always)]
fn fold_groups(lanes: &[f32; 64], m: usize, scales: &[f32; BLOCK_GROUPS], t: &mut [f32; 8]) {
    for o in 0..m.div_ceil(8) {
        let mut add = [0.0f32; 8];
        for (g, &lane) in OCTET_LANE.iter().enumerate() {
            let gi = 8 * o + g;
            if gi < m {
                let l = &lanes[4 * gi..4 * gi + 4];
                add[lane] = scales[gi] * ((l[0] + l[1]) + (l[2] + l[3]));
            }
        }
        for (tk, a) in t.iter_mut().zip(add) {
            *tk += a;
        }
    }
}

/// A row's value from its eight totals.
#[inline(always)]
fn row_total(t: &[f32; 8]) -> f32 {
    ((t[0] + t[4]) + (t[2] + t[6])) + ((t[1] + t[5]) + (t[3] + t[7]))
}

/// `out[t][r]` for the view's rows and every token of `x`: the scalar reference.
fn rows_into<'w>(
    f: Format,
    row: &impl Fn(usize) -> (&'w [u8], &'w [u8]),
    x: &StoredActs,
    out: &mut OutView,
) {
    let groups = x.kp / GROUP;
    let mut scales = [0.0f32; BLOCK_GROUPS];
    let mut totals = vec![[0.0f32; 8]; x.n];
    let mut q = [0.0f32; BLOCK_VALUES];
    let mut lanes = [0.0f32; 64];
    for r in out.rows() {
        let (s, v) = row(r);
        totals.fill([0.0; 8]);
        for b in 0..groups.div_ceil(BLOCK_GROUPS) {
            let g0 = b * BLOCK_GROUPS;
            let m = (groups - g0).min(BLOCK_GROUPS);
            let run = 4 * m;
            block_scales(&s[2 * g0..2 * (g0 + m)], &mut scales);
            widen_block(f, v, b, run, &mut q);
            for (t, total) in totals.iter_mut().enumerate() {
                let xs = &x.x[t * x.kp + b * BLOCK_VALUES..];
                block_lanes(run, &q, xs, &mut lanes);
                fold_groups(&lanes, m, &scales, total);
            }
        }
        for (t, total) in totals.iter().enumerate() {
            out.set(t, r, row_total(total));
        }
    }
}

/// The rows of `out`: `out[t][r] = W[r] . x[t]`, each row of `w` given by `row(r)` as (its
/// scale bytes, its value bytes). The vector kernels take `exact_avx2.rs`, which sums in
/// [`rows_into`]'s order: the kernels agree to the bit.
fn exact_into<'w>(
    k: Kernel,
    f: Format,
    kp: usize,
    row: impl Fn(usize) -> (&'w [u8], &'w [u8]),
    x: &StoredActs,
    mut out: OutView,
) {
    check_kernel(k);
    assert_eq!(
        x.kp, kp,
        "exact product: activations of {} columns, weights of {kp}",
        x.kp
    );
    assert_eq!(
        x.n, out.n,
        "exact product: {} activation rows, output of {}",
        x.n, out.n
    );
    if out.rows().is_empty() || x.n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if k != Kernel::Scalar && super::exact_avx2::takes(kp / GROUP) {
        // SAFETY: check_kernel above: the CPU has kernel `k`'s instruction set, AVX2 and F16C
        // included for both vector kernels (`Kernel::available`).
        return unsafe { super::exact_avx2::rows_into(f, &row, x, &mut out) };
    }
    rows_into(f, &row, x, &mut out)
}

/// `out[t][r] = W[r] . x[t]` for the view's rows of int4 `w`, the activations f32.
pub fn q4_exact_into<'w>(k: Kernel, w: &Q4Matrix<'w>, x: &StoredActs, out: OutView) {
    assert_eq!(
        w.grid(),
        super::Grid::Linear,
        "q4_exact_into reads the linear grid only"
    );
    let kp = w.groups() * GROUP;
    exact_into(
        k,
        Format::Q4,
        kp,
        |r| (w.row_scales(r), w.row_nibbles(r)),
        x,
        out,
    );
}

/// `out[t][r] = W[r] . x[t]` for the view's rows of 8-bit `w`, the activations f32.
pub fn q8_exact_into<'w>(k: Kernel, w: &Q8Matrix<'w>, x: &StoredActs, out: OutView) {
    let kp = w.groups() * GROUP;
    exact_into(
        k,
        Format::Q8,
        kp,
        |r| (w.row_scales(r), w.row_values(r)),
        x,
        out,
    );
}
