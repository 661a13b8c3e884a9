#![no_main]
//! See `colibri_fuzz::model_dir`.

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| colibri_fuzz::model_dir(data));
