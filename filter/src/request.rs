//! The client request as the filter sees it before asking the indexer: the headers it reads, the
//! session key it derives, and the `/v1/route` call it makes.
//!
//! Header values arrive as bytes (a client may send anything; the SDK's `String` getters would
//! panic on non-UTF-8), are decoded lossily, trimmed, bounded, and empty ones count as absent.
//! Operator overrides count only when [`override_trust`] says the request is trusted (it carries
//! the configured `override_secret`); otherwise the flow strips them and counts the refusal.

use std::rc::Rc;

use kvmesh_core::api::{DONE_PATH, FLEET_PATH, ROUTE_PATH};
use kvmesh_core::body_base::BodyBase;
use kvmesh_core::headers;
use kvmesh_core::openai::{Endpoint, OpenAiRequest, RequestPeek};
use kvmesh_core::session::{self, SessionKey, SessionSource};

use crate::config::{FilterConfig, MAX_OVERRIDE_SECRET_BYTES};
use crate::metrics::OverrideRefusal;

/// Longest override / session / request-id value the filter forwards; longer ones are ignored.
pub const MAX_META_VALUE_BYTES: usize = 256;

/// What the filter needs from the client's request headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    pub path: String,
    pub request_id: Option<String>,
    /// The explicit session id from the configured session header.
    pub session_id: Option<String>,
    pub override_worker: Option<String>,
    pub override_mode: Option<String>,
    /// The `x-kvmesh-override-secret` value (raw bytes, at most [`MAX_OVERRIDE_SECRET_BYTES`]);
    /// never logged, never forwarded.
    pub override_secret: Option<Vec<u8>>,
    /// Whether the request carried `x-kvmesh-override-secret` at all (it is always stripped).
    pub sent_override_secret: bool,
    /// Whether the client sent `content-length` (it must be fixed after a splice).
    pub has_content_length: bool,
    /// Whether the request carried `x-gateway-destination-endpoint`: the client's (stripped), or
    /// with `defer_to_picker` the endpoint picker's in front (kept).
    pub client_destination: bool,
    /// Its value (at most [`MAX_META_VALUE_BYTES`]), read for `defer_to_picker`: the first
    /// endpoint is the one the endpoint ledger judges.
    pub destination: Option<String>,
}

impl RequestHead {
    /// Reads the header pairs Envoy hands the filter (names are lowercase there).
    pub fn from_headers(pairs: &[(String, Vec<u8>)], session_header: &str) -> Self {
        let mut head = Self::default();
        for (name, value) in pairs {
            match name.as_str() {
                ":method" => head.method = text(value, usize::MAX).unwrap_or_default(),
                ":path" => head.path = text(value, usize::MAX).unwrap_or_default(),
                "content-length" => head.has_content_length = true,
                headers::DESTINATION_ENDPOINT => {
                    head.client_destination = true;
                    head.destination = text(value, MAX_META_VALUE_BYTES);
                }
                headers::REQUEST_ID => head.request_id = text(value, MAX_META_VALUE_BYTES),
                headers::OVERRIDE_WORKER => {
                    head.override_worker = text(value, MAX_META_VALUE_BYTES)
                }
                headers::OVERRIDE_MODE => head.override_mode = text(value, MAX_META_VALUE_BYTES),
                headers::OVERRIDE_SECRET => {
                    head.sent_override_secret = true;
                    head.override_secret =
                        (value.len() <= MAX_OVERRIDE_SECRET_BYTES).then(|| value.clone());
                }
                n if n == session_header => head.session_id = text(value, MAX_META_VALUE_BYTES),
                _ => {}
            }
        }
        head
    }

    /// Whether the client sent an operator override header.
    pub fn has_overrides(&self) -> bool {
        self.override_worker.is_some() || self.override_mode.is_some()
    }
}

/// Whether a request's overrides are honoured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OverrideTrust {
    /// The request sent no override header: nothing to decide.
    NoneSent,
    /// Overrides are on and the request carries the configured secret: forward them.
    Honoured,
    /// The request sent overrides that must not count: strip them and count why.
    Refused(OverrideRefusal),
}

/// Decides whether `head`'s overrides are honoured (pure; the secret compared in constant time).
pub fn override_trust(config: &FilterConfig, head: &RequestHead) -> OverrideTrust {
    if !head.has_overrides() {
        return OverrideTrust::NoneSent;
    }
    if !config.allow_overrides {
        return OverrideTrust::Refused(OverrideRefusal::Disabled);
    }
    match &head.override_secret {
        _ if !head.sent_override_secret => OverrideTrust::Refused(OverrideRefusal::NoSecret),
        Some(secret) if config.overrides_trusted(Some(secret)) => OverrideTrust::Honoured,
        _ => OverrideTrust::Refused(OverrideRefusal::BadSecret),
    }
}

/// Trimmed, non-empty, at most `max` bytes; else None.
fn text(value: &[u8], max: usize) -> Option<String> {
    let s = String::from_utf8_lossy(value);
    let s = s.trim();
    (!s.is_empty() && s.len() <= max).then(|| s.to_owned())
}

/// The session key: the explicit header wins, else (when `derive` is on) the key derived from the
/// request — a chat's conversation anchor; completions have none. The indexer's pin and the local
/// fallback both use the key returned here.
pub fn session_key(
    head: &RequestHead,
    request: &OpenAiRequest,
    derive: bool,
) -> Option<(SessionKey, SessionSource)> {
    peeked_session_key(head, &RequestPeek::of(request), derive)
}

/// [`session_key`] from the light read of the body ([`kvmesh_core::openai::peek`]), which the flow
/// uses: the same key.
pub fn peeked_session_key(
    head: &RequestHead,
    request: &RequestPeek,
    derive: bool,
) -> Option<(SessionKey, SessionSource)> {
    anchored_session_key(head, request.conversation_anchor, derive)
}

/// [`session_key`] from the conversation anchor's digest alone (`None`: the request has none).
pub fn anchored_session_key(
    head: &RequestHead,
    anchor: Option<u64>,
    derive: bool,
) -> Option<(SessionKey, SessionSource)> {
    if let Some(id) = &head.session_id {
        return Some((session::from_header_value(id), SessionSource::Header));
    }
    if !derive {
        return None;
    }
    // `session::derived_key` of the parsed request: the conversation anchor.
    anchor.map(|a| (SessionKey(a), SessionSource::Prefix))
}

/// An HTTP call through Envoy (`dispatch_http_call`). The body is shared, not copied: the
/// `/v1/route` body is the client's, which the flow keeps for a splice while the call is out
/// (`dispatch_http_call` copies it out of the VM; that copy the ABI forces).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    pub upstream: String,
    pub headers: Vec<(String, String)>,
    pub body: Option<Rc<Vec<u8>>>,
    /// Bytes of `body` not sent: a route call after a body base sends only what follows it.
    pub body_from: usize,
    pub timeout_ms: u64,
}

impl HttpCall {
    fn new(config: &FilterConfig, method: &str, path: &str, timeout_ms: u64) -> Self {
        Self {
            upstream: config.indexer_cluster.clone(),
            headers: vec![
                (":method".into(), method.into()),
                (":path".into(), path.into()),
                (":authority".into(), config.indexer_authority.clone()),
            ],
            body: None,
            body_from: 0,
            timeout_ms,
        }
    }

    /// `body`'s bytes from `from` on as the JSON body.
    fn with_json_body(mut self, body: Rc<Vec<u8>>, from: usize) -> Self {
        self.headers.push(("content-type".into(), "application/json".into()));
        self.headers.push(("content-length".into(), body.len().saturating_sub(from).to_string()));
        self.body = Some(body);
        self.body_from = from;
        self
    }

    /// The bytes the call sends, if it has a body.
    pub fn body(&self) -> Option<&[u8]> {
        self.body.as_deref().map(|b| b.get(self.body_from..).unwrap_or_default())
    }

    /// The value of header `name`, for tests and logs.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// `POST /v1/route` with the client's body unchanged (shared with the flow, not copied) — or, after
/// a body base `body` starts with, only the bytes that follow it — and the metadata in headers; the
/// overrides only when `head`'s are trusted ([`override_trust`]).
pub fn route_call(
    config: &FilterConfig,
    request_id: &str,
    endpoint: Endpoint,
    session: Option<(SessionKey, SessionSource)>,
    head: &RequestHead,
    body: Rc<Vec<u8>>,
    after: Option<BodyBase>,
) -> HttpCall {
    let mut call = HttpCall::new(config, "POST", ROUTE_PATH, config.indexer_timeout_ms);
    call.headers.push((headers::REQUEST_ID.into(), request_id.into()));
    call.headers.push((headers::KVMESH_PATH.into(), endpoint.path().into()));
    if let Some((key, source)) = session {
        call.headers.push((headers::KVMESH_SESSION.into(), session::encode_header(key, source)));
    }
    if override_trust(config, head) == OverrideTrust::Honoured {
        if let Some(worker) = &head.override_worker {
            call.headers.push((headers::OVERRIDE_WORKER.into(), worker.clone()));
        }
        if let Some(mode) = &head.override_mode {
            call.headers.push((headers::OVERRIDE_MODE.into(), mode.clone()));
        }
    }
    if let Some(base) = after {
        call.headers.push((headers::KVMESH_BODY_BASE.into(), base.to_string()));
    }
    call.with_json_body(body, after.map_or(0, |b| b.len))
}

/// Stamps a route call sent at `now_ns` (the host's wall clock, unix ns) with the instant this
/// filter stops waiting for it (`indexer_timeout_ms` later): the indexer books nothing for a call
/// it only starts after that (a stalled indexer's backlog, the calls of a VM that trapped). No
/// clock (0): no deadline, rather than one in 1970 that refuses every call.
pub fn stamp_route_deadline(call: &mut HttpCall, config: &FilterConfig, now_ns: u64) {
    if now_ns > 0 {
        let deadline_ms = now_ns / 1_000_000 + config.indexer_timeout_ms;
        call.headers.push((headers::KVMESH_ROUTE_DEADLINE.into(), deadline_ms.to_string()));
    }
}

/// `POST /v1/done` with a JSON [`kvmesh_core::api::DoneReport`].
pub fn done_call(config: &FilterConfig, report_json: Vec<u8>) -> HttpCall {
    HttpCall::new(config, "POST", DONE_PATH, config.background_timeout_ms)
        .with_json_body(Rc::new(report_json), 0)
}

/// `GET /v1/fleet`.
pub fn fleet_call(config: &FilterConfig) -> HttpCall {
    HttpCall::new(config, "GET", FLEET_PATH, config.background_timeout_ms)
}

#[cfg(test)]
#[path = "tests/request.rs"]
mod tests;
