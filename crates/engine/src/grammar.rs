//! Constrained decoding: a token mask from a grammar, applied to the logits before sampling.
//!
//! The grammar (a JSON schema, a Lark grammar or a regular expression, as `llguidance` reads
//! them) is compiled against the model's own tokenizer: [`GrammarEnv`] holds the token bytes of
//! the model directory's `tokenizer.json` as a token trie, built once per model. Each generation
//! with a grammar owns a [`Constraint`]: it is *pending* until the generated tokens end with its
//! trigger (the family's end-of-reasoning marker, so thinking stays free), then *active*: every
//! step's logits are masked to the tokens the grammar allows next, and the model's end tokens
//! are allowed exactly when the grammar accepts. A grammar that completes ends the generation;
//! one still open when the budget runs out is reported as incomplete, never as finished.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{
    ApproximateTokEnv, InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie,
};
use llguidance::{Matcher, ParserFactory};

use crate::error::{io_err, Error, Result};

/// The grammar kinds a request can give.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarKind {
    JsonSchema,
    Lark,
    Regex,
}

impl GrammarKind {
    pub fn from_name(name: &str) -> Option<GrammarKind> {
        match name {
            "json_schema" => Some(GrammarKind::JsonSchema),
            "lark" => Some(GrammarKind::Lark),
            "regex" => Some(GrammarKind::Regex),
            _ => None,
        }
    }
}

/// A model's tokenizer as llguidance needs it, and the parser factory over it (shared by every
/// generation of the model).
pub struct GrammarEnv {
    factory: ParserFactory,
    vocab_size: usize,
}

impl GrammarEnv {
    /// From a `tokenizer.json` (byte-level or byte-fallback BPE) for a model of `vocab_size`
    /// logits; `eos` is the token the grammar's end stands for (any of the generation's end
    /// tokens is allowed when the grammar accepts).
    pub fn from_tokenizer_file(path: &Path, vocab_size: usize, eos: u32) -> Result<GrammarEnv> {
        let text = std::fs::read_to_string(path).map_err(io_err(path))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| Error::Format(format!("{}: {e}", path.display())))?;
        if words.len() > vocab_size {
            return Err(Error::Format(format!(
                "{}: {} tokens, more than the model's {vocab_size} logits",
                path.display(),
                words.len()
            )));
        }
        // Rows of the embedding beyond the tokenizer (padding) have no bytes: never allowed.
        words.resize(vocab_size, Vec::new());
        GrammarEnv::from_token_bytes(&words, eos)
    }

    /// From each token's bytes (special tokens start with [`TokTrie::SPECIAL_TOKEN_MARKER`]).
    pub fn from_token_bytes(words: &[Vec<u8>], eos: u32) -> Result<GrammarEnv> {
        let vocab_size = words.len();
        if eos as usize >= vocab_size {
            return Err(Error::Input(format!(
                "end token {eos} is outside the vocabulary ({vocab_size})"
            )));
        }
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let trie = TokTrie::from(&info, words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let caps = InferenceCapabilities {
            ff_tokens: false,
            backtrack: false,
            conditional_ff_tokens: false,
            fork: false,
        };
        let slices = llguidance::earley::SlicedBiasComputer::general_slices();
        let mut factory = ParserFactory::new(&env, caps, &slices)
            .map_err(|e| Error::Format(format!("grammar tokenizer: {e}")))?;
        factory.quiet();
        Ok(GrammarEnv {
            factory,
            vocab_size,
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The bytes of `tokens` (special tokens as their text).
    pub fn decode(&self, tokens: &[u32]) -> Vec<u8> {
        self.factory.tok_env().tok_trie().decode(tokens)
    }

    /// `bytes` as tokens, greedily (the longest token first; not necessarily the tokenizer's own
    /// split).
    pub fn tokenize_greedy(&self, bytes: &[u8]) -> Vec<u32> {
        self.factory.tok_env().tok_trie().greedy_tokenize(bytes)
    }

    /// Compiles a grammar; a grammar llguidance refuses (an unsupported JSON-schema keyword, a
    /// Lark syntax error) is an input error carrying its message.
    pub fn compile(&self, kind: GrammarKind, source: &str) -> Result<Matcher> {
        let grammar = match kind {
            GrammarKind::JsonSchema => {
                let schema: serde_json::Value = serde_json::from_str(source)
                    .map_err(|e| Error::Input(format!("the JSON schema is not JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarKind::Lark => TopLevelGrammar::from_lark(source.to_string()),
            GrammarKind::Regex => TopLevelGrammar::from_regex(source),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| Error::Input(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Input(e));
        }
        Ok(matcher)
    }
}

/// Where a constrained generation stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrammarState {
    /// Waiting for the trigger: the output is free so far.
    Pending,
    /// The mask applies.
    Active,
    /// The grammar was completed (an end token where it accepted, or nothing more allowed).
    Satisfied,
    /// The generation ended before the grammar was complete, or no token was allowed.
    Incomplete,
}

impl GrammarState {
    pub fn name(self) -> &'static str {
        match self {
            GrammarState::Pending => "pending",
            GrammarState::Active => "active",
            GrammarState::Satisfied => "satisfied",
            GrammarState::Incomplete => "incomplete",
        }
    }
}

/// Mask timings of one generation.
#[derive(Debug, Default, Clone, Copy)]
pub struct MaskStats {
    /// Masks computed.
    pub masks: usize,
    /// Time inside mask computation (on whichever thread computed it).
    pub compute: Duration,
    /// Time the step waited for a mask after its forward pass had finished.
    pub wait: Duration,
    /// Time advancing the grammar over the sampled tokens.
    pub consume: Duration,
}

/// One generation's grammar: the matcher, its trigger and state.
pub struct Constraint {
    matcher: Matcher,
    trigger: Vec<u32>,
    end_tokens: Vec<u32>,
    eos: u32,
    state: GrammarState,
    /// The last generated tokens (as many as the trigger has), while pending.
    tail: Vec<u32>,
    /// The mask for the next token and whether the grammar accepts (may end) there, computed
    /// ahead (while the forward pass runs).
    next_mask: Option<(SimpleVob, bool)>,
    /// Compute the mask on another thread during the forward pass.
    overlap: bool,
    pub stats: MaskStats,
}

impl Constraint {
    /// `trigger`: tokens after which the grammar applies (empty: from the first token);
    /// `end_tokens`: the tokens that end the generation, allowed when the grammar accepts.
    pub fn new(
        env: &GrammarEnv,
        matcher: Matcher,
        trigger: Vec<u32>,
        end_tokens: Vec<u32>,
    ) -> Result<Constraint> {
        let eos = matcher
            .tok_env()
            .map_err(|e| Error::Input(e.to_string()))?
            .tok_trie()
            .eos_token();
        if end_tokens.is_empty() {
            return Err(Error::Input(
                "a grammar needs at least one end token".into(),
            ));
        }
        if let Some(&t) = end_tokens.iter().find(|&&t| t as usize >= env.vocab_size) {
            return Err(Error::Input(format!(
                "end token {t} is outside the vocabulary ({})",
                env.vocab_size
            )));
        }
        let state = if trigger.is_empty() {
            GrammarState::Active
        } else {
            GrammarState::Pending
        };
        Ok(Constraint {
            matcher,
            trigger,
            end_tokens,
            eos,
            state,
            tail: Vec::new(),
            next_mask: None,
            overlap: crate::settings::grammar_overlap(),
            stats: MaskStats::default(),
        })
    }

    pub fn state(&self) -> GrammarState {
        self.state
    }

    /// Whether masks are computed on another thread during the forward pass.
    pub fn set_overlap(&mut self, on: bool) {
        self.overlap = on;
    }

    pub fn overlap(&self) -> bool {
        self.overlap
    }

    /// Whether the next step needs a mask (and none is computed yet).
    pub fn needs_mask(&self) -> bool {
        self.state == GrammarState::Active && self.next_mask.is_none()
    }

    /// Computes the mask for the next token (call while the forward pass runs).
    pub fn compute_mask(&mut self) -> Result<()> {
        if !self.needs_mask() {
            return Ok(());
        }
        let t0 = Instant::now();
        let bad = |e: &dyn std::fmt::Display| Error::Input(format!("grammar: {e}"));
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| bad(&e));
        // Asked of the parser, not read from the mask's end bit: that bit is also set where the
        // end token's own bytes are allowed, and a config's end token may be a plain text token
        // of the vocabulary (it would let the generation end in the middle of free text).
        let accepts =
            self.matcher.is_stopped() || self.matcher.is_accepting().map_err(|e| bad(&e))?;
        self.stats.compute += t0.elapsed();
        self.stats.masks += 1;
        self.next_mask = Some((mask?, accepts));
        Ok(())
    }

    /// Masks `logits` to the tokens the grammar allows (nothing while pending). Returns false
    /// when the grammar allows no token at all (the generation must end, incomplete).
    pub fn apply(&mut self, logits: &mut [f32]) -> Result<bool> {
        if self.state != GrammarState::Active {
            return Ok(true);
        }
        if self.next_mask.is_none() {
            let t0 = Instant::now();
            self.compute_mask()?;
            self.stats.wait += t0.elapsed();
        }
        let (mask, accepts) = self.next_mask.take().expect("mask computed above");
        let mut any = false;
        for (i, l) in logits.iter_mut().enumerate() {
            let tok = i as u32;
            let allowed = if self.end_tokens.contains(&tok) {
                accepts
            } else {
                tok != self.eos && i < mask.len() && mask.is_allowed(tok)
            };
            if allowed {
                any |= *l > f32::NEG_INFINITY;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        if !any {
            self.state = GrammarState::Incomplete;
        }
        Ok(any)
    }

    /// Advances over the sampled token. Returns true when the generation must end here: the
    /// token ended it where the grammar accepted, or the grammar allows nothing more.
    pub fn advance(&mut self, tok: u32) -> Result<bool> {
        match self.state {
            GrammarState::Pending => {
                self.tail.push(tok);
                if self.tail.len() > self.trigger.len() {
                    self.tail.remove(0);
                }
                if self.tail == self.trigger {
                    self.state = GrammarState::Active;
                }
                Ok(false)
            }
            GrammarState::Active => {
                if self.end_tokens.contains(&tok) {
                    // Only sampled where the mask allowed it: the grammar accepted.
                    self.state = GrammarState::Satisfied;
                    return Ok(true);
                }
                let t0 = Instant::now();
                let consumed = self.matcher.consume_token(tok);
                self.stats.consume += t0.elapsed();
                consumed.map_err(|e| Error::Input(format!("grammar: {e}")))?;
                if self.matcher.is_stopped() {
                    self.state = GrammarState::Satisfied;
                    return Ok(true);
                }
                Ok(false)
            }
            GrammarState::Satisfied | GrammarState::Incomplete => Ok(true),
        }
    }

    /// The generation ended for another reason (budget, context, a stop token while pending):
    /// a grammar not completed by then is incomplete.
    pub fn finish(&mut self) {
        if matches!(self.state, GrammarState::Pending | GrammarState::Active) {
            self.state = GrammarState::Incomplete;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A vocabulary of single bytes, some multi-byte words and two special end tokens.
    fn env() -> GrammarEnv {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for w in ["ab", "abc", "{\"", "\":", "true", "false", "null", "xyz"] {
            words.push(w.as_bytes().to_vec());
        }
        words.push(b"\xFF<|end|>".to_vec());
        words.push(b"\xFF<|user|>".to_vec());
        let eos = (words.len() - 2) as u32;
        GrammarEnv::from_token_bytes(&words, eos).unwrap()
    }

    fn ends(env: &GrammarEnv) -> Vec<u32> {
        let n = env.vocab_size() as u32;
        vec![n - 2, n - 1]
    }

    #[test]
    fn an_unsupported_keyword_is_named() {
        let env = env();
        let err = env
            .compile(
                GrammarKind::JsonSchema,
                r#"{"type":"object","unevaluatedProperties":false,"frobnicate":1}"#,
            )
            .err()
            .expect("refused");
        let msg = err.to_string();
        assert!(msg.contains("unevaluatedProperties"), "{msg}");
    }

    #[test]
    fn the_mask_allows_exactly_the_grammar() {
        let env = env();
        let m = env.compile(GrammarKind::Regex, "a(b|c)").unwrap();
        let mut c = Constraint::new(&env, m, Vec::new(), ends(&env)).unwrap();
        let mut logits = vec![0.0f32; env.vocab_size()];
        assert!(c.apply(&mut logits).unwrap());
        let allowed: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] == 0.0).collect();
        // "a", "ab" (a complete match); never "abc" (too long) nor an end token.
        assert_eq!(allowed, vec![b'a' as usize, 256]);
        assert!(!c.advance(b'a' as u32).unwrap());
        let mut logits = vec![0.0f32; env.vocab_size()];
        c.apply(&mut logits).unwrap();
        let allowed: Vec<usize> = (0..logits.len()).filter(|&i| logits[i] == 0.0).collect();
        assert_eq!(allowed, vec![b'b' as usize, b'c' as usize]);
        // The grammar is complete after "c": nothing more, the generation ends.
        assert!(c.advance(b'c' as u32).unwrap());
        assert_eq!(c.state(), GrammarState::Satisfied);
    }

    #[test]
    fn end_tokens_only_where_the_grammar_accepts_and_the_trigger_waits() {
        let env = env();
        let m = env.compile(GrammarKind::Regex, "x+").unwrap();
        let trigger = vec![b'!' as u32, b'?' as u32];
        let mut c = Constraint::new(&env, m, trigger, ends(&env)).unwrap();
        // Pending: no mask at all.
        let mut logits = vec![0.0f32; env.vocab_size()];
        c.apply(&mut logits).unwrap();
        assert!(logits.iter().all(|&l| l == 0.0));
        for t in [b'?', b'!', b'!', b'?'] {
            assert!(!c.advance(t as u32).unwrap());
        }
        assert_eq!(c.state(), GrammarState::Active);
        let mut logits = vec![0.0f32; env.vocab_size()];
        c.apply(&mut logits).unwrap();
        assert!(ends(&env)
            .iter()
            .all(|&e| logits[e as usize] == f32::NEG_INFINITY));
        c.advance(b'x' as u32).unwrap();
        let mut logits = vec![0.0f32; env.vocab_size()];
        c.apply(&mut logits).unwrap();
        assert!(ends(&env).iter().all(|&e| logits[e as usize] == 0.0));
        assert!(c.advance(ends(&env)[1]).unwrap());
        assert_eq!(c.state(), GrammarState::Satisfied);
    }

    /// A model whose config names a plain text token as its end (a Kimi-tokenizer test
    /// checkpoint's `eos_token_id` 2 is a byte): the end tokens are still allowed only where
    /// the grammar accepts, not wherever free text would allow that byte.
    #[test]
    fn a_text_token_as_the_end_does_not_end_free_text() {
        let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        words.push(b"\xFF[EOS]".to_vec());
        let env = GrammarEnv::from_token_bytes(&words, b'#' as u32).unwrap();
        let ends = vec![b'#' as u32, 256];
        let m = env.compile(GrammarKind::Regex, "a[^z]*z+").unwrap();
        let mut c = Constraint::new(&env, m, Vec::new(), ends.clone()).unwrap();
        for tok in [b'a', b'b', b'z'] {
            let mut logits = vec![0.0f32; env.vocab_size()];
            assert!(c.apply(&mut logits).unwrap());
            let open = ends.iter().map(|&e| logits[e as usize] == 0.0);
            assert!(open.clone().all(|o| !o), "before {:?}", tok as char);
            assert!(!c.advance(tok as u32).unwrap());
        }
        let mut logits = vec![0.0f32; env.vocab_size()];
        c.apply(&mut logits).unwrap();
        assert!(ends.iter().all(|&e| logits[e as usize] == 0.0));
        assert!(c.advance(256).unwrap());
        assert_eq!(c.state(), GrammarState::Satisfied);
    }

    /// The think block chat/grammar.py writes for a family whose markers are text: free bytes
    /// (a '<' included) until the first close marker, then only the grammar's body.
    #[test]
    fn a_lazy_think_block_ends_at_its_text_marker() {
        let env = env();
        let lark = concat!(
            "start: think \"\\n\"? body\n",
            "body: %json {\"type\": \"integer\", \"x-guidance\": {\"whitespace_flexible\": false}}\n",
            "think[suffix=\"</think>\"]: /(?s:.*)/\n",
        );
        let m = env.compile(GrammarKind::Lark, lark).unwrap();
        let mut c = Constraint::new(&env, m, Vec::new(), ends(&env)).unwrap();
        let allowed = |c: &mut Constraint, b: u8| {
            let mut logits = vec![0.0f32; env.vocab_size()];
            c.apply(&mut logits).unwrap();
            logits[b as usize] == 0.0
        };
        for &b in b"a{<b </thin" {
            assert!(allowed(&mut c, b), "{}", b as char);
            assert!(allowed(&mut c, b'z'));
            assert!(!c.advance(b as u32).unwrap());
        }
        for &b in b"k>" {
            assert!(allowed(&mut c, b));
            c.advance(b as u32).unwrap();
        }
        assert!(allowed(&mut c, b'7'));
        assert!(!allowed(&mut c, b'z'));
        assert!(!allowed(&mut c, b'{'));
        c.advance(b'7' as u32).unwrap();
        let mut logits = vec![0.0f32; env.vocab_size()];
        c.apply(&mut logits).unwrap();
        assert_eq!(
            logits[ends(&env)[0] as usize],
            0.0,
            "the end where the integer may end"
        );
    }

    #[test]
    fn an_open_grammar_at_the_end_is_incomplete() {
        let env = env();
        let m = env
            .compile(GrammarKind::JsonSchema, r#"{"type":"object"}"#)
            .unwrap();
        let mut c = Constraint::new(&env, m, Vec::new(), ends(&env)).unwrap();
        let mut logits = vec![0.0f32; env.vocab_size()];
        c.apply(&mut logits).unwrap();
        assert_eq!(logits[b'{' as usize], 0.0);
        assert_eq!(logits[b'[' as usize], f32::NEG_INFINITY);
        c.advance(b'{' as u32).unwrap();
        c.finish();
        assert_eq!(c.state(), GrammarState::Incomplete);
    }
}
