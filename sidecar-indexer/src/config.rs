//! The fleet description and every policy knob, parsed once into one validated [`Config`].
//!
//! The file (TOML, or YAML by extension) is *the* fleet description: the e2e harness writes it and
//! renders the Envoy bootstrap from the same file, so its keys are a contract (see README). Values
//! come from three layers, later wins: built-in defaults, the file, then `KVMESH_<SECTION>_<KEY>`
//! environment variables (`KVMESH_LISTEN`, `KVMESH_MODEL_BLOCK_SIZE`, `KVMESH_ROUTING_OVERLAP_CREDIT`
//! …). The environment is read through [`EnvSource`] so tests never touch the process environment.
//! Overrides are applied to the parsed document *before* typing, so an override is validated exactly
//! like a file value and there is one shape of the configuration, not two.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use kvmesh_core::api::Role;
use serde::{Deserialize, Serialize};

/// Prefix of every environment override.
pub const ENV_PREFIX: &str = "KVMESH_";

/// Where environment overrides come from (the process, or a map in tests).
pub trait EnvSource: Send + Sync {
    /// Every variable whose name starts with `prefix`, sorted by name.
    fn vars_with_prefix(&self, prefix: &str) -> Vec<(String, String)>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn vars_with_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| k.starts_with(prefix))
            .collect();
        out.sort();
        out
    }
}

/// A fixed set of variables, for tests.
#[derive(Debug, Clone, Default)]
pub struct MapEnv(pub BTreeMap<String, String>);

impl MapEnv {
    /// An environment holding exactly `pairs`.
    pub fn new<const N: usize>(pairs: [(&str, &str); N]) -> Self {
        Self(
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        )
    }
}

impl EnvSource for MapEnv {
    fn vars_with_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        self.0
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

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
    InvalidValue {
        field: String,
        value: String,
        reason: String,
    },
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
    pub model: ModelConfig,
    /// Read by the Envoy renderer; accepted and kept, never used by the indexer.
    #[serde(default)]
    pub gateway: GatewayConfig,
    /// The wasm filter's settings, if the fleet file carries them; accepted and kept, unused here.
    #[serde(default, skip_serializing_if = "toml::Table::is_empty")]
    pub filter: toml::Table,
    #[serde(default)]
    pub routing: RoutingConfig,
    #[serde(default)]
    pub workers: Vec<WorkerConfig>,
    /// Workers found at run time besides `workers` (`[discovery.kubernetes]`; see [`DiscoverySection`]).
    #[serde(default, skip_serializing_if = "DiscoverySection::is_empty")]
    pub discovery: DiscoverySection,
}

/// The served model: block size and tokenization.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub name: String,
    /// Tokens per KV block; must equal the engines' (`--block-size`). Events that disagree are refused.
    pub block_size: u32,
    /// The model's `tokenizer.json`; default [`kvmesh_tokens::default_tokenizer_path`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// A Jinja2 chat template file; default the built-in DeepSeek template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
    /// `bos_token` given to a chat template loaded from `chat_template`.
    #[serde(default = "default_bos")]
    pub bos_token: String,
}

fn default_bos() -> String {
    "<｜begin▁of▁sentence｜>".to_owned()
}

impl ModelConfig {
    /// The tokenizer file to load.
    pub fn tokenizer_path(&self) -> PathBuf {
        self.tokenizer
            .clone()
            .unwrap_or_else(kvmesh_tokens::default_tokenizer_path)
    }
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

/// Where the index learns what each worker caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexMode {
    /// From the engines' KV events (exact, needs `kv_events`).
    Precise,
    /// From the indexer's own routing decisions, with a TTL and a size bound (engines without events).
    Approximate,
}

impl IndexMode {
    /// The wire / label name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Precise => "precise",
            Self::Approximate => "approximate",
        }
    }
}

/// `kv_migration`: whether decode-to-decode KV migration runs, is only counted, or is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvMigration {
    /// Never migrate; no opportunity is counted.
    Off,
    /// Count and log (sampled) the would-migrate decisions; send nothing.
    Dry,
    /// Run the producer handshake on the source and let the target pull the blocks.
    On,
}

impl KvMigration {
    /// The config / label name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Dry => "dry",
            Self::On => "on",
        }
    }
}

/// Where a session's home is (`session_placement`). Either way a session stays home while that is
/// the best or near-best choice by predicted TTFT and moves past `session_move_margin(_ms)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionPlacement {
    /// Home = where its KV is: the session's last decode worker (`kv_home`); a new session (or one
    /// whose home was forgotten) goes where it is predicted fastest.
    Predicted,
    /// Home = the rendezvous-hash worker of the key (what the filter's fallback pins to).
    Rendezvous,
    /// Deprecated alias of `predicted` (the old "first by cost, then where last served"); warns.
    Sticky,
}

/// Every policy knob and bound. Defaults are the documented ones (README, "Configuration").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `precise` (KV events) or `approximate` (learn from own decisions).
    pub mode: IndexMode,
    /// Deprecated, ignored (the block-count cost it weighted is gone; a value other than 1 warns).
    pub overlap_credit: f64,
    /// Deprecated, ignored (as `overlap_credit`).
    pub prefill_load_scale: f64,
    /// Softmax temperature over normalised costs; 0 = argmin with random tie-break.
    pub temperature: f64,
    /// Fallback endpoints returned with each decision (Envoy retries them in order).
    pub max_fallbacks: usize,
    /// A worker with at least this many active blocks is overloaded (0 = off).
    pub overload_active_blocks: u64,
    /// A worker with at least this many in-flight routed requests is overloaded (0 = off).
    pub overload_active_requests: u64,
    /// A worker whose engine reports at least this many waiting requests is overloaded (0 = off).
    pub overload_waiting_requests: u64,
    /// Load booked for a request is released after this long if `/v1/done` never comes.
    pub load_expiry_secs: u64,
    /// Most requests with booked load; the oldest is expired beyond it.
    pub max_bookings: usize,
    /// Blocks assumed per in-flight request the engine reports but the indexer did not route.
    pub unknown_request_blocks: u64,
    /// Most (block, worker) entries in the index; least recently used blocks go first beyond it.
    pub index_max_entries: usize,
    /// Most blocks one worker (dp rank) may claim; beyond it the worker is resynced (lost removals).
    pub max_blocks_per_worker: usize,
    /// Event batches queued between the ZMQ listeners and the index applier.
    pub event_queue_batches: usize,
    /// Decoded bytes of the batches queued between the listeners and the applier (a listener waits
    /// beyond it; one batch larger than the whole budget passes alone).
    pub event_queue_bytes: usize,
    /// Largest KV event payload frame, live or replayed (`ZMQ_MAXMSGSIZE` and a check before decoding).
    pub event_max_frame_bytes: usize,
    /// Most raw bytes one replay may hold; a longer replay fails (the worker is resynced).
    pub replay_max_bytes: usize,
    /// Deadline for one replay from an engine's ROUTER socket.
    pub replay_timeout_ms: u64,
    /// Engine `/metrics` scrape period, and its per-scrape timeout.
    pub scrape_interval_ms: u64,
    pub scrape_timeout_ms: u64,
    /// Consecutive failed scrapes after which a worker is unhealthy (0 = never mark unhealthy).
    pub unhealthy_after_failures: u32,
    /// Largest `/v1/route` or `/v1/done` body accepted.
    pub max_body_bytes: usize,
    /// Deadline for one API request inside the indexer.
    pub request_timeout_ms: u64,
    /// Memory bound of the incremental tokenization cache.
    pub tokenize_cache_bytes: usize,
    /// Approximate mode: how long a routed prompt's blocks count as cached on the chosen worker.
    pub approx_ttl_secs: u64,
    /// Approximate mode: most blocks remembered per worker (oldest forgotten first).
    pub approx_max_blocks_per_worker: usize,
    /// How often the config file is checked for changes (SIGHUP reloads at once).
    pub reload_poll_ms: u64,
    /// `predicted` (default), `rendezvous` or the deprecated `sticky` (see [`SessionPlacement`]).
    pub session_placement: SessionPlacement,
    /// A session leaves its home only when another worker is predicted faster by more than this
    /// (milliseconds) and by more than `session_move_margin` of the home's predicted TTFT.
    pub session_move_margin_ms: f64,
    /// Relative part of the move margin (fraction of the home's predicted TTFT).
    pub session_move_margin: f64,
    /// Workers predicted within this many ms of the fastest (and `near_tie_fraction`) are a tie,
    /// broken at random, so gateway replicas with the same view do not herd onto one worker.
    pub near_tie_ms: f64,
    /// Relative part of the near-tie band (fraction of the fastest predicted TTFT).
    pub near_tie_fraction: f64,
    /// Prefill throughput (uncached tokens/s) assumed for a worker until it is measured.
    pub prefill_tokens_per_s: f64,
    /// Clamp of the measured prefill throughput.
    pub prefill_tokens_per_s_min: f64,
    pub prefill_tokens_per_s_max: f64,
    /// Computed prompt tokens the measurement window must hold before it replaces the default.
    pub prefill_measure_min_tokens: u64,
    /// Decode part of one engine step (ms) assumed until the engine's inter-token latency is measured.
    pub decode_step_ms: f64,
    /// The engines' token budget per step (vLLM `max_num_batched_tokens`): prefill work of N tokens
    /// takes ⌈N / this⌉ steps, each also decoding the running batch.
    pub prefill_chunk_tokens: u64,
    /// Sibling bursts: how long a decision's blocks count as held by the chosen worker before its
    /// engine's events say so (0 = off).
    pub speculative_ttl_ms: u64,
    /// Speculative blocks remembered per worker (oldest forgotten first; ≈ 60 B each).
    pub speculative_max_blocks_per_worker: usize,
    /// Conditional disaggregation: prompts with at least this many tokens uncached on the chosen
    /// decode worker get a remote prefill leg; 0 = off (everything aggregate).
    pub min_remote_prefill_tokens: u64,
    /// Deadline of one prefill leg (connect, prefill, answer); beyond it the decode worker serves.
    pub prefill_timeout_ms: u64,
    /// A session seen within `local_continuation_ttl_secs` is served on its decode worker whatever
    /// its length (only its new tail needs prefill). Needs session keys from the filter.
    pub local_continuations: bool,
    pub local_continuation_ttl_secs: u64,
    /// Most sessions remembered for local continuations; least recently seen go first beyond it.
    pub local_continuation_max_sessions: usize,
    /// Decode-to-decode KV migration: `off`, `dry` (count and log only) or `on`.
    pub kv_migration: KvMigration,
    /// Smallest number of tokens (blocks to move × block size) worth a migration.
    pub kv_migration_min_tokens: u64,
    /// Deadline of the migration handshake on the source; beyond it the target recomputes.
    pub kv_migration_timeout_ms: u64,
    /// Dry mode logs one would-migrate decision in this many (1 = every one).
    pub kv_migration_log_every: u64,
    /// Each session's last decode worker (`kv_home`), the migration source when the index lags.
    pub kv_home_ttl_secs: u64,
    pub kv_home_max_sessions: usize,
    /// Most `/v1/route` calls worked on at once (tokenization included, until it really ends, even
    /// when its caller is gone); a call beyond it is shed at once with 503 `overloaded_shed`.
    pub max_concurrent_routes: usize,
    /// Blocks of recently routed prompts remembered to chain orphan stores (a prefix the index
    /// missed, e.g. after a restart); about 40 B each.
    pub recovery_max_blocks: usize,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            mode: IndexMode::Precise,
            overlap_credit: 1.0,
            prefill_load_scale: 1.0,
            temperature: 0.0,
            max_fallbacks: 2,
            overload_active_blocks: 0,
            overload_active_requests: 0,
            overload_waiting_requests: 8,
            load_expiry_secs: 600,
            max_bookings: 1_000_000,
            unknown_request_blocks: 64,
            index_max_entries: 16_000_000,
            max_blocks_per_worker: 4_000_000,
            event_queue_batches: 4096,
            event_queue_bytes: 256 * 1024 * 1024,
            event_max_frame_bytes: 16 * 1024 * 1024,
            replay_max_bytes: 256 * 1024 * 1024,
            replay_timeout_ms: 2000,
            scrape_interval_ms: 500,
            scrape_timeout_ms: 400,
            unhealthy_after_failures: 3,
            max_body_bytes: 16 * 1024 * 1024,
            request_timeout_ms: 15_000,
            tokenize_cache_bytes: 64 * 1024 * 1024,
            approx_ttl_secs: 120,
            approx_max_blocks_per_worker: 200_000,
            reload_poll_ms: 1000,
            session_placement: SessionPlacement::Predicted,
            session_move_margin_ms: 50.0,
            session_move_margin: 0.25,
            near_tie_ms: 0.0,
            near_tie_fraction: 0.02,
            prefill_tokens_per_s: 20_000.0,
            prefill_tokens_per_s_min: 100.0,
            prefill_tokens_per_s_max: 100_000_000.0,
            prefill_measure_min_tokens: 8192,
            decode_step_ms: 20.0,
            prefill_chunk_tokens: 8192,
            speculative_ttl_ms: 2000,
            speculative_max_blocks_per_worker: 65_536,
            min_remote_prefill_tokens: 0,
            prefill_timeout_ms: 10_000,
            local_continuations: false,
            local_continuation_ttl_secs: 3600,
            local_continuation_max_sessions: 4_000_000,
            kv_migration: KvMigration::Off,
            kv_migration_min_tokens: 2048,
            kv_migration_timeout_ms: 1000,
            kv_migration_log_every: 16,
            kv_home_ttl_secs: 900,
            kv_home_max_sessions: 200_000,
            max_concurrent_routes: 32,
            recovery_max_blocks: 262_144,
        }
    }
}

/// One inference worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerConfig {
    pub id: String,
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
        self.kv_events
            .as_deref()
            .and_then(|e| offset_endpoint(e, rank))
    }
    /// The replay endpoint of `rank` (port + rank).
    pub fn replay_endpoint(&self, rank: u32) -> Option<String> {
        self.kv_replay
            .as_deref()
            .and_then(|e| offset_endpoint(e, rank))
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

impl Config {
    /// Parses TOML text, applies `KVMESH_*` overrides from `env`, and validates.
    pub fn from_toml_str(text: &str, env: &dyn EnvSource) -> Result<Self, ConfigError> {
        let doc: toml::Table = text
            .parse()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
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
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        match path.extension().and_then(|e| e.to_str()) {
            Some("yaml" | "yml") => Self::from_yaml_str(&text, env),
            _ => Self::from_toml_str(&text, env),
        }
    }

    fn from_table(mut doc: toml::Table, env: &dyn EnvSource) -> Result<Self, ConfigError> {
        apply_env(&mut doc, env)?;
        let config: Config = toml::Value::Table(doc)
            .try_into()
            .map_err(|e: toml::de::Error| ConfigError::Parse(e.to_string()))?;
        config.validate()?;
        Ok(config)
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
        self.debug_endpoints.unwrap_or_else(|| self.listen_addr().is_ok_and(|a| a.ip().is_loopback()))
    }

    /// The listen address, parsed (validated at load, so this only fails on hand-built configs).
    pub fn listen_addr(&self) -> Result<SocketAddr, ConfigError> {
        self.listen
            .parse()
            .map_err(|_| invalid("listen", &self.listen, "must be ip:port"))
    }

    /// Checks every value; the first problem is returned.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let api = self.listen_addr()?;
        if let Some(m) = self.metrics_addr()? {
            if m.port() != 0 && m == api {
                return Err(invalid("metrics_listen", m, "must differ from listen"));
            }
        }
        let m = &self.model;
        if m.name.trim().is_empty() {
            return Err(invalid("model.name", &m.name, "must not be empty"));
        }
        if m.block_size == 0 || m.block_size > 4096 {
            return Err(invalid(
                "model.block_size",
                m.block_size,
                "must be in 1..=4096",
            ));
        }
        self.routing.validate()?;
        let mut seen = std::collections::HashSet::new();
        for (i, w) in self.workers.iter().enumerate() {
            let field = |k: &str| format!("workers[{i}].{k}");
            if w.id.trim().is_empty() || w.id.contains(char::is_whitespace) {
                return Err(invalid(
                    field("id"),
                    &w.id,
                    "must be non-empty without whitespace",
                ));
            }
            if !seen.insert(w.id.as_str()) {
                return Err(invalid(field("id"), &w.id, "duplicate worker id"));
            }
            if w.endpoint.parse::<SocketAddr>().is_err() {
                return Err(invalid(field("endpoint"), &w.endpoint, "must be ip:port"));
            }
            if w.dp_ranks == 0 || w.dp_ranks > 1024 {
                return Err(invalid(
                    field("dp_ranks"),
                    w.dp_ranks,
                    "must be in 1..=1024",
                ));
            }
            for (key, ep) in [("kv_events", &w.kv_events), ("kv_replay", &w.kv_replay)] {
                let Some(ep) = ep else { continue };
                if !["tcp://", "ipc://", "inproc://"]
                    .iter()
                    .any(|s| ep.starts_with(s))
                {
                    return Err(invalid(
                        field(key),
                        ep,
                        "must start with tcp://, ipc:// or inproc://",
                    ));
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
        self.discovery.validate()?;
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
        // The filter's default deadline for the route call (filter/README.md).
        let filter_ms = self
            .filter
            .get("indexer_timeout_ms")
            .and_then(toml::Value::as_integer)
            .unwrap_or(100);
        for (knob, ms) in leg_ms.into_iter().flatten() {
            if u64::try_from(filter_ms).unwrap_or(0) <= ms {
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
            (
                "prefill_load_scale",
                r.prefill_load_scale,
                d.prefill_load_scale,
            ),
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

impl RoutingConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        let non_negative = [
            ("routing.overlap_credit", self.overlap_credit),
            ("routing.prefill_load_scale", self.prefill_load_scale),
            ("routing.temperature", self.temperature),
            (
                "routing.session_move_margin_ms",
                self.session_move_margin_ms,
            ),
            ("routing.session_move_margin", self.session_move_margin),
            ("routing.near_tie_ms", self.near_tie_ms),
            ("routing.near_tie_fraction", self.near_tie_fraction),
            ("routing.decode_step_ms", self.decode_step_ms),
        ];
        for (field, v) in non_negative {
            if !v.is_finite() || v < 0.0 {
                return Err(invalid(field, v, "must be a finite number >= 0"));
            }
        }
        let positive = [
            ("routing.load_expiry_secs", self.load_expiry_secs),
            ("routing.max_bookings", self.max_bookings as u64),
            ("routing.index_max_entries", self.index_max_entries as u64),
            (
                "routing.max_blocks_per_worker",
                self.max_blocks_per_worker as u64,
            ),
            (
                "routing.event_queue_batches",
                self.event_queue_batches as u64,
            ),
            ("routing.event_queue_bytes", self.event_queue_bytes as u64),
            (
                "routing.event_max_frame_bytes",
                self.event_max_frame_bytes as u64,
            ),
            ("routing.replay_max_bytes", self.replay_max_bytes as u64),
            ("routing.replay_timeout_ms", self.replay_timeout_ms),
            ("routing.scrape_interval_ms", self.scrape_interval_ms),
            ("routing.scrape_timeout_ms", self.scrape_timeout_ms),
            ("routing.max_body_bytes", self.max_body_bytes as u64),
            ("routing.request_timeout_ms", self.request_timeout_ms),
            ("routing.approx_ttl_secs", self.approx_ttl_secs),
            (
                "routing.approx_max_blocks_per_worker",
                self.approx_max_blocks_per_worker as u64,
            ),
            ("routing.reload_poll_ms", self.reload_poll_ms),
            ("routing.prefill_timeout_ms", self.prefill_timeout_ms),
            (
                "routing.local_continuation_ttl_secs",
                self.local_continuation_ttl_secs,
            ),
            (
                "routing.local_continuation_max_sessions",
                self.local_continuation_max_sessions as u64,
            ),
            (
                "routing.kv_migration_timeout_ms",
                self.kv_migration_timeout_ms,
            ),
            (
                "routing.kv_migration_log_every",
                self.kv_migration_log_every,
            ),
            ("routing.kv_home_ttl_secs", self.kv_home_ttl_secs),
            (
                "routing.kv_home_max_sessions",
                self.kv_home_max_sessions as u64,
            ),
            (
                "routing.max_concurrent_routes",
                self.max_concurrent_routes as u64,
            ),
            ("routing.prefill_chunk_tokens", self.prefill_chunk_tokens),
            (
                "routing.speculative_max_blocks_per_worker",
                self.speculative_max_blocks_per_worker as u64,
            ),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, v, "must be > 0"));
            }
        }
        let rates = [
            (
                "routing.prefill_tokens_per_s_min",
                self.prefill_tokens_per_s_min,
            ),
            ("routing.prefill_tokens_per_s", self.prefill_tokens_per_s),
            (
                "routing.prefill_tokens_per_s_max",
                self.prefill_tokens_per_s_max,
            ),
        ];
        for (field, v) in rates {
            if !v.is_finite() || v <= 0.0 {
                return Err(invalid(field, v, "must be a finite number > 0"));
            }
        }
        if !(self.prefill_tokens_per_s_min <= self.prefill_tokens_per_s
            && self.prefill_tokens_per_s <= self.prefill_tokens_per_s_max)
        {
            return Err(invalid(
                "routing.prefill_tokens_per_s",
                self.prefill_tokens_per_s,
                "must lie within routing.prefill_tokens_per_s_min ..= routing.prefill_tokens_per_s_max",
            ));
        }
        if self.scrape_timeout_ms > self.scrape_interval_ms {
            return Err(invalid(
                "routing.scrape_timeout_ms",
                self.scrape_timeout_ms,
                "must not exceed routing.scrape_interval_ms",
            ));
        }
        if self.replay_max_bytes < self.event_max_frame_bytes {
            return Err(invalid(
                "routing.replay_max_bytes",
                self.replay_max_bytes,
                "must be at least routing.event_max_frame_bytes",
            ));
        }
        // A leg runs inside /v1/route: its deadline must leave the route call time to answer.
        if self.min_remote_prefill_tokens > 0 && self.prefill_timeout_ms >= self.request_timeout_ms
        {
            return Err(invalid(
                "routing.prefill_timeout_ms",
                self.prefill_timeout_ms,
                "must be below routing.request_timeout_ms",
            ));
        }
        if self.kv_migration == KvMigration::On
            && self.kv_migration_timeout_ms >= self.request_timeout_ms
        {
            return Err(invalid(
                "routing.kv_migration_timeout_ms",
                self.kv_migration_timeout_ms,
                "must be below routing.request_timeout_ms",
            ));
        }
        Ok(())
    }
}

/// Applies `KVMESH_LISTEN` and `KVMESH_<SECTION>_<KEY>` (sections `model`, `routing`, `gateway`)
/// onto the parsed document. A value is typed like the key's default (or existing) value, so
/// `KVMESH_MODEL_NAME=123` stays a string and `KVMESH_ROUTING_TEMPERATURE=0.5` becomes a float.
fn apply_env(doc: &mut toml::Table, env: &dyn EnvSource) -> Result<(), ConfigError> {
    let defaults = default_scalars();
    for (var, raw) in env.vars_with_prefix(ENV_PREFIX) {
        let rest = &var[ENV_PREFIX.len()..];
        let (section, key) = if rest == "LISTEN" {
            (None, "listen".to_owned())
        } else {
            let Some((section, key)) = rest.split_once('_') else {
                continue;
            };
            let section = section.to_ascii_lowercase();
            if !["model", "routing", "gateway"].contains(&section.as_str()) || key.is_empty() {
                continue; // other KVMESH_* variables belong to other tools (KVMESH_TOKENIZER, …)
            }
            (Some(section), key.to_ascii_lowercase())
        };
        let table = match &section {
            None => &mut *doc,
            Some(s) => match doc
                .entry(s.clone())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            {
                toml::Value::Table(t) => t,
                _ => {
                    return Err(ConfigError::Env {
                        var,
                        reason: format!("[{s}] is not a table in the file"),
                    })
                }
            },
        };
        let path = match &section {
            None => key.clone(),
            Some(s) => format!("{s}.{key}"),
        };
        let template = table
            .get(&key)
            .cloned()
            .or_else(|| defaults.get(&path).cloned());
        let value = typed_like(template.as_ref(), &raw).map_err(|reason| ConfigError::Env {
            var: var.clone(),
            reason,
        })?;
        table.insert(key, value);
    }
    Ok(())
}

/// Scalar keys of the default configuration by dotted path, to type environment values.
fn default_scalars() -> BTreeMap<String, toml::Value> {
    let mut out = BTreeMap::new();
    if let Ok(toml::Value::Table(t)) = toml::Value::try_from(RoutingConfig::default()) {
        for (k, v) in t {
            out.insert(format!("routing.{k}"), v);
        }
    }
    out.insert("model.block_size".into(), toml::Value::Integer(16));
    out
}

fn typed_like(template: Option<&toml::Value>, raw: &str) -> Result<toml::Value, String> {
    let raw = raw.trim();
    match template {
        Some(toml::Value::Integer(_)) => raw
            .parse::<i64>()
            .map(toml::Value::Integer)
            .map_err(|_| format!("{raw:?} is not an integer")),
        Some(toml::Value::Float(_)) => raw
            .parse::<f64>()
            .map(toml::Value::Float)
            .map_err(|_| format!("{raw:?} is not a number")),
        Some(toml::Value::Boolean(_)) => match raw {
            "1" | "true" | "yes" | "on" => Ok(toml::Value::Boolean(true)),
            "0" | "false" | "no" | "off" => Ok(toml::Value::Boolean(false)),
            _ => Err(format!("{raw:?} is not a boolean")),
        },
        _ => Ok(toml::Value::String(raw.to_owned())),
    }
}

/// `[discovery]`: where workers come from besides the static `[[workers]]`. The effective fleet is
/// the file's workers plus the discovered ones (`crate::discovered`); a static id wins a collision.
/// Read at start: a change needs a restart. Not overridable from the environment.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DiscoverySection {
    /// Follow a Kubernetes Service's EndpointSlices (crate `kvmesh-discovery`, README "Discovery").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<kvmesh_discovery::DiscoveryConfig>,
}

impl DiscoverySection {
    /// Whether no discovery is configured (the section is then left out of `--check`).
    pub fn is_empty(&self) -> bool {
        self.kubernetes.is_none()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let Some(k) = &self.kubernetes else {
            return Ok(());
        };
        match k.clone().validated() {
            Ok(_) => Ok(()),
            Err(kvmesh_discovery::ConfigError::InvalidValue {
                field,
                value,
                reason,
            }) => Err(invalid(
                format!("discovery.kubernetes.{field}"),
                value,
                reason,
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLEET: &str = r#"
listen = "127.0.0.1:9100"
[model]
name = "deepseek-v4"
block_size = 16
[gateway]
listen = "127.0.0.1:8080"
admin = "127.0.0.1:9901"
cluster = "engines"
[routing]
mode = "precise"
overlap_credit = 1.5
[[workers]]
id = "w0"
role = "decode"
endpoint = "127.0.0.1:8100"
kv_events = "tcp://127.0.0.1:5557"
kv_replay = "tcp://127.0.0.1:5558"
dp_ranks = 2
[[workers]]
id = "p0"
role = "prefill"
endpoint = "127.0.0.1:8200"
"#;

    fn env<const N: usize>(pairs: [(&str, &str); N]) -> MapEnv {
        MapEnv::new(pairs)
    }

    #[test]
    fn parses_the_contract_example() {
        let c = Config::from_toml_str(FLEET, &env([])).unwrap();
        assert_eq!(c.listen, "127.0.0.1:9100");
        assert_eq!(c.model.block_size, 16);
        assert_eq!(c.gateway.listen.as_deref(), Some("127.0.0.1:8080"));
        assert_eq!(
            c.gateway.extra.get("cluster").and_then(|v| v.as_str()),
            Some("engines")
        );
        assert_eq!(c.routing.overlap_credit, 1.5);
        assert_eq!(c.routing.prefill_load_scale, 1.0);
        assert_eq!(c.workers.len(), 2);
        assert_eq!(
            c.workers[0].events_endpoint(1).as_deref(),
            Some("tcp://127.0.0.1:5558")
        );
        assert_eq!(
            c.workers[0].replay_endpoint(1).as_deref(),
            Some("tcp://127.0.0.1:5559")
        );
        assert_eq!(c.workers[1].role, Role::Prefill);
        assert_eq!(c.workers[1].dp_ranks, 1);
    }

    #[test]
    fn env_overrides_file_values_with_typing() {
        let e = env([
            ("KVMESH_LISTEN", "127.0.0.1:0"),
            ("KVMESH_MODEL_NAME", "123"),
            ("KVMESH_ROUTING_TEMPERATURE", "0.5"),
            ("KVMESH_ROUTING_MODE", "approximate"),
            ("KVMESH_ROUTING_MAX_FALLBACKS", "4"),
            ("KVMESH_TOKENIZER", "/elsewhere"), // another tool's variable: ignored here
        ]);
        let c = Config::from_toml_str(FLEET, &e).unwrap();
        assert_eq!(c.listen, "127.0.0.1:0");
        assert_eq!(c.model.name, "123");
        assert_eq!(c.routing.temperature, 0.5);
        assert_eq!(c.routing.mode, IndexMode::Approximate);
        assert_eq!(c.routing.max_fallbacks, 4);
    }

    #[test]
    fn bad_env_values_are_named() {
        let err = Config::from_toml_str(FLEET, &env([("KVMESH_ROUTING_MAX_FALLBACKS", "many")]))
            .unwrap_err();
        assert!(
            matches!(err, ConfigError::Env { ref var, .. } if var == "KVMESH_ROUTING_MAX_FALLBACKS"),
            "{err}"
        );
        let err =
            Config::from_toml_str(FLEET, &env([("KVMESH_ROUTING_NO_SUCH_KNOB", "1")])).unwrap_err();
        assert!(err.to_string().contains("no_such_knob"), "{err}");
    }

    #[test]
    fn placement_knobs_are_validated_and_superseded_ones_warn() {
        let base = "listen = \"127.0.0.1:9100\"\n[model]\nname = \"m\"\nblock_size = 16\n[routing]\n";
        let load = |routing: &str| Config::from_toml_str(&format!("{base}{routing}\n"), &env([]));
        // (routing lines, the field refused)
        let refused = [
            ("prefill_tokens_per_s = 0.0", "routing.prefill_tokens_per_s"),
            ("prefill_tokens_per_s = 50.0", "routing.prefill_tokens_per_s"), // below the clamp's minimum
            ("prefill_tokens_per_s_max = 1000.0", "routing.prefill_tokens_per_s"),
            ("session_move_margin_ms = -1.0", "routing.session_move_margin_ms"),
            ("near_tie_fraction = inf", "routing.near_tie_fraction"),
            ("prefill_chunk_tokens = 0", "routing.prefill_chunk_tokens"),
            ("speculative_max_blocks_per_worker = 0", "routing.speculative_max_blocks_per_worker"),
        ];
        for (routing, want) in refused {
            match load(routing) {
                Err(ConfigError::InvalidValue { field, .. }) => assert_eq!(field, want, "{routing}"),
                other => panic!("{routing}: expected InvalidValue, got {other:?}"),
            }
        }
        let c = load("speculative_ttl_ms = 0\nsession_placement = \"rendezvous\"").unwrap();
        assert_eq!((c.routing.speculative_ttl_ms, c.routing.session_placement), (0, SessionPlacement::Rendezvous));
        assert!(c.warnings().is_empty());
        assert_eq!(load("").unwrap().routing.session_placement, SessionPlacement::Predicted);
        let old = load("session_placement = \"sticky\"\noverlap_credit = 2.0").unwrap();
        assert_eq!(old.warnings().len(), 2, "{:?}", old.warnings());
        assert!(old.warnings()[0].contains("deprecated"), "{:?}", old.warnings());
    }

    #[test]
    fn invalid_values_are_refused_with_field_and_reason() {
        let cases: &[(&str, &str, &str)] = &[
            ("block_size = 16", "block_size = 0", "model.block_size"),
            (
                "listen = \"127.0.0.1:9100\"",
                "listen = \"nowhere\"",
                "listen",
            ),
            (
                "endpoint = \"127.0.0.1:8100\"",
                "endpoint = \"localhost\"",
                "workers[0].endpoint",
            ),
            ("id = \"p0\"", "id = \"w0\"", "workers[1].id"),
            ("dp_ranks = 2", "dp_ranks = 0", "workers[0].dp_ranks"),
            (
                "kv_events = \"tcp://127.0.0.1:5557\"",
                "kv_events = \"udp://x\"",
                "workers[0].kv_events",
            ),
            (
                "overlap_credit = 1.5",
                "overlap_credit = -1.0",
                "routing.overlap_credit",
            ),
            (
                "mode = \"precise\"",
                "mode = \"precise\"\nindex_max_entries = 0",
                "routing.index_max_entries",
            ),
        ];
        for (from, to, want_field) in cases {
            let text = FLEET.replacen(from, to, 1);
            match Config::from_toml_str(&text, &env([])) {
                Err(ConfigError::InvalidValue { field, .. }) => {
                    assert_eq!(&field, want_field, "{to}")
                }
                other => panic!("{to}: expected InvalidValue, got {other:?}"),
            }
        }
    }

    #[test]
    fn unknown_keys_are_errors_but_gateway_and_filter_are_open() {
        let err =
            Config::from_toml_str(&FLEET.replace("overlap_credit", "overlap_credt"), &env([]))
                .unwrap_err();
        assert!(matches!(err, ConfigError::Parse(_)));
        let with_filter = format!("{FLEET}\n[filter]\nsession_header = \"x-session-id\"\n");
        let c = Config::from_toml_str(&with_filter, &env([])).unwrap();
        assert!(c.filter.contains_key("session_header"));
    }

    #[test]
    fn yaml_has_the_same_keys() {
        let yaml = "listen: 127.0.0.1:9100\nmodel: {name: m, block_size: 32}\nworkers:\n  - {id: a, role: both, endpoint: '127.0.0.1:1'}\n";
        let c = Config::from_yaml_str(yaml, &env([])).unwrap();
        assert_eq!(c.model.block_size, 32);
        assert_eq!(c.workers[0].role, Role::Both);
    }

    #[test]
    fn load_reads_files_by_extension() {
        let dir = tempfile::tempdir().unwrap();
        let toml_path = dir.path().join("fleet.toml");
        std::fs::write(&toml_path, FLEET).unwrap();
        assert_eq!(Config::load(&toml_path, &env([])).unwrap().workers.len(), 2);
        let missing = Config::load(&dir.path().join("nope.toml"), &env([])).unwrap_err();
        assert!(matches!(missing, ConfigError::Io { .. }));
    }

    #[test]
    fn the_shipped_fleets_load_without_warnings() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../envoy/fleets");
        let mut seen = 0;
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                let c = Config::load(&path, &env([]))
                    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
                assert_eq!(c.warnings(), Vec::<String>::new(), "{}", path.display());
                seen += 1;
            }
        }
        assert!(
            seen >= 2,
            "expected local.toml and disagg.toml in {}",
            dir.display()
        );
    }

    #[test]
    fn leg_deadlines_are_checked_against_the_filter_and_the_api() {
        let base = "listen = \"127.0.0.1:9100\"\n[model]\nname = \"m\"\nblock_size = 16\n";
        let with = |routing: &str, filter: &str| {
            Config::from_toml_str(
                &format!("{base}[routing]\n{routing}\n[filter]\n{filter}\n"),
                &env([]),
            )
        };
        let c = with("min_remote_prefill_tokens = 1", "").unwrap();
        assert_eq!(
            c.warnings().len(),
            1,
            "the filter's 100 ms default cannot cover a 10 s prefill leg"
        );
        assert!(with(
            "min_remote_prefill_tokens = 1",
            "indexer_timeout_ms = 12000"
        )
        .unwrap()
        .warnings()
        .is_empty());
        let migration = with(
            "kv_migration = \"on\"\nkv_migration_timeout_ms = 500",
            "indexer_timeout_ms = 400",
        )
        .unwrap();
        assert!(
            migration.warnings()[0].contains("routing.kv_migration_timeout_ms 500"),
            "{:?}",
            migration.warnings()
        );
        assert_eq!(
            with("local_continuations = true", "")
                .unwrap()
                .warnings()
                .len(),
            1
        );
        let too_long = with(
            "min_remote_prefill_tokens = 1\nprefill_timeout_ms = 20000",
            "",
        )
        .unwrap_err();
        assert!(
            too_long.to_string().contains("routing.prefill_timeout_ms"),
            "{too_long}"
        );
        let bad_mode = with("kv_migration = \"sometimes\"", "").unwrap_err();
        assert!(matches!(bad_mode, ConfigError::Parse(_)), "{bad_mode}");
    }

    #[test]
    fn offsets_follow_vllm() {
        assert_eq!(
            offset_endpoint("tcp://10.0.0.1:5557", 3).as_deref(),
            Some("tcp://10.0.0.1:5560")
        );
        assert_eq!(
            offset_endpoint("ipc:///tmp/ev", 1).as_deref(),
            Some("ipc:///tmp/ev_dp1")
        );
        assert_eq!(offset_endpoint("tcp://h:65535", 1), None);
        assert_eq!(
            offset_endpoint("tcp://h:x", 0).as_deref(),
            Some("tcp://h:x")
        );
    }
}
