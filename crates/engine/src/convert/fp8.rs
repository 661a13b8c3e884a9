//! FP8 block-quantized checkpoints, as DeepSeek-V3, Kimi K2 and GLM publish them: a linear
//! weight `X.weight` stored as e4m3 bytes beside `X.weight_scale_inv`, one scale per block of
//! `quantization_config.weight_block_size` (rows x columns, 128 x 128 unless the config says
//! otherwise; the last blocks of a row or column may be partial). Dequantized at conversion,
//! as the publishers' own reference does it: `w = e4m3(q) * scale_inv[row / br][col / bc]` in
//! f32; the converter then stores the weight as it stores any other.
//!
//! DeepSeek-V4's checkpoints add two things (transformers' `FineGrainedFP8Config`: `scale_fmt:
//! "ue8m0"`, `expert_dtype: "fp4"`): scales as UE8M0 bytes (`F8_E8M0`, or `U8` with
//! `scale_fmt: "ue8m0"`: `2^(b - 127)`), stored under `X.scale` (read as
//! `X.weight_scale_inv`), and routed experts in FP4: two e2m1 codes per byte (the even element
//! in the low nibble) in an `I8` / `U8` tensor half as wide as the weight (or `F4`), one scale
//! per 32 elements of a row (`[rows, ceil(cols / 32)]`).

use serde_json::Value;

use crate::error::{Error, Result};

fn ck(msg: impl Into<String>) -> Error {
    Error::Checkpoint(msg.into())
}

/// The block shape of a checkpoint's FP8 weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Fp8Blocks {
    pub rows: usize,
    pub cols: usize,
}

/// What config.json's `quantization_config` says about an FP8 checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Fp8Config {
    /// The FP8 weights' scale blocks.
    pub blocks: Fp8Blocks,
    /// `scale_fmt: "ue8m0"`: scale tensors of `U8` bytes are UE8M0 exponents.
    pub ue8m0: bool,
    /// `expert_dtype: "fp4"`: packed-integer weights with scales are FP4.
    pub fp4_experts: bool,
}

/// The scale blocks of FP4 weights: 32 elements of one row.
pub(super) const FP4_BLOCKS: Fp8Blocks = Fp8Blocks { rows: 1, cols: 32 };

impl Fp8Config {
    /// From config.json's `quantization_config`: None without one; the block shape and the
    /// DeepSeek-V4 options for `quant_method: "fp8"` (format e4m3); any other method or option
    /// value is refused by name (such checkpoints convert from their bf16 release instead).
    pub fn from_config(cfg: &Value) -> Result<Option<Fp8Config>> {
        let Some(blocks) = Fp8Blocks::from_config(cfg)? else {
            return Ok(None);
        };
        let q = &cfg["quantization_config"];
        // Whether option `key` is its second allowed value (absent: the first).
        let second = |key: &str, allowed: [&str; 2]| {
            let v = q.get(key).filter(|v| !v.is_null());
            match v.map(Value::as_str) {
                None => Ok(false),
                Some(Some(x)) if allowed.contains(&x) => Ok(x == allowed[1]),
                _ => Err(ck(format!(
                    "config.json: quantization_config.{key} {} is not supported (\"{}\" or \
                     \"{}\")",
                    v.map(Value::to_string).unwrap_or_default(),
                    allowed[0],
                    allowed[1]
                ))),
            }
        };
        Ok(Some(Fp8Config {
            blocks,
            ue8m0: second("scale_fmt", ["float", "ue8m0"])?,
            fp4_experts: second("expert_dtype", ["fp8", "fp4"])?,
        }))
    }
}

/// The value of a UE8M0 scale byte: `2^(b - 127)`; 0xff is NaN (None).
pub(super) fn e8m0(b: u8) -> Option<f32> {
    (b != 0xff).then(|| (b as f32 - 127.0).exp2())
}

/// The value of an e2m1 (FP4) code: 1 sign, 2 exponent bits (bias 1), 1 mantissa bit; every
/// code is finite.
pub(super) fn e2m1(code: u8) -> f32 {
    const MAGNITUDE: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];
    let m = MAGNITUDE[(code & 7) as usize];
    if code & 8 != 0 {
        -m
    } else {
        m
    }
}

/// Elements `first..first + count` of the flattened `[rows, cols]` FP4 weight `packed` (two
/// codes per byte, the even element in the low nibble) dequantized with `scales`
/// (`[rows, ceil(cols / 32)]`).
pub(super) fn dequantize_fp4(
    name: &str,
    packed: &[u8],
    cols: usize,
    scales: &[f32],
    first: usize,
    count: usize,
) -> Result<Vec<f32>> {
    let scale_cols = cols.div_ceil(FP4_BLOCKS.cols);
    let end = first + count;
    if packed.len() * 2 < end {
        return Err(ck(format!("tensor `{name}`: data shorter than its shape")));
    }
    Ok((first..end)
        .map(|i| {
            let byte = packed[i / 2];
            let code = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
            let (r, c) = (i / cols, i % cols);
            e2m1(code) * scales[r * scale_cols + c / FP4_BLOCKS.cols]
        })
        .collect())
}

impl Fp8Blocks {
    /// One block for the whole matrix (one scale per tensor).
    pub const WHOLE: Fp8Blocks = Fp8Blocks {
        rows: usize::MAX,
        cols: usize::MAX,
    };

    /// From config.json's `quantization_config`: None without one; the block shape for
    /// `quant_method: "fp8"` (format e4m3); any other method is refused by name (such
    /// checkpoints convert from their bf16 release instead).
    pub fn from_config(cfg: &Value) -> Result<Option<Fp8Blocks>> {
        let Some(q) = cfg.get("quantization_config").filter(|q| !q.is_null()) else {
            return Ok(None);
        };
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("");
        if method == "compressed-tensors" {
            return Ok(None); // read by `compressed_tensors`
        }
        if method != "fp8" {
            return Err(ck(format!(
                "config.json: quantization_config.quant_method `{method}` is not supported \
                 (FP8 block-quantized and compressed-tensors int4 checkpoints are; for others \
                 convert the bf16 release)"
            )));
        }
        if let Some(fmt) = q.get("fmt").and_then(Value::as_str) {
            if fmt != "e4m3" {
                return Err(ck(format!(
                    "config.json: quantization_config.fmt `{fmt}` is not supported (e4m3)"
                )));
            }
        }
        let (rows, cols) = match q.get("weight_block_size") {
            None | Some(Value::Null) => (128, 128),
            Some(v) => match v
                .as_array()
                .map(|a| a.iter().map(Value::as_u64).collect::<Vec<_>>())
            {
                Some(b) if b.len() == 2 && b.iter().all(|x| x.is_some_and(|x| x > 0)) => {
                    (b[0].unwrap_or(1) as usize, b[1].unwrap_or(1) as usize)
                }
                _ => {
                    return Err(ck(
                        "config.json: quantization_config.weight_block_size must be two \
                         positive integers [rows, columns]",
                    ))
                }
            },
        };
        Ok(Some(Fp8Blocks { rows, cols }))
    }

    /// The shape `X.weight_scale_inv` must have for a weight of `shape` (`[rows, cols]`).
    pub fn scale_shape(self, shape: &[usize]) -> Vec<usize> {
        vec![shape[0].div_ceil(self.rows), shape[1].div_ceil(self.cols)]
    }
}

/// The name of a weight's scale tensor: `X.weight` -> `X.weight_scale_inv`.
pub(super) fn scale_name(weight: &str) -> String {
    format!("{weight}_scale_inv")
}

/// The weight a scale tensor belongs to, if `name` is one.
pub(super) fn scaled_weight(name: &str) -> Option<&str> {
    name.strip_suffix("_scale_inv")
}

/// DeepSeek-V4's scale name `X.scale` as the others name it, `X.weight_scale_inv`, when the
/// checkpoint also has `X.weight` (`has`); transformers renames it the same way.
pub(super) fn scale_alias(name: &str, has: impl Fn(&str) -> bool) -> Option<String> {
    let base = name.strip_suffix(".scale")?;
    let weight = format!("{base}.weight");
    has(&weight).then(|| scale_name(&weight))
}

/// The value of an e4m3 (`float8_e4m3fn`) byte: 1 sign, 4 exponent bits (bias 7), 3 mantissa
/// bits; no infinities; `S.1111.111` is NaN (None).
pub(super) fn e4m3(b: u8) -> Option<f32> {
    let (exp, man) = ((b >> 3) & 0x0f, b & 0x07);
    if exp == 0x0f && man == 0x07 {
        return None;
    }
    let magnitude = if exp == 0 {
        man as f32 / 8.0 * (-6f32).exp2()
    } else {
        (1.0 + man as f32 / 8.0) * (exp as f32 - 7.0).exp2()
    };
    Some(if b & 0x80 != 0 { -magnitude } else { magnitude })
}

/// Elements `first..first + count` of the flattened `[rows, cols]` weight `q` (e4m3 bytes)
/// dequantized with `scales` (`[ceil(rows / br), ceil(cols / bc)]`, row-major).
pub(super) fn dequantize(
    name: &str,
    q: &[u8],
    cols: usize,
    scales: &[f32],
    blocks: Fp8Blocks,
    first: usize,
    count: usize,
) -> Result<Vec<f32>> {
    let scale_cols = cols.div_ceil(blocks.cols);
    let part = q
        .get(first..first + count)
        .ok_or_else(|| ck(format!("tensor `{name}`: data shorter than its shape")))?;
    part.iter()
        .enumerate()
        .map(|(k, &b)| {
            let i = first + k;
            let (r, c) = (i / cols, i % cols);
            let v = e4m3(b).ok_or_else(|| {
                ck(format!(
                    "tensor `{name}`: element [{r}, {c}] is an FP8 NaN (0x{b:02x})"
                ))
            })?;
            Ok(v * scales[(r / blocks.rows) * scale_cols + c / blocks.cols])
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn e4m3_decodes_every_byte_as_the_format_defines() {
        assert_eq!(e4m3(0x00), Some(0.0));
        assert_eq!(e4m3(0x80), Some(-0.0));
        assert_eq!(e4m3(0x38), Some(1.0)); // exponent 7, mantissa 0
        assert_eq!(e4m3(0x7e), Some(448.0)); // the largest: 1.75 * 2^8
        assert_eq!(e4m3(0xfe), Some(-448.0));
        assert_eq!(e4m3(0x01), Some(2f32.powi(-9))); // the smallest subnormal
        assert_eq!(e4m3(0x7f), None);
        assert_eq!(e4m3(0xff), None);
        // Monotonic over the positive codes, and 126 distinct finite magnitudes above zero.
        let pos: Vec<f32> = (0u8..0x7f).map(|b| e4m3(b).unwrap()).collect();
        assert!(pos.windows(2).all(|w| w[0] < w[1]));
        assert!((0u8..=255).filter(|&b| e4m3(b).is_some()).count() == 254);
    }

    #[test]
    fn block_scales_apply_to_partial_blocks_too() {
        // A 3 x 5 weight in blocks of 2 x 2: scales [2, 3].
        let q = [0x38u8; 15]; // every element 1.0
        let scales = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = Fp8Blocks { rows: 2, cols: 2 };
        let w = dequantize("w", &q, 5, &scales, b, 0, 15).unwrap();
        #[rustfmt::skip]
        assert_eq!(w, [1.0, 1.0, 2.0, 2.0, 3.0,
                       1.0, 1.0, 2.0, 2.0, 3.0,
                       4.0, 4.0, 5.0, 5.0, 6.0]);
        assert_eq!(
            dequantize("w", &q, 5, &scales, b, 12, 3).unwrap(),
            [5.0, 5.0, 6.0]
        );
        let mut nan = q;
        nan[7] = 0x7f;
        let e = dequantize("w", &nan, 5, &scales, b, 0, 15).unwrap_err();
        assert!(e.to_string().contains("[1, 2] is an FP8 NaN"), "{e}");
        assert_eq!(b.scale_shape(&[3, 5]), [2, 3]);
    }

    #[test]
    fn fp4_and_ue8m0_decode_as_the_formats_define() {
        let codes: Vec<f32> = (0u8..16).map(e2m1).collect();
        assert_eq!(
            codes,
            [
                0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0,
                -6.0
            ]
        );
        assert_eq!(e8m0(127), Some(1.0));
        assert_eq!(e8m0(130), Some(8.0));
        assert_eq!(e8m0(0), Some(2f32.powi(-127)));
        assert_eq!(e8m0(254), Some(2f32.powi(127)));
        assert_eq!(e8m0(255), None);
        // A 2 x 34 weight: rows of 17 bytes, scales [2, 2] (the second block of a row has 2).
        let mut packed = vec![0u8; 34];
        packed[0] = 0x2f; // element 0: code 0xf (-6), element 1: code 0x2 (1.0)
        packed[16] = 0x07; // element 32: 6.0, element 33: 0
        packed[17] = 0x10; // element 34 (row 1, col 0): 0, element 35: 0.5
        let scales = [0.5, 4.0, 2.0, 8.0];
        let w = dequantize_fp4("w", &packed, 34, &scales, 0, 68).unwrap();
        assert_eq!((w[0], w[1], w[32], w[33]), (-3.0, 0.5, 24.0, 0.0));
        assert_eq!((w[34], w[35]), (0.0, 1.0));
        assert_eq!(
            dequantize_fp4("w", &packed, 34, &scales, 35, 1).unwrap(),
            [1.0]
        );
        assert!(dequantize_fp4("w", &packed[..10], 34, &scales, 0, 68).is_err());
        let has = |n: &str| n == "layers.0.ffn.experts.0.w1.weight";
        assert_eq!(
            scale_alias("layers.0.ffn.experts.0.w1.scale", has).as_deref(),
            Some("layers.0.ffn.experts.0.w1.weight_scale_inv")
        );
        assert_eq!(scale_alias("layers.0.attn_hc.scale", has), None);
        assert_eq!(scale_alias("layers.0.ffn.experts.0.w1.weight", has), None);
    }

    #[test]
    fn deepseek_v4_options_are_read_or_refused_by_name() {
        let v4 = json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
            "weight_block_size": [128, 128], "scale_fmt": "ue8m0", "expert_dtype": "fp4"}});
        let c = Fp8Config::from_config(&v4).unwrap().unwrap();
        assert!(c.ue8m0 && c.fp4_experts);
        let plain = json!({"quantization_config": {"quant_method": "fp8"}});
        let c = Fp8Config::from_config(&plain).unwrap().unwrap();
        assert!(!c.ue8m0 && !c.fp4_experts);
        for (key, bad) in [("scale_fmt", "e5m2"), ("expert_dtype", "nvfp4")] {
            let mut cfg = v4.clone();
            cfg["quantization_config"][key] = json!(bad);
            let e = Fp8Config::from_config(&cfg).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains(bad), "{e}");
        }
    }

    #[test]
    fn the_quantization_config_is_read_or_refused_by_name() {
        assert_eq!(Fp8Blocks::from_config(&json!({})).unwrap(), None);
        let fp8 = json!({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
            "activation_scheme": "dynamic", "weight_block_size": [64, 32]}});
        assert_eq!(
            Fp8Blocks::from_config(&fp8).unwrap(),
            Some(Fp8Blocks { rows: 64, cols: 32 })
        );
        let default = json!({"quantization_config": {"quant_method": "fp8"}});
        assert_eq!(
            Fp8Blocks::from_config(&default).unwrap(),
            Some(Fp8Blocks {
                rows: 128,
                cols: 128
            })
        );
        for (bad, says) in [
            (json!({"quant_method": "gptq"}), "`gptq` is not supported"),
            (
                json!({"quant_method": "fp8", "fmt": "e5m2"}),
                "`e5m2` is not supported",
            ),
            (
                json!({"quant_method": "fp8", "weight_block_size": [0, 4]}),
                "weight_block_size",
            ),
            (
                json!({"quant_method": "fp8", "weight_block_size": 128}),
                "weight_block_size",
            ),
        ] {
            let e = Fp8Blocks::from_config(&json!({ "quantization_config": bad })).unwrap_err();
            assert!(e.to_string().contains(says), "{e}");
        }
    }
}
