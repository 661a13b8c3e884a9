//! The model's shape and options, read only from a Hugging Face `config.json`.
//!
//! One [`ModelConfig`] describes every supported family; the per-family files in `model/` decide
//! which fields they read. Nothing here is tied to one model size. Unsupported options are refused
//! with a message that names them rather than being ignored.

use serde_json::Value;

use crate::error::{Error, Result};

/// The model families the engine can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Olmoe,
    Qwen3Moe,
    Glm4Moe,
}

impl Arch {
    /// The Hugging Face `architectures[0]` name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Arch::Olmoe => "OlmoeForCausalLM",
            Arch::Qwen3Moe => "Qwen3MoeForCausalLM",
            Arch::Glm4Moe => "Glm4MoeForCausalLM",
        }
    }

    pub fn from_hf_name(name: &str) -> Option<Arch> {
        [Arch::Olmoe, Arch::Qwen3Moe, Arch::Glm4Moe]
            .into_iter()
            .find(|a| a.hf_name() == name)
    }
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
}

/// The feed-forward block of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FfnKind {
    Dense,
    Moe,
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Leading dims of each head that RoPE rotates (rotate-half style); the rest pass through.
    pub rotary_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f32,
    pub max_positions: usize,
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
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Config(msg.into())
}

/// Upper bound on any one size in `config.json` (hidden size, vocabulary, experts, heads, ...).
/// Far above any real model, low enough that products of two sizes (and their byte counts) cannot
/// overflow and that a corrupt config cannot make the engine reserve absurd amounts of memory.
pub const MAX_DIM: usize = 1 << 20;
/// Upper bound on `num_hidden_layers`.
pub const MAX_LAYERS: usize = 1 << 12;

struct Reader<'a> {
    v: &'a Value,
}

impl<'a> Reader<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.v.get(key).filter(|v| !v.is_null())
    }
    fn usize_req(&self, key: &str) -> Result<usize> {
        self.get(key)
            .ok_or_else(|| bad(format!("config.json: missing required field `{key}`")))?
            .as_u64()
            .map(|x| x as usize)
            .ok_or_else(|| {
                bad(format!(
                    "config.json: `{key}` must be a non-negative integer"
                ))
            })
    }
    fn usize_or(&self, key: &str, default: usize) -> Result<usize> {
        match self.get(key) {
            None => Ok(default),
            Some(_) => self.usize_req(key),
        }
    }
    /// A size: an integer in `min..=max`.
    fn size_req(&self, key: &str, min: usize, max: usize) -> Result<usize> {
        check_size(key, self.usize_req(key)?, min, max)
    }
    fn size_or(&self, key: &str, default: usize, min: usize, max: usize) -> Result<usize> {
        check_size(key, self.usize_or(key, default)?, min, max)
    }
    fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .ok_or_else(|| bad(format!("config.json: `{key}` must be a number"))),
        }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| bad(format!("config.json: `{key}` must be true or false"))),
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

/// RoPE settings: `rope_parameters` (transformers 5), else top-level `rope_theta` /
/// `partial_rotary_factor` / `rope_scaling` (older checkpoints).
fn rope_settings(r: &Reader, default_partial: f64) -> Result<(f64, f64)> {
    let params = r.get("rope_parameters").or_else(|| r.get("rope_scaling"));
    let mut theta = r.f64_or("rope_theta", 10000.0)?;
    let mut partial = r.f64_or("partial_rotary_factor", default_partial)?;
    if let Some(p) = params {
        if !p.is_object() {
            return Err(bad("config.json: `rope_parameters` must be an object"));
        }
        let p = Reader { v: p };
        let kind = p
            .get("rope_type")
            .or_else(|| p.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if kind != "default" {
            return Err(bad(format!(
                "config.json: RoPE type `{kind}` is not supported yet (only `default`)"
            )));
        }
        theta = p.f64_or("rope_theta", theta)?;
        partial = p.f64_or("partial_rotary_factor", partial)?;
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
    Ok((theta, partial))
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
        let r = Reader { v };
        let arch_name = r
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| bad("config.json: missing `architectures`"))?;
        let arch = Arch::from_hf_name(arch_name).ok_or_else(|| {
            bad(format!(
                "unsupported architecture `{arch_name}` (supported: OlmoeForCausalLM, \
                 Qwen3MoeForCausalLM, Glm4MoeForCausalLM)"
            ))
        })?;
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
        let head_dim = match arch {
            // OLMoE's q/k norms span hidden_size, so its head_dim is always hidden / heads.
            Arch::Olmoe => hidden_size / num_heads,
            _ => r.size_or("head_dim", hidden_size / num_heads, 0, MAX_DIM)?,
        };
        if num_heads * head_dim > MAX_DIM {
            return Err(bad(format!(
                "config.json: num_attention_heads * head_dim = {} exceeds {MAX_DIM}",
                num_heads * head_dim
            )));
        }
        if arch == Arch::Olmoe && head_dim * num_heads != hidden_size {
            return Err(bad(
                "config.json: OLMoE needs hidden_size divisible by num_attention_heads",
            ));
        }
        let default_partial = if arch == Arch::Glm4Moe { 0.5 } else { 1.0 };
        let (rope_theta, partial) = rope_settings(&r, default_partial)?;
        let rotary_dim = ((head_dim as f64 * partial) as usize) & !1;
        if rotary_dim == 0 {
            return Err(bad("config.json: rotary dimension is zero"));
        }
        let default_eps = match arch {
            Arch::Qwen3Moe => 1e-6,
            _ => 1e-5,
        };
        let rms_norm_eps = r.f64_or("rms_norm_eps", default_eps)? as f32;
        let vocab_size = r.size_req("vocab_size", 1, MAX_DIM)?;
        let max_positions = r.usize_or("max_position_embeddings", 4096)?;
        let intermediate_size = r.size_req("intermediate_size", 0, MAX_DIM)?;
        let top_k = r.size_req("num_experts_per_tok", 0, MAX_DIM)?;

        let (
            num_experts,
            moe_intermediate_size,
            shared_intermediate_size,
            routing,
            layers,
            qk_norm,
            clip_qkv,
        ) = match arch {
            Arch::Olmoe => {
                let e = r.size_req("num_experts", 0, MAX_DIM)?;
                let routing = Routing::SoftmaxTopK {
                    norm_topk_prob: r.bool_or("norm_topk_prob", false)?,
                };
                let clip = r.get("clip_qkv").and_then(Value::as_f64).map(|c| c as f32);
                (
                    e,
                    intermediate_size,
                    0,
                    routing,
                    vec![FfnKind::Moe; num_layers],
                    QkNorm::Full,
                    clip,
                )
            }
            Arch::Qwen3Moe => {
                if r.bool_or("use_sliding_window", false)? {
                    return Err(bad("config.json: use_sliding_window is not supported yet"));
                }
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
                let layers = (0..num_layers)
                    .map(|i| {
                        if !mlp_only.contains(&i) && e > 0 && (i + 1) % step == 0 {
                            FfnKind::Moe
                        } else {
                            FfnKind::Dense
                        }
                    })
                    .collect();
                let routing = Routing::SoftmaxTopK {
                    norm_topk_prob: r.bool_or("norm_topk_prob", false)?,
                };
                (
                    e,
                    r.size_req("moe_intermediate_size", 0, MAX_DIM)?,
                    0,
                    routing,
                    layers,
                    QkNorm::PerHead,
                    None,
                )
            }
            Arch::Glm4Moe => {
                let e = r.size_req("n_routed_experts", 0, MAX_DIM)?;
                let moe_i = r.size_req("moe_intermediate_size", 0, MAX_DIM)?;
                let n_group = r.usize_or("n_group", 1)?;
                let topk_group = r.usize_or("topk_group", 1)?;
                if n_group == 0 || e % n_group != 0 || topk_group == 0 || topk_group > n_group {
                    return Err(bad(format!(
                        "config.json: n_group {n_group} / topk_group {topk_group} do not fit \
                             {e} routed experts"
                    )));
                }
                if e / n_group < 2 && n_group > 1 {
                    return Err(bad(
                        "config.json: each expert group needs at least 2 experts",
                    ));
                }
                let routing = Routing::SigmoidGrouped {
                    n_group,
                    topk_group,
                    norm_topk_prob: r.bool_or("norm_topk_prob", true)?,
                    scaling: r.f64_or("routed_scaling_factor", 1.0)? as f32,
                };
                let first_dense = r.usize_or("first_k_dense_replace", 1)?;
                let layers = (0..num_layers)
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
                let qk = if r.bool_or("use_qk_norm", false)? {
                    QkNorm::PerHead
                } else {
                    QkNorm::None
                };
                (e, moe_i, shared, routing, layers, qk, None)
            }
        };
        if layers.contains(&FfnKind::Dense) && intermediate_size == 0 {
            return Err(bad(
                "config.json: intermediate_size must be positive (the model has dense layers)",
            ));
        }
        if layers.contains(&FfnKind::Moe) && moe_intermediate_size == 0 {
            return Err(bad(
                "config.json: the MoE intermediate size must be positive",
            ));
        }
        if layers.contains(&FfnKind::Moe) && (top_k == 0 || top_k > num_experts) {
            return Err(bad(format!(
                "config.json: num_experts_per_tok ({top_k}) must be between 1 and the number of \
                 experts ({num_experts})"
            )));
        }
        Ok(ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rotary_dim,
            rope_theta,
            rms_norm_eps,
            max_positions,
            qk_norm,
            clip_qkv,
            intermediate_size,
            num_experts,
            top_k,
            moe_intermediate_size,
            shared_intermediate_size,
            routing,
            layers,
            tie_word_embeddings: r.bool_or("tie_word_embeddings", false)?,
            eos_token_ids: token_ids(r.get("eos_token_id")),
            bos_token_id: token_ids(r.get("bos_token_id")).first().copied(),
        })
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
    fn scaled_rope_is_refused() {
        let mut v = glm();
        v["rope_parameters"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(ModelConfig::from_hf(&v)
            .unwrap_err()
            .to_string()
            .contains("yarn"));
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
}
