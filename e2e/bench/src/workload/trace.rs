//! The Mooncake conversation trace as a sweep workload (pure).
//!
//! A point replays the trace's first `window_ms` of trace time (default 10 minutes: long enough
//! for conversations to come back, which is where the trace's reuse is) compressed into the
//! point's `duration_s`, and reaches its rate by **thinning whole conversations**: a
//! conversation is kept iff its key's hash falls under `rate × duration / requests in the
//! window`. Kept conversations keep every request, their order and their (compressed) gaps, so
//! the reuse structure — and the ceiling — is the trace's at every rate; higher rates keep a
//! superset of the conversations of lower ones. (Compressing time alone would leave a 30-s
//! point with the trace's first seconds, where almost nothing repeats yet.) Requests are
//! open-loop single-turn sessions whose id is the conversation key
//! (`conversation::session_id`); prompts are the token ids of `blocks`; output lengths are the
//! trace's, capped at `max_output_tokens` (decode is not what this benchmark ranks, and every
//! streamed token costs client, Envoy and simulator CPU). The ceiling is counted over exactly
//! the kept requests **in the engines' unit**: tokens in engine blocks of `block_size`
//! (`super::sessions_ceiling`, as for the other token workloads), not the trace's 512-token
//! blocks. The engines' hit rate is tokens; the block-weighted trace ceiling
//! (`crate::ceiling::intrinsic`) weighs a short last block like a full one and sat ~1 % below
//! the token-weighted one, so two ring_hash points measured 18.94 % against 18.72 % and 16.87 %
//! against 16.80 % (token-weighted 19.09 %, 17.08 %); and a trace block first sent cut short
//! (a shorter prompt) and later whole counts as reused whole there, while an engine can only hit
//! the part that was sent. A rate above
//! `requests in the window / duration` keeps everything and is capped there (the schedule's `rate`
//! says what was offered).

use super::{Content, Schedule, Session, Turn, WorkloadKind};
use crate::blocks;
use crate::conversation;
use crate::rng::mix;
use crate::trace::TraceRecord;

/// How the trace becomes a point's schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceConfig {
    /// Requests due in `[0, duration_s)` after compression are kept.
    pub duration_s: f64,
    /// Trace time replayed by every point, ms (from the first record given).
    pub window_ms: f64,
    /// Seed of the hash id → tokens mapping.
    pub token_seed: u64,
    /// Conversation key position.
    pub anchor_block: usize,
    /// `max_tokens` = min(output_length, this), at least 1.
    pub max_output_tokens: u32,
    /// Engine KV block size: the ceiling counts engine blocks.
    pub block_size: usize,
}

impl Default for TraceConfig {
    fn default() -> Self {
        Self {
            duration_s: 60.0,
            window_ms: 600_000.0,
            token_seed: 0,
            anchor_block: 1,
            max_output_tokens: 128,
            block_size: 16,
        }
    }
}

/// Conversations are kept iff this hash of their key, as a fraction of 2^64, is below the keep share.
fn keep_hash(key: u64) -> f64 {
    mix(key, 0x7ACE) as f64 / 18_446_744_073_709_551_616.0
}

/// The schedule of one point: `window_ms` of the trace in `duration_s`, thinned to `rate` requests/s.
pub fn schedule(records: &[TraceRecord], cfg: &TraceConfig, rate: f64) -> Schedule {
    let t0 = records.first().map(|r| r.timestamp).unwrap_or(0.0);
    let window: Vec<&TraceRecord> =
        records.iter().take_while(|r| r.timestamp - t0 < cfg.window_ms).collect();
    let compression = cfg.window_ms / (cfg.duration_s * 1000.0).max(1e-9);
    let share = if window.is_empty() || rate.is_nan() || rate <= 0.0 {
        0.0
    } else {
        rate * cfg.duration_s / window.len() as f64
    };
    let selected: Vec<&TraceRecord> = window
        .into_iter()
        .filter(|r| keep_hash(conversation::key(r, cfg.anchor_block)) < share)
        .collect();
    let sessions: Vec<Session> = selected
        .iter()
        .map(|r| {
            let ids = blocks::prompt(r, cfg.token_seed);
            let upto = ids.len();
            Session {
                id: conversation::session_id(r, cfg.anchor_block),
                start_ms: (r.timestamp - t0) / compression,
                content: Content::Tokens(ids),
                turns: vec![Turn {
                    upto,
                    think_ms: 0.0,
                    max_tokens: r.output_length.clamp(1, cfg.max_output_tokens.max(1)),
                }],
                model: None,
            }
        })
        .collect();
    Schedule {
        kind: WorkloadKind::Trace,
        rate,
        ceiling: super::sessions_ceiling(&sessions, cfg.block_size),
        sessions,
        ceiling_unit: "tokens in engine blocks",
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
    fn thinning_keeps_whole_conversations_at_the_rate() {
        // 40 conversations × 5 requests over 100 s of trace time.
        let recs: Vec<TraceRecord> = (0u32..200)
            .map(|i| rec(f64::from(i) * 500.0, &[0, 1000 + u64::from(i % 40), 5000 + u64::from(i)]))
            .collect();
        let cfg = TraceConfig {
            duration_s: 10.0,
            window_ms: 100_000.0,
            max_output_tokens: 64,
            ..Default::default()
        };
        let full = schedule(&recs, &cfg, 20.0);
        assert_eq!(full.sessions.len(), 200, "rate × duration = everything");
        assert_eq!(full.sessions[3].start_ms, 150.0, "100 s of trace in 10 s");
        assert!(full.sessions.iter().all(|s| s.turns[0].max_tokens == 64));
        let half = schedule(&recs, &cfg, 10.0);
        assert!((60..=140).contains(&half.sessions.len()), "about half: {}", half.sessions.len());
        // Whole conversations: each kept key keeps all 5 of its requests.
        let mut per_key = std::collections::HashMap::<String, usize>::new();
        for s in &half.sessions {
            *per_key.entry(s.id.clone()).or_default() += 1;
        }
        assert!(per_key.values().all(|&n| n == 5), "{per_key:?}");
        // Higher rates keep a superset; the ceiling stays the trace's structure.
        let quarter = schedule(&recs, &cfg, 5.0);
        let ids = |p: &Schedule| {
            p.sessions.iter().map(|s| s.id.clone()).collect::<std::collections::HashSet<_>>()
        };
        assert!(ids(&quarter).is_subset(&ids(&half)));
        // Per kept conversation of 5: block 0 shared by all (first use misses), block 1 reused 4
        // times; each 512-token trace block is 32 engine blocks of 16.
        let k = per_key.len() as u64;
        assert_eq!(
            (half.ceiling.blocks_reused, half.ceiling.blocks_total),
            (32 * (5 * k - 1 + 4 * k), 32 * 15 * k)
        );
        assert_eq!(half.ceiling.tokens_total, 512 * 15 * k);
        assert_eq!(half.ceiling_rate(), half.ceiling.token_rate());
        assert!(schedule(&recs, &cfg, 0.0).sessions.is_empty());
        assert!(schedule(&[], &cfg, 1.0).sessions.is_empty());
    }

    #[test]
    fn ceiling_is_in_engine_blocks_of_what_was_sent() {
        // (first input_length, second input_length, same ids [7, 8]) → tokens reused of the second.
        let cases = [
            // The second sends block 8 whole after the first sent 88 of its tokens: an engine can
            // reuse 37 full 16-token blocks (592 tokens); the trace's block-weighted count says
            // both blocks, its token-weighted one 1,024 tokens.
            ("partial then whole", 600, 1024, 592),
            // The reverse: the shorter prompt's full blocks were sent before (its 8-token tail is no
            // engine block).
            ("whole then partial", 1024, 600, 592),
            ("equal", 1024, 1024, 1024),
        ];
        for (name, a, b, reused) in cases {
            let recs = vec![
                TraceRecord {
                    timestamp: 0.0,
                    input_length: a,
                    output_length: 1,
                    hash_ids: vec![7, 8],
                },
                TraceRecord {
                    timestamp: 1.0,
                    input_length: b,
                    output_length: 1,
                    hash_ids: vec![7, 8],
                },
            ];
            let cfg = TraceConfig { duration_s: 10.0, window_ms: 10_000.0, ..Default::default() };
            let p = schedule(&recs, &cfg, 100.0);
            assert_eq!(p.sessions.len(), 2, "{name}");
            assert_eq!(
                (p.ceiling.tokens_reused, p.ceiling.tokens_total),
                (reused, u64::from(a + b)),
                "{name}"
            );
            let trace = crate::ceiling::intrinsic(&recs);
            assert!(
                p.ceiling.token_rate() <= trace.token_rate() + 1e-12,
                "{name}: never above the trace's token-weighted count"
            );
        }
    }
}
