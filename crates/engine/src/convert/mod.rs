//! `colibri convert`: a Hugging Face checkpoint directory to a colibri model directory.
//!
//! Reads `config.json` and `*.safetensors` (bf16/f16/f32, one file or sharded), follows the
//! family's [`Plan`], quantizes weight matrices, and writes `resident.bin`, `experts.bin`, the
//! tokenizer files and — last, atomically — `manifest.json`, so a directory without a manifest is
//! an unfinished conversion. Any tensor that is missing, misshapen, of an unsupported dtype, or
//! unused is reported by name.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use rayon::prelude::*;
use safetensors::{Dtype, SafeTensors};

use crate::calib::Importance;
use crate::config::ModelConfig;
use crate::error::{io_err, Error, Result};
use crate::format::*;
use crate::model::plan::{self, Plan, MLP_PARTS};
use crate::quant::{self, Grid};

mod compressed_tensors;
mod fp8;
#[cfg(test)]
mod random_shapes_tests;
pub mod rounding;
pub mod text_only;
pub mod tiktoken;
use compressed_tensors::{CompressedTensors, PackedInt4};
use fp8::Fp8Config;
use text_only::TextOnly;

fn ck(msg: impl Into<String>) -> Error {
    Error::Checkpoint(msg.into())
}

/// Where a checkpoint tensor is and what its header says about it.
struct TensorMeta {
    shard: usize,
    dtype: Dtype,
    shape: Vec<usize>,
    /// Byte range of the data inside the shard's map (the header is parsed once, at open).
    data: std::ops::Range<usize>,
    /// FP4 codes, two per byte (`shape` is the weight's, twice the stored columns for a packed
    /// integer tensor).
    fp4: bool,
    /// compressed-tensors int4 (`X.weight_packed`, read as `X.weight`; `shape` is the weight's).
    int4: bool,
}

/// The checkpoint's tensors across all shards, by name.
struct Checkpoint {
    maps: Vec<Mmap>,
    index: HashMap<String, TensorMeta>,
    /// How FP8 (and FP4) weights are scaled, when config.json says the checkpoint has them.
    fp8: Option<Fp8Config>,
    /// The groups of compressed-tensors int4 weights, when config.json says there are some.
    int4: Option<PackedInt4>,
    /// Tensors the plan reads as integer tables (I32 / I64 allowed; any other tensor of an
    /// integer dtype is refused).
    int_tables: std::collections::HashSet<String>,
    /// The name in the checkpoint's files of each tensor `open` renamed (a wrapper's text
    /// model, a family whose files use other names than transformers' modules), for messages.
    stored: HashMap<String, String>,
}

impl Checkpoint {
    /// Opens the checkpoint's shards; `rename` maps its tensor names to the ones the plan
    /// reads (a family whose checkpoints use other names than transformers' modules), after
    /// `text` has taken a multimodal wrapper's text model's names to a text model's.
    fn open(
        dir: &Path,
        config: &serde_json::Value,
        rename: Option<fn(&str) -> String>,
        text: Option<&TextOnly>,
    ) -> Result<Checkpoint> {
        // compressed-tensors: packed int4, or FP8 read by the FP8 path (its `X.weight_scale`
        // read as `X.weight_scale_inv`).
        let compressed = CompressedTensors::from_config(config)?;
        let int4 = match compressed {
            Some(CompressedTensors::Int4(p)) => Some(p),
            _ => None,
        };
        let compressed_fp8 = match compressed {
            Some(CompressedTensors::Fp8(blocks)) => Some(Fp8Config {
                blocks,
                ue8m0: false,
                fp4_experts: false,
            }),
            _ => None,
        };
        let fp8 = Fp8Config::from_config(config)?.or(compressed_fp8);
        let mut files: Vec<PathBuf> = fs::read_dir(dir)
            .map_err(io_err(dir))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ck(format!("no *.safetensors files in {}", dir.display())));
        }
        let mut maps = Vec::new();
        for f in &files {
            let file = File::open(f).map_err(io_err(f))?;
            // SAFETY: the checkpoint is opened read-only and not modified while converting; a
            // concurrent writer would be a misuse outside this program's control.
            maps.push(unsafe { Mmap::map(&file) }.map_err(io_err(f))?);
        }
        let mut shards = Vec::new();
        for (map, f) in maps.iter().zip(&files) {
            shards.push(SafeTensors::deserialize(map).map_err(|e| {
                ck(format!(
                    "{}: not a valid safetensors file: {e}",
                    f.display()
                ))
            })?);
        }
        // Every stored name, for DeepSeek-V4's `X.scale` beside `X.weight`.
        let stored: std::collections::HashSet<String> = shards
            .iter()
            .flat_map(|st| st.names())
            .map(str::to_string)
            .collect();
        let mut index = HashMap::new();
        let mut stored_as = HashMap::new();
        for (i, (st, map)) in shards.iter().zip(&maps).enumerate() {
            for (file_name, t) in st.iter() {
                let name = file_name;
                let alias = if compressed_fp8.is_some() {
                    name.strip_suffix(compressed_tensors::SCALE)
                        .filter(|w| w.ends_with(".weight") && stored.contains(*w))
                        .map(fp8::scale_name)
                } else {
                    fp8.and_then(|_| fp8::scale_alias(name, |w| stored.contains(w)))
                };
                let name = alias.unwrap_or_else(|| name.to_string());
                let name = text.map_or(name.clone(), |t| t.text_name(&name));
                let name = rename.map_or_else(|| name.clone(), |f| f(&name));
                if name != file_name {
                    stored_as.insert(name.clone(), file_name.to_string());
                }
                let start = t.data().as_ptr() as usize - map.as_ptr() as usize;
                let meta = TensorMeta {
                    shard: i,
                    dtype: t.dtype(),
                    shape: t.shape().to_vec(),
                    data: start..start + t.data().len(),
                    fp4: false,
                    int4: false,
                };
                if index.insert(name.clone(), meta).is_some() {
                    return Err(ck(format!(
                        "tensor `{name}` appears in more than one shard"
                    )));
                }
            }
        }
        drop(shards);
        // FP4 weights: packed integers (or F4) with a scale, in a checkpoint whose experts are
        // FP4; a packed tensor's shape becomes the weight's.
        if fp8.is_some_and(|c| c.fp4_experts) {
            let scaled: Vec<String> = index
                .keys()
                .filter(|n| index.contains_key(&fp8::scale_name(n)))
                .cloned()
                .collect();
            for name in scaled {
                let m = index.get_mut(&name).expect("listed above");
                match m.dtype {
                    Dtype::I8 | Dtype::U8 => {
                        m.fp4 = true;
                        if let Some(last) = m.shape.last_mut() {
                            *last *= 2;
                        }
                    }
                    Dtype::F4 => m.fp4 = true,
                    _ => {}
                }
            }
        }
        packed_int4_weights(&mut index, &maps, int4)?;
        Ok(Checkpoint {
            maps,
            index,
            fp8,
            int4,
            int_tables: Default::default(),
            stored: stored_as,
        })
    }

    /// `r`, its error naming `name` also as the checkpoint's files do where `open` renamed it,
    /// so the user can find the tensor in their index (once, however deep the error came from).
    fn naming<T>(&self, name: &str, r: Result<T>) -> Result<T> {
        match (r, self.stored.get(name)) {
            (Err(Error::Checkpoint(msg)), Some(file)) if !msg.contains(file.as_str()) => {
                let shown = format!("`{name}` (`{file}` in the checkpoint)");
                Err(ck(msg.replacen(&format!("`{name}`"), &shown, 1)))
            }
            (r, _) => r,
        }
    }

    /// The name `name` has in the checkpoint's files.
    fn stored_name<'a>(&'a self, name: &'a str) -> &'a str {
        self.stored.get(name).map_or(name, String::as_str)
    }

    fn has(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Checks from the header alone that `name` exists, has `shape` and a supported dtype, so a
    /// conversion is refused before anything is written or allocated for it.
    fn check(&self, name: &str, shape: &[usize]) -> Result<()> {
        self.naming(name, self.check_named(name, shape))
    }

    fn check_named(&self, name: &str, shape: &[usize]) -> Result<()> {
        let m = self
            .index
            .get(name)
            .ok_or_else(|| ck(format!("missing tensor `{name}`")))?;
        self.check_dtype(name, m)?;
        if m.shape != shape {
            return Err(ck(format!(
                "tensor `{name}` has shape {:?}, expected {shape:?}",
                m.shape
            )));
        }
        Ok(())
    }

    /// The tensor as f32, checked against `shape`.
    fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let read = self.read_any(name).and_then(|(data, got_shape)| {
            if got_shape != shape {
                return Err(ck(format!(
                    "tensor `{name}` has shape {got_shape:?}, expected {shape:?}"
                )));
            }
            Ok(data)
        });
        self.naming(name, read)
    }

    fn read_any(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let m = self.meta(name)?;
        let n = m.shape.iter().product();
        Ok((self.read_elements(name, 0, n)?, m.shape.clone()))
    }

    fn meta(&self, name: &str) -> Result<&TensorMeta> {
        let m = self
            .index
            .get(name)
            .ok_or_else(|| ck(format!("missing tensor `{name}`")))?;
        self.check_dtype(name, m)?;
        Ok(m)
    }

    /// A supported dtype: BF16, F16, F32, or FP8 e4m3 / FP4 as a 2-D weight with its block
    /// scales (a checkpoint whose config declares FP8 blocks, and FP4 experts for FP4).
    fn check_dtype(&self, name: &str, m: &TensorMeta) -> Result<()> {
        if m.int4 {
            let config = self
                .int4
                .expect("packed int4 weights come with their config");
            let scale = format!("{name}{}", compressed_tensors::SCALE);
            let s = self.index.get(&scale).ok_or_else(|| {
                ck(format!(
                    "tensor `{name}` is packed int4 but `{scale}` is missing"
                ))
            })?;
            check_dtype(&scale, s.dtype)?;
            let want = config.scale_shape(&m.shape);
            if s.shape != want {
                return Err(ck(format!(
                    "tensor `{scale}` has shape {:?}, expected {want:?} (groups of {} over \
                     `{name}` {:?})",
                    s.shape, config.group, m.shape
                )));
            }
            return Ok(());
        }
        if m.dtype != Dtype::F8_E4M3 && !m.fp4 {
            if matches!(m.dtype, Dtype::I32 | Dtype::I64) && self.int_tables.contains(name) {
                return Ok(());
            }
            let scale = fp8::scale_name(name);
            if matches!(m.dtype, Dtype::I8 | Dtype::U8 | Dtype::F4) && self.has(&scale) {
                return Err(ck(format!(
                    "tensor `{name}` has dtype {:?} with scales `{scale}`: FP4 weights need \
                     config.json's quantization_config.expert_dtype \"fp4\"",
                    m.dtype
                )));
            }
            return check_dtype(name, m.dtype);
        }
        let Some(config) = self.fp8 else {
            return Err(ck(format!(
                "tensor `{name}` is FP8 (F8_E4M3) but config.json has no quantization_config \
                 with quant_method \"fp8\" saying how it is scaled"
            )));
        };
        let blocks = if m.fp4 {
            fp8::FP4_BLOCKS
        } else {
            config.blocks
        };
        if m.shape.len() != 2 {
            return Err(ck(format!(
                "tensor `{name}` is FP8 with shape {:?}: only 2-D FP8 weights are supported",
                m.shape
            )));
        }
        let scale = fp8::scale_name(name);
        let s = self
            .index
            .get(&scale)
            .ok_or_else(|| ck(format!("tensor `{name}` is FP8 but `{scale}` is missing")))?;
        self.check_scale_dtype(&scale, s.dtype)?;
        let want = blocks.scale_shape(&m.shape);
        // Sizes of 1 aside (a per-tensor scale may be stored as [1] or [], a row's as [rows]).
        let sizes = |s: &[usize]| s.iter().copied().filter(|&d| d != 1).collect::<Vec<_>>();
        if sizes(&s.shape) != sizes(&want) {
            return Err(ck(format!(
                "tensor `{scale}` has shape {:?}, expected {want:?} (blocks of {} x {} over \
                 `{name}` {:?})",
                s.shape, blocks.rows, blocks.cols, m.shape
            )));
        }
        Ok(())
    }

    /// A scale's dtype: a float, or UE8M0 bytes (`F8_E8M0`, or `U8` with `scale_fmt: "ue8m0"`).
    fn check_scale_dtype(&self, scale: &str, dtype: Dtype) -> Result<()> {
        let ue8m0 = self.fp8.is_some_and(|c| c.ue8m0);
        if dtype == Dtype::F8_E8M0 || (dtype == Dtype::U8 && ue8m0) {
            return Ok(());
        }
        check_dtype(scale, dtype).map_err(|_| {
            ck(format!(
                "tensor `{scale}` has dtype {dtype:?}; scales must be F32, BF16, F16 or F8_E8M0 \
                 (U8 with quantization_config.scale_fmt \"ue8m0\")"
            ))
        })
    }

    /// A weight's scales as f32 (UE8M0 bytes decoded; their NaN refused).
    fn read_scales(&self, scale: &str) -> Result<Vec<f32>> {
        let m = self
            .index
            .get(scale)
            .ok_or_else(|| ck(format!("missing tensor `{scale}`")))?;
        self.check_scale_dtype(scale, m.dtype)?;
        if matches!(m.dtype, Dtype::F8_E8M0 | Dtype::U8) {
            return self.maps[m.shard][m.data.clone()]
                .iter()
                .map(|&b| {
                    fp8::e8m0(b)
                        .ok_or_else(|| ck(format!("tensor `{scale}` holds a UE8M0 NaN (0xff)")))
                })
                .collect();
        }
        Ok(self.read_any(scale)?.0)
    }

    /// Whether `name` is part of a quantized weight, read with it: the scale of an FP8 or FP4
    /// weight, the scale or shape of a packed int4 one.
    fn is_weight_part(&self, name: &str) -> bool {
        let int4_part = [compressed_tensors::SCALE, compressed_tensors::SHAPE]
            .iter()
            .any(|suffix| {
                name.strip_suffix(suffix)
                    .and_then(|w| self.index.get(w))
                    .is_some_and(|m| m.int4)
            });
        int4_part || self.is_fp8_scale(name)
    }

    /// Whether `name` is the scale tensor of an FP8 or FP4 weight (read with the weight).
    fn is_fp8_scale(&self, name: &str) -> bool {
        // Packed-integer weights count too when the config does not say FP4: the weight's own
        // check then refuses it by name.
        fp8::scaled_weight(name)
            .and_then(|w| self.index.get(w))
            .is_some_and(|m| {
                m.fp4 || matches!(m.dtype, Dtype::F8_E4M3 | Dtype::I8 | Dtype::U8 | Dtype::F4)
            })
    }

    /// Elements `first..first + count` of the flattened tensor `name` as f32; an infinite or
    /// NaN value is refused (it would quantize to garbage, or poison every activation of an f32
    /// model).
    fn read_elements(&self, name: &str, first: usize, count: usize) -> Result<Vec<f32>> {
        self.naming(name, self.read_elements_named(name, first, count))
    }

    fn read_elements_named(&self, name: &str, first: usize, count: usize) -> Result<Vec<f32>> {
        let values = self.decode_elements(name, first, count)?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(ck(format!(
                "tensor `{name}` holds {} at element {}: weights must be finite (a damaged \
                 checkpoint, or one saved after training diverged)",
                values[i],
                first + i
            )));
        }
        Ok(values)
    }

    fn decode_elements(&self, name: &str, first: usize, count: usize) -> Result<Vec<f32>> {
        let m = self.meta(name)?;
        if m.int4 {
            let config = self.int4.expect("meta() checked the int4 config");
            let scales = self
                .read_any(&format!("{name}{}", compressed_tensors::SCALE))?
                .0;
            let packed = &self.maps[m.shard][m.data.clone()];
            return compressed_tensors::dequantize(
                name,
                packed,
                m.shape[1],
                &scales,
                config.group,
                first,
                count,
            );
        }
        if m.dtype == Dtype::F8_E4M3 || m.fp4 {
            let config = self.fp8.expect("meta() checked the FP8 config");
            let scales = self.read_scales(&fp8::scale_name(name))?;
            let q = &self.maps[m.shard][m.data.clone()];
            if m.fp4 {
                return fp8::dequantize_fp4(name, q, m.shape[1], &scales, first, count);
            }
            return fp8::dequantize(name, q, m.shape[1], &scales, config.blocks, first, count);
        }
        let width = match m.dtype {
            Dtype::F32 | Dtype::I32 => 4,
            Dtype::I64 => 8,
            _ => 2,
        };
        let all = &self.maps[m.shard][m.data.clone()];
        let b = first
            .checked_add(count)
            .and_then(|end| all.get(first * width..end.checked_mul(width)?))
            .ok_or_else(|| ck(format!("tensor `{name}`: data shorter than its shape")))?;
        Ok(match m.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            // Integer tables (DeepSeek-V4's token-to-expert map): exact as f32 below 2^24.
            Dtype::I32 => int_values(
                name,
                b.chunks_exact(4)
                    .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]]))),
            )?,
            Dtype::I64 => int_values(
                name,
                b.chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().expect("8-byte chunk"))),
            )?,
            other => return Err(check_dtype(name, other).unwrap_err()),
        })
    }
}

/// compressed-tensors int4 weights (`config`): each `X.weight_packed` (I32, 2-D) goes into the
/// index as `X.weight` with the weight's shape (from `X.weight_shape`, else eight columns per
/// packed word); a packed weight without the config is refused by name.
fn packed_int4_weights(
    index: &mut HashMap<String, TensorMeta>,
    maps: &[Mmap],
    config: Option<PackedInt4>,
) -> Result<()> {
    let suffix = format!(".weight{}", compressed_tensors::PACKED);
    let mut packed: Vec<String> = index
        .keys()
        .filter(|n| n.ends_with(&suffix))
        .cloned()
        .collect();
    packed.sort();
    if config.is_none() {
        if let Some(name) = packed.first() {
            return Err(ck(format!(
                "tensor `{name}` is a packed int4 weight but config.json has no \
                 quantization_config with quant_method \"compressed-tensors\" saying how"
            )));
        }
        return Ok(());
    }
    for name in packed {
        let weight = name
            .strip_suffix(compressed_tensors::PACKED)
            .expect("listed by suffix");
        let mut m = index.remove(&name).expect("listed from the index");
        if m.dtype != Dtype::I32 || m.shape.len() != 2 {
            return Err(ck(format!(
                "tensor `{name}` has dtype {:?} and shape {:?}: packed int4 weights are 2-D I32",
                m.dtype, m.shape
            )));
        }
        let shape_name = format!("{weight}{}", compressed_tensors::SHAPE);
        let shape = match index.get(&shape_name) {
            Some(s) => {
                let b = &maps[s.shard][s.data.clone()];
                let dims: Vec<i64> = match (s.dtype, s.shape.as_slice()) {
                    (Dtype::I32, [2]) => b
                        .chunks_exact(4)
                        .map(|c| i64::from(i32::from_le_bytes([c[0], c[1], c[2], c[3]])))
                        .collect(),
                    (Dtype::I64, [2]) => b
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                        .collect(),
                    _ => {
                        return Err(ck(format!(
                            "tensor `{shape_name}` has dtype {:?} and shape {:?}: a weight's \
                             shape is two I32 or I64 values",
                            s.dtype, s.shape
                        )))
                    }
                };
                if dims.len() != 2 || dims.iter().any(|&d| d <= 0) {
                    return Err(ck(format!(
                        "tensor `{shape_name}` holds {dims:?}, not a shape"
                    )));
                }
                vec![dims[0] as usize, dims[1] as usize]
            }
            None => vec![m.shape[0], m.shape[1] * 8],
        };
        if m.shape != [shape[0], shape[1].div_ceil(8)] {
            return Err(ck(format!(
                "tensor `{name}` has shape {:?}, expected {:?} for a weight of {shape:?}",
                m.shape,
                [shape[0], shape[1].div_ceil(8)]
            )));
        }
        if index.contains_key(weight) {
            return Err(ck(format!(
                "tensor `{weight}` is stored both plain and packed"
            )));
        }
        m.shape = shape;
        m.int4 = true;
        index.insert(weight.to_string(), m);
    }
    Ok(())
}

fn check_dtype(name: &str, dtype: Dtype) -> Result<()> {
    match dtype {
        Dtype::F32 | Dtype::BF16 | Dtype::F16 => Ok(()),
        other => Err(ck(format!(
            "tensor `{name}` has dtype {other:?}; supported: BF16, F16, F32 (and F8_E4M3 with \
             block scales; I32 / I64 for an integer table)"
        ))),
    }
}

/// Integers as f32, refused past 2^24 (where f32 stops holding every integer).
fn int_values(name: &str, values: impl Iterator<Item = i64>) -> Result<Vec<f32>> {
    const EXACT: i64 = 1 << 24;
    values
        .map(|v| {
            if (-EXACT..=EXACT).contains(&v) {
                Ok(v as f32)
            } else {
                Err(ck(format!(
                    "tensor `{name}` holds {v}, too large for colibri's f32 tables"
                )))
            }
        })
        .collect()
}

/// Encodes a tensor for storage; an int4 matrix with `weights` minimises the error weighted
/// by them (the 8-bit format rounds to nearest and has no search to weight); `q4_0` rounds
/// int4 groups as Q4_0 does ([`Precisions::q4_0_scales`]); an f32 matrix is first rounded as
/// `rounded_as` says ([`Precisions::rounded_as`]).
fn encode(
    data: &[f32],
    shape: &[usize],
    dtype: DType,
    weights: Option<quant::RowWeights>,
    q4_0: bool,
    rounded_as: Option<&rounding::Rounding>,
) -> Vec<u8> {
    match (dtype, weights) {
        (DType::F32, _) => {
            let rounded =
                rounded_as.map(|how| rounding::round_matrix(data, shape[0], shape[1], how));
            rounded
                .as_deref()
                .unwrap_or(data)
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        }
        (DType::Q4, _) if q4_0 => quant::quantize_q4_0_rtn(data, shape[0], shape[1]),
        (DType::Q4, None) => quant::quantize_q4(data, shape[0], shape[1]),
        (DType::Q4, Some(w)) => quant::quantize_q4_weighted(data, shape[0], shape[1], w),
        (DType::Q4T, w) => quant::quantize_q4_table(data, shape[0], shape[1], w),
        (DType::Q8, _) => quant::quantize_q8(data, shape[0], shape[1]),
    }
}

fn encoded_len(shape: &[usize], dtype: DType) -> usize {
    match dtype {
        DType::F32 => shape.iter().product::<usize>() * 4,
        DType::Q4 | DType::Q4T => quant::q4_byte_len(shape[0], shape[1]),
        DType::Q8 => quant::q8_byte_len(shape[0], shape[1]),
    }
}

/// The tensors `c`'s family reads (its registry entry's plan).
pub fn family_plan(c: &ModelConfig) -> Plan {
    (c.family.plan)(c)
}

/// What a conversion produced.
#[derive(Debug)]
pub struct Summary {
    pub architecture: String,
    pub resident_bytes: usize,
    pub expert_bytes: usize,
    pub tensors: usize,
    pub skipped: usize,
}

/// Progress callback: `(done, total, what)`.
pub type Progress<'a> = &'a mut dyn FnMut(usize, usize, &str);

/// A writer that places each blob at the next `align`ed offset.
struct AlignedWriter {
    out: BufWriter<File>,
    pos: usize,
    path: PathBuf,
}

impl AlignedWriter {
    fn create(path: PathBuf) -> Result<AlignedWriter> {
        let f = File::create(&path).map_err(io_err(&path))?;
        Ok(AlignedWriter {
            out: BufWriter::with_capacity(1 << 20, f),
            pos: 0,
            path,
        })
    }
    fn write_aligned(&mut self, bytes: &[u8], align: usize) -> Result<usize> {
        let start = align_up(self.pos, align);
        let pad = vec![0u8; start - self.pos];
        self.out.write_all(&pad).map_err(io_err(&self.path))?;
        self.out.write_all(bytes).map_err(io_err(&self.path))?;
        self.pos = start + bytes.len();
        Ok(start)
    }
    fn finish(mut self) -> Result<usize> {
        self.out.flush().map_err(io_err(&self.path))?;
        let f = self
            .out
            .into_inner()
            .map_err(|e| io_err(&self.path)(e.into_error()))?;
        f.sync_all().map_err(io_err(&self.path))?;
        Ok(self.pos)
    }
}

/// Where expert `e`'s `part` matrix of `shape` comes from: a per-expert tensor, or else a slice of a
/// fused 3-D one `(name, rows per expert, row offset, expected fused shape)`.
enum PartSource {
    Single(String),
    Fused(String, usize, usize, [usize; 3]),
}

fn expert_part_source(
    ck: &Checkpoint,
    prefix: &str,
    e: usize,
    part: &str,
    shape: &[usize],
    n_experts: usize,
) -> Result<PartSource> {
    let single = format!("{prefix}.{e}.{part}_proj.weight");
    if ck.has(&single) {
        return Ok(PartSource::Single(single));
    }
    let (fused, rows_per, offset) = match part {
        "gate" => (format!("{prefix}.gate_up_proj"), 2 * shape[0], 0),
        "up" => (format!("{prefix}.gate_up_proj"), 2 * shape[0], shape[0]),
        _ => (format!("{prefix}.down_proj"), shape[0], 0),
    };
    if !ck.has(&fused) {
        return Err(self::ck(format!(
            "missing tensor `{single}` (nor a fused `{fused}`)"
        )));
    }
    Ok(PartSource::Fused(
        fused,
        rows_per,
        offset,
        [n_experts, rows_per, shape[1]],
    ))
}

/// Checks expert `e`'s `part` from the header alone (see [`Checkpoint::check`]).
fn check_expert_part(
    ck: &Checkpoint,
    prefix: &str,
    e: usize,
    part: &str,
    shape: &[usize],
    n_experts: usize,
) -> Result<()> {
    match expert_part_source(ck, prefix, e, part, shape, n_experts)? {
        PartSource::Single(name) => ck.check(&name, shape),
        PartSource::Fused(name, _, _, want) => ck.check(&name, &want),
    }
}

/// Reads expert `e`'s `part` matrix from either the per-expert or the fused checkpoint layout.
fn read_expert_part(
    ck: &Checkpoint,
    prefix: &str,
    e: usize,
    part: &str,
    shape: &[usize],
    n_experts: usize,
) -> Result<Vec<f32>> {
    match expert_part_source(ck, prefix, e, part, shape, n_experts)? {
        PartSource::Single(name) => ck.read(&name, shape),
        PartSource::Fused(fused, rows_per, offset, want) => {
            ck.check(&fused, &want)?;
            let start = e * rows_per * shape[1] + offset * shape[1];
            ck.read_elements(&fused, start, shape[0] * shape[1])
        }
    }
}

/// The shapes of an expert's gate, up and down matrices.
fn expert_shape(cfg: &ModelConfig, part: &str) -> Vec<usize> {
    let (h, inter) = (cfg.hidden_size, cfg.moe_intermediate_size);
    if part == "down" {
        vec![h, inter]
    } else {
        vec![inter, h]
    }
}

/// Every tensor the plan reads, checked against the checkpoint's headers before any output
/// (and an expert table's entries, which the model would refuse at load).
fn check_plan(ckpt: &Checkpoint, plan: &Plan, cfg: &ModelConfig) -> Result<()> {
    for spec in &plan.resident {
        if spec.optional && !ckpt.has(&spec.hf) {
            continue;
        }
        ckpt.check(&spec.hf, &spec.source_shape())?;
        if spec.int_table {
            let table = ckpt.read(&spec.hf, &spec.source_shape())?;
            ckpt.naming(&spec.hf, check_expert_ids(&spec.hf, &table, cfg))?;
        }
    }
    for (_, src) in &plan.expert_layers {
        for e in 0..cfg.num_experts {
            for part in MLP_PARTS {
                check_expert_part(
                    ckpt,
                    &src.prefix,
                    e,
                    part,
                    &expert_shape(cfg, part),
                    cfg.num_experts,
                )?;
            }
        }
    }
    Ok(())
}

/// Refuses an expert table (DeepSeek-V4's `tid2eid`: the experts each token is routed to in a
/// hash layer) with an entry that is not an expert id: the model could not load it.
fn check_expert_ids(name: &str, table: &[f32], cfg: &ModelConfig) -> Result<()> {
    let bad = table
        .iter()
        .position(|&x| !(x >= 0.0 && x.fract() == 0.0 && (x as usize) < cfg.num_experts));
    match bad {
        Some(i) => Err(ck(format!(
            "tensor `{name}` holds {} at element {i}: every entry must be an expert id below {}",
            table[i], cfg.num_experts
        ))),
        None => Ok(()),
    }
}

/// Copies `src` to `dst` unless they are the same file (converting into the checkpoint's own
/// directory must not truncate its tokenizer).
fn copy_file(src: &Path, dst: &Path) -> Result<()> {
    if dst.exists()
        && fs::canonicalize(src).map_err(io_err(src))?
            == fs::canonicalize(dst).map_err(io_err(dst))?
    {
        return Ok(());
    }
    fs::copy(src, dst).map_err(io_err(src))?;
    Ok(())
}

/// The 8-bit matrices of an int4 conversion when the user names none (`colibri convert` without
/// `--q8` or `--pure`): every layer's attention value and output projections. Measured on the
/// 4-layer OLMoE shape (docs/PERFORMANCE.md): they carry ~70% of the int4 error (KL 0.0227 ->
/// 0.0066 at f32). An MLA layer's value projection is `kv_b_uv` (each head's `W_uv`; it has no
/// `v`): on the MLA and DSA fixtures `o` alone was not always closer to f32 than all-int4,
/// `kv_b_uv` + `o` always was (`precision_tests`). No pattern has to match anything.
pub const DEFAULT_Q8: [&str; 3] = ["layers.*.v", "layers.*.o", "layers.*.kv_b_uv"];

/// Resident weight matrices stored at another precision than the model's (`colibri convert
/// --keep-f32 PATTERN`, `--q8 PATTERN`, `--pure`): colibri tensor names (`lm_head`,
/// `layers.3.v`, ...) matched by patterns in which `*` stands for any run of characters. Routed
/// experts always take the model's quantization. A matrix named by both stays f32.
#[derive(Clone, Debug, Default)]
pub struct Precisions {
    /// Kept at f32 (for measuring which tensors a quantization hurts most).
    pub keep_f32: Vec<String>,
    /// Stored at 8 bits (`DType::Q8`); `None`: [`DEFAULT_Q8`] in an int4 conversion, nothing
    /// in an f32 one; `Some(vec![])`: none (`--pure`).
    pub q8: Option<Vec<String>>,
    /// Every int4 group rounded to nearest under Q4_0's max-abs scale instead of the
    /// error-minimising search (and no importance weights): llama.cpp's Q4_0 numbers in
    /// colibri's layout, the anchor the quantizer is measured against on the same engine.
    pub q4_0_scales: bool,
    /// A measurement aid for f32 conversions ([`rounding`]): every matrix an int4 conversion
    /// would quantize (the resident ones the int4 format takes under these precisions, and
    /// the routed experts) is stored at f32 already rounded this way. Ignored otherwise.
    pub rounded_as: Option<rounding::Rounding>,
    /// The grid of the int4 matrices (`colibri convert --grid`): linear (`DType::Q4`) or the
    /// table (`DType::Q4T`), but for MLA's `kv_b` halves, whose unrounded and by-column
    /// products read the linear grid only.
    pub grid: Grid,
}

impl Precisions {
    /// Only `keep_f32` named, the 8-bit default otherwise.
    pub fn keeping_f32(keep_f32: Vec<String>) -> Precisions {
        Precisions {
            keep_f32,
            ..Precisions::default()
        }
    }

    /// Every resident matrix at the model's quantization.
    pub fn pure() -> Precisions {
        Precisions {
            q8: Some(Vec::new()),
            ..Precisions::default()
        }
    }

    /// The 8-bit patterns in effect for a conversion at `quant`.
    fn q8_patterns(&self, quant: Quant) -> Vec<String> {
        match (&self.q8, quant) {
            (Some(p), _) => p.clone(),
            (None, Quant::Int4) => DEFAULT_Q8.iter().map(|p| p.to_string()).collect(),
            (None, Quant::F32) => Vec::new(),
        }
    }

    /// The dtype of the resident tensor `name` (`matrix`: a weight matrix, not a vector or a
    /// router) in a conversion at `quant`.
    fn dtype(&self, name: &str, matrix: bool, quant: Quant, q8: &[String]) -> DType {
        if !matrix || self.keep_f32.iter().any(|p| glob_match(p, name)) {
            DType::F32
        } else if q8.iter().any(|p| glob_match(p, name)) {
            DType::Q8
        } else if name.ends_with(".kv_b_uk_t") || name.ends_with(".kv_b_uv") {
            quant.matrix_dtype()
        } else {
            self.int4_dtype(quant)
        }
    }

    /// The dtype of the routed experts and the other int4 matrices at `quant`: its matrix
    /// dtype, on this conversion's grid.
    fn int4_dtype(&self, quant: Quant) -> DType {
        match (quant.matrix_dtype(), self.grid) {
            (DType::Q4, Grid::Table) => DType::Q4T,
            (d, _) => d,
        }
    }

    /// How the resident tensor `name` is rounded in an f32 conversion with
    /// [`Precisions::rounded_as`]: only if an int4 conversion under these precisions would
    /// store it int4.
    fn rounded_as_for(&self, name: &str, matrix: bool) -> Option<&rounding::Rounding> {
        let how = self.rounded_as.as_ref()?;
        let q8 = self.q8_patterns(Quant::Int4);
        let dtype = self.dtype(name, matrix, Quant::Int4, &q8);
        matches!(dtype, DType::Q4 | DType::Q4T).then_some(how)
    }

    /// Refuses a pattern the user gave that names no resident weight matrix of the plan.
    fn check(&self, plan: &Plan) -> Result<()> {
        if self.q4_0_scales && self.grid == Grid::Table {
            return Err(Error::Input(
                "Q4_0 rounding is of the linear grid; it cannot go with the table grid".into(),
            ));
        }
        let none = Vec::new();
        let given = [
            ("--keep-f32", &self.keep_f32),
            ("--q8", self.q8.as_ref().unwrap_or(&none)),
        ];
        for (flag, patterns) in given {
            for pattern in patterns {
                if !plan
                    .resident
                    .iter()
                    .any(|t| t.matrix && glob_match(pattern, &t.name))
                {
                    return Err(Error::Input(format!(
                        "{flag} `{pattern}` matches no weight matrix of this model (resident \
                         matrices are named like `embed`, `lm_head`, `layers.0.q`; routed experts \
                         cannot be chosen)"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// Whether `name` matches `pattern`, `*` matching any run of characters (dots included).
pub fn glob_match(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    // Greedy with backtracking to the last star: linear in practice for these short names.
    let (mut i, mut j, mut star, mut mark) = (0, 0, None, 0);
    while j < n.len() {
        if i < p.len() && p[i] == b'*' {
            star = Some(i);
            mark = j;
            i += 1;
        } else if i < p.len() && p[i] == n[j] {
            i += 1;
            j += 1;
        } else if let Some(s) = star {
            i = s + 1;
            mark += 1;
            j = mark;
        } else {
            return false;
        }
    }
    p[i..].iter().all(|&c| c == b'*')
}

/// Converts `hf_dir` into `out_dir` (created if needed), with the default precisions (an int4
/// conversion stores [`DEFAULT_Q8`] at 8 bits).
pub fn convert(hf_dir: &Path, out_dir: &Path, quant: Quant, progress: Progress) -> Result<Summary> {
    convert_with(hf_dir, out_dir, quant, &Precisions::default(), progress)
}

/// [`convert`], with the resident matrices' precisions chosen by `prec`.
pub fn convert_with(
    hf_dir: &Path,
    out_dir: &Path,
    quant: Quant,
    prec: &Precisions,
    progress: Progress,
) -> Result<Summary> {
    convert_calibrated(hf_dir, out_dir, quant, prec, None, progress)
}

/// Importance statistics of a checkpoint ([`crate::model::Model::collect_importance`] on its
/// f32 conversion) and the calibration text's record for the manifest.
#[derive(Clone, Debug)]
pub struct Calibration {
    pub importance: Importance,
    pub info: CalibrationInfo,
}

impl Calibration {
    /// Refuses statistics whose shapes are not this plan's (another model's, say).
    fn check(&self, plan: &Plan, cfg: &ModelConfig) -> Result<()> {
        let misfit = |what: String| {
            Err(Error::Input(format!(
                "the importance statistics do not fit this checkpoint: {what}"
            )))
        };
        // Statistics of products that stay f32 (routers, gates) are kept and not used.
        for (name, segs) in &self.importance.resident {
            let spec = plan.resident.iter().find(|t| &t.name == name);
            let Some(spec) = spec.filter(|t| t.shape.len() == 2) else {
                return misfit(format!("it has no matrix `{name}`"));
            };
            if segs
                .iter()
                .any(|s| s.weights.len() != spec.shape[1] || s.first_row + s.rows > spec.shape[0])
            {
                return misfit(format!("`{name}` is {:?}", spec.shape));
            }
        }
        for ((layer, e), parts) in &self.importance.experts {
            if *e >= cfg.num_experts || !plan.expert_layers.iter().any(|(l, _)| l == layer) {
                return misfit(format!("it has no routed expert {e} in layer {layer}"));
            }
            for (part, w) in MLP_PARTS.iter().zip(parts) {
                let cols = expert_shape(cfg, part)[1];
                if w.as_ref().is_some_and(|w| w.len() != cols) {
                    return misfit(format!("an expert's {part} has {cols} columns"));
                }
            }
        }
        Ok(())
    }
}

/// [`convert_with`], quantizing int4 matrices by the importance weights of `calib` when given
/// (int4 conversions only; recorded in the manifest's `quantization.calibration`).
pub fn convert_calibrated(
    hf_dir: &Path,
    out_dir: &Path,
    quant: Quant,
    prec: &Precisions,
    calib: Option<&Calibration>,
    progress: Progress,
) -> Result<Summary> {
    if calib.is_some() && quant != Quant::Int4 {
        return Err(Error::Input(format!(
            "a calibration weights the int4 quantization; a {} conversion has none to weight",
            quant.name()
        )));
    }
    let cfg_path = hf_dir.join("config.json");
    let cfg_text = fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?;
    let stored_json: serde_json::Value = serde_json::from_str(&cfg_text)
        .map_err(|e| ck(format!("{}: invalid JSON: {e}", cfg_path.display())))?;
    let (cfg_json, wrapper) = text_only::text_model(&stored_json)?;
    let cfg = ModelConfig::from_hf(&cfg_json)?;
    let tok_path = hf_dir.join("tokenizer.json");
    // A checkpoint with tiktoken files instead (Kimi's): its tokenizer.json is made here, before
    // the long part of the conversion, so that a tokenizer colibri cannot read stops it early.
    let made_tokenizer = if tok_path.is_file() {
        None
    } else {
        let made = tiktoken::from_checkpoint(hf_dir, cfg.vocab_size)?;
        if made.is_none() {
            return Err(ck(format!(
                "{} not found (nor {}): the checkpoint has no tokenizer",
                tok_path.display(),
                tiktoken::RANKS_FILE
            )));
        }
        made
    };
    let mut ckpt = Checkpoint::open(hf_dir, &cfg_json, cfg.family.checkpoint_name, wrapper)?;
    let plan = family_plan(&cfg);
    ckpt.int_tables = plan
        .resident
        .iter()
        .filter(|t| t.int_table)
        .map(|t| t.hf.clone())
        .collect();

    // Every checkpoint tensor must be used or deliberately skipped.
    let mut used: std::collections::HashSet<String> =
        plan.resident.iter().map(|t| t.hf.clone()).collect();
    let mut skipped = BTreeMap::new();
    for (_, src) in &plan.expert_layers {
        for e in 0..cfg.num_experts {
            for part in MLP_PARTS {
                used.insert(format!("{}.{e}.{part}_proj.weight", src.prefix));
            }
        }
        used.insert(format!("{}.gate_up_proj", src.prefix));
        used.insert(format!("{}.down_proj", src.prefix));
    }
    let mut names: Vec<&String> = ckpt.index.keys().collect();
    names.sort();
    for name in names {
        if used.contains(name) || ckpt.is_weight_part(name) {
            continue;
        }
        let reason = wrapper
            .and_then(|w| w.skip_reason(name))
            .or_else(|| compressed_tensors::kv_cache_scale_reason(&cfg_json, name))
            .or_else(|| plan::skip_reason(&cfg, name));
        match reason {
            Some(reason) => {
                skipped.insert(name.clone(), reason);
            }
            None => {
                let file = ckpt.stored_name(name);
                let read_as = if file == name.as_str() {
                    String::new()
                } else {
                    format!(" (read as `{name}`)")
                };
                return Err(ck(format!(
                    "unexpected tensor `{file}`{read_as}: not part of {} as configured",
                    cfg.family.hf_name
                )));
            }
        }
    }

    check_plan(&ckpt, &plan, &cfg)?;
    prec.check(&plan)?;
    if let Some(c) = calib {
        c.check(&plan, &cfg)?;
    }
    let imp = calib.map(|c| &c.importance);
    let q8 = prec.q8_patterns(quant);

    fs::create_dir_all(out_dir).map_err(io_err(out_dir))?;
    // A previous manifest would describe files we are about to overwrite.
    let manifest_path = out_dir.join(MANIFEST);
    if manifest_path.exists() {
        fs::remove_file(&manifest_path).map_err(io_err(&manifest_path))?;
    }
    let n_experts_total = plan.expert_layers.len() * cfg.num_experts;
    let total = plan.resident.len() + n_experts_total;
    let mut done = 0;

    // Resident weights.
    let mut rw = AlignedWriter::create(out_dir.join(RESIDENT_FILE))?;
    let mut tensors = BTreeMap::new();
    for spec in &plan.resident {
        progress(done, total, &spec.name);
        done += 1;
        if spec.optional && !ckpt.has(&spec.hf) {
            continue;
        }
        let source_shape = spec.source_shape();
        let mut data = ckpt.read(&spec.hf, &source_shape)?;
        if let Some(hr) = spec.head_rows {
            data = hr.apply(&data, source_shape[1]);
        }
        if spec.plus_one {
            data.iter_mut().for_each(|v| *v += 1.0);
        }
        let dtype = prec.dtype(&spec.name, spec.matrix, quant, &q8);
        let rows = |r: usize| imp.and_then(|i| i.resident_row(&spec.name, r));
        let weighted = imp.is_some_and(|i| i.resident.contains_key(&spec.name));
        let bytes = encode(
            &data,
            &spec.shape,
            dtype,
            weighted.then_some(&rows as _),
            prec.q4_0_scales,
            prec.rounded_as_for(&spec.name, spec.matrix),
        );
        let offset = rw.write_aligned(&bytes, TENSOR_ALIGN)?;
        tensors.insert(
            spec.name.clone(),
            TensorEntry {
                dtype,
                shape: spec.shape.clone(),
                offset,
                nbytes: bytes.len(),
            },
        );
    }
    let resident_bytes = rw.finish()?;

    // Routed experts: one record each.
    let experts = if plan.expert_layers.is_empty() {
        None
    } else {
        let dtype = prec.int4_dtype(quant);
        let mut parts = BTreeMap::new();
        let mut pos = 0;
        for part in MLP_PARTS {
            let shape = expert_shape(&cfg, part);
            let nbytes = encoded_len(&shape, dtype);
            let offset = align_up(pos, TENSOR_ALIGN);
            pos = offset + nbytes;
            parts.insert(
                part.to_string(),
                TensorEntry {
                    dtype,
                    shape,
                    offset,
                    nbytes,
                },
            );
        }
        let record_size = align_up(pos, RECORD_ALIGN);
        let mut ew = AlignedWriter::create(out_dir.join(EXPERTS_FILE))?;
        let mut layers = Vec::new();
        let mut record = 0;
        for (layer, src) in &plan.expert_layers {
            layers.push(ExpertLayer {
                layer: *layer,
                first_record: record,
                count: cfg.num_experts,
            });
            // Quantize a layer's experts in parallel, write them in order.
            let records: Vec<Result<Vec<u8>>> = (0..cfg.num_experts)
                .into_par_iter()
                .map(|e| {
                    let mut buf = vec![0u8; record_size];
                    for (p, part) in MLP_PARTS.into_iter().enumerate() {
                        let entry = &parts[part];
                        let data = read_expert_part(
                            &ckpt,
                            &src.prefix,
                            e,
                            part,
                            &entry.shape,
                            cfg.num_experts,
                        )?;
                        let weights = imp.and_then(|i| i.expert(*layer, e, p));
                        let rows = |_: usize| weights;
                        let bytes = encode(
                            &data,
                            &entry.shape,
                            dtype,
                            weights.is_some().then_some(&rows as _),
                            prec.q4_0_scales,
                            prec.rounded_as.as_ref(),
                        );
                        buf[entry.offset..entry.offset + bytes.len()].copy_from_slice(&bytes);
                    }
                    Ok(buf)
                })
                .collect();
            for (e, rec) in records.into_iter().enumerate() {
                progress(done, total, &format!("layers.{layer}.experts.{e}"));
                done += 1;
                let off = ew.write_aligned(&rec?, RECORD_ALIGN)?;
                debug_assert_eq!(off, record * record_size);
                record += 1;
            }
        }
        ew.finish()?;
        Some(ExpertsInfo {
            file: EXPERTS_FILE.into(),
            record_size,
            parts,
            layers,
        })
    };
    progress(total, total, "tokenizer and manifest");

    // Tokenizer files and chat template.
    let copy = |name: &str| -> Result<bool> {
        let src = hf_dir.join(name);
        if !src.is_file() {
            return Ok(false);
        }
        copy_file(&src, &out_dir.join(name))?;
        Ok(true)
    };
    match &made_tokenizer {
        Some(tj) => {
            let path = out_dir.join("tokenizer.json");
            let text = serde_json::to_string(tj).expect("tokenizer.json serializes");
            fs::write(&path, text).map_err(io_err(&path))?;
        }
        None => {
            copy("tokenizer.json")?;
        }
    }
    let has_tok_cfg = copy("tokenizer_config.json")?;
    copy("generation_config.json")?;
    let mut chat_template = None;
    let jinja = hf_dir.join("chat_template.jinja");
    if jinja.is_file() {
        chat_template = Some(fs::read_to_string(&jinja).map_err(io_err(&jinja))?);
    } else if has_tok_cfg {
        let p = hf_dir.join("tokenizer_config.json");
        let v: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&p).map_err(io_err(&p))?)
                .map_err(|e| ck(format!("{}: invalid JSON: {e}", p.display())))?;
        chat_template = v
            .get("chat_template")
            .and_then(|t| t.as_str())
            .map(str::to_string);
    }

    let expert_bytes = experts
        .as_ref()
        .map(|x| x.record_size * n_experts_total)
        .unwrap_or(0);
    let n_tensors = tensors.len();
    let n_skipped = skipped.len();
    let manifest = Manifest {
        format: FORMAT_NAME.into(),
        version: FORMAT_VERSION,
        architecture: cfg.family.hf_name.into(),
        config: cfg_json,
        quantization: QuantInfo {
            kind: quant,
            group_size: (quant == Quant::Int4).then_some(quant::GROUP),
            calibration: calib.map(|c| c.info.clone()),
        },
        resident: ResidentInfo {
            file: RESIDENT_FILE.into(),
            tensors,
        },
        experts,
        tokenizer: "tokenizer.json".into(),
        tokenizer_config: has_tok_cfg.then(|| "tokenizer_config.json".into()),
        chat_template,
        skipped_tensors: skipped,
    };
    let tmp = out_dir.join(format!("{MANIFEST}.tmp"));
    let text = serde_json::to_string_pretty(&manifest).expect("manifest serializes");
    {
        let mut f = File::create(&tmp).map_err(io_err(&tmp))?;
        f.write_all(text.as_bytes()).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
    }
    fs::rename(&tmp, &manifest_path).map_err(io_err(&manifest_path))?;
    Ok(Summary {
        architecture: cfg.family.hf_name.into(),
        resident_bytes,
        expert_bytes,
        tensors: n_tensors,
        skipped: n_skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testutil::{fixture, scratch_dir, ScratchDir};

    #[test]
    fn keep_f32_patterns_match_whole_names_with_stars() {
        for (pattern, name, want) in [
            ("lm_head", "lm_head", true),
            ("lm_head", "lm_head2", false),
            ("layers.*.v", "layers.12.v", true),
            ("layers.*.v", "layers.1.v_bias", false),
            ("layers.*.v", "layers.1.o", false),
            ("*", "embed", true),
            ("layers.0.*", "layers.0.q", true),
            ("layers.0.*", "layers.10.q", false),
            ("*.q*", "layers.3.q_b", true),
            ("**a", "a", true),
            ("", "", true),
            ("", "a", false),
        ] {
            assert_eq!(glob_match(pattern, name), want, "{pattern} vs {name}");
        }
    }

    /// A fresh copy of a fixture checkpoint in a scratch directory.
    fn scratch_copy(arch: &str, tag: &str) -> ScratchDir {
        let d = scratch_dir("convert", tag);
        for e in fs::read_dir(fixture(arch)).unwrap().flatten() {
            fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        d
    }

    fn quiet() -> impl FnMut(usize, usize, &str) {
        |_, _, _| {}
    }

    /// Converting into the checkpoint's own directory once truncated its tokenizer.json
    /// (`fs::copy` onto itself).
    #[test]
    fn converting_into_the_checkpoint_directory_keeps_the_tokenizer() {
        let d = scratch_copy("glm4_moe", "samedir");
        let before = fs::read(d.join("tokenizer.json")).unwrap();
        convert(&d, &d, Quant::Int4, &mut quiet()).unwrap();
        assert_eq!(fs::read(d.join("tokenizer.json")).unwrap(), before);
        assert!(d.join(MANIFEST).is_file());
        fs::remove_dir_all(&d).unwrap();
    }

    /// Found by fuzzing (the DeepSeek-V4 tiny model, 2026-12-07): a token-to-experts table with
    /// an entry past the experts converted, and the model then refused to load. The converter
    /// now refuses it, naming the tensor, before writing anything.
    #[test]
    fn an_expert_table_entry_past_the_experts_is_refused_before_any_output() {
        let d = scratch_copy("deepseek_v4", "tid2eid");
        let path = d.join("model.safetensors");
        let mut bytes = fs::read(&path).unwrap();
        let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
        let entry = &header["model.layers.1.ffn.gate.tid2eid"];
        assert_eq!(entry["dtype"], "I64");
        // The table's fifth entry becomes 7: the fixture has 7 experts, ids 0..7.
        let at = 8 + header_len + entry["data_offsets"][0].as_u64().unwrap() as usize + 4 * 8;
        bytes[at..at + 8].copy_from_slice(&7i64.to_le_bytes());
        fs::write(&path, &bytes).unwrap();
        let out = d.join("out");
        let e = convert(&d, &out, Quant::Int4, &mut quiet())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("layers.1.")
                && e.contains("gate.tid2eid")
                && e.contains("holds 7 at element 4"),
            "{e}"
        );
        assert!(e.contains("expert id below 7"), "{e}");
        // Named as the file has it too (V4's files say `ffn`, the plan `mlp`), once.
        let file_name = "`model.layers.1.ffn.gate.tid2eid` in the checkpoint";
        assert_eq!(e.matches(file_name).count(), 1, "{e}");
        assert!(!out.join(MANIFEST).exists());
        fs::remove_dir_all(&d).unwrap();
    }

    /// A family whose files name tensors otherwise than the plan (DeepSeek-V4: `ffn` for
    /// `mlp`) has its refusals name the tensor as its files do: a stray tensor by its file name.
    #[test]
    fn a_renamed_familys_stray_tensor_is_named_as_its_file_has_it() {
        let d = scratch_copy("deepseek_v4", "stray");
        let bytes = fs::read(d.join("model.safetensors")).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
            .iter()
            .map(|(n, t)| {
                (
                    n.to_string(),
                    t.dtype(),
                    t.shape().to_vec(),
                    t.data().to_vec(),
                )
            })
            .collect();
        let stray = "model.layers.0.ffn.stray.weight";
        tensors.push((stray.into(), Dtype::F32, vec![2], f32_bytes(&[1.0, 2.0])));
        write_shard(&d, &tensors);
        let e = convert(&d, &d.join("out"), Quant::F32, &mut quiet())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!(
                "unexpected tensor `{stray}` (read as `model.layers.0.mlp.stray.weight`)"
            )),
            "{e}"
        );
        fs::remove_dir_all(&d).unwrap();
    }

    /// Found by fuzzing: a config whose expert size the checkpoint does not back once made the
    /// converter allocate a record buffer of that size before reading any expert. Shapes are now
    /// checked from the headers first, and nothing is written for a refused checkpoint.
    #[test]
    fn shape_errors_are_found_before_any_output() {
        let d = scratch_copy("olmoe", "shapes");
        let cfg_path = d.join("config.json");
        let mut cfg: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(&cfg_path).unwrap()).unwrap();
        cfg["intermediate_size"] = serde_json::json!(1 << 20);
        fs::write(&cfg_path, cfg.to_string()).unwrap();
        let out = d.join("out");
        let e = convert(&d, &out, Quant::Int4, &mut quiet())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("model.layers.0.mlp.experts.0.gate_proj.weight") && e.contains("1048576"),
            "{e}"
        );
        assert!(!out.exists(), "a refused checkpoint writes nothing");
        fs::remove_dir_all(&d).unwrap();
    }

    /// The nearest e4m3 byte to `x` (exhaustively: the fixtures are small).
    fn nearest_e4m3(x: f32) -> u8 {
        (0u8..=255)
            .filter(|&b| fp8::e4m3(b).is_some())
            .min_by(|&a, &b| {
                let (da, db) = (fp8::e4m3(a).unwrap() - x, fp8::e4m3(b).unwrap() - x);
                da.abs().total_cmp(&db.abs())
            })
            .unwrap()
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    /// A fixture's config and checkpoint under its raw names (no family renaming, as the files
    /// hold them), with those names sorted.
    fn fixture_checkpoint(arch: &str) -> (serde_json::Value, Checkpoint, Vec<String>) {
        let src = fixture(arch);
        let cfg: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        let ckpt = Checkpoint::open(&src, &cfg, None, None).unwrap();
        let mut names: Vec<String> = ckpt.index.keys().cloned().collect();
        names.sort();
        (cfg, ckpt, names)
    }

    /// Checkpoints `a` and `b` converted to f32 and to int4 (each into its `out`): the same
    /// resident and expert bytes every time (`what` names the case in a failure).
    fn assert_converts_alike(a: &Path, b: &Path, what: &str) {
        for quant in [Quant::F32, Quant::Int4] {
            let (oa, ob) = (a.join("out"), b.join("out"));
            convert(a, &oa, quant, &mut quiet()).unwrap();
            convert(b, &ob, quant, &mut quiet()).unwrap();
            for file in [RESIDENT_FILE, EXPERTS_FILE] {
                assert!(
                    fs::read(oa.join(file)).unwrap() == fs::read(ob.join(file)).unwrap(),
                    "{what} {quant:?}: {file} differs"
                );
            }
            fs::remove_dir_all(&oa).unwrap();
        }
    }

    /// Writes `tensors` (name, dtype, shape, bytes) as the checkpoint's one shard.
    fn write_shard(dir: &Path, tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)]) {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                let v = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
                (n.clone(), v)
            })
            .collect();
        let bytes = safetensors::serialize(views, None).unwrap();
        fs::write(dir.join("model.safetensors"), bytes).unwrap();
    }

    /// The nearest e2m1 code to `x`.
    fn nearest_e2m1(x: f32) -> u8 {
        (0u8..16)
            .min_by(|&a, &b| {
                (fp8::e2m1(a) - x)
                    .abs()
                    .total_cmp(&(fp8::e2m1(b) - x).abs())
            })
            .unwrap()
    }

    /// The UE8M0 byte of the smallest power of two at least `max / top` (1.0 for zero blocks).
    fn e8m0_scale(max: f32, top: f32) -> u8 {
        if max == 0.0 {
            return 127;
        }
        (127 + (max / top).log2().ceil() as i32).clamp(0, 254) as u8
    }

    /// DeepSeek-V4 as published: routed experts FP4 (two e2m1 codes per `I8` byte, a UE8M0
    /// scale per 32 elements of a row), the other projections FP8 e4m3 in 8 x 8 blocks with
    /// UE8M0 scales, every scale stored as `X.scale` (`F8_E8M0`); it converts to exactly the
    /// model of an f32 checkpoint holding the dequantized weights (f32 and int4). Then the
    /// refusals: a UE8M0 NaN, FP4 experts without `expert_dtype`, `U8` scales without
    /// `scale_fmt: "ue8m0"`.
    #[test]
    fn a_deepseek_v4_fp8_fp4_checkpoint_converts_as_its_dequantized_weights() {
        let (cfg, ckpt, names) = fixture_checkpoint("deepseek_v4");
        let (mut packed, mut f32s) = (Vec::new(), Vec::new());
        let (mut n_fp4, mut n_fp8) = (0, 0);
        for name in &names {
            let m = &ckpt.index[name];
            if matches!(m.dtype, Dtype::I32 | Dtype::I64) {
                // Integer tables as they are.
                let raw = ckpt.maps[m.shard][m.data.clone()].to_vec();
                packed.push((name.clone(), m.dtype, m.shape.clone(), raw.clone()));
                f32s.push((name.clone(), m.dtype, m.shape.clone(), raw));
                continue;
            }
            let (w, shape) = ckpt.read_any(name).unwrap();
            let linear = shape.len() == 2
                && name.ends_with(".weight")
                && !name.contains("embed")
                && !name.starts_with("head")
                && !name.ends_with("gate.weight");
            if !linear {
                packed.push((name.clone(), Dtype::F32, shape.clone(), f32_bytes(&w)));
                f32s.push((name.clone(), Dtype::F32, shape, f32_bytes(&w)));
                continue;
            }
            let base = name.strip_suffix(".weight").unwrap();
            let (rows, cols) = (shape[0], shape[1]);
            let expert = name.contains(".experts.");
            let (br, bc, top) = if expert { (1, 32, 6.0) } else { (8, 8, 448.0) };
            let scale_cols = cols.div_ceil(bc);
            let mut scale_bytes = vec![0u8; rows.div_ceil(br) * scale_cols];
            let at = |i: usize| (i / cols / br) * scale_cols + (i % cols) / bc;
            let mut max = vec![0.0f32; scale_bytes.len()];
            for (i, x) in w.iter().enumerate() {
                max[at(i)] = max[at(i)].max(x.abs());
            }
            for (b, m) in scale_bytes.iter_mut().zip(&max) {
                *b = e8m0_scale(*m, top);
            }
            let scale = |i: usize| fp8::e8m0(scale_bytes[at(i)]).unwrap();
            let deq: Vec<f32>;
            if expert {
                n_fp4 += 1;
                let codes: Vec<u8> = w
                    .iter()
                    .enumerate()
                    .map(|(i, x)| nearest_e2m1(x / scale(i)))
                    .collect();
                deq = codes
                    .iter()
                    .enumerate()
                    .map(|(i, &c)| fp8::e2m1(c) * scale(i))
                    .collect();
                let bytes: Vec<u8> = codes.chunks_exact(2).map(|p| p[0] | (p[1] << 4)).collect();
                packed.push((name.clone(), Dtype::I8, vec![rows, cols / 2], bytes));
            } else {
                n_fp8 += 1;
                let q: Vec<u8> = w
                    .iter()
                    .enumerate()
                    .map(|(i, x)| nearest_e4m3(x / scale(i)))
                    .collect();
                deq = q
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| fp8::e4m3(b).unwrap() * scale(i))
                    .collect();
                packed.push((name.clone(), Dtype::F8_E4M3, shape.clone(), q));
            }
            let sshape = vec![rows.div_ceil(br), scale_cols];
            packed.push((format!("{base}.scale"), Dtype::F8_E8M0, sshape, scale_bytes));
            f32s.push((name.clone(), Dtype::F32, shape, f32_bytes(&deq)));
        }
        assert!(
            n_fp4 >= 40 && n_fp8 >= 10,
            "{n_fp4} FP4, {n_fp8} FP8 weights"
        );
        let (a, b) = (
            scratch_copy("deepseek_v4", "fp4"),
            scratch_copy("deepseek_v4", "fp4-deq"),
        );
        write_shard(&a, &packed);
        write_shard(&b, &f32s);
        let mut v4_cfg = cfg.clone();
        v4_cfg["quantization_config"] = serde_json::json!({"quant_method": "fp8",
            "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 8],
            "scale_fmt": "ue8m0", "expert_dtype": "fp4"});
        fs::write(a.join("config.json"), v4_cfg.to_string()).unwrap();
        assert_converts_alike(&a, &b, "FP8 / FP4");

        // A NaN scale byte.
        let scale_at = packed
            .iter()
            .position(|t| t.0.contains(".experts.") && t.0.ends_with(".scale"))
            .unwrap();
        let mut nan = packed.clone();
        nan[scale_at].3[0] = 0xff;
        write_shard(&a, &nan);
        let e = convert(&a, &a.join("x"), Quant::F32, &mut quiet()).unwrap_err();
        assert!(e.to_string().contains("UE8M0 NaN"), "{e}");
        // FP4 experts in a config that does not say so: integer weights are refused.
        write_shard(&a, &packed);
        let mut no_fp4 = v4_cfg.clone();
        no_fp4["quantization_config"]["expert_dtype"] = serde_json::json!("fp8");
        fs::write(a.join("config.json"), no_fp4.to_string()).unwrap();
        let e = convert(&a, &a.join("x"), Quant::F32, &mut quiet()).unwrap_err();
        assert!(e.to_string().contains("dtype I8 with scales"), "{e}");
        // U8 scales only with scale_fmt "ue8m0".
        let mut u8_scales = packed.clone();
        for t in u8_scales.iter_mut().filter(|t| t.0.ends_with(".scale")) {
            t.1 = Dtype::U8;
        }
        write_shard(&a, &u8_scales);
        fs::write(a.join("config.json"), v4_cfg.to_string()).unwrap();
        convert(&a, &a.join("u8"), Quant::F32, &mut quiet()).unwrap();
        let mut float_fmt = v4_cfg.clone();
        float_fmt["quantization_config"]["scale_fmt"] = serde_json::json!("float");
        fs::write(a.join("config.json"), float_fmt.to_string()).unwrap();
        let e = convert(&a, &a.join("x"), Quant::F32, &mut quiet()).unwrap_err();
        assert!(e.to_string().contains("scale_fmt"), "{e}");
        fs::remove_dir_all(&a).unwrap();
        fs::remove_dir_all(&b).unwrap();
    }

    /// compressed-tensors FP8 (`float-quantized`, GLM-4.5-FP8's form: scales named
    /// `X.weight_scale`) per channel, per 8 x 8 block and per tensor (a scale of shape [1])
    /// converts to exactly the model of an f32 checkpoint holding the dequantized weights.
    #[test]
    fn a_float_quantized_checkpoint_converts_as_its_dequantized_weights() {
        let (cfg, ckpt, names) = fixture_checkpoint("deepseek_v3");
        for (strategy, extra, blocks) in [
            (
                "channel",
                serde_json::json!({}),
                fp8::Fp8Blocks {
                    rows: 1,
                    cols: usize::MAX,
                },
            ),
            (
                "block",
                serde_json::json!({"block_structure": [8, 8]}),
                fp8::Fp8Blocks { rows: 8, cols: 8 },
            ),
            ("tensor", serde_json::json!({}), fp8::Fp8Blocks::WHOLE),
        ] {
            let (mut fp8s, mut f32s) = (Vec::new(), Vec::new());
            for name in &names {
                let name = name.as_str();
                let (w, shape) = ckpt.read_any(name).unwrap();
                if shape.len() != 2 || !name.ends_with("_proj.weight") {
                    fp8s.push((name.to_string(), Dtype::F32, shape.clone(), f32_bytes(&w)));
                    f32s.push((name.to_string(), Dtype::F32, shape, f32_bytes(&w)));
                    continue;
                }
                let cols = shape[1];
                let sshape = blocks.scale_shape(&shape);
                let at = |i: usize| (i / cols / blocks.rows) * sshape[1] + (i % cols) / blocks.cols;
                let mut scales = vec![0.0f32; sshape[0] * sshape[1]];
                for (i, x) in w.iter().enumerate() {
                    scales[at(i)] = scales[at(i)].max(x.abs() / 448.0);
                }
                for s in scales.iter_mut().filter(|s| **s == 0.0) {
                    *s = 1.0;
                }
                let q: Vec<u8> = w
                    .iter()
                    .enumerate()
                    .map(|(i, x)| nearest_e4m3(x / scales[at(i)]))
                    .collect();
                let deq: Vec<f32> = q
                    .iter()
                    .enumerate()
                    .map(|(i, &b)| fp8::e4m3(b).unwrap() * scales[at(i)])
                    .collect();
                let stored_shape = if strategy == "tensor" {
                    vec![1]
                } else {
                    sshape
                };
                fp8s.push((name.to_string(), Dtype::F8_E4M3, shape.clone(), q));
                fp8s.push((
                    format!("{name}_scale"),
                    Dtype::F32,
                    stored_shape,
                    f32_bytes(&scales),
                ));
                f32s.push((name.to_string(), Dtype::F32, shape, f32_bytes(&deq)));
            }
            let (a, b) = (
                scratch_copy("deepseek_v3", &format!("ct-fp8-{strategy}")),
                scratch_copy("deepseek_v3", &format!("ct-deq-{strategy}")),
            );
            write_shard(&a, &fp8s);
            write_shard(&b, &f32s);
            let mut weights = serde_json::json!({"num_bits": 8, "type": "float",
                "symmetric": true, "strategy": strategy, "dynamic": false});
            for (k, v) in extra.as_object().unwrap() {
                weights[k] = v.clone();
            }
            let mut ct_cfg = cfg.clone();
            ct_cfg["quantization_config"] = serde_json::json!({
                "quant_method": "compressed-tensors", "format": "float-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                        "dynamic": true, "symmetric": true}}}});
            fs::write(a.join("config.json"), ct_cfg.to_string()).unwrap();
            assert_converts_alike(&a, &b, strategy);
            let _ = fs::remove_dir_all(&a);
            let _ = fs::remove_dir_all(&b);
        }
    }

    type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

    /// A fixture's tensors with every projection packed as compressed-tensors int4 (groups of
    /// `group`, bf16 scales, `X.weight_shape` beside), the same tensors in f32 with those
    /// projections dequantized, and how many projections were packed.
    fn packed_int4_tensors(
        ckpt: &Checkpoint,
        names: &[String],
        group: usize,
    ) -> (Tensors, Tensors, usize) {
        let (mut packed, mut f32s) = (Vec::new(), Vec::new());
        let mut quantized = 0;
        for name in names {
            let (w, shape) = ckpt.read_any(name).unwrap();
            if shape.len() != 2 || !name.ends_with("_proj.weight") {
                packed.push((name.clone(), Dtype::F32, shape.clone(), f32_bytes(&w)));
                f32s.push((name.clone(), Dtype::F32, shape, f32_bytes(&w)));
                continue;
            }
            quantized += 1;
            let (rows, cols) = (shape[0], shape[1]);
            let groups = cols.div_ceil(group);
            let mut scales = vec![0.0f32; rows * groups];
            for (i, x) in w.iter().enumerate() {
                let at = (i / cols) * groups + (i % cols) / group;
                scales[at] = scales[at].max(x.abs() / 7.5);
            }
            for s in scales.iter_mut() {
                *s = half::bf16::from_f32(if *s == 0.0 { 1.0 } else { *s }).to_f32();
            }
            let stride = compressed_tensors::row_bytes(cols);
            let mut bytes = vec![0u8; rows * stride];
            let mut deq = vec![0.0f32; rows * cols];
            for (i, x) in w.iter().enumerate() {
                let (r, c) = (i / cols, i % cols);
                let s = scales[r * groups + c / group];
                let q = (x / s).round().clamp(-8.0, 7.0) as i32; // (no -0.0)
                bytes[r * stride + c / 2] |= ((q + 8) as u8) << (4 * (c % 2));
                deq[i] = q as f32 * s;
            }
            let bf16s: Vec<u8> = scales
                .iter()
                .flat_map(|&s| half::bf16::from_f32(s).to_le_bytes())
                .collect();
            let dims: Vec<u8> = [rows as i32, cols as i32]
                .iter()
                .flat_map(|d| d.to_le_bytes())
                .collect();
            packed.push((
                format!("{name}_packed"),
                Dtype::I32,
                vec![rows, stride / 4],
                bytes,
            ));
            packed.push((
                format!("{name}_scale"),
                Dtype::BF16,
                vec![rows, groups],
                bf16s,
            ));
            packed.push((format!("{name}_shape"), Dtype::I32, vec![2], dims));
            f32s.push((name.clone(), Dtype::F32, shape, f32_bytes(&deq)));
        }
        (packed, f32s, quantized)
    }

    /// compressed-tensors' `quantization_config` for packed int4 in groups of `group`.
    fn packed_int4_config(group: usize) -> serde_json::Value {
        serde_json::json!({
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                "output_activations": null, "weights": {"num_bits": 4, "type": "int",
                "symmetric": true, "strategy": "group", "group_size": group,
                "dynamic": false}}}})
    }

    /// A compressed-tensors int4 DeepSeek-V3 checkpoint (Kimi K2 Thinking's form: every linear
    /// projection packed, groups of 32 with bf16 scales, partial last groups, the weight's
    /// shape stored beside it) converts to exactly the model of an f32 checkpoint holding the
    /// dequantized weights, f32 and int4; refusals name the tensor.
    #[test]
    fn a_packed_int4_checkpoint_converts_as_its_dequantized_weights() {
        let (cfg, ckpt, names) = fixture_checkpoint("deepseek_v3");
        let group = 32;
        let (packed, f32s, quantized) = packed_int4_tensors(&ckpt, &names, group);
        assert!(quantized >= 10, "{quantized} packed weights");
        let (a, b) = (
            scratch_copy("deepseek_v3", "int4-packed"),
            scratch_copy("deepseek_v3", "int4-deq"),
        );
        write_shard(&a, &packed);
        write_shard(&b, &f32s);
        let mut int4_cfg = cfg.clone();
        int4_cfg["quantization_config"] = packed_int4_config(group);
        fs::write(a.join("config.json"), int4_cfg.to_string()).unwrap();
        assert_converts_alike(&a, &b, "packed int4");

        // Refusals: no config for the packed weights, a missing scale, a scale of the wrong
        // shape, a packed tensor of another dtype, a weight stored twice.
        let refusal = |tensors: &[(String, Dtype, Vec<usize>, Vec<u8>)],
                       cfg: &serde_json::Value| {
            write_shard(&a, tensors);
            fs::write(a.join("config.json"), cfg.to_string()).unwrap();
            convert(&a, &a.join("x"), Quant::F32, &mut quiet())
                .unwrap_err()
                .to_string()
        };
        let e = refusal(&packed, &cfg);
        assert!(
            e.contains("no quantization_config with quant_method \"compressed-tensors\""),
            "{e}"
        );
        let at = |suffix: &str| packed.iter().position(|t| t.0.ends_with(suffix)).unwrap();
        let weight = packed[at("_scale")]
            .0
            .strip_suffix("_scale")
            .unwrap()
            .to_string();
        let mut t = packed.clone();
        t.remove(at("_scale"));
        let e = refusal(&t, &int4_cfg);
        assert!(e.contains(&format!("`{weight}` is packed int4 but")), "{e}");
        let mut t = packed.clone();
        let i = at("_scale");
        t[i].2[1] += 1;
        let rows = t[i].2[0];
        t[i].3.extend([0, 0].repeat(rows));
        let e = refusal(&t, &int4_cfg);
        assert!(e.contains("groups of 32"), "{e}");
        let mut t = packed.clone();
        t[at("_packed")].1 = Dtype::F32;
        let e = refusal(&t, &int4_cfg);
        assert!(e.contains("packed int4 weights are 2-D I32"), "{e}");
        let mut t = packed.clone();
        let w = f32s.iter().find(|x| x.0 == weight).unwrap().clone();
        t.push(w);
        let e = refusal(&t, &int4_cfg);
        assert!(e.contains("stored both plain and packed"), "{e}");
    }

    /// Kimi K2.5's form: the DeepSeek-V3 fixture as the text model of a
    /// `KimiK25ForConditionalGeneration` (its config as `text_config`, its tensors under
    /// `language_model.`, a vision tower and projector beside) converts to the fixture's own
    /// model, f32 and int4, plain and with packed int4 projections quantized as the wrapper's
    /// top-level config says; the vision tensors are listed as skipped, and a tensor outside
    /// both is refused by name.
    #[test]
    fn kimi_k25s_text_model_converts_as_the_text_model_alone() {
        let (cfg, ckpt, names) = fixture_checkpoint("deepseek_v3");
        let vision = |d: usize| -> Tensors {
            vec![
                (
                    "vision_tower.encoder.blocks.0.wqkv.weight".into(),
                    Dtype::F32,
                    vec![3 * d, d],
                    f32_bytes(&vec![0.5; 3 * d * d]),
                ),
                (
                    "mm_projector.proj.0.weight".into(),
                    Dtype::F32,
                    vec![d, d],
                    f32_bytes(&vec![0.25; d * d]),
                ),
            ]
        };
        let wrapped = |tensors: &Tensors| -> Tensors {
            let mut out: Tensors = tensors
                .iter()
                .map(|(n, d, s, b)| (format!("language_model.{n}"), *d, s.clone(), b.clone()))
                .collect();
            out.extend(vision(16));
            out
        };
        let wrapper = |text: &serde_json::Value| {
            let mut text = text.clone();
            text.as_object_mut().unwrap().remove("architectures");
            text["model_type"] = "kimi_k2".into();
            serde_json::json!({
                "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                "media_placeholder_token_id": 163605, "tie_word_embeddings": false,
                "vision_config": {"patch_size": 14, "mm_hidden_size": 16}, "text_config": text,
            })
        };
        let plain: Tensors = names
            .iter()
            .map(|n| {
                let (w, shape) = ckpt.read_any(n).unwrap();
                (n.clone(), Dtype::F32, shape, f32_bytes(&w))
            })
            .collect();
        let (a, b) = (
            scratch_copy("deepseek_v3", "k25-wrapped"),
            scratch_copy("deepseek_v3", "k25-text"),
        );
        write_shard(&a, &wrapped(&plain));
        fs::write(a.join("config.json"), wrapper(&cfg).to_string()).unwrap();
        write_shard(&b, &plain);
        assert_converts_alike(&a, &b, "Kimi K2.5 wrapper");
        let out = a.join("listed");
        convert(&a, &out, Quant::Int4, &mut quiet()).unwrap();
        let m = read_manifest(&out).unwrap();
        assert_eq!(m.architecture, "DeepseekV3ForCausalLM");
        assert!(m.config.get("vision_config").is_none());
        let skipped: Vec<(&str, &str)> = m
            .skipped_tensors
            .iter()
            .filter(|(n, _)| !n.starts_with("language_model."))
            .map(|(n, r)| (n.as_str(), r.as_str()))
            .collect();
        assert_eq!(skipped.len(), 2, "{skipped:?}");
        for (name, reason) in skipped {
            let part = if name.starts_with("vision_tower.") {
                "vision tower"
            } else {
                "multimodal projector"
            };
            assert_eq!(
                reason,
                format!("{part} of KimiK25ForConditionalGeneration: colibri serves its text model alone")
            );
        }

        // Packed int4 projections, quantization_config at the wrapper's top level.
        let (packed, f32s, _) = packed_int4_tensors(&ckpt, &names, 32);
        write_shard(&a, &wrapped(&packed));
        let mut packed_cfg = wrapper(&cfg);
        packed_cfg["quantization_config"] = packed_int4_config(32);
        fs::write(a.join("config.json"), packed_cfg.to_string()).unwrap();
        write_shard(&b, &f32s);
        assert_converts_alike(&a, &b, "Kimi K2.5 wrapper, packed int4");

        // Neither the text model nor a part the wrapper names: refused by name.
        let mut stray = wrapped(&plain);
        stray.push((
            "audio_tower.w".into(),
            Dtype::F32,
            vec![2],
            f32_bytes(&[1.0, 2.0]),
        ));
        write_shard(&a, &stray);
        fs::write(a.join("config.json"), wrapper(&cfg).to_string()).unwrap();
        let e = convert(&a, &a.join("x"), Quant::F32, &mut quiet())
            .unwrap_err()
            .to_string();
        assert!(e.contains("unexpected tensor `audio_tower.w`"), "{e}");
        fs::remove_dir_all(&a).unwrap();
        fs::remove_dir_all(&b).unwrap();
    }

    /// A compressed-tensors checkpoint quantized with an FP8 KV-cache scheme stores calibrated
    /// `k_scale` / `v_scale` beside each attention: with the scheme they are skipped with the
    /// reason (the model converts as without them); without it they are refused by name.
    #[test]
    fn an_fp8_kv_cache_schemes_scales_are_skipped_with_the_reason() {
        let (cfg, ckpt, names) = fixture_checkpoint("deepseek_v3");
        let (mut packed, f32s, _) = packed_int4_tensors(&ckpt, &names, 32);
        let layers = cfg["num_hidden_layers"].as_u64().unwrap();
        for l in 0..layers {
            for kind in ["k_scale", "v_scale"] {
                let name = format!("model.layers.{l}.self_attn.{kind}");
                packed.push((name, Dtype::F32, vec![], f32_bytes(&[0.0625])));
            }
        }
        let (a, b) = (
            scratch_copy("deepseek_v3", "kv-scheme"),
            scratch_copy("deepseek_v3", "kv-scheme-deq"),
        );
        write_shard(&a, &packed);
        write_shard(&b, &f32s);
        let mut with_scheme = cfg.clone();
        with_scheme["quantization_config"] = packed_int4_config(32);
        with_scheme["quantization_config"]["kv_cache_scheme"] = serde_json::json!({
            "num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false,
            "symmetric": true});
        fs::write(a.join("config.json"), with_scheme.to_string()).unwrap();
        assert_converts_alike(&a, &b, "kv_cache_scheme");
        let out = a.join("listed");
        convert(&a, &out, Quant::Int4, &mut quiet()).unwrap();
        let skipped = read_manifest(&out).unwrap().skipped_tensors;
        let reason = &skipped["model.layers.0.self_attn.v_scale"];
        assert!(
            reason.starts_with("calibrated v_scale of an FP8 KV cache"),
            "{reason}"
        );
        assert_eq!(
            skipped.keys().filter(|n| n.ends_with("_scale")).count(),
            2 * layers as usize
        );

        let mut no_scheme = with_scheme.clone();
        no_scheme["quantization_config"]["kv_cache_scheme"] = serde_json::Value::Null;
        fs::write(a.join("config.json"), no_scheme.to_string()).unwrap();
        let e = convert(&a, &a.join("x"), Quant::F32, &mut quiet())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unexpected tensor `model.layers.0.self_attn.k_scale`"),
            "{e}"
        );
        fs::remove_dir_all(&a).unwrap();
        fs::remove_dir_all(&b).unwrap();
    }

    /// An FP8 block-quantized DeepSeek-V3 checkpoint (every linear projection e4m3 with scales
    /// per 8 x 8 block, partial blocks included) converts to exactly the model of an f32
    /// checkpoint holding the dequantized weights: the same bytes, f32 and int4.
    #[test]
    fn an_fp8_checkpoint_converts_as_its_dequantized_weights() {
        let (cfg, ckpt, names) = fixture_checkpoint("deepseek_v3");
        let blocks = fp8::Fp8Blocks { rows: 8, cols: 8 };
        let (mut fp8s, mut f32s) = (Vec::new(), Vec::new());
        let mut quantized = 0;
        for name in &names {
            let (w, shape) = ckpt.read_any(name).unwrap();
            if shape.len() != 2 || !name.ends_with("_proj.weight") {
                fp8s.push((name.clone(), Dtype::F32, shape.clone(), f32_bytes(&w)));
                f32s.push((name.clone(), Dtype::F32, shape, f32_bytes(&w)));
                continue;
            }
            quantized += 1;
            let (rows, cols) = (shape[0], shape[1]);
            let sshape = blocks.scale_shape(&shape);
            let mut scales = vec![0.0f32; sshape[0] * sshape[1]];
            for (i, x) in w.iter().enumerate() {
                let at = (i / cols / 8) * sshape[1] + (i % cols) / 8;
                scales[at] = scales[at].max(x.abs() / 448.0);
            }
            for s in scales.iter_mut().filter(|s| **s == 0.0) {
                *s = 1.0;
            }
            let scale_of = |i: usize| scales[(i / cols / 8) * sshape[1] + (i % cols) / 8];
            let q: Vec<u8> = w
                .iter()
                .enumerate()
                .map(|(i, x)| nearest_e4m3(x / scale_of(i)))
                .collect();
            let deq: Vec<f32> = q
                .iter()
                .enumerate()
                .map(|(i, &b)| fp8::e4m3(b).unwrap() * scale_of(i))
                .collect();
            assert_eq!(deq.len(), rows * cols);
            fp8s.push((name.clone(), Dtype::F8_E4M3, shape.clone(), q));
            fp8s.push((
                fp8::scale_name(name),
                Dtype::F32,
                sshape,
                f32_bytes(&scales),
            ));
            f32s.push((name.clone(), Dtype::F32, shape, f32_bytes(&deq)));
        }
        assert!(quantized >= 10, "{quantized} FP8 weights");
        let (a, b) = (
            scratch_copy("deepseek_v3", "fp8"),
            scratch_copy("deepseek_v3", "deq"),
        );
        write_shard(&a, &fp8s);
        write_shard(&b, &f32s);
        let mut fp8_cfg = cfg.clone();
        fp8_cfg["quantization_config"] = serde_json::json!({"quant_method": "fp8",
            "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [8, 8]});
        fs::write(a.join("config.json"), fp8_cfg.to_string()).unwrap();
        assert_converts_alike(&a, &b, "FP8 blocks");

        // Refusals: no FP8 config, a missing scale, a scale of the wrong shape.
        fs::write(a.join("config.json"), cfg.to_string()).unwrap();
        let e = convert(&a, &a.join("x"), Quant::F32, &mut quiet()).unwrap_err();
        assert!(e.to_string().contains("no quantization_config"), "{e}");
        fs::write(a.join("config.json"), fp8_cfg.to_string()).unwrap();
        let (scale_at, _) = fp8s
            .iter()
            .enumerate()
            .find(|(_, t)| t.0.ends_with("_scale_inv"))
            .unwrap();
        let weight = fp8::scaled_weight(&fp8s[scale_at].0).unwrap().to_string();
        let mut missing = fp8s.clone();
        missing.remove(scale_at);
        write_shard(&a, &missing);
        let e = convert(&a, &a.join("x"), Quant::F32, &mut quiet()).unwrap_err();
        assert!(
            e.to_string().contains(&format!("`{weight}` is FP8 but")),
            "{e}"
        );
        let mut wrong = fp8s.clone();
        wrong[scale_at] = (fp8s[scale_at].0.clone(), Dtype::F32, vec![1, 1], vec![0; 4]);
        write_shard(&a, &wrong);
        let e = convert(&a, &a.join("x"), Quant::F32, &mut quiet()).unwrap_err();
        assert!(e.to_string().contains("blocks of 8 x 8"), "{e}");
        fs::remove_dir_all(&a).unwrap();
        fs::remove_dir_all(&b).unwrap();
    }
}
