//! What a parallel region costs a bandwidth-bound decode product:
//! `cargo run --release --example region_bench -- [ROWS] [COLS] [ROUNDS] [PER_REGION]`
//!
//! A ring of distinct `ROWS x COLS` int4 matrices (~512 MB, on huge pages, so each pass reads
//! DRAM) is multiplied by one token's activations on a 2-thread [`Pool`] through
//! [`matmul_many`], in alternating rounds: one region per matrix (what a decode step does for
//! the o product), `PER_REGION` matrices per region, and plain threads each streaming its half
//! of every matrix with no region at all. Prints each side's median GB/s and its ratio to the
//! plain threads; the gap of the first is what starting and joining a region per product costs.

use std::hint::black_box;
use std::time::Instant;

use colibri_engine::hugebuf::HugeBuf;
use colibri_engine::linear::{matmul_many, Acts, Job, WeightRef};
use colibri_engine::pool::Pool;
use colibri_engine::quant::{kernel, q4_byte_len, q4_matmul, Q4Matrix, Q8Acts};

mod common;
use common::median;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (rows, cols, rounds, per) = (arg(1, 2048), arg(2, 2048), arg(3, 9), arg(4, 8));
    let threads = 2;
    let k = kernel();
    let mb = q4_byte_len(rows, cols);
    let stride = mb.next_multiple_of(4096);
    let count = ((512usize << 20) / stride).max(per) / per * per;
    let mut buf = HugeBuf::<u8>::zeroed(count * stride);
    buf.fill(0x10);
    let pool = Pool::new(threads).expect("pool");
    let xs: Vec<f32> = (0..cols).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
    let mut acts = Acts::from_vec(xs.clone(), 1, cols);
    acts.prepare(true);
    let mut q8 = Q8Acts::new();
    q8.quantize(&xs, 1, cols);
    let q4 = |i: usize| Q4Matrix::new(&buf[i * stride..i * stride + mb], rows, cols).expect("size");
    let mat = |i: usize| WeightRef::Q4(q4(i));
    println!(
        "{threads} threads, kernel {}, {count} matrices {rows}x{cols} int4 ({:.2} MB each)",
        k.name(),
        mb as f64 / 1e6
    );
    let names = ["region per matrix", "matrices per region", "plain threads"];
    let mut gbs: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let mut out = vec![0.0f32; rows * per];
    for round in 0..=rounds {
        for (side, v) in gbs.iter_mut().enumerate() {
            let t0 = Instant::now();
            match side {
                0 => {
                    for i in 0..count {
                        let mut jobs = [Job {
                            w: mat(i),
                            x: &acts,
                            out: &mut out[..rows],
                        }];
                        matmul_many(&pool, k, &mut jobs);
                    }
                }
                1 => {
                    for g in 0..count / per {
                        let mut jobs: Vec<Job> = out
                            .chunks_exact_mut(rows)
                            .enumerate()
                            .map(|(j, o)| Job {
                                w: mat(g * per + j),
                                x: &acts,
                                out: o,
                            })
                            .collect();
                        matmul_many(&pool, k, &mut jobs);
                    }
                }
                _ => {
                    let half = rows.div_ceil(threads);
                    std::thread::scope(|s| {
                        for t in 0..threads {
                            let (q8, q4) = (&q8, &q4);
                            s.spawn(move || {
                                let mut o = vec![0.0f32; rows];
                                let r = t * half..((t + 1) * half).min(rows);
                                for i in 0..count {
                                    q4_matmul(k, &q4(i), q8, &mut o, rows, r.clone());
                                }
                                black_box(&o);
                            });
                        }
                    });
                }
            }
            black_box(&out);
            let rate = (count * mb) as f64 / t0.elapsed().as_secs_f64() / 1e9;
            if round > 0 {
                v.push(rate);
            }
        }
    }
    let base = median(gbs[2].clone());
    for (name, v) in names.iter().zip(gbs) {
        let m = median(v);
        println!(
            "{name:>20}: {m:6.2} GB/s  x{:.3} of plain threads",
            m / base
        );
    }
}
