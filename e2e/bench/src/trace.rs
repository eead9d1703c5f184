//! Mooncake-format trace parsing and window selection (pure; the caller hands in a reader).
//!
//! One request per JSONL line: `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
//! "hash_ids": [..]}` where each hash id names one 512-token block and equal ids mean equal
//! content. Unknown keys are ignored (other Mooncake traces carry extra fields). A malformed line
//! is an error naming the line, never skipped: a silently shortened trace would change every
//! number in the report. Blank lines are allowed.

use serde::Deserialize;
use std::io::BufRead;
use std::path::PathBuf;

/// Environment variable naming the trace file used by default (tests and tools).
pub const TRACE_ENV: &str = "KVMESH_TRACE";

/// Where the conversation trace lives: the value of [`TRACE_ENV`] when set (pass it in), else
/// `<repo>/../shared/traces/mooncake_conversation_trace.jsonl`, the repo being where this crate
/// was built from.
pub fn default_trace_path(env_value: Option<String>) -> PathBuf {
    match env_value {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/traces/mooncake_conversation_trace.jsonl"),
    }
}

/// Tokens per Mooncake hash block. Fixed by the trace format, not the engine's block size.
pub const TRACE_BLOCK_TOKENS: u32 = 512;

/// One request of the trace, validated.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TraceRecord {
    /// Arrival time relative to the start of the trace, in milliseconds.
    pub timestamp: f64,
    /// Prompt length in tokens.
    pub input_length: u32,
    /// Output length in tokens (sent as `max_tokens`).
    pub output_length: u32,
    /// Block ids, one per 512 prompt tokens, in prompt order.
    pub hash_ids: Vec<u64>,
}

/// A record selected for replay, with its line index in the trace (0-based, blank lines skipped
/// do not count) so a result can be traced back to its source line.
#[derive(Debug, Clone, PartialEq)]
pub struct Indexed {
    /// 0-based index of the request in the trace file.
    pub index: usize,
    /// The request.
    pub record: TraceRecord,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// Reading the underlying file failed.
    #[error("reading trace: {0}")]
    Io(#[from] std::io::Error),
    /// A line is not a valid trace record.
    #[error("trace line {line}: {reason}")]
    Malformed {
        /// 1-based line number in the file.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
}

impl TraceRecord {
    /// Checks the invariants the replayer relies on: a finite non-negative timestamp, a
    /// non-empty prompt, and enough blocks to cover `input_length`.
    pub fn validate(&self) -> Result<(), String> {
        if !self.timestamp.is_finite() || self.timestamp < 0.0 {
            return Err(format!("timestamp {} is not a non-negative number", self.timestamp));
        }
        if self.input_length == 0 {
            return Err("input_length is 0".into());
        }
        if self.hash_ids.is_empty() {
            return Err("hash_ids is empty".into());
        }
        let covered = self.hash_ids.len() as u64 * u64::from(TRACE_BLOCK_TOKENS);
        if covered < u64::from(self.input_length) {
            return Err(format!(
                "{} hash_ids cover {covered} tokens < input_length {}",
                self.hash_ids.len(),
                self.input_length
            ));
        }
        Ok(())
    }

    /// Tokens of block `j` of this request's prompt: 512, except a shorter last block.
    pub fn block_tokens(&self, j: usize) -> u32 {
        let start = (j as u64) * u64::from(TRACE_BLOCK_TOKENS);
        let rest = u64::from(self.input_length).saturating_sub(start);
        rest.min(u64::from(TRACE_BLOCK_TOKENS)) as u32
    }
}

/// Parses a whole trace. Errors carry the 1-based line number.
pub fn parse<R: BufRead>(reader: R) -> Result<Vec<TraceRecord>, TraceError> {
    let mut out = Vec::new();
    for (i, line) in reader.lines().enumerate() {
        let line = line?;
        let trimmed = line.trim();
        if trimmed.is_empty() {
            continue;
        }
        let rec: TraceRecord = serde_json::from_str(trimmed)
            .map_err(|e| TraceError::Malformed { line: i + 1, reason: e.to_string() })?;
        rec.validate().map_err(|reason| TraceError::Malformed { line: i + 1, reason })?;
        out.push(rec);
    }
    Ok(out)
}

/// Which part of the trace to replay. All fields optional; the default is the whole trace.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Selection {
    /// Skip requests before this trace time (ms).
    pub window_start_ms: Option<f64>,
    /// Keep requests with `timestamp < window_start + window_ms`.
    pub window_ms: Option<f64>,
    /// Then keep at most the first N.
    pub first: Option<usize>,
}

impl Selection {
    /// Human-readable description for report headers.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        let start = self.window_start_ms.unwrap_or(0.0);
        match self.window_ms {
            Some(w) => parts.push(format!("trace time [{start} ms, {} ms)", start + w)),
            None if start > 0.0 => parts.push(format!("trace time from {start} ms")),
            None => parts.push("whole trace".to_string()),
        }
        if let Some(n) = self.first {
            parts.push(format!("first {n} requests"));
        }
        parts.join(", ")
    }

    /// Applies the selection, keeping trace order and original indices.
    pub fn apply(&self, records: &[TraceRecord]) -> Vec<Indexed> {
        let start = self.window_start_ms.unwrap_or(f64::NEG_INFINITY);
        let end = match (self.window_start_ms, self.window_ms) {
            (_, None) => f64::INFINITY,
            (s, Some(w)) => s.unwrap_or(0.0) + w,
        };
        let limit = self.first.unwrap_or(usize::MAX);
        records
            .iter()
            .enumerate()
            .filter(|(_, r)| r.timestamp >= start && r.timestamp < end)
            .take(limit)
            .map(|(index, r)| Indexed { index, record: r.clone() })
            .collect()
    }
}

/// Send offsets (ms from the start of the replay) for the selected requests: trace time
/// relative to the first selected request, divided by the speed-up. Trace order is preserved;
/// a trace whose timestamps go backwards is replayed with the later line not earlier than the
/// one before it (monotone offsets keep the scheduler a single forward pass).
pub fn send_offsets_ms(selected: &[Indexed], speedup: f64) -> Vec<f64> {
    let speedup = if speedup.is_finite() && speedup > 0.0 { speedup } else { 1.0 };
    let base = selected.first().map(|s| s.record.timestamp).unwrap_or(0.0);
    let mut last = 0.0_f64;
    selected
        .iter()
        .map(|s| {
            let off = ((s.record.timestamp - base) / speedup).max(last);
            last = off;
            off
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: f64, input: u32, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: ts,
            input_length: input,
            output_length: 10,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn parses_lines_and_ignores_unknown_keys_and_blanks() {
        let text = "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n\n\
                    {\"timestamp\": 1000.5, \"input_length\": 10, \"output_length\": 1, \"hash_ids\": [0], \"extra\": true}\n";
        let recs = parse(text.as_bytes()).unwrap();
        assert_eq!(recs.len(), 2);
        assert_eq!(recs[0], rec(0.0, 600, &[0, 1]).with_output(5));
        assert_eq!(recs[1].timestamp, 1000.5);
    }

    impl TraceRecord {
        fn with_output(mut self, n: u32) -> Self {
            self.output_length = n;
            self
        }
    }

    #[test]
    fn malformed_lines_name_the_line() {
        let cases: &[(&str, &str)] = &[
            ("{\"timestamp\": 0}", "missing field"),
            ("not json", "expected"),
            ("{\"timestamp\": -1, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}", "timestamp"),
            ("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": [0]}", "input_length is 0"),
            ("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": []}", "empty"),
            ("{\"timestamp\": 0, \"input_length\": 513, \"output_length\": 1, \"hash_ids\": [0]}", "cover 512"),
        ];
        for (line, want) in cases {
            let text = format!("{{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [0]}}\n{line}\n");
            match parse(text.as_bytes()) {
                Err(TraceError::Malformed { line: 2, reason }) => {
                    assert!(reason.contains(want), "{line}: {reason}")
                }
                other => panic!("{line}: {other:?}"),
            }
        }
    }

    #[test]
    fn block_tokens_cuts_the_last_block() {
        let r = rec(0.0, 1100, &[0, 1, 2]);
        assert_eq!((r.block_tokens(0), r.block_tokens(1), r.block_tokens(2)), (512, 512, 76));
        assert_eq!(r.block_tokens(3), 0);
    }

    #[test]
    fn selection_table() {
        let recs: Vec<_> = (0..10).map(|i| rec(f64::from(i) * 1000.0, 1, &[0])).collect();
        let cases: &[(Selection, &[usize])] = &[
            (Selection::default(), &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
            (Selection { first: Some(3), ..Default::default() }, &[0, 1, 2]),
            (Selection { window_ms: Some(2500.0), ..Default::default() }, &[0, 1, 2]),
            (
                Selection { window_start_ms: Some(4000.0), window_ms: Some(2000.0), first: None },
                &[4, 5],
            ),
            (Selection { window_start_ms: Some(8500.0), window_ms: None, first: None }, &[9]),
            (Selection { window_start_ms: Some(1000.0), window_ms: None, first: Some(2) }, &[1, 2]),
        ];
        for (sel, want) in cases {
            let got: Vec<usize> = sel.apply(&recs).iter().map(|s| s.index).collect();
            assert_eq!(&got, want, "{sel:?}");
        }
    }

    #[test]
    fn offsets_are_relative_scaled_and_monotone() {
        let recs = vec![rec(5000.0, 1, &[0]), rec(7000.0, 1, &[0]), rec(6000.0, 1, &[0])];
        let sel = Selection::default().apply(&recs);
        assert_eq!(send_offsets_ms(&sel, 2.0), vec![0.0, 1000.0, 1000.0]);
        assert_eq!(send_offsets_ms(&sel, 0.0), vec![0.0, 2000.0, 2000.0]);
        assert!(send_offsets_ms(&[], 1.0).is_empty());
    }

    #[test]
    fn describe_mentions_window_and_first() {
        let s = Selection { window_start_ms: None, window_ms: Some(600_000.0), first: Some(5) };
        assert_eq!(s.describe(), "trace time [0 ms, 600000 ms), first 5 requests");
        assert_eq!(Selection::default().describe(), "whole trace");
    }
}
