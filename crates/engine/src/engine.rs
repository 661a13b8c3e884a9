//! Generation over a loaded [`Model`]: prefill a prompt, then decode one token at a time,
//! stopping at a stop token, the token budget or the context length.

use crate::error::{Error, Result};
use crate::model::Model;
use crate::sampler::Sampler;
use crate::slots::Slot;

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
    /// Prompt tokens whose KV came from the slot's history (known after the first step).
    reused: Option<usize>,
    turn_ended: bool,
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
            reused: None,
            turn_ended: false,
        })
    }

    /// Prompt tokens reused from the slot's history (None before the first step).
    pub fn reused(&self) -> Option<usize> {
        self.reused
    }

    /// The next token, or `None` when generation has ended. The prompt is matched against the
    /// slot's history first: only the part it does not share is prefilled.
    pub fn next_token(&mut self, model: &Model, slot: &mut Slot) -> Result<Option<u32>> {
        if self.finished || self.produced >= self.opts.max_tokens {
            self.end(model, slot);
            return Ok(None);
        }
        let logits = match self.last {
            None => {
                let kept = slot.reuse_prefix(&self.prompt);
                self.reused = Some(kept);
                slot.forward(model, &self.prompt[kept..])?
            }
            Some(tok) => {
                if slot.tokens.len() >= model.cfg.max_positions {
                    self.end(model, slot);
                    return Ok(None);
                }
                slot.forward(model, &[tok])?
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

    /// Ends the turn (once): the slot's history is made durable and the model closes the
    /// turn's profile (and saves routing heat now and then). Called when the generation runs
    /// out, and by whoever drops a generation early.
    pub fn end(&mut self, model: &Model, slot: &mut Slot) {
        self.finished = true;
        if !self.turn_ended {
            self.turn_ended = true;
            slot.end_turn();
            // A failed heat save changes nothing else; the next turn tries again.
            let _ = model.end_turn();
        }
    }
}
