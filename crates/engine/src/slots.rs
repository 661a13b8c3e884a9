//! KV slots: a sequence's token history and its KV memory, kept between generations so the next
//! prompt prefills only what it does not share with the history, and (optionally) persisted so
//! the history survives a restart.
//!
//! Invariant: `tokens.len() == kv.len` — the history is exactly the positions whose keys and
//! values are stored. A sampled token joins the history when it is fed back (the next step).

use std::borrow::Cow;
use std::ops::Range;

use crate::error::Result;
use crate::kv::{KvCache, KvLayout};
use crate::model::{Model, Seq};
use crate::store::profile::Turn;

/// Where a slot's committed positions are made durable (the slot file, `slotfile/`).
pub trait SlotStore: Send {
    /// Persist positions `start .. start + tokens.len()` after truncating the stored state to
    /// `start`. `kv` is the slot's whole KV cache.
    fn commit(&mut self, start: usize, tokens: &[u32], kv: &KvCache) -> Result<()>;
    /// End of a turn: make everything committed durable.
    fn sync(&mut self, tokens: &[u32], kv: &KvCache) -> Result<()>;
}

pub struct Slot {
    pub tokens: Vec<u32>,
    pub kv: KvCache,
    store: Option<Box<dyn SlotStore>>,
    /// Why persistence stopped for this slot (a failed write); generation goes on in memory.
    pub store_error: Option<String>,
    /// The profile of the turn running in this slot (closed by the generation's end).
    pub turn: Turn,
}

impl Slot {
    pub fn new(model: &Model) -> Slot {
        Slot {
            tokens: Vec::new(),
            kv: model.new_cache(),
            store: None,
            store_error: None,
            turn: Turn::default(),
        }
    }

    /// A slot restored from persisted state (already validated against the model's layout):
    /// the rows, and per layer its state after them (empty for a layer without one).
    pub fn restored(
        model: &Model,
        tokens: Vec<u32>,
        keys: &[Vec<f32>],
        values: &[Vec<f32>],
        states: &[Vec<f32>],
    ) -> Slot {
        let n = tokens.len();
        let kv = KvCache::from_rows(model.kv_layout(), model.kv_dtype, n, keys, values);
        let mut kv =
            crate::model::layers::with_states(&model.cfg, kv).with_limit(model.cfg.max_positions);
        for (li, s) in states.iter().enumerate() {
            if !s.is_empty() {
                kv.store_state(li, 0, s);
            }
        }
        kv.snapshot();
        Slot {
            tokens,
            kv,
            store: None,
            store_error: None,
            turn: Turn::default(),
        }
    }

    /// A private copy of the history (no store, its own turn), with room for `extra` more
    /// positions: to run another continuation of the same prefix beside this one.
    pub fn fork(&self, extra: usize) -> Slot {
        Slot {
            tokens: self.tokens.clone(),
            kv: self.kv.fork(extra),
            store: None,
            store_error: None,
            turn: Turn::default(),
        }
    }

    pub fn set_store(&mut self, store: Box<dyn SlotStore>) {
        self.store = Some(store);
    }

    pub fn persistent(&self) -> bool {
        self.store.is_some()
    }

    /// Keeps the longest common prefix of the history and `prompt`, but at least one prompt
    /// token is left to compute (its logits start the generation). Returns the kept length:
    /// with linear-attention states, the latest snapshot within that prefix
    /// ([`KvCache::truncate`]).
    pub fn reuse_prefix(&mut self, prompt: &[u32]) -> usize {
        let common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len().saturating_sub(1));
        self.kv.truncate(common);
        self.tokens.truncate(self.kv.len);
        self.kv.len
    }

    /// Runs `tokens` after the history, appends them to it, and commits them to the store.
    /// Returns the logits of the last token.
    pub fn forward(&mut self, model: &Model, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(Slot::forward_many(model, &mut [(self, tokens)])?.remove(0))
    }

    /// [`Slot::forward`] for several slots in one batched pass ([`Model::forward_batch`]):
    /// each one's tokens after its own history. Returns each one's last logits.
    pub fn forward_many(model: &Model, work: &mut [(&mut Slot, &[u32])]) -> Result<Vec<Vec<f32>>> {
        let mut seqs: Vec<Seq> = work
            .iter_mut()
            .map(|(slot, tokens)| Seq {
                tokens,
                kv: &mut slot.kv,
                all_logits: false,
                turn: &mut slot.turn,
            })
            .collect();
        let logits = match model.forward_batch(&mut seqs) {
            Ok(l) => l,
            Err(e) => {
                // A failed pass drops its positions; with states that may go back further
                // (to a snapshot): the history follows the cache.
                for (slot, _) in work.iter_mut() {
                    slot.tokens.truncate(slot.kv.len);
                }
                return Err(e);
            }
        };
        for (slot, tokens) in work.iter_mut() {
            let start = slot.tokens.len();
            slot.tokens.extend_from_slice(tokens);
            if let Some(store) = slot.store.as_mut() {
                if let Err(e) = store.commit(start, tokens, &slot.kv) {
                    slot.disable_store(e.to_string());
                }
            }
        }
        Ok(logits)
    }

    /// Logits of every one of `tokens` run after the history, whose positions are then
    /// dropped again (the history is left as it was; nothing is committed).
    pub fn try_after(&mut self, model: &Model, tokens: &[u32]) -> Result<Vec<f32>> {
        Ok(Slot::try_after_many(model, &mut [(self, tokens)])?.remove(0))
    }

    /// [`Slot::try_after`] for several slots in one batched pass.
    pub fn try_after_many(
        model: &Model,
        work: &mut [(&mut Slot, &[u32])],
    ) -> Result<Vec<Vec<f32>>> {
        let lens: Vec<usize> = work.iter().map(|(s, _)| s.kv.len).collect();
        // States cannot be unwound: keep a copy to come back to exactly.
        for (slot, _) in work.iter_mut() {
            slot.kv.snapshot();
        }
        let mut seqs: Vec<Seq> = work
            .iter_mut()
            .map(|(slot, tokens)| Seq {
                tokens,
                kv: &mut slot.kv,
                all_logits: true,
                turn: &mut slot.turn,
            })
            .collect();
        let r = model.forward_batch(&mut seqs);
        for ((slot, _), len) in work.iter_mut().zip(lens) {
            slot.kv.truncate(len);
        }
        r
    }

    /// End of a turn: the store makes the history durable (and linear-attention states are
    /// kept as a snapshot, where the next prompt most likely continues).
    pub fn end_turn(&mut self) {
        self.kv.snapshot();
        if let Some(store) = self.store.as_mut() {
            if let Err(e) = store.sync(&self.tokens, &self.kv) {
                self.disable_store(e.to_string());
            }
        }
    }

    fn disable_store(&mut self, why: String) {
        // A failed write must not fail the user's generation: keep serving from memory, stop
        // persisting this slot, and say why (slot_info / health).
        self.store = None;
        self.store_error = Some(why);
    }
}

impl SlotStore for crate::slotfile::SlotFile {
    fn commit(&mut self, start: usize, tokens: &[u32], kv: &KvCache) -> Result<()> {
        self.commit_kv(start, tokens, kv)
    }

    fn sync(&mut self, tokens: &[u32], kv: &KvCache) -> Result<()> {
        self.sync_kv(tokens, kv)
    }
}

impl crate::slotfile::KvRows for KvCache {
    fn num_layers(&self) -> usize {
        KvCache::num_layers(self)
    }

    fn widths(&self, layer: usize) -> (usize, usize) {
        (self.key_width(layer), self.value_width(layer))
    }

    fn every(&self, layer: usize) -> usize {
        self.layout().layers[layer].every
    }

    fn positions(&self) -> usize {
        self.len
    }

    fn rows(&self, layer: usize, positions: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let (k, v) = KvCache::rows(self, layer, positions);
        (Cow::Owned(k), Cow::Owned(v))
    }

    fn states(&self) -> Vec<Cow<'_, [f32]>> {
        (0..KvCache::num_layers(self))
            .map(|l| self.state(l))
            .collect()
    }
}

/// What a slot file must match to be loaded: the model (its manifest: config, tensors,
/// quantization) and the KV layout ([`layout_text`]). 32 bytes from two seeded XXH3-128s.
pub fn fingerprint(model: &Model) -> [u8; 32] {
    let manifest = serde_json::to_vec(&model.manifest).unwrap_or_default();
    fingerprint_of(&manifest, model.kv_layout(), model.state_widths())
}

/// [`fingerprint`] from the manifest's JSON bytes, the KV layout and the layers' state widths
/// (a model with states adds `|state W,W,...`; without, the text is the one from before).
fn fingerprint_of(manifest: &[u8], layout: &KvLayout, states: &[usize]) -> [u8; 32] {
    use xxhash_rust::xxh3::xxh3_128_with_seed;
    let mut text = manifest.to_vec();
    text.extend_from_slice(layout_text(layout).as_bytes());
    if states.iter().any(|&s| s > 0) {
        let widths: Vec<String> = states.iter().map(|s| s.to_string()).collect();
        text.extend_from_slice(format!("|state {}", widths.join(",")).as_bytes());
    }
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&xxh3_128_with_seed(&text, 0x636f_6c69).to_le_bytes());
    out[16..].copy_from_slice(&xxh3_128_with_seed(&text, 0x6272_6921).to_le_bytes());
    out
}

/// The KV layout's part of the fingerprint text. Every layer alike with keys and values of one
/// width (GQA): `|slotfile v1|layers L|kv_dim W|f32` (W = heads * head_dim), the text from
/// before layouts, so the slot files of those models keep loading. Any other layout:
/// `|slotfile v1|layers L|kv C*HxK/V,...|f32`, runs of C equal layers of H heads of K keys and
/// V values each.
fn layout_text(layout: &KvLayout) -> String {
    let v = crate::slotfile::SLOT_FILE_VERSION;
    let layers = &layout.layers;
    let gqa = layers
        .first()
        .is_none_or(|f| f.key_dim == f.value_dim && layers.iter().all(|l| l == f));
    if gqa {
        let kv_dim = layers.first().map_or(0, |l| l.heads * l.key_dim);
        return format!("|slotfile v{v}|layers {}|kv_dim {kv_dim}|f32", layers.len());
    }
    let mut runs: Vec<(usize, crate::kv::LayerKv)> = Vec::new();
    for l in layers {
        match runs.last_mut() {
            Some((count, last)) if last == l => *count += 1,
            _ => runs.push((1, *l)),
        }
    }
    let runs: Vec<String> = runs
        .iter()
        .map(|(c, l)| match l.every {
            1 => format!("{c}*{}x{}/{}", l.heads, l.key_dim, l.value_dim),
            e => format!("{c}*{}x{}/{}@{e}", l.heads, l.key_dim, l.value_dim),
        })
        .collect();
    format!(
        "|slotfile v{v}|layers {}|kv {}|f32",
        layers.len(),
        runs.join(",")
    )
}

/// Opens slot `index`'s file in `dir`: the persisted history when the file is valid for this
/// model, else an empty slot (a refused file is reported through `log` and replaced).
pub fn open_persistent(
    model: &Model,
    dir: &std::path::Path,
    index: usize,
    log: &mut dyn FnMut(String),
) -> Result<Slot> {
    use crate::slotfile::{Opened, SlotFile};
    std::fs::create_dir_all(dir).map_err(|e| {
        crate::error::Error::Input(format!(
            "cannot create the KV directory {}: {e}",
            dir.display()
        ))
    })?;
    let path = dir.join(format!("slot-{index}.kv"));
    let (file, opened) = SlotFile::open_layout_states(
        &path,
        fingerprint(model),
        model.kv_layout(),
        model.state_widths(),
    )?;
    let mut slot = match opened {
        Opened::Loaded(s) if s.tokens.len() < model.cfg.max_positions => {
            Slot::restored(model, s.tokens, &s.keys, &s.values, &s.states)
        }
        Opened::Loaded(_) => {
            log(format!(
                "{}: holds more tokens than the context; starting the slot empty",
                path.display()
            ));
            Slot::new(model)
        }
        Opened::Fresh => Slot::new(model),
        Opened::Refused(why) => {
            log(format!(
                "{}: {why}; starting the slot empty",
                path.display()
            ));
            Slot::new(model)
        }
    };
    slot.set_store(Box::new(crate::slot_writer::BackgroundFile::new(file)?));
    Ok(slot)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv::LayerKv;

    #[test]
    fn a_gqa_layout_keeps_the_fingerprint_of_its_slot_files() {
        // The text and digest slot files were fingerprinted with before KV layouts.
        let layout = KvLayout::uniform(16, 4, 128);
        assert_eq!(
            layout_text(&layout),
            "|slotfile v1|layers 16|kv_dim 512|f32"
        );
        let manifest = br#"{"config":"any"}"#;
        let mut text = manifest.to_vec();
        text.extend_from_slice(b"|slotfile v1|layers 16|kv_dim 512|f32");
        let mut old = [0u8; 32];
        use xxhash_rust::xxh3::xxh3_128_with_seed;
        old[..16].copy_from_slice(&xxh3_128_with_seed(&text, 0x636f_6c69).to_le_bytes());
        old[16..].copy_from_slice(&xxh3_128_with_seed(&text, 0x6272_6921).to_le_bytes());
        assert_eq!(fingerprint_of(manifest, &layout, &[0; 16]), old);
    }

    #[test]
    fn other_layouts_are_spelled_out_layer_by_layer() {
        let mla = LayerKv::per_position(1, 576, 0);
        let none = LayerKv::per_position(0, 0, 0);
        let gqa = LayerKv::per_position(2, 4, 4);
        let layout = KvLayout {
            layers: vec![mla, mla, none, gqa, mla],
        };
        assert_eq!(
            layout_text(&layout),
            "|slotfile v1|layers 5|kv 2*1x576/0,1*0x0/0,1*2x4/4,1*1x576/0|f32"
        );
        let swapped = KvLayout {
            layers: vec![mla, none, mla, gqa, mla],
        };
        assert_ne!(
            fingerprint_of(b"{}", &layout, &[0; 5]),
            fingerprint_of(b"{}", &swapped, &[0; 5])
        );
        // Every layer alike but values of another width: not the GQA text either.
        let uniform_mla = KvLayout {
            layers: vec![mla; 3],
        };
        assert_eq!(
            layout_text(&uniform_mla),
            "|slotfile v1|layers 3|kv 3*1x576/0|f32"
        );
        // A layer of a row per several positions says how many (DeepSeek-V4's entries).
        let entries = LayerKv {
            every: 4,
            ..LayerKv::per_position(1, 28, 0)
        };
        let v4 = KvLayout {
            layers: vec![none, entries, entries],
        };
        assert_eq!(
            layout_text(&v4),
            "|slotfile v1|layers 3|kv 1*0x0/0,2*1x28/0@4|f32"
        );
    }
}
