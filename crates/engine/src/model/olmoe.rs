//! OLMoE (`OlmoeForCausalLM`): every layer is MoE; softmax router over all experts, top-k,
//! optionally renormalised (`norm_topk_prob`, off by default); q/k RMSNorm over the whole
//! projected q and k (all heads at once) before RoPE; optional `clip_qkv` clamp; full rotary.

use super::plan::{self, Plan};
use crate::config::ModelConfig;

pub fn plan(c: &ModelConfig) -> Plan {
    let mut p = Plan::default();
    plan::add_embeddings(&mut p, c);
    for i in 0..c.num_layers {
        plan::add_attention(&mut p, c, i);
        plan::add_qk_norm(&mut p, i, c.q_dim(), c.kv_dim());
        plan::add_ffn(&mut p, c, i);
    }
    p
}
