//! The top-level request fields routing reads besides the input (`prompt` / `messages`), defined
//! once: their keys, their checks, in the order their errors are reported. Every reading of a body
//! — the `Value` reading ([`super::parse`]), the streaming pass ([`super::peek`]) and the filter's
//! byte scan ([`super::scan`], which checks each key's [`Kind`] on the bytes) — finds these keys
//! its own way and hands their values here, so adding a field (a LoRA adapter named by `model`, a new sampling knob that changes the route) is
//! one change, in this file.

use std::borrow::Cow;

use serde_json::Value;

use super::ParseError;

/// What a field must hold for the body to be routable (`null` always counts as absent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    /// A string.
    Text,
    /// A boolean.
    Flag,
    /// An integer `as_u64` reads.
    Count,
    /// Anything: a wrong type is not an error (a reader that only wants the verdict skips it).
    Any,
}

/// The keys [`scalars`] reads, with what each must hold ([`scalars`] checks exactly that; the
/// filter's scan checks it on the bytes, without building values).
pub(super) const KEYS: [(&str, Kind); 5] = [
    ("model", Kind::Text),
    ("stream", Kind::Flag),
    ("max_tokens", Kind::Count),
    ("max_completion_tokens", Kind::Count),
    ("cache_salt", Kind::Any),
];

/// The index of `key` (its unescaped bytes) in [`KEYS`], if routing reads it.
pub(super) fn index(key: &[u8]) -> Option<usize> {
    KEYS.iter().position(|(k, _)| k.as_bytes() == key)
}

/// What routing reads from those fields.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Scalars {
    pub(super) model: Option<String>,
    /// `stream` (false when absent or null).
    pub(super) stream: bool,
    /// `max_tokens`, else `max_completion_tokens` (a null `max_tokens` counts as given).
    pub(super) max_tokens: Option<u64>,
    /// vLLM's per-request prefix-cache salt; not a string: none.
    pub(super) cache_salt: Option<String>,
}

/// The fields from their values (`field(key)`: the last of a repeated key, as `Value` keeps),
/// checked in the order errors are reported.
pub(super) fn scalars<'v>(
    field: impl Fn(&str) -> Option<Cow<'v, Value>>,
) -> Result<Scalars, ParseError> {
    let model = match field("model").as_deref() {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ParseError::WrongType { field: "model", expected: "a string" }),
    };
    let stream = match field("stream").as_deref() {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ParseError::WrongType { field: "stream", expected: "a boolean" }),
    };
    let max_tokens = match field("max_tokens").or_else(|| field("max_completion_tokens")).as_deref()
    {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or(ParseError::WrongType {
            field: "max_tokens",
            expected: "a non-negative integer",
        })?),
    };
    let cache_salt = field("cache_salt").as_deref().and_then(Value::as_str).map(str::to_owned);
    Ok(Scalars { model, stream, max_tokens, cache_salt })
}

/// The values of [`KEYS`] one reading collected, by index.
#[derive(Debug, Default)]
pub(super) struct Collected(pub(super) [Option<Value>; KEYS.len()]);

impl Collected {
    /// [`scalars`] of what was collected.
    pub(super) fn scalars(&self) -> Result<Scalars, ParseError> {
        scalars(|k| index(k.as_bytes()).and_then(|i| self.0[i].as_ref()).map(Cow::Borrowed))
    }
}
