//! Hybrid models: the residency of each worker's KV cache groups beyond the main one, and the cap
//! they put on the main index's match ([`KvIndex::cap_by_groups`], the rule in [`group_rule`]).
//!
//! vLLM keeps one KV cache group per attention kind of a hybrid model (full attention, sliding
//! window, …) and publishes each group's stores and removals with its `group_idx`, stores with the
//! group's `kv_cache_spec_kind` and `kv_cache_spec_sliding_window`. Group 0 is the main index,
//! unchanged. Each other group of a worker is kept here, beside it: `engine hash → (chain hash,
//! seed, refs)` to apply removals and chain later stores, and `chain hash → mappings` for queries.
//! A group's chain hashes are recomputed from the store's token ids exactly as the main index's
//! (every group hashes the same tokens at the same block positions, so a prompt's chains look up
//! every group alike). A store's parent is found in the group itself, else in the worker's main
//! group (a window group does not keep the blocks before its window, which are its stores'
//! parents); unknown in both, the store is an orphan and refused — the group then claims less,
//! never more. A store that skipped blocks (vLLM sends the token ids of the whole range but the
//! hashes of the blocks it cached only: null blocks outside the window, blocks its reachability
//! mask leaves out) does not say which positions it skipped, so its hashes take the chain hashes
//! the main group maps them to (engine hashes are one space across groups), and a hash the main
//! group does not map is left out.
//!
//! A worker that never published a group beyond 0 has no entry here and its match is untouched:
//! with no hybrid worker at all, [`KvIndex::cap_by_groups`] is one branch. A worker's groups are
//! those it ever published (the model needs them all): clearing a worker (`AllBlocksCleared`, a
//! resync) empties them but keeps them known, so the worker is not read as non-hybrid meanwhile;
//! a slot registered anew starts with none.
//!
//! Memory: every group of every worker together holds at most `routing.index_max_entries`
//! mappings (a store beyond it is refused and counted; removals make room), each (worker, group)
//! at most `routing.max_blocks_per_worker` (beyond it the group is cleared: the worker lost
//! removals), and a worker at most [`MAX_GROUPS`] groups (events of a higher `group_idx` are
//! skipped and counted). About 60 bytes a mapping (two hash tables at their load factor).

use std::collections::HashMap;
use std::hash::BuildHasherDefault;

use kvmesh_core::hashing::{self, SequenceHash};

use super::group_rule::{self, GroupKind};
use super::slots::{block_hash, U64Hasher};
use super::{KvIndex, OverlapScores, TierScores, WorkerSlot};

/// The highest `group_idx` kept, plus one (DeepSeek-V4 publishes a handful of groups).
pub const MAX_GROUPS: u32 = 16;

type U64Map<V> = HashMap<u64, V, BuildHasherDefault<U64Hasher>>;

/// One engine hash of a group: its chain hash, the seed its chain was hashed with, and how many
/// stores of it are live (vLLM may cache one hash in two physical blocks).
#[derive(Debug, Clone, Copy)]
struct Mapping {
    chain: u64,
    seed: u64,
    refs: u32,
}

/// One KV cache group of one worker.
#[derive(Debug)]
struct Group {
    idx: u32,
    kind: GroupKind,
    /// The block size of its stores (0 until one came).
    block_size: u32,
    engines: U64Map<Mapping>,
    /// Chain hash → engine hashes mapping to it.
    chains: U64Map<u32>,
}

impl Group {
    fn new(idx: u32, kind: GroupKind) -> Self {
        Self { idx, kind, block_size: 0, engines: U64Map::default(), chains: U64Map::default() }
    }

    fn holds(&self, chain: SequenceHash) -> bool {
        self.chains.contains_key(&chain.0)
    }

    /// Drops one store of `engine`; false if it was not mapped.
    fn unmap(&mut self, engine: u64) -> Option<bool> {
        let m = self.engines.get_mut(&engine)?;
        m.refs -= 1;
        if m.refs > 0 {
            return Some(false);
        }
        let chain = m.chain;
        self.engines.remove(&engine);
        if let Some(n) = self.chains.get_mut(&chain) {
            *n -= 1;
            if *n == 0 {
                self.chains.remove(&chain);
            }
        }
        Some(true)
    }
}

/// The result of one store of a group beyond the main one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupStore {
    /// Blocks mapped (new or duplicate; a store that skipped blocks maps those it can place).
    Stored { blocks: usize },
    /// The parent engine hash is in neither the group nor the worker's main group: nothing stored.
    Orphan,
    /// The token ids are not whole blocks, or fewer than the hashes: nothing stored.
    Malformed,
    /// Every group together is at `routing.index_max_entries`: nothing stored.
    Full,
    /// The group now maps more than `routing.max_blocks_per_worker` blocks: it was cleared.
    TooManyBlocks,
    /// `group_idx` ≥ [`MAX_GROUPS`], or the slot is not registered: nothing stored.
    Refused,
}

/// The groups beyond the main one of every worker slot.
#[derive(Debug, Default)]
pub(super) struct Groups {
    /// By slot: the worker's groups, ordered by index (a handful).
    workers: Vec<Vec<Group>>,
    /// Workers with at least one group.
    hybrid: usize,
    /// Mappings in all groups.
    entries: usize,
}

impl Groups {
    /// Whether some worker has a group beyond the main one.
    fn is_empty(&self) -> bool {
        self.hybrid == 0
    }

    fn of(&self, slot: WorkerSlot) -> &[Group] {
        self.workers.get(slot as usize).map_or(&[], Vec::as_slice)
    }

    /// Group `idx` of `slot`, created (known from now on) if absent; its kind follows the latest
    /// store that names one.
    fn group_mut(&mut self, slot: WorkerSlot, idx: u32, kind: Option<GroupKind>) -> &mut Group {
        let i = slot as usize;
        if self.workers.len() <= i {
            self.workers.resize_with(i + 1, Vec::new);
        }
        let gs = &mut self.workers[i];
        if gs.is_empty() {
            self.hybrid += 1;
        }
        let at = match gs.binary_search_by_key(&idx, |g| g.idx) {
            Ok(at) => at,
            Err(at) => {
                gs.insert(at, Group::new(idx, kind.unwrap_or(GroupKind::Unknown)));
                at
            }
        };
        let g = &mut gs[at];
        if let Some(k) = kind {
            g.kind = k;
        }
        g
    }

    /// Empties `slot`'s groups, keeping them known.
    pub(super) fn clear(&mut self, slot: WorkerSlot) {
        let Some(gs) = self.workers.get_mut(slot as usize) else { return };
        for g in gs {
            self.entries -= g.engines.len();
            g.engines = U64Map::default();
            g.chains = U64Map::default();
        }
    }

    /// Forgets `slot`'s groups (a slot registered anew).
    pub(super) fn forget(&mut self, slot: WorkerSlot) {
        self.clear(slot);
        if let Some(gs) = self.workers.get_mut(slot as usize) {
            if !gs.is_empty() {
                self.hybrid -= 1;
            }
            *gs = Vec::new();
        }
    }

    /// Heap bytes held (tables at capacity).
    pub(super) fn bytes(&self) -> usize {
        let table = |cap: usize, slot: usize| cap * (slot + 1);
        self.workers.capacity() * std::mem::size_of::<Vec<Group>>()
            + self
                .workers
                .iter()
                .flatten()
                .map(|g| {
                    std::mem::size_of::<Group>()
                        + table(g.engines.capacity(), std::mem::size_of::<(u64, Mapping)>())
                        + table(g.chains.capacity(), std::mem::size_of::<(u64, u32)>())
                })
                .sum::<usize>()
    }
}

/// One `BlockStored` of a group beyond the main one, as [`KvIndex::store_group`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct GroupEvent<'a> {
    pub group_idx: u32,
    /// The kind the event names (`None`: it names none; the group keeps what it had).
    pub kind: Option<GroupKind>,
    pub parent: Option<u64>,
    pub block_hashes: &'a [u64],
    pub token_ids: &'a [u32],
    pub block_size: usize,
    /// The seed of a store at the chain's root (LoRA × `cache_salt`).
    pub root_seed: u64,
}

impl KvIndex {
    /// Applies a `BlockStored` of group `e.group_idx` > 0 of `slot` (module docs).
    pub fn store_group(&mut self, slot: WorkerSlot, e: GroupEvent<'_>) -> GroupStore {
        let active = self.workers.get(slot as usize).is_some_and(|w| w.active);
        if !active || e.group_idx >= MAX_GROUPS || e.group_idx == 0 {
            return GroupStore::Refused;
        }
        let bs = e.block_size;
        let n = e.block_hashes.len();
        if bs == 0 || !e.token_ids.len().is_multiple_of(bs) || e.token_ids.len() / bs < n {
            return GroupStore::Malformed;
        }
        let (max_entries, max_blocks) = (self.max_entries, self.max_blocks_per_worker);
        if self.groups.entries + n > max_entries {
            // Known from now on all the same: the worker's matches are capped by what it holds.
            self.groups.group_mut(slot, e.group_idx, e.kind);
            return GroupStore::Full;
        }
        // Chain hashes: computed from the tokens after the parent (found in the group itself,
        // else in the main group); for a store that skipped blocks, taken from the main group's
        // mappings of the same engine hashes (which positions were skipped is not sent).
        let main = |engine: u64| {
            let s = self.workers.get(slot as usize)?.map.get(engine)?;
            Some((s.r.chain.0, self.seeds.seed(s.r.seed_id())))
        };
        let mut chains: Vec<Option<(u64, u64)>> = Vec::with_capacity(n);
        let gappy = e.token_ids.len() != n * bs;
        if gappy {
            chains.extend(e.block_hashes.iter().map(|h| main(*h)));
        }
        let main_parent = e.parent.and_then(main);
        let g = self.groups.group_mut(slot, e.group_idx, e.kind);
        g.block_size = bs as u32;
        if !gappy {
            let own = e.parent.and_then(|p| g.engines.get(&p).map(|m| (m.chain, m.seed)));
            let (mut prev, seed) = match e.parent {
                None => (None, e.root_seed),
                Some(_) => match own.or(main_parent) {
                    Some((chain, seed)) => (Some(SequenceHash(chain)), seed),
                    None => return GroupStore::Orphan,
                },
            };
            for tokens in e.token_ids.chunks_exact(bs) {
                let chain = hashing::chain(prev, block_hash(tokens, seed));
                prev = Some(chain);
                chains.push(Some((chain.0, seed)));
            }
        }
        let mut added = 0;
        let mut mapped = 0;
        for (&engine, found) in e.block_hashes.iter().zip(&chains) {
            let Some((chain, seed)) = *found else { continue };
            mapped += 1;
            let m = g.engines.entry(engine).or_insert(Mapping { chain, seed, refs: 0 });
            if m.refs > 0 && m.chain != chain {
                // The engine reused a hash for other content: the old mapping is stale.
                let old = m.chain;
                *m = Mapping { chain, seed, refs: 0 };
                if let Some(c) = g.chains.get_mut(&old) {
                    *c -= 1;
                    if *c == 0 {
                        g.chains.remove(&old);
                    }
                }
                *g.chains.entry(chain).or_insert(0) += 1;
            } else if m.refs == 0 {
                added += 1;
                *g.chains.entry(chain).or_insert(0) += 1;
            }
            m.refs = m.refs.saturating_add(1);
        }
        // More mappings than the engine can hold: it lost removals; the group starts over.
        let over = g.engines.len() > max_blocks;
        let dropped = if over { g.engines.len() } else { 0 };
        if over {
            g.engines = U64Map::default();
            g.chains = U64Map::default();
        }
        self.groups.entries = self.groups.entries + added - dropped;
        if over {
            return GroupStore::TooManyBlocks;
        }
        GroupStore::Stored { blocks: mapped }
    }

    /// Applies a `BlockRemoved` of group `group_idx` > 0 of `slot`; returns how many hashes the
    /// group did not map (ignored). Makes the group known (the model needs it).
    pub fn remove_group(&mut self, slot: WorkerSlot, group_idx: u32, hashes: &[u64]) -> usize {
        let active = self.workers.get(slot as usize).is_some_and(|w| w.active);
        if !active || group_idx >= MAX_GROUPS || group_idx == 0 {
            return hashes.len();
        }
        let g = self.groups.group_mut(slot, group_idx, None);
        let mut unknown = 0;
        let mut gone = 0;
        for h in hashes {
            match g.unmap(*h) {
                None => unknown += 1,
                Some(true) => gone += 1,
                Some(false) => {}
            }
        }
        self.groups.entries -= gone;
        unknown
    }

    /// Mappings held by every group beyond the main one, all workers.
    pub fn group_entries(&self) -> usize {
        self.groups.entries
    }

    /// The groups `slot` publishes beyond the main one, with their kind and mappings (debug, tests).
    pub fn worker_groups(&self, slot: WorkerSlot) -> Vec<(u32, GroupKind, usize)> {
        self.groups.of(slot).iter().map(|g| (g.idx, g.kind, g.engines.len())).collect()
    }

    /// Cuts each worker's match in `scores` ([`KvIndex::find_matches`] for `chains`) to what every
    /// KV cache group it publishes can serve ([`group_rule::hybrid_hit`]), at most `max_blocks`
    /// (the engine's last-token rule: it decides the window rule's answer, so it is applied here
    /// and not after). Workers with no group beyond the main one are untouched; a hybrid worker's
    /// lower-tier run is dropped from `tiers` (the offload connector's groups are not tracked, so
    /// the run could continue past what its window group serves). Workers left with no block
    /// leave `scores`.
    pub fn cap_by_groups(
        &self,
        chains: &[SequenceHash],
        max_blocks: u32,
        scores: &mut OverlapScores,
        tiers: &mut TierScores,
    ) {
        if self.groups.is_empty() {
            return;
        }
        let mut capped = false;
        let mut kinds = [(GroupKind::Unknown, 0u32); MAX_GROUPS as usize];
        for (slot, blocks) in scores.iter_mut() {
            let slot = *slot;
            let groups = self.groups.of(slot);
            if groups.is_empty() {
                continue;
            }
            for (k, g) in kinds.iter_mut().zip(groups) {
                *k = (g.kind, g.block_size);
            }
            let cap = (*blocks).min(max_blocks).min(chains.len() as u32) as usize;
            let held = |g: usize, i: usize| chains.get(i).is_some_and(|c| groups[g].holds(*c));
            *blocks = group_rule::hybrid_hit(cap, &kinds[..groups.len()], held) as u32;
            tiers.retain(|(s, _)| *s != slot);
            capped = true;
        }
        if capped {
            scores.retain(|(_, b)| *b > 0);
        }
    }
}

#[cfg(test)]
#[path = "groups_tests.rs"]
mod tests;
