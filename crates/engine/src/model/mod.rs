//! A loaded model and its forward pass.
//!
//! A family is one file (`olmoe.rs`, `qwen3_moe.rs`, `glm4_moe.rs`): the config fields it reads,
//! the blocks it chooses and the tensors it has, listed in `registry.rs`. The blocks live in
//! `layers/` (attention kinds, the dense MLP, the MoE and its routing); `load.rs` builds a
//! [`Model`] from a converted directory and `forward.rs` runs it.

pub mod deepseek_v3;
pub mod deepseek_v4;
mod forward;
pub mod glm4_moe;
pub mod glm_moe_dsa;
pub mod kimi_linear;
pub mod layers;
mod load;
#[cfg(feature = "python")]
pub(crate) use load::kv_dtype;
pub mod olmoe;
pub mod plan;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod registry;

#[cfg(test)]
mod published_configs_tests;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use memmap2::Mmap;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::format::*;
use crate::kv::{KvCache, KvDtype, KvLayout};
use crate::linear::{Linear, WeightRef};
use crate::ops::Rope;
use crate::pool::Pool;
use crate::quant::Kernel;
use crate::store::heat::{Heat, RoutingHeat};
use crate::store::profile::{Finished, PassTimes, Profile, Turn};
use crate::store::{ExpertStore, StoreStats, Tier};
use layers::Layer;

pub use forward::Seq;

pub(crate) fn fmt_err(msg: impl Into<String>) -> Error {
    Error::Format(msg.into())
}

/// The refusal of a context of `positions` tokens for a model whose context is `limit`
/// ([`Model::check_context`]; `positions` may be any number a caller was given).
pub(crate) fn context_error(positions: impl std::fmt::Display, limit: usize) -> Error {
    Error::Input(format!(
        "context {positions} is out of range: the model's context length is {limit} \
         (give 1 to {limit})"
    ))
}

/// Where a routed expert's three matrices sit inside its record.
pub(super) struct ExpertLayout {
    pub(super) record_size: usize,
    pub(super) parts: [TensorEntry; 3],
}

/// Where routed experts live: all in RAM (read at load), or staged by the expert cache.
pub(super) enum Experts {
    Resident(Mmap),
    Store(ExpertStore),
}

/// What one forward pass records for the turns' profiles.
#[derive(Default)]
pub(super) struct Pass {
    pub(super) times: PassTimes,
    /// The sequence each row of the pass belongs to (see `forward.rs`).
    pub(super) row_seq: Vec<usize>,
    /// Per sequence: (model layer, experts its rows routed to) of each MoE layer.
    pub(super) routed: Vec<Vec<(usize, Vec<usize>)>>,
    /// The look-ahead's prediction for the next MoE layer: (model layer, experts).
    pub(super) predicted: Option<(usize, Vec<usize>)>,
    /// The token of each row of the pass (hash-routed MoE layers choose by it).
    pub(super) tokens: Vec<u32>,
}

pub struct Model {
    pub cfg: ModelConfig,
    pub manifest: Manifest,
    resident: Mmap,
    experts: Option<Experts>,
    expert_layout: Option<ExpertLayout>,
    prefetch: bool,
    heat: Heat,
    /// Where the heat is saved (`None`: kept in memory only).
    heat_path: Option<PathBuf>,
    heat_saved: Mutex<Option<Instant>>,
    /// The turn of passes run without one of their own ([`Model::forward`]).
    own_turn: Mutex<Turn>,
    finished: Mutex<Finished>,
    embed: Linear,
    lm_head: Linear,
    norm: Vec<f32>,
    /// The hyper-connections' last collapse of the residual streams (DeepSeek-V4).
    hc_head: Option<layers::hyper::HyperHead>,
    layers: Vec<Layer>,
    rope: Rope,
    kernel: Kernel,
    pool: Pool,
    /// Positions per forward pass at most ([`forward::PREFILL_CHUNK`]).
    prefill_chunk: usize,
    /// The shortest step of a linear-attention layer that runs the delta rule's chunked form
    /// (`layers::delta::DELTA_CHUNKED_FROM`; none: always the recurrent form).
    delta_chunked_from: Option<usize>,
    /// Whether MLA prefill may attend in the expanded form (`layers::mla::expanded_pays`).
    mla_expanded: bool,
    /// How KV caches of this model store keys and values (`load::kv_dtype`).
    pub kv_dtype: KvDtype,
    kv_layout: KvLayout,
    state_widths: Vec<usize>,
    /// Importance statistics, recorded only inside [`Model::collect_importance`].
    calib: crate::calib::Recorder,
}

impl Model {
    pub fn kernel(&self) -> Kernel {
        self.kernel
    }

    /// Forces a compute kernel (tests run every path); `k` must be available on this CPU.
    pub fn set_kernel(&mut self, k: Kernel) {
        assert!(k.available(), "kernel {} not available", k.name());
        self.kernel = k;
    }

    /// Sets how many prompt positions one forward pass runs at most (at least 1).
    pub fn set_prefill_chunk(&mut self, positions: usize) {
        self.prefill_chunk = positions.max(1);
    }

    /// How many prompt positions one forward pass runs at most.
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Sets the shortest step of a linear-attention layer that runs the delta rule's chunked
    /// form (none: the recurrent form always).
    pub fn set_delta_chunked_from(&mut self, positions: Option<usize>) {
        self.delta_chunked_from = positions;
    }

    /// Lets MLA prefill attend in the expanded form where it pays (or not: the absorbed form
    /// everywhere, the same bits however a prompt is cut into passes). Makes or drops the
    /// `kv_b` copies by columns the unrounded products read.
    pub fn set_mla_expanded(&mut self, on: bool) {
        self.mla_expanded = on;
        self.refresh_kv_b_columns();
    }

    /// Whether MLA prefill may attend in the expanded form (`COLI_MLA_EXPANDED`, read at load;
    /// models without MLA layers ignore it).
    pub fn mla_expanded(&self) -> bool {
        self.mla_expanded
    }

    /// Bytes of the resident weights in RAM: the resident file, and the copies made of it at
    /// load (MLA's `kv_b` by columns while the expanded setting is on).
    pub fn resident_bytes(&self) -> usize {
        let (q4, q8) = self.kv_b_columns_held();
        self.resident.len() + q4 + q8
    }

    pub fn threads(&self) -> usize {
        self.pool.threads()
    }

    /// Runs the model with a context of `positions` tokens (prompt and reply) instead of the
    /// one it was trained for (`max_position_embeddings`): the KV caches, [`Model::forward`] and
    /// the generation loop all stop there, and slot files holding that many tokens or more
    /// start empty. Call it before making caches or slots (ones made earlier keep the old
    /// limit). Refuses 0 and more than the current context ([`Model::check_context`]).
    pub fn set_context(&mut self, positions: usize) -> Result<()> {
        Model::check_context(positions, self.cfg.max_positions)?;
        self.cfg.max_positions = positions;
        Ok(())
    }

    /// Whether a context of `positions` tokens can run a model whose context is `limit`: at
    /// least 1 and at most `limit`, else an input error naming both numbers.
    pub fn check_context(positions: usize, limit: usize) -> Result<()> {
        if (1..=limit).contains(&positions) {
            Ok(())
        } else {
            Err(context_error(positions, limit))
        }
    }

    pub fn new_cache(&self) -> KvCache {
        layers::with_states(&self.cfg, KvCache::new(&self.kv_layout, self.kv_dtype))
            .with_limit(self.cfg.max_positions)
    }

    /// Per layer, the floats of the fixed-size state it carries (linear attention; 0: none).
    pub fn state_widths(&self) -> &[usize] {
        &self.state_widths
    }

    /// What every layer keeps per position (the cache's and slot files' layout).
    pub fn kv_layout(&self) -> &KvLayout {
        &self.kv_layout
    }

    /// Runs the model over each of `chunks` (each from an empty context, every position's
    /// logits computed so the LM head sees every position) and returns the importance
    /// statistics of its weight matrices (see [`crate::calib`]). The model must be an f32
    /// conversion: the statistics are of the unquantized model, and they are placed by its
    /// f32 tensors. Chunks must fit the context. Not for a model that is serving: the
    /// recording sees every pass that runs meanwhile.
    pub fn collect_importance(&self, chunks: &[Vec<u32>]) -> Result<crate::calib::Importance> {
        let quantized = self
            .manifest
            .resident
            .tensors
            .iter()
            .find(|(_, t)| t.dtype != DType::F32);
        if self.manifest.quantization.kind != Quant::F32 || quantized.is_some() {
            return Err(Error::Input(format!(
                "importance statistics need an f32 conversion of the model (`colibri convert                  --quant f32`); this one is {}{}",
                self.manifest.quantization.kind.name(),
                quantized.map_or(String::new(), |(n, _)| format!(" (`{n}` is quantized)"))
            )));
        }
        let tokens: usize = chunks.iter().map(Vec::len).sum();
        if tokens == 0 {
            return Err(Error::Input("no calibration tokens to run".into()));
        }
        self.calib.start();
        let run = chunks.iter().filter(|c| !c.is_empty()).try_for_each(|c| {
            let mut kv = self.new_cache();
            self.forward(c, &mut kv, true).map(drop)
        });
        self.calib.stop();
        run?;
        Ok(self.calib.importance(&self.manifest, tokens))
    }

    pub(super) fn w(&self, l: &Linear) -> WeightRef<'_> {
        l.view(&self.resident)
    }

    /// The three matrices (gate, up, down) of an expert whose record starts at `base` in `buf`
    /// (the whole experts file, or one cached record).
    pub(super) fn expert_parts<'a>(&self, buf: &'a [u8], base: usize) -> [WeightRef<'a>; 3] {
        let lay = self
            .expert_layout
            .as_ref()
            .expect("MoE layer implies experts");
        std::array::from_fn(|part| {
            let p = &lay.parts[part];
            Linear {
                dtype: p.dtype,
                rows: p.shape[0],
                cols: p.shape[1],
                offset: base + p.offset,
                nbytes: p.nbytes,
            }
            .view(buf)
        })
    }

    /// Ends the turn of the passes run by [`Model::forward`] (see [`Model::close_turn`]).
    pub fn end_turn(&self) -> Result<()> {
        let mut turn =
            std::mem::take(&mut *self.own_turn.lock().unwrap_or_else(|e| e.into_inner()));
        self.close_turn(&mut turn)
    }

    /// Ends a turn: its profile joins [`Model::profiles`] (the last 30 kept), its routed
    /// experts become [`Model::last_routed_experts`], and the routing heat is saved to
    /// `routing-heat.json` where it lives ([`HeatHome`](crate::store::heat::HeatHome); at most every 10 s; a failed write is
    /// returned but changes nothing else). A generation's end calls it with its slot's turn;
    /// the turn starts empty again.
    pub fn close_turn(&self, turn: &mut Turn) -> Result<()> {
        let now = self.store_stats().unwrap_or_default();
        if let Some((profile, routed)) = turn.close(now, self.cfg.num_layers) {
            self.finished
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(profile, routed);
        }
        let due = {
            let mut saved = self.heat_saved.lock().unwrap_or_else(|e| e.into_inner());
            let due = saved.is_none_or(|t| t.elapsed() >= Duration::from_secs(10));
            if due {
                *saved = Some(Instant::now());
            }
            due
        };
        if due {
            self.save_heat()?;
        }
        Ok(())
    }

    /// The profile of the last finished turn (all zero before the first [`Model::end_turn`]).
    pub fn last_profile(&self) -> Profile {
        let t = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        t.history.back().cloned().unwrap_or_default()
    }

    /// Profiles of the last 30 finished turns, oldest first.
    pub fn profiles(&self) -> Vec<Profile> {
        let t = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        t.history.iter().cloned().collect()
    }

    /// The experts routed to during the last finished turn: for each model layer (index), the
    /// expert ids, ascending (empty for dense layers).
    pub fn last_routed_experts(&self) -> Vec<Vec<u32>> {
        let t = self.finished.lock().unwrap_or_else(|e| e.into_inner());
        t.last_routed.clone()
    }

    /// Routing counts per (MoE layer, expert) since the heat file was started.
    pub fn routing_heat(&self) -> RoutingHeat {
        self.heat.snapshot()
    }

    /// Writes the routing heat to `routing-heat.json` where it lives ([`HeatHome`](crate::store::heat::HeatHome); crash-safe);
    /// nothing when it is kept in memory only.
    pub fn save_heat(&self) -> Result<()> {
        match &self.heat_path {
            Some(p) => self.heat.save(p),
            None => Ok(()),
        }
    }

    /// The file the routing heat is saved to (`None`: kept in memory only).
    pub fn heat_file(&self) -> Option<&Path> {
        self.heat_path.as_deref()
    }

    /// Where each routed expert is now: per MoE layer (model layer index, ascending, as in
    /// [`Model::routing_heat`]), one [`Tier`] per expert: all `Resident` without an expert
    /// cache, else pinned, cached or disk as the store holds them at this moment.
    pub fn expert_tiers(&self) -> Vec<(usize, Vec<Tier>)> {
        let Some(x) = &self.manifest.experts else {
            return Vec::new();
        };
        let held = self.expert_store().map(|s| s.tiers());
        self.heat
            .layer_ids()
            .iter()
            .filter_map(|&layer| {
                let l = x.layers.iter().find(|l| l.layer == layer)?;
                let tiers = match &held {
                    None => vec![Tier::Resident; l.count],
                    Some(t) => t.get(l.first_record..l.first_record + l.count)?.to_vec(),
                };
                Some((layer, tiers))
            })
            .collect()
    }

    /// The expert cache (`None` when every expert is resident).
    pub fn expert_store(&self) -> Option<&ExpertStore> {
        match &self.experts {
            Some(Experts::Store(s)) => Some(s),
            _ => None,
        }
    }

    /// The expert cache's counters (`None` when every expert is resident).
    pub fn store_stats(&self) -> Option<StoreStats> {
        match &self.experts {
            Some(Experts::Store(s)) => Some(s.stats()),
            _ => None,
        }
    }
}
