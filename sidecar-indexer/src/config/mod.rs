//! The fleet description and every policy knob, parsed once into one validated [`Config`].
//!
//! The file (TOML, or YAML by extension) is *the* fleet description: the e2e harness writes it and
//! renders the Envoy bootstrap from the same file, so its keys are a contract (see README). Values
//! come from three layers, later wins: built-in defaults, the file, then `KVMESH_<SECTION>_<KEY>`
//! environment variables (`KVMESH_LISTEN`, `KVMESH_MODEL_BLOCK_SIZE`, `KVMESH_ROUTING_OVERLAP_CREDIT`
//! …). The environment is read through [`EnvSource`] so tests never touch the process environment.
//! Overrides are applied to the parsed document *before* typing, so an override is validated exactly
//! like a file value and there is one shape of the configuration, not two.
//!
//! Layout: this module holds [`Config`] itself, the model and gateway sections, loading (file →
//! overrides → typing → validation) and the warnings; `routing` owns [`RoutingConfig`] with its
//! defaults and checks, `workers` the fleet's members (`[[workers]]`, `[discovery]`), `env` the
//! override sources and how an override is applied.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use kvmesh_core::filter_config::{self, FilterConfig};
use serde::{Deserialize, Serialize};

use env::apply_env;

mod env;
mod models;
mod routing;
mod workers;

pub use env::{EnvSource, MapEnv, ProcessEnv, ENV_PREFIX};
pub use models::{ModelConfig, MAX_ADAPTERS_PER_MODEL, MAX_MODELS};
pub use routing::{IndexMode, KvMigration, RoutingConfig, SessionPlacement};
pub use workers::{offset_endpoint, DiscoverySection, WorkerConfig};

/// Why a configuration was refused.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    #[error("cannot read {path}: {reason}")]
    Io { path: PathBuf, reason: String },
    #[error("cannot parse configuration: {0}")]
    Parse(String),
    #[error("environment variable {var}: {reason}")]
    Env { var: String, reason: String },
    #[error("invalid {field} = {value:?}: {reason}")]
    InvalidValue { field: String, value: String, reason: String },
}

fn invalid(
    field: impl Into<String>,
    value: impl ToString,
    reason: impl Into<String>,
) -> ConfigError {
    ConfigError::InvalidValue {
        field: field.into(),
        value: value.to_string(),
        reason: reason.into(),
    }
}

/// The validated configuration of one indexer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// `ip:port` of the HTTP API (port 0 = any free port, reported on the `READY` line). The API
    /// has no authentication: keep it on loopback (the filter reaches it there).
    pub listen: String,
    /// `ip:port` of a second listener serving only `/metrics`, `/healthz` and `/readyz`, for
    /// scrapers and probes from outside the pod while `listen` stays on loopback; none = no second
    /// listener.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// Serve `/debug/workers` and `/debug/blocks` on `listen`. Default: only when `listen` is a
    /// loopback address (they dump fleet and index state).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub debug_endpoints: Option<bool>,
    /// The base models, the default first: the file's `[model]` or `[[models]]` (config/models.rs).
    #[serde(default)]
    pub models: Vec<ModelConfig>,
    /// Read by the Envoy renderer; accepted and kept, never used by the indexer.
    #[serde(default)]
    pub gateway: GatewayConfig,
    /// The wasm filter's settings (`[filter]`), typed and validated by the filter's own
    /// [`FilterConfig`] (a typo is an error naming the key); the indexer reads only
    /// `indexer_timeout_ms` (to warn when a leg cannot finish inside the route call). Printed by
    /// `--check` with `override_secret` redacted.
    #[serde(default, serialize_with = "redacted_filter")]
    pub filter: FilterConfig,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// Workers found at run time besides `workers` (`[discovery.kubernetes]`; see [`DiscoverySection`]).
    #[serde(default, skip_serializing_if = "DiscoverySection::is_empty")]
    pub discovery: DiscoverySection,
    /// The Gateway API Inference Extension endpoint picker (`[epp]`, `crate::epp`): off unless
    /// `epp.listen` is set.
    #[serde(default, skip_serializing_if = "EppConfig::is_off")]
    pub epp: EppConfig,
}

/// `[epp]`: the ext_proc endpoint picker that GIE gateways call (`crate::epp`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EppConfig {
    /// `ip:port` of the ext_proc gRPC server (GIE's convention: port 9002), plaintext HTTP/2; none
    /// = no endpoint picker. It answers gRPC health too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// `ip:port` of a listener serving only gRPC health (GIE's convention: port 9003); none = health
    /// on `listen` only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_listen: Option<String>,
    /// Honour the GIE conformance suite's `test-epp-endpoint-selection` request header (the
    /// client names the endpoints) and echo the served endpoint in
    /// `x-conformance-test-served-endpoint`. For conformance runs only: it lets clients choose.
    #[serde(default)]
    pub conformance: bool,
}

impl EppConfig {
    fn is_off(&self) -> bool {
        self == &Self::default()
    }

    /// The ext_proc and health-only addresses, when set.
    pub fn addrs(&self) -> Result<(Option<SocketAddr>, Option<SocketAddr>), ConfigError> {
        let parse = |field: &str, v: &Option<String>| {
            v.as_deref()
                .map(|a| a.parse().map_err(|_| invalid(field, a, "must be ip:port")))
                .transpose()
        };
        let listen = parse("epp.listen", &self.listen)?;
        let health = parse("epp.health_listen", &self.health_listen)?;
        if health.is_some() && listen.is_none() {
            return Err(invalid(
                "epp.health_listen",
                self.health_listen.as_deref().unwrap_or_default(),
                "needs epp.listen (health of a picker that is not served)",
            ));
        }
        Ok((listen, health))
    }
}

/// Serialises `[filter]` with a non-empty `override_secret` replaced by `(redacted)`: `--check`
/// prints the configuration, and the secret must not end up in a terminal or a CI log.
fn redacted_filter<S: serde::Serializer>(filter: &FilterConfig, s: S) -> Result<S::Ok, S::Error> {
    let mut shown = filter.clone();
    if !shown.override_secret.is_empty() {
        shown.override_secret = "(redacted)".to_owned();
    }
    shown.serialize(s)
}

/// The gateway's addresses (for the Envoy renderer). Unknown keys are kept in `extra`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GatewayConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<String>,
    #[serde(flatten)]
    pub extra: BTreeMap<String, toml::Value>,
}

impl Config {
    /// Parses TOML text, applies `KVMESH_*` overrides from `env`, and validates.
    pub fn from_toml_str(text: &str, env: &dyn EnvSource) -> Result<Self, ConfigError> {
        let doc: toml::Table =
            text.parse().map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
        Self::from_table(doc, env)
    }

    /// Parses YAML text (same keys), applies overrides, and validates.
    pub fn from_yaml_str(text: &str, env: &dyn EnvSource) -> Result<Self, ConfigError> {
        let value: serde_json::Value =
            serde_yaml::from_str(text).map_err(|e| ConfigError::Parse(e.to_string()))?;
        let doc = toml::Table::deserialize(value).map_err(|e| ConfigError::Parse(e.to_string()))?;
        Self::from_table(doc, env)
    }

    /// Reads `path` (`.yaml`/`.yml` as YAML, anything else as TOML).
    pub fn load(path: &Path, env: &dyn EnvSource) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::Io { path: path.to_owned(), reason: e.to_string() })?;
        match path.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => Self::from_yaml_str(&text, env),
            _ => Self::from_toml_str(&text, env),
        }
    }

    fn from_table(mut doc: toml::Table, env: &dyn EnvSource) -> Result<Self, ConfigError> {
        models::normalize(&mut doc)?;
        apply_env(&mut doc, env)?;
        let config: Config = toml::Value::Table(doc)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
        config.validate()?;
        Ok(config)
    }

    /// The default model (the first): what a request without `model` gets. A validated
    /// configuration has one; a hand-built one without any gets an empty placeholder.
    pub fn model(&self) -> &ModelConfig {
        static NONE: std::sync::LazyLock<ModelConfig> = std::sync::LazyLock::new(|| ModelConfig {
            name: String::new(),
            aliases: Vec::new(),
            block_size: 16,
            tokenizer: None,
            chat_template: None,
            bos_token: String::new(),
            adapters: Vec::new(),
        });
        self.models.first().unwrap_or(&NONE)
    }

    /// The base model `name`'s configuration.
    pub fn model_named(&self, name: &str) -> Option<&ModelConfig> {
        self.models.iter().find(|m| m.name == name)
    }

    /// The base model worker `w` serves: its `model`, else the default.
    pub fn worker_model<'a>(&'a self, w: &'a WorkerConfig) -> &'a str {
        w.model.as_deref().unwrap_or(&self.model().name)
    }

    /// The metrics listener's address, parsed, if one is configured.
    pub fn metrics_addr(&self) -> Result<Option<SocketAddr>, ConfigError> {
        self.metrics_listen
            .as_deref()
            .map(|m| m.parse().map_err(|_| invalid("metrics_listen", m, "must be ip:port")))
            .transpose()
    }

    /// Whether `/debug/*` is served (see [`Config::debug_endpoints`]).
    pub fn debug_enabled(&self) -> bool {
        self.debug_endpoints
            .unwrap_or_else(|| self.listen_addr().is_ok_and(|a| a.ip().is_loopback()))
    }

    /// The listen address, parsed (validated at load, so this only fails on hand-built configs).
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen.parse().map_err(|_| invalid("listen", &self.listen, "must be ip:port"))
    }

    /// Checks every value; the first problem is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let api = self.listen_addr()?;
        if let Some(m) = self.metrics_addr()? {
            if m.port() != 0 && m == api {
                return Err(invalid("metrics_listen", m, "must differ from listen"));
            }
        }
        models::validate_models(&self.models, &self.workers)?;
        self.filter.clone().validated().map_err(|e| match e {
            filter_config::ConfigError::InvalidValue { field, value, reason } => {
                invalid(format!("filter.{field}"), value, reason)
            }
            other => ConfigError::Parse(format!("[filter]: {other}")),
        })?;
        self.routing.validate()?;
        workers::validate_workers(&self.workers)?;
        self.discovery.validate()?;
        let (epp, health) = self.epp.addrs()?;
        for (field, addr) in [("epp.listen", epp), ("epp.health_listen", health)] {
            if let Some(a) = addr.filter(|a| a.port() != 0) {
                if a == api || Some(a) == self.metrics_addr()? {
                    return Err(invalid(field, a, "must differ from listen and metrics_listen"));
                }
            }
        }
        if epp.is_some_and(|e| e.port() != 0 && Some(e) == health) {
            return Err(invalid(
                "epp.health_listen",
                self.epp.health_listen.as_deref().unwrap_or_default(),
                "must differ from epp.listen",
            ));
        }
        Ok(())
    }
}

impl Config {
    /// Settings that are valid but probably not what the operator wants, as log-ready sentences.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let r = &self.routing;
        let leg_ms = [
            (r.min_remote_prefill_tokens > 0)
                .then_some(("prefill_timeout_ms", r.prefill_timeout_ms)),
            (r.kv_migration == KvMigration::On)
                .then_some(("kv_migration_timeout_ms", r.kv_migration_timeout_ms)),
        ];
        // The filter's deadline for the route call: the fleet's `[filter]` value, else the filter's default.
        let filter_ms = self.filter.indexer_timeout_ms;
        for (knob, ms) in leg_ms.into_iter().flatten() {
            if filter_ms <= ms {
                out.push(format!(
                    "filter.indexer_timeout_ms {filter_ms} <= routing.{knob} {ms}: the filter gives up on a route call before its leg can finish (set it above)"
                ));
            }
        }
        if r.session_placement == SessionPlacement::Sticky {
            out.push("routing.session_placement = \"sticky\" is deprecated: it now means \"predicted\" (a session stays where its KV is while that is predicted near-fastest)".to_owned());
        }
        let d = RoutingConfig::default();
        for (knob, v, default) in [
            ("overlap_credit", r.overlap_credit, d.overlap_credit),
            ("prefill_load_scale", r.prefill_load_scale, d.prefill_load_scale),
        ] {
            if v != default {
                out.push(format!("routing.{knob} is no longer used: workers are compared by predicted time to first token"));
            }
        }
        if r.local_continuations && r.min_remote_prefill_tokens == 0 {
            out.push("routing.local_continuations has no effect while min_remote_prefill_tokens = 0 (disaggregation off)".to_owned());
        }
        out
    }
}

#[cfg(test)]
mod tests;
