//! Operational endpoints: health, metrics, prefix-cache reset, faults, cache dump, info, and
//! the producer side of the NIXL side channel.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

use super::{ApiError, AppState};
use crate::faults::FaultPatch;
use crate::nixl::{PullRequest, PullResponse};
use crate::sched::PullError;

/// Delay between answering `POST /admin/faults` and vanishing, so the answer gets out first.
const VANISH_GRACE: Duration = Duration::from_millis(20);

fn engine_gone() -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "engine_gone", "the engine has stopped")
}

/// `GET /health`: 200 with an empty body, as vLLM.
pub async fn health() -> StatusCode {
    StatusCode::OK
}

/// `GET /metrics`.
pub async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    if let Some(status) = st.faults.get().fail_metrics_status {
        st.metrics.faults.inc("fail_metrics");
        return ApiError::fault(status, "fail_metrics").into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
        )],
        st.metrics.render(),
    )
        .into_response()
}

/// `POST /reset_prefix_cache`: `AllBlocksCleared`; 409 while blocks are in use (vLLM refuses too).
pub async fn reset_prefix_cache(State(st): State<Arc<AppState>>) -> Result<StatusCode, ApiError> {
    match st.engine.reset().await.map_err(|_| engine_gone())? {
        Ok(()) => Ok(StatusCode::OK),
        Err(e) => Err(ApiError::new(
            StatusCode::CONFLICT,
            "other",
            format!("Failed to reset prefix cache: {e}"),
        )),
    }
}

/// `GET /admin/faults`.
pub async fn get_faults(State(st): State<Arc<AppState>>) -> Response {
    Json(st.faults.get()).into_response()
}

/// `POST /admin/faults`: applies a patch, answers the new state, then vanishes if asked.
pub async fn post_faults(
    State(st): State<Arc<AppState>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let patch: FaultPatch = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("fault patch: {e}")))?;
    let faults = st.faults.apply(&patch).map_err(|e| ApiError::bad_request(e.to_string()))?;
    tracing::info!(?faults, vanish_ms = ?patch.vanish_ms, "faults changed");
    if let Some(ms) = patch.vanish_ms.filter(|&ms| ms > 0) {
        st.metrics.faults.inc("vanish");
        let tx = st.vanish.clone();
        tokio::spawn(async move {
            tokio::time::sleep(VANISH_GRACE).await;
            let _ = tx.send(Duration::from_millis(ms));
        });
    }
    Ok(Json(faults).into_response())
}

/// `GET /admin/cache`: every cached block (shape in the README).
pub async fn cache(State(st): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let dump = st.engine.dump().await.map_err(|_| engine_gone())?;
    let mut v = serde_json::to_value(&dump)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "other", e.to_string()))?;
    if let Some(obj) = v.as_object_mut() {
        obj.insert("worker".into(), json!(st.info.id));
        obj.insert("dp_rank".into(), json!(st.info.dp_rank));
    }
    Ok(Json(v).into_response())
}

/// `GET /admin/info`.
pub async fn info(State(st): State<Arc<AppState>>) -> Response {
    Json(&st.info).into_response()
}

/// `POST /internal/nixl/pull`: a consumer reads a hold of ours (and releases it).
pub async fn nixl_pull(State(st): State<Arc<AppState>>, body: Bytes) -> Result<Response, ApiError> {
    let req: PullRequest = serde_json::from_slice(&body)
        .map_err(|e| ApiError::bad_request(format!("pull request: {e}")))?;
    if let Some(engine) = req.remote_engine_id.as_deref().filter(|e| *e != st.info.id) {
        return Err(ApiError::bad_request(format!("this is engine {}, not {engine}", st.info.id)));
    }
    let result = st
        .engine
        .serve_pull(req.remote_request_id, req.remote_block_ids)
        .await
        .map_err(|_| engine_gone())?;
    match result {
        Ok(blocks) => {
            Ok(Json(PullResponse { block_size: st.info.block_size, blocks }).into_response())
        }
        Err(e @ PullError::UnknownTransfer(_)) => {
            Err(ApiError::new(StatusCode::NOT_FOUND, "other", e.to_string()))
        }
        Err(e @ PullError::ForeignBlock { .. }) => Err(ApiError::bad_request(e.to_string())),
    }
}
