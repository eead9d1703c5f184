//! The routing decision: pure, synchronous, with the random source passed in.
//!
//! Input: the request's size in tokens, its session key (if the filter sent one), operator
//! overrides, and a view of every worker (role, health, overlap with this prompt, speculative
//! overlap, booked load, and its [`WorkerTiming`]: prefill queued ahead, decode batch, measured
//! throughput). Output: a [`Plan`] — the worker, fallbacks, mode, the numbers behind the choice, the
//! predicted time to first token and a human reason. The mode ([`crate::modes`]) may name a [`Leg`]
//! the async shell runs before answering: a prefill leg on a prefill worker, or a migration
//! handshake on the decode worker that holds the blocks.
//!
//! Every candidate is scored by its predicted TTFT for this request ([`crate::predict::ttft_s`]):
//! the prefill queued ahead of it plus this request's uncached tokens there (overlap capped at
//! ⌊(tokens − 1) / block_size⌋, the engine's last-block rule), divided by its throughput, plus its
//! decode batch's share of the steps. Lowest wins; workers within the near-tie band
//! (`near_tie_ms`, `near_tie_fraction`) of the fastest are drawn uniformly at random, so gateway
//! replicas with the same view do not herd — except that a new session takes its rendezvous worker
//! when that is among them, which is the worker the filter's fallback pins it to while the indexer
//! is down, and the one every replica picks for it; `temperature > 0` samples
//! p ∝ exp(−normalised time / temperature).
//! A session stays at its home (where its KV is: the worker holding most of the prompt by the
//! index, which every gateway replica shares — this replica's `kv_home` only when the index does not
//! tell workers apart; or its rendezvous worker with `session_placement = "rendezvous"`) unless another worker
//! is predicted faster by more than the move margin (`session_move_margin_ms` and
//! `session_move_margin` × the home's time): hysteresis, so it does not flap. The `overload_*`
//! thresholds remain hard guards: an overloaded worker is a candidate only when every worker is.

use kvmesh_core::api::{Mode, Role, RouteDecision};
use kvmesh_core::rendezvous;
use kvmesh_core::session::{SessionKey, SessionSource};
use rand::Rng;

use crate::config::{KvMigration, RoutingConfig, SessionPlacement};
use crate::modes::{choose_mode, ModeInput, Opportunity};
use crate::predict::{max_cached_blocks, ttft_s, WorkerTiming};

/// One worker as the decision sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView<'a> {
    pub id: &'a str,
    pub endpoint: &'a str,
    pub role: Role,
    pub healthy: bool,
    /// Leading blocks of this prompt the worker holds, per the index (engine events).
    pub overlap_blocks: u32,
    /// Leading blocks credited from recent decisions not yet confirmed by events (sibling bursts).
    pub speculative_blocks: u32,
    /// Decode load in blocks: booked, plus the engine's in-flight requests the indexer did not route.
    pub active_blocks: u64,
    /// In-flight requests routed to the worker.
    pub active_requests: u64,
    /// `vllm:num_requests_waiting` from the last scrape.
    pub waiting_requests: u64,
    /// Queued prefill, decode batch, throughput: the inputs of the predicted TTFT.
    pub timing: WorkerTiming,
}

impl WorkerView<'_> {
    fn candidate(&self) -> bool {
        self.healthy && self.role.decodes()
    }

    /// Leading blocks counted as cached when predicting: the index's or the speculative ones.
    pub fn cached_blocks(&self) -> u32 {
        self.overlap_blocks.max(self.speculative_blocks)
    }
}

/// What the decision needs from the request.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteInput<'a> {
    pub isl_tokens: usize,
    pub block_size: u32,
    pub session: Option<(SessionKey, SessionSource)>,
    /// `x-kvmesh-worker`.
    pub override_worker: Option<&'a str>,
    /// `x-kvmesh-mode`.
    pub override_mode: Option<Mode>,
    /// The session was routed within the local-continuation TTL.
    pub continuation: bool,
    /// The session's last decode worker, if remembered (`kv_home`).
    pub kv_home: Option<&'a str>,
}

impl RouteInput<'_> {
    /// Full blocks of the prompt (what `RouteDecision::isl_blocks` reports).
    pub fn full_blocks(&self) -> u32 {
        kvmesh_core::router_metrics::isl_blocks(self.isl_tokens, self.block_size)
    }
    /// Blocks including a partial last one (booked load, and Dynamo's hit-rate denominator).
    pub fn request_blocks(&self) -> u32 {
        u32::try_from(self.isl_tokens.div_ceil(self.block_size.max(1) as usize)).unwrap_or(u32::MAX)
    }
    /// The most blocks an engine can serve from cache for this prompt (the last token is computed).
    pub fn max_cached_blocks(&self) -> u32 {
        max_cached_blocks(self.isl_tokens, self.block_size)
    }
}

/// Why the worker was chosen (the `basis` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    Override,
    /// A session stayed at its home.
    SessionPin,
    /// A session left its home: another worker was faster by more than the margin.
    SessionMoved,
    /// A session's home is over an `overload_*` guard.
    PinOverloaded,
    BestOverlap,
    LowestCost,
}

impl Basis {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Override => "override",
            Self::SessionPin => "session_pin",
            Self::SessionMoved => "session_moved",
            Self::PinOverloaded => "pin_overloaded",
            Self::BestOverlap => "best_overlap",
            Self::LowestCost => "lowest_cost",
        }
    }
}

/// Work the async shell must do before answering: a prefill leg, or a migration handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    /// Run the prefill leg on this prefill worker and carry its `kv_transfer_params`.
    PrefillOn { worker: String, endpoint: String },
    /// Ask this worker for a one-step producer handshake; the target pulls the blocks.
    MigrateFrom { worker: String, endpoint: String },
}

/// The decision, before the shell turns it into a [`RouteDecision`].
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub worker: String,
    pub endpoint: String,
    pub fallbacks: Vec<String>,
    pub mode: Mode,
    /// Index overlap on the chosen worker (capped by the last-block rule; never speculative).
    pub overlap_blocks: u32,
    /// What speculative holdings add on the chosen worker beyond `overlap_blocks`.
    pub speculative_extra_blocks: u32,
    pub isl_blocks: u32,
    pub request_blocks: u32,
    pub best_overlap: Option<(String, u32)>,
    pub basis: Basis,
    pub reason: String,
    pub leg: Option<Leg>,
    /// A would-migrate decision (counted in `dry` and `on` migration modes).
    pub opportunity: Option<Opportunity>,
    /// A continuation kept on its decode worker although it was above the disaggregation threshold.
    pub local_continuation: bool,
    /// Prompt tokens the chosen worker does not cache.
    pub uncached_tokens: u64,
    /// Predicted time to first token on the chosen worker, milliseconds.
    pub predicted_ttft_ms: f64,
}

impl Plan {
    /// The wire answer (no leg ran: `kv_transfer_params` is null, `peer_worker` none).
    pub fn into_decision(self) -> RouteDecision {
        let (best_overlap_worker, best_overlap_blocks) = match self.best_overlap {
            Some((w, b)) => (Some(w), b),
            None => (None, 0),
        };
        RouteDecision {
            endpoint: self.endpoint,
            fallbacks: self.fallbacks,
            worker: self.worker,
            mode: self.mode,
            overlap_blocks: self.overlap_blocks,
            isl_blocks: self.isl_blocks,
            kv_transfer_params: None,
            reason: self.reason,
            best_overlap_worker,
            best_overlap_blocks,
            peer_worker: None,
            predicted_ttft_ms: Some(self.predicted_ttft_ms),
            booking_id: None,
        }
    }
}

/// Why no decision could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    #[error("no healthy decode-capable worker")]
    NoDecodeWorker,
    #[error("x-kvmesh-worker names unknown worker {0:?}")]
    UnknownOverrideWorker(String),
}

impl DecideError {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoDecodeWorker => "no_decode_worker",
            Self::UnknownOverrideWorker(_) => "unknown_override_worker",
        }
    }
}

/// Why `w` is overloaded under `cfg`, or None.
pub fn overloaded(w: &WorkerView<'_>, cfg: &RoutingConfig) -> Option<String> {
    let checks = [
        ("active_blocks", w.active_blocks, cfg.overload_active_blocks),
        (
            "active_requests",
            w.active_requests,
            cfg.overload_active_requests,
        ),
        ("waiting", w.waiting_requests, cfg.overload_waiting_requests),
    ];
    checks
        .iter()
        .find(|(_, v, limit)| *limit > 0 && v >= limit)
        .map(|(name, v, limit)| format!("{name} {v} >= {limit}"))
}

/// A worker with its prediction for this request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scored<'v, 'a> {
    pub w: &'v WorkerView<'a>,
    /// Predicted TTFT, seconds.
    pub ttft_s: f64,
    /// Uncached tokens it would compute.
    pub own_tokens: u64,
    /// Blocks it would pull by KV migration instead of recomputing (`kv_migration = "on"`).
    pub migrated_blocks: u32,
}

impl Scored<'_, '_> {
    fn ms(&self) -> f64 {
        self.ttft_s * 1000.0
    }
}

/// Scores `w`: its uncached tokens (crediting a migration from `best_index` when that is on and
/// worth it) and the predicted TTFT.
pub(crate) fn score<'v, 'a>(
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
    let own_tokens = isl - (u64::from(cached) * bs).min(isl);
    Scored {
        w,
        ttft_s: ttft_s(&w.timing, own_tokens as f64, cfg.prefill_chunk_tokens),
        own_tokens,
        migrated_blocks,
    }
}

/// Decides where the request goes and in which mode.
pub fn decide<R: Rng + ?Sized>(
    input: &RouteInput<'_>,
    workers: &[WorkerView<'_>],
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Result<Plan, DecideError> {
    // The last-block rule, once, for everything downstream (decision, metrics, modes).
    let cap = input.max_cached_blocks();
    let workers: Vec<WorkerView<'_>> = workers
        .iter()
        .map(|w| WorkerView {
            overlap_blocks: w.overlap_blocks.min(cap),
            speculative_blocks: w.speculative_blocks.min(cap),
            ..w.clone()
        })
        .collect();
    let mut plan = decide_worker(input, &workers, cfg, rng)?;
    let decode = workers
        .iter()
        .find(|w| w.id == plan.worker)
        .ok_or(DecideError::NoDecodeWorker)?;
    let mode_input = ModeInput {
        isl_tokens: input.isl_tokens as u64,
        block_size: input.block_size,
        continuation: input.continuation,
        kv_home: input.kv_home,
        override_mode: input.override_mode,
    };
    let best = plan.best_overlap.as_ref().map(|(id, b)| (id.as_str(), *b));
    let m = choose_mode(&mode_input, decode, &workers, best, cfg, rng);
    plan.mode = m.mode;
    plan.leg = m.leg;
    plan.opportunity = m.opportunity;
    plan.local_continuation = m.local_continuation;
    plan.uncached_tokens = m.uncached_tokens;
    if !m.reason.is_empty() {
        plan.reason = format!("{}; {}", plan.reason, m.reason);
    }
    Ok(plan)
}

/// Chooses the decode worker (the plan's mode is `aggregate` until [`choose_mode`] runs).
fn decide_worker<R: Rng + ?Sized>(
    input: &RouteInput<'_>,
    workers: &[WorkerView<'_>],
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Result<Plan, DecideError> {
    let isl = input.full_blocks();
    let candidates: Vec<&WorkerView<'_>> = workers.iter().filter(|w| w.candidate()).collect();
    let best_index = candidates
        .iter()
        .map(|w| w.overlap_blocks)
        .max()
        .unwrap_or(0);
    let scored: Vec<Scored<'_, '_>> = candidates
        .iter()
        .map(|w| {
            score(
                w,
                input.isl_tokens as u64,
                input.block_size,
                best_index,
                cfg,
            )
        })
        .collect();
    let mut prefix = String::new();

    if let Some(id) = input.override_worker {
        let w = workers
            .iter()
            .find(|w| w.id == id)
            .ok_or_else(|| DecideError::UnknownOverrideWorker(id.to_owned()))?;
        if w.candidate() {
            let s = score(
                w,
                input.isl_tokens as u64,
                input.block_size,
                best_index,
                cfg,
            );
            let reason = format!(
                "override x-kvmesh-worker {}: overlap {}/{isl} blocks, predicted {:.1} ms",
                w.id,
                w.overlap_blocks,
                s.ms()
            );
            return Ok(finish(
                input,
                s,
                fallbacks(&scored, w.id, cfg.max_fallbacks),
                Basis::Override,
                reason,
                &candidates,
            ));
        }
        prefix = format!(
            "override {} ignored ({}); ",
            w.id,
            if w.healthy {
                "cannot decode"
            } else {
                "unhealthy"
            }
        );
    }
    if scored.is_empty() {
        return Err(DecideError::NoDecodeWorker);
    }

    // Hard guards: an overloaded worker is a candidate only when every worker is.
    let guarded: Vec<Scored<'_, '_>> = {
        let ok: Vec<Scored<'_, '_>> = scored
            .iter()
            .copied()
            .filter(|s| overloaded(s.w, cfg).is_none())
            .collect();
        if ok.is_empty() {
            scored.clone()
        } else {
            ok
        }
    };

    if let Some((key, source)) = input.session {
        let home_id = match cfg.session_placement {
            SessionPlacement::Rendezvous => {
                rendezvous::pick(key.0, candidates.iter().map(|w| w.id))
            }
            // Where its KV is. The index is shared truth — every gateway replica consumes the same
            // events — while `kv_home` is this replica's memory, stale once another replica served
            // the session elsewhere: so the home is the worker holding most of the prompt by the
            // index (its `kv_home`, else its rendezvous worker, when several hold as much), and
            // `kv_home` only when the index does not tell the workers apart. Without either (new,
            // or forgotten) the session is placed by prediction.
            SessionPlacement::Predicted | SessionPlacement::Sticky => {
                let kv_home = input.kv_home.filter(|h| candidates.iter().any(|w| w.id == *h));
                let holders: Vec<&str> =
                    candidates.iter().filter(|w| best_index > 0 && w.overlap_blocks == best_index).map(|w| w.id).collect();
                if holders.is_empty() || holders.len() == candidates.len() {
                    kv_home
                } else {
                    kv_home.filter(|h| holders.contains(h)).or_else(|| rendezvous::pick(key.0, holders.iter().copied()))
                }
            }
        };
        let src = source.as_str();
        if let Some(home_id) = home_id {
            match guarded.iter().find(|s| s.w.id == home_id) {
                Some(&home) => {
                    let others: Vec<Scored<'_, '_>> = guarded
                        .iter()
                        .copied()
                        .filter(|s| s.w.id != home_id)
                        .collect();
                    let best_other = (!others.is_empty()).then(|| pick(&others, isl, None, cfg, rng).0);
                    let gain = best_other.map_or(0.0, |o| home.ttft_s - o.ttft_s);
                    let margin_s = (cfg.session_move_margin_ms / 1000.0)
                        .max(cfg.session_move_margin * home.ttft_s);
                    if let Some(o) = best_other.filter(|_| gain > margin_s) {
                        let reason = format!(
                            "{prefix}session moved from {home_id} (source={src}): predicted {:.1} ms there {}, {} {:.1} ms (margin {:.1} ms); overlap {}/{isl} blocks{}",
                            home.ms(),
                            load_note(&home),
                            o.w.id,
                            o.ms(),
                            margin_s * 1000.0,
                            o.w.overlap_blocks,
                            migrated_note(&o)
                        );
                        return Ok(finish(
                            input,
                            o,
                            fallbacks(&scored, o.w.id, cfg.max_fallbacks),
                            Basis::SessionMoved,
                            reason,
                            &candidates,
                        ));
                    }
                    let other = best_other.map_or(String::new(), |o| {
                        format!(" (best other {} {:.1} ms)", o.w.id, o.ms())
                    });
                    let reason = format!(
                        "{prefix}session pin {home_id} (source={src}): overlap {}/{isl} blocks, predicted {:.1} ms{other}",
                        home.w.overlap_blocks,
                        home.ms()
                    );
                    return Ok(finish(
                        input,
                        home,
                        fallbacks(&scored, home_id, cfg.max_fallbacks),
                        Basis::SessionPin,
                        reason,
                        &candidates,
                    ));
                }
                None => {
                    let why = candidates
                        .iter()
                        .find(|w| w.id == home_id)
                        .and_then(|w| overloaded(w, cfg))
                        .unwrap_or_default();
                    let (chosen, inner, _) = pick(&guarded, isl, None, cfg, rng);
                    let reason = format!(
                        "{prefix}home {home_id} overloaded ({why}); chose {}: {inner}",
                        chosen.w.id
                    );
                    return Ok(finish(
                        input,
                        chosen,
                        fallbacks(&guarded, chosen.w.id, cfg.max_fallbacks),
                        Basis::PinOverloaded,
                        reason,
                        &candidates,
                    ));
                }
            }
        }
        prefix = format!("{prefix}new session: ");
    }

    // A new session's near-tie preference: its rendezvous worker (see the module docs).
    let rendezvous_home = input.session.and_then(|(key, _)| rendezvous::pick(key.0, guarded.iter().map(|s| s.w.id)));
    let (chosen, inner, next) = pick(&guarded, isl, rendezvous_home, cfg, rng);
    let max_cached = guarded
        .iter()
        .map(|s| s.w.cached_blocks())
        .max()
        .unwrap_or(0);
    let cached = chosen.w.cached_blocks();
    let basis = if cached > 0 && cached == max_cached {
        Basis::BestOverlap
    } else {
        Basis::LowestCost
    };
    Ok(finish(
        input,
        chosen,
        fallbacks(&guarded, chosen.w.id, cfg.max_fallbacks),
        basis,
        format!("{prefix}{inner}{next}"),
        &candidates,
    ))
}

/// What a prediction rests on, compactly (the reason travels in a 256-byte header).
fn load_note(s: &Scored<'_, '_>) -> String {
    let t = &s.w.timing;
    format!(
        "[{:.0} queued + {} own tokens at {:.0} tok/s, batch {}]",
        t.queued_tokens, s.own_tokens, t.prefill_tokens_per_s, t.decode_batch
    )
}

fn migrated_note(s: &Scored<'_, '_>) -> String {
    if s.migrated_blocks > 0 {
        format!(", {} blocks migrated", s.migrated_blocks)
    } else {
        String::new()
    }
}

fn finish(
    input: &RouteInput<'_>,
    s: Scored<'_, '_>,
    fallbacks: Vec<String>,
    basis: Basis,
    reason: String,
    candidates: &[&WorkerView<'_>],
) -> Plan {
    let w = s.w;
    Plan {
        worker: w.id.to_owned(),
        endpoint: w.endpoint.to_owned(),
        fallbacks,
        mode: Mode::Aggregate,
        overlap_blocks: w.overlap_blocks,
        speculative_extra_blocks: w.speculative_blocks.saturating_sub(w.overlap_blocks),
        isl_blocks: input.full_blocks(),
        request_blocks: input.request_blocks(),
        best_overlap: best_overlap(candidates, w.id),
        basis,
        reason,
        leg: None,
        opportunity: None,
        local_continuation: false,
        uncached_tokens: s.own_tokens,
        predicted_ttft_ms: s.ms(),
    }
}

/// The worker holding most of the prompt per the index (the chosen one on a tie, else the smallest
/// id); None when nobody holds block 0.
fn best_overlap(candidates: &[&WorkerView<'_>], chosen: &str) -> Option<(String, u32)> {
    let max = candidates
        .iter()
        .map(|w| w.overlap_blocks)
        .max()
        .filter(|m| *m > 0)?;
    let best = candidates
        .iter()
        .filter(|w| w.overlap_blocks == max)
        .min_by_key(|w| (w.id != chosen, w.id))?;
    Some((best.id.to_owned(), max))
}

/// Whether `t` (seconds) is within the near-tie band of the fastest `min`.
fn near(t: f64, min: f64, cfg: &RoutingConfig) -> bool {
    t - min <= (cfg.near_tie_ms / 1000.0).max(cfg.near_tie_fraction * min) + 1e-12
}

/// Picks the fastest of `set` (non-empty; `isl` = the prompt's full blocks, for the reason):
/// `prefer` when it is within the near-tie band, else one drawn uniformly from the band — no
/// deterministic preference (such as the most index overlap) inside it, which is what makes gateway
/// replicas that see the same index and events herd — or sampled with `temperature > 0`; returns
/// it, a reason and the runner-up (`; next w2 12.0 ms`, or empty).
pub(crate) fn pick<'v, 'a, R: Rng + ?Sized>(
    set: &[Scored<'v, 'a>],
    isl: u32,
    prefer: Option<&str>,
    cfg: &RoutingConfig,
    rng: &mut R,
) -> (Scored<'v, 'a>, String, String) {
    let times: Vec<f64> = set.iter().map(|s| s.ttft_s).collect();
    let min = times.iter().copied().fold(f64::INFINITY, f64::min);
    let max = times.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sampled = cfg.temperature > 0.0 && max > min;
    let index = if sampled {
        let weights: Vec<f64> = times
            .iter()
            .map(|t| (-((t - min) / (max - min)) / cfg.temperature).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut x = rng.gen::<f64>() * total;
        let mut chosen = weights.len() - 1;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                chosen = i;
                break;
            }
            x -= w;
        }
        chosen
    } else {
        let tied: Vec<usize> = (0..times.len())
            .filter(|&i| near(times[i], min, cfg))
            .collect();
        match tied.iter().copied().find(|&i| Some(set[i].w.id) == prefer) {
            Some(preferred) => preferred,
            None => tied.get(rng.gen_range(0..tied.len().max(1))).copied().unwrap_or(0),
        }
    };
    let s = set[index];
    let next = set
        .iter()
        .filter(|o| o.w.id != s.w.id)
        .min_by(|a, b| {
            a.ttft_s
                .total_cmp(&b.ttft_s)
                .then_with(|| a.w.id.cmp(b.w.id))
        })
        .map_or(String::new(), |o| {
            format!("; next {} {:.1} ms", o.w.id, o.ms())
        });
    let temp = if sampled {
        format!("sampled at temperature {}: ", cfg.temperature)
    } else {
        String::new()
    };
    let max_cached = set.iter().map(|s| s.w.cached_blocks()).max().unwrap_or(0);
    let what = if s.migrated_blocks > 0 {
        format!("migrating {} blocks", s.migrated_blocks)
    } else if max_cached == 0 {
        "nothing cached".to_owned()
    } else if s.w.cached_blocks() == max_cached {
        format!("best overlap {}/{isl} blocks", s.w.cached_blocks())
    } else {
        format!(
            "overlap {}/{isl} blocks (best elsewhere {max_cached})",
            s.w.cached_blocks()
        )
    };
    let spec = if s.w.speculative_blocks > s.w.overlap_blocks {
        format!(
            " (+{} speculative)",
            s.w.speculative_blocks - s.w.overlap_blocks
        )
    } else {
        String::new()
    };
    // Short: the reason travels in a 256-byte debug header together with the mode's part.
    let queued = s.w.timing.queued_tokens.round();
    let queued = if queued > 0.0 {
        format!(" after {queued} queued tokens")
    } else {
        String::new()
    };
    let reason = format!("{temp}{what}{spec}, predicted {:.1} ms{queued}", s.ms());
    (s, reason, next)
}

/// Endpoints of `set` other than `chosen`, fastest first.
fn fallbacks(set: &[Scored<'_, '_>], chosen: &str, n: usize) -> Vec<String> {
    let mut rest: Vec<&Scored<'_, '_>> = set.iter().filter(|s| s.w.id != chosen).collect();
    rest.sort_by(|a, b| {
        a.ttft_s
            .total_cmp(&b.ttft_s)
            .then_with(|| a.w.id.cmp(b.w.id))
    });
    rest.into_iter()
        .take(n)
        .map(|s| s.w.endpoint.to_owned())
        .collect()
}

#[cfg(test)]
#[path = "decide_tests.rs"]
pub(crate) mod tests;
