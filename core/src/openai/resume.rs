//! Reading a chat body from where an earlier body's messages end: the next turn of a
//! conversation repeats every earlier message byte for byte, so its read can start there.
//!
//! A body `B` whose first `end` bytes equal an earlier body's, where `end` is the end of that
//! body's last message ([`ChatPrefix`]), is the earlier body's first messages followed by `B`'s
//! own rest. The read continues from what the earlier read left at `end` (its messages, kept) over
//! a short body made of the earlier body's fields before its `messages` list (`open`) and `B`'s
//! bytes after `end`, with the comma that joined them dropped. serde reads JSON front to back, so
//! after the same bytes it is in the same state: the continued read equals a read of `B` whole.
//! Any doubt — `B` does not start with those bytes, what follows `end` is not `,` then an element
//! or `]`, the short body does not read `Ok` — reads `B` whole, so every error is the whole
//! read's. A property test holds the two equal.

use serde_json::Value;

use super::fast;
use super::grammar::skip_ws;
use super::peek::{self, Anchor};
use super::{ChatMessage, Endpoint, OpenAiRequest, ParseError};

/// What a chat body's read leaves for a later body that continues its messages: where its
/// `messages` list opens and its last message ends, and the messages read up to there. Held with
/// the body's first [`Self::len`] bytes (the caller keeps them: [`read_chat_from`] compares them).
#[derive(Debug, Clone)]
pub struct ChatPrefix {
    open: usize,
    end: usize,
    anchor: Anchor,
}

impl ChatPrefix {
    /// Bytes of the body this prefix covers (its last message's end).
    pub fn len(&self) -> usize {
        self.end
    }

    /// Whether it covers nothing (never: a prefix covers at least one message).
    pub fn is_empty(&self) -> bool {
        self.end == 0
    }

    /// Heap bytes its messages hold (strings and their bookkeeping), for a memory bound.
    pub fn heap_bytes(&self) -> usize {
        fn value_bytes(v: &Value) -> usize {
            std::mem::size_of::<Value>()
                + match v {
                    Value::String(s) => s.len(),
                    Value::Array(a) => a.iter().map(value_bytes).sum(),
                    Value::Object(o) => o.iter().map(|(k, v)| k.len() + value_bytes(v) + 32).sum(),
                    _ => 0,
                }
        }
        let later: usize = self
            .anchor
            .later
            .iter()
            .map(|m| m.role.len() + m.content.len() + std::mem::size_of::<ChatMessage>())
            .sum();
        let media: usize = self
            .anchor
            .later_media
            .iter()
            .map(|m| std::mem::size_of_val(m) + m.uuid.as_ref().map_or(0, |u| u.len()))
            .sum();
        later + media + self.anchor.values.iter().map(value_bytes).sum::<usize>()
    }
}

/// One chat body read: the request (as [`super::parse`] gives it), whether it continued an earlier
/// body's prefix, and this body's prefix for later bodies (`None` when the read failed or the body
/// has no single plain `messages` list).
#[derive(Debug)]
pub struct ChatRead {
    pub request: Result<OpenAiRequest, ParseError>,
    pub resumed: bool,
    pub prefix: Option<ChatPrefix>,
}

/// Reads chat `body`, continuing from `earlier` (an earlier body's bytes, at least its prefix's
/// length, and that prefix) when `body` starts with the same bytes; the request equals
/// `parse(ChatCompletions, body)` either way. A caller that knows `body` starts with the prefix's
/// bytes (it joined them) passes `body` itself as the bytes: the same slice is not compared.
pub fn read_chat_from(body: &[u8], earlier: Option<(&[u8], &ChatPrefix)>) -> ChatRead {
    if let Some(read) = earlier.and_then(|(bytes, prefix)| continued(body, bytes, prefix)) {
        return read;
    }
    let whole = fast::messages_span(body).and_then(|span| {
        let (request, anchor) = peek::read_chat_keeping(body, Anchor::default())?;
        let prefix =
            anchor.map(|anchor| ChatPrefix { open: span.open, end: span.last_end, anchor });
        Some(ChatRead { request, resumed: false, prefix })
    });
    whole.unwrap_or_else(|| ChatRead {
        request: super::parse(Endpoint::ChatCompletions, body),
        resumed: false,
        prefix: None,
    })
}

/// `body` read from `prefix` (of `earlier`), if it continues it and reads `Ok` that way.
fn continued(body: &[u8], earlier: &[u8], prefix: &ChatPrefix) -> Option<ChatRead> {
    let (open, end) = (prefix.open, prefix.end);
    let (now, then) = (body.get(..end)?, earlier.get(..end)?);
    if prefix.anchor.values.is_empty() || open >= end || !(std::ptr::eq(now, then) || now == then) {
        return None;
    }
    // After the prefix's last message: `,` and another element, or the list's `]`.
    let next = skip_ws(body, end);
    let rest = match body.get(next)? {
        b',' if body.get(skip_ws(body, next + 1)).is_some_and(|&c| c != b']') => next + 1,
        b']' => next,
        _ => return None,
    };
    let mut short = Vec::with_capacity(open + 1 + body.len() - rest);
    short.extend_from_slice(&body[..=open]);
    short.extend_from_slice(&body[rest..]);
    let span = fast::messages_span(&short).filter(|s| s.open == open)?;
    let (request, anchor) = peek::read_chat_keeping(&short, prefix.anchor.clone())?;
    request.as_ref().ok()?;
    // The short body's bytes after its `[` are the body's from `rest` on.
    let last_end = if span.last_end == open + 1 { end } else { span.last_end - (open + 1) + rest };
    let prefix = anchor.map(|anchor| ChatPrefix { open, end: last_end, anchor });
    Some(ChatRead { request, resumed: true, prefix })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::parse;
    use proptest::prelude::*;
    use serde_json::json;

    /// A chat body written by hand, so fields sit on both sides of `messages` and the separators
    /// vary: `{<before>"messages":[<m0><sep><m1>…]<after>}`.
    fn body(before: &[String], messages: &[String], sep: &str, after: &[String]) -> Vec<u8> {
        let mut b = String::from("{");
        for f in before {
            b.push_str(f);
            b.push(',');
        }
        b.push_str("\"messages\":[");
        b.push_str(&messages.join(sep));
        b.push(']');
        for f in after {
            b.push(',');
            b.push_str(f);
        }
        b.push('}');
        b.into_bytes()
    }

    fn whole(body: &[u8]) -> Result<OpenAiRequest, ParseError> {
        parse(Endpoint::ChatCompletions, body)
    }

    fn message() -> impl Strategy<Value = String> {
        let role = prop_oneof![4 => prop_oneof![Just("user"), Just("system"), Just("assistant")].prop_map(Value::from), 1 => Just(json!(7))];
        let content = prop_oneof![
            4 => "[a-c\"\\\\\né ]{0,12}".prop_map(Value::from),
            1 => Just(json!([{"type": "text", "text": "p"}, "q", {"type": "image_url", "image_url": {}}])),
            1 => Just(Value::Null),
            1 => Just(json!({"x": 1})),
        ];
        prop_oneof![
            12 => (role, content, any::<bool>()).prop_map(|(r, c, name)| {
                if name { json!({"role": r, "name": "n", "content": c}).to_string() } else { json!({"role": r, "content": c}).to_string() }
            }),
            1 => Just("7".to_owned()),
            1 => Just("{\"role\":\"user\",\"content\":\"x\",\"role\":\"tool\"}".to_owned()),
        ]
    }

    fn field() -> impl Strategy<Value = String> {
        prop_oneof![
            Just("\"model\":\"m\"".to_owned()),
            Just("\"model\":5".to_owned()),
            Just("\"stream\":true".to_owned()),
            Just("\"stream\":\"no\"".to_owned()),
            Just("\"max_tokens\":3".to_owned()),
            Just("\"cache_salt\":\"s\"".to_owned()),
            Just("\"tools\":[{\"a\":[1,{\"b\":null}]}]".to_owned()),
            Just("\"messages\":[{\"role\":\"user\",\"content\":\"again\"}]".to_owned()),
        ]
    }

    #[test]
    fn a_next_turn_is_read_from_where_the_last_ended() {
        let m = |r: &str, c: &str| json!({"role": r, "content": c}).to_string();
        let (before, after) =
            (vec!["\"model\":\"m\"".to_owned()], vec!["\"stream\":true".to_owned()]);
        let turn1 = vec![m("system", "be brief"), m("user", "hi")];
        let turn2 = [turn1.clone(), vec![m("assistant", "hello"), m("user", "more")]].concat();
        let (b1, b2) = (body(&before, &turn1, ",", &after), body(&before, &turn2, ",", &after));
        let first = read_chat_from(&b1, None);
        assert!(!first.resumed);
        let prefix = first.prefix.expect("a plain chat body leaves a prefix");
        assert!(
            b1[..prefix.len()].ends_with(turn1[1].as_bytes()) && b1[prefix.len()] == b']',
            "ends at the last message"
        );
        let second = read_chat_from(&b2, Some((&b1, &prefix)));
        assert!(second.resumed);
        assert_eq!(second.request, whole(&b2));
        let next = second.prefix.expect("the continued read leaves its own prefix");
        assert_eq!(next.len(), read_chat_from(&b2, None).prefix.map(|p| p.len()).unwrap_or(0));
        // The same messages again (a retry) continue with nothing new.
        assert!(read_chat_from(&b1, Some((&b1, &prefix))).resumed);
        // What does not continue the prefix is read whole, with the whole read's verdict.
        let trailing_comma = [&b1[..prefix.len()], b", ]}"].concat();
        let diverged = body(&before, &[m("system", "be brief"), m("user", "hI")], ",", &after);
        for other in [trailing_comma, diverged, b1[..prefix.len() - 1].to_vec(), b"{}".to_vec()] {
            let read = read_chat_from(&other, Some((&b1, &prefix)));
            assert!(!read.resumed, "{}", String::from_utf8_lossy(&other));
            assert_eq!(read.request, whole(&other), "{}", String::from_utf8_lossy(&other));
        }
    }

    proptest! {
        #[test]
        fn a_read_continued_from_an_earlier_body_equals_the_whole_read(
            before in proptest::collection::vec(field(), 0..3),
            after in proptest::collection::vec(field(), 0..3),
            messages in proptest::collection::vec(message(), 1..7),
            cut in 0usize..7,
            seps in proptest::collection::vec(prop_oneof![Just(","), Just(" ,\n "), Just(",\t")], 3),
            tail in prop_oneof![4 => Just(Vec::new()), 1 => proptest::collection::vec(any::<u8>(), 0..4)],
        ) {
            let cut = cut.min(messages.len());
            let earlier = body(&before, &messages[..cut.max(1)], seps[0], &after);
            let mut later = body(&before, &messages, seps[0], &after);
            later.extend_from_slice(&tail);
            let first = read_chat_from(&earlier, None);
            prop_assert_eq!(&first.request, &whole(&earlier));
            if let Some(prefix) = &first.prefix {
                let read = read_chat_from(&later, Some((&earlier, prefix)));
                prop_assert_eq!(&read.request, &whole(&later));
                // `later` starts with the prefix's bytes: passed itself, it is not compared.
                prop_assert_eq!(&read_chat_from(&later, Some((&later, prefix))).request, &read.request);
                if read.request.is_ok() && read_chat_from(&later, None).prefix.is_some() {
                    prop_assert!(read.resumed, "an Ok continuation is read from the prefix");
                }
                // Chained: a third body read from the second's prefix.
                if let Some(next) = &read.prefix {
                    let mut third_messages = messages.clone();
                    third_messages.push(json!({"role": "user", "content": "3"}).to_string());
                    let third = body(&before, &third_messages, seps[0], &after);
                    prop_assert_eq!(read_chat_from(&third, Some((&later, next))).request, whole(&third));
                }
            }
            // A different separator after the prefix's last message changes nothing either.
            let respaced = body(&before, &messages, seps[1], &after);
            if let Some(prefix) = &first.prefix {
                prop_assert_eq!(read_chat_from(&respaced, Some((&earlier, prefix))).request, whole(&respaced));
            }
        }
    }
}
