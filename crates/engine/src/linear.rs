//! Weight matrices as stored (f32, int4 or 8-bit) and the multi-threaded matmul over them.
//!
//! [`matmul_many`] runs several independent products (e.g. q, k and v; or every routed expert's
//! gate and up) in one parallel region: the rows of all jobs are cut into chunks that the pool's
//! threads take, so a layer costs one fork/join instead of one per matrix. Each output row is
//! computed whole by one thread, so results do not depend on the thread count.

use std::sync::Mutex;

use crate::format::DType;
use crate::pool::Pool;
use crate::quant::{self, Kernel, OutView, Q4Matrix, Q8Acts, Q8Matrix, StoredActs};

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
            DType::Q4 | DType::Q4T => WeightRef::Q4(
                Q4Matrix::on_grid(bytes, self.rows, self.cols, self.dtype.q4_grid().unwrap())
                    .expect("tensor size checked at load"),
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
    /// With [`Acts::exact`]: the values in the int4 / 8-bit weights' stored order, which those
    /// weights multiply unrounded (`quant::q4_exact_into`) instead of by the 8-bit form.
    stored: Option<StoredActs>,
}

impl Acts {
    pub fn new() -> Acts {
        Acts {
            x: Vec::new(),
            n: 0,
            cols: 0,
            q8: Q8Acts::new(),
            q8_ready: false,
            stored: None,
        }
    }

    pub fn from_vec(x: Vec<f32>, n: usize, cols: usize) -> Acts {
        let mut a = Acts::new();
        a.set(x, n, cols);
        a
    }

    /// Activations that every weight multiplies unrounded: int4 and 8-bit weights read them as
    /// f32 ([`crate::quant::StoredActs`]), never as their 8-bit form (`prepare` does nothing).
    /// For products whose results must agree with the same arithmetic done in another order
    /// (MLA's absorbed and expanded forms).
    pub fn exact(x: Vec<f32>, n: usize, cols: usize) -> Acts {
        let mut a = Acts::from_vec(x, n, cols);
        a.stored = Some(StoredActs::new(&a.x, n, cols));
        a
    }

    /// Replaces the contents (`x` is `n x cols`).
    pub fn set(&mut self, x: Vec<f32>, n: usize, cols: usize) {
        assert_eq!(x.len(), n * cols);
        self.x = x;
        self.n = n;
        self.cols = cols;
        self.q8_ready = false;
        self.stored = None;
    }

    /// Rows `rows` of these activations (in that order), as a product input: the 8-bit form
    /// is copied when it is ready (the same bits as quantizing the gathered rows), and the f32
    /// values only when `f32_too` (an f32 weight will read them); otherwise `x` stays empty.
    pub fn gather(&self, rows: &[usize], f32_too: bool) -> Acts {
        let mut a = Acts::new();
        a.n = rows.len();
        a.cols = self.cols;
        if self.stored.is_some() {
            let x = rows
                .iter()
                .flat_map(|&r| &self.x[r * self.cols..(r + 1) * self.cols]);
            return Acts::exact(x.copied().collect(), rows.len(), self.cols);
        }
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
        if needs_q8 && !self.q8_ready && self.stored.is_none() {
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

/// A row range of one product.
type WorkItem<'a> = (WeightRef<'a>, &'a Acts, OutView<'a>);

/// Bytes of one row of `w`.
fn row_bytes(w: &WeightRef, x: &Acts) -> usize {
    match w {
        WeightRef::F32(_) => x.cols * 4,
        WeightRef::Q4(m) => m.row_stride(),
        WeightRef::Q8(m) => m.row_stride(),
    }
}

/// A product whose weights are smaller than this is not cut into a chunk per thread: such
/// products (MLA's per-head blocks, 16-128 of ~36 KiB a layer) are strung together instead,
/// consecutive ones in one thread's run, so each thread streams one long stretch of memory.
/// Measured on the DeepSeek-V3 shape's 16 per-head blocks: cut per product they took 2-2.7x
/// the time of the same bytes as one product.
const SMALL_PRODUCT_BYTES: usize = 64 << 10;

/// Runs every job on `pool`, splitting rows across its threads; outputs are written in place.
/// Each thread claims work items; an item is one or more row ranges computed in order.
pub fn matmul_many(pool: &Pool, k: Kernel, jobs: &mut [Job]) {
    let threads = pool.threads();
    let mut items: Vec<Mutex<Vec<WorkItem>>> = Vec::new();
    // Small products, each with the cost of one of its rows (bytes x tokens).
    let mut small: Vec<(WorkItem, usize)> = Vec::new();
    for job in jobs.iter_mut() {
        let rows = rows_of(&job.w, job.x);
        debug_assert_eq!(job.out.len(), rows * job.x.n);
        let view = OutView::new(job.out, job.x.n, rows, rows);
        let bytes_per_row = row_bytes(&job.w, job.x);
        if rows * bytes_per_row < SMALL_PRODUCT_BYTES {
            small.push(((job.w, job.x, view), bytes_per_row * job.x.n.max(1)));
            continue;
        }
        for v in view.chunks(chunk_rows(rows, threads)) {
            items.push(Mutex::new(vec![(job.w, job.x, v)]));
        }
    }
    items.extend(string_together(small, threads).into_iter().map(Mutex::new));
    pool.run(items.len(), |i| {
        // Each index is run once, so the take always finds the item's ranges.
        let item = std::mem::take(&mut *items[i].lock().unwrap_or_else(|e| e.into_inner()));
        for (w, x, out) in item {
            matmul_view(k, w, x, out);
        }
    });
}

/// Small products, in order, cut into `threads` runs of about equal cost (row bytes x tokens),
/// each cut at a multiple of [`MIN_CHUNK_ROWS`] rows.
fn string_together(small: Vec<(WorkItem, usize)>, threads: usize) -> Vec<Vec<WorkItem>> {
    let total: usize = small
        .iter()
        .map(|((_, _, v), row_cost)| v.rows().len() * row_cost)
        .sum();
    let per_run = total.div_ceil(threads.max(1)).max(1);
    let mut runs: Vec<Vec<WorkItem>> = Vec::new();
    let mut run: Vec<WorkItem> = Vec::new();
    let mut cost = 0;
    for ((w, x, mut view), row_cost) in small {
        while !view.rows().is_empty() {
            let want = (per_run.saturating_sub(cost)).div_ceil(row_cost.max(1));
            let take = want.next_multiple_of(MIN_CHUNK_ROWS).min(view.rows().len());
            let at = view.rows().start + take;
            let (part, rest) = view.split_at(at);
            run.push((w, x, part));
            cost += take * row_cost;
            view = rest;
            if cost >= per_run {
                runs.push(std::mem::take(&mut run));
                cost = 0;
            }
        }
    }
    if !run.is_empty() {
        runs.push(run);
    }
    runs
}

/// The rows of `out` of one product, on the calling thread.
fn matmul_view(k: Kernel, w: WeightRef, x: &Acts, out: OutView) {
    match w {
        WeightRef::F32(d) => quant::f32_matmul_into(k, d, x.cols, &x.x, out),
        WeightRef::Q4(m) => match &x.stored {
            Some(stored) => quant::q4_exact_into(k, &m, stored, out),
            None => {
                debug_assert!(x.q8_ready, "Acts::prepare must run before an int4 product");
                quant::q4_matmul_into(k, &m, &x.q8, out)
            }
        },
        WeightRef::Q8(m) => match &x.stored {
            Some(stored) => quant::q8_exact_into(k, &m, stored, out),
            None => {
                debug_assert!(x.q8_ready, "Acts::prepare must run before an 8-bit product");
                quant::q8_matmul_into(k, &m, &x.q8, out)
            }
        },
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{quantize_q4, quantize_q8};

    fn wave(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 + seed * 104_729) % 2003) as f32 / 1001.0 - 1.0)
            .collect()
    }

    /// Products of every size (small ones strung together into a thread's run, large ones cut
    /// per thread) give each output exactly what the product computed alone on one thread
    /// gives, whatever the thread count, for one token and for several.
    #[test]
    fn many_products_equal_each_alone() {
        let kernel = crate::quant::kernel();
        // (rows, cols, dtype): per-head blocks (small), an odd small one, and large ones.
        let shapes: &[(usize, usize, DType)] = &[
            (64, 128, DType::Q4),
            (64, 128, DType::Q4),
            (48, 128, DType::Q4),
            (17, 96, DType::Q4),
            (40, 512, DType::Q8),
            (9, 64, DType::F32),
            (1200, 256, DType::Q4),
            (300, 512, DType::Q8),
        ];
        let weights: Vec<Vec<u8>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(rows, cols, dt))| {
                let w = wave(rows * cols, i);
                match dt {
                    DType::Q4 => quantize_q4(&w, rows, cols),
                    DType::Q8 => quantize_q8(&w, rows, cols),
                    _ => w.iter().flat_map(|v| v.to_le_bytes()).collect(),
                }
            })
            .collect();
        let f32s: Vec<Vec<f32>> = weights
            .iter()
            .map(|b| {
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect()
            })
            .collect();
        let view = |i: usize| -> WeightRef {
            let (rows, cols, dt) = shapes[i];
            match dt {
                DType::Q4 => WeightRef::Q4(Q4Matrix::new(&weights[i], rows, cols).unwrap()),
                DType::Q8 => WeightRef::Q8(Q8Matrix::new(&weights[i], rows, cols).unwrap()),
                _ => WeightRef::F32(&f32s[i]),
            }
        };
        for n in [1usize, 3] {
            let mut xs: Vec<Acts> = shapes
                .iter()
                .enumerate()
                .map(|(i, &(_, cols, _))| Acts::from_vec(wave(n * cols, 50 + i), n, cols))
                .collect();
            for x in &mut xs {
                x.prepare(true);
            }
            let alone: Vec<Vec<f32>> = (0..shapes.len())
                .map(|i| {
                    let mut out = vec![0.0; n * shapes[i].0];
                    matmul_whole(kernel, view(i), &xs[i], &mut out);
                    out
                })
                .collect();
            for threads in [1, 2, 3] {
                let pool = Pool::new(threads).unwrap();
                let mut outs: Vec<Vec<f32>> =
                    shapes.iter().map(|s| vec![f32::NAN; n * s.0]).collect();
                let mut jobs: Vec<Job> = outs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, out)| Job {
                        w: view(i),
                        x: &xs[i],
                        out,
                    })
                    .collect();
                matmul_many(&pool, kernel, &mut jobs);
                for (i, (got, want)) in outs.iter().zip(&alone).enumerate() {
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(got),
                        bits(want),
                        "product {i}, n {n}, {threads} threads"
                    );
                }
            }
        }
    }
}
