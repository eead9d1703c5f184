//! The multi-model workload (issue 44): agentic chats over two base models and their LoRA
//! adapters, adapters Zipf-popular, system prompts shared by a base model's adapters (pure).
//!
//! Each session picks a base model by its share of sessions ([`MODEL_MIX`]: 60 % / 40 %), then
//! the model it names — the base itself or one of its adapters — by a Zipf law of exponent
//! [`ZIPF_S`] over `[base, adapters…]` (the base the most popular), then one of its base model's
//! [`SYSTEM_PROMPTS_PER_BASE`] system prompts of 16–32 KB. A prompt's text is the same under every
//! adapter of its base model, but its KV is not (the engines key an adapter's blocks by its name;
//! the ceiling keys chains by the session's model, `workload::segments`), so a router must keep
//! each (model, prompt) pair on few workers of the right base model. The turns are the agentic
//! workload's (`gen::agentic`): 5–30, 60 % tool calls. Deterministic from the seed; session `i`
//! depends only on `(seed, i)`.

use super::gen::{agentic_turns, arrivals, finish, system_prompt, GenConfig};
use super::{ChatMsg, Content, Schedule, Session, WorkloadKind};
use crate::chat::text;
use crate::rng::{mix, SplitMix64};

/// One base model of the workload: its name, its adapters and its share of sessions.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BaseModel {
    /// The engines' served model name.
    pub name: &'static str,
    /// Its LoRA adapters, most popular first (after the base itself).
    pub adapters: &'static [&'static str],
    /// Share of sessions (the shares sum to 1).
    pub share: f64,
}

impl BaseModel {
    /// The names its sessions may request: the base itself, then its adapters (Zipf rank order).
    pub fn names(&self) -> Vec<&'static str> {
        std::iter::once(self.name).chain(self.adapters.iter().copied()).collect()
    }
}

/// The workload's fleet of models: the first is the default model.
pub const MODEL_MIX: [BaseModel; 2] = [
    BaseModel { name: "deepseek-v4", adapters: &["ds4-sql", "ds4-chat", "ds4-code"], share: 0.6 },
    BaseModel { name: "deepseek-v4-mini", adapters: &["mini-sql", "mini-chat"], share: 0.4 },
];

/// Zipf exponent of a base model's names' popularity.
pub const ZIPF_S: f64 = 1.1;

/// System prompts per base model, shared by all its adapters.
pub const SYSTEM_PROMPTS_PER_BASE: usize = 2;

/// The base model a request's `model` name belongs to (`None`: not in [`MODEL_MIX`]).
pub fn base_of(requested: &str) -> Option<&'static str> {
    MODEL_MIX.iter().find(|b| b.names().contains(&requested)).map(|b| b.name)
}

/// Zipf weights `1 / (k + 1)^s` of `n` ranks, normalised to sum to 1.
pub fn zipf_weights(n: usize, s: f64) -> Vec<f64> {
    let w: Vec<f64> = (0..n).map(|k| 1.0 / ((k + 1) as f64).powf(s)).collect();
    let total: f64 = w.iter().sum();
    w.into_iter().map(|x| x / total).collect()
}

/// Index drawn from `weights` (summing to 1) with a uniform draw `u` in `[0, 1)`.
fn pick(weights: &[f64], u: f64) -> usize {
    let mut acc = 0.0;
    for (i, w) in weights.iter().enumerate() {
        acc += w;
        if u < acc {
            return i;
        }
    }
    weights.len().saturating_sub(1)
}

/// Base model `b`'s shared system prompts (16–32 KB each).
pub fn system_prompts(seed: u64, b: usize) -> Vec<String> {
    (0..SYSTEM_PROMPTS_PER_BASE)
        .map(|i| {
            let mut r = SplitMix64::new(mix(seed, 0x30DE + (b * 16 + i) as u64));
            let bytes = r.range_u64(16 * 1024, 32 * 1024 + 1) as usize;
            system_prompt(seed, 0x30 + b as u64, i, bytes)
        })
        .collect()
}

/// The multi-model workload at `rate` new conversations per second.
pub fn models(cfg: &GenConfig, rate: f64) -> Schedule {
    let prompts: Vec<Vec<String>> =
        (0..MODEL_MIX.len()).map(|b| system_prompts(cfg.seed, b)).collect();
    let shares: Vec<f64> = MODEL_MIX.iter().map(|b| b.share).collect();
    let mut arr = SplitMix64::new(mix(cfg.seed, 0x30D5));
    let sessions = arrivals(&mut arr, rate, cfg.duration_s)
        .into_iter()
        .enumerate()
        .map(|(i, start_ms)| {
            let mut rng = SplitMix64::new(mix(mix(cfg.seed, 0x30), i as u64));
            let b = pick(&shares, rng.next_f64());
            let names = MODEL_MIX[b].names();
            let model = names[pick(&zipf_weights(names.len(), ZIPF_S), rng.next_f64())];
            let sys = rng.range_u64(0, prompts[b].len() as u64) as usize;
            let words = rng.range_u64(100, 301) as usize;
            let mut msgs = vec![
                ChatMsg::new("system", prompts[b][sys].clone()),
                ChatMsg::new("user", format!("Task {}-{i}: {}", cfg.seed, text(&mut rng, words))),
            ];
            let turns = agentic_turns(&mut rng, i, cfg, &mut msgs);
            Session {
                id: format!("models-{}-{i}", cfg.seed),
                start_ms,
                content: Content::Chat(msgs),
                turns,
                model: Some(model.to_owned()),
            }
        })
        .collect();
    finish(WorkloadKind::Models, rate, sessions, cfg, "content bytes")
}

/// The sessions of `sessions` whose model belongs to base model `base` (per-model ceilings).
pub fn sessions_of<'a>(sessions: &'a [Session], base: &str) -> Vec<&'a Session> {
    sessions.iter().filter(|s| s.model.as_deref().and_then(base_of) == Some(base)).collect()
}

/// `schedule` restricted to base model `base`'s sessions, its ceiling theirs alone.
pub fn model_schedule(schedule: &Schedule, base: &str, block_size: usize) -> Schedule {
    let sessions: Vec<Session> =
        sessions_of(&schedule.sessions, base).into_iter().cloned().collect();
    Schedule {
        kind: schedule.kind,
        rate: schedule.rate,
        ceiling: super::sessions_ceiling(&sessions, block_size),
        ceiling_unit: schedule.ceiling_unit,
        sessions,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{segments, sessions_ceiling};
    use std::collections::HashMap;

    fn cfg() -> GenConfig {
        GenConfig { seed: 7, duration_s: 400.0, think_divisor: 4.0, block_size: 16 }
    }

    #[test]
    fn catalog_names_are_unique_and_shares_sum_to_one() {
        let mut all: Vec<&str> = MODEL_MIX.iter().flat_map(|b| b.names()).collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "every name once across the fleet");
        assert!((MODEL_MIX.iter().map(|b| b.share).sum::<f64>() - 1.0).abs() < 1e-12);
        assert_eq!(base_of("ds4-code"), Some("deepseek-v4"));
        assert_eq!(base_of("deepseek-v4-mini"), Some("deepseek-v4-mini"));
        assert_eq!(base_of("nope"), None);
        let w = zipf_weights(4, ZIPF_S);
        assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-12 && w.windows(2).all(|p| p[0] > p[1]));
        assert_eq!((pick(&w, 0.0), pick(&w, 0.999_999_999)), (0, 3));
    }

    #[test]
    fn shape_popularity_and_determinism() {
        let p = models(&cfg(), 1.0);
        assert!(p.sessions.len() > 300, "{}", p.sessions.len());
        assert_eq!(p, models(&cfg(), 1.0), "deterministic");
        let mut by_name: HashMap<&str, usize> = HashMap::new();
        for s in &p.sessions {
            let m = s.model.as_deref().expect("every session names its model");
            *by_name.entry(m).or_default() += 1;
            let base = base_of(m).expect("a catalog name");
            let b = MODEL_MIX.iter().position(|x| x.name == base).unwrap();
            let Content::Chat(msgs) = &s.content else { panic!("chat") };
            // The system prompt is one of its base model's, shared by its adapters.
            assert!(system_prompts(7, b).contains(&msgs[0].content));
            assert!((5..=30).contains(&s.turns.len()));
            assert_eq!(s.body(0, "ignored").unwrap()["model"], m);
        }
        let n = p.sessions.len() as f64;
        let base_a: usize = MODEL_MIX[0].names().iter().map(|m| by_name.get(m).unwrap_or(&0)).sum();
        assert!((0.52..0.68).contains(&(base_a as f64 / n)), "base A share {}", base_a as f64 / n);
        // Zipf within each base model: the base first, then its adapters in rank order, all used.
        for b in &MODEL_MIX {
            let counts: Vec<usize> =
                b.names().iter().map(|m| *by_name.get(m).unwrap_or(&0)).collect();
            assert!(counts.iter().all(|&c| c > 0), "{}: {counts:?}", b.name);
            assert!(counts[0] > counts[counts.len() - 1] * 2, "{}: {counts:?}", b.name);
            let total: usize = counts.iter().sum();
            let want = zipf_weights(counts.len(), ZIPF_S)[0];
            let got = counts[0] as f64 / total as f64;
            assert!((got - want).abs() < 0.08, "{}: head {got} vs {want}", b.name);
        }
    }

    #[test]
    fn ceilings_per_model_and_adapters_never_share_prefixes() {
        let p = models(&cfg(), 1.0);
        // Two sessions with the same system prompt under different adapters share no chain id.
        let first = |m: &str| p.sessions.iter().find(|s| s.model.as_deref() == Some(m)).unwrap();
        let (a, b) = (first("deepseek-v4"), first("ds4-sql"));
        let ids = |s: &Session| segments(s, 0, 16).into_iter().map(|x| x.0).collect::<Vec<_>>();
        assert!(ids(a).iter().all(|x| !ids(b).contains(x)));
        // The same session under another model: nothing in common, same weights.
        let moved = Session { model: Some("ds4-chat".into()), ..a.clone() };
        assert!(ids(a).iter().all(|x| !ids(&moved).contains(x)));
        // Per-model ceilings: each high (shared prompts, growing histories), and the whole
        // schedule's ceiling is their sum (models share nothing).
        let mut reused = 0;
        let mut total = 0;
        for base in MODEL_MIX.iter().map(|b| b.name) {
            let of: Vec<Session> = sessions_of(&p.sessions, base).into_iter().cloned().collect();
            let c = sessions_ceiling(&of, 16);
            assert!((0.80..0.99).contains(&c.token_rate()), "{base}: {}", c.token_rate());
            reused += c.tokens_reused;
            total += c.tokens_total;
        }
        assert_eq!((reused, total), (p.ceiling.tokens_reused, p.ceiling.tokens_total));
    }
}
