//! Stage: the session's home. A session stays where its KV is unless another worker is cheaper by
//! more than the move margin — hysteresis, so it does not flap — and leaves a home that is over an
//! `overload_*` guard (over the waiting guard alone: for a worker within the guards that is
//! cheaper, by any amount).
//!
//! Where its KV is: the index is shared truth (every gateway replica consumes the same events),
//! while `kv_home` is this replica's memory, stale once another replica served the session
//! elsewhere. So the home is the worker holding most of the prompt by the index (its `kv_home`,
//! else its rendezvous worker, when several hold as much), and `kv_home` only when the index does
//! not tell the workers apart. A request opening a conversation has no history anywhere: what the
//! index shows of it is a prefix shared with other conversations (a system prompt), and pinning it
//! to that prefix's holders is what piles every new conversation onto them; only its own
//! `kv_home` (a retried first turn) is a home. With `session_placement = "rendezvous"` the home is
//! the session's rendezvous worker, the one the filter's fallback pins it to.

use kvmesh_core::session::{SessionKey, SessionSource};
use rand::Rng;

use super::pick::pick;
use super::plan::RouteInput;
use super::reason::Choice;
use super::score::{overloaded, rendezvous_among, Candidates, Guard, Scored};
use crate::config::{RoutingConfig, SessionPlacement};

/// The choice a session's home makes — it stayed (a home over the waiting guard too, when every
/// worker within the guards costs more), moved, or left an overloaded home — or None
/// when the session has no home (new, forgotten, or its home is no candidate): then it is placed
/// like any request. `guarded` is the candidates within the guards.
pub(crate) fn home<'v, 'a, R: Rng + ?Sized>(
    input: &RouteInput<'_>,
    (key, source): (SessionKey, SessionSource),
    cands: &Candidates<'v, 'a>,
    guarded: &[Scored<'v, 'a>],
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Option<Choice<'v, 'a>> {
    let home = home_of(input, key, cands, cfg)?;
    if !guarded.iter().any(|s| s.at == home.at) {
        // Over a guard: leave for the cheapest worker within the guards, without the move margin.
        // Over the waiting guard alone — a queue, which the cost already prices — only when that
        // worker is predicted cheaper: on a saturated pool every worker crosses it in turn, and
        // leaving for a costlier one recomputed the session's history there, which pushed that
        // worker over the guard and its sessions back (the `models` workload: 22 of 359 requests
        // of the busier model, ~95k tokens recomputed in 20 s, TTFTs up to 7.5 s). The active
        // guards are capacity limits the cost does not model: always left.
        let draw = pick(guarded, None, cfg, rng);
        let overload = overloaded(home.w, cfg);
        let queue_only = overload.is_some_and(|o| o.guard == Guard::Waiting);
        return Some(if !queue_only || draw.chosen.cost_s < home.cost_s {
            Choice::PinOverloaded { home: home.w, overload, draw }
        } else {
            Choice::SessionPin { home, source, best_other: Some(draw.chosen), overload }
        });
    }
    let others: Vec<Scored<'v, 'a>> = guarded.iter().copied().filter(|s| s.at != home.at).collect();
    let best_other = (!others.is_empty()).then(|| pick(&others, None, cfg, rng).chosen);
    let gain_s = best_other.map_or(0.0, |o| home.cost_s - o.cost_s);
    let margin_s = (cfg.session_move_margin_ms / 1000.0).max(cfg.session_move_margin * home.ttft_s);
    Some(match best_other.filter(|_| gain_s > margin_s) {
        Some(to) => Choice::SessionMoved { home, to, source, margin_s },
        None => Choice::SessionPin { home, source, best_other, overload: None },
    })
}

/// The candidate that is the session's home under `session_placement` (module docs), if any.
fn home_of<'v, 'a>(
    input: &RouteInput<'_>,
    key: SessionKey,
    cands: &Candidates<'v, 'a>,
    cfg: &RoutingConfig,
) -> Option<Scored<'v, 'a>> {
    match cfg.session_placement {
        SessionPlacement::Rendezvous => rendezvous_among(key.0, &cands.scored),
        SessionPlacement::Predicted | SessionPlacement::Sticky => {
            let kv_home = input.kv_home.and_then(|h| cands.scored.iter().find(|s| s.w.id == h));
            let holders: Vec<Scored<'v, 'a>> = cands
                .scored
                .iter()
                .filter(|s| cands.best_index > 0 && s.w.overlap_blocks == cands.best_index)
                .copied()
                .collect();
            if input.opens_conversation || holders.is_empty() || holders.len() == cands.scored.len()
            {
                kv_home.copied()
            } else {
                kv_home
                    .filter(|h| holders.iter().any(|s| s.at == h.at))
                    .copied()
                    .or_else(|| rendezvous_among(key.0, &holders))
            }
        }
    }
}
