//! Weight matrices as stored (f32, int4 or 8-bit) and the multi-threaded matmul over them.
//!
//! [`matmul_many`] runs several independent products (e.g. q, k and v; or every routed expert's
//! gate and up) in one parallel region: the rows of all jobs are cut into chunks that the pool's
//! threads take, so a layer costs one fork/join instead of one per matrix. Each output row is
//! computed whole by one thread, so results do not depend on the thread count.

use std::sync::Mutex;

use crate::format::DType;
use crate::pool::Pool;
use crate::quant::{self, Kernel, OutView, Q4Matrix, Q8Acts, Q8Matrix};

/// A weight matrix `[rows, cols]` (a linear layer `y = W x`) inside some byte buffer.
#[derive(Clone, Copy, Debug)]
pub struct Linear {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    /// Byte range in the owning buffer.
    pub offset: usize,
    pub nbytes: usize,
}

/// A borrowed weight matrix, ready to multiply.
#[derive(Clone, Copy)]
pub enum WeightRef<'a> {
    F32(&'a [f32]),
    Q4(Q4Matrix<'a>),
    Q8(Q8Matrix<'a>),
}

impl Linear {
    /// Rows `first..first + rows` as a matrix of their own (rows are stored whole and in
    /// order at every dtype).
    pub fn row_block(&self, first: usize, rows: usize) -> Linear {
        assert!(first + rows <= self.rows, "row block past the matrix");
        let row_bytes = self.nbytes / self.rows;
        Linear {
            rows,
            offset: self.offset + first * row_bytes,
            nbytes: rows * row_bytes,
            ..*self
        }
    }

    pub fn view<'a>(&self, buf: &'a [u8]) -> WeightRef<'a> {
        let bytes = &buf[self.offset..self.offset + self.nbytes];
        match self.dtype {
            DType::F32 => WeightRef::F32(bytemuck::cast_slice(bytes)),
            DType::Q4 => WeightRef::Q4(
                Q4Matrix::new(bytes, self.rows, self.cols).expect("tensor size checked at load"),
            ),
            DType::Q8 => WeightRef::Q8(
                Q8Matrix::new(bytes, self.rows, self.cols).expect("tensor size checked at load"),
            ),
        }
    }
}

impl WeightRef<'_> {
    /// Copies (dequantizes) row `r` into `out` (`cols` values): embedding lookup.
    pub fn row(&self, r: usize, cols: usize, out: &mut [f32]) {
        match self {
            WeightRef::F32(w) => out.copy_from_slice(&w[r * cols..(r + 1) * cols]),
            WeightRef::Q4(m) => m.dequantize_row(r, out),
            WeightRef::Q8(m) => m.dequantize_row(r, out),
        }
    }
}

/// Activations for a product: `n` rows of `cols` f32 values, plus their 8-bit form when an int4
/// or 8-bit weight needs it (quantized once, shared by every job reading the same input).
pub struct Acts {
    pub x: Vec<f32>,
    pub n: usize,
    pub cols: usize,
    q8: Q8Acts,
    q8_ready: bool,
}

impl Acts {
    pub fn new() -> Acts {
        Acts {
            x: Vec::new(),
            n: 0,
            cols: 0,
            q8: Q8Acts::new(),
            q8_ready: false,
        }
    }

    pub fn from_vec(x: Vec<f32>, n: usize, cols: usize) -> Acts {
        let mut a = Acts::new();
        a.set(x, n, cols);
        a
    }

    /// Replaces the contents (`x` is `n x cols`).
    pub fn set(&mut self, x: Vec<f32>, n: usize, cols: usize) {
        assert_eq!(x.len(), n * cols);
        self.x = x;
        self.n = n;
        self.cols = cols;
        self.q8_ready = false;
    }

    /// Rows `rows` of these activations (in that order), as a product input: the 8-bit form
    /// is copied when it is ready (the same bits as quantizing the gathered rows), and the f32
    /// values only when `f32_too` (an f32 weight will read them); otherwise `x` stays empty.
    pub fn gather(&self, rows: &[usize], f32_too: bool) -> Acts {
        let mut a = Acts::new();
        a.n = rows.len();
        a.cols = self.cols;
        if f32_too || !self.q8_ready {
            a.x = Vec::with_capacity(rows.len() * self.cols);
            for &r in rows {
                a.x.extend_from_slice(&self.x[r * self.cols..(r + 1) * self.cols]);
            }
        }
        if self.q8_ready {
            a.q8.gather(&self.q8, rows);
            a.q8_ready = true;
        }
        a
    }

    /// Makes the 8-bit form available when `needs_q8` (some weight reading these activations
    /// is int4 or 8-bit: `DType::takes_q8_acts`).
    pub fn prepare(&mut self, needs_q8: bool) {
        if needs_q8 && !self.q8_ready {
            self.q8.quantize(&self.x, self.n, self.cols);
            self.q8_ready = true;
        }
    }
}

impl Default for Acts {
    fn default() -> Self {
        Self::new()
    }
}

/// One product: `out[t][r] = W[r] . x[t]` for every token `t` of `x` and row `r` of `w`.
pub struct Job<'a> {
    pub w: WeightRef<'a>,
    pub x: &'a Acts,
    /// `x.n * rows` values, token-major.
    pub out: &'a mut [f32],
}

fn rows_of(w: &WeightRef, x: &Acts) -> usize {
    match w {
        WeightRef::F32(d) => d.len() / x.cols,
        WeightRef::Q4(m) => m.rows,
        WeightRef::Q8(m) => m.rows,
    }
}

/// Smallest piece of a product worth giving to a thread.
const MIN_CHUNK_ROWS: usize = 16;

/// Each thread gets one long contiguous run of rows per product (so the hardware prefetcher
/// streams it), unless the product is too small to be worth splitting.
fn chunk_rows(rows: usize, threads: usize) -> usize {
    rows.div_ceil(threads.max(1))
        .next_multiple_of(MIN_CHUNK_ROWS)
        .max(MIN_CHUNK_ROWS)
}

/// A row range of one product, handed to whichever thread claims it.
type WorkItem<'a> = (WeightRef<'a>, &'a Acts, OutView<'a>);

/// Runs every job on `pool`, splitting rows across its threads; outputs are written in place.
pub fn matmul_many(pool: &Pool, k: Kernel, jobs: &mut [Job]) {
    let mut items: Vec<Mutex<Option<WorkItem>>> = Vec::new();
    for job in jobs.iter_mut() {
        let rows = rows_of(&job.w, job.x);
        debug_assert_eq!(job.out.len(), rows * job.x.n);
        let view = OutView::new(job.out, job.x.n, rows, rows);
        for v in view.chunks(chunk_rows(rows, pool.threads())) {
            items.push(Mutex::new(Some((job.w, job.x, v))));
        }
    }
    pool.run(items.len(), |i| {
        // Each index is run once, so the take always finds the item.
        let item = items[i].lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some((w, x, out)) = item else { return };
        matmul_view(k, w, x, out);
    });
}

/// The rows of `out` of one product, on the calling thread.
fn matmul_view(k: Kernel, w: WeightRef, x: &Acts, out: OutView) {
    match w {
        WeightRef::F32(d) => quant::f32_matmul_into(k, d, x.cols, &x.x, out),
        WeightRef::Q4(m) => {
            debug_assert!(x.q8_ready, "Acts::prepare must run before an int4 product");
            quant::q4_matmul_into(k, &m, &x.q8, out)
        }
        WeightRef::Q8(m) => {
            debug_assert!(x.q8_ready, "Acts::prepare must run before an 8-bit product");
            quant::q8_matmul_into(k, &m, &x.q8, out)
        }
    }
}

/// One whole product on the calling thread (`out`: `x.n * rows` values, token-major), for work
/// that is already split across the pool some other way.
pub fn matmul_whole(k: Kernel, w: WeightRef, x: &Acts, out: &mut [f32]) {
    let rows = rows_of(&w, x);
    debug_assert_eq!(out.len(), rows * x.n);
    matmul_view(k, w, x, OutView::new(out, x.n, rows, rows));
}

/// Calls `f(i, chunk_i)` for each `chunk`-sized piece of `data`, spread over `pool`.
pub fn for_each_chunk_mut<F>(pool: &Pool, data: &mut [f32], chunk: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let pieces: Vec<Mutex<&mut [f32]>> = data.chunks_mut(chunk).map(Mutex::new).collect();
    pool.run(pieces.len(), |i| {
        let mut piece = pieces[i].lock().unwrap_or_else(|e| e.into_inner());
        f(i, &mut piece)
    });
}
