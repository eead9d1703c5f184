//! What a filter root (one per Envoy worker thread) shares with its HTTP contexts: the
//! configuration, the metric ids, the `/v1/route` circuit breaker, the endpoint ledger, the done
//! sink and the fleet cache.
//!
//! * The **done queue** is where a finished request's report goes: this thread's own bounded
//!   queue, which the root's tick flushes as batched `/v1/done` calls (in both background modes:
//!   a report never wakes another thread).
//! * The **placement memory** is where the indexer last placed each session, process-wide in
//!   shared data, for the local fallback ([`crate::placement`]).
//! * The **fleet cache** holds the last snapshot read from shared data and parses it again only
//!   when its CAS changes (the fallback path runs per request; the snapshot changes once a poll).
//!
//! Everything is single-threaded (one per worker thread) and reached through `RefCell`s; a borrow
//! that would conflict (never expected) degrades to "no breaker", "no reorder" or "no fleet"
//! instead of panicking.

use std::cell::RefCell;
use std::rc::Rc;

use kvmesh_core::api::{DoneReport, FleetSnapshot};
use kvmesh_core::body_base::BodyBase;
use kvmesh_core::session::SessionKey;

use crate::background::{decode_fleet, DoneQueue, FLEET_KEY};
use crate::body_bases;
use crate::body_budget::BodyBudget;
use crate::breaker::{transition_metric, Admit, Breaker, CallHealth};
use crate::config::FilterConfig;
use crate::endpoints::{EndpointHealth, HealthEvent};
use crate::flow::FleetSource;
use crate::host_api::Host;
use crate::metric_ids::MetricIds;
use crate::metrics::{BreakerState, DoneResult, InternalError, Metric, MetricUpdate};
use crate::placement;

/// What a filter root shares with its HTTP contexts.
pub struct Shared {
    pub config: Rc<FilterConfig>,
    pub metrics: Rc<MetricIds>,
    host: Rc<dyn Host>,
    fleet_cache: RefCell<Option<(u32, Rc<FleetSnapshot>)>>,
    /// This worker's bounded done queue, flushed by the root's tick.
    done: Rc<RefCell<DoneQueue>>,
    /// This worker thread's `/v1/route` circuit breaker.
    breaker: RefCell<Breaker>,
    /// This worker thread's passive health of engine endpoints.
    endpoints: RefCell<EndpointHealth>,
    /// This VM's budget of request bodies held while their route calls are out.
    pub body_budget: Rc<BodyBudget>,
}

impl Shared {
    /// A filter root's state, with a fresh breaker and endpoint ledger from `config`.
    pub fn new(
        host: Rc<dyn Host>,
        config: Rc<FilterConfig>,
        metrics: Rc<MetricIds>,
        done: Rc<RefCell<DoneQueue>>,
    ) -> Self {
        let breaker = RefCell::new(Breaker::new(config.breaker_failures, config.breaker_open_ms));
        let endpoints = RefCell::new(EndpointHealth::new(
            config.endpoint_failures,
            config.endpoint_ejection_ms,
        ));
        let body_budget = BodyBudget::new(config.held_body_budget_bytes);
        Self {
            config,
            metrics,
            host,
            fleet_cache: RefCell::new(None),
            done,
            breaker,
            endpoints,
            body_budget,
        }
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

    /// Whether the breaker says the indexer is down at `now_ns` (inside its open window, or
    /// half-open with a fresh probe out): the done flush then holds its reports (`crate::tasks`).
    pub fn indexer_down(&self, now_ns: u64) -> bool {
        self.breaker.try_borrow().is_ok_and(|b| b.holds_at(now_ns))
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

    /// Records that the indexer placed session `key` on `worker`, in its slot of the process-wide
    /// table in shared data ([`crate::placement`]); a failed write is counted, never retried.
    pub fn remember_placement(&self, key: SessionKey, worker: &str) {
        let Some(value) = placement::encode(key, worker) else { return };
        if let Err(e) = self
            .host
            .set_shared_data(&placement::slot_key(key, self.config.placement_memory_slots), &value)
        {
            self.metrics.host_call_failed("set_shared_data(placement)", &e);
        }
    }

    /// Updates session `key`'s body bases in its slot of the process-wide table in shared data
    /// ([`crate::body_bases`]). Read, changed, written without a CAS: a concurrent update of the
    /// same slot may be lost, which costs a whole body on a later call, never a wrong one. A failed
    /// write is counted, never retried.
    pub fn remember_body_base(
        &self,
        key: SessionKey,
        new: Option<body_bases::Remembered>,
        used: Option<BodyBase>,
    ) {
        let slot = body_bases::slot_key(key, self.config.body_base_slots);
        let bases = body_bases::remember(self.body_bases(key), new, used);
        if let Err(e) = self.host.set_shared_data(&slot, &body_bases::encode(key, &bases)) {
            self.metrics.host_call_failed("set_shared_data(body base)", &e);
        }
    }

    /// Hands a report to the root's done queue, counting a drop when it is full.
    pub fn queue_done(&self, report: DoneReport) {
        if !self.done.try_borrow_mut().is_ok_and(|mut q| q.offer(report)) {
            self.metrics.apply(MetricUpdate::Add(Metric::DoneReports(DoneResult::Dropped), 1));
        }
    }
}

impl FleetSource for Shared {
    fn body_bases(&self, key: SessionKey) -> Vec<body_bases::Remembered> {
        let Ok((Some(value), _)) =
            self.host.get_shared_data(&body_bases::slot_key(key, self.config.body_base_slots))
        else {
            return Vec::new();
        };
        body_bases::decode(&value, key)
    }

    fn placed(&self, key: SessionKey) -> Option<String> {
        let (value, _) = self
            .host
            .get_shared_data(&placement::slot_key(key, self.config.placement_memory_slots))
            .ok()?;
        placement::decode(&value?, key).map(str::to_owned)
    }

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
                self.metrics.apply(MetricUpdate::Add(
                    Metric::InternalErrors(InternalError::BadFleetData),
                    1,
                ));
                None
            }
        }
    }
}

#[cfg(test)]
#[path = "tests/shared.rs"]
mod tests;
