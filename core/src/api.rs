//! The filter ↔ indexer API (loopback HTTP/1.1, versioned under `/v1`).
//!
//! `POST /v1/route`: the body is the client's original request body, unchanged (or, under
//! [`crate::headers::KVMESH_BODY_BASE`], its bytes after a base the indexer holds:
//! [`crate::body_base`]); metadata rides in the headers named in [`crate::headers`]. `200` answers a [`RouteDecision`]. Every error answer is
//! an [`ErrorBody`] whose `reason` (also the [`ERROR_REASON_HEADER`] header) is a stable code: only
//! `prefill_overloaded` (a `429`/`503` from the prefill leg: the client must back off) is meant for
//! the client; every other answer (`no_decode_worker`, `tokenizer`, `overloaded_shed`,
//! `request_timeout`, a 4xx …) means "route without me" and the filter falls back.
//! `POST /v1/done`: a [`DoneReport`], or a batch of them (a JSON array, at most
//! [`MAX_DONE_BATCH`]; [`parse_done_body`]). `GET /v1/fleet`: a [`FleetSnapshot`].
//!
//! Over 600 lines: the filter–indexer wire contract (route request, decision, done report) is one
//! definition, kept whole with its serde round-trip tests.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::body_base::BodyBase;

pub const ROUTE_PATH: &str = "/v1/route";
pub const DONE_PATH: &str = "/v1/done";
pub const FLEET_PATH: &str = "/v1/fleet";

/// How a request is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Prefill and decode on the chosen decode worker.
    Aggregate,
    /// Prefill ran on a prefill worker; the decode worker pulls the KV (`kv_transfer_params`).
    Disagg,
    /// The KV moves from the worker holding it to the chosen decode worker over NIXL.
    Migrate,
    /// The prefill leg failed; served on the decode worker as aggregate.
    DecodeFallback,
}

impl Mode {
    pub const ALL: [Mode; 4] = [Mode::Aggregate, Mode::Disagg, Mode::Migrate, Mode::DecodeFallback];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Aggregate => "aggregate",
            Self::Disagg => "disagg",
            Self::Migrate => "migrate",
            Self::DecodeFallback => "decode_fallback",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s.trim())
    }
}

/// One clause of a decision's reason, as a stable snake_case code ([`RouteDecision::reason_codes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReasonCode {
    // How the worker was chosen (the indexer's `basis` metric label, one of these per decision).
    /// `x-kvmesh-worker` honoured.
    Override,
    /// A session stayed at its home.
    SessionPin,
    /// A session left its home: another worker was predicted faster by more than the margin.
    SessionMoved,
    /// A session's home is over an `overload_*` guard; the fastest other worker was chosen.
    PinOverloaded,
    /// The fastest worker, which holds the most of the prompt.
    BestOverlap,
    /// The fastest worker, which does not hold the most (or nothing is cached).
    LowestCost,
    // Qualifiers of the worker choice.
    /// `x-kvmesh-worker` named an unhealthy or non-decoding worker and was ignored.
    OverrideIgnored,
    /// A session with no home yet (placed by prediction).
    NewSession,
    /// A request opening a conversation was kept off workers carrying more than `session_balance`
    /// × the fleet's mean recent prompt tokens, or a request without a session off workers over
    /// `request_balance` × that mean (and `request_balance_slack` requests its size above it)
    /// where that costs it no more than `request_balance_yield_ms` of predicted TTFT.
    Balanced,
    // The mode.
    /// `x-kvmesh-mode: aggregate`.
    AggregateRequested,
    /// Uncached tokens below `min_remote_prefill_tokens`: aggregate.
    BelowPrefillThreshold,
    /// A local continuation kept on its decode worker although above the threshold.
    LocalContinuation,
    /// Disaggregation was due (or asked for) but no healthy prefill worker exists.
    NoPrefillWorker,
    /// Disaggregated: uncached tokens ≥ `min_remote_prefill_tokens`.
    DisaggUncached,
    /// Disaggregated because `x-kvmesh-mode: disagg` asked for it.
    DisaggRequested,
    /// KV migration from the worker that holds more of the prompt.
    Migrate,
    /// A migration opportunity counted, nothing sent (`kv_migration = "dry"`).
    MigrateDryRun,
    /// An `x-kvmesh-mode` request that could not be honoured (the reason says why).
    ModeRequestIgnored,
    // Leg outcomes (the shell, after the plan).
    /// The prefill leg failed: served on the decode worker (`decode_fallback`).
    PrefillLegFailed,
    /// The migration handshake failed: the decode worker recomputes.
    MigrationFailed,
    /// A code this build does not know (a newer indexer): kept so the decision still parses.
    #[serde(other)]
    Other,
}

impl ReasonCode {
    /// The wire name (as serialised).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Override => "override",
            Self::SessionPin => "session_pin",
            Self::SessionMoved => "session_moved",
            Self::PinOverloaded => "pin_overloaded",
            Self::BestOverlap => "best_overlap",
            Self::LowestCost => "lowest_cost",
            Self::OverrideIgnored => "override_ignored",
            Self::NewSession => "new_session",
            Self::Balanced => "balanced",
            Self::AggregateRequested => "aggregate_requested",
            Self::BelowPrefillThreshold => "below_prefill_threshold",
            Self::LocalContinuation => "local_continuation",
            Self::NoPrefillWorker => "no_prefill_worker",
            Self::DisaggUncached => "disagg_uncached",
            Self::DisaggRequested => "disagg_requested",
            Self::Migrate => "migrate",
            Self::MigrateDryRun => "migrate_dry_run",
            Self::ModeRequestIgnored => "mode_request_ignored",
            Self::PrefillLegFailed => "prefill_leg_failed",
            Self::MigrationFailed => "migration_failed",
            Self::Other => "other",
        }
    }

    /// Every code but [`Self::Other`].
    pub const ALL: [Self; 20] = [
        Self::Override,
        Self::SessionPin,
        Self::SessionMoved,
        Self::PinOverloaded,
        Self::BestOverlap,
        Self::LowestCost,
        Self::OverrideIgnored,
        Self::NewSession,
        Self::Balanced,
        Self::AggregateRequested,
        Self::BelowPrefillThreshold,
        Self::LocalContinuation,
        Self::NoPrefillWorker,
        Self::DisaggUncached,
        Self::DisaggRequested,
        Self::Migrate,
        Self::MigrateDryRun,
        Self::ModeRequestIgnored,
        Self::PrefillLegFailed,
        Self::MigrationFailed,
    ];

    /// The codes of a comma-separated list (the debug header's form); unknown names are [`Self::Other`].
    pub fn parse_list(s: &str) -> Vec<Self> {
        s.split(',')
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(|c| Self::ALL.into_iter().find(|k| k.as_str() == c).unwrap_or(Self::Other))
            .collect()
    }

    /// A comma-separated list of `codes` (the debug header's form).
    pub fn join(codes: &[Self]) -> String {
        codes.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(",")
    }
}

/// The indexer's answer to `/v1/route`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RouteDecision {
    /// `ip:port` of the worker that serves the request (the decode worker in disaggregated modes).
    pub endpoint: String,
    /// Retry candidates in order, `ip:port`.
    #[serde(default)]
    pub fallbacks: Vec<String>,
    /// Worker id of `endpoint`.
    pub worker: String,
    pub mode: Mode,
    /// Leading blocks of the request already cached on `worker`, as the index sees them.
    pub overlap_blocks: u32,
    /// Full blocks in the request's prompt.
    pub isl_blocks: u32,
    /// Spliced into the body sent to `endpoint` when present (disagg / migrate).
    #[serde(default)]
    pub kv_transfer_params: Option<Value>,
    /// Why this worker and this mode, for humans (debug header, logs).
    pub reason: String,
    /// The same, machine-readable: one stable code per clause of `reason`, in the prose's order
    /// (qualifiers and the worker choice, then the mode and its notes, then leg outcomes). Tests
    /// and tools match these, never the prose.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reason_codes: Vec<ReasonCode>,
    /// The worker holding most of the request's blocks, and how many.
    #[serde(default)]
    pub best_overlap_worker: Option<String>,
    #[serde(default)]
    pub best_overlap_blocks: u32,
    /// The prefill worker that served the prefill leg (disagg) or the migration source (migrate).
    #[serde(default)]
    pub peer_worker: Option<String>,
    /// The indexer's predicted time to first token on `worker`, in milliseconds (queued prefill
    /// ahead of the request, its own uncached prefill, its decode batch). The filter compares it
    /// with the TTFT it measures at the first response byte (`kvmesh_filter_ttft_*` metrics).
    #[serde(default)]
    pub predicted_ttft_ms: Option<f64>,
    /// The indexer's id for the load it booked for this request; the done report echoes it so the
    /// indexer releases exactly that booking (client request ids are not unique).
    #[serde(default)]
    pub booking_id: Option<String>,
    /// The request body's first bytes the indexer now holds: the next call for this conversation
    /// may send only what follows them ([`crate::body_base`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base: Option<BodyBase>,
}

impl RouteDecision {
    /// Debug response headers describing the decision (`[filter] debug_headers`: the filter's
    /// and the endpoint picker's), each value [`crate::headers::header_safe`].
    pub fn debug_headers(&self) -> Vec<(&'static str, String)> {
        use crate::headers::{self, header_safe};
        vec![
            (headers::DEBUG_MODE, self.mode.as_str().to_owned()),
            (headers::DEBUG_WORKER, header_safe(&self.worker)),
            (headers::DEBUG_OVERLAP_BLOCKS, self.overlap_blocks.to_string()),
            (headers::DEBUG_ISL_BLOCKS, self.isl_blocks.to_string()),
            (headers::DEBUG_REASON, header_safe(&self.reason)),
            (headers::DEBUG_REASON_CODES, header_safe(&ReasonCode::join(&self.reason_codes))),
        ]
    }
}

/// The `x-gateway-destination-endpoint` value, `primary[,fallback…]`: primary first, skipping
/// repeats of earlier entries.
pub fn destination_header<'a>(
    primary: &str,
    fallbacks: impl IntoIterator<Item = &'a str>,
) -> String {
    let mut out = String::from(primary);
    let mut seen: Vec<&str> = vec![primary];
    for f in fallbacks {
        if !f.is_empty() && !seen.contains(&f) {
            out.push(',');
            out.push_str(f);
            seen.push(f);
        }
    }
    out
}

/// An OpenAI-style error body: `{"error": {"message", "type", "code"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub code: u16,
    /// The request field the error is about (vLLM sets `"model"` on its unknown-model 404).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param: Option<String>,
    /// The indexer's stable, machine-readable reason (`no_decode_worker`, `tokenizer`,
    /// `overloaded_shed`, …; the `reason` label of its metrics), which the filter reports in
    /// `x-kvmesh-fallback` when it routes without the answer. Also sent as [`ERROR_REASON_HEADER`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// Response header on every indexer error answer: the same stable reason as [`ErrorDetail::reason`].
pub const ERROR_REASON_HEADER: &str = "x-kvmesh-error";

impl ErrorBody {
    pub fn new(code: u16, kind: &str, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_owned(),
                code,
                param: None,
                reason: None,
            },
        }
    }

    /// [`Self::new`] with the indexer's stable reason.
    pub fn with_reason(code: u16, kind: &str, reason: &str, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_owned(),
                code,
                param: None,
                reason: Some(reason.to_owned()),
            },
        }
    }
}

/// How a routed request ended, as the filter saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The response stream ended with a 2xx status.
    Success,
    /// The upstream answered with an error status.
    Error,
    /// The client went away or the stream was reset before it ended.
    Aborted,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Error => "error",
            Self::Aborted => "aborted",
        }
    }
}

/// `POST /v1/done`: releases the load the indexer booked for a request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DoneReport {
    pub request_id: String,
    /// The endpoint the request was sent to, when known.
    #[serde(default)]
    pub endpoint: Option<String>,
    pub outcome: Outcome,
    /// The upstream's HTTP status, when one arrived.
    #[serde(default)]
    pub status: Option<u16>,
    /// [`RouteDecision::booking_id`] of the answer, when the filter got one.
    #[serde(default)]
    pub booking_id: Option<String>,
    /// The engine's `usage`, read from the end of a successful response ([`crate::usage`]); None
    /// when the response carried none (a stream without `include_usage`, an error, an abort) or
    /// the reader does not scan responses. The indexer attributes the request's cache hit with
    /// it (available / captured / delivered) and credits the answer's blocks to the worker.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<EngineUsage>,
}

/// What an engine's response said it did for a request (OpenAI `usage`, as vLLM fills it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineUsage {
    /// `usage.prompt_tokens`.
    pub prompt_tokens: u64,
    /// `usage.completion_tokens` (0 when absent).
    #[serde(default)]
    pub completion_tokens: u64,
    /// `usage.prompt_tokens_details.cached_tokens`: prompt tokens served from the engine's prefix
    /// cache (vLLM's `num_cached_tokens`; for a NIXL consumer it includes the pulled ones). None
    /// when the engine does not report it (vLLM without `--enable-prompt-tokens-details`).
    #[serde(default)]
    pub cached_tokens: Option<u64>,
}

/// Most reports one `POST /v1/done` carries. The filter sends reports that waited while a call was
/// out as one array (one call per batch instead of per request: an HTTP call costs Envoy about as
/// much CPU as the request it reports on).
pub const MAX_DONE_BATCH: usize = 64;

/// Reads a `/v1/done` body: one [`DoneReport`] object, or an array of them (a batch; the caller
/// bounds its length by [`MAX_DONE_BATCH`]).
pub fn parse_done_body(body: &[u8]) -> Result<Vec<DoneReport>, serde_json::Error> {
    if body.trim_ascii_start().starts_with(b"[") {
        serde_json::from_slice(body)
    } else {
        serde_json::from_slice(body).map(|one| vec![one])
    }
}

/// A worker's role in the fleet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    Decode,
    Prefill,
    Both,
}

impl Role {
    /// Whether the worker may serve the decode side (and aggregate requests).
    pub fn decodes(self) -> bool {
        matches!(self, Self::Decode | Self::Both)
    }
    /// Whether the worker may serve a prefill leg.
    pub fn prefills(self) -> bool {
        matches!(self, Self::Prefill | Self::Both)
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Decode => "decode",
            Self::Prefill => "prefill",
            Self::Both => "both",
        }
    }
}

/// The load the indexer attributes to a worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct WorkerLoad {
    pub active_requests: u64,
    pub active_blocks: u64,
    pub prefill_tokens: u64,
    /// `vllm:num_requests_waiting` from the last scrape, when scraped.
    #[serde(default)]
    pub waiting_requests: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FleetWorker {
    pub id: String,
    /// `ip:port` of the worker's OpenAI HTTP server.
    pub endpoint: String,
    pub role: Role,
    /// The base model it serves (a name in [`FleetSnapshot::models`]).
    #[serde(default)]
    pub model: String,
    pub healthy: bool,
    #[serde(default)]
    pub load: WorkerLoad,
}

/// One base model of the fleet, as `GET /v1/fleet` carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FleetModel {
    /// The base model's served name (what its engines report in `/v1/models`).
    pub name: String,
    /// Other names requests may use for it (no adapter).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// LoRA adapters served on it (configured or discovered from the engines' `/v1/models`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
    /// Tokens per KV block of its engines.
    pub block_size: u32,
}

/// `GET /v1/fleet`: the workers as the indexer sees them now. The filter keeps the last one.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FleetSnapshot {
    /// Bumped whenever membership or health changes.
    pub generation: u64,
    /// The default (first) model's block size.
    pub block_size: u32,
    /// The base models served, the default first (see [`crate::models`]).
    #[serde(default)]
    pub models: Vec<FleetModel>,
    pub workers: Vec<FleetWorker>,
}

impl FleetSnapshot {
    /// Healthy workers that can decode, of any model.
    pub fn decode_candidates(&self) -> impl Iterator<Item = &FleetWorker> {
        self.workers.iter().filter(|w| w.healthy && w.role.decodes())
    }

    /// Healthy workers that can decode requests for base model `model`: the candidates of a pin.
    pub fn model_candidates<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a FleetWorker> {
        self.decode_candidates().filter(move |w| w.model == model)
    }

    /// The worker a session key pins to among base model `model`'s workers, by rendezvous over
    /// [`Self::model_candidates`] (the indexer's session pin ranks the same set the same way).
    pub fn pin(&self, key: u64, model: &str) -> Option<&FleetWorker> {
        let id = crate::rendezvous::pick(key, self.model_candidates(model).map(|w| w.id.as_str()))?;
        self.workers.iter().find(|w| w.id == id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decision_wire_format() {
        let json = r#"{"endpoint":"10.0.0.1:8000","fallbacks":["10.0.0.2:8000"],"worker":"w1","mode":"decode_fallback",
            "overlap_blocks":3,"isl_blocks":4,"kv_transfer_params":null,"reason":"prefill leg failed: 500"}"#;
        let d: RouteDecision = serde_json::from_str(json).unwrap();
        assert_eq!(d.mode, Mode::DecodeFallback);
        assert_eq!(
            destination_header(&d.endpoint, d.fallbacks.iter().map(String::as_str)),
            "10.0.0.1:8000,10.0.0.2:8000"
        );
        let back: RouteDecision =
            serde_json::from_str(&serde_json::to_string(&d).unwrap()).unwrap();
        assert_eq!(back, d);
    }

    #[test]
    fn reason_codes_are_stable_snake_case_and_tolerate_new_ones() {
        for c in ReasonCode::ALL {
            assert_eq!(serde_json::to_string(&c).unwrap(), format!("\"{}\"", c.as_str()));
            assert_eq!(ReasonCode::parse_list(c.as_str()), vec![c]);
        }
        let json = r#"{"endpoint":"e:1","worker":"w","mode":"aggregate","overlap_blocks":0,"isl_blocks":0,
            "reason":"x","reason_codes":["session_pin","a_code_from_a_newer_indexer"]}"#;
        let d: RouteDecision = serde_json::from_str(json).unwrap();
        assert_eq!(d.reason_codes, vec![ReasonCode::SessionPin, ReasonCode::Other]);
        assert_eq!(ReasonCode::join(&d.reason_codes), "session_pin,other");
        assert_eq!(
            ReasonCode::parse_list(" best_overlap, disagg_uncached ,"),
            vec![ReasonCode::BestOverlap, ReasonCode::DisaggUncached]
        );
    }

    #[test]
    fn done_bodies_are_one_report_or_a_batch() {
        let one = r#"{"request_id":"a","outcome":"success","booking_id":"b1"}"#;
        let parsed = parse_done_body(one.as_bytes()).unwrap();
        assert_eq!(parsed.len(), 1);
        assert_eq!(
            (parsed[0].request_id.as_str(), parsed[0].booking_id.as_deref()),
            ("a", Some("b1"))
        );
        let batch = format!(" \n[{one},{{\"request_id\":\"b\",\"outcome\":\"aborted\"}}]");
        let parsed = parse_done_body(batch.as_bytes()).unwrap();
        assert_eq!(
            parsed.iter().map(|r| (r.request_id.as_str(), r.outcome)).collect::<Vec<_>>(),
            [("a", Outcome::Success), ("b", Outcome::Aborted)]
        );
        assert_eq!(parse_done_body(b"[]").unwrap(), vec![]);
        for bad in [
            &b"{}"[..],
            b"[{}]",
            b"[1]",
            b"",
            b"nope",
            br#"{"request_id":"a","outcome":"success"} x"#,
        ] {
            assert!(parse_done_body(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn done_reports_carry_the_engines_usage_only_when_known() {
        let old = r#"{"request_id":"a","outcome":"success","booking_id":"b1"}"#;
        assert_eq!(parse_done_body(old.as_bytes()).unwrap()[0].usage, None);
        let with = r#"{"request_id":"a","outcome":"success","usage":{"prompt_tokens":10,"cached_tokens":8}}"#;
        let r = &parse_done_body(with.as_bytes()).unwrap()[0];
        assert_eq!(
            r.usage,
            Some(EngineUsage { prompt_tokens: 10, completion_tokens: 0, cached_tokens: Some(8) })
        );
        let back = serde_json::to_string(r).unwrap();
        assert!(
            back.contains(
                r#""usage":{"prompt_tokens":10,"completion_tokens":0,"cached_tokens":8}"#
            ),
            "{back}"
        );
        let none = DoneReport { usage: None, ..r.clone() };
        assert!(!serde_json::to_string(&none).unwrap().contains("usage"));
    }

    #[test]
    fn destination_header_skips_repeats() {
        assert_eq!(destination_header("a:1", ["a:1", "b:2", "", "b:2", "c:3"]), "a:1,b:2,c:3");
    }

    #[test]
    fn modes_round_trip() {
        for m in Mode::ALL {
            assert_eq!(Mode::parse(m.as_str()), Some(m));
            assert_eq!(serde_json::to_string(&m).unwrap(), format!("\"{}\"", m.as_str()));
        }
        assert_eq!(Mode::parse("fast"), None);
    }

    #[test]
    fn pin_uses_the_models_healthy_decoders_only() {
        let w = |id: &str, model: &str, role, healthy| FleetWorker {
            id: id.into(),
            endpoint: format!("{id}:1"),
            role,
            model: model.into(),
            healthy,
            load: WorkerLoad::default(),
        };
        let fleet = FleetSnapshot {
            generation: 1,
            block_size: 16,
            models: Vec::new(),
            workers: vec![
                w("p", "m", Role::Prefill, true),
                w("d1", "m", Role::Decode, true),
                w("d2", "m", Role::Decode, false),
                w("b", "m", Role::Both, true),
                w("other", "n", Role::Both, true),
            ],
        };
        for key in 0..500u64 {
            let pinned = fleet.pin(key, "m").unwrap();
            assert!(pinned.id == "d1" || pinned.id == "b");
            assert_eq!(fleet.pin(key, "n").unwrap().id, "other");
            assert!(fleet.pin(key, "none").is_none());
        }
    }
}
