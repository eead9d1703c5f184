//! Root contexts: configuration, metric definitions, the fleet cache and the done sink shared with
//! HTTP contexts, and (when this root runs them) the background tasks.
//!
//! One wasm module, two kinds of roots, told apart by `plugin_root_id`:
//! * [`crate::SERVICE_ROOT_ID`] — the bootstrap singleton. Registers the done queue, polls the fleet.
//! * anything else — a filter root, one per worker thread. Creates HTTP contexts; in `per_worker`
//!   mode it also polls the fleet and flushes its own done queue on its tick.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::Duration;

use kvmesh_core::api::{DoneReport, FleetSnapshot};
use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, BufferType, ContextType};

use super::background::Background;
use super::http::HttpFilter;
use super::io::{self, MetricIds};
use crate::background::{decode_fleet, encode_done, DoneQueue, DONE_QUEUE, FLEET_KEY};
use crate::config::{Background as Mode, FilterConfig};
use crate::flow::FleetSource;
use crate::breaker::{transition_metric, Admit, Breaker, CallHealth};
use crate::endpoints::{EndpointHealth, HealthEvent};
use crate::metrics::{BreakerState, DoneResult, InternalError, Metric, MetricUpdate};

/// Where HTTP contexts put their done reports.
enum DoneSink {
    /// The singleton's shared queue, resolved lazily (the singleton may configure later).
    SharedQueue { vm_id: String, queue: Cell<Option<u32>>, warned: Cell<bool> },
    /// This worker's own bounded queue, flushed by the root's tick.
    Local(Rc<RefCell<DoneQueue>>),
}

/// What a filter root shares with its HTTP contexts.
pub struct Shared {
    pub config: Rc<FilterConfig>,
    pub metrics: Rc<MetricIds>,
    fleet_cache: RefCell<Option<(u32, Rc<FleetSnapshot>)>>,
    done: DoneSink,
    /// This worker thread's `/v1/route` circuit breaker.
    breaker: RefCell<Breaker>,
    /// This worker thread's passive health of engine endpoints.
    endpoints: RefCell<EndpointHealth>,
}

impl Shared {
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
                let id = queue.get().or_else(|| hostcalls::resolve_shared_queue(vm_id, DONE_QUEUE).ok().flatten());
                queue.set(id);
                match (id, encode_done(&report)) {
                    (Some(id), Some(bytes)) => match hostcalls::enqueue_shared_queue(id, Some(&bytes)) {
                        Ok(()) => true,
                        Err(status) => {
                            queue.set(None);
                            self.metrics.host_call_failed("enqueue_shared_queue", status);
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
            Ok(health) => health.reorder(list, io::now_ns()),
            Err(_) => (list.to_owned(), 0),
        }
    }

    /// The last snapshot in shared data, parsed again only when its CAS changes.
    fn fleet(&self) -> Option<Rc<FleetSnapshot>> {
        let (bytes, cas) = hostcalls::get_shared_data(FLEET_KEY).ok()?;
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

/// A root context of either kind.
pub struct Root {
    context_id: u32,
    shared: Option<Rc<Shared>>,
    background: Option<Background>,
}

impl Root {
    pub fn new(context_id: u32) -> Self {
        Self { context_id, shared: None, background: None }
    }

    fn configure(&mut self, config: FilterConfig) -> bool {
        let root_id = io::property_string("plugin_root_id").unwrap_or_default();
        let vm_id = io::property_string("plugin_vm_id").unwrap_or_default();
        let config = Rc::new(config);
        let metrics = Rc::new(MetricIds::define());
        let local_done = Rc::new(RefCell::new(DoneQueue::new(config.done_queue_capacity, config.done_max_in_flight)));
        let is_service = root_id == crate::SERVICE_ROOT_ID;
        let (tick, role) = if is_service && config.background == Mode::PerWorker {
            // Every filter root does its own background work; a singleton would only poll twice.
            (None, "service (idle: background is per_worker)")
        } else if is_service {
            let queue = match hostcalls::register_shared_queue(DONE_QUEUE) {
                Ok(q) => Some(q),
                Err(status) => {
                    metrics.host_call_failed("register_shared_queue", status);
                    None
                }
            };
            self.background = Some(Background::new(Rc::clone(&config), Rc::clone(&metrics), Rc::clone(&local_done), queue));
            (config.tick_period_ms(false), "service")
        } else {
            let done = match config.background {
                Mode::Singleton => DoneSink::SharedQueue { vm_id: vm_id.clone(), queue: Cell::new(None), warned: Cell::new(false) },
                Mode::PerWorker => {
                    self.background = Some(Background::new(Rc::clone(&config), Rc::clone(&metrics), Rc::clone(&local_done), None));
                    DoneSink::Local(Rc::clone(&local_done))
                }
            };
            let breaker = RefCell::new(Breaker::new(config.breaker_failures, config.breaker_open_ms));
            let endpoints = RefCell::new(EndpointHealth::new(config.endpoint_failures, config.endpoint_ejection_ms));
            self.shared =
                Some(Rc::new(Shared { config: Rc::clone(&config), metrics, fleet_cache: RefCell::new(None), done, breaker, endpoints }));
            let tick = (config.background == Mode::PerWorker).then(|| config.tick_period_ms(true)).flatten();
            (tick, "filter")
        };
        if let Some(ms) = tick {
            if let Err(status) = hostcalls::set_tick_period(Duration::from_millis(ms)) {
                log::warn!("set_tick_period failed: {status:?}");
            }
        }
        log::info!(
            "kvmesh-filter {} configured: ctx={} role={role} root_id={root_id} vm_id={vm_id} background={:?} indexer_cluster={} timeout_ms={} tick_ms={tick:?}",
            env!("CARGO_PKG_VERSION"),
            self.context_id,
            config.background,
            config.indexer_cluster,
            config.indexer_timeout_ms,
        );
        true
    }
}

impl Context for Root {
    fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize, _num_trailers: usize) {
        if let Some(bg) = self.background.as_mut() {
            bg.on_http_call_response(token_id, num_headers, body_size);
        }
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _vm_configuration_size: usize) -> bool {
        true
    }

    fn on_configure(&mut self, plugin_configuration_size: usize) -> bool {
        let bytes = if plugin_configuration_size == 0 {
            None
        } else {
            hostcalls::get_buffer(BufferType::PluginConfiguration, 0, plugin_configuration_size).ok().flatten()
        };
        match FilterConfig::from_bytes(bytes.as_deref()) {
            Ok(config) => self.configure(config),
            Err(e) => {
                log::error!("kvmesh-filter: refusing plugin configuration: {e}");
                false
            }
        }
    }

    fn on_tick(&mut self) {
        if let Some(bg) = self.background.as_mut() {
            bg.on_tick();
        }
    }

    fn on_queue_ready(&mut self, _queue_id: u32) {
        if let Some(bg) = self.background.as_mut() {
            bg.on_queue_ready();
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        // The SDK panics on None; an unconfigured root (never expected) gets a pass-through context.
        Some(match &self.shared {
            Some(shared) => Box::new(HttpFilter::new(context_id, Rc::clone(shared))),
            None => Box::new(PassThrough),
        })
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

/// Does nothing: every callback continues.
struct PassThrough;

impl Context for PassThrough {}

impl HttpContext for PassThrough {
    fn on_http_request_headers(&mut self, _num_headers: usize, _end_of_stream: bool) -> Action {
        Action::Continue
    }
}
