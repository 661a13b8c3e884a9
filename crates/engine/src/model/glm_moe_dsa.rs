//! GLM-5 (`GlmMoeDsaForCausalLM`, transformers' `glm_moe_dsa`): DeepSeek sparse attention, that
//! is multi-head latent attention (`layers/mla.rs`, always with the low-rank query and
//! interleaved rope) whose queries attend only over the `index_topk` positions a lightning
//! indexer picks (`layers/dsa.rs`: `index_n_heads` heads of `index_head_dim` over the
//! normed low-rank query, one key per position, per-head weights), and GLM-4.5's MoE
//! (`glm4_moe.rs`: the leading dense layers, here `mlp_layer_types` or
//! `first_k_dense_replace` (3); grouped sigmoid routing with the correction bias; x2.5 by
//! default). Layers marked `"shared"` (`indexer_types`, or the schedule of `index_topk_pattern`
//! / `index_topk_freq` and `index_skip_topk_offset`) have no indexer and reuse the top-k of the
//! last layer that has one, as transformers does; layers past `num_hidden_layers` (the MTP head)
//! are skipped at conversion.
//!
//! DeepSeek-V3.2 (`DeepseekV32ForCausalLM`, transformers' `deepseek_v32`) is the same model
//! without shared layers (every layer has its indexer) and with the indexer's rope half-split
//! instead of interleaved (the MLA's own rope stays interleaved); its defaults are
//! `DeepseekV32Config`'s.

use super::registry::Family;
use super::{deepseek_v3, glm4_moe};
use crate::config::{bad, AttentionKind, FfnKind, IndexerDims, ModelConfig, Reader, MAX_DIM};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: GLM5.name,
    chat_family: "glm",
    reads_head_dim: false,
    default_rotary_fraction: 1.0,
    default_rms_norm_eps: 1e-5,
    configure: |r, c| configure(r, c, &GLM5),
    plan: glm4_moe::tensor_plan,
    checkpoint_name: None,
    config_aliases: &[],
};

pub static DEEPSEEK_V32: Family = Family {
    hf_name: V32.name,
    chat_family: "deepseek_v32",
    reads_head_dim: false,
    default_rotary_fraction: 1.0,
    default_rms_norm_eps: 1e-6,
    configure: |r, c| configure(r, c, &V32),
    plan: glm4_moe::tensor_plan,
    checkpoint_name: None,
    config_aliases: &[],
};

/// What tells the two architectures apart: transformers' config defaults for the fields a
/// config leaves out, whether layers may share an indexer, and the indexer's rope layout.
struct Variant {
    name: &'static str,
    moe: glm4_moe::MoeDefaults,
    index_n_heads: usize,
    shared_layers: bool,
    indexer_rope_interleave: bool,
}

const GLM5: Variant = Variant {
    name: "GlmMoeDsaForCausalLM",
    moe: glm4_moe::MoeDefaults {
        first_k_dense_replace: 3,
        n_group: 1,
        topk_group: 1,
        routed_scaling_factor: 2.5,
    },
    index_n_heads: 32,
    shared_layers: true,
    indexer_rope_interleave: true,
};

const V32: Variant = Variant {
    name: "DeepseekV32ForCausalLM",
    moe: glm4_moe::MoeDefaults {
        first_k_dense_replace: 3,
        n_group: 8,
        topk_group: 4,
        routed_scaling_factor: 2.5,
    },
    index_n_heads: 64,
    shared_layers: false,
    indexer_rope_interleave: false,
};

fn configure(r: &Reader, c: &mut ModelConfig, v: &Variant) -> Result<()> {
    glm4_moe::configure_sigmoid_moe(r, c, v.moe)?;
    read_mlp_layer_types(r, c)?;
    if r.bool_or("attention_bias", false)? {
        return Err(bad(format!(
            "config.json: `attention_bias` true is not supported for {}",
            v.name
        )));
    }
    // The indexer projects the normed low-rank query: there is no full-q_proj form.
    let q_lora_rank = r.size_req("q_lora_rank", 1, MAX_DIM)?;
    let mla = deepseek_v3::read_mla(r, c, Some(q_lora_rank), true)?;
    let heads = r.size_or("index_n_heads", v.index_n_heads, 1, MAX_DIM)?;
    let head_dim = r.size_or("index_head_dim", 128, 1, MAX_DIM)?;
    let topk = r.size_or("index_topk", 2048, 1, usize::MAX >> 1)?;
    if head_dim < mla.qk_rope_head_dim {
        return Err(bad(format!(
            "config.json: `index_head_dim` {head_dim} is narrower than `qk_rope_head_dim` {}",
            mla.qk_rope_head_dim
        )));
    }
    if heads * head_dim > MAX_DIM {
        return Err(bad(format!(
            "config.json: index_n_heads * index_head_dim = {} exceeds {MAX_DIM}",
            heads * head_dim
        )));
    }
    c.indexer_layers = if v.shared_layers {
        indexer_types(r, c.num_layers)?
    } else {
        vec![true; c.num_layers]
    };
    c.attention = AttentionKind::Dsa(
        mla,
        IndexerDims {
            heads,
            head_dim,
            topk,
            rope_interleave: v.indexer_rope_interleave,
        },
    );
    Ok(())
}

/// `mlp_layer_types` (`"dense"` / `"sparse"` per layer), when the config lists them, overrides
/// `first_k_dense_replace` as in transformers.
fn read_mlp_layer_types(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    let Some(v) = r.get("mlp_layer_types") else {
        return Ok(());
    };
    let kinds = v
        .as_array()
        .filter(|a| a.len() == c.num_layers)
        .ok_or_else(|| {
            bad(format!(
                "config.json: `mlp_layer_types` must list one type per layer ({})",
                c.num_layers
            ))
        })?;
    c.layers = kinds
        .iter()
        .map(|k| match k.as_str() {
            Some("dense") => Ok(FfnKind::Dense),
            Some("sparse") => Ok(FfnKind::Moe),
            _ => Err(bad(format!(
                "config.json: `mlp_layer_types` entry {k} is not \"dense\" or \"sparse\""
            ))),
        })
        .collect::<Result<_>>()?;
    Ok(())
}

/// Per layer, whether it runs its own indexer (`"full"`): `indexer_types` when given, else the
/// schedule transformers derives from `index_topk_pattern`, or from `index_topk_freq` /
/// `index_skip_topk_offset` (layer `i` is full when `max(i + 1 - offset, 0) % freq == 0`).
/// The first layer must be full: a shared one would have no top-k to reuse.
fn indexer_types(r: &Reader, layers: usize) -> Result<Vec<bool>> {
    let (field, full) = if let Some(v) = r.get("indexer_types") {
        let types = v.as_array().filter(|a| a.len() == layers).ok_or_else(|| {
            bad(format!(
                "config.json: `indexer_types` must list one type per layer ({layers})"
            ))
        })?;
        let full = types
            .iter()
            .map(|t| match t.as_str() {
                Some("full") => Ok(true),
                Some("shared") => Ok(false),
                _ => Err(bad(format!(
                    "config.json: `indexer_types` entry {t} is not \"full\" or \"shared\""
                ))),
            })
            .collect::<Result<Vec<bool>>>()?;
        ("indexer_types", full)
    } else if let Some(p) = r.get("index_topk_pattern") {
        let letters: Vec<Option<bool>> = match p {
            serde_json::Value::String(s) => s
                .chars()
                .map(|ch| match ch {
                    'F' => Some(true),
                    'S' => Some(false),
                    _ => None,
                })
                .collect(),
            serde_json::Value::Array(a) => a
                .iter()
                .map(|x| match x.as_str() {
                    Some("full") => Some(true),
                    Some("shared") => Some(false),
                    _ => None,
                })
                .collect(),
            _ => vec![None],
        };
        let full: Option<Vec<bool>> = letters.into_iter().collect();
        match full {
            Some(f) if f.len() == layers => ("index_topk_pattern", f),
            _ => {
                return Err(bad(format!(
                    "config.json: `index_topk_pattern` must give \"F\" or \"S\" for each of \
                     the {layers} layers"
                )))
            }
        }
    } else {
        let freq = r.usize_or("index_topk_freq", 1)?.max(1);
        let offset = r.usize_or("index_skip_topk_offset", 2)?;
        let full = (0..layers)
            .map(|i| (i + 1).saturating_sub(offset) % freq == 0)
            .collect();
        ("index_topk_freq", full)
    };
    if full.first() == Some(&false) {
        return Err(bad(format!(
            "config.json: `{field}` makes layer 0 reuse a previous layer's top-k; there is none"
        )));
    }
    Ok(full)
}
