use super::*;
use crate::index::StoreOutcome;
use kvmesh_core::hashing::{sequence_hashes, XXH3_SEED};

const BS: usize = 4;
/// A window of 9 tokens: a hit needs the ⌈8/4⌉ = 2 blocks before it.
const WINDOW: GroupKind = GroupKind::Window { tokens: 9 };

fn tokens(blocks: usize) -> Vec<u32> {
    (0..(blocks * BS) as u32).map(|t| 1000 + t).collect()
}

/// Engine hashes of the prompt's blocks (opaque ids, the same in every group).
fn engine(i: usize) -> u64 {
    500 + i as u64
}

fn index() -> KvIndex {
    let mut index = KvIndex::new(10_000, 10_000);
    index.add_worker(0);
    index.add_worker(1);
    index
}

/// Stores blocks `from..to` of the prompt in the main group of `slot`.
fn store_main(index: &mut KvIndex, slot: WorkerSlot, t: &[u32], from: usize, to: usize) {
    let hashes: Vec<u64> = (from..to).map(engine).collect();
    let parent = from.checked_sub(1).map(engine);
    let out = index.store(slot, parent, &hashes, &t[from * BS..to * BS], BS, XXH3_SEED);
    assert_eq!(out, StoreOutcome::Stored { blocks: to - from });
}

/// Stores blocks `from..to` in group 1 (a window group) of `slot`.
fn store_window(index: &mut KvIndex, slot: WorkerSlot, t: &[u32], from: usize, to: usize) {
    let hashes: Vec<u64> = (from..to).map(engine).collect();
    let e = GroupEvent {
        group_idx: 1,
        kind: Some(WINDOW),
        parent: from.checked_sub(1).map(engine),
        block_hashes: &hashes,
        token_ids: &t[from * BS..to * BS],
        block_size: BS,
        root_seed: XXH3_SEED,
    };
    assert_eq!(index.store_group(slot, e), GroupStore::Stored { blocks: to - from });
}

/// `find_matches` then `cap_by_groups`, as the route step reads them: (slot, blocks).
fn usable(index: &KvIndex, t: &[u32], max_blocks: u32) -> OverlapScores {
    let chains = sequence_hashes(t, BS, XXH3_SEED);
    let mut scores = index.find_matches(&chains);
    let mut tiers = TierScores::new();
    index.cap_by_groups(&chains, max_blocks, &mut scores, &mut tiers);
    scores.sort_unstable();
    scores
}

#[test]
fn a_worker_without_groups_keeps_its_match() {
    let t = tokens(8);
    let mut index = index();
    store_main(&mut index, 0, &t, 0, 8);
    assert_eq!(usable(&index, &t, 8), vec![(0, 8)]);
    assert_eq!(index.group_entries(), 0);
}

#[test]
fn the_window_group_cuts_the_main_match_where_its_window_is_not_held() {
    let t = tokens(8);
    let mut index = index();
    // Worker 0: both groups hold the whole prompt. Worker 1: the window group lost blocks 5..8
    // (vLLM evicts them first: a finished request frees its tail first).
    for slot in [0, 1] {
        store_main(&mut index, slot, &t, 0, 8);
        store_window(&mut index, slot, &t, 0, 8);
    }
    let gone: Vec<u64> = (5..8).map(engine).collect();
    assert_eq!(index.remove_group(1, 1, &gone), 0);
    assert_eq!(usable(&index, &t, 8), vec![(0, 8), (1, 5)]);
    // The last-token rule decides the window's answer: capped at 7, worker 0 needs blocks 5 and
    // 6 (held) and worker 1 still ends at 5.
    assert_eq!(usable(&index, &t, 7), vec![(0, 7), (1, 5)]);
    // Blocks before the window do not matter: without 0..3, a hit of 5 still stands.
    let early: Vec<u64> = (0..3).map(engine).collect();
    index.remove_group(1, 1, &early);
    assert_eq!(usable(&index, &t, 8), vec![(0, 8), (1, 5)]);
    // Block 4 gone too: no two held blocks end anywhere below 5, nor a run from block 0.
    index.remove_group(1, 1, &[engine(4)]);
    assert_eq!(usable(&index, &t, 8), vec![(0, 8)]);
    assert_eq!(index.group_entries(), 8 + 1);
}

#[test]
fn a_window_store_chains_through_the_main_group_when_its_parent_is_not_in_it() {
    let t = tokens(8);
    let mut index = index();
    store_main(&mut index, 0, &t, 0, 8);
    // The window group got blocks 6..8 only, continuing block 5 that it never held.
    store_window(&mut index, 0, &t, 6, 8);
    assert_eq!(usable(&index, &t, 8), vec![(0, 8)]);
    // Without the main group's mapping of the parent, the store is an orphan and claims nothing.
    let hashes = [engine(7)];
    let e = GroupEvent {
        group_idx: 1,
        kind: Some(WINDOW),
        parent: Some(999),
        block_hashes: &hashes,
        token_ids: &t[7 * BS..8 * BS],
        block_size: BS,
        root_seed: XXH3_SEED,
    };
    assert_eq!(index.store_group(1, e), GroupStore::Orphan);
    assert_eq!(index.worker_groups(1), vec![(1, WINDOW, 0)]);
}

#[test]
fn a_store_that_skipped_blocks_maps_its_hashes_through_the_main_group() {
    let t = tokens(8);
    let mut index = index();
    store_main(&mut index, 0, &t, 0, 8);
    // vLLM's window group cached blocks 5 and 7 of the range 0..8 (the others null or masked
    // out): the token ids of the whole range, the hashes of those two.
    let hashes = [engine(5), engine(7)];
    let e = GroupEvent {
        group_idx: 1,
        kind: Some(WINDOW),
        parent: None,
        block_hashes: &hashes,
        token_ids: &t,
        block_size: BS,
        root_seed: XXH3_SEED,
    };
    assert_eq!(index.store_group(0, e), GroupStore::Stored { blocks: 2 });
    let chains = sequence_hashes(&t, BS, XXH3_SEED);
    let g = &index.groups.of(0)[0];
    let held: Vec<usize> = (0..8).filter(|&i| g.holds(chains[i])).collect();
    assert_eq!(held, vec![5, 7], "each hash at its own position");
    // A hash the main group does not map is left out.
    let e = GroupEvent { block_hashes: &[77], ..e };
    assert_eq!(index.store_group(0, e), GroupStore::Stored { blocks: 0 });
}

#[test]
fn clearing_a_worker_empties_its_groups_but_keeps_them_and_a_new_slot_has_none() {
    let t = tokens(8);
    let mut index = index();
    store_main(&mut index, 0, &t, 0, 8);
    store_window(&mut index, 0, &t, 0, 8);
    index.clear_worker(0);
    assert_eq!(index.worker_groups(0), vec![(1, WINDOW, 0)]);
    assert_eq!(index.group_entries(), 0);
    // The main group is back, the window group not yet: nothing can be served.
    store_main(&mut index, 0, &t, 0, 8);
    assert_eq!(usable(&index, &t, 8), vec![]);
    // The slot goes to another worker, which publishes no group: its match stands.
    index.remove_worker(0);
    index.add_worker(0);
    store_main(&mut index, 0, &t, 0, 8);
    assert_eq!(index.worker_groups(0), vec![]);
    assert_eq!(usable(&index, &t, 8), vec![(0, 8)]);
}

#[test]
fn groups_are_bounded() {
    let t = tokens(8);
    // Every group together holds at most `max_entries` mappings: a store past it is refused.
    let mut index = KvIndex::new(10, 100);
    index.add_worker(0);
    store_main(&mut index, 0, &t, 0, 8);
    store_window(&mut index, 0, &t, 0, 8);
    let hashes = [engine(8), engine(9), engine(10)];
    let more = tokens(11);
    let e = GroupEvent {
        group_idx: 1,
        kind: Some(WINDOW),
        parent: Some(engine(7)),
        block_hashes: &hashes,
        token_ids: &more[8 * BS..],
        block_size: BS,
        root_seed: XXH3_SEED,
    };
    assert_eq!(index.store_group(0, e), GroupStore::Full);
    assert_eq!(index.group_entries(), 8);
    // A group past `max_blocks_per_worker` mappings lost removals: it is cleared.
    let mut index = KvIndex::new(100, 6);
    index.add_worker(0);
    let hashes: Vec<u64> = (0..8).map(engine).collect();
    let e = GroupEvent { block_hashes: &hashes, token_ids: &t, parent: None, ..e };
    assert_eq!(index.store_group(0, e), GroupStore::TooManyBlocks);
    assert_eq!(index.group_entries(), 0);
    // Group indices past MAX_GROUPS are refused; so is a slot not registered.
    let e = GroupEvent { group_idx: MAX_GROUPS, ..e };
    assert_eq!(index.store_group(0, e), GroupStore::Refused);
    let e = GroupEvent { group_idx: 1, ..e };
    assert_eq!(index.store_group(7, e), GroupStore::Refused);
    assert!(index.approx_bytes() > 0);
}

#[test]
fn duplicate_stores_need_as_many_removals() {
    let t = tokens(4);
    let mut index = index();
    store_main(&mut index, 0, &t, 0, 4);
    store_window(&mut index, 0, &t, 0, 4);
    store_window(&mut index, 0, &t, 0, 4);
    assert_eq!(index.group_entries(), 4);
    let all: Vec<u64> = (0..4).map(engine).collect();
    assert_eq!(index.remove_group(0, 1, &all), 0);
    assert_eq!(usable(&index, &t, 4), vec![(0, 4)], "one copy of each block is left");
    index.remove_group(0, 1, &all);
    assert_eq!((index.group_entries(), usable(&index, &t, 4)), (0, vec![]));
    assert_eq!(index.remove_group(0, 1, &all), 4, "unknown now");
}

proptest::proptest! {
    /// Against the rule read directly off a model of the groups' holdings: a worker's usable
    /// overlap is the window rule over its window group's blocks, capped by its main match and the
    /// last-token rule, whatever was stored and removed in either group.
    #[test]
    fn the_usable_overlap_is_the_rule_over_what_the_groups_hold(
        main_to in 0usize..12,
        window_held in proptest::collection::vec(proptest::bool::ANY, 12),
        max_blocks in 0u32..14,
    ) {
        let t = tokens(12);
        let mut index = index();
        if main_to > 0 {
            store_main(&mut index, 0, &t, 0, main_to);
        }
        store_window(&mut index, 0, &t, 0, 12);
        let gone: Vec<u64> = (0..12).filter(|i| !window_held[*i]).map(engine).collect();
        index.remove_group(0, 1, &gone);
        let cap = main_to.min(max_blocks as usize);
        let want = group_rule::window_hit(cap, 2, |i| window_held[i]);
        let got = usable(&index, &t, max_blocks);
        let want = if want == 0 { vec![] } else { vec![(0, want as u32)] };
        proptest::prop_assert_eq!(got, want);
    }
}
