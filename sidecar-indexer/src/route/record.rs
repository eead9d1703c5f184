//! Every per-route metric, written here and nowhere else: a route call's steps (and `/v1/done`)
//! say what happened through [`RouteMetrics`]' methods with typed labels; only this module knows
//! the label strings. The metrics themselves are declared in [`crate::metrics`].

use std::time::Duration;

use kvmesh_core::api::{Outcome, RouteDecision};

use super::body_memo::BaseRefusal;
use super::ApiError;
use crate::decide::{Basis, Plan};
use crate::load::Expired;
use crate::metrics::Metrics;
use crate::tokenize::{CacheStats, PromptTokens};

/// The per-route metrics recorder (a view of the registry: free to build per call).
#[derive(Clone, Copy)]
pub struct RouteMetrics<'a>(pub &'a Metrics);

/// The per-route metrics of one base model (their `model` label; see `crate::metrics`).
#[derive(Clone)]
pub struct ModelMetrics<'a> {
    m: &'a Metrics,
    model: std::borrow::Cow<'a, str>,
}

/// `kvmesh_body_memo_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyMemoResult {
    /// The call sent only the bytes after a body base, joined to it.
    BaseHit,
    /// The body base is no longer held: answered 409.
    BaseUnknown,
    /// The body base was kept for another session: answered 409, never joined.
    BaseOtherSession,
    /// A long chat body read from a held prefix.
    Hit,
    /// A long chat body read whole.
    Miss,
}

impl From<BaseRefusal> for BodyMemoResult {
    fn from(refusal: BaseRefusal) -> Self {
        match refusal {
            BaseRefusal::Unknown => Self::BaseUnknown,
            BaseRefusal::OtherSession => Self::BaseOtherSession,
        }
    }
}

/// `kvmesh_route_cancelled_total{stage}`: where a call whose caller went away was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cancelled {
    Queued,
    Tokenizing,
    Booked,
}

/// `kvmesh_tokenize_background_total{result}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Background {
    Done,
    Skipped,
    Failed,
    GaveWay,
}

/// `kvmesh_prefill_legs_total{outcome}` (and, for a fallback, `kvmesh_prefill_fallbacks_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillLeg {
    Ok,
    Overloaded,
    /// Served on the decode worker; the leg's failure reason ([`crate::legs::LegFailure::reason`]).
    Fallback(&'static str),
}

/// `kvmesh_migrations_total{outcome}` ([`crate::metrics::MIGRATION_OUTCOMES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Migration {
    Ok,
    DryRun,
    HandshakeTimeout,
    HandshakeFailed,
    SourceOverloaded,
    SourceGone,
}

impl Migration {
    /// The label, also the outcome a log line names.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::DryRun => "dry_run",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::HandshakeFailed => "handshake_failed",
            Self::SourceOverloaded => "source_overloaded",
            Self::SourceGone => "source_gone",
        }
    }
}

/// `kvmesh_bad_requests_total{endpoint}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Route,
    Done,
    /// A route asked by a gateway through the endpoint picker (`crate::epp`).
    Epp,
}

impl Endpoint {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Route => "route",
            Self::Done => "done",
            Self::Epp => "epp",
        }
    }
}

impl<'a> RouteMetrics<'a> {
    pub fn body_memo(self, result: BodyMemoResult) {
        let label = match result {
            BodyMemoResult::BaseHit => "base_hit",
            BodyMemoResult::BaseUnknown => "base_unknown",
            BodyMemoResult::BaseOtherSession => "base_other_session",
            BodyMemoResult::Hit => "hit",
            BodyMemoResult::Miss => "miss",
        };
        self.0.body_memo.with_label_values(&[label]).inc();
    }

    /// Route calls worked on now.
    pub fn inflight(self, calls: usize) {
        self.0.route_inflight.set(calls as i64);
    }

    pub fn cancelled(self, stage: Cancelled) {
        let label = match stage {
            Cancelled::Queued => "queued",
            Cancelled::Tokenizing => "tokenizing",
            Cancelled::Booked => "booked",
        };
        self.0.route_cancelled.with_label_values(&[label]).inc();
    }

    /// One tokenization that ran (`tokens` when it succeeded), with its cache and memo use.
    pub fn tokenized(self, took: Duration, stats: &CacheStats, tokens: Option<&PromptTokens>) {
        let m = self.0;
        m.tokenize_duration.observe(took.as_secs_f64());
        m.tokenize_cache.with_label_values(&["hit"]).inc_by(stats.hits);
        m.tokenize_cache.with_label_values(&["miss"]).inc_by(stats.misses);
        m.tokenize_memo.with_label_values(&["hit"]).inc_by(stats.memo_hits);
        m.tokenize_memo.with_label_values(&["tail_hit"]).inc_by(stats.memo_tail_hits);
        m.tokenize_memo.with_label_values(&["miss"]).inc_by(stats.memo_misses);
        if let Some(t) = tokens {
            m.tokenize_tokens.with_label_values(&["exact"]).inc_by(t.ids.len() as u64);
            m.tokenize_tokens.with_label_values(&["estimated"]).inc_by(t.estimated_rest as u64);
        }
    }

    /// An inline tokenization had more new text than it may encode: moved to the blocking pool.
    pub fn moved_to_pool(self) {
        self.0.tokenize_moved_to_pool.inc();
    }

    pub fn background(self, result: Background) {
        let label = match result {
            Background::Done => "done",
            Background::Skipped => "skipped",
            Background::Failed => "failed",
            Background::GaveWay => "gave_way",
        };
        self.0.tokenize_background.with_label_values(&[label]).inc();
    }

    /// The index lookup of a decision.
    pub fn matched(self, took: Duration) {
        self.0.match_duration.observe(took.as_secs_f64());
    }

    /// A decision placed: its scoring time, predicted TTFT and speculative credit; `held`
    /// speculative blocks now.
    pub fn placed(self, plan: &Plan, took: Duration, held: usize) {
        let m = self.0;
        m.predicted_ttft.observe(plan.predicted_ttft_ms / 1000.0);
        m.speculative_overlap_blocks.inc_by(u64::from(plan.speculative_extra_blocks));
        m.speculative_blocks.set(held as i64);
        m.score_duration.observe(took.as_secs_f64());
    }

    /// Approximate mode: a decision's blocks not recorded (the applier's queue was full).
    pub fn approx_dropped(self, worker: &str) {
        self.0.kv_ignored.with_label_values(&[worker, "queue_full"]).inc();
    }

    /// A would-migrate decision.
    pub fn migration_opportunity(self, from_kv_home: bool, blocks: u32) {
        let m = self.0;
        m.migration_opportunities
            .with_label_values(&[if from_kv_home { "kv_home" } else { "index" }])
            .inc();
        m.migration_opportunity_blocks.inc_by(u64::from(blocks));
    }

    pub fn migration_handshake(self, took: Duration) {
        self.0.migration_handshake_duration.observe(took.as_secs_f64());
    }

    pub fn prefill_leg_took(self, took: Duration) {
        self.0.prefill_leg_duration.observe(took.as_secs_f64());
    }

    /// A route call answered with a decision.
    pub fn answered(self, took: Duration) {
        self.0.route_duration.observe(took.as_secs_f64());
    }

    /// Counts a route call's `result` (asked at `endpoint`, answered after `took`): its duration,
    /// or its error as a route error (the indexer's, or a model nobody serves) or a bad request;
    /// every error's log line sampled (1st, 2nd, 4th, 8th … of a reason), so a fleet-wide fault
    /// is named in the log without flooding it.
    pub fn call_result(
        self,
        endpoint: Endpoint,
        result: &Result<RouteDecision, ApiError>,
        took: Duration,
    ) {
        let e = match result {
            Ok(_) => return self.answered(took),
            Err(e) => e,
        };
        tracing::debug!(status = e.status.as_u16(), reason = e.reason, message = %e.message, "route refused");
        let status = e.status;
        if e.reason == kvmesh_core::body_base::BASE_UNKNOWN {
            // Not a bad request: the filter's base was evicted; it sends the whole body next
            // (`kvmesh_body_memo_total{result="base_unknown"}` counts it).
        } else if e.reason == kvmesh_core::models::UNKNOWN_MODEL_REASON {
            // The client's mistake, but counted with the route errors (the front door answers
            // vLLM's 404 and never forwards it).
            let seen = self.failed(e);
            if seen.is_power_of_two() {
                tracing::info!(seen, message = %e.message, "route call for a model the fleet does not serve: 404");
            }
        } else if status.is_client_error() && status != axum::http::StatusCode::TOO_MANY_REQUESTS {
            self.bad_request(endpoint, e.reason);
        } else {
            let seen = self.failed(e);
            if seen.is_power_of_two() {
                tracing::warn!(status = status.as_u16(), reason = e.reason, seen, message = %e.message, "route call failed; the request is routed without the indexer's pick");
            }
        }
    }

    /// A route call answered with an error that is the indexer's (not the request's), or naming a
    /// model nobody serves; how many calls failed for its reason so far (to sample the log line).
    pub fn failed(self, e: &ApiError) -> u64 {
        let model = crate::metrics::model_label(e.model.as_deref().unwrap_or(""));
        let c = self.0.route_errors.with_label_values(&[&model, e.reason]);
        c.inc();
        c.get()
    }

    /// The recorder of base model `model`'s per-route metrics.
    pub fn for_model(self, model: &'a str) -> ModelMetrics<'a> {
        ModelMetrics { m: self.0, model: crate::metrics::model_label(model) }
    }

    pub fn bad_request(self, endpoint: Endpoint, reason: &str) {
        self.0.bad_requests.with_label_values(&[endpoint.as_str(), reason]).inc();
    }

    /// Bookings released without `/v1/done` (by the tracker's bounds).
    pub fn load_expired(self, expired: Expired) {
        let m = self.0;
        if expired.timeout > 0 {
            m.load_expired.with_label_values(&["timeout"]).inc_by(expired.timeout);
        }
        if expired.overflow > 0 {
            m.load_expired.with_label_values(&["overflow"]).inc_by(expired.overflow);
        }
    }

    /// One `/v1/done` report and whether it released a booking.
    pub fn done(self, outcome: Outcome, released: bool) {
        self.0
            .done_reports
            .with_label_values(&[outcome.as_str(), if released { "true" } else { "false" }])
            .inc();
    }

    /// A `/v1/done` report without a booking id (releases nothing); how many so far.
    pub fn done_without_booking_id(self) -> u64 {
        self.0.done_without_booking_id.inc();
        self.0.done_without_booking_id.get()
    }

    /// A retry served a session elsewhere and its `kv_home` followed.
    pub fn kv_home_moved(self) {
        self.0.kv_home_moves.inc();
    }
}

impl ModelMetrics<'_> {
    /// A served decision: its mode and basis, and the router-side hit rate.
    pub fn decided(&self, d: &RouteDecision, basis: Basis, local_continuation: bool) {
        let (m, model) = (self.m, &*self.model);
        m.decisions.with_label_values(&[model, d.mode.as_str(), basis.as_str()]).inc();
        if local_continuation {
            m.local_continuations.inc();
        }
        if let Some(permille) =
            kvmesh_core::router_metrics::hit_rate_permille(d.overlap_blocks, d.isl_blocks)
        {
            m.hit_rate.with_label_values(&[model]).observe(permille as f64);
            m.overlap_blocks.with_label_values(&[model]).inc_by(u64::from(d.overlap_blocks));
            m.isl_blocks.with_label_values(&[model]).inc_by(u64::from(d.isl_blocks));
        }
    }

    /// A decision for a request naming `adapter`; its label is the adapter while at most
    /// `max_labels` distinct adapters are exported, past it `other`.
    pub fn adapter_decided(&self, adapter: &str, max_labels: usize) {
        let label = adapter_label(self.m, adapter, max_labels);
        self.m.adapter_decisions.with_label_values(&[&self.model, label]).inc();
    }

    pub fn migration(&self, outcome: Migration) {
        self.m.migrations.with_label_values(&[&self.model, outcome.as_str()]).inc();
    }

    pub fn prefill_leg(&self, outcome: PrefillLeg) {
        let (m, model) = (self.m, &*self.model);
        let label = match outcome {
            PrefillLeg::Ok => "ok",
            PrefillLeg::Overloaded => "overloaded",
            PrefillLeg::Fallback(reason) => {
                m.prefill_fallbacks.with_label_values(&[model, reason]).inc();
                "fallback"
            }
        };
        m.prefill_legs.with_label_values(&[model, label]).inc();
    }
}

/// The `adapter` label of adapters past `routing.max_adapter_labels`.
pub const ADAPTER_OTHER: &str = "other";

/// `adapter`, if it already has a series or fewer than `max_labels` distinct adapters have one;
/// else [`ADAPTER_OTHER`]. Walks the exported series (bounded by `max_labels` × models).
fn adapter_label<'a>(m: &Metrics, adapter: &'a str, max_labels: usize) -> &'a str {
    use prometheus::core::Collector;
    let families = m.adapter_decisions.collect();
    let mut seen = std::collections::BTreeSet::new();
    for s in families.iter().flat_map(|f| f.get_metric()) {
        for l in s.get_label().iter().filter(|l| l.name() == "adapter") {
            if l.value() == adapter {
                return adapter;
            }
            if l.value() != ADAPTER_OTHER {
                seen.insert(l.value().to_owned());
            }
        }
    }
    if seen.len() < max_labels {
        adapter
    } else {
        ADAPTER_OTHER
    }
}
