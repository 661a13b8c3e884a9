//! The attention kernel, flash-attention shaped: the history is read in tiles of [`TILE`]
//! positions (at fixed absolute offsets), and each query keeps a running maximum, a running
//! total and its weighted sum of values, rescaled when a tile raises the maximum (the online
//! softmax), so no row of scores longer than a tile ever exists.
//!
//! Written once over [`Lanes`]: per score, sixteen fused multiply-add partial sums over the key
//! dimension, summed as a fixed tree, then the scalar tail; per value element, fused
//! multiply-adds in position order. Every backend computes exactly that, a query's tiles are
//! the same in a block as alone, and f16 rows widen exactly, so prefill (blocks of queries over
//! tiles widened into a buffer once for the whole block) and decode (one query reading the f16
//! rows straight from the cache) give the same bits.

use half::f16;

use super::lanes::{self, Lanes, LANES};
use super::{AttendArgs, HeadRows};
use crate::ops::exp;

/// Positions per tile: the keys and values of a tile (16 KiB each at 128 dims) stay in L1
/// while every query of a block uses them.
pub(super) const TILE: usize = 32;
/// Keys scored together (independent accumulator chains).
const GROUP: usize = 4;

/// Rows of one head's history: f32 or f16, `dim` values each, contiguous.
trait Rows: Copy {
    /// Sixteen values from index `at` as lanes.
    ///
    /// # Safety
    /// `at + 16 <= len`; the CPU has `L`'s features.
    unsafe fn lanes<L: Lanes>(self, at: usize) -> L;
    fn get(self, at: usize) -> f32;
}

impl Rows for &[f32] {
    #[inline(always)]
    unsafe fn lanes<L: Lanes>(self, at: usize) -> L {
        debug_assert!(at + LANES <= self.len());
        // SAFETY: in bounds (contract).
        unsafe { L::load(self.as_ptr().add(at)) }
    }
    #[inline(always)]
    fn get(self, at: usize) -> f32 {
        self[at]
    }
}

impl Rows for &[f16] {
    #[inline(always)]
    unsafe fn lanes<L: Lanes>(self, at: usize) -> L {
        debug_assert!(at + LANES <= self.len());
        // SAFETY: in bounds (contract).
        unsafe { L::load_f16(self.as_ptr().add(at)) }
    }
    #[inline(always)]
    fn get(self, at: usize) -> f32 {
        self[at].to_f32()
    }
}

/// One query's online-softmax state: the largest score so far and the total of
/// `exp(score - max)` over the positions seen.
#[derive(Clone, Copy)]
struct Running {
    max: f32,
    total: f32,
}

/// How many positions each query of a block sees: query `j` the first `n0 + j / share`.
#[derive(Clone, Copy)]
struct Sees {
    n0: usize,
    share: usize,
}

/// Dimensions of one call: key (and query) and value sizes, the score scale.
#[derive(Clone, Copy)]
struct Dims {
    kd: usize,
    vd: usize,
    scale: f32,
}

/// `out[j * vd..]` = softmax-weighted sum of the values query `qs[j]` sees (the first
/// `a.n0 + j / a.share` positions). See the module comment for the arithmetic.
///
/// # Safety
/// The CPU has `L`'s features.
#[inline(always)]
pub(super) unsafe fn attend_tiles<L: Lanes>(qs: &[&[f32]], a: &AttendArgs, out: &mut [f32]) {
    let Some(q0) = qs.first() else { return };
    let b = qs.len();
    let dims = Dims {
        kd: q0.len(),
        vd: out.len() / b,
        scale: a.scale,
    };
    let (kd, vd) = (dims.kd, dims.vd);
    assert!(a.share >= 1, "attend: share must be at least 1");
    let last = a.n0 + (b - 1) / a.share;
    assert!(
        a.n0 >= 1 && kd > 0 && out.len() == b * vd && qs.iter().all(|q| q.len() == kd),
        "attend: inconsistent shapes"
    );
    assert!(
        rows_len(a.keys) >= last * kd && rows_len(a.values) >= last * vd,
        "attend: the history is shorter than the queries see"
    );
    out.fill(0.0);
    let mut runs = vec![
        Running {
            max: f32::NEG_INFINITY,
            total: 0.0
        };
        b
    ];
    // A block of queries widens each f16 tile once for all of them; one query reads the f16
    // rows directly (nothing to share).
    let direct = b == 1;
    let same_rows = kd == vd && rows_ptr(a.keys) == rows_ptr(a.values);
    let sees = Sees {
        n0: a.n0,
        share: a.share,
    };
    let (mut kbuf, mut vbuf) = (Vec::new(), Vec::new());
    for lo in (0..last).step_by(TILE) {
        let hi = (lo + TILE).min(last);
        let (kr, vr) = (lo * kd..hi * kd, lo * vd..hi * vd);
        // SAFETY (each call): the CPU has L's features (contract); the tile's rows are the
        // ranges just taken, inside the history (asserted above).
        // The next tile's rows, asked for while this one computes.
        let ahead = Ahead {
            keys: next_rows(a.keys, hi * kd..(hi + TILE).min(last) * kd),
            values: next_rows(a.values, hi * vd..(hi + TILE).min(last) * vd),
            to_l1: direct,
        };
        unsafe {
            match (a.keys, a.values) {
                (HeadRows::F32(k), HeadRows::F32(v)) => tile::<L, &[f32]>(
                    qs, &k[kr], &v[vr], lo, hi, sees, dims, ahead, &mut runs, out,
                ),
                (HeadRows::F16(k), HeadRows::F16(v)) if direct => tile::<L, &[f16]>(
                    qs, &k[kr], &v[vr], lo, hi, sees, dims, ahead, &mut runs, out,
                ),
                (keys, values) => {
                    let k = widened::<L>(keys, kr, &mut kbuf);
                    // Values that are the keys' own rows (MLA's latents) are widened once.
                    let v = if same_rows {
                        k
                    } else {
                        widened::<L>(values, vr, &mut vbuf)
                    };
                    tile::<L, &[f32]>(qs, k, v, lo, hi, sees, dims, ahead, &mut runs, out)
                }
            }
        }
    }
    for (o, r) in out.chunks_exact_mut(vd).zip(&runs) {
        for x in o.iter_mut() {
            *x /= r.total;
        }
    }
}

/// The f16 rows of the tile after the current one (empty for f32 histories, which are not
/// streamed from memory), fetched in parts as the current tile's queries advance: one burst of
/// a whole tile would fill the CPU's line-fill buffers and stall it. Into L1 for one query
/// reading the rows directly (decode), into L2 for a block (its widened buffers fill L1).
/// Measured (attn_bench, Intel): blocks +13% with parts into L2; decode -18% into L2.
#[derive(Clone, Copy)]
struct Ahead<'a> {
    keys: &'a [f16],
    values: &'a [f16],
    to_l1: bool,
}

impl Ahead<'_> {
    /// Part `i` of `n` of both row ranges.
    #[inline(always)]
    fn fetch_part(self, i: usize, n: usize) {
        for x in [self.keys, self.values] {
            let part = x.len().div_ceil(n);
            prefetch(
                &x[(i * part).min(x.len())..((i + 1) * part).min(x.len())],
                self.to_l1,
            );
        }
    }
}

/// Rows `range` of an f16 history (clamped to it), nothing for an f32 one.
fn next_rows(r: HeadRows<'_>, range: std::ops::Range<usize>) -> &[f16] {
    match r {
        HeadRows::F16(x) => &x[range.start.min(x.len())..range.end.min(x.len())],
        HeadRows::F32(_) => &[],
    }
}

/// Hints the cache to fetch `x` into L1 (`to_l1`) or L2 (a hint only: it never changes a
/// result).
#[inline(always)]
fn prefetch(x: &[f16], to_l1: bool) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..x.len()).step_by(32) {
        // SAFETY: `off < x.len()`, so the address is inside `x`; a prefetch reads nothing
        // architecturally and cannot fault.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
            let at = x.as_ptr().add(off).cast();
            if to_l1 {
                _mm_prefetch::<_MM_HINT_T0>(at)
            } else {
                _mm_prefetch::<_MM_HINT_T1>(at)
            }
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (x, to_l1);
}

/// Where a history's rows start (keys and values may be the same rows).
fn rows_ptr(r: HeadRows) -> *const u8 {
    match r {
        HeadRows::F32(x) => x.as_ptr().cast(),
        HeadRows::F16(x) => x.as_ptr().cast(),
    }
}

fn rows_len(r: HeadRows) -> usize {
    match r {
        HeadRows::F32(x) => x.len(),
        HeadRows::F16(x) => x.len(),
    }
}

/// Rows `range` of a history as f32: borrowed, or widened (exactly) into `buf`.
///
/// # Safety
/// The CPU has `L`'s features.
#[inline(always)]
unsafe fn widened<'a, L: Lanes>(
    src: HeadRows<'a>,
    range: std::ops::Range<usize>,
    buf: &'a mut Vec<f32>,
) -> &'a [f32] {
    match src {
        HeadRows::F32(x) => &x[range],
        HeadRows::F16(x) => {
            let x = &x[range];
            buf.resize(x.len(), 0.0);
            let whole = x.len() / LANES * LANES;
            for i in (0..whole).step_by(LANES) {
                // SAFETY: i + 16 <= len of both; the CPU has L's features (contract).
                unsafe { L::load_f16(x.as_ptr().add(i)).store(buf.as_mut_ptr().add(i)) };
            }
            for (d, s) in buf[whole..].iter_mut().zip(&x[whole..]) {
                *d = s.to_f32();
            }
            buf
        }
    }
}

/// Every query of the block that sees part of tile `lo..hi` (rows `keys`, `values`, relative
/// to `lo`) takes it in: four at a time where all four see all of it (each key and value row
/// loaded once for the four), else two, else one. Four is the most whose running sums fit
/// AVX-512's registers (measured: 1.17-1.18x the pairs per second of two at histories of
/// 4k-32k); on AVX2 the four are still taken together, their loops blocked smaller inside
/// ([`dot_block`], [`accumulate`]: 1.06-1.14x MLA decode's 8 heads over 256-1024 positions,
/// `examples/mla_attn_bench.rs`, against four unblocked that spilled their sums).
///
/// # Safety
/// The CPU has `L`'s features; `keys`/`values` hold `hi - lo` rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn tile<L: Lanes, R: Rows>(
    qs: &[&[f32]],
    keys: R,
    values: R,
    lo: usize,
    hi: usize,
    sees: Sees,
    dims: Dims,
    ahead: Ahead,
    runs: &mut [Running],
    out: &mut [f32],
) {
    let vd = dims.vd;
    let steps = qs.len().div_ceil(2);
    let mut j = 0;
    while j < qs.len() {
        ahead.fetch_part(j / 2, steps);
        let seen = sees.n0 + j / sees.share;
        let count = hi.min(seen).saturating_sub(lo);
        if count == 0 {
            j += 1;
            continue;
        }
        if j + 3 < qs.len() && seen >= hi {
            let (o0, rest) = out[j * vd..].split_at_mut(vd);
            let (o1, rest) = rest.split_at_mut(vd);
            let (o2, rest) = rest.split_at_mut(vd);
            let o3 = &mut rest[..vd];
            let [r0, r1, r2, r3] = &mut runs[j..j + 4] else {
                unreachable!()
            };
            // SAFETY: forwarded contract; all four queries see the whole tile.
            unsafe {
                take_in::<L, R, 4>(
                    [qs[j], qs[j + 1], qs[j + 2], qs[j + 3]],
                    keys,
                    values,
                    count,
                    dims,
                    [r0, r1, r2, r3],
                    [o0, o1, o2, o3],
                )
            };
            j += 4;
            continue;
        }
        let (o, rest) = out[j * vd..].split_at_mut(vd);
        if j + 1 < qs.len() && seen >= hi {
            let (r0, r1) = runs[j..].split_at_mut(1);
            // SAFETY: forwarded contract; both queries see the whole tile (`count` rows).
            unsafe {
                take_in::<L, R, 2>(
                    [qs[j], qs[j + 1]],
                    keys,
                    values,
                    count,
                    dims,
                    [&mut r0[0], &mut r1[0]],
                    [o, &mut rest[..vd]],
                )
            };
            j += 2;
        } else {
            // SAFETY: forwarded contract.
            unsafe { take_in::<L, R, 1>([qs[j]], keys, values, count, dims, [&mut runs[j]], [o]) };
            j += 1;
        }
    }
}

/// `Q` queries take in the first `count` rows of a tile: scores, the online-softmax update,
/// the weighted values.
///
/// # Safety
/// The CPU has `L`'s features; `keys`/`values` hold `count` rows.
#[inline(always)]
unsafe fn take_in<L: Lanes, R: Rows, const Q: usize>(
    qs: [&[f32]; Q],
    keys: R,
    values: R,
    count: usize,
    dims: Dims,
    runs: [&mut Running; Q],
    outs: [&mut [f32]; Q],
) {
    let mut w = [[f32::NEG_INFINITY; TILE]; Q];
    let mut p = 0;
    // Sixteen scores at a time as one vector (their trees finished side by side) where the
    // rows have no scalar tail; the same bits as one by one.
    while dims.kd.is_multiple_of(LANES) && p + LANES <= count {
        let mut parts = [[L::zero(); 4]; Q];
        for m in 0..4 {
            // SAFETY: rows p + m + 4r < p + 16 <= count (contract).
            let acc = unsafe { dot_block::<L, R, Q, 4>(qs, keys, p + m, 4, dims.kd) };
            for (parts, acc) in parts.iter_mut().zip(acc) {
                // SAFETY: the CPU has L's features (contract).
                parts[m] = unsafe { L::reduce4(acc) };
            }
        }
        for (w, parts) in w.iter_mut().zip(parts) {
            // SAFETY: w[p..p + 16] is inside the tile's row of scores.
            unsafe {
                L::finish16(parts)
                    .mul(L::splat(dims.scale))
                    .store(w.as_mut_ptr().add(p))
            };
        }
        p += LANES;
    }
    while p + GROUP <= count {
        // SAFETY: rows p..p + GROUP < count (contract).
        let d = unsafe { dots::<L, R, Q, GROUP>(qs, keys, p, dims.kd) };
        for (w, d) in w.iter_mut().zip(d) {
            for (w, d) in w[p..p + GROUP].iter_mut().zip(d) {
                *w = d * dims.scale;
            }
        }
        p += GROUP;
    }
    while p < count {
        // SAFETY: as above.
        let d = unsafe { dots::<L, R, Q, 1>(qs, keys, p, dims.kd) };
        for (w, [d]) in w.iter_mut().zip(d) {
            w[p] = d * dims.scale;
        }
        p += 1;
    }
    let mut corr = [0.0f32; Q];
    let half = TILE / 2;
    for ((w, run), corr) in w.iter_mut().zip(runs).zip(corr.iter_mut()) {
        // Positions past `count` hold -inf: they change no maximum, and their weight is
        // exactly 0.
        // SAFETY (the loads): each half of the tile holds 16 values; the CPU has L's
        // features (contract).
        let (a, b) = unsafe { (L::load(w.as_ptr()), L::load(w.as_ptr().add(half))) };
        let max = run.max.max(unsafe { a.maximum(b).max_all() });
        *corr = exp(run.max - max);
        // SAFETY: as above (the stores too).
        let tile_total = unsafe {
            let m = L::splat(max);
            let (a, b) = (lanes::exp(a.sub(m)), lanes::exp(b.sub(m)));
            a.store(w.as_mut_ptr());
            b.store(w.as_mut_ptr().add(half));
            a.add(b).sum()
        };
        run.total = run.total * *corr + tile_total;
        run.max = max;
    }
    // SAFETY: forwarded contract.
    unsafe { accumulate::<L, R, Q>(outs, corr, &w, count, values, dims.vd) };
}

/// `dot(q, key row p + r)` for `G` consecutive rows and `Q` queries, each key vector loaded
/// once for all queries: sixteen fused partial sums per score, the tree sum, the scalar tail.
///
/// # Safety
/// The CPU has `L`'s features; `keys` holds rows `p..p + G` of `kd` values.
#[inline(always)]
unsafe fn dots<L: Lanes, R: Rows, const Q: usize, const G: usize>(
    qs: [&[f32]; Q],
    keys: R,
    p: usize,
    kd: usize,
) -> [[f32; G]; Q] {
    let chunks = kd / LANES;
    // SAFETY: forwarded contract (stride 1: rows p..p + G).
    let acc = unsafe { dot_block::<L, R, Q, G>(qs, keys, p, 1, kd) };
    let mut out = [[0.0f32; G]; Q];
    // SAFETY (the sums and the tail's reads): the CPU has L's features; rows p..p + G
    // (contract).
    unsafe {
        for ((out, acc), q) in out.iter_mut().zip(&acc).zip(&qs) {
            // Four scores' trees side by side where there are four (same bits as one by one).
            match <[L; 4]>::try_from(&acc[..]) {
                Ok(four) => out.copy_from_slice(&L::sums4(four)),
                Err(_) => {
                    for (o, a) in out.iter_mut().zip(acc) {
                        *o = a.sum();
                    }
                }
            }
            for (r, o) in out.iter_mut().enumerate() {
                let mut s = *o;
                for d in chunks * LANES..kd {
                    s = q[d].mul_add(keys.get((p + r) * kd + d), s);
                }
                *o = s;
            }
        }
    }
    out
}

/// Whether a loop keeping `sums` running sums, `loads` loaded rows and one more value fits
/// `L`'s registers.
const fn fits<L: Lanes>(sums: usize, loads: usize) -> bool {
    sums + loads < L::LIVE
}

/// [`dot_lanes`] for `Q` queries and `G` rows, in blocks of at most two queries by two rows
/// where the whole would not fit the registers ([`Lanes::LIVE`]): each partial sum is the same
/// chain of multiply-adds either way.
///
/// # Safety
/// As [`dot_lanes`].
#[inline(always)]
unsafe fn dot_block<L: Lanes, R: Rows, const Q: usize, const G: usize>(
    qs: [&[f32]; Q],
    keys: R,
    p: usize,
    stride: usize,
    kd: usize,
) -> [[L; G]; Q] {
    // SAFETY (each call): rows p + r * stride for r < G, as the contract gives.
    unsafe {
        if fits::<L>(Q * G, G) {
            return dot_lanes::<L, R, Q, G>(qs, keys, p, stride, kd);
        }
        let mut out = [[L::zero(); G]; Q];
        let mut q = 0;
        while q < Q {
            let two = q + 1 < Q;
            let mut r = 0;
            while r < G {
                let at = p + r * stride;
                if r + 1 < G {
                    if two {
                        let a = dot_lanes::<L, R, 2, 2>([qs[q], qs[q + 1]], keys, at, stride, kd);
                        out[q][r..r + 2].copy_from_slice(&a[0]);
                        out[q + 1][r..r + 2].copy_from_slice(&a[1]);
                    } else {
                        let [a] = dot_lanes::<L, R, 1, 2>([qs[q]], keys, at, stride, kd);
                        out[q][r..r + 2].copy_from_slice(&a);
                    }
                    r += 2;
                } else {
                    if two {
                        let a = dot_lanes::<L, R, 2, 1>([qs[q], qs[q + 1]], keys, at, stride, kd);
                        (out[q][r], out[q + 1][r]) = (a[0][0], a[1][0]);
                    } else {
                        out[q][r] = dot_lanes::<L, R, 1, 1>([qs[q]], keys, at, stride, kd)[0][0];
                    }
                    r += 1;
                }
            }
            q += 1 + usize::from(two);
        }
        out
    }
}

/// The sixteen fused partial sums of `dot(q, key row p + r * stride)` for `G` rows and `Q`
/// queries over the whole 16-value chunks of the rows, each key vector loaded once for all
/// queries.
///
/// # Safety
/// The CPU has `L`'s features; `keys` holds rows `p + r * stride` (r < G) of `kd` values.
#[inline(always)]
unsafe fn dot_lanes<L: Lanes, R: Rows, const Q: usize, const G: usize>(
    qs: [&[f32]; Q],
    keys: R,
    p: usize,
    stride: usize,
    kd: usize,
) -> [[L; G]; Q] {
    // SAFETY (all loads): chunk c of a row spans c * 16..c * 16 + 16 <= kd values of the row
    // and of each query (contract).
    unsafe {
        // Plain loops, not `array::from_fn`: its closures would not inherit the caller's
        // target features, and the vector operations would become calls.
        let mut acc = [[L::zero(); G]; Q];
        for c in 0..kd / LANES {
            let mut k = [L::zero(); G];
            for (r, k) in k.iter_mut().enumerate() {
                *k = keys.lanes::<L>((p + r * stride) * kd + c * LANES);
            }
            for (acc, q) in acc.iter_mut().zip(&qs) {
                let x = L::load(q.as_ptr().add(c * LANES));
                for (a, k) in acc.iter_mut().zip(&k) {
                    *a = x.mul_add(*k, *a);
                }
            }
        }
        acc
    }
}

/// `out = out * corr + sum over p < count of w[p] * value row p`, per query, in position
/// order (fused), the running sums held in registers eight vectors at a time.
///
/// # Safety
/// The CPU has `L`'s features; `values` holds `count` rows of `vd`; each out holds `vd`.
#[inline(always)]
unsafe fn accumulate<L: Lanes, R: Rows, const Q: usize>(
    mut outs: [&mut [f32]; Q],
    corr: [f32; Q],
    w: &[[f32; TILE]; Q],
    count: usize,
    values: R,
    vd: usize,
) {
    let chunks = vd / LANES;
    let mut c = 0;
    // SAFETY (each call): chunks c..c + G of every row and out are inside them (contract).
    unsafe {
        while c < chunks {
            // The widest span whose Q x G running sums, G value loads and the weight fit the
            // registers (AVX-512: four queries 4 x 4, fewer 8 each; AVX2: 4 x 1, 2 x 2, 1 x 2).
            c = match chunks - c {
                8.. if fits::<L>(Q * 8, 8) => {
                    span::<L, R, Q, 8>(&mut outs, corr, w, count, values, vd, c)
                }
                4.. if fits::<L>(Q * 4, 4) => {
                    span::<L, R, Q, 4>(&mut outs, corr, w, count, values, vd, c)
                }
                2.. if fits::<L>(Q * 2, 2) => {
                    span::<L, R, Q, 2>(&mut outs, corr, w, count, values, vd, c)
                }
                _ => span::<L, R, Q, 1>(&mut outs, corr, w, count, values, vd, c),
            };
        }
    }
    for d in chunks * LANES..vd {
        for ((o, corr), w) in outs.iter_mut().zip(corr).zip(w) {
            let mut x = o[d] * corr;
            for (p, &wp) in w[..count].iter().enumerate() {
                x = wp.mul_add(values.get(p * vd + d), x);
            }
            o[d] = x;
        }
    }
}

/// [`accumulate`] for chunks `c..c + G` (16 values each); returns `c + G`.
///
/// # Safety
/// As [`accumulate`], and `c + G <= vd / 16`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn span<L: Lanes, R: Rows, const Q: usize, const G: usize>(
    outs: &mut [&mut [f32]; Q],
    corr: [f32; Q],
    w: &[[f32; TILE]; Q],
    count: usize,
    values: R,
    vd: usize,
    c: usize,
) -> usize {
    // SAFETY (all loads and stores): chunk c + g spans (c + g) * 16..+16 <= vd values of each
    // out and of each value row p < count (contract).
    unsafe {
        let mut acc = [[L::zero(); G]; Q];
        for ((acc, o), &corr) in acc.iter_mut().zip(outs.iter()).zip(&corr) {
            let k = L::splat(corr);
            for (g, a) in acc.iter_mut().enumerate() {
                *a = L::load(o.as_ptr().add((c + g) * LANES)).mul(k);
            }
        }
        for p in 0..count {
            let mut v = [L::zero(); G];
            for (g, v) in v.iter_mut().enumerate() {
                *v = values.lanes::<L>(p * vd + (c + g) * LANES);
            }
            for (acc, w) in acc.iter_mut().zip(w) {
                let wv = L::splat(w[p]);
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = wv.mul_add(*v, *a);
                }
            }
        }
        for (acc, o) in acc.iter().zip(outs.iter_mut()) {
            for (g, a) in acc.iter().enumerate() {
                a.store(o.as_mut_ptr().add((c + g) * LANES));
            }
        }
    }
    c + G
}
