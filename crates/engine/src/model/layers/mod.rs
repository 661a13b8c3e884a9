//! The blocks a decoder layer is made of. An attention kind is one file here (its weights, its
//! tensor plan, its forward pass and what it keeps per position, [`KvLayout`]) plus a variant of
//! [`Attention`]; the feed-forward blocks are the dense [`mlp`] and the routed [`moe`].

pub mod compressed;
pub mod delta;
pub mod delta_rule;
pub mod dsa;
pub mod gqa;
pub mod hyper;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod routing;
pub mod topk;

use std::ops::Range;

use crate::attention::{AttendArgs, HeadRows};
use crate::config::{AttentionKind, HybridFull, ModelConfig};
use crate::error::Result;
use crate::kv::{KvCache, KvLayout};
use crate::model::load::Tensors;
use crate::model::plan::Plan;
use crate::model::Model;
use crate::ops::RopeAngles;

/// One layer's attention block.
pub(in crate::model) enum Attention {
    Gqa(gqa::Gqa),
    Mla(mla::Mla),
    Dsa(dsa::Dsa),
    Compressed(Box<compressed::Compressed>),
    Delta(Box<delta::Delta>),
}

/// One layer's feed-forward block.
pub(in crate::model) enum Ffn {
    Dense(mlp::Mlp),
    Moe(moe::Moe),
}

/// A decoder layer: pre-norm attention and pre-norm feed-forward, each added to the residual
/// (or, with hyper-connections, collapsed from and mixed into its streams by `attn_hc` and
/// `ffn_hc`).
pub(in crate::model) struct Layer {
    pub(in crate::model) attn_norm: Vec<f32>,
    pub(in crate::model) ffn_norm: Vec<f32>,
    pub(in crate::model) attn_hc: Option<hyper::HyperMix>,
    pub(in crate::model) ffn_hc: Option<hyper::HyperMix>,
    pub(in crate::model) attention: Attention,
    pub(in crate::model) ffn: Ffn,
}

/// The tensors of layer `i`'s attention block.
pub fn plan_attention(p: &mut Plan, c: &ModelConfig, i: usize) {
    match c.attention {
        AttentionKind::Gqa => gqa::plan(p, c, i),
        AttentionKind::Mla(_) => mla::plan(p, c, i),
        AttentionKind::Dsa(..) => dsa::plan(p, c, i),
        AttentionKind::Compressed(_) => compressed::plan(p, c, i),
        AttentionKind::Hybrid(..) if c.linear_layers[i] => delta::plan(p, c, i),
        AttentionKind::Hybrid(_, HybridFull::GatedGqa) => gqa::plan_gated(p, c, i),
        AttentionKind::Hybrid(_, HybridFull::Mla(_)) => mla::plan(p, c, i),
    }
}

/// What the model's layers keep per position.
pub fn kv_layout(c: &ModelConfig) -> KvLayout {
    match c.attention {
        AttentionKind::Gqa => gqa::kv_layout(c),
        AttentionKind::Mla(_) => mla::kv_layout(c),
        AttentionKind::Dsa(..) => dsa::kv_layout(c),
        AttentionKind::Compressed(_) => compressed::kv_layout(c),
        AttentionKind::Hybrid(_, full) => {
            let full_layer = match full {
                HybridFull::GatedGqa => {
                    crate::kv::LayerKv::per_position(c.num_kv_heads, c.head_dim, c.head_dim)
                }
                HybridFull::Mla(_) => mla::kv_layout(c).layers[0],
            };
            let none = crate::kv::LayerKv::per_position(0, 0, 0);
            KvLayout {
                layers: c
                    .linear_layers
                    .iter()
                    .map(|&linear| if linear { none } else { full_layer })
                    .collect(),
            }
        }
    }
}

/// `kv` with the model's per-layer states ([`state_widths`]), zero: linear attention's in f32
/// (a recurrence that must stay exact), DeepSeek-V4's in the cache's dtype (its keys and
/// compressor inputs are rounded as the cache stores them before they enter the state).
pub fn with_states(c: &ModelConfig, kv: KvCache) -> KvCache {
    let widths = state_widths(c);
    match c.attention {
        AttentionKind::Compressed(_) => kv.with_rounded_states(&widths),
        _ => kv.with_states(&widths),
    }
}

/// Per layer, the floats of the fixed-size state it carries (linear attention, DeepSeek-V4's
/// window and pending compressor inputs; 0: none).
pub fn state_widths(c: &ModelConfig) -> Vec<usize> {
    match c.attention {
        AttentionKind::Compressed(_) => compressed::state_widths(c),
        AttentionKind::Hybrid(..) => c
            .linear_layers
            .iter()
            .map(|&linear| if linear { delta::state_width(c) } else { 0 })
            .collect(),
        _ => vec![0; c.num_layers],
    }
}

impl Attention {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Attention> {
        Ok(match c.attention {
            AttentionKind::Gqa => Attention::Gqa(gqa::Gqa::load(t, c, i)?),
            AttentionKind::Mla(_) => Attention::Mla(mla::Mla::load(t, c, i)?),
            AttentionKind::Dsa(..) => Attention::Dsa(dsa::Dsa::load(t, c, i)?),
            AttentionKind::Compressed(_) => {
                Attention::Compressed(Box::new(compressed::Compressed::load(t, c, i)?))
            }
            AttentionKind::Hybrid(..) if c.linear_layers[i] => {
                Attention::Delta(Box::new(delta::Delta::load(t, c, i)?))
            }
            AttentionKind::Hybrid(_, HybridFull::GatedGqa) => {
                Attention::Gqa(gqa::Gqa::load(t, c, i)?)
            }
            AttentionKind::Hybrid(_, HybridFull::Mla(_)) => {
                Attention::Mla(mla::Mla::load(t, c, i)?)
            }
        })
    }
}

/// Query positions of one head attended together in a prefill (they share each tile of keys
/// and values they read). Measured: 32 scored 1.15x the pairs per second of 16 at a 4k history
/// (one thread); 64 scored 1.05-1.12x those of 32 at 4k-32k histories, and prefill of 6k
/// tokens ran 1.005-1.08x faster (3 alternating pairs), a long prompt's short steps at great
/// depth (~50-100 positions) now being one block instead of two.
const ATTN_BLOCK: usize = 64;

/// One sequence's part of a forward pass: its rows of the pass (consecutive, one per
/// position) at positions `kv.len ..` of its own history. A pass runs several sequences at once
/// when streams are stepped together; every row's arithmetic is the same as alone.
pub(in crate::model) struct SeqRows<'a> {
    pub(in crate::model) rows: Range<usize>,
    pub(in crate::model) kv: &'a mut KvCache,
}

/// Rows `row0 .. row0 + n` of a pass, at positions `p0 ..` of their sequence's history.
#[derive(Clone, Copy, Debug)]
pub(in crate::model) struct Span {
    pub(in crate::model) row0: usize,
    pub(in crate::model) n: usize,
    pub(in crate::model) p0: usize,
}

/// Writes each sequence's rows of `keys` (`kw` per row) and `values` (`vw` per row) to layer
/// `li` of its cache, after its history; returns each sequence's [`Span`].
pub(in crate::model) fn write_rows(
    seqs: &mut [SeqRows],
    li: usize,
    keys: &[f32],
    kw: usize,
    values: &[f32],
    vw: usize,
) -> Vec<Span> {
    seqs.iter_mut()
        .map(|s| {
            let (r, p0) = (s.rows.clone(), s.kv.len);
            s.kv.write(
                li,
                p0,
                &keys[r.start * kw..r.end * kw],
                &values[r.start * vw..r.end * vw],
            );
            Span {
                row0: r.start,
                n: r.len(),
                p0,
            }
        })
        .collect()
}

impl Model {
    /// Causal attention of the rows of `spans` (out of the pass's `rows`) for `heads` heads,
    /// every attention kind's core: tasks of (block of [`ATTN_BLOCK`] positions of one span,
    /// head) over the pool, the costliest (deepest) blocks first. `query(row, head)` is a row's
    /// query for `head`, and `history(span, head, len)` the first `len` keys and values of the
    /// span's sequence that head attends over, the same for each `group` consecutive heads
    /// (GQA's query heads per kv head; every head of MLA). Returns `width` values (the value
    /// width) per (row, head), row-major; rows outside the spans are zero.
    ///
    /// A decode step (one position per span) gives each task several heads of one group
    /// instead, as many as still keep every thread busy: the history is read (and widened
    /// from f16) once for all of them, where one head per task read it once per head. The
    /// results are the same bits either way (the kernel's promise for a query in a block).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn attend_causal<'q, 'h>(
        &self,
        spans: &[Span],
        rows: usize,
        heads: usize,
        group: usize,
        width: usize,
        scale: f32,
        query: impl Fn(usize, usize) -> &'q [f32] + Sync,
        history: impl Fn(usize, usize, usize) -> (HeadRows<'h>, HeadRows<'h>) + Sync,
    ) -> Vec<f32> {
        debug_assert!(group >= 1 && heads.is_multiple_of(group));
        // (span, first, end) of every block, deepest history first.
        let mut blocks: Vec<(usize, usize, usize)> = spans
            .iter()
            .enumerate()
            .flat_map(|(s, sp)| {
                (0..sp.n.div_ceil(ATTN_BLOCK))
                    .map(move |b| (s, b * ATTN_BLOCK, ((b + 1) * ATTN_BLOCK).min(sp.n)))
            })
            .collect();
        blocks.sort_by_key(|&(s, _, i1)| std::cmp::Reverse(spans[s].p0 + i1));
        // Heads per task.
        let mut g = if spans.iter().all(|sp| sp.n <= 1) {
            group
        } else {
            1
        };
        while g % 2 == 0 && blocks.len() * (heads / g) < self.pool.threads() {
            g /= 2;
        }
        let per_block = heads / g;
        // A task's block and its first head.
        let task = |t: usize| (blocks[t / per_block], (t % per_block) * g);
        let outs = self.pool.map(blocks.len() * per_block, |t| {
            let ((s, i0, i1), h0) = task(t);
            let sp = spans[s];
            let qs: Vec<&[f32]> = (i0..i1)
                .flat_map(|i| (h0..h0 + g).map(move |head| (sp.row0 + i, head)))
                .map(|(row, head)| query(row, head))
                .collect();
            let (keys, values) = history(s, h0, sp.p0 + i1);
            let args = AttendArgs {
                keys,
                values,
                n0: sp.p0 + i0 + 1,
                share: g,
                scale,
            };
            let mut out = vec![0.0f32; qs.len() * width];
            crate::attention::attend(&qs, &args, &mut out);
            out
        });
        let mut att = vec![0.0f32; rows * heads * width];
        for (t, out) in outs.iter().enumerate() {
            let ((s, i0, _), h0) = task(t);
            for (j, o) in out.chunks_exact(width).enumerate() {
                let (i, head) = (i0 + j / g, h0 + j % g);
                let at = ((spans[s].row0 + i) * heads + head) * width;
                att[at..at + width].copy_from_slice(o);
            }
        }
        att
    }

    /// Layer `li`'s attention over the normed inputs `hn` of every sequence of the pass (rows
    /// at `angles`). `selection` carries each sequence's DSA indexer choice from layer to layer
    /// within one pass.
    pub(in crate::model) fn attention(
        &self,
        li: usize,
        a: &Attention,
        hn: Vec<f32>,
        angles: &[RopeAngles],
        seqs: &mut [SeqRows],
        selection: &mut [Option<dsa::Selection>],
    ) -> Vec<f32> {
        match a {
            Attention::Gqa(w) => self.gqa_attention(li, w, hn, angles, seqs),
            Attention::Mla(w) => self.mla_attention(li, w, hn, angles, seqs),
            Attention::Dsa(w) => self.dsa_attention(li, w, hn, angles, seqs, selection),
            Attention::Compressed(w) => self.compressed_attention(li, w, hn, seqs),
            Attention::Delta(w) => self.delta_attention(li, w, hn, seqs),
        }
    }
}

/// Row `t` of `rows` (`dim` wide) as f32, in `buf`.
pub(super) fn row_f32<'a>(
    rows: &'a HeadRows<'a>,
    t: usize,
    dim: usize,
    buf: &'a mut [f32],
) -> &'a [f32] {
    match rows {
        HeadRows::F32(x) => &x[t * dim..(t + 1) * dim],
        HeadRows::F16(x) => {
            for (o, v) in buf.iter_mut().zip(&x[t * dim..(t + 1) * dim]) {
                *o = v.to_f32();
            }
            buf
        }
    }
}
