//! Lenient reading of OpenAI `/v1/completions` and `/v1/chat/completions` request bodies.
//!
//! Only the fields routing needs are read ([`fields`]); unknown fields are ignored. Every caller —
//! the filter (for session keys), the indexer (for tokenization), the engine simulator — reads a
//! body through one entry point, [`Body`], which picks the reading for what the caller needs and
//! resumes from a known prefix where there is one (`reader`'s table); every reading gives this
//! module's [`parse`] verdict, so they can never disagree about what the prompt is. Chat content given as parts is joined the way vLLM joins text
//! parts for string-format chat templates: text parts separated by `"\n"`, other parts skipped —
//! media parts (images …) are listed apart, with their message and `uuid` ([`media`]:
//! [`OpenAiRequest::media`]), for the indexer's media rule and the simulator.
//! What the flattening drops (non-text parts, tool calls, names) still identifies a conversation,
//! so a chat body's conversation anchor is digested here, while the raw messages are at hand
//! ([`OpenAiRequest::conversation_anchor`], rendered by [`anchor`]).
//!
//! Over 600 lines: about 240 of them are the unit tests of the request types and the flattening;
//! the code itself is under 420.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use serde_json::value::RawValue;
use serde_json::Value;

pub mod anchor;
mod fast;
mod fields;
mod grammar;
pub mod media;
mod peek;
mod reader;
mod resume;
pub mod scan;

pub use peek::{peek, RequestPeek};
pub use reader::Body;
pub use resume::{read_chat_from, ChatPrefix, ChatRead};
pub use scan::Skip;

/// Which OpenAI endpoint a request targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    /// The endpoint a request path (query string allowed) names, if routable.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split('?').next().unwrap_or(path);
        match path.trim_end_matches('/') {
            "/v1/completions" => Some(Self::Completions),
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            _ => None,
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// A completion prompt: text, or token ids (vLLM accepts both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One chat message with its content flattened to text. Shared strings: a conversation's next
/// turn is read from its last one (`resume`), which hands the earlier messages over by reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: Arc<str>,
    pub content: Arc<str>,
}

/// What routing needs from a request body.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestInput {
    Prompt(Prompt),
    Messages(Vec<ChatMessage>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub input: RequestInput,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    /// vLLM's per-request prefix-cache salt; changes the block hash seed.
    pub cache_salt: Option<String>,
    /// Chat only: [`anchor::anchor_digest`] of the raw messages — the conversation up to
    /// and including its first user message, canonically rendered. None for completions and for
    /// chat without a user message.
    pub conversation_anchor: Option<u64>,
    /// Chat only: the media parts the flattened contents leave out, in prompt order ([`media`]).
    pub media: Vec<media::MediaPart>,
}

impl OpenAiRequest {
    /// Whether the request opens a conversation: a chat whose messages carry no earlier turn (no
    /// `assistant`, `tool` or `function` message), so no engine can hold its history yet. A
    /// completions prompt has no turns to tell: false.
    pub fn opens_conversation(&self) -> bool {
        match &self.input {
            RequestInput::Messages(m) => {
                !m.iter().any(|m| matches!(&*m.role, "assistant" | "tool" | "function"))
            }
            RequestInput::Prompt(_) => false,
        }
    }
}

/// Why a body cannot be read as a routable request. The request still goes to an engine, which
/// answers it with its own error; these only explain why kvmesh did not route by content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    NotJson,
    NotAnObject,
    Missing {
        field: &'static str,
    },
    WrongType {
        field: &'static str,
        expected: &'static str,
    },
    /// A batch of several prompts: the engine serves it, kvmesh does not route it by content.
    BatchPrompt,
}

impl ParseError {
    /// A short, stable label for metrics and log lines.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotJson => "not_json",
            Self::NotAnObject => "not_an_object",
            Self::Missing { .. } => "missing_field",
            Self::WrongType { .. } => "wrong_type",
            Self::BatchPrompt => "batch_prompt",
        }
    }
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotJson => write!(f, "body is not valid JSON"),
            Self::NotAnObject => write!(f, "body is not a JSON object"),
            Self::Missing { field } => write!(f, "missing field `{field}`"),
            Self::WrongType { field, expected } => write!(f, "field `{field}` must be {expected}"),
            Self::BatchPrompt => write!(f, "`prompt` holds several prompts (a batch)"),
        }
    }
}

impl std::error::Error for ParseError {}

/// Reads `body` as a request to `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<OpenAiRequest, ParseError> {
    // A chat body in one streaming pass, messages decoded straight from the body (`peek`).
    if endpoint == Endpoint::ChatCompletions {
        if let Some(read) = peek::read_chat(body) {
            return read;
        }
    }
    // No raw fields: copying them out would copy the whole body once more.
    parse_fields(endpoint, body, false).map(|(req, _)| req)
}

/// The top-level fields of a request body other than `prompt`, split but not parsed: a field's
/// JSON is only deserialized when someone asks for it. Lets a reader that needs more than
/// [`OpenAiRequest`] (the engine simulator's `kv_transfer_params`, `stream_options` …) read the
/// body once.
#[derive(Debug, Default)]
pub struct RawFields {
    fields: HashMap<String, Box<RawValue>>,
}

impl RawFields {
    fn owned(fields: HashMap<Cow<'_, str>, &RawValue>) -> Self {
        Self { fields: fields.into_iter().map(|(k, v)| (k.into_owned(), v.to_owned())).collect() }
    }

    /// The raw JSON of top-level field `key` (the last one if the key repeats, as `Value` keeps);
    /// always `None` for `prompt`, which [`parse_raw`] has read already.
    pub fn get(&self, key: &str) -> Option<&RawValue> {
        self.fields.get(key).map(|v| &**v)
    }
}

/// The placeholder the fast path puts where the prompt was.
const PLACEHOLDER: &[u8] = b"[0]";

/// [`parse`], also returning the body's other top-level fields for further reading.
///
/// Same results as reading the body into a `serde_json::Value` and inspecting it. A completion
/// prompt that is a flat list of token ids is read by a byte scan instead of serde (see `fast`);
/// the rest of the body is split into raw top-level fields and only the fields routing reads
/// become `Value`s. A body serde cannot split (not an object, not JSON) is judged the `Value`
/// way and has no raw fields.
pub fn parse_raw(
    endpoint: Endpoint,
    body: &[u8],
) -> Result<(OpenAiRequest, RawFields), ParseError> {
    parse_fields(endpoint, body, true)
}

/// [`parse_raw`]; the raw fields are kept only when `keep_raw`.
fn parse_fields(
    endpoint: Endpoint,
    body: &[u8],
    keep_raw: bool,
) -> Result<(OpenAiRequest, RawFields), ParseError> {
    let keep = |fields: HashMap<Cow<'_, str>, &RawValue>| {
        if keep_raw {
            RawFields::owned(fields)
        } else {
            RawFields::default()
        }
    };
    if endpoint == Endpoint::Completions {
        if let Some(done) = parse_flat_prompt(body, keep_raw) {
            return done;
        }
    }
    let split = serde_json::from_slice::<HashMap<Cow<'_, str>, &RawValue>>(body)
        .ok()
        .filter(|_| fast::depth_ok(body));
    let Some(mut fields) = split else {
        let value: Value = serde_json::from_slice(body).map_err(|_| ParseError::NotJson)?;
        let obj = value.as_object().ok_or(ParseError::NotAnObject)?;
        let req = read(endpoint, |k| obj.get(k).map(Cow::Borrowed), None)?;
        return Ok((req, RawFields::default()));
    };
    let prompt = fields.remove("prompt");
    // Raw fields are valid JSON already, so reading one as a `Value` cannot fail.
    let as_value = |r: &RawValue| serde_json::from_str::<Value>(r.get()).ok().map(Cow::Owned);
    let req = read(
        endpoint,
        |k| {
            if k == "prompt" {
                prompt.and_then(as_value)
            } else {
                fields.get(k).and_then(|r| as_value(r))
            }
        },
        None,
    )?;
    Ok((req, keep(fields)))
}

/// The fast path of [`parse_raw`] for a completions body whose prompt is a flat list of ids;
/// `None` when it does not apply (the general path then decides).
fn parse_flat_prompt(
    body: &[u8],
    keep_raw: bool,
) -> Option<Result<(OpenAiRequest, RawFields), ParseError>> {
    let fast::PromptSpan { start, end, ids } = fast::prompt_span(body)?;
    let ids = ids?;
    let mut rest = Vec::with_capacity(body.len() - (end - start) + PLACEHOLDER.len());
    rest.extend_from_slice(&body[..start]);
    rest.extend_from_slice(PLACEHOLDER);
    rest.extend_from_slice(&body[end..]);
    let mut fields = serde_json::from_slice::<HashMap<Cow<'_, str>, &RawValue>>(&rest).ok()?;
    // serde must see the placeholder where the scan put it, as the last `prompt`: then the body
    // is valid JSON and this prompt is the one the `Value` path would read.
    let placeholder = fields.remove("prompt")?;
    if placeholder.get().as_ptr() != rest[start..].as_ptr()
        || placeholder.get().as_bytes() != PLACEHOLDER
    {
        return None;
    }
    let as_value = |r: &RawValue| serde_json::from_str::<Value>(r.get()).ok().map(Cow::Owned);
    let req = read(Endpoint::Completions, |k| fields.get(k).and_then(|r| as_value(r)), Some(ids));
    Some(
        req.map(|req| {
            (req, if keep_raw { RawFields::owned(fields) } else { RawFields::default() })
        }),
    )
}

/// The request from its top-level fields (`field(key)`), in the order errors are reported.
fn read<'v>(
    endpoint: Endpoint,
    field: impl Fn(&str) -> Option<Cow<'v, Value>>,
    tokens: Option<Vec<u32>>,
) -> Result<OpenAiRequest, ParseError> {
    let (input, conversation_anchor, media) = match (endpoint, tokens) {
        (Endpoint::Completions, Some(ids)) => {
            (RequestInput::Prompt(Prompt::Tokens(ids)), None, Vec::new())
        }
        (Endpoint::Completions, None) => {
            (RequestInput::Prompt(prompt(field("prompt").as_deref())?), None, Vec::new())
        }
        (Endpoint::ChatCompletions, _) => {
            let raw = field("messages");
            let (parsed, media) = messages_with_media(raw.as_deref())?;
            // `messages` accepted the value, so it is a non-empty list.
            let anchor = raw
                .as_deref()
                .and_then(Value::as_array)
                .and_then(|items| anchor::anchor_digest(items));
            (RequestInput::Messages(parsed), anchor, media)
        }
    };
    let fields::Scalars { model, stream, max_tokens, cache_salt } = fields::scalars(field)?;
    Ok(OpenAiRequest {
        endpoint,
        model,
        input,
        stream,
        max_tokens,
        cache_salt,
        conversation_anchor,
        media,
    })
}

fn prompt(value: Option<&Value>) -> Result<Prompt, ParseError> {
    const FIELD: &str = "prompt";
    match value {
        None | Some(Value::Null) => Err(ParseError::Missing { field: FIELD }),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => {
                Err(ParseError::WrongType { field: FIELD, expected: "a non-empty string or list" })
            }
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(inner)] => token_ids(inner).map(Prompt::Tokens),
            [Value::Number(_), ..] => token_ids(items).map(Prompt::Tokens),
            [Value::String(_) | Value::Array(_), ..] => Err(ParseError::BatchPrompt),
            _ => Err(ParseError::WrongType {
                field: FIELD,
                expected: "a string, a list of token ids, or a one-element list of either",
            }),
        },
        Some(_) => Err(ParseError::WrongType { field: FIELD, expected: "a string or a list" }),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ParseError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(ParseError::WrongType { field: "prompt", expected: "token ids in 0..2^32" })
        })
        .collect()
}

fn messages(value: Option<&Value>) -> Result<Vec<ChatMessage>, ParseError> {
    messages_with_media(value).map(|(m, _)| m)
}

/// [`messages`], with the media parts their contents hold ([`media`]).
fn messages_with_media(
    value: Option<&Value>,
) -> Result<(Vec<ChatMessage>, Vec<media::MediaPart>), ParseError> {
    const FIELD: &str = "messages";
    let items = match value {
        None | Some(Value::Null) => return Err(ParseError::Missing { field: FIELD }),
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(_) => {
            return Err(ParseError::WrongType {
                field: FIELD,
                expected: "a non-empty list of messages",
            })
        }
    };
    let mut media = Vec::new();
    let messages = items
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let obj = m
                .as_object()
                .ok_or(ParseError::WrongType { field: FIELD, expected: "a list of objects" })?;
            let role = obj
                .get("role")
                .and_then(Value::as_str)
                .ok_or(ParseError::WrongType { field: "messages[].role", expected: "a string" })?
                .to_owned();
            let content = match obj.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => {
                    let (text, uuids) = content_parts(parts)?;
                    let message = u32::try_from(i).unwrap_or(u32::MAX);
                    media.extend(uuids.into_iter().map(|uuid| media::MediaPart { message, uuid }));
                    text
                }
                Some(_) => {
                    return Err(ParseError::WrongType {
                        field: "messages[].content",
                        expected: "a string or a list of parts",
                    })
                }
            };
            Ok(ChatMessage { role: role.into(), content: content.into() })
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((messages, media))
}

/// A content list flattened to its text parts joined by `"\n"`, and the `uuid`s of its media
/// parts ([`media::part`]) in order.
fn content_parts(parts: &[Value]) -> Result<(String, media::Uuids), ParseError> {
    let mut texts = Vec::with_capacity(parts.len());
    let mut media = Vec::new();
    for part in parts {
        match part {
            Value::String(s) => texts.push(s.as_str()),
            Value::Object(obj) => {
                if let Some(uuid) = media::part(obj) {
                    media.push(uuid);
                } else if obj.get("type").and_then(Value::as_str).unwrap_or("text") == "text" {
                    let text =
                        obj.get("text").and_then(Value::as_str).ok_or(ParseError::WrongType {
                            field: "messages[].content[].text",
                            expected: "a string",
                        })?;
                    texts.push(text);
                }
            }
            _ => {
                return Err(ParseError::WrongType {
                    field: "messages[].content",
                    expected: "a list of parts",
                })
            }
        }
    }
    Ok((texts.join("\n"), media))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completions(body: &str) -> Result<OpenAiRequest, ParseError> {
        parse(Endpoint::Completions, body.as_bytes())
    }
    fn chat(body: &str) -> Result<OpenAiRequest, ParseError> {
        parse(Endpoint::ChatCompletions, body.as_bytes())
    }

    #[test]
    fn opening_a_conversation() {
        let sys = r#"{"role":"system","content":"s"}"#;
        let user = r#"{"role":"user","content":"u"}"#;
        let cases = [
            (format!("[{sys},{user}]"), true),
            (format!("[{user}]"), true),
            (format!("[{sys},{user},{{\"role\":\"assistant\",\"content\":\"a\"}},{user}]"), false),
            (format!("[{sys},{user},{{\"role\":\"tool\",\"content\":\"t\"}}]"), false),
            (format!("[{sys},{{\"role\":\"function\",\"content\":\"f\"}}]"), false),
        ];
        for (messages, opens) in cases {
            let r = chat(&format!(r#"{{"messages":{messages}}}"#)).expect("chat");
            assert_eq!(r.opens_conversation(), opens, "{messages}");
        }
        assert!(!completions(r#"{"prompt":"hi"}"#).expect("completions").opens_conversation());
    }

    #[test]
    fn paths() {
        assert_eq!(Endpoint::from_path("/v1/completions"), Some(Endpoint::Completions));
        assert_eq!(
            Endpoint::from_path("/v1/chat/completions?x=1"),
            Some(Endpoint::ChatCompletions)
        );
        assert_eq!(Endpoint::from_path("/v1/models"), None);
    }

    #[test]
    fn prompt_shapes() {
        let cases: &[(&str, Result<Prompt, ParseError>)] = &[
            (r#"{"prompt":"hi"}"#, Ok(Prompt::Text("hi".into()))),
            (r#"{"prompt":["hi"]}"#, Ok(Prompt::Text("hi".into()))),
            (r#"{"prompt":[1,2,3]}"#, Ok(Prompt::Tokens(vec![1, 2, 3]))),
            (r#"{"prompt":[[4,5]]}"#, Ok(Prompt::Tokens(vec![4, 5]))),
            (r#"{"prompt":["a","b"]}"#, Err(ParseError::BatchPrompt)),
            (r#"{"prompt":[[1],[2]]}"#, Err(ParseError::BatchPrompt)),
            (
                r#"{"prompt":[1,-2]}"#,
                Err(ParseError::WrongType { field: "prompt", expected: "token ids in 0..2^32" }),
            ),
            (
                r#"{"prompt":[]}"#,
                Err(ParseError::WrongType {
                    field: "prompt",
                    expected: "a non-empty string or list",
                }),
            ),
            (
                r#"{"prompt":7}"#,
                Err(ParseError::WrongType { field: "prompt", expected: "a string or a list" }),
            ),
            (r#"{"model":"m"}"#, Err(ParseError::Missing { field: "prompt" })),
        ];
        for (body, want) in cases {
            let got = completions(body).map(|r| match r.input {
                RequestInput::Prompt(p) => p,
                RequestInput::Messages(_) => unreachable!(),
            });
            assert_eq!(&got, want, "{body}");
        }
    }

    #[test]
    fn not_json_and_not_object() {
        assert_eq!(completions("{not json"), Err(ParseError::NotJson));
        assert_eq!(completions(r#"{"prompt":"tru"#), Err(ParseError::NotJson));
        assert_eq!(completions("[1]"), Err(ParseError::NotAnObject));
    }

    #[test]
    fn chat_content_parts_are_joined_like_vllm() {
        let r = chat(r#"{"model":"m","stream":true,"max_tokens":5,"extra":{"x":1},"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null}]}"#)
        .unwrap();
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.model.as_deref(), Some("m"));
        let RequestInput::Messages(m) = r.input else { panic!("messages") };
        assert_eq!(&*m[1].content, "a\nb");
        assert_eq!(&*m[2].content, "");
    }

    /// The `Value` reading `parse_raw` must agree with.
    fn via_value(endpoint: Endpoint, body: &[u8]) -> Result<OpenAiRequest, ParseError> {
        let value: Value = serde_json::from_slice(body).map_err(|_| ParseError::NotJson)?;
        let obj = value.as_object().ok_or(ParseError::NotAnObject)?;
        read(endpoint, |k| obj.get(k).map(Cow::Borrowed), None)
    }

    #[test]
    fn the_raw_split_reads_exactly_like_a_value() {
        let bodies: &[&[u8]] = &[
            br#"{"prompt":[1,2,3],"max_tokens":4,"stream":true,"model":"m","cache_salt":"s"}"#,
            br#"{"prompt":[[1,2]]}"#,
            br#"{"prompt":[[]]}"#,
            br#"{"prompt":[]}"#,
            br#"{"prompt":[1.0,2]}"#,
            br#"{"prompt":[4294967296]}"#,
            br#"{"prompt":[1,-2]}"#,
            br#"{"prompt":[[1],[2]]}"#,
            br#"{"prompt":[1,"a"]}"#,
            br#"{"prompt":"text","prompt":[9]}"#,
            br#"{"pro\u006dpt":[5,6]}"#,
            br#" { "prompt" : [ 1 , 2 ] , "max_tokens" : null , "max_completion_tokens" : 3 } "#,
            br#"{"prompt":[1],"max_completion_tokens":3}"#,
            br#"{"prompt":[1],"model":7}"#,
            br#"{"prompt":[1],"stream":"yes"}"#,
            br#"{"prompt":[1],"cache_salt":5}"#,
            b"{\"prompt\":\"\xff\"}",
            br#"[1,2]"#,
            br#"{"prompt":[1,2]"#,
            b"",
            br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"}]}],"max_tokens":2}"#,
            br#"{"prompt":[[1,[2]]]}"#,
            br#"{"prompt":{"a":1,"a":2}}"#,
            br#"{"prompt":null,"max_tokens":1}"#,
            br#"{"prompt":-0}"#,
            br#"{"prompt":[-0,1]}"#,
            br#"{"prompt":[1e2]}"#,
            br#"{"prompt":[true]}"#,
            br#"{"prompt":[1,2],"prompt":"x"}"#,
            br#"{"prompt":[0,4294967295]}"#,
            br#"{"prompt":[[0,4294967296]]}"#,
            br#"{"prompt":[01]}"#,
            br#"{"prompt":[1,]}"#,
            br#"{"prompt":[1] "model":"m"}"#,
            br#"{"prompt":[1],"prompt":[2]}"#,
            br#"{"prompt":[1],"pro\u006dpt":[2]}"#,
            br#"{"pro\u006dpt":"x","prompt":[2]}"#,
            br#"{"prompt":[1],"model":"m\"prompt\":[9]"}"#,
            br#"{"model":"{\"prompt\":[5]}","prompt" : [ 7 , 8 ] }"#,
            br#"{"prompt":[1],"x":{"prompt":"nested"}}"#,
            br#"{"prompt":[1]}garbage"#,
            br#"{"prompt":[1],}"#,
            br#"{"prompt":[1]"#,
            b"{\"prompt\":[1],\"x\":\"\xff\"}",
            b"\xef\xbb\xbf{\"prompt\":[1]}",
        ];
        for depth in [125, 126, 127, 128, 200] {
            // The top-level object is one level; `x` adds `depth - 1` more.
            let deep = format!(
                r#"{{"x":{}1{},"prompt":[1],"messages":[{{"role":"user","content":"a"}}]}}"#,
                "[".repeat(depth - 1),
                "]".repeat(depth - 1)
            );
            for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
                assert_eq!(
                    parse(endpoint, deep.as_bytes()),
                    via_value(endpoint, deep.as_bytes()),
                    "depth {depth}"
                );
            }
        }
        assert!(parse(
            Endpoint::Completions,
            format!(r#"{{"x":{}{},"prompt":[1]}}"#, "[".repeat(126), "]".repeat(126)).as_bytes()
        )
        .is_ok());
        for body in bodies {
            for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
                assert_eq!(
                    parse(endpoint, body),
                    via_value(endpoint, body),
                    "{}",
                    String::from_utf8_lossy(body)
                );
            }
        }
        let (_, raw) =
            parse_raw(Endpoint::Completions, br#"{"prompt":[1],"kv_transfer_params":{"a":1}}"#)
                .unwrap();
        assert_eq!(raw.get("kv_transfer_params").map(RawValue::get), Some(r#"{"a":1}"#));
        assert!(raw.get("missing").is_none());
        assert!(raw.get("prompt").is_none());
    }

    fn json_tree() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            (0u64..6_000_000_000).prop_map(Value::from),
            (0u64..300).prop_map(Value::from),
            (-5i64..5).prop_map(Value::from),
            (-2.0f64..2.0).prop_map(Value::from),
            "[a-z]{0,3}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z]{1,2}", inner, 0..3)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        #[test]
        fn any_prompt_reads_like_a_value(prompt in json_tree(), max in proptest::option::of(json_tree())) {
            let mut body = serde_json::json!({"prompt": prompt, "model": "m"});
            if let Some(max) = max {
                body["max_tokens"] = max;
            }
            for bytes in [serde_json::to_vec(&body).unwrap(), serde_json::to_vec_pretty(&body).unwrap()] {
                for endpoint in [Endpoint::Completions, Endpoint::ChatCompletions] {
                    proptest::prop_assert_eq!(parse(endpoint, &bytes), via_value(endpoint, &bytes));
                }
            }
        }
    }

    #[test]
    fn chat_errors() {
        assert_eq!(chat(r#"{"messages":[]}"#).unwrap_err().reason(), "wrong_type");
        assert_eq!(chat(r#"{"messages":"hi"}"#).unwrap_err().reason(), "wrong_type");
        assert_eq!(chat(r#"{"messages":[{"content":"x"}]}"#).unwrap_err().reason(), "wrong_type");
        assert_eq!(chat(r#"{}"#).unwrap_err().reason(), "missing_field");
        assert_eq!(
            chat(r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#)
                .unwrap_err()
                .reason(),
            "wrong_type"
        );
    }
}
