//! A routed mixture of experts: the router picks each token's experts ([`routing`]), the
//! experts' SwiGLU MLPs run from RAM or from the expert cache as their reads land, and their
//! outputs are summed by weight in expert order; an optional shared expert is added.
//!
//! [`routing`]: super::routing

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Instant;

use super::mlp::Mlp;
use super::routing;
use super::Ffn;
use crate::config::{ModelConfig, Routing};
use crate::error::Result;
use crate::format::DType;
use crate::linear::{for_each_chunk_mut, matmul_many, matmul_whole, Acts, Job, Linear, WeightRef};
use crate::model::load::Tensors;
use crate::model::{fmt_err, Experts, Model, Pass};
use crate::ops;
use crate::store::RecordRef;

/// One MoE layer's resident part.
pub(in crate::model) struct Moe {
    /// `[num_experts, hidden]`, f32, viewed in the resident weights (on huge pages, not a
    /// copy: a copy doubled the routers' RAM, 200-300 MB for Qwen3-235B or GLM-4.5).
    router: Linear,
    router_bias: Option<Vec<f32>>,
    /// A hash-routed layer's experts per token id (`[vocab, top_k]`, DeepSeek-V4's `tid2eid`).
    hash: Option<Vec<u32>>,
    first_record: usize,
    /// Index among the MoE layers (routing heat, cache lists).
    moe_idx: usize,
    shared: Option<Mlp>,
    /// The shared expert's gate (Qwen3-Next): its output times `sigmoid(gate x)`, f32 `[1,
    /// hidden]`.
    shared_gate: Option<Linear>,
}

impl Moe {
    /// Layer `i`'s router (and bias, and shared expert); its experts are records
    /// `first_record ..` of the experts file.
    pub(in crate::model) fn load(
        t: &Tensors,
        c: &ModelConfig,
        i: usize,
        first_record: usize,
        moe_idx: usize,
    ) -> Result<Moe> {
        let n = |s: &str| format!("layers.{i}.{s}");
        let h = c.hidden_size;
        let router = t.linear(&n("router"), c.num_experts, h)?;
        if router.dtype != DType::F32 {
            return Err(fmt_err(format!("tensor `{}` should be f32", n("router"))));
        }
        let router_bias = t.optional_vector(&n("router_bias"), c.num_experts)?;
        let hashed = c.hash_layers.get(i).copied().unwrap_or(false);
        let needs_bias = match c.routing {
            Routing::SigmoidGrouped { .. } => true,
            Routing::SqrtSoftplus { .. } => !hashed,
            Routing::SoftmaxTopK { .. } => false,
        };
        if needs_bias && router_bias.is_none() {
            return Err(fmt_err(format!("missing `{}`", n("router_bias"))));
        }
        let hash = if hashed {
            let table = t.vector(&n("hash"), c.vocab_size * c.top_k)?;
            let ids: Option<Vec<u32>> = table
                .iter()
                .map(|&x| {
                    (x >= 0.0 && x.fract() == 0.0 && (x as usize) < c.num_experts)
                        .then_some(x as u32)
                })
                .collect();
            Some(ids.ok_or_else(|| {
                fmt_err(format!(
                    "`{}` holds an entry that is not an expert id below {}",
                    n("hash"),
                    c.num_experts
                ))
            })?)
        } else {
            None
        };
        let shared = if c.shared_intermediate_size > 0 {
            Some(Mlp::load(t, &n("shared"), h, c.shared_intermediate_size)?)
        } else {
            None
        };
        let shared_gate = if t.has(&n("shared_gate")) {
            let g = t.linear(&n("shared_gate"), 1, h)?;
            if g.dtype != DType::F32 {
                return Err(fmt_err(format!(
                    "tensor `{}` should be f32",
                    n("shared_gate")
                )));
            }
            Some(g)
        } else {
            None
        };
        Ok(Moe {
            router,
            router_bias,
            hash,
            shared_gate,
            first_record,
            moe_idx,
            shared,
        })
    }
}

impl Model {
    /// The MoE block of layer `li` for the normed inputs `acts`; `residual` is the stream
    /// entering the block (for the router look-ahead).
    pub(in crate::model) fn moe_block(
        &self,
        m: &Moe,
        acts: &mut Acts,
        li: usize,
        residual: &[f32],
        pass: &mut Pass,
    ) -> Result<Vec<f32>> {
        let at = MoeAt {
            li,
            first_record: m.first_record,
            moe_idx: m.moe_idx,
            residual,
            hash: m.hash.as_deref(),
        };
        let mut y = self.moe(acts, &m.router, m.router_bias.as_deref(), &at, pass)?;
        if let Some(s) = &m.shared {
            let t = Instant::now();
            let mut shared = self.mlp(s, acts);
            if let Some(g) = &m.shared_gate {
                let gates = self.project(&[*g], acts).remove(0);
                let h = self.cfg.hidden_size;
                for (row, &gv) in shared.chunks_exact_mut(h).zip(&gates) {
                    let sg = ops::sigmoid(gv);
                    row.iter_mut().for_each(|x| *x *= sg);
                }
            }
            for (a, b) in y.iter_mut().zip(shared) {
                *a += b;
            }
            pass.times.expert += t.elapsed();
        }
        Ok(y)
    }

    /// Router logits of `router` for every token of `x`, and each token's `(expert, weight)`:
    /// the router's choice, or with a hash table the experts of the row's token (`tokens`).
    fn route(
        &self,
        x: &Acts,
        router: &Linear,
        bias: Option<&[f32]>,
        hash: Option<&[u32]>,
        tokens: &[u32],
    ) -> Vec<Vec<(usize, f32)>> {
        let c = &self.cfg;
        let (n, e) = (x.n, c.num_experts);
        let mut logits = vec![0.0f32; n * e];
        // The router is small but f32 (8 MB a token for OLMoE-1B-7B): split it across threads.
        debug_assert_eq!((router.rows, router.cols), (e, c.hidden_size));
        matmul_many(
            &self.pool,
            self.kernel,
            &mut [Job {
                w: self.w(router),
                x,
                out: &mut logits,
            }],
        );
        let k = c.top_k;
        (0..n)
            .map(|t| {
                let l = &logits[t * e..(t + 1) * e];
                match hash {
                    Some(table) => {
                        let tok = tokens[t] as usize;
                        routing::route_fixed(&c.routing, l, &table[tok * k..(tok + 1) * k])
                    }
                    None => routing::route(&c.routing, k, l, bias),
                }
            })
            .collect()
    }

    /// Router look-ahead: the experts the next MoE layer after `li` would route the residual
    /// stream to now, read ahead of need. Returns (next layer, predicted experts).
    fn prefetch_next(
        &self,
        li: usize,
        residual: &[f32],
        n: usize,
        tokens: &[u32],
    ) -> Option<(usize, Vec<usize>)> {
        let Some(Experts::Store(store)) = &self.experts else {
            return None;
        };
        let next = li + 1;
        let Ffn::Moe(Moe {
            router,
            router_bias,
            hash,
            first_record,
            ..
        }) = &self.layers.get(next)?.ffn
        else {
            return None;
        };
        let mut hn = residual.to_vec();
        ops::rms_norm(&mut hn, &self.layers[next].ffn_norm, self.cfg.rms_norm_eps);
        let acts = Acts::from_vec(hn, n, self.cfg.hidden_size);
        let mut experts: Vec<usize> = self
            .route(
                &acts,
                router,
                router_bias.as_deref(),
                hash.as_deref(),
                tokens,
            )
            .into_iter()
            .flat_map(|r| r.into_iter().map(|(e, _)| e))
            .collect();
        experts.sort_unstable();
        experts.dedup();
        let recs: Vec<u32> = experts.iter().map(|&e| (first_record + e) as u32).collect();
        store.prefetch(&recs);
        Some((next, experts))
    }

    /// Routed experts for every token of `x`, weighted and summed (shared experts excluded).
    /// Cached or resident experts are computed first, the others as their reads finish; the
    /// sum runs in expert order whatever the order of computing, so results never depend on
    /// what was in RAM.
    fn moe(
        &self,
        x: &mut Acts,
        router: &Linear,
        bias: Option<&[f32]>,
        at: &MoeAt,
        pass: &mut Pass,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (n, h) = (x.n, c.hidden_size);
        // expert -> [(token, weight)], in expert order (the order the reference sums them).
        let mut by_expert: BTreeMap<usize, Vec<(usize, f32)>> = BTreeMap::new();
        for (t, r) in self
            .route(x, router, bias, at.hash, &pass.tokens)
            .into_iter()
            .enumerate()
        {
            for (ex, w) in r {
                by_expert.entry(ex).or_default().push((t, w));
            }
        }
        let experts: Vec<(usize, Vec<(usize, f32)>)> = by_expert.into_iter().collect();
        for (ex, toks) in &experts {
            for _ in toks {
                self.heat.add(at.moe_idx, *ex);
            }
        }
        if self.calib.is_on() {
            self.calib.layer_input(at.first_record, &x.x, h);
            for (ex, toks) in &experts {
                let rows: Vec<f32> = toks
                    .iter()
                    .flat_map(|&(t, _)| &x.x[t * h..(t + 1) * h])
                    .copied()
                    .collect();
                for part in [0, 1] {
                    self.calib.expert(at.first_record + ex, part, &rows, h);
                }
            }
        }
        let ids: Vec<usize> = experts.iter().map(|(ex, _)| *ex).collect();
        if let Some((layer, predicted)) = pass.predicted.take() {
            if layer == at.li {
                pass.times.predicted_of += ids.len() as u64;
                pass.times.predicted_hit +=
                    ids.iter().filter(|e| predicted.contains(e)).count() as u64;
            }
        }
        // Each sequence's experts, ascending (the experts come in order).
        let mut per_seq: Vec<Vec<usize>> = vec![Vec::new(); pass.routed.len()];
        for (ex, toks) in &experts {
            for &(t, _) in toks {
                let ids = &mut per_seq[pass.row_seq[t]];
                if ids.last() != Some(ex) {
                    ids.push(*ex);
                }
            }
        }
        for (routed, ids) in pass.routed.iter_mut().zip(per_seq) {
            if !ids.is_empty() {
                routed.push((at.li, ids));
            }
        }
        let q4 = self
            .expert_layout
            .as_ref()
            .is_some_and(|l| l.parts[0].dtype.takes_q8_acts());
        // Inputs per expert: the shared activations when every token goes there (decode);
        // otherwise its tokens' rows, gathered over the pool from the activations quantized
        // once (quantizing per expert again took ~5% of a prefill).
        x.prepare(q4);
        let x = &*x;
        let inputs: Vec<Option<Acts>> = if n == 1 {
            experts.iter().map(|_| None).collect()
        } else {
            self.pool.map(experts.len(), |j| {
                let toks = &experts[j].1;
                (toks.len() != n).then(|| {
                    let rows: Vec<usize> = toks.iter().map(|&(t, _)| t).collect();
                    x.gather(&rows, !q4)
                })
            })
        };
        let mut downs: Vec<Vec<f32>> = vec![Vec::new(); experts.len()];
        let lay = self
            .expert_layout
            .as_ref()
            .expect("MoE layer implies experts");
        match self.experts.as_ref().expect("MoE layer implies experts") {
            Experts::Resident(map) => {
                let t = Instant::now();
                let group: Vec<(usize, [WeightRef; 3])> = experts
                    .iter()
                    .enumerate()
                    .map(|(i, (ex, _))| {
                        let base = (at.first_record + ex) * lay.record_size;
                        (i, self.expert_parts(map, base))
                    })
                    .collect();
                self.expert_group(&group, &experts, at.first_record, &inputs, x, &mut downs);
                pass.times.expert += t.elapsed();
            }
            Experts::Store(store) => {
                let recs: Vec<u32> = experts
                    .iter()
                    .map(|(ex, _)| (at.first_record + ex) as u32)
                    .collect();
                // Rows of several sequences (streams stepped together)?
                let several = pass
                    .row_seq
                    .first()
                    .is_some_and(|&s0| pass.row_seq.iter().any(|&s| s != s0));
                let mut batch = store.request_for(&recs, several);
                // With a slot for every record the look-ahead would only cost a router product
                // per layer: misses (warm-up) are read in the layer's own batch anyway.
                if self.prefetch && !store.holds_all() {
                    pass.predicted = self.prefetch_next(at.li, at.residual, n, &pass.tokens);
                }
                loop {
                    let ready: Vec<(usize, RecordRef)> = batch.next_ready()?;
                    if ready.is_empty() {
                        break;
                    }
                    let t = Instant::now();
                    let group: Vec<(usize, [WeightRef; 3])> = ready
                        .iter()
                        .map(|(i, r)| (*i, self.expert_parts(r.bytes(), 0)))
                        .collect();
                    self.expert_group(&group, &experts, at.first_record, &inputs, x, &mut downs);
                    pass.times.expert += t.elapsed();
                }
                pass.times.io_wait += batch.io_wait();
            }
        }
        // Each token's sum runs in expert order (as the reference sums), a token per task.
        let mut parts: Vec<Vec<(usize, usize, f32)>> = vec![Vec::new(); n]; // (expert, row, w)
        for (e, (_, toks)) in experts.iter().enumerate() {
            for (j, &(t, w)) in toks.iter().enumerate() {
                parts[t].push((e, j, w));
            }
        }
        let mut y = vec![0.0f32; n * h];
        let sum = |t: usize, yt: &mut [f32]| {
            for &(e, j, w) in &parts[t] {
                for (a, b) in yt.iter_mut().zip(&downs[e][j * h..(j + 1) * h]) {
                    *a += w * *b;
                }
            }
        };
        if n == 1 {
            sum(0, &mut y);
        } else {
            for_each_chunk_mut(&self.pool, &mut y, h, sum);
        }
        Ok(y)
    }

    /// Gate and up, SiLU, then down for the experts of `group` (`(index into experts, its
    /// matrices)`); writes each expert's down output to `downs`. Decoding (one token, or one per
    /// stream stepped together: at most [`WHOLE_EXPERT_ROWS`]) with as many experts as a whole
    /// number of rounds of the pool's threads, or at least four per thread, each thread takes
    /// whole experts, one parallel region (4 streams of the OLMoE-shaped model decoded 1.06x
    /// faster so than with the row split); otherwise every product's rows are split over the threads,
    /// three regions (gate and up; SiLU and quantizing each expert's hidden; down). Either way
    /// each output row is one thread's computation, so the results are the same.
    fn expert_group(
        &self,
        group: &[(usize, [WeightRef; 3])],
        experts: &[(usize, Vec<(usize, f32)>)],
        first_record: usize,
        inputs: &[Option<Acts>],
        x: &Acts,
        downs: &mut [Vec<f32>],
    ) {
        let (h, mi) = (self.cfg.hidden_size, self.cfg.moe_intermediate_size);
        let q4 = self
            .expert_layout
            .as_ref()
            .is_some_and(|l| l.parts[0].dtype.takes_q8_acts());
        let toks = |i: usize| experts[i].1.len();
        let threads = self.pool.threads();
        // Enough experts that whole ones keep every thread busy to the end.
        let balanced = group.len().is_multiple_of(threads) || group.len() >= 4 * threads;
        if x.n <= WHOLE_EXPERT_ROWS && threads > 1 && balanced && whole_experts() {
            let outs = self.pool.map(group.len(), |j| {
                let (i, w) = &group[j];
                let xin = inputs[*i].as_ref().unwrap_or(x);
                let n = toks(*i);
                let (mut g, mut u) = (vec![0.0; n * mi], vec![0.0; n * mi]);
                matmul_whole(self.kernel, w[0], xin, &mut g);
                matmul_whole(self.kernel, w[1], xin, &mut u);
                ops::swiglu(&mut g, &u, self.cfg.swiglu_limit);
                let mut hid = Acts::from_vec(g, n, mi);
                self.calib
                    .expert(first_record + experts[*i].0, 2, &hid.x, mi);
                hid.prepare(q4);
                let mut out = vec![0.0; n * h];
                matmul_whole(self.kernel, w[2], &hid, &mut out);
                out
            });
            for ((i, _), out) in group.iter().zip(outs) {
                downs[*i] = out;
            }
            return;
        }
        let mut gate_up: Vec<Vec<f32>> = group
            .iter()
            .flat_map(|&(i, _)| [vec![0.0; toks(i) * mi], vec![0.0; toks(i) * mi]])
            .collect();
        {
            let mut outs = gate_up.iter_mut();
            let mut jobs = Vec::with_capacity(2 * group.len());
            for (i, w) in group {
                let xin = inputs[*i].as_ref().unwrap_or(x);
                for part in [0, 1] {
                    jobs.push(Job {
                        w: w[part],
                        x: xin,
                        out: outs.next().unwrap(),
                    });
                }
            }
            matmul_many(&self.pool, self.kernel, &mut jobs);
        }
        let pairs: Vec<Mutex<&mut [Vec<f32>]>> =
            gate_up.chunks_exact_mut(2).map(Mutex::new).collect();
        let hidden: Vec<Acts> = self.pool.map(group.len(), |j| {
            let mut gu = pairs[j].lock().unwrap_or_else(|e| e.into_inner());
            let (g, u) = gu.split_at_mut(1);
            ops::swiglu(&mut g[0], &u[0], self.cfg.swiglu_limit);
            let mut a = Acts::from_vec(std::mem::take(&mut g[0]), toks(group[j].0), mi);
            self.calib
                .expert(first_record + experts[group[j].0].0, 2, &a.x, mi);
            a.prepare(q4);
            a
        });
        let mut outs: Vec<Vec<f32>> = group.iter().map(|&(i, _)| vec![0.0; toks(i) * h]).collect();
        {
            let mut jobs: Vec<Job> = group
                .iter()
                .zip(&hidden)
                .zip(outs.iter_mut())
                .map(|(((_, w), hid), out)| Job {
                    w: w[2],
                    x: hid,
                    out,
                })
                .collect();
            matmul_many(&self.pool, self.kernel, &mut jobs);
        }
        for ((i, _), out) in group.iter().zip(outs) {
            downs[*i] = out;
        }
    }
}

/// The most rows (a decode step's tokens, one per stream stepped together) for which whole
/// experts go to threads.
const WHOLE_EXPERT_ROWS: usize = 16;

/// Whether decode may give whole experts to threads (`COLI_WHOLE_EXPERTS=0` turns it off, to
/// measure against the row split).
fn whole_experts() -> bool {
    crate::settings::whole_experts()
}

/// Where a MoE layer is: its model index, its first expert record, its MoE ordinal, and the
/// residual stream entering its FFN (for the router look-ahead).
struct MoeAt<'a> {
    li: usize,
    first_record: usize,
    moe_idx: usize,
    residual: &'a [f32],
    /// A hash-routed layer's table.
    hash: Option<&'a [u32]>,
}
