//! Reading the indexer's answer to `/v1/route`.
//!
//! Envoy delivers every outcome of a `dispatch_http_call` as a response: a down indexer is a local
//! `503` with a plain-text body, a missed deadline a `504`, a reset zero headers. So the status alone
//! cannot tell the indexer's deliberate refusal from Envoy saying nobody answered; the body decides.
//!
//! A model nobody serves is not routing's to fix: the indexer's 404 `unknown_model` makes the filter
//! answer the client vLLM's 404 ([`IndexerAnswer::UnknownModel`]), never forward the request.
//!
//! Routing is an optimisation, so exactly one indexer answer reaches the client: the designed
//! prefill overload (a `429`, or a `503` whose [`ErrorBody`] reason is `prefill_overloaded`; resource
//! exhaustion must make the client back off), and even that one only as a status, the stable
//! reason `prefill_overloaded` and a fixed message ([`rejection_body`]): the indexer's own message
//! names workers and quotes engines, so it goes to the filter's log, never to the client. Every other answer — no healthy decode worker, a
//! tokenizer or chat-template failure, the indexer shedding load, bad input, Envoy saying nobody
//! answered — is a [`Fallback`] with a reason label and, when the indexer said one, its error code.

use std::net::SocketAddr;

use kvmesh_core::api::{destination_header, ErrorBody, Mode, RouteDecision};
use kvmesh_core::models::UNKNOWN_MODEL_REASON;

use crate::breaker::CallHealth;
use crate::metrics::{FallbackReason, RouteLabel};

/// Largest `/v1/route` answer the filter reads; a larger one is a bad response.
pub const MAX_ANSWER_BYTES: usize = 256 * 1024;

/// Longest debug header value (reasons are for humans, not for bloating responses).
pub use kvmesh_core::headers::{header_safe, MAX_DEBUG_VALUE_BYTES};

/// The indexer's error reason for the one refusal relayed to clients.
pub const PREFILL_OVERLOADED: &str = "prefill_overloaded";

/// The client-facing message of the prefill-overload rejection: stable, names nothing inside the fleet.
pub const REJECTION_MESSAGE: &str = "the gateway's prefill capacity is exhausted; retry later";

/// Longest error code copied from an indexer answer into the debug header.
pub const MAX_CODE_BYTES: usize = 64;

/// What the filter does with an indexer answer.
#[derive(Debug, Clone, PartialEq)]
pub enum IndexerAnswer {
    /// Route as decided (boxed: a decision is several times the size of the other answers).
    Route(Box<RouteDecision>),
    /// Send this status and the stable [`rejection_body`] to the client; `detail` is the
    /// indexer's message (header-safe, bounded), for the log only.
    Reject { status: u16, body: Vec<u8>, detail: String },
    /// The indexer's 404 `unknown_model`: nobody serves the request's `model`. The filter answers
    /// the client vLLM's 404 itself ([`crate::models::not_found`]) and never forwards the request.
    UnknownModel,
    /// Route without the indexer.
    Fallback(Fallback),
}

/// Why a request is routed without the indexer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fallback {
    pub reason: FallbackReason,
    /// The indexer's error reason (`no_decode_worker`, `tokenizer`, `overloaded_shed`, …), when its
    /// answer carried one; sanitised to `[a-z0-9_.-]`, at most [`MAX_CODE_BYTES`].
    pub code: Option<String>,
    /// The booking id of an answer that booked load although the filter cannot use it.
    pub booking_id: Option<String>,
    /// Envoy said the call never reached the indexer (no healthy upstream, connect failure,
    /// circuit-breaker overflow): nothing can have been booked.
    pub never_reached: bool,
}

impl Fallback {
    /// A fallback without an indexer code.
    pub fn new(reason: FallbackReason) -> Self {
        Self { reason, code: None, booking_id: None, never_reached: false }
    }

    /// Whether a `/v1/done` must follow ([`FallbackReason::may_be_booked`], unless Envoy said
    /// the call never reached the indexer).
    pub fn needs_done(&self) -> bool {
        self.reason.may_be_booked() && !self.never_reached
    }

    /// The `x-kvmesh-fallback` value: `<reason>` or `<reason>; code=<code>`.
    pub fn header_value(&self) -> String {
        match &self.code {
            Some(code) => format!("{}; code={code}", self.reason.as_str()),
            None => self.reason.as_str().to_owned(),
        }
    }
}

impl FallbackReason {
    /// Whether the indexer may have booked load for the request, so a `/v1/done` must follow: it
    /// may have decided before the answer was lost (reset, deadline, an empty 503 from its own
    /// request timeout, a 5xx or an unreadable 200). Not when the call never left, was skipped,
    /// or the indexer answered a structured error (it books only what it answers with a decision).
    pub fn may_be_booked(self) -> bool {
        !matches!(
            self,
            Self::DispatchFailed | Self::BreakerOpen | Self::BodyBudget | Self::IndexerError
        )
    }

    /// What this outcome says about the indexer's liveness (for the circuit breaker), or None
    /// when no call was made.
    pub fn health(self) -> Option<CallHealth> {
        match self {
            Self::BreakerOpen | Self::BodyBudget => None,
            Self::DispatchFailed | Self::Reset | Self::Timeout | Self::Unavailable => {
                Some(CallHealth::Failed)
            }
            Self::ServerError | Self::BadStatus | Self::BadResponse | Self::IndexerError => {
                Some(CallHealth::Answered)
            }
        }
    }
}

/// Classifies an answer; `status` is None when the call ended without headers.
pub fn classify(status: Option<u16>, body: &[u8]) -> IndexerAnswer {
    let Some(status) = status else {
        return IndexerAnswer::Fallback(Fallback::new(FallbackReason::Reset));
    };
    if status == 200 {
        return match serde_json::from_slice::<RouteDecision>(body) {
            Ok(d) if is_endpoint(&d.endpoint) => IndexerAnswer::Route(Box::new(d)),
            _ => IndexerAnswer::Fallback(Fallback {
                booking_id: booking_id_of(body),
                ..Fallback::new(FallbackReason::BadResponse)
            }),
        };
    }
    if let Ok(err) = serde_json::from_slice::<ErrorBody>(body) {
        let reason = err.error.reason.as_deref();
        let designed_overload = match status {
            // A 429 is the prefill overload unless the indexer names another reason (older
            // indexers name none).
            429 => reason.is_none_or(|r| r == PREFILL_OVERLOADED),
            503 => reason == Some(PREFILL_OVERLOADED),
            _ => false,
        };
        if status == 404 && reason == Some(UNKNOWN_MODEL_REASON) {
            return IndexerAnswer::UnknownModel;
        }
        if designed_overload {
            return IndexerAnswer::Reject {
                status,
                body: rejection_body(status),
                detail: header_safe(&err.error.message),
            };
        }
        if (400..=599).contains(&status) {
            let code = reason
                .map(sanitize_code)
                .or_else(|| Some(sanitize_code(&err.error.kind)))
                .filter(|c| !c.is_empty());
            return IndexerAnswer::Fallback(Fallback {
                code,
                ..Fallback::new(FallbackReason::IndexerError)
            });
        }
    }
    if status == 503 && is_envoy_unreachable(body) {
        return IndexerAnswer::Fallback(Fallback {
            never_reached: true,
            ..Fallback::new(FallbackReason::Unavailable)
        });
    }
    let reason = match status {
        503 => FallbackReason::Unavailable,
        504 => FallbackReason::Timeout,
        500..=599 => FallbackReason::ServerError,
        _ => FallbackReason::BadStatus,
    };
    IndexerAnswer::Fallback(Fallback::new(reason))
}

/// The body sent to the client for the prefill overload: an OpenAI error with the stable reason
/// [`PREFILL_OVERLOADED`] and [`REJECTION_MESSAGE`], whatever the indexer's message said.
pub fn rejection_body(status: u16) -> Vec<u8> {
    let kind = if status == 429 { "rate_limit_exceeded" } else { "service_unavailable" };
    // A struct of strings and a number: serialisation cannot fail.
    serde_json::to_vec(&ErrorBody::with_reason(status, kind, PREFILL_OVERLOADED, REJECTION_MESSAGE))
        .unwrap_or_default()
}

/// Envoy's local-reply bodies for a call that never reached an upstream host.
fn is_envoy_unreachable(body: &[u8]) -> bool {
    let text = String::from_utf8_lossy(&body[..body.len().min(512)]);
    text.starts_with("no healthy upstream")
        || (text.starts_with("upstream connect error")
            && (text.contains("connection failure") || text.contains("overflow")))
}

/// `booking_id` of a JSON object that is not a usable decision, if it names one.
fn booking_id_of(body: &[u8]) -> Option<String> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    let id = value.get("booking_id")?.as_str()?;
    (!id.is_empty() && id.len() <= MAX_DEBUG_VALUE_BYTES).then(|| id.to_owned())
}

/// An error code as a header-safe token.
pub fn sanitize_code(code: &str) -> String {
    let mut out: String = code
        .trim()
        .chars()
        .map(|c| c.to_ascii_lowercase())
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') { c } else { '_' })
        .collect();
    out.truncate(MAX_CODE_BYTES);
    out
}

/// Whether `s` is an `ip:port` the override_host LB can match (`[v6]:port` included).
pub fn is_endpoint(s: &str) -> bool {
    s.parse::<SocketAddr>().is_ok()
}

/// The `x-gateway-destination-endpoint` value of a decision and how many fallbacks were not
/// `ip:port` and were left out (the primary was validated by [`classify`]).
pub fn destination(decision: &RouteDecision) -> (String, usize) {
    let valid: Vec<&str> =
        decision.fallbacks.iter().map(String::as_str).filter(|f| is_endpoint(f)).collect();
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

/// Debug response headers describing a decision (the core's, shared with the endpoint picker).
pub fn debug_headers(decision: &RouteDecision) -> Vec<(&'static str, String)> {
    decision.debug_headers()
}

#[cfg(test)]
#[path = "tests/decision.rs"]
mod tests;
