//! Step 1 of a route call (pure): the filter's headers and the client's body → a [`RouteRequest`].

use axum::body::Bytes;
use axum::http::HeaderMap;
use kvmesh_core::api::Mode;
use kvmesh_core::openai::{self, OpenAiRequest};
use kvmesh_core::session::{self, SessionKey, SessionSource};
use kvmesh_core::headers;

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
}

fn header<'a>(h: &'a HeaderMap, name: &str) -> Result<Option<&'a str>, ApiError> {
    match h.get(name) {
        None => Ok(None),
        Some(v) => v.to_str().map(|s| Some(s.trim())).map_err(|_| ApiError::bad_request("bad_header", format!("header {name} is not visible ASCII"))),
    }
}

/// Parses the route call's headers and body; the parsed body goes to tokenization by value.
pub fn parse(h: &HeaderMap, body: Bytes) -> Result<(RouteRequest, OpenAiRequest), ApiError> {
    let path = header(h, headers::KVMESH_PATH)?.ok_or_else(|| ApiError::bad_request("missing_path", format!("missing {} header", headers::KVMESH_PATH)))?;
    let endpoint = openai::Endpoint::from_path(path)
        .ok_or_else(|| ApiError::bad_request("bad_path", format!("{} {path:?} is not a routable OpenAI path", headers::KVMESH_PATH)))?;
    let session = match header(h, headers::KVMESH_SESSION)? {
        None | Some("") => None,
        Some(v) => Some(session::parse_header(v).ok_or_else(|| ApiError::bad_request("bad_session", format!("cannot parse {} {v:?}", headers::KVMESH_SESSION)))?),
    };
    let override_worker = header(h, headers::OVERRIDE_WORKER)?.filter(|s| !s.is_empty()).map(str::to_owned);
    let override_mode = match header(h, headers::OVERRIDE_MODE)? {
        None | Some("") => None,
        Some(m) => Some(Mode::parse(m).ok_or_else(|| ApiError::bad_request("bad_mode", format!("unknown mode {m:?} in {}", headers::OVERRIDE_MODE)))?),
    };
    let request_id = header(h, headers::REQUEST_ID)?.filter(|s| !s.is_empty()).map(str::to_owned);
    let parsed = openai::parse(endpoint, &body).map_err(|e| ApiError::bad_request(e.reason(), e.to_string()))?;
    Ok((RouteRequest { path: path.to_owned(), session, override_worker, override_mode, request_id, body }, parsed))
}
