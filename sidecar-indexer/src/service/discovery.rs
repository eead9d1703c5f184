//! The discovery shell: runs `kvmesh-discovery`'s watcher for a running [`Service`] and applies its
//! membership updates through [`crate::discovered::merge`] and the service's one reload path.
//!
//! - **Order.** File reloads ([`reload_file`]) and membership updates ([`apply_update`]) both
//!   recompute the effective config from [`DiscoveryLink`]'s state and reload while holding its
//!   async lock, so they apply in the order they happened: a slow reload is never overtaken by a
//!   merge computed from older state. (`Service::reload` called directly bypasses the merge.)
//! - **Traffic.** The unroutable discovered ids are published before the reload, so a worker the
//!   reload creates starts unroutable when it must, and applied to existing workers right after.
//!   Only `WorkerRuntime::routable` changes: index, event subscription and booked load stay.
//! - **Failure.** No Kubernetes client (not in a cluster, no kubeconfig) or a watcher that cannot
//!   start is logged at ERROR and counted; the indexer keeps serving its static workers. A watch
//!   that ends keeps the last discovered fleet: discovery going quiet is never taken for every
//!   worker leaving. The watcher's own problems (a failed list or watch, an InferencePool missing
//!   or unreadable: `kvmesh_discovery::Problem`) are counted under their names. Nothing here panics.

use std::collections::BTreeSet;
use std::sync::Arc;

use kvmesh_discovery::{DiscoveryConfig, DiscoveryError, MembershipUpdate};
use parking_lot::RwLock;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::discovered::{change_kind, merge, DiscoveredFleet, LeftOut, Merged, LEFT_OUT_STATIC_ID};
use crate::service::{Service, ServiceError};
use crate::state::AppState;

/// What a [`Service`] keeps for discovery: the file's config (without discovered workers), the
/// discovered fleet, and the ids that must get no traffic.
pub struct DiscoveryLink {
    /// Held across the reload it leads to (see the module docs).
    state: tokio::sync::Mutex<LinkState>,
    /// Read (synchronously) when a worker runtime is created.
    unroutable: RwLock<BTreeSet<String>>,
}

struct LinkState {
    file: Config,
    fleet: DiscoveredFleet,
    /// Last reported, so a persistent conflict is logged once, not on every update.
    left_out: BTreeSet<LeftOut>,
}

impl DiscoveryLink {
    /// A link for a service started from `file` (nothing discovered yet).
    pub fn new(file: &Config) -> Self {
        Self {
            state: tokio::sync::Mutex::new(LinkState {
                file: file.clone(),
                fleet: DiscoveredFleet::default(),
                left_out: BTreeSet::new(),
            }),
            unroutable: RwLock::new(BTreeSet::new()),
        }
    }

    /// Whether the worker `id` may get traffic as far as discovery is concerned (static: always).
    pub fn routable(&self, id: &str) -> bool {
        !self.unroutable.read().contains(id)
    }
}

/// Applies a new fleet file: merged with the discovered workers, then reloaded. A failed reload
/// keeps the previous file. Returns whether anything changed.
pub async fn reload_file(svc: &Arc<Service>, file: Config) -> Result<bool, ServiceError> {
    let mut st = svc.discovery.state.lock().await;
    if file.discovery != st.file.discovery {
        tracing::warn!("[discovery] changed in the config file: it takes effect on restart");
    }
    let previous = std::mem::replace(&mut st.file, file);
    let merged = merge(&st.file, &st.fleet);
    *svc.discovery.unroutable.write() = merged.unroutable.clone();
    match svc.reload(merged.config.clone()).await {
        Ok(changed) => {
            let flipped = set_routability(&svc.state, &merged.unroutable);
            report(svc, &mut st, &merged);
            Ok(changed || flipped > 0)
        }
        Err(e) => {
            st.file = previous;
            let merged = merge(&st.file, &st.fleet);
            *svc.discovery.unroutable.write() = merged.unroutable.clone();
            set_routability(&svc.state, &merged.unroutable);
            Err(e)
        }
    }
}

/// Applies one membership update: counts its changes, reloads if the effective fleet changed,
/// flips routability. Returns whether anything changed.
pub async fn apply_update(
    svc: &Arc<Service>,
    update: MembershipUpdate,
) -> Result<bool, ServiceError> {
    let m = &svc.state.metrics.discovery;
    let mut st = svc.discovery.state.lock().await;
    let generation = update.generation;
    let changes = st.fleet.apply(update);
    m.updates.inc();
    for c in &changes {
        m.changes.with_label_values(&[change_kind(c)]).inc();
    }
    m.synced.set(1);
    let merged = merge(&st.file, &st.fleet);
    *svc.discovery.unroutable.write() = merged.unroutable.clone();
    // Unroutable / Routable alone change no config: no reload, only the flags below.
    let reload = if *svc.state.config() != merged.config {
        svc.reload(merged.config.clone()).await
    } else {
        Ok(false)
    };
    let flipped = set_routability(&svc.state, &merged.unroutable);
    report(svc, &mut st, &merged);
    let reloaded = reload?;
    tracing::info!(
        generation,
        changes = changes.len(),
        discovered = merged.discovered(),
        unroutable = merged.unroutable.len(),
        left_out = merged.left_out.len(),
        reloaded,
        flipped,
        "discovered fleet applied"
    );
    Ok(reloaded || flipped > 0)
}

/// Records that discovered worker `id`'s engine serves base model `model` (its pod has no model
/// label; `crate::service::served` read it from the engine's `GET /v1/models`) and reloads the
/// effective fleet when that moves it. Returns whether it did (false: a static or labelled worker,
/// or nothing new).
pub async fn learn_model(svc: &Arc<Service>, id: &str, model: &str) -> Result<bool, ServiceError> {
    let mut st = svc.discovery.state.lock().await;
    if !st.fleet.learn(id, model) {
        return Ok(false);
    }
    tracing::info!(
        worker = id,
        model,
        "discovered worker's model learned from its engine's /v1/models"
    );
    let merged = merge(&st.file, &st.fleet);
    *svc.discovery.unroutable.write() = merged.unroutable.clone();
    let reload = svc.reload(merged.config.clone()).await;
    set_routability(&svc.state, &merged.unroutable);
    report(svc, &mut st, &merged);
    reload.map(|_| true)
}

/// Sets every worker's `routable` from `unroutable`; bumps the fleet generation if one flipped.
/// Returns how many flipped.
pub fn set_routability(state: &AppState, unroutable: &BTreeSet<String>) -> usize {
    let mut fleet = state.fleet.write();
    let mut flipped = 0;
    for w in &mut fleet.workers {
        let routable = !unroutable.contains(&w.cfg.id);
        if w.routable != routable {
            w.routable = routable;
            flipped += 1;
            if routable {
                tracing::info!(worker = %w.cfg.id, "discovered worker routable again");
            } else {
                tracing::info!(worker = %w.cfg.id, "discovered worker gets no traffic; its index stays");
            }
        }
    }
    if flipped > 0 {
        fleet.generation += 1;
    }
    flipped
}

/// Gauges, and a log line for each conflict that appeared or went away.
fn report(svc: &Service, st: &mut LinkState, merged: &Merged) {
    let m = &svc.state.metrics.discovery;
    for (status, n) in &merged.statuses {
        m.workers.with_label_values(&[status]).set(i64::try_from(*n).unwrap_or(i64::MAX));
    }
    for (reason, n) in &merged.skipped {
        m.skipped.with_label_values(&[reason]).set(i64::try_from(*n).unwrap_or(i64::MAX));
    }
    let now: BTreeSet<LeftOut> = merged.left_out.iter().cloned().collect();
    for l in now.difference(&st.left_out) {
        if l.reason == LEFT_OUT_STATIC_ID {
            tracing::warn!(worker = %l.id, detail = %l.detail, "discovered worker left out: a static [[workers]] entry has its id");
        } else {
            tracing::error!(worker = %l.id, reason = l.reason, error = %l.detail, "discovered worker left out");
        }
    }
    for l in st.left_out.difference(&now) {
        tracing::info!(worker = %l.id, reason = l.reason, "discovered worker no longer left out");
    }
    st.left_out = now;
}

/// Starts discovery for `svc` if its config has `[discovery.kubernetes]`: builds the Kubernetes
/// client from the environment (in-cluster service account, else kubeconfig), starts the watcher,
/// applies its updates for ever. Never fails the service: problems are logged and counted.
pub fn spawn(svc: &Arc<Service>) -> Option<JoinHandle<()>> {
    let cfg = svc.state.config().discovery.kubernetes.clone()?;
    let m = &svc.state.metrics.discovery;
    m.init_series();
    tracing::info!(namespace = %cfg.namespace, service = %cfg.service, inference_pool = %cfg.inference_pool, grace_period_ms = cfg.grace_period_ms, "kubernetes discovery starting");
    let svc = svc.clone();
    Some(tokio::spawn(async move {
        let m = &svc.state.metrics.discovery;
        let client = match kvmesh_discovery::default_client().await {
            Ok(c) => c,
            Err(e) => {
                m.errors.with_label_values(&["client"]).inc();
                tracing::error!(
                    error = %e,
                    "kubernetes discovery disabled: no Kubernetes client (no in-cluster service account, no kubeconfig); serving the static workers only"
                );
                return;
            }
        };
        match watch(&svc, client, cfg) {
            Ok(rx) => follow(svc, rx).await,
            Err(e) => {
                m.errors.with_label_values(&["start"]).inc();
                tracing::error!(error = %e, "kubernetes discovery could not start; serving the static workers only");
            }
        }
    }))
}

/// Starts the watcher for `svc`: its problems count in `kvmesh_discovery_errors_total{reason}`
/// (`watch`, `pool_missing`, `pool_invalid`). The updates are for [`follow`].
pub fn watch(
    svc: &Arc<Service>,
    client: kvmesh_discovery::Client,
    cfg: DiscoveryConfig,
) -> Result<mpsc::Receiver<MembershipUpdate>, DiscoveryError> {
    let state = svc.state.clone();
    kvmesh_discovery::spawn_reporting(client, cfg, move |problem| {
        state.metrics.discovery.errors.with_label_values(&[problem.as_str()]).inc();
    })
}

/// Applies every update from `rx` to `svc` until the watcher ends (it does not, short of a bug).
pub async fn follow(svc: Arc<Service>, mut rx: mpsc::Receiver<MembershipUpdate>) {
    let m = &svc.state.metrics.discovery;
    m.init_series();
    while let Some(update) = rx.recv().await {
        if let Err(e) = apply_update(&svc, update).await {
            m.errors.with_label_values(&["apply"]).inc();
            tracing::error!(error = %e, "applying the discovered fleet failed; it is retried with the next update");
        }
    }
    m.errors.with_label_values(&["ended"]).inc();
    m.synced.set(0);
    tracing::error!("kubernetes discovery ended; the last discovered workers stay until restart");
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_watcher_problem_has_a_metric_label() {
        for p in kvmesh_discovery::Problem::ALL {
            assert!(crate::discovered::ERROR_REASONS.contains(&p.as_str()), "{p:?}");
        }
    }
}
