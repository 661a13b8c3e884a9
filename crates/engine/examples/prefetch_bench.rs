//! Prefill and decode speed of a converted model under each software-prefetch level, the levels
//! alternating in one process so that the machine's drift hits each alike:
//! `cargo run --release --example prefetch_bench -- MODEL_DIR [ROUNDS] [THREADS] [LEVELS]`
//! (LEVELS: comma-separated of l1, l2, off; default all three). Prints each level's median
//! decode and prefill tok/s and its per-round ratio to the first level's.

use std::time::Instant;

use colibri_engine::model::Model;
use colibri_engine::quant::prefetch::{prefetch_level, set_prefetch_level, PrefetchLevel};

const PROMPT: u32 = 64;
const DECODE: usize = 32;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// (prefill tok/s of a PROMPT-token prompt, decode tok/s of DECODE tokens after it).
fn run(model: &Model) -> (f64, f64) {
    let vocab = model.cfg.vocab_size as u32;
    let prompt: Vec<u32> = (0..PROMPT)
        .map(|i| i.wrapping_mul(7919).wrapping_add(13) % vocab)
        .collect();
    let mut kv = model.new_cache();
    let t0 = Instant::now();
    let logits = model.forward(&prompt, &mut kv, false).expect("prefill");
    let prefill = PROMPT as f64 / t0.elapsed().as_secs_f64();
    let mut tok = colibri_engine::sampler::argmax(&logits) as u32;
    let t1 = Instant::now();
    for _ in 0..DECODE {
        let l = model.forward(&[tok], &mut kv, false).expect("decode");
        tok = colibri_engine::sampler::argmax(&l) as u32;
    }
    (prefill, DECODE as f64 / t1.elapsed().as_secs_f64())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .expect("usage: prefetch_bench MODEL_DIR [ROUNDS] [THREADS] [LEVELS]");
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(7);
    let threads = args.get(3).and_then(|s| s.parse().ok());
    let levels: Vec<PrefetchLevel> = match args.get(4) {
        Some(s) => s
            .split(',')
            .map(|l| PrefetchLevel::parse(l).expect("levels: l1, l2, off"))
            .collect(),
        None => PrefetchLevel::ALL.to_vec(),
    };
    let default = prefetch_level();
    let model = Model::load(std::path::Path::new(dir), threads).expect("load");
    println!(
        "{} threads, kernel {}, default level {}, {rounds} rounds of {PROMPT}-token prefill + \
         {DECODE} decoded tokens per level",
        model.threads(),
        model.kernel().name(),
        default.name()
    );
    let mut got: Vec<Vec<(f64, f64)>> = vec![Vec::new(); levels.len()];
    // Round 0 warms up (page tables, clocks) and is not counted.
    for round in 0..=rounds {
        for (i, &level) in levels.iter().enumerate() {
            set_prefetch_level(level);
            let r = run(&model);
            if round > 0 {
                got[i].push(r);
            }
        }
    }
    for (i, level) in levels.iter().enumerate() {
        let (pre, dec): (Vec<f64>, Vec<f64>) = got[i].iter().copied().unzip();
        // Median over the rounds of this level's figure over the first level's, same round.
        let ratio = |of: fn(&(f64, f64)) -> f64| {
            median(
                got[i]
                    .iter()
                    .zip(&got[0])
                    .map(|(a, b)| of(a) / of(b))
                    .collect(),
            )
        };
        println!(
            "{:>3}: decode {:6.2} tok/s ({:.2}-{:.2}), x{:.3} per round vs {}; \
             prefill {:6.1} tok/s, x{:.3}",
            level.name(),
            median(dec.clone()),
            dec.iter().copied().fold(f64::MAX, f64::min),
            dec.iter().copied().fold(0.0, f64::max),
            ratio(|r| r.1),
            levels[0].name(),
            median(pre),
            ratio(|r| r.0)
        );
    }
}
