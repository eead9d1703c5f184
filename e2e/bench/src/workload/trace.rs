//! The Mooncake conversation trace as a sweep workload (pure).
//!
//! A point at `rate` requests/s compresses trace time by `rate / native_rate` (the native rate
//! is the trace's mean over its first `reference_window_ms`) and keeps the requests due in
//! `[0, duration)`, in trace order, each an open-loop single-turn session whose id is its
//! conversation key (`conversation::session_id`). Prompts are the token ids of `blocks`; output
//! lengths are the trace's, capped at `max_output_tokens` (decode is not what this benchmark
//! ranks, and every streamed token costs client, Envoy and simulator CPU). The ceiling is the
//! trace's own block-weighted intrinsic ceiling over exactly the selected requests.

use super::{Content, Plan, Session, Turn, WorkloadKind};
use crate::blocks;
use crate::ceiling::intrinsic;
use crate::conversation;
use crate::trace::TraceRecord;

/// How the trace becomes a point's plan.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceConfig {
    /// Requests due in `[0, duration_s)` after compression are kept.
    pub duration_s: f64,
    /// The native rate is measured over the trace's first this-many ms.
    pub reference_window_ms: f64,
    /// Seed of the hash id → tokens mapping.
    pub token_seed: u64,
    /// Conversation key position.
    pub anchor_block: usize,
    /// `max_tokens` = min(output_length, this), at least 1.
    pub max_output_tokens: u32,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self {
            duration_s: 60.0,
            reference_window_ms: 600_000.0,
            token_seed: 0,
            anchor_block: 1,
            max_output_tokens: 128,
        }
    }
}

/// Requests per second of `records` over their first `window_ms` (0 when empty).
pub fn native_rate(records: &[TraceRecord], window_ms: f64) -> f64 {
    let Some(t0) = records.first().map(|r| r.timestamp) else {
        return 0.0;
    };
    let n = records.iter().take_while(|r| r.timestamp - t0 < window_ms).count();
    if window_ms > 0.0 {
        n as f64 / (window_ms / 1000.0)
    } else {
        0.0
    }
}

/// The plan of one point: the trace compressed to `rate` requests/s, `duration_s` of it.
pub fn plan(records: &[TraceRecord], cfg: &TraceConfig, rate: f64) -> Plan {
    let native = native_rate(records, cfg.reference_window_ms);
    let factor = if native > 0.0 { rate / native } else { 0.0 };
    let t0 = records.first().map(|r| r.timestamp).unwrap_or(0.0);
    let selected: Vec<&TraceRecord> = if factor > 0.0 {
        records
            .iter()
            .take_while(|r| (r.timestamp - t0) / factor < cfg.duration_s * 1000.0)
            .collect()
    } else {
        Vec::new()
    };
    let sessions = selected
        .iter()
        .map(|r| {
            let ids = blocks::prompt(r, cfg.token_seed);
            let upto = ids.len();
            Session {
                id: conversation::session_id(r, cfg.anchor_block),
                start_ms: (r.timestamp - t0) / factor,
                content: Content::Tokens(ids),
                turns: vec![Turn {
                    upto,
                    think_ms: 0.0,
                    max_tokens: r.output_length.clamp(1, cfg.max_output_tokens.max(1)),
                }],
            }
        })
        .collect();
    Plan {
        kind: WorkloadKind::Trace,
        rate,
        sessions,
        ceiling: intrinsic(selected.iter().copied()),
        ceiling_block_weighted: true,
        ceiling_unit: "512-token trace blocks",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(ts: f64, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: ts,
            input_length: 512 * ids.len() as u32,
            output_length: 500,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn compression_keeps_the_requests_due_in_the_duration() {
        // 10 requests in the first 10 s: native 1 req/s over a 10 s reference window.
        let recs: Vec<TraceRecord> = (0u32..20)
            .map(|i| rec(f64::from(i) * 1000.0, &[0, 100 + u64::from(i % 3)]))
            .collect();
        let cfg = TraceConfig {
            duration_s: 5.0,
            reference_window_ms: 10_000.0,
            max_output_tokens: 64,
            ..Default::default()
        };
        assert_eq!(native_rate(&recs, 10_000.0), 1.0);
        let p = plan(&recs, &cfg, 2.0);
        // ×2: request i is due at i/2 s; due before 5 s → i < 10.
        assert_eq!(p.sessions.len(), 10);
        assert_eq!(p.sessions[3].start_ms, 1500.0);
        assert!(p.sessions.iter().all(|s| s.turns[0].max_tokens == 64));
        assert_eq!(p.sessions[1].id, "conv-101");
        // Block 0 is shared by all, each conversation's block 1 is reused after its first use.
        assert_eq!((p.ceiling.blocks_reused, p.ceiling.blocks_total), (9 + 7, 20));
        assert!((p.ceiling_rate() - 16.0 / 20.0).abs() < 1e-12);
        assert!(plan(&recs, &cfg, 0.0).sessions.is_empty());
        assert!(plan(&[], &cfg, 1.0).sessions.is_empty());
    }
}
