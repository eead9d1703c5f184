//! [`ApiError`]: the one error type of the HTTP API.
//!
//! Every error answer carries a stable machine-readable `reason` — the `reason` label of
//! `kvmesh_route_errors_total` / `kvmesh_bad_requests_total` — in the body (`error.reason`) and in
//! the [`ERROR_REASON_HEADER`] header, so the filter can fall back and say why in
//! `x-kvmesh-fallback` without parsing English. Only `prefill_overloaded` is meant for the client
//! (the prefill worker's own 429/503); every other error means "route without me".

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvmesh_core::api::{ErrorBody, ERROR_REASON_HEADER};

/// An API failure: status, OpenAI error body, and the stable reason it is counted and sent under.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub reason: &'static str,
    pub message: String,
}

impl ApiError {
    /// 400: the request cannot be routed as sent.
    pub fn bad_request(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            reason,
            message: message.into(),
        }
    }

    /// 413: the body (or, for a call after a body base, the base and the body) is over
    /// `routing.max_body_bytes`.
    pub fn too_large(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            kind: "invalid_request_error",
            reason: "body_too_large",
            message: message.into(),
        }
    }

    /// 503: the indexer cannot answer this one now; the filter routes without it.
    pub fn unavailable(reason: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "service_unavailable",
            reason,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body =
            ErrorBody::with_reason(self.status.as_u16(), self.kind, self.reason, self.message);
        let mut resp = (self.status, Json(body)).into_response();
        resp.headers_mut().insert(ERROR_REASON_HEADER, HeaderValue::from_static(self.reason));
        resp
    }
}
