//! How close the int4 decode kernel comes to the memory bandwidth when every thread streams:
//! `cargo run --release --example stream_bench -- [THREADS] [ROUNDS] [HIDDEN] [INTER]`
//!
//! Each thread owns ~768 MB of expert records shaped as a MoE layer's (gate and up
//! `INTER x HIDDEN`, down `HIDDEN x INTER`, int4, one 4 KiB-aligned record each, on huge pages
//! as a loaded model's are) and, in alternating rounds, either runs the one-token product over
//! every record (what a decode step's expert region does) or reads the same bytes plainly (the
//! bandwidth probe's loop). Prints each side's median aggregate GB/s and their ratio; the ratio is
//! what the kernel's own arithmetic and access pattern cost, independent of how busy the machine
//! is at that moment. Defaults: 2 threads, 9 rounds each, OLMoE-1B-7B's 2048 x 1024.

use std::hint::black_box;
use std::time::Instant;

use colibri_engine::hugebuf::HugeBuf;
use colibri_engine::quant::{kernel, q4_byte_len, q4_matmul, Q4Matrix, Q8Acts};

mod common;
use common::median;

/// Sum of the buffer as u64s, eight independent sums (the bandwidth probe's loop).
fn plain_read(b: &[u8]) -> u64 {
    let words: &[u64] = bytemuck::cast_slice(&b[..b.len() / 64 * 64]);
    let mut acc = [0u64; 8];
    for c in words.chunks_exact(8) {
        for i in 0..8 {
            acc[i] = acc[i].wrapping_add(c[i]);
        }
    }
    acc.iter().fold(0, |a, &b| a.wrapping_add(b))
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (threads, rounds, h, mi) = (arg(1, 2), arg(2, 9), arg(3, 2048), arg(4, 1024));
    let k = kernel();
    let (gu, dn) = (q4_byte_len(mi, h), q4_byte_len(h, mi));
    let rec = (2 * gu + dn).next_multiple_of(4096);
    let recs = ((768usize << 20) / rec).max(1);
    // Nonzero bytes (a zero page would be read from cache) with sane f16 scales: 0x10 repeated
    // is the scale 2^-11 * 1.0..., the nibbles 0 and 1.
    let bufs: Vec<HugeBuf<u8>> = (0..threads)
        .map(|_| {
            let mut b = HugeBuf::<u8>::zeroed(recs * rec);
            b.fill(0x10);
            b
        })
        .collect();
    let xh: Vec<f32> = (0..h).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
    let xm: Vec<f32> = (0..mi).map(|i| (i % 11) as f32 * 0.1 - 0.5).collect();
    let (mut ah, mut am) = (Q8Acts::new(), Q8Acts::new());
    ah.quantize(&xh, 1, h);
    am.quantize(&xm, 1, mi);
    println!(
        "{threads} threads, kernel {}, {recs} records of {:.2} MB per thread ({}x{} and {}x{} int4)",
        k.name(),
        (2 * gu + dn) as f64 / 1e6,
        mi,
        h,
        h,
        mi
    );
    let (mut kern, mut plain) = (Vec::new(), Vec::new());
    // Round 0 of each side warms up (page tables, frequency) and is not counted.
    for round in 0..=rounds {
        for products in [true, false] {
            let t0 = Instant::now();
            std::thread::scope(|s| {
                for b in &bufs {
                    let (ah, am) = (&ah, &am);
                    s.spawn(move || {
                        if !products {
                            black_box(plain_read(b));
                            return;
                        }
                        let (mut g, mut o) = (vec![0.0f32; mi], vec![0.0f32; h]);
                        for r in b.chunks_exact(rec) {
                            for part in 0..2 {
                                let w = Q4Matrix::new(&r[part * gu..(part + 1) * gu], mi, h)
                                    .expect("record size");
                                q4_matmul(k, &w, ah, &mut g, mi, 0..mi);
                            }
                            let w = Q4Matrix::new(&r[2 * gu..2 * gu + dn], h, mi).expect("size");
                            q4_matmul(k, &w, am, &mut o, h, 0..h);
                        }
                        black_box((&g, &o));
                    });
                }
            });
            let bytes = if products {
                threads * recs * (2 * gu + dn)
            } else {
                threads * recs * rec
            };
            let gbs = bytes as f64 / t0.elapsed().as_secs_f64() / 1e9;
            if round > 0 {
                if products { &mut kern } else { &mut plain }.push(gbs);
            }
        }
    }
    let (km, pm) = (median(kern), median(plain));
    println!("decode kernel: {km:.2} GB/s (median of {rounds})");
    println!("plain read:    {pm:.2} GB/s");
    println!("kernel / plain read: {:.3}", km / pm);
}
