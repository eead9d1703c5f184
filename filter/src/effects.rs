//! The vocabulary between the pure request logic and the host.
//!
//! Pure code decides and returns [`Effect`]s plus a [`Next`] step; `host::http` executes them in
//! order against Envoy and is the only place that performs them. Tests assert on these values
//! instead of mocking a host.

use kvmesh_core::api::DoneReport;
use kvmesh_core::body_base::BodyBase;
use kvmesh_core::session::SessionKey;

use crate::body_bases::Remembered;
use crate::body_budget::Refused;
use crate::breaker::CallHealth;
use crate::metrics::MetricUpdate;
use crate::request::HttpCall;

/// One thing to do to the stream or the world.
#[derive(Debug, Clone, PartialEq)]
pub enum Effect {
    RemoveRequestHeader(&'static str),
    SetRequestHeader(&'static str, String),
    /// Replace the whole buffered request body (`original_len` bytes) with `body`.
    ReplaceRequestBody {
        original_len: usize,
        body: Vec<u8>,
    },
    /// Answer the client locally and end the request here.
    SendResponse {
        status: u16,
        headers: Vec<(&'static str, String)>,
        body: Vec<u8>,
    },
    /// Release a request paused while waiting for the indexer.
    ResumeRequest,
    AddResponseHeader(&'static str, String),
    Metric(MetricUpdate),
    /// Hand a `/v1/done` report to the background dispatcher.
    QueueDone(DoneReport),
    /// Tell the `/v1/route` circuit breaker how a call ended.
    IndexerHealth(CallHealth),
    /// Tell the endpoint ledger how an upstream attempt on `endpoint` went.
    EndpointOutcome {
        endpoint: String,
        ok: bool,
    },
    /// Remember that the indexer placed session `key` on `worker` ([`crate::placement`]).
    RememberPlacement {
        key: SessionKey,
        worker: String,
    },
    /// Update session `key`'s body bases ([`crate::body_bases::remember`]): `new` first, `used`
    /// dropped.
    RememberBodyBase {
        key: SessionKey,
        new: Option<Remembered>,
        used: Option<BodyBase>,
    },
}

/// What the host does after applying a step's effects.
#[derive(Debug, Clone, PartialEq)]
pub enum Next {
    /// Return `Action::Continue` (or nothing more, outside a stream callback).
    Continue,
    /// Return `Action::Pause`.
    Pause,
    /// Read the first `len` bytes of the buffered body and hand them to the flow.
    ReadBody(usize),
    /// The body does not fit the VM's held-body budget: do not read it; hand the refusal and the
    /// fleet to the flow (`RequestFlow::on_body_left`), which routes without the indexer.
    LeaveBody(Refused),
    /// Dispatch this call and report the result to the flow; pause on success.
    Call(HttpCall),
    /// Hand the flow the last fleet snapshot to answer `GET /v1/models` from
    /// (`RequestFlow::on_models_list`).
    ListModels,
}

/// Effects to apply, then the next step.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub effects: Vec<Effect>,
    pub next: Next,
}

impl Step {
    /// A step with no effects.
    pub fn just(next: Next) -> Self {
        Self { effects: Vec::new(), next }
    }
}
