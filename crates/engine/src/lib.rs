//! colibri's inference engine: int4 Mixture-of-Experts forward passes over a converted model
//! directory, with the PyO3 surface (`colibri._engine`) behind the `python` feature.
//!
//! Layout: `config` (HF config.json -> [`config::ModelConfig`]), `format` (the model directory),
//! `convert` (checkpoint -> model directory), `calib` (importance statistics for it), `quant` (int4 and its kernels), `linear` (weights
//! and parallel matmul), `ops` (norms, rope, softmax), `attention` (over a KV history), `model`
//! (load + forward per family), `kv` (KV history), `sampler`, `grammar` (token masks from
//! a grammar), `engine` (generation), `python`
//! (bindings).

pub mod alloc;
pub mod attention;
pub mod calib;
pub mod config;
pub mod convert;
pub mod engine;
pub mod error;
pub mod format;
pub mod grammar;
pub mod hugebuf;
pub mod kv;
pub mod linear;
pub mod model;
pub mod ops;
pub mod pool;
pub mod quant;
pub mod sampler;
pub mod score;
pub mod settings;
pub mod slot_writer;
pub mod slotfile;
pub mod slots;
pub mod store;
pub mod upgrade;

#[cfg(test)]
mod batch_tests;
#[cfg(test)]
mod precision_tests;
#[cfg(test)]
mod testutil;

#[cfg(feature = "python")]
mod python;

pub use error::{Error, Result};
