//! gRPC health (`grpc.health.v1.Health`) under every name GIE gateways and their manifests
//! probe: `""`, `liveness` (the process serves), and `readiness`, `inference-extension` and the
//! ext_proc service's own name (the indexer is ready: its start-up replays are done and the fleet
//! is known — as `/readyz`; engine health is not part of it, see `crate::http`'s readiness).
//! From SIGTERM on they say NOT_SERVING for good ([`draining`]), before the picker drains the
//! streams it holds: a gateway's health check (and a readiness probe on the health listener, which
//! keeps serving until the process exits) stops sending new requests to a picker on its way out.

use std::sync::Arc;
use std::time::Duration;

use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use super::wire::SERVICE_NAME;
use crate::state::AppState;

/// Names whose status is the indexer's readiness.
pub const READINESS_SERVICES: [&str; 4] = ["", "readiness", "inference-extension", SERVICE_NAME];
/// The name that only says the process serves.
pub const LIVENESS_SERVICE: &str = "liveness";
/// How often readiness is re-read.
const PERIOD: Duration = Duration::from_millis(500);

/// Whether the indexer can pick: the start-up replays are done and the fleet is not empty.
pub fn ready(state: &AppState) -> bool {
    state.not_ready().is_empty() && !state.fleet.read().workers.is_empty()
}

/// Keeps `reporter` up to date with [`ready`] for as long as the process runs.
pub async fn track(state: Arc<AppState>, reporter: HealthReporter) {
    reporter.set_service_status(LIVENESS_SERVICE, ServingStatus::Serving).await;
    let mut last = None;
    loop {
        let now = ready(&state);
        if last != Some(now) {
            let status = if now { ServingStatus::Serving } else { ServingStatus::NotServing };
            for name in READINESS_SERVICES {
                reporter.set_service_status(name, status).await;
            }
            tracing::info!(
                ready = now,
                "endpoint picker health: {}",
                if now { "serving" } else { "not serving" }
            );
            last = Some(now);
        }
        tokio::time::sleep(PERIOD).await;
    }
}

/// The picker is draining: every readiness name NOT_SERVING (liveness stays SERVING: the process
/// still finishes its streams). Call once [`track`] has stopped, or it would flip them back.
pub async fn draining(reporter: &HealthReporter) {
    for name in READINESS_SERVICES {
        reporter.set_service_status(name, ServingStatus::NotServing).await;
    }
    tracing::info!("endpoint picker health: not serving (draining its streams)");
}
