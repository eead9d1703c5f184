//! KV-cache events as the block pool produces them, and the sink they leave through.
//!
//! The block pool records what vLLM's `BlockPool` records (`BlockStored` when full blocks are
//! cached, `BlockRemoved` when a cached block's slot is reused, `AllBlocksCleared` on a prefix
//! cache reset). The scheduler hands one batch per engine step to an [`EventSink`]; unit tests
//! collect batches in memory ([`MemorySink`]) and the binary publishes them on ZeroMQ
//! (`publisher`). Keeping the wire encoding (`wire`) apart from these types lets tests assert on
//! cache operations and on bytes separately.

use std::sync::Arc;

use parking_lot::Mutex;

use crate::hash::BlockHash;
use crate::lora::Adapter;

/// One cache event, vLLM's `KVCacheEvent` union: the GPU pool's (`medium = "GPU"`) and the CPU
/// offload tier's (`crate::offload`, `medium = "CPU"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Full blocks of one request newly cached in one step, in chain order.
    BlockStored {
        /// Engine hashes of the stored blocks, in chain order.
        block_hashes: Vec<BlockHash>,
        /// Hash of the block before the first stored one; `None` at the chain root.
        parent_block_hash: Option<BlockHash>,
        /// The stored blocks' tokens, concatenated (`block_size` per block).
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The request's LoRA adapter (`lora_id`, `lora_name` on the wire); `None` = base model.
        lora: Option<Adapter>,
        /// Per block, its media keys (`crate::media`; `None`: none); empty when no block has
        /// any (the field is then nil / left out on the wire).
        extra_keys: Vec<Option<crate::media::BlockKeys>>,
    },
    /// Cached blocks whose slots were reused (evicted).
    BlockRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<BlockHash>,
    },
    /// Every cached block was dropped (`POST /reset_prefix_cache`), the CPU tier's too.
    AllBlocksCleared,
    /// One block the GPU evicted, now in the CPU offload tier: vLLM's offloading connector's
    /// self-describing `BlockStored` (`medium = "CPU"`, `group_idx = 0`,
    /// `kv_cache_spec_kind = "full_attention"`), one block per event.
    OffloadStored {
        /// Engine hash of the block (the same as on the GPU).
        block_hash: BlockHash,
        /// Hash of the block before it; `None` at the chain root.
        parent_block_hash: Option<BlockHash>,
        /// The block's tokens.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
        /// The adapter of the request that cached it; `None` = base model.
        lora: Option<Adapter>,
    },
    /// Blocks the CPU offload tier evicted (`medium = "CPU"`, `group_idx = 0`).
    OffloadRemoved {
        /// Engine hashes of the evicted blocks.
        block_hashes: Vec<BlockHash>,
    },
    /// A `BlockStored` / `BlockRemoved` of a hybrid model's sliding-window group
    /// (`crate::window`): `group_idx`, and on stores `kv_cache_spec_kind = "sliding_window"` and
    /// `kv_cache_spec_sliding_window`, as vLLM's KV cache manager annotates its groups' events.
    Grouped {
        /// The group (1).
        group_idx: u32,
        /// The group's window, in tokens.
        sliding_window: u32,
        /// The group's event (`BlockStored` or `BlockRemoved`).
        event: Box<KvEvent>,
    },
}

/// The events of one engine step, vLLM's `KVEventBatch` without the DP rank (the sink adds it).
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Wall-clock seconds since the Unix epoch when the step's events were taken.
    pub ts: f64,
    /// The step's events, in the order the pool produced them. Never empty when published.
    pub events: Vec<KvEvent>,
}

/// Where event batches go. Implementations must not block the engine: they queue or drop.
pub trait EventSink: Send {
    /// Takes one batch (non-empty). Called from the engine task, once per step with events.
    fn publish(&mut self, batch: EventBatch);
}

/// A sink that discards everything (events disabled).
#[derive(Debug, Default)]
pub struct NullSink;

impl EventSink for NullSink {
    fn publish(&mut self, _batch: EventBatch) {}
}

/// A sink that keeps every batch in memory, shared so a test can read what the engine sent.
#[derive(Debug, Default, Clone)]
pub struct MemorySink {
    batches: Arc<Mutex<Vec<EventBatch>>>,
}

impl MemorySink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// Removes and returns the batches published so far.
    pub fn take(&self) -> Vec<EventBatch> {
        std::mem::take(&mut *self.batches.lock())
    }
}

impl EventSink for MemorySink {
    fn publish(&mut self, batch: EventBatch) {
        self.batches.lock().push(batch);
    }
}
