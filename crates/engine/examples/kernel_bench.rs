//! Single-thread throughput of the int4 (and f32) matmul kernels.
//!
//! `cargo run --release --example kernel_bench [-- --quick] [--wall]`
//!
//! * decode (n = 1), hot: one matrix repeatedly (it stays in L2/L3);
//! * decode (n = 1), DRAM: a ring of distinct matrices totalling ~256 MB;
//! * prefill (n = 64): tokens/s-equivalent over one matrix.
//!
//! Times are this thread's CPU time (best of 5 rounds), so other processes sharing the core
//! distort them less than wall time would (they still share the memory bandwidth); `--wall`
//! uses wall time instead.

use std::hint::black_box;
use std::time::{Duration, Instant};

mod common;
use common::{process_cpu_time, thread_cpu_time};

use colibri_engine::quant::{
    f32_matmul, q4_byte_len, q4_matmul, q8_matmul, quantize_q4, quantize_q8, Kernel, Q4Matrix,
    Q8Acts, Q8Matrix,
};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f32(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// Random int4 bytes with sane f16 scales (content does not matter for speed).
fn random_q4(rows: usize, cols: usize, rng: &mut Rng) -> Vec<u8> {
    let len = q4_byte_len(rows, cols);
    let mut b = vec![0u8; len];
    for chunk in b.chunks_mut(8) {
        let v = rng.next().to_le_bytes();
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
    // Each row: its f16 scales, then its nibbles.
    let row = colibri_engine::quant::q4_row_bytes(cols);
    for r in b.chunks_mut(row) {
        for s in r[..row / 9].chunks_mut(2) {
            let h = half::f16::from_f32(0.01 + (rng.next() % 100) as f32 * 1e-4);
            s.copy_from_slice(&h.to_le_bytes());
        }
    }
    b
}

/// Runs `f` until `min` wall time has passed; returns thread-CPU seconds per call (best of 5
/// rounds).
/// (`--wall`: wall time instead.)
fn time(min: Duration, mut f: impl FnMut()) -> f64 {
    let wall = WALL.load(std::sync::atomic::Ordering::Relaxed);
    f();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let start = Instant::now();
        let cpu0 = thread_cpu_time();
        let mut iters = 0u64;
        while start.elapsed() < min / 5 {
            f();
            iters += 1;
        }
        let t = if wall {
            start.elapsed().as_secs_f64()
        } else {
            thread_cpu_time() - cpu0
        };
        best = best.min(t / iters as f64);
    }
    best
}

static WALL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let wall = std::env::args().any(|a| a == "--wall");
    WALL.store(wall, std::sync::atomic::Ordering::Relaxed);
    println!(
        "timing: {} (best of 5 rounds)",
        if wall { "wall time" } else { "thread CPU time" }
    );
    let min = Duration::from_millis(if quick { 300 } else { 1500 });
    let kernels: Vec<Kernel> = Kernel::ALL.into_iter().filter(|k| k.available()).collect();
    println!(
        "kernels available: {:?}; default: {}",
        kernels,
        colibri_engine::quant::kernel().name()
    );
    let mut rng = Rng(0x1234_5678_9abc_def1);
    // Reference: a plain read of 256 MB (what one core streams from DRAM).
    let big: Vec<u64> = (0..(256usize << 20) / 8).map(|i| i as u64).collect();
    let t = time(min, || {
        let mut acc = [0u64; 8];
        for c in big.chunks_exact(8) {
            for i in 0..8 {
                acc[i] = acc[i].wrapping_add(c[i]);
            }
        }
        black_box(acc);
    });
    println!(
        "plain read of 256 MB: {:.2} GB/s",
        (big.len() * 8) as f64 / t / 1e9
    );
    drop(big);
    let shapes = [(2048usize, 1024usize), (1024, 2048)];

    for &(rows, cols) in &shapes {
        let bytes_one = q4_byte_len(rows, cols);
        let set = ((256usize << 20) / bytes_one).max(2);
        let mats: Vec<Vec<u8>> = (0..set).map(|_| random_q4(rows, cols, &mut rng)).collect();
        let x1: Vec<f32> = (0..cols).map(|_| rng.f32()).collect();
        let mut a1 = Q8Acts::new();
        a1.quantize(&x1, 1, cols);
        let n64 = 64;
        let x64: Vec<f32> = (0..n64 * cols).map(|_| rng.f32()).collect();
        let mut a64 = Q8Acts::new();
        a64.quantize(&x64, n64, cols);
        // An expert's share of a 64-token prefill (64 experts, top-8): ~8 tokens.
        let mut a8 = Q8Acts::new();
        a8.quantize(&x64[..8 * cols], 8, cols);
        let mut out = vec![0.0f32; n64 * rows];
        println!(
            "\n== q4 {rows} x {cols} ({:.2} MB per matrix; DRAM set: {set} matrices, {:.0} MB)",
            bytes_one as f64 / 1e6,
            (bytes_one * set) as f64 / 1e6
        );
        for &k in &kernels {
            let w0 = Q4Matrix::new(&mats[0], rows, cols).unwrap();
            let hot = time(min, || {
                q4_matmul(k, &w0, &a1, &mut out, rows, 0..rows);
                black_box(&out);
            });
            let ws: Vec<Q4Matrix> = mats
                .iter()
                .map(|m| Q4Matrix::new(m, rows, cols).unwrap())
                .collect();
            let dram = time(min.max(Duration::from_millis(600)), || {
                for w in &ws {
                    q4_matmul(k, w, &a1, &mut out, rows, 0..rows);
                }
                black_box(&out);
            }) / set as f64;
            let batch = |a: &Q8Acts, out: &mut [f32]| {
                if k == Kernel::Scalar && quick {
                    f64::NAN
                } else {
                    time(min, || {
                        q4_matmul(k, &w0, a, out, rows, 0..rows);
                        black_box(&*out);
                    })
                }
            };
            let pre = batch(&a64, &mut out);
            let pre8 = batch(&a8, &mut out);
            println!(
                "{:>7}: n=1 hot {:6.2} GB/s | n=1 DRAM {:6.2} GB/s | n=64 {:8.0} tok/s ({:6.1} GMAC/s) | n=8 {:6.1} GMAC/s",
                k.name(),
                bytes_one as f64 / hot / 1e9,
                bytes_one as f64 / dram / 1e9,
                n64 as f64 / pre,
                (n64 * rows * cols) as f64 / pre / 1e9,
                (8 * rows * cols) as f64 / pre8 / 1e9
            );
            // Streams decoded together: n tokens over matrices from DRAM, against n = 1.
            let small: Vec<String> = [2usize, 3, 4, 8]
                .iter()
                .map(|&n| {
                    let mut a = Q8Acts::new();
                    a.quantize(&x64[..n * cols], n, cols);
                    let t = time(min.max(Duration::from_millis(600)), || {
                        for w in &ws {
                            q4_matmul(k, w, &a, &mut out, rows, 0..rows);
                        }
                        black_box(&out);
                    }) / set as f64;
                    format!("n={n} {:.2}x", t / dram)
                })
                .collect();
            println!("         DRAM time vs n=1: {}", small.join(", "));
        }
    }

    // 8-bit weights (the attention value and output matrices of a default int4 conversion):
    // prefill rates at 64 tokens and at an expert's share (8).
    let (rows, cols) = (2048, 2048);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.f32() * 0.05).collect();
    let bytes = quantize_q8(&w, rows, cols);
    let w8 = Q8Matrix::new(&bytes, rows, cols).unwrap();
    let x: Vec<f32> = (0..64 * cols).map(|_| rng.f32()).collect();
    let (mut a64, mut a8) = (Q8Acts::new(), Q8Acts::new());
    a64.quantize(&x, 64, cols);
    a8.quantize(&x[..8 * cols], 8, cols);
    let mut out = vec![0.0f32; 64 * rows];
    println!(
        "\n== q8 {rows} x {cols} ({:.2} MB)",
        bytes.len() as f64 / 1e6
    );
    for &k in kernels.iter().filter(|&&k| k != Kernel::Scalar || !quick) {
        let rate = |a: &Q8Acts, out: &mut [f32]| {
            let t = time(min, || {
                q8_matmul(k, &w8, a, out, rows, 0..rows);
                black_box(&*out);
            });
            (a.n() * rows * cols) as f64 / t / 1e9
        };
        let (r64, r8) = (rate(&a64, &mut out), rate(&a8, &mut out));
        println!(
            "{:>7}: n=64 {r64:6.1} GMAC/s | n=8 {r8:6.1} GMAC/s",
            k.name()
        );
    }

    // Quantization speed (the converter's cost).
    let (rows, cols) = (512, 1024);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.f32()).collect();
    let start = Instant::now();
    let cpu0 = process_cpu_time(); // all threads
    let reps = if quick { 2 } else { 5 };
    for _ in 0..reps {
        black_box(quantize_q4(&w, rows, cols));
    }
    let t = start.elapsed().as_secs_f64() / reps as f64;
    let tc = (process_cpu_time() - cpu0) / reps as f64;
    println!(
        "\nquantize_q4: {:.1} M weights/s wall, {:.1} M weights per CPU-second (rayon, {} threads)",
        (rows * cols) as f64 / t / 1e6,
        (rows * cols) as f64 / tc / 1e6,
        rayon::current_num_threads()
    );

    // f32 weights.
    let (rows, cols) = (1024, 1024);
    let w: Vec<f32> = (0..rows * cols).map(|_| rng.f32()).collect();
    let x: Vec<f32> = (0..64 * cols).map(|_| rng.f32()).collect();
    let mut out = vec![0.0f32; 64 * rows];
    println!(
        "\n== f32 {rows} x {cols} ({:.1} MB)",
        (rows * cols * 4) as f64 / 1e6
    );
    for &k in &kernels {
        let t1 = time(min, || {
            f32_matmul(k, &w, cols, &x, 1, &mut out, rows, 0..rows);
            black_box(&out);
        });
        let t64 = time(min, || {
            f32_matmul(k, &w, cols, &x, 64, &mut out, rows, 0..rows);
            black_box(&out);
        });
        println!(
            "{:>7}: n=1 {:6.2} GB/s | n=64 {:6.1} GFLOP/s",
            k.name(),
            (rows * cols * 4) as f64 / t1 / 1e9,
            (2 * 64 * rows * cols) as f64 / t64 / 1e9
        );
    }
}
