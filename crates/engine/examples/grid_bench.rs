//! The int4 kernels on the table grid against the linear grid (issue 33): the same bytes read
//! as either grid (so the same memory traffic), one thread, thread CPU time, the two grids
//! alternated round by round; per round the ratio table / linear, then their median:
//! * decode: one token through 64 MB of 2048-wide rows (past the L3, as a decode step);
//! * prefill: 64 tokens through 1 MB of rows (from cache, as the prefill's blocks).
//!
//!     cargo run --release --example grid_bench -- [ROUNDS]
use std::hint::black_box;

mod common;
use common::{median, thread_cpu_time};

use colibri_engine::quant::{q4_matmul, quantize_q4, Grid, Q4Matrix, Q8Acts};

/// Seconds of thread CPU time `f` takes.
fn timed(f: impl FnOnce()) -> f64 {
    let t = thread_cpu_time();
    f();
    thread_cpu_time() - t
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(9);
    let k = colibri_engine::quant::kernel();
    let cols = 2048;
    let wave = |n: usize, s: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i + s) * 7919) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    };
    let cases = [
        ("decode", 29_000usize, 1usize, 1usize),
        ("prefill", 448, 64, 40),
    ];
    println!("kernel {}, {rounds} rounds", k.name());
    for (what, rows, n, reps) in cases {
        let bytes = quantize_q4(&wave(rows * cols, 1), rows, cols);
        let mut x = Q8Acts::new();
        x.quantize(&wave(n * cols, 2), n, cols);
        let mut out = vec![0.0f32; n * rows];
        let mut run = |grid: Grid| {
            let w = Q4Matrix::on_grid(&bytes, rows, cols, grid).unwrap();
            timed(|| {
                for _ in 0..reps {
                    q4_matmul(k, &w, &x, &mut out, rows, 0..rows);
                    black_box(&out);
                }
            })
        };
        run(Grid::Linear);
        run(Grid::Table);
        let mut ratios = Vec::new();
        let (mut lin, mut tab) = (Vec::new(), Vec::new());
        for r in 0..rounds {
            let (a, b) = if r % 2 == 0 {
                let a = run(Grid::Linear);
                (a, run(Grid::Table))
            } else {
                let b = run(Grid::Table);
                (run(Grid::Linear), b)
            };
            lin.push(a);
            tab.push(b);
            ratios.push(b / a);
        }
        let gb = bytes.len() as f64 * reps as f64 / 1e9;
        let (l, t) = (median(lin), median(tab));
        println!(
            "{what}: {rows} x {cols}, {n} token(s), {reps} pass(es): linear {:.2} ms ({:.1} GB/s), \
             table {:.2} ms ({:.1} GB/s); time ratio table / linear median {:.3} (range {:.3}-{:.3})",
            l * 1e3,
            gb / l,
            t * 1e3,
            gb / t,
            median(ratios.clone()),
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max),
        );
    }
}
