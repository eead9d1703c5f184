//! The HTTP API: `/v1/route`, `/v1/done`, `/v1/fleet`, `/v1/models`, `/metrics`, `/healthz`,
//! `/readyz`, `/debug/workers`, `/debug/blocks`.
//!
//! Handlers only: a route call's life (plan → run → settle) is [`crate::route`]'s. Every error is
//! an [`ApiError`] (OpenAI-style JSON body with a stable `reason`, a status, a metric label);
//! bodies are bounded by `routing.max_body_bytes` and every request by `routing.request_timeout_ms`
//! (a request past it is dropped, which releases what it booked).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvmesh_core::api::{RouteDecision, DONE_PATH, FLEET_PATH, ROUTE_PATH};
use tower_http::timeout::TimeoutLayer;

use crate::route::bookings;
use crate::route::record::{Endpoint, RouteMetrics};
use crate::state::AppState;

pub use crate::route::ApiError;

/// How much later than `routing.request_timeout_ms` the router-wide timeout fires.
const ROUTE_DEADLINE_MARGIN_MS: u64 = 500;

/// The API router over `state`. `/debug/*` only when [`crate::config::Config::debug_enabled`]
/// (by default: `listen` is a loopback address), as the config was at start.
pub fn router(state: Arc<AppState>) -> Router {
    let cfg = state.config();
    let mut api = Router::new()
        .route(ROUTE_PATH, post(route))
        .route(DONE_PATH, post(done))
        .route(FLEET_PATH, get(fleet))
        .route(MODELS_PATH, get(models))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz));
    if cfg.debug_enabled() {
        api = api
            .route("/debug/workers", get(debug_workers))
            .route("/debug/blocks", get(debug_blocks));
    }
    api.layer(DefaultBodyLimit::max(cfg.routing.max_body_bytes))
        // A backstop for every endpoint; `/v1/route` answers its own deadline first, with a reason.
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            Duration::from_millis(cfg.routing.request_timeout_ms + ROUTE_DEADLINE_MARGIN_MS),
        ))
        .with_state(state)
}

/// The `metrics_listen` router: `/metrics`, `/healthz`, `/readyz` and nothing else (no `/v1/*`, no
/// `/debug/*`), for scrapers and probes from outside the pod.
pub fn metrics_router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .layer(DefaultBodyLimit::max(1024))
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            Duration::from_secs(10),
        ))
        .with_state(state)
}

fn body(
    state: &AppState,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let err = if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(e.body_text())
        } else {
            ApiError::bad_request("bad_body", e.body_text())
        };
        RouteMetrics(&state.metrics).bad_request(endpoint, err.reason);
        err
    })
}

async fn route(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<RouteDecision>, ApiError> {
    let started = Instant::now();
    let raw = body(&state, Endpoint::Route, raw)?;
    let cfg = state.config();
    // The wall clock (not `clock::now`): the caller's deadline is unix time on the host's clock.
    let now_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let gone = crate::route::request::refuse_if_caller_gone(&headers, now_unix_ms);
    // Our own deadline (inside the layer's), so the answer carries a reason; the dropped call
    // releases whatever it booked.
    let deadline = Duration::from_millis(cfg.routing.request_timeout_ms);
    let result = match gone {
        Err(e) => Err(e),
        Ok(()) => {
            let call = crate::route::route(&state, cfg, &headers, raw, Default::default());
            match tokio::time::timeout(deadline, call).await {
                Ok(r) => r,
                Err(_) => Err(ApiError::unavailable(
                    "request_timeout",
                    format!(
                        "no decision within routing.request_timeout_ms = {} ms",
                        deadline.as_millis()
                    ),
                )),
            }
        }
    };
    RouteMetrics(&state.metrics).call_result(Endpoint::Route, &result, started.elapsed());
    result.map(Json)
}

async fn done(
    State(state): State<Arc<AppState>>,
    raw: Result<Bytes, BytesRejection>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let raw = body(&state, Endpoint::Done, raw)?;
    // One report (an object), or a batch (an array): the filter sends what waited as one call.
    let max = kvmesh_core::api::MAX_DONE_BATCH;
    let reports = kvmesh_core::api::parse_done_body(&raw)
        .map_err(|e| format!("not a DoneReport or an array of them: {e}"))
        .and_then(|r| match r.len() <= max {
            true => Ok(r),
            false => Err(format!("{} reports in one batch (at most {max})", r.len())),
        })
        .map_err(|message| {
            RouteMetrics(&state.metrics).bad_request(Endpoint::Done, "bad_json");
            ApiError::bad_request("bad_json", message)
        })?;
    let released = reports.iter().filter(|r| bookings::release_reported(&state, r)).count();
    if raw.trim_ascii_start().starts_with(b"[") {
        return Ok(Json(serde_json::json!({ "released": released })));
    }
    Ok(Json(serde_json::json!({ "released": released == 1 })))
}

async fn fleet(State(state): State<Arc<AppState>>) -> Json<kvmesh_core::api::FleetSnapshot> {
    Json(state.snapshot())
}

/// `GET /v1/models`: every base model, alias and adapter of the catalog, in vLLM's shape
/// (`kvmesh_core::models::models_list`, the filter's renderer too), for GIE gateways and debugging.
pub const MODELS_PATH: &str = "/v1/models";

async fn models(State(state): State<Arc<AppState>>) -> Json<serde_json::Value> {
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    Json(kvmesh_core::models::models_list(state.models().catalog(), created))
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    state.refresh_gauges();
    ([("content-type", "text/plain; version=0.0.4")], state.metrics.render())
}

/// Readiness means "this gateway can route": the start-up replays are done and the fleet is
/// known (non-empty). Engine health is not part of it: with every worker unhealthy (scrapes failing
/// fleet-wide, say) route calls answer 503 and the filter's fallback still routes every request, so
/// taking every gateway replica out of its Service would only turn that fallback into an outage.
/// That degraded state answers 200 with a `degraded:` body and a warning (the per-worker
/// `kvmesh_worker_healthy` gauges and `kvmesh_engine_scrapes_total{result="error"}` show it).
async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let waiting = state.not_ready();
    if !waiting.is_empty() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("waiting for the start-up replay of: {}\n", waiting.join(", ")),
        )
            .into_response();
    }
    let snapshot = state.snapshot();
    if snapshot.workers.is_empty() {
        tracing::debug!("not ready: the fleet is empty");
        return (StatusCode::SERVICE_UNAVAILABLE, "no_decode_worker: the fleet is empty\n")
            .into_response();
    }
    if snapshot.decode_candidates().next().is_none() {
        tracing::warn!(
            workers = snapshot.workers.len(),
            "no decode-capable worker is healthy: route calls fail and the filter's fallback \
             routes; staying ready"
        );
        return (
            StatusCode::OK,
            "degraded: no decode-capable worker is healthy; the filter's fallback routes\n",
        )
            .into_response();
    }
    (StatusCode::OK, "ready\n").into_response()
}

async fn debug_workers(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    Json(state.debug_workers())
}

#[derive(serde::Deserialize)]
struct BlocksQuery {
    worker: String,
}

async fn debug_blocks(
    State(state): State<Arc<AppState>>,
    q: Result<Query<BlocksQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::bad_request("bad_query", e.body_text()))?;
    match state.debug_blocks(&q.worker) {
        Some(b) => Ok(Json(b).into_response()),
        None => Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found",
            "unknown_worker",
            format!("no worker {:?}", q.worker),
        )),
    }
}

#[cfg(test)]
#[path = "http_tests.rs"]
mod tests;
