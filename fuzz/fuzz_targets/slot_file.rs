#![no_main]
//! KV slot files: `colibri_engine::slotfile::load_bytes` on arbitrary bytes, with a fixed small
//! layout (2 layers, kv_dim 3, fingerprint `[0xa5; 32]`). Byte 0: odd = first recompute every
//! checksum (`slotfile::reseal`) so mutated fields reach the record replay; even = load the
//! rest as it is; bit 1 set = a version-2 file with state records (`load_bytes_states`); bit 2
//! set = a version-3 file, the second layer keeping a row per 2 positions. An `Err` is a correct
//! answer; a panic, or a loaded state whose shape does not match the layout, is a bug. (The same
//! harness is `slot_file` in `tests/smoke.rs`.)

use colibri_engine::kv::KvLayout;
use colibri_engine::slotfile::{load_bytes, load_bytes_states, reseal, reseal_layout_states};
use libfuzzer_sys::fuzz_target;

const LAYERS: usize = 2;
const KV_DIM: usize = 3;
const FINGERPRINT: [u8; 32] = [0xa5; 32];
/// Byte 0 bit 1 set: a version-2 (linear-attention) file whose first layer has a 4-float state.
const STATES: [usize; LAYERS] = [4, 0];

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut bytes = rest.to_vec();
    if mode & 6 != 0 {
        let mut layout = KvLayout::uniform(LAYERS, 1, KV_DIM);
        if mode & 4 == 4 {
            layout.layers[1].every = 2;
        }
        if mode & 1 == 1 {
            reseal_layout_states(&mut bytes, &layout, &STATES);
        }
        if let Ok(Some(s)) = load_bytes_states(&bytes, FINGERPRINT, &layout, &STATES) {
            for (l, layer) in layout.layers.iter().enumerate() {
                let rows = layer.rows(s.tokens.len());
                assert_eq!(s.keys[l].len(), rows * KV_DIM);
                assert_eq!(s.values[l].len(), rows * KV_DIM);
            }
            let widths: Vec<usize> = s.states.iter().map(Vec::len).collect();
            assert_eq!(widths, STATES);
        }
        return;
    }
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
