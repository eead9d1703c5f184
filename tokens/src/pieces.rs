//! ASCII text between added tokens, encoded without `tokenizers`' per-call machinery.
//!
//! Why: `tokenizers` wraps every piece of a call in a `NormalizedString` that tracks an alignment
//! per byte through each of the DeepSeek-V4 pre-tokenizer's four steps, and runs the three split
//! regexes through Oniguruma; measured here, ~1.2 µs per token, most of it `malloc`/`free` and
//! `memmove` — more than half of what the indexer spends on a route. For ASCII text the same four
//! steps are a few byte-class tests ([`pre_tokens`]), so only the BPE merges are left to the
//! library's model, and a pre-token seen before is one lookup in a bounded word cache
//! ([`WORD_CACHE_ENTRIES`]). Text with non-ASCII chars is cut at [`safe_cut`] boundaries: its
//! ASCII stretches go the same way, the others through `tokenizers` (and the same cache).
//!
//! Exactness: [`pre_tokens`] is the pre-tokenizer written out for ASCII, alternative by
//! alternative (see its doc). The tests compare it with `tokenizers` exhaustively over short strings
//! of a tricky alphabet and on generated text of every ASCII byte; the indexer also checks a probe
//! at load; text with non-ASCII chars on 256 generated mixes. It is used only when the
//! `tokenizer.json`'s normalizer and pre-tokenizer are exactly `deepseek_pipeline()`'s and its
//! model is BPE without dropout, for text that holds no added token (the caller cut it at them);
//! anything else goes through `tokenizers`.

use std::collections::HashMap;

use tokenizers::models::ModelWrapper;
use tokenizers::Model;

use crate::deepseek::{has_deepseek_pipeline, safe_cut};
use crate::TokensError;

/// Pre-tokens (and non-ASCII stretches between safe cuts) whose ids [`AsciiEncoder`] remembers;
/// when full, it forgets them all and starts again (≤ 2¹⁶ × (64 B + the ids + ~50 B of map
/// overhead): under ~10 MiB, ~4 MiB for prose).
pub const WORD_CACHE_ENTRIES: usize = 1 << 16;

/// Longer pre-tokens are encoded each time, not remembered.
pub const MAX_CACHED_WORD_BYTES: usize = 64;

/// The word cache's map: text bytes → their ids.
type WordIds = HashMap<Box<[u8]>, Box<[u32]>, foldhash::fast::RandomState>;

/// Encodes ASCII pieces with the model's BPE directly.
pub(crate) struct AsciiEncoder {
    /// GPT-2's byte → char map (`bytes_to_unicode`) for the ASCII bytes, as ByteLevel applies it.
    byte_chars: [char; 128],
    /// ASCII pre-token bytes → ids, and non-ASCII stretch bytes → ids (the two never share a
    /// key). A hit costs a hash lookup, where the model's own cache clones the word and a string
    /// per token (and stops taking words once it holds 10,000).
    words: std::sync::RwLock<WordIds>,
}

impl AsciiEncoder {
    /// Some when the tokenizer's pipeline is DeepSeek-V4's and its model a BPE without dropout.
    pub(crate) fn for_tokenizer(tokenizer_json: &[u8], model: &ModelWrapper) -> Option<Self> {
        let ModelWrapper::BPE(bpe) = model else {
            return None;
        };
        let deterministic = bpe.dropout.is_none_or(|p| p == 0.0);
        (deterministic && has_deepseek_pipeline(tokenizer_json)).then(|| Self {
            byte_chars: ascii_byte_chars(),
            words: std::sync::RwLock::new(HashMap::default()),
        })
    }

    /// The ids of `text` (no added token inside), appended to `ids`: cut at every [`safe_cut`]
    /// boundary, the ASCII stretches encoded directly and each stretch with a non-ASCII char by
    /// `library` (or from the word cache: a stretch between two safe cuts encodes the same in any
    /// text, as the pre-tokenizer gives the same pre-tokens for the parts as for the whole there).
    pub(crate) fn encode(
        &self,
        model: &ModelWrapper,
        text: &str,
        ids: &mut Vec<u32>,
        mut library: impl FnMut(&str, &mut Vec<u32>) -> Result<(), TokensError>,
    ) -> Result<(), TokensError> {
        if text.is_ascii() {
            return self.encode_ascii(model, text, ids);
        }
        // ASCII stretches before `ascii_from` are encoded; those after it wait to be encoded as one.
        let mut ascii_from = 0;
        for (stretch, ascii) in safe_stretches(text) {
            if ascii {
                continue;
            }
            if ascii_from < stretch.start {
                self.encode_ascii(model, &text[ascii_from..stretch.start], ids)?;
            }
            ascii_from = stretch.end;
            self.encode_stretch(&text[stretch], ids, &mut library)?;
        }
        if ascii_from < text.len() {
            self.encode_ascii(model, &text[ascii_from..], ids)?;
        }
        Ok(())
    }

    /// A stretch between two safe cuts, with a non-ASCII char: from the word cache, else `library`.
    fn encode_stretch(
        &self,
        stretch: &str,
        ids: &mut Vec<u32>,
        library: &mut impl FnMut(&str, &mut Vec<u32>) -> Result<(), TokensError>,
    ) -> Result<(), TokensError> {
        let key = stretch.as_bytes();
        if let Some(hit) =
            self.words.read().unwrap_or_else(std::sync::PoisonError::into_inner).get(key)
        {
            ids.extend_from_slice(hit);
            return Ok(());
        }
        let from = ids.len();
        library(stretch, ids)?;
        if key.len() <= MAX_CACHED_WORD_BYTES {
            self.remember([(key, ids[from..].into())]);
        }
        Ok(())
    }

    /// Puts words and their ids in the word cache, starting it again when it is full.
    fn remember<'k>(&self, learned: impl IntoIterator<Item = (&'k [u8], Box<[u32]>)>) {
        let mut words = self.words.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        for (key, word_ids) in learned {
            if words.len() >= WORD_CACHE_ENTRIES {
                words.clear();
            }
            words.insert(key.into(), word_ids);
        }
    }

    /// The ids of ASCII `text` (no added token inside), appended to `ids`.
    fn encode_ascii(
        &self,
        model: &ModelWrapper,
        text: &str,
        ids: &mut Vec<u32>,
    ) -> Result<(), TokensError> {
        let bytes = text.as_bytes();
        let mut learned: Vec<(std::ops::Range<usize>, Box<[u32]>)> = Vec::new();
        let mut word = String::new();
        let mut failed = None;
        {
            // One read lock for the whole text; what it lacked is inserted after it is released.
            let words = self.words.read().unwrap_or_else(std::sync::PoisonError::into_inner);
            pre_tokens(bytes, |range| {
                if let Some(hit) = words.get(&bytes[range.clone()]) {
                    ids.extend_from_slice(hit);
                    return;
                }
                if failed.is_some() {
                    return;
                }
                word.clear();
                word.extend(
                    bytes[range.clone()].iter().map(|&b| self.byte_chars[usize::from(b & 0x7f)]),
                );
                match model.tokenize(&word) {
                    Ok(tokens) => {
                        let word_ids: Box<[u32]> = tokens.iter().map(|t| t.id).collect();
                        ids.extend_from_slice(&word_ids);
                        if range.len() <= MAX_CACHED_WORD_BYTES {
                            learned.push((range, word_ids));
                        }
                    }
                    Err(e) => failed = Some(TokensError::Encode(e.to_string())),
                }
            });
        }
        if let Some(e) = failed {
            return Err(e);
        }
        if !learned.is_empty() {
            self.remember(learned.into_iter().map(|(range, word_ids)| (&bytes[range], word_ids)));
        }
        Ok(())
    }
}

/// GPT-2's `bytes_to_unicode` for bytes 0–127: printable ASCII (`!`..=`~`) maps to itself, every
/// other byte to U+0100 + its rank among the bytes not printable in Latin-1.
fn ascii_byte_chars() -> [char; 128] {
    let mut map = ['\0'; 128];
    let mut next = 0x100u32;
    for b in 0u8..=127 {
        map[usize::from(b)] = if (b'!'..=b'~').contains(&b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{100}');
            next += 1;
            c
        };
    }
    map
}

/// The stretches of `text` between consecutive [`safe_cut`] boundaries, in order, each with
/// whether it is all ASCII.
fn safe_stretches(text: &str) -> impl Iterator<Item = (std::ops::Range<usize>, bool)> + '_ {
    let mut chars = text.char_indices().peekable();
    std::iter::from_fn(move || {
        let (start, first) = chars.next()?;
        let (mut before, mut ascii) = (first, first.is_ascii());
        while let Some(&(at, c)) = chars.peek() {
            if safe_cut(before, c) {
                return Some((start..at, ascii));
            }
            ascii &= c.is_ascii();
            before = c;
            chars.next();
        }
        Some((start..text.len(), ascii))
    })
}

// === the pre-tokenizer for ASCII ===

fn is_letter(b: u8) -> bool {
    b.is_ascii_alphabetic()
}

/// `\p{P}` ∪ `\p{S}` in ASCII, which is also the first alternative's bracket class.
fn is_punct(b: u8) -> bool {
    b.is_ascii_punctuation()
}

/// `\s` in ASCII (Unicode White_Space: tab, LF, VT, FF, CR, space).
fn is_space(b: u8) -> bool {
    matches!(b, b'\t' | b'\n' | 0x0b | 0x0c | b'\r' | b' ')
}

fn is_newline(b: u8) -> bool {
    b == b'\r' || b == b'\n'
}

/// End of the run of bytes from `at` that satisfy `class`.
fn run_end(s: &[u8], at: usize, class: fn(u8) -> bool) -> usize {
    s[at..].iter().position(|&b| !class(b)).map_or(s.len(), |n| at + n)
}

/// The pre-tokens of ASCII `text`, in order, as byte ranges: exactly what the DeepSeek-V4
/// pre-tokenizer gives. Its splits apply in sequence, each to every piece the previous left:
///
/// 1. `\p{N}{1,3}`, isolated: digit runs cut into threes from the left; the stretches between
///    them are pieces of their own.
/// 2. The CJK/kana runs: none in ASCII.
/// 3. The word regex, isolated, on each piece (a digit piece holds no match; see [`word_match`]);
///    the bytes between matches form pieces too.
/// 4. ByteLevel without its regex: maps bytes, no cut.
pub(crate) fn pre_tokens(text: &[u8], mut emit: impl FnMut(std::ops::Range<usize>)) {
    let mut at = 0;
    while at < text.len() {
        if text[at].is_ascii_digit() {
            let end = run_end(text, at, |b| b.is_ascii_digit());
            while at < end {
                let next = (at + 3).min(end);
                emit(at..next);
                at = next;
            }
        } else {
            let end = run_end(text, at, |b| !b.is_ascii_digit());
            word_pieces(&text[at..end], at, &mut emit);
            at = end;
        }
    }
}

/// The word regex's matches in `piece` (at `offset` in the text) and the gaps between them.
fn word_pieces(piece: &[u8], offset: usize, emit: &mut impl FnMut(std::ops::Range<usize>)) {
    let mut at = 0;
    let mut gap = 0;
    while at < piece.len() {
        match word_match(piece, at) {
            Some(len) => {
                if gap < at {
                    emit(offset + gap..offset + at);
                }
                emit(offset + at..offset + at + len);
                at += len;
                gap = at;
            }
            None => at += 1,
        }
    }
    if gap < piece.len() {
        emit(offset + gap..offset + piece.len());
    }
}

/// The length of the word regex's match starting at `at` in `piece` (Oniguruma's semantics: the
/// first alternative that matches, each greedy with backtracking), if any:
///
/// - A1 `[punct][A-Za-z]+`.
/// - A2 `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`: letters, after one optional byte that is no
///   newline, letter or punctuation (a space, a tab, a control byte).
/// - A3 ` ?[\p{P}\p{S}]+[\r\n]*`.
/// - A4 `\s*[\r\n]+`: the whitespace run up to its last newline, when it has one.
/// - A5 `\s+(?!\S)`: the whitespace run when it ends the piece (the regex sees the piece only),
///   else all of it but its last byte when that leaves one.
/// - A6 `\s+`: the one whitespace byte before a non-whitespace one.
fn word_match(piece: &[u8], at: usize) -> Option<usize> {
    let b = piece[at];
    let next = piece.get(at + 1).copied();
    let letters_after = |from: usize| run_end(piece, from, is_letter) - at;
    // A1 (`b` punctuation) and A2 with its optional byte (`b` neither punctuation, newline nor
    // letter) take the same letters after `b`.
    if !is_newline(b) && !is_letter(b) && next.is_some_and(is_letter) {
        return Some(letters_after(at + 1));
    }
    if is_letter(b) {
        return Some(letters_after(at));
    }
    let punct_then_newlines =
        |from: usize| run_end(piece, run_end(piece, from, is_punct), is_newline) - at;
    if b == b' ' && next.is_some_and(is_punct) {
        return Some(punct_then_newlines(at + 1));
    }
    if is_punct(b) {
        return Some(punct_then_newlines(at));
    }
    if !is_space(b) {
        return None;
    }
    let end = run_end(piece, at, is_space);
    if let Some(last_newline) = piece[at..end].iter().rposition(|&c| is_newline(c)) {
        return Some(last_newline + 1);
    }
    if end == piece.len() || end - at == 1 {
        Some(end - at)
    } else {
        Some(end - at - 1)
    }
}

#[cfg(test)]
#[path = "pieces_tests.rs"]
mod tests;
