//! Decode attention alone: one query per head over an f16 history of CTX positions, for
//! LAYERS x HEADS heads of 128 dims (OLMoE-1B-7B: 16 x 16), on one thread, the history on huge
//! pages as the KV cache keeps it; prints the best of 7 rounds and the history's read rate.
//! `cargo run --release --example attn_bench -- [CTX] [LAYERS] [HEADS] [QUERIES]`
//! With QUERIES > 1, each head attends a block of that many consecutive query positions (the
//! last of the CTX; a prompt's block, as prefill computes them), and the rate is in query
//! positions x history positions per second instead.

use std::time::Instant;

use colibri_engine::attention::{attend, AttendArgs, HeadRows};
use colibri_engine::hugebuf::HugeBuf;
use half::f16;
use half::slice::HalfBitsSliceExt;

/// f16 bit patterns, as the KV cache keeps them.
fn history(len: usize, f: impl Fn(usize) -> f32) -> HugeBuf<u16> {
    let mut b = HugeBuf::zeroed(len);
    for (i, v) in b.iter_mut().enumerate() {
        *v = f16::from_f32(f(i)).to_bits();
    }
    b
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (ctx, layers, heads, hd) = (arg(1, 1024), arg(2, 16), arg(3, 16), 128);
    let block = arg(4, 1).clamp(1, ctx);
    let n = layers * heads * ctx * hd;
    let keys = history(n, |i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5);
    let values = history(n, |i| ((i * 104729) % 997) as f32 / 997.0 - 0.5);
    let queries: Vec<Vec<f32>> = (0..block)
        .map(|j| (0..hd).map(|i| (i as f32 * 0.1 + j as f32).sin()).collect())
        .collect();
    let qs: Vec<&[f32]> = queries.iter().map(|q| q.as_slice()).collect();
    let mut out = vec![0.0f32; hd * block];
    let mut best = f64::MAX;
    let mut check = 0.0f32;
    for _ in 0..7 {
        let t = Instant::now();
        for h in 0..layers * heads {
            let r = h * ctx * hd..(h + 1) * ctx * hd;
            let a = AttendArgs {
                keys: HeadRows::F16(keys[r.clone()].reinterpret_cast()),
                values: HeadRows::F16(values[r].reinterpret_cast()),
                n0: ctx + 1 - block,
                share: 1,
                scale: 0.088,
            };
            attend(&qs, &a, &mut out);
            check += out[0];
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    if block > 1 {
        // Query j of the block sees ctx - block + 1 + j positions.
        let pairs =
            (layers * heads * (0..block).map(|j| ctx + 1 - block + j).sum::<usize>()) as f64;
        println!(
            "ctx {ctx}, blocks of {block} queries: {:.2} ms for all heads, {:.1} M \
             query-position pairs/s (checksum {check:.3})",
            best * 1e3,
            pairs / best / 1e6
        );
        return;
    }
    let bytes = (2 * n * 2) as f64;
    println!(
        "ctx {ctx}: {:.2} ms per token, {:.1} GB/s of f16 history (checksum {check:.3})",
        best * 1e3,
        bytes / best / 1e9
    );
}
