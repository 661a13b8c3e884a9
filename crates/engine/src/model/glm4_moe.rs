//! GLM-4.5-MoE (`Glm4MoeForCausalLM`): the first `first_k_dense_replace` layers are dense;
//! MoE layers route with sigmoid scores plus `e_score_correction_bias` for the choice,
//! restricted to the best `topk_group` of `n_group` expert groups, weigh by the plain scores
//! (renormalised, times `routed_scaling_factor`) and add an always-on shared expert MLP.
//! Attention has q/k/v biases, optional per-head q/k norm, and partial rotary (the leading
//! `partial_rotary_factor` of each head). Layers past `num_hidden_layers` (the MTP head) are skipped.

use super::plan::{self, Plan};
use crate::config::{FfnKind, ModelConfig, QkNorm};

pub fn plan(c: &ModelConfig) -> Plan {
    let mut p = Plan::default();
    plan::add_embeddings(&mut p, c);
    for i in 0..c.num_layers {
        plan::add_attention(&mut p, c, i);
        if c.qk_norm == QkNorm::PerHead {
            plan::add_qk_norm(&mut p, i, c.head_dim, c.head_dim);
        }
        plan::add_ffn(&mut p, c, i);
        if c.layers[i] == FfnKind::Moe {
            p.vector(
                format!("layers.{i}.router_bias"),
                format!("model.layers.{i}.mlp.gate.e_score_correction_bias"),
                c.num_experts,
            );
            if c.shared_intermediate_size > 0 {
                plan::add_mlp(
                    &mut p,
                    &format!("layers.{i}.shared"),
                    &format!("model.layers.{i}.mlp.shared_experts"),
                    c.hidden_size,
                    c.shared_intermediate_size,
                );
            }
        }
    }
    p
}
