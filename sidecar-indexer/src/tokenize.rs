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

use std::path::Path;
use std::sync::Arc;

use aho_corasick::{AhoCorasick, MatchKind};
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
}

impl SegmentSplitter {
    /// Reads the `added_tokens` of a `tokenizer.json`.
    ///
    /// Only valid for tokenizers whose added tokens have no `lstrip`/`rstrip`/`single_word` and whose
    /// normalizer is the identity (DeepSeek's); [`PromptTokenizer::load`] checks the result on a probe
    /// text and falls back to whole-text encoding otherwise.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizeError> {
        let err = |reason: String| TokenizeError::AddedTokens { path: path.display().to_string(), reason };
        let text = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let file: TokenizerFile = serde_json::from_slice(&text).map_err(|e| err(e.to_string()))?;
        let (norm, raw): (Vec<_>, Vec<_>) = file.added_tokens.into_iter().partition(|t| t.normalized);
        Ok(Self { raw: automaton(raw).map_err(err)?, normalized: automaton(norm).map_err(err)? })
    }

    /// A splitter that never splits (whole-text encoding).
    pub fn none() -> Self {
        Self { raw: None, normalized: None }
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
        let probe = format!("{bos_token}sys <｜User｜> hi 12345 你好\n\n<｜Assistant｜>ok<｜end▁of▁sentence｜> x");
        let segmented = this.encode_text(&probe, &mut CacheStats::default())?;
        if segmented != this.tokenizer.encode(&probe)? {
            tracing::warn!("segment-wise tokenization disagrees with full encoding for this tokenizer; caching disabled");
            this.splitter = SegmentSplitter::none();
            this.cache.lock().max_bytes = 0;
        }
        Ok(this)
    }

    /// Builds from loaded parts (tests and benches).
    pub fn from_parts(tokenizer: Tokenizer, template: ChatTemplate, splitter: SegmentSplitter, cache_bytes: usize) -> Self {
        let cache = SegmentCache {
            lru: lru::LruCache::unbounded(),
            bytes: 0,
            max_bytes: cache_bytes,
        };
        Self { tokenizer, template, splitter, cache: Mutex::new(cache) }
    }

    /// The plain tokenizer (no segment cache), for comparisons.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The prompt's token ids as the engine sees them. Chat renders with the generation prompt.
    pub fn tokens(&self, input: &RequestInput, stats: &mut CacheStats) -> Result<Vec<u32>, TokenizeError> {
        match input {
            RequestInput::Prompt(Prompt::Tokens(ids)) => Ok(ids.clone()),
            RequestInput::Prompt(Prompt::Text(text)) => self.encode_text(text, stats),
            RequestInput::Messages(messages) => {
                let text = self.template.render(messages, true)?;
                self.encode_text(&text, stats)
            }
        }
    }

    /// Token ids of `text`, segment by segment through the cache.
    pub fn encode_text(&self, text: &str, stats: &mut CacheStats) -> Result<Vec<u32>, TokenizeError> {
        let mut segments = Vec::new();
        self.splitter.split(text, &mut segments);
        let mut ids = Vec::with_capacity(text.len() / 3);
        for seg in segments {
            match seg {
                Segment::Added(id) => ids.push(id),
                Segment::Text(t) => {
                    let cached = self.cache.lock().get(t);
                    match cached {
                        Some(hit) => {
                            stats.hits += 1;
                            ids.extend_from_slice(&hit);
                        }
                        None => {
                            stats.misses += 1;
                            let fresh = self.tokenizer.encode(t)?;
                            ids.extend_from_slice(&fresh);
                            let mut cache = self.cache.lock();
                            if cache.max_bytes > 0 {
                                cache.put(t, fresh.into());
                            }
                        }
                    }
                }
            }
        }
        Ok(ids)
    }

    /// Bytes currently held by the segment cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.lock().bytes
    }
}

#[cfg(test)]
#[path = "tokenize_tests.rs"]
mod tests;
