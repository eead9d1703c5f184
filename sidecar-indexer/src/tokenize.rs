//! Prompt → token ids, exactly as the engine computes them, and incrementally for chat.
//!
//! Why incremental is exact: a Hugging Face tokenizer first cuts the text at its *added tokens*
//! (`<｜User｜>`, `<｜Assistant｜>`, BOS …), then normalizes, pre-tokenizes and encodes each piece
//! between them on its own; an added token becomes its id. A chat template writes such a token
//! between every two messages, so the rendered history of turn N+1 is the pieces of turn N plus new
//! ones. Cutting the text the same way the library does ([`SegmentSplitter`], two passes like
//! `AddedVocabulary`: non-normalized tokens on the raw text, then normalized ones in the remaining
//! pieces) and caching piece → ids in a byte-bounded LRU makes a new turn cost its new text only,
//! with ids identical to a full encode (tested over many generated conversations).
//!
//! Token-id prompts pass through untouched. The tokenizer and template are `kvmesh_tokens`' (the
//! simulator uses the same), so router and engine agree on every block.
//!
//! **Tokenize only what can match** ([`PromptTokenizer::tokens_until`]). A prompt's overlap with any
//! cache ends at the first block no worker holds, so past that block its ids are never compared with
//! anything: tokenization goes piece by piece in prompt order, hashes each full block as it appears,
//! asks a predicate how many leading blocks some worker holds, and stops once a block nobody holds
//! has been reached (plus what the caller needs exactly: the disaggregation threshold's tokens past
//! the held prefix). The rest of the prompt's length is estimated from the bytes → tokens ratio of
//! what was tokenized. Long pieces (a document between two added tokens) are cut into chunks of
//! about [`CHUNK_BYTES`] at boundaries where the pre-tokenizer provably gives the same pre-tokens for
//! the two halves as for the whole ([`safe_cut`]); BPE encodes each pre-token on its own, so the ids
//! of the chunks concatenated are the ids of the piece. The cut rule is proved for the DeepSeek-V4
//! pre-tokenizer only: a `tokenizer.json` whose normalizer or pre-tokenizer differs is never cut
//! inside a piece (checked at load).

use std::path::Path;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
use kvmesh_core::hashing::{chain, local_block_hash, LocalBlockHash, SequenceHash};
use kvmesh_core::openai::{Prompt, RequestInput};
use kvmesh_tokens::{ChatTemplate, Tokenizer, TokensError};
use parking_lot::Mutex;

/// Why a prompt could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error(transparent)]
    Tokens(#[from] TokensError),
    #[error("cannot read added tokens from {path}: {reason}")]
    AddedTokens { path: String, reason: String },
}

/// Cuts text at added tokens, the way `tokenizers`' `AddedVocabulary` does.
pub struct SegmentSplitter {
    raw: Option<(AhoCorasick, Vec<u32>)>,
    normalized: Option<(AhoCorasick, Vec<u32>)>,
    /// Whether pieces may be cut into chunks at [`safe_cut`] boundaries (the tokenizer's normalizer
    /// and pre-tokenizer are the ones the rule is proved for).
    chunks: bool,
}

/// A piece of text: an added token (with its id) or plain text between added tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment<'a> {
    Added(u32),
    Text(&'a str),
}

#[derive(serde::Deserialize)]
struct AddedTokenDecl {
    id: u32,
    content: String,
    #[serde(default)]
    normalized: bool,
}

#[derive(serde::Deserialize)]
struct TokenizerFile {
    #[serde(default)]
    added_tokens: Vec<AddedTokenDecl>,
    #[serde(default)]
    normalizer: serde_json::Value,
    #[serde(default)]
    pre_tokenizer: serde_json::Value,
}

/// The DeepSeek-V4 `tokenizer.json` normalizer (none) and pre-tokenizer, for which [`safe_cut`] is
/// proved: digits isolated in runs of 1–3, CJK/kana runs isolated, then the word regex, then bytes.
fn deepseek_pre_tokenizer() -> (serde_json::Value, serde_json::Value) {
    let split = |re: &str| serde_json::json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    let normalizer = serde_json::json!({"type": "Sequence", "normalizers": []});
    let pre = serde_json::json!({"type": "Sequence", "pretokenizers": [
        split(r"\p{N}{1,3}"),
        split("[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+"),
        split(WORD_REGEX),
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
    (normalizer, pre)
}

/// The DeepSeek-V4 pre-tokenizer's word regex (third split), as written in its `tokenizer.json`.
const WORD_REGEX: &str = concat!(
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"##,
    r"|[^",
    "\r\n",
    r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+",
    r"| ?[\p{P}\p{S}]+[",
    "\r\n",
    "]*",
    r"|\s*[",
    "\r\n",
    "]+",
    r"|\s+(?!\S)|\s+",
);

/// Whether a `tokenizer.json`'s normalizer and pre-tokenizer are the ones [`safe_cut`] is proved for.
fn cut_rule_applies(file: &TokenizerFile) -> bool {
    let (normalizer, pre) = deepseek_pre_tokenizer();
    file.normalizer == normalizer && file.pre_tokenizer == pre
}

impl SegmentSplitter {
    /// Reads the `added_tokens` of a `tokenizer.json`.
    ///
    /// Only valid for tokenizers whose added tokens have no `lstrip`/`rstrip`/`single_word` and whose
    /// normalizer is the identity (DeepSeek's); [`PromptTokenizer::load`] checks the result on a probe
    /// text and falls back to whole-text encoding otherwise.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizeError> {
        let err = |reason: String| TokenizeError::AddedTokens {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let file: TokenizerFile = serde_json::from_slice(&text).map_err(|e| err(e.to_string()))?;
        let chunks = cut_rule_applies(&file);
        if !chunks {
            tracing::info!("tokenizer's pre-tokenizer is not DeepSeek-V4's: pieces between added tokens are encoded whole");
        }
        let (norm, raw): (Vec<_>, Vec<_>) =
            file.added_tokens.into_iter().partition(|t| t.normalized);
        Ok(Self {
            raw: automaton(raw).map_err(err)?,
            normalized: automaton(norm).map_err(err)?,
            chunks,
        })
    }

    /// A splitter that never splits (whole-text encoding).
    pub fn none() -> Self {
        Self {
            raw: None,
            normalized: None,
            chunks: false,
        }
    }

    /// Whether long pieces are cut into chunks at [`safe_cut`] boundaries.
    pub fn chunks(&self) -> bool {
        self.chunks
    }

    /// The segments of `text`, in order; concatenated they are `text`.
    pub fn split<'a>(&self, text: &'a str, out: &mut Vec<Segment<'a>>) {
        out.clear();
        let mut first = Vec::new();
        split_with(self.raw.as_ref(), text, &mut first);
        for seg in first {
            match seg {
                Segment::Text(t) => split_with(self.normalized.as_ref(), t, out),
                added => out.push(added),
            }
        }
    }
}

fn automaton(tokens: Vec<AddedTokenDecl>) -> Result<Option<(AhoCorasick, Vec<u32>)>, String> {
    if tokens.is_empty() {
        return Ok(None);
    }
    let ids = tokens.iter().map(|t| t.id).collect();
    let ac = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(tokens.iter().map(|t| t.content.as_str()))
        .map_err(|e| e.to_string())?;
    Ok(Some((ac, ids)))
}

fn split_with<'a>(ac: Option<&(AhoCorasick, Vec<u32>)>, text: &'a str, out: &mut Vec<Segment<'a>>) {
    let Some((ac, ids)) = ac else {
        if !text.is_empty() {
            out.push(Segment::Text(text));
        }
        return;
    };
    let mut at = 0;
    for m in ac.find_iter(text) {
        if m.start() > at {
            out.push(Segment::Text(&text[at..m.start()]));
        }
        out.push(Segment::Added(ids[m.pattern().as_usize()]));
        at = m.end();
    }
    if at < text.len() {
        out.push(Segment::Text(&text[at..]));
    }
}

/// Bytes after which a long piece is cut into a chunk, at the first [`safe_cut`] boundary. About
/// 500 tokens of prose: the granularity at which tokenization stops past the held blocks.
pub const CHUNK_BYTES: usize = 2048;

/// Text tokenized at least before the rest of a prompt may be estimated (unless it is all of it):
/// the sample the bytes → tokens ratio is measured on.
pub const MIN_SAMPLE_BYTES: usize = 2048;

fn is_cjk(c: char) -> bool {
    matches!(c, '\u{4e00}'..='\u{9fa5}' | '\u{3040}'..='\u{309f}' | '\u{30a0}'..='\u{30ff}')
}

/// Whether text with `before` as the last char of a prefix and `after` as the first of the rest may
/// be encoded as two halves: the DeepSeek-V4 pre-tokenizer then gives exactly the pre-tokens of the
/// whole, so (BPE encoding each pre-token on its own) the ids too. Three boundaries qualify:
///
/// 1. `\n` then a char that is alphanumeric or ASCII-graphic (never whitespace).
/// 2. an ASCII letter then a space.
/// 3. a CJK/kana char (the second split's ranges) then one outside them.
///
/// Why, split by split (each is a left-to-right scan with no look-behind and no anchors, so a scan
/// restarts identically at a position no match spans, and the pieces before it are the same when
/// no match attempt that starts before it reads differently at it):
/// - `\p{N}{1,3}`: `before` is never a digit (`\n`, a letter, CJK), so no match spans the cut; a
///   non-matched stretch spanning it becomes two stretches, which the next splits see separately —
///   fine when they, too, split there.
/// - CJK runs `[…]+`: in 1 and 2 `before` is not CJK; in 3 the run ends at the cut (greedy, `after`
///   is outside), so the scan restarts there.
/// - the word regex `A1|A2|A3|A4|A5|A6` (`[punct][A-Za-z]+`, `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`,
///   ` ?[\p{P}\p{S}]+[\r\n]*`, `\s*[\r\n]+`, `\s+(?!\S)`, `\s+`). Rule 1: only A3–A6 can take a
///   `\n`, and each stops before a non-whitespace `after` — exactly as at the end of the prefix, except
///   A5's look-ahead; but A5 is tried at a start `s` only when A4 failed there, i.e. the whitespace
///   from `s` holds no newline, so it never reaches the `\n` and never looks at the cut. A4 matches
///   any `\n` a scan reaches, so the match holding `before` ends exactly at the cut. Rule 2: only A1
///   and A2 take letters; both are greedy over letters and stop at the space, with or without the
///   rest; so the match holding `before` ends at the cut. Rule 3: CJK pieces are already isolated.
/// - ByteLevel (no regex) maps bytes; the normalizer is the identity.
///
/// `tokenize_tests` checks the chunked encoding against a full encode on generated and real text.
pub fn safe_cut(before: char, after: char) -> bool {
    (before == '\n' && (after.is_alphanumeric() || after.is_ascii_graphic()))
        || (before.is_ascii_alphabetic() && after == ' ')
        || (is_cjk(before) && !is_cjk(after))
}

/// The end of the chunk of `text` starting at `start`: the first [`safe_cut`] boundary at or past
/// `start + CHUNK_BYTES`, else the end of `text`.
pub fn chunk_end(text: &str, start: usize) -> usize {
    let mut at = start + CHUNK_BYTES;
    if at >= text.len() {
        return text.len();
    }
    while !text.is_char_boundary(at) {
        at += 1;
    }
    let Some(mut before) = text[..at].chars().next_back() else {
        return text.len();
    };
    for (i, after) in text[at..].char_indices() {
        if safe_cut(before, after) {
            return at + i;
        }
        before = after;
    }
    text.len()
}

/// A byte-bounded LRU of text segment → token ids.
struct SegmentCache {
    lru: lru::LruCache<Box<str>, Arc<[u32]>>,
    bytes: usize,
    max_bytes: usize,
}

/// Bookkeeping bytes charged per cache entry on top of its text and ids.
const ENTRY_OVERHEAD: usize = 64;

impl SegmentCache {
    fn cost(text: &str, ids: &[u32]) -> usize {
        text.len() + ids.len() * 4 + ENTRY_OVERHEAD
    }

    fn get(&mut self, text: &str) -> Option<Arc<[u32]>> {
        self.lru.get(text).cloned()
    }

    fn put(&mut self, text: &str, ids: Arc<[u32]>) {
        let cost = Self::cost(text, &ids);
        if cost > self.max_bytes / 4 {
            return; // one huge segment would flush everything else
        }
        if let Some(old) = self.lru.put(text.into(), ids) {
            self.bytes -= Self::cost(text, &old);
        }
        self.bytes += cost;
        while self.bytes > self.max_bytes {
            match self.lru.pop_lru() {
                Some((k, v)) => self.bytes -= Self::cost(&k, &v),
                None => break,
            }
        }
    }
}

/// Cache effect of one tokenization, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
}

/// Leading blocks of a chain some worker holds.
pub type HeldPrefix<'a> = dyn FnMut(&[SequenceHash]) -> usize + 'a;

/// How far [`PromptTokenizer::tokens_until`] must tokenize.
pub struct Reach<'a> {
    /// The engine's block size (0: no blocks, tokenize everything).
    pub block_size: usize,
    /// The block-hash seed (LoRA, cache salt).
    pub seed: u64,
    /// Exact tokens needed past the held prefix: the disaggregation threshold
    /// (`min_remote_prefill_tokens`), so "uncached ≥ T" is decided on exact tokens.
    pub exact_past_held: usize,
    /// Leading blocks of a chain some worker holds (index or speculative); `None`: tokenize all.
    held: Option<&'a mut HeldPrefix<'a>>,
}

impl<'a> Reach<'a> {
    /// Stop past the held prefix that `held` reports, once `exact_past_held` more tokens are exact.
    pub fn new(
        block_size: usize,
        seed: u64,
        exact_past_held: usize,
        held: &'a mut dyn FnMut(&[SequenceHash]) -> usize,
    ) -> Self {
        Self {
            block_size,
            seed,
            exact_past_held,
            held: Some(held),
        }
    }

    /// Everything, exactly (with block hashes of `block_size`).
    pub fn whole_blocks(block_size: usize, seed: u64) -> Self {
        Self {
            block_size,
            seed,
            exact_past_held: 0,
            held: None,
        }
    }

    fn whole() -> Self {
        Self::whole_blocks(0, 0)
    }
}

/// A prompt tokenized as far as a cache can match it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTokens {
    /// The prompt's first `ids.len()` token ids, exactly as a full encode gives them.
    pub ids: Vec<u32>,
    /// Chain hashes of the full blocks of `ids`.
    pub chains: Vec<SequenceHash>,
    /// Local hashes of the same blocks.
    pub locals: Vec<LocalBlockHash>,
    /// Estimated tokens after `ids` (bytes left × the tokens per byte of the tokenized text, plus
    /// the added tokens left); 0 exactly when `ids` is the whole prompt.
    pub estimated_rest: usize,
}

impl PromptTokens {
    /// The prompt's length: exact when [`Self::complete`], else estimated.
    pub fn tokens(&self) -> usize {
        self.ids.len() + self.estimated_rest
    }

    /// Whether `ids` is the whole prompt.
    pub fn complete(&self) -> bool {
        self.estimated_rest == 0
    }
}

/// Tokenization in progress: ids so far, their blocks, and the ratio sample.
struct Partial {
    ids: Vec<u32>,
    block_size: usize,
    seed: u64,
    chains: Vec<SequenceHash>,
    locals: Vec<LocalBlockHash>,
    /// Text bytes tokenized and the ids they gave (added tokens apart).
    sample_bytes: usize,
    sample_tokens: usize,
    /// Blocks the held predicate has seen.
    checked: usize,
    /// Once a block no worker holds was reached: how many leading blocks some worker holds.
    held: Option<usize>,
    /// Text bytes tokenized since (and including the chunk where) an unheld block was reached.
    cold_bytes: usize,
    estimated_rest: usize,
}

impl Partial {
    fn new(block_size: usize, seed: u64) -> Self {
        Self {
            ids: Vec::new(),
            block_size,
            seed,
            chains: Vec::new(),
            locals: Vec::new(),
            sample_bytes: 0,
            sample_tokens: 0,
            checked: 0,
            held: None,
            cold_bytes: 0,
            estimated_rest: 0,
        }
    }

    fn hash_new_blocks(&mut self) {
        if self.block_size == 0 {
            return;
        }
        while (self.locals.len() + 1) * self.block_size <= self.ids.len() {
            let at = self.locals.len() * self.block_size;
            let local = local_block_hash(&self.ids[at..at + self.block_size], self.seed);
            self.chains.push(chain(self.chains.last().copied(), local));
            self.locals.push(local);
        }
    }

    /// Whether the ids so far cover every block a worker may hold, the exact tokens asked past it,
    /// and the ratio sample, and the `rest_bytes` left are more than the text tokenized past the
    /// held prefix (so a prompt is estimated only when that saves more than half of its cold
    /// work; shorter tails are tokenized, exactly). `chunk_bytes`: the piece just tokenized.
    fn reached_enough(
        &mut self,
        reach: &mut Reach<'_>,
        chunk_bytes: usize,
        rest_bytes: usize,
    ) -> bool {
        self.hash_new_blocks();
        let Some(held) = reach.held.as_mut() else {
            return false;
        };
        if self.held.is_none() && self.chains.len() > self.checked {
            let h = held(&self.chains);
            self.checked = self.chains.len();
            if h < self.chains.len() {
                self.held = Some(h);
            }
        }
        if self.held.is_none() {
            return false;
        }
        self.cold_bytes += chunk_bytes;
        self.held.is_some_and(|h| {
            self.ids.len() >= h * self.block_size + reach.exact_past_held
                && self.sample_bytes >= MIN_SAMPLE_BYTES
                && rest_bytes > self.cold_bytes
        })
    }

    fn estimate_rest(&mut self, rest_of_piece: &str, later: &[Segment<'_>]) {
        let (mut bytes, mut added) = (rest_of_piece.len(), 0usize);
        for seg in later {
            match seg {
                Segment::Added(_) => added += 1,
                Segment::Text(t) => bytes += t.len(),
            }
        }
        let per_byte = self.sample_tokens as f64 / self.sample_bytes.max(1) as f64;
        let text = if bytes == 0 {
            0
        } else {
            ((bytes as f64 * per_byte).round() as usize).max(1)
        };
        self.estimated_rest = text + added;
    }

    fn finish(mut self) -> PromptTokens {
        self.hash_new_blocks();
        PromptTokens {
            ids: self.ids,
            chains: self.chains,
            locals: self.locals,
            estimated_rest: self.estimated_rest,
        }
    }
}

/// The model's tokenizer and chat template with the incremental segment cache.
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    splitter: SegmentSplitter,
    cache: Mutex<SegmentCache>,
}

impl PromptTokenizer {
    /// Loads `tokenizer_json` and the chat template (`None` = built-in DeepSeek). The cache holds at
    /// most `cache_bytes` of segment text and ids.
    pub fn load(
        tokenizer_json: &Path,
        chat_template: Option<&Path>,
        bos_token: &str,
        cache_bytes: usize,
    ) -> Result<Self, TokenizeError> {
        let tokenizer = Tokenizer::from_file(tokenizer_json)?;
        let template = match chat_template {
            Some(p) => ChatTemplate::from_file(p, bos_token)?,
            None => ChatTemplate::deepseek()?,
        };
        let splitter = SegmentSplitter::from_tokenizer_json(tokenizer_json)?;
        let mut this = Self::from_parts(tokenizer, template, splitter, cache_bytes);
        // Self-check on a probe with every kind of boundary; a tokenizer whose added tokens strip
        // whitespace or whose normalizer rewrites text would disagree here: then never split.
        let probe = format!(
            "{bos_token}sys <｜User｜> hi 12345 你好\n\n<｜Assistant｜>ok<｜end▁of▁sentence｜> x"
        );
        let segmented = this.encode_text(&probe, &mut CacheStats::default())?;
        if segmented != this.tokenizer.encode(&probe)? {
            tracing::warn!("segment-wise tokenization disagrees with full encoding for this tokenizer; caching disabled");
            this.splitter = SegmentSplitter::none();
            this.cache.lock().max_bytes = 0;
        }
        Ok(this)
    }

    /// Builds from loaded parts (tests and benches).
    pub fn from_parts(
        tokenizer: Tokenizer,
        template: ChatTemplate,
        splitter: SegmentSplitter,
        cache_bytes: usize,
    ) -> Self {
        let cache = SegmentCache {
            lru: lru::LruCache::unbounded(),
            bytes: 0,
            max_bytes: cache_bytes,
        };
        Self {
            tokenizer,
            template,
            splitter,
            cache: Mutex::new(cache),
        }
    }

    /// The plain tokenizer (no segment cache), for comparisons.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The prompt's token ids as the engine sees them. Chat renders with the generation prompt.
    pub fn tokens(
        &self,
        input: &RequestInput,
        stats: &mut CacheStats,
    ) -> Result<Vec<u32>, TokenizeError> {
        match input {
            RequestInput::Prompt(Prompt::Tokens(ids)) => Ok(ids.clone()),
            RequestInput::Prompt(Prompt::Text(text)) => self.encode_text(text, stats),
            RequestInput::Messages(messages) => {
                let text = self.template.render(messages, true)?;
                self.encode_text(&text, stats)
            }
        }
    }

    /// Token ids of `text`, segment by segment (long ones chunk by chunk) through the cache.
    pub fn encode_text(
        &self,
        text: &str,
        stats: &mut CacheStats,
    ) -> Result<Vec<u32>, TokenizeError> {
        let mut out = Partial::new(0, 0);
        self.encode_until(text, &mut Reach::whole(), &mut out, stats)?;
        Ok(out.ids)
    }

    /// The prompt's token ids as far as a cache can match them, and an estimate of the rest
    /// (module docs). Token-id prompts are exact and whole.
    pub fn tokens_until(
        &self,
        input: &RequestInput,
        reach: &mut Reach<'_>,
        stats: &mut CacheStats,
    ) -> Result<PromptTokens, TokenizeError> {
        let mut out = Partial::new(reach.block_size, reach.seed);
        match input {
            RequestInput::Prompt(Prompt::Tokens(ids)) => {
                out.ids.clone_from(ids);
                out.hash_new_blocks();
            }
            RequestInput::Prompt(Prompt::Text(text)) => {
                self.encode_until(text, reach, &mut out, stats)?
            }
            RequestInput::Messages(messages) => {
                let text = self.template.render(messages, true)?;
                self.encode_until(&text, reach, &mut out, stats)?;
            }
        }
        Ok(out.finish())
    }

    fn encode_until(
        &self,
        text: &str,
        reach: &mut Reach<'_>,
        out: &mut Partial,
        stats: &mut CacheStats,
    ) -> Result<(), TokenizeError> {
        let mut segments = Vec::new();
        self.splitter.split(text, &mut segments);
        out.ids.reserve(text.len().min(64 * 1024) / 3);
        // Text bytes after each segment, for the stop rule.
        let mut later_bytes = vec![0usize; segments.len()];
        for i in (0..segments.len().saturating_sub(1)).rev() {
            later_bytes[i] = later_bytes[i + 1]
                + if let Segment::Text(t) = segments[i + 1] {
                    t.len()
                } else {
                    0
                };
        }
        for (i, seg) in segments.iter().enumerate() {
            let t = match *seg {
                Segment::Added(id) => {
                    out.ids.push(id);
                    continue;
                }
                Segment::Text(t) => t,
            };
            let mut start = 0;
            while start < t.len() {
                let end = if self.splitter.chunks {
                    chunk_end(t, start)
                } else {
                    t.len()
                };
                let chunk = &t[start..end];
                let before = out.ids.len();
                self.encode_piece(chunk, &mut out.ids, stats)?;
                out.sample_bytes += chunk.len();
                out.sample_tokens += out.ids.len() - before;
                start = end;
                if out.reached_enough(reach, chunk.len(), t.len() - start + later_bytes[i]) {
                    out.estimate_rest(&t[start..], &segments[i + 1..]);
                    return Ok(());
                }
            }
        }
        Ok(())
    }

    /// Appends the ids of one piece (no added token inside), through the cache.
    fn encode_piece(
        &self,
        piece: &str,
        ids: &mut Vec<u32>,
        stats: &mut CacheStats,
    ) -> Result<(), TokenizeError> {
        let cached = self.cache.lock().get(piece);
        match cached {
            Some(hit) => {
                stats.hits += 1;
                ids.extend_from_slice(&hit);
            }
            None => {
                stats.misses += 1;
                let fresh = self.tokenizer.encode(piece)?;
                ids.extend_from_slice(&fresh);
                let mut cache = self.cache.lock();
                if cache.max_bytes > 0 {
                    cache.put(piece, fresh.into());
                }
            }
        }
        Ok(())
    }

    /// Bytes currently held by the segment cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.lock().bytes
    }
}

#[cfg(test)]
#[path = "tokenize_tests.rs"]
mod tests;
