//! DeepSeek-V3 (`DeepseekV3ForCausalLM`, also the architecture of Kimi K2 checkpoints):
//! multi-head latent attention (`layers/mla.rs`: `q_lora_rank` or a full `q_proj`,
//! `kv_lora_rank`, `qk_nope_head_dim` / `qk_rope_head_dim` / `v_head_dim`, `rope_interleave`)
//! and GLM-4.5's MoE scheme (`glm4_moe.rs`: the first `first_k_dense_replace` layers dense,
//! sigmoid routing with `e_score_correction_bias` restricted to the best `topk_group` of
//! `n_group` groups, `routed_scaling_factor`, `n_shared_experts`). With YaRN and
//! `mscale_all_dim` the softmax scale is multiplied by `mscale^2` as transformers does. Layers
//! past `num_hidden_layers` (the multi-token-prediction head of the published checkpoints) are
//! skipped at conversion.

use super::glm4_moe;
use super::registry::Family;
use crate::config::{bad, AttentionKind, MlaDims, ModelConfig, Reader, MAX_DIM};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: "DeepseekV3ForCausalLM",
    chat_family: "deepseek_v31",
    reads_head_dim: false,
    default_rotary_fraction: 1.0,
    default_rms_norm_eps: 1e-6,
    configure,
    plan: glm4_moe::tensor_plan,
    checkpoint_name: None,
    config_aliases: &[],
};

fn configure(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    // transformers' DeepseekV3Config defaults for the fields a config leaves out.
    let defaults = glm4_moe::MoeDefaults {
        first_k_dense_replace: 3,
        n_group: 8,
        topk_group: 4,
        routed_scaling_factor: 2.5,
    };
    glm4_moe::configure_sigmoid_moe(r, c, defaults)?;
    // Older DeepSeek configs name the router's scheme; transformers' DeepSeek-V3 has only this
    // one, so any other is refused rather than run as this one.
    for (key, want) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
        if let Some(v) = r.get(key) {
            if v.as_str() != Some(want) {
                return Err(bad(format!(
                    "config.json: `{key}` {v} is not supported for DeepseekV3ForCausalLM \
                     (only \"{want}\")"
                )));
            }
        }
    }
    if r.bool_or("attention_bias", false)? {
        return Err(bad(
            "config.json: `attention_bias` true is not supported for DeepseekV3ForCausalLM",
        ));
    }
    // Required (null for a full q_proj): transformers would read an absent one as 1536.
    if !r.has("q_lora_rank") {
        return Err(bad(
            "config.json: missing `q_lora_rank` (null for a model with a full q_proj)",
        ));
    }
    let q_lora_rank = match r.get("q_lora_rank") {
        None => None,
        Some(_) => Some(r.size_req("q_lora_rank", 1, MAX_DIM)?),
    };
    let interleave = r.bool_or("rope_interleave", true)?;
    c.attention = AttentionKind::Mla(read_mla(r, c, q_lora_rank, interleave)?);
    Ok(())
}

/// The MLA fields every MLA family reads (`kv_lora_rank`, `qk_nope_head_dim`,
/// `qk_rope_head_dim`, `v_head_dim`, the YaRN softmax scale), with the query's rank and the rope
/// layout as the family decides them; sets `head_dim` to the rope width.
pub(super) fn read_mla(
    r: &Reader,
    c: &mut ModelConfig,
    q_lora_rank: Option<usize>,
    rope_interleave: bool,
) -> Result<MlaDims> {
    let kv_lora_rank = r.size_req("kv_lora_rank", 1, MAX_DIM)?;
    let nope = r.size_req("qk_nope_head_dim", 0, MAX_DIM)?;
    let rope = r.size_req("qk_rope_head_dim", 2, MAX_DIM)?;
    if rope % 2 != 0 {
        return Err(bad(format!(
            "config.json: `qk_rope_head_dim` is {rope}, must be even"
        )));
    }
    let v = r.size_req("v_head_dim", 1, MAX_DIM)?;
    let heads = c.num_heads;
    for (what, width) in [
        (
            "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
            nope + rope,
        ),
        (
            "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
            nope + v,
        ),
        ("kv_lora_rank + qk_rope_head_dim", kv_lora_rank + rope),
    ] {
        let total = if what.starts_with("num") {
            heads * width
        } else {
            width
        };
        if total > MAX_DIM {
            return Err(bad(format!(
                "config.json: {what} = {total} exceeds {MAX_DIM}"
            )));
        }
    }
    let mut scale = 1.0 / ((nope + rope) as f64).sqrt();
    // transformers (`yarn_apply_mscale`): with a RoPE type other than `default` that gives
    // `mscale_all_dim`, the scale is multiplied by yarn_get_mscale(factor, mscale_all_dim)^2.
    if let Some(p) = r.get("rope_parameters").or_else(|| r.get("rope_scaling")) {
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(|x| x.as_str())
            .unwrap_or("default");
        let m_all = p
            .get("mscale_all_dim")
            .and_then(|x| x.as_f64())
            .unwrap_or(0.0);
        if kind != "default" && m_all != 0.0 {
            let factor = p.get("factor").and_then(|x| x.as_f64()).ok_or_else(|| {
                bad("config.json: RoPE scaling with `mscale_all_dim` needs a numeric `factor`")
            })?;
            let m = if factor <= 1.0 {
                1.0
            } else {
                0.1 * m_all * factor.ln() + 1.0
            };
            scale *= m * m;
        }
    }
    // RoPE rotates the shared rope key and each head's rope query: `head_dim` is their width.
    c.head_dim = rope;
    Ok(MlaDims {
        q_lora_rank,
        kv_lora_rank,
        qk_nope_head_dim: nope,
        qk_rope_head_dim: rope,
        v_head_dim: v,
        rope_interleave,
        softmax_scale: scale as f32,
        positional: true,
    })
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::config::{AttentionKind, FfnKind, ModelConfig};
    use crate::convert::text_only;
    use crate::kv::{KvCache, KvDtype};
    use crate::model::layers::{kv_layout, with_states};

    /// DeepSeek-V3's published config.json (the 671B release: FP8 blocks, one
    /// multi-token-prediction layer), every field as published.
    fn deepseek_v3_671b() -> Value {
        serde_json::from_str(
            r#"{
            "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
            "attention_dropout": 0.0, "aux_loss_alpha": 0.001, "bos_token_id": 0,
            "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
            "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
            "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
            "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
            "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
            "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
            "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
            "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3",
                "quant_method": "fp8", "weight_block_size": [128, 128]},
            "rms_norm_eps": 1e-06,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
            "seq_aux": true, "tie_word_embeddings": false, "topk_group": 4,
            "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
            "transformers_version": "4.33.1", "use_cache": true, "v_head_dim": 128,
            "vocab_size": 129280
        }"#,
        )
        .unwrap()
    }

    /// Kimi K2.5's config.json as its text model is published inside the multimodal wrapper:
    /// Kimi K2's shape (384 experts, 64 heads, one dense layer, YaRN x64 of 4096 positions)
    /// with the routed experts in compressed-tensors int4 (groups of 32).
    fn kimi_k25() -> Value {
        let quantization = json!({"quant_method": "compressed-tensors",
            "format": "pack-quantized", "quantization_status": "compressed",
            "kv_cache_scheme": null,
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
            "config_groups": {"group_0": {"targets": ["Linear"],
                "input_activations": null, "output_activations": null,
                "weights": {"num_bits": 4, "type": "int", "symmetric": true,
                    "strategy": "group", "group_size": 32, "dynamic": false,
                    "observer": "minmax", "actorder": null}}}});
        let mut text = json!({
            "model_type": "kimi_k2", "attention_bias": false, "attention_dropout": 0.0,
            "aux_loss_alpha": 0.001, "bos_token_id": 163584, "eos_token_id": 163585,
            "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 7168,
            "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
            "max_position_embeddings": 262144, "moe_intermediate_size": 2048,
            "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 384,
            "n_shared_experts": 1, "norm_topk_prob": true, "num_attention_heads": 64,
            "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 64,
            "num_nextn_predict_layers": 0, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05,
            "rope_theta": 50000.0, "routed_scaling_factor": 2.827,
            "scoring_func": "sigmoid", "seq_aux": true, "topk_group": 1,
            "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": true,
            "v_head_dim": 128, "vocab_size": 163840,
        });
        text["rope_scaling"] = json!({"beta_fast": 1.0, "beta_slow": 1.0, "factor": 64.0,
            "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
            "type": "yarn"});
        text["quantization_config"] = quantization;
        json!({
            "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "media_placeholder_token_id": 163605, "pad_token_id": 163839,
            "bos_token_id": 163584, "eos_token_id": 163585, "tie_word_embeddings": false,
            "use_unified_vision_chunk": true,
            "video_placeholder": "<|kimi_k25_video_placeholder|>",
            "vision_config": {"patch_size": 14, "merge_kernel_size": [2, 2],
                "mm_projector_type": "patchmerger", "mm_hidden_size": 1152,
                "text_hidden_size": 7168},
            "text_config": text,
        })
    }

    /// What shapes a checkpoint of `c`'s memory: layer kinds, experts, the latent per position.
    fn check_mla(c: &ModelConfig, dense: usize, experts: usize, heads: usize, yarn: f64) {
        assert_eq!(c.num_layers, 61);
        assert!(c.layers[..dense].iter().all(|&k| k == FfnKind::Dense));
        assert!(c.layers[dense..].iter().all(|&k| k == FfnKind::Moe));
        assert_eq!(
            (c.num_experts, c.top_k, c.moe_intermediate_size),
            (experts, 8, 2048)
        );
        assert_eq!((c.hidden_size, c.num_heads), (7168, heads));
        let AttentionKind::Mla(d) = &c.attention else {
            panic!("{:?}", c.attention)
        };
        let dims = (
            d.q_lora_rank,
            d.kv_lora_rank,
            d.qk_nope_head_dim,
            d.qk_rope_head_dim,
        );
        assert_eq!((dims, d.v_head_dim), ((Some(1536), 512, 128, 64), 128));
        // qk_head_dim^-0.5, times YaRN's mscale squared (mscale_all_dim 1.0).
        let m = 0.1 * yarn.ln() + 1.0;
        let want = m * m / 192f64.sqrt();
        assert!(
            (d.softmax_scale as f64 - want).abs() < 1e-6,
            "{}",
            d.softmax_scale
        );
        // The slot keeps the latent and the rope key: 576 values a layer, f16.
        let kv = with_states(c, KvCache::new(&kv_layout(c), KvDtype::F16));
        assert_eq!(kv.bytes_per_token(), 61 * 576 * 2);
    }

    #[test]
    fn deepseek_v3s_published_config_is_read_as_transformers_reads_it() {
        let c = ModelConfig::from_hf(&deepseek_v3_671b()).unwrap();
        check_mla(&c, 3, 256, 128, 40.0);
        assert_eq!((c.max_positions, c.vocab_size), (163840, 129280));
        assert_eq!(c.eos_token_ids, vec![1]);
    }

    #[test]
    fn kimi_k25s_published_config_is_kimi_k2s_text_model() {
        let (text, wrapper) = text_only::text_model(&kimi_k25()).unwrap();
        assert!(wrapper.is_some());
        let c = ModelConfig::from_hf(&text).unwrap();
        check_mla(&c, 1, 384, 64, 64.0);
        assert_eq!((c.max_positions, c.vocab_size), (262144, 163840));
        assert_eq!(c.rope_theta, 50000.0);
        assert_eq!(c.eos_token_ids, vec![163585]);
        assert_eq!(
            text["quantization_config"]["format"], "pack-quantized",
            "text_config's own"
        );
    }
}
