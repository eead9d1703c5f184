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
    let status = match e {
        LoraError::NotFound(_) | LoraError::UnknownModel(_) => StatusCode::NOT_FOUND,
        _ => StatusCode::BAD_REQUEST,
    };
    let err = ApiError::new(status, "bad_request", e.to_string());
    if status == StatusCode::BAD_REQUEST {
        err.with_kind("InvalidUserInput")
    } else {
        err
    }
}

fn engine_gone() -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "engine_gone", "the engine has stopped")
}

/// `POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}`.
pub async fn load(State(st): State<Arc<AppState>>, body: Bytes) -> Result<String, ApiError> {
    let req: LoadRequest = parse(&body)?;
    let adapter = st
        .models
        .write()
        .load(&req.lora_name, &req.lora_path, None, req.load_inplace)
        .map_err(refused)?;
    st.engine.adapter(adapter.id, true).await.map_err(|_| engine_gone())?;
    tracing::info!(name = %adapter.name, id = adapter.id, path = %req.lora_path, "LoRA adapter loaded");
    Ok(format!("Success: LoRA adapter '{}' added successfully.", adapter.name))
}

/// `POST /v1/unload_lora_adapter {"lora_name"}`. Requests already queued for the adapter finish.
pub async fn unload(State(st): State<Arc<AppState>>, body: Bytes) -> Result<String, ApiError> {
    let req: UnloadRequest = parse(&body)?;
    let adapter = st.models.write().unload(&req.lora_name).map_err(refused)?;
    st.engine.adapter(adapter.id, false).await.map_err(|_| engine_gone())?;
    tracing::info!(name = %adapter.name, id = adapter.id, "LoRA adapter unloaded");
    Ok(format!("Success: LoRA adapter '{}' removed successfully.", adapter.name))
}
