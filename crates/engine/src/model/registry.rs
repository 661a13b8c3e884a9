//! Every architecture the engine runs, keyed by its Hugging Face `architectures[0]` name. The
//! config reader, the converter and the Python gateway (`_engine.architectures()`) all look a
//! family up here; a new family is its `model/<family>.rs` plus one line in [`FAMILIES`].

use std::fmt;

use super::plan::Plan;
use crate::config::{ModelConfig, Reader};
use crate::error::Result;

/// What the engine knows about one architecture.
pub struct Family {
    /// The checkpoint's `architectures[0]`, e.g. `Qwen3MoeForCausalLM`.
    pub hf_name: &'static str,
    /// The gateway's chat family for it when the chat template names none (see
    /// `python/colibri/chat/families.py`).
    pub chat_family: &'static str,
    /// Whether `head_dim` is read from the config (else it is `hidden_size / heads`).
    pub reads_head_dim: bool,
    /// `partial_rotary_factor` when the config gives none.
    pub default_rotary_fraction: f64,
    /// `rms_norm_eps` when the config gives none.
    pub default_rms_norm_eps: f64,
    /// Reads the family's own fields into the config and chooses its blocks (attention kind,
    /// q/k norm, feed-forward per layer, routing). Runs after the shared fields are read.
    pub configure: fn(&Reader, &mut ModelConfig) -> Result<()>,
    /// The tensors the family's checkpoints hold, under colibri's names.
    pub plan: fn(&ModelConfig) -> Plan,
    /// How a checkpoint's tensor names map to the names the plan reads, when the family's
    /// checkpoints do not use transformers' module names (DeepSeek-V4).
    pub checkpoint_name: Option<fn(&str) -> String>,
    /// transformers' `attribute_map` for the family's config: (field the engine reads, key the
    /// family's configs store it under), each field read from its key when the config has no
    /// field of that name.
    pub config_aliases: &'static [(&'static str, &'static str)],
}

impl fmt::Debug for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.hf_name)
    }
}

impl PartialEq for Family {
    fn eq(&self, other: &Family) -> bool {
        self.hf_name == other.hf_name
    }
}

/// The supported families.
pub static FAMILIES: &[&Family] = &[
    &super::olmoe::FAMILY,
    &super::qwen3_moe::FAMILY,
    &super::glm4_moe::FAMILY,
    &super::deepseek_v3::FAMILY,
    &super::glm_moe_dsa::FAMILY,
    &super::glm_moe_dsa::DEEPSEEK_V32,
    &super::deepseek_v4::FAMILY,
    &super::qwen3_next::FAMILY,
    &super::kimi_linear::FAMILY,
];

pub fn by_hf_name(name: &str) -> Option<&'static Family> {
    FAMILIES.iter().copied().find(|f| f.hf_name == name)
}

pub fn hf_names() -> Vec<&'static str> {
    FAMILIES.iter().map(|f| f.hf_name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_found() {
        let names = hf_names();
        for (i, n) in names.iter().enumerate() {
            assert!(!names[..i].contains(n), "{n} listed twice");
            assert_eq!(by_hf_name(n).unwrap().hf_name, *n);
        }
        assert!(by_hf_name("LlamaForCausalLM").is_none());
    }
}
