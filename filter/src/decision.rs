//! Reading the indexer's answer to `/v1/route`.
//!
//! Envoy delivers every outcome of a `dispatch_http_call` as a response: a down indexer is a local
//! `503` with a plain-text body, a missed deadline a `504`, a reset zero headers. So the status alone
//! cannot tell the indexer's deliberate refusal (429/503 *with* an OpenAI [`ErrorBody`], relayed to
//! the client because resource exhaustion must reach it) from Envoy saying nobody answered; the body
//! decides. Everything that is not a usable decision or a deliberate refusal is a fallback reason.

use std::net::SocketAddr;

use kvmesh_core::api::{destination_header, ErrorBody, Mode, RouteDecision};
use kvmesh_core::headers;

use crate::metrics::{FallbackReason, RouteLabel};

/// Largest `/v1/route` answer the filter reads; a larger one is a bad response.
pub const MAX_ANSWER_BYTES: usize = 256 * 1024;

/// Longest debug header value (reasons are for humans, not for bloating responses).
pub const MAX_DEBUG_VALUE_BYTES: usize = 256;

/// What the filter does with an indexer answer.
#[derive(Debug, Clone, PartialEq)]
pub enum IndexerAnswer {
    /// Route as decided.
    Route(RouteDecision),
    /// Send this status and body to the client.
    Reject { status: u16, body: Vec<u8> },
    /// Route without the indexer.
    Fallback(FallbackReason),
}

/// Classifies an answer; `status` is None when the call ended without headers.
pub fn classify(status: Option<u16>, body: &[u8]) -> IndexerAnswer {
    let Some(status) = status else {
        return IndexerAnswer::Fallback(FallbackReason::Reset);
    };
    match status {
        200 => match serde_json::from_slice::<RouteDecision>(body) {
            Ok(d) if is_endpoint(&d.endpoint) => IndexerAnswer::Route(d),
            _ => IndexerAnswer::Fallback(FallbackReason::BadResponse),
        },
        429 | 503 if serde_json::from_slice::<ErrorBody>(body).is_ok() => {
            IndexerAnswer::Reject { status, body: body.to_vec() }
        }
        503 => IndexerAnswer::Fallback(FallbackReason::Unavailable),
        504 => IndexerAnswer::Fallback(FallbackReason::Timeout),
        500..=599 => IndexerAnswer::Fallback(FallbackReason::ServerError),
        _ => IndexerAnswer::Fallback(FallbackReason::BadStatus),
    }
}

/// Whether `s` is an `ip:port` the override_host LB can match (`[v6]:port` included).
pub fn is_endpoint(s: &str) -> bool {
    s.parse::<SocketAddr>().is_ok()
}

/// The `x-gateway-destination-endpoint` value of a decision and how many fallbacks were not
/// `ip:port` and were left out (the primary was validated by [`classify`]).
pub fn destination(decision: &RouteDecision) -> (String, usize) {
    let valid: Vec<&str> = decision.fallbacks.iter().map(String::as_str).filter(|f| is_endpoint(f)).collect();
    let dropped = decision.fallbacks.len() - valid.len();
    (destination_header(&decision.endpoint, valid), dropped)
}

/// The `mode` label of a decision.
pub fn route_label(mode: Mode) -> RouteLabel {
    match mode {
        Mode::Aggregate => RouteLabel::Aggregate,
        Mode::Disagg => RouteLabel::Disagg,
        Mode::Migrate => RouteLabel::Migrate,
        Mode::DecodeFallback => RouteLabel::DecodeFallback,
    }
}

/// Debug response headers describing a decision.
pub fn debug_headers(decision: &RouteDecision) -> Vec<(&'static str, String)> {
    vec![
        (headers::DEBUG_MODE, decision.mode.as_str().to_owned()),
        (headers::DEBUG_WORKER, header_safe(&decision.worker)),
        (headers::DEBUG_OVERLAP_BLOCKS, decision.overlap_blocks.to_string()),
        (headers::DEBUG_ISL_BLOCKS, decision.isl_blocks.to_string()),
        (headers::DEBUG_REASON, header_safe(&decision.reason)),
    ]
}

/// `s` as a header value: visible ASCII and spaces only, at most [`MAX_DEBUG_VALUE_BYTES`].
pub fn header_safe(s: &str) -> String {
    let mut out: String = s.chars().map(|c| if c.is_ascii_graphic() || c == ' ' { c } else { '?' }).collect();
    out.truncate(MAX_DEBUG_VALUE_BYTES);
    out.trim().to_owned()
}

#[cfg(test)]
#[path = "tests/decision.rs"]
mod tests;
