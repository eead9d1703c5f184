//! A hybrid model's sliding-window KV cache group (`--sliding-window N`): vLLM's
//! `SlidingWindowManager` beside the full-attention group that [`crate::pool`] is. Pure and
//! synchronous, owned by the scheduler.
//!
//! - **Blocks:** each request has a block table in this group too. Before a request's blocks grow
//!   (each step it is scheduled), the blocks no token still to be computed attends to are freed —
//!   vLLM's `remove_skipped_blocks`: with `c` tokens computed, the blocks wholly before token
//!   `c − N + 1`. Freed blocks go to the free queue like a finished request's and stay cached
//!   until their slot is reused; a finished request frees the rest, tail first.
//! - **Hits:** a prompt is served from cache only as far as every group can serve it (vLLM's
//!   `HybridKVCacheCoordinator`): the full-attention group's leading run, then this group's rule
//!   over it, [`WindowGroup::hit`] — scanning down from it, the first end whose
//!   ⌈(N − 1) / block_size⌉ blocks before it are cached here, else the run cached from block 0. The
//!   request takes those cached blocks; the blocks before them are null in its table.
//! - **Pool:** the group has a pool of its own, `--sliding-window-blocks` blocks with its own LRU
//!   free queue (vLLM splits one pool between its groups; a pool apart leaves the full-attention
//!   group's behaviour as it is without the flag, and lets a test make this group evict first).
//! - **Events:** this group's `BlockStored` / `BlockRemoved`, as vLLM's block pool records them for
//!   group 1 and its KV cache manager annotates them: [`KvEvent::Grouped`] (`group_idx = 1`,
//!   `kv_cache_spec_kind = "sliding_window"`, `kv_cache_spec_sliding_window = N`). A store's token
//!   ids cover its range, its hashes the blocks cached (a null block would be left out; this
//!   scheduler caches blocks before the window passes them, so none are). A prefix-cache reset
//!   empties the group under the one `AllBlocksCleared`.
//!
//! Not modelled: NIXL consumers' pulled blocks (a consumer has no table here: its blocks are not
//! cached in this group), the CPU offload tier with it (refused by the configuration).

use std::collections::HashMap;

use crate::events::KvEvent;
use crate::free_queue::BlockId;
use crate::hash::BlockHash;
use crate::lora::Adapter;
use crate::pool::BlockPool;

/// A request's id: the scheduler's `ReqId` (named here as what it is, so this module does not
/// depend on the scheduler that owns it).
type ReqId = u64;

/// The group index vLLM gives a hybrid model's second group.
pub const GROUP_IDX: u32 = 1;

/// `--sliding-window` and `--sliding-window-blocks`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlidingWindow {
    /// The window, in tokens (≥ 1).
    pub tokens: usize,
    /// Blocks of the group's pool.
    pub blocks: u32,
}

impl SlidingWindow {
    /// Blocks the most a request can hold in the group at once: its window, a step's chunk of
    /// `max_batched_tokens`, and the partial blocks at either end. A pool smaller than this could
    /// leave a request waiting for good.
    pub fn min_blocks(tokens: usize, block_size: usize, max_batched_tokens: usize) -> usize {
        tokens.saturating_sub(1).div_ceil(block_size) + max_batched_tokens.div_ceil(block_size) + 2
    }

    /// Blocks before a hit that must be cached: ⌈(N − 1) / block_size⌉ (vLLM's
    /// `sliding_window_contiguous_blocks`), at least 1.
    pub fn need(&self, block_size: usize) -> usize {
        self.tokens.saturating_sub(1).div_ceil(block_size).max(1)
    }
}

/// One request's block table in the group; `None` is vLLM's null block (outside the window).
#[derive(Debug, Default)]
struct Table {
    blocks: Vec<Option<BlockId>>,
    /// `blocks[..cached]` have been offered to the cache.
    cached: usize,
}

/// The sliding-window group: its pool and the requests' tables.
#[derive(Debug)]
pub struct WindowGroup {
    window: SlidingWindow,
    pool: BlockPool,
    tables: HashMap<ReqId, Table>,
}

impl WindowGroup {
    /// An empty group of `window.blocks` blocks of `block_size` tokens.
    pub fn new(window: SlidingWindow, block_size: usize) -> Self {
        Self { window, pool: BlockPool::new(window.blocks, block_size), tables: HashMap::new() }
    }

    /// The window and pool size.
    pub fn window(&self) -> SlidingWindow {
        self.window
    }

    /// Blocks in the group's free queue.
    pub fn num_free(&self) -> usize {
        self.pool.num_free()
    }

    /// Whether the group caches `hash`.
    pub fn is_cached(&self, hash: BlockHash) -> bool {
        self.pool.is_cached(hash)
    }

    /// vLLM's sliding-window hit over `hashes`, at most `cap` blocks (the full-attention group's
    /// hit): scanning down from `cap`, the first end whose [`SlidingWindow::need`] blocks before it
    /// are cached; with none, the run cached from block 0.
    pub fn hit(&self, hashes: &[BlockHash], cap: usize) -> usize {
        let need = self.window.need(self.pool.block_size());
        let mut run = 0;
        for i in (0..cap.min(hashes.len())).rev() {
            if self.pool.is_cached(hashes[i]) {
                run += 1;
                if run >= need {
                    return i + need;
                }
            } else {
                run = 0;
            }
        }
        run
    }

    /// Starts request `id` with a hit of `hit` blocks ([`WindowGroup::hit`]) and room for `tokens`
    /// tokens: takes the cached blocks the window needs before the hit (those earlier are null)
    /// and new ones for the rest. False, with nothing taken, when the pool is short.
    pub fn admit(&mut self, id: ReqId, hashes: &[BlockHash], hit: usize, tokens: usize) -> bool {
        let bs = self.pool.block_size();
        let start = hit.saturating_sub(self.window.need(bs));
        let tail = &hashes[start.min(hashes.len())..hit.min(hashes.len())];
        let found = self.pool.lookup(tail);
        let new = tokens.div_ceil(bs).saturating_sub(hit);
        if found.blocks < tail.len() || new + found.evictable > self.pool.num_free() {
            return false;
        }
        let mut ids = Vec::with_capacity(tail.len() + new);
        self.pool.acquire_cached(tail, &mut ids);
        if !self.pool.allocate(new, &mut ids) {
            self.pool.free(&ids);
            return false;
        }
        let mut blocks = vec![None; start];
        blocks.extend(ids.into_iter().map(Some));
        self.tables.insert(id, Table { blocks, cached: hit });
        true
    }

    /// Frees the blocks of running request `id` that no token after its `computed` ones attends
    /// to, then gives it room for `tokens` tokens. False when the pool is short (what was freed
    /// stays freed, as in vLLM). A request without a table here (a NIXL consumer) needs nothing.
    pub fn grow(&mut self, id: ReqId, computed: usize, tokens: usize) -> bool {
        let bs = self.pool.block_size();
        let Some(t) = self.tables.get_mut(&id) else { return true };
        let skipped = ((computed + 1).saturating_sub(self.window.tokens) / bs).min(t.blocks.len());
        let freed: Vec<BlockId> = t.blocks[..skipped].iter_mut().filter_map(Option::take).collect();
        // Ascending: the pool frees the last first, as vLLM frees its removed blocks.
        self.pool.free(&freed);
        let need = tokens.div_ceil(bs).saturating_sub(t.blocks.len());
        if need == 0 {
            return true;
        }
        let mut ids = Vec::with_capacity(need);
        if !self.pool.allocate(need, &mut ids) {
            return false;
        }
        t.blocks.extend(ids.into_iter().map(Some));
        true
    }

    /// Writes request `id`'s tokens `from..to` (of `tokens`, its whole sequence) into its blocks
    /// and caches the blocks they fill under `hashes` (its chain, keyed by adapter `lora`),
    /// recording `BlockStored`.
    pub fn prepare(
        &mut self,
        id: ReqId,
        tokens: &[u32],
        (from, to): (usize, usize),
        hashes: &[BlockHash],
        lora: Option<&Adapter>,
    ) {
        let bs = self.pool.block_size();
        let Some(t) = self.tables.get_mut(&id) else { return };
        let to = to.min(tokens.len());
        let mut pos = from;
        while pos < to {
            let b = pos / bs;
            let end = ((b + 1) * bs).min(to);
            if let Some(Some(block)) = t.blocks.get(b) {
                self.pool.write_tokens(*block, pos - b * bs, &tokens[pos..end]);
            }
            pos = end;
        }
        let full = (to / bs).min(t.blocks.len()).min(hashes.len());
        if full <= t.cached {
            return;
        }
        // Each run of blocks still held (a null block cannot be cached), as one call.
        let ids: Vec<BlockId> = t.blocks.iter().map(|b| b.unwrap_or(0)).collect();
        let mut i = t.cached;
        while i < full {
            if t.blocks[i].is_none() {
                i += 1;
                continue;
            }
            let run = (i..full).take_while(|&j| t.blocks[j].is_some()).count();
            self.pool.cache_blocks(&ids, hashes, i, i + run, lora);
            i += run;
        }
        t.cached = full;
    }

    /// Frees every block request `id` holds here, last first (finished, preempted, cancelled).
    pub fn free(&mut self, id: ReqId) {
        if let Some(t) = self.tables.remove(&id) {
            let ids: Vec<BlockId> = t.blocks.into_iter().flatten().collect();
            self.pool.free(&ids);
        }
    }

    /// Empties the group (a prefix-cache reset; refused by the full-attention pool while blocks
    /// are in use, so none are here either).
    pub fn reset(&mut self) {
        let _ = self.pool.reset();
        self.pool.take_events();
    }

    /// The group's events since the last call, each as [`KvEvent::Grouped`].
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        let sliding_window = u32::try_from(self.window.tokens).unwrap_or(u32::MAX);
        self.pool
            .take_events()
            .into_iter()
            .filter(|e| !matches!(e, KvEvent::AllBlocksCleared))
            .map(|e| KvEvent::Grouped { group_idx: GROUP_IDX, sliding_window, event: Box::new(e) })
            .collect()
    }
}

#[cfg(test)]
#[path = "window_tests.rs"]
mod tests;
