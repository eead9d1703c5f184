//! Every metric the indexer exports, declared once: names as constants (the README's metrics table
//! is tested against [`ALL`]), one [`Metrics`] registry, Prometheus text out.
//!
//! Request-weighted and block-weighted hit rates are different numbers and both are exported under
//! names that say which is which (DESIGN.md "Metrics"): `router_kv_hit_rate` is a histogram of
//! per-request overlap/isl in per-mille, as the filter records it (`kvmesh_core::router_metrics`;
//! its sum/count/1000 is a mean of ratios); the two `router_kv_*_blocks_total`
//! counters give the block-weighted ratio, comparable to the engines' own prefix-cache counters,
//! which are scraped and mirrored beside it. Labels are low-cardinality: worker ids, fixed enums.
//!
//! Over 600 lines: every metric of the binary is declared here and nowhere else (one definition,
//! checked against the README's table by a test); the file is declarations, not logic.
//!
//! Per-route metrics carry `model`, the request's base model (bounded: models come from the
//! config, at most `crate::config::MAX_MODELS`; "" before a model is known — a request refused
//! before its body was read, or naming no model the fleet serves). Per-adapter counts carry
//! `adapter`, bounded by `routing.max_adapter_labels` (past it: `other`).

use prometheus::{
    exponential_buckets, Encoder, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter,
    IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry, TextEncoder,
};

/// The `router_kv_*` metrics are defined once in core (names, unit, buckets), for the filter too.
pub use kvmesh_core::router_metrics::{
    HIT_RATE as ROUTER_KV_HIT_RATE, ISL_BLOCKS_TOTAL as ROUTER_KV_ISL_BLOCKS_TOTAL,
    OVERLAP_BLOCKS_TOTAL as ROUTER_KV_OVERLAP_BLOCKS_TOTAL,
};
/// The `model` label value of base model `base`: the filter's (`kvmesh_core::models::metric_label`,
/// characters outside `[A-Za-z0-9_-]` as `_`), so the two sides' series join; `""` (no model
/// resolved) stays `""`.
pub fn model_label(base: &str) -> std::borrow::Cow<'_, str> {
    if base.is_empty() {
        return std::borrow::Cow::Borrowed("");
    }
    kvmesh_core::models::metric_label_cow(base)
}

pub const DECISIONS_TOTAL: &str = "kvmesh_decisions_total";
pub const ROUTE_ERRORS_TOTAL: &str = "kvmesh_route_errors_total";
pub const BAD_REQUESTS_TOTAL: &str = "kvmesh_bad_requests_total";
pub const ROUTE_DURATION_SECONDS: &str = "kvmesh_route_duration_seconds";
pub const TOKENIZE_DURATION_SECONDS: &str = "kvmesh_tokenize_duration_seconds";
pub const MATCH_DURATION_SECONDS: &str = "kvmesh_match_duration_seconds";
pub const SCORE_DURATION_SECONDS: &str = "kvmesh_score_duration_seconds";
pub const TOKENIZE_CACHE_SEGMENTS_TOTAL: &str = "kvmesh_tokenize_cache_segments_total";
pub const TOKENIZE_MEMO_TOTAL: &str = "kvmesh_tokenize_memo_total";
pub const BODY_MEMO_TOTAL: &str = "kvmesh_body_memo_total";
pub const TOKENIZE_TOKENS_TOTAL: &str = "kvmesh_tokenize_tokens_total";
pub const TOKENIZE_BACKGROUND_TOTAL: &str = "kvmesh_tokenize_background_total";
pub const TOKENIZE_MOVED_TO_POOL_TOTAL: &str = "kvmesh_tokenize_moved_to_pool_total";
pub const DONE_REPORTS_TOTAL: &str = "kvmesh_done_reports_total";
pub const DONE_WITHOUT_BOOKING_ID_TOTAL: &str = "kvmesh_done_without_booking_id_total";
pub const LOAD_EXPIRED_TOTAL: &str = "kvmesh_load_expired_total";
pub const KV_EVENTS_TOTAL: &str = "kvmesh_kv_events_total";
pub const KV_BLOCKS_TOTAL: &str = "kvmesh_kv_blocks_total";
pub const KV_BATCHES_TOTAL: &str = "kvmesh_kv_batches_total";
pub const KV_DECODE_ERRORS_TOTAL: &str = "kvmesh_kv_decode_errors_total";
pub const KV_GAPS_TOTAL: &str = "kvmesh_kv_gaps_total";
pub const KV_REPLAYS_TOTAL: &str = "kvmesh_kv_replays_total";
pub const KV_REPLAY_ROUNDS_TOTAL: &str = "kvmesh_kv_replay_rounds_total";
pub const KV_RESYNCS_TOTAL: &str = "kvmesh_kv_resyncs_total";
pub const KV_BLOCK_SIZE_MISMATCH_TOTAL: &str = "kvmesh_kv_block_size_mismatch_total";
pub const ADAPTER_DECISIONS_TOTAL: &str = "kvmesh_adapter_decisions_total";
pub const SERVED_MODELS_POLLS_TOTAL: &str = "kvmesh_served_models_polls_total";
pub const SERVED_ADAPTERS_REFUSED_TOTAL: &str = "kvmesh_served_adapters_refused_total";
pub const KV_ORPHAN_STORES_TOTAL: &str = "kvmesh_kv_orphan_stores_total";
pub const KV_ORPHAN_RECOVERED_TOTAL: &str = "kvmesh_kv_orphan_recovered_total";
pub const ROUTE_INFLIGHT: &str = "kvmesh_route_inflight";
pub const ROUTE_CANCELLED_TOTAL: &str = "kvmesh_route_cancelled_total";
pub const KV_UNKNOWN_REMOVES_TOTAL: &str = "kvmesh_kv_unknown_removes_total";
pub const KV_UNKNOWN_GROUP_KIND_TOTAL: &str = "kvmesh_kv_unknown_group_kind_events_total";
pub const KV_UNUSABLE_EXTRA_KEYS_TOTAL: &str = "kvmesh_kv_unusable_extra_keys_total";
pub const ROUTE_MEDIA_CUT_TOTAL: &str = "kvmesh_route_media_cut_total";
pub const KV_IGNORED_EVENTS_TOTAL: &str = "kvmesh_kv_ignored_events_total";
pub const KV_EVENT_LAG_SECONDS: &str = "kvmesh_kv_event_lag_seconds";
pub const KV_EVENT_LIMITS_TOTAL: &str = "kvmesh_kv_event_limits_total";
pub const INDEX_BLOCKS: &str = "kvmesh_index_blocks";
pub const INDEX_ENTRIES: &str = "kvmesh_index_entries";
pub const INDEX_EVICTIONS_TOTAL: &str = "kvmesh_index_evictions_total";
pub const INDEX_BYTES: &str = "kvmesh_index_bytes";
pub const INDEX_WRITE_HOLD_SECONDS: &str = "kvmesh_index_write_hold_seconds";
pub const TOKENIZE_CACHE_BYTES: &str = "kvmesh_tokenize_cache_bytes";
pub const TOKENIZE_MEMO_BYTES: &str = "kvmesh_tokenize_memo_bytes";
pub const BODY_MEMO_BYTES: &str = "kvmesh_body_memo_bytes";
pub const RECOVERY_BLOCKS: &str = "kvmesh_recovery_blocks";
pub const WORKER_BLOCKS: &str = "kvmesh_worker_blocks";
pub const WORKER_ACTIVE_REQUESTS: &str = "kvmesh_worker_active_requests";
pub const WORKER_ACTIVE_BLOCKS: &str = "kvmesh_worker_active_blocks";
pub const WORKER_PREFILL_TOKENS: &str = "kvmesh_worker_prefill_tokens";
pub const WORKER_RUNNING_REQUESTS: &str = "kvmesh_worker_running_requests";
pub const WORKER_WAITING_REQUESTS: &str = "kvmesh_worker_waiting_requests";
pub const WORKER_HEALTHY: &str = "kvmesh_worker_healthy";
pub const ENGINE_SCRAPES_TOTAL: &str = "kvmesh_engine_scrapes_total";
pub const ENGINE_SCRAPE_TOO_LARGE_TOTAL: &str = "kvmesh_engine_scrape_too_large_total";
pub const ENGINE_PREFIX_CACHE_HITS_TOTAL: &str = "kvmesh_engine_prefix_cache_hits_total";
pub const ENGINE_PREFIX_CACHE_QUERIES_TOTAL: &str = "kvmesh_engine_prefix_cache_queries_total";
pub const KV_BLOCK_HIT_RATE: &str = "kvmesh_kv_block_hit_rate";
pub const FLEET_GENERATION: &str = "kvmesh_fleet_generation";
pub const CONFIG_RELOADS_TOTAL: &str = "kvmesh_config_reloads_total";
pub const APPROX_EXPIRED_BLOCKS_TOTAL: &str = "kvmesh_approx_expired_blocks_total";
pub const PREFILL_LEGS_TOTAL: &str = "kvmesh_prefill_legs_total";
pub const PREFILL_FALLBACKS_TOTAL: &str = "kvmesh_prefill_fallbacks_total";
pub const PREFILL_LEG_DURATION_SECONDS: &str = "kvmesh_prefill_leg_duration_seconds";
pub const MIGRATIONS_TOTAL: &str = "kvmesh_migrations_total";
pub const MIGRATION_OPPORTUNITIES_TOTAL: &str = "kvmesh_migration_opportunities_total";
pub const MIGRATION_OPPORTUNITY_BLOCKS_TOTAL: &str = "kvmesh_migration_opportunity_blocks_total";
pub const MIGRATION_HANDSHAKE_DURATION_SECONDS: &str =
    "kvmesh_migration_handshake_duration_seconds";
pub const LOCAL_CONTINUATIONS_TOTAL: &str = "kvmesh_local_continuations_total";
pub const KV_HOME_MOVES_TOTAL: &str = "kvmesh_kv_home_moves_total";
pub const SESSIONS_TRACKED: &str = "kvmesh_sessions_tracked";
// Placement by predicted time (decide/, predict.rs, speculative.rs).
pub const PREDICTED_TTFT_SECONDS: &str = "kvmesh_predicted_ttft_seconds";
pub const SPECULATIVE_OVERLAP_BLOCKS_TOTAL: &str = "kvmesh_speculative_overlap_blocks_total";
pub const SPECULATIVE_BLOCKS: &str = "kvmesh_speculative_blocks";
pub const WORKER_PREFILL_TOKENS_PER_SECOND: &str = "kvmesh_worker_prefill_tokens_per_second";
pub const WORKER_QUEUED_PREFILL_TOKENS: &str = "kvmesh_worker_queued_prefill_tokens";
pub const ADAPTER_LOADS_PREDICTED_TOTAL: &str = "kvmesh_adapter_loads_predicted_total";
pub const ADAPTER_SLOT_WAITS_PREDICTED_TOTAL: &str = "kvmesh_adapter_slot_waits_predicted_total";
pub const ANSWER_CREDITS_TOTAL: &str = "kvmesh_speculative_answer_credits_total";
// Attribution of the prefix-cache hit at /v1/done (route/attribution.rs), in tokens.
pub const ATTRIBUTION_REQUESTS_TOTAL: &str = "kvmesh_attribution_requests_total";
pub const ATTRIBUTION_PROMPT_TOKENS_TOTAL: &str = "kvmesh_attribution_prompt_tokens_total";
pub const ATTRIBUTION_AVAILABLE_TOKENS_TOTAL: &str = "kvmesh_attribution_available_tokens_total";
pub const ATTRIBUTION_CAPTURED_TOKENS_TOTAL: &str = "kvmesh_attribution_captured_tokens_total";
pub const ATTRIBUTION_DELIVERED_TOKENS_TOTAL: &str = "kvmesh_attribution_delivered_tokens_total";
pub const ATTRIBUTION_LOST_TOKENS_TOTAL: &str = "kvmesh_attribution_lost_tokens_total";
pub const ATTRIBUTION_UNPREDICTED_TOTAL: &str = "kvmesh_attribution_unpredicted_tokens_total";

// Exported by the prometheus crate's process collector (Linux), not declared by us: named here for
// the rules that watch them (envoy/prometheus/kvmesh-rules.yaml) and the tests. Not in [`ALL`].
pub const PROCESS_RESIDENT_MEMORY_BYTES: &str = "process_resident_memory_bytes";
pub const PROCESS_START_TIME_SECONDS: &str = "process_start_time_seconds";
pub const PROCESS_OPEN_FDS: &str = "process_open_fds";
pub const PROCESS_MAX_FDS: &str = "process_max_fds";

// Kubernetes discovery (service/discovery.rs): see [`DiscoveryMetrics`].
pub const DISCOVERY_UPDATES_TOTAL: &str = "kvmesh_discovery_updates_total";
pub const DISCOVERY_CHANGES_TOTAL: &str = "kvmesh_discovery_changes_total";
pub const DISCOVERY_WORKERS: &str = "kvmesh_discovery_workers";
pub const DISCOVERY_SKIPPED_ENDPOINTS: &str = "kvmesh_discovery_skipped_endpoints";
pub const DISCOVERY_ERRORS_TOTAL: &str = "kvmesh_discovery_errors_total";
pub const DISCOVERY_SYNCED: &str = "kvmesh_discovery_synced";

// The GIE endpoint picker (epp/).
pub const EPP_REQUESTS_TOTAL: &str = "kvmesh_epp_requests_total";

/// Every metric name, for the README drift test.
pub const ALL: &[&str] = &[
    ROUTER_KV_HIT_RATE,
    ROUTER_KV_OVERLAP_BLOCKS_TOTAL,
    ROUTER_KV_ISL_BLOCKS_TOTAL,
    DECISIONS_TOTAL,
    EPP_REQUESTS_TOTAL,
    ROUTE_ERRORS_TOTAL,
    BAD_REQUESTS_TOTAL,
    ROUTE_DURATION_SECONDS,
    TOKENIZE_DURATION_SECONDS,
    MATCH_DURATION_SECONDS,
    SCORE_DURATION_SECONDS,
    TOKENIZE_CACHE_SEGMENTS_TOTAL,
    TOKENIZE_MEMO_TOTAL,
    BODY_MEMO_TOTAL,
    TOKENIZE_TOKENS_TOTAL,
    TOKENIZE_BACKGROUND_TOTAL,
    TOKENIZE_MOVED_TO_POOL_TOTAL,
    DONE_REPORTS_TOTAL,
    DONE_WITHOUT_BOOKING_ID_TOTAL,
    LOAD_EXPIRED_TOTAL,
    KV_EVENTS_TOTAL,
    KV_BLOCKS_TOTAL,
    KV_BATCHES_TOTAL,
    KV_DECODE_ERRORS_TOTAL,
    KV_GAPS_TOTAL,
    KV_REPLAYS_TOTAL,
    KV_RESYNCS_TOTAL,
    KV_BLOCK_SIZE_MISMATCH_TOTAL,
    ADAPTER_DECISIONS_TOTAL,
    SERVED_MODELS_POLLS_TOTAL,
    SERVED_ADAPTERS_REFUSED_TOTAL,
    KV_ORPHAN_STORES_TOTAL,
    KV_ORPHAN_RECOVERED_TOTAL,
    ROUTE_INFLIGHT,
    ROUTE_CANCELLED_TOTAL,
    KV_UNKNOWN_REMOVES_TOTAL,
    KV_UNKNOWN_GROUP_KIND_TOTAL,
    KV_UNUSABLE_EXTRA_KEYS_TOTAL,
    ROUTE_MEDIA_CUT_TOTAL,
    KV_IGNORED_EVENTS_TOTAL,
    KV_EVENT_LAG_SECONDS,
    KV_EVENT_LIMITS_TOTAL,
    INDEX_BLOCKS,
    INDEX_ENTRIES,
    INDEX_EVICTIONS_TOTAL,
    INDEX_BYTES,
    INDEX_WRITE_HOLD_SECONDS,
    TOKENIZE_CACHE_BYTES,
    TOKENIZE_MEMO_BYTES,
    BODY_MEMO_BYTES,
    WORKER_BLOCKS,
    WORKER_ACTIVE_REQUESTS,
    WORKER_ACTIVE_BLOCKS,
    WORKER_PREFILL_TOKENS,
    WORKER_RUNNING_REQUESTS,
    WORKER_WAITING_REQUESTS,
    WORKER_HEALTHY,
    ENGINE_SCRAPES_TOTAL,
    ENGINE_SCRAPE_TOO_LARGE_TOTAL,
    ENGINE_PREFIX_CACHE_HITS_TOTAL,
    ENGINE_PREFIX_CACHE_QUERIES_TOTAL,
    KV_BLOCK_HIT_RATE,
    FLEET_GENERATION,
    CONFIG_RELOADS_TOTAL,
    APPROX_EXPIRED_BLOCKS_TOTAL,
    PREFILL_LEGS_TOTAL,
    PREFILL_FALLBACKS_TOTAL,
    PREFILL_LEG_DURATION_SECONDS,
    MIGRATIONS_TOTAL,
    MIGRATION_OPPORTUNITIES_TOTAL,
    MIGRATION_OPPORTUNITY_BLOCKS_TOTAL,
    MIGRATION_HANDSHAKE_DURATION_SECONDS,
    LOCAL_CONTINUATIONS_TOTAL,
    SESSIONS_TRACKED,
    PREDICTED_TTFT_SECONDS,
    SPECULATIVE_OVERLAP_BLOCKS_TOTAL,
    SPECULATIVE_BLOCKS,
    WORKER_PREFILL_TOKENS_PER_SECOND,
    WORKER_QUEUED_PREFILL_TOKENS,
    ADAPTER_LOADS_PREDICTED_TOTAL,
    ADAPTER_SLOT_WAITS_PREDICTED_TOTAL,
    ANSWER_CREDITS_TOTAL,
    ATTRIBUTION_REQUESTS_TOTAL,
    ATTRIBUTION_PROMPT_TOKENS_TOTAL,
    ATTRIBUTION_AVAILABLE_TOKENS_TOTAL,
    ATTRIBUTION_CAPTURED_TOKENS_TOTAL,
    ATTRIBUTION_DELIVERED_TOKENS_TOTAL,
    ATTRIBUTION_LOST_TOKENS_TOTAL,
    ATTRIBUTION_UNPREDICTED_TOTAL,
    DISCOVERY_UPDATES_TOTAL,
    DISCOVERY_CHANGES_TOTAL,
    DISCOVERY_WORKERS,
    DISCOVERY_SKIPPED_ENDPOINTS,
    DISCOVERY_ERRORS_TOTAL,
    DISCOVERY_SYNCED,
];

/// `kvmesh_kv_event_limits_total` reasons: a live frame above `event_max_frame_bytes` (the worker is
/// resynced), a replayed one (the replay fails), a replay above `replay_max_bytes` (fails), and a
/// listener that had to wait for `event_queue_bytes` (backpressure, nothing lost).
pub const KV_EVENT_LIMIT_REASONS: [&str; 4] =
    ["frame_too_large", "replay_frame_too_large", "replay_too_large", "queue_bytes_full"];
/// `kvmesh_kv_resyncs_total` reasons.
pub const KV_RESYNC_REASONS: [&str; 5] =
    ["gap_unrecoverable", "engine_restart", "too_many_blocks", "events_rewired", "frame_too_large"];

/// `kvmesh_prefill_legs_total` outcomes.
pub const PREFILL_LEG_OUTCOMES: [&str; 3] = ["ok", "fallback", "overloaded"];
/// `kvmesh_migrations_total` outcomes (`dry_run` counts would-migrate decisions in dry mode).
pub const MIGRATION_OUTCOMES: [&str; 6] =
    ["ok", "dry_run", "handshake_timeout", "handshake_failed", "source_overloaded", "source_gone"];

/// The indexer's metrics.
pub struct Metrics {
    registry: Registry,
    /// labels: model.
    pub hit_rate: HistogramVec,
    /// labels: model.
    pub overlap_blocks: IntCounterVec,
    /// labels: model.
    pub isl_blocks: IntCounterVec,
    /// labels: model, mode, basis (why the worker was chosen: override, session_pin, pin_overloaded, best_overlap, lowest_cost).
    pub decisions: IntCounterVec,
    /// labels: model, adapter (bounded by `routing.max_adapter_labels`, then `other`).
    pub adapter_decisions: IntCounterVec,
    /// labels: model, reason (no_decode_worker, tokenizer, unknown_model …): route requests answered with an error.
    pub route_errors: IntCounterVec,
    /// labels: result (ok, error, base_mismatch, model_learned): polls of a worker's `GET /v1/models`.
    pub served_models_polls: IntCounterVec,
    /// labels: reason (collision, too_many): adapters an engine serves left out of the catalog.
    pub served_adapters_refused: IntCounterVec,
    /// labels: endpoint (route, done), reason.
    pub bad_requests: IntCounterVec,
    pub route_duration: Histogram,
    pub tokenize_duration: Histogram,
    pub match_duration: Histogram,
    pub score_duration: Histogram,
    /// labels: result (hit, miss).
    pub tokenize_cache: IntCounterVec,
    /// labels: result (hit, miss): prompts resumed from the prefix memo, or with none to resume.
    pub tokenize_memo: IntCounterVec,
    /// labels: result (hit, miss: long chat bodies read from a held prefix, or whole; base_hit,
    /// base_unknown, base_other_session: route calls that sent only the bytes after a body base,
    /// joined to it or answered 409 — not held, or held for another session).
    pub body_memo: IntCounterVec,
    /// labels: kind (exact: tokenized on the request path, estimated: the rest of a prompt).
    pub tokenize_tokens: IntCounterVec,
    /// labels: result (done, skipped, failed): partly tokenized prompts finished off the request path.
    pub tokenize_background: IntCounterVec,
    /// Route tokenizations tried on the calling task that had more new text than it may encode.
    pub tokenize_moved_to_pool: IntCounter,
    /// labels: outcome (success, error, aborted), matched (true, false).
    pub done_reports: IntCounterVec,
    /// `/v1/done` reports without a booking id: nothing released (never by the client's request id).
    pub done_without_booking_id: IntCounter,
    /// labels: reason (timeout, overflow).
    pub load_expired: IntCounterVec,
    /// labels: worker, type (stored, removed, cleared, unknown).
    pub kv_events: IntCounterVec,
    /// labels: worker, op (stored, removed).
    pub kv_blocks: IntCounterVec,
    pub kv_batches: IntCounterVec,
    pub kv_decode_errors: IntCounterVec,
    pub kv_gaps: IntCounterVec,
    /// labels: worker, outcome (complete, truncated, failed).
    pub kv_replays: IntCounterVec,
    /// labels: worker, reason (holes, no_end_marker): a replay asked again from its first missing number.
    pub kv_replay_rounds: IntCounterVec,
    /// labels: worker, reason ([`KV_RESYNC_REASONS`]).
    pub kv_resyncs: IntCounterVec,
    pub kv_block_size_mismatch: IntCounterVec,
    pub kv_orphan_stores: IntCounterVec,
    /// labels: worker: orphan stores indexed after all, their parent learned from a routed prompt.
    pub kv_orphan_recovered: IntCounterVec,
    /// `/v1/route` calls being worked on (tokenization of abandoned calls included), ≤ `max_concurrent_routes`.
    pub route_inflight: IntGauge,
    /// labels: stage (queued, tokenizing, booked): route calls whose caller went away.
    pub route_cancelled: IntCounterVec,
    pub kv_unknown_removes: IntCounterVec,
    /// labels: worker: stores of a KV cache group kind the indexer does not model (`crate::index`).
    pub kv_unknown_group_kind: IntCounterVec,
    pub kv_unusable_extra_keys: IntCounterVec,
    pub route_media_cut: IntCounterVec,
    /// labels: worker, reason (tier, queue_full).
    pub kv_ignored: IntCounterVec,
    pub kv_event_lag: GaugeVec,
    /// labels: worker, reason ([`KV_EVENT_LIMIT_REASONS`]).
    pub kv_event_limits: IntCounterVec,
    pub index_blocks: IntGauge,
    pub index_entries: IntGauge,
    pub index_evictions: IntCounter,
    pub index_write_hold: Histogram,
    pub index_bytes: IntGauge,
    /// Bytes held by the tokenization segment cache (≤ routing.tokenize_cache_bytes).
    pub tokenize_cache_bytes: IntGauge,
    /// Bytes charged to the tokenization prefix memo (≤ routing.tokenize_memo_bytes).
    pub tokenize_memo_bytes: IntGauge,
    /// Bytes charged to the body memo (≤ routing.body_memo_bytes).
    pub body_memo_bytes: IntGauge,
    /// Blocks of routed prompts remembered for orphan recovery (≤ routing.recovery_max_blocks).
    pub recovery_blocks: IntGauge,
    pub worker_blocks: IntGaugeVec,
    pub worker_active_requests: IntGaugeVec,
    pub worker_active_blocks: IntGaugeVec,
    pub worker_prefill_tokens: IntGaugeVec,
    pub worker_running: IntGaugeVec,
    pub worker_waiting: IntGaugeVec,
    pub worker_healthy: IntGaugeVec,
    /// labels: worker, result (ok, error).
    pub engine_scrapes: IntCounterVec,
    /// labels: worker: scrapes refused for a body above `routing.scrape_max_body_bytes`.
    pub engine_scrape_too_large: IntCounterVec,
    pub engine_hits: IntCounterVec,
    pub engine_queries: IntCounterVec,
    /// labels: source (router, engine): block-weighted hit rate since the indexer started.
    pub kv_block_hit_rate: GaugeVec,
    pub fleet_generation: IntGauge,
    /// labels: result (ok, error, unchanged).
    pub config_reloads: IntCounterVec,
    pub approx_expired: IntCounter,
    /// labels: model, outcome (ok, fallback, overloaded).
    pub prefill_legs: IntCounterVec,
    /// labels: model, reason (refused, timeout, reset, http_5xx, http_4xx, no_kv_transfer_params, bad_response, bad_request_body, worker_gone).
    pub prefill_fallbacks: IntCounterVec,
    pub prefill_leg_duration: Histogram,
    /// labels: model, outcome (see [`MIGRATION_OUTCOMES`]).
    pub migrations: IntCounterVec,
    /// labels: source (index, kv_home).
    pub migration_opportunities: IntCounterVec,
    pub migration_opportunity_blocks: IntCounter,
    pub migration_handshake_duration: Histogram,
    pub local_continuations: IntCounter,
    /// Sessions whose `kv_home` moved to the host that served after a retry to another worker.
    pub kv_home_moves: IntCounter,
    /// labels: set (continuations, kv_home).
    pub sessions_tracked: IntGaugeVec,
    /// Predicted TTFT of the chosen worker, per decision.
    pub predicted_ttft: Histogram,
    /// Blocks speculative holdings added beyond the index on chosen workers.
    pub speculative_overlap_blocks: IntCounter,
    pub speculative_blocks: IntGauge,
    /// labels: model. Answers whose blocks were credited to the worker they finished on.
    pub answer_credits: IntCounterVec,
    /// labels: model, result (`crate::route::attribution::Verdict`).
    pub attribution_requests: IntCounterVec,
    /// labels: model. The attribution's tokens (`crate::route::attribution`).
    pub attribution_prompt_tokens: IntCounterVec,
    pub attribution_available_tokens: IntCounterVec,
    pub attribution_captured_tokens: IntCounterVec,
    pub attribution_delivered_tokens: IntCounterVec,
    pub attribution_unpredicted_tokens: IntCounterVec,
    /// labels: model, cause (workload, routing, not_delivered).
    pub attribution_lost_tokens: IntCounterVec,
    /// labels: worker. Prefill throughput the model uses (measured, else the default).
    pub worker_prefill_tps: GaugeVec,
    /// labels: worker. Prefill tokens predicted ahead of a new request.
    pub worker_queued_prefill: GaugeVec,
    /// labels: model. Routes placed on a worker predicted to load the request's LoRA adapter.
    pub adapter_loads_predicted: IntCounterVec,
    /// labels: model. Routes placed on a worker predicted to wait for a free LoRA slot.
    pub adapter_slot_waits_predicted: IntCounterVec,
    /// Kubernetes discovery.
    pub discovery: DiscoveryMetrics,
    /// labels: result. Requests the endpoint picker answered, by how (`crate::epp`).
    pub epp_requests: IntCounterVec,
}

fn counter_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn gauge_vec(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntGaugeVec> {
    let g = IntGaugeVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(g.clone()))?;
    Ok(g)
}

fn duration(r: &Registry, name: &str, help: &str) -> prometheus::Result<Histogram> {
    // 5 µs … ~1.3 s.
    let h = Histogram::with_opts(
        HistogramOpts::new(name, help).buckets(exponential_buckets(5e-6, 2.0, 19)?),
    )?;
    r.register(Box::new(h.clone()))?;
    Ok(h)
}

fn leg_duration(r: &Registry, name: &str, help: &str) -> prometheus::Result<Histogram> {
    // 1 ms … ~33 s: legs include a whole remote prefill.
    let h = Histogram::with_opts(
        HistogramOpts::new(name, help).buckets(exponential_buckets(1e-3, 2.0, 16)?),
    )?;
    r.register(Box::new(h.clone()))?;
    Ok(h)
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> prometheus::Result<Self> {
        let r = Registry::new();
        // process_resident_memory_bytes, process_virtual_memory_bytes, process_open_fds,
        // process_max_fds, process_cpu_seconds_total, process_start_time_seconds, process_threads.
        #[cfg(target_os = "linux")]
        r.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
        let hit_rate = HistogramVec::new(
            HistogramOpts::new(ROUTER_KV_HIT_RATE, "Predicted KV hit rate per routed request in per-mille (overlap_blocks * 1000 / isl_blocks), by base model; sum/count/1000 is request-weighted")
                .buckets(kvmesh_core::router_metrics::HIT_RATE_BUCKETS.to_vec()),
            &["model"],
        )?;
        r.register(Box::new(hit_rate.clone()))?;
        let overlap_blocks = counter_vec(
            &r,
            ROUTER_KV_OVERLAP_BLOCKS_TOTAL,
            "Predicted cached blocks of routed requests, by base model; divide by router_kv_isl_blocks_total for the block-weighted hit rate",
            &["model"],
        )?;
        let isl_blocks = counter_vec(&r, ROUTER_KV_ISL_BLOCKS_TOTAL, "Full prompt blocks (floor(tokens / block_size), the route answer's isl_blocks) of routed requests, by base model", &["model"])?;
        let index_evictions = IntCounter::new(
            INDEX_EVICTIONS_TOTAL,
            "Blocks evicted from the index by its memory bound",
        )?;
        r.register(Box::new(index_evictions.clone()))?;
        let approx_expired = IntCounter::new(
            APPROX_EXPIRED_BLOCKS_TOTAL,
            "Approximate mode: (block, worker) entries forgotten by TTL or size bound",
        )?;
        r.register(Box::new(approx_expired.clone()))?;
        let tokenize_moved_to_pool = IntCounter::new(
            TOKENIZE_MOVED_TO_POOL_TOTAL,
            "Route tokenizations tried on the calling task (a continued conversation) that found more new text past the prefix memo's resume point than it may encode there, and moved to the blocking pool",
        )?;
        r.register(Box::new(tokenize_moved_to_pool.clone()))?;
        let int_gauge = |name: &str, help: &str| -> prometheus::Result<IntGauge> {
            let g = IntGauge::new(name, help)?;
            r.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let kv_event_lag = GaugeVec::new(
            Opts::new(
                KV_EVENT_LAG_SECONDS,
                "Now minus the engine timestamp of the worker's last applied batch",
            ),
            &["worker"],
        )?;
        r.register(Box::new(kv_event_lag.clone()))?;
        let kv_block_hit_rate = GaugeVec::new(
            Opts::new(KV_BLOCK_HIT_RATE, "Block-weighted KV hit rate since indexer start: router = predicted at routing time, engine = scraped vllm:prefix_cache_hits/queries"),
            &["source"],
        )?;
        r.register(Box::new(kv_block_hit_rate.clone()))?;
        let m = Self {
            hit_rate,
            overlap_blocks,
            isl_blocks,
            decisions: counter_vec(&r, DECISIONS_TOTAL, "Routing decisions by base model, mode and basis", &["model", "mode", "basis"])?,
            adapter_decisions: counter_vec(&r, ADAPTER_DECISIONS_TOTAL, "Routing decisions for requests naming a LoRA adapter, by base model and adapter (past routing.max_adapter_labels adapters: other)", &["model", "adapter"])?,
            route_errors: counter_vec(&r, ROUTE_ERRORS_TOTAL, "Route requests the indexer could not answer with a decision, by base model (\"\" when none was resolved) and reason", &["model", "reason"])?,
            served_models_polls: counter_vec(&r, SERVED_MODELS_POLLS_TOTAL, "Polls of a worker's GET /v1/models by result (ok, error, base_mismatch: the engine does not list the worker's configured model; model_learned: a discovered worker without a model label moved to the one fleet model its engine serves)", &["result"])?,
            served_adapters_refused: counter_vec(&r, SERVED_ADAPTERS_REFUSED_TOTAL, "Adapters an engine serves that were left out of the catalog (collision: the name is another model's, alias's or adapter's; too_many: past the per-model bound), each counted once", &["reason"])?,
            bad_requests: counter_vec(&r, BAD_REQUESTS_TOTAL, "Malformed API requests answered with 4xx", &["endpoint", "reason"])?,
            route_duration: duration(&r, ROUTE_DURATION_SECONDS, "Time to answer /v1/route (parse, tokenize, match, score, and a prefill leg or migration handshake when the mode needs one)")?,
            tokenize_duration: duration(&r, TOKENIZE_DURATION_SECONDS, "Time to render and tokenize one prompt")?,
            match_duration: duration(&r, MATCH_DURATION_SECONDS, "Time to hash a prompt's blocks and find per-worker overlaps")?,
            score_duration: duration(&r, SCORE_DURATION_SECONDS, "Time to score workers and decide")?,
            tokenize_cache: counter_vec(&r, TOKENIZE_CACHE_SEGMENTS_TOTAL, "Prompt segments served from / added to the tokenization cache", &["result"])?,
            tokenize_memo: counter_vec(&r, TOKENIZE_MEMO_TOTAL, "Prompts whose tokenization resumed from a recently tokenized prefix, found after splitting the whole prompt (hit) or only its tail (tail_hit), or found none (miss)", &["result"])?,
            body_memo: counter_vec(&r, BODY_MEMO_TOTAL, "Long chat bodies read from where their conversation's last body ended (hit) or read whole (miss); route calls that sent only the bytes after a held body base (base_hit) or named one no longer held (base_unknown) or held for another session (base_other_session), both answered 409", &["result"])?,
            tokenize_tokens: counter_vec(&r, TOKENIZE_TOKENS_TOTAL, "Prompt tokens of routed requests: tokenized on the request path (exact) or estimated past the blocks any worker may hold", &["kind"])?,
            tokenize_background: counter_vec(&r, TOKENIZE_BACKGROUND_TOTAL, "Partly tokenized prompts finished off the request path for speculative holdings, by result", &["result"])?,
            done_reports: counter_vec(&r, DONE_REPORTS_TOTAL, "/v1/done reports by outcome and whether a booking matched", &["outcome", "matched"])?,
            done_without_booking_id: {
                let c = IntCounter::new(DONE_WITHOUT_BOOKING_ID_TOTAL, "/v1/done reports without a booking id: nothing released (bookings are released only by the id the indexer issued)")?;
                r.register(Box::new(c.clone()))?;
                c
            },
            load_expired: counter_vec(&r, LOAD_EXPIRED_TOTAL, "Booked request loads released without /v1/done", &["reason"])?,
            kv_events: counter_vec(&r, KV_EVENTS_TOTAL, "KV events received by worker and type", &["worker", "type"])?,
            kv_blocks: counter_vec(&r, KV_BLOCKS_TOTAL, "Blocks stored / removed in the index by worker", &["worker", "op"])?,
            kv_batches: counter_vec(&r, KV_BATCHES_TOTAL, "KV event batches applied by worker", &["worker"])?,
            kv_decode_errors: counter_vec(&r, KV_DECODE_ERRORS_TOTAL, "KV event payloads that could not be decoded", &["worker"])?,
            kv_gaps: counter_vec(&r, KV_GAPS_TOTAL, "Sequence gaps detected in a worker's event stream", &["worker"])?,
            kv_replays: counter_vec(&r, KV_REPLAYS_TOTAL, "Replays from a worker's ROUTER socket by outcome", &["worker", "outcome"])?,
            kv_replay_rounds: counter_vec(&r, KV_REPLAY_ROUNDS_TOTAL, "Replays asked again from their first missing batch (replies dropped by the engine's ROUTER), by reason", &["worker", "reason"])?,
            kv_resyncs: counter_vec(&r, KV_RESYNCS_TOTAL, "Times a worker's index state was cleared and rebuilt, by reason", &["worker", "reason"])?,
            kv_block_size_mismatch: counter_vec(&r, KV_BLOCK_SIZE_MISMATCH_TOTAL, "BlockStored events refused for a block size other than the block_size of the worker's model", &["worker", "model"])?,
            kv_orphan_stores: counter_vec(&r, KV_ORPHAN_STORES_TOTAL, "BlockStored events refused because their parent block is unknown", &["worker"])?,
            kv_orphan_recovered: counter_vec(&r, KV_ORPHAN_RECOVERED_TOTAL, "BlockStored events with an unknown parent indexed after all: the parent chain learned from a prompt routed to the worker", &["worker"])?,
            route_inflight: int_gauge(ROUTE_INFLIGHT, "/v1/route calls being worked on, abandoned tokenizations included (bounded by routing.max_concurrent_routes)")?,
            route_cancelled: counter_vec(&r, ROUTE_CANCELLED_TOTAL, "/v1/route calls whose caller went away (client gone, filter timeout), by the stage they were in", &["stage"])?,
            kv_unknown_removes: counter_vec(&r, KV_UNKNOWN_REMOVES_TOTAL, "Removed block hashes the worker never stored", &["worker"])?,
            kv_unknown_group_kind: counter_vec(&r, KV_UNKNOWN_GROUP_KIND_TOTAL, "BlockStored events of a KV cache group whose kv_cache_spec_kind the indexer does not model (or none): served as the group's leading run", &["worker"])?,
            kv_unusable_extra_keys: counter_vec(&r, KV_UNUSABLE_EXTRA_KEYS_TOTAL, "BlockStored events with extra_keys a request cannot reproduce (prompt embeddings, unknown shapes, over the size cap): their blocks are indexed but never match", &["worker"])?,
            route_media_cut: counter_vec(&r, ROUTE_MEDIA_CUT_TOTAL, "Routed requests whose predicted overlap was cut at a media item whose engine keys the indexer cannot know, by base model", &["model"])?,
            kv_ignored: counter_vec(&r, KV_IGNORED_EVENTS_TOTAL, "Events skipped: other tier or cache group, malformed stores", &["worker", "reason"])?,
            kv_event_lag,
            kv_event_limits: counter_vec(&r, KV_EVENT_LIMITS_TOTAL, "KV event byte limits hit, by reason (frames, replays, queue bytes)", &["worker", "reason"])?,
            index_blocks: int_gauge(INDEX_BLOCKS, "Distinct blocks in the index")?,
            index_entries: int_gauge(INDEX_ENTRIES, "(block, worker) entries in the index; bounded by routing.index_max_entries")?,
            index_evictions,
            index_write_hold: duration(&r, INDEX_WRITE_HOLD_SECONDS, "Time the event applier kept route queries out of the index at a stretch (from taking the write lock to letting it go)")?,
            index_bytes: int_gauge(INDEX_BYTES, "Approximate heap bytes of the index")?,
            tokenize_cache_bytes: int_gauge(TOKENIZE_CACHE_BYTES, "Bytes held by the tokenization segment cache; bounded by routing.tokenize_cache_bytes")?,
            tokenize_memo_bytes: int_gauge(TOKENIZE_MEMO_BYTES, "Bytes charged to the tokenization prefix memo; bounded by routing.tokenize_memo_bytes")?,
            body_memo_bytes: int_gauge(BODY_MEMO_BYTES, "Bytes charged to the body memo (long chat bodies' read prefixes); bounded by routing.body_memo_bytes")?,
            recovery_blocks: int_gauge(RECOVERY_BLOCKS, "Blocks of routed prompts remembered for orphan recovery; bounded by routing.recovery_max_blocks")?,
            worker_blocks: gauge_vec(&r, WORKER_BLOCKS, "Blocks a worker holds according to its events", &["worker"])?,
            worker_active_requests: gauge_vec(&r, WORKER_ACTIVE_REQUESTS, "In-flight requests routed to the worker (booked load)", &["worker"])?,
            worker_active_blocks: gauge_vec(&r, WORKER_ACTIVE_BLOCKS, "Prompt blocks of in-flight requests routed to the worker", &["worker"])?,
            worker_prefill_tokens: gauge_vec(&r, WORKER_PREFILL_TOKENS, "Uncached prompt tokens of in-flight requests routed to the worker", &["worker"])?,
            worker_running: gauge_vec(&r, WORKER_RUNNING_REQUESTS, "vllm:num_requests_running from the last scrape", &["worker"])?,
            worker_waiting: gauge_vec(&r, WORKER_WAITING_REQUESTS, "vllm:num_requests_waiting from the last scrape", &["worker"])?,
            worker_healthy: gauge_vec(&r, WORKER_HEALTHY, "1 when the worker gets traffic (its /metrics answers)", &["worker"])?,
            engine_scrapes: counter_vec(&r, ENGINE_SCRAPES_TOTAL, "Engine /metrics scrapes by result", &["worker", "result"])?,
            engine_scrape_too_large: counter_vec(&r, ENGINE_SCRAPE_TOO_LARGE_TOTAL, "Engine /metrics scrapes refused for a body above routing.scrape_max_body_bytes", &["worker"])?,
            engine_hits: counter_vec(&r, ENGINE_PREFIX_CACHE_HITS_TOTAL, "Mirror of the engine's vllm:prefix_cache_hits_total (tokens) since indexer start", &["worker"])?,
            engine_queries: counter_vec(&r, ENGINE_PREFIX_CACHE_QUERIES_TOTAL, "Mirror of the engine's vllm:prefix_cache_queries_total (tokens) since indexer start", &["worker"])?,
            kv_block_hit_rate,
            fleet_generation: int_gauge(FLEET_GENERATION, "Bumped when fleet membership or health changes")?,
            config_reloads: counter_vec(&r, CONFIG_RELOADS_TOTAL, "Config reloads by result", &["result"])?,
            approx_expired,
            tokenize_moved_to_pool,
            prefill_legs: counter_vec(&r, PREFILL_LEGS_TOTAL, "Prefill legs of disaggregated requests by base model and outcome", &["model", "outcome"])?,
            prefill_fallbacks: counter_vec(&r, PREFILL_FALLBACKS_TOTAL, "Prefill legs that failed and were served on the decode worker, by base model and reason", &["model", "reason"])?,
            prefill_leg_duration: leg_duration(&r, PREFILL_LEG_DURATION_SECONDS, "Time of one prefill leg (send, remote prefill, answer)")?,
            migrations: counter_vec(&r, MIGRATIONS_TOTAL, "KV migrations by base model and outcome (dry_run: would have migrated)", &["model", "outcome"])?,
            migration_opportunities: counter_vec(
                &r,
                MIGRATION_OPPORTUNITIES_TOTAL,
                "Requests whose decode worker is not the one holding most of their blocks, with enough to move",
                &["source"],
            )?,
            migration_opportunity_blocks: {
                let c = IntCounter::new(MIGRATION_OPPORTUNITY_BLOCKS_TOTAL, "Blocks the migration opportunities would move")?;
                r.register(Box::new(c.clone()))?;
                c
            },
            migration_handshake_duration: leg_duration(&r, MIGRATION_HANDSHAKE_DURATION_SECONDS, "Time of one migration handshake on the source worker")?,
            local_continuations: {
                let c = IntCounter::new(LOCAL_CONTINUATIONS_TOTAL, "Continuations at or above min_remote_prefill_tokens kept on their decode worker")?;
                r.register(Box::new(c.clone()))?;
                c
            },
            kv_home_moves: {
                let c = IntCounter::new(KV_HOME_MOVES_TOTAL, "Sessions whose kv_home moved to the worker that served after Envoy retried to another host (/v1/done)")?;
                r.register(Box::new(c.clone()))?;
                c
            },
            sessions_tracked: gauge_vec(&r, SESSIONS_TRACKED, "Sessions remembered for local continuations and kv_home", &["set"])?,
            predicted_ttft: {
                // 1 ms … ~65 s.
                let h = Histogram::with_opts(
                    HistogramOpts::new(PREDICTED_TTFT_SECONDS, "Predicted time to first token on the chosen worker, per routed request")
                        .buckets(exponential_buckets(1e-3, 2.0, 17)?),
                )?;
                r.register(Box::new(h.clone()))?;
                h
            },
            speculative_overlap_blocks: {
                let c = IntCounter::new(SPECULATIVE_OVERLAP_BLOCKS_TOTAL, "Blocks credited to chosen workers from recent decisions beyond what their events show")?;
                r.register(Box::new(c.clone()))?;
                c
            },
            speculative_blocks: {
                let g = IntGauge::new(SPECULATIVE_BLOCKS, "Speculative (block, worker) holdings remembered")?;
                r.register(Box::new(g.clone()))?;
                g
            },
            answer_credits: counter_vec(&r, ANSWER_CREDITS_TOTAL, "Answers whose blocks were credited to the worker they finished on until its KV events confirm them (speculative_ttl_ms), by base model", &["model"])?,
            attribution_requests: counter_vec(&r, ATTRIBUTION_REQUESTS_TOTAL, "Routed requests at /v1/done by attribution result: attributed, or why not (not_served, served_elsewhere, kv_transfer, no_usage, no_cached_tokens), by base model", &["model", "result"])?,
            attribution_prompt_tokens: counter_vec(&r, ATTRIBUTION_PROMPT_TOKENS_TOTAL, "Prompt tokens of attributed requests (the engine's usage.prompt_tokens), by base model", &["model"])?,
            attribution_available_tokens: counter_vec(&r, ATTRIBUTION_AVAILABLE_TOKENS_TOTAL, "Of attributed requests: the most cached tokens any eligible worker was predicted to hold at decision time, by base model", &["model"])?,
            attribution_captured_tokens: counter_vec(&r, ATTRIBUTION_CAPTURED_TOKENS_TOTAL, "Of attributed requests: the cached tokens predicted on the chosen worker, by base model", &["model"])?,
            attribution_delivered_tokens: counter_vec(&r, ATTRIBUTION_DELIVERED_TOKENS_TOTAL, "Of attributed requests: the tokens the engine served from its prefix cache (usage.prompt_tokens_details.cached_tokens), by base model", &["model"])?,
            attribution_unpredicted_tokens: counter_vec(&r, ATTRIBUTION_UNPREDICTED_TOTAL, "Of attributed requests: tokens the engine served from cache beyond the prediction (the index lagged the engine), by base model", &["model"])?,
            attribution_lost_tokens: counter_vec(&r, ATTRIBUTION_LOST_TOKENS_TOTAL, "Of attributed requests: prompt tokens not served from cache, by base model and cause (workload: no eligible worker held them; routing: another worker held more; not_delivered: predicted on the chosen worker but not served from its cache)", &["model", "cause"])?,
            worker_prefill_tps: {
                let g = GaugeVec::new(Opts::new(WORKER_PREFILL_TOKENS_PER_SECOND, "Prefill throughput the placement model uses for the worker (measured, else the median of its measured peers of its role, else the default)"), &["worker"])?;
                r.register(Box::new(g.clone()))?;
                g
            },
            worker_queued_prefill: {
                let g = GaugeVec::new(Opts::new(WORKER_QUEUED_PREFILL_TOKENS, "Prefill tokens the placement model predicts ahead of a new request on the worker"), &["worker"])?;
                r.register(Box::new(g.clone()))?;
                g
            },
            adapter_loads_predicted: counter_vec(&r, ADAPTER_LOADS_PREDICTED_TOTAL, "Routes placed on a worker that must load the request's LoRA adapter (none running or waiting there, none just routed there), by base model", &["model"])?,
            adapter_slot_waits_predicted: counter_vec(&r, ADAPTER_SLOT_WAITS_PREDICTED_TOTAL, "Routes placed on a worker whose max_lora slots other running adapters hold (the request waits for one), by base model", &["model"])?,
            discovery: DiscoveryMetrics::new(&r)?,
            epp_requests: counter_vec(&r, EPP_REQUESTS_TOTAL, "Requests the GIE endpoint picker answered, by result: routed (the route pipeline picked), fallback (the route call failed for the router's reasons; the session's pin), passthrough (not a completion to read: the pin), no_body (a body mode that does not show the body: the pin), models_list, unknown_model, bad_request, too_large, shed (the prefill worker's 429/503), no_endpoint (nothing eligible: 503), splice_failed, protocol_error", &["result"])?,
            registry: r,
        };
        for source in ["index", "kv_home"] {
            m.migration_opportunities.with_label_values(&[source]).inc_by(0);
        }
        Ok(m)
    }

    /// Counts one endpoint-picker answer of `result`; the count so far (to sample log lines).
    pub fn epp_request(&self, result: &str) -> u64 {
        let c = self.epp_requests.with_label_values(&[result]);
        c.inc();
        c.get()
    }

    /// Counts a route of base `model` whose adapter costs `cost` on the chosen worker.
    pub fn adapter_placed(&self, model: &str, cost: crate::predict::AdapterCost) {
        let model = &*model_label(model);
        if cost.load {
            self.adapter_loads_predicted.with_label_values(&[model]).inc();
        }
        if cost.wait_slot {
            self.adapter_slot_waits_predicted.with_label_values(&[model]).inc();
        }
    }

    /// Creates base model `model`'s series that alerts divide at zero (their series exist from
    /// the start). Called for every configured model at start and on reload.
    pub fn init_model_series(&self, model: &str) {
        let model = &*model_label(model);
        for o in PREFILL_LEG_OUTCOMES {
            self.prefill_legs.with_label_values(&[model, o]).inc_by(0);
        }
        for f in crate::legs::LegFailure::ALL {
            self.prefill_fallbacks.with_label_values(&[model, f.reason()]).inc_by(0);
        }
        for o in MIGRATION_OUTCOMES {
            self.migrations.with_label_values(&[model, o]).inc_by(0);
        }
        self.overlap_blocks.with_label_values(&[model]).inc_by(0);
        self.isl_blocks.with_label_values(&[model]).inc_by(0);
        self.adapter_loads_predicted.with_label_values(&[model]).inc_by(0);
        self.adapter_slot_waits_predicted.with_label_values(&[model]).inc_by(0);
        self.answer_credits.with_label_values(&[model]).inc_by(0);
        for v in crate::route::attribution::Verdict::ALL {
            self.attribution_requests.with_label_values(&[model, v.as_str()]).inc_by(0);
        }
        for c in [
            &self.attribution_prompt_tokens,
            &self.attribution_available_tokens,
            &self.attribution_captured_tokens,
            &self.attribution_delivered_tokens,
            &self.attribution_unpredicted_tokens,
        ] {
            c.with_label_values(&[model]).inc_by(0);
        }
        for cause in crate::route::attribution::CAUSES {
            self.attribution_lost_tokens.with_label_values(&[model, cause]).inc_by(0);
        }
    }

    /// Prometheus text exposition of everything.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        // Encoding into a Vec cannot fail for well-formed families; an error yields what was written.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// Creates a joining worker's failure series at zero, so alerts and dashboards see "no gaps yet"
    /// instead of "no data" (a `rate()` over an absent series is empty, not 0).
    pub fn register_worker(&self, worker: &str, model: &str) {
        self.kv_block_size_mismatch.with_label_values(&[worker, &model_label(model)]).inc_by(0);
        for c in [
            &self.kv_decode_errors,
            &self.kv_gaps,
            &self.kv_orphan_stores,
            &self.kv_orphan_recovered,
        ] {
            c.with_label_values(&[worker]).inc_by(0);
        }
        for reason in KV_RESYNC_REASONS {
            self.kv_resyncs.with_label_values(&[worker, reason]).inc_by(0);
        }
        for reason in KV_EVENT_LIMIT_REASONS {
            self.kv_event_limits.with_label_values(&[worker, reason]).inc_by(0);
        }
        for outcome in ["complete", "truncated", "failed"] {
            self.kv_replays.with_label_values(&[worker, outcome]).inc_by(0);
        }
        for reason in ["holes", "no_end_marker"] {
            self.kv_replay_rounds.with_label_values(&[worker, reason]).inc_by(0);
        }
    }

    /// Drops every series labelled with `worker`, which served `model` (it left the fleet).
    pub fn forget_worker(&self, worker: &str, model: &str) {
        let _ = self.kv_block_size_mismatch.remove_label_values(&[worker, model]);
        for g in [
            &self.worker_blocks,
            &self.worker_active_requests,
            &self.worker_active_blocks,
            &self.worker_prefill_tokens,
            &self.worker_running,
            &self.worker_waiting,
            &self.worker_healthy,
        ] {
            let _ = g.remove_label_values(&[worker]);
        }
        let _ = self.kv_event_lag.remove_label_values(&[worker]);
        let _ = self.worker_prefill_tps.remove_label_values(&[worker]);
        let _ = self.worker_queued_prefill.remove_label_values(&[worker]);
        for c in [
            &self.kv_batches,
            &self.kv_decode_errors,
            &self.kv_gaps,
            &self.kv_orphan_stores,
            &self.kv_orphan_recovered,
            &self.kv_unknown_removes,
            &self.kv_unknown_group_kind,
            &self.kv_unusable_extra_keys,
            &self.engine_hits,
            &self.engine_queries,
            &self.engine_scrape_too_large,
        ] {
            let _ = c.remove_label_values(&[worker]);
        }
        let pairs: [(&IntCounterVec, &[&str]); 8] = [
            (&self.kv_events, &["stored", "removed", "cleared", "unknown"]),
            (&self.kv_replay_rounds, &["holes", "no_end_marker"]),
            (&self.kv_blocks, &["stored", "removed", "group_stored", "group_removed"]),
            (&self.kv_replays, &["complete", "truncated", "failed"]),
            (&self.kv_resyncs, &KV_RESYNC_REASONS),
            (&self.kv_event_limits, &KV_EVENT_LIMIT_REASONS),
            (
                &self.kv_ignored,
                &["tier", "malformed", "queue_full", "seed_table_full", "group_full"],
            ),
            (&self.engine_scrapes, &["ok", "error"]),
        ];
        for (vec, second) in pairs {
            for s in second {
                let _ = vec.remove_label_values(&[worker, s]);
            }
        }
    }
}

/// Kubernetes discovery (`service/discovery.rs`). The families are always registered; their labelled series
/// are created at zero when discovery starts ([`DiscoveryMetrics::init_series`]), so an indexer
/// without `[discovery.kubernetes]` exports no discovery series but the two unlabelled ones.
pub struct DiscoveryMetrics {
    /// Membership updates applied.
    pub updates: IntCounter,
    /// labels: kind ([`crate::discovered::CHANGE_KINDS`]).
    pub changes: IntCounterVec,
    /// labels: status ([`crate::discovered::STATUSES`]): discovered workers in the fleet.
    pub workers: IntGaugeVec,
    /// labels: reason ([`crate::discovered::skip_reasons`]): discovered endpoints not in the fleet.
    pub skipped: IntGaugeVec,
    /// labels: reason ([`crate::discovered::ERROR_REASONS`]).
    pub errors: IntCounterVec,
    /// 1 once the first membership update arrived (both initial lists done), 0 before or after the watch ended.
    pub synced: IntGauge,
}

impl DiscoveryMetrics {
    fn new(r: &Registry) -> prometheus::Result<Self> {
        let updates = IntCounter::new(
            DISCOVERY_UPDATES_TOTAL,
            "Kubernetes discovery membership updates applied",
        )?;
        r.register(Box::new(updates.clone()))?;
        let synced = IntGauge::new(DISCOVERY_SYNCED, "1 once Kubernetes discovery completed its initial lists (0 when off, not yet, or ended)")?;
        r.register(Box::new(synced.clone()))?;
        Ok(Self {
            updates,
            changes: counter_vec(
                r,
                DISCOVERY_CHANGES_TOTAL,
                "Discovery membership changes by kind",
                &["kind"],
            )?,
            workers: gauge_vec(
                r,
                DISCOVERY_WORKERS,
                "Discovered workers in the fleet by status",
                &["status"],
            )?,
            skipped: gauge_vec(
                r,
                DISCOVERY_SKIPPED_ENDPOINTS,
                "Endpoints of the discovered Service left out of the fleet, by reason",
                &["reason"],
            )?,
            errors: counter_vec(
                r,
                DISCOVERY_ERRORS_TOTAL,
                "Discovery failures by reason (client, start, apply, ended, watch, pool_missing, pool_invalid)",
                &["reason"],
            )?,
            synced,
        })
    }

    /// Creates every labelled series at zero (alerts see 0, not "no data").
    pub fn init_series(&self) {
        for kind in crate::discovered::CHANGE_KINDS {
            self.changes.with_label_values(&[kind]).inc_by(0);
        }
        for status in crate::discovered::STATUSES {
            self.workers.with_label_values(&[status]).set(0);
        }
        for reason in crate::discovered::skip_reasons() {
            self.skipped.with_label_values(&[reason]).set(0);
        }
        for reason in crate::discovered::ERROR_REASONS {
            self.errors.with_label_values(&[reason]).inc_by(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_registered_worker_has_its_failure_series_at_zero() {
        let m = Metrics::new().unwrap();
        m.register_worker("w7", "m");
        let text = m.render();
        for line in [
            "kvmesh_kv_gaps_total{worker=\"w7\"} 0",
            "kvmesh_kv_block_size_mismatch_total{model=\"m\",worker=\"w7\"} 0",
            "kvmesh_kv_resyncs_total{reason=\"gap_unrecoverable\",worker=\"w7\"} 0",
        ] {
            assert!(text.contains(line), "missing {line}");
        }
        m.forget_worker("w7", "m");
        assert!(!m.render().contains("w7"));
    }

    #[test]
    fn every_metric_is_registered_and_named_as_declared() {
        let m = Metrics::new().unwrap();
        // Touch labelled families so they appear in the output.
        m.decisions.with_label_values(&["m", "aggregate", "best_overlap"]).inc();
        m.adapter_decisions.with_label_values(&["m", "a"]).inc();
        m.hit_rate.with_label_values(&["m"]).observe(1.0);
        m.overlap_blocks.with_label_values(&["m"]).inc();
        m.isl_blocks.with_label_values(&["m"]).inc();
        m.served_models_polls.with_label_values(&["ok"]).inc();
        m.served_adapters_refused.with_label_values(&["collision"]).inc();
        m.kv_block_size_mismatch.with_label_values(&["w", "m"]).inc();
        m.route_errors.with_label_values(&["m", "x"]).inc();
        m.bad_requests.with_label_values(&["route", "x"]).inc();
        m.tokenize_cache.with_label_values(&["hit"]).inc();
        m.tokenize_memo.with_label_values(&["hit"]).inc();
        m.body_memo.with_label_values(&["hit"]).inc();
        m.done_reports.with_label_values(&["success", "true"]).inc();
        m.load_expired.with_label_values(&["timeout"]).inc();
        for c in [
            &m.kv_batches,
            &m.kv_decode_errors,
            &m.kv_gaps,
            &m.kv_orphan_stores,
            &m.kv_orphan_recovered,
            &m.kv_unknown_removes,
            &m.kv_unknown_group_kind,
            &m.kv_unusable_extra_keys,
            &m.engine_hits,
            &m.engine_queries,
            &m.engine_scrape_too_large,
        ] {
            c.with_label_values(&["w"]).inc();
        }
        m.route_cancelled.with_label_values(&["booked"]).inc();
        m.route_media_cut.with_label_values(&["m"]).inc();
        for (c, second) in [
            (&m.kv_events, "stored"),
            (&m.kv_blocks, "removed"),
            (&m.kv_replays, "complete"),
            (&m.kv_resyncs, "engine_restart"),
            (&m.kv_ignored, "tier"),
            (&m.engine_scrapes, "ok"),
            (&m.kv_event_limits, "frame_too_large"),
        ] {
            c.with_label_values(&["w", second]).inc();
        }
        for g in [
            &m.worker_blocks,
            &m.worker_active_requests,
            &m.worker_active_blocks,
            &m.worker_prefill_tokens,
            &m.worker_running,
            &m.worker_waiting,
            &m.worker_healthy,
        ] {
            g.with_label_values(&["w"]).set(1);
        }
        m.kv_event_lag.with_label_values(&["w"]).set(0.1);
        m.worker_prefill_tps.with_label_values(&["w"]).set(1.0);
        m.worker_queued_prefill.with_label_values(&["w"]).set(1.0);
        m.kv_block_hit_rate.with_label_values(&["router"]).set(0.5);
        m.config_reloads.with_label_values(&["ok"]).inc();
        m.tokenize_tokens.with_label_values(&["exact"]).inc();
        m.tokenize_background.with_label_values(&["done"]).inc();
        m.migration_opportunities.with_label_values(&["index"]).inc();
        m.sessions_tracked.with_label_values(&["kv_home"]).set(1);
        m.epp_request("routed");
        m.adapter_placed("m", crate::predict::AdapterCost { load: true, wait_slot: true });
        m.discovery.init_series();
        m.init_model_series("m");
        // The filter's label value, so the two sides' series of one model join.
        m.init_model_series("Qwen/Qwen2.5-7B");
        assert!(m.render().contains(r#"model="Qwen_Qwen2_5-7B""#));
        assert_eq!(model_label(""), "");
        assert_eq!(model_label("deepseek-v4"), "deepseek-v4");
        let text = m.render();
        for name in ALL {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing from exposition");
        }
        m.forget_worker("w", "m");
        assert!(!m.render().contains("worker=\"w\""));
    }

    #[test]
    fn names_follow_conventions() {
        for name in ALL {
            assert!(name.starts_with("kvmesh_") || name.starts_with("router_kv_"), "{name}");
        }
    }
}
