//! Bookings: the only module that books, keeps and releases load (the pure ledger is
//! [`crate::load::LoadTracker`]; this is its one caller that changes it).
//!
//! The plan step books the chosen worker ([`Booking::book`], under the lock it already holds for
//! the decision); a prefill leg books its worker as a child of the request's booking
//! ([`Booking::leg`]), released when the leg ends; settling keeps the request's booking
//! ([`Booking::commit`]: its id rides in the decision) or the caller releases it
//! ([`Booking::release`]). A [`Booking`] or [`LegBooking`] dropped before either (client gone,
//! filter timeout, request deadline while a leg runs) releases itself, so a cancelled call leaks
//! nothing. A kept booking ends by `/v1/done` ([`release_reported`], by the booking id the indexer
//! issued — never by the client's `x-request-id`, which clients may reuse), by expiry ([`expire`])
//! or with its worker ([`forget_worker`]).
//!
//! A committed booking carries what its decision predicted of the prompt's cache
//! ([`Booking::commit_predicted`]); its `/v1/done` attributes the hit with the engine's `usage`
//! ([`super::attribution`]) and, when the answer finished on the booked worker, credits the
//! answer's blocks there for the conversation's next turn (`crate::speculative`).

use std::time::Instant;

use kvmesh_core::api::{DoneReport, Outcome};

use super::attribution::{self, Verdict};
use super::record::RouteMetrics;
use crate::load::{self, BookingId, LoadTracker};
use crate::state::AppState;

/// A request's live booking; released on drop unless committed.
pub struct Booking<'a> {
    state: &'a AppState,
    id: Option<BookingId>,
    wire: String,
}

impl<'a> Booking<'a> {
    /// Books the request's load on `worker` under the held `load` lock (the decision's hold), tagged
    /// with its session (`/v1/done` re-homes it when another host served); counts what expired.
    pub fn book(
        state: &'a AppState,
        load: &mut LoadTracker,
        worker: &str,
        blocks: u64,
        prefill_tokens: u64,
        request_id: Option<&str>,
        session: Option<u64>,
    ) -> Self {
        let (id, expired) =
            load.book(worker, blocks, prefill_tokens, request_id, crate::clock::now());
        if let Some(k) = session {
            load.set_session(id, k);
        }
        RouteMetrics(&state.metrics).load_expired(expired);
        Self { state, id: Some(id), wire: load.wire_id(id) }
    }

    /// The id as the decision carries it.
    pub fn wire_id(&self) -> &str {
        &self.wire
    }

    /// Books a prefill leg's load on `worker` (its own lock hold), a child of this booking: released
    /// when the leg ends ([`LegBooking::release`]) or is dropped.
    pub fn leg(&self, worker: &str, blocks: u64, prefill_tokens: u64) -> LegBooking<'a> {
        let (id, expired) =
            self.state.load.lock().book(worker, blocks, prefill_tokens, None, crate::clock::now());
        RouteMetrics(&self.state.metrics).load_expired(expired);
        LegBooking { state: self.state, id: Some(id) }
    }

    /// The booked worker now prefills `tokens` itself (a failed remote prefill).
    pub fn set_prefill_tokens(&self, tokens: u64) {
        if let Some(id) = self.id {
            self.state.load.lock().set_prefill_tokens(id, tokens);
        }
    }

    /// Releases the booking now (a rejected call).
    pub fn release(mut self) {
        if let Some(id) = self.id.take() {
            self.state.load.lock().release(id);
        }
    }

    /// Keeps the booking past the call: `/v1/done` or expiry releases it. Returns its wire id.
    pub fn commit(mut self) -> String {
        self.id = None;
        std::mem::take(&mut self.wire)
    }

    /// [`Self::commit`], keeping the decision's prediction with the booking for `/v1/done`.
    pub fn commit_predicted(self, predicted: attribution::Predicted) -> String {
        if let Some(id) = self.id {
            self.state.load.lock().set_predicted(id, predicted);
        }
        self.commit()
    }
}

impl Drop for Booking<'_> {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        let released = self.state.load.lock().release(id);
        RouteMetrics(&self.state.metrics).cancelled(super::record::Cancelled::Booked);
        if let Some(b) = released {
            tracing::info!(worker = %b.worker, booking_id = %self.wire, request_id = b.request_id.as_deref().unwrap_or(""), "route call dropped before its answer (caller gone); its booking is released");
        }
    }
}

/// A prefill leg's booking, a child of its request's [`Booking`]; released on drop.
pub struct LegBooking<'a> {
    state: &'a AppState,
    id: Option<BookingId>,
}

impl LegBooking<'_> {
    /// The leg ended.
    pub fn release(mut self) {
        if let Some(id) = self.id.take() {
            self.state.load.lock().release(id);
        }
    }
}

impl Drop for LegBooking<'_> {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            self.state.load.lock().release(id);
        }
    }
}

/// `/v1/done`: releases the booking `report` names by its booking id; whether there was one. A
/// report without a booking id (the filter's report for a call the indexer rejected or never
/// answered — whose booking the indexer released itself) releases nothing: it is counted and
/// logged (sampled).
pub fn release_reported(state: &AppState, report: &DoneReport) -> bool {
    let metrics = RouteMetrics(&state.metrics);
    let Some(wire) = report.booking_id.as_deref() else {
        let seen = metrics.done_without_booking_id();
        // 1st, 2nd, 4th, 8th …: a filter that never sends booking ids is named without flooding.
        if seen.is_power_of_two() {
            tracing::info!(request_id = %report.request_id, outcome = report.outcome.as_str(), seen, "done report without a booking id: nothing released (bookings are released only by the id the indexer issued)");
        }
        metrics.done(report.outcome, false);
        return false;
    };
    let released = {
        let mut load = state.load.lock();
        load.parse_wire_id(wire).and_then(|id| load.release(id))
    };
    // The report names the host that served (the filter reads Envoy's `upstream.address`); after
    // a retry or a fallback to another host that is not the booked worker. The booking released is
    // the one made, by its id: the booked worker's load is what the booking added.
    let mut elsewhere = false;
    if let (Some(b), Some(served)) = (&released, report.endpoint.as_deref()) {
        let (booked_at, served_by) = {
            let fleet = state.fleet.read();
            let booked_at =
                fleet.workers.iter().find(|w| w.cfg.id == b.worker).map(|w| w.cfg.endpoint.clone());
            let served_by = fleet
                .workers
                .iter()
                .find(|w| w.cfg.endpoint == served && w.cfg.role.decodes())
                .map(|w| w.cfg.id.clone());
            (booked_at, served_by)
        };
        if booked_at.as_deref().is_some_and(|e| e != served) {
            elsewhere = true;
            tracing::debug!(request_id = %report.request_id, booked = %b.worker, served, "served by another host than booked; the booking is released");
            // The session's KV is where the request was served: its next turn goes there.
            if let (Some(session), Some(to), Outcome::Success) =
                (b.session, served_by, report.outcome)
            {
                if state.sessions.lock().served_elsewhere(
                    session,
                    &b.worker,
                    &to,
                    crate::clock::now(),
                ) {
                    metrics.kv_home_moved();
                    tracing::info!(request_id = %report.request_id, from = %b.worker, to = %to, "a retry served the session on another worker; its kv_home follows");
                }
            }
        }
    }
    if let Some(b) = &released {
        attribute(state, report, b, elsewhere);
    }
    metrics.done(report.outcome, released.is_some());
    released.is_some()
}

/// Attributes a released booking's cache hit with the report's `usage`, and credits the answer's
/// blocks to the worker it finished on (served there, whole, with a usage saying how long it was).
fn attribute(state: &AppState, report: &DoneReport, b: &load::Booking, elsewhere: bool) {
    let Some(p) = b.predicted.as_deref() else { return };
    let m = RouteMetrics(&state.metrics).for_model(&p.model);
    let served = report.outcome == Outcome::Success && !elsewhere;
    let verdict = if report.outcome != Outcome::Success {
        Err(Verdict::NotServed)
    } else if elsewhere {
        Err(Verdict::ServedElsewhere)
    } else {
        attribution::attribute(p, report.usage.as_ref())
    };
    match verdict {
        Ok(a) => {
            m.attributed(&a);
            if a.lost_not_delivered > 0 || a.unpredicted > 0 {
                tracing::debug!(request_id = %report.request_id, worker = %b.worker, captured = a.captured, delivered = a.delivered, "the engine served from cache other than predicted");
            }
        }
        Err(v) => m.not_attributed(v),
    }
    let (Some(usage), Some(anchor), true) = (report.usage, p.anchor, served) else { return };
    if usage.completion_tokens == 0 {
        return;
    }
    // The engine computed every token but the last one sampled: its full blocks are cached.
    let computed = (usage.prompt_tokens + usage.completion_tokens - 1) / u64::from(p.block_size);
    let end_blocks = u32::try_from(computed).unwrap_or(u32::MAX);
    let slot = {
        let fleet = state.fleet.read();
        fleet
            .workers
            .iter()
            .find(|w| w.cfg.id == b.worker)
            .and_then(|w| w.ranks.first())
            .map(|r| r.slot)
    };
    let Some(slot) = slot else { return };
    let credited =
        state.placement.lock().speculative.answered(slot, anchor, end_blocks, crate::clock::now());
    if credited {
        m.answer_credited();
    }
}

/// Releases, counts and logs the bookings that never reported done by `now`.
pub fn expire(state: &AppState, now: Instant) {
    let expired = state.load.lock().expire(now);
    RouteMetrics(&state.metrics).load_expired(expired);
    if expired.timeout > 0 {
        tracing::info!(
            requests = expired.timeout,
            "released load of requests that never reported done"
        );
    }
}

/// Drops every booking on a worker that left the fleet.
pub fn forget_worker(state: &AppState, id: &str) {
    state.load.lock().remove_worker(id);
}
