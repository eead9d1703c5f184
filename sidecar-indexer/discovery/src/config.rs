//! Discovery configuration: which Service (or InferencePool) to follow and how to turn its
//! endpoints into workers.
//!
//! Two sources, exactly one configured: `service` (the Service's EndpointSlices) or
//! `inference_pool` (a Gateway API Inference Extension `InferencePool`: its selector's Ready pods ×
//! its target ports, `crate::pool`). One validated [`DiscoveryConfig`], deserialised from the indexer's config file (a
//! `[discovery.kubernetes]` table, say) with `deny_unknown_fields` so a typo fails at start instead of
//! silently discovering nothing. Every bound the watcher keeps is a field here, with its default.

use std::time::Duration;

use kvmesh_core::api::Role;
use serde::{Deserialize, Serialize};

/// Label the EndpointSlice controller puts on every slice of a Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Default pod label holding a worker's role (`decode`, `prefill` or `both`).
pub const DEFAULT_ROLE_LABEL: &str = "kvmesh.io/role";

/// Default pod label holding the base model a worker serves (none = the fleet's default model).
pub const DEFAULT_MODEL_LABEL: &str = "kvmesh.io/model";

/// Largest accepted `grace_period_ms` (one hour): longer would keep a dead worker's blocks for ever.
pub const MAX_GRACE_MS: u64 = 3_600_000;

/// A port given by number, or by the name of a port the Service exposes (looked up in each slice).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PortRef {
    /// A fixed container port on the pod's IP.
    Number(u16),
    /// The port of that name in the EndpointSlice's `ports`.
    Name(String),
}

/// Validated Kubernetes discovery settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoveryConfig {
    /// Namespace of the model Service and its pods.
    pub namespace: String,
    /// The model Service whose EndpointSlices list the workers (slices are selected by
    /// `kubernetes.io/service-name=<service>`). Empty when `inference_pool` is set.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// The `inference.networking.k8s.io/v1` InferencePool (in `namespace`) whose selected Ready
    /// pods, one worker per pod and target port, are the workers. Empty = Service mode.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub inference_pool: String,
    /// Label selector for the pod watch that supplies role labels (e.g. `app=vllm`). Empty = every
    /// pod of the namespace (works, but watches more than needed). Service mode only: a pool's
    /// own selector chooses its pods.
    pub pod_selector: String,
    /// Pod label whose value is the worker's role.
    pub role_label: String,
    /// Pod label whose value is the base model the worker serves (a model of the fleet); a pod
    /// without it serves the fleet's default model.
    pub model_label: String,
    /// Role of a pod without the label; `None` (`"none"` in the file) leaves such pods out
    /// (counted as skipped).
    #[serde(deserialize_with = "role_or_none", serialize_with = "none_or_role")]
    pub default_role: Option<Role>,
    /// Name of the Service port serving the OpenAI API (the worker's HTTP endpoint). Service mode
    /// only: a pool's `targetPorts` are the HTTP endpoints.
    pub http_port: String,
    /// Where the worker publishes KV events: `tcp://<pod ip>:<port>`. In pool mode a name is looked
    /// up in the pod's container ports, and the worker of the pool's i-th target port (data-parallel
    /// rank i) uses port + i, as vLLM offsets a rank's publisher.
    pub kv_events_port: PortRef,
    /// The worker's replay (ROUTER) socket, if it has one (`"none"` in the file: no replay socket).
    #[serde(deserialize_with = "port_or_none", serialize_with = "none_or_port")]
    pub kv_replay_port: Option<PortRef>,
    /// How long a worker that vanished from the slices keeps its index entries. It is not routable
    /// from the moment it vanishes; if it comes back within the grace period nothing is lost.
    pub grace_period_ms: u64,
    /// Most workers tracked; endpoints beyond it are skipped (bounds memory and event sockets).
    pub max_workers: usize,
    /// Capacity of the update channel to the indexer (updates are full snapshots plus deltas;
    /// a full channel makes the watcher wait, it never drops one).
    pub channel_capacity: usize,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            namespace: "default".to_owned(),
            service: String::new(),
            inference_pool: String::new(),
            pod_selector: String::new(),
            role_label: DEFAULT_ROLE_LABEL.to_owned(),
            model_label: DEFAULT_MODEL_LABEL.to_owned(),
            default_role: Some(Role::Both),
            http_port: "http".to_owned(),
            kv_events_port: PortRef::Number(5557),
            kv_replay_port: Some(PortRef::Number(5558)),
            grace_period_ms: 30_000,
            max_workers: 1024,
            channel_capacity: 16,
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A field holds a value outside its contract.
    #[error("discovery.{field} = {value:?}: {reason}")]
    InvalidValue {
        /// The field name.
        field: &'static str,
        /// The offending value.
        value: String,
        /// What the field must be.
        reason: &'static str,
    },
}

impl DiscoveryConfig {
    /// Checks every field; returns the config unchanged when valid.
    pub fn validated(self) -> Result<Self, ConfigError> {
        fn bad(field: &'static str, value: impl ToString, reason: &'static str) -> ConfigError {
            ConfigError::InvalidValue { field, value: value.to_string(), reason }
        }
        if !is_dns_label(&self.namespace) {
            return Err(bad("namespace", &self.namespace, "must be a Kubernetes namespace name"));
        }
        if self.inference_pool.is_empty() {
            if !is_dns_label(&self.service) {
                return Err(bad(
                    "service",
                    &self.service,
                    "must name the model Service (or set inference_pool instead)",
                ));
            }
        } else {
            if !self.service.is_empty() {
                return Err(bad(
                    "service",
                    &self.service,
                    "set either service or inference_pool, not both",
                ));
            }
            if !is_dns_subdomain(&self.inference_pool) {
                return Err(bad(
                    "inference_pool",
                    &self.inference_pool,
                    "must be an InferencePool name (DNS subdomain)",
                ));
            }
            if !self.pod_selector.is_empty() {
                return Err(bad(
                    "pod_selector",
                    &self.pod_selector,
                    "must be empty with inference_pool (the pool's selector chooses the pods)",
                ));
            }
        }
        if self.role_label.trim().is_empty() || self.role_label.contains(char::is_whitespace) {
            return Err(bad("role_label", &self.role_label, "must be a label key"));
        }
        if self.model_label.trim().is_empty() || self.model_label.contains(char::is_whitespace) {
            return Err(bad("model_label", &self.model_label, "must be a label key"));
        }
        if self.http_port.trim().is_empty() {
            return Err(bad("http_port", &self.http_port, "must name a Service port"));
        }
        check_port("kv_events_port", &self.kv_events_port)?;
        if let Some(p) = &self.kv_replay_port {
            check_port("kv_replay_port", p)?;
        }
        if self.grace_period_ms > MAX_GRACE_MS {
            return Err(bad("grace_period_ms", self.grace_period_ms, "must be at most 3600000"));
        }
        if !(1..=100_000).contains(&self.max_workers) {
            return Err(bad("max_workers", self.max_workers, "must be within 1..=100000"));
        }
        if !(1..=4096).contains(&self.channel_capacity) {
            return Err(bad("channel_capacity", self.channel_capacity, "must be within 1..=4096"));
        }
        Ok(self)
    }

    /// The grace period as a duration.
    pub fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_period_ms)
    }

    /// The label selector of the Service's EndpointSlices.
    pub fn slice_selector(&self) -> String {
        format!("{SERVICE_NAME_LABEL}={}", self.service)
    }

    /// Whether workers come from an InferencePool (else from the Service's EndpointSlices).
    pub fn pool_mode(&self) -> bool {
        !self.inference_pool.is_empty()
    }

    /// The field selector that lists and watches the one InferencePool.
    pub fn pool_field_selector(&self) -> String {
        format!("metadata.name={}", self.inference_pool)
    }
}

/// `"decode" | "prefill" | "both"`, or `"none"` / null for no default (TOML has no null).
fn role_or_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Role>, D::Error> {
    match Option::<String>::deserialize(d)?.as_deref() {
        None | Some("none") => Ok(None),
        Some(other) => {
            Role::deserialize(serde::de::value::StrDeserializer::<D::Error>::new(other)).map(Some)
        }
    }
}

/// Writes `None` as `"none"`, so a normalised config read back means the same (TOML has no null).
fn none_or_role<S: serde::Serializer>(role: &Option<Role>, s: S) -> Result<S::Ok, S::Error> {
    match role {
        Some(r) => r.serialize(s),
        None => s.serialize_str("none"),
    }
}

/// A port, or `"none"` / null for no port (omitting the key means the default, so TOML needs a word).
fn port_or_none<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<PortRef>, D::Error> {
    match Option::<PortRef>::deserialize(d)? {
        Some(PortRef::Name(n)) if n == "none" => Ok(None),
        other => Ok(other),
    }
}

fn none_or_port<S: serde::Serializer>(port: &Option<PortRef>, s: S) -> Result<S::Ok, S::Error> {
    match port {
        Some(p) => p.serialize(s),
        None => s.serialize_str("none"),
    }
}

fn check_port(field: &'static str, port: &PortRef) -> Result<(), ConfigError> {
    let ok = match port {
        PortRef::Number(n) => *n > 0,
        PortRef::Name(name) => !name.trim().is_empty(),
    };
    if ok {
        Ok(())
    } else {
        Err(ConfigError::InvalidValue {
            field,
            value: format!("{port:?}"),
            reason: "must be a port number > 0 or a port name",
        })
    }
}

/// RFC 1123 subdomain: what Kubernetes accepts for most object names (an InferencePool's).
fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// RFC 1123 label: what Kubernetes accepts for namespace and Service names.
fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> DiscoveryConfig {
        DiscoveryConfig { service: "vllm".into(), ..DiscoveryConfig::default() }
    }

    #[test]
    fn defaults_need_only_a_service() {
        assert!(DiscoveryConfig::default().validated().is_err());
        let cfg = base().validated().unwrap();
        assert_eq!(cfg.slice_selector(), "kubernetes.io/service-name=vllm");
        assert_eq!(cfg.grace(), Duration::from_secs(30));
        assert!(!cfg.pool_mode());
    }

    #[test]
    fn a_pool_replaces_the_service() {
        let cfg =
            DiscoveryConfig { inference_pool: "vllm-pool.v1".into(), ..DiscoveryConfig::default() }
                .validated()
                .unwrap();
        assert!(cfg.pool_mode());
        assert_eq!(cfg.pool_field_selector(), "metadata.name=vllm-pool.v1");
        let parsed: DiscoveryConfig =
            serde_json::from_str(r#"{"namespace":"llm","inference_pool":"vllm"}"#).unwrap();
        assert_eq!(parsed.validated().unwrap().inference_pool, "vllm");
    }

    #[test]
    fn refuses_bad_values() {
        let cases: Vec<(&str, DiscoveryConfig)> = vec![
            ("namespace", DiscoveryConfig { namespace: "Bad_NS".into(), ..base() }),
            ("service", DiscoveryConfig { service: "-x".into(), ..base() }),
            ("service", DiscoveryConfig { inference_pool: "pool".into(), ..base() }),
            (
                "inference_pool",
                DiscoveryConfig { service: String::new(), inference_pool: "Pool".into(), ..base() },
            ),
            (
                "pod_selector",
                DiscoveryConfig {
                    service: String::new(),
                    inference_pool: "pool".into(),
                    pod_selector: "app=vllm".into(),
                    ..base()
                },
            ),
            ("role_label", DiscoveryConfig { role_label: " ".into(), ..base() }),
            ("http_port", DiscoveryConfig { http_port: String::new(), ..base() }),
            ("kv_events_port", DiscoveryConfig { kv_events_port: PortRef::Number(0), ..base() }),
            (
                "kv_replay_port",
                DiscoveryConfig { kv_replay_port: Some(PortRef::Name(String::new())), ..base() },
            ),
            ("grace_period_ms", DiscoveryConfig { grace_period_ms: MAX_GRACE_MS + 1, ..base() }),
            ("max_workers", DiscoveryConfig { max_workers: 0, ..base() }),
            ("channel_capacity", DiscoveryConfig { channel_capacity: 0, ..base() }),
        ];
        for (field, cfg) in cases {
            match cfg.validated() {
                Err(ConfigError::InvalidValue { field: f, .. }) => assert_eq!(f, field),
                Ok(_) => panic!("{field} accepted"),
            }
        }
    }

    #[test]
    fn parses_ports_by_number_or_name_and_refuses_unknown_fields() {
        let cfg: DiscoveryConfig = serde_json::from_str(
            r#"{"service":"vllm","kv_events_port":"kv-events","kv_replay_port":5600,"default_role":null}"#,
        )
        .unwrap();
        assert_eq!(cfg.kv_events_port, PortRef::Name("kv-events".into()));
        assert_eq!(cfg.kv_replay_port, Some(PortRef::Number(5600)));
        assert_eq!(cfg.default_role, None);
        assert!(serde_json::from_str::<DiscoveryConfig>(r#"{"service":"vllm","grace":1}"#).is_err());
        let roles: Vec<Option<Role>> = ["\"none\"", "\"prefill\"", "\"both\""]
            .iter()
            .map(|r| {
                serde_json::from_str::<DiscoveryConfig>(&format!(
                    r#"{{"service":"vllm","default_role":{r}}}"#
                ))
                .unwrap()
                .default_role
            })
            .collect();
        assert_eq!(roles, [None, Some(Role::Prefill), Some(Role::Both)]);
        assert!(serde_json::from_str::<DiscoveryConfig>(
            r#"{"service":"vllm","default_role":"turbo"}"#
        )
        .is_err());
    }

    #[test]
    fn none_is_written_so_that_it_reads_back() {
        let cases = [
            DiscoveryConfig { default_role: None, kv_replay_port: None, ..base() },
            DiscoveryConfig { kv_replay_port: Some(PortRef::Name("kv-replay".into())), ..base() },
            base(),
        ];
        for cfg in cases {
            let text = serde_json::to_string(&cfg).unwrap();
            assert_eq!(serde_json::from_str::<DiscoveryConfig>(&text).unwrap(), cfg, "{text}");
        }
        let none: DiscoveryConfig =
            serde_json::from_str(r#"{"service":"vllm","kv_replay_port":"none"}"#).unwrap();
        assert_eq!(none.kv_replay_port, None);
    }
}
