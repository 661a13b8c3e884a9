//! Loading and forward-pass tests over the committed fixtures.

use std::fs;

use super::forward::{resolve_prefill_chunk, PREFILL_CHUNK};
use super::*;
use serde_json::{json, Value};

use crate::testutil::ScratchDir;

/// The committed `arch` fixture converted at `quant` into a fresh scratch directory named
/// by `tag` (removed when the guard drops, if the test has not removed it before).
fn convert_fixture(arch: &str, quant: Quant, tag: &str) -> ScratchDir {
    let hf = crate::testutil::fixture(arch);
    let d = crate::testutil::scratch_dir("model", tag);
    crate::convert::convert(&hf, &d, quant, &mut |_, _, _| {}).unwrap();
    d
}

/// Converts the GLM fixture (f32) into a scratch directory, edits its manifest, loads it
/// (and runs a forward pass if it loads), and removes the directory again.
fn load_edited(tag: &str, edit: impl FnOnce(&mut Value)) -> Result<Model> {
    let d = convert_fixture("glm4_moe", Quant::F32, &format!("load-{tag}"));
    let mut m: Value =
        serde_json::from_str(&fs::read_to_string(d.join(MANIFEST)).unwrap()).unwrap();
    edit(&mut m);
    fs::write(d.join(MANIFEST), m.to_string()).unwrap();
    let r = Model::load(&d, Some(1));
    if let Ok(model) = &r {
        let mut kv = model.new_cache();
        model.forward(&[1, 2, 3], &mut kv, false).unwrap();
    }
    // The model keeps its maps; the files can go.
    fs::remove_dir_all(&d).unwrap();
    r
}

/// The largest difference between `a` and `reference`, relative to `reference`'s largest
/// magnitude.
fn max_diff_of_scale(a: &[f32], reference: &[f32]) -> f32 {
    let scale = reference.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    let diff = a
        .iter()
        .zip(reference)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

fn err(r: Result<Model>) -> String {
    match r {
        Ok(_) => panic!("expected the model to be refused"),
        Err(e) => e.to_string(),
    }
}

/// A prompt run in chunks gives the bits of the same prompt in one pass, for the first three
/// fixture architectures, DeepSeek-V3 (chunks of one position take MLA's decode path) and
/// DeepSeek-V4 (whose compressor windows and indexer span chunks), in
/// int4 (expert-grouped products, f16 cache) and f32, with every token's
/// logits and with the last one's; and decoding after it continues identically. (MLA with
/// its expanded prefill on picks each pass's form by its length and history, and chunks agree
/// with the whole within f32 rounding only: `mla_expanded_prefill_gives_the_absorbed_logits`;
/// here it is off.)
#[test]
fn chunked_prefill_gives_the_same_bits() {
    for arch in [
        "olmoe",
        "qwen3_moe",
        "glm4_moe",
        "deepseek_v3",
        "deepseek_v4",
        "qwen3_next",
        "kimi_linear",
    ] {
        for quant in [Quant::Int4, Quant::F32] {
            let d = convert_fixture(arch, quant, &format!("chunk-{arch}-{quant:?}"));
            let mut model = Model::load(&d, Some(2)).unwrap();
            model.set_mla_expanded(false);
            fs::remove_dir_all(&d).unwrap();
            let vocab = model.cfg.vocab_size as u32;
            let prompt: Vec<u32> = (0..61u32).map(|i| (i * 37 + 5) % vocab).collect();
            let run = |model: &Model, all: bool| {
                let mut kv = model.new_cache();
                let prefill = model.forward(&prompt, &mut kv, all).unwrap();
                let next = model.forward(&[7], &mut kv, false).unwrap();
                let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                (bits(prefill), bits(next))
            };
            model.set_prefill_chunk(usize::MAX);
            let whole = [run(&model, true), run(&model, false)];
            for chunk in [1, 8, 13, 60] {
                model.set_prefill_chunk(chunk);
                let chunked = [run(&model, true), run(&model, false)];
                assert!(
                    chunked == whole,
                    "{arch} {quant:?}: chunks of {chunk} changed the logits"
                );
            }
            assert_eq!(whole[0].0.len(), prompt.len() * vocab as usize);
        }
    }
}

/// A decode step's MLA heads, each thread taking a run of heads through its whole chain
/// (`mla::decode`), give the bits of a prefill's three parallel regions under any thread count
/// (more threads than heads included, runs of unequal length): every position of a prompt
/// decoded one by one gives the logits of the prompt in one pass. (Decode steps of several sequences together: `batch_tests`.)
#[test]
fn decode_heads_give_the_bits_of_the_three_regions() {
    for arch in ["deepseek_v3", "deepseek_v3_noqlora", "kimi_linear"] {
        for quant in [Quant::Int4, Quant::F32] {
            let d = convert_fixture(arch, quant, &format!("heads-{arch}-{quant:?}"));
            let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
            let mut want = None;
            for threads in [1, 2, 3, 5] {
                let mut model = Model::load(&d, Some(threads)).unwrap();
                // The prefill absorbed, as a decode step (the forms agree within rounding).
                model.set_mla_expanded(false);
                let vocab = model.cfg.vocab_size as u32;
                let prompt: Vec<u32> = (0..23u32).map(|i| (i * 37 + 5) % vocab).collect();
                let mut kv = model.new_cache();
                let whole = bits(model.forward(&prompt, &mut kv, true).unwrap());
                let mut kv = model.new_cache();
                let mut stepped = Vec::new();
                for &t in &prompt {
                    stepped.extend(bits(model.forward(&[t], &mut kv, false).unwrap()));
                }
                assert!(stepped == whole, "{arch} {quant:?} {threads} threads");
                match &want {
                    None => want = Some(whole),
                    Some(w) => assert!(*w == whole, "{arch} {quant:?}: {threads} threads"),
                }
            }
            fs::remove_dir_all(&d).unwrap();
        }
    }
}

/// The delta rule's chunked form, forced for every step, gives the recurrent form's logits
/// within f32 rounding on both linear-attention families (a prompt in one step, then decode).
#[test]
fn the_chunked_delta_rule_gives_the_recurrent_logits() {
    use super::layers::delta::resolve_delta_chunked;
    assert_eq!(resolve_delta_chunked(Some("off")), (None, None));
    assert_eq!(resolve_delta_chunked(Some(" 96 ")), (Some(96), None));
    assert!(resolve_delta_chunked(Some("0"))
        .1
        .unwrap()
        .contains("COLI_DELTA_CHUNKED=0"));
    for arch in ["qwen3_next", "kimi_linear"] {
        let d = convert_fixture(arch, Quant::F32, &format!("delta-form-{arch}"));
        let mut model = Model::load(&d, Some(2)).unwrap();
        fs::remove_dir_all(&d).unwrap();
        let vocab = model.cfg.vocab_size as u32;
        let prompt: Vec<u32> = (0..150u32).map(|i| (i * 37 + 5) % vocab).collect();
        let run = |model: &Model| {
            let mut kv = model.new_cache();
            let mut all = model.forward(&prompt, &mut kv, true).unwrap();
            all.extend(model.forward(&[7], &mut kv, false).unwrap());
            all
        };
        model.set_delta_chunked_from(None);
        let recurrent = run(&model);
        model.set_delta_chunked_from(Some(1));
        let chunked = run(&model);
        let diff = max_diff_of_scale(&chunked, &recurrent);
        assert!(diff < 1e-5, "{arch}: {diff}");
        assert_ne!(recurrent, chunked, "{arch}: the chunked form did not run");
    }
}

#[test]
fn prefill_chunk_setting() {
    assert_eq!(resolve_prefill_chunk(None), (PREFILL_CHUNK, None));
    assert_eq!(resolve_prefill_chunk(Some(" ")), (PREFILL_CHUNK, None));
    assert_eq!(resolve_prefill_chunk(Some(" 256 ")), (256, None));
    for bad in ["0", "-3", "lots", "1.5"] {
        let (n, warning) = resolve_prefill_chunk(Some(bad));
        assert_eq!(n, PREFILL_CHUNK);
        assert!(warning
            .unwrap()
            .contains(&format!("COLI_PREFILL_CHUNK={bad}:")));
    }
}

#[test]
fn unedited_model_loads() {
    load_edited("ok", |_| {}).unwrap();
}

/// Found by fuzzing: offsets and record counts from a corrupt manifest overflowed (`offset +
/// nbytes`, `first_record + count`, `records * record_size`) and misaligned f32 tensors
/// panicked in the in-place `&[f32]` view at the first forward pass.
#[test]
fn corrupt_manifest_offsets_are_refused() {
    let e = err(load_edited("first", |m| {
        m["experts"]["layers"][0]["first_record"] = json!(u64::MAX)
    }));
    assert!(e.contains("truncated"), "{e}");
    let e = err(load_edited("offset", |m| {
        m["resident"]["tensors"]["embed"]["offset"] = json!(u64::MAX - 3)
    }));
    assert!(e.contains("embed") && e.contains("past the end"), "{e}");
    let e = err(load_edited("align", |m| {
        let off = m["resident"]["tensors"]["layers.0.q"]["offset"]
            .as_u64()
            .unwrap();
        m["resident"]["tensors"]["layers.0.q"]["offset"] = json!(off + 2);
    }));
    assert!(e.contains("layers.0.q") && e.contains("aligned"), "{e}");
    // Routers are viewed in place too (as f32), not copied.
    let e = err(load_edited("router", |m| {
        let tensors = m["resident"]["tensors"].as_object_mut().unwrap();
        let (_, t) = tensors
            .iter_mut()
            .find(|(name, _)| name.ends_with(".router"))
            .unwrap();
        t["offset"] = json!(t["offset"].as_u64().unwrap() + 2);
    }));
    assert!(e.contains(".router") && e.contains("aligned"), "{e}");
    let e = err(load_edited("shape", |m| {
        m["resident"]["tensors"]["norm"]["shape"] = json!([1u64 << 63, 4])
    }));
    assert!(e.contains("norm"), "{e}");
    let e = err(load_edited("record", |m| {
        let r = m["experts"]["record_size"].as_u64().unwrap();
        m["experts"]["record_size"] = json!(r + 4);
    }));
    assert!(e.contains("record size"), "{e}");
}

#[test]
fn manifest_file_names_stay_inside_the_directory() {
    for (tag, ptr) in [
        ("res", "/resident/file"),
        ("exp", "/experts/file"),
        ("tok", "/tokenizer"),
    ] {
        let e = err(load_edited(tag, |m| {
            *m.pointer_mut(ptr).unwrap() = json!("../x.bin")
        }));
        assert!(e.contains("../x.bin"), "{e}");
    }
}

/// An MLA directory converted before `kv_b_proj` was split (one f32 `kv_b` per layer, per head
/// `W_uk` rows then `W_uv` rows) still loads, and gives the logits of today's split layout.
#[test]
fn an_mla_directory_with_the_fused_f32_kv_b_still_loads() {
    let d = convert_fixture("deepseek_v3", Quant::F32, "mla-fused-kv-b");
    let split = Model::load(&d, Some(1)).unwrap();
    let tokens = [5u32, 17, 99, 3, 250, 41, 7];
    let want = split
        .forward(&tokens, &mut split.new_cache(), true)
        .unwrap();
    drop(split);

    let cfg: Value = serde_json::from_str(
        &fs::read_to_string(crate::testutil::fixture("deepseek_v3").join("config.json")).unwrap(),
    )
    .unwrap();
    let heads = cfg["num_attention_heads"].as_u64().unwrap() as usize;
    let (nope, v, r) = (
        cfg["qk_nope_head_dim"].as_u64().unwrap() as usize,
        cfg["v_head_dim"].as_u64().unwrap() as usize,
        cfg["kv_lora_rank"].as_u64().unwrap() as usize,
    );
    let mut m: Value =
        serde_json::from_str(&fs::read_to_string(d.join(MANIFEST)).unwrap()).unwrap();
    let file = d.join(m["resident"]["file"].as_str().unwrap());
    let mut resident = fs::read(&file).unwrap();
    let f32s = |e: &Value, buf: &[u8]| -> Vec<f32> {
        let (o, n) = (
            e["offset"].as_u64().unwrap() as usize,
            e["nbytes"].as_u64().unwrap() as usize,
        );
        buf[o..o + n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let tensors = m["resident"]["tensors"].as_object_mut().unwrap();
    let mut layers = 0;
    for i in 0.. {
        let (uk_name, uv_name) = (
            format!("layers.{i}.kv_b_uk_t"),
            format!("layers.{i}.kv_b_uv"),
        );
        let Some(uk) = tensors.remove(&uk_name) else {
            break;
        };
        let uv = tensors.remove(&uv_name).unwrap();
        let (uk_t, uv) = (f32s(&uk, &resident), f32s(&uv, &resident));
        // Back to kv_b_proj's own layout: per head, W_uk (nope x r) then W_uv (v x r).
        let mut fused = Vec::with_capacity(heads * (nope + v) * r);
        for h in 0..heads {
            let block = &uk_t[h * r * nope..(h + 1) * r * nope];
            for j in 0..nope {
                fused.extend((0..r).map(|c| block[c * nope + j]));
            }
            fused.extend_from_slice(&uv[h * v * r..(h + 1) * v * r]);
        }
        let offset = resident.len().next_multiple_of(64);
        resident.resize(offset, 0);
        resident.extend(fused.iter().flat_map(|x| x.to_le_bytes()));
        tensors.insert(
            format!("layers.{i}.kv_b"),
            json!({"dtype": "f32", "shape": [heads * (nope + v), r], "offset": offset,
                   "nbytes": fused.len() * 4}),
        );
        layers += 1;
    }
    assert_eq!(layers, cfg["num_hidden_layers"].as_u64().unwrap() as usize);
    fs::write(&file, &resident).unwrap();
    fs::write(d.join(MANIFEST), m.to_string()).unwrap();

    let fused = Model::load(&d, Some(1)).unwrap();
    let got = fused
        .forward(&tokens, &mut fused.new_cache(), true)
        .unwrap();
    let scale = want.iter().fold(0f32, |a, x| a.max(x.abs()));
    let worst = want
        .iter()
        .zip(&got)
        .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
    assert!(worst <= 1e-5 * scale, "max difference {worst} of {scale}");
    drop(fused);
    fs::remove_dir_all(&d).unwrap();
}

/// MLA prefill in the expanded form (a pass of at least `EXPAND_MIN_QUERIES` positions) gives
/// the absorbed form's logits (the same prompt in passes too short to expand, which decode
/// uses) within f32 rounding, in f32 and in int4 alike: both forms multiply by the same
/// weights (`W_uk` is `W_uk^T` as stored, transposed) and `kv_b`'s products take their inputs
/// unrounded (`Acts::exact`); with 8-bit inputs there the forms had differed by ~1-2% of the
/// logits' scale per position. And a directory converted while conversions stored a derived
/// `kv_b_uk` (now made per pass) loads and gives the same bits.
#[test]
fn mla_expanded_prefill_gives_the_absorbed_logits() {
    use crate::model::layers::mla::EXPAND_MIN_QUERIES;
    for arch in [
        "deepseek_v3",
        "deepseek_v3_noqlora",
        "kimi_linear",
        "kimi_linear_lora",
    ] {
        // (quantization, bound on the median position, on the 90th percentile)
        for (quant, median, p90) in [(Quant::F32, 2e-6, 5e-6), (Quant::Int4, 2e-6, 5e-6)] {
            let d = convert_fixture(arch, quant, &format!("expand-{arch}-{quant:?}"));
            let mut model = Model::load(&d, Some(2)).unwrap();
            model.set_mla_expanded(true);
            let vocab = model.cfg.vocab_size as usize;
            let n = EXPAND_MIN_QUERIES + 37;
            let prompt: Vec<u32> = (0..n).map(|i| ((i * 37 + 5) % vocab) as u32).collect();
            let run = |model: &Model| {
                let mut kv = model.new_cache();
                let mut all = model.forward(&prompt, &mut kv, true).unwrap();
                all.extend(model.forward(&[7], &mut kv, false).unwrap());
                all
            };
            model.set_prefill_chunk(usize::MAX);
            let expanded = run(&model);
            model.set_prefill_chunk(EXPAND_MIN_QUERIES - 1);
            let absorbed = run(&model);
            let scale = absorbed.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let mut per: Vec<f32> = expanded
                .chunks(vocab)
                .zip(absorbed.chunks(vocab))
                .map(|(a, b)| {
                    let w = a.iter().zip(b).map(|(x, y)| (x - y).abs());
                    w.fold(0.0f32, f32::max) / scale
                })
                .collect();
            per.sort_by(f32::total_cmp);
            let (mid, high) = (per[per.len() / 2], per[per.len() * 9 / 10]);
            println!("{arch} {quant:?}: expanded vs absorbed, per position median {mid:.1e}, 90th percentile {high:.1e}");
            assert!(
                mid < median && high < p90,
                "{arch} {quant:?}: {mid:.1e} {high:.1e}"
            );
            drop(model);
            if quant == Quant::Int4 {
                // Neither form is the less accurate: both against the f32 model.
                let f = convert_fixture(arch, Quant::F32, &format!("expand-ref-{arch}"));
                let reference = run(&Model::load(&f, Some(2)).unwrap());
                fs::remove_dir_all(&f).unwrap();
                let rel = |x: &[f32]| {
                    let num: f64 = x
                        .iter()
                        .zip(&reference)
                        .map(|(a, b)| ((a - b) as f64).powi(2))
                        .sum();
                    let den: f64 = reference.iter().map(|b| (*b as f64).powi(2)).sum();
                    (num / den).sqrt()
                };
                let (e, a) = (rel(&expanded), rel(&absorbed));
                println!("  int4 vs f32: expanded {e:.4}, absorbed {a:.4}");
                assert!(
                    e < 1.1 * a,
                    "{arch}: expanded int4 {e:.4} vs absorbed {a:.4}"
                );
            }

            // A directory with the `kv_b_uk` entries conversions wrote for a while (here each
            // pointing at its layer's `kv_b_uk_t` bytes, which is what is read, if anything).
            let mut m: Value =
                serde_json::from_str(&fs::read_to_string(d.join(MANIFEST)).unwrap()).unwrap();
            let tensors = m["resident"]["tensors"].as_object_mut().unwrap();
            let names: Vec<String> = tensors.keys().cloned().collect();
            for name in names.iter().filter(|n| n.ends_with(".kv_b_uk_t")) {
                let entry = tensors[name.as_str()].clone();
                tensors.insert(name.trim_end_matches("_t").to_string(), entry);
            }
            fs::write(d.join(MANIFEST), m.to_string()).unwrap();
            let mut old = Model::load(&d, Some(2)).unwrap();
            old.set_mla_expanded(true);
            old.set_prefill_chunk(usize::MAX);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&run(&old)) == bits(&expanded), "{arch} {quant:?}");
            fs::remove_dir_all(&d).unwrap();
        }
    }
}

/// MLA's `kv_b` copies by columns exist while the expanded setting is on (the products
/// reading them take unrounded inputs), in both formats a default int4 conversion stores
/// (`W_uk^T` int4, `W_uv` 8-bit), and the RAM budget counts exactly their bytes; switched off,
/// they are dropped, and the rows (with 8-bit inputs) give the same model within that rounding.
#[test]
fn kv_b_columns_follow_the_expanded_setting() {
    use crate::model::layers::mla::kv_b_columns_bytes;
    for arch in ["deepseek_v3", "glm_moe_dsa"] {
        let d = convert_fixture(arch, Quant::Int4, &format!("columns-{arch}"));
        let manifest = crate::format::read_manifest(&d).unwrap();
        let mut model = Model::load(&d, Some(2)).unwrap();
        model.set_mla_expanded(true);
        let (q4, q8) = model.kv_b_columns_held();
        assert!(
            q4 > 0 && q8 > 0,
            "{arch}: int4 {q4}, 8-bit {q8} bytes by columns"
        );
        if crate::model::layers::mla::mla_expanded_from_env() {
            assert_eq!((q4 + q8) as u64, kv_b_columns_bytes(&manifest), "{arch}");
        }
        let prompt: Vec<u32> = (0..9).map(|i| (i * 13 + 3) % 50).collect();
        let logits = |m: &Model| m.forward(&prompt, &mut m.new_cache(), true).unwrap();
        let by_columns = logits(&model);
        model.set_mla_expanded(false);
        assert_eq!(model.kv_b_columns_held(), (0, 0), "{arch}");
        // The rows with 8-bit inputs: the same model within that rounding.
        let worst = max_diff_of_scale(&logits(&model), &by_columns);
        println!("{arch}: rows with 8-bit inputs vs columns, {worst:.1e} of the scale");
        assert!(worst < 0.05, "{arch}: {worst} of the scale");
        drop(model);
        fs::remove_dir_all(&d).unwrap();
    }
}

#[test]
fn mla_expanded_setting() {
    use crate::model::layers::mla::resolve_mla_expanded;
    for (v, want) in [
        (None, true),
        (Some(""), true),
        (Some("off"), false),
        (Some(" 0 "), false),
        (Some(" on "), true),
        (Some("1"), true),
        (Some("yes"), true),
    ] {
        assert_eq!(resolve_mla_expanded(v), want, "{v:?}");
    }
}
