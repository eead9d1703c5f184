//! The CPU offload tier (`--cpu-offload-blocks`): vLLM's offloading connector with its CPU
//! backend, as far as a router can observe it. Pure and synchronous, owned by the block pool.
//!
//! - **What goes there:** a cached block the GPU pool evicts (its slot reused) is copied here with
//!   its hash, parent hash, tokens and adapter; a block already here is only marked used. vLLM
//!   writes blocks to the CPU as they are computed (write-through); offloading on eviction keeps
//!   exactly what the GPU lost, and the router sees the same kind of events either way.
//! - **Capacity and eviction:** at most `capacity` blocks, least recently used evicted first
//!   (stored, or loaded by a request, counts as a use) — vLLM's CPU manager's LRU policy.
//! - **Loads:** a request's GPU prefix hit continues with the blocks this tier holds consecutively
//!   after it ([`OffloadTier::run`]; vLLM's `_maximal_prefix_lookup` from the GPU hit), which the
//!   scheduler loads into GPU blocks at `--cpu-load-tokens-per-s` (`crate::sched`). The copies stay.
//! - **Events:** vLLM's `OffloadingEventsTracker` with `self_describing_kv_events` and one block per
//!   chunk: each stored block is one `BlockStored` (`medium = "CPU"`, its hash, its parent's hash,
//!   its token ids, `block_size`, the adapter, `group_idx = 0`, `kv_cache_spec_kind =
//!   "full_attention"`); the blocks one store evicts are one `BlockRemoved` (`medium = "CPU"`,
//!   `group_idx = 0`) before it, as the CPU manager evicts in `prepare_store` before it stores.
//! - A prefix cache reset (`AllBlocksCleared`) empties it too, silently (vLLM resets the connector
//!   with the prefix cache; the one event says it).

use std::collections::{BTreeMap, HashMap};

use crate::events::KvEvent;
use crate::hash::BlockHash;
use crate::lora::Adapter;

#[derive(Debug, Clone)]
struct Entry {
    /// Last use, on the tier's own counter (the key in `lru`).
    used: u64,
    tokens: Vec<u32>,
}

/// The CPU tier: `capacity` blocks, LRU.
#[derive(Debug)]
pub struct OffloadTier {
    capacity: usize,
    blocks: HashMap<BlockHash, Entry>,
    /// Last use → hash, oldest first.
    lru: BTreeMap<u64, BlockHash>,
    clock: u64,
    /// Blocks stored / loaded / evicted since start.
    stats: OffloadStats,
}

/// Cumulative counters of the tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct OffloadStats {
    pub stored: u64,
    pub loaded: u64,
    pub evicted: u64,
}

impl OffloadTier {
    /// An empty tier of `capacity` blocks (at least 1).
    pub fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            clock: 0,
            stats: OffloadStats::default(),
        }
    }

    /// Blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// True when no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Cumulative counters.
    pub fn stats(&self) -> OffloadStats {
        self.stats
    }

    /// True when `hash` is held.
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.blocks.contains_key(&hash)
    }

    fn touch(&mut self, hash: BlockHash) {
        self.clock += 1;
        if let Some(e) = self.blocks.get_mut(&hash) {
            self.lru.remove(&e.used);
            e.used = self.clock;
            self.lru.insert(self.clock, hash);
        }
    }

    /// Copies a block the GPU evicts: recorded as one `BlockStored` (`medium = "CPU"`) after the
    /// `BlockRemoved` of the blocks it pushes out. A block already held is only marked used.
    pub fn offload(
        &mut self,
        hash: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        lora: Option<&Adapter>,
        events: &mut Vec<KvEvent>,
    ) {
        if self.blocks.contains_key(&hash) {
            self.touch(hash);
            return;
        }
        let mut evicted = Vec::new();
        while self.blocks.len() >= self.capacity {
            let Some((_, old)) = self.lru.pop_first() else { break };
            self.blocks.remove(&old);
            evicted.push(old);
        }
        if !evicted.is_empty() {
            self.stats.evicted += evicted.len() as u64;
            events.push(KvEvent::OffloadRemoved { block_hashes: evicted });
        }
        self.clock += 1;
        self.blocks.insert(hash, Entry { used: self.clock, tokens: tokens.to_vec() });
        self.lru.insert(self.clock, hash);
        self.stats.stored += 1;
        events.push(KvEvent::OffloadStored {
            block_hash: hash,
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: u32::try_from(tokens.len()).unwrap_or(u32::MAX),
            lora: lora.cloned(),
        });
    }

    /// How many of `hashes` (the blocks after a request's GPU hit, in chain order) this tier holds
    /// consecutively from the first.
    pub fn run(&self, hashes: &[BlockHash]) -> usize {
        hashes.iter().take_while(|h| self.blocks.contains_key(h)).count()
    }

    /// The tokens of held block `hash`, marking it used and counting it loaded.
    pub fn load(&mut self, hash: BlockHash) -> Option<Vec<u32>> {
        let tokens = self.blocks.get(&hash)?.tokens.clone();
        self.touch(hash);
        self.stats.loaded += 1;
        Some(tokens)
    }

    /// Drops every block (a prefix cache reset; no event of its own).
    pub fn clear(&mut self) {
        self.blocks.clear();
        self.lru.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(events: &[KvEvent]) -> Vec<BlockHash> {
        events
            .iter()
            .filter_map(|e| match e {
                KvEvent::OffloadStored { block_hash, .. } => Some(*block_hash),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn lru_capacity_and_events_in_vllms_order() {
        let mut t = OffloadTier::new(2);
        let mut ev = Vec::new();
        t.offload(1, None, &[1, 2], None, &mut ev);
        t.offload(2, Some(1), &[3, 4], None, &mut ev);
        assert_eq!(stored(&ev), [1, 2]);
        assert_eq!(
            ev[1],
            KvEvent::OffloadStored {
                block_hash: 2,
                parent_block_hash: Some(1),
                token_ids: vec![3, 4],
                block_size: 2,
                lora: None,
            }
        );
        // Again: only marked used, no event. Block 1 is now the most recently used.
        ev.clear();
        t.offload(1, None, &[1, 2], None, &mut ev);
        assert!(ev.is_empty());
        // A third block evicts the least recently used (2): its removal first, then the store.
        t.offload(3, Some(2), &[5, 6], None, &mut ev);
        assert_eq!(ev[0], KvEvent::OffloadRemoved { block_hashes: vec![2] });
        assert_eq!(stored(&ev), [3]);
        assert_eq!((t.len(), t.contains(1), t.contains(2), t.contains(3)), (2, true, false, true));
        // A run stops at the first block not held; loading marks used.
        assert_eq!(t.run(&[1, 3, 2, 3]), 2);
        assert_eq!(t.run(&[2, 1]), 0);
        assert_eq!(t.load(1), Some(vec![1, 2]));
        assert_eq!(t.load(2), None);
        ev.clear();
        t.offload(4, None, &[7, 8], None, &mut ev);
        assert_eq!(ev[0], KvEvent::OffloadRemoved { block_hashes: vec![3] }, "1 was loaded later");
        assert_eq!(t.stats(), OffloadStats { stored: 4, loaded: 1, evicted: 2 });
        t.clear();
        assert!(t.is_empty());
    }
}
