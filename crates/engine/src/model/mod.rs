//! A loaded model and its forward pass.
//!
//! The per-family files (`olmoe.rs`, `qwen3_moe.rs`, `glm4_moe.rs`) say which tensors a family has
//! and where they come from; the differences in the math (q/k norm placement, routing, shared
//! experts, partial rotary) are options of [`ModelConfig`], applied here by the shared blocks:
//! attention ([`Model::attention`]), dense MLP and MoE ([`Model::moe`], routing in `routing.rs`).

pub mod glm4_moe;
pub mod olmoe;
pub mod plan;
pub mod qwen3_moe;
pub mod routing;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use memmap2::Mmap;

use crate::config::{FfnKind, ModelConfig, QkNorm};
use crate::error::{io_err, Error, Result};
use crate::format::*;
use crate::kv::{KvCache, KvDtype};
use crate::linear::{for_each_chunk_mut, matmul_many, matmul_whole, Acts, Job, Linear, WeightRef};
use crate::ops::{self, Rope, RopeAngles};
use crate::pool::Pool;
use crate::quant::{self, Kernel};
use crate::store::heat::{Heat, RoutingHeat, HEAT_FILE};
use crate::store::profile::{PassTimes, Profile, Turns};
use crate::store::{ExpertOptions, ExpertStore, RecordRef, StoreLayout, StoreStats};

/// Query positions of one head attended together in a prefill (they share each chunk of keys
/// and values they read).
const ATTN_BLOCK: usize = 16;

/// The most prompt positions one forward pass runs at once; longer prompts run in chunks of
/// this many, one after another over the same cache. A pass's transient memory grows with its
/// positions (OLMoE-1B-7B: ~0.2 GB of activations, expert inputs and outputs per 1024, by
/// peak RSS), so an unchunked 32k-token prompt would take ~6.5 GB beside the model. Prefill
/// of 2048 and 3072 tokens ran as fast in chunks of 256, 512, 1024 or 2048 as in one pass
/// (within the machine's ±3%; the weights re-read per chunk are ~3% of a 512-position chunk's
/// time). Results do not depend on the chunking (every position's arithmetic is the same;
/// tested).
const PREFILL_CHUNK: usize = 512;

/// [`PREFILL_CHUNK`], or `COLI_PREFILL_CHUNK` (positions, at least 1) to measure others; a
/// value that is not one gives the default and a warning (the second value).
fn resolve_prefill_chunk(setting: Option<&str>) -> (usize, Option<String>) {
    match setting.map(str::trim) {
        None | Some("") => (PREFILL_CHUNK, None),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if n >= 1 => (n, None),
            _ => (
                PREFILL_CHUNK,
                Some(format!(
                    "colibri: COLI_PREFILL_CHUNK={v}: expected a number of positions >= 1, \
                     using {PREFILL_CHUNK}"
                )),
            ),
        },
    }
}

fn prefill_chunk_from_env() -> usize {
    let (n, warning) = resolve_prefill_chunk(crate::settings::prefill_chunk().as_deref());
    if let Some(w) = warning {
        eprintln!("{w}");
    }
    n
}

fn fmt_err(msg: impl Into<String>) -> Error {
    Error::Format(msg.into())
}

struct Mlp {
    gate: Linear,
    up: Linear,
    down: Linear,
}

enum Ffn {
    Dense(Mlp),
    Moe {
        /// `[num_experts, hidden]`, f32, viewed in the resident weights (on huge pages, not a
        /// copy: a copy doubled the routers' RAM, 200-300 MB for Qwen3-235B or GLM-4.5).
        router: Linear,
        router_bias: Option<Vec<f32>>,
        first_record: usize,
        /// Index among the MoE layers (routing heat, cache lists).
        moe_idx: usize,
        shared: Option<Mlp>,
    },
}

struct Layer {
    attn_norm: Vec<f32>,
    ffn_norm: Vec<f32>,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    biases: [Option<Vec<f32>>; 4],
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    ffn: Ffn,
}

/// Where a routed expert's three matrices sit inside its record.
struct ExpertLayout {
    record_size: usize,
    parts: [TensorEntry; 3],
}

/// Where routed experts live: all in RAM (read at load), or staged by the expert cache.
enum Experts {
    Resident(Mmap),
    Store(ExpertStore),
}

/// What one forward pass records for the turn's profile.
#[derive(Default)]
struct Pass {
    times: PassTimes,
    /// (model layer, routed experts) of each MoE layer.
    routed: Vec<(usize, Vec<usize>)>,
    /// The look-ahead's prediction for the next MoE layer: (model layer, experts).
    predicted: Option<(usize, Vec<usize>)>,
}

pub struct Model {
    pub cfg: ModelConfig,
    pub manifest: Manifest,
    resident: Mmap,
    experts: Option<Experts>,
    expert_layout: Option<ExpertLayout>,
    prefetch: bool,
    heat: Heat,
    heat_path: PathBuf,
    heat_saved: Mutex<Option<Instant>>,
    turns: Mutex<Turns>,
    embed: Linear,
    lm_head: Linear,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: Rope,
    kernel: Kernel,
    pool: Pool,
    /// Positions per forward pass at most ([`PREFILL_CHUNK`]).
    prefill_chunk: usize,
    /// How KV caches of this model store keys and values ([`kv_dtype`]).
    pub kv_dtype: KvDtype,
}

/// The KV cache dtype: `COLI_KV_DTYPE` (`f32` or `f16`), else by the weights: f16 for int4
/// models (llama.cpp's default cache: half the memory, and with F16C widening a little faster at
/// long contexts; its rounding is far below int4's), f32 for f32 models (their logits match the
/// reference within 1e-4).
fn kv_dtype(quant: Quant) -> Result<KvDtype> {
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

struct Tensors<'a> {
    entries: &'a BTreeMap<String, TensorEntry>,
    buf: &'a [u8],
}

impl Tensors<'_> {
    fn entry(&self, name: &str) -> Result<&TensorEntry> {
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

    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
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

    fn vector(&self, name: &str, n: usize) -> Result<Vec<f32>> {
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

    fn optional_vector(&self, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
        if self.entries.contains_key(name) {
            self.vector(name, n).map(Some)
        } else {
            Ok(None)
        }
    }

    fn mlp(&self, prefix: &str, hidden: usize, inter: usize) -> Result<Mlp> {
        Ok(Mlp {
            gate: self.linear(&format!("{prefix}.gate"), inter, hidden)?,
            up: self.linear(&format!("{prefix}.up"), inter, hidden)?,
            down: self.linear(&format!("{prefix}.down"), hidden, inter)?,
        })
    }
}

fn check_linear(name: &str, e: &TensorEntry, rows: usize, cols: usize) -> Result<()> {
    let want = match e.dtype {
        DType::F32 => rows * cols * 4,
        DType::Q4 => quant::q4_byte_len(rows, cols),
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
    /// The routing heat is read from `routing-heat.json` in `dir` (if there) and, with
    /// `pin_bytes`, its hottest experts are loaded into the pinned part of the cache.
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
        let (h, qd, kvd, hd) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);

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
            let (q_norm, k_norm) = match cfg.qk_norm {
                QkNorm::None => (None, None),
                QkNorm::Full => (
                    Some(t.vector(&n("q_norm"), qd)?),
                    Some(t.vector(&n("k_norm"), kvd)?),
                ),
                QkNorm::PerHead => (
                    Some(t.vector(&n("q_norm"), hd)?),
                    Some(t.vector(&n("k_norm"), hd)?),
                ),
            };
            let ffn = match cfg.layers[i] {
                FfnKind::Dense => Ffn::Dense(t.mlp(&n("mlp"), h, cfg.intermediate_size)?),
                FfnKind::Moe => {
                    let router = t.linear(&n("router"), cfg.num_experts, h)?;
                    if router.dtype != DType::F32 {
                        return Err(fmt_err(format!("tensor `{}` should be f32", n("router"))));
                    }
                    let router_bias = t.optional_vector(&n("router_bias"), cfg.num_experts)?;
                    if matches!(cfg.routing, crate::config::Routing::SigmoidGrouped { .. })
                        && router_bias.is_none()
                    {
                        return Err(fmt_err(format!("missing `{}`", n("router_bias"))));
                    }
                    let shared = if cfg.shared_intermediate_size > 0 {
                        Some(t.mlp(&n("shared"), h, cfg.shared_intermediate_size)?)
                    } else {
                        None
                    };
                    let first_record = *expert_first
                        .get(&i)
                        .ok_or_else(|| fmt_err(format!("no experts recorded for MoE layer {i}")))?;
                    moe_ids.push(i);
                    Ffn::Moe {
                        router,
                        router_bias,
                        first_record,
                        moe_idx: moe_ids.len() - 1,
                        shared,
                    }
                }
            };
            layers.push(Layer {
                attn_norm: t.vector(&n("attn_norm"), h)?,
                ffn_norm: t.vector(&n("ffn_norm"), h)?,
                q: t.linear(&n("q"), qd, h)?,
                k: t.linear(&n("k"), kvd, h)?,
                v: t.linear(&n("v"), kvd, h)?,
                o: t.linear(&n("o"), h, qd)?,
                biases: [
                    t.optional_vector(&n("q_bias"), qd)?,
                    t.optional_vector(&n("k_bias"), kvd)?,
                    t.optional_vector(&n("v_bias"), kvd)?,
                    t.optional_vector(&n("o_bias"), h)?,
                ],
                q_norm,
                k_norm,
                ffn,
            });
        }

        let heat = Heat::new(moe_ids.clone(), cfg.num_experts);
        let heat_path = dir.join(HEAT_FILE);
        heat.load(&heat_path);
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
        let turns = Turns::new(
            cfg.num_layers,
            cfg.num_experts,
            match &experts {
                Some(Experts::Store(s)) => s.stats(),
                _ => StoreStats::default(),
            },
        );
        Ok(Model {
            rope: Rope::new(cfg.rotary_dim, cfg.rope_theta),
            cfg,
            manifest,
            resident,
            experts,
            expert_layout,
            prefetch,
            heat,
            heat_path,
            heat_saved: Mutex::new(None),
            turns: Mutex::new(turns),
            embed,
            lm_head,
            norm,
            layers,
            kernel: quant::kernel(),
            pool,
            prefill_chunk: prefill_chunk_from_env(),
            kv_dtype,
        })
    }

    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Forces a compute kernel (tests run every path); `k` must be available on this CPU.
    pub fn set_kernel(&mut self, k: Kernel) {
        assert!(k.available(), "kernel {} not available", k.name());
        self.kernel = k;
    }

    /// Sets how many prompt positions one forward pass runs at most (at least 1).
    pub fn set_prefill_chunk(&mut self, positions: usize) {
        self.prefill_chunk = positions.max(1);
    }

    /// How many prompt positions one forward pass runs at most.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(
            self.cfg.num_layers,
            self.cfg.num_kv_heads,
            self.cfg.head_dim,
            self.kv_dtype,
        )
        .with_limit(self.cfg.max_positions)
    }

    fn w(&self, l: &Linear) -> WeightRef<'_> {
        l.view(&self.resident)
    }

    /// The three matrices (gate, up, down) of an expert whose record starts at `base` in `buf`
    /// (the whole experts file, or one cached record).
    fn expert_parts<'a>(&self, buf: &'a [u8], base: usize) -> [WeightRef<'a>; 3] {
        let lay = self
            .expert_layout
            .as_ref()
            .expect("MoE layer implies experts");
        std::array::from_fn(|part| {
            let p = &lay.parts[part];
            Linear {
                dtype: p.dtype,
                rows: p.shape[0],
                cols: p.shape[1],
                offset: base + p.offset,
                nbytes: p.nbytes,
            }
            .view(buf)
        })
    }

    /// Ends the current turn: its profile joins [`Model::profiles`] (the last 30 kept), its
    /// routed experts become [`Model::last_routed_experts`], and the routing heat is saved to
    /// `routing-heat.json` in the model directory (at most every 10 s; a failed write is
    /// returned but changes nothing else). Call it when a generation ends (the engine's
    /// `Generation::end`); forward passes after it belong to the next turn.
    pub fn end_turn(&self) -> Result<()> {
        let now = self.store_stats().unwrap_or_default();
        self.turns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .end(now);
        let due = {
            let mut saved = self.heat_saved.lock().unwrap_or_else(|e| e.into_inner());
            let due = saved.is_none_or(|t| t.elapsed() >= Duration::from_secs(10));
            if due {
                *saved = Some(Instant::now());
            }
            due
        };
        if due {
            self.save_heat()?;
        }
        Ok(())
    }

    /// The profile of the last finished turn (all zero before the first [`Model::end_turn`]).
    pub fn last_profile(&self) -> Profile {
        let t = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        t.history.back().cloned().unwrap_or_default()
    }

    /// Profiles of the last 30 finished turns, oldest first.
    pub fn profiles(&self) -> Vec<Profile> {
        let t = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        t.history.iter().cloned().collect()
    }

    /// The experts routed to during the last finished turn: for each model layer (index), the
    /// expert ids, ascending (empty for dense layers).
    pub fn last_routed_experts(&self) -> Vec<Vec<u32>> {
        let t = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        t.last_routed.clone()
    }

    /// Routing counts per (MoE layer, expert) since the heat file was started.
    pub fn routing_heat(&self) -> RoutingHeat {
        self.heat.snapshot()
    }

    /// Writes the routing heat to `routing-heat.json` in the model directory (crash-safe).
    pub fn save_heat(&self) -> Result<()> {
        self.heat.save(&self.heat_path)
    }

    /// The expert cache (`None` when every expert is resident).
    pub fn expert_store(&self) -> Option<&ExpertStore> {
        match &self.experts {
            Some(Experts::Store(s)) => Some(s),
            _ => None,
        }
    }

    /// The expert cache's counters (`None` when every expert is resident).
    pub fn store_stats(&self) -> Option<StoreStats> {
        match &self.experts {
            Some(Experts::Store(s)) => Some(s.stats()),
            _ => None,
        }
    }

    /// Runs `tokens` at positions `kv.len ..` and appends them to `kv`, in passes of at most
    /// [`PREFILL_CHUNK`] positions. Returns logits for every token (`all_logits`) or only the
    /// last, `vocab_size` values per token.
    pub fn forward(&self, tokens: &[u32], kv: &mut KvCache, all_logits: bool) -> Result<Vec<f32>> {
        let n = tokens.len();
        if n == 0 {
            return Err(Error::Input("no tokens to run".into()));
        }
        if kv.len + n > self.cfg.max_positions {
            return Err(Error::Input(format!(
                "{} tokens exceed the context length {}",
                kv.len + n,
                self.cfg.max_positions
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= self.cfg.vocab_size) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary ({})",
                self.cfg.vocab_size
            )));
        }
        let t0 = Instant::now();
        let mut pass = Pass::default();
        let len0 = kv.len;
        kv.reserve(n);
        let r = tokens
            .chunks(self.prefill_chunk)
            .try_fold(Vec::new(), |mut logits, chunk| {
                let l = self.forward_inner(chunk, kv, all_logits, &mut pass)?;
                if !all_logits {
                    return Ok(l);
                }
                logits.extend(l);
                Ok(logits)
            });
        if r.is_err() {
            // A failed read leaves this pass's positions half written: drop them.
            kv.truncate(len0);
        }
        pass.times.total = t0.elapsed();
        self.turns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add_pass(n, &pass.times, &pass.routed);
        r
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        kv: &mut KvCache,
        all_logits: bool,
        pass: &mut Pass,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (n, h) = (tokens.len(), c.hidden_size);
        let mut x = vec![0.0f32; n * h];
        let embed = self.w(&self.embed);
        for (i, &tok) in tokens.iter().enumerate() {
            embed.row(tok as usize, h, &mut x[i * h..(i + 1) * h]);
        }
        // The same rotation serves every layer's queries and keys.
        let angles: Vec<RopeAngles> = (0..n).map(|i| self.rope.angles(kv.len + i)).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            let t = Instant::now();
            let mut hn = x.clone();
            self.per_position(&mut hn, h, |_, row| {
                ops::rms_norm(row, &layer.attn_norm, c.rms_norm_eps)
            });
            let att = self.attention(li, layer, hn, &angles, kv);
            pass.times.attention += t.elapsed();
            for (a, b) in x.iter_mut().zip(&att) {
                *a += *b;
            }
            let mut hn = x.clone();
            self.per_position(&mut hn, h, |_, row| {
                ops::rms_norm(row, &layer.ffn_norm, c.rms_norm_eps)
            });
            let mut acts = Acts::from_vec(hn, n, h);
            let y = match &layer.ffn {
                Ffn::Dense(m) => {
                    let t = Instant::now();
                    let y = self.mlp(m, &mut acts);
                    pass.times.expert += t.elapsed();
                    y
                }
                Ffn::Moe {
                    router,
                    router_bias,
                    first_record,
                    moe_idx,
                    shared,
                } => {
                    let at = MoeAt {
                        li,
                        first_record: *first_record,
                        moe_idx: *moe_idx,
                        residual: &x,
                    };
                    let mut y = self.moe(&mut acts, router, router_bias.as_deref(), &at, pass)?;
                    if let Some(m) = shared {
                        let t = Instant::now();
                        for (a, b) in y.iter_mut().zip(self.mlp(m, &mut acts)) {
                            *a += b;
                        }
                        pass.times.expert += t.elapsed();
                    }
                    y
                }
            };
            for (a, b) in x.iter_mut().zip(&y) {
                *a += *b;
            }
        }
        kv.len += n;

        let t = Instant::now();
        let rows: Vec<f32> = if all_logits {
            x
        } else {
            x[(n - 1) * h..].to_vec()
        };
        let m = rows.len() / h;
        let mut hn = rows;
        ops::rms_norm(&mut hn, &self.norm, c.rms_norm_eps);
        let mut acts = Acts::from_vec(hn, m, h);
        let logits = self.project(&[self.lm_head], &mut acts).remove(0);
        pass.times.lm_head += t.elapsed();
        Ok(logits)
    }

    /// `W x` for each weight in `ws` (same input), in one parallel region.
    fn project(&self, ws: &[Linear], x: &mut Acts) -> Vec<Vec<f32>> {
        x.prepare(ws.iter().any(|w| w.dtype == DType::Q4));
        let mut outs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0; w.rows * x.n]).collect();
        let x = &*x;
        let mut jobs: Vec<Job> = ws
            .iter()
            .zip(outs.iter_mut())
            .map(|(w, out)| Job {
                w: self.w(w),
                x,
                out,
            })
            .collect();
        matmul_many(&self.pool, self.kernel, &mut jobs);
        outs
    }

    fn attention(
        &self,
        li: usize,
        layer: &Layer,
        hn: Vec<f32>,
        angles: &[RopeAngles],
        kv: &mut KvCache,
    ) -> Vec<f32> {
        let n = angles.len();
        let c = &self.cfg;
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let mut acts = Acts::from_vec(hn, n, h);
        let mut qkv = self.project(&[layer.q, layer.k, layer.v], &mut acts);
        for (out, bias) in qkv.iter_mut().zip(&layer.biases) {
            if let Some(b) = bias {
                for row in out.chunks_exact_mut(b.len()) {
                    for (v, bb) in row.iter_mut().zip(b) {
                        *v += *bb;
                    }
                }
            }
        }
        let mut v = qkv.pop().unwrap();
        let mut k = qkv.pop().unwrap();
        let mut q = qkv.pop().unwrap();
        // Per position: q/k norm (Full: qn spans all heads; PerHead: one head; rms_norm
        // normalises each qn-sized run), the clip, then the rotation.
        let clip = |row: &mut [f32]| {
            if let Some(clip) = c.clip_qkv {
                for x in row.iter_mut() {
                    *x = x.clamp(-clip, clip);
                }
            }
        };
        // The q/k norms apply as a pair (a family has both or neither).
        let (q_norm, k_norm) = match (&layer.q_norm, &layer.k_norm) {
            (Some(qn), Some(kn)) => (Some(qn), Some(kn)),
            _ => (None, None),
        };
        for (t, width, norm) in [(&mut q, qd, q_norm), (&mut k, kvd, k_norm)] {
            self.per_position(t, width, |i, row| {
                if let Some(w) = norm {
                    ops::rms_norm(row, w, c.rms_norm_eps);
                }
                clip(row);
                self.rope.apply_angles(row, hd, &angles[i]);
            });
        }
        self.per_position(&mut v, kvd, |_, row| clip(row));
        let p0 = kv.len;
        kv.write(li, p0, &k, &v);
        let kv = &*kv;
        let group = c.num_heads / c.num_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        // Tasks of (block of ATTN_BLOCK query positions, head), the costliest (latest) blocks
        // first; each reads its kv head's history once per chunk for the whole block.
        let heads = c.num_heads;
        let blocks = n.div_ceil(ATTN_BLOCK);
        let task = |t: usize| (blocks - 1 - t / heads, t % heads);
        let outs = self.pool.map(blocks * heads, |t| {
            let (b, head) = task(t);
            let (i0, i1) = (b * ATTN_BLOCK, ((b + 1) * ATTN_BLOCK).min(n));
            let qs: Vec<&[f32]> = (i0..i1)
                .map(|i| &q[i * qd + head * hd..i * qd + (head + 1) * hd])
                .collect();
            let (keys, values) = kv.head(li, head / group, p0 + i1);
            let args = crate::attention::AttendArgs {
                keys,
                values,
                n0: p0 + i0 + 1,
                scale,
            };
            let mut out = vec![0.0f32; qs.len() * hd];
            crate::attention::attend(&qs, &args, &mut out);
            out
        });
        let mut att = vec![0.0f32; n * qd];
        for (t, out) in outs.iter().enumerate() {
            let (b, head) = task(t);
            for (j, o) in out.chunks_exact(hd).enumerate() {
                let i = b * ATTN_BLOCK + j;
                att[i * qd + head * hd..i * qd + (head + 1) * hd].copy_from_slice(o);
            }
        }
        let mut acts = Acts::from_vec(att, n, qd);
        let mut o = self.project(&[layer.o], &mut acts).remove(0);
        if let Some(b) = &layer.biases[3] {
            for row in o.chunks_exact_mut(h) {
                for (v, bb) in row.iter_mut().zip(b) {
                    *v += *bb;
                }
            }
        }
        o
    }

    /// `f(i, row i)` for each `width`-long row of `x` (one per position): over the pool for a
    /// prompt, on this thread for one position (a parallel region would cost more than it
    /// saves). Each row is computed whole by one thread, so the results do not depend on it.
    fn per_position<F>(&self, x: &mut [f32], width: usize, f: F)
    where
        F: Fn(usize, &mut [f32]) + Sync,
    {
        if x.len() <= width {
            x.chunks_exact_mut(width)
                .enumerate()
                .for_each(|(i, r)| f(i, r));
        } else {
            for_each_chunk_mut(&self.pool, x, width, f);
        }
    }

    fn mlp(&self, m: &Mlp, x: &mut Acts) -> Vec<f32> {
        let mut gu = self.project(&[m.gate, m.up], x);
        let up = gu.pop().unwrap();
        let mut g = gu.pop().unwrap();
        ops::silu_mul(&mut g, &up);
        let mut hidden = Acts::from_vec(g, x.n, m.gate.rows);
        self.project(&[m.down], &mut hidden).remove(0)
    }

    /// Router logits of `router` for every token of `x`, and each token's `(expert, weight)`.
    fn route(&self, x: &Acts, router: &Linear, bias: Option<&[f32]>) -> Vec<Vec<(usize, f32)>> {
        let c = &self.cfg;
        let (n, e) = (x.n, c.num_experts);
        let mut logits = vec![0.0f32; n * e];
        // The router is small but f32 (8 MB a token for OLMoE-1B-7B): split it across threads.
        debug_assert_eq!((router.rows, router.cols), (e, c.hidden_size));
        matmul_many(
            &self.pool,
            self.kernel,
            &mut [Job {
                w: self.w(router),
                x,
                out: &mut logits,
            }],
        );
        (0..n)
            .map(|t| routing::route(&c.routing, c.top_k, &logits[t * e..(t + 1) * e], bias))
            .collect()
    }

    /// Router look-ahead: the experts the next MoE layer after `li` would route the residual
    /// stream to now, read ahead of need. Returns (next layer, predicted experts).
    fn prefetch_next(&self, li: usize, residual: &[f32], n: usize) -> Option<(usize, Vec<usize>)> {
        let Some(Experts::Store(store)) = &self.experts else {
            return None;
        };
        let next = li + 1;
        let Ffn::Moe {
            router,
            router_bias,
            first_record,
            ..
        } = &self.layers.get(next)?.ffn
        else {
            return None;
        };
        let mut hn = residual.to_vec();
        ops::rms_norm(&mut hn, &self.layers[next].ffn_norm, self.cfg.rms_norm_eps);
        let acts = Acts::from_vec(hn, n, self.cfg.hidden_size);
        let mut experts: Vec<usize> = self
            .route(&acts, router, router_bias.as_deref())
            .into_iter()
            .flat_map(|r| r.into_iter().map(|(e, _)| e))
            .collect();
        experts.sort_unstable();
        experts.dedup();
        let recs: Vec<u32> = experts.iter().map(|&e| (first_record + e) as u32).collect();
        store.prefetch(&recs);
        Some((next, experts))
    }

    /// Routed experts for every token of `x`, weighted and summed (shared experts excluded).
    /// Cached or resident experts are computed first, the others as their reads finish; the
    /// sum runs in expert order whatever the order of computing, so results never depend on
    /// what was in RAM.
    fn moe(
        &self,
        x: &mut Acts,
        router: &Linear,
        bias: Option<&[f32]>,
        at: &MoeAt,
        pass: &mut Pass,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (n, h) = (x.n, c.hidden_size);
        // expert -> [(token, weight)], in expert order (the order the reference sums them).
        let mut by_expert: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
        for (t, r) in self.route(x, router, bias).into_iter().enumerate() {
            for (ex, w) in r {
                by_expert.entry(ex).or_default().push((t, w));
            }
        }
        let experts: Vec<(usize, Vec<(usize, f32)>)> = by_expert.into_iter().collect();
        for (ex, toks) in &experts {
            for _ in toks {
                self.heat.add(at.moe_idx, *ex);
            }
        }
        let ids: Vec<usize> = experts.iter().map(|(ex, _)| *ex).collect();
        if let Some((layer, predicted)) = pass.predicted.take() {
            if layer == at.li {
                pass.times.predicted_of += ids.len() as u64;
                pass.times.predicted_hit +=
                    ids.iter().filter(|e| predicted.contains(e)).count() as u64;
            }
        }
        pass.routed.push((at.li, ids));
        let q4 = self
            .expert_layout
            .as_ref()
            .is_some_and(|l| l.parts[0].dtype == DType::Q4);
        // Inputs per expert: the shared activations when every token goes there (decode);
        // otherwise its tokens' rows, gathered over the pool from the activations quantized
        // once (quantizing per expert again took ~5% of a prefill).
        x.prepare(q4);
        let x = &*x;
        let inputs: Vec<Option<Acts>> = if n == 1 {
            experts.iter().map(|_| None).collect()
        } else {
            self.pool.map(experts.len(), |j| {
                let toks = &experts[j].1;
                (toks.len() != n).then(|| {
                    let rows: Vec<usize> = toks.iter().map(|&(t, _)| t).collect();
                    x.gather(&rows, !q4)
                })
            })
        };
        let mut downs: Vec<Vec<f32>> = vec![Vec::new(); experts.len()];
        let lay = self
            .expert_layout
            .as_ref()
            .expect("MoE layer implies experts");
        match self.experts.as_ref().expect("MoE layer implies experts") {
            Experts::Resident(map) => {
                let t = Instant::now();
                let group: Vec<(usize, [WeightRef; 3])> = experts
                    .iter()
                    .enumerate()
                    .map(|(i, (ex, _))| {
                        let base = (at.first_record + ex) * lay.record_size;
                        (i, self.expert_parts(map, base))
                    })
                    .collect();
                self.expert_group(&group, &experts, &inputs, x, &mut downs);
                pass.times.expert += t.elapsed();
            }
            Experts::Store(store) => {
                let recs: Vec<u32> = experts
                    .iter()
                    .map(|(ex, _)| (at.first_record + ex) as u32)
                    .collect();
                let mut batch = store.request(&recs);
                // With a slot for every record the look-ahead would only cost a router product
                // per layer: misses (warm-up) are read in the layer's own batch anyway.
                if self.prefetch && !store.holds_all() {
                    pass.predicted = self.prefetch_next(at.li, at.residual, n);
                }
                loop {
                    let ready: Vec<(usize, RecordRef)> = batch.next_ready()?;
                    if ready.is_empty() {
                        break;
                    }
                    let t = Instant::now();
                    let group: Vec<(usize, [WeightRef; 3])> = ready
                        .iter()
                        .map(|(i, r)| (*i, self.expert_parts(r.bytes(), 0)))
                        .collect();
                    self.expert_group(&group, &experts, &inputs, x, &mut downs);
                    pass.times.expert += t.elapsed();
                }
                pass.times.io_wait += batch.io_wait();
            }
        }
        // Each token's sum runs in expert order (as the reference sums), a token per task.
        let mut parts: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); n]; // (expert, row, w)
        for (e, (_, toks)) in experts.iter().enumerate() {
            for (j, &(t, w)) in toks.iter().enumerate() {
                parts[t].push((e, j, w));
            }
        }
        let mut y = vec![0.0f32; n * h];
        let sum = |t: usize, yt: &mut [f32]| {
            for &(e, j, w) in &parts[t] {
                for (a, b) in yt.iter_mut().zip(&downs[e][j * h..(j + 1) * h]) {
                    *a += w * *b;
                }
            }
        };
        if n == 1 {
            sum(0, &mut y);
        } else {
            for_each_chunk_mut(&self.pool, &mut y, h, sum);
        }
        Ok(y)
    }

    /// Gate and up, SiLU, then down for the experts of `group` (`(index into experts, its
    /// matrices)`); writes each expert's down output to `downs`. Decoding (one token) with as
    /// many experts as a whole number of rounds of the pool's threads, each thread takes whole
    /// experts, one parallel region; otherwise every product's rows are split over the threads,
    /// three regions (gate and up; SiLU and quantizing each expert's hidden; down). Either way
    /// each output row is one thread's computation, so the results are the same.
    fn expert_group(
        &self,
        group: &[(usize, [WeightRef; 3])],
        experts: &[(usize, Vec<(usize, f32)>)],
        inputs: &[Option<Acts>],
        x: &Acts,
        downs: &mut [Vec<f32>],
    ) {
        let (h, mi) = (self.cfg.hidden_size, self.cfg.moe_intermediate_size);
        let q4 = self
            .expert_layout
            .as_ref()
            .is_some_and(|l| l.parts[0].dtype == DType::Q4);
        let toks = |i: usize| experts[i].1.len();
        let threads = self.pool.threads();
        if x.n == 1 && threads > 1 && group.len().is_multiple_of(threads) && whole_experts() {
            let outs = self.pool.map(group.len(), |j| {
                let (i, w) = &group[j];
                let xin = inputs[*i].as_ref().unwrap_or(x);
                let n = toks(*i);
                let (mut g, mut u) = (vec![0.0; n * mi], vec![0.0; n * mi]);
                matmul_whole(self.kernel, w[0], xin, &mut g);
                matmul_whole(self.kernel, w[1], xin, &mut u);
                ops::silu_mul(&mut g, &u);
                let mut hid = Acts::from_vec(g, n, mi);
                hid.prepare(q4);
                let mut out = vec![0.0; n * h];
                matmul_whole(self.kernel, w[2], &hid, &mut out);
                out
            });
            for ((i, _), out) in group.iter().zip(outs) {
                downs[*i] = out;
            }
            return;
        }
        let mut gate_up: Vec<Vec<f32>> = group
            .iter()
            .flat_map(|&(i, _)| [vec![0.0; toks(i) * mi], vec![0.0; toks(i) * mi]])
            .collect();
        {
            let mut outs = gate_up.iter_mut();
            let mut jobs = Vec::with_capacity(2 * group.len());
            for (i, w) in group {
                let xin = inputs[*i].as_ref().unwrap_or(x);
                for part in [0, 1] {
                    jobs.push(Job {
                        w: w[part],
                        x: xin,
                        out: outs.next().unwrap(),
                    });
                }
            }
            matmul_many(&self.pool, self.kernel, &mut jobs);
        }
        let pairs: Vec<Mutex<&mut [Vec<f32>]>> =
            gate_up.chunks_exact_mut(2).map(Mutex::new).collect();
        let hidden: Vec<Acts> = self.pool.map(group.len(), |j| {
            let mut gu = pairs[j].lock().unwrap_or_else(|e| e.into_inner());
            let (g, u) = gu.split_at_mut(1);
            ops::silu_mul(&mut g[0], &u[0]);
            let mut a = Acts::from_vec(std::mem::take(&mut g[0]), toks(group[j].0), mi);
            a.prepare(q4);
            a
        });
        let mut outs: Vec<Vec<f32>> = group.iter().map(|&(i, _)| vec![0.0; toks(i) * h]).collect();
        {
            let mut jobs: Vec<Job> = group
                .iter()
                .zip(&hidden)
                .zip(outs.iter_mut())
                .map(|(((_, w), hid), out)| Job {
                    w: w[2],
                    x: hid,
                    out,
                })
                .collect();
            matmul_many(&self.pool, self.kernel, &mut jobs);
        }
        for ((i, _), out) in group.iter().zip(outs) {
            downs[*i] = out;
        }
    }
}

/// Whether decode may give whole experts to threads (`COLI_WHOLE_EXPERTS=0` turns it off, to
/// measure against the row split).
fn whole_experts() -> bool {
    crate::settings::whole_experts()
}

/// Where a MoE layer is: its model index, its first expert record, its MoE ordinal, and the
/// residual stream entering its FFN (for the router look-ahead).
struct MoeAt<'a> {
    li: usize,
    first_record: usize,
    moe_idx: usize,
    residual: &'a [f32],
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// The committed `arch` fixture converted at `quant` into a fresh scratch directory named
    /// by `tag` (the caller removes it).
    fn convert_fixture(arch: &str, quant: Quant, tag: &str) -> PathBuf {
        let hf = crate::testutil::fixture(arch);
        let d = std::env::temp_dir().join(format!("colibri-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        crate::convert::convert(&hf, &d, quant, &mut |_, _, _| {}).unwrap();
        d
    }

    /// Converts the GLM fixture (f32) into a scratch directory, edits its manifest, loads it
    /// (and runs a forward pass if it loads), and removes the directory again.
    fn load_edited(tag: &str, edit: impl FnOnce(&mut Value)) -> Result<Model> {
        let d = convert_fixture("glm4_moe", Quant::F32, &format!("load-{tag}"));
        let mut m: Value =
            serde_json::from_str(&fs::read_to_string(d.join(MANIFEST)).unwrap()).unwrap();
        edit(&mut m);
        fs::write(d.join(MANIFEST), m.to_string()).unwrap();
        let r = Model::load(&d, Some(1));
        if let Ok(model) = &r {
            let mut kv = model.new_cache();
            model.forward(&[1, 2, 3], &mut kv, false).unwrap();
        }
        // The model keeps its maps; the files can go.
        fs::remove_dir_all(&d).unwrap();
        r
    }

    fn err(r: Result<Model>) -> String {
        match r {
            Ok(_) => panic!("expected the model to be refused"),
            Err(e) => e.to_string(),
        }
    }

    /// A prompt run in chunks gives the bits of the same prompt in one pass, for every fixture
    /// architecture, in int4 (expert-grouped products, f16 cache) and f32, with every token's
    /// logits and with the last one's; and decoding after it continues identically.
    #[test]
    fn chunked_prefill_gives_the_same_bits() {
        for arch in ["olmoe", "qwen3_moe", "glm4_moe"] {
            for quant in [Quant::Int4, Quant::F32] {
                let d = convert_fixture(arch, quant, &format!("chunk-{arch}-{quant:?}"));
                let mut model = Model::load(&d, Some(2)).unwrap();
                fs::remove_dir_all(&d).unwrap();
                let vocab = model.cfg.vocab_size as u32;
                let prompt: Vec<u32> = (0..61u32).map(|i| (i * 37 + 5) % vocab).collect();
                let run = |model: &Model, all: bool| {
                    let mut kv = model.new_cache();
                    let prefill = model.forward(&prompt, &mut kv, all).unwrap();
                    let next = model.forward(&[7], &mut kv, false).unwrap();
                    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                    (bits(prefill), bits(next))
                };
                model.set_prefill_chunk(usize::MAX);
                let whole = [run(&model, true), run(&model, false)];
                for chunk in [1, 8, 13, 60] {
                    model.set_prefill_chunk(chunk);
                    let chunked = [run(&model, true), run(&model, false)];
                    assert!(
                        chunked == whole,
                        "{arch} {quant:?}: chunks of {chunk} changed the logits"
                    );
                }
                assert_eq!(whole[0].0.len(), prompt.len() * vocab as usize);
            }
        }
    }

    #[test]
    fn prefill_chunk_setting() {
        assert_eq!(resolve_prefill_chunk(None), (PREFILL_CHUNK, None));
        assert_eq!(resolve_prefill_chunk(Some(" ")), (PREFILL_CHUNK, None));
        assert_eq!(resolve_prefill_chunk(Some(" 256 ")), (256, None));
        for bad in ["0", "-3", "lots", "1.5"] {
            let (n, warning) = resolve_prefill_chunk(Some(bad));
            assert_eq!(n, PREFILL_CHUNK);
            assert!(warning
                .unwrap()
                .contains(&format!("COLI_PREFILL_CHUNK={bad}:")));
        }
    }

    #[test]
    fn unedited_model_loads() {
        load_edited("ok", |_| {}).unwrap();
    }

    /// Found by fuzzing: offsets and record counts from a corrupt manifest overflowed (`offset +
    /// nbytes`, `first_record + count`, `records * record_size`) and misaligned f32 tensors
    /// panicked in the in-place `&[f32]` view at the first forward pass.
    #[test]
    fn corrupt_manifest_offsets_are_refused() {
        let e = err(load_edited("first", |m| {
            m["experts"]["layers"][0]["first_record"] = json!(u64::MAX)
        }));
        assert!(e.contains("truncated"), "{e}");
        let e = err(load_edited("offset", |m| {
            m["resident"]["tensors"]["embed"]["offset"] = json!(u64::MAX - 3)
        }));
        assert!(e.contains("embed") && e.contains("past the end"), "{e}");
        let e = err(load_edited("align", |m| {
            let off = m["resident"]["tensors"]["layers.0.q"]["offset"]
                .as_u64()
                .unwrap();
            m["resident"]["tensors"]["layers.0.q"]["offset"] = json!(off + 2);
        }));
        assert!(e.contains("layers.0.q") && e.contains("aligned"), "{e}");
        // Routers are viewed in place too (as f32), not copied.
        let e = err(load_edited("router", |m| {
            let tensors = m["resident"]["tensors"].as_object_mut().unwrap();
            let (_, t) = tensors
                .iter_mut()
                .find(|(name, _)| name.ends_with(".router"))
                .unwrap();
            t["offset"] = json!(t["offset"].as_u64().unwrap() + 2);
        }));
        assert!(e.contains(".router") && e.contains("aligned"), "{e}");
        let e = err(load_edited("shape", |m| {
            m["resident"]["tensors"]["norm"]["shape"] = json!([1u64 << 63, 4])
        }));
        assert!(e.contains("norm"), "{e}");
        let e = err(load_edited("record", |m| {
            let r = m["experts"]["record_size"].as_u64().unwrap();
            m["experts"]["record_size"] = json!(r + 4);
        }));
        assert!(e.contains("record size"), "{e}");
    }

    #[test]
    fn manifest_file_names_stay_inside_the_directory() {
        for (tag, ptr) in [
            ("res", "/resident/file"),
            ("exp", "/experts/file"),
            ("tok", "/tokenizer"),
        ] {
            let e = err(load_edited(tag, |m| {
                *m.pointer_mut(ptr).unwrap() = json!("../x.bin")
            }));
            assert!(e.contains("../x.bin"), "{e}");
        }
    }
}
