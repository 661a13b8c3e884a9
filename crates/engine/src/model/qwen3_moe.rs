//! Qwen3-MoE (`Qwen3MoeForCausalLM`): explicit `head_dim`; per-head q/k RMSNorm before RoPE;
//! softmax router, top-k, renormalised when `norm_topk_prob`; layers listed in `mlp_only_layers`
//! (or off the `decoder_sparse_step` grid) are dense SwiGLU MLPs of `intermediate_size`.

use serde_json::Value;

use super::plan;
use super::registry::Family;
use crate::config::{bad, AttentionKind, FfnKind, ModelConfig, QkNorm, Reader, Routing, MAX_DIM};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: "Qwen3MoeForCausalLM",
    chat_family: "qwen3",
    reads_head_dim: true,
    default_rotary_fraction: 1.0,
    default_rms_norm_eps: 1e-6,
    configure,
    plan: plan::standard,
    checkpoint_name: None,
    config_aliases: &[],
};

fn configure(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    if r.bool_or("use_sliding_window", false)? {
        return Err(bad("config.json: use_sliding_window is not supported yet"));
    }
    c.attention = AttentionKind::Gqa;
    c.qk_norm = QkNorm::PerHead;
    // Hub checkpoints say `num_experts`; transformers 5 saves `num_local_experts`.
    let e = match r.get("num_experts") {
        Some(_) => r.size_req("num_experts", 0, MAX_DIM)?,
        None => r.size_or("num_local_experts", 0, 0, MAX_DIM)?,
    };
    let step = r.usize_or("decoder_sparse_step", 1)?.max(1);
    let mlp_only: Vec<usize> = match r.get("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_u64().map(|x| x as usize))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("config.json: mlp_only_layers must list integers"))?,
        Some(_) => return Err(bad("config.json: mlp_only_layers must be a list")),
    };
    c.layers = (0..c.num_layers)
        .map(|i| {
            if !mlp_only.contains(&i) && e > 0 && (i + 1) % step == 0 {
                FfnKind::Moe
            } else {
                FfnKind::Dense
            }
        })
        .collect();
    c.num_experts = e;
    c.moe_intermediate_size = r.size_req("moe_intermediate_size", 0, MAX_DIM)?;
    c.routing = Routing::SoftmaxTopK {
        norm_topk_prob: r.bool_or("norm_topk_prob", false)?,
    };
    Ok(())
}
