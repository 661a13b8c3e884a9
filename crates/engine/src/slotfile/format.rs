//! The slot file's byte layout: the header copies and records, their checksums, and the
//! fuzzing helper that re-seals them (`docs/FORMATS.md`, "KV slot files").

use xxhash_rust::xxh3::xxh3_64;

use crate::kv::KvLayout;

/// The slot file format version of a model without linear-attention states; a file of any
/// other version is refused.
pub const SLOT_FILE_VERSION: u32 = 1;
/// The version of a model whose layers carry fixed-size states: the log also holds state
/// records ([`STATE_MAGIC`]). Builds that read only version 1 refuse these files by version.
pub const STATE_SLOT_FILE_VERSION: u32 = 2;
/// The version of a model with a layer that keeps one row per several positions (DeepSeek-V4's
/// compressed entries): a record holds, per layer, the rows its positions complete, so its size
/// depends on its `start` too; state records as in version 2. Builds that read only versions 1
/// and 2 refuse these files by version.
pub const ROWS_SLOT_FILE_VERSION: u32 = 3;

/// Every version this build reads, for a message.
pub(super) const VERSIONS: &str = "1, 2 and 3";

/// First 8 bytes of every header copy.
pub const SLOT_FILE_MAGIC: [u8; 8] = *b"CLBKVSLT";
/// First 4 bytes of every record.
pub const RECORD_MAGIC: [u8; 4] = *b"KVRC";
/// First 4 bytes of a state record (version 2): every state layer's state after `position`
/// positions.
pub const STATE_MAGIC: [u8; 4] = *b"KVST";
/// A state record's fixed part: magic, reserved, position, floats.
pub(super) const STATE_HEAD: u64 = 24;
/// Number of header copies at the start of the file.
pub const HEADER_COPIES: usize = 3;
/// Each header copy owns one 4 KiB block (so no two copies share a page or a disk sector).
pub const HEADER_BLOCK: u64 = 4096;
/// Byte offset of the record log (the end of the header region).
pub const LOG_START: u64 = HEADER_COPIES as u64 * HEADER_BLOCK;
/// Bytes of a header copy that carry data (the rest of its block is zero).
pub(super) const HEADER_LEN: usize = 104;
/// Bytes of a header covered by its checksum.
pub(super) const HEADER_SUMMED: usize = 96;
/// A record's fixed part before the tokens: magic, reserved, start, n.
pub(super) const RECORD_HEAD: u64 = 24;
/// A record's trailing checksum.
pub(super) const RECORD_TAIL: u64 = 8;

/// One header copy (the decoded fields; magic and version are implied).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Header {
    /// [`SLOT_FILE_VERSION`], [`STATE_SLOT_FILE_VERSION`] for a model with states, or
    /// [`ROWS_SLOT_FILE_VERSION`] for one with a layer of a row per several positions.
    pub(super) version: u32,
    pub(super) fingerprint: [u8; 32],
    pub(super) num_layers: u64,
    pub(super) kv_dim: u64,
    /// Commit sequence number: the newest valid copy wins. 0 is never written.
    pub(super) seq: u64,
    /// Absolute byte offset where the committed log ends.
    pub(super) end: u64,
    /// Tokens in the committed state.
    pub(super) tokens: u64,
    /// Checksum of the last committed record (0 for an empty log): closes the hash chain.
    pub(super) chain: u64,
}

impl Header {
    pub(super) fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&SLOT_FILE_MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        // 12..16 reserved, zero.
        b[16..48].copy_from_slice(&self.fingerprint);
        b[48..56].copy_from_slice(&self.num_layers.to_le_bytes());
        b[56..64].copy_from_slice(&self.kv_dim.to_le_bytes());
        b[64..72].copy_from_slice(&self.seq.to_le_bytes());
        b[72..80].copy_from_slice(&self.end.to_le_bytes());
        b[80..88].copy_from_slice(&self.tokens.to_le_bytes());
        b[88..96].copy_from_slice(&self.chain.to_le_bytes());
        let sum = xxh3_64(&b[..HEADER_SUMMED]);
        b[96..104].copy_from_slice(&sum.to_le_bytes());
        b
    }
}

/// What one header block holds.
pub(super) enum Block {
    Valid(Header),
    /// Our magic, another version (read only when the checksum cannot vouch for it either).
    Version(u32),
    /// Our magic and version, but the checksum fails (torn or corrupted).
    Torn,
    /// Not our magic.
    Foreign,
}

pub(super) fn le_u32(b: &[u8], at: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(a)
}

pub(super) fn le_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(a)
}

pub(super) fn parse_block(b: &[u8]) -> Block {
    if b.len() < HEADER_LEN || b[0..8] != SLOT_FILE_MAGIC {
        return Block::Foreign;
    }
    // The version sits at a fixed offset in every version; it is read before the checksum,
    // whose scheme another version may change.
    let version = le_u32(b, 8);
    if ![
        SLOT_FILE_VERSION,
        STATE_SLOT_FILE_VERSION,
        ROWS_SLOT_FILE_VERSION,
    ]
    .contains(&version)
    {
        return Block::Version(version);
    }
    if le_u64(b, 96) != xxh3_64(&b[..HEADER_SUMMED]) || le_u32(b, 12) != 0 {
        return Block::Torn;
    }
    let mut fingerprint = [0u8; 32];
    fingerprint.copy_from_slice(&b[16..48]);
    Block::Valid(Header {
        version,
        fingerprint,
        num_layers: le_u64(b, 48),
        kv_dim: le_u64(b, 56),
        seq: le_u64(b, 64),
        end: le_u64(b, 72),
        tokens: le_u64(b, 80),
        chain: le_u64(b, 88),
    })
}

pub(super) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Bytes one token takes in a record of a uniform layout: its id plus keys and values in
/// every layer.
pub(super) fn token_bytes(num_layers: usize, kv_dim: usize) -> Option<u64> {
    (num_layers as u64)
        .checked_mul(kv_dim as u64)?
        .checked_mul(8)?
        .checked_add(4)
}

/// Bit 63 of the header's `kv_dim` field: set, the field is a digest of the per-layer widths
/// (a layout whose layers do not all keep `w` keys and `w` values per position); clear, it is
/// that `w`. A real `w` never reaches it (a token's bytes would overflow).
pub(super) const MIXED_WIDTHS: u64 = 1 << 63;

/// What a slot file's records hold per position: per layer, the f32 keys and values of all its
/// heads, the header's `kv_dim` field that stands for them, and a token's bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    /// Per layer: (key floats, value floats) per row.
    pub(super) widths: Vec<(usize, usize)>,
    /// Per layer: positions per row (1: a row per position; `e`: positions `0 .. len` hold
    /// `len / e` rows, [`crate::kv::LayerKv::rows`]).
    pub(super) every: Vec<usize>,
    /// The header's `kv_dim` field: `w` when every layer keeps `w` keys and `w` values per
    /// position, else [`MIXED_WIDTHS`] with a digest of `widths`.
    pub(super) kv_dim: u64,
    /// Bytes a position takes in a record: its id, then 4 * the widths of the layers of a row
    /// per position ([`token_bytes`] for a uniform layout); see [`Shape::record_len`].
    pub(super) per_token: u64,
    /// Per layer: floats of its fixed-size state (linear attention; 0: none). Any state makes
    /// the file version [`STATE_SLOT_FILE_VERSION`], with state records in its log.
    pub(super) states: Vec<usize>,
}

impl Shape {
    /// `num_layers` layers of `kv_dim` keys and `kv_dim` values per position (the header holds
    /// `kv_dim` as given, whatever the layer count).
    pub(super) fn uniform(num_layers: usize, kv_dim: usize) -> Result<Shape, String> {
        let too_large = || format!("KV layout {num_layers} layers x {kv_dim} is too large");
        let per_token = token_bytes(num_layers, kv_dim).ok_or_else(too_large)?;
        let mut widths = Vec::new();
        widths
            .try_reserve_exact(num_layers)
            .map_err(|_| too_large())?;
        widths.resize(num_layers, (kv_dim, kv_dim));
        Ok(Shape {
            every: vec![1; num_layers],
            widths,
            kv_dim: kv_dim as u64,
            per_token,
            states: vec![0; num_layers],
        })
    }

    /// The records of `layout`: per layer `heads * key_dim` keys and `heads * value_dim`
    /// values per row (a row per position, or per `every` positions).
    pub(super) fn of(layout: &KvLayout) -> Result<Shape, String> {
        let too_large = || format!("KV layout of {} layers is too large", layout.layers.len());
        let mut widths = Vec::with_capacity(layout.layers.len());
        let mut every = Vec::with_capacity(layout.layers.len());
        let mut floats = 0u64;
        let mut all = 0u64;
        for l in &layout.layers {
            if l.every == 0 {
                return Err("a KV layer keeps a row per 0 positions".into());
            }
            let k = l.heads.checked_mul(l.key_dim).ok_or_else(too_large)?;
            let v = l.heads.checked_mul(l.value_dim).ok_or_else(too_large)?;
            let kv = (k as u64).checked_add(v as u64).ok_or_else(too_large)?;
            all = all.checked_add(kv).ok_or_else(too_large)?;
            if l.every == 1 {
                floats += kv;
            }
            widths.push((k, v));
            every.push(l.every);
        }
        all.checked_mul(4).ok_or_else(too_large)?;
        let per_token = floats
            .checked_mul(4)
            .and_then(|b| b.checked_add(4))
            .ok_or_else(too_large)?;
        let kv_dim = match widths.first() {
            None => 0,
            Some(&(w, _)) if widths.iter().all(|&p| p == (w, w)) => w as u64,
            Some(_) => {
                let mut bytes: Vec<u8> = widths
                    .iter()
                    .flat_map(|&(k, v)| [(k as u64).to_le_bytes(), (v as u64).to_le_bytes()])
                    .flatten()
                    .collect();
                // The positions per row join the digest only when some layer has more than
                // one (the layouts of before keep their digest).
                if every.iter().any(|&e| e != 1) {
                    bytes.extend(every.iter().flat_map(|&e| (e as u64).to_le_bytes()));
                }
                MIXED_WIDTHS | xxh3_64(&bytes)
            }
        };
        let states = vec![0; widths.len()];
        Ok(Shape {
            every,
            widths,
            kv_dim,
            per_token,
            states,
        })
    }

    /// The same records, with `states[li]` floats of state in each layer.
    pub(super) fn with_states(mut self, states: &[usize]) -> Result<Shape, String> {
        if states.len() != self.widths.len() {
            return Err(format!(
                "{} state widths for {} layers",
                states.len(),
                self.widths.len()
            ));
        }
        states
            .iter()
            .try_fold(0u64, |a, &s| a.checked_add(s as u64))
            .filter(|&f| f.checked_mul(4).is_some())
            .ok_or("the layers' states are too large")?;
        self.states = states.to_vec();
        Ok(self)
    }

    /// Floats of a state record's data: every layer's state.
    pub(super) fn state_floats(&self) -> u64 {
        self.states.iter().map(|&s| s as u64).sum()
    }

    pub(super) fn has_states(&self) -> bool {
        self.state_floats() > 0
    }

    /// Whether a layer keeps a row per several positions.
    pub(super) fn has_sparse_rows(&self) -> bool {
        self.every.iter().any(|&e| e > 1)
    }

    /// Rows of layer `l` written by positions `start .. start + n`: `(start + n) / every -
    /// start / every` (None when `start + n` overflows).
    pub(super) fn rows_in(&self, l: usize, start: u64, n: u64) -> Option<u64> {
        let e = self.every[l] as u64;
        Some(start.checked_add(n)? / e - start / e)
    }

    /// Bytes of a record of positions `start .. start + n` (None on overflow).
    pub(super) fn record_len(&self, start: u64, n: u64) -> Option<u64> {
        let mut len = record_len(n, self.per_token)?;
        for (l, &(kw, vw)) in self.widths.iter().enumerate() {
            if self.every[l] > 1 {
                let floats = self
                    .rows_in(l, start, n)?
                    .checked_mul(kw as u64 + vw as u64)?;
                len = len.checked_add(floats.checked_mul(4)?)?;
            }
        }
        Some(len)
    }

    /// The version of this shape's files.
    pub(super) fn version(&self) -> u32 {
        if self.has_sparse_rows() {
            ROWS_SLOT_FILE_VERSION
        } else if self.has_states() {
            STATE_SLOT_FILE_VERSION
        } else {
            SLOT_FILE_VERSION
        }
    }

    pub(super) fn num_layers(&self) -> usize {
        self.widths.len()
    }

    /// The layout a header's fields stand for, for a message.
    pub(super) fn describe(num_layers: u64, kv_dim: u64) -> String {
        if kv_dim & MIXED_WIDTHS != 0 {
            format!("{num_layers} layers of per-layer widths (digest {kv_dim:016x})")
        } else {
            format!("{num_layers} layers x {kv_dim} floats")
        }
    }
}

/// Bytes of a state record of `floats` floats.
pub(super) fn state_record_len(floats: u64) -> Option<u64> {
    floats.checked_mul(4)?.checked_add(STATE_HEAD + RECORD_TAIL)
}

/// Bytes of a record of `n` tokens.
pub(super) fn record_len(n: u64, per_token: u64) -> Option<u64> {
    n.checked_mul(per_token)?
        .checked_add(RECORD_HEAD + RECORD_TAIL)
}

/// Fuzzing support: recomputes every checksum in `bytes` (records as far as they chain from
/// the log start, then each header copy with our magic, whose `chain` is set to the chain value
/// at its committed end when a record ends there), so mutated fields reach the replay logic
/// instead of stopping at a checksum. For `num_layers` layers of `kv_dim` keys and values per
/// position ([`reseal_layout`]: any layout). Never panics; O(len).
#[doc(hidden)]
pub fn reseal(bytes: &mut [u8], num_layers: usize, kv_dim: usize) {
    if let Ok(shape) = Shape::uniform(num_layers, kv_dim) {
        reseal_records(bytes, &shape);
    }
}

/// [`reseal`] for the slot files of `layout`.
#[doc(hidden)]
pub fn reseal_layout(bytes: &mut [u8], layout: &KvLayout) {
    if let Ok(shape) = Shape::of(layout) {
        reseal_records(bytes, &shape);
    }
}

/// [`reseal`] for the (version-2 or 3) slot files of `layout` with `states[li]` floats of state
/// per layer: state records are resealed too.
#[doc(hidden)]
pub fn reseal_layout_states(bytes: &mut [u8], layout: &KvLayout, states: &[usize]) {
    if let Ok(shape) = Shape::of(layout).and_then(|s| s.with_states(states)) {
        reseal_records(bytes, &shape);
    }
}

fn reseal_records(bytes: &mut [u8], shape: &Shape) {
    let state_floats = shape.state_floats();
    let size = bytes.len() as u64;
    let mut ends = vec![(LOG_START, 0u64)];
    let (mut pos, mut chain) = (LOG_START, 0u64);
    while size >= pos + RECORD_HEAD + RECORD_TAIL {
        let at = pos as usize;
        if state_floats > 0 && bytes[at..at + 4] == STATE_MAGIC {
            let floats = le_u64(bytes, at + 16);
            if floats != state_floats || floats > (size - pos - STATE_HEAD - RECORD_TAIL) / 4 {
                break;
            }
            let body_end = (pos + STATE_HEAD + 4 * floats) as usize;
            let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[at..body_end], chain);
            bytes[body_end..body_end + 8].copy_from_slice(&sum.to_le_bytes());
            chain = sum;
            pos = body_end as u64 + RECORD_TAIL;
            ends.push((pos, chain));
            continue;
        }
        if bytes[at..at + 4] != RECORD_MAGIC {
            break;
        }
        let (start, n) = (le_u64(bytes, at + 8), le_u64(bytes, at + 16));
        let Some(len) = shape.record_len(start, n).filter(|&l| l <= size - pos) else {
            break;
        };
        let body_end = (pos + len - RECORD_TAIL) as usize;
        let sum = xxhash_rust::xxh3::xxh3_64_with_seed(&bytes[at..body_end], chain);
        bytes[body_end..body_end + 8].copy_from_slice(&sum.to_le_bytes());
        chain = sum;
        pos = body_end as u64 + RECORD_TAIL;
        ends.push((pos, chain));
    }
    for i in 0..HEADER_COPIES {
        let at = i * HEADER_BLOCK as usize;
        let Some(b) = bytes.get_mut(at..at + HEADER_LEN) else {
            break;
        };
        if b[0..8] != SLOT_FILE_MAGIC {
            continue;
        }
        let end = le_u64(b, 72);
        if let Some(&(_, c)) = ends.iter().find(|(e, _)| *e == end) {
            b[88..96].copy_from_slice(&c.to_le_bytes());
        }
        let sum = xxh3_64(&b[..HEADER_SUMMED]);
        b[96..104].copy_from_slice(&sum.to_le_bytes());
    }
}
