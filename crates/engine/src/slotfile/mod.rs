//! KV slot files: a sequence's token history and KV memory on disk, so a warm conversation
//! survives a restart (or a crash) without a new prefill.
//!
//! A slot file is three fixed header copies followed by an append-only log of records. A record
//! truncates the state to its `start` and appends positions; replaying the log from the start
//! rebuilds the state. A commit appends one record past the committed end and then writes one
//! header copy (a higher sequence number, the new committed end and the checksum that closes a
//! hash chain over every record). Nothing is ever rewritten in place except header copies that
//! are neither the newest one nor the one made durable by the last [`SlotFile::sync`].
//! Compaction writes the whole state into `<path>.tmp` and renames it over the file.
//!
//! The byte layout, the protocol and the crash-safety argument are in `docs/FORMATS.md`
//! ("KV slot files").

mod format;
mod lock;
mod replay;
mod writer;

#[cfg(test)]
mod tests;

use std::borrow::Cow;
use std::fs::{self, File};
use std::ops::Range;
use std::path::{Path, PathBuf};

use crate::error::{io_err, Error, Result};
use crate::kv::KvLayout;

pub use format::{
    reseal, reseal_layout, reseal_layout_states, HEADER_BLOCK, HEADER_COPIES, LOG_START,
    RECORD_MAGIC, ROWS_SLOT_FILE_VERSION, SLOT_FILE_MAGIC, SLOT_FILE_VERSION, STATE_MAGIC,
    STATE_SLOT_FILE_VERSION,
};
pub use lock::IN_USE;
pub use replay::{load_bytes, load_bytes_layout, load_bytes_states};

use format::{Shape, HEADER_LEN};
use lock::open_locked;
use replay::{load_from, Found, LoadError};
use writer::{tmp_path, Io, RealIo, Tuning};

/// A loaded slot: the tokens and, per layer, its rows of them (`tokens.len()` rows, or
/// `tokens.len() / every` for a layer of a row per `every` positions) of `key width` keys and
/// `value width` values (row-major f32).
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedSlot {
    pub tokens: Vec<u32>,
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
    /// Per layer, its state after the tokens (a version-2 or 3 file; empty for a layer
    /// without, and for every layer of a version-1 file).
    pub states: Vec<Vec<f32>>,
}

impl LoadedSlot {
    fn empty(num_layers: usize) -> LoadedSlot {
        LoadedSlot {
            tokens: Vec::new(),
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
            states: vec![Vec::new(); num_layers],
        }
    }
}

/// What [`SlotFile::open`] found.
#[derive(Debug)]
pub enum Opened {
    /// No file, an empty file, or a valid file holding no tokens: start empty.
    Fresh,
    /// The last committed state.
    Loaded(LoadedSlot),
    /// The file was foreign or damaged (the reason, for one log line); it was replaced by an
    /// empty slot file.
    Refused(String),
}

/// The KV state a slot file persists, read as row-major rows per layer (the engine keeps
/// its cache head-major and converts only the rows a record holds).
pub trait KvRows {
    fn num_layers(&self) -> usize;
    /// Floats per row of `layer`'s keys and of its values (all heads).
    fn widths(&self, layer: usize) -> (usize, usize);
    /// Positions per row of `layer` (1: a row per position).
    fn every(&self, layer: usize) -> usize;
    /// Positions every layer holds rows for.
    fn positions(&self) -> usize;
    /// Keys and values of `layer` written by `positions` (within [`KvRows::positions`]): its
    /// rows `positions.start / every .. positions.end / every`, row by row.
    fn rows(&self, layer: usize, positions: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>);
    /// Per layer, its fixed-size state after [`KvRows::positions`] positions (empty for a
    /// layer without one).
    fn states(&self) -> Vec<Cow<'_, [f32]>> {
        vec![Cow::Borrowed(&[][..]); self.num_layers()]
    }
}

/// Per-layer row-major vectors (`keys[layer][row * widths[layer].0 ..]`, values with
/// `widths[layer].1`), as [`LoadedSlot`] holds.
pub struct PositionMajor<'a> {
    pub keys: &'a [Vec<f32>],
    pub values: &'a [Vec<f32>],
    /// Per layer: (key floats, value floats) per row.
    pub widths: &'a [(usize, usize)],
    /// Per layer: positions per row.
    pub every: &'a [usize],
}

impl KvRows for PositionMajor<'_> {
    fn num_layers(&self) -> usize {
        if self.keys.len() == self.widths.len() && self.values.len() == self.widths.len() {
            self.keys.len()
        } else {
            usize::MAX // never equal to a file's layer count: refused by `check_state`
        }
    }

    fn widths(&self, layer: usize) -> (usize, usize) {
        self.widths[layer]
    }

    fn every(&self, layer: usize) -> usize {
        self.every[layer]
    }

    fn positions(&self) -> usize {
        // A layer without keys (or values) holds rows for any number of positions; one of `r`
        // rows of a row per `e` positions, for up to `(r + 1) * e - 1`.
        let fit = |v: &Vec<f32>, w: usize, e: usize| {
            v.len().checked_div(w).map_or(usize::MAX, |r| {
                (r.saturating_add(1)).saturating_mul(e).saturating_sub(1)
            })
        };
        self.keys
            .iter()
            .zip(self.values)
            .zip(self.widths.iter().zip(self.every))
            .map(|((k, v), (&(kw, vw), &e))| fit(k, kw, e).min(fit(v, vw, e)))
            .min()
            .unwrap_or(usize::MAX)
    }

    fn rows(&self, layer: usize, positions: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let (kw, vw) = self.widths[layer];
        let e = self.every[layer];
        let (a, b) = (positions.start / e, positions.end / e);
        (
            Cow::Borrowed(&self.keys[layer][a * kw..b * kw]),
            Cow::Borrowed(&self.values[layer][a * vw..b * vw]),
        )
    }
}

/// An open slot file, locked (advisory `flock`) against a second process using it.
pub struct SlotFile {
    file: File,
    path: PathBuf,
    fingerprint: [u8; 32],
    shape: Shape,
    /// The persisted tokens (the committed state's history).
    tokens: Vec<u32>,
    /// Committed end of the log and the chain value there.
    end: u64,
    chain: u64,
    /// The highest sequence number written.
    seq: u64,
    /// `seq` of the valid header each block holds (0: none, or being overwritten).
    seqs: [u64; HEADER_COPIES],
    /// The block holding the newest header.
    current: usize,
    /// The block holding the header made durable by the last fsync; never overwritten
    /// before the next fsync.
    durable: usize,
    io: Box<dyn Io>,
    tuning: Tuning,
}

impl std::fmt::Debug for SlotFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SlotFile")
            .field("path", &self.path)
            .field("num_layers", &self.shape.num_layers())
            .field("kv_dim", &self.shape.kv_dim)
            .field("persisted_tokens", &self.tokens.len())
            .field("committed_bytes", &self.end)
            .field("seq", &self.seq)
            .finish()
    }
}

impl SlotFile {
    /// Opens (creating if missing) the slot file at `path` for `num_layers` layers of `kv_dim`
    /// keys and `kv_dim` values per position (a GQA layout's row width; [`SlotFile::open_layout`]
    /// takes any layout); an existing valid file is loaded, an invalid/foreign one is refused
    /// and replaced by an empty file.
    ///
    /// `fingerprint` identifies the model and KV layout (computed by the caller); a file made
    /// with another fingerprint, version, `num_layers` or `kv_dim` is refused. An I/O error
    /// while reading returns `Err` and leaves the file alone.
    pub fn open(
        path: &Path,
        fingerprint: [u8; 32],
        num_layers: usize,
        kv_dim: usize,
    ) -> Result<(SlotFile, Opened)> {
        let shape = Shape::uniform(num_layers, kv_dim).map_err(Error::Input)?;
        Self::open_shape(
            path,
            fingerprint,
            shape,
            Box::new(RealIo),
            Tuning::default(),
        )
    }

    /// [`SlotFile::open`] for the slot file of a model whose KV is laid out as `layout`: the
    /// records hold per layer `heads * key_dim` keys and `heads * value_dim` values per
    /// position, and a file of another layout is refused. For a layout whose layers all keep
    /// `w` keys and `w` values per position, the file is the one `open(path, fingerprint,
    /// layers, w)` makes.
    pub fn open_layout(
        path: &Path,
        fingerprint: [u8; 32],
        layout: &KvLayout,
    ) -> Result<(SlotFile, Opened)> {
        Self::open_layout_states(path, fingerprint, layout, &vec![0; layout.layers.len()])
    }

    /// [`SlotFile::open_layout`] for a model whose layers also carry fixed-size states of
    /// `states[li]` floats (linear attention, DeepSeek-V4's windows): a version-2 (or, with a
    /// layer of a row per several positions, 3) file whose log holds state records beside the
    /// position records; it loads at the last position a state was written for.
    pub fn open_layout_states(
        path: &Path,
        fingerprint: [u8; 32],
        layout: &KvLayout,
        states: &[usize],
    ) -> Result<(SlotFile, Opened)> {
        let shape = Shape::of(layout)
            .and_then(|s| s.with_states(states))
            .map_err(Error::Input)?;
        Self::open_shape(
            path,
            fingerprint,
            shape,
            Box::new(RealIo),
            Tuning::default(),
        )
    }

    #[cfg(test)]
    fn open_with(
        path: &Path,
        fingerprint: [u8; 32],
        num_layers: usize,
        kv_dim: usize,
        io: Box<dyn Io>,
        tuning: Tuning,
    ) -> Result<(SlotFile, Opened)> {
        let shape = Shape::uniform(num_layers, kv_dim).map_err(Error::Input)?;
        Self::open_shape(path, fingerprint, shape, io, tuning)
    }

    fn open_shape(
        path: &Path,
        fingerprint: [u8; 32],
        shape: Shape,
        io: Box<dyn Io>,
        tuning: Tuning,
    ) -> Result<(SlotFile, Opened)> {
        let file = open_locked(path)?;
        // A compaction killed before its rename; only the lock holder writes it.
        let _ = fs::remove_file(tmp_path(path));
        let num_layers = shape.num_layers();
        let mut sf = SlotFile {
            file,
            path: path.to_path_buf(),
            fingerprint,
            shape,
            tokens: Vec::new(),
            end: LOG_START,
            chain: 0,
            seq: 0,
            seqs: [0; HEADER_COPIES],
            current: 0,
            durable: 0,
            io,
            tuning,
        };
        let empty = LoadedSlot::empty(num_layers);
        let (widths, every) = (sf.shape.widths.clone(), sf.shape.every.clone());
        let empty_kv = PositionMajor {
            keys: &empty.keys,
            values: &empty.values,
            widths: &widths,
            every: &every,
        };
        let found = match sf.file.metadata() {
            Ok(m) if m.len() == 0 => Ok(None),
            Ok(_) => load_from(&sf.file, fingerprint, &sf.shape),
            Err(e) => Err(LoadError::Io(e)),
        };
        match found {
            Err(LoadError::Io(e)) => Err(io_err(path)(e)),
            Ok(None) => {
                sf.replace(&empty.tokens, &empty_kv)?;
                Ok((sf, Opened::Fresh))
            }
            Err(LoadError::Invalid(why)) => {
                sf.replace(&empty.tokens, &empty_kv)?;
                Ok((sf, Opened::Refused(why)))
            }
            Ok(Some(found)) => {
                sf.adopt(&found)?;
                let opened = if found.state.tokens.is_empty() {
                    Opened::Fresh
                } else {
                    Opened::Loaded(found.state)
                };
                Ok((sf, opened))
            }
        }
    }

    /// Continues the file after a successful load: drops newer headers whose log did not
    /// verify and any bytes past the committed end, and makes the loaded state durable.
    fn adopt(&mut self, found: &Found) -> Result<()> {
        let path = self.path.clone();
        let h = found.header;
        let mut seqs = found.seqs;
        for (i, s) in seqs.iter_mut().enumerate() {
            if *s > h.seq {
                // A header newer than the loaded state whose log failed to verify: erase it
                // so it can never compete with the sequence numbers written from now on.
                self.io
                    .write_at(&self.file, &[0u8; HEADER_LEN], i as u64 * HEADER_BLOCK)
                    .map_err(io_err(&path))?;
                *s = 0;
            }
        }
        let len = self.file.metadata().map_err(io_err(&path))?.len();
        if len > h.end {
            self.io.set_len(&self.file, h.end).map_err(io_err(&path))?;
        }
        self.io.sync_file(&self.file).map_err(io_err(&path))?;
        self.tokens = found.state.tokens.clone();
        self.end = h.end;
        self.chain = h.chain;
        self.seq = h.seq;
        self.seqs = seqs;
        self.current = found.copy;
        self.durable = found.copy;
        Ok(())
    }

    /// Tokens in the persisted (committed) state.
    pub fn persisted_tokens(&self) -> usize {
        self.tokens.len()
    }

    /// The persisted tokens themselves.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Bytes of the file's committed part (header region plus log).
    pub fn committed_bytes(&self) -> u64 {
        self.end
    }
}
