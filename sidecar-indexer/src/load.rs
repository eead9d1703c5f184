//! The load each worker carries, as the indexer booked it from its own decisions.
//!
//! A routed request books its prompt blocks and uncached prompt tokens on the chosen worker under a
//! [`BookingId`] the indexer issues (never the client's `x-request-id`, which two clients may
//! share); the id rides in the decision and `/v1/done` releases by it. A booking whose `/v1/done`
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
    /// The client's `x-request-id`, for reports from filters that do not echo the booking id.
    pub request_id: Option<String>,
    /// The request's session key, set when its decision is settled: `/v1/done` moves the
    /// session's `kv_home` when another host served.
    pub session: Option<u64>,
}

/// Why loads were released without a report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expired {
    pub timeout: u64,
    pub overflow: u64,
    /// Booked after its request's `/v1/done` already came (released at once).
    pub done_first: u64,
}

/// How long a `/v1/done` that matched no booking waits for its booking, and how many wait. A
/// route call the filter gave up on (timeout, an indexer stopped and resumed) can be answered after
/// the report the filter sent for it: without this, that booking would hold load until `expiry`.
pub const EARLY_DONE_TTL: Duration = Duration::from_secs(60);
pub const EARLY_DONE_MAX: usize = 4096;

/// Booked load per booking and per worker.
#[derive(Debug)]
pub struct LoadTracker {
    bookings: ExpiringMap<BookingId, Booking>,
    /// request id → its live bookings, oldest first (only for legacy `/v1/done` reports).
    by_request: HashMap<String, Vec<BookingId>>,
    per_worker: HashMap<String, WorkerLoad>,
    /// Request ids whose `/v1/done` (without a booking id) matched nothing yet ([`EARLY_DONE_TTL`]).
    early_done: ExpiringMap<String, ()>,
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
            by_request: HashMap::new(),
            per_worker: HashMap::new(),
            early_done: ExpiringMap::new(EARLY_DONE_TTL, EARLY_DONE_MAX),
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
        if let Some(r) = request_id {
            self.by_request.entry(r.to_owned()).or_default().push(id);
        }
        let b = Booking {
            worker: worker.to_owned(),
            blocks,
            prefill_tokens,
            at: now,
            request_id: request_id.map(str::to_owned),
            session: None,
        };
        self.bookings.insert(id, b, now);
        let mut expired = self.expire(now);
        // Almost always empty: no key is built for the lookup then.
        if !self.early_done.is_empty()
            && request_id.is_some_and(|r| self.early_done.remove(&r.to_owned()).is_some())
        {
            self.release(id);
            expired.done_first += 1;
        }
        while let Some((oldest, b)) = self.bookings.pop_over_cap() {
            self.unbook(oldest, &b);
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
        self.unbook(id, &b);
        Some(b)
    }

    /// Takes a booking that left the map off its worker's load and its request id's list.
    fn unbook(&mut self, id: BookingId, b: &Booking) {
        if let Some(w) = self.per_worker.get_mut(&b.worker) {
            w.active_requests = w.active_requests.saturating_sub(1);
            w.active_blocks = w.active_blocks.saturating_sub(b.blocks);
            w.prefill_tokens = w.prefill_tokens.saturating_sub(b.prefill_tokens);
        }
        if let Some(r) = &b.request_id {
            if let Some(ids) = self.by_request.get_mut(r) {
                ids.retain(|i| *i != id);
                if ids.is_empty() {
                    self.by_request.remove(r);
                }
            }
        }
    }

    /// Releases the oldest live booking made for `request_id` (reports without a booking id); when
    /// there is none, the next booking under that id within [`EARLY_DONE_TTL`] is released as it
    /// is made.
    pub fn release_request(&mut self, request_id: &str, now: Instant) -> Option<Booking> {
        match self.by_request.get(request_id).and_then(|ids| ids.first()).copied() {
            Some(id) => self.release(id),
            None => {
                self.early_done.insert(request_id.to_owned(), (), now);
                while self.early_done.pop_over_cap().is_some() {}
                None
            }
        }
    }

    /// Releases every booking at least `expiry` old; never a younger one.
    pub fn expire(&mut self, now: Instant) -> Expired {
        let mut expired = Expired::default();
        while let Some((id, b)) = self.bookings.pop_expired(now) {
            self.unbook(id, &b);
            expired.timeout += 1;
        }
        while self.early_done.pop_expired(now).is_some() {}
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

    /// Entries held for ordering and legacy lookups (bounded by [`Self::len`]; for tests).
    pub fn tracked_entries(&self) -> usize {
        self.bookings.len() + self.by_request.values().map(Vec::len).sum::<usize>()
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
        // Legacy reports by request id release one booking each, oldest first.
        let a = l.book("w0", 1, 0, Some("x"), t0).0;
        l.book("w1", 1, 0, Some("x"), t0);
        assert_eq!(l.release_request("x", t0).map(|b| b.worker), Some("w0".into()));
        assert_eq!(l.release(a), None);
        assert_eq!(l.release_request("x", t0).map(|b| b.worker), Some("w1".into()));
        assert_eq!(l.tracked_entries(), 0);
    }

    #[test]
    fn a_done_report_that_comes_before_its_booking_releases_it_as_it_is_made() {
        // A route call the filter gave up on (the indexer was stopped), answered after SIGCONT,
        // after the filter's report for it.
        let t0 = Instant::now();
        let mut l = LoadTracker::new(secs(600), 10, 7);
        assert_eq!(l.release_request("late", t0), None);
        let (id, expired) = l.book("w0", 4, 100, Some("late"), t0 + secs(1));
        assert_eq!(expired.done_first, 1);
        assert_eq!(l.worker("w0"), WorkerLoad::default(), "released at once");
        assert_eq!(l.release(id), None, "and only once");
        // The report is used up: the next booking under that id is booked.
        let (_, expired) = l.book("w0", 4, 100, Some("late"), t0 + secs(2));
        assert_eq!((expired.done_first, l.worker("w0").active_requests), (0, 1));
        // An early report waits EARLY_DONE_TTL, no longer; other ids are not touched.
        assert_eq!(l.release_request("gone", t0), None);
        let (_, expired) = l.book("w1", 1, 0, Some("other"), t0 + secs(3));
        assert_eq!(expired.done_first, 0);
        let (_, expired) = l.book("w1", 1, 0, Some("gone"), t0 + EARLY_DONE_TTL + secs(1));
        assert_eq!((expired.done_first, l.worker("w1").active_requests), (0, 2));
        // Bounded: at most EARLY_DONE_MAX wait (the oldest forgotten first).
        for i in 0..EARLY_DONE_MAX + 10 {
            l.release_request(&format!("r{i}"), t0 + secs(100));
        }
        assert_eq!(l.early_done.len(), EARLY_DONE_MAX);
        let (_, expired) = l.book("w2", 1, 0, Some("r0"), t0 + secs(101));
        assert_eq!(expired.done_first, 0, "the oldest was forgotten");
        let (_, expired) = l.book("w2", 1, 0, Some("r20"), t0 + secs(101));
        assert_eq!(expired.done_first, 1);
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
        assert_eq!(l.len(), 1);
        assert_eq!(
            l.tracked_entries(),
            2,
            "the live booking and its request-id entry, nothing per released one"
        );
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
        assert_eq!(l.release_request("a", t0), None);
    }
}
