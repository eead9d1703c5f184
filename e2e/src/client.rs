//! Small OpenAI-over-HTTP helpers for tests: send a request through the gateway and read what
//! kvmesh and the engine said about it (worker, decision headers, usage).

use kvmesh_core::headers;
use serde_json::Value;

/// Header every vllm-sim response carries: the id of the worker that served it.
pub const SIM_WORKER: &str = "x-sim-worker";

/// A finished (non-streaming) response.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: u16,
    pub headers: reqwest::header::HeaderMap,
    pub text: String,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
    /// The worker that served the request (from the engine's own header).
    pub fn worker(&self) -> Option<&str> {
        self.header(SIM_WORKER)
    }
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or(Value::Null)
    }
    /// The kvmesh debug headers, when the filter has them on.
    pub fn mode(&self) -> Option<&str> {
        self.header(headers::DEBUG_MODE)
    }
    pub fn reason(&self) -> Option<&str> {
        self.header(headers::DEBUG_REASON)
    }
    /// The decision's stable reason codes (`x-kvmesh-decision-reason-codes`); empty without one.
    pub fn reason_codes(&self) -> Vec<kvmesh_core::api::ReasonCode> {
        self.header(headers::DEBUG_REASON_CODES)
            .map(kvmesh_core::api::ReasonCode::parse_list)
            .unwrap_or_default()
    }
    pub fn overlap_blocks(&self) -> Option<u64> {
        self.header(headers::DEBUG_OVERLAP_BLOCKS)?.parse().ok()
    }
    pub fn isl_blocks(&self) -> Option<u64> {
        self.header(headers::DEBUG_ISL_BLOCKS)?.parse().ok()
    }
    /// `usage.prompt_tokens`.
    pub fn prompt_tokens(&self) -> Option<u64> {
        self.json().pointer("/usage/prompt_tokens")?.as_u64()
    }
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub fn cached_tokens(&self) -> Option<u64> {
        self.json().pointer("/usage/prompt_tokens_details/cached_tokens")?.as_u64()
    }
    /// The generated text of an SSE answer (`stream: true`), chunks joined.
    pub fn stream_text(&self) -> String {
        sse_events(&self.text)
            .filter_map(|e| {
                let c = e.pointer("/choices/0")?;
                c.pointer("/delta/content")
                    .or_else(|| c.get("text"))
                    .and_then(Value::as_str)
                    .map(str::to_owned)
            })
            .collect()
    }
    /// `usage.prompt_tokens_details.cached_tokens` of an SSE answer's usage chunk.
    pub fn stream_cached_tokens(&self) -> Option<u64> {
        sse_events(&self.text)
            .find_map(|e| e.pointer("/usage/prompt_tokens_details/cached_tokens")?.as_u64())
    }
    /// The assistant's reply text of a chat completion.
    pub fn chat_content(&self) -> Option<String> {
        Some(self.json().pointer("/choices/0/message/content")?.as_str()?.to_owned())
    }
}

/// The JSON events of an SSE body (`data: {…}` lines; `[DONE]` and anything else skipped).
pub fn sse_events(text: &str) -> impl Iterator<Item = Value> + '_ {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
}

/// POSTs `body` (raw bytes) to `url` with extra headers and reads the whole answer.
pub async fn post_raw(
    client: &reqwest::Client,
    url: &str,
    body: impl Into<reqwest::Body>,
    extra: &[(&str, &str)],
) -> anyhow::Result<Reply> {
    let mut req = client.post(url).header("content-type", "application/json").body(body);
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    let text = resp.text().await?;
    Ok(Reply { status, headers, text })
}

/// POSTs a JSON body.
pub async fn post_json(
    client: &reqwest::Client,
    url: &str,
    body: &Value,
    extra: &[(&str, &str)],
) -> anyhow::Result<Reply> {
    post_raw(client, url, serde_json::to_vec(body)?, extra).await
}

/// A chat request body.
pub fn chat_body(messages: &[(String, String)], max_tokens: u32) -> Value {
    let msgs: Vec<Value> =
        messages.iter().map(|(r, c)| serde_json::json!({"role": r, "content": c})).collect();
    serde_json::json!({"model": "deepseek-v4", "messages": msgs, "max_tokens": max_tokens})
}

/// Deterministic filler text of roughly `words` words, distinct per `seed`.
pub fn filler(seed: u64, words: usize) -> String {
    const VOCAB: &[&str] = &[
        "router", "cache", "prefix", "block", "worker", "engine", "token", "mesh", "envoy",
        "latency", "request", "session", "decode", "prefill", "index", "event", "stream", "batch",
        "queue", "memory", "policy", "load",
    ];
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(words * 7);
    for i in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(VOCAB[(x % VOCAB.len() as u64) as usize]);
        if x.is_multiple_of(11) {
            out.push_str(&format!(" {}", x % 1000));
        }
    }
    out
}
