//! `/v1/completions`, `/v1/chat/completions`, `/v1/models`.
//!
//! The handler waits for the engine's first event before answering, so a request the engine
//! refuses (queue full, too long, failed KV load) gets a proper status instead of a 200 with an
//! error inside; after that, a stream relays tokens as the engine produces them. Dropping the
//! response body (client gone) drops the request's engine stream, which cancels the request
//! and frees its blocks.

use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use kvmesh_core::openai::Endpoint;
use serde_json::{json, Value};

use super::request::{prepare, RequestShape, Transfer};
use super::response::{self, Full, Meta};
use super::{ApiError, AppState};
use crate::engine::{ReqEvent, RequestStream};
use crate::nixl::response_params;
use crate::output::OutputVocab;
use crate::sched::Finished;

/// Ids for responses to requests without `X-Request-Id`.
static ANON: AtomicU64 = AtomicU64::new(1);

/// `POST /v1/completions`.
pub async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(st, Endpoint::Completions, headers, body).await
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    handle(st, Endpoint::ChatCompletions, headers, body).await
}

/// `GET /v1/models`, as vLLM's `show_available_models`: each served name (`root` = the model,
/// `parent: null`), then each loaded adapter in load order (`root` = its path, `parent` = its
/// base model, no `max_model_len`).
pub async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    let created = unix_now();
    let models = st.models.read();
    let card = |id: &str, root: &str, parent: Option<&str>, max_model_len: Option<usize>| {
        json!({
            "id": id, "object": "model", "created": created, "owned_by": "vllm",
            "root": root, "parent": parent, "max_model_len": max_model_len,
        })
    };
    let mut data: Vec<Value> = models
        .base_names()
        .iter()
        .map(|n| card(n, &st.info.model, None, Some(st.info.max_model_len)))
        .collect();
    data.extend(
        models.adapters().iter().map(|e| card(&e.adapter.name, &e.path, Some(&e.parent), None)),
    );
    Json(json!({"object": "list", "data": data}))
}

async fn handle(
    st: Arc<AppState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match serve(&st, endpoint, &headers, &body).await {
        Ok(resp) => resp,
        Err(e) => {
            st.metrics.rejected.inc(e.reason);
            tracing::debug!(status = %e.status, reason = e.reason, message = %e.message, "request rejected");
            e.into_response()
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

async fn serve(
    st: &Arc<AppState>,
    endpoint: Endpoint,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    if let Some(status) = st.faults.take_fail_next() {
        st.metrics.faults.inc("fail_next");
        return Err(ApiError::fault(status, "fail_next"));
    }
    let prepared = prepare(st, endpoint, body).await?;
    let faults = st.faults.get();
    match prepared.transfer {
        Transfer::Prefill => {
            if let Some(status) = faults.fail_prefill_status {
                st.metrics.faults.inc("fail_prefill");
                return Err(ApiError::fault(status, "fail_prefill"));
            }
        }
        Transfer::MigrationSource => {
            if let Some(status) = faults.fail_migration_source_status {
                st.metrics.faults.inc("fail_migration_source");
                return Err(ApiError::fault(status, "fail_migration_source"));
            }
        }
        _ => {}
    }
    if faults.extra_latency_ms > 0 {
        st.metrics.faults.inc("extra_latency");
        tokio::time::sleep(std::time::Duration::from_millis(faults.extra_latency_ms)).await;
    }

    let pulls = matches!(prepared.transfer, Transfer::Consume(_));
    let rid = headers
        .get(kvmesh_core::headers::REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .unwrap_or_else(|| format!("{}-{:x}", st.info.id, ANON.fetch_add(1, Ordering::Relaxed)));
    let id = st.engine.next_id();
    let transfer_id = format!("{}-{id}", st.info.id);
    let prepared_model =
        prepared.lora.as_ref().map_or_else(|| st.info.model.clone(), |a| a.name.to_string());
    let (req, shape) = prepared.into_new_request(id, transfer_id);
    let prefix = match endpoint {
        Endpoint::Completions => "cmpl",
        Endpoint::ChatCompletions => "chatcmpl",
    };
    let meta = Meta {
        id: format!("{prefix}-{rid}"),
        created: unix_now(),
        // vLLM answers with the adapter's name for an adapter request, else the first served name.
        model: prepared_model,
        endpoint,
    };

    let mut stream = st.engine.submit(req, shape.stream, arrived).await.map_err(|e| {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "engine_gone", e.to_string())
    })?;
    let first = match stream.next().await {
        None => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "engine_gone",
                "the engine has stopped",
            ))
        }
        Some(ReqEvent::Failed(e)) => return Err(e.into()),
        Some(ev) => ev,
    };
    // The first event comes after the pull: the producer's hold is spent.
    if let Some(status) = st.faults.get().fail_after_pull_status.filter(|_| pulls) {
        st.metrics.faults.inc("fail_after_pull");
        return Err(ApiError::fault(status, "fail_after_pull"));
    }
    if shape.stream {
        Ok(sse(st.clone(), meta, shape, stream, first))
    } else {
        whole(st, &meta, &shape, stream, first).await
    }
}

async fn whole(
    st: &AppState,
    meta: &Meta,
    shape: &RequestShape,
    mut stream: RequestStream,
    first: ReqEvent,
) -> Result<Response, ApiError> {
    let mut tokens = Vec::new();
    let mut ev = Some(first);
    let done: Finished = loop {
        match ev.take() {
            Some(ReqEvent::Token(t)) => tokens.push(t),
            Some(ReqEvent::Last(t, done)) => {
                tokens.push(t);
                break done;
            }
            Some(ReqEvent::Done(all, done)) => {
                tokens = all;
                break done;
            }
            Some(ReqEvent::Finished(done)) => break done,
            Some(ReqEvent::Failed(e)) => return Err(e.into()),
            None => {
                return Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "engine_gone",
                    "the engine has stopped",
                ))
            }
        }
        ev = stream.next().await;
    };
    let params = match (&done.transfer, shape.transfer) {
        (Some(t), true) => {
            Some(response_params(t, &st.info.id, &st.info.advertise_host, st.info.port))
        }
        _ => None,
    };
    let body = response::full_body(
        meta,
        &st.vocab,
        Full {
            tokens: &tokens,
            done: &done,
            kv_transfer_params: params.as_ref(),
            return_token_ids: shape.return_token_ids,
            prompt_token_ids: shape.prompt_token_ids.as_deref(),
        },
    )
    .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "other", e.to_string()))?;
    Ok(([(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], body)
        .into_response())
}

/// The state of one SSE stream.
struct Sse {
    vocab: Arc<OutputVocab>,
    meta: Meta,
    shape: RequestShape,
    stream: RequestStream,
    pending: Option<ReqEvent>,
    opened: bool,
    ended: bool,
}

impl Sse {
    /// The bytes for the next engine event (several SSE events at the start and the end).
    async fn next_chunk(&mut self) -> Option<Bytes> {
        if self.ended {
            return None;
        }
        let ev = match self.pending.take() {
            Some(ev) => Some(ev),
            None => self.stream.next().await,
        };
        let mut out = Vec::with_capacity(256);
        let r = self.render(ev, &mut out);
        if let Err(e) = r {
            tracing::error!(error = %e, "cannot serialize a stream chunk");
            self.ended = true;
            out.extend_from_slice(response::DONE);
        }
        Some(Bytes::from(out))
    }

    fn render(&mut self, ev: Option<ReqEvent>, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        if !self.opened {
            self.opened = true;
            if self.meta.endpoint == Endpoint::ChatCompletions {
                response::chat_role_chunk(&self.meta, out)?;
            }
        }
        let ids = self.shape.return_token_ids;
        let done = match ev {
            Some(ReqEvent::Token(t)) => {
                return response::token_chunk(&self.meta, &self.vocab, t, None, ids, out);
            }
            Some(ReqEvent::Last(t, done)) => {
                response::token_chunk(&self.meta, &self.vocab, t, Some(done.reason), ids, out)?;
                Some(done)
            }
            Some(ReqEvent::Finished(done)) => {
                response::finish_chunk(&self.meta, done.reason, out)?;
                Some(done)
            }
            Some(ReqEvent::Done(tokens, done)) => {
                // Not sent to streaming requests; rendered anyway rather than dropped.
                for t in &tokens {
                    response::token_chunk(&self.meta, &self.vocab, *t, None, ids, out)?;
                }
                response::finish_chunk(&self.meta, done.reason, out)?;
                Some(done)
            }
            Some(ReqEvent::Failed(e)) => {
                response::error_event(500, &e.to_string(), out)?;
                None
            }
            None => {
                response::error_event(503, "the engine has stopped", out)?;
                None
            }
        };
        if let Some(done) = done.filter(|_| self.shape.include_usage) {
            response::usage_chunk(&self.meta, &done, out)?;
        }
        out.extend_from_slice(response::DONE);
        self.ended = true;
        Ok(())
    }
}

fn sse(
    st: Arc<AppState>,
    meta: Meta,
    shape: RequestShape,
    stream: RequestStream,
    first: ReqEvent,
) -> Response {
    let state = Sse {
        vocab: st.vocab.clone(),
        meta,
        shape,
        stream,
        pending: Some(first),
        opened: false,
        ended: false,
    };
    let body = futures::stream::unfold(state, |mut s| async move {
        let chunk = s.next_chunk().await?;
        Some((Ok::<_, Infallible>(chunk), s))
    });
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream")),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::from_stream(body),
    )
        .into_response()
}
