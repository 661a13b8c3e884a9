//! AVX-512 (F, BW, VL, VNNI) kernels.
//!
//! int4 × int8: per 4 groups, 64 weight bytes are split into low and high nibbles (two vectors
//! of 4 x 16 unsigned values) and multiplied with the matching activation halves by
//! `_mm512_dpbusd_epi32` (u8 × i8 summed into 4 i32 lanes per group), starting from the
//! precomputed `-8 * sum(a)` lanes; then converted to f32 and accumulated with FMA against
//! `weight scale * activation scale`. Tiles of `R` rows × `T` tokens as in the AVX2 kernel,
//! except that decode (n = 1) goes one row at a time.

use std::arch::x86_64::*;
use std::ops::Range;

use super::prefetch::{prefetch_level, PrefetchLevel};
use super::x86_avx2::{for_each_block, prefetch_line, ActPtr, TilePrefetch, PREFETCH};
use super::{Q4Matrix, Q8Acts};

/// Dots of `R` rows with `T` activation vectors.
///
/// # Safety
/// `wr[r]` points at the `groups * 18` readable bytes of one row (`groups * 2` bytes of scales,
/// then `groups * 16` bytes of nibbles); each `a[t]` points at the arrays of one activation
/// vector with at least `groups.next_multiple_of(8)` groups (`qs`: 32 bytes, `corr`/`dexp`: 4
/// values per group).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_tile<const R: usize, const T: usize>(
    wr: [*const u8; R],
    groups: usize,
    a: [ActPtr; T],
    l2: bool,
) -> [[f32; T]; R] {
    let full = groups / 8;
    let nch = groups.div_ceil(8);
    let row_bytes = groups * 18;
    // Scales at the start of the row, nibbles after them.
    let ws = wr;
    let wq: [*const u8; R] = std::array::from_fn(|r| wr[r].wrapping_add(groups * 2));
    let mut prefetch = TilePrefetch::new(wr[0], R * row_bytes, l2);
    // The last partial chunk of 8 groups is copied into zero-filled buffers (zero scales make
    // the padding groups contribute nothing; the activations are zero there as well).
    let mut tq = [[0u8; 128]; R];
    let mut ts = [[0u8; 16]; R];
    if nch > full {
        let rem = groups - full * 8;
        for r in 0..R {
            // SAFETY: row r has groups*16 nibble bytes and groups*2 scale bytes; the copies
            // read [full*128, groups*16) and [full*16, groups*2) of them into 128/16-byte
            // buffers (rem < 8 groups).
            unsafe {
                std::ptr::copy_nonoverlapping(wq[r].add(full * 128), tq[r].as_mut_ptr(), rem * 16);
                std::ptr::copy_nonoverlapping(ws[r].add(full * 16), ts[r].as_mut_ptr(), rem * 2);
            }
        }
    }
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    for c in 0..nch {
        prefetch.chunk(c, nch);
        let mut q = [std::ptr::null::<u8>(); R];
        let mut dw = [_mm512_setzero_ps(); R];
        for r in 0..R {
            let s = if c < full {
                // SAFETY: chunk c < full lies inside the row (c*128 + 128 <= groups*16,
                // c*16 + 16 <= groups*2).
                q[r] = unsafe { wq[r].add(c * 128) };
                // SAFETY: as above.
                unsafe { ws[r].add(c * 16) }
            } else {
                q[r] = tq[r].as_ptr();
                ts[r].as_ptr()
            };
            // SAFETY: s points at 16 readable bytes (8 f16 scales), see above.
            let h = unsafe { _mm_loadu_si128(s.cast()) };
            dw[r] = _mm512_castps256_ps512(_mm256_cvtph_ps(h));
        }
        for s in 0..2 {
            let g = 4 * s as i32;
            let idx = _mm512_setr_epi32(
                g,
                g,
                g,
                g,
                g + 1,
                g + 1,
                g + 1,
                g + 1,
                g + 2,
                g + 2,
                g + 2,
                g + 2,
                g + 3,
                g + 3,
                g + 3,
                g + 3,
            );
            let mut wlo = [_mm512_setzero_si512(); R];
            let mut whi = [_mm512_setzero_si512(); R];
            let mut dwe = [_mm512_setzero_ps(); R];
            for r in 0..R {
                // SAFETY: q[r] points at 128 readable bytes (this chunk's nibbles).
                let v = unsafe { _mm512_loadu_si512(q[r].add(s * 64).cast()) };
                wlo[r] = _mm512_and_si512(v, m4);
                whi[r] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                dwe[r] = _mm512_permutexvar_ps(idx, dw[r]);
            }
            // Groups 8c + 4s .. +4: 4-group block 2c + s.
            let aoff = c * 256 + s * 128;
            let loff = c * 32 + s * 16;
            for t in 0..T {
                // SAFETY: chunk c < nch <= padded groups / 8, so qs[aoff..aoff+128] and
                // corr/dexp[loff..loff+16] are inside the vector's arrays.
                let (alo, ahi, corr, de) = unsafe {
                    (
                        _mm512_loadu_si512(a[t].qs.add(aoff).cast()),
                        _mm512_loadu_si512(a[t].qs.add(aoff + 64).cast()),
                        _mm512_loadu_si512(a[t].corr.add(loff).cast()),
                        _mm512_loadu_ps(a[t].dexp.add(loff)),
                    )
                };
                for r in 0..R {
                    let i = _mm512_dpbusd_epi32(corr, wlo[r], alo);
                    let i = _mm512_dpbusd_epi32(i, whi[r], ahi);
                    acc[r][t] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(i),
                        _mm512_mul_ps(dwe[r], de),
                        acc[r][t],
                    );
                }
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
/// As [`q4_rows`], for rows `r0..r0 + R` and tokens `t0..t0 + T`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_run<const R: usize, const T: usize>(
    w: &Q4Matrix,
    r0: usize,
    x: &Q8Acts,
    t0: usize,
    out: *mut f32,
    out_stride: usize,
    l2: bool,
) {
    let wr: [*const u8; R] = std::array::from_fn(|i| w.row(r0 + i).as_ptr());
    let a: [ActPtr; T] = std::array::from_fn(|j| ActPtr::new(&x.token(t0 + j)));
    // SAFETY: the pointers come from row slices of `w` (groups*18 bytes: scales, then nibbles)
    // and from activation vectors padded to a multiple of 8 groups >= w.groups() (cols agree).
    let res = unsafe { q4_tile::<R, T>(wr, w.groups(), a, l2) };
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
    l2: bool,
) {
    let mut t = ts.start;
    while t < ts.end {
        // SAFETY: tokens t..t+T are inside ts; forwarded contract otherwise.
        unsafe {
            match ts.end - t {
                1 => q4_run::<R, 1>(w, r0, x, t, out, out_stride, l2),
                2 => q4_run::<R, 2>(w, r0, x, t, out, out_stride, l2),
                3 => q4_run::<R, 3>(w, r0, x, t, out, out_stride, l2),
                _ => q4_run::<R, 4>(w, r0, x, t, out, out_stride, l2),
            }
        }
        t += (ts.end - t).min(4);
    }
}

/// Decode (one token) over rows whose groups fill whole chunks of 8: the rows one after another,
/// each read as one sequential stream as by the one-row tile, with the per-row setup (pointers,
/// the zero-filled tail buffers, the prefetch cursor) hoisted out of the row loop; the prefetch
/// runs PREFETCH bytes ahead of the reads across row ends. The arithmetic is that of
/// `q4_tile::<1, 1>` in the same order, so the results are bit-identical to it.
///
/// # Safety
/// As [`q4_rows`], with `x.n() == 1`, `w.groups()` a multiple of 8 and `rows` not empty.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_decode_rows(w: &Q4Matrix, x: &Q8Acts, out: *mut f32, rows: Range<usize>, l2: bool) {
    let groups = w.groups();
    let nch = groups / 8;
    let row_bytes = groups * 18;
    let a = ActPtr::new(&x.token(0));
    // Consecutive rows are contiguous: one byte range from the first row on.
    let base = w.row(rows.start).as_ptr();
    let m4 = _mm512_set1_epi8(0x0f);
    let idx = [
        _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
        _mm512_setr_epi32(4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7, 7, 7),
    ];
    let mut cursor = PREFETCH - (base as usize).wrapping_add(PREFETCH) % 64;
    let mut target = PREFETCH;
    let step = row_bytes / nch;
    for (i, r) in rows.enumerate() {
        let ws = base.wrapping_add(i * row_bytes);
        let wq = ws.wrapping_add(groups * 2);
        let mut acc = _mm512_setzero_ps();
        for c in 0..nch {
            // SAFETY: chunk c < nch lies inside row r (c*16 + 16 <= groups*2 scale bytes,
            // c*128 + 128 <= groups*16 nibble bytes); the activation arrays hold at least
            // `groups` groups (c*256 + 256 bytes of qs, c*32 + 32 values of corr/dexp).
            unsafe {
                let h = _mm_loadu_si128(ws.add(c * 16).cast());
                let dw = _mm512_castps256_ps512(_mm256_cvtph_ps(h));
                for (s, ix) in idx.iter().enumerate() {
                    target += step / 2;
                    while cursor < target {
                        prefetch_line(base.wrapping_add(cursor), l2);
                        cursor += 64;
                    }
                    let v = _mm512_loadu_si512(wq.add(c * 128 + s * 64).cast());
                    let wlo = _mm512_and_si512(v, m4);
                    let whi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
                    let dwe = _mm512_permutexvar_ps(*ix, dw);
                    let aoff = c * 256 + s * 128;
                    let loff = c * 32 + s * 16;
                    let alo = _mm512_loadu_si512(a.qs.add(aoff).cast());
                    let ahi = _mm512_loadu_si512(a.qs.add(aoff + 64).cast());
                    let corr = _mm512_loadu_si512(a.corr.add(loff).cast());
                    let de = _mm512_loadu_ps(a.dexp.add(loff));
                    let i = _mm512_dpbusd_epi32(corr, wlo, alo);
                    let i = _mm512_dpbusd_epi32(i, whi, ahi);
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(dwe, de), acc);
                }
            }
        }
        // SAFETY: r is in `rows`, token 0: the caller guarantees out + r writable.
        unsafe { *out.add(r) = _mm512_reduce_add_ps(acc) };
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
    let l2 = prefetch_level() == PrefetchLevel::L2;
    let n = x.n();
    if n == 1 && w.groups().is_multiple_of(8) && !rows.is_empty() {
        // SAFETY: forwarded contract; whole chunks of 8 groups, one token.
        unsafe { q4_decode_rows(w, x, out, rows, l2) };
        return;
    }
    // Blocks that keep weights in L2 and activations in L1 (see `for_each_block`).
    for_each_block(w, x, rows, |chunk, ts| {
        let mut r = chunk.start;
        // Single rows for decode (n = 1), 3 rows x 4 tokens for prefill (measured best on Zen
        // 4): with one row at a time each thread reads its rows as one sequential stream, which
        // gave ~15% more decode throughput than 2-row tiles at 1 and 2 threads.
        while r < chunk.end {
            let left = chunk.end - r;
            // SAFETY: rows r..r+R are inside `rows` (R <= left), tokens `ts` inside 0..n.
            unsafe {
                if n > 1 && left >= 3 {
                    q4_rows_tokens::<3>(w, r, x, ts.clone(), out, out_stride, l2);
                    r += 3;
                } else if n > 1 && left >= 2 {
                    q4_rows_tokens::<2>(w, r, x, ts.clone(), out, out_stride, l2);
                    r += 2;
                } else {
                    q4_rows_tokens::<1>(w, r, x, ts.clone(), out, out_stride, l2);
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
