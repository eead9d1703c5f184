//! What a routing decision reads and returns: the worker views and request it is made from, the
//! [`Plan`] it produces (turned into the wire [`RouteDecision`]), why the worker was chosen
//! ([`Basis`]), the [`Leg`] the shell may have to run first, a would-migrate [`Opportunity`], and
//! why no decision could be made. The types the shell reads and writes, and nothing that decides:
//! every stage of the decision imports this module, and it imports none of them.

use kvmesh_core::api::{Mode, ReasonCode, Role, RouteDecision};
use kvmesh_core::session::{SessionKey, SessionSource};

use crate::index::TierBlocks;
use crate::predict::{max_cached_blocks, AdapterCost, WorkerAdapters, WorkerTiming};

/// One worker as the decision sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerView<'a> {
    pub id: &'a str,
    pub endpoint: &'a str,
    pub role: Role,
    pub healthy: bool,
    /// Leading blocks of this prompt the worker holds, per the index (engine events).
    pub overlap_blocks: u32,
    /// Leading blocks credited from recent decisions not yet confirmed by events (sibling bursts).
    pub speculative_blocks: u32,
    /// Blocks of this prompt the worker holds in lower KV tiers (CPU, disk) right after its
    /// `overlap_blocks`, per the index: loaded at the tier's bandwidth instead of recomputed
    /// (`crate::index::KvIndex::find_lower_matches`).
    pub tier_blocks: TierBlocks,
    /// Decode load in blocks: booked, plus the engine's in-flight requests the indexer did not route.
    pub active_blocks: u64,
    /// In-flight requests routed to the worker.
    pub active_requests: u64,
    /// `vllm:num_requests_waiting` from the last scrape.
    pub waiting_requests: u64,
    /// Queued prefill, decode batch, throughput: the inputs of the predicted TTFT.
    pub timing: WorkerTiming,
    /// Prompt tokens per second this indexer routed to it recently (`crate::predict::LoadOutlook`):
    /// its share of the fleet's KV and decode work, for `session_balance` and `request_balance`.
    pub recent_tokens_per_s: f64,
    /// Its LoRA adapters (running, waiting, slots, just routed); None when its engine does not say
    /// (`vllm:lora_requests_info` absent): unknown, and an adapter costs nothing there.
    pub adapters: Option<WorkerAdapters<'a>>,
}

impl WorkerView<'_> {
    pub(crate) fn candidate(&self) -> bool {
        self.healthy && self.role.decodes()
    }

    /// Leading blocks counted as cached when predicting: the index's or the speculative ones.
    pub fn cached_blocks(&self) -> u32 {
        self.overlap_blocks.max(self.speculative_blocks)
    }
}

/// What the decision needs from the request.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteInput<'a> {
    pub isl_tokens: usize,
    pub block_size: u32,
    pub session: Option<(SessionKey, SessionSource)>,
    /// `x-kvmesh-worker`.
    pub override_worker: Option<&'a str>,
    /// `x-kvmesh-mode`.
    pub override_mode: Option<Mode>,
    /// The session was routed within the local-continuation TTL.
    pub continuation: bool,
    /// The session's last decode worker, if remembered (`kv_home`).
    pub kv_home: Option<&'a str>,
    /// The request opens a conversation (a chat with no earlier turn): no worker holds its
    /// history, so it has no home by the index, and its later turns will follow it.
    pub opens_conversation: bool,
    /// The LoRA adapter the request's `model` resolved to (`ModelRef::adapter`); None for a base
    /// model. Priced by each worker's [`WorkerView::adapters`].
    pub adapter: Option<&'a str>,
}

impl RouteInput<'_> {
    /// Full blocks of the prompt (what `RouteDecision::isl_blocks` reports).
    pub fn full_blocks(&self) -> u32 {
        kvmesh_core::router_metrics::isl_blocks(self.isl_tokens, self.block_size)
    }
    /// Blocks including a partial last one (booked load, and Dynamo's hit-rate denominator).
    pub fn request_blocks(&self) -> u32 {
        u32::try_from(self.isl_tokens.div_ceil(self.block_size.max(1) as usize)).unwrap_or(u32::MAX)
    }
    /// The most blocks an engine can serve from cache for this prompt (the last token is computed).
    pub fn max_cached_blocks(&self) -> u32 {
        max_cached_blocks(self.isl_tokens, self.block_size)
    }
}

/// Why the worker was chosen (the `basis` metric label): one of the worker-choice reason codes
/// ([`BASES`]), the decision's code for its choice — one name for the label and the code.
pub type Basis = ReasonCode;

/// The codes a [`Basis`] takes: `x-kvmesh-worker` honoured, a session stayed home, a session left
/// it (another worker faster by more than the margin), its home over an `overload_*` guard, the
/// fastest worker holding the most of the prompt, the fastest otherwise.
pub const BASES: [Basis; 6] = [
    ReasonCode::Override,
    ReasonCode::SessionPin,
    ReasonCode::SessionMoved,
    ReasonCode::PinOverloaded,
    ReasonCode::BestOverlap,
    ReasonCode::LowestCost,
];

/// Work the async shell must do before answering: a prefill leg, or a migration handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leg {
    /// Run the prefill leg on this prefill worker and carry its `kv_transfer_params`.
    PrefillOn { worker: String, endpoint: String },
    /// Ask this worker for a one-step producer handshake; the target pulls the blocks.
    MigrateFrom { worker: String, endpoint: String },
}

/// The decision, before the shell turns it into a [`RouteDecision`].
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// The chosen worker's index in the worker views [`super::decide`] was given.
    pub worker_index: usize,
    pub worker: String,
    pub endpoint: String,
    pub fallbacks: Vec<String>,
    pub mode: Mode,
    /// Index overlap on the chosen worker (capped by the last-block rule; never speculative).
    pub overlap_blocks: u32,
    /// What speculative holdings add on the chosen worker beyond `overlap_blocks`.
    pub speculative_extra_blocks: u32,
    pub isl_blocks: u32,
    pub request_blocks: u32,
    /// The candidate holding most of the prompt by the index (the chosen one on a tie), and how
    /// many blocks; None when nobody holds block 0.
    pub best_overlap: Option<(String, u32)>,
    pub basis: Basis,
    /// Why, in words: every stage's typed reason rendered once, when the plan is assembled
    /// (`decide::reason::render`); the shell appends a leg's outcome.
    pub reason: String,
    /// One code per clause of `reason` (the wire's `reason_codes`).
    pub reason_codes: Vec<ReasonCode>,
    pub leg: Option<Leg>,
    /// A would-migrate decision (counted in `dry` and `on` migration modes).
    pub opportunity: Option<Opportunity>,
    /// A continuation kept on its decode worker although it was above the disaggregation threshold.
    pub local_continuation: bool,
    /// Prompt tokens the chosen worker does not cache (in any tier it loads from).
    pub uncached_tokens: u64,
    /// Blocks the chosen worker loads from its lower KV tiers (credited at their load cost).
    pub tier_blocks: TierBlocks,
    /// Predicted time to first token on the chosen worker, milliseconds.
    pub predicted_ttft_ms: f64,
    /// What the request's adapter costs on the chosen worker (nothing without an adapter, or where
    /// the engine does not say).
    pub adapter: AdapterCost,
}

impl Plan {
    /// The wire answer (no leg ran: `kv_transfer_params` is null, `peer_worker` none).
    pub fn into_decision(self) -> RouteDecision {
        let (best_overlap_worker, best_overlap_blocks) = match self.best_overlap {
            Some((w, b)) => (Some(w), b),
            None => (None, 0),
        };
        RouteDecision {
            endpoint: self.endpoint,
            fallbacks: self.fallbacks,
            worker: self.worker,
            mode: self.mode,
            overlap_blocks: self.overlap_blocks,
            isl_blocks: self.isl_blocks,
            kv_transfer_params: None,
            reason: self.reason,
            reason_codes: self.reason_codes,
            best_overlap_worker,
            best_overlap_blocks,
            peer_worker: None,
            predicted_ttft_ms: Some(self.predicted_ttft_ms),
            booking_id: None,
            body_base: None,
        }
    }
}

/// A would-migrate decision: counted in every migration mode but `off`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opportunity {
    pub source: String,
    pub source_endpoint: String,
    pub target: String,
    /// Leading blocks the source holds (the whole prompt's full blocks when it comes from `kv_home`).
    pub source_blocks: u32,
    pub target_blocks: u32,
    /// Whether the source came from `kv_home` rather than the index.
    pub from_kv_home: bool,
}

impl Opportunity {
    /// Blocks the target would pull instead of recomputing.
    pub fn blocks_to_move(&self) -> u32 {
        self.source_blocks.saturating_sub(self.target_blocks)
    }
}

/// Why no decision could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecideError {
    #[error("no healthy decode-capable worker")]
    NoDecodeWorker,
    #[error("x-kvmesh-worker names unknown worker {0:?}")]
    UnknownOverrideWorker(String),
}

impl DecideError {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoDecodeWorker => "no_decode_worker",
            Self::UnknownOverrideWorker(_) => "unknown_override_worker",
        }
    }
}
