//! The one JSON editor: set or remove top-level members of a JSON object in its original text.
//!
//! Every in-place body edit in kvmesh goes through here: the filter splicing the decision's
//! `kv_transfer_params` into the body it forwards, the indexer cutting the client's body to a
//! one-step leg. A request body must reach the engine as the client sent it plus the edit:
//! re-serialising through `serde_json::Value` would change number spellings (`1e3`, `1.0`, integers
//! past 2^64), escapes, key order and whitespace, and costs an allocation-heavy round trip over the
//! whole prompt. So [`TopLevel::scan`] lets `serde_json` read the object once, borrowing each member's
//! value as a [`RawValue`] (the body is validated as JSON exactly as serde validates it; nothing is
//! built), and keeps only byte spans. [`TopLevel::apply`] then copies every untouched byte unchanged
//! and writes the edits:
//!
//! - [`Edit::Set`]: the value of **every** occurrence of the key is replaced (duplicates included:
//!   JSON parsers disagree on which one wins); when the key is absent, `"key":value` is inserted
//!   right after the opening brace.
//! - [`Edit::Replace`]: like `Set`, but nothing is inserted when the key is absent.
//! - [`Edit::Remove`]: every occurrence is removed with one of its separating commas.
//!
//! Keys are compared decoded (`"kv\u005ftransfer_params"` is `kv_transfer_params`); a replaced
//! member keeps its key's original spelling. Nested keys of the same name are not top-level and
//! are never touched. With no effective edit the output is the input, byte for byte.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use serde::de::{Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// Why a body could not be edited. Callers forward or use the body unchanged and count it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EditError {
    /// The body is not valid JSON (serde's verdict, with its line and column).
    NotJson { line: usize, column: usize },
    /// Valid JSON, but not an object.
    NotAnObject,
    /// A new value is not one valid JSON value.
    BadValue,
}

impl fmt::Display for EditError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotJson { line, column } => {
                write!(f, "body is not valid JSON (line {line}, column {column})")
            }
            Self::NotAnObject => write!(f, "body is not a JSON object"),
            Self::BadValue => write!(f, "new value is not one JSON value"),
        }
    }
}

impl std::error::Error for EditError {}

/// One edit of a top-level member; `value` is JSON text (see [`Edit::set_value`] for a `Value`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Edit<'k> {
    /// Replace every occurrence's value, or insert the member when absent.
    Set { key: &'k str, value: Cow<'k, str> },
    /// Replace every occurrence's value; do nothing when absent.
    Replace { key: &'k str, value: Cow<'k, str> },
    /// Remove every occurrence.
    Remove { key: &'k str },
}

impl<'k> Edit<'k> {
    /// [`Edit::Set`] of a serialisable value.
    pub fn set_value(key: &'k str, value: &serde_json::Value) -> Self {
        Self::Set { key, value: Cow::Owned(value.to_string()) }
    }

    fn key(&self) -> &'k str {
        match self {
            Self::Set { key, .. } | Self::Replace { key, .. } | Self::Remove { key } => key,
        }
    }
}

/// One top-level member, as spans into the body.
#[derive(Debug, Clone)]
struct Member<'a> {
    /// The decoded key (borrowed unless it has escapes).
    key: Cow<'a, str>,
    /// From just after the preceding `{` or `,` to just before the following `,` or `}`.
    segment: Range<usize>,
    /// The value, within the segment.
    value: Range<usize>,
}

/// A JSON object's top level, read once: its members' keys and byte spans.
#[derive(Debug, Clone)]
pub struct TopLevel<'a> {
    body: &'a [u8],
    /// Index of the opening brace.
    open: usize,
    /// Index of the closing brace.
    close: usize,
    members: Vec<Member<'a>>,
}

impl<'a> TopLevel<'a> {
    /// Reads `body` (validated as serde validates it) as an object's top level.
    pub fn scan(body: &'a [u8]) -> Result<Self, EditError> {
        let raw: Vec<(Key<'a>, &'a RawValue)> = match serde_json::from_slice::<Entries<'a>>(body) {
            Ok(Entries::Object(entries)) => entries,
            Ok(Entries::Other) => return Err(EditError::NotAnObject),
            Err(e) => return Err(EditError::NotJson { line: e.line(), column: e.column() }),
        };
        let open = skip_ws(body, 0);
        let base = body.as_ptr() as usize;
        let mut members = Vec::with_capacity(raw.len());
        let mut after_delim = open + 1;
        for (key, value) in raw {
            // The raw value borrows from `body`: its offset is exact.
            let start = (value.get().as_ptr() as usize).saturating_sub(base);
            let end = start + value.get().len();
            let delim = skip_ws(body, end);
            members.push(Member { key: key.0, segment: after_delim..delim, value: start..end });
            after_delim = delim + 1;
        }
        let close = match members.last() {
            Some(m) => m.segment.end,
            None => skip_ws(body, open + 1),
        };
        Ok(Self { body, open, close, members })
    }

    /// The raw JSON of the last occurrence of top-level `key` (the one `Value` keeps).
    pub fn get(&self, key: &str) -> Option<&'a str> {
        let body = self.body;
        self.members
            .iter()
            .rev()
            .find(|m| m.key == key)
            .and_then(|m| std::str::from_utf8(&body[m.value.clone()]).ok())
    }

    /// Whether top-level `key` occurs.
    pub fn contains(&self, key: &str) -> bool {
        self.members.iter().any(|m| m.key == key)
    }

    /// Number of top-level members, duplicates included.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the object has no member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The body with `edits` applied. When several edits name one key, the last one counts.
    pub fn apply(&self, edits: &[Edit<'_>]) -> Result<Vec<u8>, EditError> {
        for e in edits {
            if let Edit::Set { value, .. } | Edit::Replace { value, .. } = e {
                if serde_json::from_str::<&RawValue>(value).is_err() {
                    return Err(EditError::BadValue);
                }
            }
        }
        let rule = |key: &str| edits.iter().rev().find(|e| e.key() == key);
        let body = self.body;
        let extra: usize =
            edits.iter().map(|e| e.key().len() + 4 + edit_value(e).map_or(0, str::len)).sum();
        let mut out = Vec::with_capacity(body.len() + extra);
        out.extend_from_slice(&body[..=self.open]);
        let mut parts = 0usize;
        // Inserts first, in edit order, once per key.
        for (i, e) in edits.iter().enumerate() {
            let Edit::Set { key, value } = e else { continue };
            let last = rule(key).is_some_and(|r| std::ptr::eq(r, &edits[i]));
            if !last || self.contains(key) {
                continue;
            }
            if parts > 0 {
                out.push(b',');
            }
            push_key(&mut out, key);
            out.push(b':');
            out.extend_from_slice(value.as_bytes());
            parts += 1;
        }
        if self.members.is_empty() {
            out.extend_from_slice(&body[self.open + 1..]);
            return Ok(out);
        }
        for m in &self.members {
            let new_value = match rule(&m.key) {
                Some(Edit::Remove { .. }) => continue,
                Some(Edit::Set { value, .. } | Edit::Replace { value, .. }) => {
                    Some(value.as_bytes())
                }
                None => None,
            };
            if parts > 0 {
                out.push(b',');
            }
            match new_value {
                Some(v) => {
                    out.extend_from_slice(&body[m.segment.start..m.value.start]);
                    out.extend_from_slice(v);
                    out.extend_from_slice(&body[m.value.end..m.segment.end]);
                }
                None => out.extend_from_slice(&body[m.segment.clone()]),
            }
            parts += 1;
        }
        out.extend_from_slice(&body[self.close..]);
        Ok(out)
    }
}

/// [`TopLevel::scan`] then [`TopLevel::apply`].
pub fn edit(body: &[u8], edits: &[Edit<'_>]) -> Result<Vec<u8>, EditError> {
    TopLevel::scan(body)?.apply(edits)
}

fn edit_value<'e>(e: &'e Edit<'_>) -> Option<&'e str> {
    match e {
        Edit::Set { value, .. } | Edit::Replace { value, .. } => Some(value),
        Edit::Remove { .. } => None,
    }
}

/// `key` as a JSON string.
fn push_key(out: &mut Vec<u8>, key: &str) {
    // Serialising a `str` cannot fail.
    out.extend_from_slice(serde_json::Value::from(key).to_string().as_bytes());
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

// === serde plumbing: an object's entries in order, values borrowed raw ===

/// A key, borrowed from the body unless it has escapes (also read by `openai::peek`).
pub(crate) struct Key<'a>(pub(crate) Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
        }
        d.deserialize_str(V)
    }
}

/// Either the entries of an object, in order with duplicates, or "some other JSON value".
enum Entries<'a> {
    Object(Vec<(Key<'a>, &'a RawValue)>),
    Other,
}

impl<'de> Deserialize<'de> for Entries<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Entries<'de>, A::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(8).min(64));
                while let Some(entry) = map.next_entry::<Key<'de>, &'de RawValue>()? {
                    entries.push(entry);
                }
                Ok(Entries::Object(entries))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Entries<'de>, A::Error> {
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Entries::Other)
            }
            fn visit_bool<E>(self, _: bool) -> Result<Entries<'de>, E> {
                Ok(Entries::Other)
            }
            fn visit_i64<E>(self, _: i64) -> Result<Entries<'de>, E> {
                Ok(Entries::Other)
            }
            fn visit_u64<E>(self, _: u64) -> Result<Entries<'de>, E> {
                Ok(Entries::Other)
            }
            fn visit_f64<E>(self, _: f64) -> Result<Entries<'de>, E> {
                Ok(Entries::Other)
            }
            fn visit_str<E>(self, _: &str) -> Result<Entries<'de>, E> {
                Ok(Entries::Other)
            }
            fn visit_unit<E>(self) -> Result<Entries<'de>, E> {
                Ok(Entries::Other)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
#[path = "json_edit_tests.rs"]
mod tests;
