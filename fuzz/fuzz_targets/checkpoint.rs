#![no_main]
//! See `colibri_fuzz::checkpoint`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| colibri_fuzz::checkpoint(data));
