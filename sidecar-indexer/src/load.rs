//! The load each worker carries, as the indexer booked it from its own decisions.
//!
//! The pure ledger: `crate::route::bookings` is its one caller that books and releases. A routed
//! request books its prompt blocks and uncached prompt tokens on the chosen worker under a
//! [`BookingId`] the indexer issues (never the client's `x-request-id`, which two clients may
//! share); the id rides in the decision and `/v1/done` releases by it, and only by it. A booking whose `/v1/done`
//! never comes (filter crash, lost report) is released after `expiry`, and at most `max_bookings`
//! are tracked (the oldest is released first beyond it), so the tracker is bounded in time and
//! memory. The bookings are the shared [`ExpiringMap`] (booking id → booking, oldest first): a
//! released booking leaves a stale queue record that is skipped, never acted on, so an expiry pass
//! cannot release a young booking behind a released old one.
//!
//! Wire ids carry a per-process nonce, so a report for a booking made before a restart matches
//! nothing instead of releasing an unrelated new booking. The clock is passed in (`now`), so
//! expiry is tested without sleeping.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvmesh_core::api::WorkerLoad;

use crate::expiring::ExpiringMap;

/// A booking, as the tracker knows it. Issued in increasing order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct BookingId(u64);

/// One routed request's booked load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booking {
    pub worker: String,
    pub blocks: u64,
    pub prefill_tokens: u64,
    pub at: Instant,
    /// The client's `x-request-id`, for log lines only (never a key: clients may reuse it).
    pub request_id: Option<String>,
    /// The request's session key, set when its decision is settled: `/v1/done` moves the
    /// session's `kv_home` when another host served.
    pub session: Option<u64>,
    /// What the decision predicted for the request's cache, set when it is settled: `/v1/done`
    /// attributes the hit with it (`crate::route::attribution`).
    pub predicted: Option<Box<crate::route::attribution::Predicted>>,
}

/// Why loads were released without a report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expired {
    pub timeout: u64,
    pub overflow: u64,
}

/// Booked load per booking and per worker.
#[derive(Debug)]
pub struct LoadTracker {
    bookings: ExpiringMap<BookingId, Booking>,
    per_worker: HashMap<String, WorkerLoad>,
    next: u64,
    nonce: u32,
}

const WIRE_PREFIX: &str = "kvb-";

impl LoadTracker {
    /// A tracker releasing unreported loads after `expiry`, tracking at most `max_bookings`;
    /// `nonce` (random per process) makes its wire ids differ from any earlier process's.
    pub fn new(expiry: Duration, max_bookings: usize, nonce: u32) -> Self {
        Self {
            bookings: ExpiringMap::new(expiry, max_bookings),
            per_worker: HashMap::new(),
            next: 0,
            nonce,
        }
    }

    /// New bounds (a reload).
    pub fn set_limits(&mut self, expiry: Duration, max_bookings: usize) {
        self.bookings.set_limits(expiry, max_bookings);
    }

    /// Books `blocks` and `prefill_tokens` on `worker`; a new id every call. Bookings must be made
    /// in time order (`now` never earlier than a previous call's), which `Instant::now()` gives.
    pub fn book(
        &mut self,
        worker: &str,
        blocks: u64,
        prefill_tokens: u64,
        request_id: Option<&str>,
        now: Instant,
    ) -> (BookingId, Expired) {
        self.next += 1;
        let id = BookingId(self.next);
        let w = self.per_worker.entry(worker.to_owned()).or_default();
        w.active_requests += 1;
        w.active_blocks += blocks;
        w.prefill_tokens += prefill_tokens;
        let b = Booking {
            worker: worker.to_owned(),
            blocks,
            prefill_tokens,
            at: now,
            request_id: request_id.map(str::to_owned),
            session: None,
            predicted: None,
        };
        self.bookings.insert(id, b, now);
        let mut expired = self.expire(now);
        while let Some((_, b)) = self.bookings.pop_over_cap() {
            self.unbook(&b);
            expired.overflow += 1;
        }
        (id, expired)
    }

    /// Tags a live booking with its request's session; false when the booking is gone.
    pub fn set_session(&mut self, id: BookingId, session: u64) -> bool {
        let Some(b) = self.bookings.peek_mut(&id) else { return false };
        b.session = Some(session);
        true
    }

    /// Keeps a live booking's prediction; false when the booking is gone.
    pub fn set_predicted(
        &mut self,
        id: BookingId,
        predicted: crate::route::attribution::Predicted,
    ) -> bool {
        let Some(b) = self.bookings.peek_mut(&id) else { return false };
        b.predicted = Some(Box::new(predicted));
        true
    }

    /// Changes the prefill tokens of a live booking (its worker now prefills locally); false when
    /// the booking is gone.
    pub fn set_prefill_tokens(&mut self, id: BookingId, prefill_tokens: u64) -> bool {
        let Some(b) = self.bookings.peek_mut(&id) else { return false };
        if let Some(w) = self.per_worker.get_mut(&b.worker) {
            w.prefill_tokens = w.prefill_tokens.saturating_sub(b.prefill_tokens) + prefill_tokens;
        }
        b.prefill_tokens = prefill_tokens;
        true
    }

    /// Releases `id`; the booking when it was live.
    pub fn release(&mut self, id: BookingId) -> Option<Booking> {
        let b = self.bookings.remove(&id)?;
        self.unbook(&b);
        Some(b)
    }

    /// Takes a booking that left the map off its worker's load.
    fn unbook(&mut self, b: &Booking) {
        if let Some(w) = self.per_worker.get_mut(&b.worker) {
            w.active_requests = w.active_requests.saturating_sub(1);
            w.active_blocks = w.active_blocks.saturating_sub(b.blocks);
            w.prefill_tokens = w.prefill_tokens.saturating_sub(b.prefill_tokens);
        }
    }

    /// Releases every booking at least `expiry` old; never a younger one.
    pub fn expire(&mut self, now: Instant) -> Expired {
        let mut expired = Expired::default();
        while let Some((_, b)) = self.bookings.pop_expired(now) {
            self.unbook(&b);
            expired.timeout += 1;
        }
        expired
    }

    /// The id as the decision carries it: `kvb-<nonce>-<serial>` in hex.
    pub fn wire_id(&self, id: BookingId) -> String {
        format!("{WIRE_PREFIX}{:08x}-{:x}", self.nonce, id.0)
    }

    /// The booking a wire id names, if this process issued it.
    pub fn parse_wire_id(&self, s: &str) -> Option<BookingId> {
        let (nonce, serial) = s.strip_prefix(WIRE_PREFIX)?.split_once('-')?;
        if u32::from_str_radix(nonce, 16).ok()? != self.nonce {
            return None;
        }
        u64::from_str_radix(serial, 16).ok().map(BookingId)
    }

    /// The booked load of `worker`.
    pub fn worker(&self, worker: &str) -> WorkerLoad {
        self.per_worker.get(worker).copied().unwrap_or_default()
    }

    /// Drops every booking on `worker` (it left the fleet).
    pub fn remove_worker(&mut self, worker: &str) {
        let gone: Vec<BookingId> =
            self.bookings.iter().filter(|(_, b)| b.worker == worker).map(|(id, _)| *id).collect();
        for id in gone {
            self.release(id);
        }
        self.per_worker.remove(worker);
    }

    /// Bookings currently live.
    pub fn len(&self) -> usize {
        self.bookings.len()
    }

    /// Whether nothing is booked.
    pub fn is_empty(&self) -> bool {
        self.bookings.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn book_release_and_adjust() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(60), 100, 7);
        let (r1, _) = l.book("w0", 10, 100, Some("r1"), t0);
        let (r2, _) = l.book("w0", 5, 50, None, t0);
        l.book("w1", 1, 0, None, t0);
        assert_eq!(
            l.worker("w0"),
            WorkerLoad {
                active_requests: 2,
                active_blocks: 15,
                prefill_tokens: 150,
                waiting_requests: 0
            }
        );
        assert_eq!(l.release(r1).map(|b| b.blocks), Some(10));
        assert_eq!(l.release(r1), None, "released exactly once");
        assert_eq!(l.worker("w0").active_blocks, 5);
        assert!(l.set_prefill_tokens(r2, 80));
        assert_eq!(l.worker("w0").prefill_tokens, 80);
        assert!(!l.set_prefill_tokens(r1, 1));
    }

    #[test]
    fn one_request_id_books_and_releases_separately() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(60), 100, 7);
        let ids: Vec<BookingId> = (0..10)
            .map(|i| l.book(if i % 2 == 0 { "w0" } else { "w1" }, 1, 0, Some("same"), t0).0)
            .collect();
        assert_eq!(l.len(), 10);
        for id in &ids {
            assert!(l.release(*id).is_some());
        }
        assert!(l.is_empty());
        assert_eq!((l.worker("w0").active_requests, l.worker("w1").active_requests), (0, 0));
    }

    #[test]
    fn expiry_never_releases_a_young_booking() {
        // The issue's case: book A, release A, book B at t+599 s, expire at t+600 s → B still booked.
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(600), 100, 7);
        let (a, _) = l.book("w0", 3, 0, Some("a"), t0);
        l.release(a);
        let (b, _) = l.book("w0", 4, 0, Some("b"), t0 + secs(599));
        assert_eq!(l.expire(t0 + secs(600)), Expired::default());
        assert_eq!(l.worker("w0").active_blocks, 4);
        assert_eq!(l.expire(t0 + secs(1199)), Expired { timeout: 1, ..Expired::default() });
        assert_eq!(l.release(b), None);
        assert!(l.is_empty());
    }

    #[test]
    fn unreported_bookings_expire_oldest_first() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(10), 100, 7);
        l.book("w0", 3, 0, None, t0);
        let (new, _) = l.book("w0", 4, 0, None, t0 + secs(5));
        assert_eq!(l.expire(t0 + secs(9)), Expired::default());
        assert_eq!(l.expire(t0 + secs(10)), Expired { timeout: 1, ..Expired::default() });
        assert_eq!(l.worker("w0").active_blocks, 4);
        l.release(new);
        assert_eq!(
            l.expire(t0 + secs(100)),
            Expired::default(),
            "a released booking is not expired again"
        );
    }

    #[test]
    fn a_million_cycles_keep_memory_at_the_live_set() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(600), 1_000_000, 7);
        let (held, _) = l.book("w0", 1, 0, Some("held"), t0);
        for i in 0..1_000_000u64 {
            let (id, expired) = l.book("w1", 2, 16, Some("r"), t0 + Duration::from_micros(i));
            assert_eq!(expired, Expired::default());
            assert!(l.release(id).is_some());
        }
        assert_eq!(l.len(), 1, "the live booking, nothing per released one");
        assert!(l.bookings.queue_len() <= 2 + 1024 + 1, "stale queue records are compacted away");
        assert_eq!(l.worker("w1"), WorkerLoad::default());
        assert!(l.release(held).is_some());
    }

    #[test]
    fn the_oldest_goes_beyond_the_bound() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(600), 2, 7);
        let (a, _) = l.book("w0", 1, 0, None, t0);
        l.book("w0", 1, 0, None, t0);
        assert_eq!(l.book("w0", 1, 0, None, t0).1.overflow, 1);
        assert_eq!(l.len(), 2);
        assert!(l.release(a).is_none());
    }

    #[test]
    fn wire_ids_round_trip_only_in_their_process() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(600), 10, 0xdead_beef);
        let (id, _) = l.book("w0", 1, 0, None, t0);
        let wire = l.wire_id(id);
        assert_eq!(wire, "kvb-deadbeef-1");
        assert_eq!(l.parse_wire_id(&wire), Some(id));
        let other = LoadTracker::new(secs(600), 10, 1);
        assert_eq!(other.parse_wire_id(&wire), None, "a restarted indexer ignores old ids");
        for bad in ["", "kvb-", "kvb-deadbeef", "kvb-deadbeef-zz", "x-deadbeef-1"] {
            assert_eq!(l.parse_wire_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn removed_workers_lose_their_bookings() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(600), 10, 7);
        l.book("w0", 1, 0, Some("a"), t0);
        l.book("w1", 1, 0, None, t0);
        l.remove_worker("w0");
        assert_eq!(l.len(), 1);
        assert_eq!(l.worker("w0"), WorkerLoad::default());
    }
}
