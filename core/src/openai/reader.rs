//! The one entry point for reading a request body: [`Body`]. A caller says what it needs and from
//! where the read may resume; which reading runs is decided here, once, for the filter, the indexer
//! and the engine simulator alike.
//!
//! | need | method | who | how |
//! |---|---|---|---|
//! | routable?, `stream`, the conversation anchor | [`Body::peek`] | the filter, per request | chat: the strict byte scan ([`super::scan`]), resuming at a body base the caller names; else, and whatever the scan declines, one streaming serde pass ([`super::peek`]) |
//! | the whole request | [`Body::request`] | the indexer (short bodies), tests | chat: one streaming serde pass; completions: a byte scan of a token-id prompt, else serde ([`super::parse`]) |
//! | the whole request, resuming from a known prefix | [`Body::request_from`] | the indexer's body memo | a chat body continuing an earlier body's [`ChatPrefix`] is read from its end ([`super::resume`]); it leaves its own prefix for the next turn |
//! | the request and the other top-level fields, raw | [`Body::request_with_raw`] | the engine simulator | [`super::parse_raw`] |
//!
//! Every reading gives the same verdict on the same bytes — the one `serde_json::Value` reading's
//! (property tests in each module hold them equal) — so the filter's session key, the indexer's
//! tokens and the simulator's prompt always agree. The fields routing reads and their checks are
//! defined once, in [`super::fields`]; the byte scans share one grammar, [`super::grammar`].
//!
//! **Body bases** ([`crate::body_base`]: the protocol, both sides): the indexer keeps a long chat
//! body's prefix — its bytes through the last message, and what they read to ([`ChatPrefix`]) —
//! and names it in its answer; the filter's next call for that conversation sends only the bytes
//! after it, and [`Body::peek`] resumes its own scan there (the [`Skip`] callback: the filter
//! hashes the base's bytes before it says where); the indexer joins the bytes back to the base and
//! [`Body::request_from`] resumes from the held prefix.

use super::resume::{read_chat_from, ChatPrefix, ChatRead};
use super::scan::{self, Skip};
use super::{parse, parse_raw, Endpoint, OpenAiRequest, ParseError, RawFields, RequestPeek};

/// A request body to `endpoint`, to be read for what the caller needs.
#[derive(Debug, Clone, Copy)]
pub struct Body<'a> {
    endpoint: Endpoint,
    bytes: &'a [u8],
}

impl<'a> Body<'a> {
    pub fn new(endpoint: Endpoint, bytes: &'a [u8]) -> Self {
        Self { endpoint, bytes }
    }

    /// What the filter's decision needs: [`super::peek`]'s answer — without the conversation
    /// anchor when `anchor` is false (the request sent a session header, or key derivation is
    /// off), which spares digesting it. A chat body's scan asks `skip` once, right after the
    /// anchor, where a body base the body starts with ends, and goes on from there.
    pub fn peek(&self, anchor: bool, skip: &mut Skip<'_>) -> Result<RequestPeek, ParseError> {
        scan::read(self.endpoint, self.bytes, anchor, skip)
    }

    /// The whole request ([`super::parse`]).
    pub fn request(&self) -> Result<OpenAiRequest, ParseError> {
        parse(self.endpoint, self.bytes)
    }

    /// The whole request, a chat body read on from `earlier` (an earlier body's bytes, at least
    /// its prefix's length, and that prefix) when it starts with the same bytes, and this body's
    /// own prefix for a later one ([`read_chat_from`]); other endpoints are read whole.
    pub fn request_from(&self, earlier: Option<(&[u8], &ChatPrefix)>) -> ChatRead {
        match self.endpoint {
            Endpoint::ChatCompletions => read_chat_from(self.bytes, earlier),
            Endpoint::Completions => {
                ChatRead { request: self.request(), resumed: false, prefix: None }
            }
        }
    }

    /// The request and the body's other top-level fields, raw ([`super::parse_raw`]).
    pub fn request_with_raw(&self) -> Result<(OpenAiRequest, RawFields), ParseError> {
        parse_raw(self.endpoint, self.bytes)
    }
}
