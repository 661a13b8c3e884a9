//! KV slots: a sequence's token history and its KV memory, kept between generations so the next
//! prompt prefills only what it does not share with the history, and (optionally) persisted so
//! the history survives a restart.
//!
//! Invariant: `tokens.len() == kv.len` — the history is exactly the positions whose keys and
//! values are stored. A sampled token joins the history when it is fed back (the next step).

use std::borrow::Cow;
use std::ops::Range;

use crate::error::Result;
use crate::kv::KvCache;
use crate::model::Model;

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
}

impl Slot {
    pub fn new(model: &Model) -> Slot {
        Slot {
            tokens: Vec::new(),
            kv: model.new_cache(),
            store: None,
            store_error: None,
        }
    }

    /// A slot restored from persisted state (already validated against the model's layout).
    pub fn restored(
        model: &Model,
        tokens: Vec<u32>,
        keys: &[Vec<f32>],
        values: &[Vec<f32>],
    ) -> Slot {
        let c = &model.cfg;
        let n = tokens.len();
        let kv = KvCache::from_rows(c.num_kv_heads, c.head_dim, model.kv_dtype, n, keys, values)
            .with_limit(c.max_positions);
        Slot {
            tokens,
            kv,
            store: None,
            store_error: None,
        }
    }

    pub fn set_store(&mut self, store: Box<dyn SlotStore>) {
        self.store = Some(store);
    }

    pub fn persistent(&self) -> bool {
        self.store.is_some()
    }

    /// Keeps the longest common prefix of the history and `prompt`, but at least one prompt
    /// token is left to compute (its logits start the generation). Returns the kept length.
    pub fn reuse_prefix(&mut self, prompt: &[u32]) -> usize {
        let common = self
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len().saturating_sub(1));
        self.tokens.truncate(common);
        self.kv.truncate(common);
        common
    }

    /// Runs `tokens` after the history, appends them to it, and commits them to the store.
    /// Returns the logits of the last token.
    pub fn forward(&mut self, model: &Model, tokens: &[u32]) -> Result<Vec<f32>> {
        let start = self.tokens.len();
        let logits = model.forward(tokens, &mut self.kv, false)?;
        self.tokens.extend_from_slice(tokens);
        if let Some(store) = self.store.as_mut() {
            if let Err(e) = store.commit(start, tokens, &self.kv) {
                self.disable_store(e.to_string());
            }
        }
        Ok(logits)
    }

    /// End of a turn: the store makes the history durable.
    pub fn end_turn(&mut self) {
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

    fn positions(&self) -> usize {
        self.len
    }

    fn rows(&self, layer: usize, positions: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let (k, v) = KvCache::rows(self, layer, positions);
        (Cow::Owned(k), Cow::Owned(v))
    }
}

/// What a slot file must match to be loaded: the model (its manifest: config, tensors,
/// quantization) and the KV layout (layers, width, f32). 32 bytes from two seeded XXH3-128s.
pub fn fingerprint(model: &Model) -> [u8; 32] {
    use xxhash_rust::xxh3::xxh3_128_with_seed;
    let mut text = serde_json::to_vec(&model.manifest).unwrap_or_default();
    text.extend_from_slice(
        format!(
            "|slotfile v{}|layers {}|kv_dim {}|f32",
            crate::slotfile::SLOT_FILE_VERSION,
            model.cfg.num_layers,
            model.cfg.kv_dim()
        )
        .as_bytes(),
    );
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&xxh3_128_with_seed(&text, 0x636f_6c69).to_le_bytes());
    out[16..].copy_from_slice(&xxh3_128_with_seed(&text, 0x6272_6921).to_le_bytes());
    out
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
    let (file, opened) = SlotFile::open(
        &path,
        fingerprint(model),
        model.cfg.num_layers,
        model.cfg.kv_dim(),
    )?;
    let mut slot = match opened {
        Opened::Loaded(s) if s.tokens.len() < model.cfg.max_positions => {
            Slot::restored(model, s.tokens, &s.keys, &s.values)
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
    slot.set_store(Box::new(file));
    Ok(slot)
}
