//! What a filter root (one per Envoy worker thread) shares with its HTTP contexts: the
//! configuration, the metric ids, the `/v1/route` circuit breaker, the endpoint ledger, the done
//! sink and the fleet cache.
//!
//! * The **done sink** is where a finished request's report goes: in `singleton` mode the shared
//!   queue the singleton service registered (resolved lazily — the singleton may configure after
//!   this root; a missing queue is warned about once and every report is dropped and counted), in
//!   `per_worker` mode this thread's own bounded queue that the root's tick flushes.
//! * The **fleet cache** holds the last snapshot read from shared data and parses it again only
//!   when its CAS changes (the fallback path runs per request; the snapshot changes once a poll).
//!
//! Everything is single-threaded (one per worker thread) and reached through `RefCell`s; a borrow
//! that would conflict (never expected) degrades to "no breaker", "no reorder" or "no fleet"
//! instead of panicking.

use std::cell::{Cell, RefCell};
use std::rc::Rc;

use kvmesh_core::api::{DoneReport, FleetSnapshot};

use crate::background::{decode_fleet, encode_done, DoneQueue, DONE_QUEUE, FLEET_KEY};
use crate::breaker::{transition_metric, Admit, Breaker, CallHealth};
use crate::config::FilterConfig;
use crate::endpoints::{EndpointHealth, HealthEvent};
use crate::flow::FleetSource;
use crate::host_api::Host;
use crate::metric_ids::MetricIds;
use crate::metrics::{BreakerState, DoneResult, InternalError, Metric, MetricUpdate};

/// Where HTTP contexts put their done reports.
pub enum DoneSink {
    /// The singleton's shared queue in `vm_id`, resolved on first use and again after a failure.
    SharedQueue { vm_id: String, queue: Cell<Option<u32>>, warned: Cell<bool> },
    /// This worker's own bounded queue, flushed by the root's tick.
    Local(Rc<RefCell<DoneQueue>>),
}

impl DoneSink {
    /// The singleton's queue in `vm_id`, not resolved yet.
    pub fn shared_queue(vm_id: &str) -> Self {
        Self::SharedQueue { vm_id: vm_id.to_owned(), queue: Cell::new(None), warned: Cell::new(false) }
    }
}

/// What a filter root shares with its HTTP contexts.
pub struct Shared {
    pub config: Rc<FilterConfig>,
    pub metrics: Rc<MetricIds>,
    host: Rc<dyn Host>,
    fleet_cache: RefCell<Option<(u32, Rc<FleetSnapshot>)>>,
    done: DoneSink,
    /// This worker thread's `/v1/route` circuit breaker.
    breaker: RefCell<Breaker>,
    /// This worker thread's passive health of engine endpoints.
    endpoints: RefCell<EndpointHealth>,
}

impl Shared {
    /// A filter root's state, with a fresh breaker and endpoint ledger from `config`.
    pub fn new(host: Rc<dyn Host>, config: Rc<FilterConfig>, metrics: Rc<MetricIds>, done: DoneSink) -> Self {
        let breaker = RefCell::new(Breaker::new(config.breaker_failures, config.breaker_open_ms));
        let endpoints = RefCell::new(EndpointHealth::new(config.endpoint_failures, config.endpoint_ejection_ms));
        Self { config, metrics, host, fleet_cache: RefCell::new(None), done, breaker, endpoints }
    }

    /// The host this root's contexts call.
    pub fn host(&self) -> &dyn Host {
        self.host.as_ref()
    }

    /// Whether a route call may start now (the breaker's word; a transition is logged and counted).
    pub fn admit_route_call(&self, now_ns: u64) -> Admit {
        let Ok(mut breaker) = self.breaker.try_borrow_mut() else { return Admit::Call };
        let (admit, transition) = breaker.admit(now_ns);
        if let Some(state) = transition {
            self.breaker_moved(state);
        }
        admit
    }

    /// Feeds a route call's outcome to the breaker.
    pub fn record_route_call(&self, health: CallHealth, now_ns: u64) {
        let Ok(mut breaker) = self.breaker.try_borrow_mut() else { return };
        if let Some(state) = breaker.record(health, now_ns) {
            self.breaker_moved(state);
        }
    }

    /// Feeds one upstream attempt's outcome to the endpoint ledger.
    pub fn record_endpoint(&self, endpoint: &str, ok: bool, now_ns: u64) {
        let Ok(mut health) = self.endpoints.try_borrow_mut() else { return };
        if health.record(endpoint, ok, now_ns) == Some(HealthEvent::Ejected) {
            log::warn!(
                "engine endpoint {endpoint} ejected for {} ms after {} consecutive failed attempts: listed last in destinations",
                self.config.endpoint_ejection_ms,
                self.config.endpoint_failures
            );
            self.metrics.apply(MetricUpdate::Add(Metric::EndpointEjections, 1));
        }
    }

    fn breaker_moved(&self, state: BreakerState) {
        match state {
            BreakerState::Open => log::warn!(
                "indexer circuit breaker open: {} consecutive /v1/route calls unanswered; routing locally for {} ms before a probe",
                self.config.breaker_failures,
                self.config.breaker_open_ms
            ),
            BreakerState::HalfOpen => log::info!("indexer circuit breaker half-open: probing /v1/route"),
            BreakerState::Closed => log::info!("indexer circuit breaker closed: the indexer answers again"),
        }
        self.metrics.apply(transition_metric(state));
    }

    /// Hands a report to the background dispatcher, counting a drop when that is impossible.
    pub fn queue_done(&self, report: DoneReport) {
        let accepted = match &self.done {
            DoneSink::Local(queue) => queue.try_borrow_mut().is_ok_and(|mut q| q.offer(report)),
            DoneSink::SharedQueue { vm_id, queue, warned } => {
                let id = queue.get().or_else(|| self.host.resolve_shared_queue(vm_id, DONE_QUEUE).ok().flatten());
                queue.set(id);
                match (id, encode_done(&report)) {
                    (Some(id), Some(bytes)) => match self.host.enqueue_shared_queue(id, &bytes) {
                        Ok(()) => true,
                        Err(status) => {
                            queue.set(None);
                            self.metrics.host_call_failed("enqueue_shared_queue", &status);
                            false
                        }
                    },
                    (None, _) => {
                        if !warned.replace(true) {
                            log::warn!("no `{DONE_QUEUE}` queue in vm_id `{vm_id}`: is the kvmesh singleton service configured? done reports are dropped");
                        }
                        false
                    }
                    (Some(_), None) => false,
                }
            }
        };
        if !accepted {
            self.metrics.apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Dropped), 1));
        }
    }
}

impl FleetSource for Shared {
    fn reorder_endpoints(&self, list: &str) -> (String, usize) {
        match self.endpoints.try_borrow() {
            Ok(health) => health.reorder(list, self.host.now_ns()),
            Err(_) => (list.to_owned(), 0),
        }
    }

    /// The last snapshot in shared data, parsed again only when its CAS changes.
    fn fleet(&self) -> Option<Rc<FleetSnapshot>> {
        let (bytes, cas) = self.host.get_shared_data(FLEET_KEY).ok()?;
        let bytes = bytes?;
        let mut cache = self.fleet_cache.try_borrow_mut().ok()?;
        if let (Some((cached_cas, snapshot)), Some(cas)) = (cache.as_ref(), cas) {
            if *cached_cas == cas {
                return Some(Rc::clone(snapshot));
            }
        }
        match decode_fleet(&bytes) {
            Ok(snapshot) => {
                let snapshot = Rc::new(snapshot);
                *cache = cas.map(|c| (c, Rc::clone(&snapshot)));
                Some(snapshot)
            }
            Err(e) => {
                log::warn!("stored fleet unreadable: {e}");
                self.metrics.apply(MetricUpdate::Add(Metric::InternalErrors(InternalError::BadFleetData), 1));
                None
            }
        }
    }
}

#[cfg(test)]
#[path = "tests/shared.rs"]
mod tests;
