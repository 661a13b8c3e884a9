//! GLM-4.5-MoE (`Glm4MoeForCausalLM`): the first `first_k_dense_replace` layers are dense;
//! MoE layers route with sigmoid scores plus `e_score_correction_bias` for the choice,
//! restricted to the best `topk_group` of `n_group` expert groups, weigh by the plain scores
//! (renormalised, times `routed_scaling_factor`) and add an always-on shared expert MLP.
//! Attention has q/k/v biases, optional per-head q/k norm, and partial rotary (the leading
//! `partial_rotary_factor` of each head). Layers past `num_hidden_layers` (the MTP head) are skipped.

use super::layers;
use super::plan::{self, Plan};
use super::registry::Family;
use crate::config::{bad, AttentionKind, FfnKind, ModelConfig, QkNorm, Reader, Routing, MAX_DIM};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: "Glm4MoeForCausalLM",
    chat_family: "glm",
    reads_head_dim: true,
    default_rotary_fraction: 0.5,
    default_rms_norm_eps: 1e-5,
    configure,
    plan: tensor_plan,
    checkpoint_name: None,
    config_aliases: &[],
};

fn configure(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    configure_sigmoid_moe(
        r,
        c,
        MoeDefaults {
            first_k_dense_replace: 1,
            n_group: 1,
            topk_group: 1,
            routed_scaling_factor: 1.0,
        },
    )?;
    c.attention = AttentionKind::Gqa;
    c.qk_norm = if r.bool_or("use_qk_norm", false)? {
        QkNorm::PerHead
    } else {
        QkNorm::None
    };
    Ok(())
}

/// A family's defaults for the sigmoid-routed MoE fields a config may leave out.
#[derive(Clone, Copy)]
pub(super) struct MoeDefaults {
    pub(super) first_k_dense_replace: usize,
    pub(super) n_group: usize,
    pub(super) topk_group: usize,
    pub(super) routed_scaling_factor: f64,
}

/// The MoE scheme GLM-4.5 and DeepSeek-V3 share: `n_routed_experts` of
/// `moe_intermediate_size`, sigmoid routing with the correction bias restricted to the best
/// `topk_group` of `n_group` groups, `routed_scaling_factor`, `n_shared_experts` (default 1)
/// always-on experts, the first `first_k_dense_replace` layers dense. Fields the config does not
/// give take the family's defaults (its transformers config class's).
pub(super) fn configure_sigmoid_moe(r: &Reader, c: &mut ModelConfig, d: MoeDefaults) -> Result<()> {
    let e = r.size_req("n_routed_experts", 0, MAX_DIM)?;
    let moe_i = r.size_req("moe_intermediate_size", 0, MAX_DIM)?;
    let n_group = r.usize_or("n_group", d.n_group)?;
    let topk_group = r.usize_or("topk_group", d.topk_group)?;
    if n_group == 0 || e % n_group != 0 || topk_group == 0 || topk_group > n_group {
        return Err(bad(format!(
            "config.json: {} {n_group} / topk_group {topk_group} do not fit {e} routed experts",
            r.name("n_group")
        )));
    }
    if e / n_group < 2 && n_group > 1 {
        return Err(bad(
            "config.json: each expert group needs at least 2 experts",
        ));
    }
    c.routing = Routing::SigmoidGrouped {
        n_group,
        topk_group,
        norm_topk_prob: r.bool_or("norm_topk_prob", true)?,
        scaling: r.f64_or("routed_scaling_factor", d.routed_scaling_factor)? as f32,
    };
    let first_dense = r.usize_or("first_k_dense_replace", d.first_k_dense_replace)?;
    c.layers = (0..c.num_layers)
        .map(|i| {
            if i >= first_dense {
                FfnKind::Moe
            } else {
                FfnKind::Dense
            }
        })
        .collect();
    let shared = moe_i * r.size_or("n_shared_experts", 1, 0, MAX_DIM)?;
    if shared > MAX_DIM {
        return Err(bad(format!(
            "config.json: n_shared_experts * moe_intermediate_size = {shared} exceeds {MAX_DIM}"
        )));
    }
    c.num_experts = e;
    c.moe_intermediate_size = moe_i;
    c.shared_intermediate_size = shared;
    Ok(())
}

/// The tensors of a decoder with sigmoid-routed MoE layers (GLM-4.5, DeepSeek-V3, Kimi Linear): each layer's
/// norms, its attention block (whichever kind the config chose) and its feed-forward block.
pub(super) fn tensor_plan(c: &ModelConfig) -> Plan {
    let mut p = Plan::default();
    plan::add_embeddings(&mut p, c);
    for i in 0..c.num_layers {
        plan::add_layer_norms(&mut p, c, i);
        layers::plan_attention(&mut p, c, i);
        plan::add_ffn(&mut p, c, i);
        plan_sigmoid_moe(&mut p, c, i);
    }
    p
}

/// Layer `i`'s tensors of the sigmoid-routed MoE beyond the router and experts: the correction
/// bias and the shared expert (nothing for a dense layer).
pub(super) fn plan_sigmoid_moe(p: &mut Plan, c: &ModelConfig, i: usize) {
    if c.layers[i] == FfnKind::Moe {
        p.vector(
            format!("layers.{i}.router_bias"),
            format!("model.layers.{i}.mlp.gate.e_score_correction_bias"),
            c.num_experts,
        );
        if c.shared_intermediate_size > 0 {
            plan::add_mlp(
                p,
                &format!("layers.{i}.shared"),
                &format!("model.layers.{i}.mlp.shared_experts"),
                c.hidden_size,
                c.shared_intermediate_size,
            );
        }
    }
}
