//! The name the filter gives a request in its logs, its `/v1/route` call and its `/v1/done`
//! report, from the client's `x-request-id`.
//!
//! A header value may carry bytes an HTTP library will not read as text (anything outside visible
//! ASCII, e.g. UTF-8 from a client that puts a user name in its id). Envoy passes them through,
//! but the indexer reads its headers as visible ASCII and would answer the route call 400 — that
//! client would never be routed by KV. So such an id is percent-encoded for everything the filter
//! says about the request (every byte outside visible ASCII, and `%` itself so the encoding can be
//! undone): `café-7` reads `caf%C3%A9-7` in the filter's and the indexer's logs alike, still
//! searchable. The header the engine receives is never touched: it stays the client's.

/// `id` percent-encoded, or `None` when it is visible ASCII already (sent as it is).
///
/// Bounded: at most three bytes out per byte in (the filter reads ids of at most
/// [`crate::request::MAX_META_VALUE_BYTES`]).
pub fn encoded_for_indexer(id: &str) -> Option<String> {
    if id.bytes().all(is_header_text) {
        return None;
    }
    let mut out = String::with_capacity(id.len() * 3);
    for b in id.bytes() {
        if b.is_ascii_graphic() && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(hex_digit(b >> 4));
            out.push(hex_digit(b & 0x0f));
        }
    }
    Some(out)
}

/// What an HTTP header value may carry as text (`http::HeaderValue::to_str`): visible ASCII,
/// space and tab.
fn is_header_text(b: u8) -> bool {
    b == b'\t' || (b' '..=b'~').contains(&b)
}

fn hex_digit(nibble: u8) -> char {
    char::from(b"0123456789ABCDEF"[usize::from(nibble & 0x0f)])
}

#[cfg(test)]
#[path = "tests/request_id.rs"]
mod tests;
