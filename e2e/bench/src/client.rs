//! The thin HTTP layer: send one streaming OpenAI request, measure it, never hang.
//!
//! Everything measurable is decided by the pure `sse` module; this layer only moves bytes and
//! reads clocks. Every request runs under one overall deadline (connect + headers + the whole
//! stream); when it fires, the partial outcome (status, headers, TTFT if seen) is kept and the
//! request is recorded as failed with `timeout after …`. A non-2xx status keeps the first
//! [`MAX_ERROR_BODY`] bytes of the body as the error text.

use crate::sse::{interpret, SseParser, Usage};
use futures::StreamExt;
use kvmesh_core::headers;
use reqwest::header::HeaderMap;
use std::time::{Duration, Instant};

/// Response header set by `vllm-sim`: the worker that served the request.
pub const SIM_WORKER_HEADER: &str = "x-sim-worker";
/// Longest error body kept in a record.
pub const MAX_ERROR_BODY: usize = 2048;

/// What happened to one request.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Outcome {
    /// HTTP status, when headers arrived.
    pub status: Option<u16>,
    /// `x-sim-worker`.
    pub worker: Option<String>,
    /// `x-kvmesh-decision-mode`.
    pub decision_mode: Option<String>,
    /// `x-kvmesh-decision-worker`.
    pub decision_worker: Option<String>,
    /// `x-kvmesh-overlap-blocks`.
    pub overlap_blocks: Option<u64>,
    /// `x-kvmesh-isl-blocks`.
    pub isl_blocks: Option<u64>,
    /// `x-kvmesh-fallback`.
    pub fallback: Option<String>,
    /// `x-kvmesh-predicted-ttft-ms`: the router's prediction, to set beside the measured TTFT.
    pub predicted_ttft_ms: Option<f64>,
    /// `x-kvmesh-decision-reason`.
    pub decision_reason: Option<String>,
    /// Time from send to the first token-carrying chunk.
    pub ttft: Option<Duration>,
    /// Time from send to the end (or failure).
    pub e2e: Duration,
    /// Generated text, concatenated (chat workload appends it to the history).
    pub text: String,
    /// Usage from the final chunk.
    pub usage: Option<Usage>,
    /// Why the request failed; `None` on success.
    pub error: Option<String>,
}

/// Builds the shared HTTP client. `max_idle` bounds pooled idle connections.
pub fn build_client(
    connect_timeout: Duration,
    max_idle: usize,
) -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .connect_timeout(connect_timeout)
        .pool_max_idle_per_host(max_idle)
        .tcp_nodelay(true)
        .build()
}

fn header_str(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(|s| s.trim().to_string())
}

fn capture_headers(out: &mut Outcome, h: &HeaderMap) {
    out.worker = header_str(h, SIM_WORKER_HEADER);
    out.decision_mode = header_str(h, headers::DEBUG_MODE);
    out.decision_worker = header_str(h, headers::DEBUG_WORKER);
    out.overlap_blocks = header_str(h, headers::DEBUG_OVERLAP_BLOCKS).and_then(|v| v.parse().ok());
    out.isl_blocks = header_str(h, headers::DEBUG_ISL_BLOCKS).and_then(|v| v.parse().ok());
    out.fallback = header_str(h, headers::DEBUG_FALLBACK);
    out.predicted_ttft_ms =
        header_str(h, headers::DEBUG_PREDICTED_TTFT).and_then(|v| v.parse().ok());
    out.decision_reason = header_str(h, headers::DEBUG_REASON);
}

/// POSTs `body` (JSON bytes) to `url` with `extra_headers`, reads the SSE stream to the end and
/// measures it. Always returns within `deadline` (plus scheduling noise).
pub async fn send_streaming(
    client: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    extra_headers: &[(String, String)],
    deadline: Duration,
) -> Outcome {
    let mut out = Outcome::default();
    let start = Instant::now();
    let finished =
        tokio::time::timeout(deadline, drive(client, url, body, extra_headers, start, &mut out))
            .await;
    if finished.is_err() {
        out.error = Some(format!("timeout after {:.1}s", deadline.as_secs_f64()));
    }
    out.e2e = start.elapsed();
    out
}

async fn drive(
    client: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    extra_headers: &[(String, String)],
    start: Instant,
    out: &mut Outcome,
) {
    let mut req =
        client.post(url).header(reqwest::header::CONTENT_TYPE, "application/json").body(body);
    for (k, v) in extra_headers {
        req = req.header(k.as_str(), v.as_str());
    }
    let resp = match req.send().await {
        Ok(r) => r,
        Err(e) => {
            out.error = Some(format!("request failed: {}", error_chain(&e)));
            return;
        }
    };
    out.status = Some(resp.status().as_u16());
    capture_headers(out, resp.headers());
    let ok_status = resp.status().is_success();
    let mut stream = resp.bytes_stream();
    if !ok_status {
        let mut buf = Vec::new();
        while let Some(chunk) = stream.next().await {
            match chunk {
                Ok(b) => buf
                    .extend_from_slice(&b[..b.len().min(MAX_ERROR_BODY.saturating_sub(buf.len()))]),
                Err(_) => break,
            }
            if buf.len() >= MAX_ERROR_BODY {
                break;
            }
        }
        out.error = Some(format!(
            "HTTP {}: {}",
            out.status.unwrap_or(0),
            String::from_utf8_lossy(&buf).trim()
        ));
        return;
    }
    let mut parser = SseParser::new();
    let mut done = false;
    while let Some(chunk) = stream.next().await {
        let bytes = match chunk {
            Ok(b) => b,
            Err(e) => {
                out.error = Some(format!("stream broken: {}", error_chain(&e)));
                return;
            }
        };
        let events = match parser.push(&bytes) {
            Ok(ev) => ev,
            Err(e) => {
                out.error = Some(e.to_string());
                return;
            }
        };
        for ev in events {
            done |= on_event(&ev, start, out);
        }
    }
    if let Some(ev) = parser.finish() {
        done |= on_event(&ev, start, out);
    }
    if out.error.is_none() && !done {
        out.error = Some("stream ended before [DONE]".into());
    }
}

/// Applies one event; returns true on `[DONE]`.
fn on_event(data: &str, start: Instant, out: &mut Outcome) -> bool {
    let c = interpret(data);
    if c.has_tokens() && out.ttft.is_none() {
        out.ttft = Some(start.elapsed());
    }
    out.text.push_str(&c.text);
    if c.usage.is_some() {
        out.usage = c.usage;
    }
    if let Some(e) = c.error {
        // Keep the first error: later ones are usually consequences.
        out.error.get_or_insert(e);
    }
    c.done
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(inner) = cur {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        cur = inner.source();
    }
    s
}

/// Asks `GET {base}/v1/models` for the first model id (used when `--model` is not given).
pub async fn discover_model(
    client: &reqwest::Client,
    base: &str,
    deadline: Duration,
) -> Result<String, String> {
    let url = format!("{}/v1/models", base.trim_end_matches('/'));
    let fut = async {
        let resp = client.get(&url).send().await.map_err(|e| error_chain(&e))?;
        let status = resp.status();
        let v: serde_json::Value = resp.json().await.map_err(|e| error_chain(&e))?;
        if !status.is_success() {
            return Err(format!("HTTP {status}: {v}"));
        }
        v.pointer("/data/0/id")
            .and_then(|x| x.as_str())
            .map(String::from)
            .ok_or_else(|| format!("no model in {v}"))
    };
    match tokio::time::timeout(deadline, fut).await {
        Ok(r) => r.map_err(|e| format!("{url}: {e}")),
        Err(_) => Err(format!("{url}: timeout after {:.1}s", deadline.as_secs_f64())),
    }
}
