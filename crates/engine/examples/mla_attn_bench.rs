//! MLA decode attention alone, as `decode_heads` calls it: per layer, SHARE heads' absorbed
//! queries (`kv_lora_rank + rope` = 576 wide) attend together over one f16 history of latent
//! rows that are both keys and values (the first 512 values of a row), on one thread; prints
//! the best of 7 rounds per token for LAYERS layers and the MACs per second.
//! `cargo run --release --example mla_attn_bench -- [CTX] [LAYERS] [SHARE]`
//! (DeepSeek-V3's 16 heads on two threads: SHARE 8.)

use std::time::Instant;

use colibri_engine::attention::{attend, AttendArgs, HeadRows};
use colibri_engine::hugebuf::HugeBuf;
use half::f16;
use half::slice::HalfBitsSliceExt;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: usize| args.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let (ctx, layers, share) = (arg(1, 256), arg(2, 16), arg(3, 8));
    let (kd, vd) = (576, 512);
    let mut rows = HugeBuf::<u16>::zeroed(layers * ctx * kd);
    for (i, v) in rows.iter_mut().enumerate() {
        *v = f16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5).to_bits();
    }
    let queries: Vec<Vec<f32>> = (0..share)
        .map(|j| {
            (0..kd)
                .map(|i| (i as f32 * 0.1 + j as f32).sin() * 0.2)
                .collect()
        })
        .collect();
    let qs: Vec<&[f32]> = queries.iter().map(|q| q.as_slice()).collect();
    let mut out = vec![0.0f32; vd * share];
    let mut best = f64::MAX;
    let mut check = 0.0f32;
    for _ in 0..7 {
        let t = Instant::now();
        for l in 0..layers {
            let r = l * ctx * kd..(l + 1) * ctx * kd;
            let h = HeadRows::F16(rows[r].reinterpret_cast());
            let a = AttendArgs {
                keys: h,
                values: h,
                n0: ctx,
                share,
                scale: 0.07,
            };
            attend(&qs, &a, &mut out);
            check += out[0];
        }
        best = best.min(t.elapsed().as_secs_f64());
    }
    let macs = (layers * share * ctx * (kd + vd)) as f64;
    println!(
        "ctx {ctx}, {share} heads x {layers} layers: {:.3} ms per token, {:.2} GMAC/s \
         (checksum {check:.3})",
        best * 1e3,
        macs / best / 1e9
    );
}
