//! One error type for every handler: vLLM-style OpenAI error JSON with the right status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvmesh_core::api::ErrorBody;

use crate::sched::RequestError;

/// An error answered to the client; `reason` labels `kvmesh_sim_requests_rejected_total`.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Metric label.
    pub reason: &'static str,
    /// Human-readable message.
    pub message: String,
    /// vLLM's `error.param`: the request field at fault (`input_tokens`, `max_tokens`), else null.
    pub param: Option<&'static str>,
    /// vLLM's `error.type` where it is not the status's usual one (`InvalidUserInput`).
    pub kind: Option<&'static str>,
}

impl ApiError {
    /// A 400 `BadRequestError`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            reason: "bad_request",
            message: message.into(),
            param: None,
            kind: None,
        }
    }

    /// Names the request field at fault (`error.param`).
    pub fn with_param(mut self, param: &'static str) -> Self {
        self.param = Some(param);
        self
    }

    /// Another metric reason.
    pub fn with_reason(mut self, reason: &'static str) -> Self {
        self.reason = reason;
        self
    }

    /// Another `error.type`.
    pub fn with_kind(mut self, kind: &'static str) -> Self {
        self.kind = Some(kind);
        self
    }

    /// Any status, with a metric reason.
    pub fn new(status: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        Self { status, reason, message: message.into(), param: None, kind: None }
    }

    /// vLLM's unknown-model 404: `NotFoundError`, `param: "model"`.
    pub fn unknown_model(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "model_not_found", message).with_param("model")
    }

    /// An injected fault.
    pub fn fault(status: u16, what: &str) -> Self {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Self {
            status,
            reason: "fault",
            message: format!("injected fault: {what}"),
            param: None,
            kind: None,
        }
    }
}

/// OpenAI's `error.type` for a status, as vLLM names them.
fn kind(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "BadRequestError",
        404 => "NotFoundError",
        429 => "RateLimitError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // vLLM's shape: {"error": {"message", "type", "param", "code"}}.
        let kind = self.kind.unwrap_or_else(|| kind(self.status));
        let body = ErrorBody::new(self.status.as_u16(), kind, self.message);
        let mut v = serde_json::to_value(&body).unwrap_or_default();
        if let Some(e) = v.get_mut("error").and_then(serde_json::Value::as_object_mut) {
            e.insert("param".into(), self.param.map_or(serde_json::Value::Null, Into::into));
        }
        (self.status, Json(v)).into_response()
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let (status, reason) = match &e {
            RequestError::QueueFull { .. } => (StatusCode::SERVICE_UNAVAILABLE, "queue_full"),
            RequestError::TooLong { .. } => (StatusCode::BAD_REQUEST, "too_long"),
            RequestError::EmptyPrompt => (StatusCode::BAD_REQUEST, "bad_request"),
            // vLLM surfaces a KV load failure as a generic 500.
            RequestError::KvLoadFailed(_) => (StatusCode::INTERNAL_SERVER_ERROR, "kv_load_failed"),
            RequestError::Duplicate(_) => (StatusCode::INTERNAL_SERVER_ERROR, "other"),
        };
        Self { status, reason, message: e.to_string(), param: None, kind: None }
    }
}
