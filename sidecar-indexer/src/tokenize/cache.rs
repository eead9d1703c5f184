//! The byte-bounded LRU of text segment → token ids that makes a new chat turn cost its new text
//! only, and the hit/miss counts of one tokenization.

use std::sync::Arc;

/// A byte-bounded LRU of text segment → token ids.
pub(super) struct SegmentCache {
    pub(super) lru: lru::LruCache<Box<str>, Arc<[u32]>>,
    pub(super) bytes: usize,
    pub(super) max_bytes: usize,
}

/// Bookkeeping bytes charged per cache entry on top of its text and ids.
const ENTRY_OVERHEAD: usize = 64;

impl SegmentCache {
    fn cost(text: &str, ids: &[u32]) -> usize {
        text.len() + ids.len() * 4 + ENTRY_OVERHEAD
    }

    pub(super) fn get(&mut self, text: &str) -> Option<Arc<[u32]>> {
        self.lru.get(text).cloned()
    }

    pub(super) fn put(&mut self, text: &str, ids: Arc<[u32]>) {
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
    /// Segments served from / added to the segment cache.
    pub hits: u64,
    pub misses: u64,
    /// Prompts resumed from the prefix memo after splitting them whole, after splitting only
    /// their tail (`PromptTokenizer::resume_from_tail`), and prompts with an added token that
    /// found none.
    pub memo_hits: u64,
    pub memo_tail_hits: u64,
    pub memo_misses: u64,
}
