//! Stage: the operator's override. `x-kvmesh-worker` naming a decode candidate decides alone;
//! naming a worker that gets no traffic (unhealthy, or a role that does not decode) is ignored and
//! said in the reason; naming no worker at all is the caller's error (400), not a fallback.

use super::plan::{DecideError, RouteInput, WorkerView};
use super::reason::IgnoredOverride;
use super::score::{Candidates, Scored};

/// What the override stage found.
pub(crate) enum Override<'v, 'a> {
    /// No `x-kvmesh-worker`.
    Absent,
    /// It named this candidate: the decision.
    Honoured(Scored<'v, 'a>),
    /// It named a worker that gets no traffic: the decision goes on without it.
    Ignored(IgnoredOverride<'a>),
}

/// The override stage for `input` over `workers` and their scored candidates.
pub(crate) fn override_worker<'v, 'a>(
    input: &RouteInput<'_>,
    workers: &'v [WorkerView<'a>],
    cands: &Candidates<'v, 'a>,
) -> Result<Override<'v, 'a>, DecideError> {
    let Some(id) = input.override_worker else {
        return Ok(Override::Absent);
    };
    let at = workers
        .iter()
        .position(|w| w.id == id)
        .ok_or_else(|| DecideError::UnknownOverrideWorker(id.to_owned()))?;
    Ok(match cands.get(at) {
        Some(s) => Override::Honoured(s),
        None => Override::Ignored(IgnoredOverride {
            worker: workers[at].id,
            healthy: workers[at].healthy,
        }),
    })
}
