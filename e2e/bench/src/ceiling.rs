//! The trace's intrinsic reuse: the best block-weighted hit rate any router can reach.
//!
//! With an infinite cache and perfect routing, a block is a hit exactly when its hash id was seen
//! earlier in the replayed window (caches start empty, as they do after the reset between
//! policies). That ratio — reused blocks / all blocks — is the ceiling the report compares every
//! policy against. The traces README quotes 36.6% for the whole conversation trace.
//!
//! Two weightings are computed because the engine counts tokens, not trace blocks:
//! - **block-weighted** (the README's definition): every hash id counts 1;
//! - **token-weighted**: every block counts its real token count (the last block of a prompt is
//!   usually shorter than 512), which is what `vllm:prefix_cache_hits_total /
//!   vllm:prefix_cache_queries_total` measures. The two differ by about a point on this trace.

use crate::trace::TraceRecord;
use serde::{Deserialize, Serialize};
use std::collections::HashSet;

/// Reuse counts for a sequence of requests replayed in order.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ceiling {
    /// Requests considered.
    pub requests: u64,
    /// All blocks (hash ids) of all prompts.
    pub blocks_total: u64,
    /// Blocks whose hash id appeared earlier in the sequence.
    pub blocks_reused: u64,
    /// All prompt tokens.
    pub tokens_total: u64,
    /// Tokens in reused blocks (a reused block counts its length in this prompt).
    pub tokens_reused: u64,
}

impl Ceiling {
    /// Block-weighted ceiling, `blocks_reused / blocks_total` (0 for an empty window).
    pub fn block_rate(&self) -> f64 {
        ratio(self.blocks_reused, self.blocks_total)
    }

    /// Token-weighted ceiling, `tokens_reused / tokens_total` (0 for an empty window).
    pub fn token_rate(&self) -> f64 {
        ratio(self.tokens_reused, self.tokens_total)
    }
}

impl std::ops::AddAssign for Ceiling {
    fn add_assign(&mut self, o: Self) {
        self.requests += o.requests;
        self.blocks_total += o.blocks_total;
        self.blocks_reused += o.blocks_reused;
        self.tokens_total += o.tokens_total;
        self.tokens_reused += o.tokens_reused;
    }
}

fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        0.0
    } else {
        num as f64 / den as f64
    }
}

/// Computes the intrinsic ceiling of `records` replayed in the given order.
/// Memory is one set entry per distinct hash id (bounded by the trace's size).
pub fn intrinsic<'a, I>(records: I) -> Ceiling
where
    I: IntoIterator<Item = &'a TraceRecord>,
{
    let mut seen: HashSet<u64> = HashSet::new();
    let mut c = Ceiling::default();
    for r in records {
        c.requests += 1;
        for (j, &id) in r.hash_ids.iter().enumerate() {
            let tokens = u64::from(r.block_tokens(j));
            if tokens == 0 {
                // Ids past input_length carry no prompt tokens: not part of the prompt.
                break;
            }
            c.blocks_total += 1;
            c.tokens_total += tokens;
            if !seen.insert(id) {
                c.blocks_reused += 1;
                c.tokens_reused += tokens;
            }
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{parse, Selection};

    fn rec(input: u32, ids: &[u64]) -> TraceRecord {
        TraceRecord {
            timestamp: 0.0,
            input_length: input,
            output_length: 1,
            hash_ids: ids.to_vec(),
        }
    }

    #[test]
    fn ceiling_table() {
        struct Case {
            name: &'static str,
            recs: Vec<TraceRecord>,
            blocks: (u64, u64),
            tokens: (u64, u64),
        }
        let cases = vec![
            Case { name: "empty", recs: vec![], blocks: (0, 0), tokens: (0, 0) },
            Case {
                name: "single",
                recs: vec![rec(1024, &[0, 1])],
                blocks: (0, 2),
                tokens: (0, 1024),
            },
            Case {
                name: "growing conversation",
                recs: vec![rec(1024, &[0, 1]), rec(1300, &[0, 1, 2]), rec(1600, &[0, 1, 2, 3])],
                blocks: (5, 9),
                tokens: (512 * 2 + 512 * 3, 1024 + 1300 + 1600),
            },
            Case {
                name: "partial block reused counts its own length",
                recs: vec![rec(1024, &[0, 1]), rec(600, &[0, 1])],
                blocks: (2, 4),
                tokens: (600, 1624),
            },
            Case {
                name: "repeat within a request counts",
                recs: vec![rec(1536, &[7, 7, 7])],
                blocks: (2, 3),
                tokens: (1024, 1536),
            },
        ];
        for c in cases {
            let got = intrinsic(&c.recs);
            assert_eq!((got.blocks_reused, got.blocks_total), c.blocks, "{}", c.name);
            assert_eq!((got.tokens_reused, got.tokens_total), c.tokens, "{}", c.name);
            assert_eq!(got.requests, c.recs.len() as u64, "{}", c.name);
        }
        assert_eq!(Ceiling::default().block_rate(), 0.0);
    }

    #[test]
    fn full_conversation_trace_matches_the_readme() {
        let path = crate::trace::default_trace_path(std::env::var(crate::trace::TRACE_ENV).ok());
        let file = std::fs::File::open(&path)
            .unwrap_or_else(|e| panic!("open {} (set KVMESH_TRACE): {e}", path.display()));
        let recs = parse(std::io::BufReader::new(file)).unwrap();
        assert_eq!(recs.len(), 12_031);
        let all = intrinsic(&recs);
        assert!((all.block_rate() - 0.366).abs() <= 0.001, "block rate {}", all.block_rate());
        // First 10 minutes, the window the targets use.
        let sel = Selection { window_ms: Some(600_000.0), ..Default::default() }.apply(&recs);
        let ten = intrinsic(sel.iter().map(|s| &s.record));
        assert_eq!(ten.requests, 1750);
        assert!((ten.block_rate() - 0.2840).abs() <= 0.0005, "10 min {}", ten.block_rate());
        assert!(ten.token_rate() > ten.block_rate());
    }
}
