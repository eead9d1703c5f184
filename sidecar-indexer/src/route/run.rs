//! Step 3 of a route call (the only I/O): runs the leg a plan names — the prefill leg of `disagg`, the producer handshake of `migrate` —
//! and turns its result into the decision the filter applies.
//!
//! Outcomes: the producer's `kv_transfer_params` ride in the decision (`disagg` / `migrate`, the
//! peer named in `peer_worker`). A prefill leg that fails for any reason but overload serves the
//! request on the decode worker (`decode_fallback`); overload (429, or a 503 that says so) is
//! answered to the filter as that status, which relays it to the client so it backs off. A failed
//! or late migration handshake recomputes on the target (`aggregate`). A worker that left the fleet
//! or turned unhealthy while its leg ran is not trusted even if it answered. Nothing here touches
//! the gateway's health: leg errors are counted and logged, never surfaced by `/healthz`.
//!
//! Load: the decode worker is booked by the plan step (without the prompt's prefill tokens when the
//! prefill runs remotely); the prefill worker carries the leg's booking, a child of the request's
//! ([`Booking::leg`]), while it runs, released when the leg ends or the call is dropped. A fallback moves the prefill onto the decode
//! worker's booking; a rejection is released by the caller. The legs send the indexer's booking id
//! as `X-Request-Id`, never the client's, so two clients sending one id cannot pair each other's
//! NIXL transfers.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use kvmesh_core::api::{Mode, RouteDecision};

use super::bookings::Booking;
use super::record::{Migration, PrefillLeg, RouteMetrics};
use super::ApiError;
use crate::config::{Config, KvMigration};
use crate::decide::Opportunity;
use crate::decide::{Leg, Plan};
use crate::legs::{self, LegFailure, LegKind, LegResult};
use crate::state::AppState;

/// What the request is, for the leg's body and its id.
pub struct LegRequest<'a> {
    /// The id the legs send as `X-Request-Id`: derived from the booking, unique per call.
    pub leg_id: &'a str,
    /// The client's `x-request-id`, for log lines.
    pub request_id: &'a str,
    /// The OpenAI path the client used (`/v1/completions` or `/v1/chat/completions`).
    pub path: &'a str,
    /// The client's body, unchanged.
    pub body: &'a [u8],
    /// The request's base model (the `model` label of the leg's metrics).
    pub model: &'a str,
}

/// Runs `plan`'s leg (if any) and returns the decision; an overloaded prefill worker is an error
/// carrying its status for the client (the caller releases `booking` then).
pub async fn run(
    state: &AppState,
    cfg: &Config,
    plan: Plan,
    req: &LegRequest<'_>,
    booking: &Booking<'_>,
) -> Result<RouteDecision, ApiError> {
    count_opportunity(state, cfg, &plan, req.model);
    let leg = plan.leg.clone();
    let decision = match leg {
        None => plan.into_decision(),
        Some(Leg::PrefillOn { worker, endpoint }) => {
            prefill(state, cfg, plan, &worker, &endpoint, req, booking).await?
        }
        Some(Leg::MigrateFrom { worker, endpoint }) => {
            migrate(state, cfg, plan, &worker, &endpoint, req).await
        }
    };
    Ok(decision)
}

/// Counts (and in dry mode logs, sampled) a would-migrate decision.
fn count_opportunity(state: &AppState, cfg: &Config, plan: &Plan, model: &str) {
    let Some(o) = &plan.opportunity else { return };
    let m = RouteMetrics(&state.metrics);
    m.migration_opportunity(o.from_kv_home, o.blocks_to_move());
    if cfg.routing.kv_migration == KvMigration::Dry {
        m.for_model(model).migration(Migration::DryRun);
        let n = state.dry_runs.fetch_add(1, Ordering::Relaxed);
        if n.is_multiple_of(cfg.routing.kv_migration_log_every.max(1)) {
            log_opportunity(o, n + 1, cfg.routing.kv_migration_log_every);
        }
    }
}

fn log_opportunity(o: &Opportunity, seen: u64, every: u64) {
    tracing::info!(
        source = %o.source,
        target = %o.target,
        source_blocks = o.source_blocks,
        target_blocks = o.target_blocks,
        blocks_to_move = o.blocks_to_move(),
        from_kv_home = o.from_kv_home,
        dry_runs_seen = seen,
        sampled_one_in = every,
        "dry-run KV migration: would move blocks instead of recomputing"
    );
}

/// Whether `worker` is still in the fleet and healthy (it may have left while its leg ran).
fn still_serving(state: &AppState, worker: &str) -> bool {
    state.fleet.read().workers.iter().any(|w| w.cfg.id == worker && w.gets_traffic())
}

async fn prefill(
    state: &AppState,
    cfg: &Config,
    plan: Plan,
    worker: &str,
    endpoint: &str,
    req: &LegRequest<'_>,
    booking: &Booking<'_>,
) -> Result<RouteDecision, ApiError> {
    let (m, mm) = (RouteMetrics(&state.metrics), RouteMetrics(&state.metrics).for_model(req.model));
    let leg = booking.leg(worker, u64::from(plan.request_blocks), plan.uncached_tokens);
    let started = Instant::now();
    let deadline = Duration::from_millis(cfg.routing.prefill_timeout_ms);
    let mut result = legs::run(
        &state.legs,
        LegKind::Prefill,
        endpoint,
        req.path,
        req.leg_id,
        req.body,
        deadline,
    )
    .await;
    leg.release();
    m.prefill_leg_took(started.elapsed());
    if matches!(result, LegResult::Params(_)) && !still_serving(state, worker) {
        result = LegResult::Failed {
            failure: LegFailure::WorkerGone,
            detail: "left the fleet or turned unhealthy during the leg".into(),
        };
    }
    match result {
        LegResult::Params(params) => {
            mm.prefill_leg(PrefillLeg::Ok);
            let mut d = plan.into_decision();
            d.kv_transfer_params = Some(params);
            d.peer_worker = Some(worker.to_owned());
            Ok(d)
        }
        LegResult::Overloaded { status, message } => {
            mm.prefill_leg(PrefillLeg::Overloaded);
            tracing::warn!(request_id = req.request_id, prefill = worker, status, message = %message, "prefill worker overloaded: the client gets {status}");
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE);
            let kind = if status == StatusCode::TOO_MANY_REQUESTS {
                "rate_limit_exceeded"
            } else {
                "service_unavailable"
            };
            Err(ApiError::new(
                status,
                kind,
                "prefill_overloaded",
                format!("prefill worker {worker} is out of capacity ({message}); retry later"),
            )
            .for_model(req.model))
        }
        LegResult::Failed { failure, detail } => {
            mm.prefill_leg(PrefillLeg::Fallback(failure.reason()));
            tracing::warn!(
                request_id = req.request_id,
                prefill = worker,
                decode = %plan.worker,
                reason = failure.reason(),
                detail = %detail,
                "remote prefill failed; falling back to prefill on the decode worker"
            );
            // The decode worker now prefills the uncached part itself.
            booking.set_prefill_tokens(plan.uncached_tokens);
            let mut d = plan.into_decision();
            d.mode = Mode::DecodeFallback;
            d.reason = format!(
                "{}; prefill on {worker} failed ({}): served on the decode worker",
                d.reason,
                failure.reason()
            );
            d.reason_codes.push(kvmesh_core::api::ReasonCode::PrefillLegFailed);
            Ok(d)
        }
    }
}

async fn migrate(
    state: &AppState,
    cfg: &Config,
    plan: Plan,
    source: &str,
    endpoint: &str,
    req: &LegRequest<'_>,
) -> RouteDecision {
    let m = RouteMetrics(&state.metrics);
    let started = Instant::now();
    let deadline = Duration::from_millis(cfg.routing.kv_migration_timeout_ms);
    let mut result = legs::run(
        &state.legs,
        LegKind::Migration,
        endpoint,
        req.path,
        req.leg_id,
        req.body,
        deadline,
    )
    .await;
    m.migration_handshake(started.elapsed());
    if matches!(result, LegResult::Params(_)) && !still_serving(state, source) {
        result = LegResult::Failed {
            failure: LegFailure::WorkerGone,
            detail: "left the fleet or turned unhealthy during the handshake".into(),
        };
    }
    let (outcome, why) = match result {
        LegResult::Params(params) => {
            m.for_model(req.model).migration(Migration::Ok);
            let mut d = plan.into_decision();
            d.kv_transfer_params = Some(params);
            d.peer_worker = Some(source.to_owned());
            return d;
        }
        LegResult::Overloaded { message, .. } => (Migration::SourceOverloaded, message),
        LegResult::Failed { failure: LegFailure::Timeout, detail } => {
            (Migration::HandshakeTimeout, detail)
        }
        LegResult::Failed { failure: LegFailure::WorkerGone, detail } => {
            (Migration::SourceGone, detail)
        }
        LegResult::Failed { failure, detail } => {
            (Migration::HandshakeFailed, format!("{}: {detail}", failure.reason()))
        }
    };
    m.for_model(req.model).migration(outcome);
    let outcome = outcome.as_str();
    tracing::warn!(request_id = req.request_id, source, target = %plan.worker, outcome, detail = %why, "KV migration handshake failed; the target recomputes");
    let mut d = plan.into_decision();
    d.mode = Mode::Aggregate;
    d.reason = format!(
        "{}; migration handshake on {source} failed ({outcome}): {} recomputes",
        d.reason, d.worker
    );
    d.reason_codes.push(kvmesh_core::api::ReasonCode::MigrationFailed);
    d
}
