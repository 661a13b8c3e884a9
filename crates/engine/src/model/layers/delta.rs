//! Linear attention with a delta-rule state: gated DeltaNet (Qwen3-Next, transformers'
//! `Qwen3NextGatedDeltaNet`) and Kimi Delta Attention (Kimi Linear, transformers'
//! `KimiLinearDeltaAttention`), [`LinearKind`].
//!
//! Per position: q and k (`key_heads` heads of `key_dim`), v (`value_heads` of `value_dim`),
//! `beta` per value head and a decay. q, k and v go through a causal depthwise convolution of
//! `conv_kernel` taps (SiLU after); q and k are L2-normalised per head (q also scaled by
//! `key_dim^-1/2`). Each value head `j` keeps a `key_dim x value_dim` state `S` and reads the
//! key head `j / (value_heads / key_heads)`:
//! `S *= exp(g); delta = (v - S^T k) * beta; S += k delta^T; o = S^T q` (the recurrent form; the
//! chunked form transformers uses for a prompt is the same arithmetic regrouped). The output is
//! RMS-normed per value head, times its weight and a gate, then the output projection.
//!
//! - DeltaNet: q, k, v, the gate z and `b`, `a` cut out of `in_proj_qkvz` / `in_proj_ba`;
//!   `beta = sigmoid(b)`, one decay per head `g = -exp(A_log) * softplus(a + dt_bias)`; the
//!   output gate `silu(z)`.
//! - KDA (one key head per value head): separate q, k, v projections and convolutions;
//!   `beta = sigmoid(b_proj(x))`; one decay per key channel,
//!   `g = -exp(A_log[head]) * softplus(f_b(f_a(x)) + dt_bias)` (a rank-`key_dim` forget gate),
//!   so each row of `S` decays at its own rate; the output gate `sigmoid(g_b(g_a(x)))`.
//!
//! Nothing is kept per position: the layer's state in the cache (`KvCache::state`) is the
//! convolution's last `conv_kernel - 1` inputs and every head's `S`, rewritten by each position;
//! prefix reuse goes back to a snapshot of it.

use super::delta_rule::{self, Form, HeadInputs, Rows};
use super::SeqRows;
use crate::config::{AttentionKind, LinearDims, LinearKind, ModelConfig};
use crate::error::Result;
use crate::linear::{for_each_chunk_mut, Acts, Linear};
use crate::model::load::Tensors;
use crate::model::plan::{HeadRows, Plan};
use crate::model::Model;
use crate::ops;

pub(super) fn dims(c: &ModelConfig) -> LinearDims {
    match c.attention {
        AttentionKind::Hybrid(d, _) => d,
        _ => unreachable!("a DeltaNet block of a non-hybrid config"),
    }
}

/// The shortest step of a linear-attention layer that runs the delta rule's chunked form (the
/// recurrent form below it; `delta_rule::Form`). None: on this CPU (AMD EPYC, AVX-512) the
/// recurrent form measured 1.5-3x faster than chunks of 32 or 64 at every step length from 1
/// to 512 positions with a per-head decay, and 3-7x with KDA's per-channel one (one 128 x 128
/// head, `delta_rule::speed`): its state stays in cache across a step, and the chunked form's
/// triangular solve and pairwise decays cost more than the state's re-reads. The recurrent
/// form also keeps a prompt's results independent of how it is cut into steps.
pub const DELTA_CHUNKED_FROM: Option<usize> = None;

/// [`DELTA_CHUNKED_FROM`], or `COLI_DELTA_CHUNKED` (positions, or `off`) to measure others; a
/// value that is neither gives the default and a warning (the second value).
pub(in crate::model) fn resolve_delta_chunked(
    setting: Option<&str>,
) -> (Option<usize>, Option<String>) {
    match setting.map(str::trim) {
        None | Some("") => (DELTA_CHUNKED_FROM, None),
        Some("off") => (None, None),
        Some(v) => match v.parse::<usize>() {
            Ok(n) if n >= 1 => (Some(n), None),
            _ => (
                DELTA_CHUNKED_FROM,
                Some(format!(
                    "colibri: COLI_DELTA_CHUNKED={v}: expected a number of positions >= 1 or \
                     `off`, using the default"
                )),
            ),
        },
    }
}

pub(in crate::model) fn delta_chunked_from_env() -> Option<usize> {
    let (n, warning) = resolve_delta_chunked(crate::settings::delta_chunked().as_deref());
    if let Some(w) = warning {
        eprintln!("{w}");
    }
    n
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

/// The tensors of layer `i`'s linear attention block.
pub fn plan(p: &mut Plan, c: &ModelConfig, i: usize) {
    match dims(c).kind {
        LinearKind::GatedDeltaNet => plan_delta_net(p, c, i),
        LinearKind::Kda => plan_kda(p, c, i),
    }
}

/// KDA's tensors, under `self_attn` with the checkpoint's names: q, k, v and their three
/// convolutions, the forget gate (`f_a_proj`, `f_b_proj`, `dt_bias`, `A_log`), `b_proj`, the
/// output gate (`g_a_proj`, `g_b_proj`), `o_norm`, `o_proj`.
fn plan_kda(p: &mut Plan, c: &ModelConfig, i: usize) {
    let d = dims(c);
    let (h, heads, hd) = (c.hidden_size, d.value_heads, d.value_dim);
    let width = heads * hd;
    let hf = |s: &str| format!("model.layers.{i}.self_attn.{s}");
    let n = |s: &str| format!("layers.{i}.{s}");
    for x in ["q", "k", "v"] {
        p.matrix(n(x), hf(&format!("{x}_proj.weight")), width, h);
        p.f32_tensor(
            n(&format!("{x}_conv")),
            hf(&format!("{x}_conv1d.weight")),
            vec![width, 1, d.conv_kernel],
        );
    }
    p.matrix(n("f_a"), hf("f_a_proj.weight"), hd, h);
    p.matrix(n("f_b"), hf("f_b_proj.weight"), width, hd);
    p.vector(n("dt_bias"), hf("dt_bias"), width);
    p.f32_tensor(n("a_log"), hf("A_log"), vec![1, 1, heads, 1]);
    p.matrix(n("b"), hf("b_proj.weight"), heads, h);
    p.matrix(n("g_a"), hf("g_a_proj.weight"), hd, h);
    p.matrix(n("g_b"), hf("g_b_proj.weight"), width, hd);
    p.vector(n("out_norm"), hf("o_norm.weight"), hd);
    p.matrix(n("out"), hf("o_proj.weight"), h, width);
}

/// DeltaNet's tensors: `in_proj_qkvz` and `in_proj_ba` cut per key head group into q, k, v, z
/// and b, a (transformers' `fix_query_key_value_ordering`).
fn plan_delta_net(p: &mut Plan, c: &ModelConfig, i: usize) {
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

/// One layer's linear attention weights.
pub(in crate::model) struct Delta {
    q: Linear,
    k: Linear,
    v: Linear,
    /// `[channels, conv_kernel]`: q, k then v.
    conv: Vec<f32>,
    /// Per value head.
    a_log: Vec<f32>,
    /// Per decay input: per value head (DeltaNet) or per value head and key channel (KDA).
    dt_bias: Vec<f32>,
    out_norm: Vec<f32>,
    out: Linear,
    gates: Gates,
}

/// The projections of a layer's beta, decay and output gate.
enum Gates {
    /// `z` (the output gate, per value channel), `b` and `a` (per value head).
    DeltaNet { z: Linear, b: Linear, a: Linear },
    /// `b` (per head); the decay input `f_b(f_a(x))` and the output gate `g_b(g_a(x))`, both
    /// per head and channel.
    Kda {
        b: Linear,
        f_a: Linear,
        f_b: Linear,
        g_a: Linear,
        g_b: Linear,
    },
}

impl Delta {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Delta> {
        let d = dims(c);
        let h = c.hidden_size;
        let n = |s: &str| format!("layers.{i}.{s}");
        let (kd, vd) = (d.key_heads * d.key_dim, d.value_heads * d.value_dim);
        let (conv, gates, decay_inputs) = match d.kind {
            LinearKind::GatedDeltaNet => (
                t.vector(&n("conv"), conv_channels(&d) * d.conv_kernel)?,
                Gates::DeltaNet {
                    z: t.linear(&n("z"), vd, h)?,
                    b: t.linear(&n("b"), d.value_heads, h)?,
                    a: t.linear(&n("a"), d.value_heads, h)?,
                },
                d.value_heads,
            ),
            LinearKind::Kda => {
                let mut conv = t.vector(&n("q_conv"), kd * d.conv_kernel)?;
                conv.extend(t.vector(&n("k_conv"), kd * d.conv_kernel)?);
                conv.extend(t.vector(&n("v_conv"), vd * d.conv_kernel)?);
                let rank = d.key_dim;
                let gates = Gates::Kda {
                    b: t.linear(&n("b"), d.value_heads, h)?,
                    f_a: t.linear(&n("f_a"), rank, h)?,
                    f_b: t.linear(&n("f_b"), kd, rank)?,
                    g_a: t.linear(&n("g_a"), rank, h)?,
                    g_b: t.linear(&n("g_b"), vd, rank)?,
                };
                (conv, gates, kd)
            }
        };
        Ok(Delta {
            q: t.linear(&n("q"), kd, h)?,
            k: t.linear(&n("k"), kd, h)?,
            v: t.linear(&n("v"), vd, h)?,
            conv,
            a_log: t.vector(&n("a_log"), d.value_heads)?,
            dt_bias: t.vector(&n("dt_bias"), decay_inputs)?,
            out_norm: t.vector(&n("out_norm"), d.value_dim)?,
            out: t.linear(&n("out"), h, vd)?,
            gates,
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
        // `gate`: the output gate's input per (row, value channel); `a`: the decay's input per
        // (row, value head, `dw` channels).
        let (q, k, v, gate, b, a, dw) = match w.gates {
            Gates::DeltaNet { z, b, a } => {
                let [q, k, v, z, b, a]: [Vec<f32>; 6] = self
                    .project(&[w.q, w.k, w.v, z, b, a], &mut acts)
                    .try_into()
                    .expect("six projections");
                (q, k, v, z, b, a, 1)
            }
            Gates::Kda {
                b,
                f_a,
                f_b,
                g_a,
                g_b,
            } => {
                let [q, k, v, b, fa, ga]: [Vec<f32>; 6] = self
                    .project(&[w.q, w.k, w.v, b, f_a, g_a], &mut acts)
                    .try_into()
                    .expect("six projections");
                let f = self
                    .project(&[f_b], &mut Acts::from_vec(fa, n, hk))
                    .remove(0);
                let g = self
                    .project(&[g_b], &mut Acts::from_vec(ga, n, hk))
                    .remove(0);
                (q, k, v, g, b, f, hk)
            }
        };
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
        // The log decay g per (row, value head, `dw` channels).
        let log_decay: Vec<f32> = a
            .iter()
            .enumerate()
            .map(|(t, &x)| {
                let at = t % (nv * dw);
                -w.a_log[at / dw].exp() * ops::softplus(x + w.dt_bias[at])
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
            let form = Form::for_step(rows.len(), self.delta_chunked_from);
            let kernel = crate::attention::Kernel::best();
            for_each_chunk_mut(&self.pool, state, hk * hv, |j, sm| {
                let kh = j / r;
                let mut out = heads_out[j].lock().unwrap_or_else(|e| e.into_inner());
                let at = |data, offset, stride, width| Rows {
                    data,
                    offset: rows.start * stride + offset,
                    stride,
                    width,
                };
                let x = HeadInputs {
                    len: rows.len(),
                    q: at(&mixed, kh * hk, ch, hk),
                    k: at(&mixed, kd + kh * hk, ch, hk),
                    v: at(&mixed, 2 * kd + j * hv, ch, hv),
                    g: at(&log_decay, j * dw, nv * dw, dw),
                    beta: at(&beta, j, nv, 1),
                };
                delta_rule::run(kernel, form, &x, sm, &mut out);
            });
            for (j, ho) in heads_out.into_iter().enumerate() {
                let ho = ho.into_inner().unwrap_or_else(|e| e.into_inner());
                for (t, row) in rows.clone().enumerate() {
                    o[row * vd + j * hv..row * vd + (j + 1) * hv]
                        .copy_from_slice(&ho[t * hv..(t + 1) * hv]);
                }
            }
        }
        // Gated RMSNorm per value head: rms(o) * weight * silu(z) (DeltaNet) or
        // sigmoid(gate) (KDA).
        let act: fn(f32) -> f32 = match d.kind {
            LinearKind::GatedDeltaNet => silu,
            LinearKind::Kda => ops::sigmoid,
        };
        self.per_position(&mut o, vd, |i, row| {
            for (j, head) in row.chunks_exact_mut(hv).enumerate() {
                ops::rms_norm(head, &w.out_norm, eps);
                let gh = &gate[i * vd + j * hv..i * vd + (j + 1) * hv];
                for (x, &g) in head.iter_mut().zip(gh) {
                    *x *= act(g);
                }
            }
        });
        let mut acts = Acts::from_vec(o, n, vd);
        self.project(&[w.out], &mut acts).remove(0)
    }
}
