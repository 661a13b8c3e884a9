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

pub use format::{
    reseal, HEADER_BLOCK, HEADER_COPIES, LOG_START, RECORD_MAGIC, SLOT_FILE_MAGIC,
    SLOT_FILE_VERSION,
};
pub use lock::IN_USE;
pub use replay::load_bytes;

use format::{token_bytes, HEADER_LEN};
use lock::open_locked;
use replay::{load_from, Found, LoadError};
use writer::{tmp_path, Io, RealIo, Tuning};

/// A loaded slot: the tokens and, per layer, `tokens.len() * kv_dim` keys and values.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadedSlot {
    pub tokens: Vec<u32>,
    pub keys: Vec<Vec<f32>>,
    pub values: Vec<Vec<f32>>,
}

impl LoadedSlot {
    fn empty(num_layers: usize) -> LoadedSlot {
        LoadedSlot {
            tokens: Vec::new(),
            keys: vec![Vec::new(); num_layers],
            values: vec![Vec::new(); num_layers],
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

/// The KV state a slot file persists, read as position-major rows of `kv_dim` floats per layer
/// (the engine keeps its cache head-major and converts only the rows a record holds).
pub trait KvRows {
    fn num_layers(&self) -> usize;
    /// Positions every layer holds rows for.
    fn positions(&self) -> usize;
    /// Keys and values of `layer` at `positions` (within [`KvRows::positions`]), row by row.
    fn rows(&self, layer: usize, positions: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>);
}

/// Per-layer position-major vectors (`keys[layer][pos * kv_dim ..]`), as [`LoadedSlot`] holds.
pub struct PositionMajor<'a> {
    pub keys: &'a [Vec<f32>],
    pub values: &'a [Vec<f32>],
    pub kv_dim: usize,
}

impl KvRows for PositionMajor<'_> {
    fn num_layers(&self) -> usize {
        if self.keys.len() == self.values.len() {
            self.keys.len()
        } else {
            usize::MAX // never equal to a file's layer count: refused by `check_state`
        }
    }

    fn positions(&self) -> usize {
        self.keys
            .iter()
            .chain(self.values)
            .map(|v| v.len() / self.kv_dim.max(1))
            .min()
            .unwrap_or(usize::MAX)
    }

    fn rows(&self, layer: usize, positions: Range<usize>) -> (Cow<'_, [f32]>, Cow<'_, [f32]>) {
        let r = positions.start * self.kv_dim..positions.end * self.kv_dim;
        (
            Cow::Borrowed(&self.keys[layer][r.clone()]),
            Cow::Borrowed(&self.values[layer][r]),
        )
    }
}

/// An open slot file, locked (advisory `flock`) against a second process using it.
pub struct SlotFile {
    file: File,
    path: PathBuf,
    fingerprint: [u8; 32],
    num_layers: usize,
    kv_dim: usize,
    per_token: u64,
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
            .field("num_layers", &self.num_layers)
            .field("kv_dim", &self.kv_dim)
            .field("persisted_tokens", &self.tokens.len())
            .field("committed_bytes", &self.end)
            .field("seq", &self.seq)
            .finish()
    }
}

impl SlotFile {
    /// Opens (creating if missing) the slot file at `path` for this layout; an existing valid
    /// file is loaded, an invalid/foreign one is refused and replaced by an empty file.
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
        Self::open_with(
            path,
            fingerprint,
            num_layers,
            kv_dim,
            Box::new(RealIo),
            Tuning::default(),
        )
    }

    fn open_with(
        path: &Path,
        fingerprint: [u8; 32],
        num_layers: usize,
        kv_dim: usize,
        io: Box<dyn Io>,
        tuning: Tuning,
    ) -> Result<(SlotFile, Opened)> {
        let per_token = token_bytes(num_layers, kv_dim).ok_or_else(|| {
            Error::Input(format!(
                "KV layout {num_layers} layers x {kv_dim} is too large"
            ))
        })?;
        let file = open_locked(path)?;
        // A compaction killed before its rename; only the lock holder writes it.
        let _ = fs::remove_file(tmp_path(path));
        let mut sf = SlotFile {
            file,
            path: path.to_path_buf(),
            fingerprint,
            num_layers,
            kv_dim,
            per_token,
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
        let empty_kv = PositionMajor {
            keys: &empty.keys,
            values: &empty.values,
            kv_dim,
        };
        let found = match sf.file.metadata() {
            Ok(m) if m.len() == 0 => Ok(None),
            Ok(_) => load_from(&sf.file, fingerprint, num_layers, kv_dim),
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
