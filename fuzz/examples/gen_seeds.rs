//! Writes the seed corpora to `fuzz/seeds/<target>/`:
//! `cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds`.

use std::fs;
use std::path::Path;

use colibri_fuzz::*;
use safetensors::Dtype;

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds");
    let write = |target: &str, name: &str, bytes: &[u8]| {
        let d = root.join(target);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join(name), bytes).unwrap();
    };

    // config_json: the tiny configs and the reference fixtures' configs.
    for (i, c) in CONFIGS.iter().enumerate() {
        write("config_json", &format!("tiny-{i}.json"), c.as_bytes());
    }
    // ...and structured edits of them: [config, ops...] (see `edit_json`).
    for (i, ops) in [
        vec![0u8, 3, 0, 3, 8, 0, 0, 0, 0, 0, 0, 0],
        vec![1u8, 40, 0, 6, 1, 0, 0, 0, 0, 0, 0, 0],
        vec![2u8, 7, 0, 1, 3, 0, 0, 0, 0, 0, 0, 0],
    ]
    .iter()
    .enumerate()
    {
        write("config_json", &format!("edit-{i}.bin"), ops);
    }
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    for arch in [
        "olmoe",
        "qwen3_moe",
        "glm4_moe",
        "deepseek_v3",
        "glm_moe_dsa",
        "deepseek_v4",
        "qwen3_next",
        "kimi_linear",
    ] {
        if let Ok(b) = fs::read(fixtures.join(arch).join("hf/config.json")) {
            write("config_json", &format!("fixture-{arch}.json"), &b);
        }
    }
    // DeepSeek-V3's as the text model of a Kimi K2.5 (`convert::text_only`).
    if let Ok(b) = fs::read(fixtures.join("deepseek_v3/hf/config.json")) {
        let mut text: serde_json::Value = serde_json::from_slice(&b).unwrap();
        text.as_object_mut().unwrap().remove("architectures");
        let wrapped = serde_json::json!({
            "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "vision_config": {"patch_size": 14}, "text_config": text,
        });
        let b = serde_json::to_vec_pretty(&wrapped).unwrap();
        write("config_json", "fixture-kimi_k25.json", &b);
    }

    // checkpoint: [config, flags] + safetensors bytes, per arch, dtype and layout.
    for arch in 0..ARCHS {
        for (dt, dtype) in [
            ("f32", Dtype::F32),
            ("bf16", Dtype::BF16),
            ("f16", Dtype::F16),
        ] {
            let mut b = vec![arch as u8, 0];
            b.extend(tiny_checkpoint(arch, dtype, false));
            write("checkpoint", &format!("a{arch}-{dt}.bin"), &b);
        }
        // transformers 5's fused expert tensors (the first three families).
        let mut b = vec![arch as u8, 4];
        b.extend(tiny_checkpoint(arch, Dtype::F16, arch < 3));
        write("checkpoint", &format!("a{arch}-fused-f32out.bin"), &b);
        // Two shards: [selector | 8, len(first) u16 le, first, second].
        let tensors = tiny_tensors(arch, Dtype::BF16, false);
        let (x, y) = tensors.split_at(tensors.len() / 2);
        let (x, y) = (serialize(x), serialize(y));
        let mut b = vec![arch as u8, 8];
        b.extend((x.len() as u16).to_le_bytes());
        b.extend(&x);
        b.extend(&y);
        write("checkpoint", &format!("a{arch}-sharded.bin"), &b);
        // Each quantized form (FP8 / FP4, compressed-tensors int4 and FP8) under its bit.
        for (bit, name, form, _) in QUANTIZED_FORMS {
            let mut b = vec![arch as u8, bit];
            b.extend(serialize(&form(tiny_tensors(arch, Dtype::F32, false))));
            write("checkpoint", &format!("a{arch}-{name}.bin"), &b);
        }
        // A config edit (nudge one value) in front of a valid checkpoint.
        let mut b = vec![arch as u8, 16, 1, 9, 0, 6, 5, 0, 0, 0, 0, 0, 0, 0];
        b.extend(tiny_checkpoint(arch, Dtype::BF16, false));
        write("checkpoint", &format!("a{arch}-config-edit.bin"), &b);
    }

    // model_dir: [model, mode] + a whole manifest (mode 0) or patch ops (modes 1..3).
    for (i, m) in base_models().iter().enumerate() {
        let mut b = vec![i as u8, 0];
        b.extend(&m.files[0].1);
        write("model_dir", &format!("m{i}-manifest.bin"), &b);
        for mode in 1..4u8 {
            // Overwrite 4 bytes at offset 64, then write a NaN at offset 128.
            let mut b = vec![
                i as u8, mode, 0, 64, 0, 0, 0, 4, 0xff, 0x7f, 0xff, 0x7f, 3, 128, 0, 0, 0, 0,
            ];
            if mode == 2 {
                b.extend([1, 0, 16, 0, 0, 0]); // and truncate experts.bin to 4096
            }
            write("model_dir", &format!("m{i}-patch{mode}.bin"), &b);
        }
        // Two structured manifest edits: set leaf 5 to an edge value, nudge leaf 20.
        let b = [
            i as u8, 4, 5, 0, 3, 8, 0, 0, 0, 0, 0, 0, 0, 20, 0, 6, 1, 0, 0, 0, 0, 0, 0, 0,
        ];
        write("model_dir", &format!("m{i}-edit.bin"), &b);
    }
    // tiktoken: [reader] + the fixture's files (a ranks file cut to 300 tokens).
    let tik = fixtures.join("tiktoken");
    let ranks = fs::read_to_string(tik.join("tiktoken.model")).unwrap();
    let cut: String = ranks.lines().take(300).map(|l| format!("{l}\n")).collect();
    for (sel, name, bytes) in [
        (0u8, "ranks", cut.into_bytes()),
        (
            1,
            "module",
            fs::read(tik.join("tokenization_kimi.py")).unwrap(),
        ),
        (
            2,
            "tokenizer-config",
            fs::read(tik.join("tokenizer_config.json")).unwrap(),
        ),
    ] {
        let mut b = vec![sel];
        b.extend(bytes);
        write("tiktoken", &format!("{name}.bin"), &b);
    }
    println!("seeds written to {}", root.display());
}
