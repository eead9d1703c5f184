//! Per-policy counters: the engine's and the router's view of cache hits during one policy's run.
//!
//! The orchestrator writes one `counters.json` per policy (shape: [`PolicyCounters`]). Values are
//! **deltas** over the policy's run — counters survive `POST /reset_prefix_cache`, so the
//! orchestrator scrapes before and after and subtracts ([`engine_delta`], [`router_delta`]).
//!
//! - Engine (each simulator's `/metrics`): `vllm:prefix_cache_hits_total` and
//!   `vllm:prefix_cache_queries_total`, both counted in tokens; hits/queries is the engine-side
//!   block-weighted hit rate (every cached token counts, so long prompts weigh more).
//! - Router (Envoy `/stats/prometheus`): `router_kv_overlap_blocks_total` /
//!   `router_kv_isl_blocks_total` is the predicted block-weighted rate; the histogram
//!   `router_kv_hit_rate` (`_sum` / `_count`) is the predicted request-weighted rate. Envoy
//!   histograms record integers, so the filter may record the rate scaled (e.g. ×100);
//!   `hit_rate_scale` undoes that. Envoy may prefix names with `envoy_`; both spellings match.
//! - Attribution (the indexer's `/metrics`, issue 46): `kvmesh_attribution_*_tokens_total` —
//!   available, captured, delivered and the losses by cause, in tokens, over the requests whose
//!   usage reached the indexer ([`attribution_delta`]); a kvmesh policy's only.

use crate::prom::{sum, Sample};
use serde::{Deserialize, Serialize};

/// vLLM's prefix-cache hit counter (tokens).
pub const VLLM_PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";
/// vLLM's prefix-cache query counter (tokens).
pub const VLLM_PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";
/// vLLM's preemption counter: a preempted request is re-admitted and its prompt looked up
/// again, so preemptions inflate both prefix-cache counters.
pub const VLLM_NUM_PREEMPTIONS: &str = "vllm:num_preemptions_total";
/// Router counter: predicted overlapping blocks.
pub const ROUTER_OVERLAP_BLOCKS: &str = kvmesh_core::router_metrics::OVERLAP_BLOCKS_TOTAL;
/// Router counter: input blocks of routed requests.
pub const ROUTER_ISL_BLOCKS: &str = kvmesh_core::router_metrics::ISL_BLOCKS_TOTAL;
/// Router histogram of per-request overlap/isl (its `_sum` and `_count` series are read).
pub const ROUTER_HIT_RATE: &str = kvmesh_core::router_metrics::HIT_RATE;

/// One engine's counters over a policy's run.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineCounters {
    /// Worker id (as in the `x-sim-worker` header).
    pub worker: String,
    /// `ip:port` of the worker, informational.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Δ `vllm:prefix_cache_hits_total` (tokens).
    pub prefix_cache_hits: f64,
    /// Δ `vllm:prefix_cache_queries_total` (tokens).
    pub prefix_cache_queries: f64,
    /// Δ `vllm:num_preemptions_total`.
    #[serde(default)]
    pub preemptions: f64,
}

/// The router's predictions over a policy's run (absent for policies without kvmesh).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RouterCounters {
    /// Δ `router_kv_overlap_blocks_total`.
    pub overlap_blocks: f64,
    /// Δ `router_kv_isl_blocks_total`.
    pub isl_blocks: f64,
    /// Δ `router_kv_hit_rate_sum`.
    #[serde(default)]
    pub hit_rate_sum: f64,
    /// Δ `router_kv_hit_rate_count`.
    #[serde(default)]
    pub hit_rate_count: f64,
    /// Divide `hit_rate_sum / hit_rate_count` by this (1 when the rate is recorded as 0..1).
    #[serde(default = "one")]
    pub hit_rate_scale: f64,
    /// The indexer's attribution of the hits over the run, when it exports one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attribution: Option<AttributionCounters>,
}

/// The indexer's attribution over a policy's run, in tokens (deltas; `sidecar-indexer/README.md`
/// § Attribution): P, A, C, D and the losses, over the attributed requests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct AttributionCounters {
    /// Requests attributed.
    pub requests: f64,
    pub prompt: f64,
    pub available: f64,
    pub captured: f64,
    pub delivered: f64,
    /// Lost: nobody eligible held it (P − A).
    pub workload: f64,
    /// Lost: another worker held more (A − C).
    pub routing: f64,
    /// Lost: predicted on the chosen worker, not served from its cache (C − D where positive).
    pub not_delivered: f64,
    /// Served beyond the prediction (D − C where positive).
    pub unpredicted: f64,
}

impl AttributionCounters {
    /// `tokens` as a share of the attributed prompt tokens.
    pub fn share(&self, tokens: f64) -> Option<f64> {
        rate(tokens, self.prompt)
    }
}

/// Attribution metric names (the indexer's, `sidecar-indexer/src/metrics.rs`).
pub const ATTRIBUTION_REQUESTS: &str = "kvmesh_attribution_requests_total";
pub const ATTRIBUTION_PREFIX: &str = "kvmesh_attribution_";

/// The indexer's attribution between two scrapes of its `/metrics`; `None` when it exports none
/// (an indexer without attribution, or no indexer).
pub fn attribution_delta(before: &[Sample], after: &[Sample]) -> Option<AttributionCounters> {
    let tokens = |kind: &str| format!("{ATTRIBUTION_PREFIX}{kind}_tokens_total");
    let labelled = |samples: &[Sample], name: &str, key: &str, value: &str| -> f64 {
        samples
            .iter()
            .filter(|s| s.name == name && s.label(key) == Some(value))
            .map(|s| s.value)
            .sum()
    };
    let d = |name: &str| delta(before, after, name).unwrap_or(0.0);
    let dl = |name: &str, key: &str, value: &str| {
        labelled(after, name, key, value) - labelled(before, name, key, value)
    };
    sum(after, &tokens("prompt"))?;
    let lost = tokens("lost");
    Some(AttributionCounters {
        requests: dl(ATTRIBUTION_REQUESTS, "result", "attributed"),
        prompt: d(&tokens("prompt")),
        available: d(&tokens("available")),
        captured: d(&tokens("captured")),
        delivered: d(&tokens("delivered")),
        workload: dl(&lost, "cause", "workload"),
        routing: dl(&lost, "cause", "routing"),
        not_delivered: dl(&lost, "cause", "not_delivered"),
        unpredicted: d(&tokens("unpredicted")),
    })
}

fn one() -> f64 {
    1.0
}

/// Everything `counters.json` holds for one policy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyCounters {
    /// One entry per engine in the fleet.
    pub engines: Vec<EngineCounters>,
    /// Router predictions, when the policy is a kvmesh one.
    #[serde(default)]
    pub router: Option<RouterCounters>,
}

fn rate(num: f64, den: f64) -> Option<f64> {
    (den > 0.0 && num.is_finite()).then(|| num / den)
}

impl PolicyCounters {
    /// Engine-side hit rate over the fleet: Σhits / Σqueries.
    pub fn engine_hit_rate(&self) -> Option<f64> {
        let hits: f64 = self.engines.iter().map(|e| e.prefix_cache_hits).sum();
        let queries: f64 = self.engines.iter().map(|e| e.prefix_cache_queries).sum();
        rate(hits, queries)
    }

    /// Prompt tokens per engine (its prefix-cache queries), max ÷ mean over the fleet's engines;
    /// `None` when none was queried.
    pub fn load_max_over_mean(&self) -> Option<f64> {
        let fleet: Vec<String> = self.engines.iter().map(|e| e.worker.clone()).collect();
        crate::stats::balance(
            self.engines.iter().map(|e| (e.worker.as_str(), e.prefix_cache_queries)),
            &fleet,
        )
        .max_over_mean()
    }

    /// Preemptions over the fleet.
    pub fn preemptions(&self) -> f64 {
        self.engines.iter().map(|e| e.preemptions).sum()
    }

    /// Router-predicted block-weighted hit rate.
    pub fn router_block_rate(&self) -> Option<f64> {
        self.router.as_ref().and_then(|r| rate(r.overlap_blocks, r.isl_blocks))
    }

    /// Router-predicted request-weighted hit rate (mean of per-request overlap/isl).
    pub fn router_request_rate(&self) -> Option<f64> {
        let r = self.router.as_ref()?;
        let scale = if r.hit_rate_scale > 0.0 { r.hit_rate_scale } else { 1.0 };
        rate(r.hit_rate_sum, r.hit_rate_count).map(|x| x / scale)
    }
}

/// Sum of `name` or, failing that, `envoy_<name>` (Envoy's Prometheus prefix).
fn lookup(samples: &[Sample], name: &str) -> Option<f64> {
    sum(samples, name).or_else(|| sum(samples, &format!("envoy_{name}")))
}

fn delta(before: &[Sample], after: &[Sample], name: &str) -> Option<f64> {
    let a = lookup(after, name)?;
    Some(a - lookup(before, name).unwrap_or(0.0))
}

/// One engine's counters between two scrapes of its `/metrics`. Missing metrics count as 0
/// deltas (a simulator that never saw a request may not export them yet).
pub fn engine_delta(
    worker: &str,
    endpoint: Option<&str>,
    before: &[Sample],
    after: &[Sample],
) -> EngineCounters {
    EngineCounters {
        worker: worker.to_string(),
        endpoint: endpoint.map(String::from),
        prefix_cache_hits: delta(before, after, VLLM_PREFIX_CACHE_HITS).unwrap_or(0.0),
        prefix_cache_queries: delta(before, after, VLLM_PREFIX_CACHE_QUERIES).unwrap_or(0.0),
        preemptions: delta(before, after, VLLM_NUM_PREEMPTIONS).unwrap_or(0.0),
    }
}

/// The router's counters between two scrapes of Envoy's `/stats/prometheus`; `None` when the
/// gateway exports no kvmesh metrics (a plain Envoy policy).
pub fn router_delta(
    before: &[Sample],
    after: &[Sample],
    hit_rate_scale: f64,
) -> Option<RouterCounters> {
    let overlap = delta(before, after, ROUTER_OVERLAP_BLOCKS);
    let isl = delta(before, after, ROUTER_ISL_BLOCKS);
    if overlap.is_none() && isl.is_none() {
        return None;
    }
    let sum_name = format!("{ROUTER_HIT_RATE}_sum");
    let count_name = format!("{ROUTER_HIT_RATE}_count");
    Some(RouterCounters {
        overlap_blocks: overlap.unwrap_or(0.0),
        isl_blocks: isl.unwrap_or(0.0),
        hit_rate_sum: delta(before, after, &sum_name).unwrap_or(0.0),
        hit_rate_count: delta(before, after, &count_name).unwrap_or(0.0),
        hit_rate_scale,
        attribution: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prom::parse;

    #[test]
    fn engine_delta_subtracts_and_sums_engines() {
        let before = parse("vllm:prefix_cache_hits_total{engine=\"0\"} 100\nvllm:prefix_cache_queries_total{engine=\"0\"} 400\n").unwrap();
        let after = parse("vllm:prefix_cache_hits_total{engine=\"0\"} 300\nvllm:prefix_cache_hits_total{engine=\"1\"} 50\nvllm:prefix_cache_queries_total{engine=\"0\"} 900\n").unwrap();
        let e = engine_delta("w0", Some("127.0.0.1:1"), &before, &after);
        assert_eq!(
            (e.prefix_cache_hits, e.prefix_cache_queries, e.preemptions),
            (250.0, 500.0, 0.0)
        );
        let pre = engine_delta(
            "w0",
            None,
            &parse("vllm:num_preemptions_total 2").unwrap(),
            &parse("vllm:num_preemptions_total 5").unwrap(),
        );
        assert_eq!(pre.preemptions, 3.0);
        let empty = engine_delta("w1", None, &[], &[]);
        assert_eq!((empty.prefix_cache_hits, empty.prefix_cache_queries), (0.0, 0.0));
    }

    #[test]
    fn router_delta_accepts_envoy_prefix_and_absence() {
        let before =
            parse("envoy_router_kv_overlap_blocks_total 10\nenvoy_router_kv_isl_blocks_total 20\n")
                .unwrap();
        let after = parse(
            "envoy_router_kv_overlap_blocks_total 40\nenvoy_router_kv_isl_blocks_total 80\n\
             router_kv_hit_rate_sum 150\nrouter_kv_hit_rate_count 3\n",
        )
        .unwrap();
        let r = router_delta(&before, &after, 100.0).unwrap();
        assert_eq!((r.overlap_blocks, r.isl_blocks), (30.0, 60.0));
        let c = PolicyCounters { engines: vec![], router: Some(r) };
        assert_eq!(c.router_block_rate(), Some(0.5));
        assert_eq!(c.router_request_rate(), Some(0.5));
        // The gateway exports no kvmesh metrics after the run: no router view at all.
        assert_eq!(router_delta(&before, &parse("other 1").unwrap(), 1.0), None);
        assert_eq!(router_delta(&[], &parse("other 1").unwrap(), 1.0), None);
    }

    #[test]
    fn attribution_is_a_delta_of_the_indexers_counters() {
        let text = |p: u32, c: u32, d: u32| {
            format!(
                "kvmesh_attribution_requests_total{{model=\"m\",result=\"attributed\"}} {n}\n\
                 kvmesh_attribution_requests_total{{model=\"m\",result=\"no_usage\"}} 7\n\
                 kvmesh_attribution_prompt_tokens_total{{model=\"m\"}} {p}\n\
                 kvmesh_attribution_available_tokens_total{{model=\"m\"}} {c}\n\
                 kvmesh_attribution_captured_tokens_total{{model=\"m\"}} {c}\n\
                 kvmesh_attribution_delivered_tokens_total{{model=\"m\"}} {d}\n\
                 kvmesh_attribution_unpredicted_tokens_total{{model=\"m\"}} 0\n\
                 kvmesh_attribution_lost_tokens_total{{cause=\"workload\",model=\"m\"}} {w}\n\
                 kvmesh_attribution_lost_tokens_total{{cause=\"routing\",model=\"m\"}} 0\n\
                 kvmesh_attribution_lost_tokens_total{{cause=\"not_delivered\",model=\"m\"}} {nd}\n",
                n = p / 100,
                w = p - c,
                nd = c - d
            )
        };
        let before = parse(&text(1000, 600, 500)).unwrap();
        let after = parse(&text(3000, 2000, 1600)).unwrap();
        let a = attribution_delta(&before, &after).unwrap();
        assert_eq!(
            (a.requests, a.prompt, a.captured, a.delivered, a.workload, a.not_delivered),
            (20.0, 2000.0, 1400.0, 1100.0, 600.0, 300.0)
        );
        assert_eq!(a.share(a.delivered), Some(0.55));
        assert_eq!(attribution_delta(&[], &parse("other 1").unwrap()), None);
    }

    #[test]
    fn rates_table() {
        let eng = |h: f64, q: f64| EngineCounters {
            worker: "w".into(),
            endpoint: None,
            prefix_cache_hits: h,
            prefix_cache_queries: q,
            ..Default::default()
        };
        let cases = [
            (vec![], None),
            (vec![eng(0.0, 0.0)], None),
            (vec![eng(1.0, 4.0), eng(3.0, 4.0)], Some(0.5)),
        ];
        for (engines, want) in cases {
            assert_eq!(PolicyCounters { engines, router: None }.engine_hit_rate(), want);
        }
        assert_eq!(PolicyCounters::default().router_block_rate(), None);
    }

    #[test]
    fn load_is_prompt_tokens_per_engine_max_over_mean() {
        let eng = |w: &str, q: f64| EngineCounters {
            worker: w.into(),
            prefix_cache_queries: q,
            ..Default::default()
        };
        let c = |engines| PolicyCounters { engines, router: None };
        assert_eq!(c(vec![eng("w0", 300.0), eng("w1", 100.0)]).load_max_over_mean(), Some(1.5));
        assert_eq!(c(vec![eng("w0", 0.0), eng("w1", 0.0)]).load_max_over_mean(), None);
    }

    #[test]
    fn json_shape_defaults() {
        let c: PolicyCounters = serde_json::from_str(
            r#"{"engines":[{"worker":"w0","prefix_cache_hits":1,"prefix_cache_queries":2}],
                "router":{"overlap_blocks":1,"isl_blocks":2}}"#,
        )
        .unwrap();
        assert_eq!(c.router.as_ref().unwrap().hit_rate_scale, 1.0);
        assert_eq!(c.router_request_rate(), None);
    }
}
