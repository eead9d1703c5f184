//! One point's summary: the machine sample, the per-point result the report reads, and
//! [`summarize_point`] from its records and counters.

use super::lost_events::LostEvents;
use super::replicas::{load_cov, session_moves, ReplicaSetup, SessionMoves};
use super::validity::invalid_reasons;
use super::window::MeasureWindow;
use crate::ceiling::Ceiling;
use crate::counters::{AttributionCounters, PolicyCounters};
use crate::record::RequestRecord;
use crate::stats::{balance, percentile};
use serde::{Deserialize, Serialize};

/// HTTP statuses that mean "rejected for load" (engine queue full, rate limited).
pub const REJECT_STATUSES: [u16; 2] = [429, 503];

/// Machine and process measurements taken during one point.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MachineSample {
    /// Mean machine CPU use over the point, 0..1 (`/proc/stat`).
    pub cpu_busy_mean: Option<f64>,
    /// Highest sampled interval, 0..1.
    pub cpu_busy_max: Option<f64>,
    /// CPU seconds the simulator processes used during the point (`/proc/<pid>/stat`).
    pub sim_cpu_s: Option<f64>,
}

/// One measured point.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PointResult {
    /// Workload name.
    pub workload: String,
    /// Policy name.
    pub policy: String,
    /// Offered rate (the workload's unit).
    pub rate: f64,
    /// Where the point's files are, relative to the sweep directory.
    pub dir: String,
    /// Records.
    pub requests: usize,
    /// Successful records.
    pub ok: usize,
    /// Failed records other than rejections.
    pub failed: usize,
    /// Records rejected for load (HTTP 429 / 503).
    pub rejected: usize,
    /// TTFT p50 / p90 / p99 over successful requests, ms.
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Inter-token latency p50 / p90, ms: per request (e2e − TTFT) / (output tokens − 1).
    pub itl_p50_ms: Option<f64>,
    pub itl_p90_ms: Option<f64>,
    /// Output tokens per second over first send → last completion.
    pub output_tokens_per_s: f64,
    /// Engine hit rate from the engines' counters (Σ hits / Σ queries, tokens).
    pub engine_hit_rate: Option<f64>,
    /// Engine hit rate from the responses: Σ cached_tokens / Σ prompt_tokens.
    pub usage_hit_rate: Option<f64>,
    /// Engine preemptions during the point.
    pub preemptions: Option<f64>,
    /// The point's intrinsic ceiling (the rate the hit rates are compared with).
    pub ceiling: Option<f64>,
    /// The ceiling's counts.
    pub ceiling_counts: Option<Ceiling>,
    /// The fleet-LRU reference (token prompts only): what one LRU cache of the whole fleet's
    /// capacity would hit of the same prompts (`workload::fleet_lru`).
    #[serde(default)]
    pub fleet_lru: Option<f64>,
    /// The TTFT floor's p90, ms (token prompts on simulators, `point_ttft_floor_p90_ms`): no router
    /// gives the point's TTFT p90 less.
    #[serde(default)]
    pub ttft_floor_p90_ms: Option<f64>,
    /// Max / mean prompt tokens per worker (idle workers count as 0).
    pub load_max_over_mean: Option<f64>,
    /// Client lateness (sent − scheduled) p90, ms.
    pub lateness_p90_ms: Option<f64>,
    /// Machine measurements.
    pub machine: MachineSample,
    /// Simulator CPU seconds per 1,000 requests.
    pub sim_cpu_s_per_1k: Option<f64>,
    /// Why the point is invalid; empty when valid.
    pub invalid: Vec<String>,
    /// Requests the filter routed without the indexer.
    pub fallbacks: usize,
    /// Set when the point could not run (stack did not start …).
    #[serde(default)]
    pub error: Option<String>,
    /// The point's warm-up and measured window (everything above counts the window only).
    #[serde(default)]
    pub window: MeasureWindow,
    /// Requests sent in the warm-up: history for the caches and the ceiling, not counted.
    #[serde(default)]
    pub warmup_requests: usize,
    /// Turns not sent: due at or after the window's end, or after a failed turn of their session.
    #[serde(default)]
    pub cut_turns: u64,
    /// Counted requests per second of the window (turns/s; requests/s for single-turn workloads).
    #[serde(default)]
    pub turns_per_s: Option<f64>,
    /// Several models: each base model's numbers (`models::model_points`); empty otherwise.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub per_model: Vec<super::models::ModelPoint>,
    /// Several models: the point's requests (warm-up included) an engine answered 404 (sent to a
    /// worker of another model; should be 0); `None` for a one-model point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cross_model: Option<usize>,
    /// The indexer's attribution of the hits (kvmesh policies): available, captured, delivered
    /// and the losses by cause, in tokens; `None` for baselines, which have no router view.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attribution: Option<AttributionCounters>,
    /// The gateway replicas the point ran behind (one by default) and the client's spread.
    #[serde(default)]
    pub replicas: ReplicaSetup,
    /// How often a session's follow-up turn was served by another worker than its previous turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub session_moves: Option<SessionMoves>,
    /// Prompt tokens per worker: standard deviation ÷ mean (idle workers count 0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_cov: Option<f64>,
    /// A lost-events point (`--lose-events`): the faulted replica's recovery.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lost_events: Option<LostEvents>,
}

impl PointResult {
    /// Valid: ran, and neither the CPU nor the client's lateness shaped it.
    pub fn valid(&self) -> bool {
        self.error.is_none() && self.invalid.is_empty()
    }

    /// The engines reported more hits than the point's prompts can hold: above the token-weighted
    /// ceiling by more than half a point. Preemption re-admissions counted as hits do that (the
    /// simulator bug issue 12 names); the report flags it beside the point.
    pub fn above_ceiling(&self) -> bool {
        match (self.engine_hit_rate, self.ceiling_counts) {
            (Some(h), Some(c)) if c.tokens_total > 0 => h > c.token_rate() + 0.005,
            _ => false,
        }
    }

    /// Records the window this point was counted over, the warm-up requests and the cut turns,
    /// and derives turns/s (counted requests ÷ the window).
    pub fn with_window(
        self,
        window: MeasureWindow,
        warmup_requests: usize,
        cut_turns: u64,
    ) -> Self {
        let span = window.counted_span_s();
        Self {
            turns_per_s: (span > 0.0).then(|| self.requests as f64 / span),
            window,
            warmup_requests,
            cut_turns,
            ..self
        }
    }

    /// Engine hit rate ÷ ceiling.
    pub fn hit_over_ceiling(&self) -> Option<f64> {
        match (self.engine_hit_rate, self.ceiling) {
            (Some(h), Some(c)) if c > 0.0 => Some(h / c),
            _ => None,
        }
    }

    /// The engines' hit rate ÷ the fleet-LRU reference.
    pub fn hit_over_fleet_lru(&self) -> Option<f64> {
        match (self.engine_hit_rate, self.fleet_lru) {
            (Some(h), Some(c)) if c > 0.0 => Some(h / c),
            _ => None,
        }
    }
}

/// Whether a record was rejected for load.
pub fn rejected(r: &RequestRecord) -> bool {
    r.status.is_some_and(|s| REJECT_STATUSES.contains(&s))
}

/// Summarises one point from its records, counters and machine samples.
#[allow(clippy::too_many_arguments)]
pub fn summarize_point(
    workload: &str,
    policy: &str,
    rate: f64,
    dir: &str,
    records: &[RequestRecord],
    counters: Option<&PolicyCounters>,
    ceiling: Option<(f64, Ceiling)>,
    machine: MachineSample,
    fleet: &[String],
) -> PointResult {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let rej = records.iter().filter(|r| rejected(r)).count();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let itl: Vec<f64> = ok
        .iter()
        .filter_map(|r| match (r.ttft_ms, r.output_tokens) {
            (Some(t), Some(n)) if n > 1 => Some((r.e2e_ms - t).max(0.0) / (n - 1) as f64),
            _ => None,
        })
        .collect();
    let lateness: Vec<f64> =
        records.iter().map(|r| (r.sent_ms - r.scheduled_ms).max(0.0)).collect();
    let start = records.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let end = records.iter().map(|r| r.sent_ms + r.e2e_ms).fold(f64::NEG_INFINITY, f64::max);
    let span_s = if end > start { (end - start) / 1000.0 } else { 0.0 };
    let out_tokens: u64 = ok.iter().filter_map(|r| r.output_tokens).sum();
    let (mut cached, mut prompt) = (0u64, 0u64);
    for r in ok.iter().filter(|r| r.cached_tokens.is_some()) {
        cached += r.cached_tokens.unwrap_or(0);
        prompt += r.prompt_tokens.unwrap_or(0);
    }
    let load = balance(
        ok.iter().filter_map(|r| {
            r.worker.as_deref().map(|w| (w, r.prompt_tokens.or(r.input_tokens).unwrap_or(0) as f64))
        }),
        fleet,
    );
    let lateness_p90 = percentile(&lateness, 90.0);
    PointResult {
        workload: workload.into(),
        policy: policy.into(),
        rate,
        dir: dir.into(),
        requests: records.len(),
        ok: ok.len(),
        failed: records.len() - ok.len() - rej,
        rejected: rej,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        itl_p50_ms: percentile(&itl, 50.0),
        itl_p90_ms: percentile(&itl, 90.0),
        output_tokens_per_s: if span_s > 0.0 { out_tokens as f64 / span_s } else { 0.0 },
        engine_hit_rate: counters.and_then(PolicyCounters::engine_hit_rate),
        usage_hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
        preemptions: counters.map(PolicyCounters::preemptions),
        ceiling: ceiling.map(|c| c.0),
        ceiling_counts: ceiling.map(|c| c.1),
        load_max_over_mean: load.max_over_mean(),
        load_cov: load_cov(records, fleet),
        session_moves: Some(session_moves(records)).filter(|m| m.follow_ups > 0),
        lateness_p90_ms: lateness_p90,
        machine,
        sim_cpu_s_per_1k: machine
            .sim_cpu_s
            .filter(|_| !records.is_empty())
            .map(|s| s * 1000.0 / records.len() as f64),
        invalid: invalid_reasons(machine.cpu_busy_mean, lateness_p90),
        fallbacks: records.iter().filter(|r| r.fallback.is_some()).count(),
        error: None,
        attribution: counters.and_then(|c| c.router.as_ref()?.attribution),
        ..Default::default()
    }
}
