//! DeepSeek-V4 (`DeepseekV4ForCausalLM`, transformers' `deepseek_v4`).
//!
//! - The residual is `hc_mult` streams with manifold-constrained hyper-connections around every
//!   block (`layers/hyper.rs`): weights computed from the streams collapse them into the block's
//!   input and mix the block's output back in; a last collapse before the final norm.
//! - Attention (`layers/compressed.rs`): the low-rank query (`q_a_proj`, RMSNorm, `q_b_proj`,
//!   an unweighted per-head RMSNorm), one shared key-and-value head of `head_dim`, the last
//!   `head_dim * partial_rotary_factor` dims rotated (interleaved pairs) and rotated back on the
//!   output, per-head sinks in the softmax, a grouped low-rank output projection (`o_groups`
//!   blocks to `o_lora_rank`, then `o_b_proj`). Each layer attends over a sliding window of
//!   `sliding_window` positions and, by its `layer_types` entry, nothing more (sliding), every
//!   compressed entry of `compress_rates.heavily_compressed_attention` positions (HCA), or the
//!   `index_topk` entries of overlapping `compressed_sparse_attention`-wide windows that a
//!   lightning indexer scores highest (CSA). Sliding layers use `rope_parameters.main`, the
//!   others (and their entries and indexer) `rope_parameters.compress`.
//! - MoE in every layer: the first `mlp_layer_types` entries `hash_moe` take each token's
//!   experts from a table (`tid2eid`), the others the top `num_experts_per_tok` of
//!   `sqrt(softplus)` scores plus the correction bias; weights renormalised, times
//!   `routed_scaling_factor`; one shared expert; SwiGLU inputs clamped at `swiglu_limit`.
//!
//! Checkpoints come with DeepSeek's own tensor names (`layers.0.attn.wq_a.weight`,
//! `ffn.experts.3.w1.weight`, `hc_attn_fn`, ...), with or without a `model.` prefix, as
//! published and as transformers saves them; [`module_name`] maps them to transformers' module
//! names, which the plan uses. The multi-token-prediction layers (`mtp.*`) are not part of
//! transformers' model and are skipped at conversion.

use super::layers::compressed;
use super::plan::{self, Plan};
use super::registry::Family;
use crate::config::{
    bad, rope_from, AttentionKind, CompressKind, CompressedDims, FfnKind, HyperDims, ModelConfig,
    Reader, Routing, MAX_DIM,
};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: "DeepseekV4ForCausalLM",
    chat_family: "deepseek_v4",
    reads_head_dim: true,
    default_rotary_fraction: 0.125,
    default_rms_norm_eps: 1e-6,
    configure,
    plan: tensor_plan,
    checkpoint_name: Some(module_name),
    config_aliases: &[],
};

const SLIDING: &str = "sliding_attention";
const CSA: &str = "compressed_sparse_attention";
const HCA: &str = "heavily_compressed_attention";

fn configure(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    let name = FAMILY.hf_name;
    for (key, want) in [("scoring_func", "sqrtsoftplus"), ("hidden_act", "silu")] {
        if let Some(v) = r.get(key) {
            if v.as_str() != Some(want) {
                return Err(bad(format!(
                    "config.json: `{key}` {v} is not supported for {name} (only \"{want}\")"
                )));
            }
        }
    }
    for key in ["attention_bias", "mlp_bias"] {
        if r.bool_or(key, false)? {
            return Err(bad(format!(
                "config.json: `{key}` true is not supported for {name}"
            )));
        }
    }
    if r.usize_or("num_key_value_heads", 1)? != 1 {
        return Err(bad(format!(
            "config.json: `num_key_value_heads` must be 1 for {name} (one shared key-and-value \
             head)"
        )));
    }
    c.num_kv_heads = 1;
    // The shared expert is one MLP of `moe_intermediate_size` whatever this says
    // (transformers' DeepseekV4MLP): refuse a count it would not honour.
    if r.usize_or("n_shared_experts", 1)? != 1 {
        return Err(bad(format!(
            "config.json: `n_shared_experts` must be 1 for {name}"
        )));
    }
    let n = c.num_layers;
    let e = r.size_or("n_routed_experts", 256, 1, MAX_DIM)?;
    let moe_i = r.size_req("moe_intermediate_size", 1, MAX_DIM)?;
    c.num_experts = e;
    c.moe_intermediate_size = moe_i;
    c.shared_intermediate_size = moe_i;
    c.layers = vec![FfnKind::Moe; n];
    c.routing = Routing::SqrtSoftplus {
        scaling: r.f64_or("routed_scaling_factor", 1.5)? as f32,
    };
    c.hash_layers = mlp_layer_types(r, n)?;
    c.compress_layers = layer_types(r, n)?;
    let limit = r.f64_or("swiglu_limit", 10.0)?;
    if !(limit.is_finite() && limit > 0.0) {
        return Err(bad(format!(
            "config.json: `swiglu_limit` {limit} must be a positive number"
        )));
    }
    c.swiglu_limit = Some(limit as f32);
    let mult = r.size_or("hc_mult", 4, 1, 64)?;
    if mult * c.hidden_size > MAX_DIM {
        return Err(bad(format!(
            "config.json: hc_mult * hidden_size = {} exceeds {MAX_DIM}",
            mult * c.hidden_size
        )));
    }
    c.hyper = Some(HyperDims {
        mult,
        sinkhorn_iters: r.size_or("hc_sinkhorn_iters", 20, 1, 10_000)?,
        eps: r.f64_or("hc_eps", 1e-6)? as f32,
    });
    c.attention = AttentionKind::Compressed(read_dims(r, c)?);
    Ok(())
}

/// `mlp_layer_types` (`hash_moe` / `moe`), or the first `num_hash_layers` (3) hashed.
fn mlp_layer_types(r: &Reader, n: usize) -> Result<Vec<bool>> {
    match r.get("mlp_layer_types") {
        Some(v) => {
            let list = v
                .as_array()
                .ok_or_else(|| bad("config.json: `mlp_layer_types` must be a list"))?;
            if list.len() < n {
                return Err(bad(format!(
                    "config.json: `mlp_layer_types` has {} entries for {n} layers",
                    list.len()
                )));
            }
            list[..n]
                .iter()
                .map(|t| match t.as_str() {
                    Some("hash_moe") => Ok(true),
                    Some("moe") => Ok(false),
                    _ => Err(bad(format!(
                        "config.json: `mlp_layer_types` entry {t} is not \"hash_moe\" or \"moe\""
                    ))),
                })
                .collect()
        }
        None => {
            let hashed = r.usize_or("num_hash_layers", 3)?;
            Ok((0..n).map(|i| i < hashed).collect())
        }
    }
}

/// `layer_types`, or the older per-layer `compress_ratios` (0 / 4 / 128), or transformers'
/// default (two HCA layers, then CSA and HCA alternating).
fn layer_types(r: &Reader, n: usize) -> Result<Vec<CompressKind>> {
    let kind = |t: &serde_json::Value| match t.as_str() {
        Some(SLIDING) => Ok(CompressKind::Sliding),
        Some(CSA) => Ok(CompressKind::Sparse),
        Some(HCA) => Ok(CompressKind::Heavy),
        _ => Err(bad(format!(
            "config.json: `layer_types` entry {t} is not one of \"{SLIDING}\", \"{CSA}\", \
             \"{HCA}\""
        ))),
    };
    if let Some(v) = r.get("layer_types") {
        let list = v
            .as_array()
            .ok_or_else(|| bad("config.json: `layer_types` must be a list"))?;
        if list.len() < n {
            return Err(bad(format!(
                "config.json: `layer_types` has {} entries for {n} layers",
                list.len()
            )));
        }
        return list[..n].iter().map(kind).collect();
    }
    if let Some(v) = r.get("compress_ratios") {
        let list = v
            .as_array()
            .ok_or_else(|| bad("config.json: `compress_ratios` must be a list"))?;
        if list.len() < n {
            return Err(bad(format!(
                "config.json: `compress_ratios` has {} entries for {n} layers",
                list.len()
            )));
        }
        return list[..n]
            .iter()
            .map(|x| match x.as_u64() {
                Some(0) => Ok(CompressKind::Sliding),
                Some(4) => Ok(CompressKind::Sparse),
                Some(128) => Ok(CompressKind::Heavy),
                _ => Err(bad(format!(
                    "config.json: `compress_ratios` entry {x} is not 0, 4 or 128"
                ))),
            })
            .collect();
    }
    Ok((0..n)
        .map(|i| match i {
            0 | 1 => CompressKind::Heavy,
            _ if (i - 2) % 2 == 1 => CompressKind::Sparse,
            _ => CompressKind::Heavy,
        })
        .collect())
}

fn read_dims(r: &Reader, c: &mut ModelConfig) -> Result<CompressedDims> {
    let hd = c.head_dim;
    let partial = match r.get("partial_rotary_factor") {
        Some(_) => r.f64_or("partial_rotary_factor", 0.0)?,
        None => match r.get("qk_rope_head_dim") {
            Some(_) => r.size_req("qk_rope_head_dim", 2, MAX_DIM)? as f64 / hd.max(1) as f64,
            None => 64.0 / 512.0,
        },
    };
    let rope_dim = (hd as f64 * partial) as usize;
    if rope_dim == 0 || !rope_dim.is_multiple_of(2) || rope_dim > hd {
        return Err(bad(format!(
            "config.json: the rotated part of a head (`partial_rotary_factor`: {rope_dim} of \
             head_dim {hd}) must be even, positive and at most head_dim"
        )));
    }
    let heads = c.num_heads;
    let o_groups = r.size_or("o_groups", 8, 1, MAX_DIM)?;
    if !heads.is_multiple_of(o_groups) {
        return Err(bad(format!(
            "config.json: `o_groups` {o_groups} must divide num_attention_heads {heads}"
        )));
    }
    let o_lora_rank = r.size_or("o_lora_rank", 1024, 1, MAX_DIM)?;
    if o_groups * o_lora_rank > MAX_DIM {
        return Err(bad(format!(
            "config.json: o_groups * o_lora_rank = {} exceeds {MAX_DIM}",
            o_groups * o_lora_rank
        )));
    }
    let index_heads = r.size_or("index_n_heads", 64, 1, MAX_DIM)?;
    let index_head_dim = r.size_or("index_head_dim", 128, 1, MAX_DIM)?;
    if index_head_dim < rope_dim {
        return Err(bad(format!(
            "config.json: `index_head_dim` {index_head_dim} is narrower than the rotated part \
             of a head ({rope_dim})"
        )));
    }
    if index_heads * index_head_dim > MAX_DIM {
        return Err(bad(format!(
            "config.json: index_n_heads * index_head_dim = {} exceeds {MAX_DIM}",
            index_heads * index_head_dim
        )));
    }
    let (mut csa_rate, mut hca_rate) = (4, 128);
    if let Some(rates) = r.object("compress_rates")? {
        csa_rate = rates.size_or(CSA, csa_rate, 1, 1 << 16)?;
        hca_rate = rates.size_or(HCA, hca_rate, 1, 1 << 16)?;
    }
    csa_rate = r.size_or("compress_rate_csa", csa_rate, 1, 1 << 16)?;
    hca_rate = r.size_or("compress_rate_hca", hca_rate, 1, 1 << 16)?;
    let max_positions = r.usize_or("max_position_embeddings", 1 << 20)?;
    // `rope_parameters` as transformers leaves it ({main, compress}) or flat: then `main` is
    // plain RoPE at `rope_theta` and `compress` the flat parameters at `compress_rope_theta`,
    // YaRN's attention factor 1 (transformers' DeepseekV4Config).
    let params = r.object("rope_parameters")?;
    let nested = params
        .as_ref()
        .and_then(|p| Some((p.object("main").ok()??, p.object("compress").ok()??)));
    let ((main_theta, _, main_scaling), (compress_theta, _, compress_scaling)) = match nested {
        Some((main, compress)) => (
            rope_from(r, Some(main.value()), partial, max_positions)?,
            rope_from(r, Some(compress.value()), partial, max_positions)?,
        ),
        None => {
            let theta = r.f64_or("rope_theta", 10000.0)?;
            let main = serde_json::json!({"rope_type": "default", "rope_theta": theta});
            let mut compress = params
                .map(|p| p.value().clone())
                .unwrap_or_else(|| serde_json::json!({}));
            let ctheta = r.f64_or("compress_rope_theta", 160000.0)?;
            compress["rope_theta"] = serde_json::json!(ctheta);
            let yarn = compress
                .get("rope_type")
                .or_else(|| compress.get("type"))
                .and_then(|t| t.as_str())
                == Some("yarn");
            if yarn && compress.get("attention_factor").is_none() {
                compress["attention_factor"] = serde_json::json!(1.0);
            }
            (
                rope_from(r, Some(&main), partial, max_positions)?,
                rope_from(r, Some(&compress), partial, max_positions)?,
            )
        }
    };
    c.rotary_dim = rope_dim;
    Ok(CompressedDims {
        q_lora_rank: r.size_or("q_lora_rank", 1024, 1, MAX_DIM)?,
        rope_dim,
        o_groups,
        o_lora_rank,
        sliding_window: r.size_or("sliding_window", 128, 1, usize::MAX >> 1)?,
        csa_rate,
        hca_rate,
        index_heads,
        index_head_dim,
        index_topk: r.size_or("index_topk", 512, 1, usize::MAX >> 1)?,
        main_theta,
        main_scaling,
        compress_theta,
        compress_scaling,
    })
}

/// The tensors of a DeepSeek-V4 checkpoint under transformers' module names.
fn tensor_plan(c: &ModelConfig) -> Plan {
    let mut p = Plan::default();
    plan::add_embeddings(&mut p, c);
    let n = c.hyper.map_or(1, |h| h.mult);
    let wide = n * c.hidden_size;
    p.f32_matrix("hc_head.fn".into(), "model.hc_head.hc_fn".into(), n, wide);
    p.vector("hc_head.base".into(), "model.hc_head.hc_base".into(), n);
    p.vector("hc_head.scale".into(), "model.hc_head.hc_scale".into(), 1);
    for i in 0..c.num_layers {
        plan::add_layer_norms(&mut p, c, i);
        for block in ["attn_hc", "ffn_hc"] {
            let hf = |s: &str| format!("model.layers.{i}.{block}.{s}");
            let name = |s: &str| format!("layers.{i}.{block}.{s}");
            p.f32_matrix(name("fn"), hf("fn"), (2 + n) * n, wide);
            p.vector(name("base"), hf("base"), (2 + n) * n);
            p.vector(name("scale"), hf("scale"), 3);
        }
        compressed::plan(&mut p, c, i);
        plan::add_ffn(&mut p, c, i);
        if c.hash_layers[i] {
            p.int_table(
                format!("layers.{i}.hash"),
                format!("model.layers.{i}.mlp.gate.tid2eid"),
                c.vocab_size,
                c.top_k,
            );
        } else {
            p.vector(
                format!("layers.{i}.router_bias"),
                format!("model.layers.{i}.mlp.gate.e_score_correction_bias"),
                c.num_experts,
            );
        }
        plan::add_mlp(
            &mut p,
            &format!("layers.{i}.shared"),
            &format!("model.layers.{i}.mlp.shared_experts"),
            c.hidden_size,
            c.shared_intermediate_size,
        );
    }
    p
}

/// A DeepSeek-V4 checkpoint tensor's name under transformers' module names (what
/// transformers' conversion mapping does for `deepseek_v4`): DeepSeek's own names, with or
/// without a `model.` prefix, are renamed; names already in transformers' form stay.
pub fn module_name(name: &str) -> String {
    let bare = name.strip_prefix("model.").unwrap_or(name);
    match bare {
        "embed.weight" => return "model.embed_tokens.weight".into(),
        "head.weight" | "lm_head.weight" => return "lm_head.weight".into(),
        "hc_head_fn" => return "model.hc_head.hc_fn".into(),
        "hc_head_base" => return "model.hc_head.hc_base".into(),
        "hc_head_scale" => return "model.hc_head.hc_scale".into(),
        _ => {}
    }
    if !bare.starts_with("layers.") {
        return format!("model.{bare}");
    }
    // In transformers' order: the later rules see the earlier ones' output.
    const RULES: &[(&str, &str)] = &[
        (".attn.", ".self_attn."),
        (".ffn.", ".mlp."),
        (".indexer.compressor.", ".compressor.indexer."),
        (".attn_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        (".hc_attn_fn", ".attn_hc.fn"),
        (".hc_attn_base", ".attn_hc.base"),
        (".hc_attn_scale", ".attn_hc.scale"),
        (".hc_ffn_fn", ".ffn_hc.fn"),
        (".hc_ffn_base", ".ffn_hc.base"),
        (".hc_ffn_scale", ".ffn_hc.scale"),
        (".attn_sink", ".sinks"),
        (
            ".indexer.weights_proj.",
            ".compressor.indexer.scorer.weights_proj.",
        ),
        (".indexer.wq_b.", ".compressor.indexer.q_b_proj."),
        (".norm.", ".kv_norm."),
        (".ape", ".position_bias"),
        (".wq_a.", ".q_a_proj."),
        (".self_attn.wq_b.", ".self_attn.q_b_proj."),
        (".wkv.", ".kv_proj."),
        (".wgate.", ".gate_proj."),
        (".wo_a.", ".o_a_proj."),
        (".wo_b.", ".o_b_proj."),
        (".q_norm.", ".q_a_norm."),
        (".gate.bias", ".gate.e_score_correction_bias"),
        (".w1.", ".gate_proj."),
        (".w2.", ".down_proj."),
        (".w3.", ".up_proj."),
    ];
    let mut s = format!(".{bare}");
    for (from, to) in RULES {
        s = s.replace(from, to);
    }
    format!("model{s}")
}

#[cfg(test)]
mod tests {
    use super::module_name;

    #[test]
    fn published_and_saved_names_map_to_module_names() {
        for (from, to) in [
            ("embed.weight", "model.embed_tokens.weight"),
            ("model.embed_tokens.weight", "model.embed_tokens.weight"),
            ("head.weight", "lm_head.weight"),
            ("hc_head_fn", "model.hc_head.hc_fn"),
            ("model.hc_head.hc_scale", "model.hc_head.hc_scale"),
            ("norm.weight", "model.norm.weight"),
            (
                "layers.3.attn.wq_b.weight",
                "model.layers.3.self_attn.q_b_proj.weight",
            ),
            (
                "model.layers.2.attn.indexer.compressor.ape",
                "model.layers.2.self_attn.compressor.indexer.position_bias",
            ),
            (
                "layers.2.attn.indexer.wq_b.weight",
                "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight",
            ),
            (
                "layers.2.attn.indexer.weights_proj.weight",
                "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
            ),
            (
                "layers.1.attn.compressor.norm.weight",
                "model.layers.1.self_attn.compressor.kv_norm.weight",
            ),
            (
                "layers.0.ffn.experts.5.w3.weight",
                "model.layers.0.mlp.experts.5.up_proj.weight",
            ),
            (
                "layers.0.ffn.shared_experts.w2.weight",
                "model.layers.0.mlp.shared_experts.down_proj.weight",
            ),
            (
                "layers.0.ffn.gate.bias",
                "model.layers.0.mlp.gate.e_score_correction_bias",
            ),
            ("layers.0.hc_ffn_fn", "model.layers.0.ffn_hc.fn"),
            (
                "layers.0.attn_norm.weight",
                "model.layers.0.input_layernorm.weight",
            ),
            ("layers.0.attn.attn_sink", "model.layers.0.self_attn.sinks"),
            (
                "model.layers.0.self_attn.q_a_norm.weight",
                "model.layers.0.self_attn.q_a_norm.weight",
            ),
        ] {
            assert_eq!(module_name(from), to, "{from}");
        }
    }
}
