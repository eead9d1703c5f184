//! Per-model numbers of a multi-model point (issue 44, the `models` workload; pure): each base
//! model's hit rate (its workers' engine counters, and the responses' `cached_tokens`) against
//! its own ceiling, its TTFT p90, its load max/mean over its own workers, and the cross-model
//! requests — those an engine answered 404 (vLLM's answer to a model it does not serve), i.e. a
//! request sent to a worker of another model. The done-when line of issue 44 reads these.

use crate::counters::PolicyCounters;
use crate::record::RequestRecord;
use crate::stats::{balance, percentile};
use serde::{Deserialize, Serialize};

/// The status an engine answers a model it does not serve with (vLLM: 404, `param: "model"`).
pub const CROSS_MODEL_STATUS: u16 = 404;

/// Whether a record was answered as a request for a model its worker does not serve.
pub fn cross_model(r: &RequestRecord) -> bool {
    r.status == Some(CROSS_MODEL_STATUS)
}

/// One base model's numbers at one point.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelPoint {
    /// The base model (its adapters' requests included).
    pub model: String,
    /// Its workers.
    pub workers: Vec<String>,
    /// Its records in the window.
    pub requests: usize,
    /// Its successful records.
    pub ok: usize,
    /// TTFT p90 over its successful records, ms.
    pub ttft_p90_ms: Option<f64>,
    /// Σ hits / Σ queries of its workers' engine counters (tokens).
    pub engine_hit_rate: Option<f64>,
    /// Σ cached_tokens / Σ prompt_tokens of its responses.
    pub usage_hit_rate: Option<f64>,
    /// Its own ceiling (its sessions' prompts only: models share no prefix).
    pub ceiling: Option<f64>,
    /// Max / mean prompt tokens over its own workers (idle ones count as 0).
    pub load_max_over_mean: Option<f64>,
    /// Its records answered [`CROSS_MODEL_STATUS`].
    pub cross_model: usize,
}

impl ModelPoint {
    /// Engine hit rate ÷ its ceiling.
    pub fn hit_over_ceiling(&self) -> Option<f64> {
        match (self.engine_hit_rate, self.ceiling) {
            (Some(h), Some(c)) if c > 0.0 => Some(h / c),
            _ => None,
        }
    }
}

/// One base model of the fleet: its name, its workers and its ceiling at the point.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetModelShare {
    /// The base model.
    pub model: String,
    /// The workers serving it.
    pub workers: Vec<String>,
    /// Its ceiling at the point, when known.
    pub ceiling: Option<f64>,
}

/// Per-model numbers of `records` (the window's), in `fleet`'s order. `base_of` maps a record's
/// requested model (base or adapter) to its base model; records naming none, or a model outside
/// `fleet`, are in no model's numbers (the point's totals still count them).
pub fn model_points(
    records: &[RequestRecord],
    counters: Option<&PolicyCounters>,
    fleet: &[FleetModelShare],
    base_of: impl Fn(&str) -> Option<&'static str>,
) -> Vec<ModelPoint> {
    fleet
        .iter()
        .map(|m| {
            let mine: Vec<&RequestRecord> = records
                .iter()
                .filter(|r| r.model.as_deref().and_then(&base_of) == Some(m.model.as_str()))
                .collect();
            let ok: Vec<&RequestRecord> = mine.iter().copied().filter(|r| r.ok()).collect();
            let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
            let (mut cached, mut prompt) = (0u64, 0u64);
            for r in ok.iter().filter(|r| r.cached_tokens.is_some()) {
                cached += r.cached_tokens.unwrap_or(0);
                prompt += r.prompt_tokens.unwrap_or(0);
            }
            let engine_hit_rate = counters.and_then(|c| {
                let (mut hits, mut queries) = (0.0, 0.0);
                for e in c.engines.iter().filter(|e| m.workers.contains(&e.worker)) {
                    hits += e.prefix_cache_hits;
                    queries += e.prefix_cache_queries;
                }
                (queries > 0.0).then(|| hits / queries)
            });
            let load = balance(
                ok.iter().filter_map(|r| {
                    r.worker
                        .as_deref()
                        .map(|w| (w, r.prompt_tokens.or(r.input_tokens).unwrap_or(0) as f64))
                }),
                &m.workers,
            );
            ModelPoint {
                model: m.model.clone(),
                workers: m.workers.clone(),
                requests: mine.len(),
                ok: ok.len(),
                ttft_p90_ms: percentile(&ttft, 90.0),
                engine_hit_rate,
                usage_hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
                ceiling: m.ceiling,
                load_max_over_mean: load.max_over_mean(),
                cross_model: mine.iter().filter(|r| cross_model(r)).count(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::EngineCounters;
    use crate::workload::models::base_of;

    fn rec(
        model: &str,
        worker: &str,
        status: u16,
        ttft: f64,
        prompt: u64,
        cached: u64,
    ) -> RequestRecord {
        RequestRecord {
            model: Some(model.into()),
            worker: Some(worker.into()),
            status: Some(status),
            ttft_ms: (status == 200).then_some(ttft),
            prompt_tokens: (status == 200).then_some(prompt),
            cached_tokens: (status == 200).then_some(cached),
            error: (status != 200).then(|| format!("HTTP {status}")),
            ..Default::default()
        }
    }

    fn engine(worker: &str, hits: f64, queries: f64) -> EngineCounters {
        EngineCounters {
            worker: worker.into(),
            prefix_cache_hits: hits,
            prefix_cache_queries: queries,
            ..Default::default()
        }
    }

    #[test]
    fn numbers_are_per_base_model_over_its_own_workers() {
        let records = vec![
            rec("deepseek-v4", "w0", 200, 100.0, 1000, 900),
            rec("ds4-sql", "w1", 200, 300.0, 1000, 500),
            // A request of the mini model sent to a worker of the other model.
            rec("mini-chat", "w0", 404, 0.0, 0, 0),
            rec("deepseek-v4-mini", "w2", 200, 50.0, 400, 400),
            rec("unknown-model", "w3", 200, 1.0, 1, 1),
        ];
        let counters = PolicyCounters {
            engines: vec![
                engine("w0", 900.0, 1000.0),
                engine("w1", 500.0, 1000.0),
                engine("w2", 400.0, 400.0),
                engine("w3", 0.0, 100.0),
            ],
            router: None,
        };
        let fleet = vec![
            FleetModelShare {
                model: "deepseek-v4".into(),
                workers: vec!["w0".into(), "w1".into()],
                ceiling: Some(0.8),
            },
            FleetModelShare {
                model: "deepseek-v4-mini".into(),
                workers: vec!["w2".into(), "w3".into()],
                ceiling: None,
            },
        ];
        let p = model_points(&records, Some(&counters), &fleet, base_of);
        assert_eq!(p.len(), 2);
        let (a, b) = (&p[0], &p[1]);
        assert_eq!((a.requests, a.ok, a.cross_model), (2, 2, 0));
        assert_eq!(a.engine_hit_rate, Some(0.7));
        assert_eq!(a.usage_hit_rate, Some(0.7));
        assert!((a.hit_over_ceiling().unwrap() - 0.875).abs() < 1e-12);
        assert_eq!(a.ttft_p90_ms, Some(300.0));
        assert_eq!(a.load_max_over_mean, Some(1.0));
        assert_eq!((b.requests, b.ok, b.cross_model), (2, 1, 1));
        // w3 served nothing of its model: load max/mean 2 over its two workers.
        assert_eq!(b.load_max_over_mean, Some(2.0));
        assert_eq!(b.engine_hit_rate, Some(0.8));
        assert_eq!(b.hit_over_ceiling(), None);
    }
}
