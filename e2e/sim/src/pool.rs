//! The paged KV cache with prefix caching: vLLM's `BlockPool`, pure and synchronous.
//!
//! Invariants (the ones a router can observe through events):
//! - A block is *cached* when it holds a full block of tokens under a hash; one block per hash
//!   (a second physical copy of an already-cached hash stays uncached, so every `BlockStored`
//!   names a hash the pool did not hold and every `BlockRemoved` one it no longer holds).
//! - Running requests hold references; a block is in the free queue iff its count is 0.
//! - Freed cached blocks keep their hash until their slot is taken from the head of the free
//!   queue: eviction is LRU in free order and happens only when a slot is reused, at which point
//!   `BlockRemoved` is recorded (vLLM's `_maybe_evict_cached_block`; the evictions of one
//!   allocation share one event, in eviction order, where vLLM sends one event per block).
//! - `BlockStored` is recorded once per `cache_blocks` call and contiguous run, with the parent of
//!   the run's first block, exactly as vLLM's `cache_full_blocks`.
//!
//! - With a CPU offload tier ([`BlockPool::with_offload`], [`crate::offload`]), an evicted block is
//!   copied there first: its `BlockStored` (`medium = "CPU"`) precedes the GPU `BlockRemoved` of
//!   the same allocation, so a consumer chains it through the parent the GPU still holds.
//!
//! Tokens of every slot are kept in one flat array (`num_blocks × block_size` ids) so events, the
//! cache dump and NIXL pulls can read them without per-block allocations.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use serde::Serialize;

use crate::events::KvEvent;
use crate::free_queue::{BlockId, FreeQueue};
use crate::hash::BlockHash;
use crate::lora::Adapter;
use crate::media::MediaSpan;
use crate::offload::OffloadTier;

/// Block hashes are uniformly distributed already; hashing them again would be wasted work.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = v;
    }
}

type HashIndex = HashMap<BlockHash, BlockId, BuildHasherDefault<IdHasher>>;

#[derive(Debug, Clone, Copy, Default)]
struct Meta {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    parent: Option<BlockHash>,
    position: u32,
    len: u32,
}

/// What a prefix lookup found: how many leading blocks are cached, and how many of those sit in
/// the free queue (taking them reduces the free count, which admission must account for).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixHit {
    /// Leading blocks of the chain that are cached.
    pub blocks: usize,
    /// Of those, blocks with no reference (currently in the free queue).
    pub evictable: usize,
}

/// One cached block as `GET /admin/cache` reports it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CachedBlock {
    /// Physical slot.
    pub block_id: BlockId,
    /// Engine hash (as published in events).
    pub block_hash: BlockHash,
    /// Hash of the previous block of the chain; `null` for a chain's first block.
    pub parent_block_hash: Option<BlockHash>,
    /// Index of the block in its chain (0 = first block of the prompt).
    pub position: u32,
    /// The block's `block_size` token ids.
    pub token_ids: Vec<u32>,
    /// The LoRA adapter whose request cached it (its hash is keyed by it); `null` = base model.
    pub lora_name: Option<String>,
    /// Requests (or NIXL holds) referencing the block; 0 = evictable.
    pub ref_cnt: u32,
}

/// `reset` refused: some blocks are still referenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{in_use} KV blocks are still in use by running requests")]
pub struct InUse {
    /// Blocks with a non-zero reference count.
    pub in_use: usize,
}

/// The block pool. All operations are O(blocks touched).
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    meta: Vec<Meta>,
    /// The adapter of each cached slot (apart from `Meta`, which stays `Copy`).
    lora: Vec<Option<Adapter>>,
    tokens: Vec<u32>,
    free: FreeQueue,
    cached: HashIndex,
    events: Vec<KvEvent>,
    /// The CPU tier evicted blocks go to, if any.
    offload: Option<OffloadTier>,
}

impl BlockPool {
    /// `num_blocks` free, uncached blocks of `block_size` tokens.
    pub fn new(num_blocks: u32, block_size: usize) -> Self {
        Self {
            block_size,
            meta: vec![Meta::default(); num_blocks as usize],
            lora: vec![None; num_blocks as usize],
            tokens: vec![0; num_blocks as usize * block_size],
            free: FreeQueue::full(num_blocks),
            cached: HashIndex::default(),
            events: Vec::new(),
            offload: None,
        }
    }

    /// The pool with a CPU offload tier of `blocks` blocks (0: none).
    pub fn with_offload(mut self, blocks: usize) -> Self {
        self.offload = (blocks > 0).then(|| OffloadTier::new(blocks));
        self
    }

    /// The CPU offload tier, if any.
    pub fn offload(&self) -> Option<&OffloadTier> {
        self.offload.as_ref()
    }

    /// How many of `hashes` (the blocks after a GPU hit) the CPU tier holds consecutively.
    pub fn offload_run(&self, hashes: &[BlockHash]) -> usize {
        self.offload.as_ref().map_or(0, |t| t.run(hashes))
    }

    /// The tokens of `hashes` read from the CPU tier (marking them used), in order, stopping at
    /// the first it does not hold. Read before the GPU blocks they go to are allocated: that
    /// allocation may offload other blocks and push these out of the tier.
    pub fn load_offloaded(&mut self, hashes: &[BlockHash]) -> Vec<Vec<u32>> {
        let Some(tier) = self.offload.as_mut() else { return Vec::new() };
        hashes.iter().map_while(|h| tier.load(*h)).collect()
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Total blocks.
    pub fn num_blocks(&self) -> usize {
        self.meta.len()
    }

    /// Blocks in the free queue (cached or not).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks currently cached under a hash.
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// vLLM's `kv_cache_usage_perc`: `1 - free / total` (0..=1).
    pub fn usage(&self) -> f64 {
        if self.meta.is_empty() {
            return 0.0;
        }
        1.0 - self.free.len() as f64 / self.meta.len() as f64
    }

    /// True when `hash` is cached.
    pub fn is_cached(&self, hash: BlockHash) -> bool {
        self.cached.contains_key(&hash)
    }

    /// How many leading blocks of `hashes` are cached.
    pub fn lookup(&self, hashes: &[BlockHash]) -> PrefixHit {
        let mut hit = PrefixHit::default();
        for h in hashes {
            match self.cached.get(h) {
                Some(&id) => {
                    hit.blocks += 1;
                    if self.meta[id as usize].ref_cnt == 0 {
                        hit.evictable += 1;
                    }
                }
                None => break,
            }
        }
        hit
    }

    /// Takes a reference on the cached blocks of `hashes` (all must be cached: pass a prefix
    /// that [`lookup`](Self::lookup) found) and appends their ids to `out`.
    pub fn acquire_cached(&mut self, hashes: &[BlockHash], out: &mut Vec<BlockId>) {
        for h in hashes {
            if let Some(&id) = self.cached.get(h) {
                let m = &mut self.meta[id as usize];
                if m.ref_cnt == 0 {
                    self.free.remove(id);
                }
                m.ref_cnt += 1;
                out.push(id);
            }
        }
    }

    /// Takes `n` blocks from the head of the free queue (evicting cached contents, which
    /// records one `BlockRemoved` listing the evicted hashes in eviction order) and appends them
    /// to `out`. False, with nothing taken, when fewer than `n` blocks are free.
    pub fn allocate(&mut self, n: usize, out: &mut Vec<BlockId>) -> bool {
        if n > self.free.len() {
            return false;
        }
        let mut evicted = Vec::new();
        let bs = self.block_size;
        for _ in 0..n {
            let Some(id) = self.free.pop_front() else { break };
            let m = &mut self.meta[id as usize];
            let (hash, parent) = (m.hash.take(), m.parent);
            *m = Meta { ref_cnt: 1, ..Meta::default() };
            let lora = self.lora[id as usize].take();
            if let Some(h) = hash {
                self.cached.remove(&h);
                evicted.push(h);
                if let Some(tier) = self.offload.as_mut() {
                    let base = id as usize * bs;
                    let tokens = &self.tokens[base..base + bs];
                    tier.offload(h, parent, tokens, lora.as_ref(), &mut self.events);
                }
            }
            out.push(id);
        }
        if !evicted.is_empty() {
            self.events.push(KvEvent::BlockRemoved { block_hashes: evicted });
        }
        true
    }

    /// Writes `tokens` into block `id` starting at slot `offset` (tokens past the block are
    /// ignored).
    pub fn write_tokens(&mut self, id: BlockId, offset: usize, tokens: &[u32]) {
        let bs = self.block_size;
        let Some(m) = self.meta.get_mut(id as usize) else { return };
        if offset >= bs || m.hash.is_some() {
            return; // a cached block is immutable
        }
        let n = tokens.len().min(bs - offset);
        let base = id as usize * bs + offset;
        self.tokens[base..base + n].copy_from_slice(&tokens[..n]);
        m.len = m.len.max((offset + n) as u32);
    }

    /// The token ids written into block `id`.
    pub fn block_tokens(&self, id: BlockId) -> &[u32] {
        match self.meta.get(id as usize) {
            Some(m) => {
                let base = id as usize * self.block_size;
                &self.tokens[base..base + m.len as usize]
            }
            None => &[],
        }
    }

    /// Caches `blocks[from..to]` under `hashes[from..to]` (the request's block table and hash
    /// chain, keyed by its adapter `lora`), recording one `BlockStored` per contiguous run of
    /// newly cached blocks. Blocks whose hash is already cached elsewhere stay uncached copies.
    pub fn cache_blocks(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        from: usize,
        to: usize,
        lora: Option<&Adapter>,
    ) {
        self.cache_blocks_keyed(blocks, hashes, from, to, lora, &[])
    }

    /// [`Self::cache_blocks`] for a request with media items: each stored block's media keys go
    /// in its event's `extra_keys` ([`crate::media::block_keys`]).
    pub fn cache_blocks_keyed(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        from: usize,
        to: usize,
        lora: Option<&Adapter>,
        media: &[MediaSpan],
    ) {
        let to = to.min(blocks.len()).min(hashes.len());
        let mut run_start: Option<usize> = None;
        for i in from..to {
            let id = blocks[i];
            let h = hashes[i];
            let full = self.meta[id as usize].len as usize == self.block_size;
            let fresh =
                full && self.meta[id as usize].hash.is_none() && !self.cached.contains_key(&h);
            if fresh {
                let m = &mut self.meta[id as usize];
                m.hash = Some(h);
                m.parent = if i == 0 { None } else { Some(hashes[i - 1]) };
                m.position = i as u32;
                self.cached.insert(h, id);
                self.lora[id as usize] = lora.cloned();
                run_start.get_or_insert(i);
            } else if let Some(s) = run_start.take() {
                self.record_stored(blocks, hashes, s, i, lora, media);
            }
        }
        if let Some(s) = run_start {
            self.record_stored(blocks, hashes, s, to, lora, media);
        }
    }

    fn record_stored(
        &mut self,
        blocks: &[BlockId],
        hashes: &[BlockHash],
        from: usize,
        to: usize,
        lora: Option<&Adapter>,
        media: &[MediaSpan],
    ) {
        let mut token_ids = Vec::with_capacity((to - from) * self.block_size);
        for &id in &blocks[from..to] {
            token_ids.extend_from_slice(self.block_tokens(id));
        }
        self.events.push(KvEvent::BlockStored {
            block_hashes: hashes[from..to].to_vec(),
            parent_block_hash: if from == 0 { None } else { Some(hashes[from - 1]) },
            token_ids,
            block_size: self.block_size as u32,
            lora: lora.cloned(),
            extra_keys: crate::media::event_keys(media, from, to, self.block_size),
        });
    }

    /// Drops one reference on each of `blocks`, last block first (so a request's tail blocks
    /// are evicted before its shared head, as vLLM frees them).
    pub fn free(&mut self, blocks: &[BlockId]) {
        for &id in blocks.iter().rev() {
            let Some(m) = self.meta.get_mut(id as usize) else { continue };
            m.ref_cnt = m.ref_cnt.saturating_sub(1);
            if m.ref_cnt == 0 {
                self.free.push_back(id);
            }
        }
    }

    /// Forgets every cached hash (`AllBlocksCleared`), like vLLM's `reset_prefix_cache`, which
    /// refuses while any block is referenced.
    pub fn reset(&mut self) -> Result<(), InUse> {
        let in_use = self.meta.len() - self.free.len();
        if in_use > 0 {
            return Err(InUse { in_use });
        }
        for m in &mut self.meta {
            *m = Meta::default();
        }
        self.lora.iter_mut().for_each(|l| *l = None);
        self.cached.clear();
        if let Some(tier) = self.offload.as_mut() {
            tier.clear();
        }
        self.free = FreeQueue::full(self.meta.len() as u32);
        self.events.push(KvEvent::AllBlocksCleared);
        Ok(())
    }

    /// Removes and returns the events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Every cached block, ordered by chain position then hash.
    pub fn dump(&self) -> Vec<CachedBlock> {
        let mut out: Vec<CachedBlock> = self
            .cached
            .values()
            .filter_map(|&id| {
                let m = self.meta.get(id as usize)?;
                Some(CachedBlock {
                    block_id: id,
                    block_hash: m.hash?,
                    parent_block_hash: m.parent,
                    position: m.position,
                    token_ids: self.block_tokens(id).to_vec(),
                    lora_name: self
                        .lora
                        .get(id as usize)
                        .and_then(|l| l.as_ref().map(|a| a.name.to_string())),
                    ref_cnt: m.ref_cnt,
                })
            })
            .collect();
        out.sort_by_key(|b| (b.position, b.block_hash));
        out
    }

    /// Reference count of block `id` (tests, assertions).
    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.meta.get(id as usize).map_or(0, |m| m.ref_cnt)
    }

    /// The block ids in the free queue, head (next to be reused) first.
    pub fn free_order(&self) -> Vec<BlockId> {
        self.free.iter().collect()
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;
