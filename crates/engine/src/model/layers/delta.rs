//! Gated DeltaNet linear attention (Qwen3-Next, transformers' `Qwen3NextGatedDeltaNet`).
//!
//! Per position: q and k (`key_heads` heads of `key_dim`), v and the output gate z
//! (`value_heads` of `value_dim`), and per value head `b` and `a`. q, k and v go through a
//! causal depthwise convolution of `conv_kernel` taps (SiLU after); q and k are L2-normalised
//! per head (q also scaled by `key_dim^-1/2`); `beta = sigmoid(b)`, the decay
//! `g = -exp(A_log) * softplus(a + dt_bias)`. Each value head `j` keeps a `key_dim x value_dim`
//! state `S` and reads the key head `j / (value_heads / key_heads)`:
//! `S *= exp(g); delta = (v - S^T k) * beta; S += k delta^T; o = S^T q` (the recurrent form; the
//! chunked form transformers uses for a prompt is the same arithmetic regrouped). The output is
//! RMS-normed per value head, times its weight and `silu(z)`, then `out_proj`.
//!
//! Nothing is kept per position: the layer's state in the cache (`KvCache::state`) is the
//! convolution's last `conv_kernel - 1` inputs and every head's `S`, rewritten by each position;
//! prefix reuse goes back to a snapshot of it.

use super::SeqRows;
use crate::config::{AttentionKind, LinearDims, ModelConfig};
use crate::error::Result;
use crate::linear::{for_each_chunk_mut, Acts, Linear};
use crate::model::load::Tensors;
use crate::model::plan::{HeadRows, Plan};
use crate::model::Model;
use crate::ops;

pub(super) fn dims(c: &ModelConfig) -> LinearDims {
    match c.attention {
        AttentionKind::Hybrid(d) => d,
        _ => unreachable!("a DeltaNet block of a non-hybrid config"),
    }
}

/// Channels of the convolution: q, k, v.
fn conv_channels(d: &LinearDims) -> usize {
    2 * d.key_heads * d.key_dim + d.value_heads * d.value_dim
}

/// Floats of a linear layer's state: the convolution's window, then every value head's `S`.
pub fn state_width(c: &ModelConfig) -> usize {
    let d = dims(c);
    (d.conv_kernel - 1) * conv_channels(&d) + d.value_heads * d.key_dim * d.value_dim
}

/// The tensors of layer `i`'s DeltaNet block: `in_proj_qkvz` and `in_proj_ba` cut per key
/// head group into q, k, v, z and b, a (transformers' `fix_query_key_value_ordering`).
pub fn plan(p: &mut Plan, c: &ModelConfig, i: usize) {
    let d = dims(c);
    let h = c.hidden_size;
    let r = d.value_heads / d.key_heads;
    let (hk, hv) = (d.key_dim, d.value_dim);
    let hf = |s: &str| format!("model.layers.{i}.linear_attn.{s}");
    let n = |s: &str| format!("layers.{i}.{s}");
    let group = |per_head, skip, take| HeadRows {
        heads: d.key_heads,
        per_head,
        skip,
        take,
        transpose: false,
    };
    let qkvz = 2 * hk + 2 * r * hv;
    for (name, skip, take) in [
        ("q", 0, hk),
        ("k", hk, hk),
        ("v", 2 * hk, r * hv),
        ("z", 2 * hk + r * hv, r * hv),
    ] {
        p.head_rows_matrix(
            n(name),
            hf("in_proj_qkvz.weight"),
            group(qkvz, skip, take),
            h,
        );
    }
    p.head_rows_matrix(n("b"), hf("in_proj_ba.weight"), group(2 * r, 0, r), h);
    p.head_rows_matrix(n("a"), hf("in_proj_ba.weight"), group(2 * r, r, r), h);
    p.f32_tensor(
        n("conv"),
        hf("conv1d.weight"),
        vec![conv_channels(&d), 1, d.conv_kernel],
    );
    p.vector(n("a_log"), hf("A_log"), d.value_heads);
    p.vector(n("dt_bias"), hf("dt_bias"), d.value_heads);
    p.vector(n("out_norm"), hf("norm.weight"), hv);
    p.matrix(n("out"), hf("out_proj.weight"), h, d.value_heads * hv);
}

/// One layer's DeltaNet weights.
pub(in crate::model) struct Delta {
    q: Linear,
    k: Linear,
    v: Linear,
    z: Linear,
    b: Linear,
    a: Linear,
    /// `[channels, conv_kernel]`.
    conv: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    out_norm: Vec<f32>,
    out: Linear,
}

impl Delta {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Delta> {
        let d = dims(c);
        let h = c.hidden_size;
        let n = |s: &str| format!("layers.{i}.{s}");
        let (kd, vd) = (d.key_heads * d.key_dim, d.value_heads * d.value_dim);
        Ok(Delta {
            q: t.linear(&n("q"), kd, h)?,
            k: t.linear(&n("k"), kd, h)?,
            v: t.linear(&n("v"), vd, h)?,
            z: t.linear(&n("z"), vd, h)?,
            b: t.linear(&n("b"), d.value_heads, h)?,
            a: t.linear(&n("a"), d.value_heads, h)?,
            conv: t.vector(&n("conv"), conv_channels(&d) * d.conv_kernel)?,
            a_log: t.vector(&n("a_log"), d.value_heads)?,
            dt_bias: t.vector(&n("dt_bias"), d.value_heads)?,
            out_norm: t.vector(&n("out_norm"), d.value_dim)?,
            out: t.linear(&n("out"), h, vd)?,
        })
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Divides `x` by `sqrt(sum x^2 + 1e-6)` (transformers' `l2norm`).
fn l2norm(x: &mut [f32]) {
    let inv = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= inv);
}

impl Model {
    /// Layer `li`'s DeltaNet output for the normed inputs `hn` of every sequence of the pass;
    /// advances each sequence's state over its rows.
    pub(in crate::model) fn delta_attention(
        &self,
        li: usize,
        w: &Delta,
        hn: Vec<f32>,
        seqs: &mut [SeqRows],
    ) -> Vec<f32> {
        let c = &self.cfg;
        let d = dims(c);
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let n = hn.len() / h;
        let (nk, nv, hk, hv, kk) = (
            d.key_heads,
            d.value_heads,
            d.key_dim,
            d.value_dim,
            d.conv_kernel,
        );
        let (kd, vd) = (nk * hk, nv * hv);
        let ch = conv_channels(&d);
        let mut acts = Acts::from_vec(hn, n, h);
        let mut outs = self
            .project(&[w.q, w.k, w.v, w.z, w.b, w.a], &mut acts)
            .into_iter();
        let (q, k, v) = (
            outs.next().unwrap(),
            outs.next().unwrap(),
            outs.next().unwrap(),
        );
        let z = outs.next().unwrap();
        let (b, a) = (outs.next().unwrap(), outs.next().unwrap());
        // Per row: q | k | v through the causal convolution (in each sequence's order, its
        // window carried in the state), SiLU, then q and k normalised.
        let mut mixed = vec![0.0f32; n * ch];
        for (i, row) in mixed.chunks_exact_mut(ch).enumerate() {
            row[..kd].copy_from_slice(&q[i * kd..(i + 1) * kd]);
            row[kd..2 * kd].copy_from_slice(&k[i * kd..(i + 1) * kd]);
            row[2 * kd..].copy_from_slice(&v[i * vd..(i + 1) * vd]);
        }
        let window = (kk - 1) * ch;
        for s in seqs.iter_mut() {
            let state = s.kv.state_mut(li);
            let (conv_state, _) = state.split_at_mut(window);
            for row in mixed[s.rows.start * ch..s.rows.end * ch].chunks_exact_mut(ch) {
                for (cidx, x) in row.iter_mut().enumerate() {
                    let taps = &w.conv[cidx * kk..(cidx + 1) * kk];
                    let mut acc = taps[kk - 1] * *x;
                    for j in 0..kk - 1 {
                        acc += taps[j] * conv_state[j * ch + cidx];
                    }
                    // Shift the window: the oldest input goes, this one joins.
                    for j in 0..kk.saturating_sub(2) {
                        conv_state[j * ch + cidx] = conv_state[(j + 1) * ch + cidx];
                    }
                    if kk > 1 {
                        conv_state[(kk - 2) * ch + cidx] = *x;
                    }
                    *x = silu(acc);
                }
            }
        }
        let qscale = 1.0 / (hk as f32).sqrt();
        self.per_position(&mut mixed, ch, |_, row| {
            for head in row[..kd].chunks_exact_mut(hk) {
                l2norm(head);
                head.iter_mut().for_each(|x| *x *= qscale);
            }
            for head in row[kd..2 * kd].chunks_exact_mut(hk) {
                l2norm(head);
            }
        });
        let beta: Vec<f32> = b.iter().map(|&x| ops::sigmoid(x)).collect();
        let decay: Vec<f32> = a
            .iter()
            .enumerate()
            .map(|(t, &x)| {
                let j = t % nv;
                (-w.a_log[j].exp() * ops::softplus(x + w.dt_bias[j])).exp()
            })
            .collect();
        // The recurrence: each value head of each sequence on its own thread, rows in order.
        let mut o = vec![0.0f32; n * vd];
        let r = nv / nk;
        for s in seqs.iter_mut() {
            let rows = s.rows.clone();
            let heads_out: Vec<std::sync::Mutex<Vec<f32>>> = (0..nv)
                .map(|_| std::sync::Mutex::new(vec![0.0f32; rows.len() * hv]))
                .collect();
            let state = &mut s.kv.state_mut(li)[window..];
            for_each_chunk_mut(&self.pool, state, hk * hv, |j, sm| {
                let kh = j / r;
                let mut out = heads_out[j].lock().unwrap_or_else(|e| e.into_inner());
                let mut delta = vec![0.0f32; hv];
                for (t, row) in rows.clone().enumerate() {
                    let m = &mixed[row * ch..(row + 1) * ch];
                    let qh = &m[kh * hk..(kh + 1) * hk];
                    let khv = &m[kd + kh * hk..kd + (kh + 1) * hk];
                    let vh = &m[2 * kd + j * hv..2 * kd + (j + 1) * hv];
                    let g = decay[row * nv + j];
                    sm.iter_mut().for_each(|x| *x *= g);
                    delta.copy_from_slice(vh);
                    for (ki, srow) in khv.iter().zip(sm.chunks_exact(hv)) {
                        for (dv, sv) in delta.iter_mut().zip(srow) {
                            *dv -= ki * sv;
                        }
                    }
                    let bt = beta[row * nv + j];
                    delta.iter_mut().for_each(|x| *x *= bt);
                    for (ki, srow) in khv.iter().zip(sm.chunks_exact_mut(hv)) {
                        for (sv, dv) in srow.iter_mut().zip(&delta) {
                            *sv += ki * dv;
                        }
                    }
                    let oh = &mut out[t * hv..(t + 1) * hv];
                    for (qi, srow) in qh.iter().zip(sm.chunks_exact(hv)) {
                        for (ov, sv) in oh.iter_mut().zip(srow) {
                            *ov += qi * sv;
                        }
                    }
                }
            });
            for (j, ho) in heads_out.into_iter().enumerate() {
                let ho = ho.into_inner().unwrap_or_else(|e| e.into_inner());
                for (t, row) in rows.clone().enumerate() {
                    o[row * vd + j * hv..row * vd + (j + 1) * hv]
                        .copy_from_slice(&ho[t * hv..(t + 1) * hv]);
                }
            }
        }
        // Gated RMSNorm per value head: rms(o) * weight * silu(z).
        self.per_position(&mut o, vd, |i, row| {
            for (j, head) in row.chunks_exact_mut(hv).enumerate() {
                ops::rms_norm(head, &w.out_norm, eps);
                let zh = &z[i * vd + j * hv..i * vd + (j + 1) * hv];
                for (x, &g) in head.iter_mut().zip(zh) {
                    *x *= silu(g);
                }
            }
        });
        let mut acts = Acts::from_vec(o, n, vd);
        self.project(&[w.out], &mut acts).remove(0)
    }
}
