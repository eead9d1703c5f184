//! The conversation anchor's digest: the messages of a chat request up to and including its first
//! user message, canonically rendered and hashed — the derived session key ([`crate::session`]).
//! Computed where the raw messages are read (here in `openai`), so every reader of a body — the
//! filter's, the indexer's — gets the same value from the same code.
//!
//! The canonical rendering is a type-tagged, length-prefixed encoding of each anchor message's
//! `role`, `name`, `content`, `tool_calls`, `tool_call_id` and `function_call`, in that order
//! (other message fields are metadata some clients change between turns). Content is a list of
//! parts: a string content is one text part; a part is its `type` and that type's payload
//! (`text`, `image_url`, `input_audio`, …), so a `cache_control` marker a client moves from turn to
//! turn does not change the key. Objects render with sorted keys, so key order and whitespace do
//! not matter. No tokenizer or chat template is involved: the filter has neither, and the key only
//! has to be stable and distinct, not equal to the engine's tokens.

use std::hash::Hasher;

use serde_json::Value;
use twox_hash::XxHash3_64;

/// Seed of the anchor digest. Changed from the old cut-at-N key's seed so keys of the two schemes
/// never coincide.
const ANCHOR_SEED: u64 = 0x6b76_6d65_7368_0021;

/// The message fields that identify a conversation, in rendering order.
const MESSAGE_FIELDS: [&str; 6] =
    ["role", "name", "content", "tool_calls", "tool_call_id", "function_call"];

/// A content part's fields that never identify it (prompt-caching hints clients move every turn).
const IGNORED_PART_FIELDS: [&str; 1] = ["cache_control"];

/// The digest of a chat conversation's anchor: `messages` (the request's raw JSON messages, in
/// order) up to and including the first whose `role` is `"user"`, canonically rendered. None when
/// no message is a user message. Total on any JSON: a non-object message renders as its value.
pub fn anchor_digest(messages: &[Value]) -> Option<u64> {
    let first_user =
        messages.iter().position(|m| m.get("role").and_then(Value::as_str) == Some("user"))?;
    let mut canon = Canonical(XxHash3_64::with_seed(ANCHOR_SEED));
    for m in &messages[..=first_user] {
        canon.message(m);
    }
    Some(canon.0.finish())
}

/// Writes the canonical rendering into a hasher. Every value is type-tagged and every string and
/// list length-prefixed, so no two different renderings share bytes (no escaping needed).
struct Canonical<H: Hasher>(H);

impl<H: Hasher> Canonical<H> {
    fn tag(&mut self, tag: u8) {
        self.0.write(&[tag]);
    }

    fn len(&mut self, n: usize) {
        self.0.write(&(n as u64).to_le_bytes());
    }

    fn str(&mut self, s: &str) {
        self.tag(b's');
        self.len(s.len());
        self.0.write(s.as_bytes());
    }

    fn value(&mut self, v: &Value) {
        match v {
            Value::Null => self.tag(b'n'),
            Value::Bool(b) => self.tag(if *b { b't' } else { b'f' }),
            Value::Number(n) => {
                self.tag(b'd');
                let text = n.to_string();
                self.len(text.len());
                self.0.write(text.as_bytes());
            }
            Value::String(s) => self.str(s),
            Value::Array(items) => {
                self.tag(b'a');
                self.len(items.len());
                items.iter().for_each(|i| self.value(i));
            }
            Value::Object(obj) => self.object(obj.iter().map(|(k, v)| (k.as_str(), v))),
        }
    }

    /// An object from its fields, rendered in sorted key order whatever the map's order.
    fn object<'v>(&mut self, fields: impl Iterator<Item = (&'v str, &'v Value)>) {
        let mut fields: Vec<(&str, &Value)> = fields.collect();
        fields.sort_unstable_by(|a, b| a.0.cmp(b.0));
        self.tag(b'o');
        self.len(fields.len());
        for (k, v) in fields {
            self.str(k);
            self.value(v);
        }
    }

    fn message(&mut self, m: &Value) {
        let Some(obj) = m.as_object() else {
            self.value(m);
            return;
        };
        self.tag(b'M');
        for field in MESSAGE_FIELDS {
            match obj.get(field) {
                None | Some(Value::Null) => {}
                Some(v) => {
                    self.str(field);
                    if field == "content" {
                        self.content(v);
                    } else {
                        self.value(v);
                    }
                }
            }
        }
        self.tag(b'E');
    }

    /// Content as a list of parts: a string is one text part.
    fn content(&mut self, v: &Value) {
        match v {
            Value::String(s) => {
                self.tag(b'a');
                self.len(1);
                self.part_type("text");
                self.str(s);
            }
            Value::Array(parts) => {
                self.tag(b'a');
                self.len(parts.len());
                for p in parts {
                    match p {
                        Value::String(s) => {
                            self.part_type("text");
                            self.str(s);
                        }
                        Value::Object(obj) => {
                            // vLLM reads a part without `type` as text.
                            let kind = obj.get("type").and_then(Value::as_str).unwrap_or("text");
                            match obj.get(kind) {
                                Some(payload) => {
                                    self.part_type(kind);
                                    self.value(payload);
                                }
                                // An unknown part shape: all of it except the ignored fields.
                                None => self.object(
                                    obj.iter()
                                        .filter(|(k, _)| !IGNORED_PART_FIELDS.contains(&k.as_str()))
                                        .map(|(k, v)| (k.as_str(), v)),
                                ),
                            }
                        }
                        other => self.value(other),
                    }
                }
            }
            other => self.value(other),
        }
    }

    /// A part's head; its payload (the value under the type's name) follows.
    fn part_type(&mut self, kind: &str) {
        self.tag(b'P');
        self.str(kind);
    }
}
