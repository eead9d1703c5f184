//! Bounded "seen recently" maps keyed by session: the local-continuation set and each session's
//! last decode worker (`kv_home`).
//!
//! Both are hit on every routed request with a session key, so they must stay O(1) and bounded in
//! time and memory: an entry lives `ttl` after its last touch, and beyond `max_entries` the entry
//! touched longest ago goes first. Both are the shared [`ExpiringMap`] keyed by the session hash
//! (its recency queue and compaction are described there).
//!
//! Memory per live entry: the map slot (key 8 B + value + 8 B stamp, plus hashbrown's control byte
//! and load-factor slack) and one or two queue records of 16 B. For the continuation set (value
//! `()`) that is about 40–70 B per session; 4M sessions ≈ 160–280 MB. The clock is passed in.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::RoutingConfig;
use crate::expiring::ExpiringMap;

/// A bounded, TTL-limited map from session key to `V`.
#[derive(Debug)]
pub struct RecentMap<V> {
    inner: ExpiringMap<u64, V>,
}

impl<V> RecentMap<V> {
    /// A map whose entries expire `ttl` after their last touch, holding at most `max_entries`.
    /// (`_now`: the map's clock starts at its first touch.)
    pub fn new(ttl: Duration, max_entries: usize, _now: Instant) -> Self {
        Self { inner: ExpiringMap::new(ttl, max_entries) }
    }

    /// New bounds (a reload); entries beyond them go on the next touch.
    pub fn set_limits(&mut self, ttl: Duration, max_entries: usize) {
        self.inner.set_limits(ttl, max_entries);
    }

    /// The live value of `key`, if it was touched within the TTL.
    pub fn get(&self, key: u64, now: Instant) -> Option<&V> {
        self.inner.get(&key, now)
    }

    /// Records `key → value` as touched now; returns how many entries the bounds pushed out.
    pub fn touch(&mut self, key: u64, value: V, now: Instant) -> u64 {
        self.inner.insert(key, value, now);
        self.prune(now)
    }

    /// Drops expired entries and, beyond `max_entries`, the least recently touched; returns how many.
    pub fn prune(&mut self, now: Instant) -> u64 {
        self.inner.prune(now).len() as u64
    }

    /// Live entries (expired ones not yet pruned included).
    pub fn len(&self) -> usize {
        self.inner.len()
    }

    /// Whether the map holds nothing.
    pub fn is_empty(&self) -> bool {
        self.inner.is_empty()
    }

    /// Records in the recency queue (for tests of the memory bound).
    pub fn queue_len(&self) -> usize {
        self.inner.queue_len()
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
            continuations: RecentMap::new(
                Duration::from_secs(cfg.local_continuation_ttl_secs),
                cfg.local_continuation_max_sessions,
                now,
            ),
            kv_home: RecentMap::new(
                Duration::from_secs(cfg.kv_home_ttl_secs),
                cfg.kv_home_max_sessions,
                now,
            ),
        }
    }

    /// New bounds (a reload).
    pub fn set_limits(&mut self, cfg: &RoutingConfig) {
        self.continuations.set_limits(
            Duration::from_secs(cfg.local_continuation_ttl_secs),
            cfg.local_continuation_max_sessions,
        );
        self.kv_home
            .set_limits(Duration::from_secs(cfg.kv_home_ttl_secs), cfg.kv_home_max_sessions);
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

    /// `session`'s request, booked on `booked`, was served by `served` (Envoy retried to another
    /// host): its KV is there now. Moves the home unless it no longer is `booked` (expired, or a
    /// later turn was placed elsewhere); returns whether it moved.
    pub fn served_elsewhere(
        &mut self,
        session: u64,
        booked: &str,
        served: &str,
        now: Instant,
    ) -> bool {
        if booked == served || self.kv_home.get(session, now).is_none_or(|h| &**h != booked) {
            return false;
        }
        self.kv_home.touch(session, Arc::from(served), now);
        true
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
        assert_eq!(
            m.get(1, t0 + secs(17)),
            Some(&"w2"),
            "a touch renews the TTL and replaces the value"
        );
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

    #[test]
    fn a_retry_to_another_host_moves_the_home_only_from_the_booked_worker() {
        let t0 = Instant::now();
        let cfg = RoutingConfig::default();
        let ttl = secs(cfg.kv_home_ttl_secs);
        // (home before, booked, served, when) → (moved, home after)
        let table = [
            (Some("w0"), "w0", "w1", secs(1), true, Some("w1")),
            (Some("w0"), "w0", "w0", secs(1), false, Some("w0")),
            (Some("w2"), "w0", "w1", secs(1), false, Some("w2")),
            (None, "w0", "w1", secs(1), false, None),
            (Some("w0"), "w0", "w1", ttl + secs(1), false, None),
        ];
        for (before, booked, served, at, moved, after) in table {
            let mut s = Sessions::new(&cfg, t0);
            if let Some(h) = before {
                s.served(7, h, t0);
            }
            let now = t0 + at;
            assert_eq!(
                s.served_elsewhere(7, booked, served, now),
                moved,
                "{before:?} {booked} {served} {at:?}"
            );
            assert_eq!(
                s.kv_home.get(7, now).map(|w| &**w),
                after,
                "{before:?} {booked} {served} {at:?}"
            );
            assert_eq!(s.kv_home.get(8, now), None, "other sessions untouched");
        }
    }
}
