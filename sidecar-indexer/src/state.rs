//! Shared state of a running indexer and the read-only views the debug and fleet endpoints build
//! from it (a route call's logic is `crate::route`'s).
//!
//! Locks, and the rule that keeps them simple: every lock here is held for a bounded, synchronous
//! stretch and never across an `.await` (parking_lot guards are not `Send`, so the compiler holds us
//! to it). The index has its own `RwLock` (written only by the applier thread); fleet membership,
//! health and engine samples sit in [`Fleet`] behind one `RwLock`; booked load in one `Mutex`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::time::Instant;

use kvmesh_core::api::{FleetSnapshot, FleetWorker, Role, WorkerLoad};
use parking_lot::{Mutex, RwLock};
use rand::rngs::StdRng;
use serde::Serialize;

use crate::catalog::{Models, Refused, Served};
use crate::config::{Config, IndexMode, RoutingConfig, WorkerConfig};
use crate::events::applier::{ApplierMsg, IndexGauges};
use crate::events::listener::{ListenerHandle, ListenerStats};
use crate::index::{KvIndex, OverlapScores, WorkerSlot};
use crate::load::LoadTracker;
use crate::metrics::Metrics;
use crate::predict::{AdapterBookings, LoadOutlook, PrefillBacklog};
use crate::recent::Sessions;
use crate::scrape::{CounterMirror, EngineSample, PrefillMeter};
use crate::speculative::Speculative;

/// One dp rank of a worker: its index slot and listener.
pub struct RankRuntime {
    pub rank: u32,
    pub slot: WorkerSlot,
    pub stats: Arc<ListenerStats>,
    pub listener: Option<ListenerHandle>,
}

/// A worker as the running indexer knows it.
pub struct WorkerRuntime {
    pub cfg: WorkerConfig,
    /// The base model it serves (its `model`, else the default model): only requests for this
    /// model are placed on it.
    pub model: String,
    pub ranks: Vec<RankRuntime>,
    pub healthy: bool,
    pub scrape_failures: u32,
    pub engine: Option<EngineSample>,
    pub hits: CounterMirror,
    pub queries: CounterMirror,
    /// False while discovery says the worker must get no traffic (not ready, or vanished and in
    /// its grace period); its index, events and load stay (`crate::service::discovery`). Static workers: true.
    pub routable: bool,
    /// Measured prefill throughput and decode step time, from its scrapes.
    pub meter: PrefillMeter,
}

impl WorkerRuntime {
    /// Whether requests may go to it: healthy (scrapes answer) and routable (discovery).
    pub fn gets_traffic(&self) -> bool {
        self.healthy && self.routable
    }

    /// Decode part of a step, seconds: the measured inter-token latency, else the configured one.
    pub fn decode_step_s(&self, r: &RoutingConfig) -> f64 {
        self.meter.decode_step_s().unwrap_or(r.decode_step_ms / 1000.0)
    }
}

/// Requests tracked per worker in the prefill backlog model (the oldest dropped beyond it).
pub const BACKLOG_MAX_PER_WORKER: usize = 4096;

/// What placement remembers between decisions: booked prefill draining per worker, the blocks of
/// recent decisions (speculative holdings), and the recent route rate, per-worker utilization and
/// prompt tokens per second that the cost, `session_balance` and `request_balance` read; the
/// LoRA adapters just routed to each worker; and the decisions' randomness (near-tie draws), taken
/// under the same lock. All pure; the clock is passed in.
pub struct Placement {
    pub backlog: PrefillBacklog,
    pub speculative: Speculative,
    pub outlook: LoadOutlook,
    pub adapters: AdapterBookings,
    pub rng: StdRng,
}

impl Placement {
    /// Empty, bounded by `r`, drawing from `rng`.
    pub fn new(r: &RoutingConfig, rng: StdRng) -> Self {
        Self {
            rng,
            backlog: PrefillBacklog::new(BACKLOG_MAX_PER_WORKER),
            speculative: Speculative::new(
                std::time::Duration::from_millis(r.speculative_ttl_ms),
                r.speculative_max_blocks_per_worker,
            ),
            outlook: LoadOutlook::new(r.load_outlook_window_s),
            adapters: AdapterBookings::new(std::time::Duration::from_millis(
                r.adapter_booking_ttl_ms,
            )),
        }
    }

    /// Forgets a worker that left the fleet.
    pub fn remove_worker(&mut self, id: &str) {
        self.backlog.remove_worker(id);
        self.outlook.remove_worker(id);
        self.adapters.remove_worker(id);
    }

    /// New bounds (a reload).
    pub fn set_limits(&mut self, r: &RoutingConfig) {
        self.speculative.set_limits(
            std::time::Duration::from_millis(r.speculative_ttl_ms),
            r.speculative_max_blocks_per_worker,
        );
        self.outlook.set_window(r.load_outlook_window_s);
        self.adapters.set_ttl(std::time::Duration::from_millis(r.adapter_booking_ttl_ms));
    }
}

/// Fleet membership and health.
#[derive(Default)]
pub struct Fleet {
    pub generation: u64,
    pub workers: Vec<WorkerRuntime>,
    /// slot → index into `workers`.
    pub slot_owner: HashMap<WorkerSlot, usize>,
    /// Per role, the median prefill throughput of its measured workers: derived from the workers'
    /// meters, refreshed where those change (each scrape round) and with membership ([`Fleet::reindex`]).
    measured_prefill: Vec<(Role, f64)>,
}

impl Fleet {
    /// Rebuilds `slot_owner` and the per-role throughput medians after membership changes.
    pub fn reindex(&mut self) {
        self.slot_owner = self
            .workers
            .iter()
            .enumerate()
            .flat_map(|(i, w)| w.ranks.iter().map(move |r| (r.slot, i)))
            .collect();
        self.remeasure();
    }

    /// Prefill tokens/s the model uses for `w`: its own measurement, else the median of the
    /// measured workers of its role (a worker that just joined, or has not computed a prompt yet,
    /// most likely runs on the same hardware as its peers), else the configured default; clamped.
    /// Before, an unmeasured worker stood at the default: among engines ~7× slower than the default
    /// (real vLLM on CPU) a worker joining a measured fleet looked 7× faster than its peers, and
    /// every session whose recompute there was predicted cheaper moved to it. (With an even count
    /// the upper of the two middle readings stands for the median.)
    pub fn prefill_tokens_per_s(&self, w: &WorkerRuntime, r: &RoutingConfig) -> f64 {
        let peers =
            || self.measured_prefill.iter().find(|(role, _)| *role == w.cfg.role).map(|(_, t)| *t);
        w.meter.prefill_tokens_per_s().or_else(peers).map_or(r.prefill_tokens_per_s, |t| {
            t.clamp(r.prefill_tokens_per_s_min, r.prefill_tokens_per_s_max)
        })
    }

    /// Recomputes, per role, the median throughput of the measured workers (after each scrape
    /// round and each membership change).
    pub fn remeasure(&mut self) {
        let mut by_role: Vec<(Role, Vec<f64>)> = Vec::new();
        for w in &self.workers {
            let Some(t) = w.meter.prefill_tokens_per_s() else { continue };
            match by_role.iter_mut().find(|(role, _)| *role == w.cfg.role) {
                Some((_, rates)) => rates.push(t),
                None => by_role.push((w.cfg.role, vec![t])),
            }
        }
        self.measured_prefill = by_role
            .into_iter()
            .map(|(role, mut rates)| {
                rates.sort_by(f64::total_cmp);
                (role, rates[rates.len() / 2])
            })
            .collect();
    }

    /// Per worker (in fleet order), its overlap if it serves base model `model`, else 0: matches
    /// are read only for the model's workers (one index for every model: `crate::catalog`).
    pub fn overlaps_in(&self, scores: &OverlapScores, model: &str) -> Vec<u32> {
        let mut out = self.overlaps(scores);
        for (o, w) in out.iter_mut().zip(&self.workers) {
            if w.model != model {
                *o = 0;
            }
        }
        out
    }

    /// Per worker (in fleet order), its overlap: the best over its dp ranks.
    pub fn overlaps(&self, scores: &OverlapScores) -> Vec<u32> {
        let mut out = vec![0u32; self.workers.len()];
        for (slot, blocks) in scores {
            if let Some(&i) = self.slot_owner.get(slot) {
                out[i] = out[i].max(*blocks);
            }
        }
        out
    }
}

/// Engine counters summed over the fleet since start (for the engine-side hit rate).
#[derive(Debug, Default)]
pub struct EngineTotals {
    pub hits: AtomicU64,
    pub queries: AtomicU64,
}

/// Everything the API handlers and background tasks share.
pub struct AppState {
    pub config: RwLock<Arc<Config>>,
    pub fleet: RwLock<Fleet>,
    pub index: Arc<RwLock<KvIndex>>,
    pub gauges: Arc<IndexGauges>,
    pub load: Mutex<LoadTracker>,
    /// Per base model its configuration and tokenizer, and the catalog requests resolve against
    /// (`crate::catalog`); replaced whole on a reload or when the served adapters change.
    pub models: RwLock<Arc<Models>>,
    /// The adapters each worker's engine reports serving (`crate::service::served`) and the
    /// refusals already logged and counted.
    pub served: Mutex<ServedState>,
    pub metrics: Arc<Metrics>,
    pub applier: SyncSender<ApplierMsg>,
    pub engine_totals: EngineTotals,
    pub free_slots: Arc<Mutex<Vec<WorkerSlot>>>,
    pub next_slot: Mutex<WorkerSlot>,
    pub started: Instant,
    /// Recently seen sessions and their last decode worker (modes).
    pub sessions: Mutex<Sessions>,
    /// HTTP client for prefill legs and migration handshakes.
    pub legs: reqwest::Client,
    /// Dry-run migrations seen, for sampling their log lines.
    pub dry_runs: AtomicU64,
    /// `/v1/route` calls being worked on (`crate::route::admission`).
    pub route_inflight: Arc<std::sync::atomic::AtomicUsize>,
    /// Prefill backlog model, speculative holdings and the decisions' randomness.
    pub placement: Mutex<Placement>,
    /// Recent long chat bodies' read prefixes (`crate::route::body_memo`).
    pub body_memo: Mutex<crate::route::body_memo::BodyMemo>,
    /// Decisions placed since the current scrape round started, and the signal that asks the
    /// scrape loop for an early round once `scrape_burst_decisions` of them were placed.
    pub decisions_since_scrape: AtomicU64,
    pub scrape_soon: tokio::sync::Notify,
    /// The threads that finish partly tokenized prompts off the request path
    /// (`crate::route::background`).
    pub background: crate::route::background::Background,
}

/// What the engines report serving, as the catalog was last built from it.
#[derive(Default)]
pub struct ServedState {
    pub served: Served,
    /// Refusals already logged and counted (each once while it lasts; bounded by the served lists).
    pub refused: std::collections::BTreeSet<Refused>,
}

impl AppState {
    /// The models and catalog now.
    pub fn models(&self) -> Arc<Models> {
        self.models.read().clone()
    }

    /// Rebuilds the catalog from the current runtimes and `served`, logging and counting refusals
    /// not seen before. Returns whether the catalog changed.
    pub fn rebuild_catalog(&self) -> bool {
        let mut served = self.served.lock();
        let mut models = self.models.write();
        let (next, refused) = Models::new(models.runtimes().to_vec(), &served.served);
        for r in &refused {
            if !served.refused.contains(r) {
                self.metrics.served_adapters_refused.with_label_values(&[r.reason.as_str()]).inc();
                tracing::warn!(adapter = %r.adapter, model = %r.model, reason = r.reason.as_str(), "adapter an engine serves left out of the catalog");
            }
        }
        served.refused = refused.into_iter().collect();
        let changed = next.catalog() != models.catalog();
        *models = Arc::new(next);
        changed
    }

    /// The current configuration.
    pub fn config(&self) -> Arc<Config> {
        self.config.read().clone()
    }

    /// A slot for a new (worker, rank): a returned one if any, else a fresh one.
    pub fn alloc_slot(&self) -> WorkerSlot {
        if let Some(s) = self.free_slots.lock().pop() {
            return s;
        }
        let mut next = self.next_slot.lock();
        let s = *next;
        *next += 1;
        s
    }

    /// `GET /v1/fleet`.
    pub fn snapshot(&self) -> FleetSnapshot {
        let models = self.models();
        let fleet = self.fleet.read();
        let load = self.load.lock();
        FleetSnapshot {
            generation: fleet.generation,
            block_size: models.catalog().first().map_or(0, |m| m.block_size),
            models: models.catalog().to_vec(),
            workers: fleet
                .workers
                .iter()
                .map(|w| {
                    let mut l = load.worker(&w.cfg.id);
                    l.waiting_requests = w.engine.as_ref().map_or(0, |e| e.waiting.max(0.0) as u64);
                    FleetWorker {
                        id: w.cfg.id.clone(),
                        endpoint: w.cfg.endpoint.clone(),
                        role: w.cfg.role,
                        model: w.model.clone(),
                        healthy: w.gets_traffic(),
                        load: l,
                    }
                })
                .collect(),
        }
    }

    /// Whether the index reflects the engines: every events listener finished its start-up replay.
    /// Returns the workers still syncing.
    pub fn not_ready(&self) -> Vec<String> {
        if self.config.read().routing.mode == IndexMode::Approximate {
            return Vec::new();
        }
        let fleet = self.fleet.read();
        fleet
            .workers
            .iter()
            .filter(|w| {
                w.cfg.kv_events.is_some()
                    && w.ranks.iter().any(|r| !r.stats.synced.load(Ordering::Relaxed))
            })
            .map(|w| w.cfg.id.clone())
            .collect()
    }

    /// Refreshes the gauges that are cheaper to read at scrape time than to keep current.
    pub fn refresh_gauges(&self) {
        let m = &self.metrics;
        m.index_blocks.set(self.gauges.blocks.load(Ordering::Relaxed) as i64);
        m.index_entries.set(self.gauges.entries.load(Ordering::Relaxed) as i64);
        m.index_bytes.set(self.gauges.bytes.load(Ordering::Relaxed) as i64);
        let models = self.models();
        let tokenizers = models.runtimes().iter().map(|r| &r.tokenizer);
        let (cache, memo) =
            tokenizers.fold((0, 0), |(c, m), t| (c + t.cache_bytes(), m + t.memo_bytes()));
        m.tokenize_cache_bytes.set(cache as i64);
        m.tokenize_memo_bytes.set(memo as i64);
        m.body_memo_bytes.set(self.body_memo.lock().bytes() as i64);
        m.recovery_blocks.set(self.index.read().recovery_blocks() as i64);
        let fleet = self.fleet.read();
        m.fleet_generation.set(fleet.generation as i64);
        let now_ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        {
            let index = self.index.read();
            for w in &fleet.workers {
                let blocks: usize = w.ranks.iter().map(|r| index.worker_blocks(r.slot)).sum();
                m.worker_blocks.with_label_values(&[&w.cfg.id]).set(blocks as i64);
            }
        }
        let load = self.load.lock();
        let routing = self.config.read().routing.clone();
        let now = crate::clock::now();
        {
            let mut placement = self.placement.lock();
            placement.backlog.compact(
                |id| {
                    fleet
                        .workers
                        .iter()
                        .find(|w| w.cfg.id == id)
                        .map_or(routing.prefill_tokens_per_s, |w| {
                            fleet.prefill_tokens_per_s(w, &routing)
                        })
                },
                now,
            );
            for w in &fleet.workers {
                let tps = fleet.prefill_tokens_per_s(w, &routing);
                let ahead = placement
                    .backlog
                    .ahead(&w.cfg.id, tps, now)
                    .tokens
                    .min(load.worker(&w.cfg.id).prefill_tokens as f64);
                m.worker_prefill_tps.with_label_values(&[&w.cfg.id]).set(tps);
                m.worker_queued_prefill.with_label_values(&[&w.cfg.id]).set(ahead);
            }
            placement.speculative.expire(now);
            m.speculative_blocks.set(placement.speculative.len() as i64);
        }
        for w in &fleet.workers {
            let id = w.cfg.id.as_str();
            let l = load.worker(id);
            m.worker_active_requests.with_label_values(&[id]).set(l.active_requests as i64);
            m.worker_active_blocks.with_label_values(&[id]).set(l.active_blocks as i64);
            m.worker_prefill_tokens.with_label_values(&[id]).set(l.prefill_tokens as i64);
            m.worker_healthy.with_label_values(&[id]).set(i64::from(w.gets_traffic()));
            if let Some(e) = &w.engine {
                m.worker_running.with_label_values(&[id]).set(e.running as i64);
                m.worker_waiting.with_label_values(&[id]).set(e.waiting as i64);
            }
            if let Some(ts) = w.ranks.iter().filter_map(|r| r.stats.last_ts()).reduce(f64::max) {
                m.kv_event_lag.with_label_values(&[id]).set((now_ts - ts).max(0.0));
            }
        }
        {
            let sessions = self.sessions.lock();
            m.sessions_tracked
                .with_label_values(&["continuations"])
                .set(sessions.continuations.len() as i64);
            m.sessions_tracked.with_label_values(&["kv_home"]).set(sessions.kv_home.len() as i64);
        }
        let (overlap, isl) = models.runtimes().iter().fold((0, 0), |(o, i), r| {
            let label = [r.name()];
            (
                o + m.overlap_blocks.with_label_values(&label).get(),
                i + m.isl_blocks.with_label_values(&label).get(),
            )
        });
        if isl > 0 {
            m.kv_block_hit_rate.with_label_values(&["router"]).set(overlap as f64 / isl as f64);
        }
        let q = self.engine_totals.queries.load(Ordering::Relaxed);
        if q > 0 {
            let h = self.engine_totals.hits.load(Ordering::Relaxed);
            m.kv_block_hit_rate.with_label_values(&["engine"]).set(h as f64 / q as f64);
        }
    }

    /// `GET /debug/workers`.
    pub fn debug_workers(&self) -> Vec<DebugWorker> {
        let fleet = self.fleet.read();
        let index = self.index.read();
        let load = self.load.lock();
        let now_ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        fleet
            .workers
            .iter()
            .map(|w| DebugWorker {
                id: w.cfg.id.clone(),
                model: w.model.clone(),
                endpoint: w.cfg.endpoint.clone(),
                role: w.cfg.role.as_str(),
                healthy: w.healthy,
                routable: w.routable,
                scrape_failures: w.scrape_failures,
                load: load.worker(&w.cfg.id),
                engine_running: w.engine.as_ref().map(|e| e.running),
                engine_waiting: w.engine.as_ref().map(|e| e.waiting),
                engine_kv_usage: w.engine.as_ref().and_then(|e| e.kv_usage),
                ranks: w
                    .ranks
                    .iter()
                    .map(|r| DebugRank {
                        rank: r.rank,
                        slot: r.slot,
                        events: w.cfg.events_endpoint(r.rank),
                        replay: w.cfg.replay_endpoint(r.rank),
                        blocks_held: index.worker_blocks(r.slot),
                        last_seq: r.stats.last_seq(),
                        batches: r.stats.batches.load(Ordering::Relaxed),
                        gaps: r.stats.gaps.load(Ordering::Relaxed),
                        replays: r.stats.replays.load(Ordering::Relaxed),
                        resyncs: r.stats.resyncs.load(Ordering::Relaxed),
                        orphan_stores: r.stats.orphan_stores.load(Ordering::Relaxed),
                        decode_errors: r.stats.decode_errors.load(Ordering::Relaxed),
                        lag_seconds: r.stats.last_ts().map(|ts| (now_ts - ts).max(0.0)),
                        synced: r.stats.synced.load(Ordering::Relaxed),
                    })
                    .collect(),
            })
            .collect()
    }

    /// `GET /debug/blocks?worker=<id>`: per rank, the blocks the index holds for the worker.
    pub fn debug_blocks(&self, worker: &str) -> Option<Vec<DebugBlocks>> {
        // The fleet lock only for the slots; the index read lock only for the copy. Sorting (and
        // serialising) happens after both are released: a dump must not hold back the index writer
        // (which waits for a moment with no reader, `events/applier.rs`).
        let ranks: Vec<(u32, WorkerSlot)> = {
            let fleet = self.fleet.read();
            let w = fleet.workers.iter().find(|w| w.cfg.id == worker)?;
            w.ranks.iter().map(|r| (r.rank, r.slot)).collect()
        };
        let copied: Vec<(u32, Vec<DebugBlock>)> = {
            let index = self.index.read();
            ranks
                .iter()
                .map(|&(rank, slot)| {
                    let blocks = index
                        .worker_refs(slot)
                        .into_iter()
                        .map(|(engine, b)| DebugBlock {
                            engine_hash: engine,
                            chain_hash: b.chain.0,
                            indexed: index.holds(slot, b.chain),
                        })
                        .collect();
                    (rank, blocks)
                })
                .collect()
        };
        Some(
            copied
                .into_iter()
                .map(|(rank, mut blocks)| {
                    blocks.sort_unstable_by_key(|b| b.engine_hash);
                    DebugBlocks { rank, blocks }
                })
                .collect(),
        )
    }
}

/// One worker in `/debug/workers`.
#[derive(Debug, Serialize)]
pub struct DebugWorker {
    pub id: String,
    pub model: String,
    pub endpoint: String,
    pub role: &'static str,
    pub healthy: bool,
    /// False while discovery keeps the worker out of routing (see [`WorkerRuntime::routable`]).
    pub routable: bool,
    pub scrape_failures: u32,
    pub load: WorkerLoad,
    pub engine_running: Option<f64>,
    pub engine_waiting: Option<f64>,
    pub engine_kv_usage: Option<f64>,
    pub ranks: Vec<DebugRank>,
}

/// One dp rank in `/debug/workers`.
#[derive(Debug, Serialize)]
pub struct DebugRank {
    pub rank: u32,
    pub slot: WorkerSlot,
    pub events: Option<String>,
    pub replay: Option<String>,
    pub blocks_held: usize,
    pub last_seq: Option<u64>,
    pub batches: u64,
    pub gaps: u64,
    pub replays: u64,
    pub resyncs: u64,
    pub orphan_stores: u64,
    pub decode_errors: u64,
    pub lag_seconds: Option<f64>,
    pub synced: bool,
}

/// One rank in `/debug/blocks`.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct DebugBlocks {
    pub rank: u32,
    pub blocks: Vec<DebugBlock>,
}

/// One block a worker holds: its engine hash, the chain hash computed here, and whether the index
/// (not only the worker's mapping) holds it — false only after a memory-bound eviction.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct DebugBlock {
    pub engine_hash: u64,
    pub chain_hash: u64,
    pub indexed: bool,
}

#[cfg(test)]
#[path = "state_tests.rs"]
mod tests;
