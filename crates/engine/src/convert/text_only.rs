//! Multimodal checkpoints whose text model colibri serves alone.
//!
//! Kimi K2.5 and its successors (K2.6, K2.7) are published as `KimiK25ForConditionalGeneration`:
//! a vision tower and a projector (`vision_tower.*`, `mm_projector.*`) beside a DeepSeek-V3 text
//! model stored under `language_model.` (`language_model.model.layers.N...`,
//! `language_model.lm_head.weight`), whose config is config.json's `text_config`. colibri has no
//! vision path, so a conversion takes the text model: its config (with what the wrapper states
//! for it, [`INHERITED`]), its tensors under their text-model names, and the vision tensors
//! recorded as skipped in the manifest, each with the reason. Anything else outside the text
//! model is refused by the converter's unused-tensor check, as in any checkpoint.

use serde_json::Value;

use crate::config::bad;
use crate::error::Result;

/// One kind of multimodal checkpoint served as its text model.
#[derive(Debug)]
pub struct TextOnly {
    /// The wrapper's `architectures` entry.
    pub architecture: &'static str,
    /// The text model's architecture (its `text_config` may omit `architectures`).
    text_architecture: &'static str,
    /// The text model's tensors are stored under this prefix.
    text_prefix: &'static str,
    /// Tensors under these prefixes are the parts colibri does not serve, and what each is.
    dropped: &'static [(&'static str, &'static str)],
}

const WRAPPERS: [TextOnly; 1] = [TextOnly {
    architecture: "KimiK25ForConditionalGeneration",
    text_architecture: "DeepseekV3ForCausalLM",
    text_prefix: "language_model.",
    dropped: &[
        ("vision_tower.", "vision tower"),
        ("mm_projector.", "multimodal projector"),
    ],
}];

/// Top-level fields of the wrapper's config that belong to the text model too, taken when
/// `text_config` does not set them (llm-compressor, for one, writes `quantization_config` at
/// the top level).
const INHERITED: [&str; 5] = [
    "quantization_config",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "torch_dtype",
];

/// The config of the model a checkpoint's `config.json` describes, and the wrapper it came in:
/// the config itself for a text model, the text model's for a known multimodal wrapper.
pub fn text_model(cfg: &Value) -> Result<(Value, Option<&'static TextOnly>)> {
    let named = |a: &str| {
        cfg.get("architectures")
            .and_then(Value::as_array)
            .is_some_and(|v| v.iter().any(|x| x.as_str() == Some(a)))
    };
    let Some(w) = WRAPPERS.iter().find(|w| named(w.architecture)) else {
        return Ok((cfg.clone(), None));
    };
    let Some(Value::Object(text)) = cfg.get("text_config") else {
        return Err(bad(format!(
            "config.json: {} needs `text_config`, the config of its text model (colibri serves \
             the text model alone)",
            w.architecture
        )));
    };
    let mut text = text.clone();
    match text.get("architectures") {
        None => {
            text.insert("architectures".into(), [w.text_architecture].into());
        }
        Some(a)
            if a.as_array()
                .is_some_and(|v| v.len() == 1 && v[0] == w.text_architecture) => {}
        Some(other) => {
            return Err(bad(format!(
                "config.json: text_config.architectures {other} is not supported in {} (its \
                 text model is [\"{}\"])",
                w.architecture, w.text_architecture
            )))
        }
    }
    for key in INHERITED {
        match (cfg.get(key), text.get(key)) {
            (Some(top), None) => {
                text.insert(key.into(), top.clone());
            }
            (Some(top), Some(inner)) if key == "quantization_config" && top != inner => {
                return Err(bad(
                    "config.json: quantization_config differs between the top level and \
                     text_config: which one describes the weights is not clear",
                ));
            }
            _ => {}
        }
    }
    Ok((Value::Object(text), Some(w)))
}

impl TextOnly {
    /// A stored tensor's name in the text model (`language_model.model.x` is `model.x`); other
    /// names as they are.
    pub fn text_name(&self, stored: &str) -> String {
        stored
            .strip_prefix(self.text_prefix)
            .unwrap_or(stored)
            .to_string()
    }

    /// Why a stored tensor outside the text model is not converted, if it is a part colibri
    /// knowingly leaves out.
    pub fn skip_reason(&self, stored: &str) -> Option<String> {
        self.dropped
            .iter()
            .find(|(prefix, _)| stored.starts_with(prefix))
            .map(|(_, what)| {
                format!(
                    "{what} of {}: colibri serves its text model alone",
                    self.architecture
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn wrapped(text: Value) -> Value {
        json!({
            "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
            "media_placeholder_token_id": 163605, "tie_word_embeddings": false,
            "vision_config": {"patch_size": 14}, "text_config": text,
        })
    }

    #[test]
    fn a_text_model_config_is_its_own() {
        let cfg = json!({"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 8});
        let (text, w) = text_model(&cfg).unwrap();
        assert_eq!(text, cfg);
        assert!(w.is_none());
    }

    #[test]
    fn kimi_k25s_text_config_is_the_model_with_what_the_wrapper_adds() {
        let q = json!({"quant_method": "compressed-tensors"});
        let mut cfg =
            wrapped(json!({"model_type": "kimi_k2", "hidden_size": 8, "eos_token_id": 2}));
        cfg["quantization_config"] = q.clone();
        cfg["eos_token_id"] = json!(7);
        let (text, w) = text_model(&cfg).unwrap();
        assert_eq!(w.unwrap().architecture, "KimiK25ForConditionalGeneration");
        assert_eq!(text["architectures"], json!(["DeepseekV3ForCausalLM"]));
        assert_eq!(text["hidden_size"], 8);
        assert_eq!(text["quantization_config"], q);
        assert_eq!(text["tie_word_embeddings"], false);
        assert_eq!(text["eos_token_id"], 2, "the text model's own value wins");
        assert!(text.get("vision_config").is_none() && text.get("text_config").is_none());
    }

    #[test]
    fn malformed_wrappers_are_refused_by_field() {
        let mut no_text = wrapped(json!({}));
        no_text.as_object_mut().unwrap().remove("text_config");
        let cases = [
            (no_text, "needs `text_config`"),
            (wrapped(json!("text")), "needs `text_config`"),
            (
                wrapped(json!({"architectures": ["Qwen3MoeForCausalLM"]})),
                "text_config.architectures",
            ),
            (
                {
                    let mut c = wrapped(json!({"quantization_config": {"quant_method": "fp8"}}));
                    c["quantization_config"] = json!({"quant_method": "compressed-tensors"});
                    c
                },
                "quantization_config differs",
            ),
        ];
        for (cfg, want) in cases {
            let err = text_model(&cfg).unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn stored_names_map_to_the_text_model_and_the_vision_parts_are_named() {
        let w = &WRAPPERS[0];
        assert_eq!(
            w.text_name("language_model.model.layers.0.mlp.gate.weight"),
            "model.layers.0.mlp.gate.weight"
        );
        assert_eq!(
            w.text_name("language_model.lm_head.weight"),
            "lm_head.weight"
        );
        assert_eq!(w.text_name("lm_head.weight"), "lm_head.weight");
        let why = w
            .skip_reason("vision_tower.encoder.blocks.0.wqkv.weight")
            .unwrap();
        assert!(
            why.starts_with("vision tower of KimiK25ForConditionalGeneration"),
            "{why}"
        );
        assert!(w.skip_reason("mm_projector.proj.0.weight").is_some());
        assert!(w.skip_reason("language_model.model.norm.weight").is_none());
        assert!(w.skip_reason("audio_tower.x").is_none());
    }
}
