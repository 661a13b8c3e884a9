//! The colibri model directory: `manifest.json`, `resident.bin` (every weight that stays in RAM)
//! and `experts.bin` (one fixed-size, 4096-byte-aligned record per routed expert holding its gate,
//! up and down matrices, so one read loads one expert). See docs/FORMATS.md.
//!
//! This module describes the layout and reads a directory's manifest; `convert` writes the
//! directory and `model::load` reads it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{io_err, Error, Result};

pub const FORMAT_NAME: &str = "colibri-model";
pub const FORMAT_VERSION: u32 = 3;
pub const MANIFEST: &str = "manifest.json";
pub const RESIDENT_FILE: &str = "resident.bin";
pub const EXPERTS_FILE: &str = "experts.bin";
/// Alignment of every tensor inside a file (cache lines; lets f32 data be viewed in place).
pub const TENSOR_ALIGN: usize = 64;
/// Alignment and size granularity of an expert record (a page, so O_DIRECT reads work).
pub const RECORD_ALIGN: usize = 4096;

/// How a tensor's bytes encode its values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    /// little-endian f32, row-major
    F32,
    /// group-wise int4, layout of `quant::quantize_q4`, codes on the linear grid (`q - 8`)
    Q4,
    /// the same layout, codes on the table grid (`quant::TABLE_LEVELS`; `colibri convert
    /// --grid table`)
    Q4T,
    /// group-wise int8, layout of `quant::quantize_q8` (resident matrices chosen at conversion)
    Q8,
}

impl DType {
    /// Whether products with a weight of this dtype read the activations' 8-bit form
    /// (`linear::Acts::prepare`): the quantized ones.
    pub fn takes_q8_acts(self) -> bool {
        matches!(self, DType::Q4 | DType::Q4T | DType::Q8)
    }

    /// The manifest's name of the dtype.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Q4 => "q4",
            DType::Q4T => "q4t",
            DType::Q8 => "q8",
        }
    }

    /// How an int4 dtype's codes map to levels (`None` for the others).
    pub fn q4_grid(self) -> Option<crate::quant::Grid> {
        match self {
            DType::Q4 => Some(crate::quant::Grid::Linear),
            DType::Q4T => Some(crate::quant::Grid::Table),
            DType::F32 | DType::Q8 => None,
        }
    }
}

/// Weight precision chosen at conversion.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Quant {
    Int4,
    F32,
}

impl Quant {
    pub fn parse(s: &str) -> Option<Quant> {
        match s {
            "int4" => Some(Quant::Int4),
            "f32" => Some(Quant::F32),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Quant::Int4 => "int4",
            Quant::F32 => "f32",
        }
    }
    /// The storage of a weight matrix under this quantization (vectors and routers stay f32).
    pub fn matrix_dtype(self) -> DType {
        match self {
            Quant::Int4 => DType::Q4,
            Quant::F32 => DType::F32,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub dtype: DType,
    /// `[n]` for vectors, `[rows, cols]` for matrices (a linear layer's `[out, in]`).
    pub shape: Vec<usize>,
    /// Byte offset in the file (resident) or inside the record (expert part).
    pub offset: usize,
    pub nbytes: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QuantInfo {
    #[serde(rename = "type")]
    pub kind: Quant,
    /// Weights per scale (int4 only).
    pub group_size: Option<usize>,
    /// The calibration text the int4 matrices were quantized by (`colibri convert
    /// --calibration`); absent without one, so such manifests are as before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calibration: Option<CalibrationInfo>,
}

/// Which calibration text an importance-weighted conversion used (see `calib`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CalibrationInfo {
    /// SHA-256 of the text file's bytes, hex.
    pub sha256: String,
    /// Tokens of the text the f32 model ran.
    pub tokens: usize,
    /// Tokens per forward pass (each chunk from an empty context).
    pub ctx: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExpertLayer {
    pub layer: usize,
    /// Index of this layer's expert 0 in `experts.bin`; expert `e` is record `first_record + e`.
    pub first_record: usize,
    pub count: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ExpertsInfo {
    pub file: String,
    pub record_size: usize,
    /// `gate`, `up`, `down`: where each matrix sits inside a record.
    pub parts: BTreeMap<String, TensorEntry>,
    pub layers: Vec<ExpertLayer>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ResidentInfo {
    pub file: String,
    pub tensors: BTreeMap<String, TensorEntry>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub architecture: String,
    /// The checkpoint's `config.json`, verbatim: the only source of shapes and options.
    pub config: serde_json::Value,
    pub quantization: QuantInfo,
    pub resident: ResidentInfo,
    pub experts: Option<ExpertsInfo>,
    /// File names inside the model directory.
    pub tokenizer: String,
    pub tokenizer_config: Option<String>,
    pub chat_template: Option<String>,
    /// Tensors of the checkpoint deliberately not converted, with the reason (e.g. MTP layers).
    pub skipped_tensors: BTreeMap<String, String>,
}

impl Manifest {
    /// How many weight matrices each dtype stores: the resident ones (2-D tensors) and every
    /// routed expert's gate, up and down.
    pub fn matrix_dtypes(&self) -> BTreeMap<&'static str, usize> {
        let mut n = BTreeMap::new();
        for t in self
            .resident
            .tensors
            .values()
            .filter(|t| t.shape.len() == 2)
        {
            *n.entry(t.dtype.name()).or_insert(0) += 1;
        }
        if let Some(x) = &self.experts {
            let experts: usize = x.layers.iter().map(|l| l.count).sum();
            for p in x.parts.values() {
                *n.entry(p.dtype.name()).or_insert(0) += experts;
            }
        }
        n
    }
}

/// The manifest of the model directory `dir`, parsed (whatever its format and version: the
/// caller decides what it accepts).
pub fn read_manifest(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            Error::Format(format!(
                "{} not found: not a colibri model directory (convert a Hugging Face \
                 checkpoint with `colibri convert`)",
                path.display()
            ))
        } else {
            io_err(&path)(e)
        }
    })?;
    serde_json::from_str(&text)
        .map_err(|e| Error::Format(format!("{}: invalid manifest: {e}", path.display())))
}

/// Checks that `name`, a file named by a manifest (`what`: which one), is a plain file name
/// inside the model directory.
pub fn check_file_name(what: &str, name: &str) -> Result<()> {
    let p = Path::new(name);
    let plain = p.components().count() == 1
        && matches!(p.components().next(), Some(std::path::Component::Normal(_)));
    if !plain {
        return Err(Error::Format(format!(
            "manifest: {what} `{name}` is not a file name inside the model directory"
        )));
    }
    Ok(())
}

pub fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}
