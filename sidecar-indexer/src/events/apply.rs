//! Applying one decoded batch of one worker (dp rank) to the index: the rules between the wire and
//! the data structure, kept pure so every rule is unit-tested.
//!
//! * A `BlockStored` whose `block_size` differs from the configured one is refused and counted: the
//!   chain hashes would be computed over the wrong token windows and silently never match.
//! * Stores and removals are applied to the tier their `medium` names ([`Tier::of_medium`]: GPU,
//!   CPU, disk), each tier's residency apart ([`crate::index`]'s `tiers`): a GPU removal leaves a
//!   CPU copy. Events for a medium that is not the worker's own (`OBJ`, `EXTERNAL`, unknown), and
//!   lower-tier stores without token ids (vLLM's placeholder payload when the connector's
//!   `self_describing_kv_events` is off: `token_ids = []`, `block_size = 0`, nothing to hash) are
//!   skipped and counted.
//! * GPU events of a KV cache group beyond the main one (`group_idx` > 0, hybrid models) go to
//!   that group's residency ([`KvIndex::store_group`], [`KvIndex::remove_group`]), with the kind
//!   the store names ([`GroupKind::of`]); a kind the indexer does not model (or none) is counted.
//!   Lower-tier events of such groups are skipped (the tiers are tracked for the main group only).
//! * An orphan store (unknown parent) stores nothing; a worker claiming more blocks than allowed is
//!   cleared (a resync) because it must have lost removals.
//!
//! Over 600 lines: one dispatch from events to index mutations for every tier, cache group and key
//! kind, with its tests.

use kvmesh_core::hashing::{block_seed, UNUSABLE_TERM};

use super::decode::{EventBatch, KvEvent};
use crate::index::{GroupEvent, GroupKind, GroupStore, KvIndex, StoreOutcome, Tier, WorkerSlot};

/// What one batch did (feeds metrics and logs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApplyReport {
    /// Events by kind: stored, removed, cleared, unknown.
    pub stored_events: u64,
    pub removed_events: u64,
    pub cleared_events: u64,
    pub unknown_events: u64,
    /// GPU blocks stored / removed.
    pub stored_blocks: u64,
    pub removed_blocks: u64,
    /// Lower-tier (CPU, disk) blocks stored / removed.
    pub tier_stored_blocks: u64,
    pub tier_removed_blocks: u64,
    /// Lower-tier stores without token ids (the connector's placeholder payload): skipped.
    pub undescribed_stores: u64,
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
    /// Stores refused because their seed (LoRA × `cache_salt`) is new and the index's seed table
    /// is full of seeds in use.
    pub seed_refusals: u64,
    /// Events for another tier, or for a lower tier of a group beyond the main one.
    pub ignored_events: u64,
    /// Blocks stored / removed in KV cache groups beyond the main one (hybrid models).
    pub group_stored_blocks: u64,
    pub group_removed_blocks: u64,
    /// Group stores refused because every group together is at `routing.index_max_entries`.
    pub group_refused: u64,
    /// Stores naming a group kind the indexer does not model (or none, for a group beyond 0).
    pub unknown_kind_events: u64,
    /// Stores with `extra_keys` the index cannot reproduce from a request (prompt embeddings,
    /// unknown shapes, over the size cap): their blocks are indexed but never match.
    pub unusable_extra_keys: u64,
    /// The worker exceeded `max_blocks_per_worker` and was cleared.
    pub resynced: bool,
}

/// Where applying a batch stands: the next event, and the next block within a `BlockStored`
/// (a store is applied in pieces, see [`apply_step`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Cursor {
    event: usize,
    block: usize,
}

/// What one [`apply_step`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Step {
    /// Where the next step starts; `None`: the batch is applied.
    pub next: Option<Cursor>,
    /// Blocks the step stored or removed (the applier's measure of work under the lock).
    pub blocks: usize,
}

/// Applies `batch` for `slot` whole. `block_size` is the configured block size.
pub fn apply_batch(
    index: &mut KvIndex,
    slot: WorkerSlot,
    batch: &EventBatch,
    block_size: u32,
) -> ApplyReport {
    let mut r = ApplyReport::default();
    let mut at = Some(Cursor::default());
    while let Some(c) = at {
        at = apply_step(index, slot, batch, block_size, c, usize::MAX, &mut r).next;
    }
    r
}

/// Blocks the step at `at` may store (what the tables must have room for), at most `max_blocks`.
pub fn step_blocks(batch: &EventBatch, at: Cursor, max_blocks: usize) -> usize {
    match batch.events.get(at.event) {
        // A store of another group is applied whole, outside the main tables.
        Some(KvEvent::Stored { block_hashes, group_idx: None | Some(0), .. }) => {
            block_hashes.len().saturating_sub(at.block).min(max_blocks.max(1))
        }
        _ => 0,
    }
}

/// The tier the step at `at` writes to (the GPU for anything but a lower-tier event): whose
/// tables must have room for [`step_blocks`].
pub fn step_tier(batch: &EventBatch, at: Cursor) -> Tier {
    match batch.events.get(at.event) {
        Some(KvEvent::Stored { medium, group_idx, .. }) => {
            tier_of(medium.as_deref(), *group_idx).unwrap_or(Tier::Gpu)
        }
        _ => Tier::Gpu,
    }
}

/// Applies one step of `batch` from `at`, adding to `r`: one event, or at most `max_blocks` blocks
/// of a `BlockStored`. The pieces of a store are the store: each continues the chain from the
/// previous piece's last engine hash, as if the engine had sent them as consecutive events, so
/// the index ends the same whatever `max_blocks` is (tested); between pieces the applier lets
/// route queries in. A `BlockRemoved` is one step whatever its length: its hashes are taken as a
/// whole (`KvIndex::remove`).
pub fn apply_step(
    index: &mut KvIndex,
    slot: WorkerSlot,
    batch: &EventBatch,
    block_size: u32,
    at: Cursor,
    max_blocks: usize,
    r: &mut ApplyReport,
) -> Step {
    let next_event =
        (at.event + 1 < batch.events.len()).then_some(Cursor { event: at.event + 1, block: 0 });
    let done = |blocks| Step { next: next_event, blocks };
    let Some(event) = batch.events.get(at.event) else { return Step { next: None, blocks: 0 } };
    match event {
        KvEvent::Stored {
            block_hashes,
            parent,
            token_ids,
            block_size: bs,
            lora_name,
            cache_salt,
            medium,
            group_idx,
            spec_kind,
            sliding_window,
            extra_terms,
        } => {
            let kind =
                spec_kind.is_some().then(|| GroupKind::of(spec_kind.as_deref(), *sliding_window));
            if let Some(g) = group_idx.filter(|g| *g > 0) {
                r.stored_events += 1;
                if kind.is_none_or(|k| k == GroupKind::Unknown) {
                    r.unknown_kind_events += 1;
                }
                if Tier::of_medium(medium.as_deref()) != Some(Tier::Gpu) {
                    r.ignored_events += 1;
                    return done(0);
                }
                if *bs != block_size {
                    r.block_size_mismatches += 1;
                    r.mismatched_block_size = Some(*bs);
                    return done(0);
                }
                let e = GroupEvent {
                    group_idx: g,
                    kind,
                    parent: *parent,
                    block_hashes,
                    token_ids,
                    block_size: block_size as usize,
                    root_seed: block_seed(lora_name.as_deref(), cache_salt.as_deref()),
                };
                match index.store_group(slot, e) {
                    GroupStore::Stored { blocks } => r.group_stored_blocks += blocks as u64,
                    GroupStore::Orphan => r.orphan_stores += 1,
                    GroupStore::Malformed => r.malformed_stores += 1,
                    GroupStore::Full => r.group_refused += 1,
                    GroupStore::TooManyBlocks => r.resynced = true,
                    GroupStore::Refused => r.ignored_events += 1,
                }
                return done(block_hashes.len());
            }
            if at.block == 0 && kind == Some(GroupKind::Unknown) {
                // The main group is read as full attention whatever it is named (module docs of
                // `crate::index::group_rule`); a kind it does not model is counted all the same.
                r.unknown_kind_events += 1;
            }
            let Some(tier) = tier_of(medium.as_deref(), *group_idx) else {
                r.stored_events += 1;
                r.ignored_events += 1;
                return done(0);
            };
            if at.block == 0 {
                r.stored_events += 1;
                if tier != Tier::Gpu && token_ids.is_empty() && *bs == 0 {
                    r.undescribed_stores += 1;
                    return done(0);
                }
                if extra_terms.contains(&UNUSABLE_TERM) {
                    r.unusable_extra_keys += 1;
                }
                if *bs != block_size {
                    r.block_size_mismatches += 1;
                    r.mismatched_block_size = Some(*bs);
                    return done(0);
                }
            }
            let bs = block_size as usize;
            let end = at.block + step_blocks(batch, at, max_blocks);
            // A malformed store is refused whole, at its first piece (`KvIndex::store` checks
            // each piece's tokens against its hashes, so slices of a malformed store could pass).
            let tokens = if token_ids.len() == block_hashes.len() * bs {
                token_ids.get(at.block * bs..end * bs)
            } else {
                None
            };
            let Some(tokens) = tokens else {
                r.malformed_stores += 1;
                return done(0);
            };
            let parent =
                if at.block == 0 { *parent } else { block_hashes.get(at.block - 1).copied() };
            let seed = block_seed(lora_name.as_deref(), cache_salt.as_deref());
            let piece = &block_hashes[at.block..end];
            let more = (end < block_hashes.len()).then_some(Cursor { event: at.event, block: end });
            let counter =
                if tier == Tier::Gpu { &mut r.stored_blocks } else { &mut r.tier_stored_blocks };
            let terms = extra_terms.get(at.block..end).unwrap_or_default();
            match index.store_keyed_in(tier, slot, parent, piece, tokens, bs, seed, terms) {
                StoreOutcome::Stored { blocks } => {
                    *counter += blocks as u64;
                    return Step { next: more.or(next_event), blocks };
                }
                StoreOutcome::Recovered { blocks } => {
                    *counter += blocks as u64;
                    r.recovered_orphans += 1;
                    return Step { next: more.or(next_event), blocks };
                }
                StoreOutcome::Orphan => r.orphan_stores += 1,
                StoreOutcome::Malformed => r.malformed_stores += 1,
                StoreOutcome::SeedTableFull => r.seed_refusals += 1,
                StoreOutcome::UnknownWorker => {}
                StoreOutcome::TooManyBlocks => {
                    index.clear_in(tier, slot);
                    r.resynced = true;
                }
            }
            done(piece.len())
        }
        KvEvent::Removed { block_hashes, medium, group_idx } => {
            r.removed_events += 1;
            if let Some(g) = group_idx.filter(|g| *g > 0) {
                if Tier::of_medium(medium.as_deref()) != Some(Tier::Gpu) {
                    r.ignored_events += 1;
                    return done(0);
                }
                let unknown = index.remove_group(slot, g, block_hashes) as u64;
                r.unknown_removes += unknown;
                r.group_removed_blocks += block_hashes.len() as u64 - unknown;
                return done(block_hashes.len());
            }
            let Some(tier) = tier_of(medium.as_deref(), *group_idx) else {
                r.ignored_events += 1;
                return done(0);
            };
            let unknown = index.remove_in(tier, slot, block_hashes) as u64;
            r.unknown_removes += unknown;
            let removed = block_hashes.len() as u64 - unknown;
            if tier == Tier::Gpu {
                r.removed_blocks += removed;
            } else {
                r.tier_removed_blocks += removed;
            }
            done(block_hashes.len())
        }
        KvEvent::Cleared => {
            r.cleared_events += 1;
            index.clear_worker(slot);
            done(0)
        }
        KvEvent::Unknown { .. } => {
            r.unknown_events += 1;
            done(0)
        }
    }
}

/// The tier an event of the main KV cache group applies to; `None`: skipped.
fn tier_of(medium: Option<&str>, group_idx: Option<u32>) -> Option<Tier> {
    Tier::of_medium(medium).filter(|_| group_idx.unwrap_or(0) == 0)
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
            spec_kind: None,
            sliding_window: None,
            extra_terms: vec![],
        }
    }

    fn tier_store(
        medium: &str,
        hashes: Vec<u64>,
        tokens: Vec<u32>,
        bs: u32,
        group_idx: Option<u32>,
    ) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes,
            parent: None,
            token_ids: tokens,
            block_size: bs,
            lora_name: None,
            cache_salt: None,
            medium: Some(medium.into()),
            group_idx,
            spec_kind: None,
            sliding_window: None,
            extra_terms: vec![],
        }
    }

    /// A GPU store of group `group` with vLLM's sliding-window spec of `window` tokens.
    fn window_store(
        group: u32,
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        window: u32,
    ) -> KvEvent {
        KvEvent::Stored {
            block_hashes: hashes,
            parent,
            token_ids: tokens,
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            medium: Some("GPU".into()),
            group_idx: Some(group),
            spec_kind: Some("sliding_window".into()),
            sliding_window: Some(window),
            extra_terms: vec![],
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
                ApplyReport {
                    stored_events: 1,
                    block_size_mismatches: 1,
                    mismatched_block_size: Some(8),
                    ..Default::default()
                },
            ),
            (
                "orphan",
                vec![stored(vec![2], Some(1), t[4..].to_vec(), 4)],
                0,
                ApplyReport { stored_events: 1, orphan_stores: 1, ..Default::default() },
            ),
            (
                "a CPU store is indexed in the CPU tier, not the GPU's",
                vec![tier_store("CPU", vec![1], t[..4].to_vec(), 4, None)],
                0,
                ApplyReport { stored_events: 1, tier_stored_blocks: 1, ..Default::default() },
            ),
            (
                "GPU and CPU removals apply to their own tier",
                vec![
                    stored(vec![1, 2], None, t.clone(), 4),
                    tier_store("CPU", vec![2], t[4..].to_vec(), 4, None),
                    KvEvent::Removed { block_hashes: vec![2], medium: None, group_idx: None },
                    KvEvent::Removed {
                        block_hashes: vec![1],
                        medium: Some("CPU".into()),
                        group_idx: None,
                    },
                ],
                1,
                ApplyReport {
                    stored_events: 2,
                    stored_blocks: 2,
                    tier_stored_blocks: 1,
                    removed_events: 2,
                    removed_blocks: 1,
                    unknown_removes: 1,
                    ..Default::default()
                },
            ),
            (
                "a shared store and a lower tier of another group are skipped",
                vec![
                    tier_store("OBJ", vec![1], t[..4].to_vec(), 4, None),
                    tier_store("CPU", vec![1], t[..4].to_vec(), 4, Some(1)),
                    KvEvent::Removed {
                        block_hashes: vec![1],
                        medium: Some("EXTERNAL".into()),
                        group_idx: None,
                    },
                ],
                0,
                ApplyReport {
                    stored_events: 2,
                    removed_events: 1,
                    ignored_events: 3,
                    unknown_kind_events: 1,
                    ..Default::default()
                },
            ),
            (
                "another group's store goes beside the main index, not into it",
                vec![
                    tier_store("GPU", vec![1], t[..4].to_vec(), 4, Some(1)),
                    window_store(2, vec![1, 2], None, t.clone(), 64),
                    KvEvent::Removed { block_hashes: vec![2, 9], medium: None, group_idx: Some(2) },
                ],
                0,
                ApplyReport {
                    stored_events: 2,
                    removed_events: 1,
                    group_stored_blocks: 3,
                    group_removed_blocks: 1,
                    unknown_removes: 1,
                    unknown_kind_events: 1,
                    ..Default::default()
                },
            ),
            (
                "a placeholder offload store (no token ids) is skipped",
                vec![tier_store("CPU", vec![1], vec![], 0, Some(0))],
                0,
                ApplyReport { stored_events: 1, undescribed_stores: 1, ..Default::default() },
            ),
            (
                "store, remove one, unknown remove",
                vec![
                    stored(vec![1, 2], None, t.clone(), 4),
                    KvEvent::Removed { block_hashes: vec![2, 9], medium: None, group_idx: None },
                ],
                1,
                ApplyReport {
                    stored_events: 1,
                    stored_blocks: 2,
                    removed_events: 1,
                    removed_blocks: 1,
                    unknown_removes: 1,
                    ..Default::default()
                },
            ),
            (
                "cleared",
                vec![stored(vec![1, 2], None, t.clone(), 4), KvEvent::Cleared],
                0,
                ApplyReport {
                    stored_events: 1,
                    stored_blocks: 2,
                    cleared_events: 1,
                    ..Default::default()
                },
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
        assert_eq!(
            across.worker_blocks(0),
            3,
            "blocks 1, 2 and 3 although the engine holds 1 and 3"
        );
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

    /// Applies `batches` with steps of at most `max_blocks` blocks.
    fn apply_in_steps(
        index: &mut KvIndex,
        batches: &[EventBatch],
        max_blocks: usize,
    ) -> Vec<ApplyReport> {
        batches
            .iter()
            .map(|b| {
                let mut r = ApplyReport::default();
                let mut at = Some(Cursor::default());
                while let Some(c) = at {
                    let step = apply_step(index, 0, b, 4, c, max_blocks, &mut r);
                    let removal = matches!(b.events[c.event], KvEvent::Removed { .. });
                    assert!(
                        removal || step.blocks <= max_blocks,
                        "a store step stays within its budget"
                    );
                    at = step.next;
                }
                r
            })
            .collect()
    }

    proptest::proptest! {
        // The applier applies a long store in pieces so that route queries wait for one piece, not
        // the whole store: any piece size leaves the index, and the reports, as applying whole.
        #[test]
        fn a_store_applied_in_pieces_leaves_the_index_as_applied_whole(
            ops in proptest::collection::vec((0u8..4, 1usize..24, proptest::num::u64::ANY), 1..40),
            max_blocks in 1usize..9,
        ) {
            // An engine's history: stores continuing an earlier block (or from the root), duplicate
            // stores, removals; a few malformed and wrong-size stores; batches of 1–3 events.
            let mut next_hash = 1u64;
            let mut known: Vec<u64> = Vec::new();
            let mut events = Vec::new();
            for (kind, len, pick) in ops {
                let parent = (!known.is_empty() && pick % 3 != 0).then(|| known[(pick as usize / 3) % known.len()]);
                match kind {
                    0 | 1 => {
                        let hashes: Vec<u64> = (0..len as u64).map(|i| next_hash + i).collect();
                        next_hash += len as u64;
                        known.extend(&hashes);
                        let tokens: Vec<u32> = (0..len * 4).map(|i| (pick as u32).wrapping_add(i as u32 % 7)).collect();
                        events.push(stored(hashes, parent, tokens, if pick % 17 == 0 { 8 } else { 4 }));
                    }
                    2 if !known.is_empty() => {
                        let from = (pick as usize) % known.len();
                        let hashes: Vec<u64> = known[from..].iter().take(len).copied().collect();
                        events.push(KvEvent::Removed { block_hashes: hashes, medium: None, group_idx: None });
                    }
                    _ => events.push(stored(vec![next_hash], parent, vec![1, 2, 3], 4)),
                }
            }
            let batches: Vec<EventBatch> = events.chunks(3).map(|c| batch(c.to_vec())).collect();
            let fresh = || {
                let mut index = KvIndex::new(10_000, 10_000);
                index.add_worker(0);
                index
            };
            let (mut whole, mut pieces) = (fresh(), fresh());
            let whole_reports: Vec<ApplyReport> = batches.iter().map(|b| apply_batch(&mut whole, 0, b, 4)).collect();
            let piece_reports = apply_in_steps(&mut pieces, &batches, max_blocks);
            proptest::prop_assert_eq!(whole_reports, piece_reports);
            let mut a = whole.worker_refs(0);
            let mut b = pieces.worker_refs(0);
            a.sort_by_key(|e| e.0);
            b.sort_by_key(|e| e.0);
            proptest::prop_assert_eq!(a, b);
            proptest::prop_assert_eq!((whole.entries(), whole.blocks()), (pieces.entries(), pieces.blocks()));
            proptest::prop_assert_eq!(pieces.check_consistent(), Ok(()));
        }
    }

    #[test]
    fn too_many_blocks_resyncs_the_worker() {
        let mut index = KvIndex::new(1000, 2);
        index.add_worker(0);
        let t: Vec<u32> = (0..12).collect();
        let r =
            apply_batch(&mut index, 0, &batch(vec![stored(vec![1, 2, 3], None, t.clone(), 4)]), 4);
        assert!(r.resynced);
        assert_eq!(held(&index, &t), 0);
    }

    /// Issue 44.3: a prompt stored under adapter A (the engine's `lora_name`) is matched by a
    /// request for A — hashed as the route side hashes it, `RouteModel::seed` =
    /// `block_seed(Some(A), cache_salt)` — and by neither the base model nor adapter B, with or
    /// without a `cache_salt`.
    #[test]
    fn a_prompt_stored_under_an_adapter_is_matched_only_by_requests_for_it() {
        use kvmesh_core::hashing::block_seed;
        let t: Vec<u32> = (500..516).collect();
        for salt in [None, Some("tenant-1")] {
            let mut index = KvIndex::new(1000, 1000);
            index.add_worker(0);
            let store = KvEvent::Stored {
                block_hashes: vec![11, 12, 13, 14],
                parent: None,
                token_ids: t.clone(),
                block_size: 4,
                lora_name: Some("a".into()),
                cache_salt: salt.map(str::to_owned),
                medium: None,
                group_idx: None,
                spec_kind: None,
                sliding_window: None,
                extra_terms: vec![],
            };
            let r = apply_batch(&mut index, 0, &batch(vec![store]), 4);
            assert_eq!(r.stored_blocks, 4);
            let held = |adapter: Option<&str>| {
                let chains = sequence_hashes(&t, 4, block_seed(adapter, salt));
                index.find_matches(&chains).first().map_or(0, |m| m.1)
            };
            assert_eq!(held(Some("a")), 4, "the adapter's own request, salt {salt:?}");
            assert_eq!(held(None), 0, "the base model, salt {salt:?}");
            assert_eq!(held(Some("b")), 0, "another adapter, salt {salt:?}");
        }
    }

    proptest::proptest! {
        /// Adapter and base chains never collide: for any tokens, the chains under no adapter,
        /// adapter A and adapter B ≠ A (each with or without a salt) share no hash.
        #[test]
        fn adapter_and_base_chains_never_collide(
            tokens in proptest::collection::vec(0u32..200_000, 4..64),
            a in "[a-z0-9-]{1,12}",
            b in "[a-z0-9-]{1,12}",
            salt in proptest::option::of("[a-z]{1,6}"),
        ) {
            use kvmesh_core::hashing::block_seed;
            proptest::prop_assume!(a != b);
            let chains = |adapter: Option<&str>| {
                sequence_hashes(&tokens, 4, block_seed(adapter, salt.as_deref()))
            };
            let (base, ca, cb) = (chains(None), chains(Some(&a)), chains(Some(&b)));
            for c in &ca {
                proptest::prop_assert!(!base.contains(c) && !cb.contains(c));
            }
            for c in &cb {
                proptest::prop_assert!(!base.contains(c));
            }
        }
    }
}
