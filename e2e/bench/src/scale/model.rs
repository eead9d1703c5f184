//! The synthetic fleet's KV-cache churn (pure): what each engine's prefix cache stores and evicts,
//! as vLLM's KV events, from a seeded model of its traffic. No I/O, no clock: the batch time is
//! passed in, the randomness is the worker's own [`SplitMix64`].
//!
//! The model (README "Scale", "The workload model"):
//! - Each worker serves the conversations pinned to it (session affinity: a conversation never
//!   moves). A request continues one of the worker's open conversations, or opens a new one with
//!   probability `new_conversation` (always when none is open, never past `max_open`).
//! - A conversation opens with one of `system_prompts` system prompts shared by the whole fleet,
//!   `system_blocks` long (fixed per prompt); prompt `⌊n·u²⌋` (u uniform) is picked, so a few are
//!   popular and held by most workers, the rest by some.
//! - A request's prompt is its system prompt, its conversation so far and a new user turn
//!   (`first_prompt_blocks` on the first turn, `turn_prompt_blocks` after); the worker stores what
//!   it does not hold of that chain (prefill: `BlockStored` events of at most
//!   `prefill_chunk_blocks` blocks, vLLM's chunked prefill, chained by parent), then the answer's
//!   `turn_output_blocks` blocks one per event (decode fills one block at a time), at most
//!   `decode_events_per_batch` events per batch. A conversation past `max_conversation_blocks` ends
//!   (its blocks stay cached until evicted).
//! - A worker holds at most `capacity` blocks. Beyond it, the least recently used conversation (or
//!   system prompt no held conversation continues) loses blocks from its tail — leaf first, as
//!   vLLM's free queue evicts — sent as one `BlockRemoved` after the request's stores. So what a
//!   worker holds is always prefix-closed, as on a real engine.
//!
//! Blocks are named by (segment, index); the engine hash and the token ids are functions of that
//! name, so a system prompt's blocks are the same tokens (hence the same chain hashes in the
//! indexer) and the same engine hashes on every worker that holds them, as vLLM's would be.

use std::collections::{BTreeSet, HashMap};

use kvmesh_sim::events::{EventBatch, KvEvent};

use crate::rng::{mix, SplitMix64};

/// Token ids are drawn below this (DeepSeek-V4's vocabulary is ~129k; ids ≥ 65,536 take 5 bytes
/// in msgpack, the rest 3 or fewer, about as in real prompts).
const VOCAB: u64 = 100_000;

/// Conversation segment keys have this bit set; system prompt keys are the prompt's number.
const CONV: u64 = 1 << 63;

/// The workload model's knobs (module docs). Ranges are inclusive.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ModelParams {
    /// Tokens per block.
    pub block_size: u32,
    /// Blocks one worker's cache holds.
    pub capacity: u32,
    /// Shared system prompts in the fleet.
    pub system_prompts: u32,
    /// System prompt length, blocks.
    pub system_blocks: (u32, u32),
    /// A conversation's first user turn, blocks.
    pub first_prompt_blocks: (u32, u32),
    /// Each later user turn, blocks.
    pub turn_prompt_blocks: (u32, u32),
    /// Each answer, blocks.
    pub turn_output_blocks: (u32, u32),
    /// A conversation ends once it holds this many blocks (system prompt not counted).
    pub max_conversation_blocks: u32,
    /// Probability that a request opens a conversation.
    pub new_conversation: f64,
    /// Open conversations per worker, at most.
    pub max_open: usize,
    /// Blocks per prefill `BlockStored` (vLLM's chunked prefill: 8,192 tokens per step).
    pub prefill_chunk_blocks: u32,
    /// One-block decode events per batch.
    pub decode_events_per_batch: usize,
}

impl ModelParams {
    /// The defaults (README "The workload model") for `capacity` blocks per worker.
    pub fn new(block_size: u32, capacity: u32) -> Self {
        Self {
            block_size,
            capacity,
            system_prompts: 64,
            system_blocks: (32, 256),
            first_prompt_blocks: (16, 128),
            turn_prompt_blocks: (4, 64),
            turn_output_blocks: (4, 32),
            max_conversation_blocks: 512,
            new_conversation: 0.25,
            max_open: 64,
            prefill_chunk_blocks: (8192 / block_size.max(1)).max(1),
            decode_events_per_batch: 8,
        }
    }

    /// Length of system prompt `s`, blocks (fixed per prompt, the same on every worker).
    pub fn system_len(&self, s: u32) -> u32 {
        let (lo, hi) = self.system_blocks;
        let span = u64::from(hi.saturating_sub(lo)) + 1;
        lo.max(1) + (mix(0x5157_0000, u64::from(s)) % span) as u32
    }
}

/// The engine hash of block `index` of segment `seg` (never 0).
pub fn engine_hash(seg: u64, index: u32) -> u64 {
    // The segment is hashed first: `mix(a, b)` alone collides whenever `a ^ b·2³²` does, which
    // segment keys carrying the worker in their high half would.
    mix(mix(seg, 0x51ed), u64::from(index)) | 1
}

/// The token ids of block `index` of segment `seg`, appended to `out`.
pub fn block_tokens(seg: u64, index: u32, block_size: u32, out: &mut Vec<u32>) {
    let id = engine_hash(seg, index);
    out.extend((0..u64::from(block_size)).map(|k| (mix(id, k) % VOCAB) as u32));
}

/// The segment key of system prompt `s`.
pub fn system_key(s: u32) -> u64 {
    u64::from(s)
}

#[derive(Debug, Clone, Copy)]
struct Conversation {
    key: u64,
    system: u32,
    /// Conversation blocks after its last answer.
    len: u32,
}

#[derive(Debug, Clone, Copy)]
struct Held {
    /// Leading blocks held.
    blocks: u32,
    /// The tick it was last used at (its place in the LRU order).
    last: u64,
    /// System prompts: conversations continuing it held on this worker (it is not evicted while
    /// any is); conversations: their system prompt.
    link: u32,
}

/// What one request produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestOps {
    pub stored: u64,
    pub removed: u64,
    pub batches: u64,
}

/// One worker's prefix cache and traffic (module docs).
#[derive(Debug)]
pub struct WorkerCache {
    worker: u32,
    rng: SplitMix64,
    tick: u64,
    next_conversation: u64,
    open: Vec<Conversation>,
    segments: HashMap<u64, Held>,
    /// (last used, segment), oldest first.
    lru: BTreeSet<(u64, u64)>,
    held: u64,
}

impl WorkerCache {
    /// An empty cache for `worker`, its traffic seeded by `seed`.
    pub fn new(worker: u32, seed: u64) -> Self {
        Self {
            worker,
            rng: SplitMix64::new(mix(seed, u64::from(worker))),
            tick: 0,
            next_conversation: 0,
            open: Vec::new(),
            segments: HashMap::new(),
            lru: BTreeSet::new(),
            held: 0,
        }
    }

    /// Blocks held now.
    pub fn held(&self) -> u64 {
        self.held
    }

    fn blocks_of(&self, seg: u64) -> u32 {
        self.segments.get(&seg).map_or(0, |h| h.blocks)
    }

    fn range(&mut self, (lo, hi): (u32, u32)) -> u32 {
        self.rng.range_u64(u64::from(lo), u64::from(hi.max(lo)) + 1) as u32
    }

    /// Picks the conversation the next request continues (opening one if due); its index in `open`.
    fn choose(&mut self, p: &ModelParams) -> usize {
        let open_new = self.open.is_empty()
            || (self.open.len() < p.max_open && self.rng.next_f64() < p.new_conversation);
        if !open_new {
            return self.rng.range_u64(0, self.open.len() as u64) as usize;
        }
        let u = self.rng.next_f64();
        let system =
            ((u * u * f64::from(p.system_prompts.max(1))) as u32).min(p.system_prompts.max(1) - 1);
        let key = CONV | (u64::from(self.worker) << 32) | (self.next_conversation & 0xffff_ffff);
        self.next_conversation += 1;
        self.open.push(Conversation { key, system, len: 0 });
        self.open.len() - 1
    }

    /// Marks `seg` used now with `blocks` held (`link` as in [`Held`] for a new entry).
    fn hold(&mut self, seg: u64, blocks: u32, link: u32) {
        let tick = self.tick;
        let before = self.segments.get(&seg).copied();
        if let Some(h) = before {
            self.lru.remove(&(h.last, seg));
        }
        let had = before.map_or(0, |h| h.blocks);
        let link = before.map_or(link, |h| h.link);
        self.held = self.held + u64::from(blocks) - u64::from(had);
        self.segments.insert(seg, Held { blocks, last: tick, link });
        self.lru.insert((tick, seg));
    }

    /// One request of this worker at time `ts`: its batches appended to `out`.
    pub fn request(&mut self, p: &ModelParams, ts: f64, out: &mut Vec<EventBatch>) -> RequestOps {
        self.tick += 1;
        let i = self.choose(p);
        let conv = self.open[i];
        let sys_key = system_key(conv.system);
        let sys_len = p.system_len(conv.system);
        let prompt = if conv.len == 0 {
            self.range(p.first_prompt_blocks)
        } else {
            self.range(p.turn_prompt_blocks)
        };
        let output = self.range(p.turn_output_blocks);
        let context = conv.len + prompt;
        let mut ops = RequestOps::default();
        let mut events = Vec::new();

        // Prefill: the system prompt's missing tail, then the conversation's.
        let sys_held = self.blocks_of(sys_key);
        let mut parent = if sys_held < sys_len {
            let from = (sys_held > 0).then(|| engine_hash(sys_key, sys_held - 1));
            stores(p, sys_key, (sys_held, sys_len), from, &mut events, &mut ops)
        } else {
            Some(engine_hash(sys_key, sys_len - 1))
        };
        // What a worker holds of a conversation never reaches past its last answer.
        let conv_held = self.blocks_of(conv.key).min(context);
        if conv_held > 0 {
            parent = Some(engine_hash(conv.key, conv_held - 1));
        }
        parent = stores(p, conv.key, (conv_held, context), parent, &mut events, &mut ops);
        self.hold(sys_key, sys_len, 0);
        if conv_held == 0 {
            // A newly held conversation continues its system prompt: keep that prompt.
            if let Some(h) = self.segments.get_mut(&sys_key) {
                h.link += 1;
            }
        }
        self.hold(conv.key, context, conv.system);
        out.push(EventBatch { ts, events: std::mem::take(&mut events) });
        ops.batches += 1;

        // Decode: one block per event.
        let end = context + output;
        for b in context..end {
            let mut tokens = Vec::with_capacity(p.block_size as usize);
            block_tokens(conv.key, b, p.block_size, &mut tokens);
            events.push(KvEvent::BlockStored {
                block_hashes: vec![engine_hash(conv.key, b)],
                parent_block_hash: parent,
                token_ids: tokens,
                block_size: p.block_size,
                lora: None,
                extra_keys: Vec::new(),
            });
            parent = Some(engine_hash(conv.key, b));
            ops.stored += 1;
            if events.len() >= p.decode_events_per_batch.max(1) {
                out.push(EventBatch { ts, events: std::mem::take(&mut events) });
                ops.batches += 1;
            }
        }
        self.hold(conv.key, end, conv.system);
        let removed = self.evict(p);
        if !removed.is_empty() {
            ops.removed += removed.len() as u64;
            events.push(KvEvent::BlockRemoved { block_hashes: removed });
        }
        if !events.is_empty() {
            out.push(EventBatch { ts, events });
            ops.batches += 1;
        }
        if let Some(c) = self.open.get_mut(i) {
            c.len = end;
            if end >= p.max_conversation_blocks {
                self.open.swap_remove(i);
            }
        }
        ops
    }

    /// Evicts down to capacity, least recently used segment first, tail first; the engine hashes.
    fn evict(&mut self, p: &ModelParams) -> Vec<u64> {
        let mut removed = Vec::new();
        while self.held > u64::from(p.capacity) {
            // A system prompt that held conversations continue is skipped (they go first).
            let victim = self.lru.iter().copied().find(|(_, seg)| {
                *seg & CONV != 0 || self.segments.get(seg).is_none_or(|h| h.link == 0)
            });
            let Some((last, seg)) = victim else { break };
            let Some(mut h) = self.segments.get(&seg).copied() else {
                self.lru.remove(&(last, seg));
                continue;
            };
            let excess = self.held - u64::from(p.capacity);
            let n = u32::try_from(excess).unwrap_or(u32::MAX).min(h.blocks);
            removed.extend((h.blocks - n..h.blocks).rev().map(|b| engine_hash(seg, b)));
            h.blocks -= n;
            self.held -= u64::from(n);
            if h.blocks > 0 {
                self.segments.insert(seg, h);
                continue;
            }
            self.segments.remove(&seg);
            self.lru.remove(&(last, seg));
            if seg & CONV != 0 {
                if let Some(s) = self.segments.get_mut(&system_key(h.link)) {
                    s.link = s.link.saturating_sub(1);
                }
            }
        }
        removed
    }
}

/// `BlockStored` events for blocks `from..to` of `seg` after `parent`, in prefill chunks;
/// returns the chain's end (`parent` when there is nothing to store).
fn stores(
    p: &ModelParams,
    seg: u64,
    (from, to): (u32, u32),
    mut parent: Option<u64>,
    events: &mut Vec<KvEvent>,
    ops: &mut RequestOps,
) -> Option<u64> {
    let chunk = p.prefill_chunk_blocks.max(1);
    let mut at = from;
    while at < to {
        let end = at.saturating_add(chunk).min(to);
        let mut tokens = Vec::with_capacity(((end - at) * p.block_size) as usize);
        for b in at..end {
            block_tokens(seg, b, p.block_size, &mut tokens);
        }
        events.push(KvEvent::BlockStored {
            block_hashes: (at..end).map(|b| engine_hash(seg, b)).collect(),
            parent_block_hash: parent,
            token_ids: tokens,
            block_size: p.block_size,
            lora: None,
            extra_keys: Vec::new(),
        });
        ops.stored += u64::from(end - at);
        parent = Some(engine_hash(seg, end - 1));
        at = end;
    }
    parent
}

/// Block-ops (blocks stored plus blocks removed) of `batches`.
pub fn block_ops(batches: &[EventBatch]) -> u64 {
    batches
        .iter()
        .flat_map(|b| &b.events)
        .map(|e| match e {
            KvEvent::BlockStored { block_hashes, .. } | KvEvent::BlockRemoved { block_hashes } => {
                block_hashes.len() as u64
            }
            KvEvent::OffloadStored { .. } => 1,
            KvEvent::OffloadRemoved { block_hashes } => block_hashes.len() as u64,
            KvEvent::AllBlocksCleared => 0,
            KvEvent::Grouped { .. } => 0, // the scale model serves no hybrid model
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Replays `batches` onto the set of held engine hashes, checking every store chains onto a
    /// held parent (or the root) and every removal names a held block.
    fn apply(held: &mut HashSet<u64>, parents: &mut HashMap<u64, Option<u64>>, b: &EventBatch) {
        for e in &b.events {
            match e {
                KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, .. } => {
                    if let Some(p) = parent_block_hash {
                        assert!(held.contains(p), "store after an unheld parent {p:x}");
                    }
                    assert_eq!(token_ids.len(), block_hashes.len() * 16);
                    let mut prev = *parent_block_hash;
                    for h in block_hashes {
                        held.insert(*h);
                        parents.insert(*h, prev);
                        prev = Some(*h);
                    }
                }
                KvEvent::BlockRemoved { block_hashes } => {
                    for h in block_hashes {
                        assert!(held.remove(h), "removal of an unheld block {h:x}");
                    }
                }
                KvEvent::AllBlocksCleared => held.clear(),
                KvEvent::OffloadStored { .. } | KvEvent::OffloadRemoved { .. } => {
                    panic!("the scale model publishes no offload tier")
                }
                KvEvent::Grouped { .. } => panic!("the scale model serves no hybrid model"),
            }
        }
    }

    #[test]
    fn a_worker_stays_within_capacity_prefix_closed_and_consistent() {
        let p = ModelParams::new(16, 2_000);
        let mut w = WorkerCache::new(3, 42);
        let (mut held, mut parents) = (HashSet::new(), HashMap::new());
        let (mut stored, mut removed) = (0u64, 0u64);
        for _ in 0..400 {
            let mut out = Vec::new();
            let ops = w.request(&p, 1.0, &mut out);
            assert_eq!(ops.batches, out.len() as u64);
            assert_eq!(ops.stored + ops.removed, block_ops(&out));
            for b in &out {
                assert!(!b.events.is_empty(), "no empty batch is published");
                apply(&mut held, &mut parents, b);
            }
            stored += ops.stored;
            removed += ops.removed;
            assert!(w.held() <= u64::from(p.capacity), "{} over capacity", w.held());
            assert_eq!(w.held(), held.len() as u64, "the model's count is the event stream's");
            // Prefix-closed: every held block's parent is held.
            for h in &held {
                if let Some(Some(parent)) = parents.get(h) {
                    assert!(held.contains(parent), "a held block lost its parent");
                }
            }
        }
        assert!(removed > 0, "400 requests overflow 2,000 blocks");
        assert_eq!(stored - removed, held.len() as u64);
    }

    #[test]
    fn system_prompts_are_the_same_blocks_on_every_worker_and_conversations_are_not() {
        let p = ModelParams::new(16, 1_000_000);
        let hashes = |worker: u32| {
            let mut w = WorkerCache::new(worker, 7);
            let mut out = Vec::new();
            for _ in 0..200 {
                w.request(&p, 0.0, &mut out);
            }
            out.iter()
                .flat_map(|b| &b.events)
                .flat_map(|e| match e {
                    KvEvent::BlockStored { block_hashes, .. } => block_hashes.clone(),
                    _ => Vec::new(),
                })
                .collect::<HashSet<u64>>()
        };
        let (a, b) = (hashes(0), hashes(1));
        let shared = a.intersection(&b).count();
        assert!(shared > 0, "popular system prompts are held by both");
        let system: HashSet<u64> = (0..p.system_prompts)
            .flat_map(|s| (0..p.system_len(s)).map(move |b| engine_hash(system_key(s), b)))
            .collect();
        assert!(
            a.intersection(&b).all(|h| system.contains(h)),
            "only system prompt blocks are shared: conversations are each worker's own"
        );
        let mut t1 = Vec::new();
        let mut t2 = Vec::new();
        block_tokens(system_key(5), 3, 16, &mut t1);
        block_tokens(system_key(5), 3, 16, &mut t2);
        assert_eq!(t1, t2);
        assert!(t1.iter().all(|t| u64::from(*t) < VOCAB));
    }

    #[test]
    fn the_same_seed_gives_the_same_stream() {
        let p = ModelParams::new(16, 1_000);
        let run = || {
            let mut w = WorkerCache::new(9, 1);
            let mut out = Vec::new();
            for _ in 0..30 {
                w.request(&p, 0.0, &mut out);
            }
            out
        };
        assert_eq!(run(), run());
    }
}
