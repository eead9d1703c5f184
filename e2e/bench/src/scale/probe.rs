//! The route probes: chat conversations of about 8k tokens whose history some workers of the
//! synthetic fleet hold, continued by requests POSTed to the indexer's `/v1/route` over the loaded
//! index (the whole route: body read, tokenization, `find_matches`, scoring, answer).
//!
//! The history's token ids are the engine's (the model's chat template, then its tokenizer,
//! `kvmesh_tokens`, as the indexer and `vllm-sim` compute them), so its blocks, stored through
//! the holders' KV event streams, are what the indexer finds for the continuation. Every probe
//! shares one system prompt; its blocks are held by a quarter of the fleet (many holders per block
//! — the bitmap path of the index), each probe's whole history by one worker and its first half
//! by the next one.

use kvmesh_core::openai::ChatMessage;
use kvmesh_sim::events::{EventBatch, KvEvent};

use super::model::engine_hash;
use kvmesh_e2e::client::filler;

/// Segment keys of the probes' blocks (apart from the workload model's: bit 62, not 63).
const PROBE: u64 = 1 << 62;
const SHARED: u64 = PROBE | 0xffff_ffff;

/// One probe conversation.
#[derive(Debug, Clone)]
pub struct Probe {
    /// Its messages so far (system, then user/assistant turns).
    pub history: Vec<ChatMessage>,
    /// The token ids of the history's prompt (with the generation prompt).
    pub tokens: Vec<u32>,
}

/// Every probe, and how many leading blocks they share.
#[derive(Debug, Clone)]
pub struct Probes {
    pub probes: Vec<Probe>,
    pub shared_blocks: usize,
    pub block_size: usize,
}

fn msg(role: &str, content: String) -> ChatMessage {
    ChatMessage { role: role.into(), content: content.into() }
}

/// `count` conversations of at least `tokens` tokens each, tokenized with `encode`.
pub fn build(
    count: usize,
    tokens: usize,
    block_size: usize,
    mut encode: impl FnMut(&[ChatMessage]) -> anyhow::Result<Vec<u32>>,
) -> anyhow::Result<Probes> {
    let system = msg("system", filler(1, 600));
    let mut probes = Vec::with_capacity(count);
    for p in 0..count as u64 {
        let mut history = vec![system.clone()];
        let mut turn = 0u64;
        loop {
            let seed = ((p + 2) << 20) | turn;
            history.push(msg("user", filler(seed, 150)));
            let ids = encode(&history)?;
            if ids.len() >= tokens || turn > 1_000 {
                probes.push(Probe { history, tokens: ids });
                break;
            }
            history.push(msg("assistant", filler(seed ^ 0x5555, 250)));
            turn += 1;
        }
    }
    let first = probes.first().map(|p| p.tokens.clone()).unwrap_or_default();
    let common = probes
        .iter()
        .map(|p| p.tokens.iter().zip(&first).take_while(|(a, b)| a == b).count())
        .min()
        .unwrap_or(0);
    // With one probe nothing is "shared": keep the shared holders to the system prompt's length.
    let shared_blocks = common.min(first.len().saturating_sub(block_size)) / block_size.max(1);
    Ok(Probes { probes, shared_blocks, block_size })
}

impl Probes {
    /// Full blocks of probe `p`'s history.
    pub fn blocks(&self, p: usize) -> usize {
        self.probes.get(p).map_or(0, |x| x.tokens.len() / self.block_size.max(1))
    }

    /// The worker holding probe `p` whole (the next one holds its first half).
    pub fn holder(&self, p: usize, workers: u32) -> u32 {
        ((p as u64 * u64::from(workers)) / self.probes.len().max(1) as u64) as u32
    }

    /// The engine hash of block `i` of probe `p`: shared blocks hash alike on every worker.
    fn hash(&self, p: usize, i: usize) -> u64 {
        if i < self.shared_blocks {
            engine_hash(SHARED, i as u32)
        } else {
            engine_hash(PROBE | p as u64, i as u32)
        }
    }

    /// `BlockStored` events for the first `n` blocks of probe `p`, `chunk` blocks per event.
    fn stores(&self, p: usize, n: usize, chunk: usize) -> Vec<KvEvent> {
        let bs = self.block_size;
        let mut events = Vec::new();
        let mut at = 0;
        while at < n {
            let end = (at + chunk.max(1)).min(n);
            events.push(KvEvent::BlockStored {
                block_hashes: (at..end).map(|i| self.hash(p, i)).collect(),
                parent_block_hash: at.checked_sub(1).map(|i| self.hash(p, i)),
                token_ids: self.probes[p].tokens[at * bs..end * bs].to_vec(),
                block_size: bs as u32,
                lora: None,
                extra_keys: Vec::new(),
            });
            at = end;
        }
        events
    }

    /// Per worker, the batches that make it hold what the module docs say: the shared system
    /// blocks on every fourth worker, each probe whole on its holder and half on the next.
    pub fn holdings(&self, workers: u32, chunk: usize) -> Vec<(u32, EventBatch)> {
        let mut out = Vec::new();
        let batch = |events| EventBatch { ts: 0.0, events };
        if self.shared_blocks > 0 && !self.probes.is_empty() {
            for w in (0..workers).step_by(4) {
                out.push((w, batch(self.stores(0, self.shared_blocks, chunk))));
            }
        }
        for p in 0..self.probes.len() {
            let w = self.holder(p, workers);
            out.push((w, batch(self.stores(p, self.blocks(p), chunk))));
            if workers > 1 {
                out.push(((w + 1) % workers, batch(self.stores(p, self.blocks(p) / 2, chunk))));
            }
        }
        out
    }

    /// The `i`-th continuation of probe `p`: its history, an answer and a new user turn, as a chat
    /// request body for `model`.
    pub fn continuation(&self, p: usize, i: u64, model: &str) -> serde_json::Value {
        let mut m: Vec<serde_json::Value> = self.probes[p]
            .history
            .iter()
            .map(|m| serde_json::json!({"role": &*m.role, "content": &*m.content}))
            .collect();
        m.push(serde_json::json!({"role": "assistant", "content": filler(i ^ 0xa5a5, 60)}));
        m.push(serde_json::json!({"role": "user", "content": format!("follow-up {i}: {}", filler(i, 40))}));
        serde_json::json!({"model": model, "messages": m, "stream": true})
    }

    /// Probe `p`'s history as a request body (the turn routed before the continuations).
    pub fn history_body(&self, p: usize, model: &str) -> serde_json::Value {
        let m: Vec<serde_json::Value> = self.probes[p]
            .history
            .iter()
            .map(|m| serde_json::json!({"role": &*m.role, "content": &*m.content}))
            .collect();
        serde_json::json!({"model": model, "messages": m, "stream": true})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in tokenizer: one token per byte of the rendered messages (the shapes only).
    fn bytes(m: &[ChatMessage]) -> anyhow::Result<Vec<u32>> {
        Ok(m.iter().flat_map(|m| m.content.bytes().map(u32::from)).collect())
    }

    #[test]
    fn probes_share_their_system_blocks_and_hold_whole_and_half() {
        let p = build(4, 2_000, 16, bytes).unwrap();
        assert_eq!(p.probes.len(), 4);
        assert!(p.probes.iter().all(|x| x.tokens.len() >= 2_000));
        let system_bytes = p.probes[0].history[0].content.len();
        assert!(
            p.shared_blocks >= system_bytes / 16 - 1 && p.shared_blocks <= system_bytes / 16 + 1
        );
        let h = p.holdings(100, 512);
        // 25 shared holders, then whole + half per probe.
        assert_eq!(h.len(), 25 + 8);
        let whole = &h[25].1.events;
        let KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, .. } = &whole[0]
        else {
            panic!("a store")
        };
        assert_eq!(*parent_block_hash, None);
        assert_eq!(token_ids.len(), block_hashes.len() * 16);
        let blocks: usize = whole
            .iter()
            .map(|e| match e {
                KvEvent::BlockStored { block_hashes, .. } => block_hashes.len(),
                _ => 0,
            })
            .sum();
        assert_eq!(blocks, p.blocks(0));
        assert_eq!(h[25].0, 0);
        assert_eq!(h[27].0, 25, "probe 1's holder");
        // The shared blocks hash alike for every probe; the rest apart.
        assert_eq!(p.hash(0, 0), p.hash(3, 0));
        assert_ne!(p.hash(0, p.shared_blocks), p.hash(3, p.shared_blocks));
    }
}
