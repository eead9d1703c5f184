//! The request's model as the filter sees it, against its last fleet snapshot: which base model's
//! workers may serve it ([`base_model`]), the answer for a model nobody serves ([`not_found`]),
//! and the gateway's `GET /v1/models` ([`is_models_list`], [`models_list`]).
//!
//! Resolution is core's ([`kvmesh_core::models::resolve`]), the indexer's too, so the filter's
//! fallback pins a request within the same workers the indexer would route it to. Pure: the
//! snapshot and the clock are passed in.

use kvmesh_core::api::{FleetSnapshot, ERROR_REASON_HEADER};
use kvmesh_core::headers;
use kvmesh_core::models::{self, UnknownModel, UNKNOWN_MODEL_REASON};

use crate::effects::Effect;
use crate::metrics::OTHER_MODEL_LABEL;

/// The gateway's model list path.
pub const MODELS_PATH: &str = "/v1/models";

/// Whether a request is the gateway's model list: `GET` on exactly [`MODELS_PATH`] (a query string
/// allowed, no trailing slash).
pub fn is_models_list(method: &str, path: &str) -> bool {
    method == "GET" && path.split('?').next() == Some(MODELS_PATH)
}

/// The base model whose workers may serve a request for `requested` (its `model` field), by the
/// snapshot's models. A snapshot without models (from an indexer that predates them) pins among
/// its workers as before: `""`, the model its workers carry.
pub fn base_model<'a>(
    fleet: &'a FleetSnapshot,
    requested: Option<&str>,
) -> Result<&'a str, UnknownModel> {
    if fleet.models.is_empty() {
        return Ok("");
    }
    models::resolve(&fleet.models, requested).map(|m| m.base)
}

/// What a request's metrics are labelled with ([`crate::metrics::ModelLabels`]): its base model
/// ([`base_model`]) when it is one of the snapshot's first `max_labels` models (the fleet's order,
/// the default first: the same set on every worker thread and every gateway), `other` past them;
/// none (`unknown`) when the filter does not know it (no snapshot, an unknown model, a snapshot
/// without models).
pub fn label_model(
    fleet: Option<&FleetSnapshot>,
    requested: Option<&str>,
    max_labels: usize,
) -> Option<String> {
    let fleet = fleet?;
    let base = base_model(fleet, requested).ok().filter(|b| !b.is_empty())?;
    let rank = fleet.models.iter().position(|m| m.name == base)?;
    Some(if rank < max_labels { base.to_owned() } else { OTHER_MODEL_LABEL.to_owned() })
}

/// vLLM's 404 for a model nobody serves (`kvmesh_core::models::not_found`: message, type
/// `NotFoundError`, param `model`, code 404, and kvmesh's stable reason), with
/// `x-kvmesh-error: unknown_model`.
pub fn not_found(requested: &str, request_id: &str) -> Effect {
    // A struct of strings and numbers: serialisation cannot fail.
    let body = serde_json::to_vec(&models::not_found(requested)).unwrap_or_default();
    Effect::SendResponse {
        status: 404,
        headers: vec![
            ("content-type", "application/json".to_owned()),
            (headers::REQUEST_ID, request_id.to_owned()),
            (ERROR_REASON_HEADER, UNKNOWN_MODEL_REASON.to_owned()),
        ],
        body,
    }
}

/// The answer to a body the VM has no room for when the fleet serves several base models: its
/// `model` was not read, so any worker picked could be one that does not serve it. A 503 with
/// `retry-after: 1`, in the OpenAI error shape, reason `body_budget`.
pub fn body_budget_busy(request_id: &str) -> Effect {
    let error = kvmesh_core::api::ErrorBody::with_reason(
        503,
        "ServiceUnavailableError",
        BODY_BUDGET_REASON,
        "the gateway is holding too many request bodies to read this one; retry",
    );
    let body = serde_json::to_vec(&error).unwrap_or_default();
    Effect::SendResponse {
        status: 503,
        headers: vec![
            ("content-type", "application/json".to_owned()),
            ("retry-after", "1".to_owned()),
            (headers::REQUEST_ID, request_id.to_owned()),
            (ERROR_REASON_HEADER, BODY_BUDGET_REASON.to_owned()),
        ],
        body,
    }
}

/// The stable reason of [`body_budget_busy`].
pub const BODY_BUDGET_REASON: &str = "body_budget";

/// `GET /v1/models` from the snapshot ([`kvmesh_core::models::models_list`], `created` =
/// `now_secs`); None for a snapshot without models (the request then goes to an engine).
pub fn models_list(fleet: &FleetSnapshot, now_secs: u64, request_id: &str) -> Option<Effect> {
    if fleet.models.is_empty() {
        return None;
    }
    let body = serde_json::to_vec(&models::models_list(&fleet.models, now_secs)).ok()?;
    Some(Effect::SendResponse {
        status: 200,
        headers: vec![
            ("content-type", "application/json".to_owned()),
            (headers::REQUEST_ID, request_id.to_owned()),
        ],
        body,
    })
}

#[cfg(test)]
#[path = "tests/models.rs"]
pub(crate) mod tests;
