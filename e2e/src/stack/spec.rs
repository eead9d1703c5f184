//! What a stack is made of ([`StackSpec`]): the workers, the models they serve ([`ModelSpec`]),
//! Envoy's load balancing and front door ([`Edge`]: the wasm filter, the endpoint picker over
//! ext_proc, or both), the indexer's and the filter's configuration, and the fixed ports of
//! `make run`. Pure data and its checks; [`super::Stack::start`] starts it.

use std::path::PathBuf;

use kvmesh_core::api::Role;

pub use crate::envoy_config::Edge;
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
    /// The endpoint picker's ext_proc port (edges other than [`Edge::Wasm`]). Unset: the indexer
    /// binds port 0 and says which in its READY line; a restarted indexer binds that one again.
    pub epp: Option<u16>,
}

/// One base model of a fleet with several models (or with LoRA adapters): a `[[models]]` table of
/// the fleet file, and the flags its workers' engines are started with (`--served-model-name`,
/// `--block-size`, `--enable-lora --lora-modules … --max-loras`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSpec {
    /// The engines' served model name.
    pub name: String,
    /// Other names requests may use for it (the engines serve them too, as vLLM's
    /// `--served-model-name a b` does).
    pub aliases: Vec<String>,
    /// LoRA adapters every worker of this model serves (`--lora-modules`).
    pub adapters: Vec<String>,
    /// Tokens per KV block of its engines.
    pub block_size: u32,
    /// Adapter slots of each engine (`--max-loras`; vLLM's default is 1). `None`: one per
    /// adapter, so no request waits for an adapter swap unless a test asks for it.
    pub max_loras: Option<u32>,
    /// Extra lines for its `[[models]]` table, e.g. `chat_template = "…"`.
    pub extra_toml: String,
}

impl ModelSpec {
    pub fn new(name: impl Into<String>, block_size: u32) -> Self {
        Self {
            name: name.into(),
            aliases: Vec::new(),
            adapters: Vec::new(),
            block_size,
            max_loras: None,
            extra_toml: String::new(),
        }
    }

    pub fn aliases(mut self, names: &[&str]) -> Self {
        self.aliases = names.iter().map(|n| (*n).to_owned()).collect();
        self
    }

    pub fn adapters(mut self, names: &[&str]) -> Self {
        self.adapters = names.iter().map(|n| (*n).to_owned()).collect();
        self
    }

    /// This model as the fleet snapshot describes it.
    pub fn fleet_model(&self) -> kvmesh_core::models::FleetModel {
        kvmesh_core::models::FleetModel {
            name: self.name.clone(),
            aliases: self.aliases.clone(),
            adapters: self.adapters.clone(),
            block_size: self.block_size,
        }
    }

    /// The engine flags that make a `vllm-sim` (or vLLM) serve this model as the fleet file says:
    /// its names, its block size, and its adapters (each at `<adapter_dir>/<name>`).
    pub fn engine_args(&self, adapter_dir: &std::path::Path) -> Vec<String> {
        let mut args = vec!["--served-model-name".to_owned(), self.name.clone()];
        args.extend(self.aliases.iter().cloned());
        args.extend(["--block-size".to_owned(), self.block_size.to_string()]);
        if !self.adapters.is_empty() {
            args.push("--enable-lora".to_owned());
            args.push("--lora-modules".to_owned());
            args.extend(
                self.adapters.iter().map(|a| format!("{a}={}", adapter_dir.join(a).display())),
            );
            let slots = self.max_loras.unwrap_or(self.adapters.len() as u32);
            args.extend(["--max-loras".to_owned(), slots.to_string()]);
        }
        args
    }
}

#[derive(Debug, Clone)]
pub struct StackSpec {
    pub workers: Vec<WorkerSpec>,
    pub policy: EnvoyPolicy,
    /// Which front door picks under [`EnvoyPolicy::Kvmesh`]: the wasm filter (default), the
    /// indexer's endpoint picker over ext_proc (the fleet file gets `[epp] listen`), or both.
    pub edge: Edge,
    /// `[epp] conformance`: the picker honours GIE's `test-epp-endpoint-selection` request header
    /// and echoes the served endpoint (conformance runs and tests only: it lets clients choose).
    pub epp_conformance: bool,
    /// Envoy's wait for one answer of the picker (ext_proc `message_timeout`).
    pub epp_message_timeout_ms: u64,
    /// Tokens per KV block (of the first model when `models` names several).
    pub block_size: u32,
    /// The base models, the default first, when the fleet has several (or adapters): the fleet
    /// file gets `[[models]]` tables and each worker its `model`, and each simulator is started
    /// for its worker's model. Empty: one model, `deepseek-v4` at `block_size`, in a `[model]`
    /// table, as every single-model fleet is written.
    pub models: Vec<ModelSpec>,
    /// `vllm-sim` flags for every worker (cache size, speed-up, timing).
    pub sim_args: Vec<String>,
    /// Whether workers publish KV events (off for the approximate-mode baseline).
    pub kv_events: bool,
    /// Extra lines for the indexer's `[routing]` table, e.g. `mode = "approximate"`.
    pub routing_toml: String,
    /// Extra lines for the indexer's `[model]` table, e.g. `chat_template = "…"` (single-model
    /// fleets; see [`ModelSpec::extra_toml`] for the others).
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

    /// The endpoint picker is the indexer's: an edge other than [`Edge::Wasm`] needs the kvmesh
    /// policy (the baselines run Envoy alone).
    pub fn check_edge(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.policy == EnvoyPolicy::Kvmesh || self.edge == Edge::Wasm,
            "edge {} needs the kvmesh policy, not {}",
            self.edge.as_str(),
            self.policy.as_str()
        );
        Ok(())
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
            edge: Edge::Wasm,
            epp_conformance: false,
            epp_message_timeout_ms: crate::envoy_config::DEFAULT_EPP_MESSAGE_TIMEOUT_MS,
            block_size: 16,
            models: Vec::new(),
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

    /// Aggregate workers for several models: `per_model` workers of each of `models` (the first
    /// is the default), numbered `w0`, `w1`, … in the order of `models`; kvmesh routing.
    pub fn multi_model(models: Vec<ModelSpec>, per_model: usize) -> Self {
        let workers = models
            .iter()
            .flat_map(|m| std::iter::repeat_n(m.name.clone(), per_model))
            .enumerate()
            .map(|(i, model)| WorkerSpec {
                model: Some(model),
                ..WorkerSpec::new(format!("w{i}"), Role::Both)
            })
            .collect();
        let block_size = models.first().map_or(16, |m| m.block_size);
        Self { workers, block_size, models, ..Self::aggregate(0) }
    }

    /// Whether the fleet file describes its models as `[[models]]` (several models, or adapters
    /// or aliases on one) rather than one `[model]`.
    pub fn has_model_catalog(&self) -> bool {
        self.models.len() > 1
            || self.models.iter().any(|m| !m.adapters.is_empty() || !m.aliases.is_empty())
    }

    /// The model a worker whose `model` is `name` serves: that one, else (`None`) the first.
    /// `None` in a single-model spec, or for a name the spec does not list.
    pub fn model(&self, name: Option<&str>) -> Option<&ModelSpec> {
        match name {
            Some(name) => self.models.iter().find(|m| m.name == name),
            None => self.models.first(),
        }
    }

    /// Every worker names a model of `models`, every model is served by a worker, and no name
    /// (base, alias, adapter) repeats — the fleet file the indexer would refuse, refused here
    /// first with the test's own names.
    pub fn check_models(&self) -> anyhow::Result<()> {
        if self.models.is_empty() {
            if let Some(w) = self.workers.iter().find(|w| w.model.is_some()) {
                anyhow::bail!("worker {} names a model but the spec lists no models", w.id);
            }
            return Ok(());
        }
        for w in &self.workers {
            if self.model(w.model.as_deref()).is_none() {
                anyhow::bail!("worker {} serves {:?}, which the spec does not list", w.id, w.model);
            }
        }
        for m in &self.models {
            if !self
                .workers
                .iter()
                .any(|w| self.model(w.model.as_deref()).is_some_and(|x| x.name == m.name))
            {
                anyhow::bail!("model {} has no worker", m.name);
            }
        }
        let fleet: Vec<kvmesh_core::models::FleetModel> =
            self.models.iter().map(ModelSpec::fleet_model).collect();
        let dup = kvmesh_core::models::duplicate_names(&fleet);
        anyhow::ensure!(dup.is_empty(), "model names used twice: {dup:?}");
        Ok(())
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
