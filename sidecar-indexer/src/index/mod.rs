//! The block index: which workers hold which KV blocks, keyed by Dynamo-compatible chain hash.
//!
//! Shape, and why:
//! * `blocks: chain hash → word {holders, age}`, a flat open-addressing table of 16-byte slots
//!   ([`table`]): a block is identified by its whole prefix (the chain hash), so a prompt's
//!   leading-match walk is one hash lookup per block — normally one cache line, holders included
//!   ([`workers`]: up to three inline, a bitmap in a shared arena beyond) — with no tree to keep
//!   balanced and no per-entry allocation.
//! * Per worker (slot): `engine hash → BlockRef {chain, parent, seed, refs, kids}` (32-byte slots).
//!   Engine hashes are opaque ids only used to find a store's parent and a removal's block; the
//!   chain hash is always recomputed here from the event's token ids ([`kvmesh_core::hashing`]). A
//!   store whose parent engine hash is unknown cannot be chained, so it is refused and counted (an
//!   orphan), never guessed — unless a prompt routed to the worker explains it ([`recovery`]). `refs` counts duplicate stores of one engine hash (vLLM can cache one
//!   hash in two physical blocks); `parent`/`kids` tell whether a removal leaves a child behind.
//! * The index lives in DRAM once it is big, so every path is arranged to overlap cache misses:
//!   an event's chain hashes are computed first and the table lines of a chunk of its blocks are
//!   touched together before any is changed; queries probe several blocks per round trip.
//! * Matching gallops ([`matching`]). A chain hash names its whole prefix, so a worker whose
//!   holdings are prefix-closed ("clean": no block removed while a child stayed, no index
//!   eviction) holds blocks 0..j whenever it holds block j; for such workers the leading-match
//!   depths are found by galloping and a many-way search instead of one lookup per block. A dirty
//!   worker (tracked exactly, cleared when its map empties) gets the block-by-block walk. Both are
//!   exact; a proptest checks they agree after arbitrary histories.
//! * Memory is bounded by `max_entries` (block, worker) pairs: beyond it, blocks are evicted by
//!   CLOCK over the table's own slots (no queue to keep): each block has a 2-bit age — 1 when
//!   stored, 2 when a query finds it or it is stored again — that the hand decrements and evicts
//!   at 0, so an unused new block survives one to two turns of the hand and a used one two to
//!   three. Queries refresh the age through an atomic under the read lock. Eviction drops a block
//!   from the index but keeps the workers' engine-hash mappings, so later stores still chain (and
//!   marks its holders dirty). The mappings are bounded per worker by `max_blocks_per_worker` (the
//!   caller resyncs beyond it).
//!
//! * Local-hash seeds (LoRA × `cache_salt`, client-chosen) are kept once in [`seeds`] and named by
//!   id from each mapping; ids no mapping uses are reclaimed, so cycled salts cannot fill it.
//! * Tables grow off the write lock ([`growth`]).
//! * Hybrid models' other KV cache groups are kept beside it per worker ([`groups`]).
//! * Lower tiers (CPU memory, disk: vLLM's offloading connector, SGLang's HiCache) are each an
//!   index of this same shape over the same worker slots, created on the tier's first store and
//!   kept beside the GPU one ([`tiers`]): a block's residency is per (block, worker, tier), so a
//!   GPU removal leaves a CPU copy indexed and the other way round. [`KvIndex::find_matches`] reads
//!   the GPU index alone; [`KvIndex::find_lower_matches`] continues each worker's GPU match into
//!   the lower tiers.
//!
//! Everything here is synchronous and free of I/O; the applier thread owns writes. Past 600 lines:
//! the write paths (store, remove, evict, clear) share the private tables and their invariants.

#[cfg(test)]
mod consistency;
mod group_rule;
mod groups;
mod growth;
mod matching;
mod recovery;
mod seeds;
mod slots;
mod table;
mod tiers;
mod workers;

use std::sync::atomic::{AtomicU64, Ordering};

use kvmesh_core::hashing::{self, SequenceHash};

pub use group_rule::GroupKind;
pub use groups::{GroupEvent, GroupStore, MAX_GROUPS};
pub use growth::{Growth, Room};
pub use recovery::{RoutedPrompts, DEFAULT_RECOVERY_BLOCKS};
use seeds::SeedTable;
pub use seeds::MAX_SEEDS;
/// The one-shot block hash (the tokenizer hashes a prompt's blocks with it too).
pub(crate) use slots::block_hash;
pub use slots::BlockRef;
use slots::{BlockSlot, RefSlot, AGE_NEW, AGE_USED};
use table::Table;
pub use tiers::{Tier, TierBlocks, TierScores};
use workers::{Bitmaps, Holders, AGE_MASK, AGE_SHIFT};
pub use workers::{WorkerSlot, MAX_SLOT};

#[derive(Default)]
struct WorkerBlocks {
    active: bool,
    /// Not known to be prefix-closed (see [`KvIndex::find_matches`]); cleared when the map empties.
    dirty: bool,
    map: Table<RefSlot, 2>,
}

/// The result of one `BlockStored`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Blocks stored (new or duplicate).
    Stored { blocks: usize },
    /// Blocks stored although the parent engine hash was unknown: the parent chain was learned
    /// from a prompt routed to the worker ([`recovery`]).
    Recovered { blocks: usize },
    /// The parent engine hash is unknown: nothing stored.
    Orphan,
    /// The token ids do not cover `block_hashes × block_size`: nothing stored.
    Malformed,
    /// The store's seed (LoRA × `cache_salt`) is new and the seed table is full of seeds in use
    /// ([`seeds`]): nothing stored.
    SeedTableFull,
    /// The worker now claims more than `max_blocks_per_worker` blocks: the caller must resync it.
    TooManyBlocks,
    /// The slot is not registered (a stale event after the worker left): nothing stored.
    UnknownWorker,
}

/// Per-prompt leading-match counts: `(slot, blocks)` for every worker holding at least block 0.
pub type OverlapScores = Vec<(WorkerSlot, u32)>;

/// Blocks of one event whose table lines are fetched together before any is changed.
const CHUNK: usize = 16;

/// The index. Writers need `&mut`; [`KvIndex::find_matches`] needs `&self` only.
pub struct KvIndex {
    blocks: Table<BlockSlot, 4>,
    bitmaps: Bitmaps,
    /// The CLOCK hand: a slot position in `blocks`.
    hand: usize,
    workers: Vec<WorkerBlocks>,
    /// Local-hash seeds by id, reclaimed when no mapping uses them ([`seeds`]).
    seeds: SeedTable,
    /// Bitmap of dirty worker slots (mirrors `WorkerBlocks::dirty`) for a word-wise check.
    dirty_words: Vec<u64>,
    max_entries: usize,
    max_blocks_per_worker: usize,
    entries: usize,
    evictions: u64,
    /// Chain hashes of the store being applied (kept to reuse its allocation).
    scratch: Vec<u64>,
    /// Prompts routed to each worker, for orphan recovery (written under the read lock).
    routed: parking_lot::Mutex<RoutedPrompts>,
    /// The lower tiers' indexes ([`Tier::Cpu`], [`Tier::Disk`]), each created on its first store
    /// ([`tiers`]); always `None` inside a lower tier's own index.
    lower: [Option<Box<KvIndex>>; 2],
    /// Workers' KV cache groups beyond the main one ([`groups`]; unused in a lower tier's index).
    groups: groups::Groups,
}

impl KvIndex {
    /// An empty index bounded to `max_entries` (block, worker) pairs and `max_blocks_per_worker`
    /// engine-hash mappings per worker.
    pub fn new(max_entries: usize, max_blocks_per_worker: usize) -> Self {
        Self {
            blocks: Table::default(),
            bitmaps: Bitmaps::default(),
            hand: 0,
            workers: Vec::new(),
            seeds: SeedTable::new(MAX_SEEDS),
            dirty_words: Vec::new(),
            max_entries: max_entries.max(1),
            max_blocks_per_worker: max_blocks_per_worker.max(1),
            entries: 0,
            evictions: 0,
            scratch: Vec::new(),
            routed: Default::default(),
            lower: [None, None],
            groups: Default::default(),
        }
    }

    /// Changes the bounds (a reload); evicts at once if the index is now over.
    pub fn set_limits(&mut self, max_entries: usize, max_blocks_per_worker: usize) {
        for t in self.lower.iter_mut().flatten() {
            t.set_limits(max_entries, max_blocks_per_worker);
        }
        self.max_entries = max_entries.max(1);
        self.max_blocks_per_worker = max_blocks_per_worker.max(1);
        self.enforce_bound();
        self.blocks.shrink_if_sparse();
    }

    /// Makes `slot` a live worker (idempotent). Slots are small dense numbers chosen by the caller;
    /// a slot above [`MAX_SLOT`] is not registered (its stores answer `UnknownWorker`).
    pub fn add_worker(&mut self, slot: WorkerSlot) {
        if slot > MAX_SLOT {
            return;
        }
        let i = slot as usize;
        if self.workers.len() <= i {
            self.workers.resize_with(i + 1, WorkerBlocks::default);
        }
        self.bitmaps.ensure_slots(i + 1);
        if !self.workers[i].active {
            self.groups.forget(slot); // a slot registered anew: no groups of its former worker
        }
        self.workers[i].active = true;
        for t in self.lower.iter_mut().flatten() {
            t.add_worker(slot);
        }
    }

    /// Forgets everything `slot` holds in this tier's index (see [`KvIndex::clear_worker`]).
    fn clear_own(&mut self, slot: WorkerSlot) {
        let Some(w) = self.workers.get_mut(slot as usize) else { return };
        let map = w.map.take();
        let chains: Vec<u64> = map.iter().map(|s| s.r.chain.0).collect();
        for s in map.iter() {
            self.seeds.release(s.r.seed_id());
        }
        drop(map);
        for chunk in chains.chunks(CHUNK) {
            std::hint::black_box(chunk.iter().fold(0, |a, c| a ^ self.blocks.touch(*c)));
            for c in chunk {
                self.unhold(*c, slot);
            }
        }
        self.set_dirty(slot, false);
        self.blocks.shrink_if_sparse();
        self.groups.clear(slot);
    }

    fn set_dirty(&mut self, slot: WorkerSlot, dirty: bool) {
        if let Some(w) = self.workers.get_mut(slot as usize) {
            w.dirty = dirty;
        }
        let (word, bit) = ((slot / 64) as usize, slot % 64);
        if self.dirty_words.len() <= word {
            if !dirty {
                return;
            }
            self.dirty_words.resize(word + 1, 0);
        }
        if dirty {
            self.dirty_words[word] |= 1 << bit;
        } else {
            self.dirty_words[word] &= !(1 << bit);
        }
    }

    /// New seeds refused because the seed table was full of seeds in use, since start.
    pub fn seed_refusals(&self) -> u64 {
        self.seeds.refusals()
    }

    /// Seeds in the seed table (the unsalted one included).
    pub fn seeds(&self) -> usize {
        self.seeds.len()
    }

    /// Applies a `BlockStored`: `block_hashes[i]` covers `token_ids[i*bs..(i+1)*bs]`; the chain
    /// continues from `parent` (an engine hash of this worker) or starts at the root with `root_seed`.
    pub fn store(
        &mut self,
        slot: WorkerSlot,
        parent: Option<u64>,
        block_hashes: &[u64],
        token_ids: &[u32],
        block_size: usize,
        root_seed: u64,
    ) -> StoreOutcome {
        self.store_from(slot, parent, None, block_hashes, token_ids, block_size, root_seed, &[])
    }

    /// [`KvIndex::store`], with `known_parent` = the chain hash and seed of `parent` when another
    /// tier of the same worker maps it (a CPU store continuing a block still on the GPU): used when
    /// this tier's own map lacks `parent`. Block `i` is keyed by `terms[i]` (`store_keyed_in`).
    #[allow(clippy::too_many_arguments)]
    fn store_from(
        &mut self,
        slot: WorkerSlot,
        parent: Option<u64>,
        known_parent: Option<(SequenceHash, u64)>,
        block_hashes: &[u64],
        token_ids: &[u32],
        block_size: usize,
        root_seed: u64,
        terms: &[u64],
    ) -> StoreOutcome {
        if block_size == 0 || token_ids.len() != block_hashes.len() * block_size {
            return StoreOutcome::Malformed;
        }
        let Some(w) = self.workers.get(slot as usize).filter(|w| w.active) else {
            return StoreOutcome::UnknownWorker;
        };
        let mut recovered = false;
        let mut hinted = false;
        let (mut prev, seed_id) = match parent {
            None => (None, None),
            Some(p) => match w.map.get(p) {
                Some(s) => (Some(s.r.chain), Some(s.r.seed_id())),
                // The parent is in another tier only: this tier's holdings are no longer
                // prefix-closed (the worker is dirty, see `find_matches`).
                None if known_parent.is_some() => {
                    let Some((chain, seed)) = known_parent else { return StoreOutcome::Orphan };
                    hinted = true;
                    match self.seeds.intern(seed) {
                        Some(id) => (Some(chain), Some(id)),
                        None => return StoreOutcome::SeedTableFull,
                    }
                }
                // Recovery compares unkeyed local hashes: a keyed store stays an orphan.
                None if !terms.is_empty() => return StoreOutcome::Orphan,
                None => match self.recover_parent(slot, p, token_ids, block_size, root_seed) {
                    Some(chain) => {
                        recovered = true;
                        (Some(chain), None)
                    }
                    None => return StoreOutcome::Orphan,
                },
            },
        };
        let seed_id = match seed_id.or_else(|| self.seeds.intern(root_seed)) {
            Some(id) => id,
            None => return StoreOutcome::SeedTableFull,
        };
        let seed = self.seeds.seed(seed_id);
        // Hash first (pure compute), so each chunk's table lines can be fetched together below.
        let mut chains = std::mem::take(&mut self.scratch);
        chains.clear();
        for (i, tokens) in token_ids.chunks_exact(block_size).enumerate() {
            let keyed = hashing::keyed_seed(seed, terms.get(i).copied().unwrap_or(0));
            let c = hashing::chain(prev, block_hash(tokens, keyed));
            chains.push(c.0);
            prev = Some(c);
        }
        let mut parent_engine = parent;
        for (engines, hashes) in block_hashes.chunks(CHUNK).zip(chains.chunks(CHUNK)) {
            let map = &self.workers[slot as usize].map;
            let touched = engines
                .iter()
                .zip(hashes)
                .fold(0, |a, (e, c)| a ^ map.touch(*e) ^ self.blocks.touch(*c));
            std::hint::black_box(touched);
            for (engine, chain) in engines.iter().zip(hashes) {
                self.hold_engine(slot, *engine, parent_engine, SequenceHash(*chain), seed_id);
                parent_engine = Some(*engine);
            }
        }
        self.scratch = chains;
        if hinted {
            self.set_dirty(slot, true);
        }
        self.enforce_bound();
        if self.worker_blocks(slot) > self.max_blocks_per_worker {
            return StoreOutcome::TooManyBlocks;
        }
        if recovered {
            return StoreOutcome::Recovered { blocks: block_hashes.len() };
        }
        StoreOutcome::Stored { blocks: block_hashes.len() }
    }

    /// Applies a `BlockRemoved`; returns how many hashes were unknown (ignored).
    ///
    /// The batch is taken as a whole: a parent and its child removed in one batch (in any order)
    /// leave no orphaned child behind. A block removed while a child stays mapped marks the worker
    /// dirty (its holdings are no longer prefix-closed).
    pub fn remove(&mut self, slot: WorkerSlot, block_hashes: &[u64]) -> usize {
        let Some(w) = self.workers.get_mut(slot as usize) else { return block_hashes.len() };
        let mut unknown = 0;
        let mut gone: Vec<(u64, BlockRef)> = Vec::with_capacity(block_hashes.len());
        for chunk in block_hashes.chunks(CHUNK) {
            std::hint::black_box(chunk.iter().fold(0, |a, e| a ^ w.map.touch(*e)));
            for engine in chunk {
                let Some(pos) = w.map.find(*engine) else {
                    unknown += 1;
                    continue;
                };
                let r = &mut w.map.at_mut(pos).r;
                r.refs = r.refs.saturating_sub(1);
                if r.refs == 0 {
                    gone.push((*engine, w.map.remove_at(pos).r));
                }
            }
        }
        if gone.is_empty() {
            return unknown;
        }
        // Children leaving in this batch no longer count as their parents' kids.
        let mut sorted: Option<Vec<(u64, usize)>> = None;
        for i in 0..gone.len() {
            let Some(p) = gone[i].1.parent() else { continue };
            let parent = match w.map.get_mut(p) {
                Some(s) => Some(&mut s.r),
                None => {
                    // Parent gone in this batch too: usually its neighbour in the batch.
                    let j = if i > 0 && gone[i - 1].0 == p {
                        Some(i - 1)
                    } else if gone.get(i + 1).is_some_and(|g| g.0 == p) {
                        Some(i + 1)
                    } else {
                        let idx = sorted.get_or_insert_with(|| {
                            let mut v: Vec<(u64, usize)> =
                                gone.iter().enumerate().map(|(i, (h, _))| (*h, i)).collect();
                            v.sort_unstable();
                            v
                        });
                        idx.binary_search_by_key(&p, |e| e.0).ok().map(|k| idx[k].1)
                    };
                    j.map(|j| &mut gone[j].1)
                }
            };
            if let Some(r) = parent {
                if r.kids != u16::MAX {
                    r.kids = r.kids.saturating_sub(1);
                }
            }
        }
        let interior = gone.iter().any(|(_, r)| r.kids > 0);
        // Synthetic ancestors (orphan recovery) leave with their last child.
        let parents: Vec<u64> = gone
            .iter()
            .filter_map(|(_, r)| r.parent())
            .filter(|p| {
                w.map.get(*p).is_some_and(|s| recovery::is_synthetic(*p, &s.r) && s.r.kids == 0)
            })
            .collect();
        let now_empty = w.map.len() == 0;
        for chunk in gone.chunks(CHUNK) {
            std::hint::black_box(
                chunk.iter().fold(0, |a, (_, r)| a ^ self.blocks.touch(r.chain.0)),
            );
            for (_, r) in chunk {
                self.unhold(r.chain.0, slot);
                self.seeds.release(r.seed_id());
            }
        }
        let now_empty = if parents.is_empty() {
            now_empty
        } else {
            self.drop_childless_synthetic(slot, parents);
            self.workers.get(slot as usize).is_none_or(|w| w.map.len() == 0)
        };
        if now_empty {
            self.set_dirty(slot, false);
        } else if interior {
            self.set_dirty(slot, true);
        }
        unknown
    }

    /// Records that `slot` holds the whole chain `chains` (approximate mode: the chain hash is also
    /// the engine hash). Idempotent.
    pub fn insert_chain(&mut self, slot: WorkerSlot, chains: &[SequenceHash]) -> StoreOutcome {
        let Some(w) = self.workers.get_mut(slot as usize).filter(|w| w.active) else {
            return StoreOutcome::UnknownWorker;
        };
        let mut new = Vec::new();
        let mut parent: Option<u64> = None;
        for c in chains {
            let (s, _) = w
                .map
                .get_or_insert_with(c.0, || RefSlot { key: c.0, r: BlockRef::new(*c, parent, 0) });
            if s.r.refs == 0 {
                s.r.refs = 1;
                new.push(c.0);
                if let Some(pr) = parent.and_then(|p| w.map.get_mut(p)) {
                    pr.r.kids = pr.r.kids.saturating_add(1);
                }
            }
            parent = Some(c.0);
        }
        for c in new {
            self.hold(c, slot);
        }
        self.enforce_bound();
        StoreOutcome::Stored { blocks: chains.len() }
    }

    fn hold_engine(
        &mut self,
        slot: WorkerSlot,
        engine: u64,
        parent: Option<u64>,
        chain: SequenceHash,
        seed: u32,
    ) {
        let w = &mut self.workers[slot as usize];
        let (s, new) = w.map.get_or_insert_with(engine, || RefSlot {
            key: engine,
            r: BlockRef::new(chain, parent, seed),
        });
        let r = &mut s.r;
        if new {
            self.seeds.retain(seed);
        }
        let stale = if r.chain != chain {
            // The engine reused a hash for different content: the old mapping is stale.
            let old = r.chain.0;
            self.seeds.release(r.seed_id());
            self.seeds.retain(seed);
            *r = BlockRef::new(chain, parent, seed);
            Some(old)
        } else {
            None
        };
        let first = r.refs == 0;
        r.refs = r.refs.saturating_add(1);
        if first {
            if let Some(pr) = parent.and_then(|p| w.map.get_mut(p)) {
                pr.r.kids = pr.r.kids.saturating_add(1);
            }
        }
        if let Some(old) = stale {
            self.unhold(old, slot);
            self.set_dirty(slot, true);
        }
        self.hold(chain.0, slot);
    }

    fn hold(&mut self, chain: u64, slot: WorkerSlot) {
        let (s, new) = self.blocks.get_or_insert_with(chain, || BlockSlot {
            key: chain,
            word: AtomicU64::new(workers::single(slot, AGE_NEW)),
        });
        self.entries += 1;
        if new {
            return;
        }
        let word = s.word.get_mut();
        if !workers::insert(word, slot, &mut self.bitmaps) {
            self.entries -= 1;
        }
        *word = (*word & !AGE_MASK) | AGE_USED << AGE_SHIFT;
    }

    fn unhold(&mut self, chain: u64, slot: WorkerSlot) {
        let Some(pos) = self.blocks.find(chain) else { return };
        let word = self.blocks.at_mut(pos).word.get_mut();
        if workers::remove(word, slot, &mut self.bitmaps) {
            self.entries -= 1;
        }
        if workers::count(*word) == 0 {
            self.blocks.remove_at(pos);
        }
    }

    fn enforce_bound(&mut self) {
        // CLOCK over the table slots: a block of age > 0 is aged and passed over, one of age 0 is
        // evicted. Three turns of the hand bring every age to 0, so the budget ends the loop.
        let mut budget = 3 * self.blocks.slots() + 3;
        let mut holders = Vec::new();
        while self.entries > self.max_entries && budget > 0 {
            budget -= 1;
            let total = self.blocks.slots();
            if total == 0 {
                break;
            }
            if self.hand >= total {
                self.hand = 0;
            }
            let word = self.blocks.at_mut(self.hand).word.get_mut();
            if *word == 0 {
                self.hand += 1;
                continue;
            }
            if *word & AGE_MASK != 0 {
                *word -= 1 << AGE_SHIFT;
                self.hand += 1;
                continue;
            }
            // Evict. The hand stays: a later entry may have shifted back into this slot.
            let word = self.blocks.remove_at(self.hand).word.into_inner();
            holders.clear();
            Holders::of(word, &self.bitmaps).for_each(|s| holders.push(s));
            workers::release(word, &mut self.bitmaps);
            self.entries -= holders.len();
            self.evictions += 1;
            // The holders' mappings stay, so their holdings may now have a hole.
            for &s in &holders {
                self.set_dirty(s, true);
            }
        }
    }

    /// Distinct blocks in the index.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// (block, worker) pairs in the index.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Blocks evicted by the memory bound since start, every tier's.
    pub fn evictions(&self) -> u64 {
        self.evictions + self.lower.iter().flatten().map(|t| t.evictions).sum::<u64>()
    }

    /// Engine-hash mappings `slot` holds (its blocks per events, evicted or not).
    pub fn worker_blocks(&self, slot: WorkerSlot) -> usize {
        self.workers.get(slot as usize).map_or(0, |w| w.map.len())
    }

    /// Whether `slot` holds block `chain` in the index.
    pub fn holds(&self, slot: WorkerSlot, chain: SequenceHash) -> bool {
        self.blocks.get(chain.0).is_some_and(|s| {
            Holders::of(s.word.load(Ordering::Relaxed), &self.bitmaps).contains(slot)
        })
    }

    /// `slot`'s engine hashes with what they map to (debug and tests).
    pub fn worker_refs(&self, slot: WorkerSlot) -> Vec<(u64, BlockRef)> {
        self.workers
            .get(slot as usize)
            .map_or_else(Vec::new, |w| w.map.iter().map(|s| (s.key, s.r)).collect())
    }

    /// Heap bytes held (tables, bitmap arena, per-worker tables, seeds; every tier's) — what is
    /// allocated, at capacity, not an estimate per entry.
    pub fn approx_bytes(&self) -> usize {
        let lower: usize = self.lower.iter().flatten().map(|t| t.approx_bytes()).sum();
        let mut total = lower
            + self.blocks.bytes()
            + self.bitmaps.bytes()
            + self.workers.capacity() * std::mem::size_of::<WorkerBlocks>();
        total += self.workers.iter().map(|w| w.map.bytes()).sum::<usize>();
        // hashbrown: one control byte plus the (key, value) slot per bucket.
        total += self.groups.bytes();
        total + self.seeds.bytes() + self.dirty_words.capacity() * 8 + self.scratch.capacity() * 8
    }
}

#[cfg(test)]
mod tests;
