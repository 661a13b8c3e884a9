//! AVX-512 (F, BW, VL, VNNI) kernels.
//!
//! int4 × int8, per block of 16 groups: the block's 256 nibble bytes are four 64-byte vectors,
//! vector `k` holding dword `k` of each group (`q4::nibble_offset`), so i32 lane `i` is group
//! `i` throughout. Each vector's low and high nibbles are multiplied with the matching
//! activation vectors by `_mm512_dpbusd_epi32` (u8 × i8, four products summed into each lane),
//! all four into one accumulator that starts at the groups' `-8 * sum(a)`: the lane ends as the
//! group's exact integer dot. Then one conversion to f32 and one FMA against `weight scale *
//! activation scale` per block, where a lane per dword needed four of each. Tiles of `R` rows
//! × `T` tokens for prefill; decode (n = 1) has its own one-row loop with the same arithmetic.

use std::arch::x86_64::*;
use std::ops::Range;

use super::prefetch::{decode_prefetch_level, prefetch_level, PrefetchLevel};
use super::q4::{RowBlocks, TailBuf, BLOCK_GROUPS, BLOCK_NIBBLES};
use super::q8w::{RowBlocks8, TailBuf8, BLOCK_VALUES};
use super::x86_avx2::{
    first_prefetch, for_each_block, prefetch_line, ActPtr, TilePrefetch, PREFETCH,
};
use super::{Q4Matrix, Q8Acts, Q8Matrix};

/// Dots of `R` rows with `T` activation vectors.
///
/// # Safety
/// `wr[r]` points at the `groups * 18` readable bytes of one row (`groups * 2` bytes of scales,
/// then `groups * 16` bytes of nibbles); each `a[t]` points at the arrays of one activation
/// vector with at least `groups.next_multiple_of(16)` groups.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_tile<const R: usize, const T: usize>(
    wr: [*const u8; R],
    groups: usize,
    a: [ActPtr; T],
    pf: PrefetchLevel,
) -> [[f32; T]; R] {
    let nb = groups.div_ceil(BLOCK_GROUPS);
    let row_bytes = groups * 18;
    let mut tails: [TailBuf; R] = [const { TailBuf::uninit() }; R];
    // SAFETY: each wr[r] is one row of `groups` groups (contract); `tails` lives to the end.
    let blocks: [RowBlocks; R] =
        std::array::from_fn(|r| unsafe { RowBlocks::new(wr[r], groups, &mut tails[r]) });
    let mut prefetch = TilePrefetch::new(wr[0], R * row_bytes, pf);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for c in 0..nb {
        prefetch.chunk(c, nb);
        let mut q = [std::ptr::null::<u8>(); R];
        let mut dw = [_mm512_setzero_ps(); R];
        for r in 0..R {
            let (nib, sc) = blocks[r].block(c);
            q[r] = nib;
            // SAFETY: sc points at 32 readable bytes (16 f16 scales), see RowBlocks::block.
            dw[r] = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(sc.cast()) });
        }
        // SAFETY (activation reads below): block c < nb <= padded groups / 16, so
        // qs[c*512..c*512 + 512] and corr/dexp[c*16..c*16 + 16] are inside each vector's arrays.
        let mut ints = [[_mm512_setzero_si512(); T]; R];
        for t in 0..T {
            let corr = unsafe { _mm512_loadu_si512(a[t].corr.add(c * 16).cast()) };
            for row in ints.iter_mut() {
                row[t] = corr;
            }
        }
        for k in 0..4 {
            let mut wlo = [_mm512_setzero_si512(); R];
            let mut whi = [_mm512_setzero_si512(); R];
            for r in 0..R {
                // SAFETY: q[r] points at the block's 256 nibble bytes.
                let v = unsafe { _mm512_loadu_si512(q[r].add(k * 64).cast()) };
                wlo[r] = _mm512_and_si512(v, m4);
                whi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            let aoff = c * 512 + k * 128;
            for t in 0..T {
                let (alo, ahi) = unsafe {
                    (
                        _mm512_loadu_si512(a[t].qs.add(aoff).cast()),
                        _mm512_loadu_si512(a[t].qs.add(aoff + 64).cast()),
                    )
                };
                for r in 0..R {
                    let i = _mm512_dpbusd_epi32(ints[r][t], wlo[r], alo);
                    ints[r][t] = _mm512_dpbusd_epi32(i, whi[r], ahi);
                }
            }
        }
        for t in 0..T {
            let de = unsafe { _mm512_loadu_ps(a[t].dexp.add(c * 16)) };
            for r in 0..R {
                acc[r][t] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(ints[r][t]),
                    _mm512_mul_ps(dw[r], de),
                    acc[r][t],
                );
            }
        }
    }
    let mut res = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            res[r][t] = sum16(acc[r][t]);
        }
    }
    res
}

/// The sum of the sixteen lanes in a fixed order: lanes `i + 8` onto `i`, then `i + 4` onto
/// `i`, then `(0 + 2) + (1 + 3)`. Every int4 path here ends a row with it (or, for rows packed
/// four to a vector, with the same additions), so they agree to the bit.
#[target_feature(enable = "avx512f,avx2")]
#[inline]
fn sum16(v: __m512) -> f32 {
    let hi = _mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v));
    let a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(hi));
    let b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps::<1>(c, c))
}

/// # Safety
/// As [`q4_rows`], for rows `r0..r0 + R` and tokens `t0..t0 + T`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_run<const R: usize, const T: usize>(
    w: &Q4Matrix,
    r0: usize,
    x: &Q8Acts,
    t0: usize,
    out: *mut f32,
    out_stride: usize,
    pf: PrefetchLevel,
) {
    let wr: [*const u8; R] = std::array::from_fn(|i| w.row(r0 + i).as_ptr());
    let a: [ActPtr; T] = std::array::from_fn(|j| ActPtr::new(&x.token(t0 + j)));
    // SAFETY: the pointers come from row slices of `w` (groups*18 bytes: scales, then nibbles)
    // and from activation vectors padded to a multiple of 16 groups >= w.groups() (cols agree).
    let res = unsafe { q4_tile::<R, T>(wr, w.groups(), a, pf) };
    for (i, row) in res.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            // SAFETY: (t0 + j, r0 + i) is within the tokens and rows the caller guarantees
            // writable.
            unsafe { *out.wrapping_add((t0 + j) * out_stride + r0 + i) = v };
        }
    }
}

/// # Safety
/// As `q4_rows`, for rows `r0..r0 + R` and tokens `ts`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_rows_tokens<const R: usize>(
    w: &Q4Matrix,
    r0: usize,
    x: &Q8Acts,
    ts: Range<usize>,
    out: *mut f32,
    out_stride: usize,
    pf: PrefetchLevel,
) {
    let mut t = ts.start;
    while t < ts.end {
        // SAFETY: tokens t..t+T are inside ts; forwarded contract otherwise.
        unsafe {
            match ts.end - t {
                1 => q4_run::<R, 1>(w, r0, x, t, out, out_stride, pf),
                2 => q4_run::<R, 2>(w, r0, x, t, out, out_stride, pf),
                3 => q4_run::<R, 3>(w, r0, x, t, out, out_stride, pf),
                _ => q4_run::<R, 4>(w, r0, x, t, out, out_stride, pf),
            }
        }
        t += (ts.end - t).min(4);
    }
}

/// Decode (one token): the rows one after another, each read as one sequential stream, the
/// prefetch running PREFETCH bytes ahead across row ends, one cache line per 64 bytes of
/// nibbles read. The exact integer per group is summed in two chains: low nibbles from the
/// offset lanes, and high nibbles kept in place (`v & 0xf0`, 16 times their value, which saves
/// the shift), shifted back once per block. A row's last block of `m < 16` groups is read with
/// masked loads in place (its dword `k` of every group is `4m` bytes at `k * 4m`; lanes past `m`
/// read as zero, as the tile's zero-filled copy of it does), so rows shorter than a block take
/// this path too (four-group rows only the last few of a range: the others go four at a time,
/// [`q4_decode_rows_of_4_groups`]). The integer is the same as the tile's, and the float
/// operations are those of `q4_tile::<1, 1>` in the same order, so the results are
/// bit-identical to it.
///
/// # Safety
/// As [`q4_rows`], with `x.n() == 1` and `rows` not empty.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_decode_rows(
    w: &Q4Matrix,
    x: &Q8Acts,
    out: *mut f32,
    rows: Range<usize>,
    pf: PrefetchLevel,
) {
    let groups = w.groups();
    let nb = groups / BLOCK_GROUPS;
    // The last block's groups when it is partial (0: whole blocks only).
    let m = groups % BLOCK_GROUPS;
    let row_bytes = groups * 18;
    let a = ActPtr::new(&x.token(0));
    // Consecutive rows are contiguous: one byte range from the first row on.
    let base = w.row(rows.start).as_ptr();
    let m4 = _mm512_set1_epi8(0x0f);
    let mf0 = _mm512_set1_epi8(0xf0u8 as i8);
    let mut cursor = first_prefetch(base, pf);
    let mut target = PREFETCH;
    // Row bytes per 64 bytes of nibbles (scales included): 72 (a partial block counts as one).
    let step = row_bytes / ((nb + usize::from(m > 0)) * 4);
    let lanes: __mmask16 = ((1u32 << m) - 1) as __mmask16;
    for (i, r) in rows.enumerate() {
        let ws = base.wrapping_add(i * row_bytes);
        let wq = ws.wrapping_add(groups * 2);
        let mut acc = _mm512_setzero_ps();
        for c in 0..nb {
            // SAFETY: block c < nb lies inside row r (c*32 + 32 <= groups*2 scale bytes,
            // c*256 + 256 <= groups*16 nibble bytes); the activation arrays hold at least
            // `groups` groups (c*512 + 512 bytes of qs, c*16 + 16 values of corr/dexp).
            unsafe {
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(ws.add(c * 32).cast()));
                let mut lo = _mm512_loadu_si512(a.corr.add(c * 16).cast());
                let mut hi = _mm512_setzero_si512();
                for k in 0..4 {
                    target += step;
                    while cursor < target {
                        prefetch_line(base.wrapping_add(cursor), pf);
                        cursor += 64;
                    }
                    let v = _mm512_loadu_si512(wq.add(c * BLOCK_NIBBLES + k * 64).cast());
                    let aoff = c * 512 + k * 128;
                    let alo = _mm512_loadu_si512(a.qs.add(aoff).cast());
                    let ahi = _mm512_loadu_si512(a.qs.add(aoff + 64).cast());
                    lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, m4), alo);
                    hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(v, mf0), ahi);
                }
                let ints = _mm512_add_epi32(lo, _mm512_srai_epi32::<4>(hi));
                let de = _mm512_loadu_ps(a.dexp.add(c * 16));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_mul_ps(dw, de), acc);
            }
        }
        if m > 0 {
            // The whole-block loop above with masked loads. Kept apart on purpose: folding
            // both into one masked loop measured ~11% slower on whole rows (2048 x 512 and
            // 2048 x 2048, the experts' shapes).
            let c = nb;
            // SAFETY: the masked loads read only the partial block's bytes inside row r: 2m
            // scale bytes at c*32 (< groups*2) and, per dword k, 4m nibble bytes at
            // c*256 + k*4m (< groups*16); the activation arrays are padded to whole blocks
            // (c*512 + 512 bytes of qs, c*16 + 16 values of corr/dexp), zero past `groups`.
            unsafe {
                let sc = _mm256_maskz_loadu_epi16(lanes, ws.add(c * 32).cast());
                let dw = _mm512_cvtph_ps(sc);
                let mut lo = _mm512_loadu_si512(a.corr.add(c * 16).cast());
                let mut hi = _mm512_setzero_si512();
                for k in 0..4 {
                    target += step;
                    while cursor < target {
                        prefetch_line(base.wrapping_add(cursor), pf);
                        cursor += 64;
                    }
                    let v = _mm512_maskz_loadu_epi32(
                        lanes,
                        wq.add(c * BLOCK_NIBBLES + k * 4 * m).cast(),
                    );
                    let aoff = c * 512 + k * 128;
                    let alo = _mm512_loadu_si512(a.qs.add(aoff).cast());
                    let ahi = _mm512_loadu_si512(a.qs.add(aoff + 64).cast());
                    lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(v, m4), alo);
                    hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(v, mf0), ahi);
                }
                let ints = _mm512_add_epi32(lo, _mm512_srai_epi32::<4>(hi));
                let de = _mm512_loadu_ps(a.dexp.add(c * 16));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_mul_ps(dw, de), acc);
            }
            // Whole rows between prefetch targets: the integer steps of a partial row need
            // not add up to its bytes.
            target = (i + 1) * row_bytes + PREFETCH;
        }
        // SAFETY: r is in `rows`, token 0: the caller guarantees out + r writable.
        unsafe { *out.add(r) = sum16(acc) };
    }
}

/// Decode of rows of four groups (128 columns: MLA's per-head `W_uk^T` at the usual
/// `qk_nope_head_dim`), four rows at a time. A row's 64 nibble bytes are one vector, lane
/// `4k + g` holding dword `k` of group `g`; the activations are rearranged to match once per
/// call, so a row is one load and two `dpbusd`s, and its four dword sums per group are added
/// across lanes (integers: exact in any order). The rows' per-group integers then go four rows
/// to a vector for the float part: the operations of [`q4_decode_rows`]'s partial block per
/// lane, and each row's four lanes summed as [`sum16`] sums a vector holding only them
/// (`(x0 + x2) + (x1 + x3)`, each `+ 0` first), so the results are the same bits at about a
/// third of the instructions. `rows.len()` is a multiple of 4.
///
/// # Safety
/// As [`q4_rows`], with `x.n() == 1` and `w.groups() == 4`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_decode_rows_of_4_groups(
    w: &Q4Matrix,
    x: &Q8Acts,
    out: *mut f32,
    rows: Range<usize>,
    pf: PrefetchLevel,
) {
    const ROW_BYTES: usize = 4 * 18;
    debug_assert!(w.groups() == 4 && rows.len().is_multiple_of(4));
    let a = ActPtr::new(&x.token(0));
    let base = w.row(rows.start).as_ptr();
    // Lane 4k + g: group g's activation bytes for dword k, low nibbles (at k*128 + 4g) and
    // high (64 further); the groups' corrections and scales repeated in each 128-bit lane.
    // Indices into a two-vector table of dwords k (lanes 0..16) and k + 1 (16..32).
    let idx: [i32; 16] = std::array::from_fn(|l| ((l / 4) % 2 * 16 + l % 4) as i32);
    // SAFETY: the activation arrays hold at least one whole block (16 groups): 512 bytes of
    // qs (the eight 64-byte reads below), 16 values of corr and dexp; idx is 16 i32s.
    let (alo, ahi, corr, de) = unsafe {
        let idx = _mm512_loadu_si512(idx.as_ptr().cast());
        let dwords = |at: usize| _mm512_loadu_si512(a.qs.add(at).cast());
        // k = 0, 1 from the first table, k = 2, 3 from the second
        let lo = _mm512_permutex2var_epi32(dwords(0), idx, dwords(128));
        let lo2 = _mm512_permutex2var_epi32(dwords(256), idx, dwords(384));
        let hi = _mm512_permutex2var_epi32(dwords(64), idx, dwords(192));
        let hi2 = _mm512_permutex2var_epi32(dwords(320), idx, dwords(448));
        // lanes 0..8 (k = 0, 1) from the first pair, 8..16 (k = 2, 3) from the second
        let alo = _mm512_mask_mov_epi32(lo, 0xff00, lo2);
        let ahi = _mm512_mask_mov_epi32(hi, 0xff00, hi2);
        let corr = _mm512_broadcast_i32x4(_mm_loadu_si128(a.corr.cast()));
        let de = _mm512_broadcast_f32x4(_mm_loadu_ps(a.dexp));
        (alo, ahi, corr, de)
    };
    let m4 = _mm512_set1_epi8(0x0f);
    let mf0 = _mm512_set1_epi8(0xf0u8 as i8);
    let firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    let mut cursor = first_prefetch(base, pf);
    for i in (0..rows.len()).step_by(4) {
        let target = (i + 4) * ROW_BYTES + PREFETCH;
        while cursor < target {
            prefetch_line(base.wrapping_add(cursor), pf);
            cursor += 64;
        }
        let mut ints = corr;
        let mut sc = [0u64; 4];
        for (j, sc) in sc.iter_mut().enumerate() {
            let row = base.wrapping_add((i + j) * ROW_BYTES);
            // SAFETY: row i + j is inside `rows`: its 8 scale bytes, then 64 nibble bytes.
            let (v, s) = unsafe {
                (
                    _mm512_loadu_si512(row.add(8).cast()),
                    row.cast::<u64>().read_unaligned(),
                )
            };
            *sc = s;
            let lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, m4), alo);
            let hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, mf0), ahi);
            let t = _mm512_add_epi32(lo, _mm512_srai_epi32::<4>(hi));
            // lane 4k + g -> every lane g of each 128-bit lane: the group's four dwords
            let t = _mm512_add_epi32(t, _mm512_shuffle_i32x4::<0b0100_1110>(t, t));
            let t = _mm512_add_epi32(t, _mm512_shuffle_i32x4::<0b1011_0001>(t, t));
            ints = _mm512_mask_add_epi32(ints, 0xf << (4 * j), ints, t);
        }
        let dw = _mm512_cvtph_ps(_mm256_setr_epi64x(
            sc[0] as i64,
            sc[1] as i64,
            sc[2] as i64,
            sc[3] as i64,
        ));
        let f = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(ints),
            _mm512_mul_ps(dw, de),
            _mm512_setzero_ps(),
        );
        let u = _mm512_add_ps(f, _mm512_setzero_ps());
        let c = _mm512_add_ps(u, _mm512_permute_ps::<0b01_00_11_10>(u));
        let r = _mm512_add_ps(c, _mm512_permute_ps::<0b10_11_00_01>(c));
        let sums = _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, r));
        // SAFETY: rows rows.start + i .. + 4 are in `rows`, token 0: out + them writable.
        unsafe { _mm_storeu_ps(out.add(rows.start + i), sums) };
    }
}

/// `out[t * out_stride + r] = dot(w[r], x[t])`.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; `rows.end <= w.rows`;
/// `x.cols() == w.cols`; every `out + t * out_stride + r` (`t < x.n()`, `r in rows`) is valid
/// for writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q4_rows(
    w: &Q4Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    let n = x.n();
    if n == 1 && !rows.is_empty() {
        let pf = decode_prefetch_level();
        let mut rows = rows;
        if w.groups() == 4 {
            // Rows of four groups, four at a time; the last few one by one.
            let packed = rows.start..rows.start + rows.len() / 4 * 4;
            rows = packed.end..rows.end;
            if !packed.is_empty() {
                // SAFETY: forwarded contract; one token, four groups.
                unsafe { q4_decode_rows_of_4_groups(w, x, out, packed, pf) };
            }
        }
        if !rows.is_empty() {
            // SAFETY: forwarded contract; one token.
            unsafe { q4_decode_rows(w, x, out, rows, pf) };
        }
        return;
    }
    let pf = prefetch_level();
    // Blocks that keep weights in L2 and activations in L1 (see `for_each_block`).
    for_each_block(w.row_stride(), x, rows, |chunk, ts| {
        let mut r = chunk.start;
        // Single rows for decode (n = 1): each thread reads its rows as one sequential stream.
        // 2 rows x 4 tokens for prefill: with 3 rows the integer and float accumulators (24 +
        // 12 vectors) would no longer fit the 32 registers.
        while r < chunk.end {
            // SAFETY: rows r..r+R are inside `rows` (R <= left), tokens `ts` inside 0..n.
            unsafe {
                if n > 1 && chunk.end - r >= 2 {
                    q4_rows_tokens::<2>(w, r, x, ts.clone(), out, out_stride, pf);
                    r += 2;
                } else {
                    q4_rows_tokens::<1>(w, r, x, ts.clone(), out, out_stride, pf);
                    r += 1;
                }
            }
        }
    });
}

/// f32 dots of `R` rows with `T` vectors (masked loads for the last partial 16 columns).
///
/// # Safety
/// `w[r]` and `x[t]` each point at `cols` readable floats.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn f32_tile<const R: usize, const T: usize>(
    w: [*const f32; R],
    x: [*const f32; T],
    cols: usize,
) -> [[f32; T]; R] {
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let mut k = 0;
    while k < cols {
        let left = cols - k;
        let m: __mmask16 = if left >= 16 {
            0xffff
        } else {
            (1u16 << left) - 1
        };
        let mut xv = [_mm512_setzero_ps(); T];
        for t in 0..T {
            // SAFETY: the mask only enables lanes k..min(k + 16, cols).
            xv[t] = unsafe { _mm512_maskz_loadu_ps(m, x[t].add(k)) };
        }
        for r in 0..R {
            // SAFETY: as above.
            let wv = unsafe { _mm512_maskz_loadu_ps(m, w[r].add(k)) };
            for t in 0..T {
                acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
        k += 16;
    }
    let mut res = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            res[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    res
}

/// # Safety
/// As `f32_rows`, for rows `r0..r0 + R` and tokens `t0..t0 + T`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn f32_run<const R: usize, const T: usize>(
    w: &[f32],
    cols: usize,
    r0: usize,
    x: &[f32],
    t0: usize,
    out: *mut f32,
    out_stride: usize,
) {
    let wp: [*const f32; R] = std::array::from_fn(|i| w[(r0 + i) * cols..][..cols].as_ptr());
    let xp: [*const f32; T] = std::array::from_fn(|j| x[(t0 + j) * cols..][..cols].as_ptr());
    // SAFETY: each pointer comes from a slice of `cols` floats.
    let res = unsafe { f32_tile::<R, T>(wp, xp, cols) };
    for (i, row) in res.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            // SAFETY: (t0 + j, r0 + i) is within the range the caller guarantees writable.
            unsafe { *out.wrapping_add((t0 + j) * out_stride + r0 + i) = v };
        }
    }
}

/// # Safety
/// The CPU has AVX-512 F/BW/VL, AVX2 and FMA; `w.len() >= rows.end * cols`;
/// `x.len() >= n * cols`; every `out + t * out_stride + r` (`t < n`, `r in rows`) is valid
/// for writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
pub(crate) unsafe fn f32_rows(
    w: &[f32],
    cols: usize,
    x: &[f32],
    n: usize,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    let mut r = rows.start;
    while r < rows.end {
        let four = rows.end - r >= 4;
        let mut t = 0;
        while t < n {
            let left = n - t;
            // SAFETY: rows r..r+(4 if four else 1) are inside `rows` and tokens
            // t..t+min(left, 4) inside 0..n; forwarded contract.
            unsafe {
                match (four, left) {
                    (true, 1) => f32_run::<4, 1>(w, cols, r, x, t, out, out_stride),
                    (true, 2) => f32_run::<4, 2>(w, cols, r, x, t, out, out_stride),
                    (true, 3) => f32_run::<4, 3>(w, cols, r, x, t, out, out_stride),
                    (true, _) => f32_run::<4, 4>(w, cols, r, x, t, out, out_stride),
                    (false, 1) => f32_run::<1, 1>(w, cols, r, x, t, out, out_stride),
                    (false, 2) => f32_run::<1, 2>(w, cols, r, x, t, out, out_stride),
                    (false, 3) => f32_run::<1, 3>(w, cols, r, x, t, out, out_stride),
                    (false, _) => f32_run::<1, 4>(w, cols, r, x, t, out, out_stride),
                }
            }
            t += left.min(4);
        }
        r += if four { 4 } else { 1 };
    }
}

// ---------------------------------------------------------------------------------------------
// 8-bit weights (`q8w`): a block of 16 groups is eight 64-byte vectors of values laid out like
// the activations' eight, so vector k of the weights meets vector k of the activations and i32
// lane i is group i throughout. `dpbusd` takes the weights as unsigned bytes `q ^ 0x80 = q + 128`
// and each lane starts at `-128 * sum(a)` (16 times the activations' `corr`): the exact integer
// `sum(q * a)`. Then, as for int4, one conversion and one FMA per block.
// ---------------------------------------------------------------------------------------------

/// Dots of `R` 8-bit rows with `T` activation vectors.
///
/// # Safety
/// `wr[r]` points at the `groups * 34` readable bytes of one row (`groups * 2` bytes of scales,
/// then `groups * 32` values); each `a[t]` points at the arrays of one activation vector with
/// at least `groups.next_multiple_of(16)` groups.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_tile<const R: usize, const T: usize>(
    wr: [*const u8; R],
    groups: usize,
    a: [ActPtr; T],
    pf: PrefetchLevel,
) -> [[f32; T]; R] {
    let nb = groups.div_ceil(BLOCK_GROUPS);
    let row_bytes = groups * 34;
    let mut tails: [TailBuf8; R] = [const { TailBuf8::uninit() }; R];
    // SAFETY: each wr[r] is one row of `groups` groups (contract); `tails` lives to the end.
    let blocks: [RowBlocks8; R] =
        std::array::from_fn(|r| unsafe { RowBlocks8::new(wr[r], groups, &mut tails[r]) });
    let mut prefetch = TilePrefetch::new(wr[0], R * row_bytes, pf);
    let bias = _mm512_set1_epi8(0x80u8 as i8);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for c in 0..nb {
        prefetch.chunk(c, nb);
        let mut q = [std::ptr::null::<u8>(); R];
        let mut dw = [_mm512_setzero_ps(); R];
        for r in 0..R {
            let (vals, sc) = blocks[r].block(c);
            q[r] = vals;
            // SAFETY: sc points at 32 readable bytes (16 f16 scales), see RowBlocks8::block.
            dw[r] = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(sc.cast()) });
        }
        // SAFETY (activation reads below): block c < nb <= padded groups / 16, so
        // qs[c*512..c*512 + 512] and corr/dexp[c*16..c*16 + 16] are inside each vector's arrays.
        let mut ints = [[_mm512_setzero_si512(); T]; R];
        for t in 0..T {
            let corr = unsafe { _mm512_loadu_si512(a[t].corr.add(c * 16).cast()) };
            let start = _mm512_slli_epi32::<4>(corr);
            for row in ints.iter_mut() {
                row[t] = start;
            }
        }
        for k in 0..8 {
            let mut wv = [_mm512_setzero_si512(); R];
            for r in 0..R {
                // SAFETY: q[r] points at the block's 512 value bytes.
                let v = unsafe { _mm512_loadu_si512(q[r].add(k * 64).cast()) };
                wv[r] = _mm512_xor_si512(v, bias);
            }
            for t in 0..T {
                let av = unsafe { _mm512_loadu_si512(a[t].qs.add(c * 512 + k * 64).cast()) };
                for r in 0..R {
                    ints[r][t] = _mm512_dpbusd_epi32(ints[r][t], wv[r], av);
                }
            }
        }
        for t in 0..T {
            let de = unsafe { _mm512_loadu_ps(a[t].dexp.add(c * 16)) };
            for r in 0..R {
                acc[r][t] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(ints[r][t]),
                    _mm512_mul_ps(dw[r], de),
                    acc[r][t],
                );
            }
        }
    }
    let mut res = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            res[r][t] = _mm512_reduce_add_ps(acc[r][t]);
        }
    }
    res
}

/// # Safety
/// As [`q8_rows`], for rows `r0..r0 + R` and tokens `t0..t0 + T`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_run<const R: usize, const T: usize>(
    w: &Q8Matrix,
    r0: usize,
    x: &Q8Acts,
    t0: usize,
    out: *mut f32,
    out_stride: usize,
    pf: PrefetchLevel,
) {
    let wr: [*const u8; R] = std::array::from_fn(|i| w.row(r0 + i).as_ptr());
    let a: [ActPtr; T] = std::array::from_fn(|j| ActPtr::new(&x.token(t0 + j)));
    // SAFETY: the pointers come from row slices of `w` (groups*34 bytes: scales, then values)
    // and from activation vectors padded to a multiple of 16 groups >= w.groups() (cols agree).
    let res = unsafe { q8_tile::<R, T>(wr, w.groups(), a, pf) };
    for (i, row) in res.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            // SAFETY: (t0 + j, r0 + i) is within the tokens and rows the caller guarantees
            // writable.
            unsafe { *out.wrapping_add((t0 + j) * out_stride + r0 + i) = v };
        }
    }
}

/// # Safety
/// As `q8_rows`, for rows `r0..r0 + R` and tokens `ts`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_rows_tokens<const R: usize>(
    w: &Q8Matrix,
    r0: usize,
    x: &Q8Acts,
    ts: Range<usize>,
    out: *mut f32,
    out_stride: usize,
    pf: PrefetchLevel,
) {
    let mut t = ts.start;
    while t < ts.end {
        // SAFETY: tokens t..t+T are inside ts; forwarded contract otherwise.
        unsafe {
            match ts.end - t {
                1 => q8_run::<R, 1>(w, r0, x, t, out, out_stride, pf),
                2 => q8_run::<R, 2>(w, r0, x, t, out, out_stride, pf),
                3 => q8_run::<R, 3>(w, r0, x, t, out, out_stride, pf),
                _ => q8_run::<R, 4>(w, r0, x, t, out, out_stride, pf),
            }
        }
        t += (ts.end - t).min(4);
    }
}

/// Decode (one token) over 8-bit rows: as `q4_decode_rows`, the rows one after another as one
/// sequential stream with the prefetch running PREFETCH bytes ahead, a row's partial last block
/// read in place with masked loads (its run `k` of every group is `4m` bytes at `k * 4m`; lanes
/// past `m` read as zero, whose `0 ^ 0x80` meets zero activations). The integer is summed in
/// two chains (even and odd runs) and is the tile's exact integer; the float operations are
/// those of `q8_tile::<1, 1>` in the same order, so the results are bit-identical to it.
///
/// # Safety
/// As [`q8_rows`], with `x.n() == 1` and `rows` not empty.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_decode_rows(
    w: &Q8Matrix,
    x: &Q8Acts,
    out: *mut f32,
    rows: Range<usize>,
    pf: PrefetchLevel,
) {
    let groups = w.groups();
    let nb = groups / BLOCK_GROUPS;
    // The last block's groups when it is partial (0: whole blocks only).
    let m = groups % BLOCK_GROUPS;
    let row_bytes = groups * 34;
    let a = ActPtr::new(&x.token(0));
    let base = w.row(rows.start).as_ptr();
    let bias = _mm512_set1_epi8(0x80u8 as i8);
    let mut cursor = first_prefetch(base, pf);
    let mut target = PREFETCH;
    // Row bytes per 64 bytes of values (scales included): 68 (a partial block counts as one).
    let step = row_bytes / ((nb + usize::from(m > 0)) * 8);
    let lanes: __mmask16 = ((1u32 << m) - 1) as __mmask16;
    for (i, r) in rows.enumerate() {
        let ws = base.wrapping_add(i * row_bytes);
        let wq = ws.wrapping_add(groups * 2);
        let mut acc = _mm512_setzero_ps();
        for c in 0..nb {
            // SAFETY: block c < nb lies inside row r (c*32 + 32 <= groups*2 scale bytes,
            // c*512 + 512 <= groups*32 value bytes); the activation arrays hold at least
            // `groups` groups (c*512 + 512 bytes of qs, c*16 + 16 values of corr/dexp).
            unsafe {
                let dw = _mm512_cvtph_ps(_mm256_loadu_si256(ws.add(c * 32).cast()));
                let corr = _mm512_loadu_si512(a.corr.add(c * 16).cast());
                let mut even = _mm512_slli_epi32::<4>(corr);
                let mut odd = _mm512_setzero_si512();
                for k in (0..8).step_by(2) {
                    target += 2 * step;
                    while cursor < target {
                        prefetch_line(base.wrapping_add(cursor), pf);
                        cursor += 64;
                    }
                    let off = c * BLOCK_VALUES + k * 64;
                    let w0 = _mm512_xor_si512(_mm512_loadu_si512(wq.add(off).cast()), bias);
                    let w1 = _mm512_xor_si512(_mm512_loadu_si512(wq.add(off + 64).cast()), bias);
                    let a0 = _mm512_loadu_si512(a.qs.add(c * 512 + k * 64).cast());
                    let a1 = _mm512_loadu_si512(a.qs.add(c * 512 + k * 64 + 64).cast());
                    even = _mm512_dpbusd_epi32(even, w0, a0);
                    odd = _mm512_dpbusd_epi32(odd, w1, a1);
                }
                let ints = _mm512_add_epi32(even, odd);
                let de = _mm512_loadu_ps(a.dexp.add(c * 16));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_mul_ps(dw, de), acc);
            }
        }
        if m > 0 {
            // The whole-block loop above with masked loads, kept apart as in the int4 kernel.
            let c = nb;
            // SAFETY: the masked loads read only the partial block's bytes inside row r: 2m
            // scale bytes at c*32 (< groups*2) and, per run k, 4m value bytes at
            // c*512 + k*4m (< groups*32); the activation arrays are padded to whole blocks
            // (c*512 + 512 bytes of qs, c*16 + 16 values of corr/dexp), zero past `groups`.
            unsafe {
                let dw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, ws.add(c * 32).cast()));
                let corr = _mm512_loadu_si512(a.corr.add(c * 16).cast());
                let mut even = _mm512_slli_epi32::<4>(corr);
                let mut odd = _mm512_setzero_si512();
                for k in (0..8).step_by(2) {
                    target += 2 * step;
                    while cursor < target {
                        prefetch_line(base.wrapping_add(cursor), pf);
                        cursor += 64;
                    }
                    let off = c * BLOCK_VALUES + k * 4 * m;
                    let w0 = _mm512_maskz_loadu_epi32(lanes, wq.add(off).cast());
                    let w1 = _mm512_maskz_loadu_epi32(lanes, wq.add(off + 4 * m).cast());
                    let a0 = _mm512_loadu_si512(a.qs.add(c * 512 + k * 64).cast());
                    let a1 = _mm512_loadu_si512(a.qs.add(c * 512 + k * 64 + 64).cast());
                    even = _mm512_dpbusd_epi32(even, _mm512_xor_si512(w0, bias), a0);
                    odd = _mm512_dpbusd_epi32(odd, _mm512_xor_si512(w1, bias), a1);
                }
                let ints = _mm512_add_epi32(even, odd);
                let de = _mm512_loadu_ps(a.dexp.add(c * 16));
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_mul_ps(dw, de), acc);
            }
            // Whole rows between prefetch targets: a partial row's integer steps need not add
            // up to its bytes.
            target = (i + 1) * row_bytes + PREFETCH;
        }
        // SAFETY: r is in `rows`, token 0: the caller guarantees out + r writable.
        unsafe { *out.add(r) = _mm512_reduce_add_ps(acc) };
    }
}

/// `out[t * out_stride + r] = dot(w[r], x[t])` for 8-bit weights.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C; `rows.end <= w.rows`;
/// `x.cols() == w.cols`; every `out + t * out_stride + r` (`t < x.n()`, `r in rows`) is valid
/// for writes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn q8_rows(
    w: &Q8Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    let n = x.n();
    if n == 1 && !rows.is_empty() {
        // SAFETY: forwarded contract; one token.
        unsafe { q8_decode_rows(w, x, out, rows, decode_prefetch_level()) };
        return;
    }
    let pf = prefetch_level();
    for_each_block(w.row_stride(), x, rows, |chunk, ts| {
        let mut r = chunk.start;
        // 2 rows x 4 tokens, as for int4.
        while r < chunk.end {
            // SAFETY: rows r..r+R are inside `rows` (R <= left), tokens `ts` inside 0..n.
            unsafe {
                if chunk.end - r >= 2 {
                    q8_rows_tokens::<2>(w, r, x, ts.clone(), out, out_stride, pf);
                    r += 2;
                } else {
                    q8_rows_tokens::<1>(w, r, x, ts.clone(), out, out_stride, pf);
                    r += 1;
                }
            }
        }
    });
}
