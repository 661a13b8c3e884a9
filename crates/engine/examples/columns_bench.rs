//! MLA's per-head products by columns as a decode step streams them: 16 layers x 16 heads of
//! `W_uk^T` (512 x 128) and `W_uv` (128 x 512), int4, one token, one thread, each head's copy
//! read once per step (20 MB a step: from memory, as in the model), timed in thread CPU time:
//! `cargo run --release --example columns_bench -- [ROUNDS]`.
use std::hint::black_box;

mod common;
use common::thread_cpu_time;

use colibri_engine::linear::WeightRef;
use colibri_engine::quant::{columns_exact_into, quantize_q4, Columns, Q4Matrix};

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(9);
    let k = colibri_engine::quant::kernel();
    let mut heads = Vec::new();
    for h in 0..16 * 16 {
        for (rows, cols) in [(512usize, 128usize), (128, 512)] {
            let w: Vec<f32> = (0..rows * cols)
                .map(|i| (((i + h) * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let q = quantize_q4(&w, rows, cols);
            let m = Q4Matrix::new(&q, rows, cols).unwrap();
            heads.push(Columns::new(&WeightRef::Q4(m)).unwrap());
        }
    }
    let mb: usize = heads.iter().map(Columns::bytes).sum();
    let x: Vec<f32> = (0..512).map(|i| (i as f32 * 0.37).sin()).collect();
    let mut out = vec![0.0f32; 512];
    let mut ms = Vec::new();
    for _ in 0..rounds {
        let t = thread_cpu_time();
        for c in &heads {
            columns_exact_into(k, c, &x[..c.cols()], 1, &mut out[..c.rows()]);
            black_box(&out);
        }
        ms.push((thread_cpu_time() - t) * 1e3);
    }
    // The same MACs from cache: the first two heads' copies over and over.
    let t = thread_cpu_time();
    for i in 0..heads.len() * rounds {
        let c = &heads[i % 2];
        columns_exact_into(k, c, &x[..c.cols()], 1, &mut out[..c.rows()]);
        black_box(&out);
    }
    let hot = (thread_cpu_time() - t) * 1e3 / rounds as f64;
    println!("from cache: {hot:.3} ms a step");
    ms.sort_by(f64::total_cmp);
    println!(
        "kernel {}, {:.1} MB by columns: {:.3} ms a step (median of {rounds}; min {:.3}), {:.1} GB/s",
        k.name(),
        mb as f64 / 1e6,
        ms[rounds / 2],
        ms[0],
        mb as f64 / ms[rounds / 2] / 1e6
    );
}
