//! [`ApiError`]: the one error type of the HTTP API.
//!
//! Every error answer carries a stable machine-readable `reason` — the `reason` label of
//! `kvmesh_route_errors_total` / `kvmesh_bad_requests_total` — in the body (`error.reason`) and in
//! the [`ERROR_REASON_HEADER`] header, so the filter can fall back and say why in
//! `x-kvmesh-fallback` without parsing English. Only `prefill_overloaded` is meant for the client
//! (the prefill worker's own 429/503); every other error means "route without me".

use std::sync::Arc;

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvmesh_core::api::{ErrorBody, ERROR_REASON_HEADER};
use kvmesh_core::models::{self, UNKNOWN_MODEL_REASON};

/// An API failure: status, OpenAI error body, and the stable reason it is counted and sent under.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub reason: &'static str,
    pub message: String,
    /// The request field the error is about (`model` for an unknown model, as vLLM says).
    pub param: Option<&'static str>,
    /// The base model the request resolved to, once it did (the `model` label of its count).
    pub model: Option<Arc<str>>,
}

impl ApiError {
    /// Any error: status, OpenAI error type, stable reason, message.
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        reason: &'static str,
        message: impl Into<String>,
    ) -> Self {
        Self { status, kind, reason, message: message.into(), param: None, model: None }
    }

    /// 404 for a `model` no entry of the fleet serves: vLLM's answer ([`models::not_found`]),
    /// reason [`UNKNOWN_MODEL_REASON`]. The filter answers the client with it; never forwarded.
    pub fn unknown_model(requested: &str) -> Self {
        let body = models::not_found(requested);
        Self {
            param: Some("model"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "NotFoundError",
                UNKNOWN_MODEL_REASON,
                body.error.message,
            )
        }
    }

    /// The error, counted under base model `model`.
    pub fn for_model(mut self, model: &str) -> Self {
        self.model = Some(Arc::from(model));
        self
    }

    /// 400: the request cannot be routed as sent.
    pub fn bad_request(reason: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", reason, message)
    }

    /// 413: the body (or, for a call after a body base, the base and the body) is over
    /// `routing.max_body_bytes`.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", "body_too_large", message)
    }

    /// 503: the indexer cannot answer this one now; the filter routes without it.
    pub fn unavailable(reason: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, "service_unavailable", reason, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body =
            ErrorBody::with_reason(self.status.as_u16(), self.kind, self.reason, self.message);
        body.error.param = self.param.map(str::to_owned);
        let mut resp = (self.status, Json(body)).into_response();
        resp.headers_mut().insert(ERROR_REASON_HEADER, HeaderValue::from_static(self.reason));
        resp
    }
}
