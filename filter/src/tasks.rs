//! Background work of a long-lived root context: the `/v1/fleet` poll that feeds the local
//! fallback, and the `/v1/done` dispatcher. Calls made here belong to the root context, which
//! lives as long as the VM, so Envoy never cancels them with a request.
//!
//! The bookkeeping is [`crate::background`]'s ([`DoneQueue`], [`FleetSchedule`]); this module
//! drives it with host calls through [`Host`]: it starts a poll when one is due (when this root
//! polls: the singleton, or every filter root in `per_worker` mode), stores a valid answer in shared data for
//! every VM of the `vm_id`, and keeps at most `done_max_in_flight` `/v1/done` calls out, each
//! carrying a batch of the reports that waited ([`DoneQueue::next_batch`]).
//!
//! A done report is what releases a request's load at the indexer; one lost keeps that load
//! booked for `load_expiry_secs` (600 s) and steers traffic away from a worker that is idle. So a
//! call that got no answer (timeout, reset), a `5xx`, or that could not be dispatched puts its
//! reports back at the front of the queue ([`DoneQueue::requeue`], counted `retried`): they ride
//! the next batch, after a hold of `breaker_open_ms`, for at most
//! [`crate::background::MAX_DONE_ATTEMPTS`] failed calls (then `failed`). A `4xx` is the indexer
//! refusing the body (an indexer older than batching answers 400 to an array): not retried,
//! `failed`. Inside this thread's `/v1/route` breaker's open window (the indexer does not answer)
//! the flush sends nothing and reports wait in the bounded queue instead of using up their
//! attempts; past it they go, probe or not ([`crate::breaker::Breaker::holds_at`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::background::{
    encode_done_batch, parse_fleet_answer, DoneQueue, FleetSchedule, QueuedDone, FLEET_KEY,
    MAX_FLEET_BYTES,
};
use crate::config::FilterConfig;
use crate::host_api::{Host, HostError};
use crate::metric_ids::MetricIds;
use crate::metrics::{DoneResult, FleetResult, Metric, MetricUpdate};
use crate::request::{done_call, fleet_call};
use crate::shared::Shared;

/// Fleet poller plus done dispatcher.
pub struct BackgroundTasks {
    host: Rc<dyn Host>,
    config: Rc<FilterConfig>,
    metrics: Rc<MetricIds>,
    fleet: FleetSchedule,
    done: Rc<RefCell<DoneQueue>>,
    /// `/v1/done` calls out: token → the batch it carries (kept to re-queue on failure; at most
    /// `done_max_in_flight` × [`kvmesh_core::api::MAX_DONE_BATCH`] reports).
    done_calls: HashMap<u32, Vec<QueuedDone>>,
    /// The filter root whose `/v1/route` breaker gates the done flush (None: the singleton, whose
    /// queue stays empty).
    gate: Option<Rc<Shared>>,
}

impl BackgroundTasks {
    /// `done` is the queue this root's HTTP contexts fill (a filter root's; the singleton's stays
    /// empty); `polls_fleet` says whether this root polls `/v1/fleet`.
    pub fn new(
        host: Rc<dyn Host>,
        config: Rc<FilterConfig>,
        metrics: Rc<MetricIds>,
        done: Rc<RefCell<DoneQueue>>,
        polls_fleet: bool,
    ) -> Self {
        let fleet = FleetSchedule::new(if polls_fleet { config.fleet_refresh_ms } else { 0 });
        Self { host, config, metrics, fleet, done, done_calls: HashMap::new(), gate: None }
    }

    /// Holds the done flush while `shared`'s `/v1/route` breaker says the indexer is down.
    pub fn gated_by(mut self, shared: Rc<Shared>) -> Self {
        self.gate = Some(shared);
        self
    }

    /// Periodic work: poll when due, dispatch.
    pub fn on_tick(&mut self) {
        self.poll_fleet_if_due();
        self.pump_done();
    }

    /// An answer to one of this context's calls (`num_headers == 0`: the call failed without a
    /// response). Tokens of other calls are ignored.
    pub fn on_http_call_response(&mut self, token: u32, num_headers: usize, body_size: usize) {
        let status = if num_headers == 0 { None } else { self.host.call_response_status() };
        if self.fleet.take_answer(token) {
            let body = if body_size == 0 {
                Vec::new()
            } else {
                self.host.call_response_body(MAX_FLEET_BYTES + 1)
            };
            self.store_fleet(status, &body);
        } else if let Some(batch) = self.done_calls.remove(&token) {
            if let Ok(mut q) = self.done.try_borrow_mut() {
                q.call_finished();
            }
            let reports = batch.len() as u64;
            match status {
                Some(s) if (200..300).contains(&s) => self
                    .metrics
                    .apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Sent), reports)),
                None => self.retry_done(batch, "got no answer (timeout or reset)"),
                Some(s) if s >= 500 => self.retry_done(batch, &format!("answered {s}")),
                Some(s) => {
                    log::warn!("/v1/done answered {s}: {reports} done reports refused, not retried (an indexer older than the filter answers 400 to a batch: upgrade the indexer first)");
                    self.metrics
                        .apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Failed), reports));
                }
            }
            self.pump_done();
        }
    }

    fn store_fleet(&mut self, status: Option<u16>, body: &[u8]) {
        match parse_fleet_answer(status, body) {
            Ok(snapshot) => {
                let decoders = snapshot.decode_candidates().count() as u64;
                let stored = serde_json::to_vec(&snapshot)
                    .map_err(|e| HostError(format!("serialising the fleet: {e}")))
                    .and_then(|bytes| self.host.set_shared_data(FLEET_KEY, &bytes));
                match stored {
                    Ok(()) => {
                        self.metrics
                            .apply(MetricUpdate::Add(Metric::FleetRefreshes(FleetResult::Ok), 1));
                        self.metrics
                            .apply(MetricUpdate::Record(Metric::FleetDecodeWorkers, decoders));
                    }
                    Err(status) => {
                        self.metrics.host_call_failed("set_shared_data(fleet)", &status);
                        self.metrics.apply(MetricUpdate::Add(
                            Metric::FleetRefreshes(FleetResult::Failed),
                            1,
                        ));
                    }
                }
            }
            Err(e) => {
                log::debug!("fleet poll not stored: {e}");
                self.metrics
                    .apply(MetricUpdate::Add(Metric::FleetRefreshes(FleetResult::Failed), 1));
            }
        }
    }

    fn poll_fleet_if_due(&mut self) {
        let now = self.host.now_ns();
        if !self.fleet.due(now) {
            return;
        }
        match self.host.dispatch(&fleet_call(&self.config)) {
            Ok(token) => self.fleet.started(now, token),
            Err(status) => {
                self.fleet.failed_to_start(now);
                self.metrics.host_call_failed("dispatch_http_call(/v1/fleet)", &status);
                self.metrics
                    .apply(MetricUpdate::Add(Metric::FleetRefreshes(FleetResult::Failed), 1));
            }
        }
    }

    /// Puts a failed call's reports back at the front of the queue (or gives them up) and counts
    /// them. Sending a report twice is harmless (a call can time out here after the indexer
    /// released its load): a report with a `booking_id` releases that booking, which the indexer
    /// releases at most once; one without (its route answer was lost) releases the oldest live
    /// booking of its request id, which is already gone unless another live request shares it.
    fn retry_done(&mut self, batch: Vec<QueuedDone>, why: &str) {
        let reports = batch.len() as u64;
        let now = self.host.now_ns();
        let hold_ns = self.config.breaker_open_ms.saturating_mul(1_000_000);
        let Ok(requeued) = self.done.try_borrow_mut().map(|mut q| q.requeue(batch, now, hold_ns))
        else {
            self.metrics.apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Failed), reports));
            return;
        };
        log::info!(
            "/v1/done {why}: {} of {reports} done reports re-queued for the next batch in {} ms, {} given up after {} attempts, {} dropped (queue full)",
            requeued.retried,
            self.config.breaker_open_ms,
            requeued.given_up,
            crate::background::MAX_DONE_ATTEMPTS,
            requeued.dropped,
        );
        if requeued.given_up > 0 || requeued.dropped > 0 {
            log::warn!(
                "/v1/done: {} done reports lost (their load stays booked at the indexer until it expires)",
                requeued.given_up + requeued.dropped
            );
        }
        self.metrics
            .apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Retried), requeued.retried));
        self.metrics
            .apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Failed), requeued.given_up));
        self.metrics
            .apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Dropped), requeued.dropped));
    }

    /// Dispatches queued reports, a batch per call, while [`DoneQueue::next_batch`] has one and the
    /// gate's breaker does not hold ([`crate::breaker::Breaker::holds_at`]: inside its open window
    /// the indexer does not answer and the reports wait; past it they go, a failure re-queueing
    /// them, even if no route call came to probe — else a thread that gets no more requests after
    /// a hang would hold its reports, and the indexer their bookings, until they expire).
    fn pump_done(&mut self) {
        if self.gate.as_ref().is_some_and(|shared| shared.indexer_down(self.host.now_ns())) {
            return;
        }
        loop {
            let now = self.host.now_ns();
            let batch = match self.done.try_borrow_mut() {
                Ok(mut q) => q.next_batch(now),
                Err(_) => Vec::new(),
            };
            if batch.is_empty() {
                return;
            }
            let dispatched = encode_done_batch(&batch)
                .ok_or_else(|| HostError("serialising done reports failed".to_owned()))
                .and_then(|json| self.host.dispatch(&done_call(&self.config, json)));
            match dispatched {
                Ok(token) => {
                    self.done_calls.insert(token, batch);
                }
                Err(status) => {
                    if let Ok(mut q) = self.done.try_borrow_mut() {
                        q.call_finished();
                    }
                    self.metrics.host_call_failed("dispatch_http_call(/v1/done)", &status);
                    // The hold it sets ends this loop.
                    self.retry_done(batch, "could not be dispatched");
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "tests/tasks.rs"]
mod tests;
