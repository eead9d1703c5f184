//! Step 5 of a route call: settles a served decision — commits its booking (the id rides in the
//! decision; [`super::bookings`] owns it from there) and records what the decision changes: the
//! session maps, the blocks approximate mode and orphan recovery learn, and its metrics (through
//! [`super::record`]).

use kvmesh_core::api::RouteDecision;
use kvmesh_core::hashing::{LocalBlockHash, SequenceHash};

use super::attribution::Predicted;
use super::bookings::Booking;
use super::record::RouteMetrics;
use super::request::RouteRequest;
use crate::catalog::RouteModel;
use crate::decide::Basis;
use crate::events::applier::ApplierMsg;
use crate::index::WorkerSlot;
use crate::state::AppState;

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
    /// The request's model and adapter (metrics labels).
    pub model: RouteModel,
    /// What the decision predicted of the prompt's cache (`super::attribution`); completed here.
    pub predicted: Predicted,
}

/// Settles a served decision: keeps its booking (id in the decision) and records it.
pub fn settle(
    state: &AppState,
    req: &RouteRequest,
    record: Record,
    mut decision: RouteDecision,
    booking: Booking<'_>,
) -> RouteDecision {
    // Kept with the booking for `/v1/done`: the attribution, and the answer's credit (its anchor
    // is the prompt's last hashed block).
    let predicted = Predicted {
        model: record.model.base().to_owned(),
        kv_transfer: decision.kv_transfer_params.as_ref().is_some_and(|p| !p.is_null()),
        anchor: record
            .chains
            .last()
            .map(|&c| (u32::try_from(record.chains.len()).unwrap_or(u32::MAX), c)),
        ..record.predicted
    };
    decision.booking_id = Some(booking.commit_predicted(predicted));
    let m = RouteMetrics(&state.metrics);
    let model = m.for_model(record.model.base());
    model.decided(&decision, record.basis, record.local_continuation);
    if let Some(adapter) = &record.model.adapter {
        model.adapter_decided(adapter, state.config().routing.max_adapter_labels);
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
            m.approx_dropped(&decision.worker);
        }
    }
    tracing::debug!(
        request_id = req.request_id.as_deref().unwrap_or(""),
        booking_id = decision.booking_id.as_deref().unwrap_or(""),
        worker = %decision.worker,
        model = record.model.base(),
        adapter = record.model.adapter.as_deref().unwrap_or(""),
        mode = decision.mode.as_str(),
        overlap_blocks = decision.overlap_blocks,
        isl_blocks = decision.isl_blocks,
        reason = %decision.reason,
        "routed"
    );
    decision
}
