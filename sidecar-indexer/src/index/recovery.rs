//! Orphan recovery: learning a chain the index missed from the prompts routed to the worker.
//!
//! After an indexer restart, blocks an engine still caches but that left its replay buffer are
//! unknown, so every later store chained to them is an orphan — and a hot prefix stays blind
//! until the engine evicts it. But the indexer routed the request whose blocks those stores are:
//! its prompt's chain hashes and local block hashes are remembered here ([`RoutedPrompts`], bounded
//! by blocks). An orphan store whose first block is block `k ≥ 1` of a prompt routed to the same
//! worker (its local hash, and those of the following stored blocks, agree) tells us that its
//! parent engine hash is that prompt's block `k−1`, and that the worker holds blocks `0..k` (the
//! engine served the prompt's prefix from cache to compute block `k`). The parent is mapped under
//! its real engine hash; its ancestors, whose engine hashes are unknown, under *synthetic* keys
//! (derived from the chain hash). A synthetic ancestor leaves with its last
//! mapped child (the engine evicts a chain's tail before its head), so a removal of the real
//! blocks never leaves it behind for long; the index still may under-predict, and over-predicts
//! only while a recovered ancestor was evicted before its descendants.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use kvmesh_core::hashing::{LocalBlockHash, SequenceHash};

use super::slots::{block_hash, BlockRef, RefSlot};
use super::{KvIndex, WorkerSlot};

/// Synthetic keys are `chain ^ SYNTHETIC`: never an approximate-mode key (the chain itself), and
/// a real engine hash equal to one is as unlikely as any 64-bit collision.
const SYNTHETIC: u64 = 0x5f3c_9e1d_a7b2_4c61;

/// Whether the mapping `key → r` is a recovered ancestor (no real engine hash).
fn synthetic(key: u64, r: &BlockRef) -> bool {
    key == r.chain.0 ^ SYNTHETIC
}

/// Default bound of [`RoutedPrompts`], in blocks (about 40 B each).
pub const DEFAULT_RECOVERY_BLOCKS: usize = 262_144;

struct Routed {
    id: u64,
    slot: WorkerSlot,
    /// The first block looked up by its local hash (blocks before it were known on `slot`).
    from: usize,
    chains: Arc<[SequenceHash]>,
    locals: Arc<[LocalBlockHash]>,
}

/// The last prompts routed to each worker, oldest forgotten first beyond `max_blocks`.
pub struct RoutedPrompts {
    ring: VecDeque<Routed>,
    /// (slot, local hash of block k ≥ 1) → (prompt id, k); the newest prompt wins.
    by_local: HashMap<(WorkerSlot, u64), (u64, u32), crate::expiring::FastHasher>,
    blocks: usize,
    max_blocks: usize,
    next: u64,
}

impl Default for RoutedPrompts {
    fn default() -> Self {
        Self {
            ring: VecDeque::new(),
            by_local: HashMap::default(),
            blocks: 0,
            max_blocks: DEFAULT_RECOVERY_BLOCKS,
            next: 0,
        }
    }
}

impl RoutedPrompts {
    fn note(
        &mut self,
        slot: WorkerSlot,
        chains: Arc<[SequenceHash]>,
        locals: Arc<[LocalBlockHash]>,
        known: usize,
    ) {
        if chains.len() < 2
            || chains.len() != locals.len()
            || chains.len() > self.max_blocks
            || known >= chains.len()
        {
            return;
        }
        self.next += 1;
        let id = self.next;
        let from = known.max(1);
        for (k, l) in locals.iter().enumerate().skip(from) {
            self.by_local.insert((slot, l.0), (id, k as u32));
        }
        self.blocks += chains.len();
        self.ring.push_back(Routed { id, slot, from, chains, locals });
        self.trim();
    }

    fn trim(&mut self) {
        while self.blocks > self.max_blocks {
            let Some(old) = self.ring.pop_front() else { break };
            self.blocks -= old.chains.len();
            for l in old.locals.iter().skip(old.from) {
                if self.by_local.get(&(old.slot, l.0)).is_some_and(|(id, _)| *id == old.id) {
                    self.by_local.remove(&(old.slot, l.0));
                }
            }
        }
    }

    /// The prompt and position whose block `k` has local hash `local` on `slot`.
    fn find(&self, slot: WorkerSlot, local: LocalBlockHash) -> Option<(&Routed, usize)> {
        let (id, k) = *self.by_local.get(&(slot, local.0))?;
        let first = self.ring.front()?.id;
        let r = self.ring.get(usize::try_from(id.checked_sub(first)?).ok()?)?;
        (r.id == id).then_some((r, k as usize))
    }

    /// Blocks remembered (for tests and gauges).
    pub fn blocks(&self) -> usize {
        self.blocks
    }
}

/// [`synthetic`] for the removal path in `mod.rs`.
pub(super) fn is_synthetic(key: u64, r: &BlockRef) -> bool {
    synthetic(key, r)
}

impl KvIndex {
    /// Remembers that a prompt with these chain and local block hashes was routed to `slot`, where
    /// the index knew its first `known` blocks. An orphan store starts where the engine's cache
    /// ended, at or past what the index knew of it, so only blocks from `known` on are looked up
    /// (a continuation notes its new turn's blocks, not its whole history's, and a prompt known
    /// whole is not noted). Takes `&self` (the route path holds only the read lock); the applier
    /// reads it on orphans.
    pub fn note_routed(
        &self,
        slot: WorkerSlot,
        chains: Arc<[SequenceHash]>,
        locals: Arc<[LocalBlockHash]>,
        known: usize,
    ) {
        self.routed.lock().note(slot, chains, locals, known);
    }

    /// Bounds the routed-prompt memory to `max_blocks` blocks.
    pub fn set_recovery_blocks(&self, max_blocks: usize) {
        let mut r = self.routed.lock();
        r.max_blocks = max_blocks;
        r.trim();
    }

    /// Blocks of routed prompts remembered for recovery.
    pub fn recovery_blocks(&self) -> usize {
        self.routed.lock().blocks()
    }

    /// For an orphan store on `slot` chained to the unknown engine hash `parent`: maps `parent` and
    /// its ancestors from a routed prompt that agrees with the stored blocks, and returns the
    /// parent's chain hash (then the store goes on as usual), or None.
    pub(super) fn recover_parent(
        &mut self,
        slot: WorkerSlot,
        parent: u64,
        token_ids: &[u32],
        block_size: usize,
        seed: u64,
    ) -> Option<SequenceHash> {
        let routed = self.routed.get_mut();
        let first = token_ids.get(..block_size)?;
        let (prompt, k) = routed.find(slot, block_hash(first, seed))?;
        if k == 0 {
            return None;
        }
        // The following stored blocks must be the prompt's next ones too (as far as it goes).
        let agrees = token_ids
            .chunks_exact(block_size)
            .zip(prompt.locals.iter().skip(k))
            .all(|(t, l)| block_hash(t, seed) == *l);
        if !agrees {
            return None;
        }
        let chains: Vec<SequenceHash> = prompt.chains[..k].to_vec();
        let seed_id = self.seeds.intern(seed)?;
        let w = self.workers.get_mut(slot as usize).filter(|w| w.active)?;
        let mut up: Option<u64> = None;
        let mut new = Vec::new();
        for (j, c) in chains.iter().enumerate() {
            let key = if j + 1 == k { parent } else { c.0 ^ SYNTHETIC };
            let (s, inserted) = w
                .map
                .get_or_insert_with(key, || RefSlot { key, r: BlockRef::new(*c, up, seed_id) });
            if inserted {
                self.seeds.retain(seed_id);
            }
            if s.r.chain != *c {
                // The key already names other content (a synthetic key colliding): give up.
                return None;
            }
            if s.r.refs == 0 {
                s.r.refs = 1;
                new.push(c.0);
                if let Some(pr) = up.and_then(|p| w.map.get_mut(p)) {
                    pr.r.kids = pr.r.kids.saturating_add(1);
                }
            }
            up = Some(key);
        }
        for c in new {
            self.hold(c, slot);
        }
        chains.last().copied()
    }

    /// After removals on `slot`: synthetic ancestors left without mapped children are removed
    /// too, up the chain.
    pub(super) fn drop_childless_synthetic(&mut self, slot: WorkerSlot, mut parents: Vec<u64>) {
        while let Some(p) = parents.pop() {
            let Some(w) = self.workers.get_mut(slot as usize) else { return };
            let Some(pos) = w.map.find(p) else { continue };
            let r = w.map.at_mut(pos).r;
            if !synthetic(p, &r) || r.kids != 0 {
                continue;
            }
            w.map.remove_at(pos);
            self.seeds.release(r.seed_id());
            if let Some(up) = r.parent() {
                if let Some(u) = w.map.get_mut(up) {
                    if u.r.kids != u16::MAX {
                        u.r.kids = u.r.kids.saturating_sub(1);
                    }
                }
                parents.push(up);
            }
            self.unhold(r.chain.0, slot);
        }
    }
}
