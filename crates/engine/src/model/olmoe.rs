//! OLMoE (`OlmoeForCausalLM`): every layer is MoE; softmax router over all experts, top-k,
//! optionally renormalised (`norm_topk_prob`, off by default); q/k RMSNorm over the whole
//! projected q and k (all heads at once) before RoPE; optional `clip_qkv` clamp; full rotary.

use super::plan;
use super::registry::Family;
use crate::config::{bad, AttentionKind, FfnKind, ModelConfig, QkNorm, Reader, Routing, MAX_DIM};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: "OlmoeForCausalLM",
    chat_family: "olmoe",
    // Its q/k norms span hidden_size, so its head_dim is always hidden / heads.
    reads_head_dim: false,
    default_rotary_fraction: 1.0,
    default_rms_norm_eps: 1e-5,
    configure,
    plan: plan::standard,
    checkpoint_name: None,
    config_aliases: &[],
};

fn configure(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    if c.head_dim * c.num_heads != c.hidden_size {
        return Err(bad(
            "config.json: OLMoE needs hidden_size divisible by num_attention_heads",
        ));
    }
    c.attention = AttentionKind::Gqa;
    c.qk_norm = QkNorm::Full;
    c.clip_qkv = r.get("clip_qkv").and_then(|v| v.as_f64()).map(|x| x as f32);
    c.num_experts = r.size_req("num_experts", 0, MAX_DIM)?;
    c.moe_intermediate_size = c.intermediate_size;
    c.routing = Routing::SoftmaxTopK {
        norm_topk_prob: r.bool_or("norm_topk_prob", false)?,
    };
    c.layers = vec![FfnKind::Moe; c.num_layers];
    Ok(())
}
