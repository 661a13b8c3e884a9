#![no_main]
//! KV slot files: `colibri_engine::slotfile` on arbitrary bytes, by the library's `slot_file`
//! harness (byte 0 picks the layout and whether checksums are recomputed first).

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| colibri_fuzz::slot_file(data));
