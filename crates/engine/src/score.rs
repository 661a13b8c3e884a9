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
    /// Options up to `index` (of every question's, in order) are scored (one step may score
    /// several; see [`Scoring::scores`]).
    Scored { index: usize },
    /// Every option is scored.
    End,
}

/// One question of a scoring: a context and the options read after it.
struct Question {
    context: Vec<u32>,
    options: Vec<Vec<u32>>,
    /// The logits after the context's last token, once it has run.
    last: Option<Vec<f32>>,
    scores: Vec<Option<OptionScore>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Prefilling the start every context shares, in steps.
    Shared,
    /// Each question's rest of its context, all in one batched pass.
    Contexts,
    /// Round `r`: the `r`-th option of several tokens of every question, in one batched pass.
    Options(usize),
    Done,
}

/// An in-progress scoring of one or several questions (contexts that may share a start, such
/// as one state asked several questions), each with its options: call [`Scoring::step`] until
/// it returns [`ScoreStep::End`].
///
/// The shared start is prefilled in the slot in steps; then the rest of every context runs in
/// one batched pass (question 0 in the slot, the others in private copies of it,
/// [`Slot::fork`]), so several questions cost one sweep over the experts instead of one each;
/// then the options of several tokens run in rounds, one option of every question per batched
/// pass. The slot keeps the first question's context.
pub struct Scoring {
    questions: Vec<Question>,
    /// Tokens every context starts with (a lone question: its whole context).
    shared: usize,
    prefill: Prefill,
    phase: Phase,
    /// Questions 1.. run in these copies of the slot after the shared start.
    forks: Vec<Slot>,
    turn_ended: bool,
}

impl Scoring {
    /// One context and its options (any lengths; an empty option scores 0 over 0 tokens).
    pub fn new(context: Vec<u32>, options: Vec<Vec<u32>>) -> Result<Scoring> {
        Scoring::many(vec![(context, options)])
    }

    /// Several questions, each a context and its options, read in one scoring.
    pub fn many(questions: Vec<(Vec<u32>, Vec<Vec<u32>>)>) -> Result<Scoring> {
        if questions.is_empty() {
            return Err(Error::Input("nothing to score: no questions".into()));
        }
        for (context, options) in &questions {
            if context.is_empty() {
                return Err(Error::Input("the scoring context has no tokens".into()));
            }
            if options.is_empty() {
                return Err(Error::Input("nothing to score: no options".into()));
            }
        }
        let first = &questions[0].0;
        let shared = if questions.len() == 1 {
            first.len()
        } else {
            // Every question keeps at least one token of its own (its context's last logits).
            let common = questions[1..]
                .iter()
                .map(|(c, _)| c.iter().zip(first).take_while(|(a, b)| a == b).count())
                .min()
                .unwrap_or(0);
            let shortest = questions.iter().map(|(c, _)| c.len()).min().unwrap_or(1);
            common.min(shortest - 1)
        };
        let prefill = Prefill::new(first[..shared].to_vec());
        Ok(Scoring {
            questions: questions
                .into_iter()
                .map(|(context, options)| Question {
                    scores: vec![None; options.len()],
                    context,
                    options,
                    last: None,
                })
                .collect(),
            shared,
            prefill,
            phase: Phase::Shared,
            forks: Vec::new(),
            turn_ended: false,
        })
    }

    /// Context tokens whose KV came from the slot's history (None before the first step).
    pub fn reused(&self) -> Option<usize> {
        self.prefill.reused()
    }

    /// The options scored so far, question after question, in order (those not scored yet
    /// left out).
    pub fn scores(&self) -> Vec<OptionScore> {
        self.questions
            .iter()
            .flat_map(|q| q.scores.iter().flatten().copied())
            .collect()
    }

    /// Context tokens the scoring runs in all: the shared start once and every question's rest
    /// (reused ones included).
    pub fn context_tokens(&self) -> usize {
        self.shared
            + self
                .questions
                .iter()
                .map(|q| q.context.len() - self.shared)
                .sum::<usize>()
    }

    /// One step: a part of the shared start's prefill, the rest of every context, or one round
    /// of options.
    pub fn step(&mut self, model: &Model, slot: &mut Slot) -> Result<ScoreStep> {
        match self.phase {
            Phase::Shared => {
                if self.shared == 0 {
                    // Nothing shared: the history is dropped; every context runs whole.
                    slot.reuse_prefix(&[]);
                    self.prefill = Prefill::reused_none();
                    self.phase = Phase::Contexts;
                    return self.step(model, slot);
                }
                let total = self.context_tokens();
                match self.prefill.step(model, slot)? {
                    PrefillStep::Part { done } => Ok(ScoreStep::Prefilled { done, total }),
                    PrefillStep::Last(logits) => {
                        if self.questions.len() == 1 {
                            self.questions[0].last = Some(logits);
                            self.phase = Phase::Options(0);
                            return self.step(model, slot);
                        }
                        self.phase = Phase::Contexts;
                        Ok(ScoreStep::Prefilled {
                            done: self.shared,
                            total,
                        })
                    }
                }
            }
            Phase::Contexts => {
                let room = self
                    .questions
                    .iter()
                    .map(|q| {
                        q.context.len() - self.shared
                            + q.options.iter().map(Vec::len).max().unwrap_or(0)
                    })
                    .max()
                    .unwrap_or(0);
                self.forks = (1..self.questions.len()).map(|_| slot.fork(room)).collect();
                let shared = self.shared;
                let mut work: Vec<(&mut Slot, &[u32])> = std::iter::once(slot)
                    .chain(self.forks.iter_mut())
                    .zip(&self.questions)
                    .map(|(s, q)| (s, &q.context[shared..]))
                    .collect();
                let logits = Slot::forward_many(model, &mut work)?;
                for (q, l) in self.questions.iter_mut().zip(logits) {
                    q.last = Some(l);
                }
                self.phase = Phase::Options(0);
                let total = self.context_tokens();
                Ok(ScoreStep::Prefilled { done: total, total })
            }
            Phase::Options(round) => {
                if round == 0 {
                    self.check_options(model)?;
                    self.score_short();
                }
                let ran = self.option_round(model, slot, round)?;
                self.phase = if ran {
                    Phase::Options(round + 1)
                } else {
                    Phase::Done
                };
                if !ran && round > 0 {
                    return self.step(model, slot);
                }
                let index = self.scores().len().saturating_sub(1);
                Ok(ScoreStep::Scored { index })
            }
            Phase::Done => {
                self.end(model, slot);
                Ok(ScoreStep::End)
            }
        }
    }

    fn check_options(&self, model: &Model) -> Result<()> {
        let vocab = model.cfg.vocab_size;
        for q in &self.questions {
            if let Some(&bad) = q.options.iter().flatten().find(|&&t| t as usize >= vocab) {
                return Err(Error::Input(format!(
                    "token id {bad} is outside the vocabulary ({vocab})"
                )));
            }
        }
        Ok(())
    }

    /// Options of at most one token: read from the context's own logits.
    fn score_short(&mut self) {
        for q in &mut self.questions {
            let last = q.last.as_ref().expect("the context has run");
            for (o, score) in q.options.iter().zip(q.scores.iter_mut()) {
                *score = match o.as_slice() {
                    [] => Some(OptionScore {
                        logprob: 0.0,
                        tokens: 0,
                    }),
                    [t] => Some(OptionScore {
                        logprob: log_softmax_at(last, *t as usize),
                        tokens: 1,
                    }),
                    _ => None,
                };
            }
        }
    }

    /// The `round`-th option of several tokens of every question that has one, in one pass
    /// (each after its question's context, then dropped again). False when none is left.
    fn option_round(&mut self, model: &Model, slot: &mut Slot, round: usize) -> Result<bool> {
        // (question, option) of this round.
        let picks: Vec<(usize, usize)> = self
            .questions
            .iter()
            .enumerate()
            .filter_map(|(qi, q)| {
                let long: Vec<usize> = (0..q.options.len())
                    .filter(|&i| q.options[i].len() > 1)
                    .collect();
                long.get(round).map(|&oi| (qi, oi))
            })
            .collect();
        if picks.is_empty() {
            return Ok(false);
        }
        let questions = &self.questions;
        let mut slots: Vec<Option<&mut Slot>> = std::iter::once(slot)
            .chain(self.forks.iter_mut())
            .map(Some)
            .collect();
        let mut work: Vec<(&mut Slot, &[u32])> = picks
            .iter()
            .map(|&(qi, oi)| {
                let o = &questions[qi].options[oi];
                (
                    slots[qi].take().expect("one option per question a round"),
                    &o[..o.len() - 1],
                )
            })
            .collect();
        let logits = Slot::try_after_many(model, &mut work)?;
        let vocab = model.cfg.vocab_size;
        for (&(qi, oi), rows) in picks.iter().zip(logits) {
            let q = &mut self.questions[qi];
            let o = &q.options[oi];
            let last = q.last.as_ref().expect("the context has run");
            let mut logprob = log_softmax_at(last, o[0] as usize);
            for (row, &t) in rows.chunks_exact(vocab).zip(&o[1..]) {
                logprob += log_softmax_at(row, t as usize);
            }
            q.scores[oi] = Some(OptionScore {
                logprob,
                tokens: o.len(),
            });
        }
        Ok(true)
    }

    /// Ends the turn (once): the slot's history (the first context) is made durable and the
    /// model closes the turn's profile. Called at the end, and by whoever drops a scoring early.
    pub fn end(&mut self, model: &Model, slot: &mut Slot) {
        self.phase = Phase::Done;
        self.forks.clear();
        if !self.turn_ended {
            self.turn_ended = true;
            slot.end_turn();
            // A failed heat save changes nothing else; the next turn tries again.
            let _ = model.close_turn(&mut slot.turn);
        }
    }
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
        // Tests run at once: each conversion its own directory.
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let root = crate::testutil::scratch_dir("score", &format!("{fixture}-{n}"));
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

    /// A question as [`Scoring::many`] takes it: a context and its options.
    type Asked = (Vec<u32>, Vec<Vec<u32>>);

    /// Several questions after one state in one scoring give exactly the scores each one gets
    /// alone (the state prefilled once, the questions' rests in one batched pass, options of
    /// several tokens in rounds); the slot keeps the first question's context. Questions that
    /// share no start, or one that is the start of another, are scored alike.
    #[test]
    fn several_questions_score_as_each_alone() {
        for fixture in ["olmoe", "glm_moe_dsa"] {
            let model = model(fixture);
            let vocab = model.cfg.vocab_size as u32;
            let state: Vec<u32> = (0..40u32).map(|i| (i * 17 + 3) % vocab).collect();
            let ctx = |tail: &[u32]| state.iter().chain(tail).copied().collect::<Vec<u32>>();
            let cases: Vec<Vec<Asked>> = vec![
                vec![
                    (ctx(&[4, 8, 15]), vec![vec![5], vec![9, 2, 11], vec![]]),
                    (ctx(&[16, 23]), vec![vec![1, 1, 1, 7], vec![3], vec![2, 6]]),
                    (ctx(&[42, 4, 8, 15, 16, 23, 42]), vec![vec![7], vec![8]]),
                ],
                // No shared start at all.
                vec![
                    (vec![1, 2, 3], vec![vec![4, 5], vec![6]]),
                    (vec![9, 8], vec![vec![7]]),
                ],
                // One context is the start of the other.
                vec![
                    (ctx(&[]), vec![vec![5, 6]]),
                    (ctx(&[5, 6, 7]), vec![vec![8], vec![9, 10]]),
                ],
            ];
            for questions in cases {
                let alone: Vec<Vec<OptionScore>> = questions
                    .iter()
                    .map(|(c, o)| run(&model, &mut Slot::new(&model), c, o).scores())
                    .collect();
                let mut slot = Slot::new(&model);
                let mut s = Scoring::many(questions.clone()).unwrap();
                let mut progress = Vec::new();
                loop {
                    match s.step(&model, &mut slot).unwrap() {
                        ScoreStep::Prefilled { done, total } => progress.push((done, total)),
                        ScoreStep::Scored { .. } => {}
                        ScoreStep::End => break,
                    }
                }
                assert_eq!(s.scores(), alone.concat(), "{fixture}");
                assert_eq!(slot.tokens, questions[0].0, "{fixture}");
                let (done, total) = *progress.last().unwrap();
                assert_eq!(done, total, "{fixture}: {progress:?}");
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
