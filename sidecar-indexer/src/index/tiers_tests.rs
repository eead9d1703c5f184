use super::*;
use kvmesh_core::hashing::{sequence_hashes, XXH3_SEED};
use std::collections::HashMap;

const BS: usize = 4;
const BLOCKS: usize = 10;

fn tokens() -> Vec<u32> {
    (0..(BLOCKS * BS) as u32).map(|t| t * 7 + 3).collect()
}

/// Engine hash of block `i` (the same in every tier, as vLLM publishes offloaded blocks).
fn engine(worker: WorkerSlot, i: usize) -> u64 {
    (u64::from(worker) << 32) | (i as u64 + 1)
}

fn index(workers: &[WorkerSlot]) -> KvIndex {
    let mut idx = KvIndex::new(1_000_000, 1_000_000);
    for &w in workers {
        idx.add_worker(w);
    }
    idx
}

/// Stores blocks `from..to` of the prompt on `worker` in `tier`, chained to block `from - 1`.
fn store(
    idx: &mut KvIndex,
    tier: Tier,
    worker: WorkerSlot,
    from: usize,
    to: usize,
) -> StoreOutcome {
    let t = tokens();
    let hashes: Vec<u64> = (from..to).map(|i| engine(worker, i)).collect();
    let parent = from.checked_sub(1).map(|p| engine(worker, p));
    idx.store_in(tier, worker, parent, &hashes, &t[from * BS..to * BS], BS, XXH3_SEED)
}

fn remove(idx: &mut KvIndex, tier: Tier, worker: WorkerSlot, blocks: &[usize]) -> usize {
    let hashes: Vec<u64> = blocks.iter().map(|&i| engine(worker, i)).collect();
    idx.remove_in(tier, worker, &hashes)
}

/// (GPU match, lower-tier run) per worker, sorted.
fn matched(idx: &KvIndex) -> Vec<(WorkerSlot, u32, TierBlocks)> {
    let chains = sequence_hashes(&tokens(), BS, XXH3_SEED);
    let gpu = idx.find_matches(&chains);
    let lower = idx.find_lower_matches(&chains, &gpu);
    let mut slots: Vec<WorkerSlot> =
        gpu.iter().map(|m| m.0).chain(lower.iter().map(|m| m.0)).collect();
    slots.sort_unstable();
    slots.dedup();
    slots
        .into_iter()
        .map(|s| {
            let g = gpu.iter().find(|m| m.0 == s).map_or(0, |m| m.1);
            let l = lower.iter().find(|m| m.0 == s).map_or(TierBlocks::default(), |m| m.1);
            (s, g, l)
        })
        .collect()
}

fn cpu(n: u32) -> TierBlocks {
    TierBlocks { cpu: n, disk: 0 }
}

#[test]
fn media_name_the_tiers() {
    let cases = [
        (None, Some(Tier::Gpu)),
        (Some("GPU"), Some(Tier::Gpu)),
        (Some("gpu"), Some(Tier::Gpu)),
        (Some("CPU"), Some(Tier::Cpu)),
        (Some("CPU_PINNED"), Some(Tier::Cpu)),
        (Some("CPU_TIER1"), Some(Tier::Cpu)),
        (Some("STORAGE"), Some(Tier::Disk)),
        (Some("DISK"), Some(Tier::Disk)),
        (Some("CPU_TIER2"), Some(Tier::Disk)),
        (Some("FS"), Some(Tier::Disk)),
        (Some("OBJ"), None),
        (Some("EXTERNAL"), None),
        (Some(""), None),
    ];
    for (medium, want) in cases {
        assert_eq!(Tier::of_medium(medium), want, "{medium:?}");
    }
}

#[test]
fn a_gpu_removal_keeps_the_cpu_copy_and_a_cpu_removal_the_gpu_one() {
    let mut idx = index(&[0]);
    assert_eq!(store(&mut idx, Tier::Gpu, 0, 0, 6), StoreOutcome::Stored { blocks: 6 });
    // The GPU evicts its tail to the CPU, tail first: each offloaded block's parent is still on
    // the GPU (chained through the GPU's mapping), or was offloaded just before.
    for i in (3..6).rev() {
        assert_eq!(store(&mut idx, Tier::Cpu, 0, i, i + 1), StoreOutcome::Stored { blocks: 1 });
    }
    assert_eq!(remove(&mut idx, Tier::Gpu, 0, &[5, 4, 3]), 0);
    assert_eq!(matched(&idx), vec![(0, 3, cpu(3))], "blocks 3..6 load from the CPU");
    assert_eq!((idx.entries(), idx.tier_entries(Tier::Cpu)), (3, 3));
    // A CPU removal leaves the GPU blocks; a hole in the CPU run ends it.
    assert_eq!(remove(&mut idx, Tier::Cpu, 0, &[4]), 0);
    assert_eq!(matched(&idx), vec![(0, 3, cpu(1))]);
    // Block 4 back on the GPU (loaded): the GPU match stops at 3 still, as the engine's does.
    assert_eq!(store(&mut idx, Tier::Gpu, 0, 4, 5), StoreOutcome::Stored { blocks: 1 });
    assert_eq!(matched(&idx), vec![(0, 3, cpu(1))]);
    // The whole GPU copy goes; the CPU holds 3 and 5, not block 0: nothing loads.
    assert_eq!(remove(&mut idx, Tier::Gpu, 0, &[4, 2, 1, 0]), 0);
    assert_eq!(matched(&idx), vec![]);
    assert_eq!(idx.tier_entries(Tier::Cpu), 2, "the CPU copies stay indexed");
    // Blocks 0..3 offloaded from the root (a write-through connector) and block 4 on disk: the
    // run from block 0 is 0..6, by the cheapest tier holding each block.
    assert_eq!(store(&mut idx, Tier::Cpu, 0, 0, 3), StoreOutcome::Stored { blocks: 3 });
    assert_eq!(store(&mut idx, Tier::Disk, 0, 4, 5), StoreOutcome::Stored { blocks: 1 });
    assert_eq!(matched(&idx), vec![(0, 0, TierBlocks { cpu: 5, disk: 1 })]);
    // A reset clears every tier.
    idx.clear_worker(0);
    assert_eq!((idx.tier_entries(Tier::Cpu), idx.tier_entries(Tier::Disk)), (0, 0));
    assert_eq!(matched(&idx), vec![]);
}

#[test]
fn an_offloaded_block_whose_parent_no_tier_maps_is_an_orphan() {
    let mut idx = index(&[0, 1]);
    assert_eq!(store(&mut idx, Tier::Cpu, 0, 3, 4), StoreOutcome::Orphan);
    assert_eq!(store(&mut idx, Tier::Cpu, 7, 0, 1), StoreOutcome::UnknownWorker);
    // Another worker's mapping of the same engine hash does not count.
    assert_eq!(store(&mut idx, Tier::Gpu, 1, 0, 3), StoreOutcome::Stored { blocks: 3 });
    let t = tokens();
    let parent = Some(engine(1, 2));
    assert_eq!(
        idx.store_in(Tier::Cpu, 0, parent, &[engine(0, 3)], &t[12..16], BS, XXH3_SEED),
        StoreOutcome::Orphan
    );
    // Removing a worker removes its lower tiers too.
    assert_eq!(store(&mut idx, Tier::Cpu, 1, 3, 5), StoreOutcome::Stored { blocks: 2 });
    assert_eq!(matched(&idx), vec![(1, 3, cpu(2))]);
    idx.remove_worker(1);
    assert_eq!((idx.entries(), idx.tier_entries(Tier::Cpu)), (0, 0));
    assert_eq!(idx.tier_worker_blocks(Tier::Cpu, 1), 0);
}

#[test]
fn lower_tier_tables_grow_off_the_write_lock_too() {
    let mut idx = index(&[0]);
    assert!(idx.growth_in(Tier::Cpu, 0, 100).is_none(), "no CPU tier yet");
    assert_eq!(store(&mut idx, Tier::Gpu, 0, 0, 1), StoreOutcome::Stored { blocks: 1 });
    assert_eq!(store(&mut idx, Tier::Cpu, 0, 1, 2), StoreOutcome::Stored { blocks: 1 });
    let growth = idx.growth_in(Tier::Cpu, 0, 1000).expect("1000 more blocks grow the CPU tables");
    let room = idx.room_for(growth);
    drop(idx.make_room(room));
    assert!(idx.growth_in(Tier::Cpu, 0, 1000).is_none(), "room was made");
    assert_eq!(matched(&idx), vec![(0, 1, cpu(1))]);
}

proptest::proptest! {
    /// Random stores and removals in every tier for two workers, against a model of the engine:
    /// per worker, the GPU match is its leading run of GPU blocks, and the lower run continues
    /// from there while a CPU or storage block is held (CPU credited first). A store is applied
    /// only when its parent is mapped in some tier of the worker (else an orphan); duplicate
    /// stores need as many removals.
    #[test]
    fn tiered_matches_agree_with_a_model(
        ops in proptest::collection::vec((0u8..3, 0u32..2, 0usize..BLOCKS, 1usize..4, proptest::bool::weighted(0.6)), 1..80),
    ) {
        let mut idx = index(&[0, 1]);
        // (worker, tier, block) → reference count.
        let mut model: HashMap<(WorkerSlot, Tier, usize), u32> = HashMap::new();
        let tiers = [Tier::Gpu, Tier::Cpu, Tier::Disk];
        for (t, w, from, len, is_store) in ops {
            let tier = tiers[t as usize];
            let to = (from + len).min(BLOCKS);
            if is_store {
                let mapped = from == 0
                    || tiers.iter().any(|x| model.get(&(w, *x, from - 1)).is_some_and(|r| *r > 0));
                let got = store(&mut idx, tier, w, from, to);
                if mapped {
                    proptest::prop_assert_eq!(got, StoreOutcome::Stored { blocks: to - from });
                    for i in from..to {
                        *model.entry((w, tier, i)).or_default() += 1;
                    }
                } else {
                    proptest::prop_assert_eq!(got, StoreOutcome::Orphan);
                }
            } else {
                let blocks: Vec<usize> = (from..to).collect();
                let unknown = remove(&mut idx, tier, w, &blocks);
                let mut want_unknown = 0;
                for i in from..to {
                    match model.get_mut(&(w, tier, i)) {
                        Some(r) if *r > 0 => *r -= 1,
                        _ => want_unknown += 1,
                    }
                }
                proptest::prop_assert_eq!(unknown, want_unknown);
            }
        }
        let held = |w, tier, i| model.get(&(w, tier, i)).is_some_and(|r| *r > 0);
        let mut want = Vec::new();
        for w in [0, 1] {
            let g = (0..BLOCKS).take_while(|&i| held(w, Tier::Gpu, i)).count();
            let mut lower = TierBlocks::default();
            for i in g..BLOCKS {
                if held(w, Tier::Cpu, i) {
                    lower.cpu += 1;
                } else if held(w, Tier::Disk, i) {
                    lower.disk += 1;
                } else {
                    break;
                }
            }
            if g > 0 || lower.total() > 0 {
                want.push((w, g as u32, lower));
            }
        }
        proptest::prop_assert_eq!(matched(&idx), want);
    }
}
