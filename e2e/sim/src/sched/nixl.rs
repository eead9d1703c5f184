//! NIXL semantics inside the scheduler: producer holds and consumer pulls.
//!
//! Producer: a request marked as producer that finishes length-capped does not free its blocks;
//! they stay referenced under its transfer id until a consumer pulls them or
//! `kv_transfer_timeout` passes (vLLM's delayed free with a lease). Consumer: a request with
//! `do_remote_prefill` first takes its local prefix hits and blocks for the rest of its prompt,
//! then waits (not running, counted as waiting) while the driver pulls the producer's blocks;
//! `pull_done` writes the pulled tokens into its blocks, caches the full ones (`BlockStored`) and
//! counts them as prefix hits, leaving only the prompt's last token to compute — or, when the
//! pull failed or returned other tokens, recomputes or fails per `kv_load_failure_policy`.

use std::time::Duration;

use super::types::{Emit, KvLoadFailurePolicy, ReqId, RequestError, StepOutput, TransferOut};
use super::{Hold, Remote, Request, Scheduler, State};
use crate::free_queue::BlockId;

/// Why a producer cannot serve a pull.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PullError {
    /// No hold under that id (never existed, already pulled, or expired).
    #[error("no KV blocks held for request {0} (unknown, already pulled, or expired)")]
    UnknownTransfer(String),
    /// A requested block is not part of the hold.
    #[error("block {block} is not held for request {transfer}")]
    ForeignBlock {
        /// The transfer asked for.
        transfer: String,
        /// The offending block id.
        block: u32,
    },
}

impl Scheduler {
    /// Keeps `blocks` referenced for a consumer; returns what the response advertises.
    pub(super) fn hold(
        &mut self,
        transfer_id: String,
        blocks: Vec<BlockId>,
        num_tokens: usize,
    ) -> TransferOut {
        // Only full blocks and the tail holding computed tokens are useful to a consumer.
        let useful = num_tokens.div_ceil(self.cfg.block_size).min(blocks.len());
        let out = TransferOut {
            transfer_id: transfer_id.clone(),
            block_ids: blocks[..useful].to_vec(),
            num_tokens,
        };
        let expires = self.now_hint + self.cfg.kv_transfer_timeout;
        if let Some(old) = self.holds.insert(transfer_id.clone(), Hold { blocks, expires }) {
            self.pool.free(&old.blocks); // a reused transfer id: the older hold is dead anyway
        }
        self.hold_expiry.push_back((expires, transfer_id));
        out
    }

    /// Frees holds whose lease passed.
    pub(super) fn expire_holds(&mut self, now: Duration) {
        self.now_hint = now;
        while let Some((t, _)) = self.hold_expiry.front() {
            if *t > now {
                break;
            }
            let Some((t, id)) = self.hold_expiry.pop_front() else { break };
            // The id may have been pulled (gone) or re-held with a later expiry (keep that one).
            if self.holds.get(&id).is_some_and(|h| h.expires == t) {
                if let Some(h) = self.holds.remove(&id) {
                    self.pool.free(&h.blocks);
                    self.stats.transfers_expired += 1;
                }
            }
        }
    }

    /// Number of producer holds waiting to be pulled.
    pub fn num_holds(&self) -> usize {
        self.holds.len()
    }

    /// Serves a consumer's pull: the token ids of `block_ids` (each must belong to the hold),
    /// then releases the whole hold, as a NIXL read followed by the consumer's notification.
    pub fn serve_pull(
        &mut self,
        transfer_id: &str,
        block_ids: &[u32],
    ) -> Result<Vec<Vec<u32>>, PullError> {
        let hold = self
            .holds
            .remove(transfer_id)
            .ok_or_else(|| PullError::UnknownTransfer(transfer_id.to_owned()))?;
        let result = block_ids
            .iter()
            .map(|&b| {
                if hold.blocks.contains(&b) {
                    Ok(self.pool.block_tokens(b).to_vec())
                } else {
                    Err(PullError::ForeignBlock { transfer: transfer_id.to_owned(), block: b })
                }
            })
            .collect();
        // Released either way: a consumer that asked for the wrong blocks will not ask again.
        self.pool.free(&hold.blocks);
        self.stats.transfers_served += 1;
        result
    }

    /// Starts the pull of the waiting consumer at the front of the queue: takes its local hits
    /// and blocks for the rest of its prompt, emits `Emit::Pull`. False when the pool cannot hold
    /// the prompt yet (the consumer stays at the front).
    pub(super) fn start_pull(&mut self, id: ReqId, out: &mut StepOutput) -> bool {
        let bs = self.cfg.block_size;
        let Some(r) = self.reqs.get_mut(&id) else { return true };
        let Remote::Pending(source) = std::mem::replace(&mut r.remote, Remote::Done) else {
            return true;
        };
        let prompt_blocks = r.num_prompt.div_ceil(bs);
        let max_hit = ((r.num_prompt - 1) / bs).min(r.hashes.len());
        let hit = self.pool.lookup(&r.hashes[..max_hit]);
        let need = prompt_blocks - hit.blocks;
        if need + hit.evictable > self.pool.num_free() {
            r.remote = Remote::Pending(source);
            return false;
        }
        self.pool.acquire_cached(&r.hashes[..hit.blocks], &mut r.blocks);
        if !self.pool.allocate(need, &mut r.blocks) {
            self.pool.free(&r.blocks);
            r.blocks.clear();
            r.remote = Remote::Pending(source);
            return false;
        }
        let hit_tokens = hit.blocks * bs;
        r.num_computed = hit_tokens;
        r.num_cached_blocks = hit.blocks;
        r.local_hit = hit_tokens;
        r.state = State::RemoteWait;
        r.scheduled_at.get_or_insert(self.now_hint);
        self.stats.prefix_queries += r.num_prompt as u64;
        self.stats.prefix_hits += hit_tokens as u64;
        self.stats.external_queries += (r.num_prompt - hit_tokens) as u64;
        let end = prompt_blocks.min(source.block_ids.len());
        let block_ids =
            source.block_ids.get(hit.blocks..end).map(<[u32]>::to_vec).unwrap_or_default();
        self.waiting.pop_front();
        self.remote_waiting += 1;
        out.emits.push(Emit::Pull { id, source, first_block: hit.blocks, block_ids });
        true
    }

    /// The result of a consumer's pull: the token ids of each pulled block, in order from the
    /// `first_block` the `Emit::Pull` named, or why the pull failed.
    pub fn pull_done(
        &mut self,
        id: ReqId,
        result: Result<Vec<Vec<u32>>, String>,
        out: &mut StepOutput,
    ) {
        let bs = self.cfg.block_size;
        let Some(r) = self.reqs.get_mut(&id) else { return }; // cancelled meanwhile
        if r.state != State::RemoteWait {
            return;
        }
        self.remote_waiting = self.remote_waiting.saturating_sub(1);
        let first = r.local_hit / bs;
        let verdict = result
            .and_then(|blocks| usable_prefix(r, first, bs, &blocks).map(|lens| (lens, blocks)));
        match verdict {
            Ok((lens, blocks)) => {
                let mut pulled = 0;
                for (j, (toks, &n)) in blocks.iter().zip(&lens).enumerate() {
                    if let Some(&block) = r.blocks.get(first + j) {
                        self.pool.write_tokens(block, 0, &toks[..n]);
                    }
                    pulled += n;
                }
                // The last prompt token is always recomputed (its logits give the first token).
                let computed = (r.local_hit + pulled).min(r.num_prompt - 1);
                let full = computed / bs;
                if full > r.num_cached_blocks {
                    self.pool.cache_blocks_keyed(
                        &r.blocks,
                        &r.hashes,
                        r.num_cached_blocks,
                        full,
                        r.lora.as_ref(),
                        &r.media,
                    );
                    r.num_cached_blocks = full;
                }
                self.stats.external_hits += pulled as u64;
                self.stats.prefix_hits += (computed - r.local_hit) as u64;
                r.num_computed = computed;
                r.cached_tokens = Some(computed);
            }
            Err(reason) => {
                self.stats.kv_load_failures += 1;
                if self.cfg.kv_load_failure_policy == KvLoadFailurePolicy::Fail {
                    // vLLM finishes such a request with FinishReason.ERROR (counted in request_success).
                    self.stats.finished_error += 1;
                    if let Some(r) = self.reqs.remove(&id) {
                        self.pool.free(&r.blocks);
                    }
                    out.emits.push(Emit::Failed { id, error: RequestError::KvLoadFailed(reason) });
                    return;
                }
                r.num_computed = r.local_hit;
                r.cached_tokens = Some(r.local_hit);
            }
        }
        r.state = State::Waiting;
        self.waiting.push_front(id);
    }
}

/// Checks pulled blocks against the consumer's prompt and returns how many tokens of each are
/// usable: a block must hold this prompt's tokens at its position; a partial block (the
/// producer's tail, e.g. a migration source's shorter conversation) ends the usable run, and
/// tokens beyond this prompt are ignored.
fn usable_prefix(
    r: &Request,
    first: usize,
    bs: usize,
    blocks: &[Vec<u32>],
) -> Result<Vec<usize>, String> {
    let mut lens = Vec::with_capacity(blocks.len());
    for (j, toks) in blocks.iter().enumerate() {
        let start = (first + j) * bs;
        if start >= r.num_prompt {
            break;
        }
        let n = toks.len().min(bs).min(r.num_prompt - start);
        if n == 0 || toks[..n] != r.tokens[start..start + n] {
            return Err(format!(
                "pulled block {} does not hold this prompt's tokens from {start}",
                first + j
            ));
        }
        lens.push(n);
        if n < bs {
            break;
        }
    }
    Ok(lens)
}
