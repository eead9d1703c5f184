//! The routing decision: pure, synchronous, with the random source passed in.
//!
//! Input: the request's size in tokens, its session key (if the filter sent one), operator
//! overrides, and a view of every worker (role, health, overlap with this prompt, load). Output: a
//! [`Plan`] — the worker, fallbacks, mode, the numbers behind the choice and a human reason. The mode
//! ([`crate::modes`]) may name a [`Leg`] the async shell runs before answering: a prefill leg on a
//! prefill worker, or a migration handshake on the decode worker that holds the blocks.
//!
//! Scoring (Dynamo's current form): `cost = prefill_load_scale × max(0, request_blocks −
//! overlap_credit × overlap_blocks) + active_blocks`, lowest wins; ties are broken at random, or with
//! `temperature > 0` the worker is sampled with p ∝ exp(−normalised_cost / temperature). A session
//! key pins to `kvmesh_core::rendezvous::pick` over the healthy decode-capable workers — the same
//! function and the same candidate set as `FleetSnapshot::pin`, so the filter's fallback agrees —
//! unless the pinned worker is overloaded; then the best other non-overloaded worker is chosen.
//! With `session_placement = sticky` the pin is the session's last decode worker instead, and a
//! session seen for the first time is placed by cost.

use kvmesh_core::api::{Mode, Role, RouteDecision};
use kvmesh_core::rendezvous;
use kvmesh_core::session::{SessionKey, SessionSource};
use rand::Rng;

use crate::config::{RoutingConfig, SessionPlacement};
use crate::modes::{choose_mode, ModeInput, Opportunity};

/// One worker as the decision sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView<'a> {
    pub id: &'a str,
    pub endpoint: &'a str,
    pub role: Role,
    pub healthy: bool,
    /// Leading blocks of this prompt the worker holds.
    pub overlap_blocks: u32,
    /// Decode load in blocks: booked, plus the engine's in-flight requests the indexer did not route.
    pub active_blocks: u64,
    /// In-flight requests routed to the worker.
    pub active_requests: u64,
    /// `vllm:num_requests_waiting` from the last scrape.
    pub waiting_requests: u64,
}

impl WorkerView<'_> {
    fn candidate(&self) -> bool {
        self.healthy && self.role.decodes()
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
        u32::try_from(self.isl_tokens / self.block_size.max(1) as usize).unwrap_or(u32::MAX)
    }
    /// Blocks including a partial last one (the cost term, and Dynamo's hit-rate denominator).
    pub fn request_blocks(&self) -> u32 {
        u32::try_from(self.isl_tokens.div_ceil(self.block_size.max(1) as usize)).unwrap_or(u32::MAX)
    }
}

/// Why the worker was chosen (the `basis` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Basis {
    Override,
    SessionPin,
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
    pub overlap_blocks: u32,
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
            predicted_ttft_ms: None,
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
        ("active_requests", w.active_requests, cfg.overload_active_requests),
        ("waiting", w.waiting_requests, cfg.overload_waiting_requests),
    ];
    checks.iter().find(|(_, v, limit)| *limit > 0 && v >= limit).map(|(name, v, limit)| format!("{name} {v} >= {limit}"))
}

/// The cost of serving the request on `w` (lower is better).
pub fn cost(w: &WorkerView<'_>, request_blocks: u32, cfg: &RoutingConfig) -> f64 {
    let uncached = (f64::from(request_blocks) - cfg.overlap_credit * f64::from(w.overlap_blocks)).max(0.0);
    cfg.prefill_load_scale * uncached + w.active_blocks as f64
}

/// Decides where the request goes and in which mode.
pub fn decide<R: Rng + ?Sized>(
    input: &RouteInput<'_>,
    workers: &[WorkerView<'_>],
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Result<Plan, DecideError> {
    let mut plan = decide_worker(input, workers, cfg, rng)?;
    let decode = workers.iter().find(|w| w.id == plan.worker).ok_or(DecideError::NoDecodeWorker)?;
    let mode_input = ModeInput {
        isl_tokens: input.isl_tokens as u64,
        block_size: input.block_size,
        continuation: input.continuation,
        kv_home: input.kv_home,
        override_mode: input.override_mode,
    };
    let best = plan.best_overlap.as_ref().map(|(id, b)| (id.as_str(), *b));
    let m = choose_mode(&mode_input, decode, workers, best, cfg, rng);
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
    let request_blocks = input.request_blocks();
    let candidates: Vec<&WorkerView<'_>> = workers.iter().filter(|w| w.candidate()).collect();
    let mut prefix = String::new();

    if let Some(id) = input.override_worker {
        let w = workers.iter().find(|w| w.id == id).ok_or_else(|| DecideError::UnknownOverrideWorker(id.to_owned()))?;
        if w.candidate() {
            let reason = format!("override x-kvmesh-worker {}: overlap {}/{isl} blocks", w.id, w.overlap_blocks);
            let fallbacks = by_cost(&candidates, request_blocks, cfg, Some(w.id), cfg.max_fallbacks);
            return Ok(finish(input, w, fallbacks, Basis::Override, reason, &candidates));
        }
        prefix = format!("override {} ignored ({}); ", w.id, if w.healthy { "cannot decode" } else { "unhealthy" });
    }
    if candidates.is_empty() {
        return Err(DecideError::NoDecodeWorker);
    }

    // `sticky`: a session is pinned to where it was last served; its first request is placed by cost.
    let sticky = cfg.session_placement == SessionPlacement::Sticky;
    let home = input.kv_home.filter(|_| sticky).and_then(|h| candidates.iter().copied().find(|w| w.id == h));
    if let Some((key, source)) = input.session.filter(|_| !sticky || home.is_some()) {
        let pinned = match home {
            Some(h) => h,
            None => {
                let pinned_id = rendezvous::pick(key.0, candidates.iter().map(|w| w.id)).ok_or(DecideError::NoDecodeWorker)?;
                candidates.iter().copied().find(|w| w.id == pinned_id).ok_or(DecideError::NoDecodeWorker)?
            }
        };
        let ranked = rendezvous::rank(key.0, candidates.iter().map(|w| w.id));
        match overloaded(pinned, cfg) {
            None => {
                let reason = format!(
                    "{prefix}session pin {} (source={}): overlap {}/{isl} blocks",
                    pinned.id,
                    source.as_str(),
                    pinned.overlap_blocks
                );
                let fallbacks = endpoints_of(&candidates, ranked.iter().copied().filter(|id| *id != pinned.id), cfg.max_fallbacks);
                return Ok(finish(input, pinned, fallbacks, Basis::SessionPin, reason, &candidates));
            }
            Some(why) => {
                let others: Vec<&WorkerView<'_>> =
                    candidates.iter().copied().filter(|w| w.id != pinned.id && overloaded(w, cfg).is_none()).collect();
                if others.is_empty() {
                    let reason = format!(
                        "{prefix}session pin {} kept although overloaded ({why}): every other worker is too; overlap {}/{isl} blocks",
                        pinned.id, pinned.overlap_blocks
                    );
                    let fallbacks = endpoints_of(&candidates, ranked.iter().copied().filter(|id| *id != pinned.id), cfg.max_fallbacks);
                    return Ok(finish(input, pinned, fallbacks, Basis::SessionPin, reason, &candidates));
                }
                let (chosen, inner) = choose(&others, request_blocks, isl, cfg, rng);
                let reason = format!("{prefix}pinned {} overloaded ({why}); chose {}: {inner}", pinned.id, chosen.id);
                let fallbacks = by_cost(&others, request_blocks, cfg, Some(chosen.id), cfg.max_fallbacks);
                return Ok(finish(input, chosen, fallbacks, Basis::PinOverloaded, reason, &candidates));
            }
        }
    }

    let (chosen, inner) = choose(&candidates, request_blocks, isl, cfg, rng);
    let max_overlap = candidates.iter().map(|w| w.overlap_blocks).max().unwrap_or(0);
    let basis = if chosen.overlap_blocks > 0 && chosen.overlap_blocks == max_overlap { Basis::BestOverlap } else { Basis::LowestCost };
    let fallbacks = by_cost(&candidates, request_blocks, cfg, Some(chosen.id), cfg.max_fallbacks);
    Ok(finish(input, chosen, fallbacks, basis, format!("{prefix}{inner}"), &candidates))
}

fn finish(
    input: &RouteInput<'_>,
    w: &WorkerView<'_>,
    fallbacks: Vec<String>,
    basis: Basis,
    reason: String,
    candidates: &[&WorkerView<'_>],
) -> Plan {
    Plan {
        worker: w.id.to_owned(),
        endpoint: w.endpoint.to_owned(),
        fallbacks,
        mode: Mode::Aggregate,
        overlap_blocks: w.overlap_blocks,
        isl_blocks: input.full_blocks(),
        request_blocks: input.request_blocks(),
        best_overlap: best_overlap(candidates, w.id),
        basis,
        reason,
        leg: None,
        opportunity: None,
        local_continuation: false,
        uncached_tokens: 0,
    }
}

/// The worker holding most of the prompt (the chosen one on a tie, else the smallest id); None when
/// nobody holds block 0.
fn best_overlap(candidates: &[&WorkerView<'_>], chosen: &str) -> Option<(String, u32)> {
    let max = candidates.iter().map(|w| w.overlap_blocks).max().filter(|m| *m > 0)?;
    let best = candidates
        .iter()
        .filter(|w| w.overlap_blocks == max)
        .min_by_key(|w| (w.id != chosen, w.id))?;
    Some((best.id.to_owned(), max))
}

/// Picks among `set` (non-empty) by cost; returns the worker and a reason.
pub(crate) fn choose<'a, 'b, R: Rng + ?Sized>(
    set: &[&'b WorkerView<'a>],
    request_blocks: u32,
    isl: u32,
    cfg: &RoutingConfig,
    rng: &mut R,
) -> (&'b WorkerView<'a>, String) {
    let costs: Vec<f64> = set.iter().map(|w| cost(w, request_blocks, cfg)).collect();
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let index = if cfg.temperature > 0.0 && max > min {
        let weights: Vec<f64> = costs.iter().map(|c| (-((c - min) / (max - min)) / cfg.temperature).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut x = rng.gen::<f64>() * total;
        let mut pick = weights.len() - 1;
        for (i, w) in weights.iter().enumerate() {
            if x < *w {
                pick = i;
                break;
            }
            x -= w;
        }
        pick
    } else {
        let tied: Vec<usize> = (0..costs.len()).filter(|&i| costs[i] - min <= 1e-9 * min.abs().max(1.0)).collect();
        tied[rng.gen_range(0..tied.len())]
    };
    let w = set[index];
    let max_overlap = set.iter().map(|w| w.overlap_blocks).max().unwrap_or(0);
    let sampled = if cfg.temperature > 0.0 && max > min { format!("sampled at temperature {}: ", cfg.temperature) } else { String::new() };
    let reason = if max_overlap == 0 {
        format!("{sampled}no cached prefix anywhere; least loaded (load {} blocks)", w.active_blocks)
    } else if w.overlap_blocks == max_overlap {
        format!("{sampled}best overlap {}/{isl} blocks", w.overlap_blocks)
    } else {
        let best = set.iter().filter(|b| b.overlap_blocks == max_overlap).min_by_key(|b| b.id);
        let (bid, bload) = best.map_or(("?", 0), |b| (b.id, b.active_blocks));
        format!(
            "{sampled}lowest cost: overlap {}/{isl} blocks, load {} blocks (best overlap {bid} {max_overlap}/{isl}, load {bload})",
            w.overlap_blocks, w.active_blocks
        )
    };
    (w, reason)
}

fn by_cost(set: &[&WorkerView<'_>], request_blocks: u32, cfg: &RoutingConfig, exclude: Option<&str>, n: usize) -> Vec<String> {
    let mut rest: Vec<(f64, &str, &str)> = set
        .iter()
        .filter(|w| Some(w.id) != exclude)
        .map(|w| (cost(w, request_blocks, cfg), w.id, w.endpoint))
        .collect();
    rest.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(b.1)));
    rest.into_iter().take(n).map(|(_, _, e)| e.to_owned()).collect()
}

fn endpoints_of<'a>(set: &[&WorkerView<'_>], ids: impl Iterator<Item = &'a str>, n: usize) -> Vec<String> {
    ids.filter_map(|id| set.iter().find(|w| w.id == id).map(|w| w.endpoint.to_owned())).take(n).collect()
}

#[cfg(test)]
#[path = "decide_tests.rs"]
pub(crate) mod tests;
