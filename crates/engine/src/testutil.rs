//! Helpers shared by the crate's unit tests.

use std::fs;
use std::path::{Path, PathBuf};

use crate::model::Model;

/// The committed fixture checkpoint of `arch` (`tests/fixtures/ARCH/hf`).
pub fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(arch)
        .join("hf")
}

/// A fresh, empty scratch directory for one test, named by `what` and `tag` and unique to this
/// process; removed when the returned guard is dropped, so a failing test leaves nothing behind.
pub fn scratch_dir(what: &str, tag: &str) -> ScratchDir {
    let d = std::env::temp_dir().join(format!("colibri-{what}-{}-{tag}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    ScratchDir(d)
}

/// A test's scratch directory, removed (with everything in it) on drop.
#[derive(Debug)]
pub struct ScratchDir(PathBuf);

impl std::ops::Deref for ScratchDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for ScratchDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        // The test may have removed it already.
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Every committed fixture checkpoint (`tests/fixtures/*/hf`), by name, sorted.
pub fn committed_fixtures() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let mut names: Vec<String> = fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("hf/config.json").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Logits of every position of `prompts` fixed prompts of `len` tokens each (set `set`: the
/// prompts `set * prompts ..`), one after another, from the model in `dir` on 2 threads.
pub fn prompt_logits(dir: &Path, prompts: u32, len: u32, set: u32) -> Vec<f32> {
    let model = Model::load(dir, Some(2)).unwrap();
    let vocab = model.cfg.vocab_size as u32;
    let mut all = Vec::new();
    for s in set * prompts..(set + 1) * prompts {
        let prompt: Vec<u32> = (0..len).map(|i| (i * 37 + 5 + s * 101) % vocab).collect();
        let mut kv = model.new_cache();
        all.extend(model.forward(&prompt, &mut kv, true).unwrap());
    }
    all
}

/// `|a - reference| / |reference|` (Frobenius norms, in f64).
pub fn rel_err(a: &[f32], reference: &[f32]) -> f64 {
    let num: f64 = a
        .iter()
        .zip(reference)
        .map(|(&x, &y)| ((x - y) as f64).powi(2))
        .sum();
    let den: f64 = reference.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Deterministic Gaussian numbers (xorshift and Box-Muller), `n` of them from `seed`.
pub fn gauss(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| {
            let (u, v) = (next(), next());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}
