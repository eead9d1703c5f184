//! The routing decision: pure and synchronous, with the random source passed in (no I/O, no
//! clock: every time-dependent number arrives in the [`WorkerView`]s).
//!
//! Input: the request ([`RouteInput`]: its size in tokens, its session key, operator overrides)
//! and a view of every worker (role, health, overlap with this prompt, speculative overlap, booked
//! load, and its [`crate::predict::WorkerTiming`]). Output: a [`Plan`] — the worker (by name and
//! by its index in the views), fallbacks, mode, the numbers behind the choice, the predicted time
//! to first token, and the reason as prose and codes. The mode may name a [`Leg`] the async shell
//! runs before answering: a prefill leg on a prefill worker, or a migration handshake on the
//! decode worker that holds the blocks.
//!
//! [`decide`] is a few named stages, each in its own module and each returning a typed reason
//! ([`reason`]); the reason is worded once, by [`reason::render`], when the plan is assembled:
//!
//! 1. [`score`]: every decode candidate's predicted TTFT and cost for this request (the overlap
//!    capped first by the engine's last-block rule; blocks in lower KV tiers at their load cost),
//!    and the hard `overload_*` guards — an
//!    overloaded worker is a candidate only when every worker is.
//! 2. [`overrides`]: `x-kvmesh-worker` naming a candidate decides alone.
//! 3. [`home`]: a session stays where its KV is unless another worker is cheaper by more than the
//!    move margin (hysteresis), and leaves a home over a guard.
//! 4. [`balance`]: a request opening a conversation, or one without a session, is kept off workers
//!    carrying more than their share of the recent load.
//! 5. [`pick`]: the cheapest by cost, near ties drawn at random (a new session prefers its
//!    rendezvous worker among them), or sampled with `temperature > 0`.
//! 6. [`mode`]: `aggregate`, conditional `disagg` or `migrate`, for the chosen worker.
//!
//! Stages name workers by their index in the views ([`score::Scored::at`]); ids are matched only
//! where they come from outside the views (`x-kvmesh-worker`, `kv_home`, the rendezvous hash).
//! [`plan`] holds the types the shell reads and writes.

mod balance;
mod home;
mod mode;
mod overrides;
mod pick;
mod plan;
mod reason;
mod score;

use rand::Rng;

use crate::config::RoutingConfig;
use crate::predict::WorkerTiming;

use mode::{choose_mode, ModeChoice, ModeInput};
use overrides::Override;
pub use plan::{Basis, DecideError, Leg, Opportunity, Plan, RouteInput, WorkerView, BASES};
use reason::{Choice, WorkerReason};
use score::{fallbacks, guarded, rendezvous_among, Candidates};
pub use score::{overloaded, Guard, Overload};

/// Decides where the request goes and in which mode.
pub fn decide<R: Rng + ?Sized>(
    input: &RouteInput<'_>,
    workers: &[WorkerView<'_>],
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Result<Plan, DecideError> {
    // The last-block rule and the adapter's delay, once, for everything downstream (decision,
    // metrics, modes).
    let cap = input.max_cached_blocks();
    let workers: Vec<WorkerView<'_>> = workers
        .iter()
        .map(|w| WorkerView {
            overlap_blocks: w.overlap_blocks.min(cap),
            speculative_blocks: w.speculative_blocks.min(cap),
            tier_blocks: w.tier_blocks.capped(cap.saturating_sub(w.overlap_blocks.min(cap))),
            timing: WorkerTiming {
                adapter_delay_s: score::adapter_delay_s(input, w, cfg),
                ..w.timing
            },
            ..w.clone()
        })
        .collect();
    let cands = score::candidates(input, &workers, cfg);
    let worker = choose_worker(input, &workers, &cands, cfg, rng)?;
    let chosen = worker.reason.choice.chosen();
    let best = best_overlap(&cands, chosen.at);
    let mode_input = ModeInput {
        isl_tokens: input.isl_tokens as u64,
        block_size: input.block_size,
        continuation: input.continuation,
        kv_home: input.kv_home,
        override_mode: input.override_mode,
    };
    let mode = choose_mode(&mode_input, chosen.at, &workers, best, cfg, rng)
        .ok_or(DecideError::NoDecodeWorker)?;
    Ok(assemble(input, &workers, worker, best, mode))
}

/// The decode worker's choice, its reason and its fallbacks.
struct WorkerChoice<'v, 'a> {
    reason: WorkerReason<'v, 'a>,
    fallbacks: Vec<String>,
}

/// Stages 2–5 over the scored candidates: the override, the session's home, balance, the pick.
fn choose_worker<'v, 'a, R: Rng + ?Sized>(
    input: &RouteInput<'_>,
    workers: &'v [WorkerView<'a>],
    cands: &Candidates<'v, 'a>,
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Result<WorkerChoice<'v, 'a>, DecideError> {
    let n = cfg.max_fallbacks;
    let override_ignored = match overrides::override_worker(input, workers, cands)? {
        Override::Honoured(s) => {
            let reason = WorkerReason {
                override_ignored: None,
                new_session: false,
                balance: None,
                choice: Choice::Override(s),
            };
            return Ok(WorkerChoice { reason, fallbacks: fallbacks(&cands.scored, s.at, n) });
        }
        Override::Ignored(ignored) => Some(ignored),
        Override::Absent => None,
    };
    if cands.scored.is_empty() {
        return Err(DecideError::NoDecodeWorker);
    }
    let guarded = guarded(&cands.scored, cfg);
    let mut new_session = false;
    if let Some(session) = input.session {
        match home::home(input, session, cands, &guarded, cfg, rng) {
            Some(choice) => {
                // A session at or leaving its home falls back to any candidate; one that left an
                // overloaded home falls back within the guards, as a pick does.
                let pool = match choice {
                    Choice::PinOverloaded { .. } => guarded.as_slice(),
                    _ => cands.scored.as_slice(),
                };
                let fallbacks = fallbacks(pool, choice.chosen().at, n);
                let reason = WorkerReason { override_ignored, new_session, balance: None, choice };
                return Ok(WorkerChoice { reason, fallbacks });
            }
            None => new_session = true,
        }
    }
    let balanced = balance::balance(input, &guarded, cfg);
    let placeable = balanced.as_ref().map_or(guarded.as_slice(), |b| b.kept.as_slice());
    // A new session's near-tie preference: its rendezvous worker, where the filter's fallback pins
    // it while the indexer is down and where every gateway replica puts it.
    let prefer = input.session.and_then(|(key, _)| rendezvous_among(key.0, placeable));
    let draw = pick::pick(placeable, prefer.map(|s| s.at), cfg, rng);
    let max_cached = guarded.iter().map(|s| s.w.cached_blocks()).max().unwrap_or(0);
    let cached = draw.chosen.w.cached_blocks();
    let choice = if cached > 0 && cached == max_cached {
        Choice::BestOverlap(draw)
    } else {
        Choice::LowestCost(draw)
    };
    let reason =
        WorkerReason { override_ignored, new_session, balance: balanced.map(|b| b.note), choice };
    Ok(WorkerChoice { reason, fallbacks: fallbacks(&guarded, draw.chosen.at, n) })
}

/// The view index and blocks of the candidate holding most of the prompt by the index (the chosen
/// one on a tie, else the smallest id); None when nobody holds block 0.
fn best_overlap(cands: &Candidates<'_, '_>, chosen: usize) -> Option<(usize, u32)> {
    let max = Some(cands.best_index).filter(|m| *m > 0)?;
    let best = cands
        .scored
        .iter()
        .filter(|s| s.w.overlap_blocks == max)
        .min_by_key(|s| (s.at != chosen, s.w.id))?;
    Some((best.at, max))
}

/// The plan: the chosen worker's numbers, its mode, and the reason rendered — the one place the
/// typed reasons become prose and codes.
fn assemble(
    input: &RouteInput<'_>,
    workers: &[WorkerView<'_>],
    worker: WorkerChoice<'_, '_>,
    best: Option<(usize, u32)>,
    mode: ModeChoice<'_, '_>,
) -> Plan {
    let s = worker.reason.choice.chosen();
    let (reason, reason_codes) =
        reason::render(input.full_blocks(), &worker.reason, &mode.reason, &mode.notes);
    Plan {
        worker_index: s.at,
        worker: s.w.id.to_owned(),
        endpoint: s.w.endpoint.to_owned(),
        fallbacks: worker.fallbacks,
        mode: mode.mode,
        overlap_blocks: s.w.overlap_blocks,
        speculative_extra_blocks: s.w.speculative_blocks.saturating_sub(s.w.overlap_blocks),
        isl_blocks: input.full_blocks(),
        request_blocks: input.request_blocks(),
        best_overlap: best.and_then(|(at, blocks)| Some((workers.get(at)?.id.to_owned(), blocks))),
        basis: worker.reason.choice.basis(),
        reason,
        reason_codes,
        leg: mode.leg,
        opportunity: mode.opportunity,
        local_continuation: mode.local_continuation,
        uncached_tokens: mode.uncached_tokens,
        tier_blocks: s.loaded,
        predicted_ttft_ms: s.ms(),
        adapter: score::adapter_cost(input, s.w),
    }
}

#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod tier_tests;
