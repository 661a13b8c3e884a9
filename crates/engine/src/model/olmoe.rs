//! OLMoE (`OlmoeForCausalLM`): every layer is MoE; softmax router over all experts, top-k,
//! optionally renormalised (`norm_topk_prob`, off by default); q/k RMSNorm over the whole
//! projected q and k (all heads at once) before RoPE; optional `clip_qkv` clamp; full rotary.

use super::plan;
use super::registry::Family;
use crate::config::{bad, AttentionKind, FfnKind, ModelConfig, QkNorm, Reader, Routing, MAX_DIM};
use crate::error::Result;

pub static FAMILY: Family = Family {
    hf_name: "OlmoeForCausalLM",
    chat_family: "olmoe",
    // Its q/k norms span hidden_size, so its head_dim is always hidden / heads.
    reads_head_dim: false,
    default_rotary_fraction: 1.0,
    default_rms_norm_eps: 1e-5,
    configure,
    plan: plan::standard,
    checkpoint_name: None,
    config_aliases: &[],
};

fn configure(r: &Reader, c: &mut ModelConfig) -> Result<()> {
    if c.head_dim * c.num_heads != c.hidden_size {
        return Err(bad(
            "config.json: OLMoE needs hidden_size divisible by num_attention_heads",
        ));
    }
    c.attention = AttentionKind::Gqa;
    c.qk_norm = QkNorm::Full;
    c.clip_qkv = match r.get("clip_qkv") {
        None => None,
        Some(_) => {
            let clip = r.f64_or("clip_qkv", 0.0)?;
            // q, k and v are clamped to [-clip, clip]: a negative bound has no values in it.
            if clip < 0.0 {
                return Err(bad(format!(
                    "config.json: `clip_qkv` {clip} must be a non-negative number (or null)"
                )));
            }
            Some(clip as f32)
        }
    };
    c.num_experts = r.size_req("num_experts", 0, MAX_DIM)?;
    c.moe_intermediate_size = c.intermediate_size;
    c.routing = Routing::SoftmaxTopK {
        norm_topk_prob: r.bool_or("norm_topk_prob", false)?,
    };
    c.layers = vec![FfnKind::Moe; c.num_layers];
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use crate::config::ModelConfig;
    use crate::testutil::fixture;

    fn olmoe() -> Value {
        let text = std::fs::read_to_string(fixture("olmoe").join("config.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    /// Found by fuzzing: a negative `clip_qkv` reached the clamp (whose range it empties) and
    /// panicked in the first forward pass; a string was silently read as no clip.
    #[test]
    fn clip_qkv_is_a_non_negative_number_or_null() {
        for (value, want) in [
            (json!(null), None),
            (json!(8.0), Some(8.0)),
            (json!(0), Some(0.0)),
        ] {
            let mut v = olmoe();
            v["clip_qkv"] = value;
            assert_eq!(ModelConfig::from_hf(&v).unwrap().clip_qkv, want);
        }
        for value in [json!(-1.0), json!("8"), json!(-1e300)] {
            let mut v = olmoe();
            v["clip_qkv"] = value.clone();
            let e = ModelConfig::from_hf(&v).unwrap_err().to_string();
            assert!(e.contains("`clip_qkv`"), "{value}: {e}");
        }
    }
}
