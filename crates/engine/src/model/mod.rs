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
use std::path::Path;

use memmap2::Mmap;

use crate::config::{FfnKind, ModelConfig, QkNorm};
use crate::error::{io_err, Error, Result};
use crate::format::*;
use crate::kv::KvCache;
use crate::linear::{for_each_chunk_mut, matmul_many, Acts, Job, Linear, WeightRef};
use crate::ops::{self, Rope};
use crate::pool::Pool;
use crate::quant::{self, Kernel};

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
        /// `[num_experts, hidden]`, f32.
        router: Vec<f32>,
        router_bias: Option<Vec<f32>>,
        first_record: usize,
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

pub struct Model {
    pub cfg: ModelConfig,
    pub manifest: Manifest,
    resident: Mmap,
    experts: Option<Mmap>,
    expert_layout: Option<ExpertLayout>,
    embed: Linear,
    lm_head: Linear,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: Rope,
    kernel: Kernel,
    pool: Pool,
}

fn map_file(path: &Path) -> Result<Mmap> {
    if std::env::var("COLI_LOAD").is_ok_and(|v| v == "mmap") {
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

/// A file named by the manifest: a plain name inside the model directory.
fn file_name(what: &str, name: &str) -> Result<()> {
    let p = Path::new(name);
    let plain = p.components().count() == 1
        && matches!(p.components().next(), Some(std::path::Component::Normal(_)));
    if !plain {
        return Err(fmt_err(format!(
            "manifest: {what} `{name}` is not a file name inside the model directory"
        )));
    }
    Ok(())
}

impl Model {
    /// Loads a converted model directory. `threads`: worker threads (default: all cores).
    pub fn load(dir: &Path, threads: Option<usize>) -> Result<Model> {
        let mpath = dir.join(MANIFEST);
        let text = fs::read_to_string(&mpath).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                fmt_err(format!(
                    "{} not found: not a colibri model directory (convert a Hugging Face \
                     checkpoint with `colibri convert`)",
                    mpath.display()
                ))
            } else {
                io_err(&mpath)(e)
            }
        })?;
        let manifest: Manifest = serde_json::from_str(&text)
            .map_err(|e| fmt_err(format!("{}: invalid manifest: {e}", mpath.display())))?;
        if manifest.format != FORMAT_NAME || manifest.version != FORMAT_VERSION {
            return Err(fmt_err(format!(
                "{}: format {} v{} is not supported (expected {FORMAT_NAME} v{FORMAT_VERSION}); \
                 convert the checkpoint again with `colibri convert`",
                mpath.display(),
                manifest.format,
                manifest.version
            )));
        }
        let cfg = ModelConfig::from_hf(&manifest.config)?;
        file_name("resident file", &manifest.resident.file)?;
        file_name("tokenizer", &manifest.tokenizer)?;
        if let Some(t) = &manifest.tokenizer_config {
            file_name("tokenizer config", t)?;
        }
        if let Some(x) = &manifest.experts {
            file_name("experts file", &x.file)?;
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
                    let router = t.vector(&n("router"), cfg.num_experts * h)?;
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
                    Ffn::Moe {
                        router,
                        router_bias,
                        first_record,
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

        let (experts, expert_layout) = match &manifest.experts {
            None => (None, None),
            Some(x) => {
                let map = map_file(&dir.join(&x.file))?;
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
                if need.is_none_or(|need| map.len() < need) {
                    return Err(fmt_err(format!(
                        "{} is {} bytes, smaller than its {} records of {} bytes (truncated?)",
                        x.file,
                        map.len(),
                        records.map_or("too many".to_string(), |r| r.to_string()),
                        x.record_size
                    )));
                }
                (
                    Some(map),
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
        let pool = Pool::new(threads.max(1))
            .map_err(|e| Error::Input(format!("cannot start worker threads: {e}")))?;
        Ok(Model {
            rope: Rope::new(cfg.rotary_dim, cfg.rope_theta),
            cfg,
            manifest,
            resident,
            experts,
            expert_layout,
            embed,
            lm_head,
            norm,
            layers,
            kernel: quant::kernel(),
            pool,
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

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    pub fn new_cache(&self) -> KvCache {
        KvCache::new(self.cfg.num_layers, self.cfg.kv_dim())
    }

    fn w(&self, l: &Linear) -> WeightRef<'_> {
        l.view(&self.resident)
    }

    fn expert(&self, record: usize, part: usize) -> WeightRef<'_> {
        let lay = self
            .expert_layout
            .as_ref()
            .expect("MoE layer implies experts");
        let p = &lay.parts[part];
        let lin = Linear {
            dtype: p.dtype,
            rows: p.shape[0],
            cols: p.shape[1],
            offset: record * lay.record_size + p.offset,
            nbytes: p.nbytes,
        };
        lin.view(self.experts.as_ref().expect("experts file mapped"))
    }

    /// Runs `tokens` at positions `kv.len ..` and appends them to `kv`. Returns logits for every
    /// token (`all_logits`) or only the last, `vocab_size` values per token.
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
        self.forward_inner(tokens, kv, all_logits)
    }

    fn forward_inner(
        &self,
        tokens: &[u32],
        kv: &mut KvCache,
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (n, h) = (tokens.len(), c.hidden_size);
        let mut x = vec![0.0f32; n * h];
        let embed = self.w(&self.embed);
        for (i, &tok) in tokens.iter().enumerate() {
            embed.row(tok as usize, h, &mut x[i * h..(i + 1) * h]);
        }
        for (li, layer) in self.layers.iter().enumerate() {
            let mut hn = x.clone();
            ops::rms_norm(&mut hn, &layer.attn_norm, c.rms_norm_eps);
            let att = self.attention(li, layer, hn, n, kv);
            for (a, b) in x.iter_mut().zip(&att) {
                *a += *b;
            }
            let mut hn = x.clone();
            ops::rms_norm(&mut hn, &layer.ffn_norm, c.rms_norm_eps);
            let mut acts = Acts::from_vec(hn, n, h);
            let y = match &layer.ffn {
                Ffn::Dense(m) => self.mlp(m, &mut acts),
                Ffn::Moe {
                    router,
                    router_bias,
                    first_record,
                    shared,
                } => {
                    let mut y = self.moe(&mut acts, router, router_bias.as_deref(), *first_record);
                    if let Some(m) = shared {
                        for (a, b) in y.iter_mut().zip(self.mlp(m, &mut acts)) {
                            *a += b;
                        }
                    }
                    y
                }
            };
            for (a, b) in x.iter_mut().zip(&y) {
                *a += *b;
            }
        }
        kv.len += n;

        let rows: Vec<f32> = if all_logits {
            x
        } else {
            x[(n - 1) * h..].to_vec()
        };
        let m = rows.len() / h;
        let mut hn = rows;
        ops::rms_norm(&mut hn, &self.norm, c.rms_norm_eps);
        let mut acts = Acts::from_vec(hn, m, h);
        Ok(self.project(&[self.lm_head], &mut acts).remove(0))
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
        n: usize,
        kv: &mut KvCache,
    ) -> Vec<f32> {
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
        if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
            // Full: qn spans all heads; PerHead: one head. rms_norm normalises each qn-sized run.
            ops::rms_norm(&mut q, qn, c.rms_norm_eps);
            ops::rms_norm(&mut k, kn, c.rms_norm_eps);
        }
        if let Some(clip) = c.clip_qkv {
            for t in [&mut q, &mut k, &mut v] {
                for x in t.iter_mut() {
                    *x = x.clamp(-clip, clip);
                }
            }
        }
        let p0 = kv.len;
        for i in 0..n {
            self.rope.apply(&mut q[i * qd..(i + 1) * qd], hd, p0 + i);
            self.rope.apply(&mut k[i * kvd..(i + 1) * kvd], hd, p0 + i);
        }
        kv.keys[li].extend_from_slice(&k);
        kv.values[li].extend_from_slice(&v);
        let (keys, values) = (&kv.keys[li], &kv.values[li]);
        let group = c.num_heads / c.num_kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let mut att = vec![0.0f32; n * qd];
        for_each_chunk_mut(&self.pool, &mut att, hd, |idx, out| {
            let (i, head) = (idx / c.num_heads, idx % c.num_heads);
            let qh = &q[i * qd + head * hd..i * qd + (head + 1) * hd];
            let args = ops::AttendArgs {
                keys,
                values,
                n: p0 + i + 1,
                kv_stride: kvd,
                kv_off: (head / group) * hd,
                scale,
            };
            let mut scores = vec![0.0f32; args.n];
            ops::attend(qh, &args, &mut scores, out);
        });
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

    fn mlp(&self, m: &Mlp, x: &mut Acts) -> Vec<f32> {
        let mut gu = self.project(&[m.gate, m.up], x);
        let up = gu.pop().unwrap();
        let mut g = gu.pop().unwrap();
        ops::silu_mul(&mut g, &up);
        let mut hidden = Acts::from_vec(g, x.n, m.gate.rows);
        self.project(&[m.down], &mut hidden).remove(0)
    }

    /// Routed experts for every token of `x`, weighted and summed (shared experts excluded).
    fn moe(
        &self,
        x: &mut Acts,
        router: &[f32],
        bias: Option<&[f32]>,
        first_record: usize,
    ) -> Vec<f32> {
        let c = &self.cfg;
        let (n, h, e) = (x.n, c.hidden_size, c.num_experts);
        let mut logits = vec![0.0f32; n * e];
        // The router is small but f32 (8 MB a token for OLMoE-1B-7B): split it across threads.
        debug_assert_eq!(router.len(), e * h);
        matmul_many(
            &self.pool,
            self.kernel,
            &mut [Job {
                w: WeightRef::F32(router),
                x,
                out: &mut logits,
            }],
        );
        // expert -> [(token, weight)], in expert order (the order the reference sums them).
        let mut by_expert: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
        for t in 0..n {
            for (ex, w) in routing::route(&c.routing, c.top_k, &logits[t * e..(t + 1) * e], bias) {
                by_expert.entry(ex).or_default().push((t, w));
            }
        }
        let experts: Vec<(usize, Vec<(usize, f32)>)> = by_expert.into_iter().collect();
        let q4 = self
            .expert_layout
            .as_ref()
            .is_some_and(|l| l.parts[0].dtype == DType::Q4);
        // Inputs per expert: the shared activations when every token goes there (decode).
        let inputs: Vec<Option<Acts>> = experts
            .iter()
            .map(|(_, toks)| {
                (toks.len() != n).then(|| {
                    let mut xs = Vec::with_capacity(toks.len() * h);
                    for &(t, _) in toks {
                        xs.extend_from_slice(&x.x[t * h..(t + 1) * h]);
                    }
                    let mut a = Acts::from_vec(xs, toks.len(), h);
                    a.prepare(q4);
                    a
                })
            })
            .collect();
        x.prepare(q4);
        let x = &*x;
        let mi = c.moe_intermediate_size;
        let mut gate_up: Vec<Vec<f32>> = experts
            .iter()
            .flat_map(|(_, t)| [vec![0.0; t.len() * mi], vec![0.0; t.len() * mi]])
            .collect();
        {
            let mut outs = gate_up.iter_mut();
            let mut jobs = Vec::with_capacity(2 * experts.len());
            for ((ex, _), inp) in experts.iter().zip(&inputs) {
                let rec = first_record + ex;
                let xin = inp.as_ref().unwrap_or(x);
                jobs.push(Job {
                    w: self.expert(rec, 0),
                    x: xin,
                    out: outs.next().unwrap(),
                });
                jobs.push(Job {
                    w: self.expert(rec, 1),
                    x: xin,
                    out: outs.next().unwrap(),
                });
            }
            matmul_many(&self.pool, self.kernel, &mut jobs);
        }
        let hidden: Vec<Acts> = gate_up
            .chunks_exact_mut(2)
            .zip(&experts)
            .map(|(gu, (_, toks))| {
                let (g, u) = gu.split_at_mut(1);
                ops::silu_mul(&mut g[0], &u[0]);
                let mut a = Acts::from_vec(std::mem::take(&mut g[0]), toks.len(), mi);
                a.prepare(q4);
                a
            })
            .collect();
        let mut downs: Vec<Vec<f32>> = experts
            .iter()
            .map(|(_, t)| vec![0.0; t.len() * h])
            .collect();
        {
            let mut jobs: Vec<Job> = experts
                .iter()
                .zip(&hidden)
                .zip(downs.iter_mut())
                .map(|(((ex, _), hid), out)| Job {
                    w: self.expert(first_record + ex, 2),
                    x: hid,
                    out,
                })
                .collect();
            matmul_many(&self.pool, self.kernel, &mut jobs);
        }
        let mut y = vec![0.0f32; n * h];
        for ((_, toks), d) in experts.iter().zip(&downs) {
            for (j, &(t, w)) in toks.iter().enumerate() {
                for (a, b) in y[t * h..(t + 1) * h].iter_mut().zip(&d[j * h..(j + 1) * h]) {
                    *a += w * *b;
                }
            }
        }
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    /// Converts the GLM fixture (f32) into a scratch directory, edits its manifest, loads it
    /// (and runs a forward pass if it loads), and removes the directory again.
    fn load_edited(tag: &str, edit: impl FnOnce(&mut Value)) -> Result<Model> {
        let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/glm4_moe/hf");
        let d = std::env::temp_dir().join(format!("colibri-load-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        crate::convert::convert(&hf, &d, Quant::F32, &mut |_, _, _| {}).unwrap();
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
