//! Bounded "seen recently" maps keyed by session: the local-continuation set and each session's
//! last decode worker (`kv_home`).
//!
//! Both are hit on every routed request with a session key, so they must stay O(1) and bounded in
//! time and memory: an entry lives `ttl` after its last touch, and beyond `max_entries` the entry
//! touched longest ago goes first. Recency order is kept in an append-only queue of
//! `(touched_at, key)`; touching a key again appends a new record and leaves the old one stale
//! (recognised because its time no longer matches the map's). The queue is compacted when stale
//! records outnumber live ones, so it never holds more than about `2 × max_entries` records.
//!
//! Memory per live entry: the map slot (key 8 B + value + 4 B stamp, plus hashbrown's control byte
//! and load-factor slack) and up to two queue records of 12 B. For the continuation set (value
//! `()`) that is about 40–60 B per session; 4M sessions ≈ 160–240 MB. The clock is passed in.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::RoutingConfig;

/// A bounded, TTL-limited map from session key to `V`.
#[derive(Debug)]
pub struct RecentMap<V> {
    map: HashMap<u64, (u32, V)>,
    order: VecDeque<(u32, u64)>,
    epoch: Instant,
    ttl: Duration,
    max_entries: usize,
}

impl<V: Clone> RecentMap<V> {
    /// A map whose entries expire `ttl` after their last touch, holding at most `max_entries`.
    pub fn new(ttl: Duration, max_entries: usize, now: Instant) -> Self {
        Self { map: HashMap::new(), order: VecDeque::new(), epoch: now, ttl, max_entries: max_entries.max(1) }
    }

    /// New bounds (a reload); entries beyond them go on the next touch.
    pub fn set_limits(&mut self, ttl: Duration, max_entries: usize) {
        self.ttl = ttl;
        self.max_entries = max_entries.max(1);
    }

    /// Seconds since the map was created, saturating (a u32 lasts 136 years).
    fn stamp(&self, now: Instant) -> u32 {
        u32::try_from(now.saturating_duration_since(self.epoch).as_secs()).unwrap_or(u32::MAX)
    }

    fn expired(&self, stamp: u32, now: Instant) -> bool {
        u64::from(self.stamp(now).saturating_sub(stamp)) >= self.ttl.as_secs()
    }

    /// The live value of `key`, if it was touched within the TTL.
    pub fn get(&self, key: u64, now: Instant) -> Option<&V> {
        self.map.get(&key).filter(|(at, _)| !self.expired(*at, now)).map(|(_, v)| v)
    }

    /// Records `key → value` as touched now; returns how many entries the bounds pushed out.
    pub fn touch(&mut self, key: u64, value: V, now: Instant) -> u64 {
        let at = self.stamp(now);
        self.map.insert(key, (at, value));
        self.order.push_back((at, key));
        let dropped = self.prune(now);
        if self.order.len() > 2 * self.map.len() + 1024 {
            self.compact();
        }
        dropped
    }

    /// Drops expired entries and, beyond `max_entries`, the least recently touched; returns how many.
    pub fn prune(&mut self, now: Instant) -> u64 {
        let mut dropped = 0;
        while let Some(&(at, key)) = self.order.front() {
            let live = self.map.get(&key).is_some_and(|(stamp, _)| *stamp == at);
            if live && !self.expired(at, now) && self.map.len() <= self.max_entries {
                break;
            }
            self.order.pop_front();
            if live {
                self.map.remove(&key);
                dropped += 1;
            }
        }
        dropped
    }

    /// Rewrites the queue with one record per live key, in recency order.
    fn compact(&mut self) {
        let map = &self.map;
        self.order.retain(|(at, key)| map.get(key).is_some_and(|(stamp, _)| stamp == at));
        // Several touches of one key within the same second leave equal records; keep the last.
        let mut seen = std::collections::HashSet::with_capacity(self.order.len());
        let mut kept: Vec<(u32, u64)> = self.order.iter().rev().filter(|(_, k)| seen.insert(*k)).copied().collect();
        kept.reverse();
        self.order = kept.into();
    }

    /// Live entries (expired ones not yet pruned included).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether the map holds nothing.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Records in the recency queue (for tests of the memory bound).
    pub fn queue_len(&self) -> usize {
        self.order.len()
    }
}

/// The two per-session maps the modes read: sessions seen recently (local continuations) and
/// each session's last decode worker (`kv_home`).
#[derive(Debug)]
pub struct Sessions {
    pub continuations: RecentMap<()>,
    pub kv_home: RecentMap<Arc<str>>,
}

impl Sessions {
    /// Empty maps bounded as `cfg` says.
    pub fn new(cfg: &RoutingConfig, now: Instant) -> Self {
        Self {
            continuations: RecentMap::new(Duration::from_secs(cfg.local_continuation_ttl_secs), cfg.local_continuation_max_sessions, now),
            kv_home: RecentMap::new(Duration::from_secs(cfg.kv_home_ttl_secs), cfg.kv_home_max_sessions, now),
        }
    }

    /// New bounds (a reload).
    pub fn set_limits(&mut self, cfg: &RoutingConfig) {
        self.continuations.set_limits(Duration::from_secs(cfg.local_continuation_ttl_secs), cfg.local_continuation_max_sessions);
        self.kv_home.set_limits(Duration::from_secs(cfg.kv_home_ttl_secs), cfg.kv_home_max_sessions);
    }

    /// Records that `session` was served by `worker` now.
    pub fn served(&mut self, session: u64, worker: &str, now: Instant) {
        self.continuations.touch(session, (), now);
        // Reuse the stored name when the home is unchanged (the common case): no allocation.
        let home = match self.kv_home.get(session, now) {
            Some(w) if &**w == worker => w.clone(),
            _ => Arc::from(worker),
        };
        self.kv_home.touch(session, home, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn entries_expire_ttl_after_their_last_touch() {
        let t0 = Instant::now();
        let mut m = RecentMap::new(secs(10), 100, t0);
        m.touch(1, "w1", t0);
        assert_eq!(m.get(1, t0 + secs(9)), Some(&"w1"));
        assert_eq!(m.get(1, t0 + secs(10)), None);
        m.touch(1, "w2", t0 + secs(8));
        assert_eq!(m.get(1, t0 + secs(17)), Some(&"w2"), "a touch renews the TTL and replaces the value");
        m.touch(2, "w3", t0 + secs(30));
        assert_eq!(m.len(), 1, "the expired key was pruned by a later touch");
    }

    #[test]
    fn beyond_the_cap_the_least_recently_touched_goes_first() {
        let t0 = Instant::now();
        let mut m = RecentMap::new(secs(3600), 3, t0);
        for k in 1..=3 {
            m.touch(k, (), t0 + secs(k));
        }
        m.touch(1, (), t0 + secs(4));
        assert_eq!(m.touch(4, (), t0 + secs(5)), 1);
        let now = t0 + secs(6);
        assert!(m.get(2, now).is_none(), "2 was touched longest ago");
        assert!([1, 3, 4].iter().all(|k| m.get(*k, now).is_some()));
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn the_queue_stays_bounded_under_repeated_touches() {
        let t0 = Instant::now();
        let mut m = RecentMap::new(secs(3600), 10, t0);
        for i in 0..100_000u64 {
            m.touch(i % 5, (), t0 + Duration::from_millis(i));
        }
        assert_eq!(m.len(), 5);
        assert!(m.queue_len() <= 2 * 5 + 1024 + 1, "queue {}", m.queue_len());
        for k in 0..5 {
            assert!(m.get(k, t0 + secs(100)).is_some());
        }
    }

    #[test]
    fn a_shrunk_cap_applies_on_the_next_touch() {
        let t0 = Instant::now();
        let mut m = RecentMap::new(secs(3600), 100, t0);
        for k in 0..50 {
            m.touch(k, (), t0);
        }
        m.set_limits(secs(3600), 10);
        m.touch(99, (), t0 + secs(1));
        assert_eq!(m.len(), 10);
        assert!(m.get(99, t0 + secs(1)).is_some());
    }
}
