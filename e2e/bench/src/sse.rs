//! Server-sent events: an incremental parser and the meaning of OpenAI streaming chunks (pure).
//!
//! The HTTP layer feeds body bytes as they arrive, in whatever pieces the network cuts them;
//! the parser returns each complete event's `data` payload. The pending buffer is bounded
//! ([`MAX_EVENT_BYTES`]) so a server that never ends an event cannot grow it without limit.
//! [`interpret`] turns one payload into what the replayer measures: whether it carries generated
//! text (TTFT is the first such chunk — the role-only first chat chunk does not count), the
//! text itself (the chat workload appends the real reply to the history), usage, and errors.

use serde_json::Value;

/// Largest event (all its lines together) the parser buffers before giving up.
pub const MAX_EVENT_BYTES: usize = 8 * 1024 * 1024;

/// Why a stream could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// An event grew beyond [`MAX_EVENT_BYTES`].
    #[error("SSE event larger than {limit} bytes")]
    TooLarge {
        /// The bound.
        limit: usize,
    },
}

/// Incremental SSE parser (only `data:` fields matter for OpenAI streams).
#[derive(Debug, Default)]
pub struct SseParser {
    line: Vec<u8>,
    data: Vec<String>,
    data_bytes: usize,
}

impl SseParser {
    /// A parser with empty buffers.
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the data payloads of events completed by them, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        let mut out = Vec::new();
        for &b in bytes {
            if b == b'\n' {
                let mut line = std::mem::take(&mut self.line);
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                self.on_line(&line, &mut out);
            } else {
                self.line.push(b);
                if self.line.len() + self.data_bytes > MAX_EVENT_BYTES {
                    return Err(SseError::TooLarge { limit: MAX_EVENT_BYTES });
                }
            }
        }
        Ok(out)
    }

    /// End of stream: an event not followed by a blank line is still delivered.
    pub fn finish(&mut self) -> Option<String> {
        if !self.line.is_empty() {
            let line = std::mem::take(&mut self.line);
            let mut sink = Vec::new();
            self.on_line(&line, &mut sink);
            if let Some(ev) = sink.pop() {
                return Some(ev);
            }
        }
        self.dispatch()
    }

    fn on_line(&mut self, line: &[u8], out: &mut Vec<String>) {
        if line.is_empty() {
            if let Some(ev) = self.dispatch() {
                out.push(ev);
            }
            return;
        }
        if let Some(rest) = line.strip_prefix(b"data:") {
            let rest = rest.strip_prefix(b" ").unwrap_or(rest);
            let text = String::from_utf8_lossy(rest).into_owned();
            self.data_bytes += text.len();
            self.data.push(text);
        }
        // Comments (":…"), `event:`, `id:`, `retry:` carry nothing the replayer measures.
    }

    fn dispatch(&mut self) -> Option<String> {
        if self.data.is_empty() {
            return None;
        }
        self.data_bytes = 0;
        Some(std::mem::take(&mut self.data).join("\n"))
    }
}

/// Token usage as reported in the final chunk (`stream_options.include_usage`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub completion_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
}

/// What one event payload means to the replayer.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// The `[DONE]` sentinel.
    pub done: bool,
    /// Generated text in this chunk (completions `text`, chat `delta.content`), concatenated
    /// over choices. Non-empty means the chunk carries tokens.
    pub text: String,
    /// Usage, when the chunk has it.
    pub usage: Option<Usage>,
    /// An error the server reported in the stream, or why the payload is not valid JSON.
    pub error: Option<String>,
}

impl Chunk {
    /// True when the chunk carries generated tokens (the TTFT event).
    pub fn has_tokens(&self) -> bool {
        !self.text.is_empty()
    }
}

/// Interprets one SSE data payload of an OpenAI completions or chat completions stream.
pub fn interpret(data: &str) -> Chunk {
    let data = data.trim();
    if data == "[DONE]" {
        return Chunk { done: true, ..Default::default() };
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => {
            return Chunk { error: Some(format!("malformed SSE data: {e}")), ..Default::default() }
        }
    };
    let mut chunk = Chunk::default();
    if let Some(err) = v.get("error") {
        let msg = err.get("message").and_then(Value::as_str).map(String::from);
        chunk.error = Some(msg.unwrap_or_else(|| err.to_string()));
    }
    if let Some(choices) = v.get("choices").and_then(Value::as_array) {
        for c in choices {
            let text = c
                .get("text")
                .and_then(Value::as_str)
                .or_else(|| c.pointer("/delta/content").and_then(Value::as_str));
            if let Some(t) = text {
                chunk.text.push_str(t);
            }
        }
    }
    if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
        chunk.usage = Some(Usage {
            prompt_tokens: u.get("prompt_tokens").and_then(Value::as_u64),
            completion_tokens: u.get("completion_tokens").and_then(Value::as_u64),
            cached_tokens: u
                .pointer("/prompt_tokens_details/cached_tokens")
                .and_then(Value::as_u64),
        });
    }
    chunk
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_survive_any_split() {
        let stream = b"data: {\"a\":1}\n\n: comment\nevent: x\ndata: two\r\ndata: lines\r\n\r\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let mut p = SseParser::new();
            let mut got = p.push(&stream[..cut]).unwrap();
            got.extend(p.push(&stream[cut..]).unwrap());
            assert_eq!(got, vec!["{\"a\":1}", "two\nlines", "[DONE]"], "cut at {cut}");
            assert_eq!(p.finish(), None);
        }
    }

    #[test]
    fn unterminated_last_event_is_delivered_at_finish() {
        let mut p = SseParser::new();
        assert!(p.push(b"data: tail").unwrap().is_empty());
        assert_eq!(p.finish().as_deref(), Some("tail"));
        let mut p = SseParser::new();
        assert!(p.push(b"data: x\n").unwrap().is_empty());
        assert_eq!(p.finish().as_deref(), Some("x"));
    }

    #[test]
    fn oversized_event_is_refused() {
        let mut p = SseParser::new();
        let big = vec![b'a'; MAX_EVENT_BYTES + 1];
        assert_eq!(p.push(&big), Err(SseError::TooLarge { limit: MAX_EVENT_BYTES }));
    }

    #[test]
    fn interpret_table() {
        let cases: &[(&str, Chunk)] = &[
            ("[DONE]", Chunk { done: true, ..Default::default() }),
            (
                r#"{"choices":[{"index":0,"text":"hi"}]}"#,
                Chunk { text: "hi".into(), ..Default::default() },
            ),
            (r#"{"choices":[{"index":0,"text":""}]}"#, Chunk::default()),
            (r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#, Chunk::default()),
            (r#"{"choices":[{"delta":{"role":"assistant"}}]}"#, Chunk::default()),
            (
                r#"{"choices":[{"delta":{"content":"Hel"}}]}"#,
                Chunk { text: "Hel".into(), ..Default::default() },
            ),
            (
                r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#,
                Chunk {
                    usage: Some(Usage {
                        prompt_tokens: Some(10),
                        completion_tokens: Some(3),
                        cached_tokens: Some(8),
                    }),
                    ..Default::default()
                },
            ),
            (
                r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":null}}"#,
                Chunk {
                    usage: Some(Usage {
                        prompt_tokens: Some(10),
                        completion_tokens: Some(3),
                        cached_tokens: None,
                    }),
                    ..Default::default()
                },
            ),
            (
                r#"{"choices":[{"text":"x"}],"usage":null}"#,
                Chunk { text: "x".into(), ..Default::default() },
            ),
            (
                r#"{"error":{"message":"overloaded","type":"x","code":503}}"#,
                Chunk { error: Some("overloaded".into()), ..Default::default() },
            ),
        ];
        for (data, want) in cases {
            assert_eq!(&interpret(data), want, "{data}");
        }
        let bad = interpret("{not json");
        assert!(bad.error.unwrap().starts_with("malformed SSE data"));
        assert!(interpret(r#"{"choices":[{"text":"a"}]}"#).has_tokens());
    }
}
