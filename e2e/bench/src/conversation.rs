//! Which conversation a trace request belongs to (for the optional session header).
//!
//! The Mooncake trace has no session ids; conversations have to be read off the block ids.
//! Facts of the conversation trace (checked by `kvmesh-replay --analyze` and the test below):
//! - every request starts with hash id 0 — one block shared by *all* requests (a global system
//!   prompt), so block 0 says nothing about the conversation;
//! - every other hash id always sits at the same position behind the same parent id: the
//!   requests form a prefix forest, and all reuse is prefix reuse;
//! - every hash id except 0 occurs under exactly one `hash_ids[1]`.
//!
//! So the conversation key is the **first block after the globally shared one**, `hash_ids[1]`
//! (the "anchor block", configurable). Requests with equal anchors share their first
//! 1024 tokens, and no reuse beyond block 0 crosses two keys, so perfect session affinity on this
//! key (with infinite caches) loses only block 0's first use on each worker. Some keys are
//! trees rather than chains (one long document, many follow-up questions); they still share the
//! document's blocks, so pinning them together is what a cache-aware router wants.
//! A request with no block at the anchor position is keyed by its last block.

use crate::trace::TraceRecord;
use std::collections::{HashMap, HashSet};

/// Default anchor position: the first block after the globally shared block 0.
pub const DEFAULT_ANCHOR_BLOCK: usize = 1;

/// The conversation key of a request: `hash_ids[anchor]`, or its last id when shorter.
pub fn key(record: &TraceRecord, anchor: usize) -> u64 {
    record.hash_ids.get(anchor).or_else(|| record.hash_ids.last()).copied().unwrap_or(0)
}

/// The session header value for a request: `conv-<key>`.
pub fn session_id(record: &TraceRecord, anchor: usize) -> String {
    format!("conv-{}", key(record, anchor))
}

/// How well the conversation definition fits a trace.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ConversationStats {
    /// Distinct conversation keys.
    pub conversations: u64,
    /// Conversations with a single request.
    pub singletons: u64,
    /// Requests in the largest conversation.
    pub max_requests: u64,
    /// Distinct hash ids at or after the anchor position seen under more than one key — reuse
    /// that session affinity cannot capture. 0 on the conversation trace.
    pub ids_in_several_conversations: u64,
    /// Distinct hash ids seen at more than one position (0 means a clean prefix forest).
    pub ids_at_several_positions: u64,
    /// Reused blocks whose earlier occurrence was in the same conversation (what perfect
    /// affinity with an infinite cache could hit).
    pub blocks_reused_within_conversation: u64,
}

/// Computes [`ConversationStats`] for `records` in order.
pub fn analyze<'a, I>(records: I, anchor: usize) -> ConversationStats
where
    I: IntoIterator<Item = &'a TraceRecord>,
{
    let mut per_key: HashMap<u64, u64> = HashMap::new();
    let mut owner: HashMap<u64, u64> = HashMap::new();
    let mut multi: HashSet<u64> = HashSet::new();
    let mut position: HashMap<u64, usize> = HashMap::new();
    let mut multi_pos: HashSet<u64> = HashSet::new();
    let mut seen_in: HashSet<(u64, u64)> = HashSet::new();
    let mut within = 0u64;
    for r in records {
        let k = key(r, anchor);
        *per_key.entry(k).or_default() += 1;
        for (j, &id) in r.hash_ids.iter().enumerate() {
            if r.block_tokens(j) == 0 {
                break;
            }
            if *position.entry(id).or_insert(j) != j {
                multi_pos.insert(id);
            }
            if j >= anchor && *owner.entry(id).or_insert(k) != k {
                multi.insert(id);
            }
            if !seen_in.insert((k, id)) {
                within += 1;
            }
        }
    }
    ConversationStats {
        conversations: per_key.len() as u64,
        singletons: per_key.values().filter(|&&n| n == 1).count() as u64,
        max_requests: per_key.values().copied().max().unwrap_or(0),
        ids_in_several_conversations: multi.len() as u64,
        ids_at_several_positions: multi_pos.len() as u64,
        blocks_reused_within_conversation: within,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::parse;

    fn rec(ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: 0.0,
            input_length: ids.len() as u32 * 512,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn key_table() {
        let cases: &[(&[u64], usize, u64)] = &[
            (&[0, 7, 8], 1, 7),
            (&[0, 7], 1, 7),
            (&[0], 1, 0),
            (&[0, 7, 8], 2, 8),
            (&[0, 7], 2, 7),
            (&[], 1, 0),
        ];
        for (ids, anchor, want) in cases {
            let r = TraceRecord {
                timestamp: 0.0,
                input_length: 1,
                output_length: 1,
                hash_ids: ids.to_vec(),
            };
            assert_eq!(key(&r, *anchor), *want, "{ids:?} @ {anchor}");
        }
        assert_eq!(session_id(&rec(&[0, 42, 1]), 1), "conv-42");
    }

    #[test]
    fn analyze_counts_conversations_and_leaks() {
        let recs = vec![rec(&[0, 1, 2]), rec(&[0, 1, 2, 3]), rec(&[0, 4]), rec(&[0, 5, 2])];
        let s = analyze(&recs, 1);
        assert_eq!(s.conversations, 3);
        assert_eq!(s.singletons, 2);
        assert_eq!(s.max_requests, 2);
        // id 2 appears under keys 1 and 5, and at positions 2 in both (same position).
        assert_eq!(s.ids_in_several_conversations, 1);
        assert_eq!(s.ids_at_several_positions, 0);
        // Within conversation 1: 0, 1, 2 reused by the second request.
        assert_eq!(s.blocks_reused_within_conversation, 3);
    }

    #[test]
    fn conversation_trace_is_a_clean_prefix_forest() {
        let path = crate::trace::default_trace_path(std::env::var(crate::trace::TRACE_ENV).ok());
        let file = std::fs::File::open(&path).unwrap();
        let recs = parse(std::io::BufReader::new(file)).unwrap();
        let s = analyze(&recs, DEFAULT_ANCHOR_BLOCK);
        assert_eq!(s.ids_in_several_conversations, 0);
        assert_eq!(s.ids_at_several_positions, 0);
        assert_eq!(s.conversations, 7373);
    }
}
