//! The light read of a request body: what the filter's decision needs, with [`super::parse`]'s
//! verdict, without building the prompt.
//!
//! The filter needs three things from a body before it asks the indexer: whether it is routable
//! (the same [`ParseError`] `parse` would give, which names the unroutable reason), `stream`, and
//! a chat's conversation anchor (the session key). `parse` gives them by building the whole request
//! — every message as a `serde_json::Value`, every content string copied twice (into the `Value`,
//! then flattened) — which for an 8k-token chat continuation is most of the filter's per-request
//! work. Here serde reads the body in one streaming pass and keeps almost nothing: the messages
//! up to the first user message — the conversation anchor, usually a handful — become `Value`s
//! for [`super::anchor::anchor_digest`] and are checked as `parse` checks them; every later
//! message keeps only its `role` and `content` as borrowed [`RawValue`] spans, type-checked by
//! their first byte (valid JSON already: a value starting with `"` is a string); every other field
//! is skipped. Completions bodies and bodies serde refuses (not JSON, not an object) are
//! read by `parse` itself. A property test holds the two readings equal.
//!
//! The same pass also reads a whole chat request for [`super::parse`] ([`read_chat`]): then each
//! later message's `role` and `content` are decoded straight into a [`ChatMessage`] (content
//! strings copied once, from the body) instead of through a `Value` tree and a second copy — the
//! indexer's body read was a third of a long shared-prefix route. Its own property test holds it
//! equal to the `Value` reading.
//!
//! Over 600 lines: the streaming reading is one serde visitor whose states share the message
//! decoding; about 165 lines are its tests, including the property test against the `Value` reading.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::Value;

use super::anchor::anchor_digest;
use super::media::{MediaPart, Uuids};
use super::{fast, fields, parse, ChatMessage, Endpoint, OpenAiRequest, ParseError, RequestInput};
use crate::json_edit::Key;

/// What the filter needs from a routable body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestPeek {
    /// `stream` (false when absent or null).
    pub stream: bool,
    /// As [`super::OpenAiRequest::conversation_anchor`].
    pub conversation_anchor: Option<u64>,
    /// `model` (absent or null: none), which selects the model's workers
    /// ([`crate::models::resolve`]).
    pub model: Option<String>,
}

impl RequestPeek {
    /// The peek of a fully parsed request.
    pub fn of(request: &super::OpenAiRequest) -> Self {
        Self {
            stream: request.stream,
            conversation_anchor: request.conversation_anchor,
            model: request.model.clone(),
        }
    }
}

/// Reads `body` as a request to `endpoint`: `Ok` exactly when [`parse`] is, with its `stream`
/// and conversation anchor; the same error otherwise.
pub fn peek(endpoint: Endpoint, body: &[u8]) -> Result<RequestPeek, ParseError> {
    if endpoint == Endpoint::ChatCompletions {
        if let Some(fields) = chat_fields(body, false, None) {
            return fields.verdict();
        }
    }
    parse(endpoint, body).map(|r| RequestPeek::of(&r))
}

/// A chat body read whole in the one streaming pass: `Some` with exactly what the `Value` reading
/// gives, or `None` when serde refuses the body (not JSON, not an object, too deep), which the
/// caller then reads the `Value` way.
pub(super) fn read_chat(body: &[u8]) -> Option<Result<OpenAiRequest, ParseError>> {
    chat_fields(body, true, None).map(|f| f.request())
}

/// [`read_chat`], continuing from `resume` (the messages read before the first element of the
/// body's first `messages` list: [`super::resume`]), and also giving what the read messages are
/// for a later body's resume (`None` when the read is not `Ok`). The caller has checked the depth
/// ([`fast::messages_span`] found the body's list).
pub(super) fn read_chat_keeping(
    body: &[u8],
    resume: Anchor,
) -> Option<(Result<OpenAiRequest, ParseError>, Option<Anchor>)> {
    let fields = chat_fields(body, true, Some(resume))?;
    let kept = match &fields.messages {
        Some(Ok(anchor)) if anchor.later_error.is_none() => Some(anchor.clone()),
        _ => None,
    };
    let read = fields.request();
    let kept = kept.filter(|_| read.is_ok());
    Some((read, kept))
}

/// The top-level chat fields of `body` (later messages kept whole when `collect`). With `resume`
/// (depth checked by the caller), the first `messages` list continues from it.
fn chat_fields(body: &[u8], collect: bool, resume: Option<Anchor>) -> Option<ChatFields> {
    if resume.is_none() && !fast::depth_ok(body) {
        return None;
    }
    let mut de = serde_json::Deserializer::from_slice(body);
    let top = TopSeed { collect, resume }.deserialize(&mut de);
    match top {
        // Trailing characters make the body invalid JSON, as `from_slice` says.
        Ok(Top::Object(fields)) if de.end().is_ok() => Some(*fields),
        _ => None,
    }
}

/// The top-level fields chat routing reads; the last of a repeated key wins, as in `Value`.
#[derive(Default)]
struct ChatFields {
    messages: Option<Result<Anchor, ParseError>>,
    /// The other fields routing reads ([`fields::KEYS`]).
    scalars: fields::Collected,
}

impl ChatFields {
    /// `super::read`'s chat verdict, in its order of errors.
    fn verdict(self) -> Result<RequestPeek, ParseError> {
        let anchor = self.messages.unwrap_or(Err(ParseError::Missing { field: "messages" }))?;
        let conversation_anchor = anchor.digest()?;
        let fields::Scalars { stream, model, .. } = self.scalars.scalars()?;
        Ok(RequestPeek { stream, conversation_anchor, model })
    }

    /// `super::read`'s chat request, in its order of errors (messages kept by a collecting pass).
    fn request(self) -> Result<OpenAiRequest, ParseError> {
        let anchor = self.messages.unwrap_or(Err(ParseError::Missing { field: "messages" }))?;
        let values = Value::Array(anchor.values);
        let (mut messages, mut media) = super::messages_with_media(Some(&values))?;
        if let Some(e) = anchor.later_error {
            return Err(e);
        }
        messages.extend(anchor.later);
        media.extend(anchor.later_media);
        let conversation_anchor = values.as_array().and_then(|v| anchor_digest(v));
        let fields::Scalars { model, stream, max_tokens, cache_salt } = self.scalars.scalars()?;
        Ok(OpenAiRequest {
            endpoint: Endpoint::ChatCompletions,
            model,
            input: RequestInput::Messages(messages),
            stream,
            max_tokens,
            cache_salt,
            conversation_anchor,
            media,
        })
    }
}

/// The messages up to and including the first user message, as values (what the anchor digest
/// renders), and the first error among the later ones (checked without building them).
#[derive(Debug, Clone, Default)]
pub(super) struct Anchor {
    pub(super) values: Vec<Value>,
    later_error: Option<ParseError>,
    /// The later messages, when collected (a whole read), else empty.
    pub(super) later: Vec<ChatMessage>,
    /// The media parts of the later messages, when collected.
    pub(super) later_media: Vec<MediaPart>,
}

impl Anchor {
    fn digest(self) -> Result<Option<u64>, ParseError> {
        let values = Value::Array(self.values);
        // The anchor's messages come first: their error, if any, is the first.
        super::messages(Some(&values))?;
        if let Some(e) = self.later_error {
            return Err(e);
        }
        Ok(values.as_array().and_then(|v| anchor_digest(v)))
    }
}

// === one streaming pass of serde over the body ===

/// A value passed over. Not serde's `IgnoredAny`: that does not check the UTF-8 of the strings it
/// skips, and the `Value` reading calls a body that is not UTF-8 not JSON; a borrowed raw span is
/// checked (only the skipped bytes: the strings that are read are checked as they are decoded).
type Skip<'a> = &'a RawValue;

enum Top {
    Object(Box<ChatFields>),
    Other,
}

/// The visitor methods of a value that is "something else" (consumed; serde checks it is JSON).
macro_rules! other_values {
    ($out:expr) => {
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok($out)
        }
        fn visit_str<E>(self, _: &str) -> Result<Self::Value, E> {
            Ok($out)
        }
    };
}

/// The body; later messages are kept whole when `collect`; the first `messages` list continues
/// from `resume`.
struct TopSeed {
    collect: bool,
    resume: Option<Anchor>,
}

impl<'de> DeserializeSeed<'de> for TopSeed {
    type Value = Top;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Top, D::Error> {
        struct V {
            collect: bool,
            resume: Option<Anchor>,
        }
        impl<'de> Visitor<'de> for V {
            type Value = Top;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            other_values!(Top::Other);
            fn visit_unit<E>(self) -> Result<Top, E> {
                Ok(Top::Other)
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Top, A::Error> {
                while seq.next_element::<Skip<'de>>()?.is_some() {}
                Ok(Top::Other)
            }
            fn visit_map<A: MapAccess<'de>>(mut self, mut map: A) -> Result<Top, A::Error> {
                let mut f = ChatFields::default();
                while let Some(Key(k)) = map.next_key::<Key<'de>>()? {
                    match &*k {
                        "messages" => {
                            let seed =
                                Messages { collect: self.collect, resume: self.resume.take() };
                            f.messages = Some(map.next_value_seed(seed)?);
                        }
                        // A field only a whole read needs is skipped by a verdict.
                        key => match fields::index(key.as_bytes())
                            .filter(|&i| self.collect || fields::KEYS[i].1 != fields::Kind::Any)
                        {
                            Some(i) => f.scalars.0[i] = Some(map.next_value()?),
                            None => {
                                map.next_value::<Skip<'de>>()?;
                            }
                        },
                    }
                }
                Ok(Top::Object(Box::new(f)))
            }
        }
        d.deserialize_any(V { collect: self.collect, resume: self.resume })
    }
}

/// The `messages` value: values up to the first user message, then checked in passing (and kept
/// as [`ChatMessage`]s when `collect`). With `resume`, a list's elements continue what it holds.
struct Messages {
    collect: bool,
    resume: Option<Anchor>,
}

impl<'de> DeserializeSeed<'de> for Messages {
    type Value = Result<Anchor, ParseError>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

const NOT_A_LIST: ParseError =
    ParseError::WrongType { field: "messages", expected: "a non-empty list of messages" };
const NOT_OBJECT: ParseError =
    ParseError::WrongType { field: "messages", expected: "a list of objects" };

impl<'de> Visitor<'de> for Messages {
    type Value = Result<Anchor, ParseError>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }
    other_values!(Err(NOT_A_LIST));
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(Err(ParseError::Missing { field: "messages" }))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        while map.next_entry::<Key<'de>, Skip<'de>>()?.is_some() {}
        Ok(Err(NOT_A_LIST))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let Anchor { mut values, mut later_error, mut later, mut later_media } =
            self.resume.unwrap_or_default();
        loop {
            let user_seen = values
                .last()
                .is_some_and(|m| m.get("role").and_then(Value::as_str) == Some("user"));
            if !user_seen {
                match seq.next_element::<Value>()? {
                    Some(v) => values.push(v),
                    None => break,
                }
            } else if later_error.is_some() {
                if seq.next_element::<Skip<'de>>()?.is_none() {
                    break;
                }
            } else if self.collect {
                match seq.next_element::<MessageParts<'de, Content>>()? {
                    Some(MessageParts(parts)) => {
                        match parts.and_then(|(role, content)| full_message(role, content)) {
                            Ok((m, uuids)) => {
                                let at = values.len() + later.len();
                                let message = u32::try_from(at).unwrap_or(u32::MAX);
                                later_media.extend(
                                    uuids.into_iter().map(|uuid| MediaPart { message, uuid }),
                                );
                                later.push(m);
                            }
                            Err(e) => later_error = Some(e),
                        }
                    }
                    None => break,
                }
            } else {
                match seq.next_element::<MessageParts<'de, &'de RawValue>>()? {
                    Some(MessageParts(parts)) => {
                        later_error =
                            parts.and_then(|(role, content)| check_message(role, content)).err()
                    }
                    None => break,
                }
            }
        }
        if values.is_empty() {
            return Ok(Err(NOT_A_LIST));
        }
        Ok(Ok(Anchor { values, later_error, later, later_media }))
    }
}

/// A message past the anchor: its `role` kept raw and its `content` read as `C` (the last of a
/// repeated key each); nothing else is kept. Not an object: `NOT_OBJECT`.
struct MessageParts<'de, C>(Result<(Option<&'de RawValue>, Option<C>), ParseError>);

impl<'de, C: Deserialize<'de>> Deserialize<'de> for MessageParts<'de, C> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<C>(std::marker::PhantomData<C>);
        impl<'de, C: Deserialize<'de>> Visitor<'de> for V<C> {
            type Value = MessageParts<'de, C>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            other_values!(MessageParts(Err(NOT_OBJECT)));
            fn visit_unit<E>(self) -> Result<Self::Value, E> {
                Ok(MessageParts(Err(NOT_OBJECT)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                while seq.next_element::<Skip<'de>>()?.is_some() {}
                Ok(MessageParts(Err(NOT_OBJECT)))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let (mut role, mut content) = (None, None);
                while let Some(Key(k)) = map.next_key::<Key<'de>>()? {
                    match &*k {
                        "role" => role = Some(map.next_value()?),
                        "content" => content = Some(map.next_value()?),
                        _ => {
                            map.next_value::<Skip<'de>>()?;
                        }
                    }
                }
                Ok(MessageParts(Ok((role, content))))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// A later message read whole (`super::messages`' checks, role first): the role decoded, the
/// content already flattened by [`Content`], with its media parts' `uuid`s.
fn full_message(
    role: Option<&RawValue>,
    content: Option<Content>,
) -> Result<(ChatMessage, Uuids), ParseError> {
    let role = role
        .filter(|r| first(r) == b'"')
        .and_then(|r| serde_json::from_str::<String>(r.get()).ok());
    let role =
        role.ok_or(ParseError::WrongType { field: "messages[].role", expected: "a string" })?;
    content
        .map_or(Ok((Arc::from(""), Vec::new())), |c| c.0)
        .map(|(content, media)| (ChatMessage { role: role.into(), content }, media))
}

/// A message's `content` flattened to text as `super::messages` flattens it (null is empty), and
/// its media parts' `uuid`s.
struct Content(Result<(Arc<str>, Uuids), ParseError>);

const NOT_CONTENT: ParseError =
    ParseError::WrongType { field: "messages[].content", expected: "a string or a list of parts" };

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Content;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_bool<E>(self, _: bool) -> Result<Content, E> {
                Ok(Content(Err(NOT_CONTENT)))
            }
            fn visit_i64<E>(self, _: i64) -> Result<Content, E> {
                Ok(Content(Err(NOT_CONTENT)))
            }
            fn visit_u64<E>(self, _: u64) -> Result<Content, E> {
                Ok(Content(Err(NOT_CONTENT)))
            }
            fn visit_f64<E>(self, _: f64) -> Result<Content, E> {
                Ok(Content(Err(NOT_CONTENT)))
            }
            fn visit_str<E>(self, s: &str) -> Result<Content, E> {
                Ok(Content(Ok((s.into(), Vec::new()))))
            }
            fn visit_unit<E>(self) -> Result<Content, E> {
                Ok(Content(Ok((Arc::from(""), Vec::new()))))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Content, A::Error> {
                while map.next_entry::<Key<'de>, Skip<'de>>()?.is_some() {}
                Ok(Content(Err(NOT_CONTENT)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Content, A::Error> {
                // Parts are rare and small: read as values and flattened the `Value` way.
                let mut parts = Vec::new();
                while let Some(p) = seq.next_element::<Value>()? {
                    parts.push(p);
                }
                Ok(Content(super::content_parts(&parts).map(|(t, m)| (Arc::from(t), m))))
            }
        }
        d.deserialize_any(V)
    }
}

/// A raw value's JSON type, by its first byte (the text is valid JSON).
fn first(raw: &RawValue) -> u8 {
    raw.get().as_bytes().first().copied().unwrap_or(b' ')
}

/// `super::messages`' checks of one message, on raw `role` and `content`.
fn check_message(role: Option<&RawValue>, content: Option<&RawValue>) -> Result<(), ParseError> {
    if role.is_none_or(|r| first(r) != b'"') {
        return Err(ParseError::WrongType { field: "messages[].role", expected: "a string" });
    }
    match content {
        None => Ok(()),
        Some(c) if c.get() == "null" || first(c) == b'"' => Ok(()),
        Some(c) if first(c) == b'[' => content_parts(c),
        Some(_) => Err(ParseError::WrongType {
            field: "messages[].content",
            expected: "a string or a list of parts",
        }),
    }
}

/// `super::content_parts`' checks, on the raw list (a second reading, of list contents only).
fn content_parts(content: &RawValue) -> Result<(), ParseError> {
    let not_parts =
        ParseError::WrongType { field: "messages[].content", expected: "a list of parts" };
    let parts: Vec<&RawValue> =
        serde_json::from_str(content.get()).map_err(|_| not_parts.clone())?;
    for part in parts {
        match first(part) {
            b'"' => {}
            b'{' => {
                let obj: HashMap<Cow<'_, str>, &RawValue> =
                    serde_json::from_str(part.get()).map_err(|_| not_parts.clone())?;
                // A missing or non-string `type` counts as text.
                let kind = obj
                    .get("type")
                    .filter(|t| first(t) == b'"')
                    .and_then(|t| serde_json::from_str::<String>(t.get()).ok());
                if kind.as_deref().unwrap_or("text") == "text"
                    && obj.get("text").is_none_or(|t| first(t) != b'"')
                {
                    return Err(ParseError::WrongType {
                        field: "messages[].content[].text",
                        expected: "a string",
                    });
                }
            }
            _ => return Err(not_parts),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    /// The `Value` reading of a chat body, which `parse` (the collecting pass) must equal.
    fn via_value(body: &[u8]) -> Result<OpenAiRequest, ParseError> {
        let value: Value = serde_json::from_slice(body).map_err(|_| ParseError::NotJson)?;
        let obj = value.as_object().ok_or(ParseError::NotAnObject)?;
        super::super::read(Endpoint::ChatCompletions, |k| obj.get(k).map(Cow::Borrowed), None)
    }

    fn agree(body: &[u8]) {
        for endpoint in [Endpoint::ChatCompletions, Endpoint::Completions] {
            let want = parse(endpoint, body).map(|r| RequestPeek::of(&r));
            assert_eq!(
                peek(endpoint, body),
                want,
                "{endpoint:?} {}",
                String::from_utf8_lossy(body)
            );
        }
        assert_eq!(
            parse(Endpoint::ChatCompletions, body),
            via_value(body),
            "{}",
            String::from_utf8_lossy(body)
        );
    }

    #[test]
    fn reads_like_parse() {
        let bodies: &[&str] = &[
            r#"{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":"hi"},{"role":"assistant","content":null}],"stream":true}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}},"b",{"text":"c"}]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":7,"text":"a"}]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":7}]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"te\u0078t"}]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"type":"image"}]}]}"#,
            r#"{"messages":[{"role":"user","content":[1]}]}"#,
            r#"{"messages":[{"role":"user","content":[{"text":5}]}]}"#,
            r#"{"messages":[{"role":"user","content":{}}]}"#,
            r#"{"messages":[{"role":"user","content":5}]}"#,
            r#"{"messages":[{"role":"u\u0073er","content":"x"}]}"#,
            r#"{"messages":[{"role":"user","role":5,"content":"x"}]}"#,
            r#"{"messages":[{"role":5,"role":"user","content":"x"}]}"#,
            r#"{"messages":[{"content":"x"}]}"#,
            r#"{"messages":[{"role":"assistant","content":"x"}]}"#,
            r#"{"messages":[{"role":"assistant","content":"x"},7]}"#,
            r#"{"messages":[]}"#,
            r#"{"messages":{}}"#,
            r#"{"messages":null}"#,
            r#"{"messages":"hi"}"#,
            r#"{}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"model":5}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"model":null,"stream":null}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":null,"max_completion_tokens":-1}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"max_completion_tokens":1.5}"#,
            r#"{"messages":[{"role":"user","content":"x"}],"messages":7}"#,
            r#"{"messages":7,"messages":[{"role":"user","content":"x"}]}"#,
            r#"{"messages":[{"role":"user","content":"x"}]"#,
            r#"[1]"#,
            "",
            "{\"messages\":[{\"role\":\"user\",\"content\":\"\u{ff}\"}]}",
            r#"{"prompt":[1,2],"stream":true}"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"a\"b\u00e9","content":null,"role":"tool"},{"role":"user","content":["p",{"text":"q"}]}],"cache_salt":"s","max_completion_tokens":3}"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"y"}],"cache_salt":7}"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":5,"content":"ok"}]}"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"ok","content":5}]}"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":7,"content":{}}]}"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":{}},{"role":9}]}"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":[{"type":"text"}]}]}"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant"}]} x"#,
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"y"}]}  "#,
        ];
        for body in bodies {
            agree(body.as_bytes());
        }
        // Not UTF-8 in a skipped field: not JSON, as the `Value` reading says.
        agree(b"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"user\",\"x\":\"\xff\"}],\"y\":\"\xfe\"}");
        agree(b"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"user\",\"\xfe\":1}]}");
        agree(b"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"},{\"role\":\"user\",\"content\":[{\"type\":\"\xfe\"}]}]}");
        agree(b"{\"messages\":[{\"role\":\"user\",\"content\":\"x\"}],\"cache_salt\":\"\xff\"}");
        for depth in [126, 127, 128, 200] {
            let deep = format!(
                r#"{{"x":{}1{},"messages":[{{"role":"user","content":"a"}}]}}"#,
                "[".repeat(depth - 1),
                "]".repeat(depth - 1)
            );
            agree(deep.as_bytes());
        }
    }

    fn json_tree() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            (0u64..300).prop_map(Value::from),
            (-5i64..5).prop_map(Value::from),
            Just(json!(1.5)),
            prop_oneof![Just("user"), Just("system"), Just("text"), Just("image_url"), Just("a")]
                .prop_map(|s| Value::String(s.into())),
        ];
        leaf.prop_recursive(3, 24, 5, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("role"),
                        Just("content"),
                        Just("type"),
                        Just("text"),
                        Just("x")
                    ],
                    inner,
                    0..4
                )
                .prop_map(|m| Value::Object(
                    m.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
                )),
            ]
        })
    }

    /// A message that is usually well formed, sometimes not in one field.
    fn message() -> impl Strategy<Value = Value> {
        let role = prop_oneof![4 => prop_oneof![Just("user"), Just("system"), Just("assistant")].prop_map(Value::from), 1 => json_tree()];
        let part = prop_oneof![
            3 => "[a-c]{0,3}".prop_map(|t| json!({"type": "text", "text": t})),
            1 => Just(json!({"type": "image_url", "image_url": {}})),
            1 => json_tree(),
        ];
        let content = prop_oneof![
            3 => "[a-c\"\\\\\né]{0,4}".prop_map(Value::from),
            2 => proptest::collection::vec(part, 0..3).prop_map(Value::Array),
            1 => json_tree(),
        ];
        prop_oneof![8 => (role, content).prop_map(|(r, c)| json!({"role": r, "content": c})), 1 => json_tree()]
    }

    proptest! {
        #[test]
        fn any_chat_reads_like_parse(
            messages in proptest::collection::vec(message(), 0..5),
            stream in proptest::option::of(json_tree()),
            max in proptest::option::of(json_tree()),
            model in proptest::option::of(json_tree()),
            salt in proptest::option::of(json_tree()),
            pretty in any::<bool>(),
        ) {
            let mut body = json!({"messages": messages});
            for (k, v) in [("stream", stream), ("max_tokens", max), ("model", model), ("cache_salt", salt)] {
                if let Some(v) = v {
                    body[k] = v;
                }
            }
            let bytes = if pretty { serde_json::to_vec_pretty(&body).unwrap() } else { serde_json::to_vec(&body).unwrap() };
            let want = parse(Endpoint::ChatCompletions, &bytes).map(|r| RequestPeek::of(&r));
            prop_assert_eq!(peek(Endpoint::ChatCompletions, &bytes), want);
            prop_assert_eq!(parse(Endpoint::ChatCompletions, &bytes), via_value(&bytes));
        }
    }
}
