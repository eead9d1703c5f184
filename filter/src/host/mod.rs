//! The only code that talks to Envoy: proxy-wasm contexts that gather plain data, hand it to the
//! plain modules, and execute the [`crate::effects::Effect`]s they return. Root-level logic (roles,
//! done sink, fleet cache, background work) lives in [`crate::roles`], [`crate::shared`] and
//! [`crate::tasks`] and reaches Envoy only through [`crate::host_api::Host`], implemented here.
//!
//! Host results are `Result`s here, never unwrapped: the SDK's trait helpers `unwrap()` internally,
//! so this layer calls `proxy_wasm::hostcalls` directly and turns an error status into a log line
//! and an `internal_errors{kind="host_call"}` count. (The SDK still aborts on statuses the ABI does
//! not define for a call; the panic hook below makes that visible at critical level, and the
//! bootstrap's `failure_policy: FAIL_RELOAD` replaces the trapped VM after a short backoff.)
//!
//! * [`adapter`]: [`crate::host_api::Host`] over `proxy_wasm::hostcalls`.
//! * [`root`]: root contexts (filter roots and the singleton service), glue of [`crate::roles`].
//! * [`http`]: one HTTP context per request, driving [`crate::flow::RequestFlow`].
//! * [`io`]: reads of one stream's headers, buffers and properties.

mod adapter;
mod http;
mod io;
mod root;

use proxy_wasm::hostcalls;
use proxy_wasm::types::LogLevel;

/// Installs the logger, the panic hook and the root context factory (called from `_initialize`).
pub fn init() {
    proxy_wasm::set_log_level(LogLevel::Info);
    // Replaces the SDK's hook (which unwraps its own log call) with one that cannot fail.
    std::panic::set_hook(Box::new(|info| {
        let _ = hostcalls::log(LogLevel::Critical, &format!("kvmesh-filter panicked: {info}"));
    }));
    proxy_wasm::set_root_context(|context_id| Box::new(root::Root::new(context_id)));
}
