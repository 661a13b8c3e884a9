//! Checkpoints quantized by compressed-tensors (`quant_method: "compressed-tensors"`).
//!
//! Int4 weights in its `pack-quantized` form, as Moonshot publishes Kimi K2 Thinking (its routed experts, quantization-aware trained): a linear weight
//! `X.weight` is stored as
//!
//! * `X.weight_packed`: I32 `[rows, ceil(cols / 8)]`, element `c` of a row at bits `4c..4c + 4`
//!   of the row's little-endian bytes (the even element in the low nibble of its byte), stored
//!   as `q + 8` for `q` in `-8..=7`;
//! * `X.weight_scale`: a float per `group_size` elements of a row, `[rows, ceil(cols / group)]`;
//! * `X.weight_shape` (optional): I32 / I64 `[2]`, the weight's `[rows, cols]`.
//!
//! `w = q * scale[r][c / group]` (symmetric: no zero point), dequantized at conversion in f32 as
//! compressed-tensors does it; the converter then stores the weight as any other. The config
//! (`quantization_config`: `quant_method: "compressed-tensors"`, `format: "pack-quantized"`,
//! every `config_groups` entry's `weights` 4-bit signed integers, symmetric, `strategy:
//! "group"`, no activation quantization) is read and anything else is refused by name.
//!
//! The same config with `format: "float-quantized"` (GLM-4.5's FP8 release) is FP8 e4m3
//! weights `X.weight` beside `X.weight_scale` per tensor, row (`channel`), group of a row or
//! block: [`CompressedTensors::Fp8`] gives the FP8 path its scale blocks, and the scale is read
//! as the FP8 path's `X.weight_scale_inv` (both multiply).

use serde_json::Value;

use super::fp8::Fp8Blocks;
use crate::error::{Error, Result};

fn ck(msg: impl Into<String>) -> Error {
    Error::Checkpoint(msg.into())
}

/// The int4 groups of a checkpoint's packed weights: elements of a row per scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PackedInt4 {
    pub group: usize,
}

/// The tensors a packed weight `X.weight` is stored as.
pub(super) const PACKED: &str = "_packed";
pub(super) const SCALE: &str = "_scale";
pub(super) const SHAPE: &str = "_shape";

/// What a compressed-tensors checkpoint's weights are: packed int4 (`pack-quantized`), or FP8
/// e4m3 beside `X.weight_scale` (`float-quantized`, as GLM-4.5's FP8 release has them), read
/// by the FP8 path with these scale blocks (a whole row or matrix is one block of
/// `usize::MAX`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CompressedTensors {
    Int4(PackedInt4),
    Fp8(Fp8Blocks),
}

impl CompressedTensors {
    /// From config.json's `quantization_config`: None unless its `quant_method` is
    /// `compressed-tensors`; then what its weights are, or a refusal naming what is not
    /// supported.
    pub fn from_config(cfg: &Value) -> Result<Option<CompressedTensors>> {
        let Some(q) = cfg.get("quantization_config").filter(|q| !q.is_null()) else {
            return Ok(None);
        };
        if q.get("quant_method").and_then(Value::as_str) != Some("compressed-tensors") {
            return Ok(None);
        }
        let bad = |what: String| {
            ck(format!(
                "config.json: quantization_config {what} is not supported (compressed-tensors \
                 weights are: format \"pack-quantized\", 4-bit symmetric integers in groups; \
                 format \"float-quantized\", 8-bit symmetric floats per tensor, channel, group \
                 or block; activations unquantized or quantized dynamically)"
            ))
        };
        let format = q.get("format").and_then(Value::as_str).unwrap_or("");
        let int4 = match format {
            "pack-quantized" => true,
            "float-quantized" => false,
            _ => return Err(bad(format!("format `{format}`"))),
        };
        let groups = q
            .get("config_groups")
            .and_then(Value::as_object)
            .filter(|g| !g.is_empty())
            .ok_or_else(|| bad("without config_groups".into()))?;
        let mut found = None;
        for (name, g) in groups {
            for key in ["input_activations", "output_activations"] {
                let a = g.get(key).filter(|v| !v.is_null());
                // Activations quantized on the fly are a runtime choice colibri makes its own
                // way; static ones would come with scales this model does not use.
                if a.is_some_and(|a| int4 || key == "output_activations" || a["dynamic"] != true) {
                    return Err(bad(format!("config_groups.{name}.{key}")));
                }
            }
            let w = g
                .get("weights")
                .filter(|w| !w.is_null())
                .ok_or_else(|| bad(format!("config_groups.{name} without weights")))?;
            let field = |key: &str| w.get(key).cloned().unwrap_or(Value::Null);
            let (bits, kind) = if int4 { (4, "int") } else { (8, "float") };
            for (key, want) in [
                ("num_bits", Value::from(bits)),
                ("type", Value::from(kind)),
                ("symmetric", Value::from(true)),
            ] {
                if field(key) != want {
                    return Err(bad(format!(
                        "config_groups.{name}.weights.{key} {} (needs {want})",
                        field(key)
                    )));
                }
            }
            if field("dynamic").as_bool() == Some(true) {
                return Err(bad(format!("config_groups.{name}.weights.dynamic true")));
            }
            let size = |v: &Value| {
                v.as_u64()
                    .filter(|&g| g > 0 && g <= 1 << 20)
                    .map(|g| g as usize)
            };
            let group = || {
                size(&field("group_size")).ok_or_else(|| {
                    bad(format!(
                        "config_groups.{name}.weights.group_size {}",
                        field("group_size")
                    ))
                })
            };
            let strategy = field("strategy");
            let this = match (int4, strategy.as_str().unwrap_or("")) {
                (true, "group") => CompressedTensors::Int4(PackedInt4 { group: group()? }),
                (false, "tensor") => CompressedTensors::Fp8(Fp8Blocks::WHOLE),
                (false, "channel") => CompressedTensors::Fp8(Fp8Blocks {
                    rows: 1,
                    cols: usize::MAX,
                }),
                (false, "group") => CompressedTensors::Fp8(Fp8Blocks {
                    rows: 1,
                    cols: group()?,
                }),
                (false, "block") => {
                    let b = field("block_structure");
                    match b.as_array().map(|a| a.iter().map(size).collect::<Vec<_>>()) {
                        Some(v) if v.len() == 2 && v.iter().all(Option::is_some) => {
                            CompressedTensors::Fp8(Fp8Blocks {
                                rows: v[0].unwrap_or(1),
                                cols: v[1].unwrap_or(1),
                            })
                        }
                        _ => {
                            return Err(bad(format!(
                                "config_groups.{name}.weights.block_structure {b}"
                            )))
                        }
                    }
                }
                _ => {
                    return Err(bad(format!(
                        "config_groups.{name}.weights.strategy {strategy}"
                    )))
                }
            };
            if found.is_some_and(|f| f != this) {
                return Err(bad("config groups that quantize differently".into()));
            }
            found = Some(this);
        }
        Ok(found)
    }
}

impl PackedInt4 {
    /// The shape `X.weight_scale` must have for a weight of `shape` (`[rows, cols]`).
    pub fn scale_shape(self, shape: &[usize]) -> Vec<usize> {
        vec![shape[0], shape[1].div_ceil(self.group)]
    }
}

/// Bytes of one packed row of `cols` elements: whole int32 words.
pub(super) fn row_bytes(cols: usize) -> usize {
    cols.div_ceil(8) * 4
}

/// Why `name` is not converted when it is a calibrated scale of an FP8 KV cache: a
/// compressed-tensors checkpoint with a `kv_cache_scheme` stores one beside each attention's
/// projections (`X.k_scale`, `X.v_scale`) for engines that keep the cache in FP8. That is a
/// serving choice, not part of the weights: colibri keeps its own KV dtype, so they are skipped
/// (without the scheme, such a tensor is unexpected and refused as any other).
pub(super) fn kv_cache_scale_reason(cfg: &Value, name: &str) -> Option<String> {
    let q = cfg.get("quantization_config")?;
    let scheme = q.get("kv_cache_scheme").filter(|s| s.is_object())?;
    if q.get("quant_method").and_then(Value::as_str) != Some("compressed-tensors") {
        return None;
    }
    let kind = [".k_scale", ".v_scale"]
        .into_iter()
        .find(|suffix| name.ends_with(suffix))?;
    Some(format!(
        "calibrated {} of an FP8 KV cache (quantization_config.kv_cache_scheme {}): colibri \
         keeps its own KV cache dtype",
        &kind[1..],
        scheme.get("type").and_then(Value::as_str).unwrap_or("?")
    ))
}

/// Elements `first..first + count` of the flattened `[rows, cols]` weight stored as `packed`
/// (rows of [`row_bytes`]), dequantized with `scales` (`[rows, ceil(cols / group)]`).
pub(super) fn dequantize(
    name: &str,
    packed: &[u8],
    cols: usize,
    scales: &[f32],
    group: usize,
    first: usize,
    count: usize,
) -> Result<Vec<f32>> {
    let (stride, scale_cols) = (row_bytes(cols), cols.div_ceil(group));
    let end = first + count;
    let rows = end.div_ceil(cols.max(1));
    if packed.len() < rows * stride || scales.len() < rows * scale_cols {
        return Err(ck(format!("tensor `{name}`: data shorter than its shape")));
    }
    Ok((first..end)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            let byte = packed[r * stride + c / 2];
            let u = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            (i32::from(u) - 8) as f32 * scales[r * scale_cols + c / group]
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn config(weights: Value) -> Value {
        json!({"quantization_config": {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                "output_activations": null, "weights": weights}}}})
    }

    fn kimi_weights() -> Value {
        json!({"num_bits": 4, "type": "int", "symmetric": true, "strategy": "group",
               "group_size": 32, "dynamic": false, "observer": "minmax", "actorder": null})
    }

    #[test]
    fn kimis_config_is_read_and_others_refused_by_name() {
        assert_eq!(
            CompressedTensors::from_config(&config(kimi_weights())).unwrap(),
            Some(CompressedTensors::Int4(PackedInt4 { group: 32 }))
        );
        assert_eq!(CompressedTensors::from_config(&json!({})).unwrap(), None);
        let fp8 = json!({"quantization_config": {"quant_method": "fp8"}});
        assert_eq!(CompressedTensors::from_config(&fp8).unwrap(), None);
        let with = |key: &str, v: Value| {
            let mut w = kimi_weights();
            w[key] = v;
            CompressedTensors::from_config(&config(w))
                .unwrap_err()
                .to_string()
        };
        assert!(with("num_bits", json!(8)).contains("num_bits 8"));
        assert!(with("symmetric", json!(false)).contains("symmetric false"));
        assert!(with("type", json!("float")).contains("type \"float\""));
        assert!(with("strategy", json!("channel")).contains("strategy \"channel\""));
        assert!(with("group_size", json!(0)).contains("group_size 0"));
        assert!(with("dynamic", json!(true)).contains("dynamic true"));
        let mut acts = config(kimi_weights());
        acts["quantization_config"]["config_groups"]["group_0"]["input_activations"] =
            json!({"num_bits": 8});
        let e = CompressedTensors::from_config(&acts)
            .unwrap_err()
            .to_string();
        assert!(e.contains("group_0.input_activations"), "{e}");
        let mut fmt = config(kimi_weights());
        fmt["quantization_config"]["format"] = json!("nvfp4-pack-quantized");
        let e = CompressedTensors::from_config(&fmt)
            .unwrap_err()
            .to_string();
        assert!(e.contains("format `nvfp4-pack-quantized`"), "{e}");
    }

    /// GLM-4.5-FP8's form: FP8 weights per channel, activations quantized dynamically per token.
    #[test]
    fn float_quantized_configs_give_the_fp8_paths_blocks() {
        let fp8 = |weights: Value, acts: Value| {
            let mut c = config(weights);
            c["quantization_config"]["format"] = json!("float-quantized");
            c["quantization_config"]["config_groups"]["group_0"]["input_activations"] = acts;
            CompressedTensors::from_config(&c)
        };
        let w = |strategy: &str, extra: Value| {
            let mut w = json!({"num_bits": 8, "type": "float", "symmetric": true,
                               "strategy": strategy, "dynamic": false});
            for (k, v) in extra.as_object().unwrap() {
                w[k] = v.clone();
            }
            w
        };
        let dynamic = json!({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true});
        let blocks = |rows, cols| Some(CompressedTensors::Fp8(Fp8Blocks { rows, cols }));
        assert_eq!(
            fp8(w("channel", json!({})), dynamic.clone()).unwrap(),
            blocks(1, usize::MAX)
        );
        assert_eq!(
            fp8(w("tensor", json!({})), Value::Null).unwrap(),
            blocks(usize::MAX, usize::MAX)
        );
        assert_eq!(
            fp8(w("group", json!({"group_size": 64})), Value::Null).unwrap(),
            blocks(1, 64)
        );
        let block = w("block", json!({"block_structure": [128, 64]}));
        assert_eq!(fp8(block, Value::Null).unwrap(), blocks(128, 64));
        let e = fp8(w("block", json!({"block_structure": [128]})), Value::Null).unwrap_err();
        assert!(e.to_string().contains("block_structure [128]"), "{e}");
        let e = fp8(
            w("channel", json!({})),
            json!({"num_bits": 8, "dynamic": false}),
        )
        .unwrap_err();
        assert!(e.to_string().contains("input_activations"), "{e}");
        let e = fp8(w("channel", json!({"type": "int"})), Value::Null).unwrap_err();
        assert!(e.to_string().contains("type \"int\""), "{e}");
    }

    #[test]
    fn elements_unpack_low_nibble_first_with_their_groups_scale() {
        // One row of 10 elements (two words, the last six nibbles padding) in groups of 4.
        let q: [i32; 10] = [-8, -1, 0, 7, 3, -3, 1, 2, -5, 6];
        let mut packed = vec![0u8; row_bytes(10)];
        for (c, &v) in q.iter().enumerate() {
            packed[c / 2] |= ((v + 8) as u8) << (4 * (c % 2));
        }
        assert_eq!(packed.len(), 8);
        let scales = [0.5, 2.0, -1.0];
        let all = dequantize("w", &packed, 10, &scales, 4, 0, 10).unwrap();
        let want: Vec<f32> = q
            .iter()
            .enumerate()
            .map(|(c, &v)| v as f32 * scales[c / 4])
            .collect();
        assert_eq!(all, want);
        assert_eq!(
            dequantize("w", &packed, 10, &scales, 4, 3, 4).unwrap(),
            &want[3..7]
        );
        let short = dequantize("w", &packed[..4], 10, &scales, 4, 0, 10).unwrap_err();
        assert!(short.to_string().contains("shorter"), "{short}");
    }
}
