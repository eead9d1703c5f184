//! The load each worker carries, as the indexer booked it from its own decisions.
//!
//! A routed request books its prompt blocks and uncached prompt tokens on the chosen worker;
//! `/v1/done` releases them. A request whose `/v1/done` never comes (filter crash, lost report)
//! is released after `expiry`, and at most `max_bookings` requests are tracked (the oldest is
//! released first beyond it), so the tracker is bounded in time and memory. The clock is passed
//! in (`now`), so expiry is tested without sleeping.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use kvmesh_core::api::WorkerLoad;

/// One routed request's booked load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Booking {
    pub worker: String,
    pub blocks: u64,
    pub prefill_tokens: u64,
    pub at: Instant,
    /// Distinguishes re-bookings of one request id in the expiry queue.
    serial: u64,
}

/// Why loads were released without a report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Expired {
    pub timeout: u64,
    pub overflow: u64,
}

/// Booked load per request and per worker.
#[derive(Debug)]
pub struct LoadTracker {
    bookings: HashMap<String, Booking>,
    queue: VecDeque<(Instant, u64, String)>,
    per_worker: HashMap<String, WorkerLoad>,
    expiry: Duration,
    max_bookings: usize,
    serial: u64,
}

impl LoadTracker {
    /// A tracker releasing unreported loads after `expiry`, tracking at most `max_bookings`.
    pub fn new(expiry: Duration, max_bookings: usize) -> Self {
        Self {
            bookings: HashMap::new(),
            queue: VecDeque::new(),
            per_worker: HashMap::new(),
            expiry,
            max_bookings: max_bookings.max(1),
            serial: 0,
        }
    }

    /// New bounds (a reload).
    pub fn set_limits(&mut self, expiry: Duration, max_bookings: usize) {
        self.expiry = expiry;
        self.max_bookings = max_bookings.max(1);
    }

    /// Books `request_id` on `worker` (replacing an earlier booking of the same id).
    pub fn book(&mut self, request_id: &str, worker: &str, blocks: u64, prefill_tokens: u64, now: Instant) -> Expired {
        self.release(request_id);
        self.serial += 1;
        let b = Booking { worker: worker.to_owned(), blocks, prefill_tokens, at: now, serial: self.serial };
        let w = self.per_worker.entry(worker.to_owned()).or_default();
        w.active_requests += 1;
        w.active_blocks += blocks;
        w.prefill_tokens += prefill_tokens;
        self.bookings.insert(request_id.to_owned(), b);
        self.queue.push_back((now, self.serial, request_id.to_owned()));
        let mut expired = self.expire(now);
        while self.bookings.len() > self.max_bookings {
            if !self.pop_oldest() {
                break;
            }
            expired.overflow += 1;
        }
        expired
    }

    /// Releases `request_id`; the booking when there was one.
    pub fn release(&mut self, request_id: &str) -> Option<Booking> {
        let b = self.bookings.remove(request_id)?;
        if let Some(w) = self.per_worker.get_mut(&b.worker) {
            w.active_requests = w.active_requests.saturating_sub(1);
            w.active_blocks = w.active_blocks.saturating_sub(b.blocks);
            w.prefill_tokens = w.prefill_tokens.saturating_sub(b.prefill_tokens);
        }
        Some(b)
    }

    /// Releases every booking older than the expiry.
    pub fn expire(&mut self, now: Instant) -> Expired {
        let mut expired = Expired::default();
        while let Some((at, _, _)) = self.queue.front() {
            if now.saturating_duration_since(*at) < self.expiry {
                break;
            }
            if self.pop_oldest() {
                expired.timeout += 1;
            }
        }
        expired
    }

    /// Pops the queue head; true when it released a live booking (not a stale queue entry).
    fn pop_oldest(&mut self) -> bool {
        while let Some((_, serial, id)) = self.queue.pop_front() {
            if self.bookings.get(&id).is_some_and(|b| b.serial == serial) {
                self.release(&id);
                return true;
            }
        }
        false
    }

    /// The booked load of `worker`.
    pub fn worker(&self, worker: &str) -> WorkerLoad {
        self.per_worker.get(worker).copied().unwrap_or_default()
    }

    /// Drops every booking on `worker` (it left the fleet).
    pub fn remove_worker(&mut self, worker: &str) {
        self.bookings.retain(|_, b| b.worker != worker);
        self.per_worker.remove(worker);
    }

    /// Requests currently booked.
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

    #[test]
    fn book_release_and_rebook() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(Duration::from_secs(60), 100);
        l.book("r1", "w0", 10, 100, t0);
        l.book("r2", "w0", 5, 50, t0);
        l.book("r3", "w1", 1, 0, t0);
        assert_eq!(l.worker("w0"), WorkerLoad { active_requests: 2, active_blocks: 15, prefill_tokens: 150, waiting_requests: 0 });
        assert_eq!(l.release("r1").map(|b| b.blocks), Some(10));
        assert_eq!(l.release("r1"), None);
        assert_eq!(l.worker("w0").active_blocks, 5);
        // Re-booking an id moves it.
        l.book("r2", "w1", 7, 0, t0);
        assert_eq!(l.worker("w0"), WorkerLoad::default());
        assert_eq!(l.worker("w1").active_blocks, 8);
    }

    #[test]
    fn unreported_requests_expire() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(Duration::from_secs(10), 100);
        l.book("old", "w0", 3, 0, t0);
        l.book("new", "w0", 4, 0, t0 + Duration::from_secs(5));
        assert_eq!(l.expire(t0 + Duration::from_secs(9)), Expired::default());
        assert_eq!(l.expire(t0 + Duration::from_secs(10)), Expired { timeout: 1, overflow: 0 });
        assert_eq!(l.worker("w0").active_blocks, 4);
        // A booking released by /v1/done leaves a stale queue entry that must not count.
        l.release("new");
        assert_eq!(l.expire(t0 + Duration::from_secs(100)), Expired::default());
        assert!(l.is_empty());
    }

    #[test]
    fn the_oldest_goes_beyond_the_bound() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(Duration::from_secs(600), 2);
        l.book("a", "w0", 1, 0, t0);
        l.book("b", "w0", 1, 0, t0);
        assert_eq!(l.book("c", "w0", 1, 0, t0).overflow, 1);
        assert_eq!(l.len(), 2);
        assert!(l.release("a").is_none());
    }

    #[test]
    fn removed_workers_lose_their_bookings() {
        let t0 = Instant::now();
        let mut l = LoadTracker::new(Duration::from_secs(600), 10);
        l.book("a", "w0", 1, 0, t0);
        l.book("b", "w1", 1, 0, t0);
        l.remove_worker("w0");
        assert_eq!(l.len(), 1);
        assert_eq!(l.worker("w0"), WorkerLoad::default());
    }
}
