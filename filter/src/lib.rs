//! kvmesh-filter: the proxy-wasm HTTP filter that makes Envoy route OpenAI requests to the worker
//! already holding their KV cache.
//!
//! Per request: pause at headers, buffer the body, parse it (`kvmesh_core::openai`), derive the
//! session key, ask the sidecar indexer (`POST /v1/route`), then set
//! `x-gateway-destination-endpoint` for Envoy's `override_host` load balancer and splice
//! `kv_transfer_params` into the body when the decision carries them. Without an answer it pins the
//! session by rendezvous over the request's model's workers in the last `/v1/fleet` snapshot — the
//! same function the indexer pins with — or leaves the choice to Envoy's fallback LB. A model
//! nobody serves gets vLLM's 404 from the filter ([`models`]), and `GET /v1/models` is answered
//! from the snapshot. When the response ends, a `/v1/done` report is queued for a long-lived root
//! context to send.
//!
//! Shape (after Kuadrant's wasm-shim): every decision lives in plain modules with no proxy-wasm
//! import — [`config`], [`request`], [`body`], [`decision`], [`splice`], [`fallback`], [`flow`],
//! [`breaker`], [`endpoints`], [`background`], [`metrics`], [`models`] — which take plain data and
//! return [`effects::Effect`]s, tested natively with `cargo test`. Root-level logic — the role
//! matrix ([`roles`]), the done sink and fleet cache ([`shared`]), the fleet poll and done
//! dispatcher ([`tasks`]), metric ids ([`metric_ids`]) — calls the host only through the narrow
//! [`host_api::Host`] trait and is tested natively against its test double. The `host` module
//! (wasm only) is the one place that calls Envoy: the real `Host` adapter and the proxy-wasm
//! contexts.

pub mod background;
pub mod body;
pub mod body_bases;
pub mod body_budget;
pub mod breaker;
pub mod config;
pub mod decision;
pub mod effects;
pub mod endpoints;
pub mod fallback;
pub mod flow;
pub mod host_api;
pub mod metric_ids;
pub mod metrics;
pub mod models;
pub mod placement;
pub mod request;
pub mod request_id;
pub mod roles;
pub mod session_slots;
pub mod shared;
pub mod splice;
pub mod tasks;
pub mod ttft;

#[cfg(target_arch = "wasm32")]
mod host;

pub use config::FilterConfig;

/// `root_id` of the bootstrap singleton service (`envoy.bootstrap.wasm`, same `vm_id` as the filter).
/// Any other root id is a filter root.
pub const SERVICE_ROOT_ID: &str = "kvmesh_service";

#[cfg(target_arch = "wasm32")]
proxy_wasm::main! {{
    host::init();
}}
