//! From EndpointSlices and pods to the workers they describe — pure, deterministic, no clock.
//!
//! An EndpointSlice knows addresses, ports, readiness and the backing pod's name, but not the pod's
//! labels, so the role comes from a second collection (pods). [`observe`] joins the two:
//! worker id = pod name (`targetRef`), HTTP endpoint = address + the named Service port, KV-event
//! and replay endpoints = the same address + configured ports. The same pod may appear in two
//! slices while the EndpointSlice controller rebalances them; it is one worker, ready if any copy
//! is. Whatever cannot become a worker is reported with a reason instead of silently dropped.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::{Endpoint, EndpointSlice};
use kvmesh_core::api::Role;
use serde::Serialize;

use crate::config::{DiscoveryConfig, PortRef};
use crate::objects::ObjectSet;

/// A worker as discovery sees it: everything the indexer needs to route to it and hear its events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DiscoveredWorker {
    /// Stable identity: the pod name.
    pub id: String,
    /// From the pod's role label (or the configured default).
    pub role: Role,
    /// From the pod's model label; `None`: the fleet's default model.
    pub model: Option<String>,
    /// `ip:port` of the OpenAI server (`[ip]:port` for IPv6), as Envoy's override_host expects.
    pub endpoint: String,
    /// `tcp://ip:port` of the ZMQ KV-event publisher.
    pub kv_events: String,
    /// `tcp://ip:port` of the replay socket, if configured.
    pub kv_replay: Option<String>,
}

/// One worker in a [`View`], with its readiness in the slices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// The worker.
    pub worker: DiscoveredWorker,
    /// EndpointSlice `conditions.ready` (absent means ready, per the API).
    pub ready: bool,
}

/// Why an endpoint did not become a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SkipReason {
    /// The slice's `addressType` is FQDN: no pod IP to reach the KV-event socket on.
    FqdnAddress,
    /// The endpoint lists no address, or one that is not an IP.
    BadAddress,
    /// The slice has no port named `http_port`.
    NoHttpPort,
    /// A named KV-event or replay port is missing from the slice.
    NoKvPort,
    /// The backing pod is not (yet) in the pod watch, so its role is unknown.
    UnknownPod,
    /// The pod has no role label and no `default_role` is configured.
    NoRole,
    /// The role label's value is not `decode`, `prefill` or `both`.
    BadRole,
    /// More workers than `max_workers`.
    TooManyWorkers,
    /// InferencePool mode with several target ports: a rank's KV-event port (base + rank) is
    /// another rank's replay port.
    KvPortOverlap,
}

impl SkipReason {
    /// The label value used in metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FqdnAddress => "fqdn_address",
            Self::BadAddress => "bad_address",
            Self::NoHttpPort => "no_http_port",
            Self::NoKvPort => "no_kv_port",
            Self::UnknownPod => "unknown_pod",
            Self::NoRole => "no_role",
            Self::BadRole => "bad_role",
            Self::TooManyWorkers => "too_many_workers",
            Self::KvPortOverlap => "kv_port_overlap",
        }
    }

    /// Every reason, for metric pre-registration.
    pub const ALL: [SkipReason; 9] = [
        Self::FqdnAddress,
        Self::BadAddress,
        Self::NoHttpPort,
        Self::NoKvPort,
        Self::UnknownPod,
        Self::NoRole,
        Self::BadRole,
        Self::TooManyWorkers,
        Self::KvPortOverlap,
    ];
}

/// An endpoint left out of the view.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Skipped {
    /// The pod name, else the first address, else the slice name.
    pub target: String,
    /// Why.
    pub reason: SkipReason,
}

/// The workers described by the current slices and pods.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// By worker id.
    pub workers: BTreeMap<String, Observed>,
    /// Endpoints that could not become workers, sorted.
    pub skipped: Vec<Skipped>,
}

/// Joins the slices with the pods into a [`View`].
pub fn observe(
    slices: &ObjectSet<EndpointSlice>,
    pods: &ObjectSet<Pod>,
    cfg: &DiscoveryConfig,
) -> View {
    let mut view = View::default();
    for slice in slices.iter() {
        for ep in slice.endpoints.iter().flatten() {
            match worker_of(slice, ep, pods, cfg) {
                Ok(obs) => merge(&mut view, obs, cfg.max_workers),
                Err(skipped) => view.skipped.push(skipped),
            }
        }
    }
    view.skipped.sort_by(|a, b| (a.reason, &a.target).cmp(&(b.reason, &b.target)));
    view.skipped.dedup();
    view
}

pub(crate) fn merge(view: &mut View, obs: Observed, max_workers: usize) {
    if let Some(existing) = view.workers.get_mut(&obs.worker.id) {
        // Duplicate across slices: first one wins (slices iterate in name order), any ready copy counts.
        existing.ready |= obs.ready;
        return;
    }
    if view.workers.len() >= max_workers {
        view.skipped.push(Skipped { target: obs.worker.id, reason: SkipReason::TooManyWorkers });
        return;
    }
    view.workers.insert(obs.worker.id.clone(), obs);
}

fn worker_of(
    slice: &EndpointSlice,
    ep: &Endpoint,
    pods: &ObjectSet<Pod>,
    cfg: &DiscoveryConfig,
) -> Result<Observed, Skipped> {
    let pod_name = ep
        .target_ref
        .as_ref()
        .filter(|r| r.kind.as_deref() == Some("Pod"))
        .and_then(|r| r.name.clone());
    let target = pod_name
        .clone()
        .or_else(|| ep.addresses.first().cloned())
        .or_else(|| slice.metadata.name.clone())
        .unwrap_or_default();
    let skip = |reason| Skipped { target: target.clone(), reason };

    if slice.address_type == "FQDN" {
        return Err(skip(SkipReason::FqdnAddress));
    }
    let ip: IpAddr = ep
        .addresses
        .first()
        .and_then(|a| a.parse().ok())
        .ok_or_else(|| skip(SkipReason::BadAddress))?;
    let http_port =
        named_port(slice, &cfg.http_port).ok_or_else(|| skip(SkipReason::NoHttpPort))?;
    let kv_port = resolve(slice, &cfg.kv_events_port).ok_or_else(|| skip(SkipReason::NoKvPort))?;
    let replay_port = match &cfg.kv_replay_port {
        Some(p) => Some(resolve(slice, p).ok_or_else(|| skip(SkipReason::NoKvPort))?),
        None => None,
    };
    // Without a pod reference (a hand-made slice) there are no labels: only the default role applies.
    let (role, model) = match &pod_name {
        Some(name) => {
            let pod = pods.get(name).ok_or_else(|| skip(SkipReason::UnknownPod))?;
            let model = pod.metadata.labels.as_ref().and_then(|l| l.get(&cfg.model_label));
            (role_of(pod, cfg).map_err(skip)?, model.filter(|m| !m.is_empty()).cloned())
        }
        None => (cfg.default_role.ok_or_else(|| skip(SkipReason::NoRole))?, None),
    };
    let id = pod_name.unwrap_or_else(|| ip.to_string());
    let ready = ep.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
    Ok(Observed {
        worker: DiscoveredWorker {
            id,
            role,
            model,
            endpoint: SocketAddr::new(ip, http_port).to_string(),
            kv_events: format!("tcp://{}", SocketAddr::new(ip, kv_port)),
            kv_replay: replay_port.map(|p| format!("tcp://{}", SocketAddr::new(ip, p))),
        },
        ready,
    })
}

pub(crate) fn role_of(pod: &Pod, cfg: &DiscoveryConfig) -> Result<Role, SkipReason> {
    match pod.metadata.labels.as_ref().and_then(|l| l.get(&cfg.role_label)) {
        Some(value) => match value.as_str() {
            "decode" => Ok(Role::Decode),
            "prefill" => Ok(Role::Prefill),
            "both" => Ok(Role::Both),
            _ => Err(SkipReason::BadRole),
        },
        None => cfg.default_role.ok_or(SkipReason::NoRole),
    }
}

fn named_port(slice: &EndpointSlice, name: &str) -> Option<u16> {
    slice
        .ports
        .iter()
        .flatten()
        .find(|p| p.name.as_deref() == Some(name))
        .and_then(|p| p.port)
        .and_then(|p| u16::try_from(p).ok())
        .filter(|p| *p > 0)
}

fn resolve(slice: &EndpointSlice, port: &PortRef) -> Option<u16> {
    match port {
        PortRef::Number(n) => Some(*n),
        PortRef::Name(name) => named_port(slice, name),
    }
}
