//! The store alone (bytes, budgets, back ends, concurrency) and the invariant that matters: a
//! model's greedy output and logits are identical whatever the budget, prefetch or I/O path.

use std::fs;
use std::path::Path;

use super::*;
use crate::format::Quant;
use crate::model::Model;

use crate::testutil::{fixture, ScratchDir};

fn scratch(tag: &str) -> ScratchDir {
    crate::testutil::scratch_dir("store", tag)
}

/// Byte `i` of record `r` of the synthetic experts file.
fn byte(r: usize, i: usize) -> u8 {
    ((r * 131 + i * 7 + (i >> 9)) % 251) as u8
}

/// An experts file of `records` records of 8 KiB, `layers` layers of equal size.
fn synthetic(tag: &str, records: usize, layers: usize) -> (ScratchDir, StoreLayout) {
    let d = scratch(tag);
    let rs = 8192;
    let mut data = vec![0u8; records * rs];
    for r in 0..records {
        for i in 0..rs {
            data[r * rs + i] = byte(r, i);
        }
    }
    let path = d.join("experts.bin");
    fs::write(&path, &data).unwrap();
    let per = records / layers;
    let layout = StoreLayout {
        path,
        record_size: rs,
        rec_layer: (0..records).map(|r| (r / per) as u32).collect(),
        moe_layers: layers,
        top_k: 2,
    };
    (d, layout)
}

fn check(r: &RecordRef) {
    let b = r.bytes();
    let rec = r.record() as usize;
    assert!(b.iter().enumerate().all(|(i, &x)| x == byte(rec, i)));
}

fn opts(slots: u64, io: IoBackend, direct: bool, policy: Policy) -> ExpertOptions {
    ExpertOptions {
        ram_bytes: Some(slots * 8192),
        io,
        direct_io: direct,
        policy,
        ..Default::default()
    }
}

#[test]
fn records_arrive_intact_under_every_budget_and_back_end() {
    let (d, _) = synthetic("bytes", 32, 4);
    for io in [IoBackend::Pread, IoBackend::Uring] {
        for direct in [false, true] {
            for policy in [Policy::GlobalLru, Policy::PerLayerLru] {
                for slots in [1, 3, 8, 32, 100] {
                    let (_, layout) = synthetic_layout(&d, 32, 4);
                    let store =
                        ExpertStore::open(layout, &opts(slots, io, direct, policy), &[]).unwrap();
                    for round in 0..3 {
                        for layer in 0..4u32 {
                            let recs: Vec<u32> =
                                (0..5).map(|k| layer * 8 + (k * 3 + round) % 8).collect();
                            let mut b = store.request(&recs);
                            let mut seen = vec![false; recs.len()];
                            loop {
                                let ready = b.next_ready().unwrap();
                                if ready.is_empty() {
                                    break;
                                }
                                for (i, r) in &ready {
                                    assert_eq!(r.record(), recs[*i]);
                                    assert!(!seen[*i]);
                                    seen[*i] = true;
                                    check(r);
                                }
                            }
                            assert!(seen.iter().all(|&s| s));
                        }
                    }
                    let st = store.stats();
                    assert_eq!(st.bytes_read, st.reads * 8192);
                    if slots >= 32 {
                        // Everything fits: each touched record was read once.
                        assert_eq!(st.misses, st.reads);
                        assert!(st.reads <= 32);
                    }
                }
            }
        }
    }
    fs::remove_dir_all(&d).unwrap();
}

fn synthetic_layout(d: &Path, records: usize, layers: usize) -> ((), StoreLayout) {
    let per = records / layers;
    (
        (),
        StoreLayout {
            path: d.join("experts.bin"),
            record_size: 8192,
            rec_layer: (0..records).map(|r| (r / per) as u32).collect(),
            moe_layers: layers,
            top_k: 2,
        },
    )
}

#[test]
fn concurrent_callers_share_a_one_record_cache() {
    let (d, layout) = synthetic("conc", 16, 2);
    let store = ExpertStore::open(
        layout,
        &opts(1, IoBackend::Auto, false, Policy::GlobalLru),
        &[],
    )
    .unwrap();
    std::thread::scope(|s| {
        for t in 0..3u32 {
            let store = &store;
            s.spawn(move || {
                for round in 0..20u32 {
                    let recs: Vec<u32> = (0..4).map(|k| (t * 5 + round * 3 + k * 4) % 16).collect();
                    let mut b = store.request(&recs);
                    let mut n = 0;
                    loop {
                        let ready = b.next_ready().unwrap();
                        if ready.is_empty() {
                            break;
                        }
                        for (_, r) in &ready {
                            check(r);
                        }
                        n += ready.len();
                    }
                    assert_eq!(n, 4);
                }
            });
        }
    });
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn pinned_records_stay_and_prefetch_is_counted() {
    let (d, layout) = synthetic("pin", 16, 2);
    // 7 slots, 3 pinned: 4 for the LRU part (= 2 layers x top_k 2: plain LRU).
    let mut o = opts(7, IoBackend::Pread, false, Policy::GlobalLru);
    o.pin_bytes = 3 * 8192;
    let store = ExpertStore::open(layout, &o, &[5, 9, 2, 7]).unwrap();
    let st = store.stats();
    assert_eq!((st.slots, st.pinned, st.reads), (7, 3, 3));
    for r in [5, 9, 2] {
        assert!(store.is_resident(r));
    }
    // Churn through everything else: the pinned ones stay.
    for r in 0..16u32 {
        let mut b = store.request(&[r]);
        while !b.next_ready().unwrap().is_empty() {}
    }
    for r in [5, 9, 2] {
        assert!(store.is_resident(r));
    }
    store.prefetch(&[0, 1]);
    let mut b = store.request(&[0, 1]);
    while !b.next_ready().unwrap().is_empty() {}
    let st = store.stats();
    assert_eq!(st.prefetch_reads, 2);
    fs::remove_dir_all(&d).unwrap();
}

#[test]
fn tiers_say_where_every_record_is() {
    let (d, layout) = synthetic("tiers", 16, 2);
    // 7 slots, 3 pinned (the hottest by heat: 5, 9, 2), 4 for the LRU part.
    let mut o = opts(7, IoBackend::Pread, false, Policy::GlobalLru);
    o.pin_bytes = 3 * 8192;
    let store = ExpertStore::open(layout, &o, &[5, 9, 2, 7]).unwrap();
    let at = |t: &[Tier], want: Tier| -> Vec<u32> {
        (0..16u32).filter(|&r| t[r as usize] == want).collect()
    };
    // At load: the pinned part only; everything else on disk.
    let t = store.tiers();
    assert_eq!(t.len(), 16);
    assert_eq!(at(&t, Tier::Pinned), vec![2, 5, 9]);
    assert_eq!(at(&t, Tier::Cached), Vec::<u32>::new());
    assert_eq!(at(&t, Tier::Disk).len(), 13);
    // Seven records asked for, one at a time: the LRU part keeps the last four; a pinned one
    // asked for stays pinned (and takes no LRU slot).
    for r in [0, 1, 5, 11, 12, 13, 14] {
        let mut b = store.request(&[r]);
        while !b.next_ready().unwrap().is_empty() {}
    }
    let t = store.tiers();
    assert_eq!(at(&t, Tier::Pinned), vec![2, 5, 9]);
    assert_eq!(at(&t, Tier::Cached), vec![11, 12, 13, 14]);
    assert_eq!(at(&t, Tier::Disk).len(), 16 - 7);
    for (r, tier) in t.iter().enumerate() {
        assert_eq!(
            store.is_resident(r as u32),
            *tier != Tier::Disk,
            "record {r}"
        );
    }
    let letters: String = t.iter().map(|t| t.letter()).collect();
    assert_eq!(letters, "ddpddpdddpdccccd");
    fs::remove_dir_all(&d).unwrap();
}

/// Requests of several sequences whose union overflows the cache are inserted by frequency:
/// a cyclic pattern of 6 records per layer over 2 layers (12, cache 8: plain LRU evicts each
/// before its next use) then hits on the records kept hot; the same requests of one sequence
/// keep LRU, and miss every time.
#[test]
fn overflowing_steps_of_several_sequences_keep_the_frequent_records() {
    let hits_over_rounds = |several: bool| {
        let (d, layout) = synthetic(&format!("overflow-{several}"), 16, 2);
        let store = ExpertStore::open(
            layout,
            &opts(8, IoBackend::Pread, false, Policy::GlobalLru),
            &[],
        )
        .unwrap();
        let steps: [[u32; 6]; 2] = [[0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13]];
        // Long enough for the frequency ranking (every 1024 requests) to know the records.
        for _ in 0..200 {
            for recs in &steps {
                let mut b = store.request_for(recs, several);
                while !b.next_ready().unwrap().is_empty() {}
            }
        }
        fs::remove_dir_all(&d).unwrap();
        store.stats().hits
    };
    assert_eq!(hits_over_rounds(false), 0);
    let h = hits_over_rounds(true);
    assert!(
        h >= 200,
        "by frequency, the hot records stay: {h} hits of 2400"
    );
}

#[test]
fn a_truncated_file_is_refused_at_open() {
    let (d, layout) = synthetic("short", 8, 2);
    let f = fs::OpenOptions::new()
        .write(true)
        .open(&layout.path)
        .unwrap();
    f.set_len(7 * 8192 + 100).unwrap();
    let e = ExpertStore::open(
        layout,
        &opts(4, IoBackend::Pread, false, Policy::GlobalLru),
        &[],
    )
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("smaller"), "{e}");
    fs::remove_dir_all(&d).unwrap();
}

// ---- Models: results never depend on placement ----

/// A random checkpoint with OLMoE's structure (every layer MoE, 16 experts top-4, q/k norm),
/// small enough for a test: 4 layers, hidden 64.
fn random_olmoe(dir: &Path) {
    use rand::{RngExt, SeedableRng};
    use safetensors::tensor::TensorView;
    let (h, layers, experts, top_k, inter, vocab, heads) = (64, 4, 16, 4, 96, 397, 4);
    let cfg = serde_json::json!({
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": heads, "num_experts": experts,
        "num_experts_per_tok": top_k, "vocab_size": vocab, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "norm_topk_prob": false, "tie_word_embeddings": false, "clip_qkv": null,
        "attention_bias": false, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0
    });
    fs::create_dir_all(dir).unwrap();
    fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    fs::copy(
        fixture("olmoe").join("tokenizer.json"),
        dir.join("tokenizer.json"),
    )
    .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, std: f32, one: bool| {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|_| {
                if one {
                    1.0
                } else {
                    // Sum of uniforms: roughly normal, mean 0.
                    let u: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum();
                    u * std
                }
            })
            .collect();
        tensors.push((name, shape, bytemuck::cast_slice(&v).to_vec()));
    };
    add(
        "model.embed_tokens.weight".into(),
        vec![vocab, h],
        0.5,
        false,
    );
    add("lm_head.weight".into(), vec![vocab, h], 0.1, false);
    add("model.norm.weight".into(), vec![h], 0.0, true);
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.0, true);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            0.0,
            true,
        );
        for m in ["q", "k", "v", "o"] {
            add(
                format!("{p}.self_attn.{m}_proj.weight"),
                vec![h, h],
                0.1,
                false,
            );
        }
        add(format!("{p}.self_attn.q_norm.weight"), vec![h], 0.0, true);
        add(format!("{p}.self_attn.k_norm.weight"), vec![h], 0.0, true);
        add(format!("{p}.mlp.gate.weight"), vec![experts, h], 0.3, false);
        for e in 0..experts {
            for (m, shape) in [
                ("gate", vec![inter, h]),
                ("up", vec![inter, h]),
                ("down", vec![h, inter]),
            ] {
                add(
                    format!("{p}.mlp.experts.{e}.{m}_proj.weight"),
                    shape,
                    0.1,
                    false,
                );
            }
        }
    }
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, s, b)| {
            (
                n.clone(),
                TensorView::new(safetensors::Dtype::F32, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let bytes = safetensors::serialize(views, None).unwrap();
    fs::write(dir.join("model.safetensors"), bytes).unwrap();
}

/// Greedy generation: two turns (the second after the first's history), `steps` tokens each.
/// Returns the tokens and the bits of every logit computed.
fn greedy(m: &Model, steps: usize) -> (Vec<u32>, Vec<u32>) {
    let vocab = m.cfg.vocab_size as u32;
    let mut toks = Vec::new();
    let mut bits = Vec::new();
    let mut kv = m.new_cache();
    for turn in 0..2u32 {
        let prompt: Vec<u32> = (0..7u32)
            .map(|i| (i * 37 + turn * 11 + 3) % vocab)
            .collect();
        let mut logits = m.forward(&prompt, &mut kv, false).unwrap();
        for _ in 0..steps {
            bits.extend(logits.iter().map(|x| x.to_bits()));
            let t = crate::sampler::argmax(&logits) as u32;
            toks.push(t);
            logits = m.forward(&[t], &mut kv, false).unwrap();
        }
        m.end_turn().unwrap();
    }
    (toks, bits)
}

struct Converted {
    dir: ScratchDir,
    experts_bytes: u64,
    record_size: u64,
    moe_layers: u64,
}

fn convert(hf: &Path, tag: &str, quant: Quant) -> Converted {
    let dir = scratch(tag);
    crate::convert::convert(hf, &dir, quant, &mut |_, _, _| {}).unwrap();
    let m = Model::load(&dir, Some(1)).unwrap();
    let x = m.manifest.experts.as_ref().unwrap();
    let c = Converted {
        experts_bytes: fs::metadata(dir.join(&x.file)).unwrap().len(),
        record_size: x.record_size as u64,
        moe_layers: x.layers.len() as u64,
        dir,
    };
    let _ = fs::remove_file(c.dir.join(heat::HEAT_FILE));
    c
}

/// Every placement gives the resident model's tokens and logits, bit for bit.
fn placement_never_matters(c: &Converted, threads: usize) {
    let reference = greedy(&Model::load(&c.dir, Some(threads)).unwrap(), 6);
    let _ = fs::remove_file(c.dir.join(heat::HEAT_FILE));
    let all = c.experts_bytes;
    let half = (c.experts_bytes / c.record_size / 2) * c.record_size;
    let one_per_layer = c.moe_layers * c.record_size;
    let mut cases = Vec::new();
    for ram in [all, half, one_per_layer, 1] {
        for (prefetch, io, direct) in [
            (false, IoBackend::Pread, false),
            (true, IoBackend::Auto, false),
            (false, IoBackend::Uring, true),
        ] {
            cases.push(ExpertOptions {
                ram_bytes: Some(ram),
                prefetch,
                io,
                direct_io: direct,
                ..Default::default()
            });
        }
    }
    for (ram, policy) in [
        (half, Policy::PerLayerLru),
        (half, Policy::GlobalLruFreq),
        (one_per_layer, Policy::GlobalLruFreq),
    ] {
        cases.push(ExpertOptions {
            ram_bytes: Some(ram),
            policy,
            prefetch: true,
            ..Default::default()
        });
    }
    for o in &cases {
        let m = Model::load_with(&c.dir, Some(threads), o).unwrap();
        let got = greedy(&m, 6);
        assert!(got.0 == reference.0, "tokens differ under {o:?}");
        assert!(got.1 == reference.1, "logits differ under {o:?}");
        let st = m.store_stats().unwrap();
        assert!(st.reads > 0);
        // The path asked for is the one taken, or the fallback says why.
        if o.io == IoBackend::Uring {
            assert!(st.io == "io_uring" || !st.notes.is_empty(), "{st:?}");
        }
        if o.direct_io {
            assert!(st.direct_io || !st.notes.is_empty(), "{st:?}");
        }
        if o.ram_bytes == Some(all) {
            // Holds everything: each record read at most once, the rest hits.
            assert!(st.reads <= c.experts_bytes / c.record_size, "{st:?}");
        }
    }
    // Pinned experts from the heat the runs above saved.
    let o = ExpertOptions {
        ram_bytes: Some(half),
        pin_bytes: half / 2,
        ..Default::default()
    };
    let m = Model::load_with(&c.dir, Some(threads), &o).unwrap();
    assert!(m.store_stats().unwrap().pinned > 0);
    assert!(greedy(&m, 6) == reference);
}

#[test]
fn fixtures_give_the_same_tokens_under_every_budget() {
    for (arch, quant) in [
        ("olmoe", Quant::Int4),
        ("qwen3_moe", Quant::F32),
        ("glm4_moe", Quant::Int4),
    ] {
        let c = convert(&fixture(arch), &format!("fx-{arch}"), quant);
        placement_never_matters(&c, 2);
        fs::remove_dir_all(&c.dir).unwrap();
    }
}

#[test]
fn random_olmoe_gives_the_same_tokens_under_every_budget() {
    let hf = scratch("olmoe-hf");
    random_olmoe(&hf);
    let c = convert(&hf, "olmoe-int4", Quant::Int4);
    placement_never_matters(&c, 2);
    placement_never_matters(&c, 1);
    // Decode at 2 threads gives each thread whole experts (top-4): the same bits as 1 thread.
    let one = greedy(&Model::load(&c.dir, Some(1)).unwrap(), 6);
    assert!(greedy(&Model::load(&c.dir, Some(2)).unwrap(), 6) == one);
    assert!(greedy(&Model::load(&c.dir, Some(3)).unwrap(), 6) == one);
    fs::remove_dir_all(&c.dir).unwrap();
    fs::remove_dir_all(&hf).unwrap();
}

#[test]
fn nothing_is_read_after_warm_up_when_everything_fits() {
    let hf = scratch("warm-hf");
    random_olmoe(&hf);
    let c = convert(&hf, "warm", Quant::Int4);
    let o = ExpertOptions {
        ram_bytes: Some(c.experts_bytes),
        ..Default::default()
    };
    let m = Model::load_with(&c.dir, Some(2), &o).unwrap();
    greedy(&m, 4);
    let before = m.store_stats().unwrap();
    greedy(&m, 4);
    let after = m.store_stats().unwrap();
    assert_eq!(after.bytes_read, before.bytes_read);
    assert_eq!(after.misses, before.misses);
    assert!(after.hits > before.hits);
    fs::remove_dir_all(&c.dir).unwrap();
    fs::remove_dir_all(&hf).unwrap();
}

#[test]
fn turn_profiles_heat_and_routed_experts() {
    let hf = scratch("prof-hf");
    random_olmoe(&hf);
    let c = convert(&hf, "prof", Quant::Int4);
    let o = ExpertOptions {
        ram_bytes: Some(c.experts_bytes / 4),
        prefetch: true,
        ..Default::default()
    };
    let m = Model::load_with(&c.dir, Some(2), &o).unwrap();
    assert_eq!(m.last_profile(), profile::Profile::default());
    let before = m.store_stats().unwrap();
    greedy(&m, 5);
    let after = m.store_stats().unwrap();
    let ps = m.profiles();
    assert_eq!(ps.len(), 2);
    // A turn's counters start before its first pass: the two turns hold every read and lookup
    // (prefetches still in flight at a turn's end aside: none are left by then here).
    let sum = |f: fn(&profile::Profile) -> u64| ps.iter().map(f).sum::<u64>();
    let lookups = after.hits + after.misses - before.hits - before.misses;
    assert_eq!(sum(|p| p.cache_hits + p.cache_misses), lookups);
    assert!(sum(|p| p.bytes_read) <= after.bytes_read - before.bytes_read);
    assert!(ps[0].bytes_read > 0);
    // Read busy time: some when something was read, never more than the turn's span.
    for p in &ps {
        assert!(p.read_busy_s > 0.0, "{p:?}");
        assert!(p.read_busy_s <= after.read_busy_s - before.read_busy_s + 1e-9);
    }
    let p = m.last_profile();
    assert_eq!((p.prefill_tokens, p.decode_tokens), (7, 5));
    assert!(p.prefill_tok_s > 0.0 && p.decode_tok_s > 0.0);
    assert!(p.bytes_read > 0 && p.cache_misses > 0);
    assert!((0.0..=1.0).contains(&p.cache_hit_rate));
    assert!(p.prefetch_recall > 0.0 && p.prefetch_recall <= 1.0, "{p:?}");
    let parts = p.io_wait_s + p.expert_matmul_s + p.attention_s + p.lm_head_s + p.other_s;
    assert!((parts - (p.prefill_s + p.decode_s)).abs() < 1e-3, "{p:?}");
    let routed = m.last_routed_experts();
    assert_eq!(routed.len(), 4);
    assert!(routed
        .iter()
        .all(|r| r.len() >= 4 && r.windows(2).all(|w| w[0] < w[1])));
    // Heat: every token of every pass routed to top_k experts in each layer.
    let heat = m.routing_heat();
    assert_eq!(heat.layers.len(), 4);
    for l in &heat.layers {
        assert_eq!(l.counts.iter().sum::<u64>(), 2 * (7 + 5) * 4);
    }
    // Saved at the first end_turn; the file matches the counts of that time.
    let saved: heat::RoutingHeat =
        serde_json::from_str(&fs::read_to_string(c.dir.join(heat::HEAT_FILE)).unwrap()).unwrap();
    assert_eq!(saved.layers[0].counts.iter().sum::<u64>(), (7 + 5) * 4);
    m.save_heat().unwrap();
    let m2 = Model::load(&c.dir, Some(1)).unwrap();
    assert_eq!(m2.routing_heat(), heat);
    // A resident model profiles too.
    greedy(&m2, 2);
    let p = m2.last_profile();
    assert_eq!(
        (p.cache_hit_rate, p.bytes_read, p.read_busy_s),
        (1.0, 0, 0.0)
    );
    fs::remove_dir_all(&c.dir).unwrap();
    fs::remove_dir_all(&hf).unwrap();
}

/// The model's tier report: per MoE layer in heat order, every expert's place, agreeing with
/// the store's counts; all resident without a cache. The heat kept in a state directory of its
/// own (`HeatHome::Dir`) picks the pinned experts and the model directory is not written.
#[test]
fn expert_tiers_per_layer_and_the_heat_in_a_state_directory() {
    let hf = scratch("tiers-hf");
    random_olmoe(&hf);
    let c = convert(&hf, "tiers-model", Quant::Int4);
    let state = scratch("tiers-state");
    let resident = Model::load(&c.dir, Some(1)).unwrap();
    let r = resident.expert_tiers();
    let layers: Vec<usize> = resident
        .routing_heat()
        .layers
        .iter()
        .map(|l| l.layer)
        .collect();
    assert_eq!(r.iter().map(|l| l.0).collect::<Vec<_>>(), layers);
    assert!(r.iter().all(
        |(_, t)| t.len() == resident.cfg.num_experts && t.iter().all(|&t| t == Tier::Resident)
    ));
    drop(resident);
    let _ = fs::remove_file(c.dir.join(heat::HEAT_FILE));

    // A cache of a quarter of the experts, half of it pinned by the heat of a first run.
    let home = heat::HeatHome::Dir(state.to_path_buf());
    let quarter = (c.experts_bytes / c.record_size / 4) * c.record_size;
    let first = ExpertOptions {
        ram_bytes: Some(quarter),
        heat: home.clone(),
        ..Default::default()
    };
    let m = Model::load_with(&c.dir, Some(2), &first).unwrap();
    greedy(&m, 5);
    m.save_heat().unwrap();
    assert_eq!(m.heat_file(), Some(state.join(heat::HEAT_FILE).as_path()));
    assert!(state.join(heat::HEAT_FILE).is_file());
    assert!(
        !c.dir.join(heat::HEAT_FILE).exists(),
        "the model directory was written"
    );
    let heat = m.routing_heat();
    drop(m);
    let o = ExpertOptions {
        pin_bytes: quarter / 2,
        ..first
    };
    let m = Model::load_with(&c.dir, Some(2), &o).unwrap();
    assert_eq!(m.routing_heat(), heat);
    let st = m.store_stats().unwrap();
    let e = m.cfg.num_experts;
    // (MoE ordinal * experts + expert) of every expert of `tier`.
    let of = |tiers: &[(usize, Vec<Tier>)], tier: Tier| -> Vec<usize> {
        tiers
            .iter()
            .enumerate()
            .flat_map(|(i, (_, t))| {
                t.iter()
                    .enumerate()
                    .filter(move |(_, &x)| x == tier)
                    .map(move |(x, _)| i * e + x)
            })
            .collect()
    };
    let tiers = m.expert_tiers();
    assert!(st.pinned > 0);
    assert_eq!(of(&tiers, Tier::Cached), Vec::<usize>::new());
    // The pinned experts are the hottest of the saved heat.
    let mut by_heat: Vec<(u64, usize)> = heat
        .layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| {
            l.counts
                .iter()
                .enumerate()
                .map(move |(x, &n)| (n, i * e + x))
        })
        .collect();
    by_heat.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut want: Vec<usize> = by_heat.iter().take(st.pinned).map(|&(_, i)| i).collect();
    want.sort();
    assert_eq!(of(&tiers, Tier::Pinned), want);
    // After one turn the LRU part holds experts that turn routed to; the rest are on disk.
    let mut kv = m.new_cache();
    m.forward(&[3, 5, 7, 11, 13], &mut kv, false).unwrap();
    m.end_turn().unwrap();
    let tiers = m.expert_tiers();
    let routed = m.last_routed_experts();
    let cached = of(&tiers, Tier::Cached);
    assert!(
        !cached.is_empty() && cached.len() <= st.slots - st.pinned,
        "{cached:?}"
    );
    for i in &cached {
        let (layer, x) = (tiers[i / e].0, (i % e) as u32);
        assert!(routed[layer].contains(&x), "layer {layer} expert {x}");
    }
    assert_eq!(of(&tiers, Tier::Pinned), want);
    assert_eq!(
        of(&tiers, Tier::Disk).len() + cached.len() + st.pinned,
        tiers.len() * e,
        "every expert has one tier"
    );
    fs::remove_dir_all(&c.dir).unwrap();
    fs::remove_dir_all(&hf).unwrap();
    fs::remove_dir_all(&state).unwrap();
}

#[test]
fn two_threads_generating_on_a_tiny_cache_agree_with_one() {
    let hf = scratch("conc-hf");
    random_olmoe(&hf);
    let c = convert(&hf, "conc-model", Quant::Int4);
    let reference = greedy(&Model::load(&c.dir, Some(1)).unwrap(), 4);
    let o = ExpertOptions {
        ram_bytes: Some(c.record_size * 3),
        prefetch: true,
        ..Default::default()
    };
    let m = Model::load_with(&c.dir, Some(2), &o).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..2).map(|_| s.spawn(|| greedy(&m, 4))).collect();
        for h in hs {
            assert!(h.join().unwrap() == reference);
        }
    });
    fs::remove_dir_all(&c.dir).unwrap();
    fs::remove_dir_all(&hf).unwrap();
}

#[test]
fn the_default_budget_is_everything_when_it_fits() {
    let c = convert(&fixture("olmoe"), "fit", Quant::Int4);
    assert_eq!(fit_ram_bytes(&c.dir, 0).unwrap(), None);
    if mem_available().is_some() {
        // No room left at all: one record.
        assert_eq!(
            fit_ram_bytes(&c.dir, u64::MAX / 2).unwrap(),
            Some(c.record_size)
        );
    }
    assert!(fit_ram_bytes(&c.dir.join("missing"), 0).is_err());
    fs::remove_dir_all(&c.dir).unwrap();
}

/// The busy clock alone, on times it is given: overlapping reads count once, a gap with no read
/// counts nothing, an open period counts up to the moment asked.
#[test]
fn read_busy_time_counts_overlapping_reads_once() {
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    let mut c = BusyClock::default();
    c.start(|| at(0)); // read A 0..30 ms
    c.start(|| at(10)); // read B 10..50 ms: overlaps A
    c.finish(|| at(30));
    assert_eq!(c.busy_at(at(40)), Duration::from_millis(40)); // open period counted
    c.finish(|| at(50));
    assert_eq!(c.busy_at(at(100)), Duration::from_millis(50)); // idle 50..100: nothing
    c.start(|| at(100)); // read C 100..120 ms, alone
    c.finish(|| at(120));
    assert_eq!(c.busy_at(at(500)), Duration::from_millis(70));
    assert_eq!(c.in_flight, 0);
}

/// Through a real store whose pread reads each take 100 ms: one read counts its time; four
/// reads at once (four pread threads) count about 100 ms, not 400; a read left to run while
/// the caller "computes" is busy time the caller did not wait for (read busy - I/O wait).
#[test]
fn read_busy_time_of_slow_reads() {
    let (d, layout) = synthetic("busy", 16, 2);
    let slow = Duration::from_millis(100);
    let o = opts(16, IoBackend::Pread, false, Policy::GlobalLru);
    let store = ExpertStore::open_with(layout, &o, &[], slow).unwrap();
    assert_eq!(store.stats().read_busy_s, 0.0);
    let take_all = |recs: &[u32]| {
        let mut b = store.request(recs);
        while !b.next_ready().unwrap().is_empty() {}
    };
    let busy = |s: &StoreStats| s.read_busy_s;
    let s0 = store.stats();
    take_all(&[0]);
    let s1 = store.stats();
    let one = busy(&s1) - busy(&s0);
    assert!((0.1..0.2).contains(&one), "one read: {one}");
    assert!(s1.io_wait_s - s0.io_wait_s >= 0.09, "{s1:?}");
    // Four at once: their times overlap and count once.
    take_all(&[1, 2, 3, 4]);
    let s2 = store.stats();
    let four = busy(&s2) - busy(&s1);
    assert!((0.1..0.3).contains(&four), "four overlapping reads: {four}");
    // A read in flight: the open period is in the counters already.
    let mut b = store.request(&[5]);
    std::thread::sleep(Duration::from_millis(50));
    let mid = busy(&store.stats()) - busy(&s2);
    assert!(mid >= 0.05, "open period: {mid}");
    // ... and the caller computes 250 ms before taking it: it never waits.
    std::thread::sleep(Duration::from_millis(200));
    while !b.next_ready().unwrap().is_empty() {}
    drop(b);
    let s3 = store.stats();
    let (read, waited) = (busy(&s3) - busy(&s2), s3.io_wait_s - s2.io_wait_s);
    assert!((0.1..0.2).contains(&read), "{read}");
    assert!(waited < 0.01, "{waited}");
    assert!(read - waited >= 0.09, "overlapped: {}", read - waited);
    // Cached records read nothing: the clock stands still.
    take_all(&[0, 1, 5]);
    assert_eq!(busy(&store.stats()), busy(&s3));
    drop(store);
    fs::remove_dir_all(&d).unwrap();
}
