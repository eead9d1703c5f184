//! The engine's `usage` read from the end of an OpenAI response, without buffering the response.
//!
//! Attribution (issue 46) needs what the engine served from its prefix cache for each routed
//! request: `usage.prompt_tokens_details.cached_tokens` (vLLM's `num_cached_tokens`, the same
//! tokens `vllm:prefix_cache_hits_total` counts). vLLM writes `usage` at the end of the response:
//! a non-streamed body ends with it (after `choices`; only `prompt_logprobs`, `prompt_token_ids`
//! and `kv_transfer_params` may follow), and a stream that asked for it
//! (`stream_options.include_usage`, or the engine's `--enable-force-include-usage`) sends it in
//! the last chunk before `data: [DONE]`. So a reader keeps only the last [`USAGE_TAIL_BYTES`] of
//! the response ([`UsageTail::push`], fed each chunk's own tail, so a chunk costs at most that
//! copy whatever its size) and parses the last `"usage"` object found there
//! ([`UsageTail::usage`]) when the response ends. Memory per response: at most twice the bound.
//!
//! Limits (the request is then reported without usage and not attributed): a stream that did not
//! ask for usage; a usage object followed by more than the bound (a non-streamed response with
//! `prompt_token_ids` or `prompt_logprobs` of a long prompt); a compressed response; a usage
//! without `prompt_tokens_details` (vLLM sends it only with `--enable-prompt-tokens-details`)
//! carries no cached tokens. `"usage"` inside generated text is escaped (`\"usage\"`) and never
//! matches the key. Pure: no I/O, compiles for `wasm32-wasip1`.

use serde::Deserialize;

use crate::api::EngineUsage;

/// Bytes of a response's end kept to find its `usage` (a vLLM usage object with
/// `prompt_tokens_details` is ~150 bytes; the rest is room for the fields vLLM writes after it and
/// for an SSE stream's `[DONE]` and final chunks).
pub const USAGE_TAIL_BYTES: usize = 4096;

/// The last bytes of a response, kept to read its `usage` at the end.
#[derive(Debug, Clone)]
pub struct UsageTail {
    buf: Vec<u8>,
    cap: usize,
    seen: u64,
}

impl Default for UsageTail {
    fn default() -> Self {
        Self::new(USAGE_TAIL_BYTES)
    }
}

impl UsageTail {
    /// Keeps the last `cap` bytes (at least 1).
    pub fn new(cap: usize) -> Self {
        Self { buf: Vec::new(), cap: cap.max(1), seen: 0 }
    }

    /// How many bytes of a chunk of `len` bytes are worth reading: its last `cap`.
    pub fn wanted(&self, len: usize) -> usize {
        len.min(self.cap)
    }

    /// Appends the end of a chunk (its last [`Self::wanted`] bytes, or all of it); `chunk_len`
    /// is the whole chunk's size (what was skipped still counts as seen).
    pub fn push(&mut self, tail_of_chunk: &[u8], chunk_len: usize) {
        self.seen += chunk_len.max(tail_of_chunk.len()) as u64;
        let tail = &tail_of_chunk[tail_of_chunk.len().saturating_sub(self.cap)..];
        // Bytes skipped in the middle of a chunk break continuity: what came before is not the
        // response's text any more, so it goes.
        if chunk_len > tail.len() {
            self.buf.clear();
        }
        self.buf.extend_from_slice(tail);
        // Amortised: trim only past twice the bound, so a stream of small chunks moves the
        // buffer once per `cap` bytes, not once per chunk.
        if self.buf.len() > 2 * self.cap {
            let cut = self.buf.len() - self.cap;
            self.buf.drain(..cut);
        }
    }

    /// Bytes of the response seen so far.
    pub fn seen(&self) -> u64 {
        self.seen
    }

    /// Bytes held now (at most twice the bound).
    pub fn held(&self) -> usize {
        self.buf.len()
    }

    /// The last usage object in the kept tail that carries `prompt_tokens`, if any.
    pub fn usage(&self) -> Option<EngineUsage> {
        find_usage(&self.buf)
    }
}

const KEY: &[u8] = b"\"usage\"";

/// The last `"usage": {…}` in `text` with `prompt_tokens` (a `null` usage, or one cut off by the
/// start of the tail or by the end, is skipped for an earlier one).
pub fn find_usage(text: &[u8]) -> Option<EngineUsage> {
    let mut end = text.len();
    while let Some(at) = rfind(&text[..end], KEY) {
        if let Some(u) = usage_at(&text[at + KEY.len()..]) {
            return Some(u);
        }
        end = at;
    }
    None
}

fn rfind(hay: &[u8], needle: &[u8]) -> Option<usize> {
    if hay.len() < needle.len() {
        return None;
    }
    (0..=hay.len() - needle.len()).rev().find(|&i| hay[i..].starts_with(needle))
}

/// `: {…}` right after the key: the usage object, when it parses and names `prompt_tokens`.
fn usage_at(after_key: &[u8]) -> Option<EngineUsage> {
    let rest = after_key.trim_ascii_start().strip_prefix(b":")?.trim_ascii_start();
    if !rest.starts_with(b"{") {
        return None;
    }
    // One value, whatever follows it (the rest of the body, more SSE events).
    let mut de = serde_json::Deserializer::from_slice(rest);
    let wire = WireUsage::deserialize(&mut de).ok()?;
    Some(EngineUsage {
        prompt_tokens: wire.prompt_tokens?,
        completion_tokens: wire.completion_tokens.unwrap_or(0),
        cached_tokens: wire.prompt_tokens_details.and_then(|d| d.cached_tokens),
    })
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<WireDetails>,
}

#[derive(Deserialize)]
struct WireDetails {
    #[serde(default)]
    cached_tokens: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    const USAGE: &str = r#"{"prompt_tokens":1000,"total_tokens":1010,"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":960}}"#;

    fn want() -> Option<EngineUsage> {
        Some(EngineUsage { prompt_tokens: 1000, completion_tokens: 10, cached_tokens: Some(960) })
    }

    /// Feeds `body` in chunks of `size`, each read as the filter reads it (its wanted tail).
    fn scan(body: &[u8], size: usize, cap: usize) -> UsageTail {
        let mut t = UsageTail::new(cap);
        for chunk in body.chunks(size.max(1)) {
            let n = t.wanted(chunk.len());
            t.push(&chunk[chunk.len() - n..], chunk.len());
            assert!(t.held() <= 2 * cap);
        }
        t
    }

    fn sse(tokens: usize) -> String {
        let mut s = String::new();
        for i in 0..tokens {
            s.push_str(&format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" w{i}\"}},\"finish_reason\":null}}]}}\n\n"
            ));
        }
        s.push_str(&format!(
            "data: {{\"id\":\"chatcmpl-1\",\"choices\":[],\"usage\":{USAGE}}}\n\ndata: [DONE]\n\n"
        ));
        s
    }

    #[test]
    fn a_non_streamed_body_ends_with_its_usage() {
        let body = format!(
            r#"{{"id":"cmpl-1","object":"text_completion","choices":[{{"index":0,"text":"a \"usage\": {{\"prompt_tokens\": 1}}","finish_reason":"length"}}],"usage":{USAGE},"prompt_logprobs":null,"prompt_token_ids":null,"kv_transfer_params":null}}"#
        );
        for size in [1, 7, 64, 100_000] {
            assert_eq!(scan(body.as_bytes(), size, USAGE_TAIL_BYTES).usage(), want(), "{size}");
        }
    }

    #[test]
    fn a_stream_split_anywhere_gives_its_last_usage() {
        let body = sse(300);
        for size in [1, 2, 3, 17, 200, 4096, 5000, 1 << 20] {
            assert_eq!(scan(body.as_bytes(), size, USAGE_TAIL_BYTES).usage(), want(), "{size}");
        }
        // `continuous_usage_stats`: every chunk carries the running usage; the last one wins.
        let running = body.replace(
            "\"finish_reason\":null}]}",
            "\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":1000,\"completion_tokens\":1}}",
        );
        assert_eq!(scan(running.as_bytes(), 50, USAGE_TAIL_BYTES).usage(), want());
    }

    #[test]
    fn missing_null_or_partial_usage_reads_as_none_or_without_cached_tokens() {
        let no_usage = sse(5).replace(&format!(",\"usage\":{USAGE}"), "");
        let cases: Vec<(String, Option<EngineUsage>)> = vec![
            (no_usage, None),
            (r#"{"choices":[],"usage":null}"#.into(), None),
            (
                r#"{"usage":{"prompt_tokens":5,"completion_tokens":2}}"#.into(),
                Some(EngineUsage { prompt_tokens: 5, completion_tokens: 2, cached_tokens: None }),
            ),
            (
                r#"{"usage":{"prompt_tokens":5,"prompt_tokens_details":null}}"#.into(),
                Some(EngineUsage { prompt_tokens: 5, completion_tokens: 0, cached_tokens: None }),
            ),
            (r#"{"usage":{"completion_tokens":2}}"#.into(), None),
            (r#"{"usage":{"prompt_tokens":5,"#.into(), None),
            (r#"{"usage": "x"}"#.into(), None),
            (String::new(), None),
            ("\"usage\"".into(), None),
        ];
        for (body, expected) in cases {
            assert_eq!(find_usage(body.as_bytes()), expected, "{body}");
        }
        // A null usage after a real one: the real one.
        let both = format!(r#"{{"usage":{USAGE}}} {{"usage":null}}"#);
        assert_eq!(find_usage(both.as_bytes()), want());
    }

    #[test]
    fn a_huge_response_stays_bounded_and_a_far_usage_is_not_found() {
        let huge = sse(100_000);
        assert!(huge.len() > 10 << 20);
        let t = scan(huge.as_bytes(), 300, USAGE_TAIL_BYTES);
        assert_eq!((t.usage(), t.seen()), (want(), huge.len() as u64));
        // One huge chunk: only its tail is read.
        let t = scan(huge.as_bytes(), usize::MAX, USAGE_TAIL_BYTES);
        assert_eq!(t.usage(), want());
        assert!(t.held() <= USAGE_TAIL_BYTES);
        // Usage followed by more than the bound (prompt_token_ids of a long prompt): not found.
        let ids: Vec<String> = (0..5000).map(|i| i.to_string()).collect();
        let far =
            format!(r#"{{"choices":[],"usage":{USAGE},"prompt_token_ids":[{}]}}"#, ids.join(","));
        assert_eq!(scan(far.as_bytes(), 1000, USAGE_TAIL_BYTES).usage(), None);
        assert_eq!(scan(far.as_bytes(), 1000, 64 << 10).usage(), want());
    }

    #[test]
    fn skipped_middles_never_join_unrelated_bytes() {
        let mut t = UsageTail::new(16);
        t.push(br#""usage":{"prompt_tokens":1"#, 26);
        // A 1 MB chunk of which only the last 16 bytes were read: the earlier bytes are dropped.
        t.push(b"_tokens\":2}} end", 1 << 20);
        assert_eq!(t.usage(), None);
    }
}
