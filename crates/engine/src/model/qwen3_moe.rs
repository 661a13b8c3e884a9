//! Qwen3-MoE (`Qwen3MoeForCausalLM`): explicit `head_dim`; per-head q/k RMSNorm before RoPE;
//! softmax router, top-k, renormalised when `norm_topk_prob`; layers listed in `mlp_only_layers`
//! (or off the `decoder_sparse_step` grid) are dense SwiGLU MLPs of `intermediate_size`.

use super::plan::{self, Plan};
use crate::config::ModelConfig;

pub fn plan(c: &ModelConfig) -> Plan {
    let mut p = Plan::default();
    plan::add_embeddings(&mut p, c);
    for i in 0..c.num_layers {
        plan::add_attention(&mut p, c, i);
        plan::add_qk_norm(&mut p, i, c.head_dim, c.head_dim);
        plan::add_ffn(&mut p, c, i);
    }
    p
}
