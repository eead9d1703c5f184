//! The narrow interface between the filter's root-level logic and its host: the few host calls
//! that logic needs — the clock, HTTP callouts to the indexer, shared data, metrics and the tick
//! period — and nothing else.
//!
//! Why a trait: the root role matrix ([`crate::roles`]), the done queue and the fleet cache
//! ([`crate::shared`]) and the background dispatcher ([`crate::tasks`]) make decisions about host
//! results (a CAS that did not change, a dispatch that failed, a tick that could not be set),
//! and those decisions need native tests. `host::adapter` (wasm only) implements it over
//! `proxy_wasm::hostcalls`; [`fake`] (tests only) is an in-memory host that records what it was
//! asked. Logging is not in the trait: the modules log through the `log` facade, which the
//! proxy-wasm SDK backs with Envoy's logger and which is silent in native tests.
//!
//! Stream-level calls (request headers, bodies, properties of one request) stay in `host::http`:
//! the request logic already takes them as plain data ([`crate::flow::RequestFlow`]).
//! No method panics: every host error is a [`HostError`] the caller counts and logs.

use crate::metrics::MetricKind;
use crate::request::HttpCall;

/// A host call that returned an error status; the text is the status as the host named it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct HostError(pub String);

/// Shared data as stored: the value (absent when never set) and its CAS (absent when the host
/// keeps none).
pub type SharedData = (Option<Vec<u8>>, Option<u32>);

/// The host calls of root-level logic.
pub trait Host {
    /// Wall-clock nanoseconds (0 when unavailable; only used for durations).
    fn now_ns(&self) -> u64;

    /// Starts `call`; the token identifies its answer (`on_http_call_response`).
    fn dispatch(&self, call: &HttpCall) -> Result<u32, HostError>;
    /// `:status` of the answer being delivered, if present and numeric.
    fn call_response_status(&self) -> Option<u16>;
    /// Up to `max` bytes of the answer's body being delivered (empty when there is none).
    fn call_response_body(&self, max: usize) -> Vec<u8>;

    /// Shared data under `key`, visible to every VM with the same `vm_id`.
    fn get_shared_data(&self, key: &str) -> Result<SharedData, HostError>;
    /// Stores `value` under `key` (no CAS check).
    fn set_shared_data(&self, key: &str, value: &[u8]) -> Result<(), HostError>;

    /// Defines (or finds: the same name gives the same stat) a metric; its id.
    fn define_metric(&self, kind: MetricKind, name: &str) -> Result<u32, HostError>;
    fn increment_metric(&self, id: u32, by: i64) -> Result<(), HostError>;
    fn record_metric(&self, id: u32, value: u64) -> Result<(), HostError>;

    /// Calls the root's `on_tick` every `period_ms`.
    fn set_tick_period(&self, period_ms: u64) -> Result<(), HostError>;
}

#[cfg(test)]
#[path = "tests/fake_host.rs"]
pub mod fake;
