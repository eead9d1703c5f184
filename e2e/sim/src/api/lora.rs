//! `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter`, as vLLM answers them:
//! 200 with a plain-text "Success: …" message, or an error JSON (400 `InvalidUserInput` for a
//! missing field or a name already loaded, 404 `NotFoundError` for unloading an unknown name).
//! The adapter path is not read (the simulator has no weights), so any path loads.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use serde::Deserialize;

use super::{ApiError, AppState};
use crate::lora::LoraError;

/// vLLM's `LoadLoRAAdapterRequest` (other fields are ignored).
#[derive(Debug, Deserialize)]
struct LoadRequest {
    #[serde(default)]
    lora_name: String,
    #[serde(default)]
    lora_path: String,
    #[serde(default)]
    load_inplace: bool,
}

/// vLLM's `UnloadLoRAAdapterRequest`.
#[derive(Debug, Deserialize)]
struct UnloadRequest {
    #[serde(default)]
    lora_name: String,
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid JSON: {e}")))
}

fn refused(e: LoraError) -> ApiError {
    match e {
        LoraError::NotFound(_) | LoraError::UnknownModel(_) => {
            ApiError::new(StatusCode::NOT_FOUND, "model_not_found", e.to_string())
        }
        _ => ApiError::new(StatusCode::BAD_REQUEST, "bad_request", e.to_string())
            .with_kind("InvalidUserInput"),
    }
}

fn engine_gone() -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "engine_gone", "the engine has stopped")
}

/// Counts a refused load or unload (`kvmesh_sim_requests_rejected_total`) and answers it.
fn counted(st: &AppState, r: Result<String, ApiError>) -> Result<String, ApiError> {
    if let Err(e) = &r {
        st.metrics.rejected.inc(e.reason);
        tracing::info!(status = %e.status, message = %e.message, "LoRA adapter request refused");
    }
    r
}

/// `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}`.
pub async fn load(State(st): State<Arc<AppState>>, body: Bytes) -> Result<String, ApiError> {
    let r = load_adapter(&st, &body).await;
    counted(&st, r)
}

/// `POST /v1/unload_lora_adapter {"lora_name"}`. Requests already queued for the adapter finish.
pub async fn unload(State(st): State<Arc<AppState>>, body: Bytes) -> Result<String, ApiError> {
    let r = unload_adapter(&st, &body).await;
    counted(&st, r)
}

async fn load_adapter(st: &AppState, body: &[u8]) -> Result<String, ApiError> {
    let req: LoadRequest = parse(body)?;
    let adapter = st
        .models
        .write()
        .load(&req.lora_name, &req.lora_path, None, req.load_inplace)
        .map_err(refused)?;
    st.engine.adapter(adapter.id, true).await.map_err(|_| engine_gone())?;
    tracing::info!(name = %adapter.name, id = adapter.id, path = %req.lora_path, "LoRA adapter loaded");
    Ok(format!("Success: LoRA adapter '{}' added successfully.", adapter.name))
}

async fn unload_adapter(st: &AppState, body: &[u8]) -> Result<String, ApiError> {
    let req: UnloadRequest = parse(body)?;
    let adapter = st.models.write().unload(&req.lora_name).map_err(refused)?;
    st.engine.adapter(adapter.id, false).await.map_err(|_| engine_gone())?;
    tracing::info!(name = %adapter.name, id = adapter.id, "LoRA adapter unloaded");
    Ok(format!("Success: LoRA adapter '{}' removed successfully.", adapter.name))
}
