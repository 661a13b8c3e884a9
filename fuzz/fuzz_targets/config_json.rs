#![no_main]
//! See `colibri_fuzz::config_json`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| colibri_fuzz::config_json(data));
