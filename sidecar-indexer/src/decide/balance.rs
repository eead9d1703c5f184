//! Stage: balance. Keeps a request off workers carrying more than their share of the recent load
//! ([`WorkerView::recent_tokens_per_s`] against the fleet's mean), before the pick.
//!
//! Which bound applies depends on the request ([`bound`]). A conversation's later turns follow its
//! first, so a request opening one is kept off workers over `session_balance` × the mean. A request
//! without a session is bounded more loosely (`request_balance`, with a slack of a few requests its
//! size, so a few siblings still follow their prefix's holder) and only on workers busy now: each
//! replica's share of a burst stays bounded on its own, so replicas whose near-tie draws or shared
//! events favour one holder do not add up to a pile there, while a prompt repeated on an idle fleet
//! stays where it is cached. A session's later turns are not balanced: they stay with their history
//! (the home stage).

use super::plan::{RouteInput, WorkerView};
use super::reason::{BalanceNote, Share};
use super::score::{ttft_and_cost_s, Scored};
use crate::config::RoutingConfig;

/// How much of the recent load a worker may take before [`balanced`] keeps requests off it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ShareBound {
    /// Multiple of the mean recent prompt tokens per second (0 = off).
    pub of_mean: f64,
    /// And this much above the least routed worker's (tokens per second).
    pub slack_tokens_per_s: f64,
    /// Only a worker serving more than one request of this replica's more than the least busy
    /// is over its share: the bound is about load now (a burst), not about where a prompt was
    /// routed before (one request at a time leaves at most one in flight, its `/v1/done` racing
    /// the next request).
    pub only_when_busy: bool,
    /// A worker over its share stays when keeping the request off it would make this request's
    /// predicted TTFT longer than this (seconds) — what its holdings save is then worth more than
    /// the share (`f64::INFINITY` = never).
    pub yield_s: f64,
}

/// What [`balanced`] left of a candidate set, and why.
pub(crate) struct Balanced<'v, 'a> {
    /// The candidates the request may go to.
    pub kept: Vec<Scored<'v, 'a>>,
    pub note: BalanceNote<'a>,
}

/// The bound for `input`: `session_balance` for a request opening a conversation, none for a
/// session's later turns, `request_balance` (slack in the recent rate's units: `slack` prompts of
/// this size in the window) for a request without a session.
pub(crate) fn bound(input: &RouteInput<'_>, cfg: &RoutingConfig) -> Option<ShareBound> {
    match (input.session, input.opens_conversation) {
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
    }
}

/// `set` without the workers over their share of the recent load ([`ShareBound`]), and a note
/// naming them. A worker over its share stays when it is cheaper than every other even holding
/// none of the prompt (its cold cost, `prompt_tokens` uncached): then its holdings are not what
/// draws the request, and sending it elsewhere would only make it wait. It also stays, named in the
/// note as yielded to, when the cheapest worker within its share is predicted slower for this
/// request by more than [`ShareBound::yield_s`]: the bound spreads bursts of short shared prefixes,
/// and is not worth recomputing a long one.
/// None when the bound is off, nothing was routed recently, or it would keep none of them or
/// leave every one in place without yielding.
pub(crate) fn balanced<'v, 'a>(
    set: &[Scored<'v, 'a>],
    bound: ShareBound,
    prompt_tokens: u64,
    cfg: &RoutingConfig,
) -> Option<Balanced<'v, 'a>> {
    if bound.of_mean <= 0.0 || set.is_empty() {
        return None;
    }
    let rate = |s: &Scored<'_, '_>| s.w.recent_tokens_per_s;
    let mean = set.iter().map(rate).sum::<f64>() / set.len() as f64;
    if mean <= 0.0 {
        return None;
    }
    let least = set.iter().map(rate).fold(f64::INFINITY, f64::min);
    let least_busy = set.iter().map(|s| s.w.active_requests).min().unwrap_or(0);
    let busy = |w: &WorkerView<'_>| w.active_requests > least_busy + 1;
    let over_share = |s: &Scored<'_, '_>| {
        rate(s) > bound.of_mean * mean
            && rate(s) - least > bound.slack_tokens_per_s.max(0.0)
            && (!bound.only_when_busy || busy(s.w))
    };
    let cheapest_within =
        set.iter().filter(|s| !over_share(s)).min_by(|a, b| a.cost_s.total_cmp(&b.cost_s))?;
    let cold_cost_s = |w: &WorkerView<'_>| ttft_and_cost_s(w, prompt_tokens, cfg).1;
    let drawn_by_holdings =
        |s: &Scored<'_, '_>| over_share(s) && cold_cost_s(s.w) >= cheapest_within.cost_s;
    let share = |s: &Scored<'_, 'a>| Share { worker: s.w.id, of_mean: rate(s) / mean };
    let mut kept = Vec::with_capacity(set.len());
    let mut note = BalanceNote { kept_off: Vec::new(), yielded: Vec::new() };
    for s in set.iter().copied() {
        let saving_s = cheapest_within.ttft_s - s.ttft_s;
        if !drawn_by_holdings(&s) {
            kept.push(s);
        } else if saving_s > bound.yield_s {
            note.yielded.push((share(&s), saving_s));
            kept.push(s);
        } else {
            note.kept_off.push(share(&s));
        }
    }
    if note.kept_off.is_empty() && note.yielded.is_empty() {
        return None;
    }
    Some(Balanced { kept, note })
}

/// The stage: `guarded` balanced under `input`'s bound, or None when it keeps every candidate.
pub(crate) fn balance<'v, 'a>(
    input: &RouteInput<'_>,
    guarded: &[Scored<'v, 'a>],
    cfg: &RoutingConfig,
) -> Option<Balanced<'v, 'a>> {
    bound(input, cfg).and_then(|b| balanced(guarded, b, input.isl_tokens as u64, cfg))
}
