//! Grouped-query attention (every family so far): q/k/v projections with optional biases,
//! optional q/k RMSNorm (over all heads or per head), optional clamp, RoPE on the leading
//! `rotary_dim` of each head, then softmax attention of each query head over its kv head's
//! history, in blocks of query positions that share every chunk of keys they read.
//! Keeps `num_kv_heads` key and value rows of `head_dim` per position.

use super::{write_rows, SeqRows};
use crate::config::{ModelConfig, QkNorm};
use crate::error::Result;
use crate::kv::{KvCache, KvLayout};
use crate::linear::{Acts, Linear};
use crate::model::load::Tensors;
use crate::model::plan::{HeadRows, Plan};
use crate::model::Model;
use crate::ops::{self, RopeAngles};

/// One layer's attention weights.
pub(in crate::model) struct Gqa {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    biases: [Option<Vec<f32>>; 4],
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    /// The output gate (Qwen3-Next): each head's output times `sigmoid(gate x)`.
    gate: Option<Linear>,
}

/// What every layer keeps per position: the kv heads' keys and values.
pub fn kv_layout(c: &ModelConfig) -> KvLayout {
    KvLayout::uniform(c.num_layers, c.num_kv_heads, c.head_dim)
}

/// The projections of layer `i` (biases optional) and its q/k norms.
pub fn plan(p: &mut Plan, c: &ModelConfig, i: usize) {
    let h = c.hidden_size;
    let hf = |s: &str| format!("model.layers.{i}.{s}");
    let n = |s: &str| format!("layers.{i}.{s}");
    for (name, rows, cols) in [
        ("q", c.q_dim(), h),
        ("k", c.kv_dim(), h),
        ("v", c.kv_dim(), h),
        ("o", h, c.q_dim()),
    ] {
        p.matrix(
            n(name),
            hf(&format!("self_attn.{name}_proj.weight")),
            rows,
            cols,
        );
        p.optional_vector(
            n(&format!("{name}_bias")),
            hf(&format!("self_attn.{name}_proj.bias")),
            rows,
        );
    }
    let (q_len, k_len) = match c.qk_norm {
        QkNorm::None => return,
        QkNorm::Full => (c.q_dim(), c.kv_dim()),
        QkNorm::PerHead => (c.head_dim, c.head_dim),
    };
    p.vector(n("q_norm"), hf("self_attn.q_norm.weight"), q_len);
    p.vector(n("k_norm"), hf("self_attn.k_norm.weight"), k_len);
}

/// Qwen3-Next's gated attention: `q_proj` holds each head's query then its output gate
/// (`[heads * 2 * head_dim, hidden]`), cut into `q` and `q_gate`; the q/k norms are
/// zero-centred (stored as `1 + w`).
pub fn plan_gated(p: &mut Plan, c: &ModelConfig, i: usize) {
    let (h, hd) = (c.hidden_size, c.head_dim);
    let hf = |s: &str| format!("model.layers.{i}.self_attn.{s}");
    let n = |s: &str| format!("layers.{i}.{s}");
    for (name, skip) in [("q", 0), ("q_gate", hd)] {
        let hr = HeadRows {
            heads: c.num_heads,
            per_head: 2 * hd,
            skip,
            take: hd,
            transpose: false,
        };
        p.head_rows_matrix(n(name), hf("q_proj.weight"), hr, h);
    }
    p.matrix(n("k"), hf("k_proj.weight"), c.kv_dim(), h);
    p.matrix(n("v"), hf("v_proj.weight"), c.kv_dim(), h);
    p.matrix(n("o"), hf("o_proj.weight"), h, c.q_dim());
    p.vector_plus_one(n("q_norm"), hf("q_norm.weight"), hd);
    p.vector_plus_one(n("k_norm"), hf("k_norm.weight"), hd);
}

impl Gqa {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Gqa> {
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let n = |s: &str| format!("layers.{i}.{s}");
        let (q_norm, k_norm) = match c.qk_norm {
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
        Ok(Gqa {
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
            gate: if t.has(&n("q_gate")) {
                Some(t.linear(&n("q_gate"), qd, h)?)
            } else {
                None
            },
        })
    }
}

impl Model {
    /// The attention output of layer `li` for the normed inputs `hn` (one row per position of
    /// the pass's sequences); writes each sequence's keys and values to its cache.
    pub(in crate::model) fn gqa_attention(
        &self,
        li: usize,
        layer: &Gqa,
        hn: Vec<f32>,
        angles: &[RopeAngles],
        seqs: &mut [SeqRows],
    ) -> Vec<f32> {
        let n = angles.len();
        let c = &self.cfg;
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let mut acts = Acts::from_vec(hn, n, h);
        let mut ws = vec![layer.q, layer.k, layer.v];
        ws.extend(layer.gate);
        let mut qkv = self.project(&ws, &mut acts);
        let gate = layer.gate.map(|_| qkv.pop().unwrap());
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
        let spans = write_rows(seqs, li, &k, kvd, &v, kvd);
        let kvs: Vec<&KvCache> = seqs.iter().map(|s| &*s.kv).collect();
        let group = c.num_heads / c.num_kv_heads;
        let att = self.attend_causal(
            &spans,
            n,
            c.num_heads,
            group,
            hd,
            1.0 / (hd as f32).sqrt(),
            |i, head| &q[i * qd + head * hd..i * qd + (head + 1) * hd],
            |s, head, len| kvs[s].head(li, head / group, len),
        );
        let mut att = att;
        if let Some(g) = &gate {
            for (x, &gv) in att.iter_mut().zip(g) {
                *x *= ops::sigmoid(gv);
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
}
