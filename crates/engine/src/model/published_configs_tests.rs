//! Released checkpoints' config.json files, field for field as published, read as transformers
//! reads them: what shapes their memory (layer kinds, experts, attention dims, the KV kept per
//! position). The tiny fixtures exercise the math; these make sure the real sizes and the
//! fields only real configs carry are accepted.

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

/// What shapes a checkpoint of `c`'s memory: layer kinds, experts, MLA's dims and softmax
/// scale; the MLA dims whatever attention kind carries them.
fn check_mla(c: &ModelConfig, dense: usize, experts: usize, heads: usize, yarn: f64) {
    assert_eq!(c.num_layers, 61);
    assert!(c.layers[..dense].iter().all(|&k| k == FfnKind::Dense));
    assert!(c.layers[dense..].iter().all(|&k| k == FfnKind::Moe));
    assert_eq!(
        (c.num_experts, c.top_k, c.moe_intermediate_size),
        (experts, 8, 2048)
    );
    assert_eq!((c.hidden_size, c.num_heads), (7168, heads));
    let d = match &c.attention {
        AttentionKind::Mla(d) | AttentionKind::Dsa(d, _) => d,
        other => panic!("{other:?}"),
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
}

/// Bytes a position keeps in an f16 cache of `c`.
fn kv_bytes_per_token(c: &ModelConfig) -> usize {
    with_states(c, KvCache::new(&kv_layout(c), KvDtype::F16)).bytes_per_token()
}

#[test]
fn deepseek_v3s_published_config_is_read_as_transformers_reads_it() {
    let c = ModelConfig::from_hf(&deepseek_v3_671b()).unwrap();
    check_mla(&c, 3, 256, 128, 40.0);
    assert_eq!((c.max_positions, c.vocab_size), (163840, 129280));
    assert_eq!(c.eos_token_ids, vec![1]);
    // The slot keeps the latent and the rope key: 576 values a layer.
    assert_eq!(kv_bytes_per_token(&c), 61 * 576 * 2);
}

/// DeepSeek-V3.2's: V3's, with the lightning indexer's fields (64 heads of 128, the top 2,048
/// positions) under its own architecture.
#[test]
fn deepseek_v32s_published_config_adds_the_indexer() {
    let mut v = deepseek_v3_671b();
    v["architectures"] = json!(["DeepseekV32ForCausalLM"]);
    v["model_type"] = json!("deepseek_v32");
    v["index_head_dim"] = json!(128);
    v["index_n_heads"] = json!(64);
    v["index_topk"] = json!(2048);
    let c = ModelConfig::from_hf(&v).unwrap();
    check_mla(&c, 3, 256, 128, 40.0);
    let AttentionKind::Dsa(_, x) = c.attention else {
        panic!("{:?}", c.attention)
    };
    assert_eq!((x.heads, x.head_dim, x.topk), (64, 128, 2048));
    assert!(!x.rope_interleave, "V3.2's indexer ropes the two halves");
    assert!(
        c.indexer_layers.iter().all(|&i| i),
        "an indexer in every layer"
    );
    // The latent, the rope key and the indexer's key: 576 + 128 values a layer.
    assert_eq!(kv_bytes_per_token(&c), 61 * (576 + 128) * 2);
}

#[test]
fn kimi_k25s_published_config_is_kimi_k2s_text_model() {
    let (text, wrapper) = text_only::text_model(&kimi_k25()).unwrap();
    assert!(wrapper.is_some());
    let c = ModelConfig::from_hf(&text).unwrap();
    check_mla(&c, 1, 384, 64, 64.0);
    assert_eq!(kv_bytes_per_token(&c), 61 * 576 * 2);
    assert_eq!((c.max_positions, c.vocab_size), (262144, 163840));
    assert_eq!(c.rope_theta, 50000.0);
    assert_eq!(c.eos_token_ids, vec![163585]);
    assert_eq!(
        text["quantization_config"]["format"], "pack-quantized",
        "text_config's own"
    );
}
