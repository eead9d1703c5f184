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
//!
//! **The answer's own blocks** (issue 46, point 5). A conversation's next turn sent right after
//! the previous answer is routed before the engine has published the answer's last blocks: the
//! worker that produced the answer holds them (an engine caches decode blocks as they fill), the
//! index does not yet. The indexer never sees the answer's tokens, but `/v1/done` says where the
//! answer finished and how long it was (`usage`), and the next turn's prompt contains the answer.
//! So [`Speculative::answered`] keeps, per worker, an *answer credit*: the prompt's last hashed
//! block (the anchor: its chain hash names the whole prefix) and where the engine's computed
//! tokens end, `prompt_tokens + completion_tokens - 1` (the last sampled token is never
//! computed). A later prompt whose chain passes through the anchor is credited on that worker up
//! to that end, in full blocks ([`Speculative::overlap`]); the engine's events confirm it (the
//! index overlap then reaches it) or the TTL (`speculative_ttl_ms`) expires it. Kept per worker,
//! the newest [`ANSWERS_PER_WORKER`] (about 40 B each). Limits: the credit assumes the client
//! sends the answer back as the engine generated it and the chat template renders it token for
//! token (the shipped DeepSeek template does; a template that drops reasoning from the history,
//! or a client that edits the answer, does not); any prompt through the anchor is credited (a
//! regenerated or branched turn too); an eviction within the TTL is not seen. Each such miss is
//! counted as `not_delivered` by the attribution (`crate::route::attribution`) and alerted on. A
//! prompt shorter than one block has no anchor and gets no credit.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvmesh_core::hashing::SequenceHash;

use crate::approx::ApproxTracker;
use crate::index::WorkerSlot;

/// Answer credits kept per worker (the newest): a bound on memory and on the work of a lookup.
pub const ANSWERS_PER_WORKER: usize = 256;

/// An answer that finished on a worker: its prompt's anchor and the end of its computed tokens.
#[derive(Debug, Clone, Copy)]
struct Answer {
    /// Blocks up to and including the anchor (at least 1).
    prompt_blocks: u32,
    /// The chain hash of the prompt's block `prompt_blocks - 1`.
    anchor: u64,
    /// Full blocks of the prompt and the answer the engine computed.
    end_blocks: u32,
    at: Instant,
}

/// Recently decided blocks per worker slot, and answers that just finished there.
pub struct Speculative {
    tracker: ApproxTracker,
    answers: HashMap<WorkerSlot, VecDeque<Answer>>,
    ttl: Duration,
    enabled: bool,
}

impl Speculative {
    /// Holdings kept `ttl` (zero = off), at most `max_per_worker` blocks per worker.
    pub fn new(ttl: Duration, max_per_worker: usize) -> Self {
        Self {
            tracker: ApproxTracker::new(ttl.max(Duration::from_millis(1)), max_per_worker),
            answers: HashMap::new(),
            ttl,
            enabled: !ttl.is_zero(),
        }
    }

    /// New bounds (a reload).
    pub fn set_limits(&mut self, ttl: Duration, max_per_worker: usize) {
        self.enabled = !ttl.is_zero();
        self.ttl = ttl;
        if !self.enabled {
            self.answers.clear();
        }
        self.tracker.set_limits(ttl.max(Duration::from_millis(1)), max_per_worker);
    }

    /// Records that `slot` was chosen for a prompt with `chains` at `now`; forgets expired entries.
    /// Writes the blocks past what `slot` already holds and the last block (module docs). Returns
    /// how many entries were forgotten (TTL and size bound).
    pub fn record(&mut self, slot: WorkerSlot, chains: &[SequenceHash], now: Instant) -> usize {
        let mut forgotten: usize = self.tracker.expire(now).iter().map(|(_, v)| v.len()).sum();
        if self.enabled && !chains.is_empty() {
            // What recent decisions hold (an answer's credit is no decision's write).
            let decided = if self.tracker.is_empty(slot) {
                0
            } else {
                self.decided_overlap(slot, chains, now)
            };
            let held = (decided as usize).min(chains.len() - 1);
            forgotten += self.tracker.record(slot, &chains[held..], now).len();
        }
        forgotten
    }

    /// Forgets entries whose TTL ran out.
    pub fn expire(&mut self, now: Instant) {
        self.tracker.expire(now);
        let ttl = self.ttl;
        self.answers.retain(|_, q| {
            while q.front().is_some_and(|a| now.saturating_duration_since(a.at) >= ttl) {
                q.pop_front();
            }
            !q.is_empty()
        });
    }

    /// Records that an answer finished on `slot` at `now`: its prompt's last hashed block
    /// `anchor` (blocks up to it, its chain hash) and the full blocks the engine computed,
    /// `end_blocks` (module docs). Returns whether a credit was kept (none when off, or with
    /// nothing past the anchor).
    pub fn answered(
        &mut self,
        slot: WorkerSlot,
        anchor: (u32, SequenceHash),
        end_blocks: u32,
        now: Instant,
    ) -> bool {
        let (prompt_blocks, hash) = anchor;
        if !self.enabled || prompt_blocks == 0 || end_blocks <= prompt_blocks {
            return false;
        }
        let ttl = self.ttl;
        let q = self.answers.entry(slot).or_default();
        while q.front().is_some_and(|a| now.saturating_duration_since(a.at) >= ttl) {
            q.pop_front();
        }
        q.push_back(Answer { prompt_blocks, anchor: hash.0, end_blocks, at: now });
        while q.len() > ANSWERS_PER_WORKER {
            q.pop_front();
        }
        true
    }

    /// Leading blocks of `chains` an answer that finished on `slot` vouches for at `now`: the
    /// most of any live credit whose anchor is in `chains` at its position, up to the answer's end.
    fn answer_overlap(&self, slot: WorkerSlot, chains: &[SequenceHash], now: Instant) -> u32 {
        let Some(q) = self.answers.get(&slot) else { return 0 };
        let len = u32::try_from(chains.len()).unwrap_or(u32::MAX);
        q.iter()
            .filter(|a| now.saturating_duration_since(a.at) < self.ttl)
            .filter(|a| chains.get(a.prompt_blocks as usize - 1).is_some_and(|c| c.0 == a.anchor))
            .map(|a| a.end_blocks.min(len))
            .max()
            .unwrap_or(0)
    }

    /// Answer credits held over all workers.
    pub fn answers(&self) -> usize {
        self.answers.values().map(VecDeque::len).sum()
    }

    /// Leading blocks of `chains` speculatively held by `slot` at `now`: the end of the last held
    /// block found, or further where an answer that finished there vouches for more (module docs).
    pub fn overlap(&self, slot: WorkerSlot, chains: &[SequenceHash], now: Instant) -> u32 {
        if !self.enabled || chains.is_empty() {
            return 0;
        }
        let answered = self.answer_overlap(slot, chains, now);
        if self.tracker.is_empty(slot) {
            return answered;
        }
        self.decided_overlap(slot, chains, now).max(answered)
    }

    /// The recent decisions' part of [`Self::overlap`].
    fn decided_overlap(&self, slot: WorkerSlot, chains: &[SequenceHash], now: Instant) -> u32 {
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
        self.answers.remove(&slot);
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
    fn an_answer_credits_the_next_turn_up_to_its_end_until_the_ttl() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut s = Speculative::new(Duration::from_secs(2), 10_000);
        // Turn 1: 56 full blocks hashed (896 tokens of 16), decided on slot 1 at t0.
        s.record(1, &chains(0..56), t0);
        // It finished 3 s later (the decision's own credit has expired): prompt 900 tokens and 70
        // generated: the engine computed 969 tokens, 60 full blocks.
        let end = (900 + 70 - 1) / 16;
        assert!(s.answered(1, (56, SequenceHash(55)), end, ms(3000)));
        // Turn 2 contains turn 1 and the answer: its blocks past 56 are the answer's (other hashes).
        let turn2: Vec<SequenceHash> = chains(0..56).into_iter().chain(chains(500..520)).collect();
        assert_eq!(s.overlap(1, &turn2, ms(3001)), 60, "credited up to the answer's end");
        assert_eq!(s.overlap(2, &turn2, ms(3001)), 0, "only where it finished");
        // A shorter prompt through the anchor gets at most its own blocks.
        assert_eq!(s.overlap(1, &turn2[..58], ms(3001)), 58);
        // A prompt that does not pass through the anchor gets nothing from it.
        let other: Vec<SequenceHash> = chains(0..55).into_iter().chain(chains(900..910)).collect();
        assert_eq!(s.overlap(1, &other, ms(3001)), 0);
        assert_eq!(s.overlap(1, &turn2[..50], ms(3001)), 0, "the anchor is past the prompt");
        // The TTL ends it (the events have confirmed the blocks by then, or they are gone).
        assert_eq!(s.overlap(1, &turn2, ms(4999)), 60);
        assert_eq!(s.overlap(1, &turn2, ms(5000)), 0);
        assert_eq!(s.answers(), 1);
        s.expire(ms(5000));
        assert_eq!(s.answers(), 0);
        // Nothing past the anchor, no anchor, or off: no credit.
        assert!(!s.answered(1, (56, SequenceHash(55)), 56, ms(6000)));
        assert!(!s.answered(1, (0, SequenceHash(0)), 9, ms(6000)));
        let mut off = Speculative::new(Duration::ZERO, 10);
        assert!(!off.answered(1, (1, SequenceHash(0)), 9, t0));
        assert_eq!(off.overlap(1, &chains(0..9), t0), 0);
    }

    #[test]
    fn answer_credits_are_bounded_per_worker_and_leave_with_it() {
        let t0 = Instant::now();
        let mut s = Speculative::new(Duration::from_secs(60), 10);
        let extra = 10u64;
        for i in 0..(ANSWERS_PER_WORKER as u64 + extra) {
            s.answered(3, (1, SequenceHash(i)), 5, t0 + Duration::from_millis(i));
        }
        assert_eq!(s.answers(), ANSWERS_PER_WORKER);
        let now = t0 + Duration::from_secs(1);
        assert_eq!(s.overlap(3, &chains(0..9), now), 0, "the oldest credits went");
        let newest = ANSWERS_PER_WORKER as u64 + extra - 1;
        assert_eq!(s.overlap(3, &chains(newest..newest + 9), now), 5);
        s.forget_worker(3);
        assert_eq!(s.answers(), 0);
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
