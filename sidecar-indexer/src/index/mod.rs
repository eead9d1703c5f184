//! The block index: which workers hold which KV blocks, keyed by Dynamo-compatible chain hash.
//!
//! Shape, and why:
//! * `blocks: chain hash → entry {holders, referenced}`. A block is identified by its whole
//!   prefix (the chain hash), so a prompt's leading-match walk is one hash lookup per block with no
//!   tree to keep balanced, and a worker's position in a tree never has to be repaired.
//! * Per worker (slot): `engine hash → BlockRef {chain, parent, seed, refs, kids}`. Engine hashes
//!   are opaque ids only used to find a store's parent and a removal's block; the chain hash is
//!   always recomputed here from the event's token ids ([`kvmesh_core::hashing`]). A store whose
//!   parent engine hash is unknown cannot be chained, so it is refused and counted (an orphan),
//!   never guessed. `refs` counts duplicate stores of one engine hash (vLLM can cache one hash in
//!   two physical blocks); `parent`/`kids` tell whether a removal leaves a child behind.
//! * Matching gallops. A chain hash names its whole prefix, so a worker whose holdings are
//!   prefix-closed ("clean": no block removed while a child stayed, no index eviction) holds blocks
//!   0..j whenever it holds block j; for such workers the leading-match depths are found by
//!   galloping and binary search instead of one lookup per block. A dirty worker (tracked exactly,
//!   cleared when its map empties) gets the block-by-block walk. Both are exact; a proptest checks
//!   they agree after arbitrary histories.
//! * Memory is bounded by `max_entries` (block, worker) pairs: beyond it, blocks are evicted by
//!   second chance (CLOCK over a FIFO of chain hashes), an LRU approximation whose "use" bit a
//!   query can set through `&self` (an atomic), so queries run under a read lock concurrently.
//!   Eviction drops a block from the index but keeps the workers' engine-hash mappings, so later
//!   stores still chain (and marks its holders dirty). The mappings are bounded per worker by
//!   `max_blocks_per_worker` (the caller resyncs beyond it).
//!
//! Everything here is synchronous and free of I/O; the applier thread owns writes.

mod workers;

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};

use kvmesh_core::hashing::{self, SequenceHash};

pub use workers::{WorkerSet, WorkerSlot};

/// A hasher for keys that are already well-mixed 64-bit hashes (or small engine ids): one multiply.
#[derive(Default, Clone, Copy)]
pub struct U64Hasher(u64);

impl Hasher for U64Hasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(5) ^ u64::from(*b)).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
    fn write_u64(&mut self, n: u64) {
        // Fold the high half in and multiply: good spread in both the low bits (bucket) and the
        // high bits (hashbrown's control byte), also for sequential engine ids.
        self.0 = (n ^ (n >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        self.0 ^= self.0 >> 32;
    }
}

type U64Map<V> = HashMap<u64, V, BuildHasherDefault<U64Hasher>>;

/// What a worker's engine hash stands for (24 bytes: the per-worker maps dominate memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef {
    pub chain: SequenceHash,
    /// Engine hash of the parent mapping (meaningful when `seed & HAS_PARENT`).
    parent: u64,
    /// Index into the seed table (the local-hash seed of the chain, inherited by children), with
    /// [`HAS_PARENT`] in the top bit.
    seed: u32,
    /// Live stores of this engine hash not yet removed (saturating).
    pub refs: u16,
    /// Mapped children chained after this block (saturating; `u16::MAX` = unknown, treated as many).
    kids: u16,
}

const HAS_PARENT: u32 = 1 << 31;

impl BlockRef {
    fn new(chain: SequenceHash, parent: Option<u64>, seed: u32) -> Self {
        let flag = if parent.is_some() { HAS_PARENT } else { 0 };
        Self { chain, parent: parent.unwrap_or(0), seed: seed | flag, refs: 0, kids: 0 }
    }
    fn parent(&self) -> Option<u64> {
        (self.seed & HAS_PARENT != 0).then_some(self.parent)
    }
    fn seed_id(&self) -> u32 {
        self.seed & !HAS_PARENT
    }
}

struct Entry {
    holders: WorkerSet,
    referenced: AtomicBool,
}

#[derive(Default)]
struct WorkerBlocks {
    active: bool,
    /// Not known to be prefix-closed (see [`KvIndex::find_matches`]); cleared when the map empties.
    dirty: bool,
    map: U64Map<BlockRef>,
}

/// The result of one `BlockStored`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreOutcome {
    /// Blocks stored (new or duplicate).
    Stored { blocks: usize },
    /// The parent engine hash is unknown: nothing stored.
    Orphan,
    /// The token ids do not cover `block_hashes × block_size`, or the seed table is full: nothing stored.
    Malformed,
    /// The worker now claims more than `max_blocks_per_worker` blocks: the caller must resync it.
    TooManyBlocks,
    /// The slot is not registered (a stale event after the worker left): nothing stored.
    UnknownWorker,
}

/// Per-prompt leading-match counts: `(slot, blocks)` for every worker holding at least block 0.
pub type OverlapScores = Vec<(WorkerSlot, u32)>;

/// Most distinct local-hash seeds (LoRA × cache salt combinations) remembered.
pub const MAX_SEEDS: usize = 1 << 20;

/// Blocks looked up together in `find_matches`: independent lookups let the CPU overlap their
/// cache misses instead of paying them one after another.
const LOOKAHEAD: usize = 32;

/// The index. Writers need `&mut`; [`KvIndex::find_matches`] needs `&self` only.
pub struct KvIndex {
    blocks: U64Map<Entry>,
    /// Second-chance FIFO over chain hashes (CLOCK without positional access); may hold stale or
    /// repeated hashes, compacted when it grows past twice the live blocks.
    order: VecDeque<u64>,
    workers: Vec<WorkerBlocks>,
    seeds: Vec<u64>,
    seed_ids: U64Map<u32>,
    /// Bitmap of dirty worker slots (mirrors `WorkerBlocks::dirty`) for a word-wise check.
    dirty_words: Vec<u64>,
    max_entries: usize,
    max_blocks_per_worker: usize,
    entries: usize,
    evictions: u64,
}

impl KvIndex {
    /// An empty index bounded to `max_entries` (block, worker) pairs and `max_blocks_per_worker`
    /// engine-hash mappings per worker.
    pub fn new(max_entries: usize, max_blocks_per_worker: usize) -> Self {
        let mut seed_ids = U64Map::default();
        seed_ids.insert(hashing::XXH3_SEED, 0);
        Self {
            blocks: U64Map::default(),
            order: VecDeque::new(),
            workers: Vec::new(),
            seeds: vec![hashing::XXH3_SEED],
            seed_ids,
            dirty_words: Vec::new(),
            max_entries: max_entries.max(1),
            max_blocks_per_worker: max_blocks_per_worker.max(1),
            entries: 0,
            evictions: 0,
        }
    }

    /// Changes the bounds (a reload); evicts at once if the index is now over.
    pub fn set_limits(&mut self, max_entries: usize, max_blocks_per_worker: usize) {
        self.max_entries = max_entries.max(1);
        self.max_blocks_per_worker = max_blocks_per_worker.max(1);
        self.enforce_bound();
    }

    /// Makes `slot` a live worker (idempotent). Slots are small dense numbers chosen by the caller.
    pub fn add_worker(&mut self, slot: WorkerSlot) {
        let i = slot as usize;
        if self.workers.len() <= i {
            self.workers.resize_with(i + 1, WorkerBlocks::default);
        }
        self.workers[i].active = true;
    }

    /// Forgets everything `slot` holds and retires it (its blocks leave the index).
    pub fn remove_worker(&mut self, slot: WorkerSlot) {
        self.clear_worker(slot);
        if let Some(w) = self.workers.get_mut(slot as usize) {
            w.active = false;
            w.map = U64Map::default();
        }
    }

    /// Forgets everything `slot` holds (`AllBlocksCleared`, a resync) but keeps it registered.
    pub fn clear_worker(&mut self, slot: WorkerSlot) {
        let Some(w) = self.workers.get_mut(slot as usize) else { return };
        let map = std::mem::take(&mut w.map);
        for r in map.values() {
            self.unhold(r.chain.0, slot);
        }
        self.set_dirty(slot, false);
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

    fn seed_id(&mut self, seed: u64) -> Option<u32> {
        if let Some(&id) = self.seed_ids.get(&seed) {
            return Some(id);
        }
        if self.seeds.len() >= MAX_SEEDS {
            return None;
        }
        let id = self.seeds.len() as u32;
        self.seeds.push(seed);
        self.seed_ids.insert(seed, id);
        Some(id)
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
        if block_size == 0 || token_ids.len() != block_hashes.len() * block_size {
            return StoreOutcome::Malformed;
        }
        let Some(w) = self.workers.get(slot as usize).filter(|w| w.active) else {
            return StoreOutcome::UnknownWorker;
        };
        let (mut prev, seed_id) = match parent {
            None => (None, None),
            Some(p) => match w.map.get(&p) {
                Some(r) => (Some(r.chain), Some(r.seed_id())),
                None => return StoreOutcome::Orphan,
            },
        };
        let seed_id = match seed_id.or_else(|| self.seed_id(root_seed)) {
            Some(id) => id,
            None => return StoreOutcome::Malformed,
        };
        let seed = self.seeds[seed_id as usize];
        let mut parent_engine = parent;
        for (engine, tokens) in block_hashes.iter().zip(token_ids.chunks_exact(block_size)) {
            let chain = hashing::chain(prev, hashing::local_block_hash(tokens, seed));
            self.hold_engine(slot, *engine, parent_engine, chain, seed_id);
            prev = Some(chain);
            parent_engine = Some(*engine);
        }
        self.enforce_bound();
        if self.worker_blocks(slot) > self.max_blocks_per_worker {
            return StoreOutcome::TooManyBlocks;
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
        let mut gone: Vec<(u64, BlockRef)> = Vec::new();
        for engine in block_hashes {
            let Some(r) = w.map.get_mut(engine) else {
                unknown += 1;
                continue;
            };
            r.refs = r.refs.saturating_sub(1);
            if r.refs == 0 {
                if let Some(r) = w.map.remove(engine) {
                    gone.push((*engine, r));
                }
            }
        }
        if gone.is_empty() {
            return unknown;
        }
        // Children leaving in this batch no longer count as their parents' kids.
        let positions: U64Map<usize> = if gone.len() > 8 { gone.iter().enumerate().map(|(i, (h, _))| (*h, i)).collect() } else { U64Map::default() };
        for i in 0..gone.len() {
            let Some(p) = gone[i].1.parent() else { continue };
            let parent = match w.map.get_mut(&p) {
                Some(r) => Some(r),
                None => {
                    let j = if gone.len() > 8 { positions.get(&p).copied() } else { gone.iter().position(|(h, _)| *h == p) };
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
        let now_empty = w.map.is_empty();
        for (_, r) in &gone {
            self.unhold(r.chain.0, slot);
        }
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
            let r = w.map.entry(c.0).or_insert(BlockRef::new(*c, parent, 0));
            if r.refs == 0 {
                r.refs = 1;
                new.push(c.0);
                if let Some(pr) = parent.and_then(|p| w.map.get_mut(&p)) {
                    pr.kids = pr.kids.saturating_add(1);
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

    fn hold_engine(&mut self, slot: WorkerSlot, engine: u64, parent: Option<u64>, chain: SequenceHash, seed: u32) {
        let w = &mut self.workers[slot as usize];
        let r = w.map.entry(engine).or_insert(BlockRef::new(chain, parent, seed));
        let stale = if r.chain != chain {
            // The engine reused a hash for different content: the old mapping is stale.
            let old = r.chain.0;
            *r = BlockRef::new(chain, parent, seed);
            Some(old)
        } else {
            None
        };
        let first = r.refs == 0;
        r.refs = r.refs.saturating_add(1);
        if first {
            if let Some(pr) = parent.and_then(|p| w.map.get_mut(&p)) {
                pr.kids = pr.kids.saturating_add(1);
            }
        }
        if let Some(old) = stale {
            self.unhold(old, slot);
            self.set_dirty(slot, true);
        }
        self.hold(chain.0, slot);
    }

    fn hold(&mut self, chain: u64, slot: WorkerSlot) {
        match self.blocks.entry(chain) {
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let e = o.get_mut();
                if e.holders.insert(slot) {
                    self.entries += 1;
                }
                e.referenced.store(true, Ordering::Relaxed);
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                // New blocks start unreferenced: a block is "used" when a query matches it or it is
                // stored again. Otherwise a sweep over all-referenced entries would evict hot ones.
                v.insert(Entry { holders: WorkerSet::single(slot), referenced: AtomicBool::new(false) });
                self.order.push_back(chain);
                self.entries += 1;
            }
        }
    }

    fn unhold(&mut self, chain: u64, slot: WorkerSlot) {
        let Some(e) = self.blocks.get_mut(&chain) else { return };
        if e.holders.remove(slot) {
            self.entries -= 1;
        }
        if e.holders.is_empty() {
            self.blocks.remove(&chain);
            if self.order.len() > 2 * self.blocks.len() + 1024 {
                self.compact_order();
            }
        }
    }

    /// Drops stale and repeated hashes from the eviction queue (amortised O(1) per removal).
    fn compact_order(&mut self) {
        let mut seen = std::collections::HashSet::with_capacity_and_hasher(self.blocks.len(), BuildHasherDefault::<U64Hasher>::default());
        let blocks = &self.blocks;
        self.order.retain(|c| blocks.contains_key(c) && seen.insert(*c));
    }

    fn enforce_bound(&mut self) {
        // Second chance: a referenced block loses its bit and goes to the back; at most one full
        // pass clears every bit, so the loop ends.
        let mut budget = 2 * self.order.len() + 2;
        while self.entries > self.max_entries && budget > 0 {
            budget -= 1;
            let Some(chain) = self.order.pop_front() else { break };
            let Some(e) = self.blocks.get(&chain) else { continue };
            if e.referenced.swap(false, Ordering::Relaxed) {
                self.order.push_back(chain);
                continue;
            }
            if let Some(e) = self.blocks.remove(&chain) {
                self.entries -= e.holders.len();
                self.evictions += 1;
                // The holders' mappings stay, so their holdings may now have a hole.
                for s in e.holders.iter() {
                    self.set_dirty(s, true);
                }
            }
        }
    }

    /// Per worker slot, how many leading blocks of `chains` it holds (workers holding none of the
    /// first block are absent). Stops as soon as no worker matches the prefix so far.
    ///
    /// Exact in every case. When every worker holding block 0 is *clean* — its holdings are
    /// prefix-closed: no block was removed while a child stayed, no index eviction touched it —
    /// holding block j implies holding blocks 0..j (a chain hash names its whole prefix), so the
    /// holder sets shrink monotonically along the prompt and the drop-out points are found by
    /// galloping and binary search: O(drops × log blocks) lookups instead of one per block.
    /// Otherwise every block is checked ([`KvIndex::walk`]). vLLM-style eviction (children before
    /// parents) keeps workers clean.
    pub fn find_matches(&self, chains: &[SequenceHash]) -> OverlapScores {
        let Some(first) = chains.first().and_then(|c| self.lookup(c.0)) else { return OverlapScores::new() };
        let mut active = workers::Active::from_set(&first.holders);
        if active.any_in(&self.dirty_words) {
            return self.walk(chains);
        }
        let mut scores = OverlapScores::new();
        let n = chains.len();
        let all_hold = |active: &workers::Active, j: usize| self.lookup(chains[j].0).is_some_and(|e| active.subset_of(&e.holders));
        let mut lo = 0usize; // every active worker holds blocks 0..=lo
        while lo + 1 < n {
            let mut step = 1;
            let hi = loop {
                let j = (lo + step).min(n - 1);
                if !all_hold(&active, j) {
                    break j;
                }
                lo = j;
                if j == n - 1 {
                    break n;
                }
                step *= 2;
            };
            if hi == n {
                break;
            }
            let mut hi = hi;
            while hi - lo > 1 {
                let mid = lo + (hi - lo) / 2;
                if all_hold(&active, mid) {
                    lo = mid;
                } else {
                    hi = mid;
                }
            }
            // Block `hi` is the first some active worker lacks: those hold exactly `hi` blocks.
            match self.lookup(chains[hi].0) {
                None => {
                    active.for_each(|s| scores.push((s, hi as u32)));
                    return scores;
                }
                Some(e) => {
                    active.intersect(&e.holders, |s| scores.push((s, hi as u32)));
                    if active.is_empty() {
                        return scores;
                    }
                }
            }
            lo = hi;
        }
        active.for_each(|s| scores.push((s, n as u32)));
        scores
    }

    #[inline]
    fn lookup(&self, chain: u64) -> Option<&Entry> {
        let e = self.blocks.get(&chain)?;
        // Load first: writing a cache line every query would make readers fight over it.
        if !e.referenced.load(Ordering::Relaxed) {
            e.referenced.store(true, Ordering::Relaxed);
        }
        Some(e)
    }

    /// [`KvIndex::find_matches`] checking every block (for dirty workers, and as its test oracle).
    pub fn walk(&self, chains: &[SequenceHash]) -> OverlapScores {
        let mut scores = OverlapScores::new();
        let mut active: Option<workers::Active> = None;
        let mut depth = 0u32;
        let mut found: [Option<&Entry>; LOOKAHEAD] = [None; LOOKAHEAD];
        for chunk in chains.chunks(LOOKAHEAD) {
            for (slot, c) in found.iter_mut().zip(chunk) {
                *slot = self.blocks.get(&c.0);
            }
            for e in &found[..chunk.len()] {
                let Some(e) = e else {
                    if let Some(a) = &active {
                        a.for_each(|s| scores.push((s, depth)));
                    }
                    return scores;
                };
                if !e.referenced.load(Ordering::Relaxed) {
                    // Load first: writing a cache line every query would make readers fight over it.
                    e.referenced.store(true, Ordering::Relaxed);
                }
                match &mut active {
                    None => active = Some(workers::Active::from_set(&e.holders)),
                    Some(a) => {
                        a.intersect(&e.holders, |s| scores.push((s, depth)));
                        if a.is_empty() {
                            return scores;
                        }
                    }
                }
                depth += 1;
            }
        }
        if let Some(a) = &active {
            a.for_each(|s| scores.push((s, depth)));
        }
        scores
    }

    /// Distinct blocks in the index.
    pub fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// (block, worker) pairs in the index.
    pub fn entries(&self) -> usize {
        self.entries
    }

    /// Blocks evicted by the memory bound since start.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Engine-hash mappings `slot` holds (its blocks per events, evicted or not).
    pub fn worker_blocks(&self, slot: WorkerSlot) -> usize {
        self.workers.get(slot as usize).map_or(0, |w| w.map.len())
    }

    /// Whether `slot` holds block `chain` in the index.
    pub fn holds(&self, slot: WorkerSlot, chain: SequenceHash) -> bool {
        self.blocks.get(&chain.0).is_some_and(|e| e.holders.contains(slot))
    }

    /// `slot`'s engine hashes with what they map to (debug and tests).
    pub fn worker_refs(&self, slot: WorkerSlot) -> Vec<(u64, BlockRef)> {
        self.workers.get(slot as usize).map_or_else(Vec::new, |w| w.map.iter().map(|(k, v)| (*k, *v)).collect())
    }

    /// Approximate heap bytes held (tables at capacity, queue, bitmaps, per-worker maps).
    pub fn approx_bytes(&self) -> usize {
        // hashbrown: one control byte plus the (key, value) slot per bucket.
        let table = |cap: usize, kv: usize| cap * (kv + 1);
        let mut total = table(self.blocks.capacity(), std::mem::size_of::<(u64, Entry)>()) + self.order.capacity() * 8;
        total += self.blocks.values().map(|e| e.holders.heap_bytes()).sum::<usize>();
        for w in &self.workers {
            total += table(w.map.capacity(), std::mem::size_of::<(u64, BlockRef)>());
        }
        total + self.seeds.capacity() * 8 + table(self.seed_ids.capacity(), 16)
    }
}

#[cfg(test)]
mod tests;
