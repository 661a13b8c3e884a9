//! One step's per-head MLA products (DeepSeek-V3's `W_uk^T` 512 x 128 and `W_uv` 128 x 512,
//! int4) for 1, 4 and 32 tokens: the 8-bit-activation kernel against the unrounded one
//! (`quant/exact.rs`), each with its activations' preparation, single thread:
//! `cargo run --release --example exact_bench`.
use std::hint::black_box;
use std::time::Instant;

use colibri_engine::quant::{
    q4_exact_into, q4_matmul_into, quantize_q4, OutView, Q4Matrix, Q8Acts, StoredActs,
};

fn time(iters: usize, mut f: impl FnMut()) -> f64 {
    let t0 = Instant::now();
    for _ in 0..iters {
        f();
    }
    t0.elapsed().as_secs_f64() / iters as f64 * 1e6
}

fn main() {
    let k = colibri_engine::quant::kernel();
    println!("kernel {}", k.name());
    for (rows, cols) in [(512usize, 128usize), (128, 512)] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let q = quantize_q4(&w, rows, cols);
        let m = Q4Matrix::new(&q, rows, cols).unwrap();
        for n in [1usize, 4, 32] {
            let x: Vec<f32> = (0..n * cols).map(|i| (i as f32 * 0.37).sin()).collect();
            let iters = 20000 / n;
            let mut out = vec![0.0f32; n * rows];
            let q8 = time(iters, || {
                let mut a = Q8Acts::new();
                a.quantize(&x, n, cols);
                q4_matmul_into(k, &m, &a, OutView::new(&mut out, n, rows, rows));
                black_box(&out);
            });
            let exact = time(iters, || {
                let s = StoredActs::new(&x, n, cols);
                q4_exact_into(k, &m, &s, OutView::new(&mut out, n, rows, rows));
                black_box(&out);
            });
            let stored = time(iters, || {
                black_box(StoredActs::new(black_box(&x), n, cols));
            });
            println!(
                "{rows}x{cols} n={n}: 8-bit acts {q8:.2} us, exact {exact:.2} us \
                 (of which the stored order {stored:.2} us)"
            );
        }
    }
}
