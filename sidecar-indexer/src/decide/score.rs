//! What every stage ranks by: each candidate's predicted TTFT and cost for this request
//! ([`score`], from [`crate::predict`]; a LoRA request's adapter delay per worker,
//! [`adapter_delay_s`]; the blocks it loads from lower KV tiers, [`loaded_blocks`]), the hard
//! `overload_*` guards ([`overloaded`], [`guarded`]) and the fallback order.
//!
//! A prompt splits per worker into GPU-cached blocks (its index overlap, or the speculative or
//! migrated ones credited instead), lower-tier blocks (CPU or disk copies continuing that overlap:
//! loaded at the tier's bandwidth, [`crate::predict::tier_load_s`]) and uncached tokens (computed
//! at its prefill throughput). Computed once per request ([`candidates`]); the stages compare these
//! numbers and never compute them again.
//!
//! A [`Scored`] candidate carries its index in the worker views the decision was given (`at`):
//! that is how stages, reasons and the plan name it, so nothing looks a worker up again by id.

use std::fmt;

use kvmesh_core::rendezvous;

use super::plan::{RouteInput, WorkerView};
use crate::config::{KvMigration, RoutingConfig};
use crate::index::TierBlocks;
use crate::predict::{cost_s, tier_load_s, ttft_s, AdapterCost};

/// An `overload_*` guard a worker is over: which one, its value and the limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overload {
    pub guard: Guard,
    pub value: u64,
    pub limit: u64,
}

/// The three hard guards, in the order they are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    /// `overload_active_blocks`.
    ActiveBlocks,
    /// `overload_active_requests`.
    ActiveRequests,
    /// `overload_waiting_requests`.
    Waiting,
}

impl Guard {
    /// The name the reason shows (`waiting 9 >= 8`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ActiveBlocks => "active_blocks",
            Self::ActiveRequests => "active_requests",
            Self::Waiting => "waiting",
        }
    }
}

impl fmt::Display for Overload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} >= {}", self.guard.as_str(), self.value, self.limit)
    }
}

/// The first `overload_*` guard `w` is over under `cfg` (a limit of 0 is off), or None.
pub fn overloaded(w: &WorkerView<'_>, cfg: &RoutingConfig) -> Option<Overload> {
    [
        (Guard::ActiveBlocks, w.active_blocks, cfg.overload_active_blocks),
        (Guard::ActiveRequests, w.active_requests, cfg.overload_active_requests),
        (Guard::Waiting, w.waiting_requests, cfg.overload_waiting_requests),
    ]
    .into_iter()
    .find(|&(_, value, limit)| limit > 0 && value >= limit)
    .map(|(guard, value, limit)| Overload { guard, value, limit })
}

/// What the request's adapter costs on `w` (nothing for a base-model request, or where the engine
/// does not export its adapters).
pub(crate) fn adapter_cost(input: &RouteInput<'_>, w: &WorkerView<'_>) -> AdapterCost {
    match (input.adapter, &w.adapters) {
        (Some(adapter), Some(adapters)) => adapters.cost(adapter),
        _ => AdapterCost::default(),
    }
}

/// The delay the request's adapter adds on `w` before its prefill, seconds: `adapter_load_ms` to
/// load it, plus the worker's expected slot wait when other adapters hold every slot.
pub(crate) fn adapter_delay_s(
    input: &RouteInput<'_>,
    w: &WorkerView<'_>,
    cfg: &RoutingConfig,
) -> f64 {
    let slot_wait_s = w.adapters.as_ref().map_or(0.0, |a| a.slot_wait_s);
    adapter_cost(input, w).delay_s(cfg.adapter_load_ms / 1000.0, slot_wait_s)
}

/// A worker with its prediction for this request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scored<'v, 'a> {
    /// Its index in the worker views the decision was given.
    pub at: usize,
    pub w: &'v WorkerView<'a>,
    /// Predicted TTFT, seconds.
    pub ttft_s: f64,
    /// What placing it there costs, seconds ([`cost_s`]): its TTFT plus what its prefill adds to
    /// the requests behind it. The choice is by cost; the prediction reported is `ttft_s`.
    pub cost_s: f64,
    /// Uncached tokens it would compute.
    pub own_tokens: u64,
    /// Blocks it would load from lower KV tiers instead of computing ([`loaded_blocks`]).
    pub loaded: TierBlocks,
    /// Blocks it would pull by KV migration instead of recomputing (`kv_migration = "on"`).
    pub migrated_blocks: u32,
}

impl Scored<'_, '_> {
    /// The predicted TTFT, milliseconds.
    pub(crate) fn ms(&self) -> f64 {
        self.ttft_s * 1000.0
    }
}

/// Scores `w` (view `at`): its uncached tokens (crediting a migration from `best_index` when that
/// is on and worth it), the predicted TTFT and the cost.
pub(crate) fn score<'v, 'a>(
    at: usize,
    w: &'v WorkerView<'a>,
    isl: u64,
    block_size: u32,
    best_index: u32,
    cfg: &RoutingConfig,
) -> Scored<'v, 'a> {
    let bs = u64::from(block_size.max(1));
    let mut cached = w.cached_blocks();
    let mut migrated_blocks = 0;
    let movable = best_index.saturating_sub(w.overlap_blocks);
    if cfg.kv_migration == KvMigration::On
        && best_index > cached
        && u64::from(movable) * bs >= cfg.kv_migration_min_tokens
    {
        migrated_blocks = best_index - cached;
        cached = best_index;
    }
    let loaded = loaded_blocks(w, cached, cfg);
    let local = u64::from(cached) + u64::from(loaded.total());
    let own_tokens = isl - (local * bs).min(isl);
    let load_s =
        tier_load_s(loaded, block_size, cfg.cpu_load_tokens_per_s, cfg.disk_load_tokens_per_s);
    let (ttft, cost) = ttft_and_cost_with_load_s(w, own_tokens, load_s, cfg);
    Scored { at, w, ttft_s: ttft, cost_s: cost, own_tokens, loaded, migrated_blocks }
}

/// The lower-tier blocks `w` would load for this prompt when its first `cached` blocks count as
/// on its GPU (its overlap, or speculative / migrated blocks beyond it): what its lower-tier run
/// ([`WorkerView::tier_blocks`], continuing `overlap_blocks`) adds past `cached`. Where `cached`
/// covers part of the run, the rest is split between the tiers in the run's proportion (which
/// block sits in which tier is not kept). Nothing with `kv_tiers = false`.
pub(crate) fn loaded_blocks(w: &WorkerView<'_>, cached: u32, cfg: &RoutingConfig) -> TierBlocks {
    let run = w.tier_blocks;
    if !cfg.kv_tiers || run.total() == 0 {
        return TierBlocks::default();
    }
    let end = w.overlap_blocks.saturating_add(run.total());
    let left = end.saturating_sub(cached.max(w.overlap_blocks));
    if left >= run.total() {
        return run;
    }
    let cpu = (u64::from(run.cpu) * u64::from(left) / u64::from(run.total())) as u32;
    TierBlocks { cpu, disk: left - cpu }
}

/// The predicted TTFT and the cost of `w` computing `own_tokens` uncached tokens.
pub(crate) fn ttft_and_cost_s(
    w: &WorkerView<'_>,
    own_tokens: u64,
    cfg: &RoutingConfig,
) -> (f64, f64) {
    ttft_and_cost_with_load_s(w, own_tokens, 0.0, cfg)
}

/// [`ttft_and_cost_s`] after `load_s` seconds of loading lower-tier blocks first: the engine
/// loads them before the request's prefill is scheduled (the request waits, the GPU does not),
/// so the load adds to this request's TTFT but not to the prefill work others queue behind.
pub(crate) fn ttft_and_cost_with_load_s(
    w: &WorkerView<'_>,
    own_tokens: u64,
    load_s: f64,
    cfg: &RoutingConfig,
) -> (f64, f64) {
    let ttft = ttft_s(&w.timing, own_tokens as f64, cfg.prefill_chunk_tokens) + load_s.max(0.0);
    (ttft, cost_s(&w.timing, ttft, own_tokens as f64, cfg.work_charge))
}

/// The decode candidates of one request: healthy decode-capable workers, in view order, scored.
pub(crate) struct Candidates<'v, 'a> {
    pub scored: Vec<Scored<'v, 'a>>,
    /// The most leading blocks any candidate holds by the index (what a migration can bring).
    pub best_index: u32,
}

/// Scores every decode candidate among `workers` for `input`.
pub(crate) fn candidates<'v, 'a>(
    input: &RouteInput<'_>,
    workers: &'v [WorkerView<'a>],
    cfg: &RoutingConfig,
) -> Candidates<'v, 'a> {
    let best_index =
        workers.iter().filter(|w| w.candidate()).map(|w| w.overlap_blocks).max().unwrap_or(0);
    let scored = workers
        .iter()
        .enumerate()
        .filter(|(_, w)| w.candidate())
        .map(|(at, w)| score(at, w, input.isl_tokens as u64, input.block_size, best_index, cfg))
        .collect();
    Candidates { scored, best_index }
}

impl<'v, 'a> Candidates<'v, 'a> {
    /// The candidate at view index `at`, if `at` is one.
    pub(crate) fn get(&self, at: usize) -> Option<Scored<'v, 'a>> {
        self.scored.iter().find(|s| s.at == at).copied()
    }
}

/// `set` without the workers over an `overload_*` guard — or all of it when every one is over.
pub(crate) fn guarded<'v, 'a>(set: &[Scored<'v, 'a>], cfg: &RoutingConfig) -> Vec<Scored<'v, 'a>> {
    let ok: Vec<Scored<'v, 'a>> =
        set.iter().copied().filter(|s| overloaded(s.w, cfg).is_none()).collect();
    if ok.is_empty() {
        set.to_vec()
    } else {
        ok
    }
}

/// The member of `set` that `key` pins to by rendezvous hashing over their ids
/// ([`rendezvous::pick`], the function the filter's fallback calls), if `set` is not empty.
pub(crate) fn rendezvous_among<'v, 'a>(key: u64, set: &[Scored<'v, 'a>]) -> Option<Scored<'v, 'a>> {
    let id = rendezvous::pick(key, set.iter().map(|s| s.w.id))?;
    set.iter().find(|s| s.w.id == id).copied()
}

/// Endpoints of `set` other than view `chosen`, cheapest first (`n` at most).
pub(crate) fn fallbacks(set: &[Scored<'_, '_>], chosen: usize, n: usize) -> Vec<String> {
    let mut rest: Vec<&Scored<'_, '_>> = set.iter().filter(|s| s.at != chosen).collect();
    rest.sort_by(|a, b| a.cost_s.total_cmp(&b.cost_s).then_with(|| a.w.id.cmp(b.w.id)));
    rest.into_iter().take(n).map(|s| s.w.endpoint.to_owned()).collect()
}
