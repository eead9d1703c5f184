//! The per-VM budget of request bodies the filter holds in wasm memory (`held_body_budget_bytes`).
//!
//! To ask the indexer the filter copies the client's body into its VM and keeps it there until the
//! answer comes (a splice needs it). A VM's linear memory grows to the most it ever held at once
//! and never shrinks, and it lies outside Envoy's heap, so the overload manager's heap budget
//! does not see it: without a bound, a flood of large bodies paused on one worker thread grows
//! that thread's VM by their sum. Each request reserves its body's size here before the body is
//! read; a body that does not fit is not read at all and the request is routed without the
//! indexer (routing is an optimisation). The reservation is a guard: dropping it — the answer, a
//! timeout, a local reply, a stream reset or the context's destruction — gives the bytes back, so
//! no path can leak budget or release it twice.
//!
//! Single-threaded (one budget per VM, shared by its HTTP contexts through `Rc`).

use std::cell::Cell;
use std::rc::Rc;

/// Refusals logged: the first, then one in this many (the counter says how many there were).
pub const LOG_EVERY: u64 = 64;

/// The bytes of request bodies held in one VM, bounded by `limit`.
#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    held: Cell<usize>,
    refusals: Cell<u64>,
}

/// Bytes reserved for one body; given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Rc<BodyBudget>,
    bytes: usize,
}

/// A body that does not fit: what was held when it was refused, and which refusal it is (1-based).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refused {
    pub wanted: usize,
    pub held: usize,
    pub limit: usize,
    pub nth: u64,
}

impl Refused {
    /// Whether this refusal gets a log line ([`LOG_EVERY`]): a flood must not flood the log.
    pub fn logged(&self) -> bool {
        self.nth % LOG_EVERY == 1
    }
}

impl BodyBudget {
    /// A budget of `limit` bytes, nothing held.
    pub fn new(limit: usize) -> Rc<Self> {
        Rc::new(Self { limit, held: Cell::new(0), refusals: Cell::new(0) })
    }

    /// Reserves `bytes` if they fit beside what is held, else counts a refusal.
    pub fn reserve(self: &Rc<Self>, bytes: usize) -> Result<Reservation, Refused> {
        let held = self.held.get();
        match held.checked_add(bytes).filter(|&total| total <= self.limit) {
            Some(total) => {
                self.held.set(total);
                Ok(Reservation { budget: Rc::clone(self), bytes })
            }
            None => {
                let nth = self.refusals.get().saturating_add(1);
                self.refusals.set(nth);
                Err(Refused { wanted: bytes, held, limit: self.limit, nth })
            }
        }
    }

    /// Bytes reserved now.
    pub fn held(&self) -> usize {
        self.held.get()
    }

    /// The bound.
    pub fn limit(&self) -> usize {
        self.limit
    }
}

impl Reservation {
    /// The bytes this reservation holds.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        // Saturating: a reservation only gives back what it took, but never below zero either way.
        let held = self.budget.held.get();
        self.budget.held.set(held.saturating_sub(self.bytes));
    }
}

#[cfg(test)]
#[path = "tests/body_budget.rs"]
mod tests;
