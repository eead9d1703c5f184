//! Session keys: which conversation a request belongs to, so its turns find the worker holding
//! its KV cache — and different conversations are free to go to different workers.
//!
//! An explicit session header wins. Otherwise the filter derives a key (on by default):
//!
//! * **chat**: a digest of the conversation's *anchor* — every message up to and including the
//!   first user message (system and developer messages, anything else before the first user turn,
//!   and that user turn), canonically rendered, whatever their length. Later turns only append
//!   messages, so the anchor, and the key, are the same on every turn; conversations behind one
//!   system prompt differ in their first user message and get different keys. There is no cut at
//!   N bytes: any cut shorter than a shared system prompt (agents send 10–30 KB) gives every
//!   conversation behind it one key and one worker, the collapse issue 11 measured. A chat request
//!   without a user message has no anchor yet and gets no derived key. A client that drops old
//!   turns from the front (context-window truncation) changes its anchor and so its key — rightly:
//!   its prompt no longer extends the cached one past the system prompt, so there is no KV to keep.
//! * **completions** (text or token ids): no derived key. A raw prompt carries no turn structure:
//!   a key over its first N units collapses every request sharing N units (a shared preamble of a
//!   few thousand tokens is the common case), and a key over the whole prompt changes on every
//!   turn. Such requests are placed by the indexer's overlap and load (predicted-TTFT) scoring,
//!   which already sends a continuation to the worker holding its prefix; a client that wants a
//!   pin sends the session header.
//!
//! The anchor is digested where the raw messages are read ([`crate::openai::anchor`]: the
//! canonical rendering), and [`crate::openai::parse`] stores it in
//! [`OpenAiRequest::conversation_anchor`], so the filter's session key, its fallback pin and any
//! indexer reading the same body all see the same value.

use crate::hashing::xxh3;
pub use crate::openai::anchor::anchor_digest;
use crate::openai::OpenAiRequest;

const HEADER_SEED: u64 = 0x6b76_6d65_7368_0010;

/// A 64-bit session key. On the wire: 16 lowercase hex digits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SessionKey(pub u64);

/// Where a session key came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionSource {
    /// The client's explicit session header.
    Header,
    /// Derived from the request (the chat conversation's anchor). `prefix` on the wire.
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

/// The derived key of `request`: its conversation anchor (chat with a user message), else None
/// (completions, chat without a user message). See the module docs.
pub fn derived_key(request: &OpenAiRequest) -> Option<SessionKey> {
    request.conversation_anchor.map(SessionKey)
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
    use std::collections::HashSet;

    use serde_json::{json, Value};

    use super::*;
    use crate::openai::{parse, Endpoint};

    fn chat_key(messages: &[Value]) -> Option<SessionKey> {
        let body = serde_json::to_vec(&json!({ "model": "m", "messages": messages })).unwrap();
        derived_key(&parse(Endpoint::ChatCompletions, &body).unwrap())
    }

    fn msg(role: &str, content: &str) -> Value {
        json!({ "role": role, "content": content })
    }

    /// A tool-using assistant turn: the call, the tool's answer, the assistant's reply.
    fn tool_turn(i: usize) -> Vec<Value> {
        vec![
            json!({ "role": "assistant", "content": null, "tool_calls": [
                { "id": format!("call_{i}"), "type": "function", "function": { "name": "search", "arguments": format!("{{\"q\":\"{i}\"}}") } }
            ]}),
            json!({ "role": "tool", "tool_call_id": format!("call_{i}"), "content": format!("result {i}") }),
            msg("assistant", &format!("answer {i}")),
        ]
    }

    /// Appends 20 turns (plain, tool-using, with content parts) and checks the key after each.
    fn assert_stable_for_20_turns(mut history: Vec<Value>) {
        let first = chat_key(&history);
        assert!(first.is_some());
        for turn in 1..20 {
            match turn % 3 {
                0 => history.extend(tool_turn(turn)),
                1 => history.push(msg("assistant", &format!("reply {turn}"))),
                _ => history.push(json!({ "role": "assistant", "content": [{ "type": "text", "text": format!("part {turn}") }] })),
            }
            history.push(json!({ "role": "user", "content": [{ "type": "text", "text": format!("next {turn}"), "cache_control": { "type": "ephemeral" } }] }));
            assert_eq!(chat_key(&history), first, "turn {}", turn + 1);
        }
    }

    #[test]
    fn a_one_message_conversation_keeps_its_key_for_20_turns() {
        assert_stable_for_20_turns(vec![msg("user", "hi")]);
    }

    #[test]
    fn a_100_message_conversation_keeps_its_key_for_20_turns() {
        let mut history = vec![
            msg("system", &"You are a coding agent. ".repeat(200)),
            msg("developer", "repo rules"),
        ];
        history.push(json!({ "role": "user", "content": [{ "type": "text", "text": "fix the bug" }, { "type": "image_url", "image_url": { "url": "data:image/png;base64,AAAA" } }] }));
        while history.len() < 100 {
            let i = history.len();
            history.extend(tool_turn(i));
            history.push(msg("user", &format!("and then {i}")));
        }
        history.truncate(100);
        assert_eq!(history.len(), 100);
        assert_stable_for_20_turns(history);
    }

    #[test]
    fn conversations_sharing_a_30kb_system_prompt_get_distinct_keys() {
        let system = "Shared policy text for every conversation of this application. ".repeat(480);
        assert!(system.len() >= 30_000);
        let keys: HashSet<SessionKey> = (0..64)
            .map(|i| {
                chat_key(&[msg("system", &system), msg("user", &format!("question {i}"))]).unwrap()
            })
            .collect();
        assert_eq!(keys.len(), 64);
    }

    #[test]
    fn no_cut_a_difference_deep_in_the_anchor_changes_the_key() {
        let long = "x".repeat(200_000);
        let a = chat_key(&[msg("system", &long), msg("user", "q")]);
        let b = chat_key(&[msg("system", &format!("{long}y")), msg("user", "q")]);
        assert_ne!(a, b);
    }

    #[test]
    fn what_the_anchor_covers() {
        let base = chat_key(&[msg("system", "s"), msg("user", "q")]);
        let cases: &[(&str, Vec<Value>, bool)] = &[
            ("same messages", vec![msg("system", "s"), msg("user", "q")], true),
            (
                "later turns ignored",
                vec![msg("system", "s"), msg("user", "q"), msg("assistant", "a"), msg("user", "r")],
                true,
            ),
            (
                "string = one text part",
                vec![
                    msg("system", "s"),
                    json!({"role": "user", "content": [{"type": "text", "text": "q"}]}),
                ],
                true,
            ),
            (
                "bare string part",
                vec![msg("system", "s"), json!({"role": "user", "content": ["q"]})],
                true,
            ),
            (
                "part without type is text",
                vec![msg("system", "s"), json!({"role": "user", "content": [{"text": "q"}]})],
                true,
            ),
            (
                "cache_control ignored",
                vec![
                    json!({"role": "system", "content": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}]}),
                    msg("user", "q"),
                ],
                true,
            ),
            (
                "other message fields ignored",
                vec![
                    msg("system", "s"),
                    json!({"role": "user", "content": "q", "metadata": {"t": 1}}),
                ],
                true,
            ),
            (
                "null name ignored",
                vec![msg("system", "s"), json!({"role": "user", "content": "q", "name": null})],
                true,
            ),
            ("system differs", vec![msg("system", "t"), msg("user", "q")], false),
            ("first user differs", vec![msg("system", "s"), msg("user", "q2")], false),
            ("role differs", vec![msg("developer", "s"), msg("user", "q")], false),
            (
                "extra system message",
                vec![msg("system", "s"), msg("system", ""), msg("user", "q")],
                false,
            ),
            (
                "name differs",
                vec![msg("system", "s"), json!({"role": "user", "content": "q", "name": "bob"})],
                false,
            ),
            (
                "two parts vs one joined",
                vec![
                    msg("system", "s"),
                    json!({"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "text", "text": ""}]}),
                ],
                false,
            ),
            (
                "an image part",
                vec![
                    msg("system", "s"),
                    json!({"role": "user", "content": [{"type": "text", "text": "q"}, {"type": "image_url", "image_url": {"url": "http://127.0.0.1/a.png"}}]}),
                ],
                false,
            ),
            (
                "a later user message ignored",
                vec![msg("system", "s"), msg("user", "q"), msg("user", "")],
                true,
            ),
        ];
        for (what, messages, same) in cases {
            assert_eq!(chat_key(messages) == base, *same, "{what}");
        }
        let image = |url: &str| {
            chat_key(&[
                json!({"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}),
            ])
        };
        assert_ne!(image("http://127.0.0.1/a.png"), image("http://127.0.0.1/b.png"));
    }

    #[test]
    fn tool_calls_before_the_first_user_message_are_part_of_the_anchor() {
        let convo = |args: &str| {
            let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}]});
            let result = json!({"role": "tool", "tool_call_id": "c1", "content": "ok"});
            chat_key(&[msg("system", "s"), call, result, msg("user", "q")])
        };
        assert!(convo("{}").is_some());
        assert_eq!(convo("{}"), convo("{}"));
        assert_ne!(convo("{}"), convo("{\"a\":1}"));
        assert_ne!(convo("{}"), chat_key(&[msg("system", "s"), msg("user", "q")]));
    }

    #[test]
    fn key_order_and_whitespace_do_not_matter() {
        let a = br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u","detail":"low"}}]}]}"#;
        let b = br#"{ "messages" : [ { "content" : [ { "image_url" : { "detail" : "low" , "url" : "u" } , "type" : "image_url" } ] , "role" : "user" } ] }"#;
        let key = |body: &[u8]| derived_key(&parse(Endpoint::ChatCompletions, body).unwrap());
        assert!(key(a).is_some());
        assert_eq!(key(a), key(b));
    }

    #[test]
    fn no_derived_key_without_an_anchor() {
        assert_eq!(chat_key(&[msg("system", "s")]), None);
        assert_eq!(chat_key(&[msg("system", "s"), msg("assistant", "hello")]), None);
        for body in [
            r#"{"prompt":"a long shared preamble"}"#,
            r#"{"prompt":[1,2,3,4,5,6,7,8]}"#,
            r#"{"prompt":[[1,2,3]]}"#,
        ] {
            assert_eq!(
                derived_key(&parse(Endpoint::Completions, body.as_bytes()).unwrap()),
                None,
                "{body}"
            );
        }
    }

    #[test]
    fn anchor_digest_is_total_on_odd_messages() {
        let odd = [
            json!(1),
            json!(null),
            json!({"role": "user", "content": {"x": [1.5, true, null]}}),
            json!({"role": "user"}),
        ];
        assert!(anchor_digest(&odd).is_some());
        assert_eq!(anchor_digest(&[json!("user")]), None);
    }

    fn text() -> impl proptest::strategy::Strategy<Value = String> {
        "[a-z ]{0,40}"
    }

    proptest::proptest! {
        /// Whatever the anchor and the turns after it, every prefix of the conversation that holds
        /// the first user message has the anchor's key; a different first user message changes it.
        #[test]
        fn every_turn_has_the_anchor_key(
            system in proptest::collection::vec(text(), 0..4),
            first in text(),
            other in text(),
            turns in proptest::collection::vec((text(), text(), proptest::bool::ANY), 0..20),
        ) {
            let mut history: Vec<Value> = system.iter().map(|s| msg("system", s)).collect();
            history.push(msg("user", &first));
            let key = chat_key(&history);
            proptest::prop_assert!(key.is_some());
            let mut other_history = history.clone();
            *other_history.last_mut().unwrap() = msg("user", &format!("{other}!"));
            proptest::prop_assert_ne!(chat_key(&other_history), key);
            for (i, (reply, next, tools)) in turns.iter().enumerate() {
                if *tools {
                    history.extend(tool_turn(i));
                }
                history.push(msg("assistant", reply));
                history.push(msg("user", next));
                proptest::prop_assert_eq!(chat_key(&history), key);
            }
        }
    }

    fn any_json() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
            prop_oneof![
                Just("user".to_owned()),
                Just("text".to_owned()),
                Just("type".to_owned()),
                "\\PC{0,6}"
            ]
            .prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 48, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("role".to_owned()),
                        Just("content".to_owned()),
                        Just("type".to_owned()),
                        Just("text".to_owned()),
                        Just("tool_calls".to_owned()),
                        "[a-z_]{1,8}"
                    ],
                    inner,
                    0..5
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// The filter runs this on whatever a client sends (in wasm, where a panic aborts the VM):
        /// any JSON, as raw messages or as a whole chat body, gives a digest or none, never a panic,
        /// and the same input always gives the same answer.
        #[test]
        fn any_input_is_digested_without_panicking(messages in proptest::collection::vec(any_json(), 0..6)) {
            let once = anchor_digest(&messages);
            proptest::prop_assert_eq!(once, anchor_digest(&messages));
            let body = serde_json::to_vec(&json!({ "messages": messages })).unwrap();
            if let Ok(req) = parse(Endpoint::ChatCompletions, &body) {
                proptest::prop_assert_eq!(derived_key(&req).map(|k| k.0), once);
            }
        }
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
