//! Work that outlives a request: `/v1/done` reports and the `/v1/fleet` poll.
//!
//! Envoy cancels an HTTP call when the context that made it is destroyed, and a request's context is
//! destroyed right when the request ends — exactly when its done report is due. So requests only
//! *queue* reports; a long-lived root context (each worker thread's filter root)
//! dispatches them. Both pieces here are pure bookkeeping with explicit bounds: [`DoneQueue`] caps
//! waiting reports and concurrent calls (overflow is dropped and counted, never grows memory),
//! batches the reports that wait while a call is out (one `/v1/done` per batch: in Envoy an HTTP
//! call costs about as much CPU as the proxied request itself) and takes a failed call's reports
//! back at its front, up to [`MAX_DONE_ATTEMPTS`] calls each (a lost report would leave its load
//! booked at the indexer until `load_expiry_secs`); [`FleetSchedule`] keeps at most one poll in
//! flight, due every `fleet_refresh_ms`.

use std::collections::VecDeque;

use kvmesh_core::api::{DoneReport, FleetSnapshot, MAX_DONE_BATCH};

/// Shared-data key of the last fleet snapshot (JSON), written by whoever polls, read by every VM
/// with the same `vm_id`.
pub const FLEET_KEY: &str = "kvmesh.fleet.v1";
/// Largest `/v1/fleet` answer accepted.
pub const MAX_FLEET_BYTES: usize = 1024 * 1024;

/// How many failed calls a report rides before it is given up (counted `failed`): a report the
/// indexer keeps refusing with a 5xx, or that never gets an answer while the breaker stays
/// closed, must not loop forever. Inside the `/v1/route` breaker's open window nothing is sent,
/// so a hung indexer seen by route calls does not use up attempts (see [`crate::tasks`]).
pub const MAX_DONE_ATTEMPTS: u8 = 3;

/// A report waiting for dispatch, with the number of calls that carried it and failed.
#[derive(Debug, Clone, PartialEq)]
pub struct QueuedDone {
    pub report: DoneReport,
    pub failed_attempts: u8,
}

/// What [`DoneQueue::requeue`] did with a failed call's reports (counts of reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Requeued {
    /// Back at the front of the queue, sent again with the next batch.
    pub retried: u64,
    /// Given up after [`MAX_DONE_ATTEMPTS`] failed calls.
    pub given_up: u64,
    /// Pushed out because the queue was over `capacity` (the oldest go).
    pub dropped: u64,
}

/// Bounded done reports awaiting dispatch, plus the count of calls in flight and the retry hold.
#[derive(Debug)]
pub struct DoneQueue {
    pending: VecDeque<QueuedDone>,
    capacity: usize,
    in_flight: usize,
    max_in_flight: usize,
    /// No call starts before this (set by a failed call: retries do not hammer the indexer).
    hold_until_ns: u64,
}

impl DoneQueue {
    /// A queue holding at most `capacity` reports with at most `max_in_flight` calls outstanding.
    pub fn new(capacity: usize, max_in_flight: usize) -> Self {
        Self {
            pending: VecDeque::new(),
            capacity: capacity.max(1),
            in_flight: 0,
            max_in_flight: max_in_flight.max(1),
            hold_until_ns: 0,
        }
    }

    /// Queues a report; false when full (the caller counts the drop).
    pub fn offer(&mut self, report: DoneReport) -> bool {
        if self.pending.len() >= self.capacity {
            return false;
        }
        self.pending.push_back(QueuedDone { report, failed_attempts: 0 });
        true
    }

    /// The next batch to send as one call at `now_ns` (oldest first, at most [`MAX_DONE_BATCH`]);
    /// the call's slot is taken. A call starts when none is out — a lone report goes at once — or,
    /// with up to `max_in_flight` out, when a full batch waits; otherwise reports gather until an
    /// answer. Nothing starts while a failed call's hold lasts ([`Self::requeue`]).
    /// Empty: nothing to send now.
    pub fn next_batch(&mut self, now_ns: u64) -> Vec<QueuedDone> {
        let full = self.pending.len() >= MAX_DONE_BATCH;
        if self.pending.is_empty()
            || now_ns < self.hold_until_ns
            || self.in_flight >= self.max_in_flight
            || (self.in_flight > 0 && !full)
        {
            return Vec::new();
        }
        self.in_flight += 1;
        self.pending.drain(..self.pending.len().min(MAX_DONE_BATCH)).collect()
    }

    /// A call carrying `batch` failed at `now_ns` in a way worth retrying (no answer, a 5xx, or it
    /// could not be dispatched); its slot must be freed with [`Self::call_finished`] as for any
    /// call. Each report's attempt is counted: those at [`MAX_DONE_ATTEMPTS`] are given up, the
    /// rest go back to the FRONT of the queue in their order (they are the oldest), so they ride
    /// the next batch. The bound holds: when that puts the queue over `capacity`, the oldest
    /// reports are dropped. No call starts for `hold_ns` after the failure.
    pub fn requeue(&mut self, batch: Vec<QueuedDone>, now_ns: u64, hold_ns: u64) -> Requeued {
        let mut out = Requeued::default();
        for mut queued in batch.into_iter().rev() {
            queued.failed_attempts = queued.failed_attempts.saturating_add(1);
            if queued.failed_attempts >= MAX_DONE_ATTEMPTS {
                out.given_up += 1;
            } else {
                self.pending.push_front(queued);
                out.retried += 1;
            }
        }
        while self.pending.len() > self.capacity && self.pending.pop_front().is_some() {
            out.dropped += 1;
        }
        out.retried = out.retried.saturating_sub(out.dropped);
        self.hold_until_ns = self.hold_until_ns.max(now_ns.saturating_add(hold_ns));
        out
    }

    /// A dispatched call finished (answered or failed) or could not be dispatched: frees its slot.
    pub fn call_finished(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// Reports waiting.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Calls outstanding.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }
}

/// When to poll `/v1/fleet`: once per period, never two at once.
#[derive(Debug, Clone)]
pub struct FleetSchedule {
    period_ns: u64,
    last_start_ns: Option<u64>,
    in_flight: Option<u32>,
}

impl FleetSchedule {
    /// `period_ms == 0` disables polling.
    pub fn new(period_ms: u64) -> Self {
        Self {
            period_ns: period_ms.saturating_mul(1_000_000),
            last_start_ns: None,
            in_flight: None,
        }
    }

    /// Whether a poll should start at `now_ns` (the first one is due at once).
    pub fn due(&self, now_ns: u64) -> bool {
        self.period_ns > 0
            && self.in_flight.is_none()
            && self.last_start_ns.is_none_or(|last| now_ns.saturating_sub(last) >= self.period_ns)
    }

    /// A poll started at `now_ns` as call `token`.
    pub fn started(&mut self, now_ns: u64, token: u32) {
        self.last_start_ns = Some(now_ns);
        self.in_flight = Some(token);
    }

    /// A poll could not be dispatched at `now_ns`; retry after a period.
    pub fn failed_to_start(&mut self, now_ns: u64) {
        self.last_start_ns = Some(now_ns);
    }

    /// Whether `token` is the poll in flight; if so it is no longer in flight.
    pub fn take_answer(&mut self, token: u32) -> bool {
        if self.in_flight == Some(token) {
            self.in_flight = None;
            true
        } else {
            false
        }
    }
}

/// Why a fleet answer was not stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FleetError {
    #[error("fleet call failed without a response")]
    NoResponse,
    #[error("fleet call answered status {0}")]
    Status(u16),
    #[error("fleet answer too large ({0} bytes)")]
    TooLarge(usize),
    #[error("fleet answer is not a fleet snapshot: {0}")]
    Invalid(String),
}

/// Validates a `/v1/fleet` answer.
pub fn parse_fleet_answer(status: Option<u16>, body: &[u8]) -> Result<FleetSnapshot, FleetError> {
    match status {
        None => Err(FleetError::NoResponse),
        Some(200) if body.len() > MAX_FLEET_BYTES => Err(FleetError::TooLarge(body.len())),
        Some(200) => decode_fleet(body),
        Some(s) => Err(FleetError::Status(s)),
    }
}

/// Reads a snapshot as stored in shared data (or as answered by the indexer).
pub fn decode_fleet(bytes: &[u8]) -> Result<FleetSnapshot, FleetError> {
    serde_json::from_slice(bytes).map_err(|e| FleetError::Invalid(e.to_string()))
}

/// Encodes a batch as the `/v1/done` body ([`kvmesh_core::api::parse_done_body`]): a lone report
/// as the bare object every indexer version takes, more as a JSON array. So during a rollout that
/// upgrades the filter before the indexer, an older indexer (which answers 400 to an array) still
/// gets every report that went alone — all of them at low load — and the rest are counted as
/// `failed` (a 4xx is not retried).
pub fn encode_done_batch(batch: &[QueuedDone]) -> Option<Vec<u8>> {
    match batch {
        [one] => serde_json::to_vec(&one.report).ok(),
        many => serde_json::to_vec(&many.iter().map(|q| &q.report).collect::<Vec<_>>()).ok(),
    }
}

#[cfg(test)]
#[path = "tests/background.rs"]
mod tests;
