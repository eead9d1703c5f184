//! The HTTP surface: OpenAI endpoints, admin endpoints, metrics, and the NIXL side channel.
//!
//! Handlers only translate: parse and tokenize a request, hand it to the engine, turn engine
//! events into OpenAI JSON or SSE. Every response carries `x-sim-worker: <id>` (benchmarks
//! attribute requests by it) and echoes `X-Request-Id`.

mod admin;
mod error;
mod lora;
mod openai;
pub mod request;
mod response;

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use tokio::sync::mpsc;

pub use error::ApiError;

use crate::config::Role;
use crate::engine::EngineHandle;
use crate::faults::FaultState;
use crate::metrics::Metrics;
use crate::output::OutputVocab;

/// Response header naming the worker that served a request.
pub const WORKER_HEADER: &str = "x-sim-worker";

/// Where this worker listens (reported by `GET /admin/info`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Info {
    /// Worker id.
    pub id: String,
    /// The first served model name (responses' `model`, the `model_name` metric label).
    pub model: String,
    /// Every `--served-model-name`.
    pub served_model_names: Vec<String>,
    /// LoRA enabled (`--enable-lora`).
    pub enable_lora: bool,
    /// GPU adapter slots (`--max-loras`).
    pub max_loras: usize,
    /// CPU adapter cache (`--max-cpu-loras`, informational).
    pub max_cpu_loras: usize,
    /// Modelled adapter load time, ms (before the speedup).
    pub lora_load_ms: f64,
    /// Role in a disaggregated fleet.
    pub role: Role,
    /// HTTP `ip:port`.
    pub http: String,
    /// `remote_host` given to NIXL consumers.
    pub advertise_host: String,
    /// HTTP port (`remote_port`).
    pub port: u16,
    /// KV-event PUB endpoint, if enabled.
    pub kv_events: Option<String>,
    /// Replay ROUTER endpoint, if enabled.
    pub replay: Option<String>,
    /// Event layout.
    pub kv_events_layout: crate::wire::Layout,
    /// Data-parallel rank.
    pub dp_rank: u32,
    /// Tokens per block.
    pub block_size: usize,
    /// Blocks in the cache.
    pub num_gpu_blocks: u32,
    /// Prompt + completion limit.
    pub max_model_len: usize,
    /// Duration divisor.
    pub speedup: f64,
}

/// Everything handlers share.
pub struct AppState {
    /// Identity and addresses.
    pub info: Info,
    /// The engine.
    pub engine: EngineHandle,
    /// Served base names and loaded LoRA adapters.
    pub models: parking_lot::RwLock<crate::lora::Registry>,
    /// The model's tokenizer.
    pub tokenizer: Arc<kvmesh_tokens::Tokenizer>,
    /// The chat template.
    pub template: Arc<kvmesh_tokens::ChatTemplate>,
    /// Reply words.
    pub vocab: Arc<OutputVocab>,
    /// Tokenizer vocabulary size (token-id prompts are checked against it).
    pub vocab_size: u32,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// Injected faults.
    pub faults: Arc<FaultState>,
    /// Replies without `max_tokens` stop after a seeded length in `1..=default_max_tokens`.
    pub default_max_tokens: u32,
    /// Asks the server to vanish for the given time.
    pub vanish: mpsc::UnboundedSender<std::time::Duration>,
    /// `x-sim-worker` value (see [`AppState::worker_header`]).
    pub worker_header: HeaderValue,
}

impl AppState {
    /// The value of the `x-sim-worker` header for worker `id` (fails if `id` is not a valid
    /// header value).
    pub fn worker_header(id: &str) -> Result<HeaderValue, axum::http::header::InvalidHeaderValue> {
        HeaderValue::from_str(id)
    }
}

/// The application router. The LoRA load/unload routes exist only with `--enable-lora` (vLLM
/// registers them only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING`; elsewhere they are a 404).
pub fn router(state: Arc<AppState>, max_body_bytes: usize) -> Router {
    let mut app = Router::new();
    if state.info.enable_lora {
        app = app
            .route("/v1/load_lora_adapter", post(lora::load))
            .route("/v1/unload_lora_adapter", post(lora::unload));
    }
    app.route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/health", get(admin::health))
        .route("/metrics", get(admin::metrics))
        .route("/reset_prefix_cache", post(admin::reset_prefix_cache))
        .route("/admin/faults", get(admin::get_faults).post(admin::post_faults))
        .route("/admin/cache", get(admin::cache))
        .route("/admin/info", get(admin::info))
        .route(crate::nixl::PULL_PATH, post(admin::nixl_pull))
        .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(state.clone(), tag_response))
        .with_state(state)
}

/// Adds `x-sim-worker` and echoes `x-request-id`.
async fn tag_response(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let request_id = req.headers().get(kvmesh_core::headers::REQUEST_ID).cloned();
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(HeaderName::from_static(WORKER_HEADER), state.worker_header.clone());
    if let Some(id) = request_id {
        h.insert(HeaderName::from_static(kvmesh_core::headers::REQUEST_ID), id);
    }
    resp
}
