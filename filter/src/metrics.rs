//! Every metric the filter exports, declared once.
//!
//! proxy-wasm has no label API: a metric is one Envoy stat per label combination, its name the base
//! name followed by `.<label>.<value>` pairs (e.g. `kvmesh_filter_requests_total.mode.disagg.outcome.success`).
//! Envoy registers it as `wasmcustom.<name>`; the bootstrap's `stats_tags` turn each `.<label>.<value>`
//! pair back into a Prometheus label and `/stats/prometheus` prints the base name without the
//! `envoy_` prefix. Label values are closed enums, so cardinality is fixed and every series is
//! defined (at zero) when the filter configures — dashboards see them before the first request.
//!
//! The one open label is `model` (the request's base model, [`Metric::by_model`] families only):
//! the fleet's first `max_model_labels` base models, `other` for the rest
//! (`crate::models::label_model`), `unknown` when the filter does not know the model; each VM
//! also labels at most `max_model_labels` values, first come ([`ModelLabels`]), so a changing
//! fleet cannot grow the series without bound. It comes last in the stat name, its value reduced
//! to `[A-Za-z0-9_-]` ([`model_label_value`]: a dot would split it), and a model's series are
//! defined (at zero) when its label is first used.
//!
//! Envoy stats are integers: [`KV_HIT_RATE`] records per-mille ([`HIT_RATE_SCALE`]) and
//! [`ROUTE_LATENCY`] microseconds. Bucket bounds live in the bootstrap (`histogram_bucket_settings`).

/// The `router_kv_*` metrics are defined once in core, for the filter and the indexer alike.
pub use kvmesh_core::router_metrics::{
    hit_rate_permille, HIT_RATE as KV_HIT_RATE, HIT_RATE_SCALE, ISL_BLOCKS_TOTAL as KV_ISL_BLOCKS,
    OVERLAP_BLOCKS_TOTAL as KV_OVERLAP_BLOCKS,
};
/// Counter `{mode, outcome}`: finished requests by how they were routed and how they ended.
pub const REQUESTS: &str = "kvmesh_filter_requests_total";
/// Counter `{reason}`: `/v1/route` calls that gave no usable answer (the request was routed anyway).
pub const FALLBACKS: &str = "kvmesh_filter_fallbacks_total";
/// Counter `{result}`: what the local fallback did (pinned by rendezvous, or why it could not).
pub const FALLBACK_ROUTES: &str = "kvmesh_filter_fallback_routes_total";
/// Counter `{result}`: requests routed by the filter alone by choice, their body being at most
/// `local_route_max_body_bytes` (same `result` values as [`FALLBACK_ROUTES`]).
pub const LOCAL_ROUTES: &str = "kvmesh_filter_local_routes_total";
/// Counter `{result}`: `/v1/route` calls by the body they sent: `whole`, `delta` (only the bytes
/// after a body base the indexer named, `kvmesh_core::body_base`), `resent` (a delta whose base the
/// indexer no longer held, sent again whole).
pub const ROUTE_BODIES: &str = "kvmesh_filter_route_bodies_total";
/// Counter `{reason}`: requests not routed by content (passed to Envoy's fallback LB untouched).
pub const UNROUTABLE: &str = "kvmesh_filter_unroutable_requests_total";
/// Histogram: `/v1/route` round trip in milliseconds, answered or not.
pub const ROUTE_LATENCY: &str = "kvmesh_filter_route_latency_microseconds";
/// Counter `{result}`: `/v1/done` reports sent (2xx), retried (a call carrying them got no answer
/// or a 5xx: re-queued), failed (given up: 4xx, or the attempts cap) or dropped (queue full / no queue).
pub const DONE_REPORTS: &str = "kvmesh_filter_done_reports_total";
/// Counter `{result}`: `/v1/fleet` polls stored (`ok`) or not (`failed`).
pub const FLEET_REFRESHES: &str = "kvmesh_filter_fleet_refreshes_total";
/// Gauge: healthy decode-capable workers in the last stored fleet snapshot.
pub const FLEET_DECODE_WORKERS: &str = "kvmesh_filter_fleet_decode_workers";
/// Counter `{kind}`: things that should not happen (a host call failed, a splice failed, bad data).
pub const INTERNAL_ERRORS: &str = "kvmesh_filter_internal_errors_total";
/// Counter `{state}`: transitions of the `/v1/route` circuit breaker (per worker thread, summed).
pub const BREAKER_TRANSITIONS: &str = "kvmesh_filter_breaker_transitions_total";
/// Counter: engine endpoints ejected by the filter's passive health (moved to the end of lists).
pub const ENDPOINT_EJECTIONS: &str = "kvmesh_filter_endpoint_ejections_total";
/// Counter `{reason}`: requests whose `x-kvmesh-worker` / `x-kvmesh-mode` were stripped, not honoured.
pub const OVERRIDES_REFUSED: &str = "kvmesh_filter_overrides_refused_total";
/// Counter: requests whose `x-request-id` was not visible ASCII, so the filter named them by its
/// percent-encoded form in logs, `/v1/route` and `/v1/done` (`crate::request_id`; the engine still
/// gets the client's header).
pub const REQUEST_IDS_ENCODED: &str = "kvmesh_filter_request_ids_encoded_total";

/// Histogram: time to first token in milliseconds, from the request's arrival at the filter to the
/// first response body byte of a streamed 2xx response (`crate::ttft`).
pub const TTFT: &str = "kvmesh_filter_ttft_milliseconds";
/// Histogram: the indexer's predicted TTFT (`RouteDecision::predicted_ttft_ms`) of the same
/// requests, when the decision carried one.
pub const TTFT_PREDICTED: &str = "kvmesh_filter_ttft_predicted_milliseconds";
/// Histogram: actual / predicted TTFT in per-mille (1000 = as predicted): the model's calibration.
pub const TTFT_RATIO: &str = "kvmesh_filter_ttft_ratio_permille";

/// Counter `{result}`: with `defer_to_picker`, requests by whether an endpoint picker in front
/// (Envoy `ext_proc`) had set their destination: `deferred` (let go unchanged) or `absent` (the
/// filter routed them: the picker failed open).
pub const PICKER_DESTINATIONS: &str = "kvmesh_filter_picker_destinations_total";

/// Counter `{reason}`: requests the filter answered itself, never forwarded: an unknown model
/// (the indexer's 404, or the filter's own resolution against its last fleet snapshot when it
/// routes without the indexer) and `GET /v1/models` from the last fleet snapshot.
pub const LOCAL_ANSWERS: &str = "kvmesh_filter_local_answers_total";

/// Envoy's own counter (not defined by the filter) of VM reloads of the wasm filter named `kvmesh`
/// after a trap (`failure_policy: FAIL_RELOAD`), as `/stats/prometheus` prints it. Read by the
/// `KvmeshWasmFilterCrashed` alert.
pub const ENVOY_WASM_VM_RELOAD_SUCCESS: &str = "envoy_wasm_kvmesh_vm_reload_success";
/// Envoy's counter of failed VM reloads of the filter named `kvmesh` (`KvmeshWasmFilterReloadFailing`).
pub const ENVOY_WASM_VM_RELOAD_FAILURE: &str = "envoy_wasm_kvmesh_vm_reload_failure";

/// Every base name, for docs and drift tests.
pub const ALL_NAMES: [&str; 23] = [
    KV_OVERLAP_BLOCKS,
    KV_ISL_BLOCKS,
    KV_HIT_RATE,
    REQUESTS,
    FALLBACKS,
    FALLBACK_ROUTES,
    LOCAL_ROUTES,
    ROUTE_BODIES,
    UNROUTABLE,
    ROUTE_LATENCY,
    DONE_REPORTS,
    FLEET_REFRESHES,
    FLEET_DECODE_WORKERS,
    INTERNAL_ERRORS,
    TTFT,
    TTFT_PREDICTED,
    TTFT_RATIO,
    BREAKER_TRANSITIONS,
    ENDPOINT_EJECTIONS,
    OVERRIDES_REFUSED,
    REQUEST_IDS_ENCODED,
    LOCAL_ANSWERS,
    PICKER_DESTINATIONS,
];

/// Every label name; each needs a `stats_tags` entry in the bootstrap.
pub const LABELS: [&str; 7] = ["mode", "outcome", "reason", "result", "kind", "state", "model"];

pub use kvmesh_core::models::{
    metric_label as model_label_value, MAX_MODEL_LABEL_BYTES, OTHER_MODEL_LABEL,
    UNKNOWN_MODEL_LABEL,
};

macro_rules! label_enum {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident => $text:literal),+ $(,)? }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name { $($(#[$vdoc])* $variant),+ }
        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// The label value.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$variant => $text),+ }
            }
        }
    };
}

label_enum! {
    /// `mode` of [`REQUESTS`]: the indexer's mode, or how the filter routed without it.
    RouteLabel {
        Aggregate => "aggregate",
        Disagg => "disagg",
        Migrate => "migrate",
        DecodeFallback => "decode_fallback",
        /// Local fallback: the session pinned by rendezvous over the last fleet.
        Pinned => "pinned",
        /// No destination header: Envoy's fallback LB chose (unroutable, no fleet, no session, rejected).
        Unrouted => "unrouted",
        /// The endpoint picker in front had set the destination (`defer_to_picker`): let go as is.
        Picker => "picker",
    }
}

label_enum! {
    /// `outcome` of [`REQUESTS`].
    OutcomeLabel {
        /// The response ended with a 2xx status.
        Success => "success",
        /// The response carried a non-2xx status.
        Error => "error",
        /// The stream ended before the response did (client gone, reset).
        Aborted => "aborted",
        /// The indexer refused the request (429/503 with an error body), relayed to the client.
        Rejected => "rejected",
    }
}

label_enum! {
    /// `reason` of [`FALLBACKS`].
    FallbackReason {
        /// `dispatch_http_call` itself failed (unknown cluster, send failure).
        DispatchFailed => "dispatch_failed",
        /// The call ended without headers (reset, response too large for Envoy).
        Reset => "reset",
        /// 504: the call's deadline passed.
        Timeout => "timeout",
        /// 503 without an error body: no indexer reachable.
        Unavailable => "unavailable",
        /// Any other 5xx.
        ServerError => "server_error",
        /// A non-2xx status the protocol does not define (e.g. 404, 429 without an error body).
        BadStatus => "bad_status",
        /// 200 whose body is not a usable decision.
        BadResponse => "bad_response",
        /// The indexer answered an error body other than the designed prefill overload (no healthy
        /// decode worker, tokenizer or chat-template failure, shed under overload, bad input…);
        /// the error's code rides in the `x-kvmesh-fallback` debug header.
        IndexerError => "indexer_error",
        /// The circuit breaker is open after consecutive unanswered calls: the call was skipped.
        BreakerOpen => "breaker_open",
        /// The body would pass the VM's `held_body_budget_bytes` (bodies already waiting for the
        /// indexer on this worker thread): not read, no call made (`crate::body_budget`).
        BodyBudget => "body_budget",
    }
}

label_enum! {
    /// `result` of [`FALLBACK_ROUTES`].
    FallbackRoute {
        /// Pinned by rendezvous over the fleet snapshot.
        Pinned => "pinned",
        /// Sent to the worker the indexer last placed the session on ([`crate::placement`]).
        Remembered => "remembered",
        /// No session key, but some healthy worker serves another model: spread over the
        /// request's model's workers by its request id (Envoy's LB could pick another model's).
        Spread => "spread",
        /// The request has no session key (no header, prefix keys off or prompt too short), and
        /// every healthy worker serves its model: Envoy's LB chooses.
        NoSession => "no_session",
        /// No fleet snapshot stored yet.
        NoFleet => "no_fleet",
        /// The fleet has no healthy decode worker (of the request's model).
        NoWorker => "no_worker",
        /// The fleet serves no such model: answered 404 (vLLM's body), never forwarded.
        UnknownModel => "unknown_model",
    }
}

label_enum! {
    /// `reason` of [`UNROUTABLE`].
    UnroutableReason {
        UnknownPath => "unknown_path",
        Method => "method",
        NoBody => "no_body",
        BodyTooLarge => "body_too_large",
        /// The stream ended (e.g. Envoy's 413) before the body did.
        IncompleteBody => "incomplete_body",
        NotJson => "not_json",
        NotAnObject => "not_an_object",
        MissingField => "missing_field",
        WrongType => "wrong_type",
        BatchPrompt => "batch_prompt",
    }
}

impl UnroutableReason {
    /// Maps [`kvmesh_core::openai::ParseError::reason`] labels onto this enum.
    pub fn from_parse_error(err: &kvmesh_core::openai::ParseError) -> Self {
        use kvmesh_core::openai::ParseError as E;
        match err {
            E::NotJson => Self::NotJson,
            E::NotAnObject => Self::NotAnObject,
            E::Missing { .. } => Self::MissingField,
            E::WrongType { .. } => Self::WrongType,
            E::BatchPrompt => Self::BatchPrompt,
        }
    }
}

label_enum! {
    /// `state` of [`BREAKER_TRANSITIONS`]: the state the breaker entered.
    BreakerState {
        /// Consecutive unanswered calls reached `breaker_failures`: calls are skipped.
        Open => "open",
        /// The open window passed: one probe call goes through.
        HalfOpen => "half_open",
        /// An answer arrived: calls go through again.
        Closed => "closed",
    }
}

label_enum! {
    /// `reason` of [`OVERRIDES_REFUSED`].
    OverrideRefusal {
        /// `allow_overrides` is off.
        Disabled => "disabled",
        /// The request carried no `x-kvmesh-override-secret`.
        NoSecret => "no_secret",
        /// The secret did not match `override_secret` (or was longer than any valid one).
        BadSecret => "bad_secret",
    }
}

label_enum! {
    /// `reason` of [`LOCAL_ANSWERS`].
    LocalAnswer {
        /// The indexer answered `/v1/route` 404 `unknown_model`: relayed as vLLM's 404.
        UnknownModel => "unknown_model",
        /// Routing without the indexer (fallback, or a body routed locally), the last fleet
        /// snapshot serves no such model: vLLM's 404.
        UnknownModelLocal => "unknown_model_local",
        /// `GET /v1/models` answered from the last fleet snapshot.
        ModelsList => "models_list",
        /// A body past `held_body_budget_bytes` in a fleet of several base models: its `model`
        /// was not read, so no worker is known to serve it; answered 503 with `retry-after`.
        BodyBudget => "body_budget",
    }
}

label_enum! {
    /// `result` of [`PICKER_DESTINATIONS`].
    PickerDestination {
        /// The request carried the picker's `x-gateway-destination-endpoint`: let go unchanged.
        Deferred => "deferred",
        /// It carried none (ext_proc failed open: the picker was down or hung): the filter routed it.
        Absent => "absent",
    }
}

label_enum! {
    /// `result` of [`DONE_REPORTS`].
    DoneResult {
        Sent => "sent",
        /// Given up: a 4xx, or [`crate::background::MAX_DONE_ATTEMPTS`] failed calls.
        Failed => "failed",
        Dropped => "dropped",
        /// A call carrying it failed (no answer, 5xx, dispatch error): back in the queue.
        Retried => "retried",
    }
}

label_enum! {
    /// `result` of [`FLEET_REFRESHES`].
    FleetResult {
        Ok => "ok",
        Failed => "failed",
    }
}

label_enum! {
    /// `result` of [`ROUTE_BODIES`].
    RouteBody {
        /// The client's whole body.
        Whole => "whole",
        /// Only the bytes after a body base the indexer named.
        Delta => "delta",
        /// The whole body again, after the indexer answered that it no longer held the base.
        Resent => "resent",
    }
}

label_enum! {
    /// `kind` of [`INTERNAL_ERRORS`].
    InternalError {
        /// `kv_transfer_params` could not be spliced; the request went on without them.
        SpliceFailed => "splice_failed",
        /// A decision's fallback endpoint was not `ip:port`; it was left out of the header.
        InvalidFallbackEndpoint => "invalid_fallback_endpoint",
        /// A host call returned an error status.
        HostCall => "host_call",
        /// Stored fleet data could not be read back.
        BadFleetData => "bad_fleet_data",
    }
}

/// What Envoy does with a metric's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricKind {
    Counter,
    Gauge,
    Histogram,
}

/// One Envoy stat: a base name plus its label values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Metric {
    OverlapBlocks,
    IslBlocks,
    HitRate,
    Requests(RouteLabel, OutcomeLabel),
    Fallbacks(FallbackReason),
    FallbackRoutes(FallbackRoute),
    LocalRoutes(FallbackRoute),
    RouteBodies(RouteBody),
    Unroutable(UnroutableReason),
    RouteLatency,
    DoneReports(DoneResult),
    FleetRefreshes(FleetResult),
    FleetDecodeWorkers,
    InternalErrors(InternalError),
    Ttft,
    TtftPredicted,
    TtftRatio,
    BreakerTransitions(BreakerState),
    EndpointEjections,
    OverridesRefused(OverrideRefusal),
    RequestIdsEncoded,
    LocalAnswers(LocalAnswer),
    PickerDestinations(PickerDestination),
}

impl Metric {
    /// Counter, gauge or histogram.
    pub fn kind(self) -> MetricKind {
        match self {
            Self::HitRate
            | Self::RouteLatency
            | Self::Ttft
            | Self::TtftPredicted
            | Self::TtftRatio => MetricKind::Histogram,
            Self::FleetDecodeWorkers => MetricKind::Gauge,
            _ => MetricKind::Counter,
        }
    }

    /// The base name (a constant of this module).
    pub fn base(self) -> &'static str {
        match self {
            Self::OverlapBlocks => KV_OVERLAP_BLOCKS,
            Self::IslBlocks => KV_ISL_BLOCKS,
            Self::HitRate => KV_HIT_RATE,
            Self::Requests(..) => REQUESTS,
            Self::Fallbacks(_) => FALLBACKS,
            Self::FallbackRoutes(_) => FALLBACK_ROUTES,
            Self::LocalRoutes(_) => LOCAL_ROUTES,
            Self::RouteBodies(_) => ROUTE_BODIES,
            Self::Unroutable(_) => UNROUTABLE,
            Self::RouteLatency => ROUTE_LATENCY,
            Self::DoneReports(_) => DONE_REPORTS,
            Self::FleetRefreshes(_) => FLEET_REFRESHES,
            Self::FleetDecodeWorkers => FLEET_DECODE_WORKERS,
            Self::InternalErrors(_) => INTERNAL_ERRORS,
            Self::Ttft => TTFT,
            Self::TtftPredicted => TTFT_PREDICTED,
            Self::TtftRatio => TTFT_RATIO,
            Self::BreakerTransitions(_) => BREAKER_TRANSITIONS,
            Self::EndpointEjections => ENDPOINT_EJECTIONS,
            Self::OverridesRefused(_) => OVERRIDES_REFUSED,
            Self::RequestIdsEncoded => REQUEST_IDS_ENCODED,
            Self::LocalAnswers(_) => LOCAL_ANSWERS,
            Self::PickerDestinations(_) => PICKER_DESTINATIONS,
        }
    }

    /// Whether the family carries the `model` label: the per-request routing metrics. (Not the
    /// ones counted before the body is read, nor the per-VM ones.)
    pub fn by_model(self) -> bool {
        matches!(
            self,
            Self::OverlapBlocks
                | Self::IslBlocks
                | Self::HitRate
                | Self::Requests(..)
                | Self::Fallbacks(_)
                | Self::FallbackRoutes(_)
                | Self::LocalRoutes(_)
                | Self::RouteLatency
                | Self::Ttft
                | Self::TtftPredicted
                | Self::TtftRatio
        )
    }

    /// `(label, value)` pairs in name order.
    pub fn labels(self) -> Vec<(&'static str, &'static str)> {
        match self {
            Self::Requests(mode, outcome) => {
                vec![("mode", mode.as_str()), ("outcome", outcome.as_str())]
            }
            Self::Fallbacks(r) => vec![("reason", r.as_str())],
            Self::FallbackRoutes(r) | Self::LocalRoutes(r) => vec![("result", r.as_str())],
            Self::RouteBodies(b) => vec![("result", b.as_str())],
            Self::Unroutable(r) => vec![("reason", r.as_str())],
            Self::DoneReports(r) => vec![("result", r.as_str())],
            Self::FleetRefreshes(r) => vec![("result", r.as_str())],
            Self::InternalErrors(k) => vec![("kind", k.as_str())],
            Self::BreakerTransitions(s) => vec![("state", s.as_str())],
            Self::OverridesRefused(r) => vec![("reason", r.as_str())],
            Self::LocalAnswers(r) => vec![("reason", r.as_str())],
            Self::PickerDestinations(r) => vec![("result", r.as_str())],
            _ => Vec::new(),
        }
    }

    /// The name passed to `define_metric` for `model` (a [`model_label_value`]): the stat name
    /// with `.model.<model>` last, for a [`Self::by_model`] family; the stat name otherwise.
    pub fn stat_name_for(self, model: &str) -> String {
        let mut name = self.stat_name();
        if self.by_model() {
            name.push_str(".model.");
            name.push_str(model);
        }
        name
    }

    /// `base[.label.value…]`, without the `model` label ([`Self::stat_name_for`] adds it).
    pub fn stat_name(self) -> String {
        let mut name = self.base().to_owned();
        for (label, value) in self.labels() {
            name.push('.');
            name.push_str(label);
            name.push('.');
            name.push_str(value);
        }
        name
    }

    /// Every stat, so all series exist from the start.
    pub fn all() -> Vec<Metric> {
        let mut all = vec![
            Self::OverlapBlocks,
            Self::IslBlocks,
            Self::HitRate,
            Self::RouteLatency,
            Self::FleetDecodeWorkers,
        ];
        all.extend([Self::Ttft, Self::TtftPredicted, Self::TtftRatio]);
        for &mode in RouteLabel::ALL {
            all.extend(OutcomeLabel::ALL.iter().map(|&o| Self::Requests(mode, o)));
        }
        all.extend(FallbackReason::ALL.iter().map(|&r| Self::Fallbacks(r)));
        all.extend(FallbackRoute::ALL.iter().map(|&r| Self::FallbackRoutes(r)));
        all.extend(FallbackRoute::ALL.iter().map(|&r| Self::LocalRoutes(r)));
        all.extend(RouteBody::ALL.iter().map(|&b| Self::RouteBodies(b)));
        all.extend(UnroutableReason::ALL.iter().map(|&r| Self::Unroutable(r)));
        all.extend(DoneResult::ALL.iter().map(|&r| Self::DoneReports(r)));
        all.extend(FleetResult::ALL.iter().map(|&r| Self::FleetRefreshes(r)));
        all.extend(InternalError::ALL.iter().map(|&k| Self::InternalErrors(k)));
        all.extend(BreakerState::ALL.iter().map(|&s| Self::BreakerTransitions(s)));
        all.push(Self::EndpointEjections);
        all.extend(OverrideRefusal::ALL.iter().map(|&r| Self::OverridesRefused(r)));
        all.push(Self::RequestIdsEncoded);
        all.extend(LocalAnswer::ALL.iter().map(|&r| Self::LocalAnswers(r)));
        all.extend(PickerDestination::ALL.iter().map(|&r| Self::PickerDestinations(r)));
        all
    }
}

/// The `model` label values of one VM, bounded: [`UNKNOWN_MODEL_LABEL`] and [`OTHER_MODEL_LABEL`],
/// then up to `max` base models in the order they are first seen; later ones are `other`. A
/// value is its index here ([`Self::slot`]), so the metric ids can be keyed by it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLabels {
    names: Vec<String>,
    max: usize,
}

/// [`ModelLabels::slot`] of a request whose model is not known.
pub const UNKNOWN_SLOT: usize = 0;
/// [`ModelLabels::slot`] of the models past the bound.
pub const OTHER_SLOT: usize = 1;

impl ModelLabels {
    /// No model labelled yet; at most `max` will be.
    pub fn new(max: usize) -> Self {
        Self { names: vec![UNKNOWN_MODEL_LABEL.to_owned(), OTHER_MODEL_LABEL.to_owned()], max }
    }

    /// The slot of base model `base` (None: not known), labelling it when it is new and the bound
    /// allows; `true` when this call labelled it (its series are to be defined).
    pub fn slot(&mut self, base: Option<&str>) -> (usize, bool) {
        let Some(base) = base else { return (UNKNOWN_SLOT, false) };
        let value = model_label_value(base);
        if let Some(i) = self.names.iter().position(|n| *n == value) {
            return (i, false);
        }
        if self.names.len() - 2 >= self.max {
            return (OTHER_SLOT, false);
        }
        self.names.push(value);
        (self.names.len() - 1, true)
    }

    /// The label value of `slot` ([`UNKNOWN_MODEL_LABEL`] for a slot never handed out).
    pub fn name(&self, slot: usize) -> &str {
        self.names.get(slot).map_or(UNKNOWN_MODEL_LABEL, String::as_str)
    }

    /// How many base models are labelled (at most the bound).
    pub fn labelled(&self) -> usize {
        self.names.len() - 2
    }

    /// The bound (`max_model_labels`).
    pub fn max(&self) -> usize {
        self.max
    }
}

/// A metric update the host applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetricUpdate {
    /// Add to a counter (zero is skipped: Envoy refuses non-positive counter increments).
    Add(Metric, u64),
    /// Record a histogram sample or set a gauge.
    Record(Metric, u64),
}

impl MetricUpdate {
    /// The metric updated.
    pub fn metric(self) -> Metric {
        match self {
            Self::Add(m, _) | Self::Record(m, _) => m,
        }
    }
}

#[cfg(test)]
#[path = "tests/metrics.rs"]
mod tests;
