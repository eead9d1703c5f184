//! The per-request result record: one JSON object per line in a results file.
//!
//! Written by `kvmesh-replay` (both workloads) and read by `kvmesh-report`. One shape for both
//! sides, so a field cannot be renamed on one side only. Every field that may be unknown is an
//! `Option` (absent header, failed request, missing usage); nothing is dropped: a request that
//! failed is a record with `error` set and `status` holding the HTTP status if one arrived.

use serde::{Deserialize, Serialize};
use std::io::BufRead;

/// The outcome of one request.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Trace workload: 0-based line index in the trace. Chat workload: sequence number of the
    /// turn in the run.
    pub index: u64,
    /// Session id sent in the session header (or the chat session), when any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    /// The `model` the request named, when its session names its own (the `models` workload).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Chat workload: 0-based turn within the session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub turn: Option<u32>,
    /// When the request was due, ms since the start of the run.
    pub scheduled_ms: f64,
    /// When it was actually sent (after waiting for a concurrency slot), ms since the start.
    pub sent_ms: f64,
    /// Time to first token: from send to the first SSE chunk that carries generated text.
    #[serde(default)]
    pub ttft_ms: Option<f64>,
    /// End-to-end latency: from send to the end of the stream (or the failure).
    pub e2e_ms: f64,
    /// HTTP status, when response headers arrived.
    #[serde(default)]
    pub status: Option<u16>,
    /// `x-sim-worker` response header: the engine that served the request.
    #[serde(default)]
    pub worker: Option<String>,
    /// `x-kvmesh-decision-mode` debug header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_mode: Option<String>,
    /// `x-kvmesh-decision-worker` debug header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_worker: Option<String>,
    /// `x-kvmesh-overlap-blocks` debug header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub overlap_blocks: Option<u64>,
    /// `x-kvmesh-isl-blocks` debug header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub isl_blocks: Option<u64>,
    /// `x-kvmesh-fallback` debug header: the filter routed without the indexer, and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
    /// `x-kvmesh-predicted-ttft-ms` debug header: the router's predicted TTFT (compare `ttft_ms`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub predicted_ttft_ms: Option<f64>,
    /// `x-kvmesh-decision-reason` debug header.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decision_reason: Option<String>,
    /// Prompt tokens the client sent (trace workload; unknown for text prompts).
    #[serde(default)]
    pub input_tokens: Option<u64>,
    /// `max_tokens` requested.
    pub max_tokens: u64,
    /// `usage.prompt_tokens` reported by the engine.
    #[serde(default)]
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` reported by the engine.
    #[serde(default)]
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens` reported by the engine.
    #[serde(default)]
    pub output_tokens: Option<u64>,
    /// Why the request failed (transport error, timeout, non-2xx, error event in the stream).
    #[serde(default)]
    pub error: Option<String>,
}

impl RequestRecord {
    /// A request succeeded when it got a 2xx and no error was recorded.
    pub fn ok(&self) -> bool {
        self.error.is_none() && self.status.is_some_and(|s| (200..300).contains(&s))
    }

    /// Tokens the serving worker processed: prompt (engine-reported, else sent) plus output.
    pub fn worker_tokens(&self) -> u64 {
        self.prompt_tokens.or(self.input_tokens).unwrap_or(0) + self.output_tokens.unwrap_or(0)
    }
}

/// Why a results file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// Reading failed.
    #[error("reading results: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a record.
    #[error("results line {line}: {reason}")]
    Malformed {
        /// 1-based line number.
        line: usize,
        /// The parse error.
        reason: String,
    },
}

/// Reads a JSONL results file; blank lines are allowed, malformed lines are errors.
pub fn read_all<R: BufRead>(reader: R) -> Result<Vec<RequestRecord>, RecordError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let rec = serde_json::from_str(&line)
            .map_err(|e| RecordError::Malformed { line: i + 1, reason: e.to_string() })?;
        out.push(rec);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_omits_absent_debug_fields() {
        let r = RequestRecord {
            index: 3,
            scheduled_ms: 1.0,
            sent_ms: 1.5,
            ttft_ms: Some(10.0),
            e2e_ms: 20.0,
            status: Some(200),
            worker: Some("w1".into()),
            input_tokens: Some(100),
            max_tokens: 5,
            prompt_tokens: Some(100),
            cached_tokens: Some(64),
            output_tokens: Some(5),
            ..Default::default()
        };
        let line = serde_json::to_string(&r).unwrap();
        assert!(!line.contains("decision_mode"));
        let back = read_all(format!("{line}\n\n{line}\n").as_bytes()).unwrap();
        assert_eq!(back, vec![r.clone(), r.clone()]);
        assert!(r.ok());
        assert_eq!(r.worker_tokens(), 105);
    }

    #[test]
    fn ok_table() {
        let cases = [
            (Some(200), None, true),
            (Some(200), Some("stream error"), false),
            (Some(503), None, false),
            (None, Some("timeout"), false),
            (None, None, false),
        ];
        for (status, err, want) in cases {
            let r = RequestRecord { status, error: err.map(String::from), ..Default::default() };
            assert_eq!(r.ok(), want, "{status:?} {err:?}");
        }
    }

    #[test]
    fn malformed_line_is_an_error() {
        let err = read_all("{\"index\": 1}\n".as_bytes()).unwrap_err();
        assert!(matches!(err, RecordError::Malformed { line: 1, .. }), "{err}");
    }
}
