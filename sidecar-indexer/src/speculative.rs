//! Speculative holdings: the blocks of a decision, credited to the chosen worker before its engine
//! says so.
//!
//! Requests that share a new prefix and arrive within the time it takes the engine to publish
//! `BlockStored` (best-of-n, fan-out agents, a burst of siblings) would otherwise all see no overlap
//! and scatter. So each decision's chain hashes are recorded on the chosen worker for a short TTL
//! (`speculative_ttl_ms`, default 2 s) and matched like real holdings when scoring: a worker's
//! effective overlap is `max(index overlap, speculative overlap)`. The engine's events replace them:
//! once the index shows the blocks, the index overlap is at least the speculative one and the entry
//! only waits for its TTL. They are never engine truth: the decision's `overlap_blocks`,
//! `router_kv_overlap_blocks_total` and the hit-rate metrics count index overlap only; what
//! speculation adds on the chosen worker is counted apart (`kvmesh_speculative_overlap_blocks_total`).
//!
//! Storage reuses approximate mode's expiring structure ([`ApproxTracker`]: per worker slot, chain →
//! last time, oldest forgotten first, at most `speculative_max_blocks_per_worker` entries, ≈ 60 B
//! each). A chain hash names its whole prefix, so a live entry for block `j` means blocks `0..=j`
//! were decided for that worker within the TTL, whatever became of the entries before it. A
//! decision therefore writes only the blocks past what the worker already holds speculatively (and
//! always its last block, which renews the prompt's own credit): rewriting a long shared prefix on
//! every turn cost a map write, mostly a cache miss, per block — three quarters of the decision
//! step for a 48k-token continuation (0.31 → 0.08 ms in the overhead bench). The overlap is the
//! end of the last held block, found by galloping back from the prompt's last block (the newest
//! decisions wrote the prompt's last blocks) and bisecting: O(log n) lookups. Pure: the clock is
//! passed in.

use std::time::{Duration, Instant};

use kvmesh_core::hashing::SequenceHash;

use crate::approx::ApproxTracker;
use crate::index::WorkerSlot;

/// Recently decided blocks per worker slot.
pub struct Speculative {
    tracker: ApproxTracker,
    enabled: bool,
}

impl Speculative {
    /// Holdings kept `ttl` (zero = off), at most `max_per_worker` blocks per worker.
    pub fn new(ttl: Duration, max_per_worker: usize) -> Self {
        Self {
            tracker: ApproxTracker::new(ttl.max(Duration::from_millis(1)), max_per_worker),
            enabled: !ttl.is_zero(),
        }
    }

    /// New bounds (a reload).
    pub fn set_limits(&mut self, ttl: Duration, max_per_worker: usize) {
        self.enabled = !ttl.is_zero();
        self.tracker.set_limits(ttl.max(Duration::from_millis(1)), max_per_worker);
    }

    /// Records that `slot` was chosen for a prompt with `chains` at `now`; forgets expired entries.
    /// Writes the blocks past what `slot` already holds and the last block (module docs). Returns
    /// how many entries were forgotten (TTL and size bound).
    pub fn record(&mut self, slot: WorkerSlot, chains: &[SequenceHash], now: Instant) -> usize {
        let mut forgotten: usize = self.tracker.expire(now).iter().map(|(_, v)| v.len()).sum();
        if self.enabled && !chains.is_empty() {
            let held = (self.overlap(slot, chains, now) as usize).min(chains.len() - 1);
            forgotten += self.tracker.record(slot, &chains[held..], now).len();
        }
        forgotten
    }

    /// Forgets entries whose TTL ran out.
    pub fn expire(&mut self, now: Instant) {
        self.tracker.expire(now);
    }

    /// Leading blocks of `chains` speculatively held by `slot` at `now`: the end of the last held
    /// block found (module docs).
    pub fn overlap(&self, slot: WorkerSlot, chains: &[SequenceHash], now: Instant) -> u32 {
        if !self.enabled || chains.is_empty() || self.tracker.is_empty(slot) {
            return 0;
        }
        let holds = |i: usize| chains.get(i).is_some_and(|c| self.tracker.holds(slot, c.0, now));
        // Gallop back from the last block to a held one, remembering the nearest unheld one above.
        let (mut held, mut unheld, mut step) = (chains.len() - 1, chains.len(), 1);
        while !holds(held) {
            if held == 0 {
                return 0;
            }
            unheld = held;
            held = held.saturating_sub(step);
            step *= 2;
        }
        // The boundary between them: invariant holds(lo - 1), unheld at hi (or hi is the end).
        let (mut lo, mut hi) = (held + 1, unheld);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if holds(mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        u32::try_from(lo).unwrap_or(u32::MAX)
    }

    /// Forgets a worker slot (it left, or was cleared).
    pub fn forget_worker(&mut self, slot: WorkerSlot) {
        self.tracker.forget_worker(slot);
    }

    /// Entries held over all workers.
    pub fn len(&self) -> usize {
        self.tracker.total()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chains(range: std::ops::Range<u64>) -> Vec<SequenceHash> {
        range.map(SequenceHash).collect()
    }

    #[test]
    fn siblings_see_what_was_just_decided_until_the_ttl() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Speculative::new(Duration::from_secs(2), 1000);
        s.record(1, &chains(0..10), t0);
        // A sibling sharing 6 blocks, then diverging; the whole prompt; a longer one; another worker.
        let sibling: Vec<SequenceHash> = chains(0..6).into_iter().chain(chains(100..104)).collect();
        let cases = [
            (1, sibling.clone(), 6),
            (1, chains(0..10), 10),
            (1, chains(0..20), 10),
            (2, chains(0..10), 0),
            (1, chains(50..60), 0),
            (1, vec![], 0),
        ];
        for (slot, c, want) in &cases {
            assert_eq!(s.overlap(*slot, c, ms(1999)), *want, "slot {slot} {c:?}");
        }
        assert_eq!(s.overlap(1, &chains(0..10), ms(2000)), 0, "expired");
        s.record(2, &chains(0..1), ms(2000));
        assert_eq!(s.len(), 1, "expired entries are forgotten on the next record");
    }

    #[test]
    fn a_later_turn_writes_only_its_new_blocks_and_its_last_block_vouches_for_the_prefix() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Speculative::new(Duration::from_secs(2), 10_000);
        s.record(1, &chains(0..1000), t0);
        // Turn 2 a second later: the 1000 blocks held, 10 new ones written.
        s.record(1, &chains(0..1010), ms(1000));
        // Past turn 1's TTL its blocks read as expired one by one, but turn 2's last blocks stand
        // for the prefix: turn 2 resent, and turn 3 (turn 2 and 10 more blocks), see all of it.
        assert_eq!(s.overlap(1, &chains(0..1010), ms(2500)), 1010);
        assert_eq!(s.overlap(1, &chains(0..1020), ms(2500)), 1010);
        // Only what turn 2 wrote is renewed: a sibling of turn 1's first half has lost its credit.
        assert_eq!(s.overlap(1, &chains(0..500), ms(2500)), 0);
        // An identical prompt renews its last block, so its credit lasts from the latest decision.
        s.record(1, &chains(0..1010), ms(2900));
        assert_eq!(s.overlap(1, &chains(0..1010), ms(4800)), 1010);
        assert_eq!(s.overlap(1, &chains(0..1010), ms(4900)), 0);
        // Expired blocks between live ones: the end of the last live run found.
        let mut t = Speculative::new(Duration::from_secs(2), 10_000);
        t.record(2, &chains(0..4), t0);
        t.record(2, &chains(0..8), ms(1000));
        t.record(2, &chains(0..2), ms(2100));
        assert_eq!(
            t.overlap(2, &chains(0..12), ms(2100)),
            8,
            "block 7, written at 1000 ms, stands for 0..8"
        );
    }

    #[test]
    fn off_holds_nothing_and_the_bound_holds() {
        let t0 = Instant::now();
        let mut off = Speculative::new(Duration::ZERO, 1000);
        off.record(1, &chains(0..10), t0);
        assert_eq!((off.overlap(1, &chains(0..10), t0), off.len()), (0, 0));
        let mut small = Speculative::new(Duration::from_secs(2), 8);
        for i in 0..10 {
            small.record(1, &chains(i * 100..i * 100 + 4), t0 + Duration::from_millis(i));
        }
        assert!(small.len() <= 8);
        assert_eq!(small.overlap(1, &chains(900..904), t0 + Duration::from_millis(10)), 4);
        small.forget_worker(1);
        assert!(small.is_empty());
    }
}
