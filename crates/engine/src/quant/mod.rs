//! Int4 weights (`Q4`), 8-bit activations (`Q8Acts`) and the matmul kernels over them.
//!
//! # Int4 storage layout
//!
//! One matrix `[rows x cols]`, row-major, each row padded with zero weights to
//! `kp = q4_padded_cols(cols)` (a multiple of [`GROUP`] = 32). Each row is one contiguous
//! stream of `q4_row_bytes(cols) = kp/32 * 18` bytes, its scales followed by its nibbles, so a
//! kernel walking the rows in order reads the matrix front to back. The bytes are a pure
//! function of `(rows, cols)` and the weights:
//!
//! ```text
//! row r at r * kp/32 * 18:
//!   [scales: kp/32 f16, little-endian]   group g at + g*2
//!   [nibbles: kp/2 bytes]                in blocks of 16 groups (256 bytes; the last may be
//!                                        shorter), see below
//! ```
//!
//! Within a group of 32 weights, nibble byte `j` (0..16) holds element `j` in its low nibble and
//! element `j + 16` in its high nibble; the weight is `(q - 8) * scale` (on the table grid,
//! [`Grid::Table`], `TABLE_LEVELS[q] * scale`: the same layout). The nibble bytes of 16
//! groups form a block, interleaved by dword: byte `j` of the block's group `i` is at
//! `(j / 4) * 4m + 4i + j % 4`, `m` the block's groups (16 but in a row's last block), so each
//! 64 bytes hold one dword of each of 16 groups (`q4::nibble_offset`). Padding columns hold
//! `q = 8` (weight 0). The buffer may sit at any alignment: every kernel uses unaligned loads.
//! Rows are not padded: when `kp` is a multiple of 256 they and their nibbles are 16-byte
//! aligned relative to the buffer, otherwise as little as 2-byte aligned (measured no slower).
//!
//! # Kernels
//!
//! [`Kernel::Scalar`] is the reference; [`Kernel::Avx2`] (AVX2 + FMA + F16C, with AVX-VNNI
//! where the CPU has it) and [`Kernel::Avx512Vnni`] (AVX-512 F/BW/VL/VNNI) compute the same
//! integer dot product per group (exact) and differ from it only in the order of the f32
//! accumulation over groups. A group's dot is `dw * da * (sum q*a - 8 * sum a)` with `q` the
//! unsigned nibbles and `a` the i8 activations; `-8 * sum a` comes precomputed with the
//! activations ([`Q8Acts`], laid out in the same blocks). Because a block's dword `k` of 16
//! groups is one 64-byte vector, each i32 lane of the SIMD kernels is one group: the four
//! dwords accumulate into the same lanes, and the conversion to f32 and the FMA with the scales
//! happen once per 16 groups (AVX-512) or 8 (AVX2), where one lane per dword needed them four
//! times as often (format v2: AVX-512 decode +3-4%, its in-cache rate +20%).
//! The SIMD kernels work on tiles of rows x tokens (2 x 4 for prefill; for decode, n = 1, both
//! run a row loop of their own with the 1 x 1 tile's arithmetic), so each unpacked weight vector
//! serves up to 4 tokens and
//! each activation vector several rows; tokens go in blocks whose activations stay in L1
//! while the weights stream past once per block. They software-prefetch each row's byte
//! stream 8 KiB ahead (which doubled the DRAM throughput of decode on Zen 4; storing each
//! row's scales next to its nibbles, one stream instead of two, added ~20% at 1 thread and ~7%
//! at 2).
//! `f32_matmul` uses AVX2+FMA for [`Kernel::Avx2`] and AVX-512F for [`Kernel::Avx512Vnni`].
//!
//! Asking a function here for a kernel the CPU lacks panics; [`kernel()`] never returns one.
//!
//! # Writing the output from several threads
//!
//! [`q4_matmul`] / [`f32_matmul`] take the whole output and index it as
//! `out[t * out_stride + r]`. To split rows across rayon tasks without `unsafe` in the caller:
//! * [`OutView`]: a mutable view of an `n x rows` strided output that can be split into disjoint
//!   row ranges ([`OutView::split_at`], [`OutView::chunks`]); each piece is `Send`, and
//!   [`q4_matmul_into`] / [`f32_matmul_into`] compute exactly the rows of the piece they get
//!   (still indexing `out[t * out_stride + r]` of the original buffer);
//! * [`q4_matmul_rows`] / [`f32_matmul_rows`]: `out` covers the row range only and is indexed
//!   `out[t * out_stride + (r - rows.start)]` (handy for n = 1 with `par_chunks_mut`);
//! * [`q4_matmul_par`] / [`f32_matmul_par`]: do the rayon split themselves.

#![deny(unsafe_op_in_unsafe_fn)]

mod columns;
mod exact;
#[cfg(target_arch = "x86_64")]
mod exact_avx2;
pub mod prefetch;
mod q4;
mod q4_table;
mod q8;
mod q8w;
mod scalar;
#[cfg(target_arch = "x86_64")]
mod x86_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_avx512;

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::OnceLock;

pub use columns::{columns_exact_into, Columns};
pub use exact::{q4_exact_into, q8_exact_into, StoredActs};
pub(crate) use q4::v2_nibbles_to_v3;
#[cfg(test)]
pub(crate) use q4::v3_nibbles_to_v2;
pub use q4::{
    q4_byte_len, q4_padded_cols, q4_row_bytes, quantize_q4, quantize_q4_0_rtn, quantize_q4_table,
    quantize_q4_weighted, Grid, Q4Matrix, RowWeights, GROUP, TABLE_LEVELS,
};
pub use q8::Q8Acts;
pub use q8w::{q8_byte_len, q8_row_bytes, quantize_q8, Q8Matrix};

/// Errors of this module.
#[derive(thiserror::Error, Debug)]
pub enum QuantError {
    /// The byte buffer does not have the length the layout needs for `rows x cols`.
    #[error("quantized matrix {rows}x{cols} needs {expected} bytes, got {actual}")]
    Length {
        rows: usize,
        cols: usize,
        expected: usize,
        actual: usize,
    },
    /// `rows x cols` overflows `usize` in the layout computation.
    #[error("quantized matrix shape {rows}x{cols} is too large")]
    Shape { rows: usize, cols: usize },
}

/// A matmul implementation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    Scalar,
    Avx2,
    Avx512Vnni,
}

impl Kernel {
    /// All kernels, slowest first.
    pub const ALL: [Kernel; 3] = [Kernel::Scalar, Kernel::Avx2, Kernel::Avx512Vnni];

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Scalar => "scalar",
            Kernel::Avx2 => "avx2",
            Kernel::Avx512Vnni => "avx512",
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        match self {
            Kernel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512Vnni => {
                Kernel::Avx2.available()
                    && is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx512bw")
                    && is_x86_feature_detected!("avx512vl")
                    && is_x86_feature_detected!("avx512vnni")
            }
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The fastest kernel this CPU can run.
    pub fn best() -> Kernel {
        Kernel::ALL
            .into_iter()
            .rev()
            .find(|k| k.available())
            .unwrap_or(Kernel::Scalar)
    }

    /// Parses a `COLI_KERNEL` value (`scalar`, `avx2`, `avx512`).
    pub fn from_name(s: &str) -> Option<Kernel> {
        match s.trim().to_ascii_lowercase().as_str() {
            "scalar" => Some(Kernel::Scalar),
            "avx2" => Some(Kernel::Avx2),
            "avx512" | "avx512vnni" | "avx512_vnni" => Some(Kernel::Avx512Vnni),
            _ => None,
        }
    }
}

/// Resolves a `COLI_KERNEL` setting: `None`/empty → best; an unknown or unavailable kernel → a
/// warning (returned as the second value) and the best available one.
pub fn resolve_kernel(setting: Option<&str>) -> (Kernel, Option<String>) {
    let best = Kernel::best();
    match setting.map(str::trim) {
        None | Some("") => (best, None),
        Some(s) => match Kernel::from_name(s) {
            Some(k) if k.available() => (k, None),
            Some(k) => (
                best,
                Some(format!(
                    "colibri: COLI_KERNEL={s}: kernel {} is not available on this CPU, using {}",
                    k.name(),
                    best.name()
                )),
            ),
            None => (
                best,
                Some(format!(
                    "colibri: COLI_KERNEL={s}: unknown kernel (expected scalar|avx2|avx512), using {}",
                    best.name()
                )),
            ),
        },
    }
}

/// The kernel used by default: the best available one, detected once; the environment variable
/// `COLI_KERNEL=scalar|avx2|avx512` forces one (if it is not available on this CPU, one warning
/// line goes to stderr and the best available one is used).
pub fn kernel() -> Kernel {
    static KERNEL: OnceLock<Kernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        let (k, warning) = resolve_kernel(crate::settings::kernel());
        if let Some(w) = warning {
            eprintln!("{w}");
        }
        k
    })
}

/// Whether the AVX2 kernel's int8 dots use AVX-VNNI in this process (the CPU has it and
/// `COLI_AVX_VNNI` is not `0`); the results are the same bits either way.
pub fn avx2_uses_avx_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86_avx2::avx_vnni()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn check_kernel(k: Kernel) {
    assert!(
        k.available(),
        "kernel {} is not available on this CPU",
        k.name()
    );
}

/// A mutable view of the rows `rows` of a strided output `out[t * stride + r]`, `t < n`.
///
/// Views of disjoint row ranges of one buffer can be used from different threads at once.
pub struct OutView<'a> {
    ptr: *mut f32,
    n: usize,
    stride: usize,
    rows: Range<usize>,
    _out: PhantomData<&'a mut [f32]>,
}

// SAFETY: an `OutView` is a `&mut` borrow of the elements `t * stride + r` for `t < n`,
// `r in rows`; views are only created by splitting, so two views never share an element, and
// `f32` is `Send`.
unsafe impl Send for OutView<'_> {}

impl<'a> OutView<'a> {
    /// A view of all of `out` seen as `n` vectors of `rows` outputs, vector `t` at
    /// `out[t * stride..]`. Panics if `stride < rows` (when `n > 1`) or `out` is too short.
    pub fn new(out: &'a mut [f32], n: usize, stride: usize, rows: usize) -> Self {
        assert!(
            n <= 1 || stride >= rows,
            "OutView: stride {stride} < rows {rows}"
        );
        if n > 0 && rows > 0 {
            assert!(
                out.len() >= (n - 1) * stride + rows,
                "OutView: output of {} floats too short for n={n} stride={stride} rows={rows}",
                out.len()
            );
        }
        OutView {
            ptr: out.as_mut_ptr(),
            n,
            stride,
            rows: 0..rows,
            _out: PhantomData,
        }
    }

    pub fn n(&self) -> usize {
        self.n
    }

    pub fn stride(&self) -> usize {
        self.stride
    }

    /// The row range this view may write.
    pub fn rows(&self) -> Range<usize> {
        self.rows.clone()
    }

    /// Splits at absolute row `r` (clamped into the view's range).
    pub fn split_at(self, r: usize) -> (OutView<'a>, OutView<'a>) {
        let r = r.clamp(self.rows.start, self.rows.end);
        let lo = OutView {
            ptr: self.ptr,
            n: self.n,
            stride: self.stride,
            rows: self.rows.start..r,
            _out: PhantomData,
        };
        let hi = OutView {
            rows: r..self.rows.end,
            ..self
        };
        (lo, hi)
    }

    /// Splits into views of `chunk_rows` rows each (the last may be shorter).
    pub fn chunks(self, chunk_rows: usize) -> Vec<OutView<'a>> {
        assert!(chunk_rows > 0);
        let mut v = Vec::new();
        let mut rest = self;
        while rest.rows.len() > chunk_rows {
            let at = rest.rows.start + chunk_rows;
            let (a, b) = rest.split_at(at);
            v.push(a);
            rest = b;
        }
        v.push(rest);
        v
    }

    /// Writes element (t, r) of the view.
    #[inline]
    pub fn set(&mut self, t: usize, r: usize, v: f32) {
        assert!(t < self.n && self.rows.contains(&r));
        // SAFETY: (t, r) is inside the view, which borrows that element of the buffer mutably.
        unsafe { *self.ptr.add(t * self.stride + r) = v }
    }

    /// Element (t, r) of the view, for tests and debugging.
    pub fn get(&self, t: usize, r: usize) -> f32 {
        assert!(t < self.n && self.rows.contains(&r));
        // SAFETY: (t, r) is inside the view, which borrows that element of the buffer.
        unsafe { *self.ptr.add(t * self.stride + r) }
    }
}

fn check_out_len(len: usize, n: usize, stride: usize, rows_end: usize, what: &str) {
    assert!(
        n == 0 || rows_end == 0 || len >= (n - 1) * stride + rows_end,
        "{what}: output of {len} floats too short for n={n} stride={stride} rows up to {rows_end}"
    );
    assert!(
        n <= 1 || stride >= rows_end,
        "{what}: out_stride {stride} < rows end {rows_end}"
    );
}

/// Raw entry point: writes `out[t * out_stride + r]` for `t < x.n()`, `r in rows`.
///
/// # Safety
/// `k` is available; `rows.end <= w.rows`; `x.cols() == w.cols`; every element
/// `out + t * out_stride + r` for `t < x.n()`, `r in rows` is valid for writes and not accessed
/// concurrently by anyone else.
pub unsafe fn q4_matmul_raw(
    k: Kernel,
    w: &Q4Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    if rows.is_empty() || x.n() == 0 {
        return;
    }
    match k {
        // SAFETY: forwarded from this function's contract.
        Kernel::Scalar => unsafe { scalar::q4_rows(w, x, out, out_stride, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract (k available ⇒ AVX2/FMA/F16C).
        Kernel::Avx2 => unsafe { x86_avx2::q4_rows(w, x, out, out_stride, rows) },
        // The AVX-512 kernel reads the linear grid only; table-grid matrices take the AVX2
        // one (the same exact integers per group, so results differ from the AVX-512 kernel's
        // only in the f32 order over groups, as any two kernels do).
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract (Avx512Vnni available ⇒ Avx2
        // available, `Kernel::available`).
        Kernel::Avx512Vnni if w.grid() == Grid::Table => unsafe {
            x86_avx2::q4_rows(w, x, out, out_stride, rows)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract (k available ⇒ AVX-512 F/BW/VL/VNNI).
        Kernel::Avx512Vnni => unsafe { x86_avx512::q4_rows(w, x, out, out_stride, rows) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("kernel {} is not available", k.name()),
    }
}

fn check_q4(k: Kernel, w: &Q4Matrix, x: &Q8Acts, rows: &Range<usize>) {
    check_kernel(k);
    assert_eq!(
        x.cols(),
        w.cols,
        "q4_matmul: activation cols != weight cols"
    );
    assert!(
        rows.start <= rows.end && rows.end <= w.rows,
        "q4_matmul: rows {rows:?} out of 0..{}",
        w.rows
    );
}

/// `out[t * out_stride + r] = dot(row r of w, activation vector t of x)` for `t in 0..x.n()`,
/// `r in rows`. Other elements of `out` are left alone.
pub fn q4_matmul(
    k: Kernel,
    w: &Q4Matrix,
    x: &Q8Acts,
    out: &mut [f32],
    out_stride: usize,
    rows: Range<usize>,
) {
    check_q4(k, w, x, &rows);
    check_out_len(out.len(), x.n(), out_stride, rows.end, "q4_matmul");
    // SAFETY: checked above: kernel available, shapes agree, every written element
    // t * out_stride + r < out.len(), and `out` is borrowed mutably.
    unsafe { q4_matmul_raw(k, w, x, out.as_mut_ptr(), out_stride, rows) }
}

/// Like [`q4_matmul`] but `out` holds the row range only:
/// `out[t * out_stride + (r - rows.start)]`.
pub fn q4_matmul_rows(
    k: Kernel,
    w: &Q4Matrix,
    x: &Q8Acts,
    out: &mut [f32],
    out_stride: usize,
    rows: Range<usize>,
) {
    check_q4(k, w, x, &rows);
    check_out_len(out.len(), x.n(), out_stride, rows.len(), "q4_matmul_rows");
    let base = out.as_mut_ptr().wrapping_sub(rows.start);
    // SAFETY: element (t, r) is written at base + t*out_stride + r = out + t*out_stride +
    // (r - rows.start), which is < out.len() as checked; `out` is borrowed mutably.
    unsafe { q4_matmul_raw(k, w, x, base, out_stride, rows) }
}

/// Computes the rows of `out` (a piece of an [`OutView`]): `out[t * stride + r]`.
pub fn q4_matmul_into(k: Kernel, w: &Q4Matrix, x: &Q8Acts, out: OutView) {
    let rows = out.rows();
    check_q4(k, w, x, &rows);
    assert_eq!(
        out.n,
        x.n(),
        "q4_matmul_into: view has n={} but x has n={}",
        out.n,
        x.n()
    );
    // SAFETY: the view borrows exactly the elements (t, r), t < n, r in rows (checked at
    // creation); kernel and shapes checked above.
    unsafe { q4_matmul_raw(k, w, x, out.ptr, out.stride, rows) }
}

/// All rows of `w`, split across the rayon pool: `out[t * out_stride + r]`.
pub fn q4_matmul_par(k: Kernel, w: &Q4Matrix, x: &Q8Acts, out: &mut [f32], out_stride: usize) {
    let view = OutView::new(out, x.n(), out_stride, w.rows);
    let chunk = par_chunk_rows(w.rows, rayon::current_num_threads());
    use rayon::prelude::*;
    view.chunks(chunk)
        .into_par_iter()
        .for_each(|v| q4_matmul_into(k, w, x, v));
}

fn par_chunk_rows(rows: usize, threads: usize) -> usize {
    // A few chunks per thread for balance, whole 16-row tiles, at least 64 rows.
    let per = rows.div_ceil(threads.max(1) * 4);
    per.next_multiple_of(16).max(64)
}

/// Raw entry point for 8-bit weights ([`Q8Matrix`]): writes `out[t * out_stride + r]` for
/// `t < x.n()`, `r in rows`.
///
/// # Safety
/// As [`q4_matmul_raw`]: `k` is available; `rows.end <= w.rows`; `x.cols() == w.cols`; every
/// element `out + t * out_stride + r` for `t < x.n()`, `r in rows` is valid for writes and not
/// accessed concurrently by anyone else.
pub unsafe fn q8_matmul_raw(
    k: Kernel,
    w: &Q8Matrix,
    x: &Q8Acts,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    if rows.is_empty() || x.n() == 0 {
        return;
    }
    match k {
        // SAFETY: forwarded from this function's contract.
        Kernel::Scalar => unsafe { q8w::q8_rows_scalar(w, x, out, out_stride, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract (k available ⇒ AVX2/FMA/F16C).
        Kernel::Avx2 => unsafe { x86_avx2::q8_rows(w, x, out, out_stride, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract (k available ⇒ AVX-512 F/BW/VL/VNNI).
        Kernel::Avx512Vnni => unsafe { x86_avx512::q8_rows(w, x, out, out_stride, rows) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("kernel {} is not available", k.name()),
    }
}

fn check_q8(k: Kernel, w: &Q8Matrix, x: &Q8Acts, rows: &Range<usize>) {
    check_kernel(k);
    assert_eq!(
        x.cols(),
        w.cols,
        "q8_matmul: activation cols != weight cols"
    );
    assert!(
        rows.start <= rows.end && rows.end <= w.rows,
        "q8_matmul: rows {rows:?} out of 0..{}",
        w.rows
    );
}

/// [`q4_matmul`] for 8-bit weights: `out[t * out_stride + r] = dot(row r of w, vector t of
/// x)` for `t in 0..x.n()`, `r in rows`. Other elements of `out` are left alone.
pub fn q8_matmul(
    k: Kernel,
    w: &Q8Matrix,
    x: &Q8Acts,
    out: &mut [f32],
    out_stride: usize,
    rows: Range<usize>,
) {
    check_q8(k, w, x, &rows);
    check_out_len(out.len(), x.n(), out_stride, rows.end, "q8_matmul");
    // SAFETY: checked above: kernel available, shapes agree, every written element
    // t * out_stride + r < out.len(), and `out` is borrowed mutably.
    unsafe { q8_matmul_raw(k, w, x, out.as_mut_ptr(), out_stride, rows) }
}

/// Computes the rows of `out` (a piece of an [`OutView`]) for 8-bit weights.
pub fn q8_matmul_into(k: Kernel, w: &Q8Matrix, x: &Q8Acts, out: OutView) {
    let rows = out.rows();
    check_q8(k, w, x, &rows);
    assert_eq!(
        out.n,
        x.n(),
        "q8_matmul_into: view has n={} but x has n={}",
        out.n,
        x.n()
    );
    // SAFETY: the view borrows exactly the elements (t, r), t < n, r in rows (checked at
    // creation); kernel and shapes checked above.
    unsafe { q8_matmul_raw(k, w, x, out.ptr, out.stride, rows) }
}

/// Raw entry point for f32 weights: writes `out[t * out_stride + r]`.
///
/// # Safety
/// `k` is available; `w.len() >= rows.end * cols`; `x.len() >= n * cols`; every element
/// `out + t * out_stride + r` for `t < n`, `r in rows` is valid for writes and not accessed
/// concurrently by anyone else.
#[allow(clippy::too_many_arguments)]
pub unsafe fn f32_matmul_raw(
    k: Kernel,
    w: &[f32],
    cols: usize,
    x: &[f32],
    n: usize,
    out: *mut f32,
    out_stride: usize,
    rows: Range<usize>,
) {
    if rows.is_empty() || n == 0 {
        return;
    }
    match k {
        // SAFETY: forwarded from this function's contract.
        Kernel::Scalar => unsafe { scalar::f32_rows(w, cols, x, n, out, out_stride, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract (k available ⇒ AVX2/FMA).
        Kernel::Avx2 => unsafe { x86_avx2::f32_rows(w, cols, x, n, out, out_stride, rows) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: forwarded from this function's contract (k available ⇒ AVX-512F).
        Kernel::Avx512Vnni => unsafe { x86_avx512::f32_rows(w, cols, x, n, out, out_stride, rows) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("kernel {} is not available", k.name()),
    }
}

fn check_f32(k: Kernel, w: &[f32], cols: usize, x: &[f32], n: usize, rows: &Range<usize>) {
    check_kernel(k);
    assert!(rows.start <= rows.end, "f32_matmul: bad rows {rows:?}");
    assert!(
        w.len() >= rows.end * cols,
        "f32_matmul: w has {} floats, rows up to {} x cols {cols} need more",
        w.len(),
        rows.end
    );
    assert!(
        x.len() >= n * cols,
        "f32_matmul: x has {} floats, n={n} x cols {cols} need more",
        x.len()
    );
}

/// Full-precision weights: `w` is `rows x cols` f32 row-major, `x` is `n x cols`;
/// `out[t * out_stride + r] = dot(w[r], x[t])` for `t < n`, `r in rows`.
#[allow(clippy::too_many_arguments)]
pub fn f32_matmul(
    k: Kernel,
    w: &[f32],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
    rows: Range<usize>,
) {
    check_f32(k, w, cols, x, n, &rows);
    check_out_len(out.len(), n, out_stride, rows.end, "f32_matmul");
    // SAFETY: shapes and output length checked above; `out` is borrowed mutably.
    unsafe { f32_matmul_raw(k, w, cols, x, n, out.as_mut_ptr(), out_stride, rows) }
}

/// Like [`f32_matmul`] but `out` holds the row range only:
/// `out[t * out_stride + (r - rows.start)]`.
#[allow(clippy::too_many_arguments)]
pub fn f32_matmul_rows(
    k: Kernel,
    w: &[f32],
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
    rows: Range<usize>,
) {
    check_f32(k, w, cols, x, n, &rows);
    check_out_len(out.len(), n, out_stride, rows.len(), "f32_matmul_rows");
    let base = out.as_mut_ptr().wrapping_sub(rows.start);
    // SAFETY: element (t, r) is written at base + t*out_stride + r = out + t*out_stride +
    // (r - rows.start) < out.len() as checked; `out` is borrowed mutably.
    unsafe { f32_matmul_raw(k, w, cols, x, n, base, out_stride, rows) }
}

/// Computes the rows of `out` (a piece of an [`OutView`]) for f32 weights.
pub fn f32_matmul_into(k: Kernel, w: &[f32], cols: usize, x: &[f32], out: OutView) {
    let rows = out.rows();
    let n = out.n;
    check_f32(k, w, cols, x, n, &rows);
    // SAFETY: the view borrows exactly the elements it lets us write; shapes checked above.
    unsafe { f32_matmul_raw(k, w, cols, x, n, out.ptr, out.stride, rows) }
}

/// All `rows` of `w`, split across the rayon pool: `out[t * out_stride + r]`.
#[allow(clippy::too_many_arguments)]
pub fn f32_matmul_par(
    k: Kernel,
    w: &[f32],
    rows: usize,
    cols: usize,
    x: &[f32],
    n: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    let view = OutView::new(out, n, out_stride, rows);
    let chunk = par_chunk_rows(rows, rayon::current_num_threads());
    use rayon::prelude::*;
    view.chunks(chunk)
        .into_par_iter()
        .for_each(|v| f32_matmul_into(k, w, cols, x, v));
}

#[cfg(test)]
mod tests;
