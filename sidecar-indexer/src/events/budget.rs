//! Byte bounds on KV event ingestion: the limits every listener reads, and the byte budget of the
//! queue between the listeners and the applier.
//!
//! The applier channel is bounded in messages (`routing.event_queue_batches`), but one message can
//! be a few bytes or many megabytes, so a count alone does not bound memory. Each listener acquires
//! the decoded size of a batch from the shared [`ByteBudget`] before queueing it and the applier
//! releases it when the message is dropped (after applying it: the [`QueuePermit`] rides in the
//! message and releases on `Drop`, so a message lost in any way — applier gone, channel closed —
//! still returns its bytes). A batch larger than the whole budget is admitted alone (when nothing
//! else is queued) so one big batch can never deadlock the stream; frames are bounded anyway by
//! `routing.event_max_frame_bytes`. Limits are atomics so a reload changes them for running
//! listeners (the ZMQ-level `ZMQ_MAXMSGSIZE` is set when a socket opens).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// The byte limits of event ingestion, shared by every listener and changed on reload.
#[derive(Debug)]
pub struct EventLimits {
    /// Largest payload frame of a live or replayed batch (`routing.event_max_frame_bytes`).
    pub max_frame_bytes: AtomicUsize,
    /// Most raw bytes one replay may hold before it is applied (`routing.replay_max_bytes`).
    pub replay_max_bytes: AtomicUsize,
    /// Decoded batches queued for the applier, in bytes (`routing.event_queue_bytes`).
    pub queue: ByteBudget,
}

impl EventLimits {
    /// Limits with the given bounds.
    pub fn new(max_frame_bytes: usize, replay_max_bytes: usize, queue_bytes: usize) -> Self {
        Self {
            max_frame_bytes: AtomicUsize::new(max_frame_bytes),
            replay_max_bytes: AtomicUsize::new(replay_max_bytes),
            queue: ByteBudget::new(queue_bytes),
        }
    }

    /// Applies new bounds (a reload).
    pub fn set(&self, max_frame_bytes: usize, replay_max_bytes: usize, queue_bytes: usize) {
        self.max_frame_bytes.store(max_frame_bytes, Ordering::Relaxed);
        self.replay_max_bytes.store(replay_max_bytes, Ordering::Relaxed);
        self.queue.set_limit(queue_bytes);
    }

    /// The current frame limit.
    pub fn max_frame(&self) -> usize {
        self.max_frame_bytes.load(Ordering::Relaxed)
    }

    /// The current replay limit.
    pub fn replay_max(&self) -> usize {
        self.replay_max_bytes.load(Ordering::Relaxed)
    }
}

/// A counting semaphore over bytes.
#[derive(Debug)]
pub struct ByteBudget {
    limit: AtomicUsize,
    used: Mutex<usize>,
    freed: Condvar,
    waiting: AtomicUsize,
}

/// How an [`ByteBudget::acquire`] went.
#[derive(Debug)]
pub enum Acquired {
    /// Granted at once.
    Now(QueuePermit),
    /// Granted after waiting for the applier to release bytes (the budget was full).
    AfterWait(QueuePermit),
    /// `stop` turned true while waiting.
    Stopped,
}

/// Bytes held in the budget; released on drop.
#[derive(Debug)]
pub struct QueuePermit {
    budget: Option<Arc<EventLimits>>,
    bytes: usize,
}

impl QueuePermit {
    /// A permit holding nothing (messages sent outside any budget).
    pub fn none() -> Self {
        Self { budget: None, bytes: 0 }
    }

    /// The bytes it holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for QueuePermit {
    fn drop(&mut self) {
        if let Some(l) = self.budget.take() {
            l.queue.release(self.bytes);
        }
    }
}

/// How long one wait lasts before the stop flag is checked again.
const WAIT_SLICE: Duration = Duration::from_millis(100);

impl ByteBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            limit: AtomicUsize::new(limit),
            used: Mutex::new(0),
            freed: Condvar::new(),
            waiting: AtomicUsize::new(0),
        }
    }

    /// Changes the limit; waiters re-check at once.
    pub fn set_limit(&self, limit: usize) {
        self.limit.store(limit, Ordering::Relaxed);
        self.freed.notify_all();
    }

    /// The limit in bytes.
    pub fn limit(&self) -> usize {
        self.limit.load(Ordering::Relaxed)
    }

    /// Bytes currently held.
    pub fn used(&self) -> usize {
        *self.used.lock()
    }

    /// Listeners waiting for bytes right now.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// Whether `bytes` more fit while `used` are held (a request larger than the limit fits alone).
    fn fits(&self, used: usize, bytes: usize) -> bool {
        used == 0 || used.saturating_add(bytes) <= self.limit()
    }

    fn release(&self, bytes: usize) {
        let mut used = self.used.lock();
        *used = used.saturating_sub(bytes);
        drop(used);
        self.freed.notify_all();
    }
}

/// Takes `bytes` from `limits.queue`, waiting while it is full, until granted or `stop` is set.
pub fn acquire(limits: &Arc<EventLimits>, bytes: usize, stop: &AtomicBool) -> Acquired {
    let budget = &limits.queue;
    let mut used = budget.used.lock();
    let waited = !budget.fits(*used, bytes);
    if waited {
        budget.waiting.fetch_add(1, Ordering::Relaxed);
        while !budget.fits(*used, bytes) {
            if stop.load(Ordering::Relaxed) {
                budget.waiting.fetch_sub(1, Ordering::Relaxed);
                return Acquired::Stopped;
            }
            budget.freed.wait_for(&mut used, WAIT_SLICE);
        }
        budget.waiting.fetch_sub(1, Ordering::Relaxed);
    }
    *used += bytes;
    let permit = QueuePermit { budget: Some(limits.clone()), bytes };
    if waited {
        Acquired::AfterWait(permit)
    } else {
        Acquired::Now(permit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn granted(a: Acquired) -> QueuePermit {
        match a {
            Acquired::Now(p) | Acquired::AfterWait(p) => p,
            Acquired::Stopped => panic!("stopped"),
        }
    }

    #[test]
    fn permits_hold_bytes_until_dropped() {
        let l = Arc::new(EventLimits::new(10, 10, 100));
        let stop = AtomicBool::new(false);
        let a = granted(acquire(&l, 60, &stop));
        let b = granted(acquire(&l, 40, &stop));
        assert_eq!(l.queue.used(), 100);
        drop(a);
        assert_eq!(l.queue.used(), 40);
        drop(b);
        assert_eq!(l.queue.used(), 0);
        assert_eq!(QueuePermit::none().bytes(), 0);
    }

    #[test]
    fn a_full_budget_waits_for_a_release_and_says_so() {
        let l = Arc::new(EventLimits::new(10, 10, 100));
        let stop = Arc::new(AtomicBool::new(false));
        let held = granted(acquire(&l, 90, &stop));
        let (l2, stop2) = (l.clone(), stop.clone());
        let waiter =
            std::thread::spawn(move || matches!(acquire(&l2, 20, &stop2), Acquired::AfterWait(_)));
        // The waiter cannot finish while 90 of 100 bytes are held; releasing lets it through.
        while l.queue.waiting() == 0 {
            std::thread::yield_now();
        }
        drop(held);
        assert!(waiter.join().unwrap());
        assert_eq!(l.queue.used(), 0, "the waiter's permit was dropped with its thread's result");
    }

    #[test]
    fn an_oversized_request_is_admitted_alone() {
        let l = Arc::new(EventLimits::new(10, 10, 100));
        let stop = AtomicBool::new(false);
        let big = granted(acquire(&l, 500, &stop));
        assert_eq!(big.bytes(), 500);
        stop.store(true, Ordering::Relaxed);
        // Something else must wait for it; with stop set the wait ends.
        assert!(matches!(acquire(&l, 1, &stop), Acquired::Stopped));
        drop(big);
        assert!(matches!(acquire(&l, 1, &stop), Acquired::Now(_)));
    }

    #[test]
    fn a_reload_changes_the_limits() {
        let l = Arc::new(EventLimits::new(10, 20, 100));
        l.set(11, 21, 5);
        assert_eq!((l.max_frame(), l.replay_max(), l.queue.limit()), (11, 21, 5));
    }
}
