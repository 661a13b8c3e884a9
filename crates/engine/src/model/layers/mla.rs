//! Multi-head latent attention (DeepSeek-V3, as transformers' `DeepseekV3Attention` computes it).
//!
//! Per position: the query is `q_proj(x)` or, with `q_lora_rank`, `q_b_proj(rms(q_a_proj(x)))`,
//! split per head into `qk_nope_head_dim` plain dims and `qk_rope_head_dim` rotated dims.
//! `kv_a_proj_with_mqa(x)` gives the latent `c_kv` (`kv_lora_rank` wide, RMS-normed by
//! `kv_a_layernorm`) and one rope key shared by every head. transformers expands the latent with
//! `kv_b_proj` into each head's key (`k_nope`) and value, and attends with
//! `q_nope . k_nope + q_rope . k_rope`.
//!
//! Here the cache keeps only what each position gives: the normed latent and the roped key,
//! `kv_lora_rank + qk_rope_head_dim` floats per position and layer (one key run, no values:
//! [`kv_layout`]). Decode (and a short pass) attends in the absorbed form:
//! `q_nope . (W_uk c) = (W_uk^T q_nope) . c`, so each head's query becomes
//! `[W_uk^T q_nope | q_rope]` and attends over the cached rows `[c | k_rope]` with the shared
//! kernel; the values are the latents (the kernel is given the same rows as values and the
//! rope columns of its output are dropped), and `W_uv` maps the weighted latent to the head's
//! value after the softmax. `kv_b_proj` is stored as the two matrices these products read, at
//! the model's quantization: `W_uk^T` (each head's key rows transposed, `[heads * kv_lora_rank,
//! qk_nope_head_dim]`) and `W_uv` (`[heads * v_head_dim, kv_lora_rank]`), each head a row block
//! multiplied by that head's own input, unrounded (`Acts::exact`: the 8-bit rounding the other
//! products take would fall on different values in the two forms below; with
//! `COLI_MLA_EXPANDED=off`, every pass absorbed, the 8-bit inputs). With those unrounded
//! inputs, an int4 or 8-bit `W_uk^T` and `W_uv` are copied by columns ([`Columns`], the same
//! values) and their absorbed products read that copy: `W_uk^T q_nope` a sum of `W_uk`'s rows
//! scaled by `q_nope`, where a row-by-row product of `W_uk^T`'s short rows is bound by each
//! row's reduction; `W_uv lat` likewise, without permuting each head's input into the rows'
//! stored order. The copy exists while the expanded setting is on ([`Model::set_mla_expanded`]).
//! Directories converted before the split keep one f32 `kv_b` and are read as before.
//!
//! A prefill of many positions attends in the expanded form instead (unless
//! `COLI_MLA_EXPANDED=off`), where that is faster
//! (measured: [`expanded_pays`]): the history's latents are expanded into each head's keys
//! `[W_uk c | k_rope]` and values `W_uv c` (one product over every position, a block of heads at
//! a time), and each head attends with `[q_nope | q_rope]` over `qk_nope + qk_rope` wide keys
//! and `v_head_dim` wide values, where the absorbed form reads `kv_lora_rank + qk_rope` wide keys
//! and `kv_lora_rank` wide values per pair of positions (3.4x the arithmetic on DeepSeek-V3's
//! shape). `W_uk` itself is made per pass from `W_uk^T` as stored (transposed per head, f32),
//! so both forms multiply by the same weights, on unrounded inputs: they agree within f32
//! rounding (plain MLA only; DSA's sparse rows stay absorbed). Conversions made while a derived
//! `kv_b_uk` was stored beside `W_uk^T` still load; it is not read.
//!
//! A decode step (one new position per sequence) runs each head's chain — absorbed query,
//! attention, `W_uv` — in one parallel region, a run of heads per thread ([`decode`]).
//!
//! Kimi Linear's MLA has no positions ([`MlaDims::positional`] false): its rope dims are kept
//! (one shared key run per position, like the others) but never rotated.
//!
//! RoPE: with `rope_interleave` transformers reorders the rope dims `(0, 2, 4, .., 1, 3, ..)`
//! before its rotate-half rotation; the same reordering here, for q and k alike (a dot product
//! does not see a permutation applied to both sides).

mod decode;

use super::{row_f32, write_rows, Attention, SeqRows, Span};
use crate::config::{AttentionKind, HybridFull, MlaDims, ModelConfig};
use crate::error::Result;
use crate::format::DType;
use crate::kv::{KvCache, KvLayout, LayerKv};
use crate::linear::{for_each_chunk_mut, matmul_many, Acts, Job, Linear, WeightRef};
use crate::model::load::Tensors;
use crate::model::plan::{HeadRows, Plan};
use crate::model::{fmt_err, Model};
use crate::ops::{self, RopeAngles};
use crate::quant::{columns_exact_into, Columns, Kernel};

/// The epsilon of `q_a_layernorm` and `kv_a_layernorm`: transformers builds them with its
/// RMSNorm's default, not `rms_norm_eps`.
const LORA_NORM_EPS: f32 = 1e-6;

/// How the query is projected.
enum QueryProj {
    Full(Linear),
    LowRank {
        a: Linear,
        norm: Vec<f32>,
        b: Linear,
    },
}

/// How `kv_b_proj` is stored.
enum KvB {
    /// `W_uk^T` `[heads * kv_lora_rank, nope]` and `W_uv` `[heads * v, kv_lora_rank]`, at the
    /// model's quantization: one row block per head; `cols`, each head's blocks again by
    /// columns while the products' inputs are unrounded ([`Model::refresh_kv_b_columns`]).
    Split {
        uk_t: Linear,
        uv: Linear,
        cols: KvBColumns,
    },
    /// Directories converted before the split: `[heads * (nope + v), kv_lora_rank]` in f32, per
    /// head `nope` rows of `W_uk` then `v` rows of `W_uv`.
    Fused(Linear),
}

/// Each head's `W_uk^T` and `W_uv` by columns ([`Columns`]: the same values), which the
/// unrounded absorbed products read ([`columns_product`]); `None` for an f32 matrix, or while
/// the products' inputs are rounded to 8 bits (the expanded setting off), which read the rows.
#[derive(Default)]
pub(in crate::model) struct KvBColumns {
    uk: Option<Vec<Columns>>,
    uv: Option<Vec<Columns>>,
}

/// The bytes of every [`KvBColumns`] a model of `m` makes at load (none with the expanded
/// setting off), for a RAM budget: its config's heads, its `kv_b` tensors' shapes and formats.
pub fn kv_b_columns_bytes(m: &crate::format::Manifest) -> u64 {
    let heads = m.config.get("num_attention_heads").and_then(|v| v.as_u64());
    let Some(heads) = heads.filter(|&h| h > 0 && mla_expanded_from_env()) else {
        return 0;
    };
    let heads = heads as usize;
    m.resident
        .tensors
        .iter()
        .filter(|(name, _)| name.ends_with(".kv_b_uk_t") || name.ends_with(".kv_b_uv"))
        .filter_map(|(_, t)| {
            let q8 = match t.dtype {
                DType::Q4 => false,
                DType::Q8 => true,
                DType::F32 | DType::Q4T => return None,
            };
            let [rows, cols] = t.shape[..] else {
                return None;
            };
            Some((heads * Columns::bytes_of(rows / heads, cols, q8)) as u64)
        })
        .sum()
}

/// One layer's MLA weights.
pub(in crate::model) struct Mla {
    q: QueryProj,
    kv_a: Linear,
    kv_a_norm: Vec<f32>,
    kv_b: KvB,
    o: Linear,
}

pub(super) fn dims(c: &ModelConfig) -> MlaDims {
    match c.attention {
        AttentionKind::Mla(d)
        | AttentionKind::Dsa(d, _)
        | AttentionKind::Hybrid(_, HybridFull::Mla(d)) => d,
        _ => unreachable!("an MLA block of a non-MLA config"),
    }
}

/// What every layer keeps per position: one run of the normed latent and the roped key.
pub fn kv_layout(c: &ModelConfig) -> KvLayout {
    let d = dims(c);
    KvLayout {
        layers: vec![
            LayerKv::per_position(1, d.kv_lora_rank + d.qk_rope_head_dim, 0);
            c.num_layers
        ],
    }
}

/// The tensors of layer `i`'s MLA block.
pub fn plan(p: &mut Plan, c: &ModelConfig, i: usize) {
    let d = dims(c);
    let (h, heads) = (c.hidden_size, c.num_heads);
    let qk = d.qk_nope_head_dim + d.qk_rope_head_dim;
    let hf = |s: &str| format!("model.layers.{i}.self_attn.{s}");
    let n = |s: &str| format!("layers.{i}.{s}");
    match d.q_lora_rank {
        None => p.matrix(n("q"), hf("q_proj.weight"), heads * qk, h),
        Some(rank) => {
            p.matrix(n("q_a"), hf("q_a_proj.weight"), rank, h);
            p.vector(n("q_a_norm"), hf("q_a_layernorm.weight"), rank);
            p.matrix(n("q_b"), hf("q_b_proj.weight"), heads * qk, rank);
        }
    }
    p.matrix(
        n("kv_a"),
        hf("kv_a_proj_with_mqa.weight"),
        d.kv_lora_rank + d.qk_rope_head_dim,
        h,
    );
    p.vector(n("kv_a_norm"), hf("kv_a_layernorm.weight"), d.kv_lora_rank);
    let per_head = d.qk_nope_head_dim + d.v_head_dim;
    let uk = HeadRows {
        heads,
        per_head,
        skip: 0,
        take: d.qk_nope_head_dim,
        transpose: true,
    };
    p.head_rows_matrix(n("kv_b_uk_t"), hf("kv_b_proj.weight"), uk, d.kv_lora_rank);
    let uv = HeadRows {
        heads,
        per_head,
        skip: d.qk_nope_head_dim,
        take: d.v_head_dim,
        transpose: false,
    };
    p.head_rows_matrix(n("kv_b_uv"), hf("kv_b_proj.weight"), uv, d.kv_lora_rank);
    p.matrix(n("o"), hf("o_proj.weight"), h, heads * d.v_head_dim);
}

/// The fewest query positions of one sequence a pass attends in the expanded form. Measured on
/// the DeepSeek-V3 shape (2 threads, fresh prompts, docs/PERFORMANCE.md): prefill 1.10-1.14x
/// the absorbed form's speed at 16 positions, 1.18x at 64, 1.24-1.30x at 256, 1.37-1.49x at 512.
pub(in crate::model) const EXPAND_MIN_QUERIES: usize = 16;

/// Whether `n` queries after `p0` positions of history attend faster expanded. The forms differ
/// in two costs (per head, in multiply-adds): the expanded form widens every one of the
/// `p0 + n` latents it reads into keys and values (`(qk_nope + v) kv_lora_rank` each) where
/// the absorbed one absorbs each query and widens each weighted latent (the same count per
/// query), so it pays `p0 (qk_nope + v) kv_lora_rank` more; and it does `(qk_nope + qk_rope) +
/// v` per pair of (query, visible position) where the absorbed form does `2 kv_lora_rank +
/// qk_rope`. A fresh prompt (`p0 = 0`) always gains; a short step over a long history (a
/// prefix reused) only when its pairs' saving covers widening the history. Measured after 2,048
/// cached positions (DeepSeek-V3 shape, expanded forced against absorbed): 32 new positions
/// 0.58x, 64 0.84x, 128 1.02x, 256 1.47x; this count's break-even there is 171.
fn expanded_pays(d: &MlaDims, n: usize, p0: usize) -> bool {
    let (nope, rope, r, vd) = (
        d.qk_nope_head_dim,
        d.qk_rope_head_dim,
        d.kv_lora_rank,
        d.v_head_dim,
    );
    let saved_per_pair = (2 * r + rope).saturating_sub(nope + rope + vd) as f64;
    let pairs = n as f64 * p0 as f64 + (n * (n + 1) / 2) as f64;
    n >= EXPAND_MIN_QUERIES && pairs * saved_per_pair >= p0 as f64 * ((nope + vd) * r) as f64
}

/// `COLI_MLA_EXPANDED`: `on` (or `1`, or unset), the default, lets MLA prefill attend in the
/// expanded form where it pays (1.2-1.4x the absorbed prefill at 512-2k positions on a
/// 16-head DeepSeek-V3 shape, docs/PERFORMANCE.md), with `kv_b`'s products taking their inputs
/// unrounded (`Model::kv_b_input`) so that the forms agree within f32 rounding: a prompt's
/// logits depend on how it is cut into passes at that level only (a reused prefix or a
/// restarted slot continues with a cold run's tokens but for a near-tie at f32 rounding). The
/// unrounded products decode as fast as the 8-bit ones (`quant/exact_avx2.rs`). `off` (or `0`)
/// keeps the absorbed form for every pass and the 8-bit inputs: the same bits however a prompt
/// is cut. Any other value: the default, with a warning.
pub(crate) fn mla_expanded_from_env() -> bool {
    resolve_mla_expanded(crate::settings::mla_expanded().as_deref())
}

pub(in crate::model) fn resolve_mla_expanded(v: Option<&str>) -> bool {
    match v.map(str::trim) {
        None | Some("on" | "1" | "") => true,
        Some("off" | "0") => false,
        Some(other) => {
            eprintln!("COLI_MLA_EXPANDED={other:?} is not on/off: MLA prefill may expand (on)");
            true
        }
    }
}

/// The most bytes of expanded keys and values held at once (heads are expanded in blocks).
const EXPAND_BYTES: usize = 256 << 20;

impl Mla {
    /// Whether this layer can attend in the expanded form (`kv_b` split).
    fn expands(&self) -> bool {
        matches!(self.kv_b, KvB::Split { .. })
    }

    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Mla> {
        let d = dims(c);
        let (h, heads) = (c.hidden_size, c.num_heads);
        let qk = d.qk_nope_head_dim + d.qk_rope_head_dim;
        let n = |s: &str| format!("layers.{i}.{s}");
        let q = match d.q_lora_rank {
            None => QueryProj::Full(t.linear(&n("q"), heads * qk, h)?),
            Some(rank) => QueryProj::LowRank {
                a: t.linear(&n("q_a"), rank, h)?,
                norm: t.vector(&n("q_a_norm"), rank)?,
                b: t.linear(&n("q_b"), heads * qk, rank)?,
            },
        };
        let r = d.kv_lora_rank;
        let kv_b = if t.has(&n("kv_b")) {
            let fused = t.linear(&n("kv_b"), heads * (d.qk_nope_head_dim + d.v_head_dim), r)?;
            if fused.dtype != DType::F32 {
                return Err(fmt_err(format!("tensor `{}` should be f32", n("kv_b"))));
            }
            KvB::Fused(fused)
        } else {
            let uk_t = t.linear(&n("kv_b_uk_t"), heads * r, d.qk_nope_head_dim)?;
            let uv = t.linear(&n("kv_b_uv"), heads * d.v_head_dim, r)?;
            // Their unrounded and by-column products read the linear grid only (the
            // converter keeps them on it).
            for (name, w) in [("kv_b_uk_t", &uk_t), ("kv_b_uv", &uv)] {
                if w.dtype == DType::Q4T {
                    return Err(fmt_err(format!(
                        "tensor `{}` is stored on the table grid (q4t); MLA's kv_b must be \
                         f32, q8 or q4",
                        n(name)
                    )));
                }
            }
            KvB::Split {
                uk_t,
                uv,
                cols: KvBColumns::default(),
            }
        };
        Ok(Mla {
            q,
            kv_a: t.linear(&n("kv_a"), d.kv_lora_rank + d.qk_rope_head_dim, h)?,
            kv_a_norm: t.vector(&n("kv_a_norm"), d.kv_lora_rank)?,
            kv_b,
            o: t.linear(&n("o"), h, heads * d.v_head_dim)?,
        })
    }
}

/// One head's absorbed queries `W_uk^T q_nope` for `n` positions (`q_nope`: `n x nope`,
/// unrounded), its `W_uk^T` read by columns: `n x kv_lora_rank`.
/// A head's unrounded product by columns: `W x` for the `n` rows of `x`.
pub(super) fn columns_product(k: Kernel, cols: &Columns, x: &[f32], n: usize) -> Vec<f32> {
    let mut out = vec![0.0f32; n * cols.rows()];
    columns_exact_into(k, cols, x, n, &mut out);
    out
}

/// Reorders interleaved rope dims `(x0, x1, x2, x3, ..)` to `(x0, x2, .., x1, x3, ..)`, as
/// transformers' `apply_rotary_pos_emb_interleave` does before rotating.
pub(super) fn deinterleave(x: &mut [f32], tmp: &mut Vec<f32>) {
    let half = x.len() / 2;
    tmp.clear();
    tmp.extend_from_slice(x);
    for i in 0..half {
        x[i] = tmp[2 * i];
        x[half + i] = tmp[2 * i + 1];
    }
}

/// What the MLA projections of a pass give for its `n` positions.
pub(in crate::model) struct MlaPass {
    /// Per (position, head), position-major: the absorbed query `[W_uk^T q_nope | q_rope]`,
    /// `kv_lora_rank + qk_rope_head_dim` wide (empty for the positions not asked for).
    pub(in crate::model) absorbed: Vec<Vec<f32>>,
    /// Per (position, head), position-major: the query `[q_nope | q_rope]` (rope applied).
    q: Vec<f32>,
    /// The rows the cache keeps (normed latent, roped key), one per position.
    pub(in crate::model) latent: Vec<f32>,
    /// The normed low-rank query `q_a_layernorm(q_a_proj(x))`, when the query is low-rank
    /// (the DSA indexer's query input).
    pub(in crate::model) q_resid: Option<Acts>,
}

impl Model {
    /// The MLA output of layer `li` for the normed inputs `hn` (one row per position of the
    /// pass's sequences); writes each sequence's latents and rope keys to its cache.
    pub(in crate::model) fn mla_attention(
        &self,
        li: usize,
        layer: &Mla,
        hn: Vec<f32>,
        angles: &[RopeAngles],
        seqs: &mut [SeqRows],
    ) -> Vec<f32> {
        let n = angles.len();
        let d = dims(&self.cfg);
        let heads = self.cfg.num_heads;
        let kw = d.kv_lora_rank + d.qk_rope_head_dim;
        // Which sequences attend in the expanded form (the calibration's statistics are taken
        // on the absorbed form's products, the ones decode reads).
        let expand: Vec<bool> = seqs
            .iter()
            .map(|s| {
                self.mla_expanded
                    && layer.expands()
                    && expanded_pays(&d, s.rows.len(), s.kv.len)
                    && !self.calib.is_on()
            })
            .collect();
        // A decode step's absorbed sequences take each head's chain in one region
        // (`decode`), which forms the absorbed queries itself.
        let absorbed_rows = seqs.iter().zip(&expand).filter(|(_, &e)| !e);
        let by_heads = self.decodes_by_heads(layer, absorbed_rows.map(|(s, _)| s.rows.len()));
        let mut absorb_row = vec![!by_heads; n];
        for (s, &e) in seqs.iter().zip(&expand) {
            if e {
                absorb_row[s.rows.clone()].fill(false);
            }
        }
        let mut acts = Acts::from_vec(hn, n, self.cfg.hidden_size);
        let pass = self.mla_project(layer, &mut acts, angles, &|i| absorb_row[i]);
        let spans = write_rows(seqs, li, &pass.latent, kw, &[], 0);
        let kvs: Vec<&KvCache> = seqs.iter().map(|s| &*s.kv).collect();
        let mut att = vec![0.0f32; n * heads * d.v_head_dim];
        let absorbed: Vec<usize> = (0..spans.len()).filter(|&s| !expand[s]).collect();
        if by_heads {
            let sp: Vec<Span> = absorbed.iter().map(|&s| spans[s]).collect();
            let kv: Vec<&KvCache> = absorbed.iter().map(|&s| kvs[s]).collect();
            self.decode_heads(li, layer, &sp, &pass.q, &kv, &mut att);
        } else if !absorbed.is_empty() {
            let sp: Vec<Span> = absorbed.iter().map(|&s| spans[s]).collect();
            let kv: Vec<&KvCache> = absorbed.iter().map(|&s| kvs[s]).collect();
            let lats = self.attend_latents(li, &sp, n, &pass.absorbed, &kv);
            let rows: Vec<usize> = sp.iter().flat_map(|s| s.row0..s.row0 + s.n).collect();
            let values = self.latent_values(layer, &lats, &rows);
            let w = heads * d.v_head_dim;
            for (j, &row) in rows.iter().enumerate() {
                att[row * w..(row + 1) * w].copy_from_slice(&values[j * w..(j + 1) * w]);
            }
        }
        for (s, sp) in spans.iter().enumerate().filter(|&(s, _)| expand[s]) {
            self.attend_expanded(li, layer, *sp, &pass.q, kvs[s], &mut att);
        }
        let mut acts = Acts::from_vec(att, n, heads * d.v_head_dim);
        self.project(&[layer.o], &mut acts).remove(0)
    }

    /// The attention values (per row, every head's `v_head_dim`, into `att`) of span `sp`'s
    /// queries `q` over layer `li`'s history in `kv`, in the expanded form: the latents widened
    /// into each head's keys and values, a block of heads at a time.
    fn attend_expanded(
        &self,
        li: usize,
        layer: &Mla,
        sp: Span,
        q: &[f32],
        kv: &KvCache,
        att: &mut [f32],
    ) {
        let KvB::Split { uk_t, uv, .. } = &layer.kv_b else {
            unreachable!("only a layer with kv_b split expands")
        };
        let d = dims(&self.cfg);
        let heads = self.cfg.num_heads;
        let (nope, rope, r, vd) = (
            d.qk_nope_head_dim,
            d.qk_rope_head_dim,
            d.kv_lora_rank,
            d.v_head_dim,
        );
        let (qk, kw) = (nope + rope, r + rope);
        let len = sp.p0 + sp.n;
        // The history's latents (one product input per position) and rope keys.
        let (rows, _) = kv.head(li, 0, len);
        let mut lat = Vec::with_capacity(len * r);
        let mut k_rope = Vec::with_capacity(len * rope);
        let mut buf = vec![0.0f32; kw];
        for p in 0..len {
            let row = row_f32(&rows, p, kw, &mut buf);
            lat.extend_from_slice(&row[..r]);
            k_rope.extend_from_slice(&row[r..]);
        }
        // Both weights as f32 (below): the f32 kernel reads the latents unrounded.
        let lat = Acts::from_vec(lat, len, r);
        let block = (EXPAND_BYTES / (4 * len * (2 * qk + vd)).max(1)).clamp(1, heads);
        for h0 in (0..heads).step_by(block) {
            let hb = block.min(heads - h0);
            let wk = self.key_up_projection(uk_t, h0, hb);
            let wv = self.dequantized(&uv.row_block(h0 * vd, hb * vd));
            let mut k_nope = vec![0.0f32; len * hb * nope];
            let mut values = vec![0.0f32; len * hb * vd];
            let mut jobs = [
                Job {
                    w: WeightRef::F32(&wk),
                    x: &lat,
                    out: &mut k_nope,
                },
                Job {
                    w: WeightRef::F32(&wv),
                    x: &lat,
                    out: &mut values,
                },
            ];
            matmul_many(&self.pool, self.kernel, &mut jobs);
            // Head-major key rows `[k_nope | k_rope]` and value rows.
            let keys: Vec<Vec<f32>> = (0..hb)
                .map(|h| {
                    let mut k = Vec::with_capacity(len * qk);
                    for p in 0..len {
                        let at = (p * hb + h) * nope;
                        k.extend_from_slice(&k_nope[at..at + nope]);
                        k.extend_from_slice(&k_rope[p * rope..(p + 1) * rope]);
                    }
                    k
                })
                .collect();
            let vals: Vec<Vec<f32>> = (0..hb)
                .map(|h| {
                    let mut v = Vec::with_capacity(len * vd);
                    for p in 0..len {
                        let at = (p * hb + h) * vd;
                        v.extend_from_slice(&values[at..at + vd]);
                    }
                    v
                })
                .collect();
            let rows = sp.row0 + sp.n;
            let out = self.attend_causal(
                &[sp],
                rows,
                hb,
                1,
                vd,
                d.softmax_scale,
                |row, h| {
                    let at = (row * heads + h0 + h) * qk;
                    &q[at..at + qk]
                },
                |_, h, l| {
                    (
                        crate::attention::HeadRows::F32(&keys[h][..l * qk]),
                        crate::attention::HeadRows::F32(&vals[h][..l * vd]),
                    )
                },
            );
            for row in sp.row0..rows {
                let src = &out[row * hb * vd..(row + 1) * hb * vd];
                let at = (row * heads + h0) * vd;
                att[at..at + hb * vd].copy_from_slice(src);
            }
        }
    }

    /// `w`'s stored values as f32 (exact: an int4 or 8-bit value times an f16 scale), for a
    /// product over many positions, where the f32 kernel's tiles pay for the widening. (The
    /// expanded form's results depend on how a prompt is cut into passes in any case; the
    /// absorbed form's per-token products keep `Acts::exact`'s fixed order.)
    fn dequantized(&self, w: &Linear) -> Vec<f32> {
        let view = self.w(w);
        let mut out = vec![0.0f32; w.rows * w.cols];
        if w.cols > 0 {
            for_each_chunk_mut(&self.pool, &mut out, w.cols * 16, |i, rows| {
                for (j, row) in rows.chunks_exact_mut(w.cols).enumerate() {
                    view.row(i * 16 + j, w.cols, row);
                }
            });
        }
        out
    }

    /// `W_uk` of heads `h0..h0 + hb` (`[hb * qk_nope_head_dim, kv_lora_rank]`, f32): `W_uk^T`'s
    /// stored values (exact: an int4 or 8-bit value times an f16 scale) with each head's block
    /// transposed, so the expanded form multiplies by the very weights the absorbed form does.
    /// Made per pass (`hb * qk_nope * kv_lora_rank` values, a small part of a prefill that pays
    /// for expanding), not kept: at int4 `W_uk^T` is an eighth of its f32 size. `TILE` rows of
    /// `W_uk^T` at a time are widened, then written as `TILE`-long runs of each `W_uk` row
    /// (element by element, writes `kv_lora_rank` apart would each touch another cache line).
    fn key_up_projection(&self, uk_t: &Linear, h0: usize, hb: usize) -> Vec<f32> {
        const TILE: usize = 16;
        let d = dims(&self.cfg);
        let (nope, r) = (d.qk_nope_head_dim, d.kv_lora_rank);
        let view = self.w(&uk_t.row_block(h0 * r, hb * r));
        let mut uk = vec![0.0f32; hb * nope * r];
        if nope == 0 {
            return uk;
        }
        for_each_chunk_mut(&self.pool, &mut uk, nope * r, |h, block| {
            let mut rows = vec![0.0f32; TILE * nope];
            for j0 in (0..r).step_by(TILE) {
                let t = TILE.min(r - j0);
                for (k, row) in rows.chunks_exact_mut(nope).take(t).enumerate() {
                    view.row(h * r + j0 + k, nope, row);
                }
                for (i, out) in block.chunks_exact_mut(r).enumerate() {
                    for (k, o) in out[j0..j0 + t].iter_mut().enumerate() {
                        *o = rows[k * nope + i];
                    }
                }
            }
        });
        uk
    }

    /// Causal attention of the rows of `spans` (out of the pass's `rows`) over layer `li`'s
    /// latent history in `kvs` (one cache per span): the absorbed queries (per (row, head))
    /// against the one key run, which is every head's history and its own values (the latent
    /// part). Returns the weighted latents per (row, head), as [`Model::attend_causal`].
    pub(in crate::model) fn attend_latents(
        &self,
        li: usize,
        spans: &[Span],
        rows: usize,
        absorbed: &[Vec<f32>],
        kvs: &[&KvCache],
    ) -> Vec<f32> {
        let d = dims(&self.cfg);
        let heads = self.cfg.num_heads;
        self.attend_causal(
            spans,
            rows,
            heads,
            heads,
            d.kv_lora_rank + d.qk_rope_head_dim,
            d.softmax_scale,
            |i, head| absorbed[i * heads + head].as_slice(),
            |s, _, len| {
                let (rows, _) = kvs[s].head(li, 0, len);
                (rows, rows)
            },
        )
    }

    /// The queries and cache rows of the positions whose normed inputs are `acts` (one row per
    /// position, at the RoPE angles `angles`).
    pub(in crate::model) fn mla_project(
        &self,
        layer: &Mla,
        acts: &mut Acts,
        angles: &[RopeAngles],
        absorb: &dyn Fn(usize) -> bool,
    ) -> MlaPass {
        let n = angles.len();
        let c = &self.cfg;
        let d = dims(c);
        let heads = c.num_heads;
        let (nope, rope, r) = (d.qk_nope_head_dim, d.qk_rope_head_dim, d.kv_lora_rank);
        let qk = nope + rope;
        let kw = r + rope;
        let (mut q, mut latent, q_resid) = match &layer.q {
            QueryProj::Full(w) => {
                let mut out = self.project(&[*w, layer.kv_a], acts);
                let kva = out.pop().unwrap();
                (out.pop().unwrap(), kva, None)
            }
            QueryProj::LowRank { a, norm, b } => {
                let mut out = self.project(&[*a, layer.kv_a], acts);
                let kva = out.pop().unwrap();
                let mut qa = out.pop().unwrap();
                self.per_position(&mut qa, a.rows, |_, row| {
                    ops::rms_norm(row, norm, LORA_NORM_EPS)
                });
                let mut qa = Acts::from_vec(qa, n, a.rows);
                let q = self.project(&[*b], &mut qa).remove(0);
                (q, kva, Some(qa))
            }
        };
        // The latent is normed, the rope key rotated; both go to the cache as one row.
        self.per_position(&mut latent, kw, |i, row| {
            let (lat, kr) = row.split_at_mut(r);
            ops::rms_norm(lat, &layer.kv_a_norm, LORA_NORM_EPS);
            if d.positional {
                if d.rope_interleave {
                    deinterleave(kr, &mut Vec::with_capacity(rope));
                }
                self.rope.apply_angles(kr, rope, &angles[i]);
            }
        });
        // Each head's rope query rotated in place (unless the model has no positions).
        if d.positional {
            self.per_position(&mut q, heads * qk, |i, row| {
                let mut tmp = Vec::with_capacity(rope);
                for head in row.chunks_exact_mut(qk) {
                    let qr = &mut head[nope..];
                    if d.rope_interleave {
                        deinterleave(qr, &mut tmp);
                    }
                    self.rope.apply_angles(qr, rope, &angles[i]);
                }
            });
        }
        // Absorbed queries, per (position, head): [W_uk^T q_nope | q_rope], `kw` wide, for
        // the positions asked for.
        let absorbed = match &layer.kv_b {
            KvB::Split { uk_t, cols, .. } => {
                let rows: Vec<usize> = (0..n).filter(|&i| absorb(i)).collect();
                let mut absorbed = vec![Vec::new(); n * heads];
                if !rows.is_empty() {
                    let picked: Vec<f32> = rows
                        .iter()
                        .flat_map(|&i| &q[i * heads * qk..(i + 1) * heads * qk])
                        .copied()
                        .collect();
                    let q_nope = self.per_head_inputs(&picked, rows.len(), qk, 0, nope);
                    let uk_q = match self.by_columns(&cols.uk) {
                        Some(cols) => self.pool.map(heads, |h| {
                            columns_product(self.kernel, &cols[h], &q_nope[h].x, rows.len())
                        }),
                        None => self.per_head_products(uk_t, r, q_nope),
                    };
                    for (j, &i) in rows.iter().enumerate() {
                        for head in 0..heads {
                            let mut out = Vec::with_capacity(kw);
                            out.extend_from_slice(&uk_q[head][j * r..(j + 1) * r]);
                            let qh = &q[(i * heads + head) * qk..(i * heads + head + 1) * qk];
                            out.extend_from_slice(&qh[nope..]);
                            absorbed[i * heads + head] = out;
                        }
                    }
                }
                absorbed
            }
            KvB::Fused(kv_b) => self.absorb_fused(kv_b, &q, n),
        };
        MlaPass {
            absorbed,
            q,
            latent,
            q_resid,
        }
    }

    /// The attention output from each (position, head)'s weighted latents `lats` (position-major,
    /// `kv_lora_rank + qk_rope_head_dim` apart; the rope columns are ignored): `W_uv`, then
    /// `o_proj`.
    pub(in crate::model) fn mla_output(&self, layer: &Mla, lats: &[f32]) -> Vec<f32> {
        let d = dims(&self.cfg);
        let heads = self.cfg.num_heads;
        let n = lats.len() / ((d.kv_lora_rank + d.qk_rope_head_dim) * heads);
        let rows: Vec<usize> = (0..n).collect();
        let att = self.latent_values(layer, lats, &rows);
        let mut acts = Acts::from_vec(att, n, heads * d.v_head_dim);
        self.project(&[layer.o], &mut acts).remove(0)
    }

    /// Every head's value `W_uv lat` for the pass rows `rows` of the weighted latents `lats`
    /// (per (row, head), position-major, `kv_lora_rank + qk_rope_head_dim` apart; the rope
    /// columns are ignored): per listed row, `heads * v_head_dim` values.
    fn latent_values(&self, layer: &Mla, lats: &[f32], rows: &[usize]) -> Vec<f32> {
        let d = dims(&self.cfg);
        let heads = self.cfg.num_heads;
        let (vd, r) = (d.v_head_dim, d.kv_lora_rank);
        let kw = r + d.qk_rope_head_dim;
        let picked: Vec<f32> = if rows.len() * kw * heads == lats.len() {
            lats.to_vec()
        } else {
            rows.iter()
                .flat_map(|&i| &lats[i * heads * kw..(i + 1) * heads * kw])
                .copied()
                .collect()
        };
        let n = rows.len();
        match &layer.kv_b {
            KvB::Split { uv, cols, .. } => {
                let lat = self.per_head_inputs(&picked, n, kw, 0, r);
                let values = match self.by_columns(&cols.uv) {
                    Some(cols) => self.pool.map(heads, |h| {
                        columns_product(self.kernel, &cols[h], &lat[h].x, n)
                    }),
                    None => self.per_head_products(uv, vd, lat),
                };
                let mut att = Vec::with_capacity(n * heads * vd);
                for i in 0..n {
                    for v in &values {
                        att.extend_from_slice(&v[i * vd..(i + 1) * vd]);
                    }
                }
                att
            }
            KvB::Fused(kv_b) => self.values_fused(kv_b, &picked, n),
        }
    }
    /// Per head, the `width` values at `offset` of each position's record for that head, as one
    /// product input (`n` rows): `x` holds `stride`-wide records per (position, head),
    /// position-major.
    fn per_head_inputs(
        &self,
        x: &[f32],
        n: usize,
        stride: usize,
        offset: usize,
        width: usize,
    ) -> Vec<Acts> {
        let heads = self.cfg.num_heads;
        (0..heads)
            .map(|head| {
                let mut rows = Vec::with_capacity(n * width);
                for i in 0..n {
                    let at = (i * heads + head) * stride + offset;
                    rows.extend_from_slice(&x[at..at + width]);
                }
                self.kv_b_input(rows, n, width)
            })
            .collect()
    }

    /// A `kv_b` matrix's heads by columns where its products read them: the copy exists
    /// (inputs unrounded, [`Model::kv_b_input`], and the matrix quantized), and statistics are
    /// not being collected (they are taken on the row products' inputs).
    pub(in crate::model) fn by_columns<'a>(
        &self,
        cols: &'a Option<Vec<Columns>>,
    ) -> Option<&'a [Columns]> {
        cols.as_deref().filter(|_| !self.calib.is_on())
    }

    /// The bytes of every layer's [`KvBColumns`], by format (int4, 8-bit).
    pub(in crate::model) fn kv_b_columns_held(&self) -> (usize, usize) {
        let mut held = (0, 0);
        for layer in &self.layers {
            let mla = match &layer.attention {
                Attention::Mla(m) => m,
                Attention::Dsa(d) => d.mla(),
                _ => continue,
            };
            let KvB::Split { uk_t, uv, cols } = &mla.kv_b else {
                continue;
            };
            for (w, c) in [(uk_t, &cols.uk), (uv, &cols.uv)] {
                let bytes: usize = c.iter().flatten().map(Columns::bytes).sum();
                match w.dtype {
                    DType::Q8 => held.1 += bytes,
                    _ => held.0 += bytes,
                }
            }
        }
        held
    }

    /// Makes (the expanded setting on: unrounded `kv_b` inputs) or drops (off) every MLA
    /// layer's [`KvBColumns`], so the copy's RAM is spent only where it is read.
    pub(in crate::model) fn refresh_kv_b_columns(&mut self) {
        let heads = self.cfg.num_heads;
        let (on, pool, resident) = (self.mla_expanded, &self.pool, &self.resident);
        for layer in &mut self.layers {
            let mla = match &mut layer.attention {
                Attention::Mla(m) => m,
                Attention::Dsa(d) => d.mla_mut(),
                _ => continue,
            };
            let KvB::Split { uk_t, uv, cols } = &mut mla.kv_b else {
                continue;
            };
            let by_heads = |w: &Linear| {
                let rows = w.rows / heads;
                let heads = pool.map(heads, |h| {
                    Columns::new(&w.row_block(h * rows, rows).view(resident))
                });
                heads.into_iter().collect::<Option<Vec<_>>>()
            };
            *cols = if on {
                KvBColumns {
                    uk: by_heads(uk_t),
                    uv: by_heads(uv),
                }
            } else {
                KvBColumns::default()
            };
        }
    }

    /// A product input of `kv_b` (`W_uk^T` or `W_uv`): unrounded where the prefill may take
    /// the expanded form, so the two forms agree within f32 rounding; with it off (every pass
    /// absorbed, the same bits however a prompt is cut) the 8-bit activations the other
    /// products take.
    pub(in crate::model) fn kv_b_input(&self, x: Vec<f32>, n: usize, cols: usize) -> Acts {
        if self.mla_expanded {
            Acts::exact(x, n, cols)
        } else {
            Acts::from_vec(x, n, cols)
        }
    }

    /// Head `h`'s row block of `w` (`rows` rows each) times `inputs[h]`, every head in one
    /// parallel region; per head `n x rows` values, position-major.
    pub(in crate::model) fn per_head_products(
        &self,
        w: &Linear,
        rows: usize,
        mut inputs: Vec<Acts>,
    ) -> Vec<Vec<f32>> {
        for x in &mut inputs {
            x.prepare(w.dtype.takes_q8_acts());
        }
        let mut outs: Vec<Vec<f32>> = inputs.iter().map(|x| vec![0.0; x.n * rows]).collect();
        let mut jobs: Vec<Job> = inputs
            .iter()
            .zip(outs.iter_mut())
            .enumerate()
            .map(|(head, (x, out))| {
                let block = w.row_block(head * rows, rows);
                self.calib.resident(block.offset, rows, &x.x, x.cols);
                Job {
                    w: self.w(&block),
                    x,
                    out,
                }
            })
            .collect();
        matmul_many(&self.pool, self.kernel, &mut jobs);
        outs
    }

    /// The absorbed queries from a fused f32 `kv_b` (directories converted before the split).
    fn absorb_fused(&self, kv_b: &Linear, q: &[f32], n: usize) -> Vec<Vec<f32>> {
        let d = dims(&self.cfg);
        let heads = self.cfg.num_heads;
        let (nope, r) = (d.qk_nope_head_dim, d.kv_lora_rank);
        let (qk, kw) = (nope + d.qk_rope_head_dim, r + d.qk_rope_head_dim);
        let WeightRef::F32(kv_b) = self.w(kv_b) else {
            unreachable!("a fused kv_b is f32 (checked at load)")
        };
        let per_head = (nope + d.v_head_dim) * r;
        self.pool.map(n * heads, |t| {
            let (i, head) = (t / heads, t % heads);
            let qh = &q[i * heads * qk + head * qk..i * heads * qk + (head + 1) * qk];
            let w_uk = &kv_b[head * per_head..head * per_head + nope * r];
            let mut out = vec![0.0f32; kw];
            let (qa, qr) = out.split_at_mut(r);
            for (x, row) in qh[..nope].iter().zip(w_uk.chunks_exact(r)) {
                for (o, w) in qa.iter_mut().zip(row) {
                    *o += x * w;
                }
            }
            qr.copy_from_slice(&qh[nope..]);
            out
        })
    }

    /// Each head's value from its weighted latent with a fused f32 `kv_b`, position-major.
    fn values_fused(&self, kv_b: &Linear, lats: &[f32], n: usize) -> Vec<f32> {
        let d = dims(&self.cfg);
        let heads = self.cfg.num_heads;
        let (nope, r) = (d.qk_nope_head_dim, d.kv_lora_rank);
        let kw = r + d.qk_rope_head_dim;
        let WeightRef::F32(kv_b) = self.w(kv_b) else {
            unreachable!("a fused kv_b is f32 (checked at load)")
        };
        let per_head = (nope + d.v_head_dim) * r;
        let outs = self.pool.map(n * heads, |t| {
            let head = t % heads;
            let lat = &lats[t * kw..t * kw + r];
            let w_uv = &kv_b[head * per_head + nope * r..(head + 1) * per_head];
            w_uv.chunks_exact(r)
                .map(|row| ops::dot(row, lat))
                .collect::<Vec<f32>>()
        });
        outs.concat()
    }
}
