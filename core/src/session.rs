//! Session keys: which conversation a request belongs to, so every turn pins to the same worker.
//!
//! An explicit session header wins. Otherwise, with `prefix_units = N > 0`, the key is a hash of a
//! prefix of the prompt that is identical on every turn of one conversation:
//!
//! * chat: the canonical rendering of the messages *up to and including the first user message*
//!   (the anchor), cut to N bytes. Later turns only append messages, so the anchor never changes —
//!   also for conversations shorter than N, where hashing `min(len, N)` of the whole prompt (the known
//!   bug) would give a new key every turn.
//! * token ids: the first N tokens; text prompts: the first N bytes. A raw prompt carries no turn
//!   structure, so one shorter than N gets no derived key (the index's overlap scoring routes it)
//!   rather than a key that would change on the next turn.
//!
//! The canonical rendering is `role 0x1F content 0x1E` per message: cheap, template-free (the filter
//! has no tokenizer), and append-only across turns.

use crate::hashing::xxh3;
use crate::openai::{ChatMessage, OpenAiRequest, Prompt, RequestInput};

const HEADER_SEED: u64 = 0x6b76_6d65_7368_0010;
const CHAT_SEED: u64 = 0x6b76_6d65_7368_0011;
const TOKENS_SEED: u64 = 0x6b76_6d65_7368_0012;
const TEXT_SEED: u64 = 0x6b76_6d65_7368_0013;

/// A 64-bit session key. On the wire: 16 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionKey(pub u64);

/// Where a session key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSource {
    /// The client's explicit session header.
    Header,
    /// Derived from the prompt prefix.
    Prefix,
}

impl SessionSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Header => "header",
            Self::Prefix => "prefix",
        }
    }
}

/// The key for an explicit session id sent by the client.
pub fn from_header_value(value: &str) -> SessionKey {
    SessionKey(xxh3(value.trim().as_bytes(), HEADER_SEED))
}

/// The prefix-derived key of `request`, or None when `prefix_units == 0` or the prompt has no
/// stable anchor (see the module docs).
pub fn from_prefix(request: &OpenAiRequest, prefix_units: usize) -> Option<SessionKey> {
    if prefix_units == 0 {
        return None;
    }
    match &request.input {
        RequestInput::Messages(messages) => {
            let anchor = chat_anchor(messages, prefix_units);
            (!anchor.is_empty()).then(|| SessionKey(xxh3(&anchor, CHAT_SEED)))
        }
        RequestInput::Prompt(Prompt::Tokens(tokens)) => {
            let head = tokens.get(..prefix_units)?;
            let bytes: Vec<u8> = head.iter().flat_map(|t| t.to_le_bytes()).collect();
            Some(SessionKey(xxh3(&bytes, TOKENS_SEED)))
        }
        RequestInput::Prompt(Prompt::Text(text)) => {
            let head = text.as_bytes().get(..prefix_units)?;
            Some(SessionKey(xxh3(head, TEXT_SEED)))
        }
    }
}

/// The canonical rendering of the messages up to and including the first user message (all of
/// them when there is none), cut to `limit` bytes.
pub fn chat_anchor(messages: &[ChatMessage], limit: usize) -> Vec<u8> {
    let end = messages.iter().position(|m| m.role == "user").map_or(messages.len(), |i| i + 1);
    let mut out = Vec::new();
    for m in &messages[..end] {
        if out.len() >= limit {
            break;
        }
        out.extend_from_slice(m.role.as_bytes());
        out.push(0x1f);
        out.extend_from_slice(m.content.as_bytes());
        out.push(0x1e);
    }
    out.truncate(limit);
    out
}

/// `x-kvmesh-session` value: `<16 hex>;source=<header|prefix>`.
pub fn encode_header(key: SessionKey, source: SessionSource) -> String {
    format!("{:016x};source={}", key.0, source.as_str())
}

/// Parses an `x-kvmesh-session` value written by [`encode_header`].
pub fn parse_header(value: &str) -> Option<(SessionKey, SessionSource)> {
    let (hex, rest) = value.trim().split_once(';').unwrap_or((value.trim(), "source=header"));
    let key = u64::from_str_radix(hex.trim(), 16).ok()?;
    let source = match rest.trim().strip_prefix("source=")? {
        "header" => SessionSource::Header,
        "prefix" => SessionSource::Prefix,
        _ => return None,
    };
    Some((SessionKey(key), source))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::Endpoint;

    fn chat(messages: &[(&str, &str)]) -> OpenAiRequest {
        OpenAiRequest {
            endpoint: Endpoint::ChatCompletions,
            model: None,
            input: RequestInput::Messages(
                messages.iter().map(|(r, c)| ChatMessage { role: (*r).into(), content: (*c).into() }).collect(),
            ),
            stream: false,
            max_tokens: None,
            cache_salt: None,
        }
    }

    fn tokens(t: Vec<u32>) -> OpenAiRequest {
        OpenAiRequest { input: RequestInput::Prompt(Prompt::Tokens(t)), ..chat(&[]) }
    }

    #[test]
    fn every_turn_of_a_short_conversation_has_one_key() {
        // Far shorter than N: the bug this module exists to avoid.
        let mut history = vec![("system", "be brief"), ("user", "hi")];
        let first = from_prefix(&chat(&history), 4096);
        assert!(first.is_some());
        for turn in 0..10 {
            history.push(("assistant", "hello"));
            history.push(("user", if turn % 2 == 0 { "more" } else { "again" }));
            assert_eq!(from_prefix(&chat(&history), 4096), first);
        }
    }

    #[test]
    fn different_conversations_have_different_keys() {
        let a = from_prefix(&chat(&[("system", "s"), ("user", "first question")]), 4096);
        let b = from_prefix(&chat(&[("system", "s"), ("user", "other question")]), 4096);
        assert_ne!(a, b);
    }

    #[test]
    fn long_anchor_is_cut_to_n() {
        let long = "x".repeat(10_000);
        let a = from_prefix(&chat(&[("user", &long)]), 64);
        let b = from_prefix(&chat(&[("user", &format!("{long}y"))]), 64);
        assert_eq!(a, b);
    }

    #[test]
    fn token_prompts_key_only_with_n_tokens() {
        assert_eq!(from_prefix(&tokens((0..10).collect()), 16), None);
        let a = from_prefix(&tokens((0..16).collect()), 16);
        let b = from_prefix(&tokens((0..500).collect()), 16);
        assert!(a.is_some());
        assert_eq!(a, b);
        assert_eq!(from_prefix(&tokens((0..500).collect()), 0), None);
    }

    #[test]
    fn header_round_trip() {
        let key = from_header_value("abc");
        for source in [SessionSource::Header, SessionSource::Prefix] {
            assert_eq!(parse_header(&encode_header(key, source)), Some((key, source)));
        }
        assert_eq!(parse_header("zz;source=prefix"), None);
        assert_eq!(parse_header("00000000000000ff;source=moon"), None);
    }
}
