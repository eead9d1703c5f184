//! The root role matrix: what a root context does, decided from its `plugin_root_id` and the
//! configured `background` mode, and the state it is configured with.
//!
//! One wasm module, two kinds of roots:
//!
//! | root | `singleton` | `per_worker` |
//! |---|---|---|
//! | [`crate::SERVICE_ROOT_ID`] (bootstrap singleton) | registers the done queue, drains it, polls the fleet, sends `/v1/done` | idle: every filter root does its own background work (a singleton would only poll twice) |
//! | any other (filter root, one per worker thread) | creates HTTP contexts; done reports go to the singleton's shared queue | creates HTTP contexts; polls the fleet and flushes its own bounded done queue on its tick |
//!
//! [`configure_root`] turns the matrix into a [`RootState`] with host calls through [`Host`], so
//! every cell is tested natively against the test double.

use std::cell::RefCell;
use std::rc::Rc;

use crate::background::{DoneQueue, DONE_QUEUE};
use crate::config::{Background as Mode, FilterConfig};
use crate::host_api::Host;
use crate::metric_ids::MetricIds;
use crate::shared::{DoneSink, Shared};
use crate::tasks::BackgroundTasks;

/// What a root context does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootRole {
    /// The singleton service in `singleton` mode: the done queue and the fleet poll.
    Service,
    /// The singleton service in `per_worker` mode: nothing.
    IdleService,
    /// A filter root whose done reports go to the singleton's queue.
    Filter,
    /// A filter root that polls and flushes its own done queue (`per_worker`).
    FilterWithBackground,
}

impl RootRole {
    /// The role of a root with `root_id` under `mode`.
    pub fn of(root_id: &str, mode: Mode) -> Self {
        match (root_id == crate::SERVICE_ROOT_ID, mode) {
            (true, Mode::Singleton) => Self::Service,
            (true, Mode::PerWorker) => Self::IdleService,
            (false, Mode::Singleton) => Self::Filter,
            (false, Mode::PerWorker) => Self::FilterWithBackground,
        }
    }

    /// How the configuration log line names it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Service => "service",
            Self::IdleService => "service (idle: background is per_worker)",
            Self::Filter | Self::FilterWithBackground => "filter",
        }
    }

    /// Whether this root creates HTTP contexts that route (a service root never does).
    pub fn is_filter(self) -> bool {
        matches!(self, Self::Filter | Self::FilterWithBackground)
    }
}

/// A configured root: its role, what it shares with HTTP contexts (filter roots), its background
/// work (when it runs any) and the tick period it asked for.
pub struct RootState {
    pub role: RootRole,
    pub shared: Option<Rc<Shared>>,
    pub tasks: Option<BackgroundTasks>,
    pub tick_ms: Option<u64>,
}

/// Parses the plugin configuration and configures the root; None (logged) when the configuration
/// is refused, so `on_configure` returns false and Envoy rejects it.
pub fn configure_from_bytes(host: Rc<dyn Host>, bytes: Option<&[u8]>, context_id: u32, root_id: &str, vm_id: &str) -> Option<RootState> {
    match FilterConfig::from_bytes(bytes) {
        Ok(config) => Some(configure_root(host, config, context_id, root_id, vm_id)),
        Err(e) => {
            log::error!("kvmesh-filter: refusing plugin configuration: {e}");
            None
        }
    }
}

/// Configures a root of `root_id` in `vm_id` (see the module's matrix). Host failures (queue
/// registration, tick period) are logged and counted; the root still configures.
pub fn configure_root(host: Rc<dyn Host>, config: FilterConfig, context_id: u32, root_id: &str, vm_id: &str) -> RootState {
    let config = Rc::new(config);
    let metrics = Rc::new(MetricIds::define(Rc::clone(&host)));
    let local_done = Rc::new(RefCell::new(DoneQueue::new(config.done_queue_capacity, config.done_max_in_flight)));
    let role = RootRole::of(root_id, config.background);
    let tasks = |shared_queue| {
        BackgroundTasks::new(Rc::clone(&host), Rc::clone(&config), Rc::clone(&metrics), Rc::clone(&local_done), shared_queue)
    };
    let (shared, tasks, tick_ms) = match role {
        RootRole::IdleService => (None, None, None),
        RootRole::Service => {
            let queue = match host.register_shared_queue(DONE_QUEUE) {
                Ok(q) => Some(q),
                Err(status) => {
                    metrics.host_call_failed("register_shared_queue", &status);
                    None
                }
            };
            (None, Some(tasks(queue)), config.tick_period_ms(false))
        }
        RootRole::Filter | RootRole::FilterWithBackground => {
            let (done, tasks, tick) = if role == RootRole::Filter {
                (DoneSink::shared_queue(vm_id), None, None)
            } else {
                (DoneSink::Local(Rc::clone(&local_done)), Some(tasks(None)), config.tick_period_ms(true))
            };
            let shared = Shared::new(Rc::clone(&host), Rc::clone(&config), Rc::clone(&metrics), done);
            (Some(Rc::new(shared)), tasks, tick)
        }
    };
    if let Some(ms) = tick_ms {
        if let Err(status) = host.set_tick_period(ms) {
            log::warn!("set_tick_period failed: {status}");
        }
    }
    log::info!(
        "kvmesh-filter {} configured: ctx={context_id} role={} root_id={root_id} vm_id={vm_id} background={:?} indexer_cluster={} timeout_ms={} tick_ms={tick_ms:?}",
        env!("CARGO_PKG_VERSION"),
        role.as_str(),
        config.background,
        config.indexer_cluster,
        config.indexer_timeout_ms,
    );
    RootState { role, shared, tasks, tick_ms }
}

#[cfg(test)]
#[path = "tests/roles.rs"]
mod tests;
