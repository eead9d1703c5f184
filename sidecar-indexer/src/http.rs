//! The HTTP API: `/v1/route`, `/v1/done`, `/v1/fleet`, `/metrics`, `/healthz`, `/readyz`,
//! `/debug/workers`, `/debug/blocks`.
//!
//! Handlers only move data: parse headers and body, run the pure steps (tokenize on the blocking
//! pool, match under the index read lock, [`decide`]), book load, record metrics, answer. Every
//! error is an [`ApiError`] (OpenAI-style JSON body, a status, a metric label); bodies are bounded by
//! `routing.max_body_bytes` and every request by `routing.request_timeout_ms`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvmesh_core::api::{DoneReport, ErrorBody, Mode, RouteDecision, DONE_PATH, FLEET_PATH, ROUTE_PATH};
use kvmesh_core::hashing::{block_seed, sequence_hashes};
use kvmesh_core::{headers, openai, session};
use tower_http::timeout::TimeoutLayer;

use crate::config::IndexMode;
use crate::decide::{decide, RouteInput};
use crate::events::applier::ApplierMsg;
use crate::handoff::{self, LegRequest};
use crate::state::AppState;
use crate::tokenize::CacheStats;

/// An API failure: status, OpenAI error body, and the metric label it is counted under.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl ApiError {
    fn bad_request(reason: &'static str, message: impl Into<String>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", reason, message: message.into() }
    }
    fn unavailable(reason: &'static str, message: impl Into<String>) -> Self {
        Self { status: StatusCode::SERVICE_UNAVAILABLE, kind: "service_unavailable", reason, message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody::new(self.status.as_u16(), self.kind, self.message);
        (self.status, Json(body)).into_response()
    }
}

/// The API router over `state`.
pub fn router(state: Arc<AppState>) -> Router {
    let cfg = state.config();
    Router::new()
        .route(ROUTE_PATH, post(route))
        .route(DONE_PATH, post(done))
        .route(FLEET_PATH, get(fleet))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/debug/workers", get(debug_workers))
        .route("/debug/blocks", get(debug_blocks))
        .layer(DefaultBodyLimit::max(cfg.routing.max_body_bytes))
        .layer(TimeoutLayer::with_status_code(StatusCode::SERVICE_UNAVAILABLE, Duration::from_millis(cfg.routing.request_timeout_ms)))
        .with_state(state)
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, ApiError> {
    match h.get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(|s| Some(s.trim())).map_err(|_| ApiError::bad_request("bad_header", format!("header {name} is not visible ASCII"))),
    }
}

fn body(state: &AppState, endpoint: &'static str, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let err = if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError { status: StatusCode::PAYLOAD_TOO_LARGE, kind: "invalid_request_error", reason: "body_too_large", message: e.body_text() }
        } else {
            ApiError::bad_request("bad_body", e.body_text())
        };
        state.metrics.bad_requests.with_label_values(&[endpoint, err.reason]).inc();
        err
    })
}

async fn route(State(state): State<Arc<AppState>>, headers: HeaderMap, raw: Result<Bytes, BytesRejection>) -> Result<Json<RouteDecision>, ApiError> {
    let started = Instant::now();
    let raw = body(&state, "route", raw)?;
    let result = route_inner(&state, &headers, raw).await;
    match &result {
        Ok(_) => state.metrics.route_duration.observe(started.elapsed().as_secs_f64()),
        Err(e) if e.status.is_client_error() && e.status != StatusCode::TOO_MANY_REQUESTS => {
            state.metrics.bad_requests.with_label_values(&["route", e.reason]).inc()
        }
        Err(e) => state.metrics.route_errors.with_label_values(&[e.reason]).inc(),
    }
    if let Err(e) = &result {
        tracing::debug!(status = e.status.as_u16(), reason = e.reason, message = %e.message, "route refused");
    }
    result.map(Json)
}

async fn route_inner(state: &Arc<AppState>, h: &HeaderMap, raw: Bytes) -> Result<RouteDecision, ApiError> {
    let path = header(h, headers::KVMESH_PATH)?.ok_or_else(|| ApiError::bad_request("missing_path", format!("missing {} header", headers::KVMESH_PATH)))?;
    let endpoint = openai::Endpoint::from_path(path)
        .ok_or_else(|| ApiError::bad_request("bad_path", format!("{} {path:?} is not a routable OpenAI path", headers::KVMESH_PATH)))?;
    let session = match header(h, headers::KVMESH_SESSION)? {
        None | Some("") => None,
        Some(v) => Some(session::parse_header(v).ok_or_else(|| ApiError::bad_request("bad_session", format!("cannot parse {} {v:?}", headers::KVMESH_SESSION)))?),
    };
    let override_worker = header(h, headers::OVERRIDE_WORKER)?.filter(|s| !s.is_empty()).map(str::to_owned);
    let override_mode = match header(h, headers::OVERRIDE_MODE)? {
        None | Some("") => None,
        Some(m) => Some(Mode::parse(m).ok_or_else(|| ApiError::bad_request("bad_mode", format!("unknown mode {m:?} in {}", headers::OVERRIDE_MODE)))?),
    };
    let request_id = header(h, headers::REQUEST_ID)?.filter(|s| !s.is_empty()).map(str::to_owned);
    let request = openai::parse(endpoint, &raw).map_err(|e| ApiError::bad_request(e.reason(), e.to_string()))?;

    let cfg = state.config();
    let block_size = cfg.model.block_size;
    let tokenizer = state.tokenizer.read().clone();
    let metrics = state.metrics.clone();
    // Tokenizing a long cold prompt takes milliseconds of CPU: keep it off the async workers.
    let (tokens, chains) = tokio::task::spawn_blocking(move || {
        let t0 = Instant::now();
        let mut stats = CacheStats::default();
        let tokens = tokenizer.tokens(&request.input, &mut stats);
        metrics.tokenize_duration.observe(t0.elapsed().as_secs_f64());
        metrics.tokenize_cache.with_label_values(&["hit"]).inc_by(stats.hits);
        metrics.tokenize_cache.with_label_values(&["miss"]).inc_by(stats.misses);
        tokens.map(|t| {
            let chains = sequence_hashes(&t, block_size as usize, block_seed(None, request.cache_salt.as_deref()));
            (t.len(), chains)
        })
    })
    .await
    .map_err(|e| ApiError::unavailable("tokenizer", format!("tokenizer task failed: {e}")))?
    .map_err(|e| ApiError::unavailable("tokenizer", e.to_string()))?;

    let t_match = Instant::now();
    let scores = state.index.read().find_matches(&chains);
    state.metrics.match_duration.observe(t_match.elapsed().as_secs_f64());

    let t_score = Instant::now();
    let session_key = session.map(|(k, _)| k.0);
    let now = Instant::now();
    let (continuation, kv_home) = match session_key {
        Some(k) => {
            let sessions = state.sessions.lock();
            (sessions.continuations.get(k, now).is_some(), sessions.kv_home.get(k, now).cloned())
        }
        None => (false, None),
    };
    let input = RouteInput {
        isl_tokens: tokens,
        block_size,
        session,
        override_worker: override_worker.as_deref(),
        override_mode,
        continuation,
        kv_home: kv_home.as_deref(),
    };
    let id = request_id.clone().unwrap_or_else(|| format!("kvmesh-{:016x}", rand::random::<u64>()));
    let (plan, approx_slot) = {
        let fleet = state.fleet.read();
        let overlaps = fleet.overlaps(&scores);
        let mut load = state.load.lock();
        let views = state.views(&fleet, &overlaps, &load, cfg.routing.unknown_request_blocks);
        let plan = {
            let mut rng = state.rng.lock();
            decide(&input, &views, &cfg.routing, &mut *rng)
        }
        .map_err(|e| {
            let err = ApiError { status: StatusCode::SERVICE_UNAVAILABLE, kind: "service_unavailable", reason: e.reason(), message: e.to_string() };
            if matches!(e, crate::decide::DecideError::UnknownOverrideWorker(_)) {
                ApiError { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", ..err }
            } else {
                err
            }
        })?;
        // A remote prefill leaves the decode worker only the KV pull; its prefill is booked on P.
        let prefill_tokens = if plan.mode == Mode::Disagg { 0 } else { plan.uncached_tokens };
        let expired = load.book(&id, &plan.worker, u64::from(plan.request_blocks), prefill_tokens, Instant::now());
        if expired.timeout > 0 {
            state.metrics.load_expired.with_label_values(&["timeout"]).inc_by(expired.timeout);
        }
        if expired.overflow > 0 {
            state.metrics.load_expired.with_label_values(&["overflow"]).inc_by(expired.overflow);
        }
        let approx_slot = (cfg.routing.mode == IndexMode::Approximate)
            .then(|| fleet.workers.iter().find(|w| w.cfg.id == plan.worker).and_then(|w| w.ranks.first().map(|r| r.slot)))
            .flatten();
        (plan, approx_slot)
    };
    state.metrics.score_duration.observe(t_score.elapsed().as_secs_f64());

    if let Some(slot) = approx_slot {
        if !chains.is_empty() && state.applier.try_send(ApplierMsg::Approx { slot, chains, at: Instant::now() }).is_err() {
            state.metrics.kv_ignored.with_label_values(&[plan.worker.as_str(), "queue_full"]).inc();
        }
    }
    let (basis, request_blocks, local_continuation) = (plan.basis, plan.request_blocks, plan.local_continuation);
    let decision = handoff::complete(state, &cfg, plan, &LegRequest { request_id: &id, path, body: &raw }).await?;
    let m = &state.metrics;
    m.decisions.with_label_values(&[decision.mode.as_str(), basis.as_str()]).inc();
    if local_continuation {
        m.local_continuations.inc();
    }
    if request_blocks > 0 {
        m.hit_rate.observe(f64::from(decision.overlap_blocks) / f64::from(request_blocks));
        m.overlap_blocks.inc_by(u64::from(decision.overlap_blocks));
        m.isl_blocks.inc_by(u64::from(request_blocks));
    }
    if let Some(k) = session_key {
        state.sessions.lock().served(k, &decision.worker, Instant::now());
    }
    tracing::debug!(
        request_id = %id,
        worker = %decision.worker,
        mode = decision.mode.as_str(),
        overlap_blocks = decision.overlap_blocks,
        isl_blocks = decision.isl_blocks,
        reason = %decision.reason,
        "routed"
    );
    Ok(decision)
}

async fn done(State(state): State<Arc<AppState>>, raw: Result<Bytes, BytesRejection>) -> Result<Json<serde_json::Value>, ApiError> {
    let raw = body(&state, "done", raw)?;
    let report: DoneReport = serde_json::from_slice(&raw).map_err(|e| {
        state.metrics.bad_requests.with_label_values(&["done", "bad_json"]).inc();
        ApiError::bad_request("bad_json", format!("not a DoneReport: {e}"))
    })?;
    let released = state.load.lock().release(&report.request_id);
    state.metrics.done_reports.with_label_values(&[report.outcome.as_str(), if released.is_some() { "true" } else { "false" }]).inc();
    Ok(Json(serde_json::json!({ "released": released.is_some() })))
}

async fn fleet(State(state): State<Arc<AppState>>) -> Json<kvmesh_core::api::FleetSnapshot> {
    Json(state.snapshot())
}

async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    state.refresh_gauges();
    ([("content-type", "text/plain; version=0.0.4")], state.metrics.render())
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let waiting = state.not_ready();
    if waiting.is_empty() {
        (StatusCode::OK, "ready\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, format!("waiting for the start-up replay of: {}\n", waiting.join(", "))).into_response()
    }
}

async fn debug_workers(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    Json(state.debug_workers())
}

#[derive(serde::Deserialize)]
struct BlocksQuery {
    worker: String,
}

async fn debug_blocks(State(state): State<Arc<AppState>>, q: Result<Query<BlocksQuery>, axum::extract::rejection::QueryRejection>) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| ApiError::bad_request("bad_query", e.body_text()))?;
    match state.debug_blocks(&q.worker) {
        Some(b) => Ok(Json(b).into_response()),
        None => Err(ApiError { status: StatusCode::NOT_FOUND, kind: "not_found", reason: "unknown_worker", message: format!("no worker {:?}", q.worker) }),
    }
}

#[cfg(test)]
#[path = "http_tests.rs"]
mod tests;
