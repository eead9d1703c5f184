//! Step 1 of a route call (pure): the filter's headers and the client's body → a [`RouteRequest`].
//! A long chat body is read from where its conversation's last body ended ([`BodyMemo`]); a call
//! that sent only the bytes after a body base gets them joined to the base first ([`with_base`]).

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use kvmesh_core::api::Mode;
use kvmesh_core::body_base::{BodyBase, BASE_UNKNOWN};
use kvmesh_core::headers;
use kvmesh_core::openai::{self, OpenAiRequest};
use kvmesh_core::session::{self, SessionKey, SessionSource};
use parking_lot::Mutex;

use super::body_memo::{self, BaseRefusal, BodyMemo, Held, MIN_BODY_BYTES};
use super::front::Front;
use super::record::BodyMemoResult;
use super::ApiError;

/// What a `/v1/route` call asks, parsed and checked; nothing here has touched shared state.
#[derive(Debug)]
pub struct RouteRequest {
    /// The OpenAI path the client used (`/v1/completions` or `/v1/chat/completions`).
    pub path: String,
    pub session: Option<(SessionKey, SessionSource)>,
    pub override_worker: Option<String>,
    pub override_mode: Option<Mode>,
    /// The client's `x-request-id`: logs, and `/v1/done` reports that carry no booking id. Never a key.
    pub request_id: Option<String>,
    /// The client's body, unchanged (the legs cut it to one step).
    pub body: Bytes,
    /// Bytes at the start of the body its read continued from a prefix the body memo held (0: read
    /// whole; `None`: not looked up — short, not a chat, or the memo is off).
    pub body_continued: Option<usize>,
    /// The body's prefix the memo kept, named for the answer: the next call may send what follows.
    pub body_base: Option<BodyBase>,
    /// What the front door asked for beyond the request (the candidates it allows).
    pub front: Front,
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, ApiError> {
    match h.get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(|s| Some(s.trim())).map_err(|_| {
            ApiError::bad_request("bad_header", format!("header {name} is not visible ASCII"))
        }),
    }
}

/// Refuses a call that starts after its caller stopped waiting (`x-kvmesh-route-deadline-ms`, unix
/// ms, on the same host clock as `now_unix_ms`): a filter whose call timed out, or whose VM
/// trapped, resets the call, and a call queued behind a stalled indexer would otherwise book a
/// request whose `/v1/done` never comes (it would hold its load until `load_expiry_secs`). A
/// missing or unreadable deadline is no deadline.
pub fn refuse_if_caller_gone(h: &HeaderMap, now_unix_ms: u64) -> Result<(), ApiError> {
    let deadline = h
        .get(headers::KVMESH_ROUTE_DEADLINE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match deadline {
        Some(deadline) if now_unix_ms > deadline => Err(ApiError::unavailable(
            CALLER_GONE,
            format!(
                "the call started {} ms after its caller's deadline ({} = {deadline}): nothing booked",
                now_unix_ms - deadline,
                headers::KVMESH_ROUTE_DEADLINE
            ),
        )),
        _ => Ok(()),
    }
}

/// The reason of a call refused by [`refuse_if_caller_gone`].
pub const CALLER_GONE: &str = "caller_gone";

/// The route call's session (`x-kvmesh-session`), if it names one.
fn session_of(h: &HeaderMap) -> Result<Option<(SessionKey, SessionSource)>, ApiError> {
    match header(h, headers::KVMESH_SESSION)? {
        None | Some("") => Ok(None),
        Some(v) => session::parse_header(v).map(Some).ok_or_else(|| {
            ApiError::bad_request(
                "bad_session",
                format!("cannot parse {} {v:?}", headers::KVMESH_SESSION),
            )
        }),
    }
}

/// Parses the route call's headers and body; the parsed body goes to tokenization by value. A chat
/// body of at least [`MIN_BODY_BYTES`] is read through `memo` (bounded by `memo_bytes`; 0 = off),
/// continuing the base it was `joined` to ([`with_base`]), if any. A call naming no session gets
/// the body's derived one when `front` asks for it ([`session::derived_key`], the filter's key).
pub fn parse(
    h: &HeaderMap,
    body: Bytes,
    joined: Option<Held>,
    memo: &Mutex<BodyMemo>,
    memo_bytes: usize,
    front: Front,
) -> Result<(RouteRequest, OpenAiRequest), ApiError> {
    let path = header(h, headers::KVMESH_PATH)?.ok_or_else(|| {
        ApiError::bad_request("missing_path", format!("missing {} header", headers::KVMESH_PATH))
    })?;
    let endpoint = openai::Endpoint::from_path(path).ok_or_else(|| {
        ApiError::bad_request(
            "bad_path",
            format!("{} {path:?} is not a routable OpenAI path", headers::KVMESH_PATH),
        )
    })?;
    let session = session_of(h)?;
    let override_worker =
        header(h, headers::OVERRIDE_WORKER)?.filter(|s| !s.is_empty()).map(str::to_owned);
    let override_mode = match header(h, headers::OVERRIDE_MODE)? {
        None | Some("") => None,
        Some(m) => Some(Mode::parse(m).ok_or_else(|| {
            ApiError::bad_request(
                "bad_mode",
                format!("unknown mode {m:?} in {}", headers::OVERRIDE_MODE),
            )
        })?),
    };
    let request_id = header(h, headers::REQUEST_ID)?.filter(|s| !s.is_empty()).map(str::to_owned);
    let remembered = endpoint == openai::Endpoint::ChatCompletions
        && body.len() >= MIN_BODY_BYTES
        && memo_bytes > 0;
    let (parsed, body_continued, body_base) = if remembered {
        let read =
            body_memo::read_chat(memo, &body, session.map(|(key, _)| key), memo_bytes, joined);
        (read.request, Some(read.continued), read.kept)
    } else {
        (openai::Body::new(endpoint, &body).request(), None, None)
    };
    let parsed = parsed.map_err(|e| ApiError::bad_request(e.reason(), e.to_string()))?;
    let session = session.or_else(|| {
        front
            .derive_session
            .then(|| session::derived_key(&parsed).map(|key| (key, SessionSource::Prefix)))
            .flatten()
    });
    Ok((
        RouteRequest {
            path: path.to_owned(),
            session,
            override_worker,
            override_mode,
            request_id,
            body,
            body_continued,
            body_base,
            front,
        },
        parsed,
    ))
}

/// The route call's whole body: `body` itself, or — under [`headers::KVMESH_BODY_BASE`] — the
/// bytes of the base `memo` holds followed by `body` (at most `max_body_bytes` in all). Also the
/// held base joined, for the read to continue. `409` [`BASE_UNKNOWN`] when the memo does not hold
/// the base for this call's session — evicted, never kept, or kept for another session (a base
/// belongs to one session: `kvmesh_core::body_base`) — and the filter then sends the whole body.
/// `counted` gets the `kvmesh_body_memo_total` result of a call that named a base: a hit, or
/// the refusal's.
pub fn with_base(
    h: &HeaderMap,
    body: Bytes,
    memo: &Mutex<BodyMemo>,
    max_body_bytes: usize,
    counted: impl Fn(BodyMemoResult),
) -> Result<(Bytes, Option<Held>), ApiError> {
    let Some(named) = header(h, headers::KVMESH_BODY_BASE)?.filter(|v| !v.is_empty()) else {
        return Ok((body, None));
    };
    let base: BodyBase = named.parse().map_err(|e: kvmesh_core::body_base::BadBodyBase| {
        ApiError::bad_request("bad_body_base", e.to_string())
    })?;
    let session = session_of(h)?.map(|(key, _)| key);
    let held = memo.lock().base(&base, session).map_err(|refusal| {
        counted(refusal.into());
        let why = match refusal {
            BaseRefusal::Unknown => "evicted or never kept",
            BaseRefusal::OtherSession => "it was named under another session",
        };
        ApiError::new(
            StatusCode::CONFLICT,
            "invalid_request_error",
            BASE_UNKNOWN,
            format!("no body base {base} held for this session ({why}): send the whole body"),
        )
    })?;
    let bytes = held.bytes();
    if bytes.len() + body.len() > max_body_bytes {
        return Err(ApiError::too_large(format!(
            "the base's {} bytes and {} more exceed routing.max_body_bytes = {max_body_bytes}",
            bytes.len(),
            body.len()
        )));
    }
    counted(BodyMemoResult::BaseHit);
    let mut whole = Vec::with_capacity(bytes.len() + body.len());
    whole.extend_from_slice(bytes);
    whole.extend_from_slice(&body);
    Ok((Bytes::from(whole), Some(held)))
}
