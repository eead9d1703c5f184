//! Routing without the indexer: the session's last worker, else its rendezvous pin over the last
//! fleet snapshot, within the workers of the request's base model.
//!
//! The request's `model` is resolved against the snapshot's models first ([`crate::models`]): a
//! model nobody serves is answered 404 (vLLM's body), never sent to a worker of another model;
//! every worker named (primary and fallbacks) serves the base model. The primary is the worker the indexer last placed the session on, when the filter remembers
//! it ([`crate::placement`]) and the fleet still lists it as a decode candidate: the conversation
//! keeps its KV cache while the indexer is away and when it returns. Otherwise it is
//! [`FleetSnapshot::pin`], a stable choice per session. The workers of the session's rendezvous
//! ranking follow as retry fallbacks. Without a session key or a fleet the header stays unset and
//! Envoy's fallback LB chooses.

use kvmesh_core::api::{destination_header, FleetSnapshot};
use kvmesh_core::rendezvous;
use kvmesh_core::session::SessionKey;

use crate::decision::is_endpoint;
use crate::metrics::FallbackRoute;
use crate::models;

/// Retry candidates listed after the pinned worker.
pub const PIN_FALLBACKS: usize = 2;

/// What the local fallback does with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FallbackPick {
    /// Set `x-gateway-destination-endpoint: header`; `worker` is the pinned worker's id,
    /// `remembered` whether it is the session's last placement rather than its rendezvous pin.
    Pinned { worker: String, header: String, remembered: bool },
    /// Leave the header unset, for this reason.
    Unrouted(FallbackRoute),
    /// The snapshot serves no such model (the request's `model`, as sent): answer vLLM's 404.
    UnknownModel(String),
}

impl FallbackPick {
    /// The metric label of this pick.
    pub fn label(&self) -> FallbackRoute {
        match self {
            Self::Pinned { remembered: true, .. } => FallbackRoute::Remembered,
            Self::Pinned { .. } => FallbackRoute::Pinned,
            Self::Unrouted(r) => *r,
            Self::UnknownModel(_) => FallbackRoute::UnknownModel,
        }
    }
}

/// Picks where a request for `requested` (its `model` field) goes without the indexer;
/// `remembered` is the worker the indexer last placed the session on, if known.
pub fn pick(
    session: Option<SessionKey>,
    fleet: Option<&FleetSnapshot>,
    remembered: Option<&str>,
    requested: Option<&str>,
) -> FallbackPick {
    let model = match fleet.map(|f| models::base_model(f, requested)) {
        Some(Err(unknown)) => return FallbackPick::UnknownModel(unknown.0),
        Some(Ok(base)) => base,
        None => "",
    };
    let Some(key) = session else { return FallbackPick::Unrouted(FallbackRoute::NoSession) };
    let Some(fleet) = fleet else { return FallbackPick::Unrouted(FallbackRoute::NoFleet) };
    let last = remembered
        .and_then(|id| fleet.model_candidates(model).find(|w| w.id == id))
        .filter(|w| is_endpoint(&w.endpoint));
    let Some(pinned) =
        last.or_else(|| fleet.pin(key.0, model)).filter(|w| is_endpoint(&w.endpoint))
    else {
        return FallbackPick::Unrouted(FallbackRoute::NoWorker);
    };
    let ranked = rendezvous::rank(key.0, fleet.model_candidates(model).map(|w| w.id.as_str()));
    let fallbacks = ranked
        .into_iter()
        .filter(|id| *id != pinned.id)
        .filter_map(|id| fleet.workers.iter().find(|w| w.id == id))
        .map(|w| w.endpoint.as_str())
        .filter(|e| is_endpoint(e))
        .take(PIN_FALLBACKS);
    FallbackPick::Pinned {
        worker: pinned.id.clone(),
        header: destination_header(&pinned.endpoint, fallbacks),
        remembered: last.is_some(),
    }
}

#[cfg(test)]
#[path = "tests/fallback.rs"]
mod tests;
