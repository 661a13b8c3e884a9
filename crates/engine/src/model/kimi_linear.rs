//! Kimi Linear (`KimiLinearForCausalLM`, transformers' `kimi_linear`): a hybrid of Kimi Delta
//! Attention (`layers/delta.rs` with [`LinearKind::Kda`]: per-channel decay from a low-rank
//! forget gate, the output gated by a low-rank sigmoid gate, a causal convolution per q, k and
//! v) and multi-head latent attention without positions (`layers/mla.rs`, its rope dims never
//! rotated); DeepSeek-V3's MoE (`glm4_moe.rs`'s sigmoid routing with the correction bias,
//! groups, `routed_scaling_factor`, shared experts). Plain RMSNorms.
//!
//! Configs come in two layouts, read as transformers' `KimiLinearConfig` reads them: its own
//! (`layer_types`, `mlp_layer_types`, `linear_head_dim` / `linear_num_heads` /
//! `linear_conv_kernel_dim`) and the published checkpoints' (`linear_attn_config` with 1-indexed
//! `full_attn_layers` / `kda_layers`, `head_dim`, `num_heads`, `short_conv_kernel_size`;
//! `first_k_dense_replace`); both store the MoE fields under their own names (`num_experts`,
//! `num_experts_per_token`, `moe_renormalize`, `num_expert_group`, `num_shared_experts`,
//! `model_max_length`: [`FAMILY`]'s aliases). Tensors keep the checkpoint's names
//! (`block_sparse_moe`, `experts.{e}.w1/w2/w3`, `q_conv1d`, `f_a_proj`, `A_log` under
//! `self_attn`); transformers' module names (`mlp`, `forget_gate.`) are read too.

use super::glm4_moe;
use super::qwen3_next::linear_layer_types;
use super::registry::Family;
use crate::config::{
    bad, AttentionKind, FfnKind, HybridFull, LinearDims, LinearKind, ModelConfig, Reader, MAX_DIM,
};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: "KimiLinearForCausalLM",
    chat_family: "kimi_k2",
    reads_head_dim: false,
    default_rotary_fraction: 1.0,
    default_rms_norm_eps: 1e-5,
    configure,
    // The sigmoid-routed MoE decoder's tensors; the attention block plans its own kind.
    plan: glm4_moe::tensor_plan,
    checkpoint_name: Some(module_name),
    config_aliases: &[
        ("max_position_embeddings", "model_max_length"),
        ("norm_topk_prob", "moe_renormalize"),
        ("n_group", "num_expert_group"),
        ("n_routed_experts", "num_experts"),
        ("n_routed_experts", "num_local_experts"),
        ("num_experts_per_tok", "num_experts_per_token"),
        ("n_shared_experts", "num_shared_experts"),
    ],
};

fn configure(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    let name = FAMILY.hf_name;
    if r.bool_or("attention_bias", false)? {
        return Err(bad(format!(
            "config.json: `attention_bias` true is not supported for {name}"
        )));
    }
    // transformers' Kimi Linear runs its MLA without positions whatever this says; a config
    // asking for positions is not one it describes.
    if !r.bool_or("mla_use_nope", true)? {
        return Err(bad(format!(
            "config.json: `mla_use_nope` false is not supported for {name} (its MLA layers \
             have no positional encoding)"
        )));
    }
    // transformers' KimiLinearConfig defaults.
    let defaults = glm4_moe::MoeDefaults {
        first_k_dense_replace: 1,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.446,
    };
    glm4_moe::configure_sigmoid_moe(r, c, defaults)?;
    if let Some(types) = r.get("mlp_layer_types") {
        c.layers = read_list(types, "mlp_layer_types", c.num_layers, |t| match t {
            "dense" => Some(FfnKind::Dense),
            "sparse" => Some(FfnKind::Moe),
            _ => None,
        })?;
    }
    let q_lora_rank = match r.get("q_lora_rank") {
        None => None,
        Some(_) => Some(r.size_req("q_lora_rank", 1, MAX_DIM)?),
    };
    let mut mla = super::deepseek_v3::read_mla(r, c, q_lora_rank, false)?;
    mla.positional = false;
    // `linear_attn_config`'s fields take precedence over the flat ones, as in transformers.
    let sub = r.object("linear_attn_config")?;
    let field = |sub_key: &str, flat: &str, default: usize, max: usize| -> Result<usize> {
        match &sub {
            Some(s) if s.has(sub_key) => s.size_req(sub_key, 1, max),
            _ => r.size_or(flat, default, 1, max),
        }
    };
    let head_dim = field("head_dim", "linear_head_dim", 128, MAX_DIM)?;
    let heads = field("num_heads", "linear_num_heads", 32, MAX_DIM)?;
    let d = LinearDims {
        kind: LinearKind::Kda,
        key_heads: heads,
        value_heads: heads,
        key_dim: head_dim,
        value_dim: head_dim,
        conv_kernel: field("short_conv_kernel_size", "linear_conv_kernel_dim", 4, 64)?,
    };
    if heads * head_dim > MAX_DIM || heads * head_dim * head_dim > MAX_DIM * 64 {
        return Err(bad(
            "config.json: the linear attention's size (heads * head_dim^2) is too large",
        ));
    }
    c.attention = AttentionKind::Hybrid(d, HybridFull::Mla(mla));
    c.linear_layers = match linear_layer_types(r, c.num_layers)? {
        Some(linear) => linear,
        None => match &sub {
            Some(s) if s.has("full_attn_layers") && s.has("kda_layers") => {
                one_indexed_types(s, c.num_layers)?
            }
            // transformers' default: every fourth layer full, the first one linear.
            _ => (0..c.num_layers).map(|i| i == 0 || i % 4 != 0).collect(),
        },
    };
    Ok(())
}

/// A per-layer list of names read with `pick`.
fn read_list<T>(
    v: &serde_json::Value,
    key: &str,
    layers: usize,
    pick: impl Fn(&str) -> Option<T>,
) -> Result<Vec<T>> {
    let list = v
        .as_array()
        .ok_or_else(|| bad(format!("config.json: `{key}` must be a list")))?;
    if list.len() < layers {
        return Err(bad(format!(
            "config.json: `{key}` has {} entries for {layers} layers",
            list.len()
        )));
    }
    list[..layers]
        .iter()
        .map(|t| {
            t.as_str()
                .and_then(&pick)
                .ok_or_else(|| bad(format!("config.json: `{key}` entry {t} is not known")))
        })
        .collect()
}

/// `linear_attn_config`'s `full_attn_layers` and `kda_layers` (1-indexed): every layer in
/// exactly one of them.
fn one_indexed_types(s: &Reader, layers: usize) -> Result<Vec<bool>> {
    let mut linear: Vec<Option<bool>> = vec![None; layers];
    for (key, is_linear) in [("full_attn_layers", false), ("kda_layers", true)] {
        let list = s.get(key).and_then(|v| v.as_array()).ok_or_else(|| {
            bad(format!(
                "config.json: linear_attn_config.{key} must be a list"
            ))
        })?;
        for x in list {
            let i = x
                .as_u64()
                .map(|i| i as usize)
                .filter(|&i| (1..=layers).contains(&i))
                .ok_or_else(|| {
                    bad(format!(
                        "config.json: linear_attn_config.{key} entry {x} is not a layer number \
                         between 1 and {layers}"
                    ))
                })?;
            if linear[i - 1].replace(is_linear).is_some() {
                return Err(bad(format!(
                    "config.json: layer {i} is listed twice in linear_attn_config"
                )));
            }
        }
    }
    linear
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.ok_or_else(|| {
                bad(format!(
                    "config.json: layer {} is in neither linear_attn_config.full_attn_layers \
                     nor kda_layers",
                    i + 1
                ))
            })
        })
        .collect()
}

/// The checkpoint's tensor names as the plan reads them: the MoE block under `mlp.`, experts'
/// `w1` / `w3` / `w2` as `gate_proj` / `up_proj` / `down_proj`, and the forget gate's tensors
/// directly under `self_attn` (transformers' module names `forget_gate.` read the same).
pub fn module_name(name: &str) -> String {
    const RULES: &[(&str, &str)] = &[
        (".block_sparse_moe.", ".mlp."),
        (".self_attn.forget_gate.", ".self_attn."),
        (".w1.", ".gate_proj."),
        (".w2.", ".down_proj."),
        (".w3.", ".up_proj."),
    ];
    let mut s = name.to_string();
    for (from, to) in RULES {
        s = s.replace(from, to);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::module_name;
    use crate::config::{AttentionKind, FfnKind, HybridFull, LinearKind, ModelConfig};
    use serde_json::json;

    /// A published-checkpoint-style config without layer lists: transformers' defaults.
    fn bare() -> serde_json::Value {
        json!({
            "architectures": ["KimiLinearForCausalLM"],
            "hidden_size": 64, "num_hidden_layers": 9, "num_attention_heads": 4,
            "intermediate_size": 96, "moe_intermediate_size": 32, "vocab_size": 100,
            "num_experts": 8, "num_experts_per_token": 2, "kv_lora_rank": 16,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "q_lora_rank": null
        })
    }

    #[test]
    fn transformers_defaults_fill_what_the_config_leaves_out() {
        let c = ModelConfig::from_hf(&bare()).unwrap();
        // Every fourth layer full, the first linear; the first layer dense.
        let full: Vec<usize> = (0..9).filter(|&i| !c.linear_layers[i]).collect();
        assert_eq!(full, vec![4, 8]);
        assert_eq!(c.layers[0], FfnKind::Dense);
        assert!(c.layers[1..].iter().all(|&l| l == FfnKind::Moe));
        let AttentionKind::Hybrid(d, HybridFull::Mla(m)) = c.attention else {
            panic!("{:?}", c.attention)
        };
        assert_eq!(d.kind, LinearKind::Kda);
        assert_eq!((d.key_heads, d.key_dim, d.conv_kernel), (32, 128, 4));
        assert!(!m.positional && m.q_lora_rank.is_none());
        assert_eq!(c.top_k, 2);
        assert_eq!(c.num_experts, 8);
        assert_eq!(c.max_positions, 4096);
        let mut v = bare();
        v["model_max_length"] = json!(1048576);
        v["linear_attn_config"] = json!({"num_heads": 2, "head_dim": 16});
        v["linear_head_dim"] = json!(64);
        let c = ModelConfig::from_hf(&v).unwrap();
        assert_eq!(c.max_positions, 1048576);
        let AttentionKind::Hybrid(d, _) = c.attention else {
            unreachable!()
        };
        // The sub-dict's fields win over the flat ones.
        assert_eq!((d.key_heads, d.key_dim), (2, 16));
    }

    #[test]
    fn checkpoint_and_module_names_map_to_the_plans_names() {
        for (from, to) in [
            (
                "model.layers.1.block_sparse_moe.experts.3.w1.weight",
                "model.layers.1.mlp.experts.3.gate_proj.weight",
            ),
            (
                "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                "model.layers.1.mlp.experts.3.down_proj.weight",
            ),
            (
                "model.layers.1.block_sparse_moe.experts.3.w3.weight",
                "model.layers.1.mlp.experts.3.up_proj.weight",
            ),
            (
                "model.layers.0.block_sparse_moe.gate_proj.weight",
                "model.layers.0.mlp.gate_proj.weight",
            ),
            (
                "model.layers.1.block_sparse_moe.gate.e_score_correction_bias",
                "model.layers.1.mlp.gate.e_score_correction_bias",
            ),
            (
                "model.layers.0.self_attn.forget_gate.f_a_proj.weight",
                "model.layers.0.self_attn.f_a_proj.weight",
            ),
            (
                "model.layers.0.self_attn.A_log",
                "model.layers.0.self_attn.A_log",
            ),
            ("lm_head.weight", "lm_head.weight"),
        ] {
            assert_eq!(module_name(from), to, "{from}");
        }
    }
}
