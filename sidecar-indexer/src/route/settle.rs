//! Step 4 of a route call: the one place that books, releases and records.
//!
//! [`BookingGuard`] is the only way route code books load: it releases the booking when dropped,
//! so a call cancelled anywhere after booking (client gone, filter timeout, request deadline while
//! a prefill leg runs) leaks nothing. A booking outlives the call only through [`settle`], which
//! hands it to `/v1/done` (its id rides in the decision) or to expiry. [`settle`] also records
//! everything a served decision changes: the session maps, approximate-mode blocks and metrics.

use kvmesh_core::api::RouteDecision;
use kvmesh_core::hashing::{LocalBlockHash, SequenceHash};

use super::request::RouteRequest;
use crate::decide::Basis;
use crate::events::applier::ApplierMsg;
use crate::index::WorkerSlot;
use crate::load::{BookingId, LoadTracker};
use crate::state::AppState;

/// A live booking owned by a route call; released on drop unless settled.
pub struct BookingGuard<'a> {
    state: &'a AppState,
    id: Option<BookingId>,
    wire: String,
    /// The call's own booking (counted as a cancellation when dropped), not a leg's.
    primary: bool,
}

impl<'a> BookingGuard<'a> {
    /// Books on `worker` under the held `load` lock and counts what the booking expired.
    pub fn book(
        state: &'a AppState,
        load: &mut LoadTracker,
        worker: &str,
        blocks: u64,
        prefill_tokens: u64,
        request_id: Option<&str>,
        primary: bool,
    ) -> Self {
        let (id, expired) =
            load.book(worker, blocks, prefill_tokens, request_id, crate::clock::now());
        if expired.timeout > 0 {
            state.metrics.load_expired.with_label_values(&["timeout"]).inc_by(expired.timeout);
        }
        if expired.overflow > 0 {
            state.metrics.load_expired.with_label_values(&["overflow"]).inc_by(expired.overflow);
        }
        if expired.done_first > 0 {
            state
                .metrics
                .load_expired
                .with_label_values(&["done_first"])
                .inc_by(expired.done_first);
            tracing::info!(request_id = request_id.unwrap_or("-"), worker, "booked after its /v1/done already came (a route call answered after the filter gave up on it); released at once");
        }
        Self { state, id: Some(id), wire: load.wire_id(id), primary }
    }

    /// Books a leg's load on `worker` (taking the load lock).
    pub fn book_leg(state: &'a AppState, worker: &str, blocks: u64, prefill_tokens: u64) -> Self {
        let mut load = state.load.lock();
        Self::book(state, &mut load, worker, blocks, prefill_tokens, None, false)
    }

    /// The id as the decision carries it.
    pub fn wire_id(&self) -> &str {
        &self.wire
    }

    /// The booked worker now prefills `tokens` itself (a failed remote prefill).
    pub fn set_prefill_tokens(&self, tokens: u64) {
        if let Some(id) = self.id {
            self.state.load.lock().set_prefill_tokens(id, tokens);
        }
    }

    /// Tags the booking with the request's session (`/v1/done` re-homes it when another host served).
    pub fn set_session(&self, session: u64) {
        if let Some(id) = self.id {
            self.state.load.lock().set_session(id, session);
        }
    }

    /// Releases the booking now (a leg ended, a rejected call).
    pub fn release(mut self) {
        if let Some(id) = self.id.take() {
            self.state.load.lock().release(id);
        }
    }

    /// Keeps the booking past the call: `/v1/done` or expiry releases it.
    fn keep(mut self) -> String {
        self.id = None;
        std::mem::take(&mut self.wire)
    }
}

impl Drop for BookingGuard<'_> {
    fn drop(&mut self) {
        let Some(id) = self.id.take() else { return };
        let released = self.state.load.lock().release(id);
        if self.primary {
            self.state.metrics.route_cancelled.with_label_values(&["booked"]).inc();
            if let Some(b) = released {
                tracing::info!(worker = %b.worker, booking_id = %self.wire, request_id = b.request_id.as_deref().unwrap_or(""), "route call dropped before its answer (caller gone); its booking is released");
            }
        }
    }
}

/// What the plan step leaves for settling.
pub struct Record {
    pub basis: Basis,
    pub local_continuation: bool,
    pub session_key: Option<u64>,
    /// Approximate mode: where the prompt's blocks will be cached.
    pub approx_slot: Option<WorkerSlot>,
    /// Precise mode: the slots whose orphan stores this prompt may explain, each with the blocks
    /// the index knew there.
    pub recover_on: Vec<(WorkerSlot, usize)>,
    pub chains: Vec<SequenceHash>,
    pub locals: Vec<LocalBlockHash>,
}

/// Settles a served decision: keeps its booking (id in the decision) and records it.
pub fn settle(
    state: &AppState,
    req: &RouteRequest,
    record: Record,
    mut decision: RouteDecision,
    booking: BookingGuard<'_>,
) -> RouteDecision {
    if let Some(k) = record.session_key {
        booking.set_session(k);
    }
    decision.booking_id = Some(booking.keep());
    let m = &state.metrics;
    m.decisions.with_label_values(&[decision.mode.as_str(), record.basis.as_str()]).inc();
    if record.local_continuation {
        m.local_continuations.inc();
    }
    if let Some(permille) =
        kvmesh_core::router_metrics::hit_rate_permille(decision.overlap_blocks, decision.isl_blocks)
    {
        m.hit_rate.observe(permille as f64);
        m.overlap_blocks.inc_by(u64::from(decision.overlap_blocks));
        m.isl_blocks.inc_by(u64::from(decision.isl_blocks));
    }
    if let Some(k) = record.session_key {
        state.sessions.lock().served(k, &decision.worker, crate::clock::now());
    }
    if !record.recover_on.is_empty() {
        let (chains, locals): (std::sync::Arc<[SequenceHash]>, std::sync::Arc<[LocalBlockHash]>) =
            (record.chains.as_slice().into(), record.locals.into());
        let index = state.index.read();
        for (slot, known) in record.recover_on {
            index.note_routed(slot, chains.clone(), locals.clone(), known);
        }
    }
    if let Some(slot) = record.approx_slot {
        if !record.chains.is_empty()
            && state
                .applier
                .try_send(ApplierMsg::Approx {
                    slot,
                    chains: record.chains,
                    at: crate::clock::now(),
                })
                .is_err()
        {
            m.kv_ignored.with_label_values(&[decision.worker.as_str(), "queue_full"]).inc();
        }
    }
    tracing::debug!(
        request_id = req.request_id.as_deref().unwrap_or(""),
        booking_id = decision.booking_id.as_deref().unwrap_or(""),
        worker = %decision.worker,
        mode = decision.mode.as_str(),
        overlap_blocks = decision.overlap_blocks,
        isl_blocks = decision.isl_blocks,
        reason = %decision.reason,
        "routed"
    );
    decision
}
