//! The filter-side circuit breaker on `/v1/route`: a hung indexer must not add its deadline to
//! every request.
//!
//! A SIGSTOPped or wedged indexer accepts connections and never answers, so each request waits the
//! full `indexer_timeout_ms` before the fallback (12 s in the disaggregated fleet). After
//! `breaker_failures` consecutive calls that got no answer from the indexer (timeout, reset,
//! connection failure, dispatch failure) the breaker opens: for `breaker_open_ms` requests skip the
//! call and go straight to the local fallback. Then one request is let through as a probe
//! (half-open); its answer closes the breaker, its failure opens it again. A probe whose request
//! vanished (the context died with the call) stops blocking others after another open window.
//!
//! One breaker per filter root (per Envoy worker thread): no cross-thread state, each thread
//! learns on its own within `breaker_failures` calls. Pure: the clock is passed in.

use crate::metrics::{BreakerState, Metric, MetricUpdate};

/// What to do with the next route call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Closed: call the indexer.
    Call,
    /// Half-open: this call is the probe.
    Probe,
    /// Open: do not call; route without the indexer.
    Skip,
}

/// How a route call ended, as far as the indexer's liveness goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallHealth {
    /// The indexer answered (a decision, a refusal, an error body: it is alive).
    Answered,
    /// No answer from the indexer (timeout, reset, connect failure, dispatch failure).
    Failed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Closed { failures: u32 },
    Open { until_ns: u64 },
    HalfOpen { probe_started_ns: u64 },
}

/// A consecutive-failure breaker with a fixed open window and a single half-open probe.
#[derive(Debug, Clone)]
pub struct Breaker {
    threshold: u32,
    open_ns: u64,
    state: State,
}

impl Breaker {
    /// Opens after `threshold` consecutive failures (0 = never) for `open_ms`.
    pub fn new(threshold: u32, open_ms: u64) -> Self {
        Self {
            threshold,
            open_ns: open_ms.saturating_mul(1_000_000),
            state: State::Closed { failures: 0 },
        }
    }

    /// Whether a route call may start at `now_ns`; a probe slot is taken when one is granted.
    pub fn admit(&mut self, now_ns: u64) -> (Admit, Option<BreakerState>) {
        match self.state {
            State::Closed { .. } => (Admit::Call, None),
            State::Open { until_ns } if now_ns < until_ns => (Admit::Skip, None),
            State::Open { .. } => {
                self.state = State::HalfOpen { probe_started_ns: now_ns };
                (Admit::Probe, Some(BreakerState::HalfOpen))
            }
            // A probe outstanding longer than a window was cancelled with its request: probe again.
            State::HalfOpen { probe_started_ns }
                if now_ns.saturating_sub(probe_started_ns) >= self.open_ns =>
            {
                self.state = State::HalfOpen { probe_started_ns: now_ns };
                (Admit::Probe, None)
            }
            State::HalfOpen { .. } => (Admit::Skip, None),
        }
    }

    /// Records how a call ended; returns the state entered when it changed.
    pub fn record(&mut self, health: CallHealth, now_ns: u64) -> Option<BreakerState> {
        match (self.state, health) {
            (State::Closed { failures }, CallHealth::Failed) => {
                let failures = failures.saturating_add(1);
                if self.threshold > 0 && failures >= self.threshold {
                    self.state = State::Open { until_ns: now_ns.saturating_add(self.open_ns) };
                    Some(BreakerState::Open)
                } else {
                    self.state = State::Closed { failures };
                    None
                }
            }
            (State::Closed { .. }, CallHealth::Answered) => {
                self.state = State::Closed { failures: 0 };
                None
            }
            (State::HalfOpen { .. }, CallHealth::Answered) => {
                self.state = State::Closed { failures: 0 };
                Some(BreakerState::Closed)
            }
            (State::HalfOpen { .. }, CallHealth::Failed) => {
                self.state = State::Open { until_ns: now_ns.saturating_add(self.open_ns) };
                Some(BreakerState::Open)
            }
            // Calls admitted before the breaker opened finish while it is open: an answer is news
            // worth acting on, a failure changes nothing.
            (State::Open { .. }, CallHealth::Answered) => {
                self.state = State::Closed { failures: 0 };
                Some(BreakerState::Closed)
            }
            (State::Open { .. }, CallHealth::Failed) => None,
        }
    }

    /// Whether calls are being skipped (open, or half-open with the probe out).
    pub fn is_open(&self) -> bool {
        !matches!(self.state, State::Closed { .. })
    }

    /// Whether other calls to the indexer should wait at `now_ns`: inside the open window, or while
    /// a half-open probe is out and not yet stale. Unlike [`Self::is_open`] this ends with the
    /// window even when no route call comes to move the state: a worker thread that gets no more
    /// requests must not hold its done reports forever.
    pub fn holds_at(&self, now_ns: u64) -> bool {
        match self.state {
            State::Closed { .. } => false,
            State::Open { until_ns } => now_ns < until_ns,
            State::HalfOpen { probe_started_ns } => {
                now_ns.saturating_sub(probe_started_ns) < self.open_ns
            }
        }
    }
}

/// The metric of a transition into `state`.
pub fn transition_metric(state: BreakerState) -> MetricUpdate {
    MetricUpdate::Add(Metric::BreakerTransitions(state), 1)
}

#[cfg(test)]
#[path = "tests/breaker.rs"]
mod tests;
