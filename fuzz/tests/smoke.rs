//! Stable-toolchain smoke tests: every fuzz harness over its seeds plus a few hundred
//! deterministic random mutations of them (no libFuzzer needed). A panic here is a bug in the
//! engine, exactly as a fuzzer crash would be.
//!
//! `cargo test --release --manifest-path fuzz/Cargo.toml` (`COLIBRI_FUZZ_ITERS` to change the count).

use std::path::Path;

use colibri_fuzz::*;
use safetensors::Dtype;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545F4914F6CDD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// A libFuzzer-like mutation: flip/set bytes, insert/delete runs, splice in interesting values.
fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut b = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let at = rng.below(b.len() + 1);
        let last = at.min(b.len().saturating_sub(1));
        match rng.below(7) {
            0 if !b.is_empty() => b[last] ^= 1 << rng.below(8),
            1 if !b.is_empty() => b[last] = rng.next() as u8,
            2 => b.truncate(at),
            3 => {
                let n = rng.below(16);
                let ins: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                b.splice(at..at, ins);
            }
            4 if at < b.len() => {
                let end = (at + rng.below(32)).min(b.len());
                b.drain(at..end);
            }
            5 => {
                let v: &[u8] = [
                    &b"18446744073709551615"[..],
                    b"-1",
                    b"0",
                    b"4294967297",
                    b"1e308",
                    b"null",
                    b"[]",
                ][rng.below(7)];
                b.splice(at..at, v.iter().copied());
            }
            _ if at + 8 <= b.len() => b[at..at + 8].copy_from_slice(&u64::MAX.to_le_bytes()),
            _ => {}
        }
    }
    b
}

fn seeds(target: &str) -> Vec<Vec<u8>> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(target);
    let mut out: Vec<Vec<u8>> = std::fs::read_dir(&dir)
        .map(|d| {
            d.flatten()
                .map(|e| std::fs::read(e.path()).unwrap())
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out
}

fn iters(default: usize) -> usize {
    std::env::var("COLIBRI_FUZZ_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn run(target: &str, base: Vec<Vec<u8>>, n: usize, f: fn(&[u8])) {
    assert!(!base.is_empty(), "no seeds for {target}");
    for s in &base {
        f(s);
    }
    let mut rng = Rng(0x9E3779B97F4A7C15 ^ target.len() as u64);
    for i in 0..n {
        let seed = &base[i % base.len()];
        let input = mutate(&mut rng, seed);
        f(&input);
    }
    cleanup_thread_scratch();
}

#[test]
fn config_json_survives_mutations() {
    let mut base = seeds("config_json");
    base.extend(CONFIGS.iter().map(|c| c.as_bytes().to_vec()));
    // Structured edits: random ops on each tiny config.
    let mut rng = Rng(7);
    for i in 0..60u8 {
        let mut b = vec![i % ARCHS as u8 + 1];
        b.extend((0..11 * (1 + rng.below(4))).map(|_| rng.next() as u8));
        base.push(b);
    }
    run("config_json", base, iters(3000), config_json);
}

#[test]
fn tiktoken_survives_mutations() {
    let base = seeds("tiktoken");
    run("tiktoken", base, iters(3000), tiktoken);
}

#[test]
fn checkpoint_survives_mutations() {
    let mut base = seeds("checkpoint");
    for arch in 0..ARCHS as u8 {
        let mut b = vec![arch, 0];
        b.extend(tiny_checkpoint(arch as usize, Dtype::BF16, arch == 1));
        base.push(b);
    }
    // Config edits in front of valid checkpoints (transformers 5's fused experts: the first
    // three families).
    let mut rng = Rng(13);
    for i in 0..(20 * ARCHS) as u8 {
        let k = 1 + rng.below(3);
        let arch = i % ARCHS as u8;
        let mut b = vec![arch, 16 | (i & 4), k as u8];
        b.extend((0..11 * k).map(|_| rng.next() as u8));
        b.extend(tiny_checkpoint(
            arch as usize,
            Dtype::F16,
            arch < 3 && i % 2 == 0,
        ));
        base.push(b);
    }
    run("checkpoint", base, iters(300), checkpoint);
}

#[test]
fn model_dir_survives_mutations() {
    let mut base = seeds("model_dir");
    for (i, m) in base_models().iter().enumerate() {
        let mut b = vec![i as u8, 0];
        b.extend(&m.files[0].1);
        base.push(b);
    }
    let mut rng = Rng(11);
    for i in 0..15 * MODEL_KINDS * ARCHS {
        let mut b = vec![(i % (MODEL_KINDS * ARCHS)) as u8, 4];
        b.extend((0..11 * (1 + rng.below(3))).map(|_| rng.next() as u8));
        base.push(b);
    }
    run("model_dir", base, iters(400), model_dir);
}

#[test]
fn tiny_models_convert_load_and_run() {
    for arch in 0..ARCHS as u8 {
        for sel in [0, 4] {
            let mut b = vec![arch, sel];
            b.extend(tiny_checkpoint(arch as usize, Dtype::F32, false));
            checkpoint(&b); // asserts that the converted model loads and runs
        }
    }
    for m in 0..(MODEL_KINDS * ARCHS) as u8 {
        model_dir(&[m, 1]); // unmodified files
    }
    // Each quantized form of each tiny checkpoint converts (and then loads and runs).
    for arch in 0..ARCHS {
        for (bit, name, form, config) in QUANTIZED_FORMS {
            let dir = scratch(name);
            let tensors = serialize(&form(tiny_tensors(arch, Dtype::F32, false)));
            write_checkpoint(&dir, arch, &[&tensors]);
            let mut v: serde_json::Value =
                serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                    .unwrap();
            v["quantization_config"] = serde_json::from_str(config).unwrap();
            std::fs::write(dir.join("config.json"), v.to_string()).unwrap();
            colibri_engine::convert::convert(
                &dir,
                &dir.join("out"),
                colibri_engine::format::Quant::Int4,
                &mut |_, _, _| {},
            )
            .unwrap_or_else(|e| panic!("arch {arch}, {name}: {e}"));
            std::fs::remove_dir_all(&dir).unwrap();
            let mut b = vec![arch as u8, bit];
            b.extend(&tensors);
            checkpoint(&b);
        }
    }
    cleanup_thread_scratch();
}

// KV slot files (`colibri_engine::slotfile`): the harness is the library's `slot_file`.

/// Valid slot files written through `SlotFile` (name, [mode] + bytes): the seeds.
fn slot_file_bases() -> Vec<(String, Vec<u8>)> {
    use colibri_engine::slotfile::SlotFile;
    let dir = scratch("slot");
    let path = dir.join("slot.kv");
    let mut out = vec![("empty".to_string(), vec![0u8])];
    let snap = |out: &mut Vec<(String, Vec<u8>)>, name: &str, mode: u8| {
        let mut b = vec![mode];
        b.extend(std::fs::read(&path).unwrap());
        out.push((name.to_string(), b));
    };
    let (mut sf, _) = SlotFile::open(&path, SLOT_FP, SLOT_LAYERS, SLOT_KV_DIM).unwrap();
    snap(&mut out, "fresh", 0);
    let mut rng = Rng(31);
    let mut tokens: Vec<u32> = Vec::new();
    let mut keys = vec![Vec::new(); SLOT_LAYERS];
    let mut values = vec![Vec::new(); SLOT_LAYERS];
    let specials = [f32::NAN, -0.0, f32::INFINITY, f32::from_bits(1), 1.5];
    let mut commit = |sf: &mut SlotFile, start: usize, n: usize| {
        tokens.truncate(start);
        tokens.extend((0..n).map(|_| rng.below(50_000) as u32));
        for v in keys.iter_mut().chain(values.iter_mut()) {
            v.truncate(start * SLOT_KV_DIM);
            v.extend((0..n * SLOT_KV_DIM).map(|_| specials[rng.below(specials.len())]));
        }
        sf.commit(start, &tokens[start..], &keys, &values).unwrap();
        sf.sync(&tokens, &keys, &values).unwrap();
    };
    commit(&mut sf, 0, 4);
    snap(&mut out, "one-record", 0);
    commit(&mut sf, 4, 1);
    commit(&mut sf, 5, 1);
    commit(&mut sf, 2, 3); // a truncation, then new positions
    snap(&mut out, "log", 0);
    snap(&mut out, "log-resealed", 1);
    commit(&mut sf, 1, 0); // truncation only
    snap(&mut out, "truncated", 0);
    drop(sf);
    // A version-2 file (and a version-3 one, its second layer a row per 2 positions):
    // positions, a state record at each sync, a truncation, more positions.
    for (mode, prefix) in [(2u8, "state"), (4, "rows"), (8, "mla"), (12, "mla-rows")] {
        use colibri_engine::kv::{KvCache, KvDtype};
        let _ = std::fs::remove_file(&path);
        let layout = slot_layout(mode);
        let (mut sf, _) =
            SlotFile::open_layout_states(&path, SLOT_FP, &layout, &SLOT_STATES).unwrap();
        let cache = |n: usize, seed: f32| {
            let mut kv = KvCache::new(&layout, KvDtype::F32).with_states(&SLOT_STATES);
            kv.reserve(n);
            for (li, layer) in layout.layers.iter().enumerate() {
                let rows = layer.rows(n) * layer.heads;
                let run = |width: usize| -> Vec<f32> {
                    (0..rows * width).map(|i| seed + i as f32).collect()
                };
                kv.write(li, 0, &run(layer.key_dim), &run(layer.value_dim));
            }
            kv.len = n;
            kv.state_mut(0).fill(seed);
            kv
        };
        let tokens: Vec<u32> = (0..8).collect();
        let kv = cache(5, 1.0);
        sf.commit_kv(0, &tokens[..5], &kv).unwrap();
        sf.sync_kv(&tokens[..5], &kv).unwrap();
        snap(&mut out, &format!("{prefix}-one"), mode);
        let kv = cache(8, 2.0);
        sf.commit_kv(3, &tokens[3..8], &kv).unwrap();
        snap(&mut out, &format!("{prefix}-tail"), mode);
        sf.sync_kv(&tokens[..8], &kv).unwrap();
        snap(&mut out, &format!("{prefix}-two"), mode);
        snap(&mut out, &format!("{prefix}-two-resealed"), mode | 1);
    }
    // Each header copy torn in turn: the loader falls back to another one (or refuses).
    let log = out.iter().find(|(n, _)| n == "log").unwrap().1.clone();
    for block in 0..3 {
        let mut b = log.clone();
        b[1 + block * 4096 + 70] ^= 0x20;
        out.push((format!("torn-header-{block}"), b));
    }
    let _ = std::fs::remove_dir_all(&dir);
    out
}

#[test]
fn slot_file_survives_mutations() {
    let mut base = seeds("slot_file");
    for s in &base {
        if s.len() > 1 && s[0] & 1 == 0 {
            let r = if s[0] & 14 != 0 {
                colibri_engine::slotfile::load_bytes_states(
                    &s[1..],
                    SLOT_FP,
                    &slot_layout(s[0]),
                    &SLOT_STATES,
                )
            } else {
                colibri_engine::slotfile::load_bytes(&s[1..], SLOT_FP, SLOT_LAYERS, SLOT_KV_DIM)
            };
            assert!(
                r.is_ok(),
                "a seed no longer loads ({r:?}): the format changed; rewrite the seeds with \
                 `cargo test --manifest-path fuzz/Cargo.toml --test smoke -- --ignored write_slot_file_seeds`"
            );
        }
    }
    let built: Vec<Vec<u8>> = slot_file_bases().into_iter().map(|(_, b)| b).collect();
    // Structured edits where the data is (header fields and the log, not the zero padding of
    // the header blocks), raw and resealed.
    let mut rng = Rng(17);
    for _ in 0..iters(3000) {
        let mut b = built[rng.below(built.len())].clone();
        if b.len() <= 1 {
            continue;
        }
        // Keep a base's kind (bit 1: a state file, bit 2: rows per 2 positions, bit 3: MLA's
        // rows); choose raw or resealed.
        b[0] = (b[0] & 14) | rng.below(2) as u8;
        for _ in 0..1 + rng.below(3) {
            let at = if rng.below(2) == 0 || b.len() <= 1 + 3 * 4096 {
                1 + rng.below(3) * 4096 + rng.below(104)
            } else {
                1 + 3 * 4096 + rng.below(b.len() - 1 - 3 * 4096)
            };
            let at = at.min(b.len() - 1);
            match rng.below(4) {
                0 => b[at] ^= 1 << rng.below(8),
                1 => b[at] = rng.next() as u8,
                2 if at + 8 <= b.len() => {
                    let v = [0, 1, 2, 7, u64::MAX, 1 << 40][rng.below(6)];
                    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
                }
                _ => b.truncate(at.max(1)),
            }
        }
        slot_file(&b);
    }
    base.extend(built);
    run("slot_file", base, iters(3000), slot_file);
}

/// Rewrites `fuzz/seeds/slot_file/` (after a format change).
#[test]
#[ignore = "writes fuzz/seeds/slot_file/"]
fn write_slot_file_seeds() {
    let d = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds/slot_file");
    std::fs::create_dir_all(&d).unwrap();
    for (name, b) in slot_file_bases() {
        std::fs::write(d.join(format!("{name}.bin")), b).unwrap();
    }
}
