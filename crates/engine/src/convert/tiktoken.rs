//! Tokenizers published as tiktoken files, rewritten at conversion as the Hugging Face
//! `tokenizer.json` the gateway loads.
//!
//! Moonshot's Kimi checkpoints (Kimi K2 on the DeepSeek-V3 architecture, Kimi Linear) ship no
//! `tokenizer.json`: their tokenizer is `tiktoken.model` (one `base64(token bytes) rank` line
//! per token), a split pattern in the tokenizer's own Python module (named by
//! `tokenizer_config.json`'s `auto_map`, run by transformers only with `trust_remote_code`),
//! and special tokens numbered from the last rank on (`added_tokens_decoder`). colibri never
//! runs that module: it reads the pattern out of its source (a `pat_str` of raw string
//! literals) and writes the equivalent byte-level BPE, as transformers' own tiktoken converter
//! does: every token's bytes mapped through GPT-2's byte-to-character table, the merges
//! recovered from the ranks (each token of rank r splits into every pair of tokens it can be
//! made of, merged at priority r), `ignore_merges` so that a piece that is itself a token is
//! that token (tiktoken's rule), the pattern as an isolating split before the byte-level step.
//! The tests check the result against tiktoken itself on arbitrary text.

use std::collections::HashMap;
use std::path::Path;

use base64::Engine as _;
use serde_json::{json, Value};

use crate::error::{io_err, Result};

use super::ck;

/// The ranks file's name in a checkpoint.
pub const RANKS_FILE: &str = "tiktoken.model";

/// Token bytes by rank, from a `tiktoken.model` file: one `base64 rank` pair per line (blank
/// lines skipped); the ranks must be exactly `0..n` in some order (special tokens are numbered
/// from `n` on), no token may repeat, and every single byte must be a token (text of any bytes
/// has to encode).
pub fn parse_ranks(data: &[u8]) -> std::result::Result<Vec<Vec<u8>>, String> {
    let text = std::str::from_utf8(data).map_err(|e| format!("not UTF-8 text: {e}"))?;
    let mut pairs: Vec<(usize, Vec<u8>)> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_ascii_whitespace();
        let (Some(b64), Some(rank), None) = (fields.next(), fields.next(), fields.next()) else {
            return Err(format!(
                "line {}: expected `base64-token rank`, got {line:?}",
                i + 1
            ));
        };
        let token = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| format!("line {}: token {b64:?} is not base64: {e}", i + 1))?;
        if token.is_empty() {
            return Err(format!("line {}: an empty token", i + 1));
        }
        let rank: usize = rank
            .parse()
            .map_err(|_| format!("line {}: rank {rank:?} is not a whole number", i + 1))?;
        pairs.push((rank, token));
    }
    let n = pairs.len();
    let mut by_rank: Vec<Option<Vec<u8>>> = vec![None; n];
    let mut seen: HashMap<&[u8], usize> = HashMap::with_capacity(n);
    for (rank, token) in &pairs {
        if let Some(first) = seen.insert(token, *rank) {
            return Err(format!(
                "token {token:?} has two ranks ({first} and {rank})"
            ));
        }
        match by_rank.get_mut(*rank) {
            None => {
                return Err(format!(
                    "rank {rank} is out of range: {n} tokens must have the ranks 0..{n}"
                ))
            }
            Some(Some(_)) => return Err(format!("rank {rank} is given twice")),
            Some(slot) => *slot = Some(token.clone()),
        }
    }
    if let Some(b) = (0..=255u8).find(|b| !seen.contains_key(&[*b][..])) {
        return Err(format!(
            "the single byte 0x{b:02x} is not a token, so text containing it could not be encoded"
        ));
    }
    // Every rank below n was filled exactly once (n distinct ranks, all < n).
    Ok(by_rank
        .into_iter()
        .map(|t| t.expect("each rank filled"))
        .collect())
}

/// The split pattern a tokenizer module's source assigns to `pat_str`: either
/// `"|".join([...])` of string literals (Kimi's form) or string literals alone (adjacent ones
/// concatenated, as Python does). Only raw literals, or plain ones without a backslash, are
/// read: anything else (escapes, f-strings, names) is refused rather than guessed at.
pub fn split_pattern(source: &str) -> std::result::Result<String, String> {
    // The first assignment that reads as a pattern (`pat_str=self.pat_str` in a call is one
    // too, by its look); else why the first one does not.
    let mut first_error = None;
    for at in assignments(source, "pat_str") {
        match pattern_at(source, at) {
            Ok(p) => return Ok(p),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error.unwrap_or_else(|| {
        "no `pat_str = ...` assignment (the split pattern) in the module".into()
    }))
}

/// The pattern assigned at byte `at` (just after `pat_str =`).
fn pattern_at(source: &str, at: usize) -> std::result::Result<String, String> {
    let mut p = Parser { s: source, i: at };
    p.skip_space();
    let pattern = if let Some(sep) = p.join_call() {
        p.skip_space();
        let close = match p.peek() {
            Some('[') => ']',
            Some('(') => ')',
            _ => return Err("`pat_str = \"|\".join(` is not followed by a list".into()),
        };
        p.i += 1;
        let mut parts = Vec::new();
        loop {
            p.skip_space();
            if p.peek() == Some(close) {
                p.i += 1;
                break;
            }
            parts.push(p.literals()?);
            p.skip_space();
            match p.peek() {
                Some(',') => p.i += 1,
                Some(c) if c == close => {}
                _ => return Err(format!("pat_str: unexpected text at {:?}", p.rest(24))),
            }
        }
        p.skip_space();
        if p.peek() != Some(')') {
            return Err("pat_str: the join call is not closed".into());
        }
        parts.join(&sep)
    } else {
        let paren = p.peek() == Some('(');
        if paren {
            p.i += 1;
        }
        let s = p.literals()?;
        if paren {
            p.skip_space();
            if p.peek() != Some(')') {
                return Err("pat_str: the parenthesis is not closed".into());
            }
        }
        s
    };
    if pattern.is_empty() {
        return Err("pat_str is empty".into());
    }
    Ok(pattern)
}

/// Byte offsets just after each `name =` (not `==`), skipping occurrences of `name` inside
/// longer identifiers.
fn assignments(source: &str, name: &str) -> Vec<usize> {
    let mut found = Vec::new();
    let mut from = 0;
    while let Some(k) = source[from..].find(name) {
        let start = from + k;
        let end = start + name.len();
        from = end;
        let before = source[..start].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.') {
            continue;
        }
        let rest = &source[end..];
        let trimmed = rest.trim_start_matches([' ', '\t']);
        // An optional annotation (`pat_str: str = ...`).
        let trimmed = match trimmed.strip_prefix(':') {
            Some(t) => t.trim_start_matches(|c: char| c != '=' && c != '\n'),
            None => trimmed,
        };
        if let Some(after) = trimmed.strip_prefix('=') {
            if !after.starts_with('=') {
                found.push(source.len() - after.len());
            }
        }
    }
    found
}

struct Parser<'a> {
    s: &'a str,
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<char> {
        self.s[self.i..].chars().next()
    }

    fn rest(&self, n: usize) -> String {
        self.s[self.i..].chars().take(n).collect()
    }

    /// Whitespace, line continuations and comments.
    fn skip_space(&mut self) {
        loop {
            let rest = &self.s[self.i..];
            let t = rest.trim_start_matches([' ', '\t', '\r', '\n', '\\']);
            if let Some(c) = t.strip_prefix('#') {
                let line_end = c.find('\n').map_or(c.len(), |k| k + 1);
                self.i = self.s.len() - c.len() + line_end;
                continue;
            }
            self.i = self.s.len() - t.len();
            return;
        }
    }

    /// `"sep".join(` at the cursor: the separator, with the cursor after the parenthesis.
    fn join_call(&mut self) -> Option<String> {
        let save = self.i;
        if let Ok(sep) = self.literal() {
            let t = self.s[self.i..].trim_start();
            if let Some(t) = t.strip_prefix(".join") {
                let t = t.trim_start();
                if let Some(t) = t.strip_prefix('(') {
                    self.i = self.s.len() - t.len();
                    return Some(sep);
                }
            }
        }
        self.i = save;
        None
    }

    /// One or more adjacent string literals, concatenated.
    fn literals(&mut self) -> std::result::Result<String, String> {
        let mut out = self.literal()?;
        loop {
            let save = self.i;
            self.skip_space();
            match self.peek() {
                Some('r' | 'R' | '"' | '\'') => out.push_str(&self.literal()?),
                _ => {
                    self.i = save;
                    return Ok(out);
                }
            }
        }
    }

    /// One string literal: `r`-prefixed (raw) or plain without backslashes, in any quotes.
    fn literal(&mut self) -> std::result::Result<String, String> {
        let rest = &self.s[self.i..];
        let (raw, body) = match rest.strip_prefix(['r', 'R']) {
            Some(b) => (true, b),
            None => (false, rest),
        };
        let quote = ["\"\"\"", "'''", "\"", "'"]
            .into_iter()
            .find(|q| body.starts_with(q))
            .ok_or_else(|| format!("pat_str: expected a string literal at {:?}", self.rest(24)))?;
        let inner = &body[quote.len()..];
        // In a raw literal a backslash still keeps the next character from closing it.
        let mut end = None;
        let mut chars = inner.char_indices();
        while let Some((k, c)) = chars.next() {
            if c == '\\' {
                if !raw {
                    // The literal up to a few characters past the backslash (whole characters:
                    // a byte count could end inside one).
                    let shown: String = inner
                        .char_indices()
                        .take_while(|&(at, _)| at < k + 8)
                        .map(|(_, c)| c)
                        .collect();
                    return Err(format!(
                        "pat_str: a plain string literal with an escape ({shown:?}); only raw \
                         literals (r\"...\") are read"
                    ));
                }
                chars.next();
                continue;
            }
            if inner[k..].starts_with(quote) {
                end = Some(k);
                break;
            }
            if c == '\n' && quote.len() == 1 {
                break;
            }
        }
        let end = end.ok_or("pat_str: a string literal is not closed")?;
        self.i = self.s.len() - inner.len() + end + quote.len();
        Ok(inner[..end].to_string())
    }
}

/// One added (special) token: id, text, whether decoding may skip it.
#[derive(Debug, Clone, PartialEq)]
pub struct Added {
    pub id: usize,
    pub content: String,
    pub special: bool,
}

/// The special tokens after `base` ranks, up to the model's vocabulary: those
/// `tokenizer_config.json`'s `added_tokens_decoder` names, and `<|reserved_token_{id}|>` for
/// the ids between them (as Kimi's tokenizer numbers them). Ids at or past `vocab` have no
/// embedding row, so they are not tokens here (Kimi's module numbers two past its vocabulary).
pub fn added_tokens(
    tokenizer_config: &Value,
    base: usize,
    vocab: usize,
) -> std::result::Result<Vec<Added>, String> {
    let mut named: HashMap<usize, (String, bool)> = HashMap::new();
    if let Some(decoder) = tokenizer_config.get("added_tokens_decoder") {
        let decoder = decoder
            .as_object()
            .ok_or("added_tokens_decoder is not an object")?;
        for (id, tok) in decoder {
            let id: usize = id
                .parse()
                .map_err(|_| format!("added_tokens_decoder: key {id:?} is not a token id"))?;
            let content = tok
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("added_tokens_decoder[{id}]: no string `content`"))?;
            if id < base {
                return Err(format!(
                    "added_tokens_decoder[{id}] ({content:?}) falls among the {base} ranked tokens"
                ));
            }
            let special = tok.get("special").and_then(Value::as_bool).unwrap_or(true);
            named.insert(id, (content.to_string(), special));
        }
    }
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    for id in base..vocab {
        let (content, special) = named
            .remove(&id)
            .unwrap_or_else(|| (format!("<|reserved_token_{id}|>"), true));
        if !seen.insert(content.clone()) {
            return Err(format!("special token {content:?} has two ids"));
        }
        out.push(Added {
            id,
            content,
            special,
        });
    }
    Ok(out)
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the others
/// for the characters from U+0100 on, in byte order.
fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xa1..=0xac | 0xae..=0xff);
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        table[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("U+0100.. are characters");
            next += 1;
            c
        };
    }
    table
}

/// The Hugging Face tokenizer (`tokenizer.json`) equivalent to tiktoken with these ranks
/// (token bytes by rank), split pattern and special tokens, encoding with special tokens
/// allowed (as Kimi's tokenizer does by default).
///
/// A ranked token whose vocabulary string is a special token's text (say a regular `<think>`
/// beside the special one) would take the special token's place: `tokenizers` gives an added
/// token that is already in the vocabulary that entry's id, and numbers the added tokens after
/// it one short. Such a token keeps its id under a name no text maps to (a private-use
/// character and its rank), with the merges that make or use it left out. tiktoken never
/// produces it with special tokens allowed either: the special token's text is taken out of
/// the text before anything else. Only text read literally (special-token strings as plain
/// text, the gateway's reading of what users write) then splits it into smaller tokens where
/// tiktoken would give the ranked one.
pub fn tokenizer_json(ranks: &[Vec<u8>], pattern: &str, added: &[Added]) -> Value {
    let table = byte_chars();
    let chars = |b: &[u8]| -> String { b.iter().map(|&x| table[x as usize]).collect() };
    let rank_of: HashMap<&[u8], usize> = ranks
        .iter()
        .enumerate()
        .map(|(r, t)| (t.as_slice(), r))
        .collect();
    let specials: std::collections::HashSet<&str> =
        added.iter().map(|a| a.content.as_str()).collect();
    let hidden: std::collections::HashSet<usize> = ranks
        .iter()
        .enumerate()
        .filter(|(_, t)| specials.contains(chars(t).as_str()))
        .map(|(r, _)| r)
        .collect();
    let mut vocab = serde_json::Map::with_capacity(ranks.len());
    let mut merges = Vec::new();
    // In rank order, so the merges come out sorted by the rank of what they make.
    for (r, token) in ranks.iter().enumerate() {
        if hidden.contains(&r) {
            vocab.insert(format!("\u{e000}{r}"), json!(r));
            continue;
        }
        vocab.insert(chars(token), json!(r));
        let mut splits: Vec<(usize, usize, usize)> = (1..token.len())
            .filter_map(|k| {
                let (a, b) = token.split_at(k);
                Some((*rank_of.get(a)?, *rank_of.get(b)?, k))
            })
            .filter(|(a, b, _)| !hidden.contains(a) && !hidden.contains(b))
            .collect();
        splits.sort_unstable();
        for (_, _, k) in splits {
            let (a, b) = token.split_at(k);
            merges.push(json!([chars(a), chars(b)]));
        }
    }
    let added: Vec<Value> = added
        .iter()
        .map(|t| {
            json!({
                "id": t.id, "content": t.content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": t.special,
            })
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated",
                 "invert": false},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                 "use_regex": false},
            ],
        },
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true,
                    "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": true, "vocab": vocab, "merges": merges,
        },
    })
}

/// The module file `auto_map.AutoTokenizer` names (`"tokenization_kimi.TikTokenTokenizer"`,
/// possibly prefixed by a repository and `--`), relative to the checkpoint.
fn tokenizer_module(tokenizer_config: &Value) -> Option<String> {
    let entry = tokenizer_config.get("auto_map")?.get("AutoTokenizer")?;
    let class = match entry {
        Value::Array(a) => a.first()?.as_str()?,
        Value::String(s) => s.as_str(),
        _ => return None,
    };
    let class = class.rsplit("--").next()?;
    let (module, _) = class.rsplit_once('.')?;
    // Python identifiers only: the name must not lead out of the checkpoint directory.
    let parts: Vec<&str> = module.split('.').collect();
    let identifier = |p: &&str| {
        !p.is_empty()
            && !p.starts_with(|c: char| c.is_ascii_digit())
            && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    parts
        .iter()
        .all(identifier)
        .then(|| format!("{}.py", parts.join("/")))
}

/// The `tokenizer.json` for a checkpoint that ships `tiktoken.model` instead, or `None` when it
/// has no such file. `vocab` is the model's vocabulary size.
pub fn from_checkpoint(hf_dir: &Path, vocab: usize) -> Result<Option<Value>> {
    let ranks_path = hf_dir.join(RANKS_FILE);
    if !ranks_path.is_file() {
        return Ok(None);
    }
    let bad = |what: &Path, e: String| ck(format!("{}: {e}", what.display()));
    let data = std::fs::read(&ranks_path).map_err(io_err(&ranks_path))?;
    let ranks = parse_ranks(&data).map_err(|e| bad(&ranks_path, e))?;
    let cfg_path = hf_dir.join("tokenizer_config.json");
    if !cfg_path.is_file() {
        return Err(ck(format!(
            "{} not found: a {RANKS_FILE} tokenizer needs it (its special tokens and the \
             module holding its split pattern)",
            cfg_path.display()
        )));
    }
    let text = std::fs::read_to_string(&cfg_path).map_err(io_err(&cfg_path))?;
    let tok_cfg: Value =
        serde_json::from_str(&text).map_err(|e| bad(&cfg_path, format!("invalid JSON: {e}")))?;
    let module = tokenizer_module(&tok_cfg).ok_or_else(|| {
        bad(
            &cfg_path,
            format!(
                "no auto_map.AutoTokenizer naming the tokenizer module, so the split pattern \
                 of {RANKS_FILE} is unknown"
            ),
        )
    })?;
    let module_path = hf_dir.join(&module);
    let source = std::fs::read_to_string(&module_path).map_err(|e| {
        ck(format!(
            "{}: cannot read the tokenizer module that holds {RANKS_FILE}'s split pattern: {e}",
            module_path.display()
        ))
    })?;
    let pattern = split_pattern(&source).map_err(|e| bad(&module_path, e))?;
    if vocab < ranks.len() {
        return Err(ck(format!(
            "{}: {} tokens, more than the model's vocab_size {vocab}",
            ranks_path.display(),
            ranks.len()
        )));
    }
    let added = added_tokens(&tok_cfg, ranks.len(), vocab).map_err(|e| bad(&cfg_path, e))?;
    Ok(Some(tokenizer_json(&ranks, &pattern, &added)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(b: &[u8]) -> String {
        base64::engine::general_purpose::STANDARD.encode(b)
    }

    /// A ranks file: the 256 bytes, then `extra` tokens.
    fn ranks_file(extra: &[&[u8]]) -> String {
        let mut lines: Vec<String> = (0..=255u8).map(|b| format!("{} {b}", b64(&[b]))).collect();
        for (i, t) in extra.iter().enumerate() {
            lines.push(format!("{} {}", b64(t), 256 + i));
        }
        lines.join("\n")
    }

    #[test]
    fn ranks_parse_in_any_line_order() {
        let mut lines: Vec<String> = ranks_file(&[b"ab", b"abc"])
            .lines()
            .map(String::from)
            .collect();
        lines.reverse();
        lines.insert(3, String::new());
        let ranks = parse_ranks(lines.join("\r\n").as_bytes()).unwrap();
        assert_eq!(ranks.len(), 258);
        assert_eq!(ranks[97], b"a");
        assert_eq!(ranks[257], b"abc");
    }

    #[test]
    fn broken_ranks_are_refused_with_the_reason() {
        let good = ranks_file(&[b"ab"]);
        let cases: Vec<(String, &str)> = vec![
            (
                format!("{good}\n{} 257 9", b64(b"cd")),
                "expected `base64-token rank`",
            ),
            (format!("{good}\n@@@ 257"), "is not base64"),
            (format!("{good}\n{} x", b64(b"cd")), "is not a whole number"),
            (
                format!("{good}\n{} 256", b64(b"cd")),
                "rank 256 is given twice",
            ),
            (
                format!("{good}\n{} 999", b64(b"cd")),
                "rank 999 is out of range",
            ),
            (format!("{good}\n{} 257", b64(b"ab")), "has two ranks"),
            (
                good.replacen(&b64(&[0]), &b64(b"zz"), 1),
                "0x00 is not a token",
            ),
            (format!("{good}\n 257"), "expected `base64-token rank`"),
        ];
        for (text, want) in cases {
            let err = parse_ranks(text.as_bytes()).unwrap_err();
            assert!(err.contains(want), "{err:?} should say {want:?}");
        }
        assert!(parse_ranks(b"\xff\xfe").unwrap_err().contains("UTF-8"));
    }

    #[test]
    fn split_pattern_reads_kimis_form_and_plain_literals() {
        let src = r####"
class T:
    num_reserved_special_tokens = 256
    not_pat_str = "x"
    pat_str = "|".join(
        [
            r"""[\p{Han}]+""",
            # a comment between the parts
            r"""\p{N}{1,3}""",  # and after one
            r'''\s+(?!\S)''', r"\s+"
        ]
    )
"####;
        assert_eq!(
            split_pattern(src).unwrap(),
            r"[\p{Han}]+|\p{N}{1,3}|\s+(?!\S)|\s+"
        );
        assert_eq!(split_pattern("pat_str = r'a\\'b' 'c'").unwrap(), r"a\'bc");
        // A keyword argument before the assignment (Kimi's module passes pat_str=self.pat_str).
        assert_eq!(
            split_pattern("enc(pat_str=self.pat_str)\npat_str = r'\\s+'").unwrap(),
            r"\s+"
        );
        assert_eq!(
            split_pattern("pat_str: str = (r\"\\d+\"\n  r\"|x\")").unwrap(),
            r"\d+|x"
        );
        for (src, want) in [
            ("pattern = r'x'", "no `pat_str = ...`"),
            ("if pat_str == r'x': pass", "no `pat_str = ...`"),
            ("pat_str = \"\\\\d\"", "only raw literals"),
            // Found by fuzzing: the message cut the literal at a byte inside a character.
            ("pat_str = \"\\\\d\u{fffd}\u{fffd}\"", "only raw literals"),
            ("pat_str = \"\\\\€€€\"", "€€\")"),
            ("pat_str = PATTERN", "expected a string literal"),
            (
                "pat_str = \"|\".join([r'a', PATTERN])",
                "expected a string literal",
            ),
            ("pat_str = r'abc", "not closed"),
            ("pat_str = \"|\".join([r'a'", "unexpected text"),
            ("pat_str = ''", "empty"),
        ] {
            let err = split_pattern(src).unwrap_err();
            assert!(err.contains(want), "{src}: {err:?} should say {want:?}");
        }
    }

    #[test]
    fn added_tokens_fill_the_vocabulary_after_the_ranks() {
        let cfg = json!({"added_tokens_decoder": {
            "258": {"content": "[BOS]", "special": true},
            "260": {"content": "<|im_end|>", "special": false},
            "400": {"content": "[PAST]", "special": true},
        }});
        let added = added_tokens(&cfg, 258, 262).unwrap();
        let names: Vec<(usize, &str, bool)> = added
            .iter()
            .map(|a| (a.id, a.content.as_str(), a.special))
            .collect();
        assert_eq!(
            names,
            [
                (258, "[BOS]", true),
                (259, "<|reserved_token_259|>", true),
                (260, "<|im_end|>", false),
                (261, "<|reserved_token_261|>", true),
            ]
        );
        let clash = json!({"added_tokens_decoder": {"3": {"content": "x"}}});
        assert!(added_tokens(&clash, 258, 262)
            .unwrap_err()
            .contains("among the 258"));
        let twice = json!({"added_tokens_decoder": {
            "258": {"content": "x"}, "259": {"content": "x"}}});
        assert!(added_tokens(&twice, 258, 262)
            .unwrap_err()
            .contains("two ids"));
    }

    #[test]
    fn merges_are_every_split_of_each_token_in_rank_order() {
        let ranks = parse_ranks(ranks_file(&[b"ab", b"bc", b"abc", b" a"]).as_bytes()).unwrap();
        let tj = tokenizer_json(&ranks, r"\s+", &[]);
        let merges: Vec<(String, String)> = tj["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| (m[0].as_str().unwrap().into(), m[1].as_str().unwrap().into()))
            .collect();
        let m = |a: &str, b: &str| (a.to_string(), b.to_string());
        // "abc" splits as a+bc and ab+c; by the ranks of the parts: a (97) before ab (256).
        assert_eq!(
            merges,
            [
                m("a", "b"),
                m("b", "c"),
                m("a", "bc"),
                m("ab", "c"),
                m("Ġ", "a")
            ]
        );
        assert_eq!(tj["model"]["vocab"]["Ġa"], 259);
        assert_eq!(tj["model"]["vocab"]["Ā"], 0);
        assert_eq!(tj["model"]["ignore_merges"], true);
    }

    #[test]
    fn the_module_is_a_file_inside_the_checkpoint() {
        let m = |v: Value| tokenizer_module(&json!({"auto_map": {"AutoTokenizer": v}}));
        assert_eq!(
            m(json!(["tokenization_kimi.TikTokenTokenizer", null])).as_deref(),
            Some("tokenization_kimi.py")
        );
        assert_eq!(
            m(json!("moonshotai/Kimi-K2--tok.sub.T")).as_deref(),
            Some("tok/sub.py")
        );
        for bad in ["..evil.T", "/abs.T", "a..b.T", "NoModule", "9x.T", "a b.T"] {
            assert_eq!(m(json!([bad])), None, "{bad}");
        }
        assert_eq!(tokenizer_module(&json!({})), None);
    }

    #[test]
    fn a_ranked_token_with_a_special_tokens_text_keeps_its_id_under_another_name() {
        let ranks =
            parse_ranks(ranks_file(&[b"[E", b"[EO", b"[EO]", b"[EO]x"]).as_bytes()).unwrap();
        let added = [Added {
            id: 260,
            content: "[EO]".into(),
            special: true,
        }];
        let tj = tokenizer_json(&ranks, r"\s+", &added);
        let vocab = tj["model"]["vocab"].as_object().unwrap();
        assert_eq!(vocab.len(), 260);
        assert_eq!(vocab["\u{e000}258"], 258);
        assert!(!vocab.contains_key("[EO]"));
        let merges: Vec<String> = tj["model"]["merges"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| format!("{} {}", m[0].as_str().unwrap(), m[1].as_str().unwrap()))
            .collect();
        // [EO] (made from [EO + ]) and [EO]x (from [EO] + x) are not made at all.
        assert_eq!(merges, ["[ E", "[E O"]);
    }

    #[test]
    fn byte_table_is_gpt2s() {
        let t = byte_chars();
        assert_eq!(
            (t[b'!' as usize], t[b' ' as usize], t[b'\n' as usize]),
            ('!', 'Ġ', 'Ċ')
        );
        assert_eq!((t[0], t[0xad], t[0xff]), ('Ā', 'Ń', 'ÿ'));
        let distinct: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }
}
