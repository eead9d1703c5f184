//! Lower KV tiers: blocks an engine keeps outside GPU memory and loads back instead of recomputing
//! (vLLM's offloading connector: `medium` `"CPU"`, `"STORAGE"`; SGLang's HiCache: `CPU_PINNED`,
//! `CPU_TIER1`, `CPU_TIER2`; others `DISK`, `FS`).
//!
//! Each lower tier is a [`KvIndex`] of its own over the same worker slots (the GPU index's
//! `lower`), created on the tier's first store, so residency is per (block, worker, tier): a GPU
//! `BlockRemoved` leaves the worker's CPU copy indexed and a CPU one its GPU copy. Engine hashes
//! are one space across tiers (vLLM's offloaded blocks keep the request's block hashes), so a store
//! whose parent only another tier of the same worker maps — a block offloaded as the GPU evicts it
//! while its parent stays on the GPU, or loaded back while its parent is offloaded — is chained
//! through that tier's mapping ([`KvIndex::store_in`]) instead of being refused as an orphan.
//!
//! Matching ([`KvIndex::find_lower_matches`]) follows how the engines load: the prefix cache serves
//! the GPU-resident leading blocks, then the connector loads the blocks that follow
//! *consecutively* from its tiers (vLLM's `OffloadingConnectorScheduler::_maximal_prefix_lookup`
//! starts at the GPU hit). So per worker the credited run starts at the worker's GPU match and
//! ends at the first block no lower tier of it holds. The run is walked block by block with the
//! table lines of a stretch ahead fetched early: lower tiers are not prefix-closed (blocks are
//! offloaded as the GPU evicts them, tail first), so the GPU index's gallop would not be exact.
//! With no lower-tier entry anywhere it costs two branches; [`KvIndex::find_matches`] is unchanged.
//!
//! Memory: each tier is bounded as the GPU index is (`routing.index_max_entries` (block, worker)
//! entries by CLOCK eviction, `routing.max_blocks_per_worker` mappings per worker), at the same
//! cost per entry, so a fleet with both lower tiers in use can hold three times the GPU bound.

use std::fmt;

use kvmesh_core::hashing::SequenceHash;

use super::workers::Holders;
use super::{KvIndex, OverlapScores, StoreOutcome, WorkerSlot};

/// Where an engine keeps a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// Device memory: what the prefix cache serves at no cost.
    Gpu,
    /// Host memory (vLLM `CPU`; SGLang `CPU_PINNED`, `CPU_TIER1`).
    Cpu,
    /// Local storage (vLLM `STORAGE`; `DISK`, `FS`, SGLang `CPU_TIER2`).
    Disk,
}

/// `medium` values of the host tier (compared without case).
const CPU_MEDIA: [&str; 3] = ["CPU", "CPU_PINNED", "CPU_TIER1"];
/// `medium` values of the storage tier (compared without case).
const DISK_MEDIA: [&str; 5] = ["STORAGE", "DISK", "FS", "LOCAL_DISK", "CPU_TIER2"];

/// Blocks fetched ahead of the one examined when walking a lower tier.
const LOOKAHEAD: usize = 8;

impl Tier {
    /// The lower tiers, in the order a block held by several is credited (cheapest first).
    pub const LOWER: [Tier; 2] = [Tier::Cpu, Tier::Disk];

    /// The tier an event's `medium` names: none (older engines) or `GPU` is the GPU; shared or
    /// remote stores (`OBJ`, `EXTERNAL`, anything unknown) are `None`: not the worker's own.
    pub fn of_medium(medium: Option<&str>) -> Option<Tier> {
        let Some(m) = medium else { return Some(Tier::Gpu) };
        if m.eq_ignore_ascii_case("GPU") {
            Some(Tier::Gpu)
        } else if CPU_MEDIA.iter().any(|c| m.eq_ignore_ascii_case(c)) {
            Some(Tier::Cpu)
        } else if DISK_MEDIA.iter().any(|c| m.eq_ignore_ascii_case(c)) {
            Some(Tier::Disk)
        } else {
            None
        }
    }

    /// The label / config name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gpu => "gpu",
            Self::Cpu => "cpu",
            Self::Disk => "disk",
        }
    }

    /// Position in `KvIndex::lower`; `None` for the GPU.
    fn lower(self) -> Option<usize> {
        match self {
            Self::Gpu => None,
            Self::Cpu => Some(0),
            Self::Disk => Some(1),
        }
    }
}

impl fmt::Display for Tier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Blocks of a prompt a worker can load from its lower tiers right after its GPU match, by tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierBlocks {
    pub cpu: u32,
    pub disk: u32,
}

impl TierBlocks {
    /// Blocks in all lower tiers.
    pub fn total(&self) -> u32 {
        self.cpu.saturating_add(self.disk)
    }

    /// At most `max` blocks in all: the run cut short (storage blocks dropped first — which of
    /// the run's blocks sit where is not kept, and the last-block rule cuts one block at most).
    pub fn capped(self, max: u32) -> Self {
        let cpu = self.cpu.min(max);
        Self { cpu, disk: self.disk.min(max - cpu) }
    }

    fn add(&mut self, tier: Tier) {
        match tier {
            Tier::Cpu => self.cpu += 1,
            Tier::Disk => self.disk += 1,
            Tier::Gpu => {}
        }
    }
}

/// Per worker slot holding any, its lower-tier blocks continuing its GPU match.
pub type TierScores = Vec<(WorkerSlot, TierBlocks)>;

impl KvIndex {
    /// Forgets everything `slot` holds, in every tier, and retires it (its blocks leave the index).
    pub fn remove_worker(&mut self, slot: WorkerSlot) {
        self.clear_worker(slot);
        if let Some(w) = self.workers.get_mut(slot as usize) {
            w.active = false;
        }
        for t in self.lower.iter_mut().flatten() {
            t.remove_worker(slot);
        }
    }

    /// Forgets everything `slot` holds in every tier (`AllBlocksCleared`, a resync) but keeps it
    /// registered. A reset of the GPU prefix cache clears the lower tiers too: vLLM resets the
    /// connector's store with it, and claiming blocks the engine cannot serve costs more than
    /// missing a few it still could.
    pub fn clear_worker(&mut self, slot: WorkerSlot) {
        self.clear_own(slot);
        for t in self.lower.iter_mut().flatten() {
            t.clear_own(slot);
        }
    }

    /// Forgets what `slot` holds in `tier` alone (a resync of that tier).
    pub fn clear_in(&mut self, tier: Tier, slot: WorkerSlot) {
        match tier.lower() {
            None => self.clear_own(slot),
            Some(i) => {
                if let Some(t) = self.lower[i].as_deref_mut() {
                    t.clear_own(slot);
                }
            }
        }
    }

    /// The index of `tier` (the GPU one is `self`), if that tier has been stored into.
    pub fn tier(&self, tier: Tier) -> Option<&KvIndex> {
        match tier.lower() {
            None => Some(self),
            Some(i) => self.lower[i].as_deref(),
        }
    }

    /// [`KvIndex::tier`], mutably.
    pub(super) fn tier_mut(&mut self, tier: Tier) -> Option<&mut KvIndex> {
        match tier.lower() {
            None => Some(self),
            Some(i) => self.lower[i].as_deref_mut(),
        }
    }

    /// (block, worker) entries held in `tier`.
    pub fn tier_entries(&self, tier: Tier) -> usize {
        self.tier(tier).map_or(0, KvIndex::entries)
    }

    /// Engine-hash mappings `slot` holds in `tier`.
    pub fn tier_worker_blocks(&self, tier: Tier, slot: WorkerSlot) -> usize {
        self.tier(tier).map_or(0, |t| t.worker_blocks(slot))
    }

    /// The index of lower tier `i`, created (with this index's bounds and workers) if absent.
    fn lower_or_new(&mut self, i: usize) -> &mut KvIndex {
        let (max_entries, max_blocks) = (self.max_entries, self.max_blocks_per_worker);
        let active: Vec<WorkerSlot> = self
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| w.active)
            .map(|(s, _)| s as WorkerSlot)
            .collect();
        self.lower[i].get_or_insert_with(|| {
            let mut t = KvIndex::new(max_entries, max_blocks);
            for s in active {
                t.add_worker(s);
            }
            Box::new(t)
        })
    }

    /// Applies a `BlockStored` of `tier` ([`KvIndex::store`]'s contract). A parent this tier does
    /// not map for `slot` is looked up in the worker's other tiers (module docs).
    #[allow(clippy::too_many_arguments)]
    pub fn store_in(
        &mut self,
        tier: Tier,
        slot: WorkerSlot,
        parent: Option<u64>,
        block_hashes: &[u64],
        token_ids: &[u32],
        block_size: usize,
        root_seed: u64,
    ) -> StoreOutcome {
        self.store_keyed_in(tier, slot, parent, block_hashes, token_ids, block_size, root_seed, &[])
    }

    /// [`KvIndex::store_in`] of blocks with extra keys: block `i`'s local hash is seeded with
    /// `keyed_seed(seed, terms[i])` (`kvmesh_core::hashing`; empty `terms`: none has keys).
    #[allow(clippy::too_many_arguments)]
    pub fn store_keyed_in(
        &mut self,
        tier: Tier,
        slot: WorkerSlot,
        parent: Option<u64>,
        block_hashes: &[u64],
        token_ids: &[u32],
        block_size: usize,
        root_seed: u64,
        terms: &[u64],
    ) -> StoreOutcome {
        if !self.workers.get(slot as usize).is_some_and(|w| w.active) {
            return StoreOutcome::UnknownWorker;
        }
        let own = |t: Option<&KvIndex>, p: u64| t.is_some_and(|t| t.own_chain(slot, p).is_some());
        let known = parent
            .filter(|&p| !own(self.tier(tier), p))
            .and_then(|p| self.chain_elsewhere(slot, p, tier));
        let target = match tier.lower() {
            None => self,
            Some(i) => self.lower_or_new(i),
        };
        target.store_from(
            slot,
            parent,
            known,
            block_hashes,
            token_ids,
            block_size,
            root_seed,
            terms,
        )
    }

    /// Applies a `BlockRemoved` of `tier`; returns how many hashes were unknown there.
    pub fn remove_in(&mut self, tier: Tier, slot: WorkerSlot, block_hashes: &[u64]) -> usize {
        match tier.lower() {
            None => self.remove(slot, block_hashes),
            Some(i) => match self.lower[i].as_deref_mut() {
                Some(t) => t.remove(slot, block_hashes),
                None => block_hashes.len(),
            },
        }
    }

    /// The chain hash and seed `slot` maps engine hash `engine` to in this tier's index.
    fn own_chain(&self, slot: WorkerSlot, engine: u64) -> Option<(SequenceHash, u64)> {
        let s = self.workers.get(slot as usize)?.map.get(engine)?;
        Some((s.r.chain, self.seeds.seed(s.r.seed_id())))
    }

    /// [`KvIndex::own_chain`] in any tier but `except` (the GPU first).
    fn chain_elsewhere(
        &self,
        slot: WorkerSlot,
        engine: u64,
        except: Tier,
    ) -> Option<(SequenceHash, u64)> {
        [Tier::Gpu, Tier::Cpu, Tier::Disk]
            .into_iter()
            .filter(|t| *t != except)
            .find_map(|t| self.tier(t)?.own_chain(slot, engine))
    }

    /// Per worker, the blocks of `chains` it holds in lower tiers right after its GPU match `gpu`
    /// (what [`KvIndex::find_matches`] returned for `chains`): the run from its GPU depth (0 for a
    /// worker not in `gpu`) to the first block none of its lower tiers holds, counted by the
    /// cheapest tier holding each block. Workers with an empty run are absent. Exact; see the
    /// module docs for the cost.
    pub fn find_lower_matches(&self, chains: &[SequenceHash], gpu: &OverlapScores) -> TierScores {
        let n = chains.len();
        let mut out = TierScores::new();
        let present: Vec<(Tier, &KvIndex)> = Tier::LOWER
            .into_iter()
            .filter_map(|t| self.tier(t).filter(|x| x.entries() > 0).map(|x| (t, x)))
            .collect();
        if present.is_empty() || n == 0 {
            return out;
        }
        // Where each worker's run starts: its GPU depth, or block 0 for a worker holding block 0
        // only in a lower tier.
        let mut starts: Vec<(usize, WorkerSlot)> =
            gpu.iter().filter(|(_, g)| (*g as usize) < n).map(|&(s, g)| (g as usize, s)).collect();
        for (_, t) in &present {
            if let Some(word) = t.lookup(chains[0].0) {
                Holders::of(word, &t.bitmaps).for_each(|s| {
                    let seen = gpu.iter().any(|&(w, _)| w == s)
                        || starts.iter().any(|&(p, x)| p == 0 && x == s);
                    if !seen {
                        starts.push((0, s));
                    }
                });
            }
        }
        starts.sort_unstable();
        let mut active: Vec<(WorkerSlot, TierBlocks)> = Vec::new();
        let mut next = 0;
        let mut pos = 0;
        let mut words = [0u64; Tier::LOWER.len()];
        while pos < n {
            while starts.get(next).is_some_and(|&(p, _)| p == pos) {
                active.push((starts[next].1, TierBlocks::default()));
                next += 1;
            }
            if active.is_empty() {
                match starts.get(next) {
                    Some(&(p, _)) => {
                        pos = p;
                        continue;
                    }
                    None => break,
                }
            }
            if let Some(ahead) = chains.get(pos + LOOKAHEAD) {
                std::hint::black_box(
                    present.iter().fold(0, |a, (_, t)| a ^ t.blocks.touch(ahead.0)),
                );
            }
            for (k, (_, t)) in present.iter().enumerate() {
                words[k] = t.lookup(chains[pos].0).unwrap_or(0);
            }
            active.retain_mut(|(slot, got)| {
                for (k, (tier, t)) in present.iter().enumerate() {
                    if words[k] != 0 && Holders::of(words[k], &t.bitmaps).contains(*slot) {
                        got.add(*tier);
                        return true;
                    }
                }
                if got.total() > 0 {
                    out.push((*slot, *got));
                }
                false
            });
            pos += 1;
        }
        out.extend(active.into_iter().filter(|(_, got)| got.total() > 0));
        out
    }
}

#[cfg(test)]
#[path = "tiers_tests.rs"]
mod tests;
