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
//! the held prefix). The rest of the prompt's length is estimated from its byte classes, weighed
//! as the tokenized text's were ([`estimate`]). Long pieces (a document between two added tokens)
//! are cut into chunks — [`FIRST_CHUNK_BYTES`] first, doubling up to [`CHUNK_BYTES`], so a cold
//! prompt stops after a few blocks — at boundaries where the pre-tokenizer provably gives the same pre-tokens for
//! the two halves as for the whole ([`safe_cut`]); BPE encodes each pre-token on its own, so the ids
//! of the chunks concatenated are the ids of the piece. The cut rule is proved for the DeepSeek-V4
//! pre-tokenizer only: a `tokenizer.json` whose normalizer or pre-tokenizer differs is never cut
//! inside a piece (checked at load).
//!
//! **A warm route costs its new text** ([`memo`]). Most requests continue a prompt this indexer
//! tokenized recently (the previous turn of the conversation, or a sibling on the same prefix).
//! After each tokenization the state at its last added-token boundary — the prefix text, its ids,
//! block hashes and ratio sample — at the boundary before it (a chat prompt ends with its
//! generation prompt's added token; the next request may continue before it), and at the held
//! prefix's edge (the last boundary before the first block no worker holds: what siblings and
//! later turns share) goes into a byte-bounded prefix memo (`routing.tokenize_memo_bytes`); a
//! prompt probes its own boundaries from the end (O(1) each), and
//! the first whose prefix text equals an entry's (compared in full) resumes there: the prefix's
//! ids and chained block hashes are copied, and only the segments after it are looked up,
//! encoded and hashed. The segment cache still serves pieces the memo does not cover.
//!
//! **Media.** A chat prompt with media parts (images …) is tokenized as its text, and its chains
//! stop before the first media item's message ([`media`]: the engine's placeholder tokens and
//! block keys there are not known here), so no block from there on is ever predicted a hit.
//!
//! Submodules: [`split`] (cutting text at added tokens), [`chunk`] (the safe cut inside a piece),
//! [`estimate`] (the untokenized rest's length), [`cache`] (the byte-bounded segment cache),
//! [`memo`] (the prefix memo), [`media`] (where a media prompt's chains stop).
//!
//! Over 600 lines: `PromptTokenizer` and its partial-tokenization state machine (`Partial`,
//! `Reached`, `Reach`) share invariants that read best in one file; the independent parts are the
//! submodules above.

mod cache;
mod chunk;
mod estimate;
mod ids;
mod media;
pub mod memo;
mod split;

use std::path::Path;

use kvmesh_core::hashing::{chain, LocalBlockHash, SequenceHash};
use kvmesh_core::openai::{Prompt, RequestInput};
use kvmesh_tokens::{ChatTemplate, Tokenizer, TokensError};
use parking_lot::Mutex;

pub use cache::CacheStats;
use cache::SegmentCache;
pub use chunk::{
    chunk_end, safe_cut, CHUNK_BYTES, FIRST_CHUNK_BYTES, MIN_ESTIMATED_BYTES, MIN_SAMPLE_BYTES,
};
pub use estimate::Shape;
pub use ids::Ids;
pub use memo::DEFAULT_MEMO_BYTES;
use memo::{MemoEntry, PrefixMemo, Tokenized};
pub use split::{Segment, SegmentSplitter};

/// Why a prompt could not be tokenized.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error(transparent)]
    Tokens(#[from] TokensError),
    #[error("cannot read added tokens from {path}: {reason}")]
    AddedTokens { path: String, reason: String },
    /// The [`Reach::yielding`] hook asked to stop (work that yields to route calls gave up).
    #[error("stopped: the tokenization yielded to other work for too long")]
    GaveWay,
    /// More text past where the prefix memo resumed the prompt than [`Reach::within`] allows:
    /// nothing was encoded (the caller tokenizes it where longer work may run).
    #[error(
        "{fresh} bytes of text past the prefix memo's resume point, over this call's {budget}"
    )]
    OverBudget { fresh: usize, budget: usize },
}

/// Leading blocks of a chain some worker holds.
pub type HeldPrefix<'a> = dyn FnMut(&[SequenceHash]) -> usize + 'a;

/// Called between chunks of a [`Reach::yielding`] tokenization; may wait; `false` stops it
/// ([`TokenizeError::GaveWay`]).
pub type Yield<'a> = dyn FnMut() -> bool + 'a;

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
    /// Between chunks: lets other work go first ([`Self::yielding`]).
    yield_now: Option<&'a mut Yield<'a>>,
    /// Text bytes past the prefix memo's resume point this call may encode ([`Self::within`]).
    max_fresh_bytes: usize,
    /// The index of the first message with media parts ([`Self::media_from`]).
    media_message: Option<usize>,
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
            yield_now: None,
            max_fresh_bytes: usize::MAX,
            media_message: None,
        }
    }

    /// Everything, exactly (with block hashes of `block_size`).
    pub fn whole_blocks(block_size: usize, seed: u64) -> Self {
        Self {
            block_size,
            seed,
            exact_past_held: 0,
            held: None,
            yield_now: None,
            max_fresh_bytes: usize::MAX,
            media_message: None,
        }
    }

    /// Calls `yield_now` before each chunk it encodes (at most [`CHUNK_BYTES`] of text where the
    /// tokenizer's pieces may be cut, else a whole segment between added tokens), so work off the
    /// request path can wait while route calls run; `false` stops the tokenization.
    pub fn yielding(mut self, yield_now: &'a mut Yield<'a>) -> Self {
        self.yield_now = Some(yield_now);
        self
    }

    /// Refuses ([`TokenizeError::OverBudget`], before encoding anything) a prompt with more
    /// than `max_fresh_bytes` of text past where the prefix memo resumes it: work bounded for a
    /// caller that must not run long (an async worker), however long the prompt is.
    pub fn within(mut self, max_fresh_bytes: usize) -> Self {
        self.max_fresh_bytes = max_fresh_bytes;
        self
    }

    /// Stops the chains before message `first` (the first with media parts: `OpenAiRequest::media`)
    /// of a chat prompt, where the engine's tokens and block keys stop being known ([`media`]).
    pub fn media_from(mut self, first: Option<usize>) -> Self {
        self.media_message = first;
        self
    }

    fn whole() -> Self {
        Self::whole_blocks(0, 0)
    }
}

/// A prompt tokenized as far as a cache can match it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptTokens {
    /// The prompt's first `ids.len()` token ids, exactly as a full encode gives them.
    pub ids: Ids,
    /// Chain hashes of the full blocks of `ids`.
    pub chains: Vec<SequenceHash>,
    /// Local hashes of the same blocks.
    pub locals: Vec<LocalBlockHash>,
    /// Estimated tokens after `ids` (the text left's byte classes, weighed as the tokenized text's
    /// were, plus the added tokens left: `estimate.rs`); 0 exactly when `ids` is the whole prompt.
    pub estimated_rest: usize,
    /// Whether `chains` stop before a media item ([`Reach::media_from`]) rather than at the end.
    pub cut_at_media: bool,
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

/// A point of a tokenization just after an added token: where the prefix memo may resume.
#[derive(Debug, Clone, Copy)]
struct Boundary {
    /// Bytes of the text before it.
    at: usize,
    /// Ids and ratio sample at it.
    ids: usize,
    sample_bytes: usize,
    sample_tokens: usize,
}

/// The boundaries one tokenization passed that the memo may keep (each shares its storage).
#[derive(Debug, Default)]
struct Reached {
    /// The last boundary reached, and the one before it.
    last: Option<Boundary>,
    previous: Option<Boundary>,
    /// The last boundary before the first block no worker holds: the end of the prefix some
    /// engine has cached, which other requests share (siblings of a prompt, the next turns after
    /// it) even when this request's own last boundaries are its alone.
    held_edge: Option<Boundary>,
}

impl Reached {
    fn pass(&mut self, b: Boundary) {
        self.previous = self.last.replace(b);
    }

    /// The boundaries worth a memo entry: those past `resumed` (the memo has that one), each once;
    /// none while the text past `resumed` is under [`REKEEP_FRACTION`] of the prefix before it.
    fn worth_keeping(&self, resumed: Option<Boundary>, text_len: usize) -> Vec<Boundary> {
        if resumed
            .is_some_and(|r| text_len.saturating_sub(r.at).saturating_mul(REKEEP_FRACTION) < r.at)
        {
            return Vec::new();
        }
        let mut keep: Vec<Boundary> = Vec::with_capacity(3);
        for b in [self.last, self.previous, self.held_edge].into_iter().flatten() {
            if resumed.is_none_or(|r| b.at > r.at) && keep.iter().all(|k| k.at != b.at) {
                keep.push(b);
            }
        }
        keep
    }
}

/// A resumed prompt keeps new memo entries once its text past the resume point is at least this
/// fraction (1/n) of the prefix before it. An entry copies its whole prefix (text, ids, hashes:
/// ~650 KB at 48k tokens, in freshly faulted pages), so keeping one every turn made each turn of a
/// long conversation cost its whole history; this way the copies cost at most n × the new text per
/// turn, amortized, and a resume encodes at most 1/n of the prefix again (through the segment
/// cache).
const REKEEP_FRACTION: usize = 8;

/// The parts of a long prompt split, in turn, to find where the memo resumes it
/// ([`PromptTokenizer::resume_from_tail`]): its last 1/32, where a conversation's next turns find
/// the entry its last renewal kept while their new text is short, then its last quarter, twice the
/// [`REKEEP_FRACTION`] margin (splitting a 244-KB prompt at its added tokens took ~70 µs).
const TAIL_FRACTIONS: [usize; 2] = [32, 4];

/// Prompts shorter than this are split whole at once (a quarter's saving is a few µs).
const MIN_TAIL_SPLIT_BYTES: usize = 32 * 1024;

/// Tokenization in progress: ids so far, their blocks, and the ratio sample.
struct Partial {
    ids: Ids,
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
    /// Byte of the text from which blocks are never hashed (media: [`media`]).
    cut_byte: Option<usize>,
    /// Tokens before the segment holding `cut_byte`, once it was reached: blocks past it are not
    /// hashed.
    cut: Option<usize>,
}

impl Partial {
    fn new(block_size: usize, seed: u64) -> Self {
        Self {
            ids: Ids::default(),
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
            cut_byte: None,
            cut: None,
        }
    }

    fn boundary(&self, at: usize) -> Boundary {
        Boundary {
            at,
            ids: self.ids.len(),
            sample_bytes: self.sample_bytes,
            sample_tokens: self.sample_tokens,
        }
    }

    /// Continues from a memo entry (`self` is empty): its ids (shared), its block hashes when they
    /// were hashed with this block size and seed (else they are hashed again from the ids), its
    /// sample.
    fn resume(&mut self, e: &MemoEntry) {
        let t = &e.tokenized;
        self.ids = Ids::sharing(t.ids.clone(), e.ids().len());
        if t.block_size == self.block_size && t.seed == self.seed && self.block_size > 0 {
            self.chains.extend_from_slice(e.chains());
            self.locals.extend_from_slice(e.locals());
        }
        self.sample_bytes = e.sample_bytes;
        self.sample_tokens = e.sample_tokens;
    }

    /// Memo entries for the prefixes of `text` up to each of `keep` (sharing one storage, up to
    /// the furthest).
    fn memo_entries(&mut self, text: &str, keep: &[Boundary]) -> Vec<MemoEntry> {
        self.hash_new_blocks();
        let blocks = |b: &Boundary| b.ids.checked_div(self.block_size).unwrap_or(0);
        let Some(last) = keep.iter().copied().max_by_key(|b| b.at) else {
            return Vec::new();
        };
        let n = blocks(&last);
        let (Some(t), Some(ids), Some(chains), Some(locals)) = (
            text.get(..last.at),
            (last.ids <= self.ids.len()).then(|| self.ids.to_shared(last.ids)),
            self.chains.get(..n),
            self.locals.get(..n),
        ) else {
            return Vec::new();
        };
        let tokenized = Tokenized {
            text: t.into(),
            ids,
            block_size: self.block_size,
            seed: self.seed,
            chains: chains.into(),
            locals: locals.into(),
        };
        keep.iter()
            .map(|b| MemoEntry {
                tokenized: tokenized.clone(),
                text_len: b.at,
                ids: b.ids,
                blocks: blocks(b),
                sample_bytes: b.sample_bytes,
                sample_tokens: b.sample_tokens,
            })
            .collect()
    }

    fn hash_new_blocks(&mut self) {
        if self.block_size == 0 {
            return;
        }
        let end = self.cut.map_or(self.ids.len(), |c| c.min(self.ids.len()));
        while (self.locals.len() + 1) * self.block_size <= end {
            let at = self.locals.len() * self.block_size;
            let local =
                crate::index::block_hash(&self.ids.slice(at..at + self.block_size), self.seed);
            self.chains.push(chain(self.chains.last().copied(), local));
            self.locals.push(local);
        }
    }

    /// Whether the ids so far cover every block a worker may hold, the exact tokens asked past it,
    /// and the ratio sample, and the `rest_bytes` left are more than the text tokenized past the
    /// held prefix and than [`MIN_ESTIMATED_BYTES`] (so a prompt is estimated only when that saves
    /// more than half of its cold work and more than a background completion costs; shorter tails
    /// are tokenized, exactly). `chunk_bytes`: the piece just tokenized.
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
        // Past a media cut no block is hashed: the chains end there, as at a block nobody holds.
        if self.held.is_none() && self.cut.is_some() {
            self.held = Some(self.chains.len());
        }
        if self.held.is_none() {
            return false;
        }
        self.cold_bytes += chunk_bytes;
        self.held.is_some_and(|h| {
            self.ids.len() >= h * self.block_size + reach.exact_past_held
                && self.sample_bytes >= MIN_SAMPLE_BYTES
                && rest_bytes > self.cold_bytes.max(MIN_ESTIMATED_BYTES)
        })
    }

    /// Estimates the tokens after the stop: `sampled` is the text tokenized (added tokens apart;
    /// its ids are the ratio sample), `rest` the text left and `added` the added tokens left.
    fn estimate_rest<'t>(
        &mut self,
        sampled: impl Iterator<Item = &'t str>,
        rest: impl Iterator<Item = &'t str>,
        added: usize,
    ) {
        let text = estimate::estimate(Shape::of(sampled), self.sample_tokens, Shape::of(rest));
        self.estimated_rest = text + added;
    }

    fn finish(mut self) -> PromptTokens {
        self.hash_new_blocks();
        PromptTokens {
            ids: self.ids,
            chains: self.chains,
            locals: self.locals,
            estimated_rest: self.estimated_rest,
            cut_at_media: self.cut.is_some(),
        }
    }
}

/// The model's tokenizer and chat template with the incremental segment cache and prefix memo.
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    splitter: SegmentSplitter,
    cache: Mutex<SegmentCache>,
    memo: Mutex<PrefixMemo>,
}

impl PromptTokenizer {
    /// Loads `tokenizer_json` and the chat template (`None` = built-in DeepSeek). The cache holds at
    /// most `cache_bytes` of segment text and ids; the prefix memo [`DEFAULT_MEMO_BYTES`] (see
    /// [`Self::with_memo_bytes`]).
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
            this.memo.lock().set_max_bytes(0);
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
        let cache =
            SegmentCache { lru: lru::LruCache::unbounded(), bytes: 0, max_bytes: cache_bytes };
        Self {
            tokenizer,
            template,
            splitter,
            cache: Mutex::new(cache),
            memo: Mutex::new(PrefixMemo::new(DEFAULT_MEMO_BYTES)),
        }
    }

    /// The prefix memo's bound (`routing.tokenize_memo_bytes`; 0 = off). A tokenizer whose
    /// segment-wise encoding failed the load check keeps it off.
    pub fn with_memo_bytes(self, memo_bytes: usize) -> Self {
        {
            let mut memo = self.memo.lock();
            if memo.enabled() {
                memo.set_max_bytes(memo_bytes);
            }
        }
        self
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
        Ok(out.ids.to_vec())
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
                out.ids = Ids::from(ids.clone());
                out.hash_new_blocks();
            }
            RequestInput::Prompt(Prompt::Text(text)) => {
                self.encode_until(text, reach, &mut out, stats)?
            }
            RequestInput::Messages(messages) => {
                let text = self.template.render(messages, true)?;
                if let Some(m) = reach.media_message {
                    out.cut_byte = Some(media::cut_byte(&self.template, messages, m, &text)?);
                }
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
        let mut ends = Vec::new();
        // `segments` are all of `text`'s, or (resumed from its tail) only those after `skipped`.
        // A prompt cut at media skips the memo both ways: its cut must be passed while encoding,
        // and its entries would be a text-only prompt's anyway.
        let memo = out.cut_byte.is_none();
        let (resumed, skipped) = match memo
            .then(|| self.resume_from_tail(text, &mut segments, &mut ends, out, stats))
            .flatten()
        {
            Some(b) => (Some(b), b.at),
            None => {
                self.splitter.split_with_ends(text, &mut segments, &mut ends);
                (
                    memo.then(|| self.resume_from_memo(text, &segments, &ends, out, stats))
                        .flatten(),
                    0,
                )
            }
        };
        let rest = text.len() - resumed.map_or(0, |b| b.at);
        if rest > reach.max_fresh_bytes {
            return Err(TokenizeError::OverBudget { fresh: rest, budget: reach.max_fresh_bytes });
        }
        out.ids.own_mut().reserve(rest.min(64 * 1024) / 3);
        let mut reached = Reached { last: resumed, ..Reached::default() };
        let start = segments
            .iter()
            .zip(&ends)
            .position(|(_, &end)| resumed.is_some_and(|b| end > b.at))
            .unwrap_or(if resumed.is_some() { segments.len() } else { 0 });
        let skipped = text.get(..skipped).unwrap_or_default();
        self.encode_segments(skipped, &segments, &ends, start, reach, out, &mut reached, stats)?;
        // Remembered: the last boundary reached, the one before it (a chat prompt ends with the
        // generation prompt's added token; the next request may continue before it, e.g. with a
        // user turn after an assistant one), and the held prefix's edge — past where it resumed.
        let keep = reached.worth_keeping(resumed, text.len());
        if memo && !keep.is_empty() && self.memo.lock().enabled() {
            let entries = out.memo_entries(text, &keep);
            let mut memo = self.memo.lock();
            for e in entries {
                memo.put(e);
            }
        }
        Ok(())
    }

    /// [`Self::resume_from_memo`] for a long `text` without splitting all of it: splits only its
    /// last part ([`TAIL_FRACTIONS`], the shorter first) into `segments` and `ends`, probes the
    /// added-token ends there, and on a hit keeps only the segments after it. A hit there is
    /// exact: the memo compares the prefix, and [`SegmentSplitter::cuts_at`] says why the split
    /// after it is `text`'s own. The memo renews a conversation's entries once the text past them
    /// is an eighth of the prefix ([`REKEEP_FRACTION`]), so its next turn finds one in the tail; a
    /// miss (a prompt branching early from another) leaves the whole split to the caller.
    fn resume_from_tail<'t>(
        &self,
        text: &'t str,
        segments: &mut Vec<Segment<'t>>,
        ends: &mut Vec<usize>,
        out: &mut Partial,
        stats: &mut CacheStats,
    ) -> Option<Boundary> {
        if text.len() < MIN_TAIL_SPLIT_BYTES || !out.ids.is_empty() || !self.memo.lock().enabled() {
            return None;
        }
        let (k, at, entry) = TAIL_FRACTIONS.iter().find_map(|&fraction| {
            let mut from = text.len() - text.len() / fraction;
            while !text.is_char_boundary(from) {
                from -= 1;
            }
            self.splitter.split_from(text, from, segments, ends);
            let mut memo = self.memo.lock();
            segments.iter().zip(ends.iter()).enumerate().rev().find_map(|(k, (seg, &at))| {
                let entry =
                    matches!(seg, Segment::Added(_)).then(|| memo.get(text, at)).flatten()?;
                self.splitter.cuts_at(text, at).then_some((k, at, entry))
            })
        })?;
        stats.memo_tail_hits += 1;
        out.resume(&entry);
        segments.drain(..=k);
        ends.drain(..=k);
        Some(out.boundary(at))
    }

    /// Resumes `out` (empty) at the last boundary of `text` whose prefix the memo holds.
    fn resume_from_memo(
        &self,
        text: &str,
        segments: &[Segment<'_>],
        ends: &[usize],
        out: &mut Partial,
        stats: &mut CacheStats,
    ) -> Option<Boundary> {
        let mut memo = self.memo.lock();
        if !memo.enabled() || !out.ids.is_empty() {
            return None;
        }
        let mut probed = false;
        for (seg, &at) in segments.iter().zip(ends).rev() {
            if !matches!(seg, Segment::Added(_)) {
                continue;
            }
            probed = true;
            if let Some(entry) = memo.get(text, at) {
                drop(memo);
                stats.memo_hits += 1;
                out.resume(&entry);
                return Some(out.boundary(at));
            }
        }
        if probed {
            stats.memo_misses += 1;
        }
        None
    }

    /// Encodes `segments[start..]` into `out` until the stop rule holds (module docs), noting the
    /// boundaries it passes in `reached`. `skipped` is the text before `segments` (not split yet:
    /// the estimate of an untokenized rest samples it, split then).
    #[allow(clippy::too_many_arguments)]
    fn encode_segments<'t>(
        &self,
        skipped: &'t str,
        segments: &[Segment<'t>],
        ends: &[usize],
        start: usize,
        reach: &mut Reach<'_>,
        out: &mut Partial,
        reached: &mut Reached,
        stats: &mut CacheStats,
    ) -> Result<(), TokenizeError> {
        // Text bytes after each segment, for the stop rule.
        let mut later_bytes = vec![0usize; segments.len()];
        for i in (start..segments.len().saturating_sub(1)).rev() {
            later_bytes[i] = later_bytes[i + 1]
                + if let Segment::Text(t) = segments[i + 1] { t.len() } else { 0 };
        }
        // Text bytes encoded by this call: it starts with a small chunk and doubles it
        // (`FIRST_CHUNK_BYTES`), so a cold prompt stops soon after its first block; a whole
        // tokenization cuts the same way, so a background completion finds the route's chunks in
        // the segment cache.
        let mut fresh = 0usize;
        for (i, (seg, &seg_end)) in segments.iter().zip(ends).enumerate().skip(start) {
            // The segment holding the media cut, and all after it, are past the chains' end (a
            // segment starts after an added token: its ids do not depend on what came before).
            if out.cut.is_none() && out.cut_byte.is_some_and(|b| seg_end > b) {
                out.cut = Some(out.ids.len());
            }
            let t = match *seg {
                Segment::Added(id) => {
                    out.ids.own_mut().push(id);
                    reached.pass(out.boundary(seg_end));
                    continue;
                }
                Segment::Text(t) => t,
            };
            let mut start = 0;
            while start < t.len() {
                let end = if self.splitter.chunks() {
                    chunk_end(t, start, fresh.clamp(FIRST_CHUNK_BYTES, CHUNK_BYTES))
                } else {
                    t.len()
                };
                let chunk = &t[start..end];
                if reach.yield_now.as_mut().is_some_and(|go_on| !go_on()) {
                    return Err(TokenizeError::GaveWay);
                }
                let before = out.ids.len();
                self.encode_piece(chunk, out.ids.own_mut(), stats)?;
                out.sample_bytes += chunk.len();
                fresh += chunk.len();
                out.sample_tokens += out.ids.len() - before;
                start = end;
                let enough =
                    out.reached_enough(reach, chunk.len(), t.len() - start + later_bytes[i]);
                if out.held.is_some() && reached.held_edge.is_none() {
                    // The first unheld block is in this chunk (or the added token before it).
                    reached.held_edge = reached.last;
                }
                if enough {
                    let text = |s: &Segment<'t>| match *s {
                        Segment::Text(t) => Some(t),
                        Segment::Added(_) => None,
                    };
                    let (before, after) = (&segments[..i], &segments[i + 1..]);
                    let mut head = Vec::new();
                    if !skipped.is_empty() {
                        self.splitter.split(skipped, &mut head);
                    }
                    let sampled = head.iter().chain(before).filter_map(text).chain([&t[..start]]);
                    let rest = [&t[start..]].into_iter().chain(after.iter().filter_map(text));
                    let added = after.len() - after.iter().filter_map(text).count();
                    out.estimate_rest(sampled, rest, added);
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
                let fresh = self.tokenizer.encode_piece(piece)?;
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

    /// Bytes currently held by the prefix memo.
    pub fn memo_bytes(&self) -> usize {
        self.memo.lock().bytes()
    }
}

#[cfg(test)]
#[path = "tokenize_tests.rs"]
mod tests;
