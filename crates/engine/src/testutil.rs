//! Helpers shared by the crate's unit tests.

use std::fs;
use std::path::{Path, PathBuf};

/// The committed fixture checkpoint of `arch` (`tests/fixtures/ARCH/hf`).
pub fn fixture(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(arch)
        .join("hf")
}

/// A fresh, empty scratch directory for one test, named by `what` and `tag` and unique to this
/// process (the test removes it at its end).
pub fn scratch_dir(what: &str, tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("colibri-{what}-{}-{tag}", std::process::id()));
    let _ = fs::remove_dir_all(&d);
    fs::create_dir_all(&d).unwrap();
    d
}
