//! What the simulated model "says": deterministic output tokens drawn from ordinary words.
//!
//! Output must be reproducible (same request content → same reply, so benchmarks and multi-turn
//! clients are repeatable) and must re-encode to the same ids when a client appends the reply to
//! its history. So tokens are drawn only from a pool of plain lower-case words with a leading
//! space (`" house"`): with a byte-level BPE each such word is its own pre-token, so the decoded
//! reply re-encodes to exactly the ids generated, and special or added tokens never appear. The
//! pool and each token's text are computed once at start-up, so generating costs no tokenizer
//! call. The generator is splitmix64 seeded from the request content (or its `seed`).

use std::collections::HashMap;

use kvmesh_tokens::Tokenizer;

/// Smallest usable pool.
pub const MIN_POOL: usize = 16;

/// The vocabulary replies are drawn from.
#[derive(Debug, Clone)]
pub struct OutputVocab {
    ids: Vec<u32>,
    texts: Vec<String>,
    index: HashMap<u32, usize>,
}

/// No usable words were found in the tokenizer.
#[derive(Debug, thiserror::Error)]
#[error("the tokenizer has only {found} plain word tokens (need {MIN_POOL}) to draw replies from")]
pub struct VocabError {
    found: usize,
}

impl OutputVocab {
    /// Scans `tok`'s vocabulary from id 0 for up to `max` tokens that decode to `" "` followed by
    /// 3–10 lower-case ASCII letters and encode back to exactly themselves.
    pub fn from_tokenizer(tok: &Tokenizer, max: usize) -> Result<Self, VocabError> {
        let mut words = Vec::with_capacity(max);
        let vocab = u32::try_from(tok.vocab_size()).unwrap_or(u32::MAX);
        for id in 0..vocab {
            if words.len() >= max {
                break;
            }
            let Ok(text) = tok.decode(&[id]) else { continue };
            if !is_plain_word(&text) {
                continue;
            }
            if tok.encode(&text).ok().as_deref() == Some(&[id][..]) {
                words.push((id, text));
            }
        }
        Self::from_words(words)
    }

    /// A vocabulary from explicit `(id, text)` pairs (tests, custom tokenizers).
    pub fn from_words(words: Vec<(u32, String)>) -> Result<Self, VocabError> {
        if words.len() < MIN_POOL {
            return Err(VocabError { found: words.len() });
        }
        let index = words.iter().enumerate().map(|(i, (id, _))| (*id, i)).collect();
        let (ids, texts) = words.into_iter().unzip();
        Ok(Self { ids, texts, index })
    }

    /// Number of words in the pool.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// True if the pool is empty (never, once constructed).
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Draws the next token of a reply.
    pub fn sample(&self, rng: &mut u64) -> u32 {
        let r = splitmix64(rng);
        // Multiply-shift: unbiased enough for a pool of a few thousand, and branch-free.
        let i = ((u128::from(r) * self.ids.len() as u128) >> 64) as usize;
        self.ids[i]
    }

    /// The text of a token drawn from this pool (empty for any other id).
    pub fn text(&self, id: u32) -> &str {
        self.index.get(&id).map_or("", |&i| self.texts[i].as_str())
    }

    /// Appends the text of `ids` to `out`.
    pub fn append_text(&self, ids: &[u32], out: &mut String) {
        for &id in ids {
            out.push_str(self.text(id));
        }
    }
}

fn is_plain_word(text: &str) -> bool {
    let Some(word) = text.strip_prefix(' ') else { return false };
    (3..=10).contains(&word.len()) && word.bytes().all(|b| b.is_ascii_lowercase())
}

/// splitmix64: one 64-bit state, good statistical quality, trivially seedable.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of a reply: the request's `seed` if given, else a digest of its prompt — the engine
/// hash of its last full block (which covers every token before it) mixed with the tokens of the
/// partial tail and the length — so the same prompt always gets the same reply, at no extra pass
/// over the prompt.
pub fn seed_for(
    prompt: &[u32],
    full_block_hashes: &[u64],
    block_size: usize,
    explicit: Option<u64>,
) -> u64 {
    if let Some(s) = explicit {
        return s;
    }
    let mut state =
        full_block_hashes.last().copied().unwrap_or(0x5eed) ^ (prompt.len() as u64).rotate_left(32);
    let mut seed = splitmix64(&mut state);
    for &t in &prompt[(full_block_hashes.len() * block_size).min(prompt.len())..] {
        state ^= u64::from(t);
        seed ^= splitmix64(&mut state);
    }
    seed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vocab() -> OutputVocab {
        OutputVocab::from_words((0..20).map(|i| (100 + i, format!(" w{i}"))).collect()).unwrap()
    }

    #[test]
    fn deterministic_per_seed_and_inside_the_pool() {
        let v = vocab();
        let draw = |seed: u64| {
            let mut s = seed;
            (0..50).map(|_| v.sample(&mut s)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        assert!(draw(9).iter().all(|id| (100..120).contains(id)));
        let mut text = String::new();
        v.append_text(&[100, 119], &mut text);
        assert_eq!(text, " w0 w19");
        assert_eq!(v.text(5), "");
    }

    #[test]
    fn seeds_follow_content() {
        let seed = |p: &[u32]| seed_for(p, &crate::hash::chain(p, 4, None), 4, None);
        assert_eq!(seed(&[1, 2, 3]), seed(&[1, 2, 3]));
        assert_ne!(seed(&[1, 2, 3]), seed(&[1, 2, 4]));
        assert_ne!(
            seed(&[1, 2, 3, 4, 5]),
            seed(&[9, 2, 3, 4, 5]),
            "full blocks count through their hash"
        );
        assert_ne!(seed(&[1, 2, 3, 4]), seed(&[1, 2, 3, 4, 5]));
        assert_eq!(seed_for(&[1], &[], 4, Some(42)), 42);
    }

    #[test]
    fn plain_words_only() {
        for (text, ok) in [
            (" house", true),
            ("house", false),
            (" Ho", false),
            (" ab", false),
            (" <x>", false),
            (" abcdefghijk", false),
        ] {
            assert_eq!(is_plain_word(text), ok, "{text:?}");
        }
        assert!(OutputVocab::from_words(vec![(1, " a".into())]).is_err());
    }
}
