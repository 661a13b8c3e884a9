//! The model's shape and options, read only from a Hugging Face `config.json`.
//!
//! One [`ModelConfig`] describes every supported family. The fields every family shares are read
//! here; the architecture's [`Family`] (in `model/<family>.rs`, listed in `model/registry.rs`)
//! reads its own fields and chooses its blocks. Nothing here is tied to one model size. Unsupported options are refused
//! with a message that names them rather than being ignored.

use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::registry::{self, Family};

/// How a layer attends over the history (each kind has its file in `model/layers/`, which also
/// says what it keeps per position).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum AttentionKind {
    /// Grouped-query attention: `num_kv_heads` key and value heads of `head_dim`, RoPE.
    Gqa,
    /// Multi-head latent attention (DeepSeek-V3): a low-rank latent per position shared by
    /// every head plus one decoupled RoPE key; `head_dim` is the RoPE part's width.
    Mla(MlaDims),
    /// MLA whose queries attend only over the positions a lightning indexer picks (GLM-5's
    /// DeepSeek sparse attention, `model/layers/dsa.rs`).
    Dsa(MlaDims, IndexerDims),
    /// DeepSeek-V4's attention (`model/layers/compressed.rs`): one shared key-and-value head
    /// over a sliding window, plus (per layer, [`ModelConfig::compress_layers`]) compressed
    /// entries of the history, all of them or those an indexer picks.
    Compressed(CompressedDims),
    /// A hybrid of linear and full attention: the layers marked in
    /// [`ModelConfig::linear_layers`] are linear attention (`model/layers/delta.rs`: a
    /// fixed-size state per sequence, no per-position KV), the others `HybridFull`.
    Hybrid(LinearDims, HybridFull),
}

/// The full-attention layers of a hybrid.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HybridFull {
    /// Grouped-query attention with an output gate (Qwen3-Next).
    GatedGqa,
    /// Multi-head latent attention (Kimi Linear: without positions, [`MlaDims::positional`]).
    Mla(MlaDims),
}

/// Which linear attention a hybrid's linear layers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearKind {
    /// Gated DeltaNet (transformers' `Qwen3NextGatedDeltaNet`): one decay per head and
    /// position, the output gated by `silu(z)`.
    GatedDeltaNet,
    /// Kimi Delta Attention (transformers' `KimiLinearDeltaAttention`): one decay per key
    /// channel (a low-rank forget gate), the output gated by the sigmoid of a low-rank gate.
    Kda,
}

/// The shape of a hybrid's linear attention: `key_heads` query/key heads of `key_dim`, each
/// serving `value_heads / key_heads` value heads of `value_dim`; a causal depthwise
/// convolution of `conv_kernel` over q, k and v.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearDims {
    pub kind: LinearKind,
    pub key_heads: usize,
    pub value_heads: usize,
    pub key_dim: usize,
    pub value_dim: usize,
    pub conv_kernel: usize,
}

/// What a DeepSeek-V4 layer attends over besides its sliding window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CompressKind {
    /// The window only.
    Sliding,
    /// Heavily compressed attention: one entry per `hca_rate` positions, every entry attended.
    Heavy,
    /// Compressed sparse attention: one entry per `csa_rate` positions over overlapping windows,
    /// the `index_topk` an indexer scores highest attended.
    Sparse,
}

/// The shape of DeepSeek-V4's attention (transformers' `DeepseekV4Attention`): `head_dim` is
/// the one key-and-value head's width, the last `rope_dim` of each head rotated (interleaved).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CompressedDims {
    pub q_lora_rank: usize,
    pub rope_dim: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub sliding_window: usize,
    pub csa_rate: usize,
    pub hca_rate: usize,
    pub index_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    /// The sliding-only layers' RoPE (`rope_parameters.main`).
    pub main_theta: f64,
    pub main_scaling: RopeScaling,
    /// The compressed layers', their entries' and the indexer's (`rope_parameters.compress`).
    pub compress_theta: f64,
    pub compress_scaling: RopeScaling,
}

/// Manifold-constrained hyper-connections (DeepSeek-V4): the residual is `mult` streams, mixed
/// around each block by weights computed from them (`model/layers/hyper.rs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HyperDims {
    pub mult: usize,
    pub sinkhorn_iters: usize,
    pub eps: f32,
}

/// The DSA lightning indexer (`model/layers/dsa.rs`): `heads` query heads of `head_dim`
/// (the leading `qk_rope_head_dim` rotated) scoring one key per position, and the `topk`
/// positions each query attends over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerDims {
    pub heads: usize,
    pub head_dim: usize,
    pub topk: usize,
    /// The indexer's rope on interleaved pairs (GLM-5) or on the two halves (DeepSeek-V3.2).
    pub rope_interleave: bool,
}

/// The shape of multi-head latent attention (`model/layers/mla.rs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlaDims {
    /// The query's low-rank projection (`q_a_proj`, RMSNorm, `q_b_proj`), or none (`q_proj`).
    pub q_lora_rank: Option<usize>,
    /// Width of the compressed KV latent `c_kv` each position keeps.
    pub kv_lora_rank: usize,
    /// Per head: query/key dims without RoPE, with RoPE (the shared rope key), value dims.
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The rope dims of q and k come interleaved (pairs `2i, 2i+1`), as transformers'
    /// `rope_interleave` reads them.
    pub rope_interleave: bool,
    /// The softmax scale: `qk_head_dim^-0.5`, times `mscale^2` with YaRN's `mscale_all_dim`.
    pub softmax_scale: f32,
    /// Whether the rope dims are rotated by position (false: Kimi Linear's MLA, whose
    /// `qk_rope_head_dim` dims are kept, shared by every head, and never rotated).
    pub positional: bool,
}

/// Where the query/key RMSNorm applies, if anywhere.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QkNorm {
    None,
    /// Over the whole projected q (all heads) and k (all kv heads), before splitting heads (OLMoE).
    Full,
    /// Over each head's `head_dim` values (Qwen3-MoE, GLM-4.5 with `use_qk_norm`).
    PerHead,
}

/// How a MoE layer picks its experts and weighs them.
#[derive(Clone, Debug, PartialEq)]
pub enum Routing {
    /// softmax over all experts, top-k, optionally renormalised over the chosen k.
    SoftmaxTopK { norm_topk_prob: bool },
    /// sigmoid scores; choice by score + correction bias restricted to the best `topk_group` of
    /// `n_group` groups (a group's score is the sum of its two best); weights are the plain
    /// scores of the chosen experts, optionally renormalised, times `scaling` (GLM-4.5).
    SigmoidGrouped {
        n_group: usize,
        topk_group: usize,
        norm_topk_prob: bool,
        scaling: f32,
    },
    /// `sqrt(softplus)` scores; choice by score + correction bias; weights the chosen scores
    /// renormalised, times `scaling` (DeepSeek-V4). A layer with a hash table
    /// ([`ModelConfig::hash_layers`]) takes its experts from the token id instead.
    SqrtSoftplus { scaling: f32 },
}

/// The feed-forward block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Moe,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// The architecture's family (its name is `family.hf_name`).
    pub family: &'static Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates (rotate-half style); the rest pass through.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub rms_norm_eps: f32,
    pub max_positions: usize,
    pub attention: AttentionKind,
    pub qk_norm: QkNorm,
    pub clip_qkv: Option<f32>,
    /// Intermediate size of dense (non-MoE) feed-forward layers.
    pub intermediate_size: usize,
    pub num_experts: usize,
    pub top_k: usize,
    pub moe_intermediate_size: usize,
    /// Intermediate size of the always-on shared expert MLP (0: none).
    pub shared_intermediate_size: usize,
    pub routing: Routing,
    pub layers: Vec<FfnKind>,
    /// DSA only (else empty): per layer, whether it runs its own indexer (`"full"`) or reuses
    /// the top-k of the last layer that did (`"shared"`).
    pub indexer_layers: Vec<bool>,
    /// DeepSeek-V4 only (else empty): per layer, what it attends over besides its window.
    pub compress_layers: Vec<CompressKind>,
    /// Hybrids only (else empty): per layer, whether it is linear attention.
    pub linear_layers: Vec<bool>,
    /// DeepSeek-V4 only (else empty): per layer, whether its experts come from a per-token
    /// table (`hash_moe`) rather than the router's choice.
    pub hash_layers: Vec<bool>,
    /// The residual's hyper-connections, if the model has them (DeepSeek-V4).
    pub hyper: Option<HyperDims>,
    /// SwiGLU inputs clamped (gate above, up both ways) at this value (DeepSeek-V4).
    pub swiglu_limit: Option<f32>,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

pub(crate) fn bad(msg: impl Into<String>) -> Error {
    Error::Config(msg.into())
}

/// Upper bound on any one size in `config.json` (hidden size, vocabulary, experts, heads, ...).
/// Far above any real model, low enough that products of two sizes (and their byte counts) cannot
/// overflow and that a corrupt config cannot make the engine reserve absurd amounts of memory.
pub const MAX_DIM: usize = 1 << 20;
/// Upper bound on `num_hidden_layers`.
pub const MAX_LAYERS: usize = 1 << 12;

/// Typed reads of `config.json` fields, with errors that name the field.
pub struct Reader<'a> {
    v: &'a Value,
    /// (field, key): `field` is also read from `key` when the config has no `field` (the
    /// family's [`Family::config_aliases`](crate::model::registry::Family)).
    aliases: &'a [(&'a str, &'a str)],
}

impl<'a> Reader<'a> {
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        let get = |k: &str| self.v.get(k).filter(|v| !v.is_null());
        get(key).or_else(|| {
            self.aliases
                .iter()
                .filter(|(field, _)| *field == key)
                .find_map(|(_, stored)| get(stored))
        })
    }
    /// The object under `key`, read with the same rules (none when absent or `null`; no
    /// aliases inside it).
    pub fn object(&self, key: &str) -> Result<Option<Reader<'a>>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) if v.is_object() => Ok(Some(Reader { v, aliases: &[] })),
            Some(_) => Err(bad(format!("config.json: `{key}` must be an object"))),
        }
    }
    /// The value itself.
    pub fn value(&self) -> &'a Value {
        self.v
    }
    /// Whether the config has `key` (or an alias of it) at all (`null` included).
    pub fn has(&self, key: &str) -> bool {
        self.v.get(key).is_some()
            || self
                .aliases
                .iter()
                .any(|(field, stored)| *field == key && self.v.get(stored).is_some())
    }
    /// How errors name `key`: the key the config stores it under, or (absent) `key` with its
    /// aliases.
    pub fn name(&self, key: &str) -> String {
        if self.v.get(key).is_some() {
            return key.to_string();
        }
        let stored: Vec<&str> = self
            .aliases
            .iter()
            .filter(|(field, _)| *field == key)
            .map(|(_, stored)| *stored)
            .collect();
        match stored.iter().find(|s| self.v.get(**s).is_some()) {
            Some(s) => s.to_string(),
            None if stored.is_empty() => key.to_string(),
            None => format!("{key}` (or `{}`)", stored.join("`, `")),
        }
    }
    pub fn usize_req(&self, key: &str) -> Result<usize> {
        let name = || self.name(key);
        self.get(key)
            .ok_or_else(|| bad(format!("config.json: missing required field `{}`", name())))?
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| {
                bad(format!(
                    "config.json: `{}` must be a non-negative integer",
                    name()
                ))
            })
    }
    pub fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.usize_req(key),
        }
    }
    /// A size: an integer in `min..=max`.
    pub fn size_req(&self, key: &str, min: usize, max: usize) -> Result<usize> {
        check_size(&self.name(key), self.usize_req(key)?, min, max)
    }
    pub fn size_or(&self, key: &str, default: usize, min: usize, max: usize) -> Result<usize> {
        check_size(&self.name(key), self.usize_or(key, default)?, min, max)
    }
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_f64().ok_or_else(|| {
                bad(format!(
                    "config.json: `{}` must be a number",
                    self.name(key)
                ))
            }),
        }
    }
    pub fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| {
                bad(format!(
                    "config.json: `{}` must be true or false",
                    self.name(key)
                ))
            }),
        }
    }
}

fn check_size(key: &str, x: usize, min: usize, max: usize) -> Result<usize> {
    if x < min || x > max {
        return Err(bad(format!(
            "config.json: `{key}` is {x}, must be between {min} and {max}"
        )));
    }
    Ok(x)
}

/// How RoPE frequencies are scaled for contexts past the pretraining length (transformers'
/// `rope_type`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// `default`: none.
    None,
    /// `linear`: every frequency divided by `factor` (position interpolation).
    Linear { factor: f64 },
    /// `yarn`: frequencies interpolated by `factor` below the correction range, kept above it,
    /// ramped between (beta_fast / beta_slow rotations over `original_max_positions`); cos and
    /// sin multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_positions: f64,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        truncate: bool,
    },
}

/// RoPE settings: (theta, partial rotary fraction, scaling) from `rope_parameters`
/// (transformers 5), else top-level `rope_theta` / `partial_rotary_factor` / `rope_scaling`
/// (older checkpoints). Scaling parameters as transformers' `modeling_rope_utils` reads them.
fn rope_settings(
    r: &Reader,
    default_partial: f64,
    max_positions: usize,
) -> Result<(f64, f64, RopeScaling)> {
    let params = r.get("rope_parameters").or_else(|| r.get("rope_scaling"));
    rope_from(r, params, default_partial, max_positions)
}

/// RoPE settings from one set of RoPE parameters `params` (an object, or none), with the
/// top-level config `r` for the fields it falls back on.
pub(crate) fn rope_from(
    r: &Reader,
    params: Option<&Value>,
    default_partial: f64,
    max_positions: usize,
) -> Result<(f64, f64, RopeScaling)> {
    let mut theta = r.f64_or("rope_theta", 10000.0)?;
    let mut partial = r.f64_or("partial_rotary_factor", default_partial)?;
    let mut scaling = RopeScaling::None;
    if let Some(p) = params {
        if !p.is_object() {
            return Err(bad("config.json: `rope_parameters` must be an object"));
        }
        let p = Reader { v: p, aliases: &[] };
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        theta = p.f64_or("rope_theta", theta)?;
        partial = p.f64_or("partial_rotary_factor", partial)?;
        scaling =
            match kind {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear {
                    factor: positive(&p, "factor", None)?,
                },
                "yarn" => yarn(r, &p, max_positions)?,
                "dynamic" => return Err(bad(
                    "config.json: RoPE type `dynamic` is not supported: its frequencies change \
                     with the length of each forward pass, which a KV cache cannot follow",
                )),
                other => {
                    return Err(bad(format!(
                        "config.json: RoPE type `{other}` is not supported yet (default, linear, \
                     yarn)"
                    )))
                }
            };
    }
    if !(theta.is_finite() && theta > 0.0) {
        return Err(bad(format!(
            "config.json: rope_theta {theta} must be a positive number"
        )));
    }
    if !(partial > 0.0 && partial <= 1.0) {
        return Err(bad(format!(
            "config.json: partial_rotary_factor {partial} must be in (0, 1]"
        )));
    }
    Ok((theta, partial, scaling))
}

/// A RoPE parameter that must be a positive number (`default` when absent, if any).
fn positive(p: &Reader, key: &str, default: Option<f64>) -> Result<f64> {
    let v = match (p.get(key), default) {
        (None, Some(d)) => d,
        (None, None) => return Err(bad(format!("config.json: RoPE scaling needs `{key}`"))),
        (Some(_), _) => p.f64_or(key, 0.0)?,
    };
    if !(v.is_finite() && v > 0.0) {
        return Err(bad(format!(
            "config.json: RoPE `{key}` {v} must be a positive number"
        )));
    }
    Ok(v)
}

/// YaRN's parameters, defaulted as transformers' `_compute_yarn_parameters` does:
/// `original_max_position_embeddings` from the RoPE parameters, else the top-level field, else
/// `max_position_embeddings`; `factor` absent: max / original; `attention_factor` absent:
/// `0.1 ln(factor) + 1`, or with `mscale` and `mscale_all_dim` the ratio of those terms;
/// `beta_fast` 32, `beta_slow` 1, `truncate` true.
fn yarn(top: &Reader, p: &Reader, max_positions: usize) -> Result<RopeScaling> {
    let original = match p.get("original_max_position_embeddings") {
        Some(_) => positive(p, "original_max_position_embeddings", None)?,
        None => positive(
            top,
            "original_max_position_embeddings",
            Some(max_positions as f64),
        )?,
    };
    let factor = match p.get("factor") {
        Some(_) => positive(p, "factor", None)?,
        None => max_positions as f64 / original,
    };
    let get_mscale = |scale: f64, m: f64| {
        if scale <= 1.0 {
            1.0
        } else {
            0.1 * m * scale.ln() + 1.0
        }
    };
    let attention_factor = match p.get("attention_factor") {
        Some(_) => positive(p, "attention_factor", None)?,
        None => {
            let m = p.f64_or("mscale", 0.0)?;
            let m_all = p.f64_or("mscale_all_dim", 0.0)?;
            if m != 0.0 && m_all != 0.0 {
                get_mscale(factor, m) / get_mscale(factor, m_all)
            } else {
                get_mscale(factor, 1.0)
            }
        }
    };
    // transformers reads `beta_fast or 32`: 0 counts as absent too.
    let beta = |key: &str, default: f64| -> Result<f64> {
        let v = p.f64_or(key, 0.0)?;
        Ok(if v == 0.0 { default } else { v })
    };
    Ok(RopeScaling::Yarn {
        factor,
        original_max_positions: original,
        beta_fast: beta("beta_fast", 32.0)?,
        beta_slow: beta("beta_slow", 1.0)?,
        attention_factor,
        truncate: p.bool_or("truncate", true)?,
    })
}

fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64())
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

impl ModelConfig {
    /// Parses a `config.json` value. Refuses unknown architectures and unsupported options.
    pub fn from_hf(v: &Value) -> Result<ModelConfig> {
        let arch_name = Reader { v, aliases: &[] }
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| bad("config.json: missing `architectures`"))?;
        let family = registry::by_hf_name(arch_name).ok_or_else(|| {
            bad(format!(
                "unsupported architecture `{arch_name}` (supported: {})",
                registry::hf_names().join(", ")
            ))
        })?;
        let r = Reader {
            v,
            aliases: family.config_aliases,
        };
        let act = r
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(bad(format!(
                "config.json: hidden_act `{act}` is not supported (only silu)"
            )));
        }
        let hidden_size = r.size_req("hidden_size", 1, MAX_DIM)?;
        let num_layers = r.size_req("num_hidden_layers", 0, MAX_LAYERS)?;
        let num_heads = r.size_req("num_attention_heads", 0, MAX_DIM)?;
        let num_kv_heads = r.size_or("num_key_value_heads", num_heads, 0, MAX_DIM)?;
        if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
            return Err(bad(format!(
                "config.json: num_attention_heads ({num_heads}) must be a positive multiple of \
                 num_key_value_heads ({num_kv_heads})"
            )));
        }
        let head_dim = if family.reads_head_dim {
            r.size_or("head_dim", hidden_size / num_heads, 0, MAX_DIM)?
        } else {
            hidden_size / num_heads
        };
        if num_heads * head_dim > MAX_DIM {
            return Err(bad(format!(
                "config.json: num_attention_heads * head_dim = {} exceeds {MAX_DIM}",
                num_heads * head_dim
            )));
        }
        let mut c = ModelConfig {
            family,
            vocab_size: 0,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim: 0,
            rope_theta: 0.0,
            rope_scaling: RopeScaling::None,
            rms_norm_eps: 0.0,
            max_positions: 0,
            attention: AttentionKind::Gqa,
            qk_norm: QkNorm::None,
            clip_qkv: None,
            intermediate_size: 0,
            num_experts: 0,
            top_k: 0,
            moe_intermediate_size: 0,
            shared_intermediate_size: 0,
            routing: Routing::SoftmaxTopK {
                norm_topk_prob: false,
            },
            layers: vec![FfnKind::Dense; num_layers],
            indexer_layers: Vec::new(),
            compress_layers: Vec::new(),
            linear_layers: Vec::new(),
            hash_layers: Vec::new(),
            hyper: None,
            swiglu_limit: None,
            tie_word_embeddings: false,
            eos_token_ids: Vec::new(),
            bos_token_id: None,
        };
        // Checked by `check_blocks` when the model has dense layers (DeepSeek-V4 has none and
        // its configs no `intermediate_size`).
        c.intermediate_size = r.size_or("intermediate_size", 0, 0, MAX_DIM)?;
        c.top_k = r.size_req("num_experts_per_tok", 0, MAX_DIM)?;
        // The family's own fields and checks (they may refuse the shared ones too).
        (family.configure)(&r, &mut c)?;
        c.max_positions = r.usize_or("max_position_embeddings", 4096)?;
        let (rope_theta, partial, scaling) =
            rope_settings(&r, family.default_rotary_fraction, c.max_positions)?;
        c.rope_theta = rope_theta;
        c.rope_scaling = scaling;
        c.rotary_dim = ((c.head_dim as f64 * partial) as usize) & !1;
        if c.rotary_dim == 0 {
            return Err(bad("config.json: rotary dimension is zero"));
        }
        c.rms_norm_eps = r.f64_or("rms_norm_eps", family.default_rms_norm_eps)? as f32;
        c.vocab_size = r.size_req("vocab_size", 1, MAX_DIM)?;
        c.tie_word_embeddings = r.bool_or("tie_word_embeddings", false)?;
        c.eos_token_ids = token_ids(r.get("eos_token_id"));
        c.bos_token_id = token_ids(r.get("bos_token_id")).first().copied();
        c.check_blocks()?;
        Ok(c)
    }

    /// Sizes the chosen blocks need.
    fn check_blocks(&self) -> Result<()> {
        let (dense, moe) = (
            self.layers.contains(&FfnKind::Dense),
            self.layers.contains(&FfnKind::Moe),
        );
        if dense && self.intermediate_size == 0 {
            return Err(bad(
                "config.json: intermediate_size must be positive (the model has dense layers)",
            ));
        }
        if moe && self.moe_intermediate_size == 0 {
            return Err(bad(
                "config.json: the MoE intermediate size must be positive",
            ));
        }
        if moe && (self.top_k == 0 || self.top_k > self.num_experts) {
            return Err(bad(format!(
                "config.json: num_experts_per_tok ({}) must be between 1 and the number of \
                 experts ({})",
                self.top_k, self.num_experts
            )));
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn glm() -> Value {
        json!({
            "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "vocab_size": 100,
            "intermediate_size": 96, "moe_intermediate_size": 32, "n_routed_experts": 8,
            "num_experts_per_tok": 3, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "use_qk_norm": true, "routed_scaling_factor": 2.5
        })
    }

    #[test]
    fn glm_partial_rotary_and_leading_dense_layers() {
        let c = ModelConfig::from_hf(&glm()).unwrap();
        assert_eq!(c.rotary_dim, 12);
        assert_eq!(c.layers, vec![FfnKind::Dense, FfnKind::Moe, FfnKind::Moe]);
        assert_eq!(c.qk_norm, QkNorm::PerHead);
        assert_eq!(c.shared_intermediate_size, 32);
    }

    #[test]
    fn unsupported_architecture_is_named() {
        let mut v = glm();
        v["architectures"] = json!(["LlamaForCausalLM"]);
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("LlamaForCausalLM"), "{e}");
    }

    #[test]
    fn rope_types_colibri_cannot_follow_are_refused_by_name() {
        for kind in ["dynamic", "longrope", "llama3"] {
            let mut v = glm();
            v["rope_parameters"] = json!({"rope_type": kind, "factor": 4.0});
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(kind), "{e}");
        }
        let mut v = glm();
        v["rope_parameters"] = json!({"rope_type": "linear"});
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("factor"), "{e}");
        v["rope_parameters"] = json!({"rope_type": "yarn", "factor": -2.0});
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("factor"), "{e}");
    }

    #[test]
    fn yarn_defaults_follow_transformers() {
        let mut v = glm();
        v["max_position_embeddings"] = json!(131072);
        v["rope_parameters"] =
            json!({"rope_type": "yarn", "original_max_position_embeddings": 32768});
        let c = ModelConfig::from_hf(&v).unwrap();
        let RopeScaling::Yarn {
            factor,
            attention_factor,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } = c.rope_scaling
        else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(
            (factor, beta_fast, beta_slow, truncate),
            (4.0, 32.0, 1.0, true)
        );
        assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
    }

    #[test]
    fn qwen_mlp_only_layers() {
        let v = json!({
            "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 20, "vocab_size": 100,
            "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8,
            "num_experts_per_tok": 3, "mlp_only_layers": [1], "rope_theta": 1e6
        });
        let c = ModelConfig::from_hf(&v).unwrap();
        assert_eq!(c.layers, vec![FfnKind::Moe, FfnKind::Dense, FfnKind::Moe]);
        assert_eq!(c.head_dim, 20);
        assert_eq!(c.rope_theta, 1e6);
    }

    fn deepseek() -> Value {
        json!({
            "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 56, "num_hidden_layers": 3,
            "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 8, "vocab_size": 100,
            "intermediate_size": 72, "moe_intermediate_size": 20, "n_routed_experts": 9,
            "num_experts_per_tok": 3, "n_group": 3, "topk_group": 2, "first_k_dense_replace": 1,
            "q_lora_rank": null, "kv_lora_rank": 20, "qk_nope_head_dim": 12,
            "qk_rope_head_dim": 8, "v_head_dim": 10, "routed_scaling_factor": 2.5,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8},
            "max_position_embeddings": 256
        })
    }

    #[test]
    fn deepseek_v3_reads_mla_dims_and_scales_the_softmax_as_transformers() {
        let c = ModelConfig::from_hf(&deepseek()).unwrap();
        let AttentionKind::Mla(d) = c.attention else {
            panic!("{:?}", c.attention)
        };
        assert_eq!(
            (
                d.q_lora_rank,
                d.kv_lora_rank,
                d.qk_nope_head_dim,
                d.qk_rope_head_dim,
                d.v_head_dim
            ),
            (None, 20, 12, 8, 10)
        );
        assert!(d.rope_interleave, "transformers' default");
        // RoPE rotates the rope part only: the whole 8 dims.
        assert_eq!((c.head_dim, c.rotary_dim), (8, 8));
        // qk_head_dim^-0.5 * yarn_get_mscale(4, 0.8)^2.
        let m = 0.1 * 0.8 * 4f64.ln() + 1.0;
        let want = (1.0 / 20f64.sqrt()) * m * m;
        assert!(
            (d.softmax_scale as f64 - want).abs() < 1e-7,
            "{}",
            d.softmax_scale
        );
        assert_eq!(c.layers, vec![FfnKind::Dense, FfnKind::Moe, FfnKind::Moe]);
        assert_eq!(c.shared_intermediate_size, 20);
        // The default RoPE type leaves the scale alone even with mscale_all_dim.
        let mut v = deepseek();
        v["rope_parameters"]["rope_type"] = json!("default");
        v["q_lora_rank"] = json!(24);
        let c = ModelConfig::from_hf(&v).unwrap();
        let AttentionKind::Mla(d) = c.attention else {
            panic!()
        };
        assert_eq!(d.q_lora_rank, Some(24));
        assert!((d.softmax_scale as f64 - 1.0 / 20f64.sqrt()).abs() < 1e-7);
    }

    #[test]
    fn the_mla_cache_keeps_one_latent_and_rope_key_run_per_layer() {
        let c = ModelConfig::from_hf(&deepseek()).unwrap();
        let layout = crate::model::layers::kv_layout(&c);
        assert_eq!(layout.layers.len(), 3);
        for l in &layout.layers {
            assert_eq!((l.heads, l.key_dim, l.value_dim), (1, 20 + 8, 0));
        }
    }

    #[test]
    fn malformed_mla_configs_are_refused_by_name() {
        for (key, value) in [
            ("kv_lora_rank", json!(0)),
            ("kv_lora_rank", Value::Null),
            ("qk_rope_head_dim", json!(5)),
            ("v_head_dim", json!(0)),
            ("q_lora_rank", json!(0)),
            ("attention_bias", json!(true)),
            ("qk_nope_head_dim", json!(1u64 << 40)),
        ] {
            let mut v = deepseek();
            v[key] = value;
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
        // transformers would default an absent q_lora_rank to 1536, not to none: refused.
        for key in ["q_lora_rank", "kv_lora_rank", "qk_rope_head_dim"] {
            let mut v = deepseek();
            v.as_object_mut().unwrap().remove(key);
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
        for (key, value) in [("scoring_func", "softmax"), ("topk_method", "greedy")] {
            let mut v = deepseek();
            v[key] = json!(value);
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
        // DeepSeek-V3's and Kimi K2's own values pass.
        let mut v = deepseek();
        v["scoring_func"] = json!("sigmoid");
        v["topk_method"] = json!("noaux_tc");
        ModelConfig::from_hf(&v).unwrap();
        let mut v = deepseek();
        v["n_group"] = json!(4);
        let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
        assert!(e.contains("n_group"), "{e}");
    }

    /// Found by fuzzing: sizes from a corrupt config once reached allocations (`vec![..;
    /// num_hidden_layers]`) and products (`n_shared_experts * moe_intermediate_size`) unchecked.
    #[test]
    fn absurd_sizes_are_refused_by_name() {
        for (key, value) in [
            ("num_hidden_layers", json!(1u64 << 60)),
            ("hidden_size", json!(u64::MAX)),
            ("hidden_size", json!(0)),
            ("vocab_size", json!(0)),
            ("n_shared_experts", json!(1u64 << 40)),
            ("head_dim", json!(1u64 << 40)),
            ("n_routed_experts", json!(1u64 << 33)),
        ] {
            let mut v = glm();
            v[key] = value;
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(key) || e.contains("exceeds"), "{key}: {e}");
        }
        let mut v = glm();
        v["num_attention_heads"] = json!(1 << 19);
        v["num_key_value_heads"] = json!(1);
        v["head_dim"] = json!(1 << 19);
        assert!(ModelConfig::from_hf(&v)
            .unwrap_err()
            .to_string()
            .contains("exceeds"));
    }

    #[test]
    fn zero_intermediate_sizes_and_bad_theta_are_refused() {
        let mut v = glm();
        v["moe_intermediate_size"] = json!(0);
        assert!(ModelConfig::from_hf(&v).is_err());
        let mut v = glm();
        v["intermediate_size"] = json!(0);
        assert!(ModelConfig::from_hf(&v)
            .unwrap_err()
            .to_string()
            .contains("intermediate_size"));
        let mut v = glm();
        v["rope_parameters"]["rope_theta"] = json!(-1.0);
        assert!(ModelConfig::from_hf(&v)
            .unwrap_err()
            .to_string()
            .contains("rope_theta"));
    }

    fn glm5() -> Value {
        json!({
            "architectures": ["GlmMoeDsaForCausalLM"], "hidden_size": 56, "num_hidden_layers": 3,
            "num_attention_heads": 3, "num_key_value_heads": 3, "vocab_size": 100,
            "intermediate_size": 72, "moe_intermediate_size": 20, "n_routed_experts": 9,
            "num_experts_per_tok": 3, "q_lora_rank": 24, "kv_lora_rank": 20,
            "qk_nope_head_dim": 12, "qk_rope_head_dim": 8, "v_head_dim": 10,
            "index_n_heads": 6, "index_head_dim": 12, "index_topk": 7,
            "max_position_embeddings": 256
        })
    }

    #[test]
    fn deepseek_v32_is_dsa_with_an_indexer_per_layer_and_half_split_indexer_rope() {
        let mut v = glm5();
        v["architectures"] = json!(["DeepseekV32ForCausalLM"]);
        v["n_routed_experts"] = json!(16);
        let c = ModelConfig::from_hf(&v).unwrap();
        let AttentionKind::Dsa(d, x) = c.attention else {
            panic!("{:?}", c.attention)
        };
        assert!(d.rope_interleave, "the MLA's own rope interleaves");
        assert!(!x.rope_interleave, "the indexer's is half-split");
        assert_eq!(c.indexer_layers, vec![true; 3]);
        // DeepseekV32Config's defaults: 8 groups, top-4 groups, eps 1e-6, 64 indexer heads.
        assert_eq!(
            c.routing,
            Routing::SigmoidGrouped {
                n_group: 8,
                topk_group: 4,
                norm_topk_prob: true,
                scaling: 2.5
            }
        );
        assert_eq!(c.rms_norm_eps, 1e-6);
        v.as_object_mut().unwrap().remove("index_n_heads");
        let AttentionKind::Dsa(_, x) = ModelConfig::from_hf(&v).unwrap().attention else {
            unreachable!()
        };
        assert_eq!(x.heads, 64);
    }

    #[test]
    fn glm_moe_dsa_reads_the_indexer_and_transformers_defaults() {
        let c = ModelConfig::from_hf(&glm5()).unwrap();
        let AttentionKind::Dsa(d, x) = c.attention else {
            panic!("{:?}", c.attention)
        };
        assert_eq!(d.q_lora_rank, Some(24));
        assert!(d.rope_interleave, "GLM-5 always interleaves");
        assert_eq!(
            x,
            IndexerDims {
                heads: 6,
                head_dim: 12,
                topk: 7,
                rope_interleave: true
            }
        );
        // GlmMoeDsaConfig's defaults: 3 dense layers, one group, x2.5.
        assert_eq!(c.layers, vec![FfnKind::Dense; 3]);
        assert_eq!(
            c.routing,
            Routing::SigmoidGrouped {
                n_group: 1,
                topk_group: 1,
                norm_topk_prob: true,
                scaling: 2.5
            }
        );
        assert_eq!(c.rms_norm_eps, 1e-5);
        // mlp_layer_types, when listed, decides.
        let mut v = glm5();
        v["mlp_layer_types"] = json!(["dense", "sparse", "sparse"]);
        let c = ModelConfig::from_hf(&v).unwrap();
        assert_eq!(c.layers, vec![FfnKind::Dense, FfnKind::Moe, FfnKind::Moe]);
        let layout = crate::model::layers::kv_layout(&c);
        for l in &layout.layers {
            assert_eq!((l.heads, l.key_dim, l.value_dim), (1, 20 + 8, 12));
        }
        assert_eq!(
            c.indexer_layers,
            vec![true; 3],
            "every layer full by default"
        );
        // A schedule, however it is written; shared layers keep no indexer key.
        for (key, value, want) in [
            (
                "indexer_types",
                json!(["full", "shared", "full"]),
                [true, false, true],
            ),
            ("index_topk_pattern", json!("FFS"), [true, true, false]),
            ("index_topk_freq", json!(2), [true, true, false]),
        ] {
            let mut v = glm5();
            v[key] = value;
            let c = ModelConfig::from_hf(&v).unwrap();
            assert_eq!(c.indexer_layers, want, "{key}");
            let layout = crate::model::layers::kv_layout(&c);
            let widths: Vec<usize> = layout.layers.iter().map(|l| l.value_dim).collect();
            let keys: Vec<usize> = want.iter().map(|&f| if f { 12 } else { 0 }).collect();
            assert_eq!(widths, keys, "{key}");
        }
        // transformers' schedule: full when max(i + 1 - offset, 0) % freq == 0.
        let mut v = glm5();
        v["num_hidden_layers"] = json!(8);
        v["index_topk_freq"] = json!(4);
        v["index_skip_topk_offset"] = json!(3);
        let c = ModelConfig::from_hf(&v).unwrap();
        let want = [true, true, true, false, false, false, true, false];
        assert_eq!(c.indexer_layers, want);
    }

    #[test]
    fn malformed_glm_moe_dsa_configs_are_refused_by_name() {
        for (key, value) in [
            ("q_lora_rank", Value::Null),
            ("index_topk", json!(0)),
            ("index_n_heads", json!(0)),
            ("index_head_dim", json!(6)),
            ("indexer_types", json!(["shared", "full", "full"])),
            ("indexer_types", json!(["full"])),
            ("indexer_types", json!(["full", "half", "full"])),
            ("index_topk_pattern", json!("SFF")),
            ("index_topk_pattern", json!("FF")),
            ("mlp_layer_types", json!(["dense", "dense"])),
            ("attention_bias", json!(true)),
        ] {
            let mut v = glm5();
            v[key] = value;
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }
}
