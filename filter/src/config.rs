//! The filter's configuration: the plugin configuration JSON → one validated [`FilterConfig`].
//!
//! Shaped after Kuadrant's wasm-shim: parsed once in `on_configure`, refused there when invalid (so
//! Envoy rejects the config instead of running a half-configured filter), then shared read-only by
//! every HTTP context. `deny_unknown_fields` turns a typo into a startup error rather than a silently
//! ignored option. The same JSON configures the filter roots and the singleton service, so the two
//! can never disagree about the indexer cluster or the queue bounds.

use kvmesh_core::headers;
use serde::{Deserialize, Serialize};

/// Largest accepted `max_body_bytes`: Envoy buffers the whole body, so this bounds its memory per request.
pub const MAX_BODY_BYTES_LIMIT: usize = 256 * 1024 * 1024;

/// The knob `derive_session_keys` replaced; named in the error a configuration still using it gets.
pub const REMOVED_SESSION_PREFIX_UNITS: &str = "session_prefix_units";

/// Coarsest tick of a context that polls the fleet.
pub const MAX_TICK_MS: u64 = 250;

/// Where the background work (fleet polling, `/v1/done` dispatch) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Background {
    /// A bootstrap `envoy.bootstrap.wasm` singleton (root id [`crate::SERVICE_ROOT_ID`], same `vm_id`)
    /// polls the fleet once for the whole Envoy and drains the shared done queue on `on_queue_ready`.
    Singleton,
    /// Every worker thread's filter root polls the fleet and flushes its own done queue on its tick.
    /// For deployments that cannot add a bootstrap extension (Istio `WasmPlugin`).
    PerWorker,
}

/// The validated filter configuration. Every field has a default; `{}` is a valid configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FilterConfig {
    /// Envoy cluster of the sidecar indexer (`dispatch_http_call` upstream).
    pub indexer_cluster: String,
    /// `:authority` sent on calls to the indexer.
    pub indexer_authority: String,
    /// Deadline of one `/v1/route` call; past it the filter routes without the indexer.
    pub indexer_timeout_ms: u64,
    /// Header carrying an explicit client session id (lowercase).
    pub session_header: String,
    /// Derive a session key from the request when no session header is sent: chat requests get
    /// their conversation's key (`kvmesh_core::session::derived_key`: every message up to and
    /// including the first user message, whatever its length); completions get none.
    pub derive_session_keys: bool,
    /// Honour `x-kvmesh-worker` / `x-kvmesh-mode` from clients (else they are stripped).
    pub allow_overrides: bool,
    /// Add `x-kvmesh-*` decision headers to responses.
    pub debug_headers: bool,
    /// Largest body the filter reads and routes by content; larger ones pass through unrouted.
    pub max_body_bytes: usize,
    /// Where fleet polling and done-report dispatch run.
    pub background: Background,
    /// Period of the `GET /v1/fleet` poll; 0 = never poll (the local fallback then has no fleet).
    pub fleet_refresh_ms: u64,
    /// Deadline of background calls (`/v1/fleet`, `/v1/done`).
    pub background_timeout_ms: u64,
    /// `per_worker` only: tick period that flushes queued done reports.
    pub done_flush_ms: u64,
    /// Done reports waiting for dispatch, per background context; more are dropped and counted.
    pub done_queue_capacity: usize,
    /// Concurrent `/v1/done` calls per background context.
    pub done_max_in_flight: usize,
    /// Consecutive unanswered `/v1/route` calls (timeout, reset, no connection) that open the
    /// circuit breaker, per worker thread; 0 = no breaker.
    pub breaker_failures: u32,
    /// How long an open breaker skips the call before one probe goes through.
    pub breaker_open_ms: u64,
    /// Consecutive failed attempts (5xx, or retried elsewhere) after which an engine endpoint is
    /// moved to the end of destination lists, per worker thread; 0 = never.
    pub endpoint_failures: u32,
    /// How long such an endpoint stays at the end of the lists.
    pub endpoint_ejection_ms: u64,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            indexer_cluster: "kvmesh_indexer".to_owned(),
            indexer_authority: "kvmesh-indexer".to_owned(),
            indexer_timeout_ms: 100,
            session_header: headers::DEFAULT_SESSION_HEADER.to_owned(),
            derive_session_keys: true,
            allow_overrides: false,
            debug_headers: false,
            max_body_bytes: 4 * 1024 * 1024,
            background: Background::Singleton,
            fleet_refresh_ms: 1000,
            background_timeout_ms: 1000,
            done_flush_ms: 20,
            done_queue_capacity: 4096,
            done_max_in_flight: 64,
            breaker_failures: 5,
            breaker_open_ms: 1000,
            endpoint_failures: 2,
            endpoint_ejection_ms: 10_000,
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("plugin configuration is not UTF-8")]
    NotUtf8,
    #[error("plugin configuration is not valid: {0}")]
    Invalid(String),
    #[error("`{field}` = {value}: {reason}")]
    InvalidValue { field: &'static str, value: String, reason: &'static str },
}

impl FilterConfig {
    /// Parses and validates the plugin configuration bytes; absent or blank means all defaults.
    pub fn from_bytes(bytes: Option<&[u8]>) -> Result<Self, ConfigError> {
        let text = match bytes {
            None => return Self::default().validated(),
            Some(b) => std::str::from_utf8(b).map_err(|_| ConfigError::NotUtf8)?,
        };
        if text.trim().is_empty() {
            return Self::default().validated();
        }
        let config: Self = serde_json::from_str(text).map_err(|e| {
            if e.to_string().contains(&format!("unknown field `{REMOVED_SESSION_PREFIX_UNITS}`")) {
                ConfigError::InvalidValue {
                    field: REMOVED_SESSION_PREFIX_UNITS,
                    value: "(any)".to_owned(),
                    reason: "was replaced by `derive_session_keys` (default true): derived keys now cover a chat's conversation anchor, whatever its length",
                }
            } else {
                ConfigError::Invalid(e.to_string())
            }
        })?;
        config.validated()
    }

    /// Checks every bound; normalises the session header to lowercase (Envoy's header maps are).
    pub fn validated(mut self) -> Result<Self, ConfigError> {
        fn bad(field: &'static str, value: impl ToString, reason: &'static str) -> ConfigError {
            ConfigError::InvalidValue { field, value: value.to_string(), reason }
        }
        if self.indexer_cluster.trim().is_empty() {
            return Err(bad("indexer_cluster", &self.indexer_cluster, "must name an Envoy cluster"));
        }
        if self.indexer_authority.trim().is_empty() || self.indexer_authority.contains(char::is_whitespace) {
            return Err(bad("indexer_authority", &self.indexer_authority, "must be a non-empty host[:port]"));
        }
        if !(1..=60_000).contains(&self.indexer_timeout_ms) {
            return Err(bad("indexer_timeout_ms", self.indexer_timeout_ms, "must be within 1..=60000"));
        }
        self.session_header = self.session_header.trim().to_ascii_lowercase();
        if !is_header_token(&self.session_header) {
            return Err(bad("session_header", &self.session_header, "must be a non-empty HTTP header name"));
        }
        let reserved = [
            headers::DESTINATION_ENDPOINT,
            headers::KVMESH_SESSION,
            headers::KVMESH_PATH,
            headers::OVERRIDE_WORKER,
            headers::OVERRIDE_MODE,
            headers::REQUEST_ID,
        ];
        if reserved.contains(&self.session_header.as_str()) {
            return Err(bad("session_header", &self.session_header, "is a header kvmesh itself sets or strips"));
        }
        if !(1..=MAX_BODY_BYTES_LIMIT).contains(&self.max_body_bytes) {
            return Err(bad("max_body_bytes", self.max_body_bytes, "must be within 1..=268435456"));
        }
        if self.fleet_refresh_ms != 0 && !(100..=3_600_000).contains(&self.fleet_refresh_ms) {
            return Err(bad("fleet_refresh_ms", self.fleet_refresh_ms, "must be 0 (off) or within 100..=3600000"));
        }
        if !(1..=60_000).contains(&self.background_timeout_ms) {
            return Err(bad("background_timeout_ms", self.background_timeout_ms, "must be within 1..=60000"));
        }
        if !(1..=10_000).contains(&self.done_flush_ms) {
            return Err(bad("done_flush_ms", self.done_flush_ms, "must be within 1..=10000"));
        }
        if !(1..=1_000_000).contains(&self.done_queue_capacity) {
            return Err(bad("done_queue_capacity", self.done_queue_capacity, "must be within 1..=1000000"));
        }
        if !(1..=10_000).contains(&self.done_max_in_flight) {
            return Err(bad("done_max_in_flight", self.done_max_in_flight, "must be within 1..=10000"));
        }
        if self.breaker_failures > 10_000 {
            return Err(bad("breaker_failures", self.breaker_failures, "must be 0 (off) or within 1..=10000"));
        }
        if !(10..=600_000).contains(&self.breaker_open_ms) {
            return Err(bad("breaker_open_ms", self.breaker_open_ms, "must be within 10..=600000"));
        }
        if self.endpoint_failures > 10_000 {
            return Err(bad("endpoint_failures", self.endpoint_failures, "must be 0 (off) or within 1..=10000"));
        }
        if !(100..=3_600_000).contains(&self.endpoint_ejection_ms) {
            return Err(bad("endpoint_ejection_ms", self.endpoint_ejection_ms, "must be within 100..=3600000"));
        }
        Ok(self)
    }

    /// The tick period of a context that runs background work, or None when it has nothing to do
    /// periodically. Both the fleet poll and (per-worker) the done flush ride on one tick; polls
    /// are scheduled by [`crate::background::FleetSchedule`], the tick only has to be fine enough
    /// (at most [`MAX_TICK_MS`], so the first fleet arrives soon after start).
    pub fn tick_period_ms(&self, runs_done_flush: bool) -> Option<u64> {
        let fleet = (self.fleet_refresh_ms > 0).then_some(self.fleet_refresh_ms.min(MAX_TICK_MS));
        let flush = runs_done_flush.then_some(self.done_flush_ms);
        match (fleet, flush) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// RFC 9110 token characters, lowercase only (Envoy lowercases header names).
fn is_header_token(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b))
}

#[cfg(test)]
#[path = "tests/config.rs"]
mod tests;
