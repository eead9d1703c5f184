//! The filter's read of a request body: core's one body reader for the filter's need
//! ([`kvmesh_core::openai::Body::peek`]: routable?, `stream`, the conversation anchor), resuming at
//! the body base the flow names. The scan, its grammar and its equality with `peek` live in
//! `kvmesh_core::openai` (`scan`, `grammar`) beside the indexer's readings, so one request field is
//! added in one place for both; what stays here is the filter's call and its tests, which drive
//! the scan on the filter's shapes.

pub use kvmesh_core::openai::Skip;
use kvmesh_core::openai::{Body, Endpoint, ParseError, RequestPeek};

#[cfg(test)]
use kvmesh_core::openai::{
    self,
    scan::{fast_chat, MAX_DEPTH},
};

/// Reads `body` as a request to `endpoint`: exactly [`kvmesh_core::openai::peek`]'s result —
/// without the conversation anchor when `anchor` is false (`conversation_anchor` is then `None`).
/// A chat body's scan may go on from where `skip` says ([`Skip`]).
pub fn read(
    endpoint: Endpoint,
    body: &[u8],
    anchor: bool,
    skip: &mut Skip<'_>,
) -> Result<RequestPeek, ParseError> {
    Body::new(endpoint, body).peek(anchor, skip)
}

#[cfg(test)]
#[path = "tests/body.rs"]
mod tests;
