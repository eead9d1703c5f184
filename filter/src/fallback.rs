//! Routing without the indexer: the session's last worker, else its rendezvous pin over the last
//! fleet snapshot, within the workers of the request's base model.
//!
//! The request's `model` is resolved against the snapshot's models first ([`crate::models`]): a
//! model nobody serves is answered 404 (vLLM's body), never sent to a worker of another model;
//! every worker named (primary and fallbacks) serves the base model.
//!
//! The primary is the worker the indexer last placed the session on, when the filter remembers
//! it ([`crate::placement`]) and the fleet still lists it as a decode candidate of the model: the
//! conversation keeps its KV cache while the indexer is away and when it returns. Otherwise it is
//! [`FleetSnapshot::pin`], a stable choice per session. The model's workers of the session's
//! rendezvous ranking follow as retry fallbacks. Without a fleet the header stays unset and
//! Envoy's fallback LB chooses; so does a request without a session key, unless some healthy decode
//! worker serves another model (Envoy's LB could pick it): then the request is spread over its
//! model's workers by its own key (`spread`). A model whose workers are all unhealthy is pinned
//! among them all rather than left to Envoy's LB, for the same reason.

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
    /// Set `x-gateway-destination-endpoint: header`; `worker` is the pinned worker's id, `how`
    /// [`FallbackRoute::Remembered`] (the session's last placement), [`FallbackRoute::Pinned`]
    /// (its rendezvous pin) or [`FallbackRoute::Spread`] (no session: the request's own key).
    Pinned { worker: String, header: String, how: FallbackRoute },
    /// Leave the header unset, for this reason.
    Unrouted(FallbackRoute),
    /// The snapshot serves no such model (the request's `model`, as sent): answer vLLM's 404.
    UnknownModel(String),
}

impl FallbackPick {
    /// The metric label of this pick.
    pub fn label(&self) -> FallbackRoute {
        match self {
            Self::Pinned { how, .. } => *how,
            Self::Unrouted(r) => *r,
            Self::UnknownModel(_) => FallbackRoute::UnknownModel,
        }
    }
}

/// Picks where a request for `requested` (its `model` field) goes without the indexer;
/// `remembered` is the worker the indexer last placed the session on, if known; `request_key` the
/// request's own key, which spreads a request without a session in a fleet of several models.
pub fn pick(
    session: Option<SessionKey>,
    fleet: Option<&FleetSnapshot>,
    remembered: Option<&str>,
    requested: Option<&str>,
    request_key: u64,
) -> FallbackPick {
    let model = match fleet.map(|f| models::base_model(f, requested)) {
        Some(Err(unknown)) => return FallbackPick::UnknownModel(unknown.0),
        Some(Ok(base)) => base,
        None => "",
    };
    // Envoy's LB may choose only when every worker it could choose serves the model.
    let scoped = fleet.is_some_and(|f| f.decode_candidates().any(|w| w.model != model));
    let (key, how) = match session {
        Some(key) => (key.0, FallbackRoute::Pinned),
        None if scoped => (request_key, FallbackRoute::Spread),
        None => return FallbackPick::Unrouted(FallbackRoute::NoSession),
    };
    let Some(fleet) = fleet else { return FallbackPick::Unrouted(FallbackRoute::NoFleet) };
    let last = remembered
        .filter(|_| session.is_some())
        .and_then(|id| fleet.model_candidates(model).find(|w| w.id == id))
        .filter(|w| is_endpoint(&w.endpoint));
    let healthy = fleet.model_candidates(model).next().is_some();
    // No healthy worker of the model: its other workers, before another model's.
    let candidates = || {
        fleet.workers.iter().filter(move |w| {
            w.model == model && w.role.decodes() && (w.healthy || (!healthy && scoped))
        })
    };
    let pinned = last.or_else(|| match healthy {
        // The indexer's session pin ranks the same set the same way.
        true => fleet.pin(key, model),
        false => rendezvous::pick(key, candidates().map(|w| w.id.as_str()))
            .and_then(|id| fleet.workers.iter().find(|w| w.id == id)),
    });
    let Some(pinned) = pinned.filter(|w| is_endpoint(&w.endpoint)) else {
        return FallbackPick::Unrouted(FallbackRoute::NoWorker);
    };
    let ranked = rendezvous::rank(key, candidates().map(|w| w.id.as_str()));
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
        how: if last.is_some() { FallbackRoute::Remembered } else { how },
    }
}

#[cfg(test)]
#[path = "tests/fallback.rs"]
mod tests;
