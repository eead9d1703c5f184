//! Stage: the pick. The cheapest of a candidate set by cost, with near ties drawn at random — or,
//! with `temperature > 0`, sampled p ∝ exp(−normalised cost / temperature). Used for the last step
//! of the decode choice, for the best alternative to a session's home, and for the prefill worker
//! of a `disagg` leg.
//!
//! Why random inside the band: gateway replicas share the index and the engines' events, so any
//! deterministic preference there (even "most index overlap") sends every replica's share of a
//! burst to the same worker. The one preference allowed is the caller's `prefer` (a new session's
//! rendezvous worker, the one the filter's fallback pins it to).

use rand::Rng;

use super::reason::{Draw, Holding};
use super::score::Scored;
use crate::config::RoutingConfig;

/// Whether `t` (seconds) is within the near-tie band of the cheapest `min`.
fn near(t: f64, min: f64, cfg: &RoutingConfig) -> bool {
    t - min <= (cfg.near_tie_ms / 1000.0).max(cfg.near_tie_fraction * min) + 1e-12
}

/// Picks from `set` (non-empty) by [`Scored::cost_s`]: view `prefer` when it is within the
/// near-tie band, else one drawn uniformly from the band, or sampled with `temperature > 0`.
/// Returns it with what it holds against the set and the runner-up.
pub(crate) fn pick<'v, 'a, R: Rng + ?Sized>(
    set: &[Scored<'v, 'a>],
    prefer: Option<usize>,
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Draw<'v, 'a> {
    let costs: Vec<f64> = set.iter().map(|s| s.cost_s).collect();
    let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
    let max = costs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let sampled = cfg.temperature > 0.0 && max > min;
    let index = if sampled {
        sample(&costs, min, max, cfg.temperature, rng)
    } else {
        let tied: Vec<usize> = (0..costs.len()).filter(|&i| near(costs[i], min, cfg)).collect();
        match tied.iter().copied().find(|&i| Some(set[i].at) == prefer) {
            Some(preferred) => preferred,
            None => tied.get(rng.gen_range(0..tied.len().max(1))).copied().unwrap_or(0),
        }
    };
    let chosen = set[index];
    let runner_up = set
        .iter()
        .filter(|o| o.at != chosen.at)
        .min_by(|a, b| a.cost_s.total_cmp(&b.cost_s).then_with(|| a.w.id.cmp(b.w.id)))
        .copied();
    Draw {
        chosen,
        sampled_at: sampled.then_some(cfg.temperature),
        holding: holding(set, &chosen),
        runner_up,
    }
}

/// An index into `costs` drawn with p ∝ exp(−((cost − min) / (max − min)) / temperature).
fn sample<R: Rng + ?Sized>(
    costs: &[f64],
    min: f64,
    max: f64,
    temperature: f64,
    rng: &mut R,
) -> usize {
    let weights: Vec<f64> =
        costs.iter().map(|t| (-((t - min) / (max - min)) / temperature).exp()).collect();
    let total: f64 = weights.iter().sum();
    let mut x = rng.gen::<f64>() * total;
    for (i, w) in weights.iter().enumerate() {
        if x < *w {
            return i;
        }
        x -= w;
    }
    weights.len() - 1
}

/// What `chosen` holds of the prompt against the best of `set`.
fn holding(set: &[Scored<'_, '_>], chosen: &Scored<'_, '_>) -> Holding {
    let max_cached = set.iter().map(|s| s.w.cached_blocks()).max().unwrap_or(0);
    let cached = chosen.w.cached_blocks();
    if chosen.migrated_blocks > 0 {
        Holding::Migrating(chosen.migrated_blocks)
    } else if max_cached == 0 {
        Holding::NothingCached
    } else if cached == max_cached {
        Holding::BestOverlap(cached)
    } else {
        Holding::Overlap { cached, best_elsewhere: max_cached }
    }
}
