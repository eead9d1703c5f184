//! Routing without the indexer: pin the session by rendezvous over the last fleet snapshot.
//!
//! The primary is [`FleetSnapshot::pin`] — the very function the indexer pins sessions with — so a
//! conversation keeps its worker (and its KV cache) while the indexer is away and when it returns.
//! The next workers of the same rendezvous ranking follow as retry fallbacks. Without a session key
//! or a fleet the header stays unset and Envoy's fallback LB chooses.

use kvmesh_core::api::{destination_header, FleetSnapshot};
use kvmesh_core::rendezvous;
use kvmesh_core::session::SessionKey;

use crate::decision::is_endpoint;
use crate::metrics::FallbackRoute;

/// Retry candidates listed after the pinned worker.
pub const PIN_FALLBACKS: usize = 2;

/// What the local fallback does with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FallbackPick {
    /// Set `x-gateway-destination-endpoint: header`; `worker` is the pinned worker's id.
    Pinned { worker: String, header: String },
    /// Leave the header unset, for this reason.
    Unrouted(FallbackRoute),
}

impl FallbackPick {
    /// The metric label of this pick.
    pub fn label(&self) -> FallbackRoute {
        match self {
            Self::Pinned { .. } => FallbackRoute::Pinned,
            Self::Unrouted(r) => *r,
        }
    }
}

/// Picks where a request goes without the indexer.
pub fn pick(session: Option<SessionKey>, fleet: Option<&FleetSnapshot>) -> FallbackPick {
    let Some(key) = session else { return FallbackPick::Unrouted(FallbackRoute::NoSession) };
    let Some(fleet) = fleet else { return FallbackPick::Unrouted(FallbackRoute::NoFleet) };
    let Some(pinned) = fleet.pin(key.0).filter(|w| is_endpoint(&w.endpoint)) else {
        return FallbackPick::Unrouted(FallbackRoute::NoWorker);
    };
    let ranked = rendezvous::rank(key.0, fleet.decode_candidates().map(|w| w.id.as_str()));
    let fallbacks = ranked
        .into_iter()
        .filter(|id| *id != pinned.id)
        .filter_map(|id| fleet.workers.iter().find(|w| w.id == id))
        .map(|w| w.endpoint.as_str())
        .filter(|e| is_endpoint(e))
        .take(PIN_FALLBACKS);
    FallbackPick::Pinned { worker: pinned.id.clone(), header: destination_header(&pinned.endpoint, fallbacks) }
}

#[cfg(test)]
#[path = "tests/fallback.rs"]
mod tests;
