//! Generation over a loaded [`Model`]: prefill a prompt, then decode one token at a time,
//! stopping at a stop token, the token budget or the context length.

use crate::error::{Error, Result};
use crate::kv::KvCache;
use crate::model::Model;
use crate::sampler::Sampler;

/// Options of one generation.
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub stop_token_ids: Vec<u32>,
    pub seed: Option<u64>,
}

/// An in-progress generation: call [`Generation::next_token`] until it returns `None`.
pub struct Generation {
    prompt: Vec<u32>,
    opts: GenerateOptions,
    sampler: Sampler,
    produced: usize,
    last: Option<u32>,
    finished: bool,
}

impl Generation {
    pub fn new(prompt: Vec<u32>, opts: GenerateOptions) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(Error::Input("the prompt has no tokens".into()));
        }
        let temperature_ok = opts.temperature >= 0.0; // false for NaN too
        let top_p_ok = opts.top_p > 0.0 && opts.top_p <= 1.0;
        if !temperature_ok || !top_p_ok {
            return Err(Error::Input(
                "temperature must be >= 0 and top_p in (0, 1]".into(),
            ));
        }
        let sampler = Sampler::new(opts.temperature, opts.top_p, opts.seed);
        Ok(Generation {
            prompt,
            opts,
            sampler,
            produced: 0,
            last: None,
            finished: false,
        })
    }

    /// The next token, or `None` when generation has ended. `kv` must be the cache this
    /// generation started with (it is cleared at the first step).
    pub fn next_token(&mut self, model: &Model, kv: &mut KvCache) -> Result<Option<u32>> {
        if self.finished || self.produced >= self.opts.max_tokens {
            self.finished = true;
            return Ok(None);
        }
        let logits = match self.last {
            None => {
                kv.clear();
                model.forward(&self.prompt, kv, false)?
            }
            Some(tok) => {
                if kv.len >= model.cfg.max_positions {
                    self.finished = true;
                    return Ok(None);
                }
                model.forward(&[tok], kv, false)?
            }
        };
        let tok = self.sampler.sample(&logits) as u32;
        self.produced += 1;
        self.last = Some(tok);
        if self.opts.stop_token_ids.contains(&tok) {
            self.finished = true;
        }
        Ok(Some(tok))
    }
}
