//! AVX2 + FMA + F16C kernels.
//!
//! int4 × int8, per half block of 8 groups: dword `k` of each of the 8 groups' nibble bytes is
//! one 32-byte vector (`q4::nibble_offset`), so i32 lane `i` is group `i` throughout. Its low
//! and high nibbles are multiplied with the matching activation vectors by
//! `_mm256_maddubs_epi16` (u8 × i8 → i16 pairs, at most 2·15·128 so no saturation), the pairs
//! added up in i16 over the four dwords (eight of them per lane: at most 30720, no wrap), then
//! summed to i32 lanes by one `_mm256_madd_epi16` and added to the precomputed `-8 * sum(a)`
//! of each group; then one conversion to f32 and one FMA against `weight scale * activation
//! scale` per 8 groups. Tiles of `R` rows × `T` tokens reuse each
//! unpacked weight vector for `T` tokens and each activation vector for `R` rows. On the table
//! grid (`q4t`) each nibble is looked up (`pshufb`) as `level + 16` (0..31), the pairs widened
//! after two dwords as well, and the offsets doubled (`-16 * sum(a)`): see [`dot_widen`].
//!
//! On CPUs with AVX-VNNI (the VEX-encoded 256-bit `vpdpbusd`: Intel Core from Alder Lake on,
//! which have no AVX-512) the two multiplies and the i16 add become two
//! `_mm256_dpbusd_avx_epi32` per dword, starting from the offset lanes. Each i32 lane then holds the
//! same exact integer (the same four low- and four high-nibble products and the same offset),
//! so the results are the same bits; `COLI_AVX_VNNI=0` turns it off (see [`avx_vnni`]).

use std::arch::x86_64::*;
use std::ops::Range;

use super::prefetch::{prefetch_level, PrefetchLevel};
use super::q4::{self, RowBlocks, TailBuf, BLOCK_GROUPS};
use super::q8::TokenActs;
use super::q8w::{RowBlocks8, TailBuf8};
use super::{Grid, Q4Matrix, Q8Acts, Q8Matrix};

/// Software prefetch distance in each row's byte stream, bytes.
pub(super) const PREFETCH: usize = 8192;

/// The software prefetch of one tile's weights, PREFETCH bytes ahead, each cache line once,
/// keeping pace with the tile's chunks (the hardware prefetcher alone reaches about half of the
/// DRAM bandwidth on the machines measured). A tile's rows are consecutive rows of one matrix,
/// so their bytes are one contiguous range and one stream covers them; the next tile continues
/// where this one ends, so a thread's rows are one sequential stream. Prefetching past the end
/// of the buffer is harmless (a prefetch never faults).
pub(super) struct TilePrefetch {
    base: *const u8,
    bytes: usize,
    /// The cache level filled; see `super::prefetch`.
    pf: PrefetchLevel,
    /// Offset from `base` of the next cache line to prefetch.
    cursor: usize,
}

impl TilePrefetch {
    #[inline(always)]
    pub(super) fn new(base: *const u8, bytes: usize, pf: PrefetchLevel) -> Self {
        let cursor = first_prefetch(base, pf);
        TilePrefetch {
            base,
            bytes,
            pf,
            cursor,
        }
    }

    /// Prefetches up to PREFETCH bytes past the end of chunk `c` of `nch`.
    #[inline(always)]
    pub(super) fn chunk(&mut self, c: usize, nch: usize) {
        let target = (c + 1) * self.bytes / nch + PREFETCH;
        while self.cursor < target {
            prefetch_line(self.base.wrapping_add(self.cursor), self.pf);
            self.cursor += 64;
        }
    }
}

/// The offset from `base` of a stream's first line to prefetch: the line PREFETCH bytes
/// ahead, or, with the prefetch off, an offset no stream reaches (the loops that issue
/// prefetches while `cursor < target` then never do).
#[inline(always)]
pub(super) fn first_prefetch(base: *const u8, pf: PrefetchLevel) -> usize {
    if pf == PrefetchLevel::Off {
        usize::MAX
    } else {
        PREFETCH - (base as usize).wrapping_add(PREFETCH) % 64
    }
}

/// Prefetches the cache line holding `p` into the level `pf` names (nothing if off).
#[inline(always)]
pub(super) fn prefetch_line(p: *const u8, pf: PrefetchLevel) {
    // SAFETY: a prefetch is a hint that never faults, whatever the address; SSE is part of
    // x86_64.
    unsafe {
        match pf {
            PrefetchLevel::L2 => _mm_prefetch::<_MM_HINT_T1>(p.cast()),
            PrefetchLevel::L1 => _mm_prefetch::<_MM_HINT_T0>(p.cast()),
            PrefetchLevel::Off => {}
        }
    }
}

/// Raw pointers to one activation vector's arrays (see `q8`'s layout).
#[derive(Clone, Copy)]
pub(crate) struct ActPtr {
    pub qs: *const i8,
    pub corr: *const i32,
    pub dexp: *const f32,
}

impl ActPtr {
    pub(crate) fn new(a: &TokenActs) -> Self {
        ActPtr {
            qs: a.qs.as_ptr(),
            corr: a.corr.as_ptr(),
            dexp: a.dexp.as_ptr(),
        }
    }
}

/// Activations per token block: at most half of Zen 4's 48 KiB L1d (40 bytes per group).
/// Measured single-thread at 64 tokens (`kernel_bench`, AVX-512): 16-32 KiB give 180-200
/// GMAC/s, 48 KiB and more 155-175.
const L1_BLOCK_BYTES: usize = 24 << 10;
/// Weights per row chunk: a quarter of a 1 MiB L2, re-read from there by each token block.
const L2_CHUNK_BYTES: usize = 256 << 10;

/// Calls `f(rows, tokens)` for the blocks of a product over `rows` (of `row_bytes` bytes each,
/// int4 or 8-bit) and every token of `x`:
/// rows in chunks whose weights stay in L2 (a multiple of 6 rows, so the 2- and 3-row tiles of
/// the 8-bit and AVX-512 kernels fit; the AVX2 int4 tile is one row),
/// and within a chunk tokens in blocks whose activations stay in L1 (a multiple of 4, the token
/// tile). The weights then come from memory once and the innermost loop reads activations from
/// L1; with one block of up to 96 tokens (384 KiB), every tile re-read 4 KiB per token from L2
/// (AVX-512 at 64 tokens: 157-173 -> 184-204 GMAC/s). Decode (one token) is one block per
/// chunk, the chunks back to back: one sequential stream per thread as without them.
pub(crate) fn for_each_block(
    row_bytes: usize,
    x: &Q8Acts,
    rows: Range<usize>,
    mut f: impl FnMut(Range<usize>, Range<usize>),
) {
    // A token's activations: 32 bytes of values, 4 of offset and 4 of scale per group (the
    // v2 layout's 64 kept the blocks at 24 KiB / 64 B; 40 gives 8-token blocks at 2048 columns
    // where 64 gave 4: prefill of 512 tokens +2%).
    let per_token = x.padded_groups() * 40;
    let tb = (L1_BLOCK_BYTES / per_token.max(1)).clamp(4, 256) / 4 * 4;
    let rc = (L2_CHUNK_BYTES / row_bytes.max(1)).max(6) / 6 * 6;
    let mut c0 = rows.start;
    while c0 < rows.end {
        let c1 = (c0 + rc).min(rows.end);
        let mut t0 = 0;
        while t0 < x.n() {
            let t1 = (t0 + tb).min(x.n());
            f(c0..c1, t0..t1);
            t0 = t1;
        }
        c0 = c1;
    }
}

#[target_feature(enable = "avx,sse3")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Whether the int4 kernel uses AVX-VNNI: the CPU has it and `COLI_AVX_VNNI` is not `0`
/// (decided once per process).
pub(crate) fn avx_vnni() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::arch::is_x86_feature_detected!("avxvnni") && crate::settings::avx_vnni_allowed()
    })
}

/// A half block's integer accumulator at its start: with AVX-VNNI the i32 lanes, from the
/// group offsets `corr` (`-8 * sum(a)`); without, i16 pair sums from zero, the offsets added
/// by [`dot_finish`].
///
/// # Safety
/// The CPU has AVX2; `corr` points at 8 readable i32; inlined into functions enabling it.
#[inline(always)]
unsafe fn dot_start<const VNNI: bool, const TABLE: bool>(corr: *const i32) -> __m256i {
    // SAFETY: forwarded contract.
    unsafe {
        if VNNI {
            offsets::<TABLE>(corr)
        } else {
            _mm256_setzero_si256()
        }
    }
}

/// The group offsets `-offset * sum(a)` of 8 groups: the activations' `-8 * sum(a)` (`corr`),
/// doubled on the table grid (whose unsigned values are `level + 16`).
///
/// # Safety
/// As [`dot_start`].
#[inline(always)]
unsafe fn offsets<const TABLE: bool>(corr: *const i32) -> __m256i {
    // SAFETY: forwarded contract.
    unsafe {
        let c = _mm256_loadu_si256(corr.cast());
        if TABLE {
            _mm256_slli_epi32(c, 1)
        } else {
            c
        }
    }
}

/// The unsigned values that one vector of codes (each byte 0..16) multiplies as: the codes
/// themselves on the linear grid, looked up in `lut` ([`q4::TABLE_UNSIGNED`] in both lanes)
/// on the table grid.
///
/// # Safety
/// The CPU has AVX2; inlined into functions enabling it.
#[inline(always)]
unsafe fn unsigned_codes<const TABLE: bool>(codes: __m256i, lut: __m256i) -> __m256i {
    if TABLE {
        // SAFETY: register operation; forwarded contract.
        unsafe { _mm256_shuffle_epi8(lut, codes) }
    } else {
        codes
    }
}

/// The table grid's lookup vector: [`q4::TABLE_UNSIGNED`] in both 128-bit lanes.
///
/// # Safety
/// The CPU has AVX2; inlined into functions enabling it.
#[inline(always)]
unsafe fn table_lut() -> __m256i {
    // SAFETY: TABLE_UNSIGNED is 16 readable bytes; forwarded contract.
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(q4::TABLE_UNSIGNED.as_ptr().cast())) }
}

/// Without AVX-VNNI on the table grid, the i16 pair sums after two of the four dwords, widened
/// (the table's unsigned values reach 31, so a pair is at most 2 * 31 * 128 = 7936 and an i16
/// lane holds four of them, not eight); zero otherwise.
///
/// # Safety
/// As [`dot_start`].
#[inline(always)]
unsafe fn dot_widen<const VNNI: bool, const TABLE: bool>(
    k: usize,
    acc: &mut __m256i,
    wide: &mut __m256i,
) {
    if TABLE && !VNNI && k == 1 {
        // SAFETY: register operations; forwarded contract.
        unsafe {
            *wide = _mm256_madd_epi16(*acc, _mm256_set1_epi16(1));
            *acc = _mm256_setzero_si256();
        }
    }
}

/// `acc` plus four low-nibble products with `alo` and four high-nibble products with `ahi`
/// per i32 lane (exact). Without AVX-VNNI the products stay i16 pair sums until
/// [`dot_finish`]: a pair is at most 2 * 15 * 128 = 3840 in magnitude and a half block adds
/// eight of them per i16 lane (four dwords, low and high nibbles), 30720 < 2^15, so the i16
/// adds never wrap, and one widening `madd` per half block (not one per dword) gives the same
/// i32 lanes with a quarter fewer multiplies.
///
/// # Safety
/// The CPU has AVX2, and AVX-VNNI if `VNNI`; inlined into functions enabling them; at most
/// four calls per accumulator between [`dot_start`] and [`dot_finish`].
#[inline(always)]
unsafe fn dot_lanes<const VNNI: bool>(
    wlo: __m256i,
    whi: __m256i,
    alo: __m256i,
    ahi: __m256i,
    acc: __m256i,
) -> __m256i {
    // SAFETY: forwarded contract (register operations only).
    unsafe {
        if VNNI {
            _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(acc, wlo, alo), whi, ahi)
        } else {
            let p = _mm256_add_epi16(
                _mm256_maddubs_epi16(wlo, alo),
                _mm256_maddubs_epi16(whi, ahi),
            );
            _mm256_add_epi16(acc, p)
        }
    }
}

/// A half block's i32 lanes from its accumulator: as they are with AVX-VNNI; without, the i16
/// pair sums widened and added to the group offsets `corr`.
///
/// # Safety
/// As [`dot_start`].
#[inline(always)]
unsafe fn dot_finish<const VNNI: bool, const TABLE: bool>(
    acc: __m256i,
    wide: __m256i,
    corr: *const i32,
) -> __m256i {
    // SAFETY: forwarded contract.
    unsafe {
        if VNNI {
            acc
        } else {
            let lanes = _mm256_add_epi32(
                _mm256_madd_epi16(acc, _mm256_set1_epi16(1)),
                offsets::<TABLE>(corr),
            );
            if TABLE {
                _mm256_add_epi32(lanes, wide)
            } else {
                lanes
            }
        }
    }
}

/// Dots of `R` rows with `T` activation vectors.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C, and AVX-VNNI if `VNNI` (inlined into the entry points that
/// enable them); `wr[r]` points at the `groups * 18` readable bytes of one row (`groups * 2`
/// bytes of scales, then `groups * 16` bytes of nibbles); each `a[t]` points at the arrays of
/// one activation vector with at least `groups.next_multiple_of(16)` groups.
#[inline(always)]
unsafe fn q4_tile<const R: usize, const T: usize, const VNNI: bool, const TABLE: bool>(
    wr: [*const u8; R],
    groups: usize,
    a: [ActPtr; T],
    pf: PrefetchLevel,
) -> [[f32; T]; R] {
    // SAFETY: the caller enables AVX2, FMA and F16C (and AVX-VNNI if VNNI) around this
    // inlined body; every pointer read is inside a row or activation vector by the
    // function's contract, as the comments below say for each.
    unsafe {
        let nb = groups.div_ceil(BLOCK_GROUPS);
        let row_bytes = groups * 18;
        let mut tails: [TailBuf; R] = [const { TailBuf::uninit() }; R];
        // Row r is one row of `groups` groups (contract); `tails` lives to the end.
        let blocks: [RowBlocks; R] =
            std::array::from_fn(|r| RowBlocks::new(wr[r], groups, &mut tails[r]));
        let mut prefetch = TilePrefetch::new(wr[0], R * row_bytes, pf);
        let m4 = _mm256_set1_epi8(0x0f);
        let lut = table_lut();
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for c in 0..nb {
            prefetch.chunk(c, nb);
            let mut q = [std::ptr::null::<u8>(); R];
            let mut sc = [std::ptr::null::<u8>(); R];
            for r in 0..R {
                (q[r], sc[r]) = blocks[r].block(c);
            }
            // Groups 16c + 8h..: block c < nb <= padded groups / 16, so the activation reads
            // (qs[c*512..c*512 + 512], corr/dexp[c*16..c*16 + 16]) are inside each vector.
            for h in 0..2 {
                let mut dw = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    // sc[r] points at the block's 16 f16 scales (32 bytes).
                    dw[r] = _mm256_cvtph_ps(_mm_loadu_si128(sc[r].add(h * 16).cast()));
                }
                let mut ints = [[_mm256_setzero_si256(); T]; R];
                let mut wide = [[_mm256_setzero_si256(); T]; R];
                for t in 0..T {
                    let start = dot_start::<VNNI, TABLE>(a[t].corr.add(c * 16 + h * 8));
                    for row in ints.iter_mut() {
                        row[t] = start;
                    }
                }
                for k in 0..4 {
                    let mut wlo = [_mm256_setzero_si256(); R];
                    let mut whi = [_mm256_setzero_si256(); R];
                    for r in 0..R {
                        // q[r] points at the block's 256 nibble bytes.
                        let v = _mm256_loadu_si256(q[r].add(k * 64 + h * 32).cast());
                        wlo[r] = unsigned_codes::<TABLE>(_mm256_and_si256(v, m4), lut);
                        whi[r] = unsigned_codes::<TABLE>(
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                            lut,
                        );
                    }
                    let aoff = c * 512 + k * 128 + h * 32;
                    for t in 0..T {
                        let alo = _mm256_loadu_si256(a[t].qs.add(aoff).cast());
                        let ahi = _mm256_loadu_si256(a[t].qs.add(aoff + 64).cast());
                        for r in 0..R {
                            // The features this tile's caller enables (contract).
                            ints[r][t] = dot_lanes::<VNNI>(wlo[r], whi[r], alo, ahi, ints[r][t]);
                            dot_widen::<VNNI, TABLE>(k, &mut ints[r][t], &mut wide[r][t]);
                        }
                    }
                }
                for t in 0..T {
                    let de = _mm256_loadu_ps(a[t].dexp.add(c * 16 + h * 8));
                    for r in 0..R {
                        let lanes = dot_finish::<VNNI, TABLE>(
                            ints[r][t],
                            wide[r][t],
                            a[t].corr.add(c * 16 + h * 8),
                        );
                        acc[r][t] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(lanes),
                            _mm256_mul_ps(dw[r], de),
                            acc[r][t],
                        );
                    }
                }
            }
        }
        let mut res = [[0.0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                res[r][t] = hsum(acc[r][t]);
            }
        }
        res
    }
}

/// # Safety
/// As [`q4_rows`] (and AVX-VNNI if `VNNI`), for rows `r0..r0 + R` and tokens `t0..t0 + T`.
#[inline(always)]
unsafe fn q4_run<const R: usize, const T: usize, const VNNI: bool, const TABLE: bool>(
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
    let res = unsafe { q4_tile::<R, T, VNNI, TABLE>(wr, w.groups(), a, pf) };
    for (i, row) in res.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            // SAFETY: (t0 + j, r0 + i) is within the tokens and rows the caller guarantees
            // writable.
            unsafe { *out.wrapping_add((t0 + j) * out_stride + r0 + i) = v };
        }
    }
}

/// # Safety
/// As `q4_rows` (and AVX-VNNI if `VNNI`), for rows `r0..r0 + R` and tokens `ts`.
#[inline(always)]
unsafe fn q4_rows_tokens<const R: usize, const VNNI: bool, const TABLE: bool>(
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
                1 => q4_run::<R, 1, VNNI, TABLE>(w, r0, x, t, out, out_stride, pf),
                2 => q4_run::<R, 2, VNNI, TABLE>(w, r0, x, t, out, out_stride, pf),
                3 => q4_run::<R, 3, VNNI, TABLE>(w, r0, x, t, out, out_stride, pf),
                _ => q4_run::<R, 4, VNNI, TABLE>(w, r0, x, t, out, out_stride, pf),
            }
        }
        t += (ts.end - t).min(4);
    }
}

/// `out[t * out_stride + r] = dot(w[r], x[t])`, with AVX-VNNI when [`avx_vnni`] says so.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `rows.end <= w.rows`; `x.cols() == w.cols`; every
/// `out + t * out_stride + r` (`t < x.n()`, `r in rows`) is valid for writes.
pub(crate) unsafe fn q4_rows(
    w: &Q4Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    // SAFETY: forwarded contract; `avx_vnni` is only true on CPUs with AVX-VNNI.
    unsafe { q4_rows_with(avx_vnni(), w, x, out, out_stride, rows) }
}

/// [`q4_rows`] with AVX-VNNI or without (`vnni` only where the CPU has it).
///
/// # Safety
/// As [`q4_rows`], and the CPU has AVX-VNNI if `vnni`.
pub(crate) unsafe fn q4_rows_with(
    vnni: bool,
    w: &Q4Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    // SAFETY: forwarded contract.
    unsafe {
        if vnni {
            q4_rows_vnni(w, x, out, out_stride, rows)
        } else {
            q4_rows_plain(w, x, out, out_stride, rows)
        }
    }
}

/// # Safety
/// As [`q4_rows`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_rows_plain(
    w: &Q4Matrix,
    x: &Q8Acts,
    out: *mut f32,
    stride: usize,
    rows: Range<usize>,
) {
    let pf = prefetch_level();
    let table = w.grid() == Grid::Table;
    if decode_rows_apply(x, &rows) {
        // SAFETY: forwarded contract; one token.
        unsafe {
            if table {
                q4_decode_rows::<false, true>(w, x, out, rows, pf)
            } else {
                q4_decode_rows::<false, false>(w, x, out, rows, pf)
            }
        };
        return;
    }
    // The closure is defined here so that it has this function's target features.
    for_each_block(w.row_stride(), x, rows, |chunk, ts| {
        // SAFETY: forwarded contract; this function enables the features the block needs.
        unsafe {
            if table {
                q4_block::<false, true>(w, x, chunk, ts, out, stride, pf)
            } else {
                q4_block::<false, false>(w, x, chunk, ts, out, stride, pf)
            }
        }
    });
}

/// # Safety
/// As [`q4_rows`], and the CPU has AVX-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q4_rows_vnni(w: &Q4Matrix, x: &Q8Acts, out: *mut f32, stride: usize, rows: Range<usize>) {
    let pf = prefetch_level();
    let table = w.grid() == Grid::Table;
    if decode_rows_apply(x, &rows) {
        // SAFETY: forwarded contract; one token.
        unsafe {
            if table {
                q4_decode_rows::<true, true>(w, x, out, rows, pf)
            } else {
                q4_decode_rows::<true, false>(w, x, out, rows, pf)
            }
        };
        return;
    }
    for_each_block(w.row_stride(), x, rows, |chunk, ts| {
        // SAFETY: as above.
        unsafe {
            if table {
                q4_block::<true, true>(w, x, chunk, ts, out, stride, pf)
            } else {
                q4_block::<true, false>(w, x, chunk, ts, out, stride, pf)
            }
        }
    });
}

/// Whether a product goes through [`q4_decode_rows`]: one token.
fn decode_rows_apply(x: &Q8Acts, rows: &Range<usize>) -> bool {
    x.n() == 1 && !rows.is_empty()
}

/// Decode (one token): the rows one after another as one sequential stream, the prefetch
/// running PREFETCH bytes ahead across row ends, a line per 32 bytes of nibbles read (the tiles
/// prefetched a tile's block at a time). A row's last block of `m < 16` groups is read in place
/// with masked loads (its dword `k` of every group is `4m` bytes at `k * 4m`; lanes past `m`
/// read as zero, as in the tile's zero-filled copy of it). The same operations in the same
/// order as `q4_tile::<1, 1, VNNI>`, so the same bits.
///
/// # Safety
/// As [`q4_rows`] (and AVX-VNNI if `VNNI`), with `x.n() == 1` and `rows` not empty; inlined
/// into a function enabling the features.
#[inline(always)]
unsafe fn q4_decode_rows<const VNNI: bool, const TABLE: bool>(
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
    let base = w.row(rows.start).as_ptr();
    let mut cursor = first_prefetch(base, pf);
    let mut target = PREFETCH;
    // Row bytes per 32 bytes of nibbles (scales included): 36 (a partial block counts as one).
    let step = row_bytes / ((nb + usize::from(m > 0)) * 8);
    // SAFETY: block c < nb lies inside each row (c*32 + 32 <= groups*2 scale bytes, c*256 +
    // 256 <= groups*16 nibble bytes); the partial block's reads are only its live bytes (the
    // scale copy takes `live * 2` bytes below groups*2, the masked loads only live lanes, below
    // c*256 + 16m); the activation arrays are padded to whole blocks (c*512 + 512 bytes of qs,
    // c*16 + 16 values of corr/dexp, zero past `groups`); the caller enables the features
    // (contract).
    unsafe {
        let m4 = _mm256_set1_epi8(0x0f);
        let lut = table_lut();
        for (i, r) in rows.enumerate() {
            let ws = base.wrapping_add(i * row_bytes);
            let wq = ws.wrapping_add(groups * 2);
            let mut acc = _mm256_setzero_ps();
            for c in 0..nb {
                for h in 0..2 {
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.add(c * 32 + h * 16).cast()));
                    let mut ints = dot_start::<VNNI, TABLE>(a.corr.add(c * 16 + h * 8));
                    let mut wide = _mm256_setzero_si256();
                    for k in 0..4 {
                        target += step;
                        while cursor < target {
                            prefetch_line(base.wrapping_add(cursor), pf);
                            cursor += 64;
                        }
                        let v = _mm256_loadu_si256(wq.add(c * 256 + k * 64 + h * 32).cast());
                        let wlo = unsigned_codes::<TABLE>(_mm256_and_si256(v, m4), lut);
                        let whi = unsigned_codes::<TABLE>(
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                            lut,
                        );
                        let aoff = c * 512 + k * 128 + h * 32;
                        let alo = _mm256_loadu_si256(a.qs.add(aoff).cast());
                        let ahi = _mm256_loadu_si256(a.qs.add(aoff + 64).cast());
                        ints = dot_lanes::<VNNI>(wlo, whi, alo, ahi, ints);
                        dot_widen::<VNNI, TABLE>(k, &mut ints, &mut wide);
                    }
                    let de = _mm256_loadu_ps(a.dexp.add(c * 16 + h * 8));
                    let lanes = dot_finish::<VNNI, TABLE>(ints, wide, a.corr.add(c * 16 + h * 8));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(dw, de), acc);
                }
            }
            if m > 0 {
                // The whole-block loop above with masked loads, kept apart as in the AVX-512
                // kernel (one masked loop for both measured slower on whole rows there).
                let c = nb;
                for h in 0..2 {
                    // Lanes of this half that hold groups of the partial block.
                    let live = m.saturating_sub(h * 8).min(8);
                    let lane_mask = _mm256_cmpgt_epi32(
                        _mm256_set1_epi32(live as i32),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                    );
                    // The live scales (2 bytes each) of this half, zero past them.
                    let mut sc = [0u16; 8];
                    std::ptr::copy_nonoverlapping(
                        ws.add(c * 32 + h * 16),
                        sc.as_mut_ptr().cast::<u8>(),
                        live * 2,
                    );
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(sc.as_ptr().cast()));
                    let mut ints = dot_start::<VNNI, TABLE>(a.corr.add(c * 16 + h * 8));
                    let mut wide = _mm256_setzero_si256();
                    for k in 0..4 {
                        target += step;
                        while cursor < target {
                            prefetch_line(base.wrapping_add(cursor), pf);
                            cursor += 64;
                        }
                        // Dword k of group g is at c*256 + k*4m + 4g: lane j of this half is
                        // group h*8 + j, read only when live.
                        let v = _mm256_maskload_epi32(
                            wq.add(c * 256 + k * 4 * m + h * 32).cast(),
                            lane_mask,
                        );
                        let wlo = unsigned_codes::<TABLE>(_mm256_and_si256(v, m4), lut);
                        let whi = unsigned_codes::<TABLE>(
                            _mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                            lut,
                        );
                        let aoff = c * 512 + k * 128 + h * 32;
                        let alo = _mm256_loadu_si256(a.qs.add(aoff).cast());
                        let ahi = _mm256_loadu_si256(a.qs.add(aoff + 64).cast());
                        ints = dot_lanes::<VNNI>(wlo, whi, alo, ahi, ints);
                        dot_widen::<VNNI, TABLE>(k, &mut ints, &mut wide);
                    }
                    let de = _mm256_loadu_ps(a.dexp.add(c * 16 + h * 8));
                    let lanes = dot_finish::<VNNI, TABLE>(ints, wide, a.corr.add(c * 16 + h * 8));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(dw, de), acc);
                }
                // Whole rows between prefetch targets: a partial row's integer steps need not
                // add up to its bytes.
                target = (i + 1) * row_bytes + PREFETCH;
            }
            // r is in `rows`, token 0: the caller guarantees out + r writable.
            *out.add(r) = hsum(acc);
        }
    }
}

/// One block of `for_each_block`: rows `chunk` for tokens `ts`, a row at a time (tiles of one
/// row and up to four tokens). A 2x4 tile holds 8 integer and 8 float accumulators, all 16
/// ymm registers, so its weights and activations spilled to the stack and were read back in
/// the inner loop; at one row each weight vector still meets four tokens, and nothing spills.
/// Measured on an AVX2-only EPYC, single thread, 1024x2048, the two forms interleaved 15 times
/// in one process (median time ratio 2-row / 1-row): 1.064 at 6 tokens, 1.026 at 8, 1.020 at
/// 64. Two-row tiles for a block's last 1-3 tokens were slower still (1.04-1.22), as were
/// 1x6 tiles (1.02 at 6 tokens). The 8-bit kernel keeps its 2-row tiles: one row there was
/// 7-14% slower.
///
/// # Safety
/// As [`q4_rows`] (and AVX-VNNI if `VNNI`), for `chunk` inside its rows and `ts` inside its
/// tokens; inlined into a function enabling the features.
#[inline(always)]
unsafe fn q4_block<const VNNI: bool, const TABLE: bool>(
    w: &Q4Matrix,
    x: &Q8Acts,
    chunk: Range<usize>,
    ts: Range<usize>,
    out: *mut f32,
    out_stride: usize,
    pf: PrefetchLevel,
) {
    for r in chunk {
        // SAFETY: row r is inside `chunk`, tokens `ts` inside 0..n (contract).
        unsafe { q4_rows_tokens::<1, VNNI, TABLE>(w, r, x, ts.clone(), out, out_stride, pf) };
    }
}

/// f32 dots of `R` rows with `T` vectors.
///
/// # Safety
/// `w[r]` and `x[t]` each point at `cols` readable floats.
#[target_feature(enable = "avx2,fma")]
unsafe fn f32_tile<const R: usize, const T: usize>(
    w: [*const f32; R],
    x: [*const f32; T],
    cols: usize,
) -> [[f32; T]; R] {
    let c8 = cols / 8 * 8;
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut k = 0;
    while k < c8 {
        let mut xv = [_mm256_setzero_ps(); T];
        for t in 0..T {
            // SAFETY: k + 8 <= cols.
            xv[t] = unsafe { _mm256_loadu_ps(x[t].add(k)) };
        }
        for r in 0..R {
            // SAFETY: k + 8 <= cols.
            let wv = unsafe { _mm256_loadu_ps(w[r].add(k)) };
            for t in 0..T {
                acc[r][t] = _mm256_fmadd_ps(wv, xv[t], acc[r][t]);
            }
        }
        k += 8;
    }
    let mut res = [[0.0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            let mut tail = 0.0f32;
            for k in c8..cols {
                // SAFETY: k < cols.
                tail += unsafe { *w[r].add(k) * *x[t].add(k) };
            }
            res[r][t] = hsum(acc[r][t]) + tail;
        }
    }
    res
}

/// # Safety
/// As `f32_rows`, for rows `r0..r0 + R` and tokens `t0..t0 + T`.
#[target_feature(enable = "avx2,fma")]
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
/// The CPU has AVX2 and FMA; `w.len() >= rows.end * cols`; `x.len() >= n * cols`; every
/// `out + t * out_stride + r` (`t < n`, `r in rows`) is valid for writes.
#[target_feature(enable = "avx2,fma")]
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
    if n == 1 {
        while r < rows.end {
            if rows.end - r >= 4 {
                // SAFETY: rows r..r+4 are inside `rows`, token 0 < n; forwarded contract.
                unsafe { f32_run::<4, 1>(w, cols, r, x, 0, out, out_stride) };
                r += 4;
            } else {
                // SAFETY: row r is inside `rows`, token 0 < n; forwarded contract.
                unsafe { f32_run::<1, 1>(w, cols, r, x, 0, out, out_stride) };
                r += 1;
            }
        }
        return;
    }
    while r < rows.end {
        let two = rows.end - r >= 2;
        let mut t = 0;
        while t < n {
            let left = n - t;
            // SAFETY: rows r..r+(2 if two else 1) are inside `rows` and tokens
            // t..t+min(left, 4) inside 0..n; forwarded contract.
            unsafe {
                match (two, left) {
                    (true, 1) => f32_run::<2, 1>(w, cols, r, x, t, out, out_stride),
                    (true, 2) => f32_run::<2, 2>(w, cols, r, x, t, out, out_stride),
                    (true, 3) => f32_run::<2, 3>(w, cols, r, x, t, out, out_stride),
                    (true, _) => f32_run::<2, 4>(w, cols, r, x, t, out, out_stride),
                    (false, 1) => f32_run::<1, 1>(w, cols, r, x, t, out, out_stride),
                    (false, 2) => f32_run::<1, 2>(w, cols, r, x, t, out, out_stride),
                    (false, 3) => f32_run::<1, 3>(w, cols, r, x, t, out, out_stride),
                    (false, _) => f32_run::<1, 4>(w, cols, r, x, t, out, out_stride),
                }
            }
            t += left.min(4);
        }
        r += if two { 2 } else { 1 };
    }
}

// ---------------------------------------------------------------------------------------------
// 8-bit weights (`q8w`), per half block of 8 groups: run `k` of the 8 groups' values is one
// 32-byte vector, meeting the activations' matching 32 bytes, i32 lane `i` = group `i`. Without
// AVX-VNNI: `maddubs(|q|, sign(a, q))` (|q| <= 127 and |a| <= 127, so at most 2 * 127 * 127 per
// i16: no saturation), widened by `madd` with ones; with it: `dpbusd(q ^ 0x80, a)` from lanes
// starting at `-128 * sum(a)` (16 times the activations' `corr`). The same exact integer.
// ---------------------------------------------------------------------------------------------

/// `acc` plus, per i32 lane, the four products of the signed weight bytes `w` with `a` (exact).
///
/// # Safety
/// The CPU has AVX2, and AVX-VNNI if `VNNI`; inlined into functions enabling them. With `VNNI`
/// the lanes of `acc` must have started at `-128 * sum(a)` of their group (see above).
#[inline(always)]
unsafe fn dot8_lanes<const VNNI: bool>(w: __m256i, a: __m256i, acc: __m256i) -> __m256i {
    // SAFETY: forwarded contract (register operations only).
    unsafe {
        if VNNI {
            let u = _mm256_xor_si256(w, _mm256_set1_epi8(0x80u8 as i8));
            _mm256_dpbusd_avx_epi32(acc, u, a)
        } else {
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(a, w));
            _mm256_add_epi32(_mm256_madd_epi16(p, _mm256_set1_epi16(1)), acc)
        }
    }
}

/// The lanes an 8-bit group's integer starts from: `-128 * sum(a)` with VNNI (it offsets the
/// unsigned weights), else 0.
///
/// # Safety
/// As [`dot8_lanes`]; `corr` points at 8 readable i32.
#[inline(always)]
unsafe fn dot8_start<const VNNI: bool>(corr: *const i32) -> __m256i {
    // SAFETY: forwarded contract.
    unsafe {
        if VNNI {
            _mm256_slli_epi32::<4>(_mm256_loadu_si256(corr.cast()))
        } else {
            _mm256_setzero_si256()
        }
    }
}

/// Dots of `R` 8-bit rows with `T` activation vectors.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C, and AVX-VNNI if `VNNI` (inlined into the entry points that
/// enable them); `wr[r]` points at the `groups * 34` readable bytes of one row (`groups * 2`
/// bytes of scales, then `groups * 32` values); each `a[t]` points at the arrays of one
/// activation vector with at least `groups.next_multiple_of(16)` groups.
#[inline(always)]
unsafe fn q8_tile<const R: usize, const T: usize, const VNNI: bool>(
    wr: [*const u8; R],
    groups: usize,
    a: [ActPtr; T],
    pf: PrefetchLevel,
) -> [[f32; T]; R] {
    // SAFETY: the caller enables AVX2, FMA and F16C (and AVX-VNNI if VNNI) around this
    // inlined body; every pointer read is inside a row or activation vector by the
    // function's contract, as the comments below say for each.
    unsafe {
        let nb = groups.div_ceil(BLOCK_GROUPS);
        let row_bytes = groups * 34;
        let mut tails: [TailBuf8; R] = [const { TailBuf8::uninit() }; R];
        // Row r is one row of `groups` groups (contract); `tails` lives to the end.
        let blocks: [RowBlocks8; R] =
            std::array::from_fn(|r| RowBlocks8::new(wr[r], groups, &mut tails[r]));
        let mut prefetch = TilePrefetch::new(wr[0], R * row_bytes, pf);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        for c in 0..nb {
            prefetch.chunk(c, nb);
            let mut q = [std::ptr::null::<u8>(); R];
            let mut sc = [std::ptr::null::<u8>(); R];
            for r in 0..R {
                (q[r], sc[r]) = blocks[r].block(c);
            }
            // Groups 16c + 8h..: block c < nb <= padded groups / 16, so the activation reads
            // (qs[c*512..c*512 + 512], corr/dexp[c*16..c*16 + 16]) are inside each vector.
            for h in 0..2 {
                let mut dw = [_mm256_setzero_ps(); R];
                for r in 0..R {
                    // sc[r] points at the block's 16 f16 scales (32 bytes).
                    dw[r] = _mm256_cvtph_ps(_mm_loadu_si128(sc[r].add(h * 16).cast()));
                }
                let mut ints = [[_mm256_setzero_si256(); T]; R];
                for t in 0..T {
                    let start = dot8_start::<VNNI>(a[t].corr.add(c * 16 + h * 8));
                    for row in ints.iter_mut() {
                        row[t] = start;
                    }
                }
                for k in 0..8 {
                    let mut wv = [_mm256_setzero_si256(); R];
                    for r in 0..R {
                        // q[r] points at the block's 512 value bytes.
                        wv[r] = _mm256_loadu_si256(q[r].add(k * 64 + h * 32).cast());
                    }
                    for t in 0..T {
                        let av = _mm256_loadu_si256(a[t].qs.add(c * 512 + k * 64 + h * 32).cast());
                        for r in 0..R {
                            ints[r][t] = dot8_lanes::<VNNI>(wv[r], av, ints[r][t]);
                        }
                    }
                }
                for t in 0..T {
                    let de = _mm256_loadu_ps(a[t].dexp.add(c * 16 + h * 8));
                    for r in 0..R {
                        acc[r][t] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(ints[r][t]),
                            _mm256_mul_ps(dw[r], de),
                            acc[r][t],
                        );
                    }
                }
            }
        }
        let mut res = [[0.0f32; T]; R];
        for r in 0..R {
            for t in 0..T {
                res[r][t] = hsum(acc[r][t]);
            }
        }
        res
    }
}

/// # Safety
/// As [`q8_rows`] (and AVX-VNNI if `VNNI`), for rows `r0..r0 + R` and tokens `t0..t0 + T`.
#[inline(always)]
unsafe fn q8_run<const R: usize, const T: usize, const VNNI: bool>(
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
    let res = unsafe { q8_tile::<R, T, VNNI>(wr, w.groups(), a, pf) };
    for (i, row) in res.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            // SAFETY: (t0 + j, r0 + i) is within the tokens and rows the caller guarantees
            // writable.
            unsafe { *out.wrapping_add((t0 + j) * out_stride + r0 + i) = v };
        }
    }
}

/// One block of `for_each_block` over 8-bit rows: rows `chunk` for tokens `ts`, in tiles of
/// 2 rows x up to 4 tokens.
///
/// # Safety
/// As [`q8_rows`] (and AVX-VNNI if `VNNI`), for `chunk` inside its rows and `ts` inside its
/// tokens; inlined into a function enabling the features.
#[inline(always)]
unsafe fn q8_block<const VNNI: bool>(
    w: &Q8Matrix,
    x: &Q8Acts,
    chunk: Range<usize>,
    ts: Range<usize>,
    out: *mut f32,
    out_stride: usize,
    pf: PrefetchLevel,
) {
    let mut r = chunk.start;
    while r < chunk.end {
        let rows2 = chunk.end - r >= 2;
        let mut t = ts.start;
        while t < ts.end {
            // SAFETY: rows r..r+(2 or 1) are inside `chunk`, tokens t..t+T inside `ts`
            // (contract).
            unsafe {
                match (rows2, ts.end - t) {
                    (true, 1) => q8_run::<2, 1, VNNI>(w, r, x, t, out, out_stride, pf),
                    (true, 2) => q8_run::<2, 2, VNNI>(w, r, x, t, out, out_stride, pf),
                    (true, 3) => q8_run::<2, 3, VNNI>(w, r, x, t, out, out_stride, pf),
                    (true, _) => q8_run::<2, 4, VNNI>(w, r, x, t, out, out_stride, pf),
                    (false, 1) => q8_run::<1, 1, VNNI>(w, r, x, t, out, out_stride, pf),
                    (false, 2) => q8_run::<1, 2, VNNI>(w, r, x, t, out, out_stride, pf),
                    (false, 3) => q8_run::<1, 3, VNNI>(w, r, x, t, out, out_stride, pf),
                    (false, _) => q8_run::<1, 4, VNNI>(w, r, x, t, out, out_stride, pf),
                }
            }
            t += (ts.end - t).min(4);
        }
        r += if rows2 { 2 } else { 1 };
    }
}

/// Decode (one token) over 8-bit rows: as [`q4_decode_rows`], one sequential stream with the
/// prefetch ahead, a row's partial last block read in place with masked loads (lanes past its
/// `m` groups read as zero, which multiply zero activations). The same operations in the same
/// order as `q8_tile::<1, 1, VNNI>`, so the same bits.
///
/// # Safety
/// As [`q8_rows`] (and AVX-VNNI if `VNNI`), with `x.n() == 1` and `rows` not empty; inlined
/// into a function enabling the features.
#[inline(always)]
unsafe fn q8_decode_rows<const VNNI: bool>(
    w: &Q8Matrix,
    x: &Q8Acts,
    out: *mut f32,
    rows: Range<usize>,
    pf: PrefetchLevel,
) {
    let groups = w.groups();
    let nb = groups / BLOCK_GROUPS;
    let m = groups % BLOCK_GROUPS;
    let row_bytes = groups * 34;
    let a = ActPtr::new(&x.token(0));
    let base = w.row(rows.start).as_ptr();
    let mut cursor = first_prefetch(base, pf);
    let mut target = PREFETCH;
    // Row bytes per 32 bytes of values (scales included): 34 (a partial block counts as one).
    let step = row_bytes / ((nb + usize::from(m > 0)) * 16);
    // SAFETY: block c < nb lies inside each row (c*32 + 32 <= groups*2 scale bytes, c*512 +
    // 512 <= groups*32 value bytes); the partial block's reads are only its live bytes (the
    // scale copy takes `live * 2` bytes below groups*2, the masked loads only live lanes, below
    // c*512 + 32m); the activation arrays are padded to whole blocks (c*512 + 512 bytes of qs,
    // c*16 + 16 values of corr/dexp, zero past `groups`); the caller enables the features
    // (contract).
    unsafe {
        for (i, r) in rows.enumerate() {
            let ws = base.wrapping_add(i * row_bytes);
            let wq = ws.wrapping_add(groups * 2);
            let mut acc = _mm256_setzero_ps();
            for c in 0..nb {
                for h in 0..2 {
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(ws.add(c * 32 + h * 16).cast()));
                    let mut ints = dot8_start::<VNNI>(a.corr.add(c * 16 + h * 8));
                    for k in 0..8 {
                        target += step;
                        while cursor < target {
                            prefetch_line(base.wrapping_add(cursor), pf);
                            cursor += 64;
                        }
                        let wv = _mm256_loadu_si256(wq.add(c * 512 + k * 64 + h * 32).cast());
                        let av = _mm256_loadu_si256(a.qs.add(c * 512 + k * 64 + h * 32).cast());
                        ints = dot8_lanes::<VNNI>(wv, av, ints);
                    }
                    let de = _mm256_loadu_ps(a.dexp.add(c * 16 + h * 8));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_mul_ps(dw, de), acc);
                }
            }
            if m > 0 {
                // The whole-block loop above with masked loads, kept apart as in the int4
                // kernels.
                let c = nb;
                for h in 0..2 {
                    let live = m.saturating_sub(h * 8).min(8);
                    let lane_mask = _mm256_cmpgt_epi32(
                        _mm256_set1_epi32(live as i32),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                    );
                    let mut sc = [0u16; 8];
                    std::ptr::copy_nonoverlapping(
                        ws.add(c * 32 + h * 16),
                        sc.as_mut_ptr().cast::<u8>(),
                        live * 2,
                    );
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(sc.as_ptr().cast()));
                    let mut ints = dot8_start::<VNNI>(a.corr.add(c * 16 + h * 8));
                    for k in 0..8 {
                        target += step;
                        while cursor < target {
                            prefetch_line(base.wrapping_add(cursor), pf);
                            cursor += 64;
                        }
                        // Run k of group g is at c*512 + k*4m + 4g: lane j of this half is
                        // group h*8 + j, read only when live.
                        let wv = _mm256_maskload_epi32(
                            wq.add(c * 512 + k * 4 * m + h * 32).cast(),
                            lane_mask,
                        );
                        let av = _mm256_loadu_si256(a.qs.add(c * 512 + k * 64 + h * 32).cast());
                        ints = dot8_lanes::<VNNI>(wv, av, ints);
                    }
                    let de = _mm256_loadu_ps(a.dexp.add(c * 16 + h * 8));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), _mm256_mul_ps(dw, de), acc);
                }
                target = (i + 1) * row_bytes + PREFETCH;
            }
            // r is in `rows`, token 0: the caller guarantees out + r writable.
            *out.add(r) = hsum(acc);
        }
    }
}

/// `out[t * out_stride + r] = dot(w[r], x[t])` for 8-bit weights, with AVX-VNNI when
/// [`avx_vnni`] says so.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; `rows.end <= w.rows`; `x.cols() == w.cols`; every
/// `out + t * out_stride + r` (`t < x.n()`, `r in rows`) is valid for writes.
pub(crate) unsafe fn q8_rows(
    w: &Q8Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    // SAFETY: forwarded contract; `avx_vnni` is only true on CPUs with AVX-VNNI.
    unsafe { q8_rows_with(avx_vnni(), w, x, out, out_stride, rows) }
}

/// [`q8_rows`] with AVX-VNNI or without (`vnni` only where the CPU has it).
///
/// # Safety
/// As [`q8_rows`], and the CPU has AVX-VNNI if `vnni`.
pub(crate) unsafe fn q8_rows_with(
    vnni: bool,
    w: &Q8Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    // SAFETY: forwarded contract.
    unsafe {
        if vnni {
            q8_rows_vnni(w, x, out, out_stride, rows)
        } else {
            q8_rows_plain(w, x, out, out_stride, rows)
        }
    }
}

/// # Safety
/// As [`q8_rows`].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_rows_plain(
    w: &Q8Matrix,
    x: &Q8Acts,
    out: *mut f32,
    stride: usize,
    rows: Range<usize>,
) {
    let pf = prefetch_level();
    if decode_rows_apply(x, &rows) {
        // SAFETY: forwarded contract; one token.
        unsafe { q8_decode_rows::<false>(w, x, out, rows, pf) };
        return;
    }
    // The closure is defined here so that it has this function's target features.
    for_each_block(w.row_stride(), x, rows, |chunk, ts| {
        // SAFETY: forwarded contract; this function enables the features the block needs.
        unsafe { q8_block::<false>(w, x, chunk, ts, out, stride, pf) }
    });
}

/// # Safety
/// As [`q8_rows`], and the CPU has AVX-VNNI.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q8_rows_vnni(w: &Q8Matrix, x: &Q8Acts, out: *mut f32, stride: usize, rows: Range<usize>) {
    let pf = prefetch_level();
    if decode_rows_apply(x, &rows) {
        // SAFETY: forwarded contract; one token.
        unsafe { q8_decode_rows::<true>(w, x, out, rows, pf) };
        return;
    }
    for_each_block(w.row_stride(), x, rows, |chunk, ts| {
        // SAFETY: as above.
        unsafe { q8_block::<true>(w, x, chunk, ts, out, stride, pf) }
    });
}
