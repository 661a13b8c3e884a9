//! DeepSeek-V4's attention (transformers' `DeepseekV4Attention` with its compressors and
//! lightning indexer).
//!
//! Per position: the query `q_b(rms(q_a x))`, each head RMS-normed without a weight; one key
//! that is also the value, `rms(kv x)`; both rotated on their last `rope_dim` dims (interleaved
//! pairs). Each head attends over the last `sliding_window` positions' keys and, by the layer's
//! kind, compressed entries of the history; a per-head sink logit joins the softmax's
//! denominator; the output is rotated back (minus the angles), then projected per group of heads
//! (`o_a`, `o_groups` row blocks) and mixed (`o_b`).
//!
//! A compressor turns every window of `rate` positions into one entry: per channel, a softmax
//! over the window's gate values (plus a learned bias per slot) weighs its values; the sum is
//! RMS-normed and rotated at the window's first position. HCA layers attend over every entry
//! whose window is complete; CSA layers' windows overlap (each entry also weighs the previous
//! window's first half of a two-part projection) and an indexer with its own compressor scores
//! the entries per query (`sum_h w_h * relu(q_h . k)`), the `index_topk` best attended.
//!
//! The cache keeps, per position and layer, one row: the rotated key, and for the compressed
//! layers the compressor's per-position values and gates (the inputs of later entries) and, at
//! the last position of each window, the window's entry ([`row_layout`]). So the history of a
//! position never depends on later ones, and prefix reuse, forks and slot files work on it as
//! on any other layer. (Every position's key stays, though the window needs only the last
//! ones: memory to take back when long contexts need it.)

use super::{write_rows, SeqRows};
use crate::config::{AttentionKind, CompressKind, CompressedDims, ModelConfig};
use crate::error::Result;
use crate::format::DType;
use crate::kv::{KvCache, KvLayout, LayerKv};
use crate::linear::{Acts, Linear};
use crate::model::load::Tensors;
use crate::model::plan::Plan;
use crate::model::{fmt_err, Model};
use crate::ops::{self, Rope};

pub(super) fn dims(c: &ModelConfig) -> CompressedDims {
    match c.attention {
        AttentionKind::Compressed(d) => d,
        _ => unreachable!("a compressed-attention block of another config"),
    }
}

/// Where each part sits in a layer's cache row (floats from the row's start).
#[derive(Clone, Copy, Debug)]
struct RowLayout {
    /// Compressor values, gates (each `comp_in` wide) and the entry (`head_dim`).
    comp_kv: usize,
    comp_gate: usize,
    comp_entry: usize,
    comp_in: usize,
    /// The indexer's (`2 * index_head_dim` wide, and its entry `index_head_dim`).
    idx_kv: usize,
    idx_gate: usize,
    idx_entry: usize,
    width: usize,
}

fn row_layout(c: &ModelConfig, kind: CompressKind) -> RowLayout {
    let d = dims(c);
    let hd = c.head_dim;
    let mut at = hd;
    let comp_in = match kind {
        CompressKind::Sliding => 0,
        CompressKind::Heavy => hd,
        CompressKind::Sparse => 2 * hd,
    };
    let (comp_kv, comp_gate, comp_entry) = (at, at + comp_in, at + 2 * comp_in);
    if kind != CompressKind::Sliding {
        at += 2 * comp_in + hd;
    }
    let iin = 2 * d.index_head_dim;
    let (idx_kv, idx_gate, idx_entry) = (at, at + iin, at + 2 * iin);
    if kind == CompressKind::Sparse {
        at += 2 * iin + d.index_head_dim;
    }
    RowLayout {
        comp_kv,
        comp_gate,
        comp_entry,
        comp_in,
        idx_kv,
        idx_gate,
        idx_entry,
        width: at,
    }
}

/// What every layer keeps per position: one row ([`row_layout`]).
pub fn kv_layout(c: &ModelConfig) -> KvLayout {
    KvLayout {
        layers: c
            .compress_layers
            .iter()
            .map(|&k| LayerKv {
                heads: 1,
                key_dim: row_layout(c, k).width,
                value_dim: 0,
            })
            .collect(),
    }
}

/// The tensors of layer `i`'s attention block.
pub fn plan(p: &mut Plan, c: &ModelConfig, i: usize) {
    let d = dims(c);
    let (h, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim);
    let hf = |s: &str| format!("model.layers.{i}.self_attn.{s}");
    let n = |s: &str| format!("layers.{i}.{s}");
    p.matrix(n("q_a"), hf("q_a_proj.weight"), d.q_lora_rank, h);
    p.vector(n("q_a_norm"), hf("q_a_norm.weight"), d.q_lora_rank);
    p.matrix(n("q_b"), hf("q_b_proj.weight"), heads * hd, d.q_lora_rank);
    p.matrix(n("kv"), hf("kv_proj.weight"), hd, h);
    p.vector(n("kv_norm"), hf("kv_norm.weight"), hd);
    let group_in = heads * hd / d.o_groups;
    p.matrix(
        n("o_a"),
        hf("o_a_proj.weight"),
        d.o_groups * d.o_lora_rank,
        group_in,
    );
    p.matrix(
        n("o_b"),
        hf("o_b_proj.weight"),
        h,
        d.o_groups * d.o_lora_rank,
    );
    p.vector(n("sinks"), hf("sinks"), heads);
    let kind = c.compress_layers[i];
    let rate = rate(&d, kind);
    let lay = row_layout(c, kind);
    if kind != CompressKind::Sliding {
        let cin = lay.comp_in;
        p.matrix(n("comp.kv"), hf("compressor.kv_proj.weight"), cin, h);
        p.matrix(n("comp.gate"), hf("compressor.gate_proj.weight"), cin, h);
        p.f32_matrix(n("comp.ape"), hf("compressor.position_bias"), rate, cin);
        p.vector(n("comp.norm"), hf("compressor.kv_norm.weight"), hd);
    }
    if kind == CompressKind::Sparse {
        let (ih, ihd) = (d.index_heads, d.index_head_dim);
        let x = |s: &str| hf(&format!("compressor.indexer.{s}"));
        p.matrix(n("idx.kv"), x("kv_proj.weight"), 2 * ihd, h);
        p.matrix(n("idx.gate"), x("gate_proj.weight"), 2 * ihd, h);
        p.f32_matrix(n("idx.ape"), x("position_bias"), rate, 2 * ihd);
        p.vector(n("idx.norm"), x("kv_norm.weight"), ihd);
        p.matrix(n("idx.q_b"), x("q_b_proj.weight"), ih * ihd, d.q_lora_rank);
        p.f32_matrix(n("idx.weights"), x("scorer.weights_proj.weight"), ih, h);
    }
}

fn rate(d: &CompressedDims, kind: CompressKind) -> usize {
    match kind {
        CompressKind::Heavy => d.hca_rate,
        _ => d.csa_rate,
    }
}

/// One compressor: per position `values` and `gates` (`inputs` wide), a learned bias per slot
/// of the window (`ape`, `[rate, inputs]`), the entry's RMSNorm weight (`width`).
struct Compressor {
    kv: Linear,
    gate: Linear,
    ape: Vec<f32>,
    norm: Vec<f32>,
    rate: usize,
    width: usize,
    /// CSA: an entry weighs the previous window's first half of the inputs and its own
    /// window's second half (`inputs` = `2 * width`); HCA: its own window (`inputs` = `width`).
    overlap: bool,
}

impl Compressor {
    fn load(
        t: &Tensors,
        prefix: &str,
        h: usize,
        rate: usize,
        width: usize,
        overlap: bool,
    ) -> Result<Self> {
        let inputs = if overlap { 2 * width } else { width };
        Ok(Compressor {
            kv: t.linear(&format!("{prefix}.kv"), inputs, h)?,
            gate: t.linear(&format!("{prefix}.gate"), inputs, h)?,
            ape: t.vector(&format!("{prefix}.ape"), rate * inputs)?,
            norm: t.vector(&format!("{prefix}.norm"), width)?,
            rate,
            width,
            overlap,
        })
    }

    /// The entry of window `w` from the rows of positions `first ..` (each `[values | gates]`,
    /// `2 * inputs` wide): `2 * rate` rows from `(w - 1) * rate` for an overlapping compressor
    /// past its first window, else `rate` rows from `w * rate`. Not yet normed or rotated.
    fn entry(&self, w: usize, rows: &[f32]) -> Vec<f32> {
        let (m, width) = (self.rate, self.width);
        let inputs = if self.overlap { 2 * width } else { width };
        let row = |j: usize| &rows[j * 2 * inputs..(j + 1) * 2 * inputs];
        // (row, column offset of this half, slot) of every slot the entry weighs.
        let mut slots: Vec<(usize, usize, usize)> = Vec::with_capacity(2 * m);
        if self.overlap {
            let cur = if w > 0 { m } else { 0 };
            if w > 0 {
                slots.extend((0..m).map(|j| (j, 0, j)));
            }
            slots.extend((0..m).map(|j| (cur + j, width, j)));
        } else {
            slots.extend((0..m).map(|j| (j, 0, j)));
        }
        let mut out = vec![0.0f32; width];
        let mut logits = vec![0.0f32; slots.len()];
        for (ch, o) in out.iter_mut().enumerate() {
            for (l, &(r, off, j)) in logits.iter_mut().zip(&slots) {
                *l = row(r)[inputs + off + ch] + self.ape[j * inputs + off + ch];
            }
            let mx = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0.0f32;
            let mut acc = 0.0f32;
            for (&l, &(r, off, _)) in logits.iter().zip(&slots) {
                let e = (l - mx).exp();
                sum += e;
                acc += e * row(r)[off + ch];
            }
            *o = acc / sum;
        }
        out
    }

    /// The positions whose rows [`Compressor::entry`] reads for window `w`.
    fn source(&self, w: usize) -> std::ops::Range<usize> {
        let m = self.rate;
        if self.overlap && w > 0 {
            (w - 1) * m..(w + 1) * m
        } else {
            w * m..(w + 1) * m
        }
    }
}

/// The CSA indexer: its compressor, query heads over the normed low-rank query, and the
/// per-head weights from the layer's input.
struct Indexer {
    comp: Compressor,
    q_b: Linear,
    weights: Linear,
}

/// One layer's DeepSeek-V4 attention weights.
pub(in crate::model) struct Compressed {
    q_a: Linear,
    q_a_norm: Vec<f32>,
    q_b: Linear,
    kv: Linear,
    kv_norm: Vec<f32>,
    o_a: Linear,
    o_b: Linear,
    sinks: Vec<f32>,
    comp: Option<Compressor>,
    indexer: Option<Indexer>,
    /// The layer's RoPE (`main` for sliding layers, else `compress`) and the compressors' and
    /// indexer's (`compress`).
    rope: Rope,
    comp_rope: Rope,
    row: RowLayout,
}

impl Compressed {
    pub(in crate::model) fn load(t: &Tensors, c: &ModelConfig, i: usize) -> Result<Compressed> {
        let d = dims(c);
        let (h, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim);
        let n = |s: &str| format!("layers.{i}.{s}");
        let kind = c.compress_layers[i];
        let comp_rope = Rope::scaled(d.rope_dim, d.compress_theta, &d.compress_scaling);
        let rope = match kind {
            CompressKind::Sliding => Rope::scaled(d.rope_dim, d.main_theta, &d.main_scaling),
            _ => Rope::scaled(d.rope_dim, d.compress_theta, &d.compress_scaling),
        };
        let r = rate(&d, kind);
        let comp = match kind {
            CompressKind::Sliding => None,
            k => Some(Compressor::load(
                t,
                &n("comp"),
                h,
                r,
                hd,
                k == CompressKind::Sparse,
            )?),
        };
        let indexer = match kind {
            CompressKind::Sparse => {
                let (ih, ihd) = (d.index_heads, d.index_head_dim);
                let weights = t.linear(&n("idx.weights"), ih, h)?;
                if weights.dtype != DType::F32 {
                    return Err(fmt_err(format!(
                        "tensor `{}` should be f32",
                        n("idx.weights")
                    )));
                }
                Some(Indexer {
                    comp: Compressor::load(t, &n("idx"), h, r, ihd, true)?,
                    q_b: t.linear(&n("idx.q_b"), ih * ihd, d.q_lora_rank)?,
                    weights,
                })
            }
            _ => None,
        };
        Ok(Compressed {
            q_a: t.linear(&n("q_a"), d.q_lora_rank, h)?,
            q_a_norm: t.vector(&n("q_a_norm"), d.q_lora_rank)?,
            q_b: t.linear(&n("q_b"), heads * hd, d.q_lora_rank)?,
            kv: t.linear(&n("kv"), hd, h)?,
            kv_norm: t.vector(&n("kv_norm"), hd)?,
            o_a: t.linear(
                &n("o_a"),
                d.o_groups * d.o_lora_rank,
                heads * hd / d.o_groups,
            )?,
            o_b: t.linear(&n("o_b"), h, d.o_groups * d.o_lora_rank)?,
            sinks: t.vector(&n("sinks"), heads)?,
            comp,
            indexer,
            rope,
            comp_rope,
            row: row_layout(c, kind),
        })
    }
}

impl Model {
    /// Layer `li`'s attention over the normed inputs `hn` of every sequence of the pass;
    /// writes each position's cache row (and the entries of the windows it completes).
    pub(in crate::model) fn compressed_attention(
        &self,
        li: usize,
        w: &Compressed,
        hn: Vec<f32>,
        seqs: &mut [SeqRows],
    ) -> Vec<f32> {
        let c = &self.cfg;
        let d = dims(c);
        let (h, heads, hd) = (c.hidden_size, c.num_heads, c.head_dim);
        let eps = c.rms_norm_eps;
        let n = hn.len() / h;
        let lay = w.row;
        // Each row's position in its sequence.
        let mut pos = vec![0usize; n];
        for s in seqs.iter() {
            for (k, r) in s.rows.clone().enumerate() {
                pos[r] = s.kv.len + k;
            }
        }
        let mut acts = Acts::from_vec(hn, n, h);
        let mut ws = vec![w.q_a, w.kv];
        if let Some(cp) = &w.comp {
            ws.extend([cp.kv, cp.gate]);
        }
        if let Some(ix) = &w.indexer {
            ws.extend([ix.comp.kv, ix.comp.gate, ix.weights]);
        }
        let mut outs = self.project(&ws, &mut acts).into_iter();
        let mut qa = outs.next().unwrap();
        let mut kv = outs.next().unwrap();
        let comp_in = w
            .comp
            .as_ref()
            .map(|_| (outs.next().unwrap(), outs.next().unwrap()));
        let idx_in = w.indexer.as_ref().map(|_| {
            (
                outs.next().unwrap(),
                outs.next().unwrap(),
                outs.next().unwrap(),
            )
        });

        let rank = d.q_lora_rank;
        self.per_position(&mut qa, rank, |_, row| ops::rms_norm(row, &w.q_a_norm, eps));
        let mut qa = Acts::from_vec(qa, n, rank);
        let mut qws = vec![w.q_b];
        if let Some(ix) = &w.indexer {
            qws.push(ix.q_b);
        }
        let mut qouts = self.project(&qws, &mut qa).into_iter();
        let mut q = qouts.next().unwrap();
        let mut iq = qouts.next();
        self.per_position(&mut q, heads * hd, |i, row| {
            row.chunks_exact_mut(hd)
                .for_each(|head| ops::rms_norm_unweighted(head, eps));
            w.rope
                .apply_interleaved_tail(row, hd, &w.rope.angles(pos[i]), false);
        });
        self.per_position(&mut kv, hd, |i, row| {
            ops::rms_norm(row, &w.kv_norm, eps);
            w.rope
                .apply_interleaved_tail(row, hd, &w.rope.angles(pos[i]), false);
        });
        if let Some(iq) = iq.as_mut() {
            let ihd = d.index_head_dim;
            self.per_position(iq, d.index_heads * ihd, |i, row| {
                w.comp_rope
                    .apply_interleaved_tail(row, ihd, &w.comp_rope.angles(pos[i]), false);
            });
        }

        // The cache rows: the key, and each compressor's values and gates (entries follow).
        let mut rows = vec![0.0f32; n * lay.width];
        for (i, row) in rows.chunks_exact_mut(lay.width).enumerate() {
            row[..hd].copy_from_slice(&kv[i * hd..(i + 1) * hd]);
            if let Some((ckv, cg)) = &comp_in {
                let ci = lay.comp_in;
                row[lay.comp_kv..lay.comp_kv + ci].copy_from_slice(&ckv[i * ci..(i + 1) * ci]);
                row[lay.comp_gate..lay.comp_gate + ci].copy_from_slice(&cg[i * ci..(i + 1) * ci]);
            }
            if let Some((ikv, ig, _)) = &idx_in {
                let ii = 2 * d.index_head_dim;
                row[lay.idx_kv..lay.idx_kv + ii].copy_from_slice(&ikv[i * ii..(i + 1) * ii]);
                row[lay.idx_gate..lay.idx_gate + ii].copy_from_slice(&ig[i * ii..(i + 1) * ii]);
            }
        }
        let spans = write_rows(seqs, li, &rows, lay.width, &[], 0);
        self.write_entries(li, w, &spans, seqs);

        let kvs: Vec<&KvCache> = seqs.iter().map(|s| &*s.kv).collect();
        let att = self.attend_compressed(
            li,
            w,
            &spans,
            &kvs,
            &q,
            iq.as_deref(),
            idx_in.as_ref().map(|x| x.2.as_slice()),
            &pos,
        );

        // Grouped output projection: each group of heads through its row block of `o_a`.
        let (g, r) = (d.o_groups, d.o_lora_rank);
        let gw = heads * hd / g;
        let inputs: Vec<Acts> = (0..g)
            .map(|k| {
                let mut x = Vec::with_capacity(n * gw);
                for i in 0..n {
                    let at = i * heads * hd + k * gw;
                    x.extend_from_slice(&att[at..at + gw]);
                }
                Acts::from_vec(x, n, gw)
            })
            .collect();
        let groups = self.per_head_products(&w.o_a, r, inputs);
        let mut mid = Vec::with_capacity(n * g * r);
        for i in 0..n {
            for out in &groups {
                mid.extend_from_slice(&out[i * r..(i + 1) * r]);
            }
        }
        let mut mid = Acts::from_vec(mid, n, g * r);
        self.project(&[w.o_b], &mut mid).remove(0)
    }

    /// The entries of the windows the pass's positions complete, written at each window's last
    /// position (the values and gates they read are in the cache already).
    fn write_entries(
        &self,
        li: usize,
        w: &Compressed,
        spans: &[super::Span],
        seqs: &mut [SeqRows],
    ) {
        let lay = w.row;
        let eps = self.cfg.rms_norm_eps;
        // (sequence, window, indexer?) of every completed window.
        let mut tasks: Vec<(usize, usize, bool)> = Vec::new();
        for (s, sp) in spans.iter().enumerate() {
            for (comp, idx) in [
                (w.comp.as_ref(), false),
                (w.indexer.as_ref().map(|x| &x.comp), true),
            ] {
                let Some(cp) = comp else { continue };
                for p in sp.p0..sp.p0 + sp.n {
                    if (p + 1).is_multiple_of(cp.rate) {
                        tasks.push((s, (p + 1) / cp.rate - 1, idx));
                    }
                }
            }
        }
        if tasks.is_empty() {
            return;
        }
        let kvs: Vec<&KvCache> = seqs.iter().map(|s| &*s.kv).collect();
        let entries = self.pool.map(tasks.len(), |t| {
            let (s, win, idx) = tasks[t];
            let (cp, start) = if idx {
                (&w.indexer.as_ref().unwrap().comp, lay.idx_kv)
            } else {
                (w.comp.as_ref().unwrap(), lay.comp_kv)
            };
            let inputs = if cp.overlap { 2 * cp.width } else { cp.width };
            let rows = kvs[s].key_columns(li, cp.source(win), start..start + 2 * inputs);
            let mut e = cp.entry(win, &rows);
            ops::rms_norm(&mut e, &cp.norm, eps);
            let angles = w.comp_rope.angles(win * cp.rate);
            w.comp_rope
                .apply_interleaved_tail(&mut e, cp.width, &angles, false);
            e
        });
        drop(kvs);
        for (&(s, win, idx), e) in tasks.iter().zip(entries) {
            let (rate, at) = if idx {
                (w.indexer.as_ref().unwrap().comp.rate, lay.idx_entry)
            } else {
                (w.comp.as_ref().unwrap().rate, lay.comp_entry)
            };
            seqs[s].kv.write_key_part(li, (win + 1) * rate - 1, at, &e);
        }
    }

    /// Every row's attention output (`heads * head_dim`, rotated back), row-major.
    #[allow(clippy::too_many_arguments)]
    fn attend_compressed(
        &self,
        li: usize,
        w: &Compressed,
        spans: &[super::Span],
        kvs: &[&KvCache],
        q: &[f32],
        iq: Option<&[f32]>,
        iw: Option<&[f32]>,
        pos: &[usize],
    ) -> Vec<f32> {
        let c = &self.cfg;
        let d = dims(c);
        let (heads, hd) = (c.num_heads, c.head_dim);
        let lay = w.row;
        let win = d.sliding_window;
        let scale = 1.0 / (hd as f32).sqrt();
        // Per sequence: the keys the pass's rows may see (from the first row's window to the
        // last row) and the entries complete by the last row.
        struct Seen {
            first: usize,
            keys: Vec<f32>,
            entries: Vec<f32>,
            index_keys: Vec<f32>,
        }
        let seen: Vec<Seen> = spans
            .iter()
            .enumerate()
            .map(|(s, sp)| {
                let first = (sp.p0 + 1).saturating_sub(win);
                let end = sp.p0 + sp.n;
                let keys = kvs[s].key_columns(li, first..end, 0..hd);
                let (mut entries, mut index_keys) = (Vec::new(), Vec::new());
                if let Some(cp) = &w.comp {
                    let last = (0..end / cp.rate).map(|e| (e + 1) * cp.rate - 1);
                    entries = kvs[s].key_columns(li, last, lay.comp_entry..lay.comp_entry + hd);
                }
                if let Some(ix) = &w.indexer {
                    let ihd = ix.comp.width;
                    let last = (0..end / ix.comp.rate).map(|e| (e + 1) * ix.comp.rate - 1);
                    index_keys = kvs[s].key_columns(li, last, lay.idx_entry..lay.idx_entry + ihd);
                }
                Seen {
                    first,
                    keys,
                    entries,
                    index_keys,
                }
            })
            .collect();
        let row_span: Vec<usize> = {
            let mut v = vec![0; q.len() / (heads * hd)];
            for (s, sp) in spans.iter().enumerate() {
                v[sp.row0..sp.row0 + sp.n].fill(s);
            }
            v
        };
        // Each row's keys: its window, then the entries it attends (the indexer's choice).
        let keys: Vec<Vec<&[f32]>> = self.pool.map(row_span.len(), |i| {
            let (s, p) = (row_span[i], pos[i]);
            let sn = &seen[s];
            let mut keys: Vec<&[f32]> = Vec::new();
            for k in (p + 1).saturating_sub(win)..=p {
                let at = (k - sn.first) * hd;
                keys.push(&sn.keys[at..at + hd]);
            }
            if let Some(cp) = &w.comp {
                let ready = (p + 1) / cp.rate;
                let chosen: Vec<usize> = match (&w.indexer, iq, iw) {
                    (Some(ix), Some(iq), Some(iw)) => {
                        let (ih, ihd) = (d.index_heads, ix.comp.width);
                        let qi = &iq[i * ih * ihd..(i + 1) * ih * ihd];
                        let wi = &iw[i * ih..(i + 1) * ih];
                        index_choice(qi, wi, &sn.index_keys, ready, ihd, d.index_topk)
                    }
                    _ => (0..ready).collect(),
                };
                for e in chosen {
                    keys.push(&sn.entries[e * hd..(e + 1) * hd]);
                }
            }
            keys
        });
        // Every (row, head) on its own: decode's one row still spreads over the threads.
        let outs = self.pool.map(row_span.len() * heads, |t| {
            let (i, head) = (t / heads, t % heads);
            let qh = &q[(i * heads + head) * hd..(i * heads + head + 1) * hd];
            attend_with_sink(qh, &keys[i], w.sinks[head], scale)
        });
        let mut att = outs.concat();
        self.per_position(&mut att, heads * hd, |i, row| {
            w.rope
                .apply_interleaved_tail(row, hd, &w.rope.angles(pos[i]), true);
        });
        att
    }
}

/// The `topk` entries (of the first `ready`) the indexer scores highest for one query
/// (`sum_h w_h / sqrt(heads) * relu(q_h . k) / sqrt(head_dim)`), ascending; ties to the lower
/// index.
fn index_choice(
    q: &[f32],
    weights: &[f32],
    keys: &[f32],
    ready: usize,
    head_dim: usize,
    topk: usize,
) -> Vec<usize> {
    let qscale = 1.0 / (head_dim as f32).sqrt();
    let wscale = 1.0 / (weights.len() as f32).sqrt();
    let scores: Vec<f32> = (0..ready)
        .map(|e| {
            let k = &keys[e * head_dim..(e + 1) * head_dim];
            q.chunks_exact(head_dim)
                .zip(weights)
                .map(|(qh, &wh)| wh * wscale * (ops::dot(qh, k).max(0.0) * qscale))
                .sum()
        })
        .collect();
    let mut order: Vec<usize> = (0..ready).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    order.truncate(topk);
    order.sort_unstable();
    order
}

/// One head's attention over `keys` (which are also the values) with a sink logit in the
/// softmax's denominator.
fn attend_with_sink(q: &[f32], keys: &[&[f32]], sink: f32, scale: f32) -> Vec<f32> {
    let mut logits: Vec<f32> = keys.iter().map(|k| ops::dot(q, k) * scale).collect();
    let mx = logits.iter().copied().fold(sink, f32::max);
    let mut sum = (sink - mx).exp();
    for l in logits.iter_mut() {
        *l = (*l - mx).exp();
        sum += *l;
    }
    let mut out = vec![0.0f32; q.len()];
    for (l, k) in logits.iter().zip(keys) {
        let p = l / sum;
        for (o, v) in out.iter_mut().zip(k.iter()) {
            *o += p * v;
        }
    }
    out
}
