//! The scheduler's inputs and outputs: plain data, no channels, no clocks.

use std::time::Duration;

use crate::free_queue::BlockId;
use crate::hash::BlockHash;
use crate::lora::Adapter;

/// Scheduler-wide request id (assigned by the engine driver).
pub type ReqId = u64;

/// What the KV connector does with a request (vLLM's NIXL `kv_transfer_params` semantics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvRole {
    /// An ordinary request.
    Plain,
    /// `do_remote_decode: true` or `kv_migration_source: true`: when the request finishes
    /// length-capped, keep its blocks for a consumer to pull under `transfer_id`.
    Producer {
        /// The id a consumer names as `remote_request_id`.
        transfer_id: String,
    },
    /// `do_remote_prefill: true`: pull the prompt's blocks from a producer before computing.
    Consumer {
        /// Where and what to pull.
        source: RemoteSource,
    },
}

/// A producer's blocks as its `kv_transfer_params` describe them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteSource {
    /// Producer side-channel host (the producer's HTTP host in the simulator).
    pub host: String,
    /// Producer side-channel port (the producer's HTTP port).
    pub port: u16,
    /// Producer engine id (informational).
    pub engine_id: String,
    /// The producer's transfer id (`remote_request_id`).
    pub request_id: String,
    /// The producer's block ids, in prompt order.
    pub block_ids: Vec<u32>,
}

/// Why a request stopped generating, as OpenAI reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// Reached `max_tokens`.
    Length,
    /// The simulated model chose to stop (only when the request set no `max_tokens`).
    Stop,
}

impl FinishReason {
    /// The OpenAI `finish_reason` string (also vLLM's `finished_reason` metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Length => "length",
            Self::Stop => "stop",
        }
    }
}

/// A request handed to the scheduler.
#[derive(Debug, Clone)]
pub struct NewRequest {
    /// Driver-assigned id.
    pub id: ReqId,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<u32>,
    /// Engine hashes of the prompt's full blocks (`hash::chain(prompt, block_size, salt)`),
    /// computed by the caller so the hashing happens off the engine loop.
    pub hashes: Vec<BlockHash>,
    /// `cache_salt`, needed to extend the chain when the prompt is shorter than one block.
    pub salt: Option<String>,
    /// The prompt's media items (`crate::media`): they key the blocks they overlap, the one
    /// completed by generated tokens too (`hashes` must be `hash::chain_for_keyed(…, media)`).
    pub media: Vec<crate::media::MediaSpan>,
    /// The LoRA adapter the request names (`None`: the base model). Its name keys every block
    /// hash (`hashes` must be `hash::chain_for(prompt, block_size, Some(name), salt)`).
    pub lora: Option<Adapter>,
    /// Tokens to generate (≥ 1).
    pub max_tokens: u32,
    /// Reported when `max_tokens` is reached.
    pub finish_reason: FinishReason,
    /// Seed of the reply's token stream.
    pub seed: u64,
    /// NIXL role.
    pub kv: KvRole,
}

/// Blocks a finished producer holds for a consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferOut {
    /// `remote_request_id`.
    pub transfer_id: String,
    /// `remote_block_ids`, in prompt order.
    pub block_ids: Vec<BlockId>,
    /// Tokens whose KV the blocks hold.
    pub num_tokens: usize,
}

/// The end of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    /// Why generation stopped.
    pub reason: FinishReason,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Generated tokens.
    pub completion_tokens: u32,
    /// Prompt tokens not computed here: local prefix hits plus tokens pulled over NIXL.
    pub cached_tokens: u32,
    /// vLLM's `created_cache_tokens`: prompt tokens in full blocks this request computed and cached
    /// (`PrefillStats.finalize`: full prompt blocks × block size − `cached_tokens`, at least 0).
    pub created_cache_tokens: u32,
    /// vLLM's `num_prefill_kv_computed_tokens`: prompt tokens this request computed (prompt −
    /// cached). Observed into `vllm:request_prefill_kv_computed_tokens` at the finish, as vLLM does
    /// (`FinishedRequestStats`), so it pairs with `request_prefill_time_seconds` request by request.
    pub prefill_computed_tokens: u32,
    /// Set when a producer kept its blocks for a consumer.
    pub transfer: Option<TransferOut>,
    /// How long the request spent in each of vLLM's phases.
    pub phases: PhaseTimes,
}

/// The phase intervals vLLM's `request_{queue,prefill,decode,inference}_time_seconds` histograms observe.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PhaseTimes {
    /// Arrival at the engine → first scheduled.
    pub queued: Duration,
    /// First scheduled → first token (includes a preemption during prefill).
    pub prefill: Duration,
    /// First token → last token.
    pub decode: Duration,
    /// First scheduled → last token.
    pub inference: Duration,
}

/// Why the scheduler failed a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// The waiting queue is at `max_waiting_requests`.
    #[error("the engine's waiting queue is full ({limit} requests)")]
    QueueFull {
        /// The bound.
        limit: usize,
    },
    /// Prompt plus `max_tokens` exceeds `max_model_len`.
    #[error(
        "This model's maximum context length is {max_model_len} tokens. However, you requested {requested} tokens ({prompt} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion."
    )]
    TooLong {
        /// The model's limit.
        max_model_len: usize,
        /// Prompt plus completion.
        requested: usize,
        /// Prompt tokens.
        prompt: usize,
        /// Requested completion tokens.
        max_tokens: u32,
    },
    /// An empty prompt.
    #[error("The prompt cannot be empty")]
    EmptyPrompt,
    /// A duplicate id (driver bug).
    #[error("request id {0} is already in use")]
    Duplicate(ReqId),
    /// The NIXL pull failed and `kv_load_failure_policy` is `fail`.
    #[error("KV load failed: {0}")]
    KvLoadFailed(String),
}

/// One thing a step produced for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Emit {
    /// A generated token.
    Token {
        /// Request.
        id: ReqId,
        /// Token id.
        token: u32,
    },
    /// The request finished normally.
    Finished {
        /// Request.
        id: ReqId,
        /// Summary.
        done: Finished,
    },
    /// The request failed.
    Failed {
        /// Request.
        id: ReqId,
        /// Why.
        error: RequestError,
    },
    /// A consumer needs `block_ids` (its prompt blocks `first_block..`) pulled from `source`;
    /// answer with `Scheduler::pull_done`.
    Pull {
        /// Request.
        id: ReqId,
        /// The producer.
        source: RemoteSource,
        /// Index in the prompt of the first block pulled (blocks before are local hits).
        first_block: usize,
        /// Producer block ids to pull (possibly empty: then the pull only releases them).
        block_ids: Vec<u32>,
    },
}

/// Everything one `step` produced, in order: events first (the driver publishes them before it
/// delivers tokens, so a router sees stored blocks no later than the response).
#[derive(Debug, Default)]
pub struct StepOutput {
    /// Per-request results.
    pub emits: Vec<Emit>,
    /// Cache events of the step that completed (publish as one batch if non-empty).
    pub events: Vec<crate::events::KvEvent>,
    /// Tokens the completed step computed for `vllm:iteration_tokens_total` (None: no output).
    pub iteration_tokens: Option<u64>,
}

/// Cumulative counters (the driver mirrors them into `/metrics`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SchedStats {
    /// Prompt tokens looked up in the prefix cache (vLLM `prefix_cache_queries`).
    pub prefix_queries: u64,
    /// Of those, tokens not computed: local hits plus NIXL-pulled tokens (`prefix_cache_hits`).
    pub prefix_hits: u64,
    /// Prompt tokens a consumer asked a producer for (`external_prefix_cache_queries`).
    pub external_queries: u64,
    /// Tokens pulled from producers (`external_prefix_cache_hits`).
    pub external_hits: u64,
    /// Prompt tokens of requests whose prefill finished (vLLM counts them at the first token).
    pub prompt_tokens: u64,
    /// Of those, tokens not computed: local hits plus NIXL-pulled (`prompt_tokens_cached`).
    pub prompt_tokens_cached: u64,
    /// Of the cached, tokens pulled over NIXL (`prompt_tokens_by_source{source="external_kv_transfer"}`).
    pub prompt_tokens_external: u64,
    /// Re-admissions of preempted requests (vLLM `PrefixCacheStats.preempted_requests`).
    pub preempted_admissions: u64,
    /// Tokens those re-admissions looked up (`preempted_queries`; not in `prefix_queries`).
    pub preempted_queries: u64,
    /// Tokens those re-admissions hit (`preempted_hits`; not in `prefix_hits`).
    pub preempted_hits: u64,
    /// Tokens generated.
    pub generation_tokens: u64,
    /// Running requests preempted for lack of blocks.
    pub preemptions: u64,
    /// Requests finished with `length`.
    pub finished_length: u64,
    /// Requests finished with `stop`.
    pub finished_stop: u64,
    /// Requests failed by a KV load with policy `fail` (vLLM's `finished_reason="error"`).
    pub finished_error: u64,
    /// Requests cancelled (client gone).
    pub aborted: u64,
    /// NIXL pulls that failed or returned the wrong tokens.
    pub kv_load_failures: u64,
    /// Producer holds that expired unpulled.
    pub transfers_expired: u64,
    /// Producer holds pulled by a consumer.
    pub transfers_served: u64,
    /// Engine steps executed.
    pub steps: u64,
    /// LoRA adapters loaded into a GPU slot by a step (each cost `lora_load_ms`).
    pub lora_loads: u64,
    /// Prompt tokens loaded from the CPU offload tier instead of computed.
    pub offload_loaded_tokens: u64,
}

/// What `kv_load_failure_policy` says to do when a pull fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum KvLoadFailurePolicy {
    /// Compute the prompt locally instead.
    Recompute,
    /// Fail the request (HTTP 500), vLLM's default.
    Fail,
}
