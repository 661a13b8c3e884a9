//! Manifold-constrained hyper-connections (DeepSeek-V4, transformers'
//! `DeepseekV4HyperConnection` / `DeepseekV4HyperHead`).
//!
//! The residual of each position is `N` streams of `hidden` values. Around a block, the streams
//! (flattened, RMS-normed without a weight) are projected to `2N + N*N` numbers: `pre` (sigmoid,
//! plus `eps`) collapses the streams into the block's input, `post` (twice a sigmoid) spreads
//! the block's output over the streams, and `comb` (a row softmax plus `eps`, made doubly
//! stochastic by `sinkhorn_iters` Sinkhorn-Knopp steps) mixes the old streams into the new:
//! `new[k] = post[k] * y + sum_j comb[j][k] * old[j]`. At the end, the head collapses the
//! streams once more (its own `pre`) before the final norm. All of it in f32, as transformers
//! keeps these weights.

use crate::config::{HyperDims, ModelConfig};
use crate::error::Result;
use crate::format::DType;
use crate::linear::{Acts, Linear};
use crate::model::load::Tensors;
use crate::model::{fmt_err, Model};
use crate::ops::sigmoid;

/// One block's hyper-connection weights: `fn` `[(2 + N) * N, N * hidden]`, `base`
/// `[(2 + N) * N]`, `scale` `[3]`.
pub(in crate::model) struct HyperMix {
    proj: Linear,
    base: Vec<f32>,
    scale: Vec<f32>,
}

/// The final collapse: `fn` `[N, N * hidden]`, `base` `[N]`, `scale` `[1]`.
pub(in crate::model) struct HyperHead {
    proj: Linear,
    base: Vec<f32>,
    scale: f32,
}

fn f32_linear(t: &Tensors, name: &str, rows: usize, cols: usize) -> Result<Linear> {
    let l = t.linear(name, rows, cols)?;
    if l.dtype != DType::F32 {
        return Err(fmt_err(format!("tensor `{name}` should be f32")));
    }
    Ok(l)
}

impl HyperMix {
    /// `{prefix}.fn|base|scale`.
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, prefix: &str) -> Result<HyperMix> {
        let n = c.hyper.map_or(1, |h| h.mult);
        let m = (2 + n) * n;
        Ok(HyperMix {
            proj: f32_linear(t, &format!("{prefix}.fn"), m, n * c.hidden_size)?,
            base: t.vector(&format!("{prefix}.base"), m)?,
            scale: t.vector(&format!("{prefix}.scale"), 3)?,
        })
    }
}

impl HyperHead {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig) -> Result<HyperHead> {
        let n = c.hyper.map_or(1, |h| h.mult);
        Ok(HyperHead {
            proj: f32_linear(t, "hc_head.fn", n, n * c.hidden_size)?,
            base: t.vector("hc_head.base", n)?,
            scale: t.vector("hc_head.scale", 1)?[0],
        })
    }
}

/// One position's mixing weights for the way out of a block: `post` (`N`) then `comb`
/// (`N * N`, `[j][k]`).
pub(in crate::model) type Mix = Vec<f32>;

impl Model {
    /// The streams' projections `proj * rms(streams)` for every position of `x` (`N * hidden`
    /// per position).
    fn hyper_project(&self, proj: &Linear, x: &[f32]) -> Vec<f32> {
        let wide = proj.cols;
        let n = x.len() / wide;
        let mut flat = x.to_vec();
        let eps = self.cfg.rms_norm_eps;
        self.per_position(&mut flat, wide, |_, row| {
            crate::ops::rms_norm_unweighted(row, eps)
        });
        let mut acts = Acts::from_vec(flat, n, wide);
        self.project(&[*proj], &mut acts).remove(0)
    }

    /// A block's input from the streams `x` (one `N * hidden` row per position): the collapsed
    /// rows (`hidden` each) and each position's [`Mix`] for [`Model::hyper_expand`].
    pub(in crate::model) fn hyper_collapse(
        &self,
        w: &HyperMix,
        d: HyperDims,
        x: &[f32],
    ) -> (Vec<f32>, Vec<Mix>) {
        let (n, h) = (d.mult, self.cfg.hidden_size);
        let m = (2 + n) * n;
        let mixes = self.hyper_project(&w.proj, x);
        let rows = x.len() / (n * h);
        let eps = d.eps;
        let outs = self.pool.map(rows, |i| {
            let raw = &mixes[i * m..(i + 1) * m];
            let pre: Vec<f32> = (0..n)
                .map(|j| sigmoid(raw[j] * w.scale[0] + w.base[j]) + eps)
                .collect();
            let mut mix: Mix = (0..n)
                .map(|k| 2.0 * sigmoid(raw[n + k] * w.scale[1] + w.base[n + k]))
                .collect();
            let mut comb: Vec<f32> = (0..n * n)
                .map(|jk| raw[2 * n + jk] * w.scale[2] + w.base[2 * n + jk])
                .collect();
            for row in comb.chunks_exact_mut(n) {
                crate::ops::softmax(row);
                row.iter_mut().for_each(|v| *v += eps);
            }
            normalize_columns(&mut comb, n, eps);
            for _ in 1..d.sinkhorn_iters {
                for row in comb.chunks_exact_mut(n) {
                    let s: f32 = row.iter().sum::<f32>() + eps;
                    row.iter_mut().for_each(|v| *v /= s);
                }
                normalize_columns(&mut comb, n, eps);
            }
            mix.extend_from_slice(&comb);
            let streams = &x[i * n * h..(i + 1) * n * h];
            let mut collapsed = vec![0.0f32; h];
            for (p, s) in pre.iter().zip(streams.chunks_exact(h)) {
                for (o, v) in collapsed.iter_mut().zip(s) {
                    *o += p * v;
                }
            }
            (collapsed, mix)
        });
        let mut collapsed = Vec::with_capacity(rows * h);
        let mut mixes = Vec::with_capacity(rows);
        for (c, m) in outs {
            collapsed.extend_from_slice(&c);
            mixes.push(m);
        }
        (collapsed, mixes)
    }

    /// The streams after a block: `new[k] = post[k] * y + sum_j comb[j][k] * old[j]` per
    /// position, `y` the block's output (`hidden` per position).
    pub(in crate::model) fn hyper_expand(
        &self,
        d: HyperDims,
        x: &mut [f32],
        y: &[f32],
        mix: &[Mix],
    ) {
        let (n, h) = (d.mult, self.cfg.hidden_size);
        self.per_position(x, n * h, |i, streams| {
            let (post, comb) = mix[i].split_at(n);
            let old = streams.to_vec();
            let yi = &y[i * h..(i + 1) * h];
            for (k, out) in streams.chunks_exact_mut(h).enumerate() {
                for (dst, v) in out.iter_mut().zip(yi) {
                    *dst = post[k] * v;
                }
                for (j, src) in old.chunks_exact(h).enumerate() {
                    let c = comb[j * n + k];
                    for (dst, v) in out.iter_mut().zip(src) {
                        *dst += c * v;
                    }
                }
            }
        });
    }

    /// The head's collapse of the streams `x` (one `N * hidden` row per position).
    pub(in crate::model) fn hyper_head(&self, w: &HyperHead, d: HyperDims, x: &[f32]) -> Vec<f32> {
        let (n, h) = (d.mult, self.cfg.hidden_size);
        let mixes = self.hyper_project(&w.proj, x);
        let rows = x.len() / (n * h);
        let mut out = vec![0.0f32; rows * h];
        self.per_position(&mut out, h, |i, o| {
            for (j, s) in x[i * n * h..(i + 1) * n * h].chunks_exact(h).enumerate() {
                let p = sigmoid(mixes[i * n + j] * w.scale + w.base[j]) + d.eps;
                for (dst, v) in o.iter_mut().zip(s) {
                    *dst += p * v;
                }
            }
        });
        out
    }
}

/// Divides each column of the `n x n` matrix by its sum plus `eps`.
fn normalize_columns(m: &mut [f32], n: usize, eps: f32) {
    for k in 0..n {
        let s: f32 = (0..n).map(|j| m[j * n + k]).sum::<f32>() + eps;
        for j in 0..n {
            m[j * n + k] /= s;
        }
    }
}
