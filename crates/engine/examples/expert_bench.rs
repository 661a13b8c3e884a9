//! Tiered-experts measurements without Python (driven by `benchmarks/bench_experts.py`).
//!
//! ```text
//! expert_bench run MODEL_DIR [--threads N] [--prompt N] [--tokens N] [--rounds N]
//!                  [--ram-frac F | --ram-gb G] [--pin-gb G | --pin-frac F] [--direct] [--prefetch]
//!                  [--io auto|uring|pread] [--policy global|layer|freq]
//! expert_bench disk MODEL_DIR [--reads N] [--depth N]   # random-record read bandwidth, O_DIRECT
//! expert_bench policy MODEL_DIR [--tokens N]            # LRU policies on routing traces
//! ```
//! Each prints one JSON object on stdout. `run` without `--ram-*` keeps every expert resident.
//! Round 1 starts with an empty cache (cold); later rounds run the same prompt and decode again
//! on what the cache kept (warm).

use std::path::Path;
use std::time::Instant;

use colibri_engine::model::Model;
use colibri_engine::sampler::argmax;
use colibri_engine::store::policy::{self, Policy, Trace};
use colibri_engine::store::{ExpertOptions, IoBackend};
use serde_json::{json, Value};

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
}

fn flag(args: &[String], name: &str) -> bool {
    args.iter().any(|a| a == name)
}

fn experts_bytes(dir: &Path) -> (u64, u64) {
    let m: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let rs = m["experts"]["record_size"].as_u64().unwrap();
    let len = std::fs::metadata(dir.join(m["experts"]["file"].as_str().unwrap()))
        .unwrap()
        .len();
    (len, rs)
}

fn options(dir: &Path, args: &[String]) -> ExpertOptions {
    let (total, rs) = experts_bytes(dir);
    let mut o = ExpertOptions::default();
    if let Some(f) = arg::<f64>(args, "--ram-frac") {
        let records = (total / rs) as f64;
        o.ram_bytes = Some((records * f).round() as u64 * rs);
    }
    if let Some(g) = arg::<f64>(args, "--ram-gb") {
        o.ram_bytes = Some((g * 1e9) as u64);
    }
    if let Some(g) = arg::<f64>(args, "--pin-gb") {
        o.pin_bytes = (g * 1e9) as u64;
    }
    if let (Some(f), Some(ram)) = (arg::<f64>(args, "--pin-frac"), o.ram_bytes) {
        o.pin_bytes = (ram as f64 * f) as u64;
    }
    o.direct_io = flag(args, "--direct");
    o.prefetch = flag(args, "--prefetch");
    if let Some(s) = arg::<String>(args, "--io") {
        o.io = IoBackend::parse(&s).expect("--io auto|uring|pread");
    }
    if let Some(s) = arg::<String>(args, "--policy") {
        o.policy = match s.as_str() {
            "layer" => Policy::PerLayerLru,
            "freq" => Policy::GlobalLruFreq,
            _ => Policy::GlobalLru,
        };
    }
    o
}

/// Prefill (one turn), then `tokens` decode steps (a second turn). Decode steps are fed a fixed
/// pseudo-random token stream rather than their own greedy output: a random model's greedy
/// output repeats one token, which would route every step to the same experts; varied tokens
/// route near-uniformly (no locality: the hardest case for a cache). Each step is the same work
/// as a real decode step. `--greedy` feeds the argmax back instead.
fn run(dir: &Path, args: &[String]) -> Value {
    let threads = arg(args, "--threads");
    let prompt_len: u32 = arg(args, "--prompt").unwrap_or(64);
    let tokens: usize = arg(args, "--tokens").unwrap_or(32);
    let rounds: usize = arg(args, "--rounds").unwrap_or(2);
    let greedy = flag(args, "--greedy");
    let o = options(dir, args);
    let t = Instant::now();
    let model = Model::load_with(dir, threads, &o).expect("load");
    let load_s = t.elapsed().as_secs_f64();
    let vocab = model.cfg.vocab_size as u32;
    let mut out = Vec::new();
    let mut gen = Vec::new();
    for round in 0..rounds as u32 {
        let prompt: Vec<u32> = (0..prompt_len)
            .map(|i| (i * 7919 + 13 + round * 101) % vocab)
            .collect();
        let mut kv = model.new_cache();
        let logits = model.forward(&prompt, &mut kv, false).expect("prefill");
        model.end_turn().ok();
        let prefill = model.last_profile();
        let mut tok = argmax(&logits) as u32;
        let mut toks = vec![tok];
        let mut x = 0x2545_F491_4F6C_DD1Du64 ^ round as u64;
        for _ in 0..tokens {
            let l = model.forward(&[tok], &mut kv, false).expect("decode");
            tok = if greedy {
                argmax(&l) as u32
            } else {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % vocab as u64) as u32
            };
            toks.push(argmax(&l) as u32);
        }
        model.end_turn().ok();
        let d = model.last_profile();
        let secs = d.prefill_s + d.decode_s;
        let steps = (d.prefill_tokens + d.decode_tokens) as f64;
        gen = toks;
        out.push(json!({
            "prefill_tok_s": prefill.prefill_tok_s,
            "prefill_bytes_read": prefill.bytes_read,
            "decode_tok_s": steps / secs,
            "decode_bytes_per_token": d.bytes_read as f64 / steps,
            "decode_hit_rate": d.cache_hit_rate,
            "decode_io_wait_s": d.io_wait_s,
            "decode_s": secs,
            "prefetch_recall": d.prefetch_recall,
            "prefetch_reads": d.prefetch_reads,
            "prefetch_used": d.prefetch_used,
            "decode_profile": serde_json::to_value(&d).unwrap(),
        }));
    }
    json!({
        "options": serde_json::to_value(&o).unwrap(),
        "load_s": load_s,
        "threads": model.threads(),
        "rounds": out,
        "store": model.store_stats().map(|s| serde_json::to_value(s).unwrap()),
        "tokens": gen,
    })
}

/// Random-record read bandwidth with the store's own read path: O_DIRECT, `depth` records in
/// flight (one layer's worth), through a store whose cache is too small to keep them.
fn disk(dir: &Path, args: &[String]) -> Value {
    let reads: usize = arg(args, "--reads").unwrap_or(256);
    let depth: usize = arg(args, "--depth").unwrap_or(8);
    let (total, rs) = experts_bytes(dir);
    let records = total / rs;
    let io = arg::<String>(args, "--io").unwrap_or_else(|| "auto".into());
    let o = ExpertOptions {
        ram_bytes: Some(rs * depth as u64),
        direct_io: !flag(args, "--buffered"),
        io: IoBackend::parse(&io).unwrap(),
        ..Default::default()
    };
    let model = Model::load_with(dir, Some(1), &o).expect("load");
    let store = model.expert_store().expect("a store");
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let t = Instant::now();
    let mut done = 0;
    while done < reads {
        let recs: Vec<u32> = (0..depth)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % records) as u32
            })
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .collect();
        let mut b = store.request(&recs);
        while !b.next_ready().expect("read").is_empty() {}
        done += recs.len();
    }
    let s = t.elapsed().as_secs_f64();
    let st = store.stats();
    json!({
        "bytes": st.bytes_read, "seconds": s, "gb_s": st.bytes_read as f64 / s / 1e9,
        "depth": depth, "io": st.io, "direct_io": st.direct_io,
    })
}

/// Hit rates of global vs per-layer LRU at several cache sizes, on the model's own decode
/// routing and on a synthetic trace with per-layer skew and token-to-token locality.
fn policies(dir: &Path, args: &[String]) -> Value {
    let tokens: usize = arg(args, "--tokens").unwrap_or(256);
    let model = Model::load(dir, None).expect("load");
    let (layers, experts, k) = (
        model.routing_heat().layers.len(),
        model.cfg.num_experts,
        model.cfg.top_k,
    );
    // The model's decode trace: one turn per token gives that token's routed experts.
    let vocab = model.cfg.vocab_size as u32;
    let mut kv = model.new_cache();
    let prompt: Vec<u32> = (0..16u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut tok = argmax(&model.forward(&prompt, &mut kv, false).unwrap()) as u32;
    model.end_turn().ok();
    let mut own: Trace = Vec::new();
    let mut x = 0x2545_F491_4F6C_DD1Du64;
    for _ in 0..tokens {
        model.forward(&[tok], &mut kv, false).unwrap();
        model.end_turn().ok();
        // The same pseudo-random token stream as `run` (greedy output repeats one token).
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        tok = (x % vocab as u64) as u32;
        own.push(
            model
                .last_routed_experts()
                .into_iter()
                .filter(|r| !r.is_empty())
                .map(|r| r.into_iter().map(|e| e as u16).collect())
                .collect(),
        );
    }
    let synth = policy::synthetic_trace(tokens.max(2000), layers, experts, k, 0.4, 1);
    let mut rows = Vec::new();
    for (name, trace) in [("model", &own), ("synthetic", &synth)] {
        // Pinned + LRU: the hottest experts of the first half pinned (3/4 of the slots), the
        // rest global LRU; hit rates on the second half (as the heat file would be used).
        let (learn, test) = trace.split_at(trace.len() / 2);
        let mut heat = vec![0u64; layers * experts];
        for tok in learn {
            for (l, es) in tok.iter().enumerate() {
                for &e in es {
                    heat[l * experts + e as usize] += 1;
                }
            }
        }
        let mut order: Vec<usize> = (0..heat.len()).collect();
        order.sort_by(|&a, &b| heat[b].cmp(&heat[a]).then(a.cmp(&b)));
        for frac in [0.0625, 0.125, 0.25, 0.5, 0.75] {
            let slots = ((layers * experts) as f64 * frac) as usize;
            let pin_n = slots * 3 / 4;
            let pinned: std::collections::HashSet<usize> =
                order.iter().take(pin_n).copied().collect();
            let total: usize = test.iter().flatten().map(Vec::len).sum();
            let rest: Trace = test
                .iter()
                .map(|tok| {
                    tok.iter()
                        .enumerate()
                        .map(|(l, es)| {
                            es.iter()
                                .copied()
                                .filter(|&e| !pinned.contains(&(l * experts + e as usize)))
                                .collect()
                        })
                        .collect()
                })
                .collect();
            let rest_n: usize = rest.iter().flatten().map(Vec::len).sum();
            let lru = policy::simulate(Policy::GlobalLru, slots - pin_n, layers, &rest);
            let pinned_hit = ((total - rest_n) as f64 + lru * rest_n as f64) / total as f64;
            rows.push(json!({
                "trace": name, "cache_frac": frac,
                "global_lru": policy::simulate(Policy::GlobalLru, slots, layers, trace),
                "per_layer_lru": policy::simulate(Policy::PerLayerLru, slots, layers, trace),
                "global_lru_freq": policy::simulate(Policy::GlobalLruFreq, slots, layers, trace),
                "pinned_global_lru": pinned_hit,
                "global_lru_second_half": policy::simulate(Policy::GlobalLru, slots, layers, &test.to_vec()),
            }));
        }
    }
    json!({ "layers": layers, "experts": experts, "top_k": k, "tokens": tokens, "rows": rows })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let usage = "usage: expert_bench run|disk|policy MODEL_DIR [options]";
    let dir = Path::new(args.get(2).expect(usage));
    let v = match args.get(1).map(String::as_str) {
        Some("run") => run(dir, &args),
        Some("disk") => disk(dir, &args),
        Some("policy") => policies(dir, &args),
        _ => panic!("{usage}"),
    };
    println!("{v}");
}
