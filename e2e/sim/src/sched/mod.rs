//! The engine's scheduler: vLLM V1's continuous batching over the block pool, as a pure
//! `step(now) -> work` state machine.
//!
//! One step at a time is in flight. `step(now)` first completes the in-flight step if its end
//! time has passed (computed tokens advance, tokens are sampled, finished requests release or
//! hand over their blocks, the step's cache events are emitted), then schedules the next one:
//! running requests first (one decode token each, or their next prefill chunk), then waiting
//! requests in FIFO order while `max_num_seqs` and the `max_num_batched_tokens` budget allow.
//! Blocks are allocated and full blocks cached at schedule time, as vLLM does, so a request
//! admitted in the next step already hits them; the events recorded while scheduling are
//! published when the step completes. A running request that needs a block when none is free
//! preempts the most recently admitted request (its blocks are freed; it restarts from its
//! prefix hits), and no waiting request is admitted in a step that preempted.
//!
//! CPU offload tier (`cpu_offload_blocks` > 0, [`crate::offload`]): a waiting request's GPU prefix
//! hit is continued by the blocks the tier holds consecutively after it; they are copied into the
//! request's new GPU blocks (cached there again) and the step admitting it lasts their tokens /
//! `cpu_load_tokens_per_s` longer (a load the step waits for; vLLM's connector loads
//! asynchronously and only the request waits — the same TTFT for the request).
//!
//! Hybrid model (`sliding_window` set, [`crate::window`]): a second KV cache group keeps each
//! request's blocks inside its sliding window; a prefix is served only as far as both groups can
//! serve it, and the group's events go out with the pool's.
//!
//! LoRA (`max_loras` set): a waiting request whose adapter would make more than `max_loras`
//! distinct adapters in the batch is skipped (it keeps its place; later requests may go first, as
//! in vLLM), and a step whose batch runs an adapter not in a GPU slot lasts `lora_load_ms` longer
//! per such adapter ([`crate::lora::Slots`]).
//!
//! The clock is an argument (`now`, time since the engine started) and the only randomness is
//! each request's seeded token stream, so every test is deterministic. NIXL producer holds and
//! consumer pulls live in `nixl.rs`, the LoRA bookkeeping in `lora.rs`.
//!
//! Over 600 lines: `schedule` → `admit` → `prepare` → `complete` is one state machine over the
//! same request table; split across files it would have to expose its invariants.

mod lora;
mod nixl;
mod types;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

pub use nixl::PullError;
pub use types::*;

use crate::events::KvEvent;
use crate::free_queue::BlockId;
use crate::hash::{extend_chain_keyed, BlockHash};
use crate::lora::{Adapter, Slots};
use crate::output::OutputVocab;
use crate::pool::{BlockPool, CachedBlock, InUse};
use crate::timing::TimingModel;
use crate::window::{SlidingWindow, WindowGroup};

/// Validated scheduler limits.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the pool.
    pub num_gpu_blocks: u32,
    /// Running requests per step.
    pub max_num_seqs: usize,
    /// Token budget per step.
    pub max_num_batched_tokens: usize,
    /// Bound of the waiting queue (including requests waiting for a NIXL pull).
    pub max_waiting: usize,
    /// Prompt plus completion limit.
    pub max_model_len: usize,
    /// Step durations.
    pub timing: TimingModel,
    /// What to do when a pull fails.
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// How long a producer holds blocks nobody pulls.
    pub kv_transfer_timeout: Duration,
    /// LoRA GPU slots (`--max-loras`); `None`: LoRA disabled.
    pub max_loras: Option<usize>,
    /// Time to load one adapter into a slot, milliseconds (divided by the speedup).
    pub lora_load_ms: f64,
    /// Blocks of the CPU offload tier (`--cpu-offload-blocks`; 0: none).
    pub cpu_offload_blocks: usize,
    /// Tokens per second loaded from the CPU tier into GPU blocks (`--cpu-load-tokens-per-s`).
    pub cpu_load_tokens_per_s: f64,
    /// A hybrid model's sliding-window group (`--sliding-window`); `None`: full attention only.
    pub sliding_window: Option<SlidingWindow>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Waiting,
    RemoteWait,
    Running,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Remote {
    None,
    Pending(RemoteSource),
    Done,
}

#[derive(Debug)]
struct Request {
    tokens: Vec<u32>,
    num_prompt: usize,
    num_computed: usize,
    max_tokens: u32,
    generated: u32,
    hashes: Vec<BlockHash>,
    salt: Option<String>,
    media: Vec<crate::media::MediaSpan>,
    lora: Option<Adapter>,
    blocks: Vec<BlockId>,
    /// `blocks[..num_cached_blocks]` have been offered to the cache.
    num_cached_blocks: usize,
    state: State,
    cached_tokens: Option<usize>,
    rng: u64,
    finish_reason: FinishReason,
    producer: Option<String>,
    remote: Remote,
    /// Local prefix-hit tokens when a consumer started its pull.
    local_hit: usize,
    /// Prompt tokens its first admission loaded from the CPU offload tier.
    offloaded_tokens: usize,
    /// Times this request was preempted (a re-admission's lookup is counted apart, as vLLM does).
    preemptions: u32,
    /// Phase timestamps on the scheduler's clock (vLLM's QUEUED, first SCHEDULED, first and last token).
    queued_at: Duration,
    scheduled_at: Option<Duration>,
    first_token_at: Option<Duration>,
}

#[derive(Debug)]
struct Inflight {
    end: Duration,
    work: Vec<(ReqId, usize)>,
    events: Vec<KvEvent>,
}

#[derive(Debug)]
struct Hold {
    blocks: Vec<BlockId>,
    expires: Duration,
}

/// The scheduler and the block pool it owns.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    vocab: Arc<OutputVocab>,
    pool: BlockPool,
    reqs: HashMap<ReqId, Request>,
    waiting: VecDeque<ReqId>,
    running: Vec<ReqId>,
    remote_waiting: usize,
    inflight: Option<Inflight>,
    holds: HashMap<String, Hold>,
    hold_expiry: VecDeque<(Duration, String)>,
    /// The `now` of the latest `step` (holds created while completing a step expire from it).
    now_hint: Duration,
    stats: SchedStats,
    /// Adapters in GPU slots (LoRA enabled).
    slots: Option<Slots>,
    /// Tokens the requests admitted in the step being scheduled load from the CPU tier.
    step_load_tokens: usize,
    /// The sliding-window group of a hybrid model.
    window: Option<WindowGroup>,
}

impl Scheduler {
    /// An idle engine with an empty cache.
    pub fn new(cfg: SchedulerConfig, vocab: Arc<OutputVocab>) -> Self {
        let pool =
            BlockPool::new(cfg.num_gpu_blocks, cfg.block_size).with_offload(cfg.cpu_offload_blocks);
        let slots = cfg.max_loras.map(Slots::new);
        let window = cfg.sliding_window.map(|w| WindowGroup::new(w, cfg.block_size));
        Self {
            window,
            slots,
            cfg,
            vocab,
            pool,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            remote_waiting: 0,
            inflight: None,
            holds: HashMap::new(),
            hold_expiry: VecDeque::new(),
            now_hint: Duration::ZERO,
            stats: SchedStats::default(),
            step_load_tokens: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Cumulative counters.
    pub fn stats(&self) -> SchedStats {
        self.stats
    }

    /// Requests in the running batch (`vllm:num_requests_running`).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting, including those waiting for a NIXL pull (`vllm:num_requests_waiting`).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len() + self.remote_waiting
    }

    /// KV usage, 0..=1 (`vllm:kv_cache_usage_perc`).
    pub fn kv_usage(&self) -> f64 {
        self.pool.usage()
    }

    /// Every cached block (`GET /admin/cache`).
    pub fn dump_cache(&self) -> Vec<CachedBlock> {
        self.pool.dump()
    }

    /// Blocks in the free queue.
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free()
    }

    /// Queues a request as of the latest step's `now`. Validation failures are returned, not emitted.
    pub fn submit(&mut self, req: NewRequest) -> Result<(), RequestError> {
        self.submit_at(req, self.now_hint)
    }

    /// Queues a request that arrived at `now` (the start of its queue time).
    pub fn submit_at(&mut self, req: NewRequest, now: Duration) -> Result<(), RequestError> {
        if req.prompt.is_empty() {
            return Err(RequestError::EmptyPrompt);
        }
        let requested = req.prompt.len() + req.max_tokens as usize;
        if requested > self.cfg.max_model_len {
            return Err(RequestError::TooLong {
                max_model_len: self.cfg.max_model_len,
                requested,
                prompt: req.prompt.len(),
                max_tokens: req.max_tokens,
            });
        }
        if self.num_waiting() >= self.cfg.max_waiting {
            return Err(RequestError::QueueFull { limit: self.cfg.max_waiting });
        }
        if self.reqs.contains_key(&req.id) {
            return Err(RequestError::Duplicate(req.id));
        }
        let num_prompt = req.prompt.len();
        let mut tokens = req.prompt;
        tokens.reserve(req.max_tokens as usize);
        let (producer, remote) = match req.kv {
            KvRole::Plain => (None, Remote::None),
            KvRole::Producer { transfer_id } => (Some(transfer_id), Remote::None),
            KvRole::Consumer { source } => (None, Remote::Pending(source)),
        };
        self.reqs.insert(
            req.id,
            Request {
                tokens,
                num_prompt,
                num_computed: 0,
                max_tokens: req.max_tokens.max(1),
                generated: 0,
                hashes: req.hashes,
                salt: req.salt,
                media: req.media,
                lora: req.lora,
                blocks: Vec::new(),
                num_cached_blocks: 0,
                state: State::Waiting,
                cached_tokens: None,
                rng: req.seed,
                finish_reason: req.finish_reason,
                producer,
                remote,
                local_hit: 0,
                offloaded_tokens: 0,
                preemptions: 0,
                queued_at: now.max(self.now_hint),
                scheduled_at: None,
                first_token_at: None,
            },
        );
        self.waiting.push_back(req.id);
        Ok(())
    }

    /// Drops a request wherever it is (client gone); its blocks are freed. Unknown ids are ignored.
    pub fn cancel(&mut self, id: ReqId) {
        let Some(r) = self.reqs.remove(&id) else { return };
        match r.state {
            State::Waiting => self.waiting.retain(|&w| w != id),
            State::Running => self.running.retain(|&w| w != id),
            State::RemoteWait => self.remote_waiting = self.remote_waiting.saturating_sub(1),
        }
        self.pool.free(&r.blocks);
        self.free_window(id);
        self.stats.aborted += 1;
    }

    /// vLLM's `reset_prefix_cache`: refused while any block is referenced; on success the
    /// `AllBlocksCleared` event is in `out.events` (after any events still pending).
    pub fn reset_prefix_cache(&mut self, out: &mut StepOutput) -> Result<(), InUse> {
        self.pool.reset()?;
        if let Some(w) = &mut self.window {
            w.reset();
        }
        if let Some(inflight) = &mut self.inflight {
            out.events.append(&mut inflight.events);
        }
        out.events.append(&mut self.pool.take_events());
        Ok(())
    }

    /// Advances the engine to `now`: completes the in-flight step if due, schedules the next.
    /// Returns when to call again (`None`: idle until a new request arrives).
    pub fn step(&mut self, now: Duration, out: &mut StepOutput) -> Option<Duration> {
        self.expire_holds(now);
        if let Some(inflight) = &self.inflight {
            if now < inflight.end {
                return self.next_wake();
            }
            if let Some(done) = self.inflight.take() {
                self.complete(done, out);
            }
        }
        self.schedule(now, out);
        self.next_wake()
    }

    fn next_wake(&self) -> Option<Duration> {
        let step = self.inflight.as_ref().map(|i| i.end);
        let hold = self.hold_expiry.front().map(|(t, _)| *t);
        match (step, hold) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn complete(&mut self, inflight: Inflight, out: &mut StepOutput) {
        out.events.extend(inflight.events);
        self.stats.steps += 1;
        let end = inflight.end;
        // vLLM's `iteration_tokens_total`: prompt tokens computed by requests whose prefill ended
        // in this step plus the tokens it generated.
        let mut iteration_tokens = 0u64;
        for (id, n) in inflight.work {
            let Some(r) = self.reqs.get_mut(&id) else { continue };
            if r.state != State::Running {
                continue;
            }
            r.num_computed += n;
            if r.num_computed < r.tokens.len() {
                continue; // a prefill chunk that is not the last
            }
            let token = self.vocab.sample(&mut r.rng);
            r.tokens.push(token);
            r.generated += 1;
            self.stats.generation_tokens += 1;
            iteration_tokens += 1;
            if r.first_token_at.is_none() {
                // vLLM counts prompt tokens when the prefill yields the first token.
                r.first_token_at = Some(end);
                let cached = r.cached_tokens.unwrap_or(0).min(r.num_prompt);
                // A consumer's cached tokens beyond its local hits came over NIXL.
                let pulled =
                    if r.remote == Remote::Done { cached.saturating_sub(r.local_hit) } else { 0 };
                // So did the tokens loaded from the CPU tier (vLLM: a connector's hits).
                let external = (pulled + r.offloaded_tokens).min(cached);
                self.stats.prompt_tokens += r.num_prompt as u64;
                self.stats.prompt_tokens_cached += cached as u64;
                self.stats.prompt_tokens_external += external as u64;
                iteration_tokens += (r.num_prompt - cached) as u64;
            }
            out.emits.push(Emit::Token { id, token });
            if r.generated >= r.max_tokens {
                let reason = r.finish_reason;
                self.finish(id, reason, end, out);
            }
        }
        if iteration_tokens > 0 {
            out.iteration_tokens = Some(iteration_tokens);
        }
    }

    fn finish(&mut self, id: ReqId, reason: FinishReason, now: Duration, out: &mut StepOutput) {
        self.running.retain(|&w| w != id);
        let Some(r) = self.reqs.remove(&id) else { return };
        self.free_window(id);
        match reason {
            FinishReason::Length => self.stats.finished_length += 1,
            FinishReason::Stop => self.stats.finished_stop += 1,
        }
        // vLLM's NIXL connector hands blocks over only for a length-capped finish.
        let transfer = match (r.producer, reason) {
            (Some(transfer_id), FinishReason::Length) => {
                Some(self.hold(transfer_id, r.blocks, r.num_computed))
            }
            _ => {
                self.pool.free(&r.blocks);
                None
            }
        };
        out.emits.push(Emit::Finished {
            id,
            done: Finished {
                reason,
                prompt_tokens: r.num_prompt as u32,
                completion_tokens: r.generated,
                cached_tokens: r.cached_tokens.unwrap_or(0) as u32,
                created_cache_tokens: (r.num_prompt / self.cfg.block_size * self.cfg.block_size)
                    .saturating_sub(r.cached_tokens.unwrap_or(0))
                    as u32,
                prefill_computed_tokens: r.num_prompt.saturating_sub(r.cached_tokens.unwrap_or(0))
                    as u32,
                transfer,
                phases: phases(r.queued_at, r.scheduled_at, r.first_token_at, now),
            },
        });
    }

    fn schedule(&mut self, now: Duration, out: &mut StepOutput) {
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut work: Vec<(ReqId, usize)> = Vec::new();
        let (mut prefill_tokens, mut decodes) = (0u64, 0u32);
        let mut preempted = false;

        // 1. The running batch: each gets its remaining tokens (1 when decoding) within budget.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(r) = self.reqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let n = (r.tokens.len() - r.num_computed).min(budget);
            let decode = r.generated > 0 && r.num_computed >= r.num_prompt && n == 1;
            if !self.ensure_blocks(id, n, &mut preempted) {
                break; // preempted itself: everything after it was preempted too
            }
            self.prepare(id, n);
            work.push((id, n));
            budget -= n;
            if decode {
                decodes += 1;
            } else {
                prefill_tokens += n as u64;
            }
            i += 1;
        }

        // 2. Waiting requests, FIFO, while the batch and the budget have room. A request whose
        // adapter has no slot in this batch is set aside and keeps its place in the queue.
        let mut batch_loras = self.running_adapters(&work);
        let mut skipped: Vec<ReqId> = Vec::new();
        while !preempted && budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let Some(r) = self.reqs.get(&id) else {
                self.waiting.pop_front();
                continue;
            };
            if matches!(r.remote, Remote::Pending(_)) {
                if !self.start_pull(id, out) {
                    break;
                }
                continue;
            }
            let lora = r.lora.as_ref().map(|a| a.id);
            if let (Some(max), Some(lora)) = (self.cfg.max_loras, lora) {
                if !crate::lora::fits(max, &batch_loras, lora) {
                    self.waiting.pop_front();
                    skipped.push(id);
                    continue;
                }
            }
            let Some(n) = self.admit(id, budget) else { break };
            if let Some(lora) = lora.filter(|l| !batch_loras.contains(l)) {
                batch_loras.push(lora);
            }
            self.waiting.pop_front();
            self.running.push(id);
            if let Some(r) = self.reqs.get_mut(&id) {
                r.state = State::Running;
            }
            self.prepare(id, n);
            work.push((id, n));
            budget -= n;
            prefill_tokens += n as u64;
        }

        for id in skipped.into_iter().rev() {
            self.waiting.push_front(id);
        }

        if work.is_empty() {
            return;
        }
        let batch = u32::try_from(work.len()).unwrap_or(u32::MAX);
        let mut end = now + self.cfg.timing.step(prefill_tokens, decodes, batch);
        if let Some(slots) = &mut self.slots {
            let loads = slots.activate(&batch_loras);
            if loads > 0 {
                self.stats.lora_loads += loads as u64;
                end += self.cfg.timing.lora_loads(loads, self.cfg.lora_load_ms);
            }
        }
        // Blocks loaded from the CPU tier arrive before the step computes past them.
        let load = std::mem::take(&mut self.step_load_tokens);
        if load > 0 {
            end += self.cfg.timing.offload_load(load as u64, self.cfg.cpu_load_tokens_per_s);
        }
        let mut events = self.pool.take_events();
        if let Some(w) = &mut self.window {
            events.extend(w.take_events());
        }
        self.inflight = Some(Inflight { end, work, events });
    }

    /// Makes sure running request `id` has blocks for `n` more tokens, preempting from the back
    /// of the running batch while the pool is short. False if `id` itself was preempted.
    fn ensure_blocks(&mut self, id: ReqId, n: usize, preempted: &mut bool) -> bool {
        let bs = self.cfg.block_size;
        loop {
            let Some(r) = self.reqs.get_mut(&id) else { return false };
            let need = (r.num_computed + n).div_ceil(bs).saturating_sub(r.blocks.len());
            let window =
                self.window.as_mut().is_none_or(|w| w.grow(id, r.num_computed, r.num_computed + n));
            if window && (need == 0 || self.pool.allocate(need, &mut r.blocks)) {
                return true;
            }
            let Some(victim) = self.running.pop() else { return false };
            self.preempt(victim);
            *preempted = true;
            if victim == id {
                return false;
            }
        }
    }

    fn preempt(&mut self, id: ReqId) {
        let Some(r) = self.reqs.get_mut(&id) else { return };
        self.pool.free(&r.blocks);
        if let Some(w) = &mut self.window {
            w.free(id);
        }
        r.blocks.clear();
        r.num_computed = 0;
        r.num_cached_blocks = 0;
        r.state = State::Waiting;
        r.preemptions += 1;
        self.waiting.push_front(id);
        self.stats.preemptions += 1;
    }

    /// Takes the blocks waiting request `id` needs for its next chunk. Returns the chunk size,
    /// or `None` (nothing taken) when the pool cannot hold it yet.
    fn admit(&mut self, id: ReqId, budget: usize) -> Option<usize> {
        let bs = self.cfg.block_size;
        let r = self.reqs.get_mut(&id)?;
        if !r.blocks.is_empty() {
            // A consumer back from its pull: blocks are taken, only the remainder is computed.
            let n = (r.tokens.len() - r.num_computed).min(budget);
            let need = (r.num_computed + n).div_ceil(bs).saturating_sub(r.blocks.len());
            return (need == 0 || self.pool.allocate(need, &mut r.blocks)).then_some(n);
        }
        // vLLM never serves a whole prompt from cache: the last token is always computed.
        let max_hit = ((r.tokens.len() - 1) / bs).min(r.hashes.len());
        let mut hit = self.pool.lookup(&r.hashes[..max_hit]);
        // A hybrid model: only as far as the window group can serve too.
        if let Some(w) = &self.window {
            hit = self.pool.lookup(&r.hashes[..w.hit(&r.hashes, hit.blocks)]);
        }
        // The CPU tier continues the GPU hit with the blocks it holds consecutively after it.
        let offloaded = self.pool.offload_run(&r.hashes[hit.blocks..max_hit]);
        let local = hit.blocks + offloaded;
        let hit_tokens = local * bs;
        let n = (r.tokens.len() - hit_tokens).min(budget);
        let need = (hit_tokens + n).div_ceil(bs) - hit.blocks;
        if need + hit.evictable > self.pool.num_free() {
            return None;
        }
        if let Some(w) = &mut self.window {
            if !w.admit(id, &r.hashes, hit.blocks, hit_tokens + n) {
                return None;
            }
        }
        self.pool.acquire_cached(&r.hashes[..hit.blocks], &mut r.blocks);
        let loaded = self.pool.load_offloaded(&r.hashes[hit.blocks..local]);
        if loaded.len() < offloaded || !self.pool.allocate(need, &mut r.blocks) {
            // Unreachable given the checks above; undo rather than trust them.
            self.pool.free(&r.blocks);
            r.blocks.clear();
            if let Some(w) = &mut self.window {
                w.free(id);
            }
            return None;
        }
        // The loaded blocks are cached on the GPU again (their `BlockStored`, medium GPU).
        for (i, tokens) in loaded.iter().enumerate() {
            self.pool.write_tokens(r.blocks[hit.blocks + i], 0, tokens);
        }
        if offloaded > 0 {
            let lora = r.lora.as_ref();
            self.pool.cache_blocks_keyed(&r.blocks, &r.hashes, hit.blocks, local, lora, &r.media);
            self.step_load_tokens += offloaded * bs;
            self.stats.offload_loaded_tokens += (offloaded * bs) as u64;
        }
        r.num_computed = hit_tokens;
        r.num_cached_blocks = local;
        if r.cached_tokens.is_none() {
            r.offloaded_tokens = offloaded * bs;
        }
        r.cached_tokens.get_or_insert(hit_tokens);
        r.scheduled_at.get_or_insert(self.now_hint);
        // vLLM's `PrefixCacheStats.record(preempted=…)`: a preempted request re-hitting its own
        // blocks is counted apart, outside `prefix_cache_queries` / `prefix_cache_hits`.
        if r.preemptions > 0 {
            self.stats.preempted_admissions += 1;
            self.stats.preempted_queries += r.tokens.len() as u64;
            self.stats.preempted_hits += hit_tokens as u64;
        } else {
            // vLLM counts the GPU prefix cache's own hits here, and the offloading connector's
            // (queried for the tokens past them) as external ones.
            self.stats.prefix_queries += r.tokens.len() as u64;
            self.stats.prefix_hits += (hit.blocks * bs) as u64;
            if self.pool.offload().is_some() {
                self.stats.external_queries += (r.tokens.len() - hit.blocks * bs) as u64;
                self.stats.external_hits += (offloaded * bs) as u64;
            }
        }
        Some(n)
    }

    /// Writes the tokens request `id` computes this step into its blocks and caches the blocks
    /// they fill (recording `BlockStored`).
    fn prepare(&mut self, id: ReqId, n: usize) {
        let bs = self.cfg.block_size;
        let Some(r) = self.reqs.get_mut(&id) else { return };
        let (from, to) = (r.num_computed, r.num_computed + n);
        let mut pos = from;
        while pos < to {
            let b = pos / bs;
            let end = ((b + 1) * bs).min(to);
            if let Some(&block) = r.blocks.get(b) {
                self.pool.write_tokens(block, pos - b * bs, &r.tokens[pos..end]);
            }
            pos = end;
        }
        let full = to / bs;
        if full > r.num_cached_blocks {
            let lora = r.lora.as_ref().map(|a| &*a.name);
            let salt = r.salt.as_deref();
            extend_chain_keyed(&mut r.hashes, &r.tokens[..full * bs], bs, lora, salt, &r.media);
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
        if let Some(w) = &mut self.window {
            w.prepare(id, &r.tokens, (from, to), &r.hashes, r.lora.as_ref());
        }
    }

    /// Frees request `id`'s blocks in the window group (finished, cancelled).
    fn free_window(&mut self, id: ReqId) {
        if let Some(w) = &mut self.window {
            w.free(id);
        }
    }
}

/// A finished request's vLLM phase intervals (`FinishedRequestStats`): queued = first SCHEDULED −
/// QUEUED, prefill = first token − first SCHEDULED, decode = last token − first token, inference =
/// last token − first SCHEDULED. Preemptions fall inside the phase they interrupted.
fn phases(
    queued: Duration,
    scheduled: Option<Duration>,
    first_token: Option<Duration>,
    last_token: Duration,
) -> PhaseTimes {
    let scheduled = scheduled.unwrap_or(queued).max(queued);
    let first = first_token.unwrap_or(last_token).max(scheduled);
    let last = last_token.max(first);
    PhaseTimes {
        queued: scheduled - queued,
        prefill: first - scheduled,
        decode: last - first,
        inference: last - scheduled,
    }
}
