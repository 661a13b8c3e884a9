#![no_main]
//! See `colibri_fuzz::tiktoken`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| colibri_fuzz::tiktoken(data));
