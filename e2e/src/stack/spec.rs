//! What a stack is made of ([`StackSpec`]): the workers, Envoy's load balancing, the indexer's
//! and the filter's configuration, and the fixed ports of `make run`. Pure data and its checks;
//! [`super::Stack::start`] starts it.

use std::path::PathBuf;

use kvmesh_core::api::Role;

use crate::worker::WorkerSpec;

/// Which load balancing Envoy does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvoyPolicy {
    /// The kvmesh filter and indexer choose the endpoint.
    Kvmesh,
    RoundRobin,
    LeastRequest,
    /// Consistent hashing of the session header (Envoy ring_hash).
    RingHash,
}

impl EnvoyPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Kvmesh => "kvmesh",
            Self::RoundRobin => "round_robin",
            Self::LeastRequest => "least_request",
            Self::RingHash => "ring_hash",
        }
    }
}

/// Fixed ports (for `make run`); tests leave them unset and get free ones.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ports {
    pub gateway: Option<u16>,
    pub admin: Option<u16>,
    pub indexer: Option<u16>,
}

#[derive(Debug, Clone)]
pub struct StackSpec {
    pub workers: Vec<WorkerSpec>,
    pub policy: EnvoyPolicy,
    pub block_size: u32,
    /// `vllm-sim` flags for every worker (cache size, speed-up, timing).
    pub sim_args: Vec<String>,
    /// Whether workers publish KV events (off for the approximate-mode baseline).
    pub kv_events: bool,
    /// Extra lines for the indexer's `[routing]` table, e.g. `mode = "approximate"`.
    pub routing_toml: String,
    /// Extra lines for the indexer's `[model]` table, e.g. `chat_template = "…"`.
    pub model_toml: String,
    /// Fields merged over the filter's default plugin configuration.
    pub filter_config: serde_json::Value,
    pub session_header: String,
    pub max_body_bytes: u64,
    pub ports: Ports,
    /// Use `target/release` binaries.
    pub release: bool,
    /// Keep logs and generated files here instead of a temporary directory.
    pub work_dir: Option<PathBuf>,
    /// What the workers are: simulators (default), real vLLM engines, or external engines.
    pub engines: crate::vllm::Engines,
    /// Envoy's bound on connections and calls to the indexer (bootstrap `indexer_max_connections`).
    pub indexer_max_connections: u32,
    /// The wasm filter's `failure_policy` (bootstrap `wasm_failure_policy`).
    pub wasm_failure_policy: String,
    /// Envoy's worker threads (`--concurrency`).
    pub envoy_concurrency: usize,
    /// Envoy's overload manager settings (heap budget, client connections).
    pub envoy_limits: crate::envoy_config::EnvoyLimits,
}

impl StackSpec {
    /// The filter's plugin configuration: the session header, with `filter_config` merged over.
    pub fn filter_config_json(&self) -> serde_json::Value {
        let mut base = serde_json::json!({ "session_header": self.session_header });
        if let (Some(base), Some(extra)) = (base.as_object_mut(), self.filter_config.as_object()) {
            for (k, v) in extra {
                base.insert(k.clone(), v.clone());
            }
        }
        base
    }

    /// The filter's configuration has one definition (core's `FilterConfig`): a typo in a test's
    /// `filter_config` is an error before anything starts, naming the key, not an Envoy that
    /// refuses to load the filter.
    pub fn check_filter_config(&self) -> anyhow::Result<()> {
        let filter = self.filter_config_json().to_string();
        kvmesh_core::filter_config::FilterConfig::from_bytes(Some(filter.as_bytes()))
            .map(drop)
            .map_err(|e| anyhow::anyhow!("the test's filter_config {filter}: {e}"))
    }

    /// `n` aggregate workers (`both`), kvmesh routing, small cache, fast timing.
    pub fn aggregate(n: usize) -> Self {
        Self {
            workers: (0..n).map(|i| WorkerSpec::new(format!("w{i}"), Role::Both)).collect(),
            policy: EnvoyPolicy::Kvmesh,
            block_size: 16,
            sim_args: Vec::new(),
            kv_events: true,
            routing_toml: String::new(),
            model_toml: String::new(),
            filter_config: serde_json::json!({}),
            session_header: kvmesh_core::headers::DEFAULT_SESSION_HEADER.to_owned(),
            max_body_bytes: 8 * 1024 * 1024,
            ports: Ports::default(),
            release: false,
            work_dir: None,
            engines: crate::vllm::Engines::Sim,
            indexer_max_connections: crate::envoy_config::DEFAULT_INDEXER_MAX_CONNECTIONS,
            wasm_failure_policy: crate::envoy_config::DEFAULT_WASM_FAILURE_POLICY.to_owned(),
            envoy_concurrency: 2,
            envoy_limits: crate::envoy_config::EnvoyLimits::default(),
        }
    }

    /// `prefill` prefill workers (`p0`, `p1`, …) and `decode` decode workers (`d0`, …), kvmesh
    /// routing; the caller sets the modes in `routing_toml` and the filter's deadline to cover legs.
    pub fn disaggregated(prefill: usize, decode: usize) -> Self {
        let workers = (0..prefill)
            .map(|i| WorkerSpec::new(format!("p{i}"), Role::Prefill))
            .chain((0..decode).map(|i| WorkerSpec::new(format!("d{i}"), Role::Decode)))
            .collect();
        Self { workers, ..Self::aggregate(0) }
    }
}

#[cfg(test)]
mod filter_config_tests {
    use super::StackSpec;

    #[test]
    fn a_typo_in_a_tests_filter_config_is_an_error_naming_it() {
        let mut spec = StackSpec::aggregate(1);
        spec.filter_config = serde_json::json!({"debug_headers": true, "indexer_timeout_ms": 500});
        assert!(spec.check_filter_config().is_ok());
        spec.filter_config = serde_json::json!({"debug_hedaers": true});
        let err = spec.check_filter_config().unwrap_err().to_string();
        assert!(err.contains("debug_hedaers"), "{err}");
    }
}
