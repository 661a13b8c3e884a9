//! Generation over a loaded [`Model`]: prefill a prompt, then decode one token at a time,
//! stopping at a stop token, the token budget or the context length. A long prompt prefills in
//! steps of about [`STEP_TARGET`] each ([`Generation::step`]), so a caller can report progress,
//! stop between steps, and let other slots' generations take turns in between; the results do
//! not depend on the steps (every position's arithmetic is the same, as for the model's chunks).
//! A generation with a grammar ([`Generation::with_grammar`]) masks each step's logits to the
//! tokens the grammar allows before sampling; the mask is computed on another thread while the
//! step's forward pass runs.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::grammar::{Constraint, GrammarState, MaskStats};
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

/// About how long one prefill step should take: the next step's length follows the last
/// step's speed.
pub const STEP_TARGET: Duration = Duration::from_millis(500);
/// Positions of the first prefill step (before any speed is known) and the least of any step.
const FIRST_STEP: usize = 128;
const MIN_STEP: usize = 16;

/// What one [`Generation::step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Part of the prompt was prefilled: `done` of its `total` tokens have KV now (reused
    /// history included).
    Prefilled { done: usize, total: usize },
    /// The next generated token.
    Token(u32),
    /// The generation has ended.
    End,
}

/// An in-progress generation: call [`Generation::step`] (or [`Generation::next_token`]) until
/// it ends.
pub struct Generation {
    opts: GenerateOptions,
    sampler: Sampler,
    produced: usize,
    last: Option<u32>,
    finished: bool,
    prefill: Prefill,
    turn_ended: bool,
    grammar: Option<Constraint>,
}

/// A prompt prefilled into a slot in steps of about [`STEP_TARGET`], after the part it shares
/// with the slot's history (generation and scoring both start with one).
pub(crate) struct Prefill {
    prompt: Vec<u32>,
    /// Prompt tokens whose KV came from the slot's history (known after the first step).
    reused: Option<usize>,
    /// Prompt tokens with KV in the slot so far.
    done: usize,
    /// Positions of the next step.
    step_len: usize,
}

/// What one [`Prefill::step`] did.
pub(crate) enum PrefillStep {
    /// `done` of the prompt's tokens have KV now; more steps follow.
    Part { done: usize },
    /// The prompt is in the slot: the logits of its last token.
    Last(Vec<f32>),
}

impl Prefill {
    pub(crate) fn new(prompt: Vec<u32>) -> Prefill {
        Prefill {
            prompt,
            reused: None,
            done: 0,
            step_len: FIRST_STEP,
        }
    }

    /// A prefill of nothing with nothing reused (a scoring whose questions share no start).
    pub(crate) fn reused_none() -> Prefill {
        Prefill {
            prompt: Vec::new(),
            reused: Some(0),
            done: 0,
            step_len: FIRST_STEP,
        }
    }

    pub(crate) fn reused(&self) -> Option<usize> {
        self.reused
    }

    /// The prompt's positions the next step runs, and whether they are its last part (the
    /// first step matches the prompt against the slot's history and keeps what they share,
    /// but at least one token to compute).
    pub(crate) fn next(&mut self, model: &Model, slot: &mut Slot) -> Result<(Range<usize>, bool)> {
        let total = self.prompt.len();
        if self.reused.is_none() {
            if total > model.cfg.max_positions {
                return Err(Error::Input(format!(
                    "{total} tokens exceed the context length {}",
                    model.cfg.max_positions
                )));
            }
            let kept = slot.reuse_prefix(&self.prompt);
            self.reused = Some(kept);
            self.done = kept;
        }
        let from = self.done;
        let len = self.step_len.min(max_step(model));
        if total - from > len {
            Ok((from..from + len, false))
        } else if slot.kv.has_states() && total - from > 1 {
            // Linear-attention states: the last token runs alone, after a snapshot of the
            // state before it, so the same prompt again (a scoring's repeated state) reuses
            // all but that token, as a cache of rows would.
            Ok((from..total - 1, false))
        } else {
            Ok((from..total, true))
        }
    }

    /// The positions `next` gave are in the slot now; that step took `took`.
    pub(crate) fn advance(&mut self, to: usize, took: Duration, model: &Model) {
        let len = to - self.done;
        self.done = to;
        if to < self.prompt.len() {
            self.step_len = next_step_len(len, took, model);
        }
    }

    pub(crate) fn total(&self) -> usize {
        self.prompt.len()
    }

    /// The next part of the prompt ([`Prefill::next`]) run in the slot; the last part returns
    /// its logits (a scoring's; a generation steps through `next` and `advance` itself, in a
    /// batched pass).
    pub(crate) fn step(&mut self, model: &Model, slot: &mut Slot) -> Result<PrefillStep> {
        let (range, is_last) = self.next(model, slot)?;
        let t0 = Instant::now();
        let (from, total) = (self.done, self.prompt.len());
        let logits = slot.forward(model, &self.prompt[range.clone()])?;
        self.advance(range.end, t0.elapsed(), model);
        slot.kv.snapshot_if(snapshot_due(from, range.end, total));
        Ok(if is_last {
            PrefillStep::Last(logits)
        } else {
            PrefillStep::Part { done: range.end }
        })
    }
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
            opts,
            sampler,
            produced: 0,
            last: None,
            finished: false,
            prefill: Prefill::new(prompt),
            turn_ended: false,
            grammar: None,
        })
    }

    /// Constrains the output by a grammar. Its end tokens should include the stop tokens: a
    /// stop token the grammar does not allow is masked like any other token.
    pub fn with_grammar(mut self, grammar: Constraint) -> Generation {
        self.grammar = Some(grammar);
        self
    }

    /// The grammar's state (None without a grammar).
    pub fn grammar_state(&self) -> Option<GrammarState> {
        self.grammar.as_ref().map(|g| g.state())
    }

    /// The grammar's mask timings (None without a grammar).
    pub fn mask_stats(&self) -> Option<MaskStats> {
        self.grammar.as_ref().map(|g| g.stats)
    }

    /// Prompt tokens reused from the slot's history (None before the first step).
    pub fn reused(&self) -> Option<usize> {
        self.prefill.reused()
    }

    /// The next token, or `None` when generation has ended (prefill steps run until the
    /// first token).
    pub fn next_token(&mut self, model: &Model, slot: &mut Slot) -> Result<Option<u32>> {
        loop {
            match self.step(model, slot)? {
                Step::Prefilled { .. } => continue,
                Step::Token(t) => return Ok(Some(t)),
                Step::End => return Ok(None),
            }
        }
    }

    /// One step: a part of the prompt's prefill, or one token. The prompt is matched against
    /// the slot's history first: only the part it does not share is prefilled. Each step's
    /// positions join the slot's history as they are computed, so a generation dropped during
    /// its prefill leaves the part done for the next request that shares it.
    pub fn step(&mut self, model: &Model, slot: &mut Slot) -> Result<Step> {
        step_batch(model, &mut [(self, slot)]).remove(0)
    }

    /// What the next step runs: a part of the prompt, or the last token fed back; None when
    /// the generation has ended (it is ended then).
    fn feed(&mut self, model: &Model, slot: &mut Slot) -> Result<Option<Feed>> {
        if self.finished || self.produced >= self.opts.max_tokens {
            self.end(model, slot);
            return Ok(None);
        }
        match self.last {
            None => {
                let (range, last) = self.prefill.next(model, slot)?;
                Ok(Some(Feed {
                    tokens: self.prefill.prompt[range.clone()].to_vec(),
                    prefill_to: Some(range.end),
                    samples: last,
                }))
            }
            Some(tok) if slot.tokens.len() < model.cfg.max_positions => Ok(Some(Feed {
                tokens: vec![tok],
                prefill_to: None,
                samples: true,
            })),
            Some(_) => {
                self.end(model, slot);
                Ok(None)
            }
        }
    }

    /// The step after its forward pass (which took `took`): a prefill part's progress, or the
    /// next token sampled from `logits` (masked by the grammar first).
    fn absorb(
        &mut self,
        model: &Model,
        slot: &mut Slot,
        feed: &Feed,
        mut logits: Vec<f32>,
        took: Duration,
    ) -> Result<Step> {
        if let Some(to) = feed.prefill_to {
            let from = self.prefill.done;
            self.prefill.advance(to, took, model);
            slot.kv
                .snapshot_if(snapshot_due(from, to, self.prefill.total()));
            if !feed.samples {
                let total = self.prefill.total();
                return Ok(Step::Prefilled { done: to, total });
            }
        }
        if let Some(g) = &mut self.grammar {
            if !g.apply(&mut logits)? {
                // Nothing the grammar allows: ends here, incomplete.
                self.end(model, slot);
                return Ok(Step::End);
            }
        }
        let tok = self.sampler.sample(&logits) as u32;
        self.produced += 1;
        self.last = Some(tok);
        if self.opts.stop_token_ids.contains(&tok) {
            self.finished = true;
        }
        if let Some(g) = &mut self.grammar {
            if g.advance(tok)? {
                self.finished = true;
            }
        }
        Ok(Step::Token(tok))
    }

    /// Ends the turn (once): the slot's history is made durable and the model closes the
    /// turn's profile (and saves routing heat now and then). Called when the generation runs
    /// out, and by whoever drops a generation early.
    pub fn end(&mut self, model: &Model, slot: &mut Slot) {
        self.finished = true;
        if let Some(g) = &mut self.grammar {
            g.finish();
        }
        if !self.turn_ended {
            self.turn_ended = true;
            slot.end_turn();
            // A failed heat save changes nothing else; the next turn tries again.
            let _ = model.close_turn(&mut slot.turn);
        }
    }
}

/// What one generation's step runs.
struct Feed {
    tokens: Vec<u32>,
    /// A prefill step: the prompt position it ends at.
    prefill_to: Option<usize>,
    /// Whether a token is sampled from its logits (a decode step or the prompt's last part).
    samples: bool,
}

/// One step of every generation of `work` (each in its own slot) together: one forward pass
/// runs each one's next tokens (a part of its prompt, or its last token) over its own history
/// ([`Slot::forward_many`]), reading every weight once for all of them; each grammar's next
/// mask is computed on another thread meanwhile (when it needs one and overlapping is on; the
/// mask depends only on the tokens the grammar has already consumed). Each generation's tokens
/// are exactly those it gets stepped alone. Returns each one's result, in order: a generation's
/// bad input fails it alone; a failed pass (an expert read) fails every generation in it.
pub fn step_batch(model: &Model, work: &mut [(&mut Generation, &mut Slot)]) -> Vec<Result<Step>> {
    let mut results: Vec<Option<Result<Step>>> = (0..work.len()).map(|_| None).collect();
    let mut feeds: Vec<(usize, Feed)> = Vec::new();
    for (i, (gen, slot)) in work.iter_mut().enumerate() {
        match gen.feed(model, slot) {
            Ok(None) => results[i] = Some(Ok(Step::End)),
            Ok(Some(feed)) => match model.check_tokens(slot.kv.len, &feed.tokens) {
                Ok(()) => feeds.push((i, feed)),
                Err(e) => results[i] = Some(Err(e)),
            },
            Err(e) => results[i] = Some(Err(e)),
        }
    }
    if !feeds.is_empty() {
        let t0 = Instant::now();
        let mut feed_of: Vec<Option<&Feed>> = vec![None; work.len()];
        for (i, feed) in &feeds {
            feed_of[*i] = Some(feed);
        }
        let mut masks: Vec<(usize, &mut Constraint)> = Vec::new();
        let mut passes: Vec<(&mut Slot, &[u32])> = Vec::new();
        for (i, ((gen, slot), feed)) in work.iter_mut().zip(&feed_of).enumerate() {
            let Some(feed) = feed else { continue };
            if let Some(g) = gen.grammar.as_mut() {
                if feed.samples && g.overlap() && g.needs_mask() {
                    masks.push((i, g));
                }
            }
            passes.push((&mut **slot, &feed.tokens));
        }
        let (logits, masked) = std::thread::scope(|s| {
            let jobs: Vec<_> = masks
                .into_iter()
                .map(|(i, g)| {
                    (
                        i,
                        s.spawn(move || {
                            let r = g.compute_mask();
                            (r, Instant::now())
                        }),
                    )
                })
                .collect();
            let logits = Slot::forward_many(model, &mut passes);
            let now = Instant::now();
            let masked: Vec<(usize, Result<()>, Duration)> = jobs
                .into_iter()
                .map(|(i, h)| {
                    let (r, done) = h.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
                    (i, r, done.saturating_duration_since(now))
                })
                .collect();
            (logits, masked)
        });
        let took = t0.elapsed();
        for (i, r, waited) in masked {
            if let Some(g) = work[i].0.grammar.as_mut() {
                g.stats.wait += waited;
            }
            if let Err(e) = r {
                results[i] = Some(Err(e));
            }
        }
        match logits {
            Ok(all) => {
                for ((i, feed), logits) in feeds.iter().zip(all) {
                    if results[*i].is_none() {
                        let (gen, slot) = &mut work[*i];
                        results[*i] = Some(gen.absorb(model, slot, feed, logits, took));
                    }
                }
            }
            Err(e) => {
                for (i, _) in &feeds {
                    results[*i].get_or_insert_with(|| Err(e.shared()));
                }
            }
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every generation has a result"))
        .collect()
}

/// Positions of a long prompt between the snapshots of linear-attention states taken while it
/// prefills (besides the one at its end): a prompt that leaves the history part way through a
/// long one resumes from the last snapshot before it instead of from the start, recomputing
/// fewer than this many positions. Measured: a snapshot is a copy of the state, 0.22 ms for the
/// benchmark's 4-layer Qwen3-Next shape (6.6 MB) and 11 ms for Qwen3-Next-80B's (79 MB) on the
/// test machine, against 2.3 s for prefilling 1024 positions of the former (450 tokens/s) and
/// tens of seconds for the latter: at 1024 the copies cost ~0.1% of the prefill at most, and
/// four times as many positions as at 4096 are saved on a divergence. Memory does not grow:
/// a slot keeps at most `kv::MAX_SNAPSHOTS`, spread over the history (`kv::evicted`).
const SNAPSHOT_EVERY: usize = 1024;

/// Whether a prefill step from `from` to `to` of a `total`-token prompt ends at a snapshot
/// point: the prompt's end or the token before it (where the same prompt again resumes), or
/// past a multiple of [`SNAPSHOT_EVERY`].
fn snapshot_due(from: usize, to: usize, total: usize) -> bool {
    to == total || to + 1 == total || to / SNAPSHOT_EVERY > from / SNAPSHOT_EVERY
}

/// The next prefill step's length after one of `len` positions took `took`: about
/// [`STEP_TARGET`] at that speed (later positions attend over more history, so the estimate
/// errs long by a little), a multiple of [`MIN_STEP`], at most the model's prefill chunk, and at
/// most twice the last step (one fast step does not jump to the largest).
fn next_step_len(len: usize, took: Duration, model: &Model) -> usize {
    let rate = len as f64 / took.as_secs_f64().max(1e-6);
    let want = (rate * STEP_TARGET.as_secs_f64()) as usize;
    (want.min(2 * len).min(max_step(model)) / MIN_STEP * MIN_STEP).max(MIN_STEP)
}

/// The longest prefill step: one forward pass's chunk.
fn max_step(model: &Model) -> usize {
    model.prefill_chunk().max(MIN_STEP)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Quant;

    fn opts(max_tokens: usize) -> GenerateOptions {
        GenerateOptions {
            max_tokens,
            temperature: 0.0,
            top_p: 1.0,
            stop_token_ids: Vec::new(),
            seed: None,
        }
    }

    /// A prompt prefilled in steps gives the tokens of the same prompt in one pass; progress
    /// rises to the prompt's length; a generation dropped mid-prefill leaves the steps done in
    /// the slot, and a retry reuses them and gives the same tokens again.
    #[test]
    fn stepped_prefill_gives_the_same_tokens_and_keeps_its_progress() {
        let hf = crate::testutil::fixture("glm4_moe");
        let root = crate::testutil::scratch_dir("engine", "steps");
        let d = root.join("model");
        crate::convert::convert(&hf, &d, Quant::F32, &mut |_, _, _| {}).unwrap();
        let mut model = Model::load(&d, Some(2)).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        let vocab = model.cfg.vocab_size as u32;
        let prompt: Vec<u32> = (0..200u32).map(|i| (i * 31 + 7) % vocab).collect();

        model.set_prefill_chunk(usize::MAX);
        let mut slot = Slot::new(&model);
        let mut whole = Generation::new(prompt.clone(), opts(6)).unwrap();
        let mut expected = Vec::new();
        while let Some(t) = whole.next_token(&model, &mut slot).unwrap() {
            expected.push(t);
        }

        model.set_prefill_chunk(48);
        let mut slot = Slot::new(&model);
        let mut gen = Generation::new(prompt.clone(), opts(6)).unwrap();
        let (mut progress, mut tokens) = (Vec::new(), Vec::new());
        loop {
            match gen.step(&model, &mut slot).unwrap() {
                Step::Prefilled { done, total } => {
                    assert_eq!(total, prompt.len());
                    progress.push(done);
                }
                Step::Token(t) => tokens.push(t),
                Step::End => break,
            }
        }
        assert_eq!(tokens, expected);
        assert!(progress.len() >= 200 / 48, "{progress:?}");
        assert!(progress.windows(2).all(|w| w[0] < w[1]) && progress[0] <= 48);
        assert!(*progress.last().unwrap() < prompt.len());

        // Dropped after two steps: the slot keeps what they computed.
        let mut slot = Slot::new(&model);
        let mut gen = Generation::new(prompt.clone(), opts(6)).unwrap();
        let Step::Prefilled { done: first, .. } = gen.step(&model, &mut slot).unwrap() else {
            panic!("expected a prefill step")
        };
        let Step::Prefilled { done, .. } = gen.step(&model, &mut slot).unwrap() else {
            panic!("expected a prefill step")
        };
        assert!(done > first);
        gen.end(&model, &mut slot);
        assert_eq!(slot.tokens, prompt[..done]);
        let mut retry = Generation::new(prompt.clone(), opts(6)).unwrap();
        let mut again = Vec::new();
        while let Some(t) = retry.next_token(&model, &mut slot).unwrap() {
            again.push(t);
        }
        assert_eq!(retry.reused(), Some(done));
        assert_eq!(again, expected);
    }

    #[test]
    fn step_lengths_follow_the_speed_within_bounds() {
        let hf = crate::testutil::fixture("olmoe");
        let root = crate::testutil::scratch_dir("engine", "lens");
        let d = root.join("model");
        crate::convert::convert(&hf, &d, Quant::F32, &mut |_, _, _| {}).unwrap();
        let mut model = Model::load(&d, Some(1)).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        model.set_prefill_chunk(512);
        // 128 positions in 1 s: 64 fit the target.
        assert_eq!(next_step_len(128, Duration::from_secs(1), &model), 64);
        // Fast: at most double, then at most the chunk.
        assert_eq!(next_step_len(128, Duration::from_millis(1), &model), 256);
        assert_eq!(next_step_len(400, Duration::from_millis(1), &model), 512);
        // Very slow: never below the least step.
        assert_eq!(
            next_step_len(16, Duration::from_secs(100), &model),
            MIN_STEP
        );
    }
}

#[cfg(test)]
mod grammar_tests {
    use super::*;
    use crate::format::Quant;
    use crate::grammar::{GrammarEnv, GrammarKind};

    fn opts(max_tokens: usize, temperature: f32, seed: u64) -> GenerateOptions {
        GenerateOptions {
            max_tokens,
            temperature,
            top_p: 1.0,
            stop_token_ids: vec![0],
            seed: Some(seed),
        }
    }

    fn run(model: &Model, gen: &mut Generation) -> Vec<u32> {
        let mut slot = Slot::new(model);
        let mut out = Vec::new();
        while let Some(t) = gen.next_token(model, &mut slot).unwrap() {
            out.push(t);
        }
        gen.end(model, &mut slot);
        out
    }

    /// A grammar that allows exactly one string makes an untrained model (random weights)
    /// write exactly that string, greedy and sampled, with and without the overlapped mask;
    /// the end token comes where the string is complete. Too small a budget ends incomplete.
    #[test]
    fn a_forced_string_is_reproduced_exactly() {
        let hf = crate::testutil::fixture("glm4_moe");
        let root = crate::testutil::scratch_dir("engine", "grammar");
        let d = root.join("model");
        crate::convert::convert(&hf, &d, Quant::F32, &mut |_, _, _| {}).unwrap();
        let model = Model::load(&d, Some(2)).unwrap();
        let tok_file = d.join(&model.manifest.tokenizer);
        let env = GrammarEnv::from_tokenizer_file(&tok_file, model.cfg.vocab_size, 0).unwrap();
        std::fs::remove_dir_all(&root).unwrap();
        let want = r#"{"city": "Lisbon", "n": 42}"#;
        let lark = format!("start: {}", serde_json::to_string(want).unwrap());
        let prompt: Vec<u32> = (1..20).collect();
        for (temperature, overlap) in [(0.0, true), (1.0, true), (1.5, false)] {
            for seed in 0..3 {
                let m = env.compile(GrammarKind::Lark, &lark).unwrap();
                let mut c = Constraint::new(&env, m, Vec::new(), vec![0]).unwrap();
                c.set_overlap(overlap);
                let mut gen = Generation::new(prompt.clone(), opts(64, temperature, seed))
                    .unwrap()
                    .with_grammar(c);
                let out = run(&model, &mut gen);
                assert_eq!(gen.grammar_state(), Some(GrammarState::Satisfied));
                let text = env.decode(&out);
                let body = String::from_utf8_lossy(&text);
                // Ends with the end token (0) where the string is complete, or right after it.
                let body = body.strip_suffix("<|endoftext|>").unwrap_or(&body);
                assert_eq!(body, want, "temperature {temperature} seed {seed}");
                let stats = gen.mask_stats().unwrap();
                assert!(stats.masks >= 2, "{stats:?}");
            }
        }
        let m = env.compile(GrammarKind::Lark, &lark).unwrap();
        let c = Constraint::new(&env, m, Vec::new(), vec![0]).unwrap();
        let mut gen = Generation::new(prompt, opts(3, 0.0, 0))
            .unwrap()
            .with_grammar(c);
        let out = run(&model, &mut gen);
        assert_eq!(out.len(), 3);
        assert_eq!(gen.grammar_state(), Some(GrammarState::Incomplete));
    }

    /// Along the tokenizer's tokens of a valid JSON text, every token is allowed by the mask of
    /// the schema it matches (the mask never excludes a token the output needs).
    #[test]
    fn the_mask_never_excludes_a_needed_token() {
        let hf = crate::testutil::fixture("glm4_moe");
        let env = GrammarEnv::from_tokenizer_file(&hf.join("tokenizer.json"), 509, 0).unwrap();
        let schema = r#"{"type":"object","properties":{"a":{"type":"array","items":{"type":"integer","minimum":-5,"maximum":900}},"b":{"enum":["red","green"]},"c":{"type":"string"}},"required":["a","b","c"],"additionalProperties":false}"#;
        let text = r#"{"a":[1,-5,900,17],"b":"green","c":"hello, world \"q\""}"#;
        let tokens = env.tokenize_greedy(text.as_bytes());
        assert_eq!(env.decode(&tokens), text.as_bytes());
        let m = env.compile(GrammarKind::JsonSchema, schema).unwrap();
        let mut c = Constraint::new(&env, m, Vec::new(), vec![0]).unwrap();
        for (i, &t) in tokens.iter().enumerate() {
            let mut logits = vec![0.0f32; env.vocab_size()];
            assert!(c.apply(&mut logits).unwrap());
            assert_eq!(logits[t as usize], 0.0, "token {t} excluded");
            assert_ne!(
                logits[0], 0.0,
                "the end token before the object is complete"
            );
            // The closing brace completes the grammar: nothing more is allowed, it ends there.
            assert_eq!(c.advance(t).unwrap(), i + 1 == tokens.len());
        }
        assert_eq!(c.state(), GrammarState::Satisfied);
    }
}
