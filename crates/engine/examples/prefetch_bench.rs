//! Prefill and decode speed of a converted model under each software-prefetch level, the levels
//! alternating in one process so that the machine's drift hits each alike:
//! `cargo run --release --example prefetch_bench -- MODEL_DIR [ROUNDS] [THREADS] [LEVELS] [TURN]`
//! (LEVELS: comma-separated of l1, l2, off; default all three). Prints each level's median
//! decode and prefill tok/s and its per-round ratio to the first level's.
//!
//! Each round prefills once per level, then decodes one sequence whose tokens take the levels
//! in turns of TURN tokens (default 1: token `j` under level `j % levels`), each level timed
//! over its own tokens: the levels then see the same host state to within a token (~20 ms),
//! where one process per level lands in the VM's states unevenly. A level can still leave the
//! caches in a state the next token inherits; a TURN of 32 (one turn per level per round)
//! shows whether that matters: when the two disagree, neither is the answer.

use std::time::Instant;

use colibri_engine::model::Model;
use colibri_engine::quant::prefetch::{prefetch_level, set_prefetch_level, PrefetchLevel};

mod common;
use common::median;

const PROMPT: u32 = 64;
const DECODE: usize = 32;

/// The prompt of every run.
fn prompt(model: &Model) -> Vec<u32> {
    let vocab = model.cfg.vocab_size as u32;
    (0..PROMPT)
        .map(|i| i.wrapping_mul(7919).wrapping_add(13) % vocab)
        .collect()
}

/// Prefill tok/s of the PROMPT-token prompt.
fn prefill(model: &Model) -> f64 {
    let mut kv = model.new_cache();
    let t0 = Instant::now();
    model
        .forward(&prompt(model), &mut kv, false)
        .expect("prefill");
    PROMPT as f64 / t0.elapsed().as_secs_f64()
}

/// Decode tok/s of each level over DECODE tokens of its own, the levels taking turns of `turn`
/// tokens in one sequence after the prompt.
fn decode_interleaved(model: &Model, levels: &[PrefetchLevel], turn: usize) -> Vec<f64> {
    let mut kv = model.new_cache();
    let logits = model
        .forward(&prompt(model), &mut kv, false)
        .expect("prefill");
    let mut tok = colibri_engine::sampler::argmax(&logits) as u32;
    let mut secs = vec![0.0f64; levels.len()];
    for j in 0..DECODE.div_ceil(turn) * turn * levels.len() {
        let i = j / turn % levels.len();
        set_prefetch_level(levels[i]);
        let t = Instant::now();
        let l = model.forward(&[tok], &mut kv, false).expect("decode");
        secs[i] += t.elapsed().as_secs_f64();
        tok = colibri_engine::sampler::argmax(&l) as u32;
    }
    let each = DECODE.div_ceil(turn) * turn;
    secs.iter().map(|s| each as f64 / s).collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .expect("usage: prefetch_bench MODEL_DIR [ROUNDS] [THREADS] [LEVELS] [TURN]");
    let rounds: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(7);
    let threads = args.get(3).and_then(|s| s.parse().ok());
    let levels: Vec<PrefetchLevel> = match args.get(4) {
        Some(s) => s
            .split(',')
            .map(|l| PrefetchLevel::parse(l).expect("levels: l1, l2, off"))
            .collect(),
        None => PrefetchLevel::ALL.to_vec(),
    };
    let turn: usize = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(1).max(1);
    let default = prefetch_level();
    let model = Model::load(std::path::Path::new(dir), threads).expect("load");
    println!(
        "{} threads, kernel {}, default level {}, {rounds} rounds of a {PROMPT}-token prefill \
         per level + {DECODE} decoded tokens per level (in turns of {turn})",
        model.threads(),
        model.kernel().name(),
        default.name()
    );
    let mut got: Vec<Vec<(f64, f64)>> = vec![Vec::new(); levels.len()];
    // Round 0 warms up (page tables, clocks) and is not counted.
    for round in 0..=rounds {
        let pre: Vec<f64> = levels
            .iter()
            .map(|&level| {
                set_prefetch_level(level);
                prefill(&model)
            })
            .collect();
        let dec = decode_interleaved(&model, &levels, turn);
        if round > 0 {
            for (i, r) in pre.into_iter().zip(dec).enumerate() {
                got[i].push(r);
            }
        }
    }
    for (i, level) in levels.iter().enumerate() {
        let (pre, dec): (Vec<f64>, Vec<f64>) = got[i].iter().copied().unzip();
        // This level's figure over the first level's, same round: median (min-max).
        let ratio = |of: fn(&(f64, f64)) -> f64| {
            let r: Vec<f64> = got[i]
                .iter()
                .zip(&got[0])
                .map(|(a, b)| of(a) / of(b))
                .collect();
            let (lo, hi) = r
                .iter()
                .fold((f64::MAX, 0.0f64), |(lo, hi), &x| (lo.min(x), hi.max(x)));
            format!("x{:.3} ({lo:.3}-{hi:.3})", median(r))
        };
        println!(
            "{:>3}: decode {:6.2} tok/s ({:.2}-{:.2}), {} per round vs {}; \
             prefill {:6.1} tok/s, {}",
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
