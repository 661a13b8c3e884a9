//! DeepSeek sparse attention (GLM-5, as transformers' `GlmMoeDsaAttention` and
//! `GlmMoeDsaIndexer` compute it): multi-head latent attention (`mla.rs`) whose queries attend
//! only over the positions a lightning indexer selects.
//!
//! The indexer, per position: a key `k = rope(LayerNorm(wk x))` (`index_head_dim` wide, one per
//! position, the leading `qk_rope_head_dim` dims rotated with the model's rope: on interleaved
//! pairs for GLM-5, on the two halves for DeepSeek-V3.2),
//! queries `q_h = rope(wq_b q_resid)` for its `index_n_heads` heads (`q_resid` is the MLA's
//! normed low-rank query), and head weights `w = weights_proj(x) / sqrt(index_n_heads)`
//! (`weights_proj` kept in f32). A query at position `p` scores every position `t <= p` with
//! `sum_h w_h relu(q_h . k_t / sqrt(index_head_dim))` and attends over the `index_topk` best
//! ([`super::topk`]); with `p + 1 <= index_topk` that is every position, the plain causal MLA.
//!
//! Ties: scores tied exactly at the cut are common (relu zeroes a position whose every head
//! product is negative). torch's CPU `topk` leaves the choice among them to its selection
//! algorithm over the whole row it is given, masked future positions included, so transformers'
//! pick depends on how many positions the call holds (`scripts/dsa_tie_check.py`: with one
//! indexer head, 13 of 33 queries pick differently in a one-shot forward and in a cached
//! decode of the same tokens). Here ties go to the earlier position in every pass alike; the
//! fixtures are seeded so that no query has a tie, or a gap under 1e-4, at its cut.
//!
//! A `"shared"` layer (`ModelConfig::indexer_layers`) has no indexer: its queries attend over
//! the positions the last layer with one picked for them ([`Selection`], carried through the
//! pass).
//!
//! The cache keeps, per position and layer, the MLA row (normed latent and rope key) as the
//! layer's key run and, in a layer with an indexer, the indexer's key as its second run
//! ([`kv_layout`]), so decoding and slot files see the indexer keys of the whole history.

use super::mla::{self, Mla};
use super::topk;
use super::{row_f32, write_rows, SeqRows, Span};
use crate::attention::{AttendArgs, HeadRows};
use crate::config::{AttentionKind, IndexerDims, ModelConfig};
use crate::error::Result;
use crate::format::DType;
use crate::kv::{KvCache, KvLayout, LayerKv};
use crate::linear::{Acts, Linear};
use crate::model::load::Tensors;
use crate::model::plan::Plan;
use crate::model::{fmt_err, Model};
use crate::ops::{self, RopeAngles};

/// The epsilon of the indexer's key LayerNorm (transformers fixes it, not `rms_norm_eps`).
const K_NORM_EPS: f32 = 1e-6;

/// One layer's indexer weights.
pub(in crate::model) struct Indexer {
    wq_b: Linear,
    wk: Linear,
    k_norm: Vec<f32>,
    k_norm_bias: Vec<f32>,
    /// `[index_n_heads, hidden]`, f32.
    weights: Linear,
}

/// One layer's DSA block: the MLA weights and the indexer's (none in a shared layer).
pub(in crate::model) struct Dsa {
    mla: Mla,
    indexer: Option<Indexer>,
}

/// The positions the queries of one pass attend over, as the last layer with an indexer chose
/// them: the first `dense` queries over their whole history, each later one over `chosen`.
pub(in crate::model) struct Selection {
    dense: usize,
    chosen: Vec<Vec<usize>>,
}

/// Whether layer `i` runs its own indexer.
fn has_indexer(c: &ModelConfig, i: usize) -> bool {
    c.indexer_layers.get(i).copied().unwrap_or(true)
}

fn indexer_dims(c: &ModelConfig) -> IndexerDims {
    match c.attention {
        AttentionKind::Dsa(_, x) => x,
        _ => unreachable!("a DSA block of a non-DSA config"),
    }
}

/// What every layer keeps per position: the MLA row (normed latent and rope key) as its key run
/// and, with an indexer, the indexer key as its second run (`value_dim`; MLA has no values of
/// its own).
pub fn kv_layout(c: &ModelConfig) -> KvLayout {
    let d = mla::dims(c);
    let x = indexer_dims(c);
    KvLayout {
        layers: (0..c.num_layers)
            .map(|i| {
                let indexer = if has_indexer(c, i) { x.head_dim } else { 0 };
                LayerKv::per_position(1, d.kv_lora_rank + d.qk_rope_head_dim, indexer)
            })
            .collect(),
    }
}

/// The tensors of layer `i`'s DSA block: the MLA's and the indexer's.
pub fn plan(p: &mut Plan, c: &ModelConfig, i: usize) {
    mla::plan(p, c, i);
    if !has_indexer(c, i) {
        return;
    }
    let x = indexer_dims(c);
    let rank = mla::dims(c).q_lora_rank.expect("DSA has a low-rank query");
    let hf = |s: &str| format!("model.layers.{i}.self_attn.indexer.{s}");
    let n = |s: &str| format!("layers.{i}.indexer.{s}");
    p.matrix(n("wq_b"), hf("wq_b.weight"), x.heads * x.head_dim, rank);
    p.matrix(n("wk"), hf("wk.weight"), x.head_dim, c.hidden_size);
    p.vector(n("k_norm"), hf("k_norm.weight"), x.head_dim);
    p.vector(n("k_norm_bias"), hf("k_norm.bias"), x.head_dim);
    p.f32_matrix(
        n("weights"),
        hf("weights_proj.weight"),
        x.heads,
        c.hidden_size,
    );
}

impl Dsa {
    /// The layer's MLA weights.
    pub(in crate::model) fn mla(&self) -> &Mla {
        &self.mla
    }

    /// The layer's MLA weights, to change.
    pub(in crate::model) fn mla_mut(&mut self) -> &mut Mla {
        &mut self.mla
    }

    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Dsa> {
        let mla = Mla::load(t, c, i)?;
        if !has_indexer(c, i) {
            return Ok(Dsa { mla, indexer: None });
        }
        let x = indexer_dims(c);
        let rank = mla::dims(c).q_lora_rank.expect("DSA has a low-rank query");
        let n = |s: &str| format!("layers.{i}.indexer.{s}");
        let weights = t.linear(&n("weights"), x.heads, c.hidden_size)?;
        if weights.dtype != DType::F32 {
            return Err(fmt_err(format!("tensor `{}` should be f32", n("weights"))));
        }
        Ok(Dsa {
            mla,
            indexer: Some(Indexer {
                wq_b: t.linear(&n("wq_b"), x.heads * x.head_dim, rank)?,
                wk: t.linear(&n("wk"), x.head_dim, c.hidden_size)?,
                k_norm: t.vector(&n("k_norm"), x.head_dim)?,
                k_norm_bias: t.vector(&n("k_norm_bias"), x.head_dim)?,
                weights,
            }),
        })
    }
}

impl Model {
    /// The DSA output of layer `li` for the normed inputs `hn` (one row per position of the
    /// pass's sequences); writes each sequence's MLA rows and indexer keys to its cache. A layer
    /// with an indexer leaves each sequence's choice in `selection`; a shared layer attends over
    /// the ones there.
    pub(in crate::model) fn dsa_attention(
        &self,
        li: usize,
        layer: &Dsa,
        hn: Vec<f32>,
        angles: &[RopeAngles],
        seqs: &mut [SeqRows],
        selection: &mut [Option<Selection>],
    ) -> Vec<f32> {
        let n = angles.len();
        let c = &self.cfg;
        let d = mla::dims(c);
        let heads = c.num_heads;
        let kw = d.kv_lora_rank + d.qk_rope_head_dim;
        let mut acts = Acts::from_vec(hn, n, c.hidden_size);
        let mut pass = self.mla_project(&layer.mla, &mut acts, angles, &|_| true);
        let spans = if let Some(ix) = &layer.indexer {
            let q_resid = pass.q_resid.take().expect("DSA has a low-rank query");
            let (spans, chosen) = self.index(li, ix, acts, q_resid, angles, &pass.latent, seqs);
            for (slot, sel) in selection.iter_mut().zip(chosen) {
                *slot = Some(sel);
            }
            spans
        } else {
            write_rows(seqs, li, &pass.latent, kw, &[], 0)
        };
        let sels: Vec<&Selection> = selection
            .iter()
            .map(|s| {
                s.as_ref()
                    .expect("layer 0 has an indexer (checked with the config)")
            })
            .collect();
        let kvs: Vec<&KvCache> = seqs.iter().map(|s| &*s.kv).collect();
        let absorbed = &pass.absorbed;
        // Each sequence's first positions attend over their whole history.
        let dense: Vec<Span> = spans
            .iter()
            .zip(&sels)
            .map(|(sp, sel)| Span {
                n: sel.dense,
                ..*sp
            })
            .collect();
        let mut lats = self.attend_latents(li, &dense, n, absorbed, &kvs);
        // The others attend over their chosen latent rows.
        let tasks: Vec<(usize, usize)> = sels
            .iter()
            .enumerate()
            .flat_map(|(s, sel)| (0..sel.chosen.len()).map(move |j| (s, j)))
            .collect();
        let sparse = self.pool.map(tasks.len(), |t| {
            let (s, j) = tasks[t];
            let (sp, sel) = (spans[s], sels[s]);
            let i = sel.dense + j;
            let row = sp.row0 + i;
            let chosen = &sel.chosen[j];
            let (latents, _) = kvs[s].head(li, 0, sp.p0 + i + 1);
            let mut buf = vec![0.0f32; kw];
            let mut rows = Vec::with_capacity(chosen.len() * kw);
            for &t in chosen {
                rows.extend_from_slice(row_f32(&latents, t, kw, &mut buf));
            }
            let args = AttendArgs {
                keys: HeadRows::F32(&rows),
                values: HeadRows::F32(&rows),
                n0: chosen.len(),
                share: heads,
                scale: d.softmax_scale,
            };
            // Every head over the same chosen rows: one call reads them once for all heads.
            let qs: Vec<&[f32]> = (0..heads)
                .map(|head| absorbed[row * heads + head].as_slice())
                .collect();
            let mut out = vec![0.0f32; heads * kw];
            crate::attention::attend(&qs, &args, &mut out);
            out
        });
        for (&(s, j), o) in tasks.iter().zip(&sparse) {
            let row = spans[s].row0 + sels[s].dense + j;
            lats[row * heads * kw..(row + 1) * heads * kw].copy_from_slice(o);
        }
        self.mla_output(&layer.mla, &lats)
    }

    /// Layer `li`'s indexer over the pass: writes each sequence's MLA rows `latent` and indexer
    /// keys to its cache, and returns each sequence's [`Span`] and the positions each of its
    /// queries attends over. `acts` are the normed inputs, `q_resid` the normed low-rank
    /// queries.
    #[allow(clippy::too_many_arguments)]
    fn index(
        &self,
        li: usize,
        ix: &Indexer,
        mut acts: Acts,
        mut q_resid: Acts,
        angles: &[RopeAngles],
        latent: &[f32],
        seqs: &mut [SeqRows],
    ) -> (Vec<Span>, Vec<Selection>) {
        let x = indexer_dims(&self.cfg);
        let d = mla::dims(&self.cfg);
        let rope = d.qk_rope_head_dim;
        let mut out = self.project(&[ix.wk, ix.weights], &mut acts);
        let mut w = out.pop().unwrap();
        let mut keys = out.pop().unwrap();
        let mut iq = self.project(&[ix.wq_b], &mut q_resid).remove(0);
        let rotate = |row: &mut [f32], i: usize, tmp: &mut Vec<f32>| {
            let r = &mut row[..rope];
            if x.rope_interleave {
                mla::deinterleave(r, tmp);
            }
            self.rope.apply_angles(r, rope, &angles[i]);
        };
        self.per_position(&mut keys, x.head_dim, |i, row| {
            ops::layer_norm(row, &ix.k_norm, &ix.k_norm_bias, K_NORM_EPS);
            rotate(row, i, &mut Vec::with_capacity(rope));
        });
        self.per_position(&mut iq, x.heads * x.head_dim, |i, row| {
            let mut tmp = Vec::with_capacity(rope);
            for head in row.chunks_exact_mut(x.head_dim) {
                rotate(head, i, &mut tmp);
            }
        });
        let head_scale = (x.heads as f32).powf(-0.5);
        for v in &mut w {
            *v *= head_scale;
        }
        let kw = d.kv_lora_rank + rope;
        let spans = write_rows(seqs, li, latent, kw, &keys, x.head_dim);
        let kvs: Vec<&KvCache> = seqs.iter().map(|s| &*s.kv).collect();
        // Positions whose whole causal history fits the top-k attend over all of it; the
        // others score the history and keep the top-k.
        let dense: Vec<usize> = spans
            .iter()
            .map(|sp| sp.n.min(x.topk.saturating_sub(sp.p0)))
            .collect();
        let tasks: Vec<(usize, usize)> = spans
            .iter()
            .enumerate()
            .flat_map(|(s, sp)| (dense[s]..sp.n).map(move |i| (s, i)))
            .collect();
        let score_scale = (x.head_dim as f32).powf(-0.5);
        let mut chosen = self
            .pool
            .map(tasks.len(), |t| {
                let (s, i) = tasks[t];
                let sp = spans[s];
                let len = sp.p0 + i + 1;
                let row = sp.row0 + i;
                let (_, index_keys) = kvs[s].head(li, 0, len);
                let q = &iq[row * x.heads * x.head_dim..(row + 1) * x.heads * x.head_dim];
                let wi = &w[row * x.heads..(row + 1) * x.heads];
                let mut buf = vec![0.0f32; x.head_dim];
                let scores: Vec<f32> = (0..len)
                    .map(|t| {
                        let k = row_f32(&index_keys, t, x.head_dim, &mut buf);
                        q.chunks_exact(x.head_dim)
                            .zip(wi)
                            .map(|(qh, wh)| wh * (ops::dot(qh, k) * score_scale).max(0.0))
                            .sum()
                    })
                    .collect();
                topk::select(&scores, x.topk)
            })
            .into_iter();
        // The tasks run sequence by sequence: each takes its own in order.
        let sels = spans
            .iter()
            .zip(dense)
            .map(|(sp, dense)| Selection {
                dense,
                chosen: chosen.by_ref().take(sp.n - dense).collect(),
            })
            .collect();
        (spans, sels)
    }
}
