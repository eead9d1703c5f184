//! Approximate mode: what each worker probably caches, learned from the indexer's own decisions.
//!
//! For engines that publish no KV events, the blocks of every routed prompt are assumed cached on
//! the chosen worker for `ttl` (refreshed when routed again), and at most `max_per_worker` blocks are
//! remembered per worker (the least recently routed go first). This module only keeps the times and
//! says which (worker, block) pairs to add or forget; the applier applies them to the index, so
//! approximate and precise entries live in the same structure and are matched the same way.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvmesh_core::hashing::SequenceHash;

use crate::expiring::ExpiringMap;
use crate::index::WorkerSlot;

/// Routed blocks per worker with their last routing time (one [`ExpiringMap`] per worker:
/// chain → (), oldest routed first).
pub struct ApproxTracker {
    workers: HashMap<WorkerSlot, ExpiringMap<u64, ()>>,
    ttl: Duration,
    max_per_worker: usize,
}

impl ApproxTracker {
    /// A tracker forgetting blocks after `ttl`, remembering at most `max_per_worker` per worker.
    pub fn new(ttl: Duration, max_per_worker: usize) -> Self {
        Self { workers: HashMap::new(), ttl, max_per_worker: max_per_worker.max(1) }
    }

    /// New bounds (a reload).
    pub fn set_limits(&mut self, ttl: Duration, max_per_worker: usize) {
        self.ttl = ttl;
        self.max_per_worker = max_per_worker.max(1);
        for w in self.workers.values_mut() {
            w.set_limits(ttl, self.max_per_worker);
        }
    }

    /// Records that `slot` was routed `chains` at `now`; returns blocks to forget for the size bound.
    pub fn record(&mut self, slot: WorkerSlot, chains: &[SequenceHash], now: Instant) -> Vec<u64> {
        let (ttl, max) = (self.ttl, self.max_per_worker);
        let w = self.workers.entry(slot).or_insert_with(|| ExpiringMap::new(ttl, max));
        for c in chains {
            w.insert(c.0, (), now);
        }
        let mut evicted = Vec::new();
        while let Some((chain, ())) = w.pop_over_cap() {
            evicted.push(chain);
        }
        evicted
    }

    /// Blocks whose TTL ran out, per worker.
    pub fn expire(&mut self, now: Instant) -> Vec<(WorkerSlot, Vec<u64>)> {
        let mut out = Vec::new();
        for (slot, w) in &mut self.workers {
            let mut gone = Vec::new();
            while let Some((chain, ())) = w.pop_expired(now) {
                gone.push(chain);
            }
            if !gone.is_empty() {
                out.push((*slot, gone));
            }
        }
        out
    }

    /// Forgets a worker (it left, or its index state was cleared).
    pub fn forget_worker(&mut self, slot: WorkerSlot) {
        self.workers.remove(&slot);
    }

    /// Whether `slot` was routed `chain` less than the TTL before `now`.
    pub fn holds(&self, slot: WorkerSlot, chain: u64, now: Instant) -> bool {
        self.workers.get(&slot).is_some_and(|w| w.get(&chain, now).is_some())
    }

    /// Whether nothing is remembered for `slot`.
    pub fn is_empty(&self, slot: WorkerSlot) -> bool {
        self.len(slot) == 0
    }

    /// Blocks remembered over all workers.
    pub fn total(&self) -> usize {
        self.workers.values().map(ExpiringMap::len).sum()
    }

    /// Blocks remembered for `slot`.
    pub fn len(&self, slot: WorkerSlot) -> usize {
        self.workers.get(&slot).map_or(0, ExpiringMap::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chains(range: std::ops::Range<u64>) -> Vec<SequenceHash> {
        range.map(SequenceHash).collect()
    }

    #[test]
    fn blocks_expire_after_the_ttl_unless_refreshed() {
        let t0 = Instant::now();
        let s = |n| t0 + Duration::from_secs(n);
        let mut a = ApproxTracker::new(Duration::from_secs(10), 100);
        a.record(0, &chains(0..3), t0);
        a.record(0, &chains(0..1), s(5)); // refresh block 0
        assert!(a.expire(s(9)).is_empty());
        let mut gone = a.expire(s(10));
        gone[0].1.sort_unstable();
        assert_eq!(gone, vec![(0, vec![1, 2])]);
        assert_eq!(a.expire(s(15)), vec![(0, vec![0])]);
        assert_eq!(a.len(0), 0);
    }

    #[test]
    fn the_size_bound_forgets_the_least_recently_routed() {
        let t0 = Instant::now();
        let mut a = ApproxTracker::new(Duration::from_secs(100), 3);
        a.record(1, &chains(0..2), t0);
        a.record(1, &chains(0..1), t0 + Duration::from_secs(1));
        let evicted = a.record(1, &chains(10..12), t0 + Duration::from_secs(2));
        assert_eq!(evicted, vec![1]);
        assert_eq!(a.len(1), 3);
    }

    #[test]
    fn refresh_churn_stays_bounded() {
        let t0 = Instant::now();
        let mut a = ApproxTracker::new(Duration::from_secs(100), 4);
        for i in 0..1000u64 {
            a.record(0, &chains(0..2), t0 + Duration::from_millis(i));
        }
        assert!(a.workers[&0].queue_len() <= 2 * 2 + 1024 + 1);
        assert_eq!(a.len(0), 2);
    }
}
