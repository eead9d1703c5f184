//! The fast path for the large part of most request bodies: a prompt that is a flat list of
//! token ids.
//!
//! Any serde pass over an 8k-token body — building `Value`s, or even skipping it as raw JSON —
//! costs hundreds of microseconds, and the engine simulator must read thousands of such bodies
//! per second on one core. So [`prompt_span`] finds the top-level `"prompt"` value with a plain
//! byte scan and reads it, as it goes, with a strict grammar (`[`, integers without sign,
//! fraction or exponent, commas, `]`, JSON whitespace). The caller then lets serde read the rest
//! of the body with the prompt replaced by a placeholder, and keeps the fast result only if serde
//! finds the placeholder exactly where the scan put it, as the value of the last `"prompt"` key.
//! That check makes the fast path give the same answer as the `Value` path on every input: if
//! anything is unusual (escaped keys, invalid JSON, a float, an empty list, an id of 2^32…),
//! the fast path declines and the `Value` path decides. Values and strings are stepped over with
//! the shared grammar's lenient functions ([`super::grammar`]).

use super::grammar::{skip_string, skip_value, skip_ws};

/// serde_json refuses documents nested this deep (its recursion limit), but skipping a field as
/// a raw value does not check it, so both paths check it here.
pub(super) const MAX_DEPTH: usize = 128;

/// True when `b` nests arrays/objects less than [`MAX_DEPTH`] deep (strings are skipped; the
/// JSON itself is not validated).
pub(super) fn depth_ok(b: &[u8]) -> bool {
    let mut depth = 0usize;
    let mut j = 0;
    while let Some(&c) = b.get(j) {
        match c {
            b'"' => match skip_string(b, j) {
                Some(end) => {
                    j = end;
                    continue;
                }
                None => return true, // unterminated: serde reports it
            },
            b'[' | b'{' => {
                depth += 1;
                if depth >= MAX_DEPTH {
                    return false;
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
        j += 1;
    }
    true
}

/// The value of the last top-level `"prompt"` key, as [`prompt_span`] found it.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct PromptSpan {
    /// First byte of the value.
    pub(super) start: usize,
    /// One past its last byte.
    pub(super) end: usize,
    /// Its ids, when it is a flat list of token ids (see [`flat_ids`]).
    pub(super) ids: Option<Vec<u32>>,
}

/// The value of the last top-level `"prompt"` key of `body`, if `body` is an object whose keys
/// contain no escapes, that nests less than [`MAX_DEPTH`] deep, and the scan understood it. The
/// prompt is read as ids while it is scanned, so its bytes are visited once. A hint, checked by
/// the caller.
pub(super) fn prompt_span(b: &[u8]) -> Option<PromptSpan> {
    let mut found = None;
    top_level_values(b, |key, start| {
        if key != b"prompt" {
            return skip_value(b, start, MAX_DEPTH - 1);
        }
        let (ids, end) = match ids_at(b, start) {
            Some((ids, end)) => (Some(ids), end),
            None => (None, skip_value(b, start, MAX_DEPTH - 1)?),
        };
        found = Some(PromptSpan { start, end, ids });
        Some(end)
    })?;
    found
}

/// Where a chat body's `messages` list sits: what a later body that extends the list shares with
/// this one (`resume`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MessagesSpan {
    /// The list's `[`.
    pub(super) open: usize,
    /// One past the last byte of its last element (`open + 1` for an empty list).
    pub(super) last_end: usize,
}

/// The span of the one top-level `"messages"` list of `body`, if `body` is an object whose keys
/// contain no escapes, with exactly one `messages` key whose value is a list, that nests less than
/// [`MAX_DEPTH`] deep (so [`depth_ok`] holds), and the scan understood it. Not validated: the
/// caller's serde pass checks the JSON.
pub(super) fn messages_span(b: &[u8]) -> Option<MessagesSpan> {
    let mut found = None;
    let mut repeated = false;
    top_level_values(b, |key, start| {
        if key != b"messages" {
            return skip_value(b, start, MAX_DEPTH - 1);
        }
        repeated |= found.is_some();
        if b.get(start) != Some(&b'[') {
            return None;
        }
        let mut i = skip_ws(b, start + 1);
        let mut last_end = start + 1;
        if b.get(i) != Some(&b']') {
            loop {
                // Elements sit two deep: inside the body and the list.
                last_end = skip_value(b, i, MAX_DEPTH - 2)?;
                i = skip_ws(b, last_end);
                match b.get(i)? {
                    b',' => i = skip_ws(b, i + 1),
                    b']' => break,
                    _ => return None,
                }
            }
        }
        found = Some(MessagesSpan { open: start, last_end });
        Some(i + 1)
    })?;
    found.filter(|_| !repeated)
}

/// Walks the top-level object `b`: `value(key, start)` gets each key (unescaped) and where its
/// value starts, and returns where the value ends. `None` if `b` is not an object this scan
/// understands (escaped keys, unbalanced, trailing bytes) or `value` declines.
fn top_level_values(b: &[u8], mut value: impl FnMut(&[u8], usize) -> Option<usize>) -> Option<()> {
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(b, i + 1);
    if b.get(i) == Some(&b'}') {
        return None;
    }
    loop {
        if b.get(i) != Some(&b'"') {
            return None;
        }
        let key_start = i + 1;
        let mut j = key_start;
        loop {
            match b.get(j)? {
                b'"' => break,
                b'\\' => return None, // escaped keys: leave them to serde
                _ => j += 1,
            }
        }
        let key = &b[key_start..j];
        i = skip_ws(b, j + 1);
        if b.get(i) != Some(&b':') {
            return None;
        }
        let end = value(key, skip_ws(b, i + 1))?;
        i = skip_ws(b, end);
        match b.get(i)? {
            b',' => i = skip_ws(b, i + 1),
            b'}' => break,
            _ => return None,
        }
    }
    (skip_ws(b, i + 1) == b.len()).then_some(())
}

/// The ids of `b` if it is exactly a non-empty flat list of integers in `0..2^32` (then valid
/// JSON by construction), surrounded by JSON whitespace at most.
#[cfg(test)]
pub(super) fn flat_ids(b: &[u8]) -> Option<Vec<u32>> {
    let (ids, end) = ids_at(b, skip_ws(b, 0))?;
    (skip_ws(b, end) == b.len()).then_some(ids)
}

/// A non-empty flat list of integers in `0..2^32` starting at `i`: its ids and its end.
fn ids_at(b: &[u8], mut i: usize) -> Option<(Vec<u32>, usize)> {
    if b.get(i) != Some(&b'[') {
        return None;
    }
    i = skip_ws(b, i + 1);
    // A JSON integer with its comma averages a few bytes: reserve once.
    let mut ids = Vec::with_capacity((b.len() - i) / 4);
    loop {
        let start = i;
        let mut v: u64 = 0;
        while let Some(&c) = b.get(i) {
            if !c.is_ascii_digit() {
                break;
            }
            v = v * 10 + u64::from(c - b'0');
            if v > u64::from(u32::MAX) {
                return None;
            }
            i += 1;
        }
        // Nothing (`]` of an empty list, `-`, `[`, `"`), or a leading zero JSON forbids.
        if i == start || (b[start] == b'0' && i - start > 1) {
            return None;
        }
        ids.push(v as u32);
        i = skip_ws(b, i);
        match b.get(i) {
            Some(b',') => i = skip_ws(b, i + 1),
            Some(b']') => return Some((ids, i + 1)),
            _ => return None, // `.`/`e` of a float, or garbage
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skip_string_agrees_with_a_byte_by_byte_scan() {
        let slow = |b: &[u8], i: usize| {
            let mut j = i + 1;
            loop {
                match b.get(j)? {
                    b'"' => return Some(j + 1),
                    b'\\' => j += 2,
                    _ => j += 1,
                }
            }
        };
        // Random placements of quotes, backslashes and multi-byte chars among plain bytes.
        let alphabet: &[u8] = b"a\"\\\xc3\x80 ";
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 40) as usize;
            let mut b = vec![b'"'];
            for k in 0..len {
                let r = (state >> (k % 60)) as usize;
                b.push(if r.is_multiple_of(5) { alphabet[r / 5 % alphabet.len()] } else { b'x' });
            }
            assert_eq!(skip_string(&b, 0), slow(&b, 0), "{:?}", String::from_utf8_lossy(&b));
        }
    }

    #[test]
    fn flat_lists_of_u32_only() {
        let cases: &[(&str, Option<&[u32]>)] = &[
            ("[1,2,3]", Some(&[1, 2, 3])),
            (" [ 0 ,\n4294967295\t] ", Some(&[0, 4_294_967_295])),
            ("[4294967296]", None),
            ("[]", None),
            ("[ ]", None),
            ("[1.0]", None),
            ("[1e2]", None),
            ("[-1]", None),
            ("[-0]", None),
            ("[01]", None),
            ("[1,]", None),
            ("[1 2]", None),
            ("[1]x", None),
            ("[[1]]", None),
            ("[1,[2]]", None),
            ("[\"1\"]", None),
            ("\"[1]\"", None),
            ("5", None),
            ("[99999999999999999999999]", None),
        ];
        for (text, want) in cases {
            assert_eq!(flat_ids(text.as_bytes()).as_deref(), *want, "{text}");
        }
    }

    #[test]
    fn messages_spans() {
        // (body, the list's `[` .. its last element's end as text)
        let cases: &[(&str, Option<&str>)] = &[
            (r#"{"messages":[{"a":"]"},{"b":[1]} ],"x":1}"#, Some(r#"[{"a":"]"},{"b":[1]}"#)),
            (r#"{"m":"\"messages\":[]","messages": [ ] }"#, Some("[")),
            (r#"{"messages":[1],"messages":[2]}"#, None),
            (r#"{"messages":{"a":1}}"#, None),
            (r#"{"mess\u0061ges":[1]}"#, None),
            (r#"{"messages":[1,]}"#, None),
            (r#"{"messages":[1]} x"#, None),
            (r#"{"x":1}"#, None),
        ];
        for (body, want) in cases {
            let got = messages_span(body.as_bytes()).map(|s| &body[s.open..s.last_end]);
            assert_eq!(got, *want, "{body}");
        }
        let deep = |d: usize| format!(r#"{{"messages":[{}1{}]}}"#, "[".repeat(d), "]".repeat(d));
        assert!(
            messages_span(deep(MAX_DEPTH - 3).as_bytes()).is_some()
                && depth_ok(deep(MAX_DEPTH - 3).as_bytes())
        );
        assert!(
            messages_span(deep(MAX_DEPTH - 2).as_bytes()).is_none()
                && !depth_ok(deep(MAX_DEPTH - 2).as_bytes())
        );
    }

    #[test]
    fn prompt_spans() {
        fn span(body: &str) -> Option<&str> {
            prompt_span(body.as_bytes()).map(|p| &body[p.start..p.end])
        }
        let p = prompt_span(br#"{"a":1,"prompt":[5, 6]}"#).unwrap();
        assert_eq!(p.ids.as_deref(), Some(&[5, 6][..]));
        assert_eq!(prompt_span(br#"{"prompt":[5.5]}"#).unwrap().ids, None);
        assert_eq!(span(r#"{"prompt":[1,2]}"#), Some("[1,2]"));
        assert_eq!(
            span(r#" { "model" : "m,}" , "prompt" : [1, 2] , "x":{"a":[1,{"b":"]"}]} } "#),
            Some("[1, 2]")
        );
        assert_eq!(span(r#"{"prompt":"a\"b","prompt":[3]}"#), Some("[3]"), "the last key wins");
        assert_eq!(span(r#"{"prompt":[1],"prompt":"text"}"#), Some("\"text\""));
        assert_eq!(span(r#"{"pro\u006dpt":[1]}"#), None);
        assert_eq!(span(r#"{"model":"m"}"#), None);
        assert_eq!(span(r#"{}"#), None);
        assert_eq!(span(r#"[1]"#), None);
        assert_eq!(span(r#"{"prompt":[1]"#), None);
        assert_eq!(span(r#"{"prompt" [1]}"#), None);
        assert_eq!(span(r#"{"prompt":[1]} x"#), None);
        assert_eq!(span(r#"{"prompt":}"#), None);
    }
}
