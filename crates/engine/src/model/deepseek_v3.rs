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
