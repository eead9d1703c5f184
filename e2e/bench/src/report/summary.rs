//! One policy's numbers, computed from its result records and counters (pure).
//!
//! Latency percentiles use successful requests only (a timeout is not a latency sample; failures
//! are counted separately and listed). Throughput is over the policy's active span: first send
//! to last completion. Router-predicted rates come from the gateway's counters when scraped and
//! otherwise from the `x-kvmesh-*` debug headers the records captured, labelled by source.

use crate::counters::PolicyCounters;
use crate::record::RequestRecord;
use crate::stats::{balance, percentile_sorted, sorted, Balance};
use std::collections::BTreeMap;

/// Where a router-predicted rate came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateSource {
    /// Envoy's `/stats/prometheus` counters.
    Counters,
    /// The `x-kvmesh-overlap-blocks` / `x-kvmesh-isl-blocks` debug headers.
    DebugHeaders,
}

/// A rate with its provenance.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SourcedRate {
    /// The rate, 0..1.
    pub value: f64,
    /// Where it came from.
    pub source: RateSource,
}

/// Percentiles of one latency, in ms.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Latency {
    /// Samples.
    pub n: usize,
    /// p50.
    pub p50: Option<f64>,
    /// p90.
    pub p90: Option<f64>,
    /// p99.
    pub p99: Option<f64>,
}

impl Latency {
    fn of(sorted: &[f64]) -> Self {
        Self {
            n: sorted.len(),
            p50: percentile_sorted(sorted, 50.0),
            p90: percentile_sorted(sorted, 90.0),
            p99: percentile_sorted(sorted, 99.0),
        }
    }
}

/// Everything the report shows for one policy.
#[derive(Debug, Clone, PartialEq)]
pub struct PolicySummary {
    /// Policy name.
    pub name: String,
    /// Records.
    pub requests: usize,
    /// Successful records.
    pub ok: usize,
    /// Failed records.
    pub failed: usize,
    /// Failure messages and how often each occurred (most frequent first, at most 5).
    pub top_errors: Vec<(String, usize)>,
    /// Engine-side hit rate from the engines' counters (Σhits/Σqueries, tokens).
    pub engine_hit_rate: Option<f64>,
    /// Engine preemptions during the run (each re-admission is looked up and counted again).
    pub preemptions: Option<f64>,
    /// Σcached_tokens / Σprompt_tokens from the responses' usage (the client's view of the same).
    pub usage_cached_rate: Option<f64>,
    /// Router-predicted block-weighted rate.
    pub router_block_rate: Option<SourcedRate>,
    /// Router-predicted request-weighted rate.
    pub router_request_rate: Option<SourcedRate>,
    /// Time to first token, successful requests.
    pub ttft: Latency,
    /// TTFT samples sorted ascending (for the CDF plot).
    pub ttft_sorted: Vec<f64>,
    /// End-to-end latency, successful requests.
    pub e2e: Latency,
    /// How late requests were sent (`sent_ms - scheduled_ms`, all records): a large lag means
    /// the replay was held back by `--max-concurrency`, i.e. the fleet could not keep up.
    pub send_lag: Latency,
    /// First send to last completion, seconds.
    pub span_s: f64,
    /// Successful requests per second over the span.
    pub requests_per_s: f64,
    /// Output tokens per second over the span.
    pub output_tokens_per_s: f64,
    /// Successful requests per worker.
    pub requests_balance: Balance,
    /// Tokens (prompt + output) per worker.
    pub tokens_balance: Balance,
    /// Decisions by `x-kvmesh-decision-mode`, when the headers were present.
    pub modes: BTreeMap<String, usize>,
    /// Requests the filter routed without the indexer, by `x-kvmesh-fallback` reason.
    pub fallbacks: BTreeMap<String, usize>,
}

fn ratio_opt(num: f64, den: f64) -> Option<f64> {
    (den > 0.0).then(|| num / den)
}

/// Summarises one policy. `fleet` lists the fleet's worker ids (idle ones count as 0 in the
/// balance); workers that only appear in the records are added.
pub fn summarize(
    name: &str,
    records: &[RequestRecord],
    counters: Option<&PolicyCounters>,
    fleet: &[String],
) -> PolicySummary {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for r in records.iter().filter(|r| !r.ok()) {
        let msg = r.error.clone().unwrap_or_else(|| format!("HTTP {}", r.status.unwrap_or(0)));
        *errors.entry(msg).or_default() += 1;
    }
    let mut top_errors: Vec<(String, usize)> = errors.into_iter().collect();
    top_errors.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    top_errors.truncate(5);

    let ttft_sorted = sorted(&ok.iter().filter_map(|r| r.ttft_ms).collect::<Vec<_>>());
    let e2e_sorted = sorted(&ok.iter().map(|r| r.e2e_ms).collect::<Vec<_>>());
    let lag_sorted =
        sorted(&records.iter().map(|r| (r.sent_ms - r.scheduled_ms).max(0.0)).collect::<Vec<_>>());

    let start = records.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let end = records.iter().map(|r| r.sent_ms + r.e2e_ms).fold(f64::NEG_INFINITY, f64::max);
    let span_s = if end > start { (end - start) / 1000.0 } else { 0.0 };
    let out_tokens: u64 = ok.iter().filter_map(|r| r.output_tokens).sum();
    let per_s = |x: f64| if span_s > 0.0 { x / span_s } else { 0.0 };

    let (mut cached, mut prompt) = (0u64, 0u64);
    for r in ok.iter().filter(|r| r.cached_tokens.is_some()) {
        cached += r.cached_tokens.unwrap_or(0);
        prompt += r.prompt_tokens.unwrap_or(0);
    }

    let served: Vec<(&str, &RequestRecord)> =
        ok.iter().filter_map(|r| r.worker.as_deref().map(|w| (w, *r))).collect();
    let requests_balance = balance(served.iter().map(|(w, _)| (*w, 1.0)), fleet);
    let tokens_balance = balance(served.iter().map(|(w, r)| (*w, r.worker_tokens() as f64)), fleet);

    let (mut ov, mut isl, mut req_sum, mut req_n) = (0u64, 0u64, 0.0, 0usize);
    let mut modes = BTreeMap::new();
    let mut fallbacks = BTreeMap::new();
    for r in records {
        if let Some(f) = &r.fallback {
            *fallbacks.entry(f.clone()).or_default() += 1;
        }
        if let (Some(o), Some(i)) = (r.overlap_blocks, r.isl_blocks) {
            ov += o;
            isl += i;
            if i > 0 {
                req_sum += o as f64 / i as f64;
                req_n += 1;
            }
        }
        if let Some(m) = &r.decision_mode {
            *modes.entry(m.clone()).or_default() += 1;
        }
    }
    let from_headers =
        |v: Option<f64>| v.map(|value| SourcedRate { value, source: RateSource::DebugHeaders });
    let from_counters =
        |v: Option<f64>| v.map(|value| SourcedRate { value, source: RateSource::Counters });
    let router_block_rate = from_counters(counters.and_then(PolicyCounters::router_block_rate))
        .or_else(|| from_headers(ratio_opt(ov as f64, isl as f64)));
    let router_request_rate = from_counters(counters.and_then(PolicyCounters::router_request_rate))
        .or_else(|| from_headers(ratio_opt(req_sum, req_n as f64)));

    PolicySummary {
        name: name.to_string(),
        requests: records.len(),
        ok: ok.len(),
        failed: records.len() - ok.len(),
        top_errors,
        engine_hit_rate: counters.and_then(PolicyCounters::engine_hit_rate),
        preemptions: counters.map(PolicyCounters::preemptions),
        usage_cached_rate: ratio_opt(cached as f64, prompt as f64),
        router_block_rate,
        router_request_rate,
        ttft: Latency::of(&ttft_sorted),
        ttft_sorted,
        e2e: Latency::of(&e2e_sorted),
        send_lag: Latency::of(&lag_sorted),
        span_s,
        requests_per_s: per_s(ok.len() as f64),
        output_tokens_per_s: per_s(out_tokens as f64),
        requests_balance,
        tokens_balance,
        modes,
        fallbacks,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::{EngineCounters, RouterCounters};

    fn ok(i: u64, worker: &str, ttft: f64, e2e: f64) -> RequestRecord {
        RequestRecord {
            index: i,
            scheduled_ms: i as f64 * 100.0,
            sent_ms: i as f64 * 100.0,
            ttft_ms: Some(ttft),
            e2e_ms: e2e,
            status: Some(200),
            worker: Some(worker.into()),
            prompt_tokens: Some(100),
            cached_tokens: Some(50),
            output_tokens: Some(10),
            max_tokens: 10,
            ..Default::default()
        }
    }

    #[test]
    fn summarizes_latency_throughput_balance_and_errors() {
        let mut recs: Vec<RequestRecord> = (0..10)
            .map(|i| ok(i, if i < 6 { "w0" } else { "w1" }, (i + 1) as f64, 100.0))
            .collect();
        recs.push(RequestRecord {
            index: 10,
            sent_ms: 50.0,
            e2e_ms: 5.0,
            error: Some("timeout".into()),
            ..Default::default()
        });
        recs.push(RequestRecord {
            index: 11,
            sent_ms: 60.0,
            e2e_ms: 5.0,
            status: Some(503),
            ..Default::default()
        });
        let fleet = vec!["w0".to_string(), "w1".to_string(), "w2".to_string()];
        let s = summarize("rr", &recs, None, &fleet);
        assert_eq!((s.requests, s.ok, s.failed), (12, 10, 2));
        assert_eq!(s.top_errors, vec![("HTTP 503".to_string(), 1), ("timeout".to_string(), 1)]);
        assert_eq!((s.ttft.p50, s.ttft.p90, s.ttft.p99), (Some(5.0), Some(9.0), Some(10.0)));
        assert_eq!(s.e2e.p50, Some(100.0));
        // The two failures were sent 50 and 60 ms after their (zero) due time.
        assert_eq!((s.send_lag.p50, s.send_lag.p99), (Some(0.0), Some(60.0)));
        // First send 0 ms, last completion 900 + 100 = 1000 ms.
        assert!((s.span_s - 1.0).abs() < 1e-9);
        assert!((s.requests_per_s - 10.0).abs() < 1e-9);
        assert!((s.output_tokens_per_s - 100.0).abs() < 1e-9);
        assert_eq!(s.usage_cached_rate, Some(0.5));
        assert_eq!(s.requests_balance.per_worker["w2"], 0.0);
        assert!((s.requests_balance.max_over_mean().unwrap() - 6.0 / (10.0 / 3.0)).abs() < 1e-9);
        assert_eq!(s.engine_hit_rate, None);
        assert_eq!(s.router_block_rate, None);
    }

    #[test]
    fn router_rates_prefer_counters_then_headers() {
        let mut a = ok(0, "w0", 1.0, 2.0);
        a.overlap_blocks = Some(3);
        a.isl_blocks = Some(4);
        a.decision_mode = Some("aggregate".into());
        a.fallback = Some("timeout".into());
        let mut b = ok(1, "w0", 1.0, 2.0);
        b.overlap_blocks = Some(0);
        b.isl_blocks = Some(4);
        let recs = vec![a, b];
        let s = summarize("p", &recs, None, &[]);
        assert_eq!(
            s.router_block_rate,
            Some(SourcedRate { value: 3.0 / 8.0, source: RateSource::DebugHeaders })
        );
        assert_eq!(
            s.router_request_rate,
            Some(SourcedRate { value: 0.375, source: RateSource::DebugHeaders })
        );
        assert_eq!(s.modes["aggregate"], 1);
        assert_eq!(s.fallbacks["timeout"], 1);

        let counters = PolicyCounters {
            engines: vec![EngineCounters {
                worker: "w0".into(),
                endpoint: None,
                prefix_cache_hits: 30.0,
                prefix_cache_queries: 100.0,
                ..Default::default()
            }],
            router: Some(RouterCounters {
                overlap_blocks: 1.0,
                isl_blocks: 2.0,
                hit_rate_sum: 0.9,
                hit_rate_count: 3.0,
                hit_rate_scale: 1.0,
                attribution: None,
            }),
        };
        let s = summarize("p", &recs, Some(&counters), &[]);
        assert_eq!(s.engine_hit_rate, Some(0.3));
        assert_eq!(
            s.router_block_rate,
            Some(SourcedRate { value: 0.5, source: RateSource::Counters })
        );
        assert_eq!(s.router_request_rate.map(|r| r.source), Some(RateSource::Counters));
    }

    #[test]
    fn empty_policy_does_not_divide_by_zero() {
        let s = summarize("empty", &[], None, &["w0".to_string()]);
        assert_eq!((s.requests, s.span_s, s.requests_per_s), (0, 0.0, 0.0));
        assert_eq!(s.ttft.p50, None);
        assert_eq!(s.tokens_balance.max_over_mean(), None);
    }
}
