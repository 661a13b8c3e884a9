//! The blocks a decoder layer is made of. An attention kind is one file here (its weights, its
//! tensor plan, its forward pass and what it keeps per position, [`KvLayout`]) plus a variant of
//! [`Attention`]; the feed-forward blocks are the dense [`mlp`] and the routed [`moe`].

pub mod dsa;
pub mod gqa;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod routing;
pub mod topk;

use crate::attention::{AttendArgs, HeadRows};
use crate::config::{AttentionKind, ModelConfig};
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
}

/// One layer's feed-forward block.
pub(in crate::model) enum Ffn {
    Dense(mlp::Mlp),
    Moe(moe::Moe),
}

/// A decoder layer: pre-norm attention and pre-norm feed-forward, each added to the residual.
pub(in crate::model) struct Layer {
    pub(in crate::model) attn_norm: Vec<f32>,
    pub(in crate::model) ffn_norm: Vec<f32>,
    pub(in crate::model) attention: Attention,
    pub(in crate::model) ffn: Ffn,
}

/// The tensors of layer `i`'s attention block.
pub fn plan_attention(p: &mut Plan, c: &ModelConfig, i: usize) {
    match c.attention {
        AttentionKind::Gqa => gqa::plan(p, c, i),
        AttentionKind::Mla(_) => mla::plan(p, c, i),
        AttentionKind::Dsa(..) => dsa::plan(p, c, i),
    }
}

/// What the model's layers keep per position.
pub fn kv_layout(c: &ModelConfig) -> KvLayout {
    match c.attention {
        AttentionKind::Gqa => gqa::kv_layout(c),
        AttentionKind::Mla(_) => mla::kv_layout(c),
        AttentionKind::Dsa(..) => dsa::kv_layout(c),
    }
}

impl Attention {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Attention> {
        Ok(match c.attention {
            AttentionKind::Gqa => Attention::Gqa(gqa::Gqa::load(t, c, i)?),
            AttentionKind::Mla(_) => Attention::Mla(mla::Mla::load(t, c, i)?),
            AttentionKind::Dsa(..) => Attention::Dsa(dsa::Dsa::load(t, c, i)?),
        })
    }
}

/// Query positions of one head attended together in a prefill (they share each tile of keys
/// and values they read). Measured: 32 scored 1.15x the pairs per second of 16 at a 4k history
/// (one thread); 64 scored 1.05-1.12x those of 32 at 4k-32k histories, and prefill of 6k
/// tokens ran 1.005-1.08x faster (3 alternating pairs), a long prompt's short steps at great
/// depth (~50-100 positions) now being one block instead of two.
const ATTN_BLOCK: usize = 64;

impl Model {
    /// Causal attention of the `n` positions after `p0` for `heads` heads, every attention kind's
    /// core: tasks of (block of [`ATTN_BLOCK`] positions, head) over the pool, the costliest
    /// (latest) blocks first. `query(i, head)` is position `i`'s query for `head`, and
    /// `history(head, len)` the first `len` keys and values that head attends over. Returns
    /// `width` values (the value width) per (position, head), position-major.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::model) fn attend_causal<'q, 'h>(
        &self,
        n: usize,
        heads: usize,
        p0: usize,
        width: usize,
        scale: f32,
        query: impl Fn(usize, usize) -> &'q [f32] + Sync,
        history: impl Fn(usize, usize) -> (HeadRows<'h>, HeadRows<'h>) + Sync,
    ) -> Vec<f32> {
        let blocks = n.div_ceil(ATTN_BLOCK);
        let task = |t: usize| (blocks - 1 - t / heads, t % heads);
        let outs = self.pool.map(blocks * heads, |t| {
            let (b, head) = task(t);
            let (i0, i1) = (b * ATTN_BLOCK, ((b + 1) * ATTN_BLOCK).min(n));
            let qs: Vec<&[f32]> = (i0..i1).map(|i| query(i, head)).collect();
            let (keys, values) = history(head, p0 + i1);
            let args = AttendArgs {
                keys,
                values,
                n0: p0 + i0 + 1,
                scale,
            };
            let mut out = vec![0.0f32; qs.len() * width];
            crate::attention::attend(&qs, &args, &mut out);
            out
        });
        let mut att = vec![0.0f32; n * heads * width];
        for (t, out) in outs.iter().enumerate() {
            let (b, head) = task(t);
            for (j, o) in out.chunks_exact(width).enumerate() {
                let at = ((b * ATTN_BLOCK + j) * heads + head) * width;
                att[at..at + width].copy_from_slice(o);
            }
        }
        att
    }

    /// Layer `li`'s attention over the normed inputs `hn` at positions `kv.len ..`.
    /// `selection` carries a DSA indexer's choice from layer to layer within one pass.
    pub(in crate::model) fn attention(
        &self,
        li: usize,
        a: &Attention,
        hn: Vec<f32>,
        angles: &[RopeAngles],
        kv: &mut KvCache,
        selection: &mut Option<dsa::Selection>,
    ) -> Vec<f32> {
        match a {
            Attention::Gqa(w) => self.gqa_attention(li, w, hn, angles, kv),
            Attention::Mla(w) => self.mla_attention(li, w, hn, angles, kv),
            Attention::Dsa(w) => self.dsa_attention(li, w, hn, angles, kv, selection),
        }
    }
}
