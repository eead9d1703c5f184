//! The wasm filter's configuration, defined once: the typed [`FilterConfig`] with its defaults,
//! bounds and validation.
//!
//! Three readers must agree on it: the filter parses its plugin configuration JSON with
//! [`FilterConfig::from_bytes`] in `on_configure` (refusing a bad one, so Envoy rejects the config
//! instead of running a half-configured filter); the indexer's `--check` validates a fleet file's
//! `[filter]` table with the same struct (a typo there is an error naming the key, not a surprise
//! when Envoy loads the rendered bootstrap) and reads the route-call deadline from it instead of
//! copying the default; the e2e harness renders the filter JSON from it. `deny_unknown_fields`
//! turns a typo into an error rather than a silently ignored option. Pure data and checks: no
//! proxy-wasm, no I/O, so it compiles for `wasm32-wasip1` and natively.
//!
//! Operator overrides (`x-kvmesh-worker`, `x-kvmesh-mode`) are honoured only from a trusted
//! source: `allow_overrides` alone is refused, it needs `override_secret`, a shared secret the
//! operator's tooling sends in [`headers::OVERRIDE_SECRET`] ([`secret_matches`] compares it in
//! constant time). The header's name is fixed, not configured, so every shipped Envoy config and
//! the filter strip the same name. `x-envoy-internal` is deliberately not a trust source: without
//! `use_remote_address: true` on the connection manager (the shipped bootstrap does not set it)
//! Envoy derives it from the client's own `x-forwarded-for`.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::headers;

/// Largest accepted `max_body_bytes`: Envoy buffers the whole body, so this bounds its memory per request.
pub const MAX_BODY_BYTES_LIMIT: usize = 256 * 1024 * 1024;

/// The knob `derive_session_keys` replaced; named in the error a configuration still using it gets.
pub const REMOVED_SESSION_PREFIX_UNITS: &str = "session_prefix_units";

/// Shortest accepted override secret (a guessable secret is no trust).
pub const MIN_OVERRIDE_SECRET_BYTES: usize = 16;

/// Longest accepted override secret (the filter reads at most this many bytes of the header).
pub const MAX_OVERRIDE_SECRET_BYTES: usize = 256;

/// Default [`FilterConfig::indexer_timeout_ms`]: the deadline of one `/v1/route` call. The
/// indexer checks its leg deadlines against the fleet's value, else this one.
pub const DEFAULT_INDEXER_TIMEOUT_MS: u64 = 100;

/// Default [`FilterConfig::held_body_budget_bytes`]: four 8 MiB bodies at once per worker
/// thread. The shipped gateway runs 2 worker threads in a 1 GiB container whose heap budget is
/// 768 MiB, so the VMs' held bodies (2 × 32 MiB) stay well inside the 256 MiB outside the heap.
pub const DEFAULT_HELD_BODY_BUDGET_BYTES: usize = 32 * 1024 * 1024;

/// Largest accepted [`FilterConfig::held_body_budget_bytes`]: half a wasm32 VM's address space.
pub const MAX_HELD_BODY_BUDGET_BYTES: usize = 2 * 1024 * 1024 * 1024;

/// Largest [`FilterConfig::placement_memory_slots`]: at most 264 bytes each, 1M slots bound the
/// table at ~280 MB of Envoy's shared data.
pub const MAX_PLACEMENT_MEMORY_SLOTS: usize = 1 << 20;

/// Largest [`FilterConfig::body_base_slots`]: at most 200 bytes each, 1M slots bound the table
/// at ~200 MB of Envoy's shared data.
pub const MAX_BODY_BASE_SLOTS: usize = 1 << 20;

/// Largest [`FilterConfig::max_model_labels`]: each model label adds about 50 Envoy stats (the
/// model-labelled families of the filter's metrics).
pub const MAX_MODEL_LABELS_LIMIT: usize = 256;

/// Coarsest tick of a context that polls the fleet.
pub const MAX_TICK_MS: u64 = 250;

/// Where the background work (fleet polling, `/v1/done` dispatch) runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Background {
    /// A bootstrap `envoy.bootstrap.wasm` singleton (root id `kvmesh_service`, same `vm_id`)
    /// polls the fleet once for the whole Envoy; every worker thread's filter root flushes its own
    /// done queue on its tick.
    Singleton,
    /// Every worker thread's filter root polls the fleet too (and flushes its done queue).
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
    /// Honour `x-kvmesh-worker` / `x-kvmesh-mode` from requests carrying `override_secret` in
    /// [`headers::OVERRIDE_SECRET`] (refused without a secret); every other request has them stripped.
    pub allow_overrides: bool,
    /// The shared secret that makes a request's overrides trusted; empty = none (overrides cannot
    /// be enabled). [`MIN_OVERRIDE_SECRET_BYTES`]..=[`MAX_OVERRIDE_SECRET_BYTES`] visible ASCII.
    /// Visible in Envoy's config dump: keep the admin interface on loopback.
    pub override_secret: String,
    /// Add `x-kvmesh-*` decision headers to responses.
    pub debug_headers: bool,
    /// Largest body the filter reads and routes by content; larger ones pass through unrouted.
    pub max_body_bytes: usize,
    /// Bytes of request bodies one worker thread's VM may hold at once while their route calls are
    /// out (the filter copies a body into the VM to send it to the indexer). A VM's memory grows to
    /// the most it held and never shrinks, outside Envoy's heap (and its overload manager), so this
    /// bounds it: a body that would pass the budget is not read into the VM and is routed without
    /// the indexer (the session's remembered worker or header-keyed pin, else Envoy's fallback LB),
    /// counted as fallback reason `body_budget`. At least `max_body_bytes`, at most 2 GiB.
    pub held_body_budget_bytes: usize,
    /// Where fleet polling and done-report dispatch run.
    pub background: Background,
    /// Period of the `GET /v1/fleet` poll; 0 = never poll (the local fallback then has no fleet).
    pub fleet_refresh_ms: u64,
    /// Deadline of background calls (`/v1/fleet`, `/v1/done`).
    pub background_timeout_ms: u64,
    /// Tick period of every filter root, which flushes its queued done reports.
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
    /// Slots of the table remembering where the indexer last placed each session (process-wide, in
    /// Envoy's shared data, each at most 264 bytes), so routing without the indexer keeps a session
    /// on its worker; 0 = off (the fallback pins by rendezvous).
    pub placement_memory_slots: usize,
    /// Requests whose body is at most this many bytes are routed by the filter alone, without the
    /// `/v1/route` call: the session's remembered worker, else its rendezvous pin over the last
    /// fleet (what the fallback does). Such a prompt can save little prefill (~4 bytes a token: 8 KiB
    /// is ~2k tokens), and skipping the call removes most of the gateway's CPU per request; the
    /// indexer then sees the request only through the engine's queue metrics and KV events. 0 = off
    /// (every request asks the indexer); at most `max_body_bytes`.
    pub local_route_max_body_bytes: usize,
    /// Slots of the table remembering, per session, the body bases the indexer named
    /// (`kvmesh_core::body_base`: a long conversation's body it holds), so the next route call
    /// sends only the bytes after one (process-wide, in Envoy's shared data, each at most 200
    /// bytes); 0 = off (every route call sends the whole body).
    pub body_base_slots: usize,
    /// Base models with a `model` label of their own on the filter's routing metrics: the fleet's
    /// first ones (its order, the default first); requests for the others are counted under
    /// `other`, those whose model is not known under `unknown`. Also each worker thread's bound on
    /// distinct values. 0 = every known model under `other`; at most [`MAX_MODEL_LABELS_LIMIT`].
    pub max_model_labels: usize,
    /// Defer to a GIE endpoint picker in front of the filter (the `both` edge: Envoy's `ext_proc`
    /// picks, the filter only routes what the picker did not). A request that reaches the filter
    /// with [`headers::DESTINATION_ENDPOINT`] set goes on unchanged — no body read, no
    /// `/v1/route` call, no done report (the picker booked it and releases it) — and the filter
    /// routes the others itself (ext_proc failed open: the picker was down or hung). Sound only
    /// where the header can have come from nowhere but the picker: every shipped `both` bootstrap
    /// strips a client's before `ext_proc`. Off (the default, and the wasm-only edge): a present
    /// header is the client's, stripped, and the filter routes every request.
    pub defer_to_picker: bool,
}

impl Default for FilterConfig {
    fn default() -> Self {
        Self {
            indexer_cluster: "kvmesh_indexer".to_owned(),
            indexer_authority: "kvmesh-indexer".to_owned(),
            indexer_timeout_ms: DEFAULT_INDEXER_TIMEOUT_MS,
            session_header: headers::DEFAULT_SESSION_HEADER.to_owned(),
            derive_session_keys: true,
            allow_overrides: false,
            override_secret: String::new(),
            debug_headers: false,
            max_body_bytes: 4 * 1024 * 1024,
            held_body_budget_bytes: DEFAULT_HELD_BODY_BUDGET_BYTES,
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
            placement_memory_slots: 65_536,
            local_route_max_body_bytes: 0,
            body_base_slots: 8192,
            max_model_labels: 16,
            defer_to_picker: false,
        }
    }
}

/// Why a configuration was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// The plugin configuration bytes are not UTF-8.
    NotUtf8,
    /// Not a configuration object (syntax, unknown key, wrong type); serde's message names the key.
    Invalid(String),
    /// A field's value is out of bounds.
    InvalidValue { field: &'static str, value: String, reason: &'static str },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotUtf8 => f.write_str("plugin configuration is not UTF-8"),
            Self::Invalid(msg) => write!(f, "plugin configuration is not valid: {msg}"),
            Self::InvalidValue { field, value, reason } => {
                write!(f, "`{field}` = {value}: {reason}")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

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
            return Err(bad(
                "indexer_cluster",
                &self.indexer_cluster,
                "must name an Envoy cluster",
            ));
        }
        if self.indexer_authority.trim().is_empty()
            || self.indexer_authority.contains(char::is_whitespace)
        {
            return Err(bad(
                "indexer_authority",
                &self.indexer_authority,
                "must be a non-empty host[:port]",
            ));
        }
        if !(1..=60_000).contains(&self.indexer_timeout_ms) {
            return Err(bad(
                "indexer_timeout_ms",
                self.indexer_timeout_ms,
                "must be within 1..=60000",
            ));
        }
        self.session_header = self.session_header.trim().to_ascii_lowercase();
        if !is_header_token(&self.session_header) {
            return Err(bad(
                "session_header",
                &self.session_header,
                "must be a non-empty HTTP header name",
            ));
        }
        let reserved = [
            headers::DESTINATION_ENDPOINT,
            headers::KVMESH_SESSION,
            headers::KVMESH_PATH,
            headers::OVERRIDE_WORKER,
            headers::OVERRIDE_MODE,
            headers::OVERRIDE_SECRET,
            headers::REQUEST_ID,
        ];
        if reserved.contains(&self.session_header.as_str()) {
            return Err(bad(
                "session_header",
                &self.session_header,
                "is a header kvmesh itself sets or strips",
            ));
        }
        if !self.override_secret.is_empty() {
            let len = self.override_secret.len();
            if !(MIN_OVERRIDE_SECRET_BYTES..=MAX_OVERRIDE_SECRET_BYTES).contains(&len)
                || !self.override_secret.bytes().all(|b| b.is_ascii_graphic())
            {
                // The value itself is never echoed into an error (it ends up in logs).
                return Err(bad(
                    "override_secret",
                    format!("({len} bytes)"),
                    "must be 16..=256 visible ASCII characters",
                ));
            }
        }
        if self.allow_overrides && self.override_secret.is_empty() {
            return Err(bad(
                "allow_overrides",
                true,
                "needs `override_secret`: overrides are honoured only from requests that carry it in x-kvmesh-override-secret",
            ));
        }
        if !(1..=MAX_BODY_BYTES_LIMIT).contains(&self.max_body_bytes) {
            return Err(bad("max_body_bytes", self.max_body_bytes, "must be within 1..=268435456"));
        }
        if !(self.max_body_bytes..=MAX_HELD_BODY_BUDGET_BYTES)
            .contains(&self.held_body_budget_bytes)
        {
            return Err(bad(
                "held_body_budget_bytes",
                self.held_body_budget_bytes,
                "must be at least `max_body_bytes` (else a body that size could never be routed) and at most 2147483648",
            ));
        }
        if self.fleet_refresh_ms != 0 && !(100..=3_600_000).contains(&self.fleet_refresh_ms) {
            return Err(bad(
                "fleet_refresh_ms",
                self.fleet_refresh_ms,
                "must be 0 (off) or within 100..=3600000",
            ));
        }
        if !(1..=60_000).contains(&self.background_timeout_ms) {
            return Err(bad(
                "background_timeout_ms",
                self.background_timeout_ms,
                "must be within 1..=60000",
            ));
        }
        if !(1..=10_000).contains(&self.done_flush_ms) {
            return Err(bad("done_flush_ms", self.done_flush_ms, "must be within 1..=10000"));
        }
        if !(1..=1_000_000).contains(&self.done_queue_capacity) {
            return Err(bad(
                "done_queue_capacity",
                self.done_queue_capacity,
                "must be within 1..=1000000",
            ));
        }
        if !(1..=10_000).contains(&self.done_max_in_flight) {
            return Err(bad(
                "done_max_in_flight",
                self.done_max_in_flight,
                "must be within 1..=10000",
            ));
        }
        if self.breaker_failures > 10_000 {
            return Err(bad(
                "breaker_failures",
                self.breaker_failures,
                "must be 0 (off) or within 1..=10000",
            ));
        }
        if !(10..=600_000).contains(&self.breaker_open_ms) {
            return Err(bad("breaker_open_ms", self.breaker_open_ms, "must be within 10..=600000"));
        }
        if self.endpoint_failures > 10_000 {
            return Err(bad(
                "endpoint_failures",
                self.endpoint_failures,
                "must be 0 (off) or within 1..=10000",
            ));
        }
        if !(100..=3_600_000).contains(&self.endpoint_ejection_ms) {
            return Err(bad(
                "endpoint_ejection_ms",
                self.endpoint_ejection_ms,
                "must be within 100..=3600000",
            ));
        }
        if self.placement_memory_slots > MAX_PLACEMENT_MEMORY_SLOTS {
            return Err(bad(
                "placement_memory_slots",
                self.placement_memory_slots,
                "must be 0 (off) or within 1..=1048576",
            ));
        }
        if self.body_base_slots > MAX_BODY_BASE_SLOTS {
            return Err(bad(
                "body_base_slots",
                self.body_base_slots,
                "must be 0 (off) or within 1..=1048576",
            ));
        }
        if self.max_model_labels > MAX_MODEL_LABELS_LIMIT {
            return Err(bad(
                "max_model_labels",
                self.max_model_labels,
                "must be within 0..=256 (0: every model under `other`)",
            ));
        }
        if self.local_route_max_body_bytes > self.max_body_bytes {
            return Err(bad(
                "local_route_max_body_bytes",
                self.local_route_max_body_bytes,
                "must be 0 (off) or at most `max_body_bytes`",
            ));
        }
        Ok(self)
    }

    /// Whether a request's override secret (its [`headers::OVERRIDE_SECRET`] value, if sent)
    /// makes its overrides trusted: overrides on and the secret matches.
    pub fn overrides_trusted(&self, sent_secret: Option<&[u8]>) -> bool {
        self.allow_overrides
            && !self.override_secret.is_empty()
            && sent_secret.is_some_and(|s| secret_matches(s, self.override_secret.as_bytes()))
    }

    /// The JSON the filter reads as its plugin configuration (every field, defaults included).
    pub fn to_json(&self) -> String {
        // Plain strings, numbers, bools and a unit enum: serialisation cannot fail.
        serde_json::to_string(self).unwrap_or_else(|_| "{}".to_owned())
    }

    /// The tick period of a context that runs background work, or None when it has nothing to do
    /// periodically. Both the fleet poll and (per-worker) the done flush ride on one tick; polls
    /// are scheduled by the filter's `background::FleetSchedule`, the tick only has to be fine enough
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
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
        })
}

/// `sent == expected`, in time that depends only on the lengths (no early exit on the first
/// differing byte, so response timing does not reveal how much of a guess was right).
pub fn secret_matches(sent: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(sent.len() != expected.len());
    for (i, &e) in expected.iter().enumerate() {
        diff |= e ^ sent.get(i).copied().unwrap_or(!e);
    }
    diff == 0
}

#[cfg(test)]
#[path = "filter_config_tests.rs"]
mod tests;
