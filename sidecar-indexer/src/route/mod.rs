//! A `/v1/route` call's life, in the order it happens (STYLE.md "A request's life in the indexer"):
//!
//! 1. [`request`] (pure): the filter's headers and the client's body → a [`request::RouteRequest`];
//!    its `model` resolved against the catalog (`crate::catalog`): the base model whose workers,
//!    tokenizer and block size the call uses, and the adapter its chains are seeded with.
//! 2. [`admission`]: at most `routing.max_concurrent_routes` calls worked on; beyond it, shed.
//! 3. [`prompt`]: tokens and block chains, inline or on the blocking pool (cancellable).
//! 4. [`plan`]: matches in the index, the workers' views, the pure [`crate::decide::decide`], the
//!    booking and the placement record — one hold of the fleet, load and placement locks.
//! 5. [`run`] (the only I/O): the prefill leg or the migration handshake the plan names.
//! 6. [`settle`]: commits the booking and records the decision (session maps, blocks learned).
//!
//! Around them: [`bookings`] is the only module that books, keeps and releases load (`/v1/done`
//! and expiry included); [`record`] is the only one that writes per-route metrics;
//! [`background`] finishes partly tokenized prompts off the request path.
//!
//! Cancellation is safe at every `.await`: a dropped call (client gone, the filter's timeout, the
//! request deadline) sets its cancel flag so queued tokenization skips itself, and drops its
//! bookings, which release their load. Nothing here is keyed by the client's `x-request-id`.

pub mod admission;
pub mod attribution;
pub mod background;
pub mod body_memo;
pub mod bookings;
mod error;
pub mod front;
pub mod plan;
pub mod prompt;
pub mod record;
pub mod request;
pub mod run;
pub mod settle;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use kvmesh_core::api::RouteDecision;

pub use error::ApiError;
pub use front::{Eligible, Front};

use crate::config::Config;
use crate::state::AppState;
use record::{BodyMemoResult, RouteMetrics};

/// Answers one route call under the configuration `cfg` (read once per call): the filter's
/// `/v1/route` (`front` = `Front::default()`) or the endpoint picker's (`crate::epp`), which
/// passes the client's request in the same headers and asks for what `front` says.
pub async fn route(
    state: &Arc<AppState>,
    cfg: Arc<Config>,
    headers: &HeaderMap,
    body: Bytes,
    front: Front,
) -> Result<RouteDecision, ApiError> {
    let metrics = RouteMetrics(&state.metrics);
    let (body, joined) = request::with_base(
        headers,
        body,
        &state.body_memo,
        cfg.routing.max_body_bytes,
        |result| metrics.body_memo(result),
    )?;
    let (req, parsed) = request::parse(
        headers,
        body,
        joined,
        &state.body_memo,
        cfg.routing.body_memo_bytes,
        front,
    )?;
    if let Some(continued) = req.body_continued {
        metrics.body_memo(if continued > 0 { BodyMemoResult::Hit } else { BodyMemoResult::Miss });
    }
    // The pool: the base model `model` names (an alias, an adapter's base) or the default; a name
    // nobody serves is vLLM's 404, answered here and never routed.
    let model = state
        .models()
        .resolve(parsed.model.as_deref())
        .map_err(|unknown| ApiError::unknown_model(&unknown.0))?;
    let base = model.base().to_owned();
    let in_model = |e: ApiError| e.for_model(&base);
    let permit =
        admission::admit(&state.route_inflight, cfg.routing.max_concurrent_routes, &state.metrics)
            .map_err(in_model)?;
    let cancel = admission::Cancel::default();
    let armed = cancel.on_drop();
    let inline =
        prompt::inline_budget(req.body.len(), req.body.len() - req.body_continued.unwrap_or(0));
    let mut prompt = prompt::tokenize(state, &cfg, &model, parsed, permit, cancel, inline)
        .await
        .map_err(in_model)?;
    let partial = prompt.partial.take();
    let (plan, booking, record) =
        plan::decide_and_book(state, &cfg, &req, &model, prompt).map_err(in_model)?;
    if let Some(request) = partial {
        prompt::complete_later(state, &model, request, &plan);
    }
    let leg_id = format!("{}-leg", booking.wire_id());
    let legs = run::LegRequest {
        leg_id: &leg_id,
        request_id: req.request_id.as_deref().unwrap_or(""),
        path: &req.path,
        body: &req.body,
        model: &base,
    };
    let result = run::run(state, &cfg, plan, &legs, &booking).await;
    armed.disarm();
    match result {
        Ok(decision) => Ok(RouteDecision {
            body_base: req.body_base,
            ..settle::settle(state, &req, record, decision, booking)
        }),
        Err(e) => {
            booking.release();
            Err(in_model(e))
        }
    }
}
