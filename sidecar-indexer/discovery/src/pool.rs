//! From a Gateway API Inference Extension `InferencePool` and its pods to workers — pure, no clock.
//!
//! An `inference.networking.k8s.io/v1` InferencePool names its model servers by a label selector
//! (`spec.selector.matchLabels`, pods of its own namespace) and 1–8 `spec.targetPorts`. GIE's rule:
//! "every port will be treated as a distinctive endpoint by EPP, addressable as podIP:portNumber" —
//! that is how a pod exposes its data-parallel ranks. So every selected pod with an IP gives one
//! worker per target port:
//!
//! - id = the pod name when the pool has one target port (as in Service mode), else
//!   `<pod>-rank-<i>` for the i-th target port (GIE's own endpoint naming);
//! - HTTP endpoint = pod IP + that port; KV events / replay = pod IP + the configured port + i
//!   (vLLM offsets a data-parallel rank's publisher by its rank; a named port is looked up in the
//!   pod's container ports);
//! - role and model from the pod's labels, exactly as in Service mode ([`crate::view`]);
//! - ready = the pod's `Ready` condition is `True` and it is not being deleted. A pod without an IP
//!   (not scheduled yet) is not an endpoint yet; a finished pod (`Succeeded`/`Failed`) is gone.
//!
//! The pool object is read through kube's dynamic API ([`api_resource`], `DynamicObject`): no
//! generated CRD type, and a spec this module cannot read is refused with a reason ([`parse_pool`])
//! rather than guessed at.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;
use kube::core::{ApiResource, DynamicObject};
use serde_json::Value;

use crate::config::{DiscoveryConfig, PortRef};
use crate::objects::ObjectSet;
use crate::view::{merge, role_of, DiscoveredWorker, Observed, SkipReason, Skipped, View};

/// The InferencePool API group.
pub const POOL_GROUP: &str = "inference.networking.k8s.io";
/// The InferencePool API version kvmesh reads (GIE v1.0 and later).
pub const POOL_VERSION: &str = "v1";
/// The kind.
pub const POOL_KIND: &str = "InferencePool";
/// The resource (plural) name, as RBAC rules and URLs spell it.
pub const POOL_PLURAL: &str = "inferencepools";
/// Most target ports a v1 pool may list (the CRD's own bound).
pub const MAX_TARGET_PORTS: usize = 8;

/// The dynamic API resource of `inference.networking.k8s.io/v1` InferencePools.
pub fn api_resource() -> ApiResource {
    ApiResource {
        group: POOL_GROUP.to_owned(),
        version: POOL_VERSION.to_owned(),
        api_version: format!("{POOL_GROUP}/{POOL_VERSION}"),
        kind: POOL_KIND.to_owned(),
        plural: POOL_PLURAL.to_owned(),
    }
}

/// What kvmesh uses of a pool's spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolSpec {
    /// `spec.selector.matchLabels`: a pod is in the pool when it carries every one of them.
    pub selector: BTreeMap<String, String>,
    /// `spec.targetPorts[].number`, in the pool's order (entry i = data-parallel rank i).
    pub target_ports: Vec<u16>,
}

impl PoolSpec {
    /// The selector as a Kubernetes label selector string (`k=v,k2=v2`), for the pod watch.
    pub fn label_selector(&self) -> String {
        self.selector.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    }

    /// Whether `pod` carries every label of the selector.
    pub fn selects(&self, pod: &Pod) -> bool {
        let labels = pod.metadata.labels.as_ref();
        self.selector.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
    }
}

/// Reads a pool's spec. Refuses (with the reason, for the log) what the v1 schema forbids or what
/// would be unsafe to follow: no selector, an empty selector (every pod of the namespace), no
/// target ports, more than [`MAX_TARGET_PORTS`], a port outside 1..=65535, a repeated port.
pub fn parse_pool(obj: &DynamicObject) -> Result<PoolSpec, String> {
    let spec = obj.data.get("spec").ok_or("no spec")?;
    let labels = spec
        .get("selector")
        .and_then(|s| s.get("matchLabels"))
        .and_then(Value::as_object)
        .ok_or("no spec.selector.matchLabels")?;
    if labels.is_empty() {
        return Err("spec.selector.matchLabels is empty (it would select every pod)".to_owned());
    }
    let mut selector = BTreeMap::new();
    for (k, v) in labels {
        let v =
            v.as_str().ok_or_else(|| format!("spec.selector.matchLabels.{k} is not a string"))?;
        selector.insert(k.clone(), v.to_owned());
    }
    let ports = spec.get("targetPorts").and_then(Value::as_array).ok_or("no spec.targetPorts")?;
    if ports.is_empty() || ports.len() > MAX_TARGET_PORTS {
        return Err(format!(
            "spec.targetPorts has {} entries (1..={MAX_TARGET_PORTS})",
            ports.len()
        ));
    }
    let mut target_ports = Vec::with_capacity(ports.len());
    for p in ports {
        let n = p
            .get("number")
            .and_then(Value::as_u64)
            .and_then(|n| u16::try_from(n).ok())
            .filter(|n| *n > 0)
            .ok_or_else(|| format!("spec.targetPorts entry {p} has no port number in 1..=65535"))?;
        if target_ports.contains(&n) {
            return Err(format!("spec.targetPorts lists {n} twice"));
        }
        target_ports.push(n);
    }
    Ok(PoolSpec { selector, target_ports })
}

/// The workers of `spec`'s pods (none without a spec: the pool is missing).
pub fn observe_pool(spec: Option<&PoolSpec>, pods: &ObjectSet<Pod>, cfg: &DiscoveryConfig) -> View {
    let mut view = View::default();
    let Some(spec) = spec else { return view };
    for pod in pods.iter() {
        if !spec.selects(pod) {
            continue;
        }
        let status = pod.status.as_ref();
        if matches!(status.and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed")) {
            continue;
        }
        let Some(ip) = status.and_then(|s| s.pod_ip.as_deref()).filter(|ip| !ip.is_empty()) else {
            continue;
        };
        match workers_of(pod, ip, spec, cfg) {
            Ok(workers) => {
                for obs in workers {
                    merge(&mut view, obs, cfg.max_workers);
                }
            }
            Err(skipped) => view.skipped.push(skipped),
        }
    }
    view.skipped.sort_by(|a, b| (a.reason, &a.target).cmp(&(b.reason, &b.target)));
    view.skipped.dedup();
    view
}

fn workers_of(
    pod: &Pod,
    ip: &str,
    spec: &PoolSpec,
    cfg: &DiscoveryConfig,
) -> Result<Vec<Observed>, Skipped> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let skip = |reason| Skipped { target: name.clone(), reason };
    let ip: IpAddr = ip.parse().map_err(|_| skip(SkipReason::BadAddress))?;
    let role = role_of(pod, cfg).map_err(skip)?;
    let model = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(&cfg.model_label))
        .filter(|m| !m.is_empty());
    let ranks = spec.target_ports.len();
    let kv =
        rank_ports(pod, &cfg.kv_events_port, ranks).ok_or_else(|| skip(SkipReason::NoKvPort))?;
    let replay = match &cfg.kv_replay_port {
        Some(p) => Some(rank_ports(pod, p, ranks).ok_or_else(|| skip(SkipReason::NoKvPort))?),
        None => None,
    };
    // Rank i's event socket must not be another rank's replay socket.
    if replay.as_ref().is_some_and(|r| r.iter().any(|p| kv.contains(p))) {
        return Err(skip(SkipReason::KvPortOverlap));
    }
    let ready = pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    Ok(spec
        .target_ports
        .iter()
        .enumerate()
        .map(|(i, port)| Observed {
            worker: DiscoveredWorker {
                id: if ranks == 1 { name.clone() } else { format!("{name}-rank-{i}") },
                role,
                model: model.cloned(),
                endpoint: SocketAddr::new(ip, *port).to_string(),
                kv_events: format!("tcp://{}", SocketAddr::new(ip, kv[i])),
                kv_replay: replay.as_ref().map(|r| format!("tcp://{}", SocketAddr::new(ip, r[i]))),
            },
            ready,
        })
        .collect())
}

/// The port of each of `ranks` ranks: the base port (a number, or a container port's name) + rank.
/// `None` when a name is not declared or a rank's port would pass 65535.
fn rank_ports(pod: &Pod, port: &PortRef, ranks: usize) -> Option<Vec<u16>> {
    let base = match port {
        PortRef::Number(n) => *n,
        PortRef::Name(name) => pod
            .spec
            .as_ref()?
            .containers
            .iter()
            .flat_map(|c| c.ports.iter().flatten())
            .find(|p| p.name.as_deref() == Some(name.as_str()))
            .and_then(|p| u16::try_from(p.container_port).ok())
            .filter(|p| *p > 0)?,
    };
    (0..ranks).map(|i| u16::try_from(i).ok().and_then(|i| base.checked_add(i))).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::objects::ObjectEvent;
    use kvmesh_core::api::Role;
    use serde_json::json;

    fn pool(spec: Value) -> DynamicObject {
        DynamicObject::new("vllm", &api_resource()).within("llm").data(json!({ "spec": spec }))
    }

    fn spec(ports: &[u16]) -> PoolSpec {
        let ports: Vec<Value> = ports.iter().map(|p| json!({ "number": p })).collect();
        parse_pool(&pool(json!({
            "selector": { "matchLabels": { "app": "vllm" } },
            "targetPorts": ports,
        })))
        .unwrap()
    }

    fn pod(name: &str, labels: Value, status: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": name, "namespace": "llm", "labels": labels },
            "spec": { "containers": [{ "name": "vllm", "ports": [
                { "name": "kv-events", "containerPort": 6000 },
                { "name": "kv-replay", "containerPort": 6100 },
            ]}]},
            "status": status,
        }))
        .unwrap()
    }

    fn ready(ip: &str) -> Value {
        json!({ "phase": "Running", "podIP": ip, "conditions": [{ "type": "Ready", "status": "True" }] })
    }

    fn pods(list: Vec<Pod>) -> ObjectSet<Pod> {
        let mut set = ObjectSet::default();
        set.apply(ObjectEvent::ListStart);
        for p in list {
            set.apply(ObjectEvent::Listed(p));
        }
        set.apply(ObjectEvent::ListDone);
        set
    }

    fn cfg() -> DiscoveryConfig {
        DiscoveryConfig { inference_pool: "vllm".into(), ..DiscoveryConfig::default() }
    }

    #[test]
    fn reads_a_v1_pool_and_refuses_what_it_cannot_follow() {
        let s = spec(&[8000, 8001]);
        assert_eq!(s.target_ports, [8000, 8001]);
        assert_eq!(s.label_selector(), "app=vllm");
        let two = parse_pool(&pool(json!({
            "selector": { "matchLabels": { "b": "2", "a": "1" } },
            "targetPorts": [{ "number": 8000 }],
            "endpointPickerRef": { "name": "kvmesh-epp", "port": { "number": 9002 } },
        })))
        .unwrap();
        assert_eq!(two.label_selector(), "a=1,b=2");
        let nine: Vec<Value> = (8000..8009).map(|p| json!({ "number": p })).collect();
        let bad = [
            json!({ "targetPorts": [{ "number": 8000 }] }),
            json!({ "selector": { "matchLabels": {} }, "targetPorts": [{ "number": 8000 }] }),
            json!({ "selector": { "matchLabels": { "app": 1 } }, "targetPorts": [{ "number": 8000 }] }),
            json!({ "selector": { "matchLabels": { "app": "x" } } }),
            json!({ "selector": { "matchLabels": { "app": "x" } }, "targetPorts": [] }),
            json!({ "selector": { "matchLabels": { "app": "x" } }, "targetPorts": nine }),
            json!({ "selector": { "matchLabels": { "app": "x" } }, "targetPorts": [{ "number": 0 }] }),
            json!({ "selector": { "matchLabels": { "app": "x" } }, "targetPorts": [{ "number": 70000 }] }),
            json!({ "selector": { "matchLabels": { "app": "x" } }, "targetPorts": [{ "number": 1 }, { "number": 1 }] }),
        ];
        for b in bad {
            assert!(parse_pool(&pool(b.clone())).is_err(), "{b}");
        }
        assert!(parse_pool(&DynamicObject::new("vllm", &api_resource())).is_err(), "no spec");
        assert_eq!(api_resource().api_version, "inference.networking.k8s.io/v1");
    }

    #[test]
    fn one_worker_per_selected_pod_and_target_port() {
        let set = pods(vec![
            pod("vllm-0", json!({ "app": "vllm", "kvmesh.io/role": "decode" }), ready("10.0.0.1")),
            pod("other", json!({ "app": "web" }), ready("10.0.0.2")),
            pod("vllm-pending", json!({ "app": "vllm" }), json!({ "phase": "Pending" })),
            pod(
                "vllm-done",
                json!({ "app": "vllm" }),
                json!({ "phase": "Failed", "podIP": "10.0.0.3" }),
            ),
            pod(
                "vllm-1",
                json!({ "app": "vllm", "kvmesh.io/model": "small" }),
                json!({ "phase": "Running", "podIP": "fd00::7", "conditions": [{ "type": "Ready", "status": "False" }] }),
            ),
        ]);
        let cfg = DiscoveryConfig {
            kv_events_port: PortRef::Name("kv-events".into()),
            kv_replay_port: Some(PortRef::Name("kv-replay".into())),
            ..cfg()
        };
        let one = observe_pool(Some(&spec(&[8000])), &set, &cfg);
        let got: Vec<(&str, &str, &str, Option<&str>, bool)> = one
            .workers
            .values()
            .map(|o| {
                let w = &o.worker;
                (
                    w.id.as_str(),
                    w.endpoint.as_str(),
                    w.kv_events.as_str(),
                    w.kv_replay.as_deref(),
                    o.ready,
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "vllm-0",
                    "10.0.0.1:8000",
                    "tcp://10.0.0.1:6000",
                    Some("tcp://10.0.0.1:6100"),
                    true
                ),
                (
                    "vllm-1",
                    "[fd00::7]:8000",
                    "tcp://[fd00::7]:6000",
                    Some("tcp://[fd00::7]:6100"),
                    false
                ),
            ]
        );
        assert_eq!(one.workers["vllm-0"].worker.role, Role::Decode);
        assert_eq!(one.workers["vllm-1"].worker.model.as_deref(), Some("small"));
        assert!(one.skipped.is_empty(), "{:?}", one.skipped);

        // Data-parallel ranks: one worker per port, rank i's sockets at base + i.
        let dp = observe_pool(Some(&spec(&[8000, 8001, 8002])), &set, &cfg);
        let ids: Vec<&str> = dp.workers.keys().map(String::as_str).collect();
        assert_eq!(
            ids,
            [
                "vllm-0-rank-0",
                "vllm-0-rank-1",
                "vllm-0-rank-2",
                "vllm-1-rank-0",
                "vllm-1-rank-1",
                "vllm-1-rank-2"
            ]
        );
        let r2 = &dp.workers["vllm-0-rank-2"].worker;
        assert_eq!(
            (r2.endpoint.as_str(), r2.kv_events.as_str(), r2.kv_replay.as_deref()),
            ("10.0.0.1:8002", "tcp://10.0.0.1:6002", Some("tcp://10.0.0.1:6102"))
        );
        assert!(observe_pool(None, &set, &cfg).workers.is_empty(), "no pool, no workers");
    }

    #[test]
    fn pods_that_cannot_be_workers_are_skipped_with_a_reason() {
        let deleting: Pod = {
            let mut p = pod("vllm-deleting", json!({ "app": "vllm" }), ready("10.0.0.9"));
            p.metadata.deletion_timestamp =
                serde_json::from_value(json!("2026-12-07T10:00:00Z")).unwrap();
            p
        };
        let set = pods(vec![
            pod(
                "vllm-badrole",
                json!({ "app": "vllm", "kvmesh.io/role": "turbo" }),
                ready("10.0.0.1"),
            ),
            pod("vllm-badip", json!({ "app": "vllm" }), ready("not-an-ip")),
            deleting,
        ]);
        let named = DiscoveryConfig { kv_events_port: PortRef::Name("nope".into()), ..cfg() };
        let v = observe_pool(Some(&spec(&[8000])), &set, &named);
        let skipped: Vec<(&str, SkipReason)> =
            v.skipped.iter().map(|s| (s.target.as_str(), s.reason)).collect();
        assert_eq!(
            skipped,
            [
                ("vllm-badip", SkipReason::BadAddress),
                ("vllm-deleting", SkipReason::NoKvPort),
                ("vllm-badrole", SkipReason::BadRole),
            ]
        );
        // Defaults (5557 events, 5558 replay) with two ranks: rank 1's events are rank 0's replay.
        let v = observe_pool(Some(&spec(&[8000, 8001])), &set, &cfg());
        assert!(v
            .skipped
            .iter()
            .any(|s| s.target == "vllm-deleting" && s.reason == SkipReason::KvPortOverlap));
        let v = observe_pool(Some(&spec(&[8000])), &set, &cfg());
        assert!(!v.workers["vllm-deleting"].ready, "a pod being deleted gets no traffic");
        // Too many workers: the bound counts pod × port.
        let small = DiscoveryConfig { max_workers: 1, kv_replay_port: None, ..cfg() };
        let v = observe_pool(Some(&spec(&[8000, 8001])), &set, &small);
        assert_eq!(v.workers.len(), 1);
        assert!(v.skipped.iter().any(|s| s.reason == SkipReason::TooManyWorkers));
    }
}
