//! The prefix memo: a byte-bounded LRU of rendered prompt prefixes this indexer tokenized recently
//! → their token ids and block hashes, so a warm route (the next turn of a conversation, or a
//! sibling of the same prefix) reuses the prefix's work and does only the new text's.
//!
//! An entry is stored at a *boundary*: the end of an added token in the prompt's segments. Why a
//! boundary makes reuse exact: a Hugging Face tokenizer encodes the pieces between added tokens on
//! their own, so the ids of a prompt are the ids of its segments concatenated. Two texts equal up
//! to `len`, both cut by the splitter with an added token ending at `len`, have the same segments
//! before `len`: the leftmost-longest scan decides identically until a decision reads a byte at or
//! past `len`, and the first such decision that differs picks a match that spans `len` in one of
//! the texts — impossible, since a match ends at `len` in both and matches do not overlap. The
//! caller probes only boundaries of the new text's own split — or, splitting only a long text's
//! tail, boundaries where no added token of the new text spans `len`
//! (`SegmentSplitter::cuts_at`, which makes it one) — and an entry is used only when its whole
//! text equals the new text's prefix (compared byte for byte), so neither a key collision nor a
//! different cut can give wrong ids. Chained block hashes make resuming the
//! hashing at the prefix exact: the next block's chain hash depends only on the last chain hash.
//!
//! Keys are cheap (the boundary's offset, the first and the last [`KEY_WINDOW`] bytes before it):
//! probing a boundary costs O(1), not O(prefix); the one full comparison is a `memcmp`.

use std::hash::{Hash, Hasher};
use std::sync::Arc;

use kvmesh_core::hashing::{LocalBlockHash, SequenceHash};

/// Bytes at each end of a prefix that its key hashes (with its length).
pub const KEY_WINDOW: usize = 64;

/// Bookkeeping bytes charged per entry on top of its text, ids and hashes.
const ENTRY_OVERHEAD: usize = 128;

/// Default bound of the memo's bytes (`routing.tokenize_memo_bytes`): ~140 conversations of 48k
/// tokens (text + ids + hashes ≈ 470 KB each), thousands of short ones.
pub const DEFAULT_MEMO_BYTES: usize = 64 * 1024 * 1024;

/// What one tokenization leaves for the memo: its text, ids and block hashes (for one block size
/// and seed) up to its last boundary, shared by the entries of its boundaries.
#[derive(Debug, Clone)]
pub struct Tokenized {
    pub text: Arc<str>,
    pub ids: Arc<[u32]>,
    /// Block size and seed `chains`/`locals` were hashed with.
    pub block_size: usize,
    pub seed: u64,
    pub chains: Arc<[SequenceHash]>,
    pub locals: Arc<[LocalBlockHash]>,
}

/// What the prompt prefix `tokenized.text[..text_len]` tokenized to: the first `ids` ids and
/// `blocks` block hashes, and the bytes → tokens sample of its text (text bytes, added tokens
/// apart, and the ids they gave; for the estimate of an untokenized rest).
#[derive(Debug, Clone)]
pub struct MemoEntry {
    pub tokenized: Tokenized,
    pub text_len: usize,
    pub ids: usize,
    pub blocks: usize,
    pub sample_bytes: usize,
    pub sample_tokens: usize,
}

impl MemoEntry {
    /// The prefix text, compared on every hit.
    pub fn text(&self) -> &str {
        self.tokenized.text.get(..self.text_len).unwrap_or_default()
    }

    pub fn ids(&self) -> &[u32] {
        self.tokenized.ids.get(..self.ids).unwrap_or_default()
    }

    pub fn chains(&self) -> &[SequenceHash] {
        self.tokenized.chains.get(..self.blocks).unwrap_or_default()
    }

    pub fn locals(&self) -> &[LocalBlockHash] {
        self.tokenized.locals.get(..self.blocks).unwrap_or_default()
    }

    /// Bytes of the whole storage the entry shares with the other entries of its tokenization
    /// (charged once for all of them: [`PrefixMemo`]).
    fn cost(&self) -> usize {
        let t = &self.tokenized;
        t.text.len() + t.ids.len() * 4 + (t.chains.len() + t.locals.len()) * 8 + ENTRY_OVERHEAD
    }
}

/// The key of the prefix `text[..len]` (`len` ≤ `text.len()`, a char boundary).
pub fn key(text: &str, len: usize) -> u64 {
    let bytes = text.as_bytes();
    let len = len.min(bytes.len());
    let mut h = std::collections::hash_map::DefaultHasher::new();
    len.hash(&mut h);
    bytes[..len.min(KEY_WINDOW)].hash(&mut h);
    bytes[len.saturating_sub(KEY_WINDOW)..len].hash(&mut h);
    h.finish()
}

/// A byte-bounded LRU of prefix → [`MemoEntry`]. The entries of one tokenization (up to three
/// boundaries) share its storage, so the bound charges a storage once, when its first entry comes
/// in, and frees it with its last: counting it per entry would fill the bound three times faster
/// than memory.
pub struct PrefixMemo {
    lru: lru::LruCache<u64, MemoEntry>,
    /// Storage (its text's address: unique while an entry holds the `Arc`) → entries holding it,
    /// and its cost.
    storages: std::collections::HashMap<usize, (u32, usize)>,
    bytes: usize,
    max_bytes: usize,
}

impl PrefixMemo {
    /// An empty memo holding at most `max_bytes` (0: off).
    pub fn new(max_bytes: usize) -> Self {
        Self {
            lru: lru::LruCache::unbounded(),
            storages: std::collections::HashMap::new(),
            bytes: 0,
            max_bytes,
        }
    }

    /// Whether entries are kept at all.
    pub fn enabled(&self) -> bool {
        self.max_bytes > 0
    }

    /// Bytes held (≤ the bound).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The bound; 0 turns the memo off and drops what it holds.
    pub fn set_max_bytes(&mut self, max_bytes: usize) {
        self.max_bytes = max_bytes;
        self.evict();
    }

    /// The entry for exactly `text[..len]`, if one is held (the text is compared in full).
    pub fn get(&mut self, text: &str, len: usize) -> Option<MemoEntry> {
        let prefix = text.get(..len)?;
        let entry = self.lru.get(&key(text, len))?;
        (entry.text() == prefix).then(|| entry.clone())
    }

    /// Keeps `entry` (its text is the prefix); an entry of more than a quarter of the bound is not
    /// kept (one huge prompt would flush everything else).
    pub fn put(&mut self, entry: MemoEntry) {
        let cost = entry.cost();
        if cost > self.max_bytes / 4 {
            return;
        }
        let k = key(entry.text(), entry.text_len);
        self.charge(&entry, cost);
        if let Some(old) = self.lru.put(k, entry) {
            self.release(&old);
        }
        self.evict();
    }

    fn evict(&mut self) {
        while self.bytes > self.max_bytes {
            match self.lru.pop_lru() {
                Some((_, old)) => self.release(&old),
                None => break,
            }
        }
    }

    fn storage(entry: &MemoEntry) -> usize {
        Arc::as_ptr(&entry.tokenized.text).cast::<u8>() as usize
    }

    fn charge(&mut self, entry: &MemoEntry, cost: usize) {
        let held = self.storages.entry(Self::storage(entry)).or_insert((0, cost));
        held.0 += 1;
        if held.0 == 1 {
            self.bytes += cost;
        }
    }

    fn release(&mut self, entry: &MemoEntry) {
        let id = Self::storage(entry);
        if let Some(held) = self.storages.get_mut(&id) {
            held.0 -= 1;
            if held.0 == 0 {
                self.bytes -= held.1;
                self.storages.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(text: &str, ids: &[u32]) -> MemoEntry {
        MemoEntry {
            tokenized: Tokenized {
                text: text.into(),
                ids: ids.into(),
                block_size: 2,
                seed: 1,
                chains: Arc::from(vec![SequenceHash(ids.len() as u64)]),
                locals: Arc::from(vec![LocalBlockHash(7)]),
            },
            text_len: text.len(),
            ids: ids.len(),
            blocks: 1,
            sample_bytes: text.len(),
            sample_tokens: ids.len(),
        }
    }

    #[test]
    fn a_prefix_is_found_only_for_its_exact_text() {
        let mut memo = PrefixMemo::new(1 << 20);
        let long_a = format!("{}A{}", "x".repeat(200), "y".repeat(200));
        let long_b = format!("{}B{}", "x".repeat(200), "y".repeat(200));
        memo.put(entry("hello <b>", &[1, 2]));
        memo.put(entry(&long_a, &[3]));
        // (text probed, prefix length, ids expected)
        let cases: &[(&str, usize, Option<&[u32]>)] = &[
            ("hello <b> world", 9, Some(&[1, 2])),
            ("hello <b>", 9, Some(&[1, 2])),
            ("hello <b> world", 8, None),
            ("hellO <b> world", 9, None),
            ("hello", 9, None),
            (&long_a, long_a.len(), Some(&[3])),
            // Same length, same first and last KEY_WINDOW bytes, same key: the full compare rejects it.
            (&long_b, long_b.len(), None),
        ];
        for (text, len, want) in cases {
            let got = memo.get(text, *len).map(|e| e.ids().to_vec());
            assert_eq!(got.as_deref(), *want, "{text:?}[..{len}]");
        }
        assert_eq!(key(&long_a, long_a.len()), key(&long_b, long_b.len()));
    }

    #[test]
    fn entries_sharing_one_tokenization_give_their_own_prefix() {
        let mut memo = PrefixMemo::new(1 << 20);
        let whole = entry("ab<e><a>", &[1, 2, 3, 4]);
        let before_last = MemoEntry { text_len: 5, ids: 3, blocks: 1, ..whole.clone() };
        memo.put(whole);
        memo.put(before_last);
        let got = memo
            .get("ab<e><u>q", 5)
            .map(|e| (e.text().to_owned(), e.ids().to_vec(), e.chains().len()));
        assert_eq!(got, Some(("ab<e>".to_owned(), vec![1, 2, 3], 1)));
        assert_eq!(memo.get("ab<e><a>x", 8).map(|e| e.ids().len()), Some(4));
    }

    #[test]
    fn entries_of_one_tokenization_are_charged_once() {
        let mut memo = PrefixMemo::new(1 << 20);
        let whole = entry("ab<e><a>", &[1, 2, 3, 4]);
        let storage = whole.cost();
        let boundaries = [3, 5, 8].map(|len| MemoEntry { text_len: len, ..whole.clone() });
        for (i, e) in boundaries.iter().enumerate() {
            memo.put(e.clone());
            assert_eq!(memo.bytes(), storage, "after {} entries sharing one storage", i + 1);
        }
        memo.put(entry("other", &[9]));
        assert_eq!(memo.bytes(), storage + entry("other", &[9]).cost());
        // Evicting down to the newest entry frees the shared storage only with its last entry.
        memo.set_max_bytes(entry("other", &[9]).cost());
        assert_eq!(memo.bytes(), entry("other", &[9]).cost());
        assert!(memo.get("ab<e><a>", 8).is_none());
        memo.set_max_bytes(0);
        assert_eq!(memo.bytes(), 0);
    }

    #[test]
    fn the_memo_stays_within_its_byte_bound() {
        let bound = 4096;
        let mut memo = PrefixMemo::new(bound);
        let texts: Vec<String> =
            (0..100).map(|i| format!("prefix {i} {}", "z".repeat(i * 3))).collect();
        for t in &texts {
            memo.put(entry(t, &[1, 2, 3]));
            assert!(memo.bytes() <= bound, "{} > {bound}", memo.bytes());
        }
        // The most recent survive, the oldest were evicted.
        assert!(memo.get(&texts[99], texts[99].len()).is_some());
        assert!(memo.get(&texts[0], texts[0].len()).is_none());
        // Too big for a quarter of the bound: not kept.
        let huge = "h".repeat(bound);
        memo.put(entry(&huge, &[1]));
        assert!(memo.get(&huge, huge.len()).is_none());
        // Replacing an entry does not leak its bytes; turning off drops everything.
        let before = memo.bytes();
        memo.put(entry(&texts[99], &[1, 2, 3]));
        assert_eq!(memo.bytes(), before);
        memo.set_max_bytes(0);
        assert_eq!(memo.bytes(), 0);
        assert!(!memo.enabled());
        memo.put(entry("a", &[1]));
        assert_eq!(memo.bytes(), 0);
    }
}
