//! Predicted time to first token: the unit every placement decision is made in.
//!
//! A worker serves prefill FIFO-ish at a throughput it measures itself ([`crate::scrape::PrefillMeter`],
//! configured default until enough is measured, clamped). A request sent to it waits for the prefill
//! work queued ahead of it, then computes its own uncached tokens, and every engine step that carries
//! prefill also carries one decode token for each sequence in the running batch. So, in seconds:
//!
//! ```text
//! ttft = (queued_tokens + own_uncached_tokens) / prefill_tokens_per_s
//!      + steps × decode_step_s      (steps = ⌈(queued + own) / prefill_chunk_tokens⌉, 0 with no batch)
//!      + adapter_delay_s            (a LoRA request: loading its adapter, waiting for a slot)
//!      + tier_load_s                (blocks loaded from CPU / disk instead of computed)
//! ```
//!
//! `tier_load_s` is [`tier_load_s`]: the prompt's blocks a worker holds in a lower KV tier right
//! after its GPU-cached prefix, in tokens, over that tier's load bandwidth
//! (`routing.cpu_load_tokens_per_s`, `routing.disk_load_tokens_per_s`). Those tokens are not in
//! `own_uncached_tokens`: a prefix in CPU memory is cheaper than recomputing it (the load runs at
//! several times the prefill throughput) and dearer than one on the GPU (free). vLLM loads them
//! before it schedules the request's prefill, without holding the GPU, so the load delays this
//! request only: it is not work the next requests queue behind.
//!
//! `adapter_delay_s` is [`AdapterCost`]'s: from the worker's `vllm:lora_requests_info` (running
//! and waiting adapters, `max_lora` slots) and the adapters this indexer routed there since
//! ([`AdapterBookings`]), it is `routing.adapter_load_ms` when the worker has no request for the
//! adapter, plus [`slot_wait_s`] when other adapters hold every slot.
//!
//! `queued_tokens` comes from [`PrefillBacklog`]: the uncached tokens this indexer booked on the
//! worker, drained at the worker's throughput since booking (the engine does not say when a request
//! finishes prefill, so it is modelled: a fluid FIFO queue), plus requests the engine reports waiting
//! that this indexer did not book (other gateway replicas, direct traffic) at the size of a typical
//! request this indexer booked there ([`PrefillBacklog::typical_tokens`]: replicas behind one
//! load balancer see the same mix), or a configured guess before it booked any. Those unseen
//! requests join the same FIFO at the scrape that reported them ([`PrefillBacklog::reconcile`])
//! and drain like the rest until the next scrape replaces them: held constant between scrapes,
//! they made every worker another replica had just loaded look busy for a whole scrape interval
//! while this replica's own bookings on one worker drained, so both replicas herded onto it.
//! Everything here is pure; the clock is passed in.
//!
//! Over 600 lines: the TTFT model, the last-block cap, the backlog drain model and the adapter
//! cost are one cost model read together; about a third of the file is their unit tests.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::index::TierBlocks;
use crate::scrape::{EngineSample, LoraInfo, PrefillMeter};

/// The numbers the model needs about one worker, all measured or derived before the decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WorkerTiming {
    /// Prefill work ahead of a new request, in uncached tokens.
    pub queued_tokens: f64,
    /// Sequences in its decode batch (engine-reported running, or booked when not scraped).
    pub decode_batch: u64,
    /// Prefill throughput, uncached tokens per second (> 0).
    pub prefill_tokens_per_s: f64,
    /// Duration of one engine step's decode part (inter-token latency), seconds.
    pub decode_step_s: f64,
    /// Requests expected to arrive at this worker per second: this indexer's recent route rate to
    /// the workers of its model over their number ([`LoadOutlook::routes_per_s`]; models are
    /// separate pools with their own traffic). Prices the delay a request's own prefill adds to
    /// the ones that will queue behind it ([`cost_s`]).
    pub arrivals_per_s: f64,
    /// Recent prefill utilization, 0..=[`MAX_UTILIZATION`]: the uncached tokens per second this
    /// indexer booked there over its throughput ([`LoadOutlook`]).
    pub utilization: f64,
    /// What this request's LoRA adapter adds before its prefill can start (loading it, waiting
    /// for a slot), seconds: per request, set by the decision from [`AdapterCost`]; 0 without one.
    pub adapter_delay_s: f64,
}

/// Utilization is capped here in [`cost_s`] (1 / (1 − 0.9) = 10× at most): a measured rate at or
/// above the throughput means a queue that grows until the rate falls, not an infinite cost.
pub const MAX_UTILIZATION: f64 = 0.9;

impl Default for WorkerTiming {
    fn default() -> Self {
        Self {
            queued_tokens: 0.0,
            decode_batch: 0,
            prefill_tokens_per_s: 20_000.0,
            decode_step_s: 0.02,
            arrivals_per_s: 0.0,
            utilization: 0.0,
            adapter_delay_s: 0.0,
        }
    }
}

/// Predicted TTFT in seconds of a request needing `own_tokens` uncached tokens on a worker with
/// `timing`; `chunk_tokens` is the engine's token budget per step. Monotone non-decreasing in both
/// `queued_tokens` and `own_tokens`, non-increasing in throughput. The adapter delay adds to it: a
/// load stalls the engine's step (so it also lengthens the busy period [`cost_s`] prices), a slot
/// wait holds this request back.
pub fn ttft_s(timing: &WorkerTiming, own_tokens: f64, chunk_tokens: u64) -> f64 {
    let work = timing.queued_tokens.max(0.0) + own_tokens.max(0.0);
    let prefill = work / timing.prefill_tokens_per_s.max(1e-9);
    let decode = if timing.decode_batch > 0 {
        let steps = (work / chunk_tokens.max(1) as f64).ceil().max(1.0);
        steps * timing.decode_step_s.max(0.0)
    } else {
        0.0
    };
    prefill + decode + timing.adapter_delay_s.max(0.0)
}

/// Seconds to load `blocks` blocks of `block_size` tokens from lower KV tiers into GPU memory, at
/// `cpu_tps` / `disk_tps` prompt tokens per second: linear in each tier's tokens, 0 for none.
/// Non-positive or non-finite bandwidths are treated as 1 token/s (config validation refuses them).
pub fn tier_load_s(blocks: TierBlocks, block_size: u32, cpu_tps: f64, disk_tps: f64) -> f64 {
    let tokens = |n: u32| f64::from(n) * f64::from(block_size);
    let rate = |tps: f64| if tps.is_finite() && tps > 0.0 { tps } else { 1.0 };
    tokens(blocks.cpu) / rate(cpu_tps) + tokens(blocks.disk) / rate(disk_tps)
}

/// What a request's LoRA adapter costs on one worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AdapterCost {
    /// The worker must load the adapter: it has no request for it running or waiting, and this
    /// indexer routed none there within `routing.adapter_booking_ttl_ms`.
    pub load: bool,
    /// Other adapters with running requests hold every `max_lora` slot: the request waits until
    /// one frees (vLLM schedules no request whose adapter would exceed `max_loras` in the batch).
    pub wait_slot: bool,
}

impl AdapterCost {
    /// The delay before the request's prefill can start, seconds: `load_s` if it loads, plus the
    /// worker's `slot_wait_s` if it waits for a slot (the load follows the wait).
    pub fn delay_s(&self, load_s: f64, slot_wait_s: f64) -> f64 {
        let load = if self.load { load_s.max(0.0) } else { 0.0 };
        let wait = if self.wait_slot { slot_wait_s.max(0.0) } else { 0.0 };
        load + wait
    }
}

/// A worker's LoRA adapters as the cost reads them: the engine's last scrape, the adapters this
/// indexer routed there since, and the expected wait for a slot there.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerAdapters<'a> {
    /// `vllm:lora_requests_info` of the last scrape (kept, as the rest of the sample, until the
    /// worker counts as unreachable).
    pub engine: &'a LoraInfo,
    /// Adapters routed there within `routing.adapter_booking_ttl_ms` ([`AdapterBookings`]): the
    /// engine shows them running only after the request arrived and a scrape ran, and a burst
    /// placed meanwhile would otherwise see every worker without them.
    pub booked: Vec<Arc<str>>,
    /// Expected wait for a free slot, seconds ([`slot_wait_s`]).
    pub slot_wait_s: f64,
}

impl<'a> WorkerAdapters<'a> {
    /// The adapter state of a worker whose last scrape is `engine` (None without one, or without
    /// `vllm:lora_requests_info`: unknown, nothing is charged), with `bookings` made there at `now`,
    /// `meter` its measurements and `configured_wait_ms` the slot wait assumed until measured.
    pub fn of(
        worker: &str,
        engine: Option<&'a EngineSample>,
        meter: &PrefillMeter,
        bookings: &AdapterBookings,
        configured_wait_ms: f64,
        now: Instant,
    ) -> Option<Self> {
        Some(Self {
            engine: engine?.lora.as_ref()?,
            booked: bookings.recent(worker, now),
            slot_wait_s: slot_wait_s(meter.request_lifetime_s(), configured_wait_ms / 1000.0),
        })
    }

    /// What a request for `adapter` costs here.
    pub fn cost(&self, adapter: &str) -> AdapterCost {
        let booked = |a: &str| self.booked.iter().any(|b| &**b == a);
        let running = |a: &str| self.engine.running.iter().any(|r| r == a) || booked(a);
        let resident = self.engine.holds(adapter) || booked(adapter);
        // Slots taken by other adapters: running ones, and those just routed here (they will run).
        let wait_slot = !running(adapter)
            && self.engine.max_lora.is_some_and(|slots| {
                let mut others: Vec<&str> =
                    self.engine.running.iter().map(String::as_str).collect();
                others.extend(self.booked.iter().map(|b| &**b));
                others.sort_unstable();
                others.dedup();
                others.iter().filter(|a| **a != adapter).count() >= slots as usize
            });
        AdapterCost { load: !resident, wait_slot }
    }
}

/// The expected wait for a LoRA slot on a worker whose running requests live `lifetime_s`
/// (scheduled → last token, measured: [`PrefillMeter::request_lifetime_s`]) on average: half of
/// it, the mean remaining time of a request seen at a random point of its run. A slot frees when
/// the last running request of one of the adapters holding it finishes: later than that when an
/// adapter has several, sooner when several slots can free. `configured_s` stands in until the
/// lifetime is measured (`routing.adapter_slot_wait_ms`).
pub fn slot_wait_s(lifetime_s: Option<f64>, configured_s: f64) -> f64 {
    lifetime_s.filter(|l| l.is_finite() && *l >= 0.0).map_or(configured_s, |l| l / 2.0).max(0.0)
}

/// Adapters at most remembered per worker in [`AdapterBookings`] (the oldest dropped beyond).
pub const ADAPTER_BOOKINGS_PER_WORKER: usize = 64;

/// Adapters this indexer routed to each worker recently: each counts as running there for
/// `ttl` (`routing.adapter_booking_ttl_ms`), until the engine's own `vllm:lora_requests_info`
/// shows it. At most [`ADAPTER_BOOKINGS_PER_WORKER`] per worker, one entry per adapter; removed
/// with the worker. Pure; the clock is passed in.
#[derive(Debug, Default)]
pub struct AdapterBookings {
    ttl: Duration,
    workers: HashMap<String, VecDeque<(Arc<str>, Instant)>>,
}

impl AdapterBookings {
    /// Bookings that count for `ttl`.
    pub fn new(ttl: Duration) -> Self {
        Self { ttl, workers: HashMap::new() }
    }

    /// A new TTL (config reload); what was booked stays.
    pub fn set_ttl(&mut self, ttl: Duration) {
        self.ttl = ttl;
    }

    /// Records a request for `adapter` routed to `worker` at `now`.
    pub fn routed(&mut self, worker: &str, adapter: &str, now: Instant) {
        let ttl = self.ttl;
        let q = self.workers.entry(worker.to_owned()).or_default();
        q.retain(|(a, at)| &**a != adapter && now.saturating_duration_since(*at) < ttl);
        q.push_back((Arc::from(adapter), now));
        while q.len() > ADAPTER_BOOKINGS_PER_WORKER {
            q.pop_front();
        }
    }

    /// The adapters routed to `worker` within the TTL at `now`.
    pub fn recent(&self, worker: &str, now: Instant) -> Vec<Arc<str>> {
        self.workers.get(worker).map_or_else(Vec::new, |q| {
            q.iter()
                .filter(|(_, at)| now.saturating_duration_since(*at) < self.ttl)
                .map(|(a, _)| Arc::clone(a))
                .collect()
        })
    }

    /// Forgets the worker (it left the fleet).
    pub fn remove_worker(&mut self, worker: &str) {
        self.workers.remove(worker);
    }

    /// Entries tracked over all workers (expired ones included until the worker's next booking).
    pub fn len(&self) -> usize {
        self.workers.values().map(VecDeque::len).sum()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// What placing a request on a worker costs, in seconds ([`ttft_s`] is this request's part):
///
/// ```text
/// cost = ttft + work_charge × behind × own_uncached_tokens / prefill_tokens_per_s
/// behind = arrivals_per_s × ttft / (1 − utilization)
/// ```
///
/// The second term is the delay this request's own prefill adds to the requests that will queue
/// behind it: every request that arrives at that worker before its queue next runs empty starts
/// that much later (FIFO). With the work ahead plus its own (its `ttft`) the queue stays busy for
/// about ttft / (1 − utilization) — the busy period of a queue at that utilization — and
/// `arrivals_per_s` requests arrive per second of it. The term is ~0 at light load and grows
/// steeply near saturation, which is what makes a cache-rich worker with a queue beat an idle one
/// that would recompute the whole prompt once the fleet is busy: recomputing is work the whole
/// fleet pays for, not only this request.
pub fn cost_s(timing: &WorkerTiming, ttft: f64, own_tokens: f64, work_charge: f64) -> f64 {
    let own_prefill_s = own_tokens.max(0.0) / timing.prefill_tokens_per_s.max(1e-9);
    let busy_s = ttft.max(0.0) / (1.0 - timing.utilization.clamp(0.0, MAX_UTILIZATION));
    ttft + work_charge.max(0.0) * timing.arrivals_per_s.max(0.0) * busy_s * own_prefill_s
}

/// A rate that decays exponentially over a time constant: events (or amounts) per second.
#[derive(Debug, Clone, Copy, Default)]
struct DecayingRate {
    /// Per second, as of `at`.
    value: f64,
    at: Option<Instant>,
}

impl DecayingRate {
    fn at(&self, now: Instant, tau_s: f64) -> f64 {
        self.at.map_or(0.0, |at| {
            self.value * (-now.saturating_duration_since(at).as_secs_f64() / tau_s).exp()
        })
    }

    fn add(&mut self, amount: f64, now: Instant, tau_s: f64) {
        self.value = self.at(now, tau_s) + amount.max(0.0) / tau_s;
        self.at = Some(now);
    }
}

/// Recent load, exponentially weighted over a time constant, per worker: the requests this
/// indexer routed there per second, the prompt tokens (the worker's share of the fleet's KV and
/// decode work: a conversation's long history counts, cached or not) and the uncached tokens it
/// booked there to prefill. At most one entry per worker in each, removed with the worker. Pure;
/// the clock is passed in.
#[derive(Debug)]
pub struct LoadOutlook {
    tau_s: f64,
    routes: HashMap<String, DecayingRate>,
    tokens: HashMap<String, DecayingRate>,
    prefill: HashMap<String, DecayingRate>,
}

impl LoadOutlook {
    /// An outlook weighting over `tau_s` seconds (clamped to ≥ 0.1 s).
    pub fn new(tau_s: f64) -> Self {
        Self {
            tau_s: tau_s.max(0.1),
            routes: HashMap::new(),
            tokens: HashMap::new(),
            prefill: HashMap::new(),
        }
    }

    /// Changes the time constant (config reload); what was measured stays.
    pub fn set_window(&mut self, tau_s: f64) {
        self.tau_s = tau_s.max(0.1);
    }

    /// Counts a route of `prompt_tokens` to `worker` at `now`, whose `prefill_tokens` uncached
    /// tokens `prefill_on` computes (the worker itself, or a disaggregated plan's prefill worker).
    pub fn routed(
        &mut self,
        worker: &str,
        prompt_tokens: f64,
        prefill_on: &str,
        prefill_tokens: f64,
        now: Instant,
    ) {
        self.routes.entry(worker.to_owned()).or_default().add(1.0, now, self.tau_s);
        self.tokens.entry(worker.to_owned()).or_default().add(prompt_tokens, now, self.tau_s);
        self.prefill.entry(prefill_on.to_owned()).or_default().add(prefill_tokens, now, self.tau_s);
    }

    /// `worker`'s recent prefill utilization at throughput `tps`, 0..=[`MAX_UTILIZATION`].
    pub fn utilization(&self, worker: &str, tps: f64, now: Instant) -> f64 {
        let rate = self.prefill.get(worker).map_or(0.0, |r| r.at(now, self.tau_s));
        (rate / tps.max(1e-9)).clamp(0.0, MAX_UTILIZATION)
    }

    /// Routes per second to `workers` (together) at `now`.
    pub fn routes_per_s<'w>(
        &self,
        workers: impl IntoIterator<Item = &'w str>,
        now: Instant,
    ) -> f64 {
        workers.into_iter().filter_map(|w| self.routes.get(w)).map(|r| r.at(now, self.tau_s)).sum()
    }

    /// Prompt tokens per second routed to `worker` at `now`.
    pub fn tokens_per_s(&self, worker: &str, now: Instant) -> f64 {
        self.tokens.get(worker).map_or(0.0, |r| r.at(now, self.tau_s))
    }

    /// Forgets the worker (it left the fleet).
    pub fn remove_worker(&mut self, worker: &str) {
        self.routes.remove(worker);
        self.tokens.remove(worker);
        self.prefill.remove(worker);
    }

    /// Entries tracked (at most three per worker).
    pub fn len(&self) -> usize {
        self.routes.len() + self.tokens.len() + self.prefill.len()
    }

    /// Whether no worker is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The most leading blocks an engine can serve from cache for a prompt of `tokens` tokens: vLLM
/// always computes the last prompt token (its logits give the first output token), so a prompt of
/// exactly k × block_size tokens hits at most k − 1 blocks. `vllm-sim` applies the same rule
/// (`e2e/sim/src/sched/mod.rs`, `admit`).
pub fn max_cached_blocks(tokens: usize, block_size: u32) -> u32 {
    u32::try_from(tokens.saturating_sub(1) / block_size.max(1) as usize).unwrap_or(u32::MAX)
}

/// How much prefill is still ahead of a new request on a worker.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Ahead {
    /// Uncached tokens of this indexer's own bookings still ahead.
    pub tokens: f64,
    /// Own booked requests not yet past prefill (the partially drained head included).
    pub requests: u64,
    /// Tokens still ahead of requests the engine reported waiting that this indexer did not book.
    pub unseen_tokens: f64,
}

/// One entry of a worker's fluid FIFO.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Item {
    /// Remaining uncached tokens.
    tokens: f64,
    /// The engine's waiting requests this indexer did not book, as of the last scrape.
    unseen: bool,
}

#[derive(Debug, Default)]
struct Queue {
    /// Oldest first.
    items: VecDeque<Item>,
    /// When `items` was last drained.
    at: Option<Instant>,
}

impl Queue {
    /// How many front items `tps × (now − at)` tokens finish, and what is left of the next one.
    fn drained(&self, tps: f64, now: Instant) -> (usize, f64) {
        let mut budget = self
            .at
            .map_or(0.0, |at| now.saturating_duration_since(at).as_secs_f64() * tps.max(0.0));
        let mut gone = 0;
        for item in &self.items {
            if budget < item.tokens {
                return (gone, item.tokens - budget);
            }
            budget -= item.tokens;
            gone += 1;
        }
        (gone, 0.0)
    }

    fn settle(&mut self, tps: f64, now: Instant) {
        let (gone, head) = self.drained(tps, now);
        self.items.drain(..gone);
        if let Some(front) = self.items.front_mut() {
            front.tokens = head;
        }
        self.at = Some(now);
    }

    fn own_requests(&self) -> usize {
        self.items.iter().filter(|i| !i.unseen).count()
    }
}

/// Booked prefill per worker, drained at the worker's throughput since booking (a fluid FIFO).
/// Bounded: at most `max_per_worker` requests per worker (the oldest, least remaining, dropped).
#[derive(Debug)]
pub struct PrefillBacklog {
    workers: HashMap<String, Queue>,
    /// Mean of the uncached tokens booked per request and the bookings it has seen, per worker
    /// (one entry per worker that was ever booked; removed with the worker).
    typical: HashMap<String, (f64, u32)>,
    max_per_worker: usize,
}

/// Weight of the newest booking in [`PrefillBacklog::typical_tokens`] (about the last 10 count)
/// once there have been 10; before that the plain mean of all of them, so the first booking (on a
/// fresh fleet usually a cold one, many times a continuation's size) weighs as one of the first
/// few, not as 0.9^k of the mean k bookings later.
const TYPICAL_WEIGHT: f64 = 0.1;

impl PrefillBacklog {
    /// A backlog tracking at most `max_per_worker` requests per worker.
    pub fn new(max_per_worker: usize) -> Self {
        Self {
            workers: HashMap::new(),
            typical: HashMap::new(),
            max_per_worker: max_per_worker.max(1),
        }
    }

    /// The uncached tokens of a typical request booked on `worker` (a weighted mean of the
    /// recent ones, [`TYPICAL_WEIGHT`]), or None before the first booking.
    pub fn typical_tokens(&self, worker: &str) -> Option<f64> {
        self.typical.get(worker).map(|&(mean, _)| mean)
    }

    /// Books `tokens` of prefill on `worker` at `now`; `tps` drains what was queued before.
    pub fn add(&mut self, worker: &str, tokens: f64, tps: f64, now: Instant) {
        let (mean, seen) = self.typical.entry(worker.to_owned()).or_insert((0.0, 0));
        *seen = seen.saturating_add(1);
        *mean += (1.0 / f64::from(*seen)).max(TYPICAL_WEIGHT) * (tokens.max(0.0) - *mean);
        let q = self.workers.entry(worker.to_owned()).or_default();
        q.settle(tps, now);
        if tokens > 0.0 {
            q.items.push_back(Item { tokens, unseen: false });
        }
        while q.items.len() > self.max_per_worker {
            q.items.pop_front();
        }
    }

    /// Takes a scrape at `now` that found `engine_waiting` requests waiting on `worker`, and
    /// `engine_not_own` requests (running or waiting) beyond this indexer's live bookings there:
    /// the waiting ones beyond this indexer's bookings not yet past prefill — at most
    /// `engine_not_own` — are someone else's, sized at the typical booking there
    /// (`fallback_tokens` before the first), and join the back of the FIFO in place of what the
    /// previous scrape reported. The bound keeps out this indexer's own requests that the drain
    /// model counts as done but the engine still holds (a request waiting for a LoRA slot, an
    /// engine slower than its measured rate): they are not another replica's prefill.
    pub fn reconcile(
        &mut self,
        worker: &str,
        engine_waiting: u64,
        engine_not_own: u64,
        fallback_tokens: f64,
        tps: f64,
        now: Instant,
    ) {
        let typical = self.typical_tokens(worker).unwrap_or(fallback_tokens).max(0.0);
        // A queue left empty here is dropped by the next `compact`.
        let q = self.workers.entry(worker.to_owned()).or_default();
        q.settle(tps, now);
        q.items.retain(|i| !i.unseen);
        let unseen = engine_waiting.saturating_sub(q.own_requests() as u64).min(engine_not_own);
        if unseen > 0 && typical > 0.0 {
            q.items.push_back(Item { tokens: unseen as f64 * typical, unseen: true });
        }
    }

    /// What is still ahead on `worker` at `now`, draining at `tps`.
    pub fn ahead(&self, worker: &str, tps: f64, now: Instant) -> Ahead {
        let Some(q) = self.workers.get(worker) else {
            return Ahead::default();
        };
        let (gone, head) = q.drained(tps, now);
        let mut ahead = Ahead::default();
        for (k, item) in q.items.iter().enumerate().skip(gone) {
            let left = if k == gone { head } else { item.tokens };
            if item.unseen {
                ahead.unseen_tokens += left;
            } else {
                ahead.tokens += left;
                ahead.requests += 1;
            }
        }
        ahead
    }

    /// Forgets the worker (it left the fleet).
    pub fn remove_worker(&mut self, worker: &str) {
        self.workers.remove(worker);
        self.typical.remove(worker);
    }

    /// Drops fully drained queues (bounded memory for fleets that churn).
    pub fn compact(&mut self, tps_of: impl Fn(&str) -> f64, now: Instant) {
        self.workers.retain(|w, q| {
            q.settle(tps_of(w), now);
            !q.items.is_empty()
        });
    }

    /// Own booked requests tracked over all workers.
    pub fn len(&self) -> usize {
        self.workers.values().map(Queue::own_requests).sum()
    }

    /// Whether nothing is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn timing(queued: f64, batch: u64) -> WorkerTiming {
        WorkerTiming {
            queued_tokens: queued,
            decode_batch: batch,
            prefill_tokens_per_s: 10_000.0,
            decode_step_s: 0.02,
            ..WorkerTiming::default()
        }
    }

    #[test]
    fn cost_table() {
        // (arrivals/s, utilization, ttft s, own tokens, work charge, want s); throughput 10k
        // tok/s, so 5,000 own tokens are 0.5 s of prefill.
        let cases = [
            (0.0, 0.0, 0.6, 5_000.0, 1.0, 0.6), // idle fleet: the TTFT alone
            (2.0, 0.0, 0.6, 5_000.0, 1.0, 0.6 + 2.0 * 0.6 * 0.5), // 1.2 arrivals behind, 0.5 s each
            (2.0, 0.5, 0.6, 5_000.0, 1.0, 0.6 + 2.0 * 1.2 * 0.5), // half busy: the queue stays busy 2× as long
            (2.0, 0.99, 0.6, 5_000.0, 1.0, 0.6 + 2.0 * 6.0 * 0.5), // capped at 0.9: 10×
            (2.0, 0.5, 0.6, 5_000.0, 0.0, 0.6),                   // work charge off
            (2.0, 0.5, 0.6, 0.0, 1.0, 0.6), // all cached: adds nothing to others
        ];
        for (rate, util, ttft, own, charge, want) in cases {
            let t = WorkerTiming { arrivals_per_s: rate, utilization: util, ..timing(0.0, 0) };
            let got = cost_s(&t, ttft, own, charge);
            assert!(
                (got - want).abs() < 1e-9,
                "{rate} {util} {ttft} {own} {charge}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn outlook_rates_decay_over_the_window() {
        let t0 = Instant::now();
        let mut o = LoadOutlook::new(10.0);
        assert_eq!((o.routes_per_s(["w0"], t0), o.tokens_per_s("w0", t0)), (0.0, 0.0));
        // 5 routes/s of 1,000 tokens to w0 for 60 s (6 time constants): 5 routes/s, 5,000 tokens/s.
        for i in 0..300 {
            o.routed("w0", 1000.0, "w0", 400.0, t0 + Duration::from_millis(200 * i));
        }
        let end = t0 + Duration::from_millis(200 * 299);
        assert!((o.routes_per_s(["w0"], end) - 5.0).abs() < 0.3, "{}", o.routes_per_s(["w0"], end));
        assert_eq!(o.routes_per_s(["w1"], end), 0.0, "routes count where they went");
        assert!(
            (o.tokens_per_s("w0", end) - 5000.0).abs() < 300.0,
            "{}",
            o.tokens_per_s("w0", end)
        );
        assert_eq!(o.tokens_per_s("w1", end), 0.0);
        // 2,000 uncached tokens/s on a 10k tokens/s worker: 0.2 busy; on a 1k one: capped.
        assert!(
            (o.utilization("w0", 10_000.0, end) - 0.2).abs() < 0.02,
            "{}",
            o.utilization("w0", 10_000.0, end)
        );
        assert_eq!(o.utilization("w0", 1_000.0, end), MAX_UTILIZATION);
        assert_eq!(o.utilization("w1", 1_000.0, end), 0.0);
        // Quiet for one time constant: ~1/e of it.
        let later = end + Duration::from_secs(10);
        assert!(
            (o.routes_per_s(["w0"], later) / o.routes_per_s(["w0"], end) - (-1.0f64).exp()).abs()
                < 1e-9
        );
        assert!(
            (o.tokens_per_s("w0", later) / o.tokens_per_s("w0", end) - (-1.0f64).exp()).abs()
                < 1e-9
        );
        assert_eq!(o.len(), 3);
        o.remove_worker("w0");
        assert!(o.is_empty());
    }

    #[test]
    fn routes_count_per_worker_so_each_model_has_its_own_arrival_rate() {
        let t0 = Instant::now();
        let mut o = LoadOutlook::new(10.0);
        // For 60 s, 6 routes/s to model A's two workers and 4 to model B's two.
        for i in 0..600u64 {
            let now = t0 + Duration::from_millis(100 * i);
            let to = ["a0", "a1", "a0", "a1", "a0", "a1", "b0", "b1", "b0", "b1"][i as usize % 10];
            o.routed(to, 1000.0, to, 100.0, now);
        }
        let end = t0 + Duration::from_millis(100 * 599);
        let per_worker = |ws: [&str; 2]| o.routes_per_s(ws, end) / 2.0;
        assert!((per_worker(["a0", "a1"]) - 3.0).abs() < 0.2, "{}", per_worker(["a0", "a1"]));
        assert!((per_worker(["b0", "b1"]) - 2.0).abs() < 0.2, "{}", per_worker(["b0", "b1"]));
        assert_eq!(o.routes_per_s(["c0"], end), 0.0);
    }

    #[test]
    fn ttft_table() {
        // (queued, batch, own, chunk, want seconds)
        let cases = [
            (0.0, 0, 1000.0, 8192, 0.1),           // idle worker: own prefill only
            (5000.0, 0, 1000.0, 8192, 0.6),        // queued work first
            (0.0, 3, 1000.0, 8192, 0.12),          // one step of the decode batch
            (9000.0, 3, 1000.0, 4096, 1.0 + 0.06), // 10k tokens in 4096-token steps: 3 steps
            (0.0, 0, 0.0, 8192, 0.0),
        ];
        for (queued, batch, own, chunk, want) in cases {
            let got = ttft_s(&timing(queued, batch), own, chunk);
            assert!((got - want).abs() < 1e-9, "{queued} {batch} {own} {chunk}: {got} != {want}");
        }
    }

    #[test]
    fn last_block_rule_matches_vllm_sim() {
        // The numbers of the issue (block 32: a 2048-token prompt hits 63 blocks) and of vllm-sim's
        // `admit`: ((tokens − 1) / block_size).
        let cases = [
            (2048, 32, 63),
            (2049, 32, 64),
            (2047, 32, 63),
            (32, 32, 0),
            (33, 32, 1),
            (1, 16, 0),
            (0, 16, 0),
            (640, 16, 39),
            (650, 16, 40),
        ];
        for (tokens, bs, want) in cases {
            assert_eq!(max_cached_blocks(tokens, bs), want, "{tokens} tokens, block {bs}");
        }
    }

    #[test]
    fn backlog_drains_at_the_throughput_since_booking() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let mut b = PrefillBacklog::new(100);
        b.add("w0", 1000.0, 10_000.0, t0);
        b.add("w0", 2000.0, 10_000.0, s(50)); // the first is half done
        assert_eq!(
            b.ahead("w0", 10_000.0, s(50)),
            Ahead { tokens: 2500.0, requests: 2, unseen_tokens: 0.0 }
        );
        assert_eq!(
            b.ahead("w0", 10_000.0, s(100)),
            Ahead { tokens: 2000.0, requests: 1, unseen_tokens: 0.0 }
        );
        assert_eq!(
            b.ahead("w0", 10_000.0, s(250)),
            Ahead { tokens: 500.0, requests: 1, unseen_tokens: 0.0 }
        );
        assert_eq!(b.ahead("w0", 10_000.0, s(300)), Ahead::default());
        assert_eq!(b.ahead("w1", 10_000.0, s(0)), Ahead::default());
        b.compact(|_| 10_000.0, s(400));
        assert!(b.is_empty());
    }

    #[test]
    fn unseen_waiting_requests_join_the_fifo_at_the_scrape_and_drain() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let tps = 10_000.0;
        let mut b = PrefillBacklog::new(100);
        // Before any booking: 2 waiting requests of another replica, at the fallback size.
        b.reconcile("w0", 2, 2, 500.0, tps, t0);
        let a = b.ahead("w0", tps, t0);
        assert_eq!((a.tokens, a.requests, a.unseen_tokens), (0.0, 0, 1000.0));
        // They drain like everything else: half gone after 50 ms.
        assert_eq!(b.ahead("w0", tps, s(50)).unseen_tokens.round(), 500.0);
        // An own booking at 50 ms queues behind them (FIFO).
        b.add("w0", 1000.0, tps, s(50));
        let a = b.ahead("w0", tps, s(100));
        assert_eq!((a.tokens.round(), a.requests, a.unseen_tokens.round()), (1000.0, 1, 0.0));
        // The next scrape (120 ms) sees 3 waiting: one is our own, 2 are someone else's, at the
        // typical size of our bookings there (our one booking: 1000 tokens), behind ours.
        b.reconcile("w0", 3, 2, 500.0, tps, s(120));
        let a = b.ahead("w0", tps, s(120));
        assert_eq!((a.tokens.round(), a.requests, a.unseen_tokens.round()), (800.0, 1, 2000.0));
        // A scrape that sees only our own request replaces the unseen part with nothing.
        b.reconcile("w0", 1, 0, 500.0, tps, s(130));
        let a = b.ahead("w0", tps, s(130));
        assert_eq!((a.tokens.round(), a.requests, a.unseen_tokens), (700.0, 1, 0.0));
        assert_eq!(b.len(), 1, "unseen requests are not bookings");
    }

    #[test]
    fn own_requests_the_engine_still_holds_are_not_someone_elses() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let tps = 10_000.0;
        let mut b = PrefillBacklog::new(100);
        // Three own requests of 1,000 tokens: the model drains them in 300 ms.
        for _ in 0..3 {
            b.add("w0", 1000.0, tps, t0);
        }
        // At 500 ms the engine still has all three waiting (their adapter waits for a LoRA slot)
        // and nothing beyond this indexer's three live bookings: no one else's work is ahead.
        b.reconcile("w0", 3, 0, 500.0, tps, s(500));
        assert_eq!(b.ahead("w0", tps, s(500)), Ahead::default());
        // Another replica's two requests waiting beside them: two, not five, at the typical size.
        b.reconcile("w0", 5, 2, 500.0, tps, s(600));
        assert_eq!(b.ahead("w0", tps, s(600)).unseen_tokens.round(), 2000.0);
    }

    #[test]
    fn typical_tokens_follow_the_recent_bookings() {
        let t0 = Instant::now();
        let mut b = PrefillBacklog::new(100);
        assert_eq!(b.typical_tokens("w0"), None);
        b.add("w0", 1000.0, 10_000.0, t0);
        assert_eq!(b.typical_tokens("w0"), Some(1000.0));
        // One cold opening, then continuations: the first few weigh alike (the plain mean); the
        // first does not keep 0.9^k of the mean k bookings later.
        for _ in 0..3 {
            b.add("w0", 50.0, 10_000.0, t0);
        }
        let t = b.typical_tokens("w0").unwrap_or(f64::NAN);
        assert!((287.4..287.6).contains(&t), "(1000 + 3 × 50) / 4, not 0.9³ × 1000 + …: {t}");
        for _ in 0..57 {
            b.add("w0", 50.0, 10_000.0, t0);
        }
        let t = b.typical_tokens("w0").unwrap_or(f64::NAN);
        assert!((50.0..52.0).contains(&t), "{t}");
        assert_eq!(b.typical_tokens("w1"), None);
        b.remove_worker("w0");
        assert_eq!(b.typical_tokens("w0"), None);
    }

    #[test]
    fn backlog_is_bounded_per_worker() {
        let t0 = Instant::now();
        let mut b = PrefillBacklog::new(3);
        for _ in 0..10 {
            b.add("w0", 100.0, 1.0, t0);
        }
        assert_eq!(b.len(), 3);
        b.remove_worker("w0");
        assert!(b.is_empty());
    }

    fn lora(max_lora: Option<u32>, running: &[&str], waiting: &[&str]) -> LoraInfo {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
        LoraInfo { max_lora, running: names(running), waiting: names(waiting) }
    }

    #[test]
    fn adapter_cost_table() {
        let (load, wait, both, none) = (
            AdapterCost { load: true, wait_slot: false },
            AdapterCost { load: false, wait_slot: true },
            AdapterCost { load: true, wait_slot: true },
            AdapterCost::default(),
        );
        // (max_lora, running, waiting, booked, want for adapter "a")
        type Case = (
            Option<u32>,
            &'static [&'static str],
            &'static [&'static str],
            &'static [&'static str],
            AdapterCost,
        );
        let cases: [Case; 11] = [
            (Some(2), &[], &[], &[], load), // idle engine: load into a free slot
            (Some(2), &["a"], &[], &[], none), // running: loaded, holds a slot
            (Some(2), &[], &["a"], &[], none), // waiting: loaded (or being) for a request
            (Some(2), &[], &[], &["a"], none), // just routed there: counts as running
            (Some(1), &["b"], &[], &[], both), // the one slot held by b: load and wait
            (Some(2), &["b"], &[], &[], load), // a second slot is free
            (Some(2), &["b", "c"], &[], &[], both), // both held
            (Some(1), &["b"], &["a"], &[], wait), // queued behind b: no load, but the wait
            (Some(1), &["b"], &[], &["a"], none), // routed here: it will hold the slot
            (Some(1), &[], &[], &["c"], both), // c just routed here takes the slot
            (None, &["b", "c", "d"], &[], &[], load), // slots unknown: no wait is charged
        ];
        for (max_lora, running, waiting, booked, want) in cases {
            let engine = lora(max_lora, running, waiting);
            let w = WorkerAdapters {
                engine: &engine,
                booked: booked.iter().map(|b| Arc::from(*b)).collect(),
                slot_wait_s: 2.0,
            };
            assert_eq!(w.cost("a"), want, "{max_lora:?} {running:?} {waiting:?} {booked:?}");
        }
        assert_eq!(load.delay_s(0.25, 2.0), 0.25);
        assert_eq!(wait.delay_s(0.25, 2.0), 2.0);
        assert_eq!(both.delay_s(0.25, 2.0), 2.25);
        assert_eq!(none.delay_s(0.25, 2.0), 0.0);
        // The delay is part of the predicted TTFT (and so of the cost).
        let t = WorkerTiming { adapter_delay_s: 0.25, ..timing(0.0, 0) };
        assert!((ttft_s(&t, 1000.0, 8192) - 0.35).abs() < 1e-9);
    }

    #[test]
    fn slot_wait_is_half_the_measured_lifetime_else_the_configured_one() {
        assert_eq!(slot_wait_s(Some(3.0), 2.0), 1.5);
        assert_eq!(slot_wait_s(None, 2.0), 2.0);
        assert_eq!(slot_wait_s(Some(f64::NAN), 2.0), 2.0);
    }

    #[test]
    fn worker_adapters_need_the_engines_lora_info() {
        let t0 = Instant::now();
        let mut bookings = AdapterBookings::new(Duration::from_secs(2));
        bookings.routed("w0", "a", t0);
        let meter = PrefillMeter::default();
        let plain = EngineSample::default();
        let with = EngineSample { lora: Some(lora(Some(1), &[], &[])), ..EngineSample::default() };
        assert_eq!(WorkerAdapters::of("w0", None, &meter, &bookings, 500.0, t0), None);
        assert_eq!(WorkerAdapters::of("w0", Some(&plain), &meter, &bookings, 500.0, t0), None);
        let w = WorkerAdapters::of("w0", Some(&with), &meter, &bookings, 500.0, t0);
        let w = w.expect("LoRA info");
        assert_eq!((w.booked, w.slot_wait_s), (vec![Arc::from("a")], 0.5));
    }

    #[test]
    fn adapter_bookings_expire_and_are_bounded() {
        let t0 = Instant::now();
        let s = |ms| t0 + Duration::from_millis(ms);
        let mut b = AdapterBookings::new(Duration::from_millis(1000));
        b.routed("w0", "a", t0);
        b.routed("w0", "b", s(600));
        b.routed("w0", "a", s(700)); // refreshed, not repeated
        assert_eq!(b.len(), 2);
        let names = |v: Vec<Arc<str>>| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        assert_eq!(names(b.recent("w0", s(900))), ["b", "a"]);
        assert_eq!(names(b.recent("w0", s(1650))), ["a"], "b expired at 1600 ms");
        assert!(b.recent("w0", s(1700)).is_empty());
        assert!(b.recent("w1", t0).is_empty());
        b.set_ttl(Duration::ZERO);
        assert!(b.recent("w0", s(700)).is_empty(), "a TTL of 0 is off");
        b.set_ttl(Duration::from_secs(60));
        for i in 0..ADAPTER_BOOKINGS_PER_WORKER + 10 {
            b.routed("w0", &format!("x{i}"), s(800));
        }
        assert_eq!(b.len(), ADAPTER_BOOKINGS_PER_WORKER);
        b.remove_worker("w0");
        assert!(b.is_empty());
    }

    #[test]
    fn tier_load_table() {
        let b = |cpu, disk| TierBlocks { cpu, disk };
        // (blocks, block size, cpu tok/s, disk tok/s, want s)
        let cases = [
            (b(0, 0), 16, 100_000.0, 25_000.0, 0.0),
            (b(100, 0), 16, 100_000.0, 25_000.0, 0.016), // 1,600 tokens at 100k/s
            (b(0, 100), 16, 100_000.0, 25_000.0, 0.064),
            (b(100, 100), 16, 100_000.0, 25_000.0, 0.08),
            (b(10, 0), 16, 0.0, 25_000.0, 160.0), // a zero bandwidth: 1 token/s, not infinity
        ];
        for (blocks, bs, cpu, disk, want) in cases {
            let got = tier_load_s(blocks, bs, cpu, disk);
            assert!((got - want).abs() < 1e-9, "{blocks:?} {bs} {cpu} {disk}: {got} vs {want}");
        }
    }

    proptest! {
        /// A prefix in CPU memory costs less than recomputing it and more than holding it on the
        /// GPU, whenever the tier loads faster than the worker prefills: the predicted TTFT of
        /// g GPU + c CPU blocks lies between g + c GPU blocks and g GPU blocks (c recomputed).
        #[test]
        fn a_cpu_tier_hit_lies_between_a_gpu_hit_and_a_recompute(
            queued in 0.0f64..1e5, batch in 0u64..64, prompt_blocks in 2u32..400,
            gpu_frac in 0.0f64..1.0, cpu_frac in 0.0f64..1.0, load_x in 1.0f64..50.0,
        ) {
            let bs = 16u32;
            let t = timing(queued, batch);
            let gpu = (f64::from(prompt_blocks) * gpu_frac) as u32;
            let cpu = (f64::from(prompt_blocks - gpu) * cpu_frac) as u32;
            let isl = f64::from(prompt_blocks * bs);
            let tokens = |blocks: u32| f64::from(blocks * bs);
            let load = tier_load_s(TierBlocks { cpu, disk: 0 }, bs, t.prefill_tokens_per_s * load_x, 1.0);
            let tiered = ttft_s(&t, isl - tokens(gpu + cpu), 8192) + load;
            let all_gpu = ttft_s(&t, isl - tokens(gpu + cpu), 8192);
            let recompute = ttft_s(&t, isl - tokens(gpu), 8192);
            prop_assert!(all_gpu <= tiered + 1e-12, "{all_gpu} > {tiered}");
            prop_assert!(tiered <= recompute + 1e-9, "{tiered} > {recompute}");
        }

        #[test]
        fn ttft_is_monotone_in_queued_work(q in 0.0f64..1e6, extra in 0.0f64..1e6, own in 0.0f64..1e5, batch in 0u64..300, chunk in 1u64..20_000) {
            let a = ttft_s(&timing(q, batch), own, chunk);
            let b = ttft_s(&timing(q + extra, batch), own, chunk);
            prop_assert!(b >= a, "{a} > {b}");
            let c = ttft_s(&timing(q, batch), own + extra, chunk);
            prop_assert!(c >= a);
        }

        #[test]
        fn backlog_never_grows_with_time(items in proptest::collection::vec((1.0f64..5000.0, 0u64..100), 1..20), later in 0u64..2000) {
            let t0 = Instant::now();
            let mut b = PrefillBacklog::new(64);
            let mut t = t0;
            for (tokens, gap) in &items {
                t += Duration::from_millis(*gap);
                b.add("w", *tokens, 20_000.0, t);
            }
            let now = b.ahead("w", 20_000.0, t);
            let after = b.ahead("w", 20_000.0, t + Duration::from_millis(later));
            prop_assert!(after.tokens <= now.tokens + 1e-6 && after.requests <= now.requests);
            let total: f64 = items.iter().map(|(x, _)| x).sum();
            prop_assert!(now.tokens <= total + 1e-6);
        }
    }
}
