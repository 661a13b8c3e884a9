//! Qwen3-Next (`Qwen3NextForCausalLM`, transformers' `qwen3_next`): a hybrid of gated DeltaNet
//! linear attention (`layers/delta.rs`) and gated grouped-query attention (`layers/gqa.rs`
//! with its output gate) per `layer_types` (or every `full_attention_interval`-th layer full);
//! partial rotary (`partial_rotary_factor`, 0.25 by default) on the leading dims, per-head q/k
//! norms; every RMSNorm but the DeltaNet's gated one zero-centred (`1 + w`, stored so at
//! conversion); Qwen3-MoE's routing (softmax top-k, `norm_topk_prob`, `decoder_sparse_step`,
//! `mlp_only_layers`) with a shared expert behind a sigmoid gate.

use serde_json::Value;

use super::layers;
use super::plan::{self, Plan};
use super::registry::Family;
use crate::config::{
    bad, AttentionKind, FfnKind, HybridFull, LinearDims, LinearKind, ModelConfig, QkNorm, Reader,
    Routing, MAX_DIM,
};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: "Qwen3NextForCausalLM",
    chat_family: "qwen3",
    reads_head_dim: true,
    default_rotary_fraction: 0.25,
    default_rms_norm_eps: 1e-6,
    configure,
    plan: tensor_plan,
    checkpoint_name: None,
    config_aliases: &[],
};

fn configure(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    let name = FAMILY.hf_name;
    if r.bool_or("attention_bias", false)? {
        return Err(bad(format!(
            "config.json: `attention_bias` true is not supported for {name}"
        )));
    }
    c.qk_norm = QkNorm::PerHead;
    let d = LinearDims {
        kind: LinearKind::GatedDeltaNet,
        key_heads: r.size_or("linear_num_key_heads", 16, 1, MAX_DIM)?,
        value_heads: r.size_or("linear_num_value_heads", 32, 1, MAX_DIM)?,
        key_dim: r.size_or("linear_key_head_dim", 128, 1, MAX_DIM)?,
        value_dim: r.size_or("linear_value_head_dim", 128, 1, MAX_DIM)?,
        conv_kernel: r.size_or("linear_conv_kernel_dim", 4, 1, 64)?,
    };
    if !d.value_heads.is_multiple_of(d.key_heads) {
        return Err(bad(format!(
            "config.json: `linear_num_value_heads` {} must be a multiple of \
             `linear_num_key_heads` {}",
            d.value_heads, d.key_heads
        )));
    }
    if d.value_heads * d.key_dim * d.value_dim > MAX_DIM * 64 {
        return Err(bad(
            "config.json: the linear attention's state (linear_num_value_heads * \
             linear_key_head_dim * linear_value_head_dim) is too large",
        ));
    }
    c.attention = AttentionKind::Hybrid(d, HybridFull::GatedGqa);
    c.linear_layers = match linear_layer_types(r, c.num_layers)? {
        Some(linear) => linear,
        None => {
            let every = r.size_or("full_attention_interval", 4, 1, MAX_DIM)?;
            (0..c.num_layers).map(|i| (i + 1) % every != 0).collect()
        }
    };
    let e = r.size_req("num_experts", 0, MAX_DIM)?;
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
    c.shared_intermediate_size = r.size_or("shared_expert_intermediate_size", 0, 0, MAX_DIM)?;
    c.routing = Routing::SoftmaxTopK {
        norm_topk_prob: r.bool_or("norm_topk_prob", true)?,
    };
    Ok(())
}

/// Per layer, whether `layer_types` makes it linear attention (none: the config has no
/// `layer_types`).
pub(super) fn linear_layer_types(r: &Reader, layers: usize) -> Result<Option<Vec<bool>>> {
    let Some(v) = r.get("layer_types") else {
        return Ok(None);
    };
    let list = v
        .as_array()
        .ok_or_else(|| bad("config.json: `layer_types` must be a list"))?;
    if list.len() < layers {
        return Err(bad(format!(
            "config.json: `layer_types` has {} entries for {layers} layers",
            list.len()
        )));
    }
    list[..layers]
        .iter()
        .map(|t| match t.as_str() {
            Some("linear_attention") => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(bad(format!(
                "config.json: `layer_types` entry {t} is not \"linear_attention\" or \
                 \"full_attention\""
            ))),
        })
        .collect::<Result<_>>()
        .map(Some)
}

/// Marks the plan's tensor `name` as a zero-centred norm weight (stored as `1 + w`).
fn plus_one(p: &mut Plan, name: &str) {
    let spec = p
        .resident
        .iter_mut()
        .find(|t| t.name == name)
        .expect("the plan just added it");
    spec.plus_one = true;
}

fn tensor_plan(c: &ModelConfig) -> Plan {
    let mut p = Plan::default();
    plan::add_embeddings(&mut p, c);
    plus_one(&mut p, "norm");
    for i in 0..c.num_layers {
        plan::add_layer_norms(&mut p, c, i);
        plus_one(&mut p, &format!("layers.{i}.attn_norm"));
        plus_one(&mut p, &format!("layers.{i}.ffn_norm"));
        layers::plan_attention(&mut p, c, i);
        plan::add_ffn(&mut p, c, i);
        if c.layers[i] == FfnKind::Moe && c.shared_intermediate_size > 0 {
            plan::add_mlp(
                &mut p,
                &format!("layers.{i}.shared"),
                &format!("model.layers.{i}.mlp.shared_expert"),
                c.hidden_size,
                c.shared_intermediate_size,
            );
            p.f32_matrix(
                format!("layers.{i}.shared_gate"),
                format!("model.layers.{i}.mlp.shared_expert_gate.weight"),
                1,
                c.hidden_size,
            );
        }
    }
    p
}
