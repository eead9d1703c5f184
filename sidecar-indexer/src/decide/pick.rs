//! Scoring and picking: each candidate's predicted TTFT for this request ([`score`]), the hard
//! overload guards ([`overloaded`]), the near-tie / temperature draw among the fastest ([`pick`])
//! and the fallback order. Shared by the decode choice ([`super::decide`]) and the prefill-worker
//! choice ([`super::mode`]).

use rand::Rng;

use super::plan::WorkerView;
use crate::config::{KvMigration, RoutingConfig};
use crate::predict::{cost_s, ttft_s};

/// Why `w` is overloaded under `cfg`, or None.
pub fn overloaded(w: &WorkerView<'_>, cfg: &RoutingConfig) -> Option<String> {
    let checks = [
        ("active_blocks", w.active_blocks, cfg.overload_active_blocks),
        ("active_requests", w.active_requests, cfg.overload_active_requests),
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
    /// What placing it there costs, seconds ([`cost_s`]): its TTFT plus what its prefill adds to
    /// the requests behind it. The choice is by cost; the prediction reported is `ttft_s`.
    pub cost_s: f64,
    /// Uncached tokens it would compute.
    pub own_tokens: u64,
    /// Blocks it would pull by KV migration instead of recomputing (`kv_migration = "on"`).
    pub migrated_blocks: u32,
}

impl Scored<'_, '_> {
    pub(crate) fn ms(&self) -> f64 {
        self.ttft_s * 1000.0
    }

    pub(crate) fn cost_ms(&self) -> f64 {
        self.cost_s * 1000.0
    }

    /// `, cost 812.0 ms` when the cost is above the predicted TTFT by what one decimal shows.
    pub(crate) fn cost_note(&self) -> String {
        if self.cost_ms() - self.ms() >= 0.05 {
            format!(", cost {:.1} ms", self.cost_ms())
        } else {
            String::new()
        }
    }
}

/// Scores `w`: its uncached tokens (crediting a migration from `best_index` when that is on and
/// worth it), the predicted TTFT and the cost.
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
    let (ttft, cost) = ttft_and_cost_s(w, own_tokens, cfg);
    Scored { w, ttft_s: ttft, cost_s: cost, own_tokens, migrated_blocks }
}

/// The predicted TTFT and the cost of `w` computing `own_tokens` uncached tokens.
fn ttft_and_cost_s(w: &WorkerView<'_>, own_tokens: u64, cfg: &RoutingConfig) -> (f64, f64) {
    let ttft = ttft_s(&w.timing, own_tokens as f64, cfg.prefill_chunk_tokens);
    (ttft, cost_s(&w.timing, ttft, own_tokens as f64, cfg.work_charge))
}

/// Whether `t` (seconds) is within the near-tie band of the fastest `min`.
pub(crate) fn near(t: f64, min: f64, cfg: &RoutingConfig) -> bool {
    t - min <= (cfg.near_tie_ms / 1000.0).max(cfg.near_tie_fraction * min) + 1e-12
}

/// Picks the cheapest of `set` by [`Scored::cost_s`] (non-empty; `isl` = the prompt's full blocks, for the reason):
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
    let costs: Vec<f64> = set.iter().map(|s| s.cost_s).collect();
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sampled = cfg.temperature > 0.0 && max > min;
    let index = if sampled {
        let weights: Vec<f64> =
            costs.iter().map(|t| (-((t - min) / (max - min)) / cfg.temperature).exp()).collect();
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
        let tied: Vec<usize> = (0..costs.len()).filter(|&i| near(costs[i], min, cfg)).collect();
        match tied.iter().copied().find(|&i| Some(set[i].w.id) == prefer) {
            Some(preferred) => preferred,
            None => tied.get(rng.gen_range(0..tied.len().max(1))).copied().unwrap_or(0),
        }
    };
    let s = set[index];
    let next = set
        .iter()
        .filter(|o| o.w.id != s.w.id)
        .min_by(|a, b| a.cost_s.total_cmp(&b.cost_s).then_with(|| a.w.id.cmp(b.w.id)))
        .map_or(String::new(), |o| format!("; next {} {:.1} ms{}", o.w.id, o.ms(), o.cost_note()));
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
        format!("overlap {}/{isl} blocks (best elsewhere {max_cached})", s.w.cached_blocks())
    };
    let spec = if s.w.speculative_blocks > s.w.overlap_blocks {
        format!(" (+{} speculative)", s.w.speculative_blocks - s.w.overlap_blocks)
    } else {
        String::new()
    };
    // Short: the reason travels in a 256-byte debug header together with the mode's part.
    let queued = s.w.timing.queued_tokens.round();
    let queued =
        if queued > 0.0 { format!(" after {queued} queued tokens") } else { String::new() };
    let reason = format!("{temp}{what}{spec}, predicted {:.1} ms{queued}{}", s.ms(), s.cost_note());
    (s, reason, next)
}

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

/// What [`balanced`] left of a candidate set.
pub(crate) struct Balanced<'v, 'a> {
    /// The candidates the request may go to.
    pub kept: Vec<Scored<'v, 'a>>,
    /// Whether any worker was kept off (reason code `balanced`), not only yielded to.
    pub kept_off: bool,
    /// `balanced (w1 1.42x mean)`, `balance yields (w2 1.31x mean saves 812 ms)`, or both.
    pub note: String,
}

/// `set` without the workers over their share of the recent load ([`ShareBound`]), and a note
/// naming them (`balanced (w1 1.42x mean)`). A worker over its share stays when it is cheaper than
/// every other even holding none of the prompt (its cold cost, `prompt_tokens` uncached): then its
/// holdings are not what draws the request, and sending it elsewhere would only make it wait. It
/// also stays, named in the note (`balance yields (w1 1.42x mean saves 812 ms)`), when the
/// cheapest worker within its share is predicted slower for this request by more than
/// [`ShareBound::yield_s`]: the bound spreads bursts of short shared prefixes, and is not worth
/// recomputing a long one.
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
    let share = |s: &Scored<'_, '_>| format!("{} {:.2}x mean", s.w.id, rate(s) / mean);
    let mut kept = Vec::with_capacity(set.len());
    let mut off = Vec::new();
    let mut yielded = Vec::new();
    for s in set.iter().copied() {
        let saving_s = cheapest_within.ttft_s - s.ttft_s;
        if !drawn_by_holdings(&s) {
            kept.push(s);
        } else if saving_s > bound.yield_s {
            yielded.push(format!("{} saves {:.0} ms", share(&s), saving_s * 1000.0));
            kept.push(s);
        } else {
            off.push(share(&s));
        }
    }
    let mut notes = Vec::new();
    if !off.is_empty() {
        notes.push(format!("balanced ({})", off.join(", ")));
    }
    if !yielded.is_empty() {
        notes.push(format!("balance yields ({})", yielded.join(", ")));
    }
    if notes.is_empty() {
        return None;
    }
    Some(Balanced { kept, kept_off: !off.is_empty(), note: notes.join(", ") })
}

/// Endpoints of `set` other than `chosen`, cheapest first.
pub(crate) fn fallbacks(set: &[Scored<'_, '_>], chosen: &str, n: usize) -> Vec<String> {
    let mut rest: Vec<&Scored<'_, '_>> = set.iter().filter(|s| s.w.id != chosen).collect();
    rest.sort_by(|a, b| a.cost_s.total_cmp(&b.cost_s).then_with(|| a.w.id.cmp(b.w.id)));
    rest.into_iter().take(n).map(|s| s.w.endpoint.to_owned()).collect()
}
