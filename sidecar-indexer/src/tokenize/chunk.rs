//! Cutting a long piece into chunks at boundaries where the DeepSeek-V4 pre-tokenizer provably gives
//! the same pre-tokens for the two halves as for the whole ([`safe_cut`]), so the ids of the chunks
//! concatenated are the ids of the piece.

/// Bytes of the first chunk a tokenization encodes. Its chunks grow with the text it has encoded
/// (each about as long as all before it) up to [`CHUNK_BYTES`]: a cold prompt stops after ~60
/// tokens (its first block nobody holds), not after ~500, and a prompt tokenized further costs a
/// few more encode calls (256, 512, 1 KiB, then 2 KiB each; an encode call has a fixed cost of
/// ~45k instructions, ~10 µs here). The schedule restarts with each call (at its resume point), so
/// a prompt's background completion cuts its first chunks as its route did and finds them cached.
pub const FIRST_CHUNK_BYTES: usize = 256;

/// Bytes after which a long piece is cut into a chunk, at the first [`safe_cut`] boundary: the
/// granularity at which tokenization stops past the held blocks.
pub const CHUNK_BYTES: usize = 2048;

/// Text left at least for a prompt's rest to be estimated rather than tokenized: a shorter tail
/// (a continuation's new turn) costs less to encode than the background completion an estimated
/// prompt starts (`route::plan::complete_later`), and keeps the prompt's length exact.
pub const MIN_ESTIMATED_BYTES: usize = CHUNK_BYTES;

/// Text tokenized at least before the rest of a prompt may be estimated (unless it is all of it):
/// the sample that calibrates the estimate (`estimate.rs`).
pub const MIN_SAMPLE_BYTES: usize = FIRST_CHUNK_BYTES;

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
/// `start + bytes`, else the end of `text`.
pub fn chunk_end(text: &str, start: usize, bytes: usize) -> usize {
    let mut at = start + bytes;
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
