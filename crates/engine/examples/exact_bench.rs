//! One token's per-head MLA products (DeepSeek-V3's `W_uk^T` 512 x 128 and `W_uv` 128 x 512,
//! int4): the 8-bit-activation kernel against the unrounded one (`quant/exact.rs`), with the
//! activations' preparation, single thread: `cargo run --release --example exact_bench`.
use std::hint::black_box;
use std::time::Instant;

use colibri_engine::quant::{
    q4_exact_into, q4_matmul_into, quantize_q4, OutView, Q4Matrix, Q8Acts, StoredActs,
};

fn main() {
    let k = colibri_engine::quant::kernel();
    for (rows, cols) in [(512usize, 128usize), (128, 512)] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let q = quantize_q4(&w, rows, cols);
        let m = Q4Matrix::new(&q, rows, cols).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let iters = 20000;
        let mut out = vec![0.0f32; rows];
        let t0 = Instant::now();
        for _ in 0..iters {
            let mut a = Q8Acts::new();
            a.quantize(&x, 1, cols);
            q4_matmul_into(k, &m, &a, OutView::new(&mut out, 1, rows, rows));
            black_box(&out);
        }
        let q8 = t0.elapsed().as_secs_f64() / iters as f64 * 1e6;
        let t0 = Instant::now();
        for _ in 0..iters {
            let s = StoredActs::new(&x, 1, cols);
            q4_exact_into(k, &m, &s, OutView::new(&mut out, 1, rows, rows));
            black_box(&out);
        }
        let ex = t0.elapsed().as_secs_f64() / iters as f64 * 1e6;
        let t0 = Instant::now();
        for _ in 0..iters {
            black_box(StoredActs::new(black_box(&x), 1, cols));
        }
        let st = t0.elapsed().as_secs_f64() / iters as f64 * 1e6;
        let s = StoredActs::new(&x, 1, cols);
        let t0 = Instant::now();
        for _ in 0..iters {
            q4_exact_into(k, &m, &s, OutView::new(&mut out, 1, rows, rows));
            black_box(&out);
        }
        let kern = t0.elapsed().as_secs_f64() / iters as f64 * 1e6;
        println!("  StoredActs::new {st:.2} us, kernel alone {kern:.2} us");
        println!("{rows}x{cols}: q8 acts {q8:.2} us, exact {ex:.2} us");
    }
}
