//! The root role matrix: what a root context does, decided from its `plugin_root_id` and the
//! configured `background` mode, and the state it is configured with.
//!
//! One wasm module, two kinds of roots:
//!
//! | root | `singleton` | `per_worker` |
//! |---|---|---|
//! | [`crate::SERVICE_ROOT_ID`] (bootstrap singleton) | polls the fleet | idle: every filter root does its own background work (a singleton would only poll twice) |
//! | any other (filter root, one per worker thread) | creates HTTP contexts; flushes its own bounded done queue on its tick | creates HTTP contexts; polls the fleet and flushes its own bounded done queue on its tick |
//!
//! Done reports never leave their worker thread: each filter root sends its thread's reports as
//! batched `/v1/done` calls every `done_flush_ms`. (Through the singleton's shared queue every
//! report woke Envoy's main thread and cost it a callout: a quarter of the gateway's CPU per
//! request.)
//!
//! [`configure_root`] turns the matrix into a [`RootState`] with host calls through [`Host`], so
//! every cell is tested natively against the test double.

use std::cell::RefCell;
use std::rc::Rc;

use crate::background::DoneQueue;
use crate::config::{Background as Mode, FilterConfig};
use crate::host_api::Host;
use crate::metric_ids::MetricIds;
use crate::shared::Shared;
use crate::tasks::BackgroundTasks;

/// What a root context does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RootRole {
    /// The singleton service in `singleton` mode: the fleet poll.
    Service,
    /// The singleton service in `per_worker` mode: nothing.
    IdleService,
    /// A filter root that flushes its own done queue (`singleton`: the singleton polls).
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
pub fn configure_from_bytes(
    host: Rc<dyn Host>,
    bytes: Option<&[u8]>,
    context_id: u32,
    root_id: &str,
    vm_id: &str,
) -> Option<RootState> {
    match FilterConfig::from_bytes(bytes) {
        Ok(config) => Some(configure_root(host, config, context_id, root_id, vm_id)),
        Err(e) => {
            log::error!("kvmesh-filter: refusing plugin configuration: {e}");
            None
        }
    }
}

/// Configures a root of `root_id` in `vm_id` (see the module's matrix). A failure to set the tick
/// period is logged; the root still configures.
pub fn configure_root(
    host: Rc<dyn Host>,
    config: FilterConfig,
    context_id: u32,
    root_id: &str,
    vm_id: &str,
) -> RootState {
    let config = Rc::new(config);
    let metrics = Rc::new(MetricIds::define(Rc::clone(&host), config.max_model_labels));
    let local_done = Rc::new(RefCell::new(DoneQueue::new(
        config.done_queue_capacity,
        config.done_max_in_flight,
    )));
    let role = RootRole::of(root_id, config.background);
    let tasks = |polls_fleet| {
        BackgroundTasks::new(
            Rc::clone(&host),
            Rc::clone(&config),
            Rc::clone(&metrics),
            Rc::clone(&local_done),
            polls_fleet,
        )
    };
    let (shared, tasks, tick_ms) = match role {
        RootRole::IdleService => (None, None, None),
        RootRole::Service => (None, Some(tasks(true)), config.tick_period_ms(false)),
        RootRole::Filter | RootRole::FilterWithBackground => {
            let polls = role == RootRole::FilterWithBackground;
            let tick = if polls { config.tick_period_ms(true) } else { Some(config.done_flush_ms) };
            let shared = Shared::new(
                Rc::clone(&host),
                Rc::clone(&config),
                Rc::clone(&metrics),
                Rc::clone(&local_done),
            );
            let shared = Rc::new(shared);
            (Some(Rc::clone(&shared)), Some(tasks(polls).gated_by(shared)), tick)
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
