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

pub use kvmesh_tokens::safe_cut;

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
