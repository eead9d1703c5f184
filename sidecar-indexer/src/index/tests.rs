use super::*;
use kvmesh_core::hashing::{sequence_hashes, XXH3_SEED};

const BS: usize = 4;

fn toks(range: std::ops::Range<u32>) -> Vec<u32> {
    range.collect()
}

/// Engine hashes for a test: distinct per (worker, block) so nothing accidentally lines up.
fn engine(worker: u32, block: u64) -> u64 {
    (u64::from(worker) << 32) | block
}

fn index_with(workers: &[WorkerSlot]) -> KvIndex {
    let mut idx = KvIndex::new(1_000_000, 1_000_000);
    for &w in workers {
        idx.add_worker(w);
    }
    idx
}

fn matches(idx: &KvIndex, tokens: &[u32]) -> Vec<(WorkerSlot, u32)> {
    let mut m = idx.find_matches(&sequence_hashes(tokens, BS, XXH3_SEED));
    m.sort_unstable();
    m
}

#[test]
fn store_then_match_prefixes() {
    let mut idx = index_with(&[0, 1]);
    // Worker 0: blocks 0..4 in one store. Worker 1: blocks 0..2 then 2..3 chained by parent.
    let t = toks(0..16);
    assert_eq!(
        idx.store(
            0,
            None,
            &[engine(0, 0), engine(0, 1), engine(0, 2), engine(0, 3)],
            &t,
            BS,
            XXH3_SEED
        ),
        StoreOutcome::Stored { blocks: 4 }
    );
    assert_eq!(
        idx.store(1, None, &[engine(1, 0), engine(1, 1)], &t[..8], BS, XXH3_SEED),
        StoreOutcome::Stored { blocks: 2 }
    );
    assert_eq!(
        idx.store(1, Some(engine(1, 1)), &[engine(1, 2)], &t[8..12], BS, XXH3_SEED),
        StoreOutcome::Stored { blocks: 1 }
    );
    assert_eq!(matches(&idx, &t), vec![(0, 4), (1, 3)]);
    assert_eq!(matches(&idx, &t[..9]), vec![(0, 2), (1, 2)], "partial last block is not hashed");
    assert_eq!(matches(&idx, &toks(100..116)), vec![]);
    assert_eq!(idx.blocks(), 4);
    assert_eq!(idx.entries(), 7);
    // The chain hashes are exactly core's.
    let want = sequence_hashes(&t, BS, XXH3_SEED);
    assert!(want.iter().all(|c| idx.holds(0, *c)));
}

#[test]
fn branches_share_their_prefix() {
    let mut idx = index_with(&[0]);
    let a: Vec<u32> = toks(0..12);
    let mut b = toks(0..8);
    b.extend(50..54);
    idx.store(0, None, &[1, 2, 3], &a, BS, XXH3_SEED);
    idx.store(0, Some(2), &[4], &b[8..], BS, XXH3_SEED);
    assert_eq!(matches(&idx, &a), vec![(0, 3)]);
    assert_eq!(matches(&idx, &b), vec![(0, 3)]);
    assert_eq!(idx.blocks(), 4);
    // Removing one branch leaves the other and the shared prefix.
    assert_eq!(idx.remove(0, &[3]), 0);
    assert_eq!(matches(&idx, &a), vec![(0, 2)]);
    assert_eq!(matches(&idx, &b), vec![(0, 3)]);
}

#[test]
fn match_stops_at_the_first_missing_block_even_if_later_ones_are_held() {
    let mut idx = index_with(&[0]);
    let t = toks(0..12);
    idx.store(0, None, &[1, 2, 3], &t, BS, XXH3_SEED);
    idx.remove(0, &[2]);
    assert_eq!(matches(&idx, &t), vec![(0, 1)]);
}

#[test]
fn unknown_parent_is_an_orphan_and_changes_nothing() {
    let mut idx = index_with(&[0]);
    let t = toks(0..8);
    assert_eq!(idx.store(0, Some(999), &[1, 2], &t, BS, XXH3_SEED), StoreOutcome::Orphan);
    assert_eq!(idx.blocks(), 0);
    assert_eq!(idx.worker_blocks(0), 0);
    // Its children are orphans too: nothing was recorded for them to chain from.
    assert_eq!(idx.store(0, Some(2), &[3], &t[..4], BS, XXH3_SEED), StoreOutcome::Orphan);
}

#[test]
fn malformed_and_unregistered_stores_are_refused() {
    let mut idx = index_with(&[0]);
    assert_eq!(idx.store(0, None, &[1, 2], &toks(0..7), BS, XXH3_SEED), StoreOutcome::Malformed);
    assert_eq!(idx.store(5, None, &[1], &toks(0..4), BS, XXH3_SEED), StoreOutcome::UnknownWorker);
    assert_eq!(idx.blocks(), 0);
}

#[test]
fn unknown_removals_are_counted_not_applied() {
    let mut idx = index_with(&[0]);
    idx.store(0, None, &[1], &toks(0..4), BS, XXH3_SEED);
    assert_eq!(idx.remove(0, &[7, 1, 8]), 2);
    assert_eq!(idx.blocks(), 0);
}

#[test]
fn duplicate_stores_need_as_many_removals() {
    let mut idx = index_with(&[0]);
    let t = toks(0..4);
    idx.store(0, None, &[1], &t, BS, XXH3_SEED);
    idx.store(0, None, &[1], &t, BS, XXH3_SEED);
    idx.remove(0, &[1]);
    assert_eq!(matches(&idx, &t), vec![(0, 1)]);
    idx.remove(0, &[1]);
    assert_eq!(matches(&idx, &t), vec![]);
}

#[test]
fn clear_and_remove_worker_drop_only_that_worker() {
    let mut idx = index_with(&[0, 1]);
    let t = toks(0..8);
    idx.store(0, None, &[1, 2], &t, BS, XXH3_SEED);
    idx.store(1, None, &[1, 2], &t, BS, XXH3_SEED);
    idx.clear_worker(0);
    assert_eq!(matches(&idx, &t), vec![(1, 2)]);
    // A cleared worker stays registered and can store again.
    assert_eq!(
        idx.store(0, None, &[9], &t[..4], BS, XXH3_SEED),
        StoreOutcome::Stored { blocks: 1 }
    );
    idx.remove_worker(1);
    assert_eq!(matches(&idx, &t), vec![(0, 1)]);
    assert_eq!(idx.store(1, None, &[1], &t[..4], BS, XXH3_SEED), StoreOutcome::UnknownWorker);
    idx.remove_worker(0);
    assert_eq!((idx.blocks(), idx.entries()), (0, 0));
}

#[test]
fn seeds_separate_salted_chains_and_children_inherit_the_seed() {
    let mut idx = index_with(&[0]);
    let salted = hashing::block_seed(None, Some("tenant-a"));
    let t = toks(0..8);
    idx.store(0, None, &[1], &t[..4], BS, salted);
    idx.store(0, Some(1), &[2], &t[4..], BS, XXH3_SEED); // child event carries no salt
    assert_eq!(matches(&idx, &t), vec![]);
    let mut m = idx.find_matches(&sequence_hashes(&t, BS, salted));
    m.sort_unstable();
    assert_eq!(m, vec![(0, 2)]);
}

#[test]
fn salts_cycled_by_clients_cannot_fill_the_seed_table_for_good() {
    // Issue 43.6: every new cache_salt an engine reports took a seed id for ever; once the table
    // was full every new salt's store was refused. Ids no mapping uses are reclaimed now.
    let mut idx = index_with(&[0, 1]);
    idx.seeds = seeds::SeedTable::new(3); // the unsalted seed and two salts
    let salt = |i: u32| hashing::block_seed(None, Some(&format!("client-{i}")));
    let t = toks(0..8);
    assert!(matches!(idx.store(0, None, &[1], &t[..4], BS, salt(1)), StoreOutcome::Stored { .. }));
    assert!(matches!(idx.store(1, None, &[1], &t[..4], BS, salt(2)), StoreOutcome::Stored { .. }));
    // A child inherits its parent's seed: no new seed, and its mapping counts for the seed.
    assert!(matches!(
        idx.store(0, Some(1), &[2], &t[4..], BS, XXH3_SEED),
        StoreOutcome::Stored { .. }
    ));
    assert_eq!(idx.store(0, None, &[3], &t[..4], BS, salt(3)), StoreOutcome::SeedTableFull);
    assert_eq!(idx.seed_refusals(), 1);
    idx.remove(0, &[1]);
    assert_eq!(
        idx.store(0, None, &[3], &t[..4], BS, salt(3)),
        StoreOutcome::SeedTableFull,
        "salt 1 still has a block (the child)"
    );
    idx.remove(0, &[2]);
    assert!(matches!(idx.store(0, None, &[3], &t[..4], BS, salt(3)), StoreOutcome::Stored { .. }));
    idx.clear_worker(1);
    assert!(matches!(idx.store(1, None, &[4], &t[..4], BS, salt(4)), StoreOutcome::Stored { .. }));
    assert_eq!(idx.seeds(), 3);
    assert_eq!(idx.check_consistent(), Ok(()));
    // What is stored under a reused id matches under its own seed only.
    let mut m = idx.find_matches(&sequence_hashes(&t[..4], BS, salt(4)));
    m.sort_unstable();
    assert_eq!(m, vec![(1, 1)]);
    assert_eq!(idx.find_matches(&sequence_hashes(&t[..4], BS, salt(2))), vec![]);
}

#[test]
fn many_workers_use_bitmaps_and_still_match_exactly() {
    let slots: Vec<WorkerSlot> = (0..200).collect();
    let mut idx = index_with(&slots);
    let t = toks(0..40); // 10 blocks
    for &w in &slots {
        // Worker w holds the first (w % 10) + 1 blocks.
        let n = (w as usize % 10) + 1;
        let hashes: Vec<u64> = (0..n as u64).map(|b| engine(w, b)).collect();
        idx.store(w, None, &hashes, &t[..n * BS], BS, XXH3_SEED);
    }
    let m = matches(&idx, &t);
    assert_eq!(m.len(), 200);
    for (w, depth) in m {
        assert_eq!(depth as usize, (w as usize % 10) + 1, "worker {w}");
    }
}

#[test]
fn memory_bound_evicts_least_recently_used_blocks() {
    let mut idx = KvIndex::new(8, 1_000);
    idx.add_worker(0);
    let hot = toks(0..8);
    idx.store(0, None, &[1, 2], &hot, BS, XXH3_SEED);
    for i in 0..10u32 {
        // Keep the hot prefix referenced while cold single blocks stream in.
        assert_eq!(matches(&idx, &hot), vec![(0, 2)], "round {i}");
        let cold = toks(1000 + i * 4..1004 + i * 4);
        idx.store(0, None, &[100 + u64::from(i)], &cold, BS, XXH3_SEED);
        assert!(idx.entries() <= 8);
    }
    assert!(idx.evictions() >= 4);
    assert_eq!(matches(&idx, &hot), vec![(0, 2)]);
    // Evicted blocks keep their mapping, so a child of one still chains (and is found by its hash).
    assert_eq!(
        idx.store(0, Some(100), &[200], &toks(5000..5004), BS, XXH3_SEED),
        StoreOutcome::Stored { blocks: 1 }
    );
}

#[test]
fn per_worker_bound_asks_for_a_resync() {
    let mut idx = KvIndex::new(1_000, 3);
    idx.add_worker(0);
    assert_eq!(
        idx.store(0, None, &[1, 2, 3, 4], &toks(0..16), BS, XXH3_SEED),
        StoreOutcome::TooManyBlocks
    );
}

#[test]
fn approximate_chains_insert_idempotently_and_remove() {
    let mut idx = index_with(&[0]);
    let chains = sequence_hashes(&toks(0..12), BS, XXH3_SEED);
    idx.insert_chain(0, &chains);
    idx.insert_chain(0, &chains);
    assert_eq!(idx.find_matches(&chains), vec![(0, 3)]);
    idx.remove(0, &[chains[2].0]);
    assert_eq!(idx.find_matches(&chains), vec![(0, 2)]);
    assert_eq!(idx.remove(0, &[chains[0].0, chains[1].0]), 0);
    assert_eq!(idx.blocks(), 0);
}

proptest::proptest! {
    // Random store/remove/clear sequences: the index always equals a model built from the same ops.
    #[test]
    fn index_matches_a_model(ops in proptest::collection::vec((0u8..4, 0u32..3, 0u64..6, 1usize..4), 1..80)) {
        use std::collections::{BTreeMap, BTreeSet};
        let mut idx = index_with(&[0, 1, 2]);
        // model: worker -> engine hash -> (chain, refs); chains computed the obvious way.
        let mut model: BTreeMap<u32, BTreeMap<u64, (u64, u32)>> = BTreeMap::new();
        for (op, w, h, n) in ops {
            let block_tokens = |e: u64| -> Vec<u32> { (0..BS as u32).map(|i| (e as u32) * 10 + i).collect() };
            match op {
                0 | 1 => {
                    // store a chain of n blocks with engine hashes h, h+1, … from the root or from h-1
                    let parent = if op == 1 && h > 0 { Some(h - 1) } else { None };
                    let hashes: Vec<u64> = (h..h + n as u64).collect();
                    let tokens: Vec<u32> = hashes.iter().flat_map(|e| block_tokens(*e)).collect();
                    let wm = model.entry(w).or_default();
                    let prev = match parent {
                        None => Some(None),
                        Some(p) => wm.get(&p).map(|(c, _)| Some(SequenceHash(*c))),
                    };
                    let outcome = idx.store(w, parent, &hashes, &tokens, BS, XXH3_SEED);
                    match prev {
                        None => proptest::prop_assert_eq!(outcome, StoreOutcome::Orphan),
                        Some(mut prev) => {
                            for e in &hashes {
                                let c = hashing::chain(prev, hashing::local_block_hash(&block_tokens(*e), XXH3_SEED));
                                let slot = wm.entry(*e).or_insert((c.0, 0));
                                if slot.0 != c.0 { *slot = (c.0, 0); }
                                slot.1 += 1;
                                prev = Some(c);
                            }
                        }
                    }
                }
                2 => {
                    idx.remove(w, &[h]);
                    let wm = model.entry(w).or_default();
                    if let Some(slot) = wm.get_mut(&h) {
                        slot.1 -= 1;
                        if slot.1 == 0 { wm.remove(&h); }
                    }
                }
                _ => {
                    idx.clear_worker(w);
                    model.remove(&w);
                }
            }
            proptest::prop_assert_eq!(idx.check_consistent(), Ok(()));
            for w in 0..3u32 {
                let want: BTreeSet<u64> = model.get(&w).map(|m| m.values().map(|(c, _)| *c).collect()).unwrap_or_default();
                let got: BTreeSet<u64> = idx.worker_refs(w).iter().filter(|(_, r)| idx.holds(w, r.chain)).map(|(_, r)| r.chain.0).collect();
                proptest::prop_assert_eq!(&got, &want);
            }
        }
    }
}

/// The canonical prompt of the model tests: blocks of engine hashes 0, 1, 2, … chained in order.
fn canonical_chains(len: u64) -> Vec<SequenceHash> {
    let block_tokens =
        |e: u64| -> Vec<u32> { (0..BS as u32).map(|i| (e as u32) * 10 + i).collect() };
    let tokens: Vec<u32> = (0..len).flat_map(block_tokens).collect();
    sequence_hashes(&tokens, BS, XXH3_SEED)
}

fn sorted(mut v: OverlapScores) -> OverlapScores {
    v.sort_unstable();
    v
}

proptest::proptest! {
    // Galloping find_matches agrees with the block-by-block walk after any history: in-order and
    // out-of-order removals (dirty workers), batches, clears, and memory-bound evictions.
    #[test]
    fn galloping_equals_the_exact_walk(
        ops in proptest::collection::vec((0u8..5, 0u32..40, 0u64..12, 1usize..6), 1..120),
        max_entries in proptest::sample::select(vec![8usize, 1_000_000]),
    ) {
        let mut idx = KvIndex::new(max_entries, 1_000_000);
        for w in 0..40 { idx.add_worker(w); }
        let block_tokens = |e: u64| -> Vec<u32> { (0..BS as u32).map(|i| (e as u32) * 10 + i).collect() };
        for (op, w, h, n) in ops {
            match op {
                0 | 1 => {
                    // Chains of engine hashes h..h+n, from the root (op 0, only at h = 0 to build the
                    // canonical prompt) or continuing after h-1.
                    let (start, parent) = if op == 0 { (0, None) } else { (h, h.checked_sub(1)) };
                    let hashes: Vec<u64> = (start..start + n as u64).collect();
                    let tokens: Vec<u32> = hashes.iter().flat_map(|e| block_tokens(*e)).collect();
                    idx.store(w, parent, &hashes, &tokens, BS, XXH3_SEED);
                }
                2 => { idx.remove(w, &[h]); }
                3 => {
                    // A tail-first batch (clean) or, for odd h, parent-first (still one batch).
                    let mut batch: Vec<u64> = (h..h + n as u64).collect();
                    if h % 2 == 0 { batch.reverse(); }
                    idx.remove(w, &batch);
                }
                _ => idx.clear_worker(w),
            }
            proptest::prop_assert_eq!(idx.check_consistent(), Ok(()));
            for len in [1u64, 3, 8, 14] {
                let chains = canonical_chains(len);
                proptest::prop_assert_eq!(sorted(idx.find_matches(&chains)), sorted(idx.walk(&chains)));
            }
        }
    }
}

#[test]
fn clean_workers_gallop_and_dirty_ones_are_still_exact() {
    let mut idx = index_with(&[0, 1]);
    let t = toks(0..64); // 16 blocks
    let hashes: Vec<u64> = (1..=16).collect();
    idx.store(0, None, &hashes, &t, BS, XXH3_SEED);
    idx.store(1, None, &hashes[..10], &t[..40], BS, XXH3_SEED);
    assert_eq!(matches(&idx, &t), vec![(0, 16), (1, 10)]);
    // Tail-first eviction keeps worker 0 clean.
    idx.remove(0, &[16, 15]);
    assert_eq!(idx.dirty_words.first().copied().unwrap_or(0), 0);
    assert_eq!(matches(&idx, &t), vec![(0, 14), (1, 10)]);
    // Removing a middle block makes worker 1 dirty; the answer stays exact (held prefix is 4).
    idx.remove(1, &[5]);
    assert_ne!(idx.dirty_words.first().copied().unwrap_or(0), 0);
    assert_eq!(matches(&idx, &t), vec![(0, 14), (1, 4)]);
    // Clearing makes it clean again.
    idx.clear_worker(1);
    assert_eq!(idx.dirty_words.first().copied().unwrap_or(0), 0);
}

#[test]
fn one_shot_block_hash_equals_cores_streaming_hash() {
    let seeds = [XXH3_SEED, hashing::block_seed(Some("lora"), Some("salt")), 0];
    for n in [0usize, 1, 3, 4, 16, 59, 60, 61, 64, 128, 255, 256, 257, 1000] {
        let tokens: Vec<u32> = (0..n as u32).map(|t| t.wrapping_mul(2_654_435_761)).collect();
        for seed in seeds {
            assert_eq!(
                block_hash(&tokens, seed),
                hashing::local_block_hash(&tokens, seed),
                "{n} tokens, seed {seed}"
            );
        }
    }
}

#[test]
fn clock_keeps_used_blocks_and_counts_evictions() {
    let mut idx = KvIndex::new(4, 1_000);
    idx.add_worker(0);
    let root = |i: u32| toks(10_000 + i * 4..10_004 + i * 4);
    for i in 0..4u32 {
        idx.store(0, None, &[u64::from(i)], &root(i), BS, XXH3_SEED);
    }
    assert_eq!((idx.entries(), idx.evictions()), (4, 0));
    for i in 4..40u32 {
        // Block 0 is used between stores; the others never are.
        assert_eq!(matches(&idx, &root(0)), vec![(0, 1)], "store {i}");
        idx.store(0, None, &[u64::from(i)], &root(i), BS, XXH3_SEED);
        assert_eq!(idx.entries(), 4);
        assert_eq!(idx.evictions(), u64::from(i) - 3);
    }
    // Evicted blocks leave the index but not the worker's mappings.
    assert_eq!(idx.worker_blocks(0), 40);
    assert_eq!(idx.blocks(), 4);
    // A block stored again counts as used too.
    let mut idx = KvIndex::new(2, 1_000);
    idx.add_worker(0);
    idx.store(0, None, &[1], &root(1), BS, XXH3_SEED);
    for i in 2..20u32 {
        idx.store(0, None, &[1], &root(1), BS, XXH3_SEED);
        idx.store(0, None, &[u64::from(i)], &root(i), BS, XXH3_SEED);
        assert!(idx.holds(0, sequence_hashes(&root(1), BS, XXH3_SEED)[0]), "store {i}");
    }
}

#[test]
fn eviction_of_a_widely_held_block_releases_its_bitmap() {
    let slots: Vec<WorkerSlot> = (0..6).collect();
    let mut idx = KvIndex::new(6, 1_000);
    for &w in &slots {
        idx.add_worker(w);
    }
    let shared = toks(0..4);
    for &w in &slots {
        idx.store(w, None, &[1], &shared, BS, XXH3_SEED);
    }
    assert_eq!((idx.blocks(), idx.entries()), (1, 6));
    assert!(idx.bitmaps.bytes() > 0, "six holders live in a bitmap");
    // A tighter bound (a reload) cannot be met while the six-holder block stays.
    idx.set_limits(1, 1_000);
    assert!(idx.entries() <= 1);
    assert_eq!((idx.blocks(), idx.evictions()), (0, 1));
    assert_eq!(idx.bitmaps.bytes(), 0);
    assert_eq!(matches(&idx, &shared), vec![]);
    // Every former holder is dirty now (its mapping stayed, the block left); matching stays exact.
    assert!(slots.iter().all(|&w| idx.dirty_words[0] & (1 << w) != 0));
}

#[test]
fn removing_workers_one_by_one_frees_their_entries_and_bitmaps() {
    let slots: Vec<WorkerSlot> = (0..6).collect();
    let mut idx = index_with(&slots);
    let shared = toks(0..32); // 8 blocks everyone holds
    for &w in &slots {
        let hashes: Vec<u64> = (0..8).map(|b| engine(w, b)).collect();
        idx.store(w, None, &hashes, &shared, BS, XXH3_SEED);
        // And a private 4-block chain.
        let own = toks(1000 * (w + 1)..1000 * (w + 1) + 16);
        idx.store(
            w,
            None,
            &[engine(w, 100), engine(w, 101), engine(w, 102), engine(w, 103)],
            &own,
            BS,
            XXH3_SEED,
        );
    }
    assert_eq!((idx.blocks(), idx.entries()), (8 + 6 * 4, 6 * 12));
    let full = idx.approx_bytes();
    for (i, &w) in slots.iter().enumerate() {
        idx.remove_worker(w);
        let left = slots.len() - i - 1;
        assert_eq!(idx.entries(), left * 12, "after removing {w}");
        assert_eq!(idx.blocks(), if left > 0 { 8 + left * 4 } else { 0 });
        let want: Vec<(WorkerSlot, u32)> = slots[i + 1..].iter().map(|&s| (s, 8)).collect();
        assert_eq!(matches(&idx, &shared), want);
        if left <= 3 {
            assert_eq!(idx.bitmaps.bytes(), 0, "three holders fit inline");
        }
        assert_eq!(
            idx.store(w, None, &[1], &shared[..4], BS, XXH3_SEED),
            StoreOutcome::UnknownWorker
        );
    }
    assert!(idx.approx_bytes() < full, "tables shrink once empty");
}

#[test]
fn slots_above_the_packed_limit_are_not_registered() {
    let mut idx = KvIndex::new(1_000, 1_000);
    idx.add_worker(MAX_SLOT + 1);
    assert_eq!(
        idx.store(MAX_SLOT + 1, None, &[1], &toks(0..4), BS, XXH3_SEED),
        StoreOutcome::UnknownWorker
    );
    idx.add_worker(MAX_SLOT);
    for w in 0..4 {
        idx.add_worker(w);
    }
    let t = toks(0..8);
    for w in [MAX_SLOT, 0, 1, 2, 3] {
        idx.store(w, None, &[1, 2], &t, BS, XXH3_SEED);
    }
    assert_eq!(matches(&idx, &t), vec![(0, 2), (1, 2), (2, 2), (3, 2), (MAX_SLOT, 2)]);
}

fn note(idx: &KvIndex, slot: WorkerSlot, tokens: &[u32]) {
    note_known(idx, slot, tokens, 0);
}

/// Notes a prompt routed to `slot` where the index knew its first `known` blocks.
fn note_known(idx: &KvIndex, slot: WorkerSlot, tokens: &[u32], known: usize) {
    let chains: std::sync::Arc<[SequenceHash]> = sequence_hashes(tokens, BS, XXH3_SEED).into();
    let locals: std::sync::Arc<[kvmesh_core::hashing::LocalBlockHash]> =
        kvmesh_core::hashing::local_block_hashes(tokens, BS, XXH3_SEED).into();
    idx.note_routed(slot, chains, locals, known);
}

#[test]
fn an_orphan_chained_to_a_routed_prompt_is_recovered() {
    // The engine caches a 64-block prefix the index never saw (it left the replay buffer before a
    // restart). A continuation of it is routed to worker 0, and the engine stores its new blocks
    // chained to the prefix's last block.
    let mut idx = index_with(&[0, 1]);
    let prefix = toks(0..256);
    let continuation = toks(0..272);
    assert_eq!(
        idx.store(0, Some(engine(0, 63)), &[engine(0, 64)], &continuation[256..260], BS, XXH3_SEED),
        StoreOutcome::Orphan,
        "nothing routed yet"
    );
    note(&idx, 1, &continuation);
    assert_eq!(
        idx.store(0, Some(engine(0, 63)), &[engine(0, 64)], &continuation[256..260], BS, XXH3_SEED),
        StoreOutcome::Orphan,
        "routed to another worker"
    );
    note(&idx, 0, &continuation);
    let new: Vec<u64> = (64..68).map(|b| engine(0, b)).collect();
    assert_eq!(
        idx.store(0, Some(engine(0, 63)), &new, &continuation[256..272], BS, XXH3_SEED),
        StoreOutcome::Recovered { blocks: 4 }
    );
    assert_eq!(matches(&idx, &continuation), vec![(0, 68)], "the whole chain is known again");
    assert_eq!(matches(&idx, &prefix), vec![(0, 64)]);
    // Later stores chain as usual from the recovered blocks.
    assert_eq!(
        idx.store(0, Some(engine(0, 67)), &[engine(0, 68)], &toks(272..276), BS, XXH3_SEED),
        StoreOutcome::Stored { blocks: 1 }
    );
    // The engine evicts the tail first: its real blocks, then the recovered parent; the synthetic
    // ancestors leave with their last child, so nothing stale stays behind.
    let tail: Vec<u64> = (64..69).rev().map(|b| engine(0, b)).collect();
    assert_eq!(idx.remove(0, &tail), 0);
    assert_eq!(matches(&idx, &continuation), vec![(0, 64)]);
    assert_eq!(idx.check_consistent(), Ok(()));
    assert_eq!(idx.remove(0, &[engine(0, 63)]), 0);
    assert_eq!(matches(&idx, &prefix), vec![]);
    assert_eq!(idx.worker_blocks(0), 0);
    assert_eq!((idx.entries(), idx.check_consistent()), (0, Ok(())));
}

#[test]
fn only_blocks_past_what_the_index_knew_are_looked_up() {
    // A continuation routed where the index knew its first 60 of 68 blocks: an orphan store
    // starting at block 64 (the engine cached more than the index knew) is recovered; one
    // starting inside the known part is not looked up (its parent was known when routed).
    let mut idx = index_with(&[0]);
    let prompt = toks(0..272);
    note_known(&idx, 0, &prompt, 60);
    assert_eq!(
        idx.store(0, Some(engine(0, 40)), &[engine(0, 41)], &prompt[164..168], BS, XXH3_SEED),
        StoreOutcome::Orphan
    );
    let new: Vec<u64> = (64..68).map(|b| engine(0, b)).collect();
    assert_eq!(
        idx.store(0, Some(engine(0, 63)), &new, &prompt[256..272], BS, XXH3_SEED),
        StoreOutcome::Recovered { blocks: 4 }
    );
    assert_eq!(matches(&idx, &prompt), vec![(0, 68)]);
    // A prompt the index knew whole is not remembered at all.
    let before = idx.recovery_blocks();
    note_known(&idx, 0, &toks(1000..1064), 16);
    assert_eq!(idx.recovery_blocks(), before);
    assert_eq!(idx.check_consistent(), Ok(()));
}

#[test]
fn an_orphan_that_disagrees_with_the_routed_prompt_stays_an_orphan() {
    let mut idx = index_with(&[0]);
    let routed = toks(0..64);
    note(&idx, 0, &routed);
    // Block 8's content matches, block 9's does not: not this prompt's continuation.
    let mut stored = routed[32..40].to_vec();
    stored[5] = 9999;
    assert_eq!(
        idx.store(0, Some(engine(0, 7)), &[engine(0, 8), engine(0, 9)], &stored, BS, XXH3_SEED),
        StoreOutcome::Orphan
    );
    // A store whose first block is the prompt's block 0 has no parent to learn.
    assert_eq!(
        idx.store(0, Some(engine(0, 99)), &[engine(0, 0)], &routed[..4], BS, XXH3_SEED),
        StoreOutcome::Orphan
    );
    assert_eq!(idx.worker_blocks(0), 0);
}

#[test]
fn routed_prompt_memory_is_bounded_by_blocks() {
    let idx = index_with(&[0]);
    idx.set_recovery_blocks(100);
    for i in 0..50u32 {
        note(&idx, 0, &toks(i * 1000..i * 1000 + 160));
    }
    assert!(idx.recovery_blocks() <= 100, "{}", idx.recovery_blocks());
    assert_eq!(idx.recovery_blocks(), 80, "the two newest 40-block prompts");
    let mut idx = idx;
    // The oldest prompts are forgotten: their continuations cannot be recovered any more.
    assert_eq!(idx.store(0, Some(1), &[2], &toks(4..8), BS, XXH3_SEED), StoreOutcome::Orphan);
    assert_eq!(
        idx.store(0, Some(1), &[2], &toks(49_004..49_008), BS, XXH3_SEED),
        StoreOutcome::Recovered { blocks: 1 }
    );
}
