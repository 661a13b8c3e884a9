//! Closed-set scoring: how likely the model finds each of a caller's continuations (options)
//! after a shared context, read from its log-probabilities; nothing is generated.
//!
//! The context is prefilled into a slot once, in steps like a generation's prompt, after the
//! part it shares with the slot's history (so a state shared by several questions, each asked
//! as state + question, is computed once). Each option then runs from that point with its KV
//! appended after the context and dropped again (the history is append-only, so truncating
//! back to the context is an exact snapshot): an option never prefills the context again, and
//! a one-token option costs no forward pass at all (the context's own logits score it).

use crate::engine::{Prefill, PrefillStep};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::slots::Slot;

/// One option's score: the sum of its tokens' log-probabilities (natural log) and how many
/// tokens it has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptionScore {
    pub logprob: f64,
    pub tokens: usize,
}

/// What one [`Scoring::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoreStep {
    /// Part of the context was prefilled: `done` of its `total` tokens have KV now.
    Prefilled { done: usize, total: usize },
    /// Option `index` was scored (its score is in [`Scoring::scores`]).
    Scored { index: usize },
    /// Every option is scored.
    End,
}

/// An in-progress scoring: call [`Scoring::step`] until it returns [`ScoreStep::End`].
pub struct Scoring {
    prefill: Prefill,
    options: Vec<Vec<u32>>,
    /// The logits after the context's last token, once it is in the slot.
    last: Option<Vec<f32>>,
    scores: Vec<OptionScore>,
    turn_ended: bool,
}

impl Scoring {
    /// `options` may be of any lengths (an empty option scores 0 over 0 tokens).
    pub fn new(context: Vec<u32>, options: Vec<Vec<u32>>) -> Result<Scoring> {
        if context.is_empty() {
            return Err(Error::Input("the scoring context has no tokens".into()));
        }
        if options.is_empty() {
            return Err(Error::Input("nothing to score: no options".into()));
        }
        Ok(Scoring {
            prefill: Prefill::new(context),
            options,
            last: None,
            scores: Vec::new(),
            turn_ended: false,
        })
    }

    /// Context tokens whose KV came from the slot's history (None before the first step).
    pub fn reused(&self) -> Option<usize> {
        self.prefill.reused()
    }

    /// The options scored so far, in order.
    pub fn scores(&self) -> &[OptionScore] {
        &self.scores
    }

    /// One step: a part of the context's prefill, or one option.
    pub fn step(&mut self, model: &Model, slot: &mut Slot) -> Result<ScoreStep> {
        let last = match self.last.take() {
            Some(l) => l,
            None => match self
                .prefill
                .step(model, slot, |m, s, ids| s.forward(m, ids))?
            {
                PrefillStep::Part { done, total } => {
                    return Ok(ScoreStep::Prefilled { done, total })
                }
                PrefillStep::Last(l) => l,
            },
        };
        let index = self.scores.len();
        let result = match self.options.get(index) {
            None => {
                self.last = Some(last);
                self.end(model, slot);
                return Ok(ScoreStep::End);
            }
            Some(option) => score_option(model, slot, &last, option),
        };
        self.last = Some(last);
        self.scores.push(result?);
        Ok(ScoreStep::Scored { index })
    }

    /// Ends the turn (once): the slot's history (the context) is made durable and the model
    /// closes the turn's profile. Called at the end, and by whoever drops a scoring early.
    pub fn end(&mut self, model: &Model, slot: &mut Slot) {
        if !self.turn_ended {
            self.turn_ended = true;
            slot.end_turn();
            // A failed heat save changes nothing else; the next turn tries again.
            let _ = model.close_turn(&mut slot.turn);
        }
    }
}

/// `option`'s score after the slot's history, whose last logits are `last`. The option's
/// positions are run after the history and dropped again: the slot is left as it was.
fn score_option(
    model: &Model,
    slot: &mut Slot,
    last: &[f32],
    option: &[u32],
) -> Result<OptionScore> {
    let vocab = model.cfg.vocab_size;
    if let Some(&bad) = option.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Input(format!(
            "token id {bad} is outside the vocabulary ({vocab})"
        )));
    }
    let Some((&first, rest)) = option.split_first() else {
        return Ok(OptionScore {
            logprob: 0.0,
            tokens: 0,
        });
    };
    let mut logprob = log_softmax_at(last, first as usize);
    if !rest.is_empty() {
        // The logits after each of the option's tokens but its last score the next one.
        let logits = slot.try_after(model, &option[..option.len() - 1])?;
        for (row, &t) in logits.chunks_exact(vocab).zip(rest) {
            logprob += log_softmax_at(row, t as usize);
        }
    }
    Ok(OptionScore {
        logprob,
        tokens: option.len(),
    })
}

/// `log softmax(logits)[t]`: the largest logit taken out before the exponentials, their sum
/// in f64 (a vocabulary of 150k values loses nothing to rounding).
pub fn log_softmax_at(logits: &[f32], t: usize) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let total: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    logits[t] as f64 - max - total.ln()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Quant;

    fn model(fixture: &str) -> Model {
        let hf = crate::testutil::fixture(fixture);
        let root = crate::testutil::scratch_dir("score", fixture);
        let d = root.join("model");
        crate::convert::convert(&hf, &d, Quant::F32, &mut |_, _, _| {}).unwrap();
        let model = Model::load(&d, Some(2)).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        model
    }

    /// The log-probabilities from the full logits of context + option in one pass.
    fn reference(model: &Model, context: &[u32], option: &[u32]) -> f64 {
        let all: Vec<u32> = context.iter().chain(option).copied().collect();
        let logits = model.forward(&all, &mut model.new_cache(), true).unwrap();
        let v = model.cfg.vocab_size;
        option
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                let at = context.len() - 1 + i;
                log_softmax_at(&logits[at * v..(at + 1) * v], t as usize)
            })
            .sum()
    }

    fn run(model: &Model, slot: &mut Slot, context: &[u32], options: &[Vec<u32>]) -> Scoring {
        let mut s = Scoring::new(context.to_vec(), options.to_vec()).unwrap();
        while s.step(model, slot).unwrap() != ScoreStep::End {}
        s
    }

    /// Scores equal the log-softmax of a whole forward pass over context + option (options of
    /// 0, 1 and several tokens), the slot keeps exactly the context, and a second context
    /// sharing the first one's start reuses it.
    #[test]
    fn scores_match_whole_passes_and_leave_the_context_in_the_slot() {
        for fixture in ["olmoe", "deepseek_v3"] {
            let model = model(fixture);
            let vocab = model.cfg.vocab_size as u32;
            let context: Vec<u32> = (0..40u32).map(|i| (i * 17 + 3) % vocab).collect();
            let options: Vec<Vec<u32>> =
                vec![vec![5], vec![9, 2, 11], vec![], vec![1, 1, 1, 1, 1, 1, 7]];
            let mut slot = Slot::new(&model);
            let s = run(&model, &mut slot, &context, &options);
            assert_eq!(s.reused(), Some(0));
            for (got, o) in s.scores().iter().zip(&options) {
                assert_eq!(got.tokens, o.len());
                let want = reference(&model, &context, o);
                assert!(
                    (got.logprob - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{fixture}: {} vs {want}",
                    got.logprob
                );
            }
            assert_eq!(slot.tokens, context);
            assert_eq!(slot.kv.len, context.len());

            // A question after the same state: the state's KV is reused, scores unchanged.
            let mut longer = context.clone();
            longer.extend([4, 8, 15]);
            let s2 = run(&model, &mut slot, &longer, &options[..2]);
            assert_eq!(s2.reused(), Some(context.len()));
            for (got, o) in s2.scores().iter().zip(&options) {
                let want = reference(&model, &longer, o);
                assert!((got.logprob - want).abs() <= 1e-5 * want.abs().max(1.0));
            }
        }
    }

    /// A long context prefills in steps (progress rising) and gives the scores of one pass.
    #[test]
    fn a_long_context_prefills_in_steps() {
        let mut model = model("glm4_moe");
        let vocab = model.cfg.vocab_size as u32;
        let context: Vec<u32> = (0..150u32).map(|i| (i * 31 + 7) % vocab).collect();
        let options = vec![vec![3, 4], vec![6]];
        model.set_prefill_chunk(usize::MAX);
        let whole = run(&model, &mut Slot::new(&model), &context, &options);
        model.set_prefill_chunk(32);
        let mut slot = Slot::new(&model);
        let mut s = Scoring::new(context.clone(), options.clone()).unwrap();
        let mut parts = Vec::new();
        loop {
            match s.step(&model, &mut slot).unwrap() {
                ScoreStep::Prefilled { done, total } => {
                    assert_eq!(total, context.len());
                    parts.push(done);
                }
                ScoreStep::Scored { .. } => {}
                ScoreStep::End => break,
            }
        }
        assert!(parts.len() >= 2 && parts.windows(2).all(|w| w[0] < w[1]));
        for (a, b) in s.scores().iter().zip(whole.scores()) {
            assert!((a.logprob - b.logprob).abs() <= 1e-5 * b.logprob.abs().max(1.0));
        }
    }

    #[test]
    fn bad_input_is_refused_and_the_slot_kept() {
        let model = model("olmoe");
        let vocab = model.cfg.vocab_size as u32;
        assert!(Scoring::new(vec![], vec![vec![1]]).is_err());
        assert!(Scoring::new(vec![1], vec![]).is_err());
        let mut slot = Slot::new(&model);
        let mut s = Scoring::new(vec![1, 2, 3], vec![vec![4, vocab]]).unwrap();
        let e = s.step(&model, &mut slot).unwrap_err();
        assert!(e.to_string().contains("outside the vocabulary"), "{e}");
        assert_eq!(slot.tokens, [1, 2, 3]);
        assert_eq!(slot.kv.len, 3);
    }

    #[test]
    fn log_softmax_is_stable_and_normalised() {
        let logits = [1000.0f32, 999.0, -1000.0, 0.0];
        let total: f64 = (0..4).map(|t| log_softmax_at(&logits, t).exp()).sum();
        assert!((total - 1.0).abs() < 1e-12);
        assert!(log_softmax_at(&logits, 0).is_finite());
        assert!((log_softmax_at(&[0.0; 8], 3) - (1.0f64 / 8.0).ln()).abs() < 1e-12);
    }
}
