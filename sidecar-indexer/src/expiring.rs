//! One expiring map: entries that live `ttl` after their last insert, at most `max_entries` of them,
//! the least recently inserted going first. The booked loads ([`crate::load`]), the per-session maps
//! ([`crate::recent`]) and the approximate and speculative holdings ([`crate::approx`]) are all this
//! one structure; each decides what an entry that leaves means (a released booking, a forgotten
//! session, a block to drop from the index).
//!
//! Recency is an append-only queue of `(stamp, key)`; inserting a key again appends a new record
//! and leaves the old one stale, recognised because its stamp no longer matches the map's (a
//! re-insert within the same stamp keeps the existing record: entries touched at the same instant
//! are equally old, in no promised order among themselves). Only the front of the queue is ever examined, so every operation is amortised
//! O(1); the queue is compacted when stale records outnumber live ones, so it never holds more than
//! `2 × len + 1024` records. An entry that left (removed, expired, over the cap) is never returned
//! again: stale records are skipped, never acted on.
//!
//! Stamps are nanoseconds since the first insert (a `u64` lasts 584 years; earlier instants count
//! as the first), 8 B instead of an `Instant`'s 16, so a live entry costs its key and value, an
//! 8 B stamp in the map and one or two 8 B + key queue records. Pure: the clock is passed in and the
//! caller's clock must not go backwards (a monotonic `Instant`, real or paused, does not).

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::time::{Duration, Instant};

/// Stale queue records tolerated beyond the live ones before a compaction.
const QUEUE_SLACK: usize = 1024;

/// The maps' hasher: foldhash, seeded per process (`lru`'s hasher, already a dependency). Keys
/// here are u64 hashes and ids inserted by the thousand per route call (speculative holdings);
/// std's SipHash cost ~170 instructions per key there, a tenth of a long prompt's route.
pub(crate) type FastHasher = lru::DefaultHasher;

/// A bounded map whose entries expire `ttl` after their last insert.
#[derive(Debug)]
pub struct ExpiringMap<K, V> {
    map: HashMap<K, (u64, V), FastHasher>,
    order: VecDeque<(u64, K)>,
    epoch: Option<Instant>,
    ttl: Duration,
    max_entries: usize,
}

impl<K: Hash + Eq + Clone, V> ExpiringMap<K, V> {
    /// An empty map whose entries expire `ttl` after their last insert, holding at most
    /// `max_entries` (at least 1) once the caller pops what is over the cap.
    pub fn new(ttl: Duration, max_entries: usize) -> Self {
        Self {
            map: HashMap::default(),
            order: VecDeque::new(),
            epoch: None,
            ttl,
            max_entries: max_entries.max(1),
        }
    }

    /// New bounds (a reload); entries beyond them leave on the next pop.
    pub fn set_limits(&mut self, ttl: Duration, max_entries: usize) {
        self.ttl = ttl;
        self.max_entries = max_entries.max(1);
    }

    /// The time-to-live of an entry.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    fn stamp(&mut self, now: Instant) -> u64 {
        let epoch = *self.epoch.get_or_insert(now);
        u64::try_from(now.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    fn expired(&self, stamp: u64, now: Instant) -> bool {
        let Some(epoch) = self.epoch else { return false };
        let at = u64::try_from(now.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX);
        u128::from(at.saturating_sub(stamp)) >= self.ttl.as_nanos()
    }

    /// The value of `key` if it was inserted less than `ttl` before `now`.
    pub fn get(&self, key: &K, now: Instant) -> Option<&V> {
        self.map.get(key).filter(|(at, _)| !self.expired(*at, now)).map(|(_, v)| v)
    }

    /// The value of `key`, expired or not (an entry leaves only when popped or removed).
    pub fn peek_mut(&mut self, key: &K) -> Option<&mut V> {
        self.map.get_mut(key).map(|(_, v)| v)
    }

    /// Inserts `key → value` as touched at `now` (renewing its TTL and recency); the previous value.
    /// Nothing leaves here: the caller pops what expired or is over the cap, and counts it.
    pub fn insert(&mut self, key: K, value: V, now: Instant) -> Option<V> {
        let at = self.stamp(now);
        let previous = match self.map.insert(key.clone(), (at, value)) {
            Some((old, v)) if old == at => return Some(v),
            Some((_, v)) => Some(v),
            None => None,
        };
        self.order.push_back((at, key));
        if self.order.len() > 2 * self.map.len() + QUEUE_SLACK {
            self.compact();
        }
        previous
    }

    /// Removes `key`; its value when it was present (its queue record turns stale).
    pub fn remove(&mut self, key: &K) -> Option<V> {
        self.map.remove(key).map(|(_, v)| v)
    }

    /// The stamp of the least recently inserted entry, skipping stale records.
    fn front(&mut self) -> Option<u64> {
        while let Some((at, key)) = self.order.front() {
            if self.map.get(key).is_some_and(|(stamp, _)| stamp == at) {
                return Some(*at);
            }
            self.order.pop_front();
        }
        None
    }

    fn pop_front(&mut self) -> Option<(K, V)> {
        self.front()?;
        let (_, key) = self.order.pop_front()?;
        let (_, value) = self.map.remove(&key)?;
        Some((key, value))
    }

    /// Removes and returns the least recently inserted entry if it is at least `ttl` old at `now`
    /// (call until `None` to expire everything due; a younger entry is never returned).
    pub fn pop_expired(&mut self, now: Instant) -> Option<(K, V)> {
        let at = self.front()?;
        if !self.expired(at, now) {
            return None;
        }
        self.pop_front()
    }

    /// Removes and returns the least recently inserted entry while more than `max_entries` are held.
    pub fn pop_over_cap(&mut self) -> Option<(K, V)> {
        if self.map.len() <= self.max_entries {
            return None;
        }
        self.pop_front()
    }

    /// Removes and returns every expired entry, then every entry over the cap, oldest first.
    pub fn prune(&mut self, now: Instant) -> Vec<(K, V)> {
        let mut out = Vec::new();
        while let Some(e) = self.pop_expired(now).or_else(|| self.pop_over_cap()) {
            out.push(e);
        }
        out
    }

    /// Every held entry (expired ones not yet popped included), in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&K, &V)> {
        self.map.iter().map(|(k, (_, v))| (k, v))
    }

    /// Entries held (expired ones not yet popped included).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Records in the recency queue (for tests of the memory bound).
    pub fn queue_len(&self) -> usize {
        self.order.len()
    }

    /// Rewrites the queue with the live records only, in recency order.
    fn compact(&mut self) {
        let map = &self.map;
        self.order.retain(|(at, key)| map.get(key).is_some_and(|(stamp, _)| stamp == at));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn an_entry_lives_ttl_after_its_last_insert() {
        let t0 = Instant::now();
        let mut m = ExpiringMap::new(secs(10), 100);
        m.insert(1u64, "a", t0);
        assert_eq!(m.get(&1, t0 + Duration::from_millis(9_999)), Some(&"a"));
        assert_eq!(m.get(&1, t0 + secs(10)), None);
        assert_eq!(m.insert(1, "b", t0 + secs(8)), Some("a"));
        assert_eq!(m.pop_expired(t0 + secs(17)), None, "the re-insert renewed it");
        assert_eq!(m.pop_expired(t0 + secs(18)), Some((1, "b")));
        assert_eq!(m.pop_expired(t0 + secs(100)), None, "the stale record is not acted on");
        assert!(m.is_empty());
    }

    #[test]
    fn a_removed_entry_never_expires_a_younger_one() {
        let t0 = Instant::now();
        let mut m = ExpiringMap::new(secs(600), 100);
        m.insert(1u64, (), t0);
        m.remove(&1);
        m.insert(2, (), t0 + secs(599));
        assert_eq!(m.pop_expired(t0 + secs(600)), None);
        assert_eq!(m.pop_expired(t0 + secs(1199)), Some((2, ())));
    }

    #[test]
    fn over_the_cap_the_least_recently_inserted_goes() {
        let t0 = Instant::now();
        let mut m = ExpiringMap::new(secs(3600), 2);
        m.insert(1u64, (), t0);
        m.insert(2, (), t0 + secs(1));
        m.insert(1, (), t0 + secs(2));
        m.insert(3, (), t0 + secs(3));
        assert_eq!(m.pop_over_cap(), Some((2, ())));
        assert_eq!(m.pop_over_cap(), None);
        m.set_limits(secs(3600), 1);
        assert_eq!(m.prune(t0 + secs(4)), vec![(1, ())]);
    }

    #[test]
    fn repeated_inserts_keep_the_queue_bounded() {
        let t0 = Instant::now();
        let mut m = ExpiringMap::new(secs(3600), 10);
        for i in 0..100_000u64 {
            m.insert(i % 5, i, t0 + Duration::from_millis(i));
            assert!(m.queue_len() <= 2 * m.len() + QUEUE_SLACK + 1);
        }
        assert_eq!(m.len(), 5);
        // Same-instant re-inserts add no record at all.
        let mut same = ExpiringMap::new(secs(1), 10);
        for _ in 0..10_000 {
            same.insert(7u64, (), t0);
        }
        assert_eq!(same.queue_len(), 1);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u8, u16),
        Remove(u8),
        Advance(u16),
        PopExpired,
        PopOverCap,
        Limits(u16, u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u8..16, any::<u16>()).prop_map(|(k, v)| Op::Insert(k, v)),
            1 => (0u8..16).prop_map(Op::Remove),
            2 => (0u16..400).prop_map(Op::Advance),
            1 => Just(Op::PopExpired),
            1 => Just(Op::PopOverCap),
            1 => (1u16..500, 1u8..12).prop_map(|(t, n)| Op::Limits(t, n)),
        ]
    }

    proptest! {
        /// Against a model that keeps (key, inserted at, value) in recency order and scans it.
        #[test]
        fn matches_a_scanning_model(ops in proptest::collection::vec(op(), 1..300)) {
            let t0 = Instant::now();
            let mut now = t0;
            let (mut ttl, mut cap) = (Duration::from_millis(300), 8usize);
            let mut m = ExpiringMap::new(ttl, cap);
            let mut model: Vec<(u8, Instant, u16)> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(k, v) => {
                        // Distinct instants, so recency is a total order (same-instant ties are
                        // equally old and tested above).
                        now += Duration::from_micros(1);
                        let prev = model.iter().position(|e| e.0 == k).map(|i| model.remove(i).2);
                        model.push((k, now, v));
                        prop_assert_eq!(m.insert(k, v, now), prev);
                    }
                    Op::Remove(k) => {
                        let prev = model.iter().position(|e| e.0 == k).map(|i| model.remove(i).2);
                        prop_assert_eq!(m.remove(&k), prev);
                    }
                    Op::Advance(ms) => now += Duration::from_millis(u64::from(ms)),
                    Op::PopExpired => {
                        let want = model.first().filter(|e| now.duration_since(e.1) >= ttl).map(|e| (e.0, e.2));
                        if want.is_some() { model.remove(0); }
                        prop_assert_eq!(m.pop_expired(now), want);
                    }
                    Op::PopOverCap => {
                        let want = (model.len() > cap).then(|| model.remove(0)).map(|e| (e.0, e.2));
                        prop_assert_eq!(m.pop_over_cap(), want);
                    }
                    Op::Limits(t, n) => {
                        (ttl, cap) = (Duration::from_millis(u64::from(t)), usize::from(n));
                        m.set_limits(ttl, cap);
                    }
                }
                prop_assert_eq!(m.len(), model.len());
                for k in 0u8..16 {
                    let want = model.iter().find(|e| e.0 == k && now.duration_since(e.1) < ttl).map(|e| e.2);
                    prop_assert_eq!(m.get(&k, now).copied(), want);
                }
            }
        }
    }
}
