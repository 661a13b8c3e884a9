//! The blocks a decoder layer is made of. An attention kind is one file here (its weights, its
//! tensor plan, its forward pass and what it keeps per position, [`KvLayout`]) plus a variant of
//! [`Attention`]; the feed-forward blocks are the dense [`mlp`] and the routed [`moe`].

pub mod gqa;
pub mod mla;
pub mod mlp;
pub mod moe;
pub mod routing;

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
    }
}

/// What the model's layers keep per position.
pub fn kv_layout(c: &ModelConfig) -> KvLayout {
    match c.attention {
        AttentionKind::Gqa => gqa::kv_layout(c),
        AttentionKind::Mla(_) => mla::kv_layout(c),
    }
}

impl Attention {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Attention> {
        Ok(match c.attention {
            AttentionKind::Gqa => Attention::Gqa(gqa::Gqa::load(t, c, i)?),
            AttentionKind::Mla(_) => Attention::Mla(mla::Mla::load(t, c, i)?),
        })
    }
}

impl Model {
    /// Layer `li`'s attention over the normed inputs `hn` at positions `kv.len ..`.
    pub(in crate::model) fn attention(
        &self,
        li: usize,
        a: &Attention,
        hn: Vec<f32>,
        angles: &[RopeAngles],
        kv: &mut KvCache,
    ) -> Vec<f32> {
        match a {
            Attention::Gqa(w) => self.gqa_attention(li, w, hn, angles, kv),
            Attention::Mla(w) => self.mla_attention(li, w, hn, angles, kv),
        }
    }
}
