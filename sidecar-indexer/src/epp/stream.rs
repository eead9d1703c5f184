//! One ext_proc stream, one HTTP request through a GIE gateway: read the request, pick on the
//! route pipeline the filter's `/v1/route` uses, answer in the order the body mode demands, and
//! release the booking when the response ends (or the stream does).
//!
//! Per body mode (`ProtocolConfiguration` on the stream's first message; absent: the
//! FULL_DUPLEX_STREAMED that GIE requires):
//! - FULL_DUPLEX_STREAMED: the headers answer waits for the whole body; then the destination
//!   (header mutation + `envoy.lb` metadata) and the body re-sent in chunks.
//! - BUFFERED / BUFFERED_PARTIAL: the headers are answered at once; the body answer carries the
//!   destination (the headers are still held) and, when spliced, the new body.
//! - STREAMED with `send_body_without_waiting_for_header_response` (the `both` edge's mode: the
//!   body reaches the picker before it answers the headers, and Envoy keeps its own copy, so
//!   failure_mode_allow holds throughout): as FULL_DUPLEX_STREAMED, the headers answer waits for
//!   the whole body; then one answer per chunk — unchanged, or the first replaced by the spliced
//!   body and the others cleared.
//! - STREAMED (headers first) / NONE: the body would be on its way before the picker saw it: the
//!   pick is made at the headers, without the prompt (the session's pin; `kvmesh_epp_requests_total{result=
//!   "no_body"}`).
//!
//! Routing is an optimisation: a route call that fails for the router's reasons (shed, timeout,
//! a tokenizer error) still gets a destination, the session's pin among the model's healthy
//! workers. Only what vLLM would refuse too (unreadable JSON, an unknown model, a body over the
//! bound) or nothing eligible gets an immediate answer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::http::{HeaderMap as HttpHeaders, HeaderName, HeaderValue, StatusCode};
use kvmesh_core::api::{destination_header, DoneReport, Outcome, RouteDecision};
use kvmesh_core::json_edit::{self, Edit};
use kvmesh_core::session::{self, SessionSource};
use kvmesh_core::usage::UsageTail;
use kvmesh_core::{headers, models, openai, rendezvous};
use tokio::sync::mpsc;

use super::body::BodyParts;
use super::head::{self, RequestHead, CONFORMANCE_SERVED};
use super::reply::{self, Destination, Phase};
use super::wire::{BodySendMode, ProcessingRequest, ProcessingResponse, Request};
use crate::route::record::{Endpoint, RouteMetrics};
use crate::route::{self, ApiError, Eligible, Front};
use crate::state::AppState;

/// How many fallback endpoints follow the primary in a pin's destination (the proxy's retries
/// walk the list).
const PIN_FALLBACKS: usize = 2;

/// An immediate answer that replaces forwarding the request (boxed: a response is large and the
/// routed path is the common one).
type Refusal = Box<ProcessingResponse>;

/// What the stream has learned so far.
struct Exchange {
    request_mode: BodySendMode,
    response_mode: BodySendMode,
    /// The headers are answered only once the whole body is in (FULL_DUPLEX_STREAMED, or STREAMED
    /// with the body sent before the headers' answer).
    hold_headers: bool,
    /// Request body chunks received (each is answered, in held STREAMED mode).
    chunk_count: usize,
    head: Option<RequestHead>,
    front: Front,
    /// The request body while it arrives.
    body: BodyParts,
    /// Its length so far.
    body_len: usize,
    /// The whole body once the pick starts (shared with the route call, re-sent from here).
    frozen: Bytes,
    /// Whether the request has been answered with a destination (or an immediate response).
    decided: bool,
    /// The booking to release when the response ends.
    booking: Option<Booked>,
    /// The decision's debug headers for the response (`[filter] debug_headers`).
    debug: Vec<(String, String)>,
    response_status: Option<u16>,
    served: Option<String>,
    /// The response's last bytes, for the engine's `usage` (attribution: `route::attribution`).
    usage: UsageTail,
}

struct Booked {
    booking_id: String,
    request_id: String,
}

/// Why the stream ended early: the gateway went away or broke the protocol.
#[derive(Debug)]
pub enum StreamEnd {
    Closed,
    Protocol(&'static str),
}

/// Drives one stream: `inbound` from the gateway, answers on `out`. Returns when the gateway ends
/// the stream; whatever is still booked is released then.
pub async fn run(
    state: Arc<AppState>,
    mut inbound: tonic::Streaming<ProcessingRequest>,
    out: mpsc::Sender<Result<ProcessingResponse, tonic::Status>>,
) {
    let mut x = Exchange {
        request_mode: BodySendMode::FullDuplexStreamed,
        response_mode: BodySendMode::FullDuplexStreamed,
        hold_headers: true,
        chunk_count: 0,
        head: None,
        front: Front {
            derive_session: state.config().filter.derive_session_keys,
            eligible: vec![],
        },
        body: BodyParts::default(),
        body_len: 0,
        frozen: Bytes::new(),
        decided: false,
        booking: None,
        debug: Vec::new(),
        response_status: None,
        served: None,
        usage: UsageTail::default(),
    };
    let mut first = true;
    let end = loop {
        let msg = match inbound.message().await {
            Ok(Some(m)) => m,
            Ok(None) => break StreamEnd::Closed,
            Err(status) => {
                tracing::debug!(code = ?status.code(), message = status.message(), "ext_proc stream ended by the gateway");
                break StreamEnd::Closed;
            }
        };
        if first {
            first = false;
            if let Some(pc) = msg.protocol_config {
                x.request_mode = mode(pc.request_body_mode);
                x.response_mode = mode(pc.response_body_mode);
                x.hold_headers = x.request_mode == BodySendMode::FullDuplexStreamed
                    || (x.request_mode == BodySendMode::Streamed
                        && pc.send_body_without_waiting_for_header_response);
            }
        }
        let answers = match step(&state, &mut x, msg).await {
            Ok(a) => a,
            Err(why) => break StreamEnd::Protocol(why),
        };
        for a in answers {
            if out.send(Ok(a)).await.is_err() {
                break;
            }
        }
    };
    if let StreamEnd::Protocol(why) = end {
        state.metrics.epp_request("protocol_error");
        tracing::warn!(why, "ext_proc stream out of order: closed");
        let _ = out.send(Err(tonic::Status::invalid_argument(why))).await;
    }
    release(&state, &mut x, Outcome::Aborted);
}

fn mode(raw: i32) -> BodySendMode {
    BodySendMode::try_from(raw).unwrap_or(BodySendMode::FullDuplexStreamed)
}

/// One message → the answers it calls for (possibly none yet: a body still arriving).
async fn step(
    state: &Arc<AppState>,
    x: &mut Exchange,
    msg: ProcessingRequest,
) -> Result<Vec<ProcessingResponse>, &'static str> {
    let cfg = state.config();
    match msg.request {
        None => Err("a message with no request part"),
        Some(Request::RequestHeaders(h)) => {
            if x.head.is_some() {
                return Err("request headers twice");
            }
            let map = h.headers.unwrap_or_default();
            let head = RequestHead::read(&map, &cfg.filter);
            if let Some(subset) = head::subset_hint(msg.metadata_context.as_ref()) {
                x.front.eligible.push(subset);
            }
            if let Some(selection) =
                head.conformance_selection.as_deref().filter(|_| cfg.epp.conformance)
            {
                x.front.eligible.push(Eligible::from_comma_list(selection));
            }
            x.head = Some(head);
            if h.end_of_stream {
                return Ok(vec![decide(state, x, Phase::RequestHeaders, true).await]);
            }
            if x.hold_headers {
                return Ok(vec![]);
            }
            match x.request_mode {
                BodySendMode::Buffered | BodySendMode::BufferedPartial => {
                    Ok(vec![reply::pass(Phase::RequestHeaders, &[])])
                }
                _ => {
                    state.metrics.epp_request("no_body");
                    Ok(vec![decide(state, x, Phase::RequestHeaders, false).await])
                }
            }
        }
        Some(Request::RequestBody(b)) => {
            if x.head.is_none() {
                return Err("a request body before its headers");
            }
            if x.decided {
                // STREAMED / NONE after a headers pick: the chunks go on as sent.
                return Ok(vec![reply::pass(Phase::RequestBody, &[])]);
            }
            if x.body_len + b.body.len() > cfg.routing.max_body_bytes {
                x.decided = true;
                state.metrics.epp_request("too_large");
                let e = ApiError::too_large(format!(
                    "the request body exceeds routing.max_body_bytes = {}",
                    cfg.routing.max_body_bytes
                ));
                return Ok(vec![error_answer(&e)]);
            }
            let ends = b.end_of_stream;
            x.body_len += b.body.len();
            x.body.push(b.body);
            x.chunk_count += 1;
            match x.request_mode {
                _ if x.hold_headers && !ends => Ok(vec![]),
                _ if x.hold_headers => Ok(decide_held(state, x, true).await),
                // BUFFERED sends the whole body in one message (not ending the stream when
                // trailers follow); BUFFERED_PARTIAL may send only the part that fit its buffer,
                // which is not a request to read: the session's pin then.
                mode => {
                    let whole = ends || mode == BodySendMode::Buffered;
                    Ok(vec![decide(state, x, Phase::RequestBody, whole).await])
                }
            }
        }
        Some(Request::RequestTrailers(_)) => {
            let mut out = Vec::new();
            if !x.decided && x.head.is_some() {
                // Only held headers get here undecided: the body ended with trailers.
                out = decide_held(state, x, false).await;
            }
            out.push(reply::pass(Phase::RequestTrailers, &[]));
            Ok(out)
        }
        Some(Request::ResponseHeaders(h)) => {
            let map = h.headers.unwrap_or_default();
            x.response_status = head::status(&map);
            x.served = head::served(msg.metadata_context.as_ref());
            let mut set = std::mem::take(&mut x.debug);
            if cfg.epp.conformance {
                if let Some(served) = &x.served {
                    set.push((CONFORMANCE_SERVED.to_owned(), served.clone()));
                }
            }
            if h.end_of_stream {
                release(state, x, outcome(x.response_status));
            }
            Ok(vec![reply::pass(Phase::ResponseHeaders, &set)])
        }
        Some(Request::ResponseBody(b)) => {
            let ends = b.end_of_stream;
            if x.booking.is_some() {
                let from = b.body.len() - x.usage.wanted(b.body.len());
                x.usage.push(&b.body[from..], b.body.len());
            }
            let answer = if x.response_mode == BodySendMode::FullDuplexStreamed {
                reply::echo_response_chunk(b.body, ends)
            } else {
                reply::pass(Phase::ResponseBody, &[])
            };
            if ends {
                release(state, x, outcome(x.response_status));
            }
            Ok(vec![answer])
        }
        Some(Request::ResponseTrailers(_)) => {
            release(state, x, outcome(x.response_status));
            Ok(vec![reply::pass(Phase::ResponseTrailers, &[])])
        }
    }
}

fn outcome(status: Option<u16>) -> Outcome {
    match status {
        Some(s) if (200..300).contains(&s) => Outcome::Success,
        Some(_) => Outcome::Error,
        None => Outcome::Aborted,
    }
}

/// Releases the booking, once: the response ended (`outcome`) or the stream did.
fn release(state: &AppState, x: &mut Exchange, outcome: Outcome) {
    let Some(b) = x.booking.take() else { return };
    // Only a response that ended whole says how much the engine served from cache.
    let usage = (outcome == Outcome::Success).then(|| x.usage.usage()).flatten();
    let report = DoneReport {
        request_id: b.request_id,
        endpoint: x.served.clone(),
        outcome,
        status: x.response_status,
        booking_id: Some(b.booking_id),
        usage,
    };
    route::bookings::release_reported(state, &report);
}

/// Held headers at the end of the body: the destination, then the body (FULL_DUPLEX_STREAMED:
/// re-sent in chunks; STREAMED: each chunk answered). `ends`: the body ended the request (no
/// trailers follow).
async fn decide_held(
    state: &Arc<AppState>,
    x: &mut Exchange,
    ends: bool,
) -> Vec<ProcessingResponse> {
    x.decided = true;
    let chunks = x.chunk_count;
    match pick(state, x, true).await {
        Ok(dest) if x.request_mode == BodySendMode::FullDuplexStreamed => {
            reply::streamed_route(&dest, &x.frozen, ends)
        }
        Ok(dest) => reply::held_chunks_route(&dest, chunks),
        Err(answer) => vec![*answer],
    }
}

/// The buffered and header-time answers: the destination in the `phase` answer (the headers'
/// answer, or the buffered body's). `whole`: the request (headers, or body) is all there is to
/// read; otherwise only the session's pin is made.
async fn decide(
    state: &Arc<AppState>,
    x: &mut Exchange,
    phase: Phase,
    whole: bool,
) -> ProcessingResponse {
    x.decided = true;
    match pick(state, x, whole).await {
        Ok(dest) if phase == Phase::RequestHeaders => reply::headers_route(&dest),
        Ok(dest) => reply::buffered_route(&dest),
        Err(answer) => *answer,
    }
}

/// The destination of the request in `x`, or the immediate answer that replaces forwarding it.
/// `whole`: the body (if any) is complete and can be read.
async fn pick(
    state: &Arc<AppState>,
    x: &mut Exchange,
    whole: bool,
) -> Result<Destination, Refusal> {
    let cfg = state.config();
    x.frozen = x.body.take();
    let Some(head) = x.head.clone() else {
        return Err(Box::new(reply::immediate(500, Vec::new(), &[], "kvmesh_no_headers")));
    };
    let routable = head.method == "POST"
        && openai::Endpoint::from_path(&head.path).is_some()
        && !x.frozen.is_empty()
        && whole;
    if head.method == "GET" && head.path == crate::http::MODELS_PATH {
        state.metrics.epp_request("models_list");
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let list = models::models_list(state.models().catalog(), created);
        let body = list.to_string().into_bytes();
        return Err(Box::new(reply::immediate(200, body, &[], "kvmesh_models_list")));
    }
    if !routable {
        // Not a completion to read (a health probe, `/tokenize`, a GET, a partial body): the
        // session's pin among the default model's workers.
        state.metrics.epp_request("passthrough");
        let key = head.session_id.as_deref().map(|id| session::from_header_value(id).0);
        return pin(state, x, &head, &default_model(state), key);
    }
    let call = route_headers(&head);
    let deadline = Duration::from_millis(cfg.routing.request_timeout_ms);
    let started = Instant::now();
    let result = tokio::time::timeout(
        deadline,
        route::route(state, cfg.clone(), &call, x.frozen.clone(), x.front.clone()),
    )
    .await
    .unwrap_or_else(|_| {
        Err(ApiError::unavailable(
            "request_timeout",
            format!("no decision within routing.request_timeout_ms = {} ms", deadline.as_millis()),
        ))
    });
    RouteMetrics(&state.metrics).call_result(Endpoint::Epp, &result, started.elapsed());
    match result {
        Ok(d) => {
            state.metrics.epp_request("routed");
            Ok(destination(state, x, &head, d))
        }
        Err(e) => answer_error(state, x, &head, e),
    }
}

/// The default (first) model's name: the pool of a request whose model was not resolved. Read
/// only off the routed path.
fn default_model(state: &AppState) -> String {
    state.models().catalog().first().map(|m| m.name.clone()).unwrap_or_default()
}

/// The route call's headers, as the filter would send them.
fn route_headers(head: &RequestHead) -> HttpHeaders {
    let mut h = HttpHeaders::new();
    let mut put = |name: &'static str, value: &str| {
        if let Ok(v) = HeaderValue::from_str(value) {
            h.insert(HeaderName::from_static(name), v);
        }
    };
    put(headers::KVMESH_PATH, &head.path);
    if let Some(id) = &head.request_id {
        put(headers::REQUEST_ID, id);
    }
    if let Some(id) = &head.session_id {
        put(
            headers::KVMESH_SESSION,
            &session::encode_header(session::from_header_value(id), SessionSource::Header),
        );
    }
    if head.overrides_trusted {
        if let Some(w) = &head.override_worker {
            put(headers::OVERRIDE_WORKER, w);
        }
        if let Some(m) = &head.override_mode {
            put(headers::OVERRIDE_MODE, m);
        }
    }
    h
}

/// A decision as the gateway's destination: endpoints, the spliced body, the booking kept.
fn destination(
    state: &AppState,
    x: &mut Exchange,
    head: &RequestHead,
    d: RouteDecision,
) -> Destination {
    let endpoints = destination_header(&d.endpoint, d.fallbacks.iter().map(String::as_str));
    let body = d.kv_transfer_params.as_ref().and_then(|params| {
        match json_edit::edit(&x.frozen, &[Edit::set_value("kv_transfer_params", params)]) {
            Ok(b) => Some(Bytes::from(b)),
            Err(e) => {
                // Cannot happen for a body the route call read; the engine then prefills itself.
                state.metrics.epp_request("splice_failed");
                tracing::warn!(error = %e, "kv_transfer_params not spliced: the body goes as sent");
                None
            }
        }
    });
    if state.config().filter.debug_headers {
        x.debug = d.debug_headers().into_iter().map(|(k, v)| (k.to_owned(), v)).collect();
        if let Some(ms) = d.predicted_ttft_ms {
            x.debug.push((headers::DEBUG_PREDICTED_TTFT.to_owned(), format!("{ms:.1}")));
        }
    }
    if let Some(booking_id) = d.booking_id {
        x.booking =
            Some(Booked { booking_id, request_id: head.request_id.clone().unwrap_or_default() });
    }
    // A request carrying kv_transfer_params is not retried elsewhere: its producer's KV may be
    // spent, and another decode worker would pull it again (the filter does the same).
    let set = if body.is_some() {
        vec![(headers::ENVOY_MAX_RETRIES.to_owned(), "0".to_owned())]
    } else {
        vec![]
    };
    Destination { endpoints, set, body }
}

/// A route error as the gateway's answer: what vLLM would say too, or — for the router's own
/// failures — the session's pin, so the request is still served.
fn answer_error(
    state: &AppState,
    x: &mut Exchange,
    head: &RequestHead,
    e: ApiError,
) -> Result<Destination, Refusal> {
    let status = e.status;
    if e.reason == models::UNKNOWN_MODEL_REASON {
        state.metrics.epp_request("unknown_model");
        return Err(Box::new(error_answer(&e)));
    }
    if e.reason == "prefill_overloaded" {
        state.metrics.epp_request("shed");
        return Err(Box::new(error_answer(&e)));
    }
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        state.metrics.epp_request("too_large");
        return Err(Box::new(error_answer(&e)));
    }
    if status.is_client_error()
        && status != StatusCode::TOO_MANY_REQUESTS
        && status != StatusCode::CONFLICT
    {
        state.metrics.epp_request("bad_request");
        return Err(Box::new(error_answer(&e)));
    }
    // The route call's error was counted and logged (sampled) with the route errors.
    let model = e.model.as_deref().map_or_else(|| default_model(state), str::to_owned);
    state.metrics.epp_request("fallback");
    let key = head
        .session_id
        .as_deref()
        .map(|id| session::from_header_value(id).0)
        .or_else(|| conversation_key(head, &x.frozen));
    pin(state, x, head, &model, key)
}

/// The conversation's derived key, read from the body (only on the fallback path).
fn conversation_key(head: &RequestHead, body: &[u8]) -> Option<u64> {
    let endpoint = openai::Endpoint::from_path(&head.path)?;
    let parsed = openai::Body::new(endpoint, body).request().ok()?;
    session::derived_key(&parsed).map(|k| k.0)
}

/// The pin of `key` (or of the request id, else the body's first bytes) among `model`'s healthy
/// workers the front allows, with fallbacks; 503 when none.
fn pin(
    state: &AppState,
    x: &Exchange,
    head: &RequestHead,
    model: &str,
    key: Option<u64>,
) -> Result<Destination, Refusal> {
    let key = key.unwrap_or_else(|| {
        let seed =
            head.request_id.as_deref().map_or(&x.frozen[..x.frozen.len().min(4096)], str::as_bytes);
        kvmesh_core::hashing::xxh3(seed, 0x6b76_6d65_7368_0e99)
    });
    let fleet = state.snapshot();
    let candidates: Vec<&str> = fleet
        .model_candidates(model)
        .filter(|w| x.front.allows(&w.endpoint))
        .map(|w| w.id.as_str())
        .collect();
    let ranked = rendezvous::rank(key, candidates);
    let endpoints: Vec<&str> = ranked
        .iter()
        .take(1 + PIN_FALLBACKS)
        .filter_map(|id| fleet.workers.iter().find(|w| w.id == *id))
        .map(|w| w.endpoint.as_str())
        .collect();
    match endpoints.split_first() {
        Some((primary, rest)) => Ok(Destination {
            endpoints: destination_header(primary, rest.iter().copied()),
            set: vec![],
            body: None,
        }),
        None => {
            state.metrics.epp_request("no_endpoint");
            let e = ApiError::unavailable(
                "no_eligible_endpoint",
                format!("no healthy worker of model {model} is eligible for this request"),
            );
            Err(Box::new(error_answer(&e)))
        }
    }
}

/// An [`ApiError`] as an immediate response: its status, the OpenAI error body, `retry-after` on
/// 429 and 503.
fn error_answer(e: &ApiError) -> ProcessingResponse {
    let mut body = kvmesh_core::api::ErrorBody::with_reason(
        e.status.as_u16(),
        e.kind,
        e.reason,
        e.message.clone(),
    );
    body.error.param = e.param.map(str::to_owned);
    let json = serde_json::to_vec(&body).unwrap_or_default();
    let retry = matches!(e.status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE);
    let headers: Vec<(&str, String)> =
        if retry { vec![("retry-after", "1".to_owned())] } else { vec![] };
    reply::immediate(e.status.as_u16(), json, &headers, e.reason)
}
