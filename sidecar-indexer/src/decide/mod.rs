//! The routing decision: pure, synchronous, with the random source passed in.
//!
//! Input: the request's size in tokens, its session key (if the filter sent one), operator
//! overrides, and a view of every worker (role, health, overlap with this prompt, speculative
//! overlap, booked load, and its [`WorkerTiming`]: prefill queued ahead, decode batch, measured
//! throughput). Output: a [`Plan`] — the worker, fallbacks, mode, the numbers behind the choice, the
//! predicted time to first token and a human reason. The mode ([`mode`]) may name a [`Leg`]
//! the async shell runs before answering: a prefill leg on a prefill worker, or a migration
//! handshake on the decode worker that holds the blocks.
//!
//! Every candidate is scored by its predicted TTFT for this request ([`crate::predict::ttft_s`]):
//! the prefill queued ahead of it plus this request's uncached tokens there (overlap capped at
//! ⌊(tokens − 1) / block_size⌋, the engine's last-block rule), divided by its throughput, plus its
//! decode batch's share of the steps — and chosen by its cost ([`crate::predict::cost_s`]): that
//! TTFT plus the delay its own prefill adds to the requests that will queue behind it there.
//! Lowest cost wins; workers within the near-tie band
//! (`near_tie_ms`, `near_tie_fraction`) of the cheapest are drawn uniformly at random, so gateway
//! replicas with the same view do not herd — except that a new session takes its rendezvous worker
//! when that is among them, which is the worker the filter's fallback pins it to while the indexer
//! is down, and the one every replica picks for it; `temperature > 0` samples
//! p ∝ exp(−normalised cost / temperature).
//! A session stays at its home (where its KV is: the worker holding most of the prompt by the
//! index, which every gateway replica shares — this replica's `kv_home` only when the index does not
//! tell workers apart; or its rendezvous worker with `session_placement = "rendezvous"`) unless another worker
//! is cheaper by more than the move margin (`session_move_margin_ms` and
//! `session_move_margin` × the home's time): hysteresis, so it does not flap. A request that opens a
//! conversation has no home by the index (what it shows is a shared system prompt), and is kept off
//! workers over `session_balance` × the mean recent load; a request without a session, off busy
//! workers over `request_balance` × that mean and `request_balance_slack` requests its size above
//! the least routed, unless that costs it more than `request_balance_yield_ms` of predicted TTFT.
//! The `overload_*` thresholds remain hard guards: an overloaded worker is a candidate only when
//! every worker is.
//!
//! Submodules: [`plan`] (inputs and outputs), [`pick`] (scoring, guards, the near-tie draw),
//! [`mode`] (the mode once the decode worker is chosen).

mod mode;
mod pick;
mod plan;

use kvmesh_core::api::{Mode, ReasonCode};
use kvmesh_core::rendezvous;
use rand::Rng;

use crate::config::{RoutingConfig, SessionPlacement};
use mode::{choose_mode, ModeInput};
pub use pick::overloaded;
pub(crate) use pick::{balanced, fallbacks, pick, score, Scored, ShareBound};
pub use plan::{Basis, DecideError, Leg, Opportunity, Plan, RouteInput, WorkerView, BASES};

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
    let decode = workers.iter().find(|w| w.id == plan.worker).ok_or(DecideError::NoDecodeWorker)?;
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
    plan.reason_codes.extend(m.codes);
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
    let best_index = candidates.iter().map(|w| w.overlap_blocks).max().unwrap_or(0);
    let scored: Vec<Scored<'_, '_>> = candidates
        .iter()
        .map(|w| score(w, input.isl_tokens as u64, input.block_size, best_index, cfg))
        .collect();
    let mut prefix = String::new();
    // The codes of `prefix`'s clauses, in order.
    let mut pre: Vec<ReasonCode> = Vec::new();

    if let Some(id) = input.override_worker {
        let w = workers
            .iter()
            .find(|w| w.id == id)
            .ok_or_else(|| DecideError::UnknownOverrideWorker(id.to_owned()))?;
        if w.candidate() {
            let s = score(w, input.isl_tokens as u64, input.block_size, best_index, cfg);
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
                (reason, &pre),
                &candidates,
            ));
        }
        pre.push(ReasonCode::OverrideIgnored);
        prefix = format!(
            "override {} ignored ({}); ",
            w.id,
            if w.healthy { "cannot decode" } else { "unhealthy" }
        );
    }
    if scored.is_empty() {
        return Err(DecideError::NoDecodeWorker);
    }

    // Hard guards: an overloaded worker is a candidate only when every worker is.
    let guarded: Vec<Scored<'_, '_>> = {
        let ok: Vec<Scored<'_, '_>> =
            scored.iter().copied().filter(|s| overloaded(s.w, cfg).is_none()).collect();
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
            // or forgotten) the session is placed by prediction. A request opening a conversation
            // has no history anywhere: what the index shows of it is a prefix shared with other
            // conversations (a system prompt), and pinning it to that prefix's holders is what
            // piles every new conversation onto them; only its own `kv_home` (a retried first
            // turn) is a home.
            SessionPlacement::Predicted | SessionPlacement::Sticky => {
                let kv_home = input.kv_home.filter(|h| candidates.iter().any(|w| w.id == *h));
                let holders: Vec<&str> = candidates
                    .iter()
                    .filter(|w| best_index > 0 && w.overlap_blocks == best_index)
                    .map(|w| w.id)
                    .collect();
                if input.opens_conversation
                    || holders.is_empty()
                    || holders.len() == candidates.len()
                {
                    kv_home
                } else {
                    kv_home
                        .filter(|h| holders.contains(h))
                        .or_else(|| rendezvous::pick(key.0, holders.iter().copied()))
                }
            }
        };
        let src = source.as_str();
        if let Some(home_id) = home_id {
            match guarded.iter().find(|s| s.w.id == home_id) {
                Some(&home) => {
                    let others: Vec<Scored<'_, '_>> =
                        guarded.iter().copied().filter(|s| s.w.id != home_id).collect();
                    let best_other =
                        (!others.is_empty()).then(|| pick(&others, isl, None, cfg, rng).0);
                    let gain = best_other.map_or(0.0, |o| home.cost_s - o.cost_s);
                    let margin_s = (cfg.session_move_margin_ms / 1000.0)
                        .max(cfg.session_move_margin * home.ttft_s);
                    if let Some(o) = best_other.filter(|_| gain > margin_s) {
                        let reason = format!(
                            "{prefix}session moved from {home_id} (source={src}): predicted {:.1} ms there{} {}, {} {:.1} ms{} (margin {:.1} ms); overlap {}/{isl} blocks{}",
                            home.ms(),
                            home.cost_note(),
                            load_note(&home),
                            o.w.id,
                            o.ms(),
                            o.cost_note(),
                            margin_s * 1000.0,
                            o.w.overlap_blocks,
                            migrated_note(&o)
                        );
                        return Ok(finish(
                            input,
                            o,
                            fallbacks(&scored, o.w.id, cfg.max_fallbacks),
                            Basis::SessionMoved,
                            (reason, &pre),
                            &candidates,
                        ));
                    }
                    let other = best_other.map_or(String::new(), |o| {
                        format!(" (best other {} {:.1} ms{})", o.w.id, o.ms(), o.cost_note())
                    });
                    let reason = format!(
                        "{prefix}session pin {home_id} (source={src}): overlap {}/{isl} blocks, predicted {:.1} ms{}{other}",
                        home.w.overlap_blocks,
                        home.ms(),
                        home.cost_note()
                    );
                    return Ok(finish(
                        input,
                        home,
                        fallbacks(&scored, home_id, cfg.max_fallbacks),
                        Basis::SessionPin,
                        (reason, &pre),
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
                        (reason, &pre),
                        &candidates,
                    ));
                }
            }
        }
        pre.push(ReasonCode::NewSession);
        prefix = format!("{prefix}new session: ");
    }

    // A conversation's later turns follow its first: keep it off workers carrying more than their
    // share of the recent load (`session_balance`). A request without a session is bounded more
    // loosely (`request_balance`, with a slack of a few requests its size, so a few siblings still
    // follow their prefix's holder) and only on workers busy now: each replica's share of a burst
    // stays bounded on its own, so replicas whose near-tie draws or shared events favour one
    // holder do not add up to a pile there, while a prompt repeated on an idle fleet stays where
    // it is cached. The slack is in the recent rate's units: `slack` such prompts in the window.
    let bound = match (input.session, input.opens_conversation) {
        (Some(_), true) => Some(ShareBound {
            of_mean: cfg.session_balance,
            slack_tokens_per_s: 0.0,
            only_when_busy: false,
            yield_s: f64::INFINITY,
        }),
        (Some(_), false) => None,
        (None, _) => {
            let prompt_tokens = f64::from(input.request_blocks()) * f64::from(input.block_size);
            Some(ShareBound {
                of_mean: cfg.request_balance,
                slack_tokens_per_s: cfg.request_balance_slack * prompt_tokens
                    / cfg.load_outlook_window_s,
                only_when_busy: true,
                yield_s: cfg.request_balance_yield_ms / 1000.0,
            })
        }
    };
    let balanced = bound.and_then(|b| balanced(&guarded, b, input.isl_tokens as u64, cfg));
    let placeable: &[Scored<'_, '_>] = match &balanced {
        Some(b) => {
            if b.kept_off {
                pre.push(ReasonCode::Balanced);
            }
            prefix = format!("{prefix}{}: ", b.note);
            &b.kept
        }
        None => &guarded,
    };
    // A new session's near-tie preference: its rendezvous worker (see the module docs).
    let rendezvous_home = input
        .session
        .and_then(|(key, _)| rendezvous::pick(key.0, placeable.iter().map(|s| s.w.id)));
    let (chosen, inner, next) = pick(placeable, isl, rendezvous_home, cfg, rng);
    let max_cached = guarded.iter().map(|s| s.w.cached_blocks()).max().unwrap_or(0);
    let cached = chosen.w.cached_blocks();
    let basis =
        if cached > 0 && cached == max_cached { Basis::BestOverlap } else { Basis::LowestCost };
    Ok(finish(
        input,
        chosen,
        fallbacks(&guarded, chosen.w.id, cfg.max_fallbacks),
        basis,
        (format!("{prefix}{inner}{next}"), &pre),
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
    (reason, pre): (String, &[ReasonCode]),
    candidates: &[&WorkerView<'_>],
) -> Plan {
    let w = s.w;
    let mut reason_codes = pre.to_vec();
    reason_codes.push(basis);
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
        reason_codes,
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
    let max = candidates.iter().map(|w| w.overlap_blocks).max().filter(|m| *m > 0)?;
    let best = candidates
        .iter()
        .filter(|w| w.overlap_blocks == max)
        .min_by_key(|w| (w.id != chosen, w.id))?;
    Some((best.id.to_owned(), max))
}

#[cfg(test)]
pub(crate) mod tests;
