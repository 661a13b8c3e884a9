//! The slot file end to end: the crash and power-loss simulators, round trips, damage and
//! foreign files.

use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use super::format::{parse_block, record_len, token_bytes, Block, HEADER_SUMMED};
use super::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

const L: usize = 2;
const D: usize = 3;
const FP: [u8; 32] = [0xa5; 32];

/// The seeded generator of these tests, with the draws they need.
struct Rng(rand::rngs::StdRng);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(rand::SeedableRng::seed_from_u64(seed))
    }
    fn next(&mut self) -> u64 {
        rand::RngExt::random(&mut self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        rand::RngExt::random_range(&mut self.0, 0..n.max(1))
    }
    /// Mostly ordinary floats, with NaN payloads, signed zeros, infinities and subnormals.
    fn float(&mut self) -> f32 {
        match self.below(8) {
            0 => f32::from_bits(self.next() as u32), // any bit pattern, NaNs included
            1 => f32::from_bits(0x7fc0_1234),
            2 => -0.0,
            3 => f32::from_bits(1 + self.below(100) as u32),
            4 => f32::NEG_INFINITY,
            _ => (self.next() % 20001) as f32 / 1000.0 - 10.0,
        }
    }
}

/// A scratch directory, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(tag: &str) -> Scratch {
        static N: AtomicUsize = AtomicUsize::new(0);
        let base = if Path::new("/dev/shm").is_dir() {
            PathBuf::from("/dev/shm")
        } else {
            std::env::temp_dir()
        };
        let d = base.join(format!(
            "colibri-slotfile-{}-{tag}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
    fn file(&self) -> PathBuf {
        self.0.join("slot.kv")
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn same(a: &LoadedSlot, b: &LoadedSlot) -> bool {
    let bits = |v: &Vec<Vec<f32>>| -> Vec<Vec<u32>> {
        v.iter()
            .map(|l| l.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    a.tokens == b.tokens && bits(&a.keys) == bits(&b.keys) && bits(&a.values) == bits(&b.values)
}

/// Truncates `s` to `start` and appends `n` random positions.
fn advance(s: &mut LoadedSlot, rng: &mut Rng, start: usize, n: usize, kv_dim: usize) {
    s.tokens.truncate(start);
    for _ in 0..n {
        s.tokens.push(rng.next() as u32);
    }
    for v in s.keys.iter_mut().chain(s.values.iter_mut()) {
        v.truncate(start * kv_dim);
        for _ in 0..n * kv_dim {
            v.push(rng.float());
        }
    }
}

fn commit(sf: &mut SlotFile, s: &LoadedSlot, start: usize) -> Result<()> {
    sf.commit(start, &s.tokens[start..], &s.keys, &s.values)
}

fn sync(sf: &mut SlotFile, s: &LoadedSlot) -> Result<()> {
    sf.sync(&s.tokens, &s.keys, &s.values)
}

fn load(path: &Path) -> std::result::Result<LoadedSlot, String> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => panic!("{e}"),
    };
    Ok(load_bytes(&bytes, FP, L, D)?.unwrap_or_else(|| LoadedSlot::empty(L)))
}

// -----------------------------------------------------------------------------------------
// The crash simulator

/// How much of the write a kill interrupts lands.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Tear {
    Nothing,
    OneByte,
    Half,
    AllButOne,
    /// Every other 4-byte block (a torn write that reached some sectors).
    Scatter,
}

const TEARS: [Tear; 5] = [
    Tear::Nothing,
    Tear::OneByte,
    Tear::Half,
    Tear::AllButOne,
    Tear::Scatter,
];

#[derive(Default)]
struct Log {
    ops: usize,
    dead: bool,
    killed_a_write: bool,
    /// The main file's bytes at its last fsync, and the writes since (power-loss model).
    synced: Vec<u8>,
    pending: Vec<(u64, Vec<u8>)>,
}

/// An [`Io`] that dies at its `kill_at`-th call (1-based): that call is torn per `tear`,
/// every later one fails without effect. fsyncs do nothing (a process kill does not care)
/// but snapshot the file for the power-loss model.
struct Killer {
    log: Arc<Mutex<Log>>,
    kill_at: usize,
    tear: Tear,
}

fn killed() -> io::Error {
    io::Error::other("killed by the test")
}

impl Killer {
    fn new(kill_at: usize, tear: Tear) -> (Killer, Arc<Mutex<Log>>) {
        let log = Arc::new(Mutex::new(Log::default()));
        let k = Killer {
            log: log.clone(),
            kill_at,
            tear,
        };
        (k, log)
    }

    /// Ok(true): this call is the kill.
    fn step(&mut self, is_write: bool) -> io::Result<bool> {
        let mut g = self.log.lock().unwrap();
        if g.dead {
            return Err(killed());
        }
        g.ops += 1;
        if g.ops == self.kill_at {
            g.dead = true;
            g.killed_a_write = is_write;
            return Ok(true);
        }
        Ok(false)
    }
}

impl Io for Killer {
    fn write_at(&mut self, file: &File, buf: &[u8], offset: u64) -> io::Result<()> {
        if self.step(true)? {
            let m = buf.len();
            let land: Vec<(usize, usize)> = match self.tear {
                Tear::Nothing => vec![],
                Tear::OneByte => vec![(0, 1.min(m))],
                Tear::Half => vec![(0, m / 2)],
                Tear::AllButOne => vec![(0, m.saturating_sub(1))],
                Tear::Scatter => (0..m).step_by(8).map(|a| (a, (a + 4).min(m))).collect(),
            };
            for (a, b) in land {
                file.write_all_at(&buf[a..b], offset + a as u64)?;
            }
            return Err(killed());
        }
        file.write_all_at(buf, offset)?;
        self.log
            .lock()
            .unwrap()
            .pending
            .push((offset, buf.to_vec()));
        Ok(())
    }
    fn set_len(&mut self, file: &File, len: u64) -> io::Result<()> {
        if self.step(false)? {
            return Err(killed());
        }
        file.set_len(len)
    }
    fn sync_file(&mut self, file: &File) -> io::Result<()> {
        if self.step(false)? {
            return Err(killed());
        }
        let mut image = vec![0u8; file.metadata()?.len() as usize];
        file.read_exact_at(&mut image, 0)?;
        let mut g = self.log.lock().unwrap();
        g.synced = image;
        g.pending.clear();
        Ok(())
    }
    fn rename(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        if self.step(false)? {
            return Err(killed());
        }
        fs::rename(from, to)
    }
    fn sync_dir(&mut self, _dir: &Path) -> io::Result<()> {
        if self.step(false)? {
            return Err(killed());
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
enum Step {
    Commit(usize, usize),
    Sync,
}

use Step::{Commit as C, Sync as S};

/// Appends of 1 and many tokens, truncations (with and without new tokens), and two syncs
/// that compact (with `compact_slack: 0`).
const SCRIPT: [Step; 15] = [
    C(0, 5),
    C(5, 1),
    C(6, 1),
    S,
    C(3, 4),
    C(2, 0),
    S, // compacts
    C(2, 6),
    C(8, 1),
    C(9, 1),
    S,
    C(0, 3),
    C(3, 2),
    S, // compacts
    C(5, 1),
];

const SMALL: Tuning = Tuning {
    chunk: 40,
    compact_slack: 0,
};

/// Runs SCRIPT with a writer killed at its `kill_at`-th call. Returns whether the kill
/// happened, whether it hit a write, and the states the file may now hold.
fn run_killed(path: &Path, kill_at: usize, tear: Tear) -> (bool, bool, Vec<LoadedSlot>) {
    let (killer, log) = Killer::new(kill_at, tear);
    let mut rng = Rng::new(42);
    let mut truth = LoadedSlot::empty(L);
    let acceptable = match SlotFile::open_with(path, FP, L, D, Box::new(killer), SMALL) {
        Err(_) => vec![truth],
        Ok((mut sf, opened)) => {
            assert!(matches!(opened, Opened::Fresh), "{opened:?}");
            let mut outcome = None;
            for step in SCRIPT {
                match step {
                    Step::Commit(start, n) => {
                        let before = truth.clone();
                        advance(&mut truth, &mut rng, start, n, D);
                        if commit(&mut sf, &truth, start).is_err() {
                            outcome = Some(vec![before, truth.clone()]);
                            break;
                        }
                        assert_eq!(sf.persisted_tokens(), truth.tokens.len());
                    }
                    Step::Sync => {
                        if sync(&mut sf, &truth).is_err() {
                            outcome = Some(vec![truth.clone()]);
                            break;
                        }
                    }
                }
            }
            outcome.unwrap_or_else(|| vec![truth])
        }
    };
    let g = log.lock().unwrap();
    (g.dead, g.killed_a_write, acceptable)
}

#[test]
fn a_kill_at_any_write_leaves_the_last_or_the_inflight_commit() {
    let mut runs = 0;
    for kill_at in 1.. {
        let mut done = false;
        for tear in TEARS {
            let dir = Scratch::new("kill");
            let path = dir.file();
            let (killed, hit_write, acceptable) = run_killed(&path, kill_at, tear);
            runs += 1;
            if !killed {
                done = true;
            }
            let got = load(&path)
                .unwrap_or_else(|why| panic!("kill at call {kill_at} ({tear:?}): refused: {why}"));
            assert!(
                acceptable.iter().any(|s| same(s, &got)),
                "kill at call {kill_at} ({tear:?}): {} tokens loaded, not a state just committed",
                got.tokens.len()
            );
            // The server restarts on the file and carries on.
            let (mut sf, opened) = SlotFile::open(&path, FP, L, D).unwrap();
            match opened {
                Opened::Fresh => assert!(got.tokens.is_empty()),
                Opened::Loaded(s) => assert!(same(&s, &got)),
                Opened::Refused(why) => panic!("refused on reopen: {why}"),
            }
            let mut next = got;
            let start = next.tokens.len() / 2;
            advance(&mut next, &mut Rng::new(kill_at as u64), start, 2, D);
            commit(&mut sf, &next, start).unwrap();
            sync(&mut sf, &next).unwrap();
            drop(sf);
            assert!(same(&load(&path).unwrap(), &next));
            assert!(!tmp_path(&path).exists() || kill_at > 0);
            if !hit_write {
                break; // the other tears are the same kill
            }
        }
        if done {
            break;
        }
    }
    assert!(runs > 100, "only {runs} runs");
}

#[test]
fn a_kill_while_reopening_a_damaged_file_is_harmless() {
    let dir = Scratch::new("reopen");
    let path = dir.file();
    let mut rng = Rng::new(5);
    let mut s = LoadedSlot::empty(L);
    let (mut sf, _) = SlotFile::open(&path, FP, L, D).unwrap();
    advance(&mut s, &mut rng, 0, 4, D);
    commit(&mut sf, &s, 0).unwrap();
    let older = s.clone();
    let older_end = sf.committed_bytes();
    advance(&mut s, &mut rng, 4, 3, D);
    commit(&mut sf, &s, 4).unwrap();
    sync(&mut sf, &s).unwrap();
    drop(sf);
    // Damage the newest record: the newest header no longer verifies, the older one does.
    let mut bytes = fs::read(&path).unwrap();
    bytes[older_end as usize + 30] ^= 0x10;
    bytes.extend([7u8; 100]); // and leftovers past the end
    for kill_at in 1..10 {
        for tear in TEARS {
            fs::write(&path, &bytes).unwrap();
            let (killer, _) = Killer::new(kill_at, tear);
            let r = SlotFile::open_with(&path, FP, L, D, Box::new(killer), SMALL);
            if let Ok((_, opened)) = &r {
                assert!(matches!(opened, Opened::Loaded(x) if same(x, &older)));
            }
            drop(r);
            assert!(same(&load(&path).unwrap(), &older), "kill at {kill_at}");
            let (_, opened) = SlotFile::open(&path, FP, L, D).unwrap();
            assert!(matches!(opened, Opened::Loaded(x) if same(&x, &older)));
        }
    }
    // Once adopted, the bad header is gone and the file is exactly the older state.
    assert_eq!(fs::metadata(&path).unwrap().len(), older_end);
}

/// Power loss: the file as of the last fsync plus any subset of the later writes, each
/// whole, torn or lost, in any order. It must load a state committed since that fsync.
#[test]
fn a_power_loss_loads_a_state_committed_since_the_last_sync() {
    let dir = Scratch::new("power");
    let path = dir.file();
    let (killer, log) = Killer::new(usize::MAX, Tear::Nothing);
    let tuning = Tuning {
        chunk: 40,
        compact_slack: u64::MAX / 4,
    };
    let (mut sf, _) = SlotFile::open_with(&path, FP, L, D, Box::new(killer), tuning).unwrap();
    let mut rng = Rng::new(9);
    let mut truth = LoadedSlot::empty(L);
    let mut states = vec![truth.clone()];
    let mut synced = 0;
    let mut trials = 0;
    for step in SCRIPT.iter().chain(&SCRIPT) {
        match *step {
            Step::Commit(start, n) => {
                let start = start.min(truth.tokens.len());
                advance(&mut truth, &mut rng, start, n, D);
                commit(&mut sf, &truth, start).unwrap();
                states.push(truth.clone());
            }
            Step::Sync => {
                sync(&mut sf, &truth).unwrap();
                synced = states.len() - 1;
            }
        }
        let (image, pending) = {
            let g = log.lock().unwrap();
            (g.synced.clone(), g.pending.clone())
        };
        for trial in 0..40 {
            let mut disk = image.clone();
            let mut order: Vec<usize> = (0..pending.len()).collect();
            if trial > 1 {
                for i in (1..order.len()).rev() {
                    order.swap(i, rng.below(i + 1));
                }
            }
            for &i in &order {
                let (off, buf) = &pending[i];
                let fate = match trial {
                    0 => 1,            // everything lands, in order
                    1 => 0,            // nothing lands
                    _ => rng.below(4), // lost, whole, torn, scattered
                };
                let off = *off as usize;
                if disk.len() < off + buf.len() && fate != 0 {
                    disk.resize(off + buf.len(), 0);
                }
                match fate {
                    0 => {}
                    1 => disk[off..off + buf.len()].copy_from_slice(buf),
                    2 => {
                        let m = rng.below(buf.len() + 1);
                        disk[off..off + m].copy_from_slice(&buf[..m]);
                    }
                    _ => {
                        for a in (0..buf.len()).filter(|_| rng.below(2) == 0) {
                            disk[off + a] = buf[a];
                        }
                    }
                }
            }
            let got = load_bytes(&disk, FP, L, D)
                .unwrap_or_else(|why| panic!("refused after a power loss: {why}"))
                .unwrap();
            let ok = states[synced..].iter().any(|s| same(s, &got));
            assert!(
                ok,
                "loaded a state older than the last sync or never committed"
            );
            if trial == 0 {
                assert!(same(&got, states.last().unwrap()));
            }
            if trial == 1 {
                assert!(same(&got, &states[synced]));
            }
            trials += 1;
        }
    }
    assert!(trials > 500);
}

// -----------------------------------------------------------------------------------------
// Round trips, damage, foreign files

/// A file written by the script (no compaction), with every state it committed.
fn scripted_file(tuning: Tuning, seed: u64) -> (Vec<u8>, Vec<LoadedSlot>) {
    let dir = Scratch::new("scripted");
    let path = dir.file();
    let (mut sf, _) = SlotFile::open_with(&path, FP, L, D, Box::new(RealIo), tuning).unwrap();
    let mut rng = Rng::new(seed);
    let mut truth = LoadedSlot::empty(L);
    let mut states = vec![truth.clone()];
    for step in SCRIPT {
        match step {
            Step::Commit(start, n) => {
                advance(&mut truth, &mut rng, start, n, D);
                commit(&mut sf, &truth, start).unwrap();
                states.push(truth.clone());
            }
            Step::Sync => sync(&mut sf, &truth).unwrap(),
        }
    }
    drop(sf);
    (fs::read(&path).unwrap(), states)
}

const NO_COMPACTION: Tuning = Tuning {
    chunk: 1 << 20,
    compact_slack: u64::MAX / 4,
};

#[test]
fn commits_round_trip_bit_exact() {
    let dir = Scratch::new("roundtrip");
    let path = dir.file();
    let mut rng = Rng::new(1);
    let mut truth = LoadedSlot::empty(L);
    let (mut sf, opened) = SlotFile::open(&path, FP, L, D).unwrap();
    assert!(matches!(opened, Opened::Fresh));
    for round in 0..4 {
        // A prefill, single-token decode steps, a truncation to a shorter prefix, more.
        let start = truth.tokens.len();
        advance(&mut truth, &mut rng, start, 20 + round, D);
        commit(&mut sf, &truth, start).unwrap();
        for _ in 0..5 {
            let start = truth.tokens.len();
            advance(&mut truth, &mut rng, start, 1, D);
            commit(&mut sf, &truth, start).unwrap();
        }
        let start = truth.tokens.len() - 7;
        advance(&mut truth, &mut rng, start, 3, D);
        commit(&mut sf, &truth, start).unwrap();
        sync(&mut sf, &truth).unwrap();
        assert_eq!(sf.persisted_tokens(), truth.tokens.len());
        assert_eq!(sf.tokens(), &truth.tokens[..]);
        drop(sf);
        let (again, opened) = SlotFile::open(&path, FP, L, D).unwrap();
        sf = again;
        match opened {
            Opened::Loaded(s) => assert!(same(&s, &truth)),
            other => panic!("{other:?}"),
        }
    }
    // Truncating everything is a commit too.
    advance(&mut truth, &mut rng, 0, 0, D);
    commit(&mut sf, &truth, 0).unwrap();
    drop(sf);
    let (_, opened) = SlotFile::open(&path, FP, L, D).unwrap();
    assert!(matches!(opened, Opened::Fresh));
}

#[test]
fn records_larger_than_a_write_chunk_round_trip() {
    let dir = Scratch::new("chunks");
    let path = dir.file();
    let tuning = Tuning {
        chunk: 7,
        compact_slack: 0,
    };
    let mut rng = Rng::new(3);
    let mut truth = LoadedSlot::empty(L);
    let (mut sf, _) = SlotFile::open_with(&path, FP, L, D, Box::new(RealIo), tuning).unwrap();
    advance(&mut truth, &mut rng, 0, 50, D);
    commit(&mut sf, &truth, 0).unwrap();
    advance(&mut truth, &mut rng, 10, 1, D);
    commit(&mut sf, &truth, 10).unwrap();
    sync(&mut sf, &truth).unwrap(); // compacts, through 7-byte writes
    drop(sf);
    assert!(same(&load(&path).unwrap(), &truth));
}

#[test]
fn compaction_keeps_the_state_and_shrinks_the_file() {
    let dir = Scratch::new("compact");
    let path = dir.file();
    let tuning = Tuning {
        chunk: 1 << 20,
        compact_slack: 4096,
    };
    let mut rng = Rng::new(4);
    let mut truth = LoadedSlot::empty(L);
    let (mut sf, _) = SlotFile::open_with(&path, FP, L, D, Box::new(RealIo), tuning).unwrap();
    advance(&mut truth, &mut rng, 0, 30, D);
    commit(&mut sf, &truth, 0).unwrap();
    // Regenerate the tail many times: the log grows, the state does not.
    for _ in 0..40 {
        advance(&mut truth, &mut rng, 25, 5, D);
        commit(&mut sf, &truth, 25).unwrap();
    }
    let before = fs::metadata(&path).unwrap().len();
    assert!(sf.compaction_due());
    sync(&mut sf, &truth).unwrap();
    let after = fs::metadata(&path).unwrap().len();
    assert_eq!(
        after,
        LOG_START + record_len(30, token_bytes(L, D).unwrap()).unwrap()
    );
    assert!(
        (after - LOG_START) * 5 < before - LOG_START,
        "{before} -> {after}"
    );
    assert!(!tmp_path(&path).exists());
    // The compacted file keeps working: commit on it, reopen.
    advance(&mut truth, &mut rng, 30, 2, D);
    commit(&mut sf, &truth, 30).unwrap();
    drop(sf);
    let (_, opened) = SlotFile::open(&path, FP, L, D).unwrap();
    assert!(matches!(opened, Opened::Loaded(s) if same(&s, &truth)));
}

#[test]
fn truncation_at_every_offset_loads_a_committed_state_or_refuses() {
    let (bytes, states) = scripted_file(NO_COMPACTION, 77);
    for cut in 0..bytes.len() {
        match load_bytes(&bytes[..cut], FP, L, D) {
            Ok(None) => assert_eq!(cut, 0),
            Ok(Some(s)) => assert!(states.iter().any(|t| same(t, &s)), "cut at {cut}"),
            Err(_) => {}
        }
    }
    let full = load_bytes(&bytes, FP, L, D).unwrap().unwrap();
    assert!(same(&full, states.last().unwrap()));
}

#[test]
fn corruption_anywhere_loads_a_committed_state_or_refuses() {
    let (bytes, states) = scripted_file(NO_COMPACTION, 77);
    // Every byte flipped once (header blocks' used bytes and the whole log)...
    let mut offsets: Vec<usize> = (0..HEADER_COPIES)
        .flat_map(|i| i * HEADER_BLOCK as usize..i * HEADER_BLOCK as usize + HEADER_LEN)
        .collect();
    offsets.extend(LOG_START as usize..bytes.len());
    let mut refused = 0;
    for &at in &offsets {
        let mut b = bytes.clone();
        b[at] ^= 0x41;
        match load_bytes(&b, FP, L, D) {
            Ok(Some(s)) => assert!(states.iter().any(|t| same(t, &s)), "flip at {at}"),
            Ok(None) => panic!("flip at {at}: empty"),
            Err(_) => refused += 1,
        }
    }
    // ...flips in the log are caught, by a refusal or a fallback to an older header.
    assert!(refused < offsets.len());
    // ...and random damage: bytes, ranges, truncations, u64::MAX over a field.
    let mut rng = Rng::new(123);
    for i in 0..4000 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(3) {
            let at = if rng.below(2) == 0 {
                rng.below(b.len())
            } else {
                rng.below(HEADER_COPIES) * HEADER_BLOCK as usize + rng.below(HEADER_LEN)
            };
            let at = at.min(b.len() - 1);
            match rng.below(5) {
                0 => b[at] = rng.next() as u8,
                1 => b.truncate(at.max(1)),
                2 => {
                    let end = (at + rng.below(64)).min(b.len());
                    b[at..end].fill(0);
                }
                3 if at + 8 <= b.len() => b[at..at + 8].copy_from_slice(&[0xff; 8]),
                _ => b[at] ^= 1 << rng.below(8),
            }
        }
        match load_bytes(&b, FP, L, D) {
            Ok(Some(s)) => assert!(states.iter().any(|t| same(t, &s)), "case {i}"),
            Ok(None) => panic!("case {i}: empty"),
            Err(_) => {}
        }
    }
}

#[test]
fn a_header_accepts_only_the_log_it_committed() {
    // Two histories of the same shape: the same record sizes and token counts.
    let (a, _) = scripted_file(NO_COMPACTION, 77);
    let (b, _) = scripted_file(NO_COMPACTION, 78);
    assert_eq!(a.len(), b.len());
    let mut spliced = a[..LOG_START as usize].to_vec();
    spliced.extend_from_slice(&b[LOG_START as usize..]);
    let why = load_bytes(&spliced, FP, L, D).expect_err("another log");
    assert!(why.contains("checksum"), "{why}");
}

/// Rewrites every valid header copy through `edit` and re-seals its checksum.
fn edit_headers(bytes: &mut [u8], edit: impl Fn(&mut [u8])) {
    for i in 0..HEADER_COPIES {
        let b = &mut bytes[i * HEADER_BLOCK as usize..][..HEADER_LEN];
        if matches!(parse_block(b), Block::Valid(_)) {
            edit(b);
            let sum = xxh3_64(&b[..HEADER_SUMMED]);
            b[96..104].copy_from_slice(&sum.to_le_bytes());
        }
    }
}

#[test]
fn foreign_files_are_refused_with_a_reason() {
    let (bytes, _) = scripted_file(NO_COMPACTION, 77);
    let why = |b: &[u8], fp: [u8; 32], l: usize, d: usize| match load_bytes(b, fp, l, d) {
        Err(why) => why,
        Ok(_) => panic!("accepted"),
    };
    assert!(why(&bytes, [0; 32], L, D).contains("fingerprint"));
    assert!(why(&bytes, FP, L + 1, D).contains("KV layout 2 layers x 3"));
    assert!(why(&bytes, FP, L, D + 1).contains("KV layout"));
    let mut b = bytes.clone();
    edit_headers(&mut b, |h| h[8..12].copy_from_slice(&2u32.to_le_bytes()));
    assert!(
        why(&b, FP, L, D).contains("version 2"),
        "{}",
        why(&b, FP, L, D)
    );
    let mut b = bytes.clone();
    edit_headers(&mut b, |h| h[0] = b'X');
    assert!(why(&b, FP, L, D).contains("bad magic"));
    let mut b = bytes.clone();
    for i in 0..HEADER_COPIES {
        b[i * HEADER_BLOCK as usize + 70] ^= 1;
    }
    assert!(why(&b, FP, L, D).contains("checksum"));
    assert!(why(b"GGUF\x03\0\0\0 something else", FP, L, D).contains("bad magic"));
    assert!(why(&bytes[..100], FP, L, D).contains("truncated"));
    assert!(why(&vec![0u8; 20000], FP, L, D).contains("bad magic"));
    assert_eq!(load_bytes(&[], FP, L, D), Ok(None));
    // Absurd layouts from the caller do not overflow.
    assert!(load_bytes(&bytes, FP, usize::MAX, usize::MAX).is_err());
    assert!(load_bytes(&bytes, FP, 0, usize::MAX).is_err());
}

#[test]
fn open_refuses_and_resets_a_foreign_file() {
    let dir = Scratch::new("foreign");
    let path = dir.file();
    let mut s = LoadedSlot::empty(L);
    advance(&mut s, &mut Rng::new(8), 0, 3, D);
    let (mut sf, _) = SlotFile::open(&path, FP, L, D).unwrap();
    commit(&mut sf, &s, 0).unwrap();
    sync(&mut sf, &s).unwrap();
    drop(sf);
    // Another model's fingerprint.
    let (sf, opened) = SlotFile::open(&path, [1; 32], L, D).unwrap();
    assert!(matches!(&opened, Opened::Refused(w) if w.contains("fingerprint")));
    assert_eq!(sf.persisted_tokens(), 0);
    drop(sf);
    assert_eq!(
        load_bytes(&fs::read(&path).unwrap(), [1; 32], L, D)
            .unwrap()
            .unwrap()
            .tokens
            .len(),
        0
    );
    // Not a slot file at all.
    fs::write(&path, b"hello").unwrap();
    let (sf, opened) = SlotFile::open(&path, FP, L, D).unwrap();
    assert!(
        matches!(&opened, Opened::Refused(w) if w.contains("bad magic")),
        "{opened:?}"
    );
    drop(sf);
    // An empty file (a crash right after creating it) is just fresh.
    fs::write(&path, b"").unwrap();
    let (_, opened) = SlotFile::open(&path, FP, L, D).unwrap();
    assert!(matches!(opened, Opened::Fresh));
}

#[test]
fn a_second_opener_is_turned_away() {
    let dir = Scratch::new("lock");
    let path = dir.file();
    let (sf, _) = SlotFile::open(&path, FP, L, D).unwrap();
    let err = SlotFile::open(&path, FP, L, D).expect_err("locked");
    assert!(err.to_string().contains(IN_USE), "{err}");
    if Path::new("/proc/locks").exists() {
        // flock locks belong to the open file, so this process's first open is the holder.
        let pid = std::process::id();
        assert!(err.to_string().contains(&format!("(pid {pid})")), "{err}");
    }
    drop(sf);
    SlotFile::open(&path, FP, L, D).unwrap();
}

#[test]
fn slot_files_can_move_between_threads() {
    fn shareable<T: Send + Sync>() {}
    shareable::<SlotFile>();
}

#[test]
fn bad_arguments_are_errors_not_panics() {
    let dir = Scratch::new("args");
    let path = dir.file();
    let mut s = LoadedSlot::empty(L);
    advance(&mut s, &mut Rng::new(2), 0, 4, D);
    let (mut sf, _) = SlotFile::open(&path, FP, L, D).unwrap();
    assert!(sf.commit(1, &s.tokens, &s.keys, &s.values).is_err()); // past the persisted
    assert!(sf.commit(0, &s.tokens, &s.keys[..1], &s.values).is_err()); // a layer short
    let short: Vec<Vec<f32>> = s.keys.iter().map(|k| k[..5].to_vec()).collect();
    assert!(sf.commit(0, &s.tokens, &short, &s.values).is_err()); // rows short
    commit(&mut sf, &s, 0).unwrap();
    assert!(sf.sync(&[9, 9, 9, 9], &s.keys, &s.values).is_err()); // other tokens
    assert!(sf.sync(&s.tokens[..2], &s.keys, &s.values).is_err()); // fewer tokens
    sync(&mut sf, &s).unwrap();
    // A no-op commit writes nothing.
    let end = sf.committed_bytes();
    sf.commit(4, &[], &s.keys, &s.values).unwrap();
    assert_eq!(sf.committed_bytes(), end);
    // Layouts without layers or KV still work.
    let (mut z, _) = SlotFile::open(&dir.0.join("z.kv"), FP, 0, 7).unwrap();
    z.commit(0, &[1, 2, 3], &[], &[]).unwrap();
    drop(z);
    let b = fs::read(dir.0.join("z.kv")).unwrap();
    assert_eq!(
        load_bytes(&b, FP, 0, 7).unwrap().unwrap().tokens,
        vec![1, 2, 3]
    );
}

// -----------------------------------------------------------------------------------------
// Layouts other than GQA: per-layer widths

use crate::kv::{KvCache, KvDtype, KvLayout, LayerKv};

fn layer(heads: usize, key_dim: usize, value_dim: usize) -> LayerKv {
    LayerKv::per_position(heads, key_dim, value_dim)
}

/// MLA-like (one 576-wide run of keys, values read from them), a layer without per-position KV
/// (linear attention), a GQA layer.
fn mixed() -> KvLayout {
    KvLayout {
        layers: vec![layer(1, 576, 0), layer(0, 0, 0), layer(2, 4, 4)],
    }
}

/// The same kinds of layers, narrow enough for the byte-by-byte damage tests.
fn mixed_small() -> KvLayout {
    KvLayout {
        layers: vec![layer(1, 6, 0), layer(0, 0, 0), layer(2, 1, 1)],
    }
}

fn widths(layout: &KvLayout) -> Vec<(usize, usize)> {
    layout
        .layers
        .iter()
        .map(|l| (l.heads * l.key_dim, l.heads * l.value_dim))
        .collect()
}

/// [`advance`] for per-layer widths.
fn advance_in(s: &mut LoadedSlot, rng: &mut Rng, start: usize, n: usize, w: &[(usize, usize)]) {
    s.tokens.truncate(start);
    for _ in 0..n {
        s.tokens.push(rng.next() as u32);
    }
    for (l, &(kw, vw)) in w.iter().enumerate() {
        for (v, width) in [(&mut s.keys[l], kw), (&mut s.values[l], vw)] {
            v.truncate(start * width);
            for _ in 0..n * width {
                v.push(rng.float());
            }
        }
    }
}

fn open_in(path: &Path, layout: &KvLayout, tuning: Tuning) -> (SlotFile, Opened) {
    let shape = Shape::of(layout).unwrap();
    SlotFile::open_shape(path, FP, shape, Box::new(RealIo), tuning).unwrap()
}

/// A file of `layout` written by the script (no compaction), with every state it committed.
fn scripted_in(layout: &KvLayout, seed: u64) -> (Vec<u8>, Vec<LoadedSlot>) {
    let w = widths(layout);
    scripted_shape(Shape::of(layout).unwrap(), seed, |s, rng, start, n| {
        advance_in(s, rng, start, n, &w)
    })
}

/// [`scripted_in`] with the state advanced by `advance`.
fn scripted_shape(
    shape: Shape,
    seed: u64,
    advance: impl Fn(&mut LoadedSlot, &mut Rng, usize, usize),
) -> (Vec<u8>, Vec<LoadedSlot>) {
    let dir = Scratch::new("scripted-shape");
    let path = dir.file();
    let layers = shape.num_layers();
    let (mut sf, _) =
        SlotFile::open_shape(&path, FP, shape, Box::new(RealIo), NO_COMPACTION).unwrap();
    let mut rng = Rng::new(seed);
    let mut truth = LoadedSlot::empty(layers);
    let mut states = vec![truth.clone()];
    for step in SCRIPT {
        match step {
            Step::Commit(start, n) => {
                advance(&mut truth, &mut rng, start, n);
                commit(&mut sf, &truth, start).unwrap();
                states.push(truth.clone());
            }
            Step::Sync => sync(&mut sf, &truth).unwrap(),
        }
    }
    drop(sf);
    (fs::read(&path).unwrap(), states)
}

#[test]
fn a_mixed_layout_round_trips_through_reopen_replay_and_compaction() {
    let layout = mixed();
    let w = widths(&layout);
    let per_token = 4 + 4 * (576 + 8 + 8);
    assert_eq!(Shape::of(&layout).unwrap().per_token, per_token);
    let dir = Scratch::new("mixed");
    let path = dir.file();
    let tuning = Tuning {
        chunk: 1000,
        compact_slack: 4096,
    };
    let mut rng = Rng::new(11);
    let mut truth = LoadedSlot::empty(3);
    let (mut sf, opened) = open_in(&path, &layout, tuning);
    assert!(matches!(opened, Opened::Fresh));
    // A prefill, decode steps, a truncation with new tokens, a truncation only.
    advance_in(&mut truth, &mut rng, 0, 12, &w);
    commit(&mut sf, &truth, 0).unwrap();
    for _ in 0..4 {
        let start = truth.tokens.len();
        advance_in(&mut truth, &mut rng, start, 1, &w);
        commit(&mut sf, &truth, start).unwrap();
    }
    advance_in(&mut truth, &mut rng, 9, 3, &w);
    commit(&mut sf, &truth, 9).unwrap();
    advance_in(&mut truth, &mut rng, 11, 0, &w);
    commit(&mut sf, &truth, 11).unwrap();
    sync(&mut sf, &truth).unwrap();
    drop(sf);
    // Replayed from its log, through both loaders.
    let bytes = fs::read(&path).unwrap();
    let got = load_bytes_layout(&bytes, FP, &layout).unwrap().unwrap();
    assert!(same(&got, &truth));
    assert_eq!(got.keys[0].len(), 11 * 576);
    assert!(got.values[0].is_empty() && got.keys[1].is_empty() && got.values[1].is_empty());
    assert_eq!(got.values[2].len(), 11 * 8);
    let (mut sf, opened) = SlotFile::open_layout(&path, FP, &layout).unwrap();
    assert!(
        matches!(&opened, Opened::Loaded(s) if same(s, &truth)),
        "{opened:?}"
    );
    // Regenerate the tail until the log is due for compaction.
    drop(sf);
    let (again, _) = open_in(&path, &layout, tuning);
    sf = again;
    for _ in 0..10 {
        advance_in(&mut truth, &mut rng, 8, 3, &w);
        commit(&mut sf, &truth, 8).unwrap();
    }
    assert!(sf.compaction_due());
    sync(&mut sf, &truth).unwrap();
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        LOG_START + record_len(11, per_token).unwrap()
    );
    assert!(!tmp_path(&path).exists());
    advance_in(&mut truth, &mut rng, 11, 2, &w);
    commit(&mut sf, &truth, 11).unwrap();
    drop(sf);
    let (_, opened) = SlotFile::open_layout(&path, FP, &layout).unwrap();
    assert!(matches!(&opened, Opened::Loaded(s) if same(s, &truth)));
}

#[test]
fn a_kv_cache_of_a_mixed_layout_persists_and_restores() {
    let layout = mixed();
    let w = widths(&layout);
    let dir = Scratch::new("mixed-cache");
    let path = dir.file();
    for dtype in [KvDtype::F32, KvDtype::F16] {
        let _ = fs::remove_file(&path);
        let mut kv = KvCache::new(&layout, dtype);
        let mut tokens = Vec::new();
        let (mut sf, _) = SlotFile::open_layout(&path, FP, &layout).unwrap();
        // Two passes (a prefill, one decode step), each committed from the cache.
        for (start, n) in [(0, 20), (20, 1)] {
            kv.reserve(n);
            for (li, &(kw, vw)) in w.iter().enumerate() {
                // Small integers: exact in f16.
                let k: Vec<f32> = (0..n * kw).map(|i| (i % 500 + li) as f32).collect();
                let v: Vec<f32> = (0..n * vw).map(|i| (i % 300) as f32 - 7.0).collect();
                kv.write(li, start, &k, &v);
            }
            kv.len += n;
            let new: Vec<u32> = (0..n as u32).map(|t| t + start as u32).collect();
            sf.commit_kv(start, &new, &kv).unwrap();
            tokens.extend(new);
        }
        sf.sync_kv(&tokens, &kv).unwrap();
        // KV of another layout is refused, and the file keeps its state.
        let other = KvCache::new(&mixed_small(), dtype);
        let err = sf.commit_kv(21, &[], &other).unwrap_err().to_string();
        assert!(err.contains("layer 0 keeps 6 + 0"), "{err}");
        assert_eq!(sf.persisted_tokens(), 21);
        drop(sf);
        let (_, opened) = SlotFile::open_layout(&path, FP, &layout).unwrap();
        let Opened::Loaded(s) = opened else {
            panic!("{opened:?}")
        };
        assert_eq!(s.tokens, tokens);
        let back = KvCache::from_rows(&layout, dtype, s.tokens.len(), &s.keys, &s.values);
        for li in 0..3 {
            assert_eq!(back.rows(li, 0..21), kv.rows(li, 0..21), "layer {li}");
        }
    }
}

#[test]
fn a_file_of_one_layout_is_refused_by_another() {
    let (bytes, states) = scripted_in(&mixed(), 5);
    let header = match parse_block(&bytes) {
        Block::Valid(h) => h,
        _ => panic!("no header in block 0"),
    };
    assert_eq!(header.num_layers, 3);
    assert_ne!(header.kv_dim & format::MIXED_WIDTHS, 0);
    let got = load_bytes_layout(&bytes, FP, &mixed()).unwrap().unwrap();
    assert!(same(&got, states.last().unwrap()));
    // The same layers in another order: the same bytes per token, another layout.
    let mut swapped = mixed();
    swapped.layers.swap(1, 2);
    let why = load_bytes_layout(&bytes, FP, &swapped).unwrap_err();
    assert!(
        why.contains("KV layout 3 layers of per-layer widths"),
        "{why}"
    );
    let why = load_bytes(&bytes, FP, 3, 576).unwrap_err();
    assert!(why.contains("expected 3 layers x 576 floats"), "{why}");
    // And the other way round: a uniform file under a mixed layout.
    let (uniform, _) = scripted_file(NO_COMPACTION, 77);
    let two = KvLayout {
        layers: vec![layer(1, 3, 3), layer(1, 3, 0)],
    };
    assert!(load_bytes_layout(&uniform, FP, &two).is_err());
    // Absurd layouts do not overflow.
    let huge = KvLayout {
        layers: vec![layer(usize::MAX, 2, 0)],
    };
    assert!(load_bytes_layout(&bytes, FP, &huge).is_err());
    let mut b = bytes.clone();
    reseal_layout(&mut b, &huge);
    assert!(SlotFile::open_layout(&Scratch::new("huge").file(), FP, &huge).is_err());
}

#[test]
fn a_gqa_layout_writes_the_files_it_always_did() {
    // Before layouts, a GQA model's slot file was `open(path, fp, layers, kv_heads * head_dim)`.
    let gqa = KvLayout::uniform(L, 1, D);
    assert_eq!(Shape::of(&gqa).unwrap(), Shape::uniform(L, D).unwrap());
    let heads = KvLayout::uniform(4, 2, 8);
    let shape = Shape::of(&heads).unwrap();
    assert_eq!(
        (shape.kv_dim, shape.per_token),
        (16, token_bytes(4, 16).unwrap())
    );
    let (old, states) = scripted_file(NO_COMPACTION, 77);
    let (new, _) = scripted_shape(Shape::of(&gqa).unwrap(), 77, |s, rng, start, n| {
        advance(s, rng, start, n, D)
    });
    assert_eq!(old, new, "the same bytes, header and records");
    let got = load_bytes_layout(&old, FP, &gqa).unwrap().unwrap();
    assert!(same(&got, states.last().unwrap()));
    // A file of the old API opens through the layout and carries on.
    let dir = Scratch::new("gqa");
    fs::write(dir.file(), &old).unwrap();
    let (mut sf, opened) = SlotFile::open_layout(&dir.file(), FP, &gqa).unwrap();
    let Opened::Loaded(mut s) = opened else {
        panic!("{opened:?}")
    };
    advance(&mut s, &mut Rng::new(3), 2, 2, D);
    commit(&mut sf, &s, 2).unwrap();
    drop(sf);
    assert!(same(&load(&dir.file()).unwrap(), &s));
}

#[test]
fn damage_to_a_mixed_layout_file_loads_a_committed_state_or_refuses() {
    let layout = mixed_small();
    let (bytes, states) = scripted_in(&layout, 21);
    let check = |b: &[u8], what: &str| match load_bytes_layout(b, FP, &layout) {
        Ok(Some(s)) => assert!(states.iter().any(|t| same(t, &s)), "{what}"),
        Ok(None) => assert!(b.is_empty(), "{what}"),
        Err(_) => {}
    };
    for cut in 0..bytes.len() {
        check(&bytes[..cut], &format!("cut at {cut}"));
    }
    for at in LOG_START as usize..bytes.len() {
        let mut b = bytes.clone();
        b[at] ^= 0x41;
        check(&b, &format!("flip at {at}"));
    }
    // Resealed mutations reach the replay: any shape must come out right or be refused.
    let mut rng = Rng::new(99);
    let w = widths(&layout);
    for i in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(3) {
            let at = if rng.below(2) == 0 && b.len() > LOG_START as usize {
                LOG_START as usize + rng.below(b.len() - LOG_START as usize)
            } else {
                rng.below(HEADER_COPIES) * HEADER_BLOCK as usize + rng.below(HEADER_LEN)
            };
            let at = at.min(b.len() - 1);
            match rng.below(4) {
                0 => b[at] = rng.next() as u8,
                1 => b.truncate(at.max(1)),
                2 if at + 8 <= b.len() => {
                    b[at..at + 8].copy_from_slice(&(rng.below(40) as u64).to_le_bytes())
                }
                _ => b[at] ^= 1 << rng.below(8),
            }
        }
        reseal_layout(&mut b, &layout);
        if let Ok(Some(s)) = load_bytes_layout(&b, FP, &layout) {
            for (l, &(kw, vw)) in w.iter().enumerate() {
                assert_eq!(s.keys[l].len(), s.tokens.len() * kw, "case {i}");
                assert_eq!(s.values[l].len(), s.tokens.len() * vw, "case {i}");
            }
        }
    }
}

// -----------------------------------------------------------------------------------------
// Version 2: layers with fixed-size states (linear attention) and state records

/// A cache of the small mixed layout whose linear layer (1) carries a 5-float state.
fn stateful(n: usize, seed: f32) -> KvCache {
    let layout = mixed_small();
    let mut kv = KvCache::new(&layout, KvDtype::F32).with_states(&[0, 5, 0]);
    kv.reserve(n);
    for li in 0..3 {
        let (kw, vw) = (kv.key_width(li), kv.value_width(li));
        let k: Vec<f32> = (0..n * kw).map(|i| seed + i as f32).collect();
        let v: Vec<f32> = (0..n * vw).map(|i| seed - i as f32).collect();
        kv.write(li, 0, &k, &v);
    }
    kv.len = n;
    for (i, x) in kv.state_mut(1).iter_mut().enumerate() {
        *x = seed * 10.0 + i as f32;
    }
    kv
}

fn open_states(path: &Path) -> (SlotFile, Opened) {
    SlotFile::open_layout_states(path, FP, &mixed_small(), &[0, 5, 0]).unwrap()
}

#[test]
fn a_state_file_is_version_2_and_restores_the_state_written_at_sync() {
    let s = Scratch::new("state-roundtrip");
    let kv = stateful(7, 1.0);
    let tokens: Vec<u32> = (0..7).collect();
    {
        let (mut f, opened) = open_states(&s.file());
        assert!(matches!(opened, Opened::Fresh));
        f.commit_kv(0, &tokens, &kv).unwrap();
        f.sync_kv(&tokens, &kv).unwrap();
    }
    let raw = fs::read(s.file()).unwrap();
    assert_eq!(le_u32_at(&raw, 8), STATE_SLOT_FILE_VERSION);
    let (_, opened) = open_states(&s.file());
    let Opened::Loaded(got) = opened else {
        panic!("expected the slot back")
    };
    assert_eq!(got.tokens, tokens);
    assert_eq!(got.states[1], *kv.state(1));
    assert!(got.states[0].is_empty() && got.states[2].is_empty());
    assert_eq!(got.keys[0], kv.rows(0, 0..7).0);
}

fn le_u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

#[test]
fn positions_committed_after_the_last_state_are_dropped_at_load() {
    let s = Scratch::new("state-tail");
    let kv = stateful(9, 2.0);
    let tokens: Vec<u32> = (0..9).collect();
    {
        let (mut f, _) = open_states(&s.file());
        f.commit_kv(0, &tokens[..4], &kv).unwrap();
        let mut at4 = stateful(4, 2.0);
        at4.state_mut(1).fill(4.5);
        f.sync_kv(&tokens[..4], &at4).unwrap();
        // A crash mid-turn: positions 4..9 committed, no state written for them.
        f.commit_kv(4, &tokens[4..], &kv).unwrap();
    }
    let (_, opened) = open_states(&s.file());
    let Opened::Loaded(got) = opened else {
        panic!("expected the slot back")
    };
    assert_eq!(got.tokens, tokens[..4]);
    assert_eq!(got.states[1], vec![4.5; 5]);
    assert_eq!(got.keys[2], kv.rows(2, 0..4).0);
}

#[test]
fn a_record_going_back_before_the_state_leaves_none() {
    let s = Scratch::new("state-back");
    let kv = stateful(6, 3.0);
    let tokens: Vec<u32> = (0..6).collect();
    {
        let (mut f, _) = open_states(&s.file());
        f.commit_kv(0, &tokens, &kv).unwrap();
        f.sync_kv(&tokens, &kv).unwrap();
        // Prefix reuse went back to position 2 and the turn never ended.
        f.commit_kv(2, &[40, 41], &kv).unwrap();
    }
    let (_, opened) = open_states(&s.file());
    assert!(
        matches!(opened, Opened::Fresh),
        "no state for any position: the slot starts empty"
    );
}

#[test]
fn compaction_keeps_the_state() {
    let s = Scratch::new("state-compact");
    let kv = stateful(5, 4.0);
    let tokens: Vec<u32> = (0..5).collect();
    {
        let (mut f, _) = open_states(&s.file());
        f.tuning.compact_slack = 0;
        for _ in 0..4 {
            f.commit_kv(0, &tokens, &kv).unwrap();
            f.sync_kv(&tokens, &kv).unwrap();
        }
        assert!(f.committed_bytes() < 2 * LOG_START + 4096, "compacted");
    }
    let (_, opened) = open_states(&s.file());
    let Opened::Loaded(got) = opened else {
        panic!("expected the slot back")
    };
    assert_eq!(got.tokens, tokens);
    assert_eq!(got.states[1], *kv.state(1));
}

#[test]
fn versions_are_not_mixed_between_models_with_and_without_states() {
    let s = Scratch::new("state-versions");
    let kv = stateful(3, 5.0);
    let tokens: Vec<u32> = vec![1, 2, 3];
    {
        let (mut f, _) = SlotFile::open_layout(&s.file(), FP, &mixed_small()).unwrap();
        f.commit_kv(0, &tokens, &kv).unwrap();
        f.sync_kv(&tokens, &kv).unwrap();
    }
    let (_, opened) = open_states(&s.file());
    let Opened::Refused(why) = opened else {
        panic!("a version-1 file must not load as a model with states")
    };
    assert!(
        why.contains("version 1") && why.contains("version 2"),
        "{why}"
    );
    {
        let (mut f, _) = open_states(&s.file());
        f.commit_kv(0, &tokens, &kv).unwrap();
        f.sync_kv(&tokens, &kv).unwrap();
    }
    let (_, opened) = SlotFile::open_layout(&s.file(), FP, &mixed_small()).unwrap();
    let Opened::Refused(why) = opened else {
        panic!("a version-2 file must not load without states")
    };
    assert!(why.contains("version 2"), "{why}");
}

/// A state file written through commits, syncs (state records), a truncation and a compaction;
/// with every state a load of the file could give at some point of the script.
fn scripted_states() -> (Vec<u8>, Vec<LoadedSlot>) {
    let s = Scratch::new("state-damage");
    let layout = mixed_small();
    let load = |path: &Path| {
        load_bytes_states(&fs::read(path).unwrap(), FP, &layout, &[0, 5, 0])
            .unwrap()
            .unwrap_or_else(|| LoadedSlot::empty(3))
    };
    let (mut f, _) = open_states(&s.file());
    let mut seen = vec![load(&s.file())];
    let tokens: Vec<u32> = (0..9).map(|t| 100 + t).collect();
    for (seed, start, end, sync) in [
        (1.0, 0, 3, true),
        (2.0, 3, 6, false),
        (3.0, 3, 7, true),
        (4.0, 1, 2, false),
        (5.0, 2, 9, true),
    ] {
        let kv = stateful(end, seed);
        f.commit_kv(start, &tokens[start..end], &kv).unwrap();
        seen.push(load(&s.file()));
        if sync {
            f.sync_kv(&tokens[..end], &kv).unwrap();
            seen.push(load(&s.file()));
        }
    }
    (fs::read(s.file()).unwrap(), seen)
}

#[test]
fn damage_to_a_state_file_loads_a_committed_state_or_refuses() {
    let layout = mixed_small();
    let (bytes, seen) = scripted_states();
    assert!(seen
        .iter()
        .any(|s| s.tokens.len() == 9 && s.states[1].len() == 5));
    let check = |b: &[u8], what: &str| match load_bytes_states(b, FP, &layout, &[0, 5, 0]) {
        Ok(Some(s)) => assert!(
            s.tokens.is_empty() || seen.iter().any(|t| same(t, &s) && t.states == s.states),
            "{what}"
        ),
        Ok(None) => assert!(b.is_empty(), "{what}"),
        Err(_) => {}
    };
    for cut in 0..bytes.len() {
        check(&bytes[..cut], &format!("cut at {cut}"));
    }
    for at in LOG_START as usize..bytes.len() {
        let mut b = bytes.clone();
        b[at] ^= 0x41;
        check(&b, &format!("flip at {at}"));
    }
    // Resealed mutations reach the replay: whatever loads has the layout's shape.
    let mut rng = Rng::new(7);
    let w = widths(&layout);
    for i in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(3) {
            let at = LOG_START as usize + rng.below(b.len() - LOG_START as usize);
            match rng.below(3) {
                0 => b[at] = rng.next() as u8,
                1 if at + 8 <= b.len() => {
                    b[at..at + 8].copy_from_slice(&(rng.below(12) as u64).to_le_bytes())
                }
                _ => b[at] ^= 1 << rng.below(8),
            }
        }
        reseal_layout_states(&mut b, &layout, &[0, 5, 0]);
        if let Ok(Some(s)) = load_bytes_states(&b, FP, &layout, &[0, 5, 0]) {
            for (l, &(kw, vw)) in w.iter().enumerate() {
                assert_eq!(s.keys[l].len(), s.tokens.len() * kw, "case {i}");
                assert_eq!(s.values[l].len(), s.tokens.len() * vw, "case {i}");
            }
            assert_eq!(
                s.states.iter().map(Vec::len).collect::<Vec<_>>(),
                [0, 5, 0],
                "case {i}"
            );
        }
    }
}

// -----------------------------------------------------------------------------------------
// Version 3: layers of a row per several positions (DeepSeek-V4's compressed entries)

/// A layer of a row per position, a layer of a row per 3 positions (with a 4-float state, as a
/// DeepSeek-V4 layer keeps its window), a layer of a row per 2 with values.
fn sparse_rows() -> KvLayout {
    KvLayout {
        layers: vec![
            layer(1, 2, 0),
            LayerKv {
                every: 3,
                ..layer(1, 3, 0)
            },
            LayerKv {
                every: 2,
                ..layer(1, 1, 1)
            },
        ],
    }
}

const SPARSE_STATES: [usize; 3] = [0, 4, 0];

/// A cache of [`sparse_rows`] holding `n` positions (each layer the rows they complete), its
/// state set from `seed`.
fn sparse_cache(n: usize, seed: f32) -> KvCache {
    let layout = sparse_rows();
    let mut kv = KvCache::new(&layout, KvDtype::F32).with_states(&SPARSE_STATES);
    kv.reserve(n);
    for (li, l) in layout.layers.iter().enumerate() {
        let rows = l.rows(n);
        let (kw, vw) = (kv.key_width(li), kv.value_width(li));
        let k: Vec<f32> = (0..rows * kw).map(|i| seed + i as f32).collect();
        let v: Vec<f32> = (0..rows * vw).map(|i| seed - i as f32).collect();
        kv.write(li, 0, &k, &v);
    }
    kv.len = n;
    for (i, x) in kv.state_mut(1).iter_mut().enumerate() {
        *x = seed * 10.0 + i as f32;
    }
    kv
}

fn open_sparse(path: &Path) -> (SlotFile, Opened) {
    SlotFile::open_layout_states(path, FP, &sparse_rows(), &SPARSE_STATES).unwrap()
}

#[test]
fn a_file_of_rows_per_several_positions_is_version_3_and_restores_rows_and_state() {
    let s = Scratch::new("rows-roundtrip");
    let tokens: Vec<u32> = (0..20).collect();
    let full = sparse_cache(20, 1.0);
    {
        let (mut f, opened) = open_sparse(&s.file());
        assert!(matches!(opened, Opened::Fresh));
        // Records that start and end inside windows (7: mid-window of 3 and of 2), and one
        // going back inside a window.
        f.commit_kv(0, &tokens[..7], &full).unwrap();
        f.commit_kv(7, &tokens[7..8], &full).unwrap();
        f.commit_kv(8, &tokens[8..13], &full).unwrap();
        f.commit_kv(4, &tokens[4..20], &full).unwrap();
        f.sync_kv(&tokens, &full).unwrap();
    }
    let raw = fs::read(s.file()).unwrap();
    assert_eq!(le_u32_at(&raw, 8), ROWS_SLOT_FILE_VERSION);
    let (_, opened) = open_sparse(&s.file());
    let Opened::Loaded(got) = opened else {
        panic!("expected the slot back: {opened:?}")
    };
    assert_eq!(got.tokens, tokens);
    for li in 0..3 {
        let (k, v) = full.rows(li, 0..20);
        assert_eq!((&got.keys[li], &got.values[li]), (&k, &v), "layer {li}");
    }
    assert_eq!(
        got.keys[1].len(),
        6 * 3,
        "20 positions complete 6 rows of 3"
    );
    assert_eq!(got.states[1], *full.state(1));
    // The slot comes back as the cache it was.
    let back = KvCache::from_rows(&sparse_rows(), KvDtype::F32, 20, &got.keys, &got.values);
    for li in 0..3 {
        assert_eq!(back.rows(li, 0..20), full.rows(li, 0..20));
    }
    // Compaction keeps it all.
    {
        let (mut f, _) = open_sparse(&s.file());
        f.tuning.compact_slack = 0;
        for _ in 0..3 {
            f.commit_kv(5, &tokens[5..20], &full).unwrap();
            f.sync_kv(&tokens, &full).unwrap();
        }
    }
    let (_, opened) = open_sparse(&s.file());
    let Opened::Loaded(again) = opened else {
        panic!("expected the slot back")
    };
    assert!(same(&again, &got) && again.states == got.states);
}

#[test]
fn versions_are_not_mixed_between_rows_per_position_and_per_several() {
    let s = Scratch::new("rows-versions");
    let tokens: Vec<u32> = (0..6).collect();
    let kv = sparse_cache(6, 2.0);
    {
        let (mut f, _) = open_sparse(&s.file());
        f.commit_kv(0, &tokens, &kv).unwrap();
        f.sync_kv(&tokens, &kv).unwrap();
    }
    // The same widths a row per position (a version-2 model): refused by version.
    let mut per_position = sparse_rows();
    for l in &mut per_position.layers {
        l.every = 1;
    }
    let (_, opened) =
        SlotFile::open_layout_states(&s.file(), FP, &per_position, &SPARSE_STATES).unwrap();
    let Opened::Refused(why) = opened else {
        panic!("a version-3 file must not load as version 2")
    };
    assert!(
        why.contains("version 3") && why.contains("version 2"),
        "{why}"
    );
    // And a version-2 file under the version-3 layout.
    let flat = stateful(6, 2.0);
    {
        let (mut f, _) = open_states(&s.file());
        f.commit_kv(0, &tokens, &flat).unwrap();
        f.sync_kv(&tokens, &flat).unwrap();
    }
    let (_, opened) = open_sparse(&s.file());
    let Opened::Refused(why) = opened else {
        panic!("a version-2 file must not load as version 3")
    };
    assert!(
        why.contains("version 2") && why.contains("version 3"),
        "{why}"
    );
    // A version-1 file (DeepSeek-V4's files before: a row per position, no states).
    {
        let _ = fs::remove_file(s.file());
        let (mut f, _) = SlotFile::open_layout(&s.file(), FP, &mixed_small()).unwrap();
        let plain = stateful(6, 2.0);
        f.commit_kv(0, &tokens, &plain).unwrap();
        f.sync_kv(&tokens, &plain).unwrap();
    }
    let (_, opened) = open_sparse(&s.file());
    let Opened::Refused(why) = opened else {
        panic!("a version-1 file must not load as version 3")
    };
    assert!(
        why.contains("version 1") && why.contains("version 3"),
        "{why}"
    );
    // Another row rate under the same widths: another layout digest.
    let mut other = sparse_rows();
    other.layers[1].every = 4;
    assert_ne!(
        Shape::of(&other).unwrap().kv_dim,
        Shape::of(&sparse_rows()).unwrap().kv_dim
    );
    // KV of another row rate is refused by a commit.
    let (mut f, _) = open_sparse(&s.file());
    let odd = KvCache::new(&other, KvDtype::F32).with_states(&SPARSE_STATES);
    let err = f.commit_kv(0, &[], &odd).unwrap_err().to_string();
    assert!(err.contains("a row per 4 positions"), "{err}");
}

/// A version-3 file written through commits (mid-window starts), syncs, a truncation and a
/// compaction; with every state a load of the file could give at some point.
fn scripted_sparse() -> (Vec<u8>, Vec<LoadedSlot>) {
    let s = Scratch::new("rows-damage");
    let layout = sparse_rows();
    let load = |path: &Path| {
        load_bytes_states(&fs::read(path).unwrap(), FP, &layout, &SPARSE_STATES)
            .unwrap()
            .unwrap_or_else(|| LoadedSlot::empty(3))
    };
    let (mut f, _) = open_sparse(&s.file());
    let mut seen = vec![load(&s.file())];
    let tokens: Vec<u32> = (0..11).map(|t| 100 + t).collect();
    for (seed, start, end, sync) in [
        (1.0, 0, 4, true),
        (2.0, 4, 7, false),
        (3.0, 2, 8, true),
        (4.0, 1, 2, false),
        (5.0, 2, 11, true),
    ] {
        let kv = sparse_cache(end, seed);
        f.commit_kv(start, &tokens[start..end], &kv).unwrap();
        seen.push(load(&s.file()));
        if sync {
            f.sync_kv(&tokens[..end], &kv).unwrap();
            seen.push(load(&s.file()));
        }
    }
    (fs::read(s.file()).unwrap(), seen)
}

#[test]
fn damage_to_a_version_3_file_loads_a_committed_state_or_refuses() {
    let layout = sparse_rows();
    let (bytes, seen) = scripted_sparse();
    assert!(seen
        .iter()
        .any(|s| s.tokens.len() == 11 && s.keys[1].len() == 3 * 3));
    let check = |b: &[u8], what: &str| match load_bytes_states(b, FP, &layout, &SPARSE_STATES) {
        Ok(Some(s)) => assert!(
            s.tokens.is_empty() || seen.iter().any(|t| same(t, &s) && t.states == s.states),
            "{what}"
        ),
        Ok(None) => assert!(b.is_empty(), "{what}"),
        Err(_) => {}
    };
    for cut in 0..bytes.len() {
        check(&bytes[..cut], &format!("cut at {cut}"));
    }
    for at in LOG_START as usize..bytes.len() {
        let mut b = bytes.clone();
        b[at] ^= 0x41;
        check(&b, &format!("flip at {at}"));
    }
    // Resealed mutations reach the replay: whatever loads has the layout's shape.
    let mut rng = Rng::new(13);
    let w = widths(&layout);
    for i in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..1 + rng.below(3) {
            let at = LOG_START as usize + rng.below(b.len() - LOG_START as usize);
            match rng.below(3) {
                0 => b[at] = rng.next() as u8,
                1 if at + 8 <= b.len() => {
                    b[at..at + 8].copy_from_slice(&(rng.below(14) as u64).to_le_bytes())
                }
                _ => b[at] ^= 1 << rng.below(8),
            }
        }
        reseal_layout_states(&mut b, &layout, &SPARSE_STATES);
        if let Ok(Some(s)) = load_bytes_states(&b, FP, &layout, &SPARSE_STATES) {
            for (l, &(kw, vw)) in w.iter().enumerate() {
                let rows = layout.layers[l].rows(s.tokens.len());
                assert_eq!(s.keys[l].len(), rows * kw, "case {i}");
                assert_eq!(s.values[l].len(), rows * vw, "case {i}");
            }
            assert_eq!(
                s.states.iter().map(Vec::len).collect::<Vec<_>>(),
                SPARSE_STATES,
                "case {i}"
            );
        }
    }
}
