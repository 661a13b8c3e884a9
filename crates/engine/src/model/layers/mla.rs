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
//! [`kv_layout`]). Attention is computed in the absorbed form, for decode and (the simplest
//! correct form, for now; not yet measured against expanding the keys) for prefill alike:
//! `q_nope . (W_uk c) = (W_uk^T q_nope) . c`, so each head's query becomes
//! `[W_uk^T q_nope | q_rope]` and attends over the cached rows `[c | k_rope]` with the shared
//! kernel; the values are the latents (the kernel is given the same rows as values and the
//! rope columns of its output are dropped), and `W_uv` maps the weighted latent to the head's
//! value after the softmax. `kv_b_proj` is stored as the two matrices these products read, at
//! the model's quantization: `W_uk^T` (each head's key rows transposed, `[heads * kv_lora_rank,
//! qk_nope_head_dim]`) and `W_uv` (`[heads * v_head_dim, kv_lora_rank]`), each head a row block
//! multiplied by that head's own input. Directories converted before the split keep one f32
//! `kv_b` and are read as before.
//!
//! Kimi Linear's MLA has no positions ([`MlaDims::positional`] false): its rope dims are kept
//! (one shared key run per position, like the others) but never rotated.
//!
//! RoPE: with `rope_interleave` transformers reorders the rope dims `(0, 2, 4, .., 1, 3, ..)`
//! before its rotate-half rotation; the same reordering here, for q and k alike (a dot product
//! does not see a permutation applied to both sides).

use super::{write_rows, SeqRows, Span};
use crate::config::{AttentionKind, HybridFull, MlaDims, ModelConfig};
use crate::error::Result;
use crate::format::DType;
use crate::kv::{KvCache, KvLayout, LayerKv};
use crate::linear::{matmul_many, Acts, Job, Linear, WeightRef};
use crate::model::load::Tensors;
use crate::model::plan::{HeadRows, Plan};
use crate::model::{fmt_err, Model};
use crate::ops::{self, RopeAngles};

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
    /// model's quantization: one row block per head.
    Split { uk_t: Linear, uv: Linear },
    /// Directories converted before the split: `[heads * (nope + v), kv_lora_rank]` in f32, per
    /// head `nope` rows of `W_uk` then `v` rows of `W_uv`.
    Fused(Linear),
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

impl Mla {
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
            KvB::Split {
                uk_t: t.linear(&n("kv_b_uk_t"), heads * r, d.qk_nope_head_dim)?,
                uv: t.linear(&n("kv_b_uv"), heads * d.v_head_dim, r)?,
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
    /// `kv_lora_rank + qk_rope_head_dim` wide.
    pub(in crate::model) absorbed: Vec<Vec<f32>>,
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
        let kw = d.kv_lora_rank + d.qk_rope_head_dim;
        let mut acts = Acts::from_vec(hn, n, self.cfg.hidden_size);
        let pass = self.mla_project(layer, &mut acts, angles);
        let spans = write_rows(seqs, li, &pass.latent, kw, &[], 0);
        let kvs: Vec<&KvCache> = seqs.iter().map(|s| &*s.kv).collect();
        let lats = self.attend_latents(li, &spans, n, &pass.absorbed, &kvs);
        self.mla_output(layer, &lats)
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
        // Absorbed queries, per (position, head): [W_uk^T q_nope | q_rope], `kw` wide.
        let absorbed = match &layer.kv_b {
            KvB::Split { uk_t, .. } => {
                let q_nope = self.per_head_inputs(&q, n, qk, 0, nope);
                let uk_q = self.per_head_products(uk_t, r, q_nope);
                (0..n * heads)
                    .map(|t| {
                        let (i, head) = (t / heads, t % heads);
                        let mut out = Vec::with_capacity(kw);
                        out.extend_from_slice(&uk_q[head][i * r..(i + 1) * r]);
                        let qh = &q[(i * heads + head) * qk..(i * heads + head + 1) * qk];
                        out.extend_from_slice(&qh[nope..]);
                        out
                    })
                    .collect()
            }
            KvB::Fused(kv_b) => self.absorb_fused(kv_b, &q, n),
        };
        MlaPass {
            absorbed,
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
        let (vd, r) = (d.v_head_dim, d.kv_lora_rank);
        let kw = r + d.qk_rope_head_dim;
        let n = lats.len() / (kw * heads);
        let att = match &layer.kv_b {
            KvB::Split { uv, .. } => {
                let lat = self.per_head_inputs(lats, n, kw, 0, r);
                let values = self.per_head_products(uv, vd, lat);
                let mut att = Vec::with_capacity(n * heads * vd);
                for i in 0..n {
                    for v in &values {
                        att.extend_from_slice(&v[i * vd..(i + 1) * vd]);
                    }
                }
                att
            }
            KvB::Fused(kv_b) => self.values_fused(kv_b, lats, n),
        };
        let mut acts = Acts::from_vec(att, n, heads * vd);
        self.project(&[layer.o], &mut acts).remove(0)
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
                Acts::from_vec(rows, n, width)
            })
            .collect()
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
