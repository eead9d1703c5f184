//! The thin I/O shell: two kube-rs watches (the Service's EndpointSlices, the worker pods) feeding a
//! [`Tracker`], membership updates out on a bounded channel.
//!
//! All decisions live in the tracker; this module only moves events and reads the clock. kube's
//! watcher re-lists on its own after a lost watch (410 Gone) and backs off on API errors; an API
//! outage therefore produces errors and no events, and the last membership stays as it was —
//! an unreachable API server is never mistaken for every worker leaving. A full channel makes
//! the watcher wait (the indexer is slow, not gone); a closed channel ends it.

use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use crate::config::DiscoveryConfig;
use crate::membership::Change;
use crate::objects::ObjectEvent;
use crate::tracker::{MembershipUpdate, Tracker};

/// Why the watcher could not start or run.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// No Kubernetes client could be built (not in a cluster, no kubeconfig).
    #[error("kubernetes client: {0}")]
    Client(#[from] kube::Error),
}

/// Builds a client from the environment: in-cluster service account, else `KUBECONFIG`/`~/.kube/config`.
pub async fn default_client() -> Result<Client, DiscoveryError> {
    Ok(Client::try_default().await?)
}

/// Validates `cfg`, starts the watcher on the current tokio runtime and returns the update channel.
/// The first update (generation 1) arrives once both initial lists are complete. The task ends when
/// the receiver is dropped.
pub fn spawn(
    client: Client,
    cfg: DiscoveryConfig,
) -> Result<mpsc::Receiver<MembershipUpdate>, DiscoveryError> {
    let cfg = cfg.validated()?;
    let (tx, rx) = mpsc::channel(cfg.channel_capacity);
    tokio::spawn(run(client, cfg, tx));
    Ok(rx)
}

/// One input of the loop (boxed: Kubernetes objects are large and unequal).
enum Input {
    Slice(Box<Result<Event<EndpointSlice>, watcher::Error>>),
    Pod(Box<Result<Event<Pod>, watcher::Error>>),
}

/// Runs until `tx` is closed. `cfg` must be validated ([`spawn`] does it).
pub async fn run(client: Client, cfg: DiscoveryConfig, tx: mpsc::Sender<MembershipUpdate>) {
    let slices_api: Api<EndpointSlice> = Api::namespaced(client.clone(), &cfg.namespace);
    let pods_api: Api<Pod> = Api::namespaced(client, &cfg.namespace);
    let slice_cfg = watcher::Config::default().labels(&cfg.slice_selector());
    let pod_cfg = if cfg.pod_selector.is_empty() {
        watcher::Config::default()
    } else {
        watcher::Config::default().labels(&cfg.pod_selector)
    };
    let slices = watcher::watcher(slices_api, slice_cfg)
        .default_backoff()
        .map(|ev| Input::Slice(Box::new(ev)));
    let pods =
        watcher::watcher(pods_api, pod_cfg).default_backoff().map(|ev| Input::Pod(Box::new(ev)));
    // Boxed: kube's watcher streams are not `Unpin`.
    let mut inputs = futures::stream::select(slices.boxed(), pods.boxed());
    info!(namespace = %cfg.namespace, service = %cfg.service, pod_selector = %cfg.pod_selector, "kubernetes discovery started");
    let mut tracker = Tracker::new(cfg);
    loop {
        let deadline = tracker.next_deadline();
        let update = tokio::select! {
            input = inputs.next() => match input {
                Some(input) => handle(&mut tracker, input, Instant::now()),
                // kube's watcher streams never end; if they did, nothing more can be learned.
                None => return,
            },
            () = sleep_until(deadline) => tracker.on_tick(Instant::now()),
            () = tx.closed() => return,
        };
        if let Some(update) = update {
            log_update(&update);
            if tx.send(update).await.is_err() {
                return;
            }
        }
    }
}

fn handle(tracker: &mut Tracker, input: Input, now: Instant) -> Option<MembershipUpdate> {
    match input {
        Input::Slice(ev) => match *ev {
            Ok(ev) => tracker.on_slice(convert(ev), now),
            Err(e) => {
                warn!(error = %e, resource = "endpointslices", "kubernetes watch error; keeping the last membership");
                None
            }
        },
        Input::Pod(ev) => match *ev {
            Ok(ev) => tracker.on_pod(convert(ev), now),
            Err(e) => {
                warn!(error = %e, resource = "pods", "kubernetes watch error; keeping the last membership");
                None
            }
        },
    }
}

/// kube-runtime's events onto the library-neutral [`ObjectEvent`].
pub fn convert<K>(ev: Event<K>) -> ObjectEvent<K> {
    match ev {
        Event::Init => ObjectEvent::ListStart,
        Event::InitApply(k) => ObjectEvent::Listed(k),
        Event::InitDone => ObjectEvent::ListDone,
        Event::Apply(k) => ObjectEvent::Applied(k),
        Event::Delete(k) => ObjectEvent::Deleted(k),
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
        None => futures::future::pending().await,
    }
}

fn log_update(update: &MembershipUpdate) {
    let routable = update.workers.iter().filter(|w| w.routable).count();
    info!(
        generation = update.generation,
        workers = update.workers.len(),
        routable,
        skipped = update.skipped.len(),
        changes = update.changes.len(),
        "discovery membership update"
    );
    for change in &update.changes {
        match change {
            Change::Joined { worker, routable } => {
                info!(worker = %worker.id, endpoint = %worker.endpoint, role = worker.role.as_str(), routable, "worker joined")
            }
            Change::Updated { worker } => {
                info!(worker = %worker.id, role = worker.role.as_str(), "worker role changed")
            }
            Change::Unroutable { id, drop_at } => {
                let drop_in_ms =
                    drop_at.map(|t| t.saturating_duration_since(Instant::now()).as_millis());
                info!(worker = %id, ?drop_in_ms, "worker not routable");
            }
            Change::Routable { id } => info!(worker = %id, "worker routable again"),
            Change::Left { id } => info!(worker = %id, "worker left; its blocks are dropped"),
        }
    }
    for s in &update.skipped {
        debug!(target_name = %s.target, reason = s.reason.as_str(), "endpoint skipped");
    }
}
