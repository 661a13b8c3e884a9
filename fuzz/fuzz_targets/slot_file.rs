#![no_main]
//! KV slot files: `colibri_engine::slotfile::load_bytes` on arbitrary bytes, with a fixed small
//! layout (2 layers, kv_dim 3, fingerprint `[0xa5; 32]`). Byte 0: odd = first recompute every
//! checksum (`slotfile::reseal`) so mutated fields reach the record replay; even = load the
//! rest as it is. An `Err` is a correct answer; a panic, or a loaded state whose shape does not
//! match the layout, is a bug. (The same harness is `slot_file` in `tests/smoke.rs`.)

use colibri_engine::slotfile::{load_bytes, reseal};
use libfuzzer_sys::fuzz_target;

const LAYERS: usize = 2;
const KV_DIM: usize = 3;
const FINGERPRINT: [u8; 32] = [0xa5; 32];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if mode & 1 == 1 {
        reseal(&mut bytes, LAYERS, KV_DIM);
    }
    if let Ok(Some(s)) = load_bytes(&bytes, FINGERPRINT, LAYERS, KV_DIM) {
        assert_eq!(s.keys.len(), LAYERS);
        assert_eq!(s.values.len(), LAYERS);
        for v in s.keys.iter().chain(&s.values) {
            assert_eq!(v.len(), s.tokens.len() * KV_DIM);
        }
    }
});
