//! Setting one top-level key of a JSON object in its original text.
//!
//! The decode worker must receive the client's request exactly as sent, plus the decision's
//! `kv_transfer_params`. Re-serialising through `serde_json::Value` would reorder nothing but could
//! still change number spellings (`1e3`, `1.0`), escapes and whitespace, and costs a full
//! allocation-heavy round trip per request. Instead [`splice_top_level`] scans the object's top
//! level once (strings and nesting aware, no recursion, never panics), then either replaces the value
//! span of every occurrence of the key (duplicates included: JSON parsers disagree on which one wins)
//! or inserts `"key":value` right after the opening brace. Every other byte is copied unchanged.

use serde_json::Value;

/// Why a body could not be spliced. The caller forwards the body unchanged and counts it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpliceError {
    #[error("body is not a JSON object")]
    NotAnObject,
    #[error("malformed JSON at byte {at}: {what}")]
    Malformed { at: usize, what: &'static str },
    #[error("unexpected bytes after the object at byte {at}")]
    Trailing { at: usize },
    #[error("value could not be serialised")]
    Value,
}

/// One `"key": value` member of the top-level object, as byte ranges into the body.
struct Member {
    key: (usize, usize),
    value: (usize, usize),
}

/// Returns `body` with top-level `key` set to `value`.
pub fn splice_top_level(body: &[u8], key: &str, value: &Value) -> Result<Vec<u8>, SpliceError> {
    let value_text = serde_json::to_vec(value).map_err(|_| SpliceError::Value)?;
    let (open, members) = scan_object(body)?;
    let matching: Vec<&Member> = members.iter().filter(|m| key_equals(&body[m.key.0..m.key.1], key)).collect();

    let mut out = Vec::with_capacity(body.len() + key.len() + value_text.len() + 4);
    if matching.is_empty() {
        let key_text = serde_json::to_vec(key).map_err(|_| SpliceError::Value)?;
        out.extend_from_slice(&body[..=open]);
        out.extend_from_slice(&key_text);
        out.push(b':');
        out.extend_from_slice(&value_text);
        if !members.is_empty() {
            out.push(b',');
        }
        out.extend_from_slice(&body[open + 1..]);
    } else {
        let mut copied = 0;
        for m in matching {
            out.extend_from_slice(&body[copied..m.value.0]);
            out.extend_from_slice(&value_text);
            copied = m.value.1;
        }
        out.extend_from_slice(&body[copied..]);
    }
    Ok(out)
}

/// Finds the opening brace and every top-level member of the object `body` holds.
fn scan_object(body: &[u8]) -> Result<(usize, Vec<Member>), SpliceError> {
    let open = skip_ws(body, 0);
    if body.get(open) != Some(&b'{') {
        return Err(SpliceError::NotAnObject);
    }
    let mut members = Vec::new();
    let mut i = skip_ws(body, open + 1);
    if body.get(i) == Some(&b'}') {
        return finish(body, i, open, members);
    }
    loop {
        if body.get(i) != Some(&b'"') {
            return Err(SpliceError::Malformed { at: i, what: "expected a key" });
        }
        let key_end = skip_string(body, i)?;
        let key = (i, key_end);
        i = skip_ws(body, key_end);
        if body.get(i) != Some(&b':') {
            return Err(SpliceError::Malformed { at: i, what: "expected `:`" });
        }
        let value_start = skip_ws(body, i + 1);
        let value_end = skip_value(body, value_start)?;
        members.push(Member { key, value: (value_start, value_end) });
        i = skip_ws(body, value_end);
        match body.get(i) {
            Some(b',') => i = skip_ws(body, i + 1),
            Some(b'}') => return finish(body, i, open, members),
            _ => return Err(SpliceError::Malformed { at: i, what: "expected `,` or `}`" }),
        }
    }
}

fn finish(body: &[u8], close: usize, open: usize, members: Vec<Member>) -> Result<(usize, Vec<Member>), SpliceError> {
    let end = skip_ws(body, close + 1);
    if end != body.len() {
        return Err(SpliceError::Trailing { at: end });
    }
    Ok((open, members))
}

fn skip_ws(body: &[u8], mut i: usize) -> usize {
    while matches!(body.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

/// `body[i]` is `"`; returns the index just past the closing quote.
fn skip_string(body: &[u8], i: usize) -> Result<usize, SpliceError> {
    let mut j = i + 1;
    loop {
        match body.get(j) {
            None => return Err(SpliceError::Malformed { at: i, what: "unterminated string" }),
            Some(b'\\') => j += 2,
            Some(b'"') => return Ok(j + 1),
            Some(_) => j += 1,
        }
    }
}

/// Returns the index just past the value starting at `i`. Containers are matched by depth only:
/// the body was already parsed as JSON, this only needs to find where the value ends.
fn skip_value(body: &[u8], i: usize) -> Result<usize, SpliceError> {
    match body.get(i) {
        None => Err(SpliceError::Malformed { at: i, what: "expected a value" }),
        Some(b'"') => skip_string(body, i),
        Some(b'{' | b'[') => {
            let mut depth = 0usize;
            let mut j = i;
            loop {
                match body.get(j) {
                    None => return Err(SpliceError::Malformed { at: i, what: "unterminated container" }),
                    Some(b'"') => {
                        j = skip_string(body, j)?;
                        continue;
                    }
                    Some(b'{' | b'[') => depth += 1,
                    Some(b'}' | b']') => {
                        depth = depth.saturating_sub(1);
                        if depth == 0 {
                            return Ok(j + 1);
                        }
                    }
                    Some(_) => {}
                }
                j += 1;
            }
        }
        Some(b',' | b'}' | b']' | b':') => Err(SpliceError::Malformed { at: i, what: "expected a value" }),
        Some(_) => {
            let mut j = i;
            while let Some(&b) = body.get(j) {
                if matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                    break;
                }
                j += 1;
            }
            Ok(j)
        }
    }
}

/// Whether the raw key text (quotes included) decodes to `key`; escapes are decoded only when present.
fn key_equals(raw: &[u8], key: &str) -> bool {
    let inner = raw.get(1..raw.len().saturating_sub(1)).unwrap_or_default();
    if !inner.contains(&b'\\') {
        return inner == key.as_bytes();
    }
    serde_json::from_slice::<String>(raw).is_ok_and(|decoded| decoded == key)
}

#[cfg(test)]
#[path = "tests/splice.rs"]
mod tests;
