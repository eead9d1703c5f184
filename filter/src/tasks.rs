//! Background work of a long-lived root context: the `/v1/fleet` poll that feeds the local
//! fallback, and the `/v1/done` dispatcher. Calls made here belong to the root context, which
//! lives as long as the VM, so Envoy never cancels them with a request.
//!
//! The bookkeeping is [`crate::background`]'s ([`DoneQueue`], [`FleetSchedule`]); this module
//! drives it with host calls through [`Host`]: it starts a poll when one is due (when this root
//! polls: the singleton, or every filter root in `per_worker` mode), stores a valid answer in shared data for
//! every VM of the `vm_id`, and keeps at most `done_max_in_flight` `/v1/done` calls out, each
//! carrying a batch of the reports that waited ([`DoneQueue::next_batch`]).

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use crate::background::{encode_done_batch, parse_fleet_answer, DoneQueue, FleetSchedule, FLEET_KEY, MAX_FLEET_BYTES};
use crate::config::FilterConfig;
use crate::host_api::{Host, HostError};
use crate::metric_ids::MetricIds;
use crate::metrics::{DoneResult, FleetResult, Metric, MetricUpdate};
use crate::request::{done_call, fleet_call};

/// Fleet poller plus done dispatcher.
pub struct BackgroundTasks {
    host: Rc<dyn Host>,
    config: Rc<FilterConfig>,
    metrics: Rc<MetricIds>,
    fleet: FleetSchedule,
    done: Rc<RefCell<DoneQueue>>,
    /// `/v1/done` calls out: token → reports in the batch.
    done_calls: HashMap<u32, u64>,
}

impl BackgroundTasks {
    /// `done` is the queue this root's HTTP contexts fill (a filter root's; the singleton's stays
    /// empty); `polls_fleet` says whether this root polls `/v1/fleet`.
    pub fn new(host: Rc<dyn Host>, config: Rc<FilterConfig>, metrics: Rc<MetricIds>, done: Rc<RefCell<DoneQueue>>, polls_fleet: bool) -> Self {
        let fleet = FleetSchedule::new(if polls_fleet { config.fleet_refresh_ms } else { 0 });
        Self { host, config, metrics, fleet, done, done_calls: HashMap::new() }
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
            let body = if body_size == 0 { Vec::new() } else { self.host.call_response_body(MAX_FLEET_BYTES + 1) };
            self.store_fleet(status, &body);
        } else if let Some(reports) = self.done_calls.remove(&token) {
            if let Ok(mut q) = self.done.try_borrow_mut() {
                q.call_finished();
            }
            let result = match status {
                Some(s) if (200..300).contains(&s) => DoneResult::Sent,
                _ => DoneResult::Failed,
            };
            if result == DoneResult::Failed {
                log::debug!("/v1/done answered {status:?}");
            }
            self.metrics.apply(MetricUpdate::Add(Metric::DoneReports(result), reports));
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
                        self.metrics.apply(MetricUpdate::Add(Metric::FleetRefreshes(FleetResult::Ok), 1));
                        self.metrics.apply(MetricUpdate::Record(Metric::FleetDecodeWorkers, decoders));
                    }
                    Err(status) => {
                        self.metrics.host_call_failed("set_shared_data(fleet)", &status);
                        self.metrics.apply(MetricUpdate::Add(Metric::FleetRefreshes(FleetResult::Failed), 1));
                    }
                }
            }
            Err(e) => {
                log::debug!("fleet poll not stored: {e}");
                self.metrics.apply(MetricUpdate::Add(Metric::FleetRefreshes(FleetResult::Failed), 1));
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
                self.metrics.apply(MetricUpdate::Add(Metric::FleetRefreshes(FleetResult::Failed), 1));
            }
        }
    }

    /// Dispatches queued reports, a batch per call, while [`DoneQueue::next_batch`] has one.
    fn pump_done(&mut self) {
        loop {
            let batch = match self.done.try_borrow_mut() {
                Ok(mut q) => q.next_batch(),
                Err(_) => Vec::new(),
            };
            if batch.is_empty() {
                return;
            }
            let reports = batch.len() as u64;
            let dispatched = encode_done_batch(&batch)
                .ok_or_else(|| HostError("serialising done reports failed".to_owned()))
                .and_then(|json| self.host.dispatch(&done_call(&self.config, json)));
            match dispatched {
                Ok(token) => {
                    self.done_calls.insert(token, reports);
                }
                Err(status) => {
                    if let Ok(mut q) = self.done.try_borrow_mut() {
                        q.call_finished();
                    }
                    self.metrics.host_call_failed("dispatch_http_call(/v1/done)", &status);
                    self.metrics.apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Failed), reports));
                }
            }
        }
    }
}

#[cfg(test)]
#[path = "tests/tasks.rs"]
mod tests;
