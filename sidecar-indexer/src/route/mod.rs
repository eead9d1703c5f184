//! A `/v1/route` call's life, in the order it happens (STYLE.md "A request's life in the indexer"):
//!
//! 1. [`request`] (pure): the filter's headers and the client's body → a [`request::RouteRequest`].
//! 2. [`admission`]: at most `routing.max_concurrent_routes` calls worked on; beyond it, shed.
//! 3. [`plan`]: tokens and block chains on the blocking pool (cancellable), matches in the index,
//!    the pure [`crate::decide::decide`], and the booking — one hold of the fleet and load locks.
//! 4. [`run`] (the only I/O): the prefill leg or the migration handshake the plan names.
//! 5. [`settle`]: the one place that books, releases and records (the booking guard, the session
//!    maps, the metrics).
//!
//! Cancellation is safe at every `.await`: a dropped call (client gone, the filter's timeout, the
//! request deadline) sets its cancel flag so queued tokenization skips itself, and drops its
//! booking guards, which release their load. Nothing here is keyed by the client's `x-request-id`.

pub mod admission;
pub mod body_memo;
mod error;
pub mod plan;
pub mod request;
pub mod run;
pub mod settle;

use std::sync::Arc;

use axum::body::Bytes;
use axum::http::HeaderMap;
use kvmesh_core::api::RouteDecision;

pub use error::ApiError;

use crate::state::AppState;

/// Answers one `/v1/route` call.
pub async fn route(
    state: &Arc<AppState>,
    headers: &HeaderMap,
    body: Bytes,
) -> Result<RouteDecision, ApiError> {
    let cfg = state.config();
    let counted = |result: &str| state.metrics.body_memo.with_label_values(&[result]).inc();
    let (body, joined) =
        request::with_base(headers, body, &state.body_memo, cfg.routing.max_body_bytes, counted)?;
    let (req, parsed) =
        request::parse(headers, body, joined, &state.body_memo, cfg.routing.body_memo_bytes)?;
    if let Some(continued) = req.body_continued {
        state
            .metrics
            .body_memo
            .with_label_values(&[if continued > 0 { "hit" } else { "miss" }])
            .inc();
    }
    let permit =
        admission::admit(&state.route_inflight, cfg.routing.max_concurrent_routes, &state.metrics)?;
    let cancel = admission::Cancel::default();
    let armed = cancel.on_drop();
    let inline =
        plan::inline_budget(req.body.len(), req.body.len() - req.body_continued.unwrap_or(0));
    let mut prompt = plan::tokenize(state, &cfg, parsed, permit, cancel, inline).await?;
    let partial = prompt.partial.take();
    let (plan, booking, record) = plan::decide_and_book(state, &cfg, &req, prompt)?;
    if let Some(request) = partial {
        plan::complete_later(state, &cfg, request, &plan);
    }
    let leg_id = format!("{}-leg", booking.wire_id());
    let legs = run::LegRequest {
        leg_id: &leg_id,
        request_id: req.request_id.as_deref().unwrap_or(""),
        path: &req.path,
        body: &req.body,
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
            Err(e)
        }
    }
}
