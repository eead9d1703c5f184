//! The offload-tier workload (issue 46.1): a working set of shared documents that exceeds the
//! fleet's GPU KV cache but fits GPU + CPU (pure).
//!
//! Each request is one of [`DOCUMENTS`] documents of 3–5k tokens (token ids; the document drawn
//! uniformly, so a document's reuses are far apart) followed by a question of its own (32–160
//! tokens), `max_tokens` 32, Poisson arrivals: a RAG / long-context Q&A fleet, the shape of
//! llm-d's hybrid-tier study (shared long prefixes, more of them than GPU memory holds).
//!
//! The fleet ([`GPU_BLOCKS`], [`CPU_BLOCKS`] per worker, set by the sweep for this workload) is
//! sized so that, with 4 workers of 16-token blocks, the documents (~256k tokens) are twice the
//! fleet's GPU cache (4 × 32k tokens) and two thirds of its GPU + CPU (4 × 96k), while one
//! worker's GPU + CPU (96k) holds little more than a third of them. A router that keeps each
//! document on one worker and counts that worker's CPU copy as a (cheaper than recomputing) hit
//! serves nearly every document from cache; one that forgets a document once its GPU copy is
//! evicted spreads it over workers, each copy evicting others; round_robin's per-worker LRU
//! caches see every document and hold about a third.
//!
//! Deterministic from the seed; request `i` depends only on `(seed, i)`.

use super::gen::{arrivals, finish, GenConfig};
use super::{Content, Schedule, Session, Turn, WorkloadKind};
use crate::rng::{mix, SplitMix64};

/// Shared documents.
pub const DOCUMENTS: usize = 64;
/// GPU KV blocks per worker of the workload's fleet (`--num-gpu-blocks`).
pub const GPU_BLOCKS: u64 = 2048;
/// CPU offload tier blocks per worker (`--cpu-offload-blocks`).
pub const CPU_BLOCKS: u64 = 4096;
/// The simulators' CPU tier load rate (`--cpu-load-tokens-per-s`, modelled time): the indexer's
/// default `routing.cpu_load_tokens_per_s` (at the workload's speed-up of 1 both clocks agree).
pub const CPU_LOAD_TOKENS_PER_S: f64 = 100_000.0;

/// Random token ids clear of DeepSeek's special tokens, as the other token workloads.
const TOKEN_LO: u64 = 1000;
const TOKEN_HI: u64 = 100_000;

fn tokens(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.range_u64(TOKEN_LO, TOKEN_HI) as u32).collect()
}

/// Document `d`'s token ids (3–5k), the same in every request and point of a seed.
pub fn document(seed: u64, d: usize) -> Vec<u32> {
    let mut rng = SplitMix64::new(mix(seed, 0x7D0C_0000 + d as u64));
    let len = rng.range_u64(3072, 5121) as usize;
    tokens(&mut rng, len)
}

/// The simulator flags of the workload's CPU tier (the GPU size is the fleet's `num_gpu_blocks`).
pub fn sim_args() -> Vec<String> {
    vec![
        "--cpu-offload-blocks".into(),
        CPU_BLOCKS.to_string(),
        "--cpu-load-tokens-per-s".into(),
        CPU_LOAD_TOKENS_PER_S.to_string(),
    ]
}

/// The workload at `rate` requests per second.
pub fn tiers(cfg: &GenConfig, rate: f64) -> Schedule {
    let docs: Vec<Vec<u32>> = (0..DOCUMENTS).map(|d| document(cfg.seed, d)).collect();
    let mut arr = SplitMix64::new(mix(cfg.seed, 0x7E25));
    let sessions = arrivals(&mut arr, rate, cfg.duration_s)
        .into_iter()
        .enumerate()
        .map(|(i, start_ms)| {
            let mut rng = SplitMix64::new(mix(mix(cfg.seed, 0x7E), i as u64));
            let d = rng.range_u64(0, DOCUMENTS as u64) as usize;
            let question = rng.range_u64(32, 161) as usize;
            let mut ids = docs[d].clone();
            ids.extend(tokens(&mut rng, question));
            let len = ids.len();
            Session {
                id: format!("tiers-{}-{i}", cfg.seed),
                start_ms,
                content: Content::Tokens(ids),
                turns: vec![Turn { upto: len, think_ms: 0.0, max_tokens: 32 }],
                model: None,
            }
        })
        .collect();
    finish(WorkloadKind::Tiers, rate, sessions, cfg, "tokens")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> GenConfig {
        GenConfig { seed: 3, duration_s: 60.0, think_divisor: 1.0, block_size: 16 }
    }

    #[test]
    fn the_documents_exceed_the_fleets_gpu_and_fit_gpu_and_cpu() {
        let bs = 16u64;
        let workers = 4u64;
        let working_set: u64 = (0..DOCUMENTS).map(|d| document(0, d).len() as u64).sum();
        assert!(working_set > workers * GPU_BLOCKS * bs, "{working_set} tokens fit the GPUs");
        assert!(
            working_set < workers * (GPU_BLOCKS + CPU_BLOCKS) * bs * 3 / 4,
            "{working_set} tokens: GPU + CPU must hold them with room for the questions"
        );
        assert!(working_set > (GPU_BLOCKS + CPU_BLOCKS) * bs * 2, "one worker could hold half");
    }

    #[test]
    fn requests_are_a_document_and_a_question_of_their_own() {
        let s = tiers(&cfg(), 5.0);
        assert_eq!(s.kind, WorkloadKind::Tiers);
        assert!((200..400).contains(&s.sessions.len()), "{}", s.sessions.len());
        let docs: Vec<Vec<u32>> = (0..DOCUMENTS).map(|d| document(3, d)).collect();
        let mut used = std::collections::HashSet::new();
        for sess in &s.sessions {
            let Content::Tokens(ids) = &sess.content else { panic!("token prompts") };
            let d =
                docs.iter().position(|doc| ids.starts_with(doc)).expect("starts with a document");
            used.insert(d);
            assert!((32..=160).contains(&(ids.len() - docs[d].len())));
            assert_eq!(sess.turns.len(), 1);
        }
        assert!(used.len() > DOCUMENTS / 2, "documents drawn across the set: {}", used.len());
        // Deterministic, and the ceiling counts the documents' reuse: most of every request after
        // a document's first.
        assert_eq!(tiers(&cfg(), 5.0).sessions, s.sessions);
        let c = s.ceiling_rate();
        assert!(c > 0.6 && c < 0.99, "{c}");
    }
}
