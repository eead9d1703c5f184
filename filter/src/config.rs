//! The filter's configuration: the plugin configuration JSON → one validated [`FilterConfig`].
//!
//! Defined once in [`kvmesh_core::filter_config`] (struct, defaults, bounds, validation, the
//! override trust check), because the indexer's `--check` and the e2e harness read the same
//! configuration; this module only re-exports it under the filter's names. Shaped after Kuadrant's
//! wasm-shim: parsed once in `on_configure`, refused there when invalid (so Envoy rejects the
//! config instead of running a half-configured filter), then shared read-only by every HTTP
//! context. The same JSON configures the filter roots and the singleton service, so the two can
//! never disagree about the indexer cluster or the queue bounds.

pub use kvmesh_core::filter_config::{
    secret_matches, Background, ConfigError, FilterConfig, DEFAULT_INDEXER_TIMEOUT_MS,
    MAX_BODY_BYTES_LIMIT, MAX_OVERRIDE_SECRET_BYTES, MAX_TICK_MS, MIN_OVERRIDE_SECRET_BYTES,
    REMOVED_SESSION_PREFIX_UNITS,
};
