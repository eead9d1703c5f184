//! ASCII text between added tokens, encoded without `tokenizers`' per-call machinery.
//!
//! Why: `tokenizers` wraps every piece of a call in a `NormalizedString` that tracks an alignment
//! per byte through each of the DeepSeek-V4 pre-tokenizer's four steps, and runs the three split
//! regexes through Oniguruma; measured here, ~1.2 µs per token, most of it `malloc`/`free` and
//! `memmove` — more than half of what the indexer spends on a route. For ASCII text the same four
//! steps are a few byte-class tests ([`pre_tokens`]), so only the BPE merges are left to the
//! library's model (which keeps its own word cache).
//!
//! Exactness: [`pre_tokens`] is the pre-tokenizer written out for ASCII, alternative by
//! alternative (see its doc). The tests compare it with `tokenizers` exhaustively over short strings
//! of a tricky alphabet and on generated text of every ASCII byte; the indexer also checks a probe
//! at load. It is used only when the `tokenizer.json`'s normalizer and pre-tokenizer are exactly
//! `deepseek_pipeline()`'s, its model is BPE without dropout, and the text is ASCII and holds no
//! added token (the caller cut it at them); anything else goes through `tokenizers`.

use tokenizers::models::ModelWrapper;
use tokenizers::Model;

use crate::deepseek::{has_deepseek_pipeline, safe_cut};
use crate::TokensError;

/// Encodes ASCII pieces with the model's BPE directly.
pub(crate) struct AsciiEncoder {
    /// GPT-2's byte → char map (`bytes_to_unicode`) for the ASCII bytes, as ByteLevel applies it.
    byte_chars: [char; 128],
}

impl AsciiEncoder {
    /// Some when the tokenizer's pipeline is DeepSeek-V4's and its model a BPE without dropout.
    pub(crate) fn for_tokenizer(tokenizer_json: &[u8], model: &ModelWrapper) -> Option<Self> {
        let ModelWrapper::BPE(bpe) = model else {
            return None;
        };
        let deterministic = bpe.dropout.is_none_or(|p| p == 0.0);
        (deterministic && has_deepseek_pipeline(tokenizer_json)).then(|| Self { byte_chars: ascii_byte_chars() })
    }

    /// The ids of `text` (no added token inside), appended to `ids`: cut at every [`safe_cut`]
    /// boundary, each ASCII stretch encoded directly and each stretch with a non-ASCII char (joined
    /// with its non-ASCII neighbours) by `library`. Exact because the pre-tokenizer gives the same
    /// pre-tokens for the parts as for the whole at those cuts.
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
        // `[library_from, start)`: non-ASCII stretches not yet encoded; `[start, at)`: the current stretch.
        let (mut library_from, mut start, mut ascii) = (0, 0, true);
        let mut finish = |start: usize, end: usize, ascii: bool, library_from: &mut usize, ids: &mut Vec<u32>| {
            if !ascii {
                return Ok(());
            }
            if *library_from < start {
                library(&text[*library_from..start], ids)?;
            }
            *library_from = end;
            self.encode_ascii(model, &text[start..end], ids)
        };
        let mut before = None;
        for (at, c) in text.char_indices() {
            if before.is_some_and(|b| safe_cut(b, c)) {
                finish(start, at, ascii, &mut library_from, ids)?;
                (start, ascii) = (at, true);
            }
            ascii &= c.is_ascii();
            before = Some(c);
        }
        finish(start, text.len(), ascii, &mut library_from, ids)?;
        if library_from < text.len() {
            library(&text[library_from..], ids)?;
        }
        Ok(())
    }

    /// The ids of ASCII `text` (no added token inside), appended to `ids`.
    fn encode_ascii(&self, model: &ModelWrapper, text: &str, ids: &mut Vec<u32>) -> Result<(), TokensError> {
        let mut word = String::new();
        let mut failed = None;
        pre_tokens(text.as_bytes(), |range| {
            if failed.is_some() {
                return;
            }
            word.clear();
            word.extend(text.as_bytes()[range].iter().map(|&b| self.byte_chars[usize::from(b & 0x7f)]));
            match model.tokenize(&word) {
                Ok(tokens) => ids.extend(tokens.iter().map(|t| t.id)),
                Err(e) => failed = Some(TokensError::Encode(e.to_string())),
            }
        });
        failed.map_or(Ok(()), Err)
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
    if is_punct(b) && next.is_some_and(is_letter) {
        return Some(letters_after(at + 1));
    }
    if !is_newline(b) && !is_letter(b) && !is_punct(b) && next.is_some_and(is_letter) {
        return Some(letters_after(at + 1));
    }
    if is_letter(b) {
        return Some(letters_after(at));
    }
    let punct_then_newlines = |from: usize| run_end(piece, run_end(piece, from, is_punct), is_newline) - at;
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
