//! The thin I/O shell: two kube-rs watches (the Service's EndpointSlices or the InferencePool, and
//! the worker pods) feeding a [`Tracker`], membership updates out on a bounded channel.
//!
//! All decisions live in the tracker; this module only moves events and reads the clock. kube's
//! watcher re-lists on its own after a lost watch (410 Gone) and backs off on API errors; an API
//! outage therefore produces errors and no events, and the last membership stays as it was —
//! an unreachable API server is never mistaken for every worker leaving. Every watch error and
//! every pool that goes missing or unreadable is logged and reported ([`Problem`], the indexer
//! counts them). A full channel makes the watcher wait (the indexer is slow, not gone); a closed
//! channel ends it.
//!
//! InferencePool mode: the pool is watched by name (`metadata.name` field selector), and the pod
//! watch uses the pool's selector; when the selector changes the pod watch is restarted with the
//! new one (its first list then swaps in atomically, [`crate::objects`]), and the pods the new
//! selector no longer picks are out at once (the tracker filters by the selector too).

use std::time::Instant;

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::core::DynamicObject;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::sync::mpsc;
use tracing::{debug, error, info, warn};

use crate::config::DiscoveryConfig;
use crate::membership::Change;
use crate::objects::ObjectEvent;
use crate::pool::api_resource;
use crate::tracker::{MembershipUpdate, PoolState, Tracker};

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

/// Something that went wrong while running, reported to the caller (the indexer counts it in
/// `kvmesh_discovery_errors_total{reason}`). Each is also logged here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// A list or watch failed (API server unreachable, 403, 404 for a CRD that is not installed,
    /// an undecodable object); kube backs off and retries, the last membership stays.
    Watch,
    /// The InferencePool does not exist (at the first list, or it was deleted): no workers.
    PoolMissing,
    /// The InferencePool's spec cannot be followed; the last readable spec stays in use.
    PoolInvalid,
}

impl Problem {
    /// Every problem, for metric pre-registration.
    pub const ALL: [Problem; 3] = [Self::Watch, Self::PoolMissing, Self::PoolInvalid];

    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Watch => "watch",
            Self::PoolMissing => "pool_missing",
            Self::PoolInvalid => "pool_invalid",
        }
    }
}

/// Builds a client from the environment: in-cluster service account, else `KUBECONFIG`/`~/.kube/config`.
pub async fn default_client() -> Result<Client, DiscoveryError> {
    Ok(Client::try_default().await?)
}

/// Validates `cfg`, starts the watcher on the current tokio runtime and returns the update channel.
/// The first update (generation 1) arrives once the initial lists are complete. The task ends when
/// the receiver is dropped. Problems are only logged; [`spawn_reporting`] hands them out too.
pub fn spawn(
    client: Client,
    cfg: DiscoveryConfig,
) -> Result<mpsc::Receiver<MembershipUpdate>, DiscoveryError> {
    spawn_reporting(client, cfg, |_| {})
}

/// [`spawn`], calling `report` for every [`Problem`] as it happens (keep it cheap: it runs on the
/// watcher's task).
pub fn spawn_reporting(
    client: Client,
    cfg: DiscoveryConfig,
    report: impl Fn(Problem) + Send + Sync + 'static,
) -> Result<mpsc::Receiver<MembershipUpdate>, DiscoveryError> {
    let cfg = cfg.validated()?;
    let (tx, rx) = mpsc::channel(cfg.channel_capacity);
    tokio::spawn(run(client, cfg, tx, report));
    Ok(rx)
}

/// One input of the loop (boxed: Kubernetes objects are large and unequal).
enum Input {
    Slice(Box<Result<Event<EndpointSlice>, watcher::Error>>),
    Pool(Box<Result<Event<DynamicObject>, watcher::Error>>),
    Pod(Box<Result<Event<Pod>, watcher::Error>>),
}

type Inputs = BoxStream<'static, Input>;

/// The pod watch, with the label selector it was started with.
struct PodWatch {
    selector: String,
    events: Inputs,
}

fn pod_watch(api: &Api<Pod>, selector: &str) -> PodWatch {
    let cfg = if selector.is_empty() {
        watcher::Config::default()
    } else {
        watcher::Config::default().labels(selector)
    };
    // Boxed: kube's watcher streams are not `Unpin`.
    let events = watcher::watcher(api.clone(), cfg)
        .default_backoff()
        .map(|ev| Input::Pod(Box::new(ev)))
        .boxed();
    PodWatch { selector: selector.to_owned(), events }
}

/// Runs until `tx` is closed. `cfg` must be validated ([`spawn`] does it).
pub async fn run(
    client: Client,
    cfg: DiscoveryConfig,
    tx: mpsc::Sender<MembershipUpdate>,
    report: impl Fn(Problem) + Send + Sync + 'static,
) {
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &cfg.namespace);
    // The slices (Service mode) or the pool (InferencePool mode): the collection that says who is in.
    let mut primary: Inputs = if cfg.pool_mode() {
        let api: Api<DynamicObject> = Api::namespaced_with(client, &cfg.namespace, &api_resource());
        let by_name = watcher::Config::default().fields(&cfg.pool_field_selector());
        info!(namespace = %cfg.namespace, inference_pool = %cfg.inference_pool, "kubernetes discovery started (InferencePool)");
        watcher::watcher(api, by_name).default_backoff().map(|ev| Input::Pool(Box::new(ev))).boxed()
    } else {
        let api: Api<EndpointSlice> = Api::namespaced(client, &cfg.namespace);
        let slice_cfg = watcher::Config::default().labels(&cfg.slice_selector());
        info!(namespace = %cfg.namespace, service = %cfg.service, pod_selector = %cfg.pod_selector, "kubernetes discovery started");
        watcher::watcher(api, slice_cfg)
            .default_backoff()
            .map(|ev| Input::Slice(Box::new(ev)))
            .boxed()
    };
    let pool_name = cfg.inference_pool.clone();
    let mut tracker = Tracker::new(cfg);
    let mut pods: Option<PodWatch> = None;
    let mut pool_state = PoolState::Unlisted;
    loop {
        // (Re)start the pod watch when the selector it needs is not the one it runs with. A
        // missing pool needs none: the running watch (if any) stays for when it comes back.
        if let Some(selector) = tracker.pod_selector() {
            if pods.as_ref().map(|p| &p.selector) != Some(&selector) {
                if pods.is_some() {
                    info!(inference_pool = %pool_name, %selector, "the pool's selector changed; watching its pods anew");
                }
                pods = Some(pod_watch(&pods_api, &selector));
            }
        }
        let deadline = tracker.next_deadline();
        let update = tokio::select! {
            input = primary.next() => match input {
                Some(input) => handle(&mut tracker, input, Instant::now(), &report),
                // kube's watcher streams never end; if they did, nothing more can be learned.
                None => return,
            },
            input = next_pod(&mut pods) => match input {
                Some(input) => handle(&mut tracker, input, Instant::now(), &report),
                None => return,
            },
            () = sleep_until(deadline) => tracker.on_tick(Instant::now()),
            () = tx.closed() => return,
        };
        if *tracker.pool_state() != pool_state {
            pool_state = tracker.pool_state().clone();
            match &pool_state {
                PoolState::Missing => {
                    warn!(inference_pool = %pool_name, "InferencePool not found: it describes no workers (its former workers leave after the grace period)");
                    report(Problem::PoolMissing);
                }
                PoolState::Invalid(reason) => {
                    error!(inference_pool = %pool_name, %reason, "InferencePool spec cannot be followed; keeping the last readable one");
                    report(Problem::PoolInvalid);
                }
                PoolState::Valid => info!(inference_pool = %pool_name, "InferencePool followed"),
                PoolState::Unlisted => {}
            }
        }
        if let Some(update) = update {
            log_update(&update);
            if tx.send(update).await.is_err() {
                return;
            }
        }
    }
}

async fn next_pod(pods: &mut Option<PodWatch>) -> Option<Input> {
    match pods {
        Some(p) => p.events.next().await,
        None => futures::future::pending().await,
    }
}

fn handle(
    tracker: &mut Tracker,
    input: Input,
    now: Instant,
    report: &impl Fn(Problem),
) -> Option<MembershipUpdate> {
    let failed = |resource: &str, e: watcher::Error| {
        if is_not_found(&e) && resource == "inferencepools" {
            warn!(error = %e, resource, "kubernetes watch error: is the InferencePool CRD (inference.networking.k8s.io/v1) installed? Keeping the last membership");
        } else {
            warn!(error = %e, resource, "kubernetes watch error; keeping the last membership");
        }
        report(Problem::Watch);
        None
    };
    match input {
        Input::Slice(ev) => match *ev {
            Ok(ev) => tracker.on_slice(convert(ev), now),
            Err(e) => failed("endpointslices", e),
        },
        Input::Pool(ev) => match *ev {
            Ok(ev) => tracker.on_pool(convert(ev), now),
            Err(e) => failed("inferencepools", e),
        },
        Input::Pod(ev) => match *ev {
            Ok(ev) => tracker.on_pod(convert(ev), now),
            Err(e) => failed("pods", e),
        },
    }
}

/// A 404 from the API server: the resource type is not served (a CRD not installed).
fn is_not_found(e: &watcher::Error) -> bool {
    match e {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => s.code == 404,
        watcher::Error::WatchError(s) => s.code == 404,
        _ => false,
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
