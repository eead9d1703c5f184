//! Applying one decoded batch of one worker (dp rank) to the index: the rules between the wire and
//! the data structure, kept pure so every rule is unit-tested.
//!
//! * A `BlockStored` whose `block_size` differs from the configured one is refused and counted: the
//!   chain hashes would be computed over the wrong token windows and silently never match.
//! * Stores and removals for other tiers (`medium` other than GPU) or other KV cache groups
//!   (`group_idx` > 0, hybrid models) are skipped and counted: the index tracks the device cache of
//!   the main attention group, which is what prefix caching reuses first.
//! * An orphan store (unknown parent) stores nothing; a worker claiming more blocks than allowed is
//!   cleared (a resync) because it must have lost removals.

use kvmesh_core::hashing::block_seed;

use super::decode::{EventBatch, KvEvent};
use crate::index::{KvIndex, StoreOutcome, WorkerSlot};

/// What one batch did (feeds metrics and logs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// Events by kind: stored, removed, cleared, unknown.
    pub stored_events: u64,
    pub removed_events: u64,
    pub cleared_events: u64,
    pub unknown_events: u64,
    /// Blocks stored / removed.
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// Removals of engine hashes the worker never stored (or already removed).
    pub unknown_removes: u64,
    /// Stores refused for an unknown parent.
    pub orphan_stores: u64,
    /// Stores whose unknown parent was learned from a routed prompt (indexed after all).
    pub recovered_orphans: u64,
    /// Stores refused for a block size other than the configured one (the last seen size kept).
    pub block_size_mismatches: u64,
    pub mismatched_block_size: Option<u32>,
    /// Stores with token ids not covering their hashes.
    pub malformed_stores: u64,
    /// Events for another tier or cache group.
    pub ignored_events: u64,
    /// The worker exceeded `max_blocks_per_worker` and was cleared.
    pub resynced: bool,
}

/// Applies `batch` for `slot`. `block_size` is the configured block size.
pub fn apply_batch(index: &mut KvIndex, slot: WorkerSlot, batch: &EventBatch, block_size: u32) -> ApplyReport {
    let mut r = ApplyReport::default();
    for event in &batch.events {
        match event {
            KvEvent::Stored { block_hashes, parent, token_ids, block_size: bs, lora_name, cache_salt, medium, group_idx } => {
                r.stored_events += 1;
                if !main_tier(medium.as_deref(), *group_idx) {
                    r.ignored_events += 1;
                    continue;
                }
                if *bs != block_size {
                    r.block_size_mismatches += 1;
                    r.mismatched_block_size = Some(*bs);
                    continue;
                }
                let seed = block_seed(lora_name.as_deref(), cache_salt.as_deref());
                match index.store(slot, *parent, block_hashes, token_ids, block_size as usize, seed) {
                    StoreOutcome::Stored { blocks } => r.stored_blocks += blocks as u64,
                    StoreOutcome::Recovered { blocks } => {
                        r.stored_blocks += blocks as u64;
                        r.recovered_orphans += 1;
                    }
                    StoreOutcome::Orphan => r.orphan_stores += 1,
                    StoreOutcome::Malformed => r.malformed_stores += 1,
                    StoreOutcome::UnknownWorker => {}
                    StoreOutcome::TooManyBlocks => {
                        index.clear_worker(slot);
                        r.resynced = true;
                    }
                }
            }
            KvEvent::Removed { block_hashes, medium, group_idx } => {
                r.removed_events += 1;
                if !main_tier(medium.as_deref(), *group_idx) {
                    r.ignored_events += 1;
                    continue;
                }
                let unknown = index.remove(slot, block_hashes) as u64;
                r.unknown_removes += unknown;
                r.removed_blocks += block_hashes.len() as u64 - unknown;
            }
            KvEvent::Cleared => {
                r.cleared_events += 1;
                index.clear_worker(slot);
            }
            KvEvent::Unknown { .. } => r.unknown_events += 1,
        }
    }
    r
}

fn main_tier(medium: Option<&str>, group_idx: Option<u32>) -> bool {
    medium.is_none_or(|m| m.eq_ignore_ascii_case("GPU")) && group_idx.unwrap_or(0) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::hashing::{sequence_hashes, XXH3_SEED};

    fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, bs: u32) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes,
            parent,
            token_ids: tokens,
            block_size: bs,
            lora_name: None,
            cache_salt: None,
            medium: Some("GPU".into()),
            group_idx: None,
        }
    }

    fn batch(events: Vec<KvEvent>) -> EventBatch {
        EventBatch { ts: 0.0, events, dp_rank: None }
    }

    fn held(index: &KvIndex, tokens: &[u32]) -> u32 {
        index.find_matches(&sequence_hashes(tokens, 4, XXH3_SEED)).first().map_or(0, |m| m.1)
    }

    #[test]
    fn rules_table() {
        let t: Vec<u32> = (0..8).collect();
        let cases: Vec<(&str, Vec<KvEvent>, u32, ApplyReport)> = vec![
            (
                "store",
                vec![stored(vec![1, 2], None, t.clone(), 4)],
                2,
                ApplyReport { stored_events: 1, stored_blocks: 2, ..Default::default() },
            ),
            (
                "block size mismatch refused",
                vec![stored(vec![1], None, t[..8].to_vec(), 8)],
                0,
                ApplyReport { stored_events: 1, block_size_mismatches: 1, mismatched_block_size: Some(8), ..Default::default() },
            ),
            (
                "orphan",
                vec![stored(vec![2], Some(1), t[4..].to_vec(), 4)],
                0,
                ApplyReport { stored_events: 1, orphan_stores: 1, ..Default::default() },
            ),
            (
                "other tier ignored",
                vec![KvEvent::Stored {
                    block_hashes: vec![1],
                    parent: None,
                    token_ids: t[..4].to_vec(),
                    block_size: 4,
                    lora_name: None,
                    cache_salt: None,
                    medium: Some("CPU".into()),
                    group_idx: None,
                }],
                0,
                ApplyReport { stored_events: 1, ignored_events: 1, ..Default::default() },
            ),
            (
                "store, remove one, unknown remove",
                vec![stored(vec![1, 2], None, t.clone(), 4), KvEvent::Removed { block_hashes: vec![2, 9], medium: None, group_idx: None }],
                1,
                ApplyReport { stored_events: 1, stored_blocks: 2, removed_events: 1, removed_blocks: 1, unknown_removes: 1, ..Default::default() },
            ),
            (
                "cleared",
                vec![stored(vec![1, 2], None, t.clone(), 4), KvEvent::Cleared],
                0,
                ApplyReport { stored_events: 1, stored_blocks: 2, cleared_events: 1, ..Default::default() },
            ),
            (
                "unknown event",
                vec![KvEvent::Unknown { tag: "X".into() }],
                0,
                ApplyReport { unknown_events: 1, ..Default::default() },
            ),
            (
                "malformed",
                vec![stored(vec![1, 2], None, t[..5].to_vec(), 4)],
                0,
                ApplyReport { stored_events: 1, malformed_stores: 1, ..Default::default() },
            ),
        ];
        for (name, events, want_held, want) in cases {
            let mut index = KvIndex::new(1000, 1000);
            index.add_worker(0);
            let got = apply_batch(&mut index, 0, &batch(events), 4);
            assert_eq!(got, want, "{name}");
            assert_eq!(held(&index, &t), want_held, "{name}");
        }
    }

    #[test]
    fn a_replay_applied_across_a_hole_keeps_an_evicted_block_for_good_and_the_run_rule_does_not() {
        // The soak's index growth (issue 15.3), at the pure level. The engine's history: store
        // 1, 2; evict 2; store 3 after 1. Its replay socket dropped batch 1 (the eviction).
        let t: Vec<u32> = (0..8).collect();
        let history = [
            batch(vec![stored(vec![1, 2], None, t.clone(), 4)]),
            batch(vec![KvEvent::Removed { block_hashes: vec![2], medium: None, group_idx: None }]),
            batch(vec![stored(vec![3], Some(1), (100..104).collect(), 4)]),
        ];
        let received: [u64; 2] = [0, 2];
        let fresh = || {
            let mut index = KvIndex::new(1000, 1000);
            index.add_worker(0);
            index
        };
        // Applied as if nothing were missing: block 2 stays, and nothing ever removes it (the
        // engine does not evict a block twice).
        let mut across = fresh();
        for &s in &received {
            apply_batch(&mut across, 0, &history[s as usize], 4);
        }
        assert_eq!(across.worker_blocks(0), 3, "blocks 1, 2 and 3 although the engine holds 1 and 3");
        assert_eq!(held(&across, &t), 2);
        // The listener's rule: the run before the hole, then (the live stream shows the gap from
        // 1) the replay from the hole. The index ends as the engine.
        let mut index = fresh();
        let run = crate::events::sequencer::contiguous_run(&received);
        assert_eq!(run, 1);
        for &s in &received[..run] {
            apply_batch(&mut index, 0, &history[s as usize], 4);
        }
        for b in &history[run..] {
            apply_batch(&mut index, 0, b, 4);
        }
        assert_eq!((index.worker_blocks(0), index.entries()), (2, 2));
        assert_eq!(held(&index, &t), 1);
        assert_eq!(index.check_consistent(), Ok(()));
    }

    #[test]
    fn too_many_blocks_resyncs_the_worker() {
        let mut index = KvIndex::new(1000, 2);
        index.add_worker(0);
        let t: Vec<u32> = (0..12).collect();
        let r = apply_batch(&mut index, 0, &batch(vec![stored(vec![1, 2, 3], None, t.clone(), 4)]), 4);
        assert!(r.resynced);
        assert_eq!(held(&index, &t), 0);
    }
}
