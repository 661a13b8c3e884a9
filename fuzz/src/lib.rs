//! Fuzz harnesses for everything colibri reads from disk, shared by the cargo-fuzz targets in
//! `fuzz_targets/`, the seed generator (`examples/gen_seeds.rs`) and the stable smoke tests
//! (`tests/smoke.rs`).
//!
//! Each harness takes arbitrary bytes and must return without panicking, aborting or allocating
//! without bound: an `Err` from the engine is a correct answer to a broken input.
//!
//! * [`config_json`]: bytes -> `serde_json` -> [`ModelConfig::from_hf`] (and the family plan).
//! * [`checkpoint`]: byte 0 picks a tiny config, byte 1 the quantization, sharding and
//!   checkpoint form; the rest is the `model.safetensors` written next to it, then
//!   [`convert::convert`] runs.
//! * [`model_dir`]: byte 0 picks a converted tiny model, byte 1 which file to break (the manifest
//!   replaced by the rest, or `resident.bin` / `experts.bin` / the manifest patched by the ops
//!   that follow); then [`Model::load`] and a prefill + one decode step run; then the same
//!   directory, labelled format v2, goes through [`colibri_engine::upgrade::upgrade`] (and a
//!   directory it produces is loaded and run).
//! * [`slot_file`]: byte 0 picks the KV layout (plain, linear-attention states, rows per 2
//!   positions, MLA's compressed rows) and whether checksums are recomputed; the rest is a
//!   slot file for `colibri_engine::slotfile` to load.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

use colibri_engine::config::ModelConfig;
use colibri_engine::convert;
use colibri_engine::format::{Quant, EXPERTS_FILE, MANIFEST, RESIDENT_FILE};
use colibri_engine::model::glm4_moe;
use colibri_engine::model::plan::MLP_PARTS;
use colibri_engine::model::Model;
use colibri_engine::quant::Grid;
use safetensors::{Dtype, View};

/// OLMoE: full-width q/k norms, clip_qkv, all layers MoE, softmax top-k without renorm.
pub const OLMOE: &str = r#"{
  "architectures": ["OlmoeForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
  "num_attention_heads": 2, "num_key_value_heads": 1, "num_hidden_layers": 2,
  "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 16, "max_position_embeddings": 32,
  "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "clip_qkv": 8.0, "eos_token_id": 2,
  "bos_token_id": 1, "tie_word_embeddings": false
}"#;

/// Qwen3-MoE: explicit head_dim (q_dim != hidden), a dense `mlp_only_layers` layer, tied
/// embeddings, transformers-5 `rope_parameters`.
pub const QWEN3_MOE: &str = r#"{
  "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 8, "intermediate_size": 12,
  "moe_intermediate_size": 8, "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 6,
  "num_hidden_layers": 3, "mlp_only_layers": [1], "num_experts": 4, "num_experts_per_tok": 2,
  "norm_topk_prob": true, "vocab_size": 16, "max_position_embeddings": 32,
  "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
  "tie_word_embeddings": true, "eos_token_id": [2, 3]
}"#;

/// GLM-4.5-MoE: partial rotary, grouped sigmoid routing with correction bias, a shared expert,
/// a leading dense layer, q/k/v biases and an MTP layer (`model.layers.2.*`) to skip.
pub const GLM4_MOE: &str = r#"{
  "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
  "moe_intermediate_size": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
  "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4, "n_group": 2,
  "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1, "use_qk_norm": true,
  "routed_scaling_factor": 2.5, "norm_topk_prob": true, "vocab_size": 16,
  "max_position_embeddings": 32, "partial_rotary_factor": 0.5, "num_nextn_predict_layers": 1,
  "tie_word_embeddings": false, "eos_token_id": 2
}"#;

/// DeepSeek-V3 (Kimi K2's architecture): MLA with a query low-rank and YaRN (mscale as the
/// config says), a leading dense layer, group-limited sigmoid routing, a shared expert.
pub const DEEPSEEK_V3: &str = r#"{
  "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
  "moe_intermediate_size": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
  "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4, "n_group": 2,
  "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1, "norm_topk_prob": true,
  "routed_scaling_factor": 2.5, "q_lora_rank": 6, "kv_lora_rank": 4, "qk_nope_head_dim": 4,
  "qk_rope_head_dim": 2, "v_head_dim": 3, "vocab_size": 16, "max_position_embeddings": 32,
  "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
    "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0,
    "mscale": 1.0, "mscale_all_dim": 0.8},
  "rope_interleave": true, "tie_word_embeddings": false, "eos_token_id": 2
}"#;

/// GLM-5 (`glm_moe_dsa`): MLA with a query low-rank and the DSA indexer, whose top-k (2)
/// is smaller than the prompt, so its selection is exercised.
pub const GLM_MOE_DSA: &str = r#"{
  "architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
  "moe_intermediate_size": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
  "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4, "n_group": 2,
  "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1, "norm_topk_prob": true,
  "routed_scaling_factor": 2.5, "q_lora_rank": 6, "kv_lora_rank": 4, "qk_nope_head_dim": 4,
  "qk_rope_head_dim": 2, "v_head_dim": 3, "index_head_dim": 4, "index_n_heads": 2,
  "index_topk": 2, "vocab_size": 16, "max_position_embeddings": 32,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
  "tie_word_embeddings": false, "eos_token_id": 2
}"#;

/// DeepSeek-V4: hyper-connections, a sliding-window layer, a heavily compressed one and a
/// compressed sparse one (with its indexer), hash-routed then scored MoE layers, grouped
/// low-rank output.
pub const DEEPSEEK_V4: &str = r#"{
  "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
  "num_key_value_heads": 1, "head_dim": 8, "qk_rope_head_dim": 4, "partial_rotary_factor": 0.5,
  "q_lora_rank": 6, "o_lora_rank": 4, "o_groups": 2, "num_hidden_layers": 3,
  "layer_types": ["sliding_attention", "heavily_compressed_attention",
    "compressed_sparse_attention"],
  "mlp_layer_types": ["hash_moe", "moe", "moe"],
  "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
  "compress_rope_theta": 160000.0, "sliding_window": 2, "index_head_dim": 4,
  "index_n_heads": 2, "index_topk": 1, "hc_mult": 2, "hc_sinkhorn_iters": 3, "hc_eps": 1e-6,
  "moe_intermediate_size": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
  "n_shared_experts": 1, "norm_topk_prob": true, "routed_scaling_factor": 1.5,
  "scoring_func": "sqrtsoftplus", "swiglu_limit": 1.5, "vocab_size": 16,
  "max_position_embeddings": 32, "rope_theta": 10000.0,
  "rope_parameters": {"main": {"rope_type": "default", "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5}, "compress": {"rope_type": "yarn", "rope_theta": 160000.0,
    "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
    "partial_rotary_factor": 0.5}},
  "tie_word_embeddings": false, "eos_token_id": 2
}"#;

/// Qwen3-Next: gated DeltaNet linear attention beside a full-attention layer, a shared expert.
pub const QWEN3_NEXT: &str = r#"{
  "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
  "moe_intermediate_size": 4, "shared_expert_intermediate_size": 4,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4,
  "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
  "linear_conv_kernel_dim": 2, "linear_key_head_dim": 2, "linear_num_key_heads": 1,
  "linear_num_value_heads": 2, "linear_value_head_dim": 2, "num_experts": 4,
  "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 1,
  "vocab_size": 16, "max_position_embeddings": 32,
  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5},
  "tie_word_embeddings": false, "eos_token_id": 2
}"#;

/// Kimi Linear: KDA linear attention beside an MLA layer without a query low-rank, a
/// leading dense layer, grouped routing with a shared expert.
pub const KIMI_LINEAR: &str = r#"{
  "architectures": ["KimiLinearForCausalLM"], "hidden_size": 8, "intermediate_size": 8,
  "moe_intermediate_size": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
  "head_dim": 4, "num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
  "mlp_layer_types": ["dense", "sparse"], "linear_conv_kernel_dim": 2, "linear_head_dim": 2,
  "linear_num_heads": 2, "kv_lora_rank": 4, "q_lora_rank": null, "qk_nope_head_dim": 4,
  "qk_rope_head_dim": 2, "v_head_dim": 3, "num_experts": 4, "num_experts_per_token": 2,
  "num_expert_group": 2, "topk_group": 1, "num_shared_experts": 1, "moe_renormalize": true,
  "routed_scaling_factor": 2.0, "vocab_size": 16, "model_max_length": 32,
  "tie_word_embeddings": false, "eos_token_id": 2
}"#;

/// Every tiny config, by index: the harnesses pick one with a byte (`% CONFIGS.len()`).
pub const CONFIGS: [&str; 8] = [
    OLMOE,
    QWEN3_MOE,
    GLM4_MOE,
    DEEPSEEK_V3,
    GLM_MOE_DSA,
    DEEPSEEK_V4,
    QWEN3_NEXT,
    KIMI_LINEAR,
];

/// How many tiny configs there are.
pub const ARCHS: usize = CONFIGS.len();

/// A stand-in tokenizer: the converter only copies it.
pub const TOKENIZER: &str =
    r#"{"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}}"#;

/// Tokens fed to a loaded model (all below the tiny vocab of 16).
pub const PROMPT: [u32; 3] = [1, 7, 15];

pub fn config(i: usize) -> ModelConfig {
    let v: serde_json::Value =
        serde_json::from_str(CONFIGS[i % ARCHS]).expect("tiny config parses");
    ModelConfig::from_hf(&v).expect("tiny config is valid")
}

/// Deterministic values in about [-0.5, 0.5) (a 64-bit LCG; no RNG dependency).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    }
}

fn encode(vals: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::F32 => vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
        Dtype::BF16 => vals
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        Dtype::F16 => vals
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        other => panic!("tiny checkpoints are f32/bf16/f16, not {other:?}"),
    }
}

/// A tensor for `safetensors::serialize`.
pub struct Tensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        std::borrow::Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Every tensor of a valid checkpoint for tiny config `arch` (0 OLMoE, 1 Qwen3-MoE, 2 GLM),
/// stored as `dtype`; experts per expert or (`fused`) as transformers 5's 3-D tensors.
pub fn tiny_tensors(arch: usize, dtype: Dtype, fused: bool) -> Vec<(String, Tensor)> {
    let c = config(arch);
    let plan = convert::family_plan(&c);
    let mut rng = Lcg(arch as u64 * 1000 + fused as u64);
    let mut out = Vec::new();
    let mut out_tables = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, norm: bool| {
        let n: usize = shape.iter().product();
        let vals: Vec<f32> = (0..n)
            .map(|_| {
                if norm {
                    1.0 + rng.next() * 0.2
                } else {
                    rng.next()
                }
            })
            .collect();
        out.push((
            name,
            Tensor {
                dtype,
                data: encode(&vals, dtype),
                shape,
            },
        ));
    };
    let mut seen = std::collections::HashSet::new();
    for spec in &plan.resident {
        // GLM has attention biases on q/k/v (not o); the others have none.
        let biased = *c.family == glm4_moe::FAMILY && !spec.hf.contains("o_proj");
        // One checkpoint tensor may give several (MLA's kv_b_proj: W_uk^T and W_uv).
        if (spec.optional && !biased) || !seen.insert(spec.hf.clone()) {
            continue;
        }
        if spec.int_table {
            // DeepSeek-V4's token-to-experts table: valid expert ids, as I64.
            let shape = spec.source_shape();
            let n: usize = shape.iter().product();
            let data = (0..n)
                .flat_map(|k| ((k % c.num_experts) as i64).to_le_bytes())
                .collect();
            out_tables.push((
                spec.hf.clone(),
                Tensor {
                    dtype: Dtype::I64,
                    shape,
                    data,
                },
            ));
            continue;
        }
        add(
            spec.hf.clone(),
            spec.source_shape(),
            spec.hf.contains("norm"),
        );
    }
    let (h, i, e) = (c.hidden_size, c.moe_intermediate_size, c.num_experts);
    for (_, src) in &plan.expert_layers {
        if fused {
            add(
                format!("{}.gate_up_proj", src.prefix),
                vec![e, 2 * i, h],
                false,
            );
            add(format!("{}.down_proj", src.prefix), vec![e, h, i], false);
        } else {
            for x in 0..e {
                for part in MLP_PARTS {
                    let shape = if part == "down" {
                        vec![h, i]
                    } else {
                        vec![i, h]
                    };
                    add(
                        format!("{}.{x}.{part}_proj.weight", src.prefix),
                        shape,
                        false,
                    );
                }
            }
        }
    }
    if *c.family == glm4_moe::FAMILY {
        // The MTP layer past num_hidden_layers, and a rotary cache: both skipped by name.
        let l = c.num_layers;
        add(
            format!("model.layers.{l}.eh_proj.weight"),
            vec![h, 2 * h],
            false,
        );
        add(format!("model.layers.{l}.enorm.weight"), vec![h], true);
        add("model.rotary_emb.inv_freq".into(), vec![2], false);
    }
    out.extend(out_tables);
    out
}

pub fn serialize(tensors: &[(String, Tensor)]) -> Vec<u8> {
    safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), None).expect("serializes")
}

/// The `quantization_config` of a DeepSeek-V4-style checkpoint (FP8 projections in 4 x 4
/// blocks, FP4 experts, UE8M0 scales) that [`fp_quantized`] tensors go with.
pub const FP_QUANT_CONFIG: &str = r#"{"quant_method": "fp8", "fmt": "e4m3",
    "weight_block_size": [4, 4], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}"#;

/// The value of an e4m3 byte (NaN: None), as the converter reads it.
fn e4m3(b: u8) -> Option<f32> {
    let (exp, man) = ((b >> 3) & 0x0f, b & 0x07);
    if exp == 0x0f && man == 0x07 {
        return None;
    }
    let m = if exp == 0 {
        man as f32 / 8.0 * (-6f32).exp2()
    } else {
        (1.0 + man as f32 / 8.0) * (exp as f32 - 7.0).exp2()
    };
    Some(if b & 0x80 != 0 { -m } else { m })
}

/// The nearest code to `x` among `codes` (value, code).
fn nearest(x: f32, codes: impl Iterator<Item = (f32, u8)>) -> u8 {
    codes
        .min_by(|a, b| (a.0 - x).abs().total_cmp(&(b.0 - x).abs()))
        .expect("codes")
        .1
}

/// The values of an F32 tensor.
fn f32_values(t: &Tensor) -> Vec<f32> {
    assert_eq!(t.dtype, Dtype::F32);
    t.data
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A tensor the quantized forms below store quantized: a 2-D f32 projection weight (not, say,
/// DeepSeek-V4's integer token-to-experts table).
fn is_projection(name: &str, t: &Tensor) -> bool {
    t.dtype == Dtype::F32 && t.shape.len() == 2 && name.ends_with("_proj.weight")
}

/// `tensors` (f32; integer tables pass through) as DeepSeek-V4 publishes such weights: routed
/// experts FP4 (two e2m1 codes per `I8` byte, a UE8M0 scale per 32 elements of a row under
/// `X.scale`), the other projections FP8 e4m3 with UE8M0 scales per 4 x 4 block; every scale
/// 1.0 (byte 127).
pub fn fp_quantized(tensors: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    const E2M1: [f32; 16] = [
        0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
    ];
    let mut out = Vec::new();
    for (name, t) in tensors {
        let base = name.strip_suffix(".weight").map(str::to_string);
        let (Some(base), true) = (base, is_projection(&name, &t)) else {
            out.push((name, t));
            continue;
        };
        let vals = f32_values(&t);
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let scale = |shape: Vec<usize>| Tensor {
            dtype: Dtype::F8_E8M0,
            data: vec![127; shape.iter().product()],
            shape,
        };
        if name.contains(".experts.") && cols % 2 == 0 {
            let codes: Vec<u8> = vals
                .iter()
                .map(|&x| nearest(x, E2M1.iter().copied().zip(0u8..)))
                .collect();
            let data = codes.chunks_exact(2).map(|p| p[0] | (p[1] << 4)).collect();
            let w = Tensor {
                dtype: Dtype::I8,
                data,
                shape: vec![rows, cols / 2],
            };
            out.push((name, w));
            out.push((
                format!("{base}.scale"),
                scale(vec![rows, cols.div_ceil(32)]),
            ));
        } else {
            let table: Vec<(f32, u8)> = (0..=255u8).filter_map(|b| Some((e4m3(b)?, b))).collect();
            let data = vals
                .iter()
                .map(|&x| nearest(x, table.iter().copied()))
                .collect();
            let w = Tensor {
                dtype: Dtype::F8_E4M3,
                data,
                shape: t.shape.clone(),
            };
            out.push((name, w));
            out.push((
                format!("{base}.scale"),
                scale(vec![rows.div_ceil(4), cols.div_ceil(4)]),
            ));
        }
    }
    out
}

/// The `quantization_config` of a compressed-tensors int4 checkpoint (Kimi K2 Thinking's form,
/// groups of 4 here) that [`int4_packed`] tensors go with.
pub const INT4_CONFIG: &str = r#"{"quant_method": "compressed-tensors",
    "format": "pack-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
    "input_activations": null, "weights": {"num_bits": 4, "type": "int", "symmetric": true,
    "strategy": "group", "group_size": 4}}}}"#;

/// `tensors` (all f32) with every 2-D projection in compressed-tensors' packed int4 form:
/// `X.weight_packed` (I32, eight nibbles a word, `q + 8`), `X.weight_scale` (F32, one per 4
/// elements of a row, each group's largest magnitude / 7), `X.weight_shape` (I32 `[2]`).
pub fn int4_packed(tensors: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for (name, t) in tensors {
        if !is_projection(&name, &t) {
            out.push((name, t));
            continue;
        }
        let vals = f32_values(&t);
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let (groups, words) = (cols.div_ceil(4), cols.div_ceil(8));
        let mut scales = vec![0.0f32; rows * groups];
        for (i, x) in vals.iter().enumerate() {
            let g = &mut scales[(i / cols) * groups + (i % cols) / 4];
            *g = g.max(x.abs() / 7.0);
        }
        let mut packed = vec![0u8; rows * words * 4];
        for (i, x) in vals.iter().enumerate() {
            let (r, c) = (i / cols, i % cols);
            let s = scales[r * groups + c / 4];
            let q = if s > 0.0 {
                (x / s).round().clamp(-8.0, 7.0) as i32
            } else {
                0
            };
            packed[r * words * 4 + c / 2] |= ((q + 8) as u8) << (4 * (c % 2));
        }
        let tensor = |dtype, shape, data| Tensor { dtype, shape, data };
        let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect();
        let dims = [rows as i32, cols as i32]
            .iter()
            .flat_map(|d| d.to_le_bytes())
            .collect();
        out.push((
            format!("{name}_packed"),
            tensor(Dtype::I32, vec![rows, words], packed),
        ));
        out.push((
            format!("{name}_scale"),
            tensor(Dtype::F32, vec![rows, groups], f32s(&scales)),
        ));
        out.push((format!("{name}_shape"), tensor(Dtype::I32, vec![2], dims)));
    }
    out
}

/// The `quantization_config` of a compressed-tensors FP8 checkpoint (GLM-4.5-FP8's form: per
/// channel, activations dynamic) that [`fp8_per_channel`] tensors go with.
pub const FP8_CHANNEL_CONFIG: &str = r#"{"quant_method": "compressed-tensors",
    "format": "float-quantized", "config_groups": {"group_0": {"targets": ["Linear"],
    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true},
    "weights": {"num_bits": 8, "type": "float", "symmetric": true, "strategy": "channel"}}}}"#;

/// `tensors` (all f32) with every 2-D projection FP8 e4m3 beside `X.weight_scale` (F32
/// `[rows, 1]`, each row's largest magnitude / 448).
pub fn fp8_per_channel(tensors: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    let table: Vec<(f32, u8)> = (0..=255u8).filter_map(|b| Some((e4m3(b)?, b))).collect();
    let mut out = Vec::new();
    for (name, t) in tensors {
        if !is_projection(&name, &t) {
            out.push((name, t));
            continue;
        }
        let vals = f32_values(&t);
        let (rows, cols) = (t.shape[0], t.shape[1]);
        let scales: Vec<f32> = vals
            .chunks_exact(cols)
            .map(|r| {
                r.iter()
                    .fold(0.0f32, |m, x| m.max(x.abs() / 448.0))
                    .max(f32::MIN_POSITIVE)
            })
            .collect();
        let data = vals
            .iter()
            .enumerate()
            .map(|(i, &x)| nearest(x / scales[i / cols], table.iter().copied()))
            .collect();
        let scale = scales.iter().flat_map(|x| x.to_le_bytes()).collect();
        out.push((
            name.clone(),
            Tensor {
                dtype: Dtype::F8_E4M3,
                shape: t.shape.clone(),
                data,
            },
        ));
        out.push((
            format!("{name}_scale"),
            Tensor {
                dtype: Dtype::F32,
                shape: vec![rows, 1],
                data: scale,
            },
        ));
    }
    out
}

/// A quantized form of a checkpoint's tensors (from all-f32 ones).
pub type QuantizedForm = fn(Vec<(String, Tensor)>) -> Vec<(String, Tensor)>;

/// The quantized checkpoint forms the `checkpoint` harness knows: its selector bit, a name
/// (seed files), the tensors' form and the `quantization_config` that says so.
pub const QUANTIZED_FORMS: [(u8, &str, QuantizedForm, &str); 3] = [
    (32, "fp8-fp4", fp_quantized, FP_QUANT_CONFIG),
    (64, "int4-packed", int4_packed, INT4_CONFIG),
    (128, "fp8-channel", fp8_per_channel, FP8_CHANNEL_CONFIG),
];

/// A valid `model.safetensors` for tiny config `arch`.
pub fn tiny_checkpoint(arch: usize, dtype: Dtype, fused: bool) -> Vec<u8> {
    serialize(&tiny_tensors(arch, dtype, fused))
}

/// A fresh, empty scratch directory (unique per process and call site).
pub fn scratch(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    // Conversions fsync their outputs: RAM-backed /dev/shm keeps iterations fast.
    let shm = Path::new("/dev/shm");
    let base = std::env::var_os("COLIBRI_FUZZ_TMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            if shm.is_dir() {
                shm.to_path_buf()
            } else {
                std::env::temp_dir()
            }
        });
    let d = base.join(format!(
        "colibri-fuzz-{}-{tag}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).expect("scratch dir");
    d
}

/// Writes a checkpoint directory: tiny config `arch`, the tokenizer, and `shards` as
/// `model.safetensors` (one) or `model-0000i-of-0000n.safetensors`.
pub fn write_checkpoint(dir: &Path, arch: usize, shards: &[&[u8]]) {
    fs::write(dir.join("config.json"), CONFIGS[arch % ARCHS]).unwrap();
    fs::write(dir.join("tokenizer.json"), TOKENIZER).unwrap();
    for entry in fs::read_dir(dir).unwrap().flatten() {
        if entry.path().extension().is_some_and(|x| x == "safetensors") {
            fs::remove_file(entry.path()).unwrap();
        }
    }
    if shards.len() == 1 {
        fs::write(dir.join("model.safetensors"), shards[0]).unwrap();
    } else {
        for (i, s) in shards.iter().enumerate() {
            fs::write(
                dir.join(format!(
                    "model-{:05}-of-{:05}.safetensors",
                    i + 1,
                    shards.len()
                )),
                s,
            )
            .unwrap();
        }
    }
}

/// Every key `ModelConfig::from_hf` reads, for structured edits.
pub const CONFIG_KEYS: [&str; 33] = [
    "architectures",
    "hidden_act",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_parameters",
    "rope_scaling",
    "rope_theta",
    "partial_rotary_factor",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "intermediate_size",
    "num_experts_per_tok",
    "num_experts",
    "norm_topk_prob",
    "clip_qkv",
    "use_sliding_window",
    "num_local_experts",
    "decoder_sparse_step",
    "mlp_only_layers",
    "moe_intermediate_size",
    "n_routed_experts",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "first_k_dense_replace",
    "n_shared_experts",
    "use_qk_norm",
    "tie_word_embeddings",
    "eos_token_id",
];

/// JSON pointers to every number and string in `v`.
fn json_leaves(v: &serde_json::Value, path: &mut String, out: &mut Vec<String>) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let len = path.len();
                path.push('/');
                path.push_str(&k.replace('~', "~0").replace('/', "~1"));
                json_leaves(x, path, out);
                path.truncate(len);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("/{i}"));
                json_leaves(x, path, out);
                path.truncate(len);
            }
        }
        Value::Number(_) | Value::String(_) => out.push(path.clone()),
        _ => {}
    }
}

/// Structured JSON edits, 11 bytes each: `[target u16 le, kind u8, value u64 le]`. The target is
/// one of `v`'s number/string leaves, or (past them) one of `extra_keys` set at the top level.
/// Kinds set edge-case numbers, nudge a number by -4..=4, set a float, null, remove the member,
/// or set one of a few telling strings, so offsets, sizes and names reach their corner cases
/// far faster than byte mutations of JSON text do.
pub fn edit_json(v: &mut serde_json::Value, mut ops: &[u8], extra_keys: &[&str]) {
    use serde_json::{json, Value};
    const EDGES: [u64; 10] = [
        0,
        1,
        2,
        4096,
        1 << 20,
        (1 << 20) + 1,
        1 << 32,
        1 << 63,
        u64::MAX,
        u64::MAX - 3,
    ];
    const STRINGS: [&str; 8] = [
        "q4",
        "f32",
        "../x.bin",
        "experts.bin",
        "resident.bin",
        "",
        "yarn",
        "LlamaForCausalLM",
    ];
    while ops.len() >= 11 {
        let target = u16::from_le_bytes([ops[0], ops[1]]) as usize;
        let kind = ops[2] % 8;
        let val = u64::from_le_bytes(ops[3..11].try_into().unwrap());
        ops = &ops[11..];
        let mut leaves = Vec::new();
        json_leaves(v, &mut String::new(), &mut leaves);
        let n = leaves.len() + extra_keys.len();
        if n == 0 {
            return;
        }
        let t = target % n;
        let pointer = if t < leaves.len() {
            leaves[t].clone()
        } else {
            let key = extra_keys[t - leaves.len()];
            if !v.is_object() {
                continue;
            }
            v[key] = json!(0);
            format!("/{key}")
        };
        if kind == 7 {
            // Remove the member (or array element), or set a string.
            let is_string = v.pointer(&pointer).is_some_and(Value::is_string);
            if is_string || val % 2 == 0 {
                *v.pointer_mut(&pointer).unwrap() = json!(STRINGS[(val / 2 % 8) as usize]);
                continue;
            }
            let (parent, last) = pointer.rsplit_once('/').unwrap();
            match v.pointer_mut(parent) {
                Some(Value::Object(m)) => {
                    m.remove(&last.replace("~1", "/").replace("~0", "~"));
                }
                Some(Value::Array(a)) => {
                    if let Ok(i) = last.parse::<usize>() {
                        if i < a.len() {
                            a.remove(i);
                        }
                    }
                }
                _ => {}
            }
            continue;
        }
        let slot = v.pointer_mut(&pointer).unwrap();
        *slot = match kind {
            0 => json!(val),
            1 => json!(val % 16),
            2 => json!(-((val % 1000) as i64) - 1),
            3 => json!(EDGES[(val % 10) as usize]),
            4 => {
                let f = f64::from_bits(val);
                json!(if f.is_finite() { f } else { 0.5 })
            }
            5 => Value::Null,
            _ => match slot.as_u64() {
                Some(x) => json!(x.wrapping_add(val % 9).wrapping_sub(4)),
                None => json!(val % 9),
            },
        };
    }
}

/// Harness (a): `config.json` bytes must parse to a config or an error, never a panic. Input
/// starting with `{` (or whitespace) is JSON text; otherwise byte 0 picks a tiny config and the
/// rest are [`edit_json`] ops on it.
/// Tokenizer files of a tiktoken checkpoint (`convert::tiktoken`): byte 0 picks the reader,
/// the rest is its input. 0: a `tiktoken.model` ranks file (and, when it parses, the
/// `tokenizer.json` made from it, whose vocabulary and merges must match the ranks); 1: a
/// tokenizer module's source, for its split pattern; 2: `tokenizer_config.json`, for the
/// special tokens after 256 ranks in a vocabulary of 256 to 319.
pub fn tiktoken(data: &[u8]) {
    use convert::tiktoken::{added_tokens, parse_ranks, split_pattern, tokenizer_json};
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    match sel % 3 {
        0 => {
            if let Ok(ranks) = parse_ranks(rest) {
                assert!(ranks.len() >= 256, "every byte is a token");
                let tj = tokenizer_json(&ranks, r"\s+", &[]);
                let vocab = tj["model"]["vocab"].as_object().expect("a vocabulary");
                assert_eq!(vocab.len(), ranks.len(), "one entry per rank");
                let merges = tj["model"]["merges"].as_array().expect("merges");
                for m in merges {
                    let joined = format!("{}{}", m[0].as_str().unwrap(), m[1].as_str().unwrap());
                    assert!(vocab.contains_key(&joined), "a merge makes a token");
                }
            }
        }
        1 => {
            if let Ok(p) = split_pattern(&String::from_utf8_lossy(rest)) {
                assert!(!p.is_empty(), "a pattern read is not empty");
            }
        }
        _ => {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(rest) else {
                return;
            };
            let vocab = 256 + usize::from(sel) % 64;
            if let Ok(added) = added_tokens(&v, 256, vocab) {
                let ids: Vec<usize> = added.iter().map(|a| a.id).collect();
                assert_eq!(
                    ids,
                    (256..vocab).collect::<Vec<_>>(),
                    "each id once, in order"
                );
            }
        }
    }
}

pub fn config_json(data: &[u8]) {
    let v = match data.first() {
        None => return,
        Some(b'{' | b' ' | b'\n' | b'\t' | b'\r') => {
            let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) else {
                return;
            };
            v
        }
        Some(&sel) => {
            let mut v: serde_json::Value =
                serde_json::from_str(CONFIGS[sel as usize % ARCHS]).unwrap();
            edit_json(&mut v, &data[1..], &CONFIG_KEYS);
            v
        }
    };
    // A multimodal wrapper's text model, as conversion reads it (Kimi K2.5's).
    let Ok((v, _)) = convert::text_only::text_model(&v) else {
        return;
    };
    if let Ok(c) = ModelConfig::from_hf(&v) {
        // A config that parses must also give a plan (shapes are computed there).
        let plan = convert::family_plan(&c);
        assert!(
            plan.resident.len() >= 2,
            "a plan has at least the embedding and the norm"
        );
        let _ = (c.q_dim(), c.kv_dim());
    }
}

/// Per thread: a file mapped by one harness call must not be rewritten by another.
fn checkpoint_dir() -> PathBuf {
    thread_local! {
        static DIR: PathBuf = scratch("checkpoint");
    }
    DIR.with(|d| d.clone())
}

/// Harness (b): byte 0 = the tiny config (`% ARCHS`); byte 1's bit 2 = f32 output instead of
/// int4, bit 3 = split the safetensors bytes into two shards at the position in the next 2
/// bytes, bit 4 = the next byte `k` then `11 * k` bytes of [`edit_json`] ops change the config
/// (so it can disagree with the tensors), bits 5-7 a quantized checkpoint form. The rest is the
/// safetensors file(s).
pub fn checkpoint(data: &[u8]) {
    let [arch, sel, ref rest @ ..] = *data else {
        return;
    };
    let mut rest = rest;
    let arch = arch as usize % ARCHS;
    let quant = if sel & 4 != 0 {
        Quant::F32
    } else {
        Quant::Int4
    };
    let dir = &checkpoint_dir();
    let hf = dir.join("hf");
    let out = dir.join("out");
    fs::create_dir_all(&hf).unwrap();
    let _ = fs::remove_dir_all(&out);
    let mut config = None;
    if sel & 16 != 0 && !rest.is_empty() {
        let n = (11 * rest[0] as usize).min(rest.len() - 1);
        let mut v: serde_json::Value = serde_json::from_str(CONFIGS[arch]).unwrap();
        edit_json(&mut v, &rest[1..1 + n], &CONFIG_KEYS);
        config = Some(v.to_string());
        rest = &rest[1 + n..];
    }
    // Bits 5-7: the checkpoint says it is in one of `QUANTIZED_FORMS` (FP8 / FP4,
    // compressed-tensors int4, compressed-tensors FP8; the highest bit wins); a valid one must
    // still convert, load and run.
    let quant_config = QUANTIZED_FORMS
        .iter()
        .rev()
        .find(|form| sel & form.0 != 0)
        .map(|form| form.3);
    if sel & 8 != 0 && rest.len() >= 2 {
        let at = u16::from_le_bytes([rest[0], rest[1]]) as usize;
        rest = &rest[2..];
        let (a, b) = rest.split_at(at.min(rest.len()));
        write_checkpoint(&hf, arch, &[a, b]);
    } else {
        write_checkpoint(&hf, arch, &[rest]);
    }
    if let Some(c) = &config {
        fs::write(hf.join("config.json"), c).unwrap();
    }
    if let Some(q) = quant_config {
        let path = hf.join("config.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&path).unwrap()).unwrap();
        v["quantization_config"] = serde_json::from_str(q).unwrap();
        fs::write(path, v.to_string()).unwrap();
    }
    if let Ok(summary) = convert::convert(&hf, &out, quant, &mut |_, _, _| {}) {
        if config.is_some() {
            // An edited config may legitimately give a model that cannot run (e.g. a context
            // of 0 positions): only "no panic" is asked of it.
            run_model(&out);
            return;
        }
        // Whatever converts must load and run.
        assert!(out.join(MANIFEST).is_file());
        let model = Model::load(&out, Some(1))
            .unwrap_or_else(|e| panic!("converted model does not load: {e}"));
        let mut kv = model.new_cache();
        model
            .forward(&PROMPT, &mut kv, false)
            .unwrap_or_else(|e| panic!("forward failed: {e}"));
        let _ = summary;
    }
}

/// A converted tiny model (arch `i % ARCHS`; `i / ARCHS`: 0 int4, 1 f32, 2 int4 on the table
/// grid, `q4t`; Qwen3-MoE's f32 one from transformers 5's fused expert tensors): its manifest,
/// resident and experts bytes.
pub struct BaseModel {
    pub files: [(String, Vec<u8>); 3],
}

/// How many conversions of each tiny checkpoint [`base_models`] holds.
pub const MODEL_KINDS: usize = 3;

pub fn base_models() -> &'static [BaseModel] {
    static MODELS: OnceLock<Vec<BaseModel>> = OnceLock::new();
    MODELS.get_or_init(|| {
        let root = scratch("base");
        let models = (0..MODEL_KINDS * ARCHS)
            .map(|i| {
                let (arch, quant) = (
                    i % ARCHS,
                    if i / ARCHS == 1 {
                        Quant::F32
                    } else {
                        Quant::Int4
                    },
                );
                let prec = convert::Precisions {
                    grid: if i / ARCHS == 2 {
                        Grid::Table
                    } else {
                        Grid::Linear
                    },
                    ..convert::Precisions::default()
                };
                let hf = root.join(format!("hf{i}"));
                let out = root.join(format!("out{i}"));
                fs::create_dir_all(&hf).unwrap();
                let fused = i == ARCHS + 1;
                write_checkpoint(&hf, arch, &[&tiny_checkpoint(arch, Dtype::BF16, fused)]);
                convert::convert_with(&hf, &out, quant, &prec, &mut |_, _, _| {})
                    .unwrap_or_else(|e| panic!("tiny model {i} does not convert: {e}"));
                let read = |n: &str| (n.to_string(), fs::read(out.join(n)).unwrap());
                BaseModel {
                    files: [read(MANIFEST), read(RESIDENT_FILE), read(EXPERTS_FILE)],
                }
            })
            .collect();
        let _ = fs::remove_dir_all(&root);
        models
    })
}

/// Applies patch ops to `buf`: each op is `[kind, offset u32 le, len u8, bytes...]`;
/// kind % 4: 0 overwrite at offset, 1 truncate to offset, 2 append, 3 write an extreme f32
/// (NaN, inf, -inf, 1e38 by `len % 4`) at offset.
pub fn apply_patches(buf: &mut Vec<u8>, mut ops: &[u8]) {
    while ops.len() >= 6 {
        let kind = ops[0] % 4;
        let off = u32::from_le_bytes([ops[1], ops[2], ops[3], ops[4]]) as usize;
        let len = ops[5] as usize;
        ops = &ops[6..];
        let take = if kind == 3 { 0 } else { len.min(ops.len()) };
        let bytes = &ops[..take];
        ops = &ops[take..];
        match kind {
            0 if !buf.is_empty() => {
                let at = off % buf.len();
                let end = (at + bytes.len()).min(buf.len());
                buf[at..end].copy_from_slice(&bytes[..end - at]);
            }
            1 => buf.truncate(off % (buf.len() + 1)),
            2 => buf.extend_from_slice(bytes),
            3 if buf.len() >= 4 => {
                let v = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e38][len % 4];
                let at = (off % (buf.len() - 3)) & !3;
                buf[at..at + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {}
        }
    }
}

/// Per thread: a file mapped by one harness call must not be rewritten by another.
fn model_dir_scratch() -> PathBuf {
    thread_local! {
        static DIR: PathBuf = scratch("model");
    }
    DIR.with(|d| d.clone())
}

/// Removes the calling thread's scratch directories (the stable tests call this when done).
pub fn cleanup_thread_scratch() {
    let _ = fs::remove_dir_all(checkpoint_dir());
    let _ = fs::remove_dir_all(model_dir_scratch());
}

/// Harness (c): byte 0 = base model (`% (MODEL_KINDS * ARCHS)`), byte 1 = what to break (`% 5`): 0 the
/// manifest is replaced by the rest; 1 `resident.bin`, 2 `experts.bin`, 3 the manifest are
/// patched by the rest as [`apply_patches`] ops; 4 the manifest gets [`edit_json`] ops (its
/// numbers and names). Then load, prefill [`PROMPT`] and decode one more token.
pub fn model_dir(data: &[u8]) {
    if data.len() < 2 {
        return;
    }
    let base = &base_models()[data[0] as usize % (MODEL_KINDS * ARCHS)];
    let rest = &data[2..];
    let dir = &model_dir_scratch();
    for (i, (name, bytes)) in base.files.iter().enumerate() {
        let bytes = match (data[1] % 5, i) {
            (0, 0) => rest.to_vec(),
            (4, 0) => {
                let mut v: serde_json::Value = serde_json::from_slice(bytes).unwrap();
                edit_json(&mut v, rest, &[]);
                serde_json::to_vec(&v).unwrap()
            }
            (m, f) if (m as usize == f && m > 0) || (m == 3 && f == 0) => {
                let mut b = bytes.clone();
                apply_patches(&mut b, rest);
                b
            }
            _ => bytes.clone(),
        };
        fs::write(dir.join(name), bytes).unwrap();
    }
    run_model(dir);
    upgrade_as_v2(dir);
}

/// The same (broken) directory labelled format v2 and upgraded into a sibling directory; if
/// that succeeds, the result is loaded and run too.
fn upgrade_as_v2(dir: &Path) {
    let manifest = dir.join(MANIFEST);
    if let Ok(mut v) = serde_json::from_slice::<serde_json::Value>(&fs::read(&manifest).unwrap()) {
        if let Some(m) = v.as_object_mut() {
            m.insert("version".into(), 2.into());
            fs::write(&manifest, serde_json::to_vec(&v).unwrap()).unwrap();
        }
    }
    let up = dir.with_extension("upgraded");
    let _ = fs::remove_dir_all(&up);
    if colibri_engine::upgrade::upgrade(dir, &up, &mut |_, _, _| {}).is_ok() {
        run_model(&up);
    }
    let _ = fs::remove_dir_all(&up);
}

/// Loads a model directory and runs a prefill and one decode step; errors are fine.
pub fn run_model(dir: &Path) {
    let Ok(model) = Model::load(dir, Some(1)) else {
        return;
    };
    let mut kv = model.new_cache();
    if let Ok(logits) = model.forward(&PROMPT, &mut kv, true) {
        assert_eq!(logits.len(), PROMPT.len() * model.cfg.vocab_size);
        let _ = model.forward(&[3], &mut kv, false);
    }
}

// KV slot files (`colibri_engine::slotfile`): the `slot_file` target's harness.

pub const SLOT_LAYERS: usize = 2;
/// The key and value width of the plain (version-1) files' layers.
pub const SLOT_KV_DIM: usize = 3;
pub const SLOT_FP: [u8; 32] = [0xa5; 32];

/// The per-layer state widths of the layered (version-2 and -3) slot files the harness reads:
/// the first layer keeps a 4-float state (a linear-attention layer's).
pub const SLOT_STATES: [usize; SLOT_LAYERS] = [4, 0];

/// The layout of the layered files, by byte 0 of the input: two layers of 3 keys and 3 values;
/// bit 2 set: the second layer keeps a row per 2 positions (DeepSeek-V4's compressed entries);
/// bit 3 set: MLA's compressed rows instead, one run of 5 (latent and rope key) with 2 indexer
/// keys beside it (GLM-5's DSA layers) in the first layer, with none in the second.
pub fn slot_layout(mode: u8) -> colibri_engine::kv::KvLayout {
    use colibri_engine::kv::{KvLayout, LayerKv};
    let mut layout = if mode & 8 == 8 {
        KvLayout {
            layers: vec![
                LayerKv::per_position(1, 5, 2),
                LayerKv::per_position(1, 5, 0),
            ],
        }
    } else {
        KvLayout::uniform(SLOT_LAYERS, 1, SLOT_KV_DIM)
    };
    if mode & 4 == 4 {
        layout.layers[1].every = 2;
    }
    layout
}

/// Harness (d): byte 0 odd: recompute every checksum first (`reseal`), so mutated fields reach
/// the replay. Bits 1-3 clear: the rest is a version-1 file of [`SLOT_LAYERS`] layers of
/// [`SLOT_KV_DIM`]; otherwise a layered file of [`slot_layout`] with [`SLOT_STATES`]. An `Err`
/// is a correct answer; a panic, or a loaded state whose shape does not match the layout, is
/// a bug.
pub fn slot_file(data: &[u8]) {
    use colibri_engine::slotfile::{load_bytes, load_bytes_states, reseal, reseal_layout_states};
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if mode & 14 != 0 {
        let layout = slot_layout(mode);
        if mode & 1 == 1 {
            reseal_layout_states(&mut bytes, &layout, &SLOT_STATES);
        }
        if let Ok(Some(s)) = load_bytes_states(&bytes, SLOT_FP, &layout, &SLOT_STATES) {
            for (l, layer) in layout.layers.iter().enumerate() {
                let rows = layer.rows(s.tokens.len()) * layer.heads;
                assert_eq!(s.keys[l].len(), rows * layer.key_dim);
                assert_eq!(s.values[l].len(), rows * layer.value_dim);
            }
            let widths: Vec<usize> = s.states.iter().map(Vec::len).collect();
            assert_eq!(widths, SLOT_STATES);
        }
        return;
    }
    if mode & 1 == 1 {
        reseal(&mut bytes, SLOT_LAYERS, SLOT_KV_DIM);
    }
    if let Ok(Some(s)) = load_bytes(&bytes, SLOT_FP, SLOT_LAYERS, SLOT_KV_DIM) {
        assert_eq!(s.keys.len(), SLOT_LAYERS);
        assert_eq!(s.values.len(), SLOT_LAYERS);
        for v in s.keys.iter().chain(&s.values) {
            assert_eq!(v.len(), s.tokens.len() * SLOT_KV_DIM);
        }
    }
}
