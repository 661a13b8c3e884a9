//! Decode and prefill speed of a converted model, without Python:
//! `cargo run --release --example decode_bench -- MODEL_DIR [THREADS] [TOKENS] [PROMPT_TOKENS]
//! [HISTORY_TOKENS]` (a long prompt, e.g. 2048, measures the prefill attention that grows with
//! its square; a history, the prompt's prefill after that many positions already cached, as a
//! reused prefix).

use std::time::Instant;

use colibri_engine::model::Model;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let dir = args
        .get(1)
        .expect("usage: decode_bench MODEL_DIR [THREADS] [TOKENS] [PROMPT_TOKENS]");
    let threads = args.get(2).and_then(|s| s.parse().ok());
    let tokens: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(32);
    let model = Model::load(std::path::Path::new(dir), threads).expect("load");
    let vocab = model.cfg.vocab_size as u32;
    let prompt_len: u32 = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(64);
    let prompt: Vec<u32> = (0..prompt_len)
        .map(|i| i.wrapping_mul(7919).wrapping_add(13) % vocab)
        .collect();
    let history_len: u32 = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(0);
    let history: Vec<u32> = (0..history_len)
        .map(|i| i.wrapping_mul(104729).wrapping_add(7) % vocab)
        .collect();
    for round in 0..3 {
        let mut kv = model.new_cache();
        if !history.is_empty() {
            model.forward(&history, &mut kv, false).expect("history");
            model.end_turn().expect("end turn");
        }
        let t0 = Instant::now();
        let logits = model.forward(&prompt, &mut kv, false).expect("prefill");
        let prefill = t0.elapsed().as_secs_f64();
        model.end_turn().expect("end turn"); // the next turn profiles decode alone
        let pp = model.last_profile();
        println!(
            "prefill ms: attention {:.1}, experts {:.1}, lm head {:.1}, other {:.1}",
            pp.attention_s * 1e3,
            pp.expert_matmul_s * 1e3,
            pp.lm_head_s * 1e3,
            pp.other_s * 1e3
        );
        let mut tok = colibri_engine::sampler::argmax(&logits) as u32;
        let t1 = Instant::now();
        for _ in 0..tokens {
            let l = model.forward(&[tok], &mut kv, false).expect("decode");
            tok = colibri_engine::sampler::argmax(&l) as u32;
        }
        let decode = t1.elapsed().as_secs_f64();
        model.end_turn().expect("end turn");
        let p = model.last_profile();
        let ms = |s: f64| s * 1e3 / tokens as f64;
        println!(
            "decode ms/token: attention {:.2}, experts {:.2}, lm head {:.2}, other {:.2}",
            ms(p.attention_s),
            ms(p.expert_matmul_s),
            ms(p.lm_head_s),
            ms(p.other_s)
        );
        println!(
            "round {round}: prefill {:.1} tok/s, decode {:.1} tok/s",
            prompt.len() as f64 / prefill,
            tokens as f64 / decode
        );
    }
    // How much of the process sits on transparent huge pages (the weights should).
    if let Ok(s) = std::fs::read_to_string("/proc/self/smaps_rollup") {
        for line in s.lines().filter(|l| l.starts_with("AnonHugePages")) {
            println!("{}", line.split_whitespace().collect::<Vec<_>>().join(" "));
        }
    }
}
