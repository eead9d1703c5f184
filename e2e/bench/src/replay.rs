//! Trace replay driver: sends the selected trace requests at their (sped-up) timestamps.
//!
//! One scheduler loop walks the requests in trace order, sleeps until each one's send offset,
//! takes a slot from a semaphore of `max_concurrency` permits, and spawns the request with the
//! permit; the permit returns when the request's record has been handed to the sink. When the
//! fleet is slower than the trace, requests wait for a slot and are sent late — `scheduled_ms`
//! and `sent_ms` both go into the record, so lateness is visible, never hidden. At the end the
//! loop takes every permit back, which waits for the in-flight requests; each of them is bounded
//! by the request deadline, so the run is bounded too.

use crate::blocks;
use crate::client::{send_streaming, Outcome};
use crate::conversation;
use crate::record::RequestRecord;
use crate::trace::{send_offsets_ms, Indexed};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Semaphore};

/// Upper bound accepted for `--max-concurrency` (and the chat driver's concurrent sessions).
pub const MAX_CONCURRENCY: usize = 65_536;

/// How to replay.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayConfig {
    /// Base URL of the gateway, e.g. `http://127.0.0.1:10000`.
    pub base_url: String,
    /// `model` field of every request.
    pub model: String,
    /// Trace time is divided by this.
    pub speedup: f64,
    /// Requests in flight at most.
    pub max_concurrency: usize,
    /// Deadline per request (connect + whole stream).
    pub request_timeout: Duration,
    /// Send a per-conversation session id in this header, when set.
    pub session_header: Option<String>,
    /// Conversation anchor block (see `conversation`).
    pub anchor_block: usize,
    /// Seed of the block → tokens mapping.
    pub token_seed: u64,
    /// Send `ignore_eos: true` so the engine generates exactly `max_tokens`.
    pub ignore_eos: bool,
}

/// The request body of one trace request.
pub fn trace_body(
    req: &Indexed,
    model: &str,
    token_seed: u64,
    ignore_eos: bool,
) -> serde_json::Value {
    let prompt = blocks::prompt(&req.record, token_seed);
    let mut body = json!({
        "model": model,
        "prompt": prompt,
        "max_tokens": req.record.output_length.max(1),
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if ignore_eos {
        body["ignore_eos"] = serde_json::Value::Bool(true);
    }
    body
}

/// Turns an outcome into a record (shared with the chat driver).
pub fn to_record(
    index: u64,
    scheduled_ms: f64,
    sent_ms: f64,
    max_tokens: u64,
    o: Outcome,
) -> RequestRecord {
    let usage = o.usage.unwrap_or_default();
    RequestRecord {
        index,
        session: None,
        turn: None,
        model: None,
        scheduled_ms,
        sent_ms,
        ttft_ms: o.ttft.map(|d| d.as_secs_f64() * 1000.0),
        e2e_ms: o.e2e.as_secs_f64() * 1000.0,
        status: o.status,
        worker: o.worker,
        decision_mode: o.decision_mode,
        decision_worker: o.decision_worker,
        overlap_blocks: o.overlap_blocks,
        isl_blocks: o.isl_blocks,
        fallback: o.fallback,
        predicted_ttft_ms: o.predicted_ttft_ms,
        decision_reason: o.decision_reason,
        input_tokens: None,
        max_tokens,
        prompt_tokens: usage.prompt_tokens,
        cached_tokens: usage.cached_tokens,
        output_tokens: usage.completion_tokens,
        error: o.error,
    }
}

/// Replays `selected` against the gateway, sending one record per request to `sink`.
/// Returns the wall time of the run.
pub async fn run_trace(
    client: reqwest::Client,
    cfg: ReplayConfig,
    selected: Vec<Indexed>,
    sink: mpsc::Sender<RequestRecord>,
) -> Duration {
    let offsets = send_offsets_ms(&selected, cfg.speedup);
    let permits = cfg.max_concurrency.clamp(1, MAX_CONCURRENCY);
    let slots = Arc::new(Semaphore::new(permits));
    let url = format!("{}/v1/completions", cfg.base_url.trim_end_matches('/'));
    let cfg = Arc::new(cfg);
    let t0 = Instant::now();
    let t0_tokio = tokio::time::Instant::from_std(t0);
    for (req, offset) in selected.into_iter().zip(offsets) {
        tokio::time::sleep_until(t0_tokio + Duration::from_secs_f64(offset / 1000.0)).await;
        let Ok(permit) = slots.clone().acquire_owned().await else {
            // The semaphore is never closed; stop scheduling rather than spin if it were.
            break;
        };
        let sent_ms = t0.elapsed().as_secs_f64() * 1000.0;
        let (client, cfg, url, sink) = (client.clone(), cfg.clone(), url.clone(), sink.clone());
        tokio::spawn(async move {
            let body = trace_body(&req, &cfg.model, cfg.token_seed, cfg.ignore_eos);
            let session = cfg
                .session_header
                .as_ref()
                .map(|h| (h.clone(), conversation::session_id(&req.record, cfg.anchor_block)));
            let extra: Vec<(String, String)> = session.iter().cloned().collect();
            let record = match serde_json::to_vec(&body) {
                Ok(bytes) => {
                    let outcome =
                        send_streaming(&client, &url, bytes, &extra, cfg.request_timeout).await;
                    to_record(
                        req.index as u64,
                        offset,
                        sent_ms,
                        u64::from(req.record.output_length.max(1)),
                        outcome,
                    )
                }
                Err(e) => RequestRecord {
                    index: req.index as u64,
                    scheduled_ms: offset,
                    sent_ms,
                    error: Some(format!("encoding body: {e}")),
                    ..Default::default()
                },
            };
            let record = RequestRecord {
                session: session.map(|(_, v)| v),
                input_tokens: Some(u64::from(req.record.input_length)),
                ..record
            };
            // A closed sink means the run is being torn down; nothing left to record into.
            let _ = sink.send(record).await;
            drop(permit);
        });
    }
    // Wait for the in-flight requests: each holds a permit until its record is handed over.
    let _ = slots.acquire_many(permits as u32).await;
    t0.elapsed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::TraceRecord;

    #[test]
    fn trace_body_carries_tokens_and_streaming_options() {
        let req = Indexed {
            index: 4,
            record: TraceRecord {
                timestamp: 0.0,
                input_length: 600,
                output_length: 0,
                hash_ids: vec![0, 1],
            },
        };
        let b = trace_body(&req, "m", 0, true);
        assert_eq!(b["prompt"].as_array().unwrap().len(), 600);
        assert_eq!(b["max_tokens"], json!(1), "0 output tokens is sent as 1");
        assert_eq!(b["stream_options"], json!({"include_usage": true}));
        assert_eq!(b["ignore_eos"], json!(true));
        assert_eq!(b["model"], json!("m"));
    }
}
