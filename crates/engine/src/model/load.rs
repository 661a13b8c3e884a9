//! Loading a converted model directory: the manifest checked, the resident weights read onto
//! huge pages (or mapped), each layer's blocks built from its tensors, and the experts held in
//! RAM or behind the expert cache.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::Path;
use std::sync::Mutex;

use memmap2::Mmap;

use super::layers::hyper::{HyperHead, HyperMix};
use super::layers::mlp::Mlp;
use super::layers::moe::Moe;
use super::layers::{self, Attention, Ffn, Layer};
use super::{fmt_err, ExpertLayout, Experts, Model};
use crate::config::{FfnKind, ModelConfig};
use crate::error::{io_err, Error, Result};
use crate::format::*;
use crate::kv::KvDtype;
use crate::linear::Linear;
use crate::ops::Rope;
use crate::pool::Pool;
use crate::quant;
use crate::store::heat::Heat;
use crate::store::profile::{Finished, Turn};
use crate::store::{ExpertOptions, ExpertStore, StoreLayout};

/// The KV cache dtype: `COLI_KV_DTYPE` (`f32` or `f16`), else by the weights: f16 for int4
/// models (llama.cpp's default cache: half the memory, and with F16C widening a little faster at
/// long contexts; its rounding is far below int4's), f32 for f32 models (their logits match the
/// reference within 1e-4).
pub(crate) fn kv_dtype(quant: Quant) -> Result<KvDtype> {
    match crate::settings::kv_dtype().as_deref() {
        None | Some("") => Ok(match quant {
            Quant::Int4 => KvDtype::F16,
            Quant::F32 => KvDtype::F32,
        }),
        Some("f32") => Ok(KvDtype::F32),
        Some("f16") => Ok(KvDtype::F16),
        Some(other) => Err(Error::Input(format!(
            "COLI_KV_DTYPE={other:?}: expected f32 or f16"
        ))),
    }
}

fn map_file(path: &Path) -> Result<Mmap> {
    if crate::settings::load_mmap() {
        let f = File::open(path).map_err(io_err(path))?;
        // SAFETY: model files are written once by the converter and only read afterwards; the
        // map is read-only. Truncating them while a server runs is outside what we can guard.
        return unsafe { memmap2::MmapOptions::new().populate().map(&f) }.map_err(io_err(path));
    }
    read_into_huge_pages(path)
}

/// Reads a whole file into anonymous memory backed by transparent huge pages where the kernel
/// allows (`madvise`). Streaming 0.7 GB of weights per token through 4 KiB pages costs a page
/// walk every 4 KiB; 2 MiB pages remove nearly all of them, and the weights no longer depend on
/// what the page cache kept of the file.
fn read_into_huge_pages(path: &Path) -> Result<Mmap> {
    use std::io::Read;
    let mut f = File::open(path).map_err(io_err(path))?;
    let len = f.metadata().map_err(io_err(path))?.len() as usize;
    let mut mem = memmap2::MmapMut::map_anon(len.max(1)).map_err(io_err(path))?;
    #[cfg(target_os = "linux")]
    let _ = mem.advise(memmap2::Advice::HugePage);
    f.read_exact(&mut mem[..len]).map_err(io_err(path))?;
    let ro = mem.make_read_only().map_err(io_err(path))?;
    Ok(ro)
}

/// The resident tensors of a loaded manifest, read by name with their shapes checked.
pub(in crate::model) struct Tensors<'a> {
    entries: &'a BTreeMap<String, TensorEntry>,
    buf: &'a [u8],
}

impl Tensors<'_> {
    pub(in crate::model) fn entry(&self, name: &str) -> Result<&TensorEntry> {
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| fmt_err(format!("manifest has no tensor `{name}`")))?;
        if e.offset
            .checked_add(e.nbytes)
            .is_none_or(|end| end > self.buf.len())
        {
            return Err(fmt_err(format!(
                "tensor `{name}` lies past the end of the resident file"
            )));
        }
        Ok(e)
    }

    pub(in crate::model) fn has(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    pub(in crate::model) fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
        let e = self.entry(name)?;
        check_linear(name, e, rows, cols)?;
        Ok(Linear {
            dtype: e.dtype,
            rows,
            cols,
            offset: e.offset,
            nbytes: e.nbytes,
        })
    }

    pub(in crate::model) fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
        let e = self.entry(name)?;
        if e.dtype != DType::F32
            || e.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d)) != Some(n)
            || e.nbytes != 4 * n
        {
            return Err(fmt_err(format!("tensor `{name}` should be {n} f32 values")));
        }
        Ok(self.buf[e.offset..e.offset + e.nbytes]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }

    pub(in crate::model) fn optional_vector(
        &self,
        name: &str,
        n: usize,
    ) -> Result<Option<Vec<f32>>> {
        if self.has(name) {
            self.vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    }
}

pub(in crate::model) fn check_linear(
    name: &str,
    e: &TensorEntry,
    rows: usize,
    cols: usize,
) -> Result<()> {
    let want = match e.dtype {
        DType::F32 => rows * cols * 4,
        DType::Q4 | DType::Q4T => quant::q4_byte_len(rows, cols),
        DType::Q8 => quant::q8_byte_len(rows, cols),
    };
    if e.shape != [rows, cols] || e.nbytes != want {
        return Err(fmt_err(format!(
            "tensor `{name}` is {:?} ({} bytes), expected [{rows}, {cols}] ({want} bytes)",
            e.shape, e.nbytes
        )));
    }
    // f32 weights are viewed in place as `&[f32]` (files are mapped page-aligned).
    if e.dtype == DType::F32 && !e.offset.is_multiple_of(4) {
        return Err(fmt_err(format!(
            "tensor `{name}` is at offset {}, not 4-byte aligned",
            e.offset
        )));
    }
    Ok(())
}

impl Model {
    /// Loads a converted model directory with every expert in RAM. `threads`: worker threads
    /// (default: all cores).
    pub fn load(dir: &Path, threads: Option<usize>) -> Result<Model> {
        Model::load_with(dir, threads, &ExpertOptions::default())
    }

    /// Loads a converted model directory; `experts` says how routed experts are held (all in
    /// RAM by default, or an expert cache under a RAM budget, see [`ExpertOptions`]).
    /// The routing heat is read from `routing-heat.json` where `opts.heat` says (if there) and,
    /// with `pin_bytes`, its hottest experts are loaded into the pinned part of the cache.
    pub fn load_with(dir: &Path, threads: Option<usize>, opts: &ExpertOptions) -> Result<Model> {
        crate::alloc::tune_once();
        let mpath = dir.join(MANIFEST);
        let manifest = read_manifest(dir)?;
        if manifest.format != FORMAT_NAME || manifest.version != FORMAT_VERSION {
            return Err(fmt_err(format!(
                "{}: format {} v{} is not supported (expected {FORMAT_NAME} v{FORMAT_VERSION}); \
                 convert the checkpoint again with `colibri convert`, or re-encode a v2 \
                 directory losslessly with `colibri upgrade OLD_DIR NEW_DIR`",
                mpath.display(),
                manifest.format,
                manifest.version
            )));
        }
        let cfg = ModelConfig::from_hf(&manifest.config)?;
        check_file_name("resident file", &manifest.resident.file)?;
        check_file_name("tokenizer", &manifest.tokenizer)?;
        if let Some(t) = &manifest.tokenizer_config {
            check_file_name("tokenizer config", t)?;
        }
        if let Some(x) = &manifest.experts {
            check_file_name("experts file", &x.file)?;
        }
        let resident = map_file(&dir.join(&manifest.resident.file))?;
        let t = Tensors {
            entries: &manifest.resident.tensors,
            buf: &resident,
        };
        let h = cfg.hidden_size;

        let embed = t.linear("embed", cfg.vocab_size, h)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed
        } else {
            t.linear("lm_head", cfg.vocab_size, h)?
        };
        let norm = t.vector("norm", h)?;
        let mut expert_first = BTreeMap::new();
        let mut moe_ids = Vec::new();
        if let Some(x) = &manifest.experts {
            for l in &x.layers {
                if l.count != cfg.num_experts {
                    return Err(fmt_err(format!(
                        "layer {} lists {} experts, config has {}",
                        l.layer, l.count, cfg.num_experts
                    )));
                }
                expert_first.insert(l.layer, l.first_record);
            }
        }
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let n = |s: &str| format!("layers.{i}.{s}");
            let ffn = match cfg.layers[i] {
                FfnKind::Dense => Ffn::Dense(Mlp::load(&t, &n("mlp"), h, cfg.intermediate_size)?),
                FfnKind::Moe => {
                    let first_record = *expert_first
                        .get(&i)
                        .ok_or_else(|| fmt_err(format!("no experts recorded for MoE layer {i}")))?;
                    moe_ids.push(i);
                    Ffn::Moe(Moe::load(&t, &cfg, i, first_record, moe_ids.len() - 1)?)
                }
            };
            let hyper = |block: &str| -> Result<Option<HyperMix>> {
                cfg.hyper
                    .map(|_| HyperMix::load(&t, &cfg, &n(block)))
                    .transpose()
            };
            layers.push(Layer {
                attn_norm: t.vector(&n("attn_norm"), h)?,
                ffn_norm: t.vector(&n("ffn_norm"), h)?,
                attn_hc: hyper("attn_hc")?,
                ffn_hc: hyper("ffn_hc")?,
                attention: Attention::load(&t, &cfg, i)?,
                ffn,
            });
        }

        let hc_head = cfg.hyper.map(|_| HyperHead::load(&t, &cfg)).transpose()?;
        let heat = Heat::new(moe_ids.clone(), cfg.num_experts);
        let (heat_read, heat_path) = opts.heat.paths(dir);
        // A state directory that cannot be made shows later as a failed heat save.
        let _ = opts.heat.make_dir();
        heat.load(&heat_read);
        let (experts, expert_layout) = match &manifest.experts {
            None => (None, None),
            Some(x) => {
                let xpath = dir.join(&x.file);
                let file_len = fs::metadata(&xpath).map_err(io_err(&xpath))?.len();
                let part = |p: &str| -> Result<TensorEntry> {
                    x.parts
                        .get(p)
                        .cloned()
                        .ok_or_else(|| fmt_err(format!("expert part `{p}` missing")))
                };
                let parts = [part("gate")?, part("up")?, part("down")?];
                let mi = cfg.moe_intermediate_size;
                check_linear("experts.gate", &parts[0], mi, h)?;
                check_linear("experts.up", &parts[1], mi, h)?;
                check_linear("experts.down", &parts[2], h, mi)?;
                if parts.iter().any(|p| {
                    p.offset
                        .checked_add(p.nbytes)
                        .is_none_or(|end| end > x.record_size)
                }) {
                    return Err(fmt_err("expert parts overflow the record size"));
                }
                if parts.iter().any(|p| p.dtype != parts[0].dtype) {
                    return Err(fmt_err(
                        "expert parts gate, up and down must have the same dtype",
                    ));
                }
                if x.record_size % RECORD_ALIGN != 0 {
                    return Err(fmt_err(format!(
                        "expert record size {} is not a multiple of {RECORD_ALIGN}",
                        x.record_size
                    )));
                }
                let records = x
                    .layers
                    .iter()
                    .map(|l| l.first_record.checked_add(l.count))
                    .try_fold(0usize, |m, r| r.map(|r| m.max(r)));
                let need = records.and_then(|r| r.checked_mul(x.record_size));
                if need.is_none_or(|need| file_len < need as u64) {
                    return Err(fmt_err(format!(
                        "{} is {} bytes, smaller than its {} records of {} bytes (truncated?)",
                        x.file,
                        file_len,
                        records.map_or("too many".to_string(), |r| r.to_string()),
                        x.record_size
                    )));
                }
                let records = records.unwrap_or(0);
                let src = if opts.ram_bytes.is_none() {
                    Experts::Resident(map_file(&xpath)?)
                } else {
                    // MoE ordinal of every record, and the hottest records for the pinned part.
                    let mut rec_layer = vec![0u32; records];
                    let mut first_of = vec![0usize; moe_ids.len()];
                    for l in &x.layers {
                        if let Some(m) = moe_ids.iter().position(|&i| i == l.layer) {
                            first_of[m] = l.first_record;
                            rec_layer[l.first_record..l.first_record + l.count].fill(m as u32);
                        }
                    }
                    let e = cfg.num_experts;
                    let hot: Vec<u32> = heat
                        .hottest()
                        .into_iter()
                        .map(|i| (first_of[i as usize / e] + i as usize % e) as u32)
                        .collect();
                    let layout = StoreLayout {
                        path: xpath.clone(),
                        record_size: x.record_size,
                        rec_layer,
                        moe_layers: moe_ids.len(),
                        top_k: cfg.top_k,
                    };
                    Experts::Store(ExpertStore::open(layout, opts, &hot)?)
                };
                (
                    Some(src),
                    Some(ExpertLayout {
                        record_size: x.record_size,
                        parts,
                    }),
                )
            }
        };

        let threads = threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        });
        let kv_dtype = kv_dtype(manifest.quantization.kind)?;
        let pool = Pool::new(threads.max(1))
            .map_err(|e| Error::Input(format!("cannot start worker threads: {e}")))?;
        let prefetch = opts.prefetch && matches!(experts, Some(Experts::Store(_)));
        let kv_layout = layers::kv_layout(&cfg);
        let state_widths = layers::state_widths(&cfg);
        let mut model = Model {
            rope: Rope::scaled(cfg.rotary_dim, cfg.rope_theta, &cfg.rope_scaling),
            cfg,
            manifest,
            resident,
            experts,
            expert_layout,
            prefetch,
            heat,
            heat_path,
            heat_saved: Mutex::new(None),
            own_turn: Mutex::new(Turn::default()),
            finished: Mutex::new(Finished::default()),
            embed,
            lm_head,
            norm,
            hc_head,
            layers,
            kernel: quant::kernel(),
            pool,
            prefill_chunk: super::forward::prefill_chunk_from_env(),
            delta_chunked_from: layers::delta::delta_chunked_from_env(),
            mla_expanded: layers::mla::mla_expanded_from_env(),
            kv_dtype,
            kv_layout,
            state_widths,
            calib: Default::default(),
        };
        model.refresh_kv_b_columns();
        Ok(model)
    }
}
