//! The fleet's members: the static `[[workers]]` entries ([`WorkerConfig`], their dp-rank
//! endpoints and their checks) and the `[discovery]` section that adds workers at run time.

use std::net::SocketAddr;

use kvmesh_core::api::Role;
use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

/// One inference worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub id: String,
    /// The base model it serves (a `[[models]]` name); none = the default (first) model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub role: Role,
    /// `ip:port` of its OpenAI HTTP server (also where `/metrics` is scraped).
    pub endpoint: String,
    /// ZMQ PUB endpoint of its KV events (`tcp://ip:port`); none = no events from this worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_events: Option<String>,
    /// ZMQ ROUTER endpoint for replay; none = gaps clear the worker instead of replaying.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_replay: Option<String>,
    /// Data-parallel ranks; rank r publishes on port +r of both endpoints, like vLLM.
    #[serde(default = "one")]
    pub dp_ranks: u32,
    /// Bind the SUB socket instead of connecting (engines that *connect* their PUB, e.g. vLLM with a
    /// concrete `tcp://host:port` endpoint).
    #[serde(default)]
    pub kv_events_bind: bool,
    /// ZMQ subscription prefix ("" = every topic).
    #[serde(default)]
    pub kv_topic: String,
}

fn one() -> u32 {
    1
}

impl WorkerConfig {
    /// The events endpoint of `rank` (port + rank).
    pub fn events_endpoint(&self, rank: u32) -> Option<String> {
        self.kv_events.as_deref().and_then(|e| offset_endpoint(e, rank))
    }
    /// The replay endpoint of `rank` (port + rank).
    pub fn replay_endpoint(&self, rank: u32) -> Option<String> {
        self.kv_replay.as_deref().and_then(|e| offset_endpoint(e, rank))
    }
    /// Whether the event wiring (not the HTTP side) of two versions of a worker differs.
    pub fn events_differ(&self, other: &WorkerConfig) -> bool {
        self.kv_events != other.kv_events
            || self.kv_replay != other.kv_replay
            || self.dp_ranks != other.dp_ranks
            || self.kv_events_bind != other.kv_events_bind
            || self.kv_topic != other.kv_topic
    }
}

/// `tcp://host:port` with the port moved by `rank` (vLLM's `offset_endpoint_port`). Other schemes
/// get `_dp<rank>` appended for rank > 0.
pub fn offset_endpoint(endpoint: &str, rank: u32) -> Option<String> {
    if rank == 0 {
        return Some(endpoint.to_owned());
    }
    if let Some(rest) = endpoint.strip_prefix("tcp://") {
        let (host, port) = rest.rsplit_once(':')?;
        let port: u32 = port.parse().ok()?;
        let moved = u16::try_from(port + rank).ok()?;
        return Some(format!("tcp://{host}:{moved}"));
    }
    Some(format!("{endpoint}_dp{rank}"))
}

/// Checks every `[[workers]]` entry in order; the first problem is returned.
pub(super) fn validate_workers(workers: &[WorkerConfig]) -> Result<(), ConfigError> {
    let mut seen = std::collections::HashSet::new();
    for (i, w) in workers.iter().enumerate() {
        let field = |k: &str| format!("workers[{i}].{k}");
        if w.id.trim().is_empty() || w.id.contains(char::is_whitespace) {
            return Err(invalid(field("id"), &w.id, "must be non-empty without whitespace"));
        }
        if !seen.insert(w.id.as_str()) {
            return Err(invalid(field("id"), &w.id, "duplicate worker id"));
        }
        if w.endpoint.parse::<SocketAddr>().is_err() {
            return Err(invalid(field("endpoint"), &w.endpoint, "must be ip:port"));
        }
        if w.dp_ranks == 0 || w.dp_ranks > 1024 {
            return Err(invalid(field("dp_ranks"), w.dp_ranks, "must be in 1..=1024"));
        }
        for (key, ep) in [("kv_events", &w.kv_events), ("kv_replay", &w.kv_replay)] {
            let Some(ep) = ep else { continue };
            if !["tcp://", "ipc://", "inproc://"].iter().any(|s| ep.starts_with(s)) {
                return Err(invalid(field(key), ep, "must start with tcp://, ipc:// or inproc://"));
            }
            if (0..w.dp_ranks).any(|r| offset_endpoint(ep, r).is_none()) {
                return Err(invalid(
                    field(key),
                    ep,
                    "needs a numeric port with room for every dp rank",
                ));
            }
        }
        if w.kv_replay.is_some() && w.kv_events.is_none() {
            return Err(invalid(
                field("kv_replay"),
                w.kv_replay.as_deref().unwrap_or(""),
                "needs kv_events",
            ));
        }
    }
    Ok(())
}

/// `[discovery]`: where workers come from besides the static `[[workers]]`. The effective fleet is
/// the file's workers plus the discovered ones (`crate::discovered`); a static id wins a collision.
/// Read at start: a change needs a restart. Not overridable from the environment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoverySection {
    /// Follow a Kubernetes Service's EndpointSlices, or (`inference_pool`) a Gateway API Inference
    /// Extension InferencePool's selected pods × target ports (crate `kvmesh-discovery`, README
    /// "Discovery").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<kvmesh_discovery::DiscoveryConfig>,
}

impl DiscoverySection {
    /// Whether no discovery is configured (the section is then left out of `--check`).
    pub fn is_empty(&self) -> bool {
        self.kubernetes.is_none()
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let Some(k) = &self.kubernetes else {
            return Ok(());
        };
        match k.clone().validated() {
            Ok(_) => Ok(()),
            Err(kvmesh_discovery::ConfigError::InvalidValue { field, value, reason }) => {
                Err(invalid(format!("discovery.kubernetes.{field}"), value, reason))
            }
        }
    }
}
