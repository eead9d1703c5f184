//! One request's life in the filter, as a pure state machine.
//!
//! ```text
//! headers ──(routable POST)──▶ Buffering ──(end of body, parsed)──▶ Routing ──(answer)──▶ Forwarded
//!    │                            │                                   ├──(prefill overload)──▶ Rejected
//!    └──(anything else)──▶ Forwarded ◀──(too large / not JSON / …)───┘──(anything else)──▶ Forwarded (fallback)
//!                                 └──(body ≤ local_route_max_body_bytes)──▶ Forwarded (routed locally, no call)
//! ```
//! Every callback of `host::http` maps to one method here that takes plain data (header pairs, body
//! bytes, status, clock) and returns a [`Step`]. The only outside knowledge it asks for is the last
//! fleet snapshot, through [`FleetSource`]: for the body's model (its label; its workers on the
//! fallback path) and for `GET /v1/models`. Whatever happens, the request goes on (`Continue` /
//! `ResumeRequest`) — except the indexer's designed prefill-overload rejection and the filter's
//! own answers (`Answered`: `GET /v1/models` from the last fleet snapshot, and vLLM's 404 for a
//! model nobody serves, said by the indexer or, routing without it, by the snapshot:
//! [`crate::models`]). The request's base model labels its metrics ([`RequestFlow::model`]).
//! With `defer_to_picker` a request that arrives with a destination set (by the GIE endpoint
//! picker in front, the `both` edge) goes on from its headers untouched ([`RequestFlow::model`]
//! stays unknown, `mode="picker"`); the filter routes only the ones that arrive without.
//! [`RequestFlow::finish`] runs once, at stream end or destruction, and books the outcome; whenever
//! the indexer may have booked the request (a decision, a rejection, a call still out, or a
//! fallback after an answer was lost) it queues a `/v1/done` echoing the booking id.
//!
//! Over 600 lines: one request's state machine, every phase of which reads and writes the same
//! `RequestFlow` fields; its pure steps live in their own modules (body, splice, decision,
//! fallback, models, placement) and its tests in `tests/flow.rs`, `tests/flow_models.rs` and `tests/flow_picker.rs`. Splitting the phases apart would spread
//! one invariant (who books, who reports done) over several files.

use std::rc::Rc;

use kvmesh_core::api::{
    DoneReport, ErrorBody, FleetSnapshot, Outcome, RouteDecision, ERROR_REASON_HEADER,
};
use kvmesh_core::body_base::{BodyBase, BASE_UNKNOWN, BASE_UNKNOWN_STATUS, MIN_BODY_BYTES};
use kvmesh_core::hashing::xxh3;
use kvmesh_core::headers;
use kvmesh_core::openai::Endpoint;
use kvmesh_core::session::{SessionKey, SessionSource};
use kvmesh_core::usage::UsageTail;

use crate::body;
use crate::body_bases::{self, Remembered};
use crate::body_budget::{BodyBudget, Refused, Reservation};
use crate::breaker::CallHealth;
use crate::config::FilterConfig;
use crate::decision::{self, Fallback, IndexerAnswer};
use crate::effects::{Effect, Next, Step};
use crate::endpoints;
use crate::fallback::{self, FallbackPick};
use crate::metrics::{
    hit_rate_permille, FallbackReason, InternalError, LocalAnswer, Metric, MetricUpdate,
    OutcomeLabel, PickerDestination, RouteBody, RouteLabel, UnroutableReason,
};
use crate::models;
use crate::request::{self, OverrideTrust, RequestHead};
use crate::splice;
use crate::ttft::TtftProbe;

/// The key spliced into the body for the serving worker.
pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

pub use kvmesh_core::headers::ENVOY_MAX_RETRIES;

/// Gives the fallback the last fleet snapshot (shared data in Envoy, a fixture in tests).
pub trait FleetSource {
    fn fleet(&self) -> Option<Rc<FleetSnapshot>>;

    /// A destination list with the endpoints the filter's passive health ejected moved to the end
    /// ([`crate::endpoints::EndpointHealth::reorder`]), and how many moved.
    fn reorder_endpoints(&self, list: &str) -> (String, usize) {
        (list.to_owned(), 0)
    }

    /// The worker the indexer last placed session `key` on, if remembered ([`crate::placement`]).
    fn placed(&self, _key: SessionKey) -> Option<String> {
        None
    }

    /// The body bases the indexer named for session `key`, most recent first ([`crate::body_bases`]).
    fn body_bases(&self, _key: SessionKey) -> Vec<Remembered> {
        Vec::new()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Headers,
    Buffering,
    Routing,
    Forwarded,
    Rejected,
    /// `GET /v1/models`, waiting for the host to hand over the fleet ([`Next::ListModels`]).
    Listing,
    /// Answered by the filter itself (model list, unknown model), with this status.
    Answered(u16),
    Finished,
}

/// Where the done report points: the endpoint the request went to (the decided one, replaced by
/// the host that served once Envoy says which) and the indexer's booking id, when known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct DoneTarget {
    endpoint: Option<String>,
    booking_id: Option<String>,
}

/// The filter's state for one request.
#[derive(Debug)]
pub struct RequestFlow {
    config: Rc<FilterConfig>,
    context_id: u32,
    phase: Phase,
    head: RequestHead,
    request_id: String,
    endpoint: Option<Endpoint>,
    session: Option<(SessionKey, SessionSource)>,
    buffered: usize,
    /// The client's body while the route call is out (shared with the call: a splice needs it).
    body: Rc<Vec<u8>>,
    /// This VM's budget of held bodies, and this request's share of it: taken before the body is
    /// read, given back with the body ([`Self::drop_body`]) or when the flow is dropped.
    budget: Rc<BodyBudget>,
    held: Option<Reservation>,
    /// The body base the route call out was sent after (it carried only the bytes past it).
    sent_after: Option<BodyBase>,
    /// The route call out is the whole body again, sent from the answer callback.
    resending: bool,
    route_started_ns: u64,
    /// Measures TTFT at the first response byte against the decision's prediction.
    ttft: TtftProbe,
    route: RouteLabel,
    /// Set when the indexer may have booked this request: what the done report says.
    report_done: Option<DoneTarget>,
    /// The first endpoint the filter named (after steering), for the endpoint ledger.
    primary: Option<String>,
    rejected_status: Option<u16>,
    debug: Vec<(&'static str, String)>,
    response_status: Option<u16>,
    response_complete: bool,
    /// [`Self::release_marker`] has been handed out.
    marked_released: bool,
    /// The body's `model`, as sent.
    requested_model: Option<String>,
    /// The base model labelling this request's metrics, `other` past the fleet's first
    /// `max_model_labels` (None: not known; [`models::label_model`]).
    model: Option<String>,
    /// The response's last bytes, kept to read the engine's `usage` for the done report: only for
    /// a 2xx response to a request the indexer booked ([`Self::response_tail_wanted`]).
    usage_tail: Option<UsageTail>,
}

impl RequestFlow {
    /// A fresh flow for HTTP context `context_id`, with a budget of its own (tests); the filter
    /// gives every flow of a VM the same one ([`Self::with_body_budget`]).
    pub fn new(config: Rc<FilterConfig>, context_id: u32) -> Self {
        let budget = BodyBudget::new(config.held_body_budget_bytes);
        Self {
            config,
            context_id,
            phase: Phase::Headers,
            head: RequestHead::default(),
            request_id: String::new(),
            endpoint: None,
            session: None,
            buffered: 0,
            body: Rc::default(),
            budget,
            held: None,
            sent_after: None,
            resending: false,
            route_started_ns: 0,
            ttft: TtftProbe::default(),
            route: RouteLabel::Unrouted,
            report_done: None,
            primary: None,
            rejected_status: None,
            debug: Vec::new(),
            response_status: None,
            response_complete: false,
            marked_released: false,
            requested_model: None,
            model: None,
            usage_tail: None,
        }
    }

    /// This flow reserves its body in `budget`, the one its VM's flows share.
    pub fn with_body_budget(mut self, budget: Rc<BodyBudget>) -> Self {
        self.budget = budget;
        self
    }

    /// Once the filter lets the request go on (routed, fallen back, routed locally or not
    /// routable), the header that moves it onto Envoy's route with the normal stream idle timeout
    /// ([`headers::RELEASED`]); `None` before, after, and for a request answered here. The host
    /// asks after every step and applies it first: the header edit makes Envoy pick the route
    /// again before the router runs. While the filter holds the request it stays on a route with a
    /// short idle timeout, which is what answers it if the VM traps meanwhile (Envoy never resumes
    /// a stream paused in a failed VM).
    pub fn release_marker(&mut self) -> Option<Effect> {
        if self.phase != Phase::Forwarded || self.marked_released {
            return None;
        }
        self.marked_released = true;
        Some(Effect::SetRequestHeader(headers::RELEASED, "1".to_owned()))
    }

    /// The base model this request's metrics are labelled with (None: `model="unknown"`): known
    /// once the body is read, from the last fleet snapshot.
    pub fn model(&self) -> Option<&str> {
        self.model.as_deref()
    }

    /// The request id used on `/v1/route` and `/v1/done` (and in logs).
    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Whether the outcome is booked ([`Self::finish`] ran): later stream ends need no host reads.
    pub fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    /// Request headers: strip what clients must not set, decide whether to buffer the body.
    pub fn on_request_headers(
        &mut self,
        pairs: &[(String, Vec<u8>)],
        end_of_stream: bool,
        now_ns: u64,
    ) -> Step {
        if self.phase != Phase::Headers {
            return Step::just(Next::Continue);
        }
        self.head = RequestHead::from_headers(pairs, &self.config.session_header);
        self.ttft.arrived(now_ns);
        if self.config.defer_to_picker && self.head.client_destination {
            return self.defer_to_picker();
        }
        let mut effects = Vec::new();
        if self.config.defer_to_picker {
            effects.push(Effect::Metric(MetricUpdate::Add(
                Metric::PickerDestinations(PickerDestination::Absent),
                1,
            )));
        }
        if self.head.client_destination {
            effects.push(Effect::RemoveRequestHeader(headers::DESTINATION_ENDPOINT));
        }
        if self.head.sent_override_secret {
            // The secret is for the filter alone: it never reaches the indexer or an engine.
            effects.push(Effect::RemoveRequestHeader(headers::OVERRIDE_SECRET));
        }
        if let OverrideTrust::Refused(reason) = request::override_trust(&self.config, &self.head) {
            log::debug!(
                "ctx={} request_id={:?} override refused: {}",
                self.context_id,
                self.head.request_id,
                reason.as_str()
            );
            self.head.override_worker = None;
            self.head.override_mode = None;
            effects.push(Effect::RemoveRequestHeader(headers::OVERRIDE_WORKER));
            effects.push(Effect::RemoveRequestHeader(headers::OVERRIDE_MODE));
            effects.push(Effect::Metric(MetricUpdate::Add(Metric::OverridesRefused(reason), 1)));
        }
        self.request_id = match &self.head.request_id {
            Some(id) => self.name_for_indexer(id, &mut effects),
            None => {
                // Envoy generates x-request-id unless told not to; make one so route and done agree.
                let id = format!("kvmesh-{:x}-{:x}", self.context_id, now_ns);
                effects.push(Effect::SetRequestHeader(headers::REQUEST_ID, id.clone()));
                id
            }
        };
        self.endpoint = Endpoint::from_path(&self.head.path);
        if models::is_models_list(&self.head.method, &self.head.path) {
            self.phase = Phase::Listing;
            return Step { effects, next: Next::ListModels };
        }
        let unroutable = if self.endpoint.is_none() {
            Some(UnroutableReason::UnknownPath)
        } else if self.head.method != "POST" {
            Some(UnroutableReason::Method)
        } else if end_of_stream {
            Some(UnroutableReason::NoBody)
        } else {
            None
        };
        if let Some(reason) = unroutable {
            effects.push(self.unroutable(reason));
            self.phase = Phase::Forwarded;
            return Step { effects, next: Next::Continue };
        }
        self.phase = Phase::Buffering;
        Step { effects, next: Next::Pause }
    }

    /// `defer_to_picker` and the request carries a destination: the endpoint picker in front set
    /// it (the bootstrap strips a client's before `ext_proc`), and booked the request — it
    /// releases the booking itself. The request goes on as it is: no body read, no route call, no
    /// done report; only the endpoint ledger hears how its first endpoint did.
    fn defer_to_picker(&mut self) -> Step {
        self.request_id = self.head.request_id.clone().unwrap_or_default();
        self.primary =
            self.head.destination.as_deref().and_then(|d| d.split(',').next()).map(str::to_owned);
        self.route = RouteLabel::Picker;
        self.phase = Phase::Forwarded;
        log::debug!(
            "ctx={} request_id={} destination set by the endpoint picker: {}",
            self.context_id,
            self.request_id,
            self.head.destination.as_deref().unwrap_or("(over 256 bytes)")
        );
        let deferred = Metric::PickerDestinations(PickerDestination::Deferred);
        Step { effects: vec![Effect::Metric(MetricUpdate::Add(deferred, 1))], next: Next::Continue }
    }

    /// `GET /v1/models` ([`Next::ListModels`]): answered from the last fleet snapshot's models
    /// (`now_ns`: wall clock, for `created`); without a snapshot (or models in it) it goes to an
    /// engine, as any path the filter does not route.
    pub fn on_models_list(&mut self, fleet: &dyn FleetSource, now_ns: u64) -> Step {
        if self.phase != Phase::Listing {
            return Step::just(Next::Continue);
        }
        let snapshot = fleet.fleet();
        let answer = snapshot
            .as_deref()
            .and_then(|f| models::models_list(f, now_ns / 1_000_000_000, &self.request_id));
        let Some(answer) = answer else {
            self.phase = Phase::Forwarded;
            return Step {
                effects: vec![self.unroutable(UnroutableReason::UnknownPath)],
                next: Next::Continue,
            };
        };
        log::debug!(
            "ctx={} request_id={} GET /v1/models answered from the fleet snapshot",
            self.context_id,
            self.request_id
        );
        self.phase = Phase::Answered(200);
        Step {
            effects: vec![
                Effect::Metric(MetricUpdate::Add(Metric::LocalAnswers(LocalAnswer::ModelsList), 1)),
                answer,
            ],
            next: Next::Pause,
        }
    }

    /// A body chunk arrived; `buffered` is the size Envoy holds so far.
    pub fn on_request_body(&mut self, buffered: usize, end_of_stream: bool) -> Step {
        if self.phase != Phase::Buffering {
            return Step::just(Next::Continue);
        }
        self.buffered = buffered;
        if buffered > self.config.max_body_bytes {
            self.phase = Phase::Forwarded;
            return Step {
                effects: vec![self.unroutable(UnroutableReason::BodyTooLarge)],
                next: Next::Continue,
            };
        }
        if end_of_stream {
            self.read_body(buffered)
        } else {
            Step::just(Next::Pause)
        }
    }

    /// Request trailers end the body too.
    pub fn on_request_trailers(&mut self) -> Step {
        if self.phase != Phase::Buffering {
            return Step::just(Next::Continue);
        }
        self.read_body(self.buffered)
    }

    /// The whole body is buffered (`len` bytes): read it into the VM if it fits the VM's
    /// held-body budget (reserved until the body is dropped), else leave it unread.
    fn read_body(&mut self, len: usize) -> Step {
        match self.budget.reserve(len) {
            Ok(reservation) => {
                self.held = Some(reservation);
                Step::just(Next::ReadBody(len))
            }
            Err(refused) => Step::just(Next::LeaveBody(refused)),
        }
    }

    /// The body did not fit the held-body budget ([`Next::LeaveBody`]) and was not read: routed
    /// without the indexer, as its fallback would, by the session header's key (a body's derived
    /// key needs the body) — else Envoy's fallback LB chooses. Counted as fallback reason
    /// `body_budget`; logged for the first refusal and one in [`crate::body_budget::LOG_EVERY`].
    pub fn on_body_left(&mut self, refused: Refused, fleet: &dyn FleetSource) -> Step {
        if self.phase != Phase::Buffering {
            return Step::just(Next::Continue);
        }
        if refused.logged() {
            log::warn!(
                "ctx={} request_id={} body of {} bytes not read: {} of the VM's held_body_budget_bytes {} are held by requests waiting for the indexer; routed without the indexer (refusal {} on this thread)",
                self.context_id,
                self.request_id,
                refused.wanted,
                refused.held,
                refused.limit,
                refused.nth
            );
        }
        // The body's `model` is not read: with several base models any pick could be a worker
        // that does not serve it. Only a one-model fleet is routed without it.
        if fleet.fleet().is_some_and(|f| f.models.len() > 1) {
            self.phase = Phase::Answered(503);
            self.route = RouteLabel::Unrouted;
            self.drop_body();
            self.debug.clear();
            let effects = vec![
                Effect::Metric(MetricUpdate::Add(Metric::Fallbacks(FallbackReason::BodyBudget), 1)),
                Effect::Metric(MetricUpdate::Add(Metric::LocalAnswers(LocalAnswer::BodyBudget), 1)),
                models::body_budget_busy(&self.request_id),
            ];
            return Step { effects, next: Next::Pause };
        }
        self.session = request::anchored_session_key(&self.head, None, false);
        let effects = self.fallback(Fallback::new(FallbackReason::BodyBudget), fleet);
        Step { effects, next: Next::Continue }
    }

    /// Drops the held body and gives its bytes back to the budget.
    fn drop_body(&mut self) {
        self.body = Rc::default();
        self.held = None;
    }

    /// The whole body (None if Envoy had none): parse, derive the session, ask the indexer — or,
    /// for a body of at most `local_route_max_body_bytes` without operator overrides, route it
    /// here ([`Self::route_locally`]).
    pub fn on_body(&mut self, body: Option<Vec<u8>>, now_ns: u64, fleet: &dyn FleetSource) -> Step {
        let (Phase::Buffering, Some(endpoint)) = (self.phase, self.endpoint) else {
            return Step::just(Next::Continue);
        };
        self.phase = Phase::Forwarded;
        // Given back on every early return below; kept only with a body held for the route call.
        let reservation = self.held.take();
        let body = match body {
            Some(b) if b.len() > self.config.max_body_bytes => {
                return Step {
                    effects: vec![self.unroutable(UnroutableReason::BodyTooLarge)],
                    next: Next::Continue,
                };
            }
            Some(b) if !b.is_empty() => b,
            _ => {
                return Step {
                    effects: vec![self.unroutable(UnroutableReason::NoBody)],
                    next: Next::Continue,
                }
            }
        };
        // The light read: parse's verdict, `stream` and the anchor, mostly without serde (`body`).
        // The anchor only matters for a derived key: a session header wins over it.
        let derive = self.config.derive_session_keys;
        let anchor = self.head.session_id.is_none() && derive;
        // A long conversation's body after a base the indexer holds: only the bytes past it are
        // sent, and the read goes on from the base's end (`body::Skip`), chosen once the anchor
        // is read. `chosen`: the key it was chosen for, and the base.
        let bases_on = self.config.body_base_slots > 0 && body.len() > MIN_BODY_BYTES;
        let base_for = |key: Option<SessionKey>| {
            key.filter(|_| bases_on)
                .and_then(|key| body_bases::choose(&fleet.body_bases(key), &body))
        };
        let mut chosen = None;
        let mut skip = |digest: Option<u64>| {
            let key = request::anchored_session_key(&self.head, digest, derive).map(|(key, _)| key);
            let base = base_for(key);
            chosen = Some((key, base));
            base.map(|b| b.len)
        };
        let parsed = match body::read(endpoint, &body, anchor, &mut skip) {
            Ok(p) => p,
            Err(e) => {
                log::debug!(
                    "ctx={} request_id={} unroutable body: {e}",
                    self.context_id,
                    self.request_id
                );
                let reason = UnroutableReason::from_parse_error(&e);
                return Step { effects: vec![self.unroutable(reason)], next: Next::Continue };
            }
        };
        self.session = request::peeked_session_key(&self.head, &parsed, derive);
        self.ttft.set_stream(parsed.stream);
        self.note_model(parsed.model, fleet);
        if body.len() <= self.config.local_route_max_body_bytes && !self.head.has_overrides() {
            let effects = self.route_locally(body.len(), fleet);
            return Step { effects, next: self.after_local_pick() };
        }
        let key = self.session.map(|(key, _)| key);
        self.sent_after = match chosen {
            Some((chosen_for, base)) if chosen_for == key => base,
            // The scan declined before the anchor (or read no chat): chosen here, as before.
            _ => base_for(key),
        };
        self.body = Rc::new(body);
        self.held = reservation;
        self.phase = Phase::Routing;
        self.route_started_ns = now_ns;
        let sent = if self.sent_after.is_some() { RouteBody::Delta } else { RouteBody::Whole };
        Step {
            effects: vec![Effect::Metric(MetricUpdate::Add(Metric::RouteBodies(sent), 1))],
            next: Next::Call(self.route_call(now_ns)),
        }
    }

    /// The route call for the body held, after [`Self::sent_after`] if set, sent at `now_ns`.
    fn route_call(&self, now_ns: u64) -> request::HttpCall {
        let endpoint = self.endpoint.unwrap_or(Endpoint::ChatCompletions);
        let mut call = request::route_call(
            &self.config,
            &self.request_id,
            endpoint,
            self.session,
            &self.head,
            Rc::clone(&self.body),
            self.sent_after,
        );
        request::stamp_route_deadline(&mut call, &self.config, now_ns);
        call
    }

    /// The session's body bases after `answer` to a call sent after [`Self::sent_after`]: the base
    /// the answer names first, the one used dropped.
    fn remember_body_base(&self, named: Option<BodyBase>) -> Option<Effect> {
        let (key, _) = self.session?;
        let new = named.and_then(|base| Remembered::new(base, &self.body));
        (self.config.body_base_slots > 0 && (new.is_some() || self.sent_after.is_some()))
            .then_some(Effect::RememberBodyBase { key, new, used: self.sent_after })
    }

    /// `dispatch_http_call` refused the route call: route without the indexer, right away.
    pub fn on_dispatch_failed(&mut self, fleet: &dyn FleetSource) -> Step {
        if self.phase != Phase::Routing {
            return Step::just(Next::Continue);
        }
        let mut effects = vec![Effect::IndexerHealth(CallHealth::Failed)];
        effects.extend(self.fallback(Fallback::new(FallbackReason::DispatchFailed), fleet));
        effects.extend(self.resume_if_resending());
        Step { effects, next: self.after_local_pick() }
    }

    /// The circuit breaker is open: route without asking the indexer.
    pub fn on_call_skipped(&mut self, fleet: &dyn FleetSource) -> Step {
        if self.phase != Phase::Routing {
            return Step::just(Next::Continue);
        }
        let mut effects = self.fallback(Fallback::new(FallbackReason::BreakerOpen), fleet);
        effects.extend(self.resume_if_resending());
        Step { effects, next: self.after_local_pick() }
    }

    /// A call that never went out leaves the request paused; in the body callback `Continue` goes
    /// on, but a whole body resent from the answer callback must resume it as an effect.
    fn resume_if_resending(&self) -> Option<Effect> {
        (self.resending && !self.answered()).then_some(Effect::ResumeRequest)
    }

    /// Whether the filter answered the request itself.
    fn answered(&self) -> bool {
        matches!(self.phase, Phase::Answered(_))
    }

    /// What a stream callback returns after a local pick: `Continue`, or `Pause` when the pick
    /// answered the client (a local reply must not let the request go on).
    fn after_local_pick(&self) -> Next {
        if self.answered() {
            Next::Pause
        } else {
            Next::Continue
        }
    }

    /// The indexer's answer (status None = no headers). The request is paused; every path resumes
    /// it or answers it.
    pub fn on_route_answer(
        &mut self,
        status: Option<u16>,
        body: &[u8],
        now_ns: u64,
        fleet: &dyn FleetSource,
    ) -> Step {
        if self.phase != Phase::Routing {
            return Step::just(Next::Continue);
        }
        if self.sent_after.is_some() && status == Some(BASE_UNKNOWN_STATUS) && base_unknown(body) {
            // The indexer no longer holds the base (evicted, restarted): forget it, send it all.
            log::debug!("ctx={} request_id={} the indexer no longer holds the body base; sending the whole body", self.context_id, self.request_id);
            let forget = self.remember_body_base(None);
            self.sent_after = None;
            self.resending = true;
            let mut effects = vec![
                Effect::IndexerHealth(CallHealth::Answered),
                Effect::Metric(MetricUpdate::Add(Metric::RouteBodies(RouteBody::Resent), 1)),
            ];
            effects.extend(forget);
            return Step { effects, next: Next::Call(self.route_call(now_ns)) };
        }
        let latency_us = now_ns.saturating_sub(self.route_started_ns) / 1_000;
        let mut effects =
            vec![Effect::Metric(MetricUpdate::Record(Metric::RouteLatency, latency_us))];
        let answer = if body.len() > decision::MAX_ANSWER_BYTES {
            IndexerAnswer::Fallback(Fallback::new(FallbackReason::BadResponse))
        } else {
            decision::classify(status, body)
        };
        let health = match &answer {
            IndexerAnswer::Fallback(fb) => fb.reason.health().unwrap_or(CallHealth::Answered),
            IndexerAnswer::Route(_)
            | IndexerAnswer::Reject { .. }
            | IndexerAnswer::UnknownModel => CallHealth::Answered,
        };
        effects.push(Effect::IndexerHealth(health));
        match answer {
            IndexerAnswer::Route(d) => {
                effects.extend(self.remember_body_base(d.body_base));
                effects.extend(self.apply(*d, fleet));
            }
            IndexerAnswer::Reject { status, body, detail } => {
                log::info!(
                    "ctx={} request_id={} indexer rejected the request with {status} reason={} detail={detail:?}",
                    self.context_id,
                    self.request_id,
                    decision::PREFILL_OVERLOADED
                );
                self.phase = Phase::Rejected;
                self.rejected_status = Some(status);
                self.report_done = Some(DoneTarget::default());
                self.drop_body();
                effects.push(Effect::SendResponse {
                    status,
                    headers: vec![
                        ("content-type", "application/json".to_owned()),
                        (headers::REQUEST_ID, self.request_id.clone()),
                        (ERROR_REASON_HEADER, decision::PREFILL_OVERLOADED.to_owned()),
                    ],
                    body,
                });
                return Step { effects, next: Next::Continue };
            }
            IndexerAnswer::UnknownModel => {
                effects.extend(self.answer_unknown_model(LocalAnswer::UnknownModel));
                return Step { effects, next: Next::Continue };
            }
            IndexerAnswer::Fallback(reason) => effects.extend(self.fallback(reason, fleet)),
        }
        if !self.answered() {
            effects.push(Effect::ResumeRequest);
        }
        Step { effects, next: Next::Continue }
    }

    /// Response headers: remember the status; add debug headers when enabled.
    pub fn on_response_headers(&mut self, status: Option<u16>, end_of_stream: bool) -> Vec<Effect> {
        self.response_status = status;
        self.response_complete |= end_of_stream;
        // The engine's usage goes with the done report of a booking the indexer made.
        let booked = self.report_done.as_ref().is_some_and(|t| t.booking_id.is_some());
        let ok = status.is_some_and(|s| (200..300).contains(&s));
        self.usage_tail = (booked && ok && !self.answered_here()).then(UsageTail::default);
        if !self.config.debug_headers || self.answered_here() {
            return Vec::new();
        }
        self.debug.iter().map(|(n, v)| Effect::AddResponseHeader(n, v.clone())).collect()
    }

    /// Response body bytes arrived (`bytes` in this chunk): the first ones of a streamed 2xx
    /// response record the TTFT histograms (`crate::ttft`).
    pub fn on_response_data(&mut self, bytes: usize, now_ns: u64) -> Vec<Effect> {
        if self.answered_here() {
            return Vec::new();
        }
        self.ttft.on_response_bytes(self.response_status, bytes, now_ns)
    }

    /// Whether [`Self::on_response_data`] can still record anything (the TTFT of a streamed
    /// response before its first byte). Envoy calls the filter for every response chunk — one per
    /// streamed token — and the clock is a host call: after the first byte it is not read.
    pub fn awaits_first_byte(&self) -> bool {
        !self.answered_here() && self.ttft.pending()
    }

    /// Whether the response is the filter's own (a relayed rejection or a local answer).
    fn answered_here(&self) -> bool {
        self.phase == Phase::Rejected || self.answered()
    }

    /// A response body chunk; the last one completes the response.
    pub fn on_response_body(&mut self, end_of_stream: bool) {
        self.response_complete |= end_of_stream;
    }

    /// How many bytes at the end of a response chunk of `len` bytes the host should read and hand
    /// to [`Self::on_response_tail`]: the chunk's last `kvmesh_core::usage::USAGE_TAIL_BYTES` while
    /// the usage scan runs, else 0 (nothing read: a response the indexer did not book, not 2xx,
    /// or answered here). The response itself is never held: Envoy passes every chunk on.
    pub fn response_tail_wanted(&self, len: usize) -> usize {
        self.usage_tail.as_ref().map_or(0, |t| t.wanted(len))
    }

    /// The last bytes of a response chunk of `chunk_len` bytes ([`Self::response_tail_wanted`]).
    pub fn on_response_tail(&mut self, tail: &[u8], chunk_len: usize) {
        if let Some(t) = self.usage_tail.as_mut() {
            t.push(tail, chunk_len);
        }
    }

    /// Response trailers complete the response.
    pub fn on_response_trailers(&mut self) {
        self.response_complete = true;
    }

    /// The stream is over (logged, done or destroyed). Books the outcome once; later calls do nothing.
    /// `final_status` is Envoy's `response.code` when known: it covers local replies the filter never
    /// saw (e.g. a 413 from the buffer filter in front of it).
    /// [`Self::finish`], first telling the endpoint ledger how the upstream attempts went:
    /// `served` is the host of the last attempt (`upstream.address`), when there was one.
    pub fn finish_upstream(
        &mut self,
        final_status: Option<u16>,
        served: Option<&str>,
    ) -> Vec<Effect> {
        if self.phase == Phase::Finished {
            return Vec::new();
        }
        let status = self.response_status.or(final_status.filter(|s| *s > 0));
        // The done report names the host that served (after a retry or a fallback to another host,
        // not the one decided); the indexer releases the booking by its id either way.
        if let (Some(target), Some(host)) = (self.report_done.as_mut(), served) {
            target.endpoint = Some(host.to_owned());
        }
        let mut effects: Vec<Effect> =
            endpoints::attempt_outcomes(self.primary.as_deref(), served, status)
                .into_iter()
                .map(|(endpoint, ok)| Effect::EndpointOutcome { endpoint, ok })
                .collect();
        effects.extend(self.finish(final_status));
        effects
    }

    pub fn finish(&mut self, final_status: Option<u16>) -> Vec<Effect> {
        let mut effects = Vec::new();
        self.response_status = self.response_status.or(final_status.filter(|s| *s > 0));
        match self.phase {
            Phase::Finished => return effects,
            Phase::Buffering => effects.push(self.unroutable(UnroutableReason::IncompleteBody)),
            Phase::Routing => {
                // The call is cancelled with the context, but the indexer may have booked the request.
                self.report_done = Some(DoneTarget::default());
            }
            _ => {}
        }
        let outcome = if self.phase == Phase::Rejected {
            OutcomeLabel::Rejected
        } else if let Phase::Answered(status) = self.phase {
            // The filter's own reply: whole as sent, whatever Envoy reports of it.
            self.response_status = Some(status);
            if (200..300).contains(&status) {
                OutcomeLabel::Success
            } else {
                OutcomeLabel::Error
            }
        } else {
            match (self.response_status, self.response_complete) {
                (Some(s), true) if (200..300).contains(&s) => OutcomeLabel::Success,
                (Some(s), _) if !(200..300).contains(&s) => OutcomeLabel::Error,
                _ => OutcomeLabel::Aborted,
            }
        };
        effects.push(Effect::Metric(MetricUpdate::Add(Metric::Requests(self.route, outcome), 1)));
        if let Some(DoneTarget { endpoint, booking_id }) = self.report_done.take() {
            let (outcome, status) = match outcome {
                OutcomeLabel::Success => (Outcome::Success, self.response_status),
                OutcomeLabel::Error => (Outcome::Error, self.response_status),
                OutcomeLabel::Rejected => (Outcome::Error, self.rejected_status),
                OutcomeLabel::Aborted => (Outcome::Aborted, self.response_status),
            };
            // Only a whole response's usage is the engine's last word on the request.
            let scanned = self.usage_tail.take().filter(|_| outcome == Outcome::Success);
            let usage = scanned.as_ref().and_then(UsageTail::usage);
            if usage.is_none() && scanned.is_some() {
                log::debug!(
                    "ctx={} request_id={} no usage at the end of the response: not attributed",
                    self.context_id,
                    self.request_id
                );
            }
            effects.push(Effect::QueueDone(DoneReport {
                request_id: self.request_id.clone(),
                endpoint,
                outcome,
                status,
                booking_id,
                usage,
            }));
        }
        self.usage_tail = None;
        self.phase = Phase::Finished;
        self.drop_body();
        effects
    }

    /// Moves ejected endpoints to the end of `header` and remembers the primary.
    fn steer(&mut self, header: String, fleet: &dyn FleetSource) -> String {
        let (header, moved) = fleet.reorder_endpoints(&header);
        if moved > 0 {
            log::debug!(
                "ctx={} request_id={} {moved} ejected endpoint(s) moved to the end: {header}",
                self.context_id,
                self.request_id
            );
        }
        self.primary = header.split(',').next().map(str::to_owned);
        header
    }

    /// The client's `x-request-id` as the filter and the indexer name the request
    /// ([`crate::request_id`]): percent-encoded (logged, counted) unless it is header text.
    fn name_for_indexer(&self, id: &str, effects: &mut Vec<Effect>) -> String {
        let Some(encoded) = crate::request_id::encoded_for_indexer(id) else {
            return id.to_owned();
        };
        log::debug!(
            "ctx={} request_id={encoded} the client's x-request-id is not visible ASCII: named by its percent-encoding (the engine gets it unchanged)",
            self.context_id
        );
        effects.push(Effect::Metric(MetricUpdate::Add(Metric::RequestIdsEncoded, 1)));
        encoded
    }

    fn unroutable(&self, reason: UnroutableReason) -> Effect {
        log::debug!(
            "ctx={} request_id={} not routed by content: {}",
            self.context_id,
            self.request_id,
            reason.as_str()
        );
        Effect::Metric(MetricUpdate::Add(Metric::Unroutable(reason), 1))
    }

    fn apply(&mut self, d: RouteDecision, fleet: &dyn FleetSource) -> Vec<Effect> {
        let (header, dropped) = decision::destination(&d);
        let header = self.steer(header, fleet);
        let mut effects = vec![Effect::SetRequestHeader(headers::DESTINATION_ENDPOINT, header)];
        if dropped > 0 {
            effects.push(Effect::Metric(MetricUpdate::Add(
                Metric::InternalErrors(InternalError::InvalidFallbackEndpoint),
                dropped as u64,
            )));
        }
        if let Some(params) = d.kv_transfer_params.as_ref().filter(|p| !p.is_null()) {
            match splice::splice_top_level(&self.body, KV_TRANSFER_PARAMS, params) {
                Ok(body) => {
                    if self.head.has_content_length {
                        effects.push(Effect::SetRequestHeader(
                            "content-length",
                            body.len().to_string(),
                        ));
                    }
                    effects
                        .push(Effect::ReplaceRequestBody { original_len: self.body.len(), body });
                    effects.push(Effect::SetRequestHeader(ENVOY_MAX_RETRIES, "0".into()));
                }
                Err(e) => {
                    log::warn!(
                        "ctx={} request_id={} kv_transfer_params not spliced: {e}",
                        self.context_id,
                        self.request_id
                    );
                    effects.push(Effect::Metric(MetricUpdate::Add(
                        Metric::InternalErrors(InternalError::SpliceFailed),
                        1,
                    )));
                }
            }
        }
        effects.push(Effect::Metric(MetricUpdate::Add(
            Metric::OverlapBlocks,
            u64::from(d.overlap_blocks),
        )));
        effects.push(Effect::Metric(MetricUpdate::Add(Metric::IslBlocks, u64::from(d.isl_blocks))));
        if let Some(rate) = hit_rate_permille(d.overlap_blocks, d.isl_blocks) {
            effects.push(Effect::Metric(MetricUpdate::Record(Metric::HitRate, rate)));
        }
        log::debug!(
            "ctx={} request_id={} routed worker={} mode={} overlap_blocks={} isl_blocks={}",
            self.context_id,
            self.request_id,
            d.worker,
            d.mode.as_str(),
            d.overlap_blocks,
            d.isl_blocks
        );
        self.ttft.set_prediction(d.predicted_ttft_ms);
        self.route = decision::route_label(d.mode);
        if self.config.debug_headers {
            self.debug = decision::debug_headers(&d);
            self.debug.extend(
                self.ttft
                    .prediction()
                    .map(|ms| (headers::DEBUG_PREDICTED_TTFT, format!("{ms:.1}"))),
            );
        }
        if let Some((key, _)) = self.session.filter(|_| self.config.placement_memory_slots > 0) {
            effects.push(Effect::RememberPlacement { key, worker: d.worker.clone() });
        }
        self.report_done =
            Some(DoneTarget { endpoint: Some(d.endpoint), booking_id: d.booking_id });
        self.phase = Phase::Forwarded;
        self.drop_body();
        effects
    }

    fn fallback(&mut self, fb: Fallback, fleet: &dyn FleetSource) -> Vec<Effect> {
        let reason = fb.reason;
        let pick = self.local_pick(fleet);
        let line = format!(
            "ctx={} request_id={} indexer fallback reason={} code={} result={}",
            self.context_id,
            self.request_id,
            reason.as_str(),
            fb.code.as_deref().unwrap_or("-"),
            pick.label().as_str()
        );
        // A skipped call is the breaker doing its job: its opening was logged once already; a
        // body over the budget is logged, sampled, by `on_body_left`.
        if matches!(reason, FallbackReason::BreakerOpen | FallbackReason::BodyBudget) {
            log::debug!("{line}");
        } else {
            log::info!("{line}");
        }
        let mut effects = vec![
            Effect::Metric(MetricUpdate::Add(Metric::Fallbacks(reason), 1)),
            Effect::Metric(MetricUpdate::Add(Metric::FallbackRoutes(pick.label()), 1)),
        ];
        if self.config.debug_headers {
            self.debug = vec![(headers::DEBUG_FALLBACK, decision::header_safe(&fb.header_value()))];
        }
        if fb.needs_done() {
            let pinned_endpoint = match &pick {
                FallbackPick::Pinned { header, .. } => header.split(',').next().map(str::to_owned),
                FallbackPick::Unrouted(_) | FallbackPick::UnknownModel(_) => None,
            };
            self.report_done =
                Some(DoneTarget { endpoint: pinned_endpoint, booking_id: fb.booking_id });
        }
        effects.extend(self.forward_pick(pick, fleet));
        effects
    }

    /// Routes a short body without the `/v1/route` call, as the fallback would (the session's
    /// remembered worker, else its pin). Nothing was booked at the indexer, so no done report.
    fn route_locally(&mut self, body_len: usize, fleet: &dyn FleetSource) -> Vec<Effect> {
        let pick = self.local_pick(fleet);
        log::debug!(
            "ctx={} request_id={} routed locally: body {body_len} bytes <= local_route_max_body_bytes {} result={}",
            self.context_id,
            self.request_id,
            self.config.local_route_max_body_bytes,
            pick.label().as_str()
        );
        if self.config.debug_headers {
            self.debug = vec![(headers::DEBUG_REASON, headers::LOCAL_ROUTE_REASON.to_owned())];
        }
        let mut effects =
            vec![Effect::Metric(MetricUpdate::Add(Metric::LocalRoutes(pick.label()), 1))];
        effects.extend(self.forward_pick(pick, fleet));
        effects
    }

    /// Where the filter sends a request on its own: the worker the indexer last placed the
    /// session on, else the session's rendezvous pin over the last fleet ([`fallback::pick`]).
    fn local_pick(&self, fleet: &dyn FleetSource) -> FallbackPick {
        let snapshot = fleet.fleet();
        let session = self.session.map(|(k, _)| k);
        let remembered = session
            .filter(|_| self.config.placement_memory_slots > 0)
            .and_then(|k| fleet.placed(k));
        let requested = self.requested_model.as_deref();
        let request_key = xxh3(self.request_id.as_bytes(), 0);
        fallback::pick(session, snapshot.as_deref(), remembered.as_deref(), requested, request_key)
    }

    /// Sets the destination of a local pick (none when it is unrouted) and ends routing.
    fn forward_pick(&mut self, pick: FallbackPick, fleet: &dyn FleetSource) -> Vec<Effect> {
        let mut effects = Vec::new();
        match pick {
            FallbackPick::Pinned { worker, header, .. } => {
                let header = self.steer(header, fleet);
                effects.push(Effect::SetRequestHeader(headers::DESTINATION_ENDPOINT, header));
                if self.config.debug_headers {
                    self.debug.push((headers::DEBUG_WORKER, decision::header_safe(&worker)));
                }
                self.route = RouteLabel::Pinned;
            }
            FallbackPick::Unrouted(_) => self.route = RouteLabel::Unrouted,
            FallbackPick::UnknownModel(_) => {
                return self.answer_unknown_model(LocalAnswer::UnknownModelLocal);
            }
        }
        self.phase = Phase::Forwarded;
        self.drop_body();
        effects
    }

    /// Reads the body's `model`: kept for a local pick, and resolved against the last fleet
    /// snapshot for the metrics' `model` label.
    fn note_model(&mut self, requested: Option<String>, fleet: &dyn FleetSource) {
        let max_labels = self.config.max_model_labels;
        self.model =
            models::label_model(fleet.fleet().as_deref(), requested.as_deref(), max_labels);
        self.requested_model = requested;
    }

    /// Answers vLLM's 404 for the request's `model` (`why`: who said nobody serves it), counted;
    /// the request is never forwarded.
    fn answer_unknown_model(&mut self, why: LocalAnswer) -> Vec<Effect> {
        let requested = self.requested_model.clone().unwrap_or_default();
        // Debug: the name is the client's (counted, and the indexer logs its own refusals).
        log::debug!(
            "ctx={} request_id={} unknown model {requested:?} ({}): answered 404",
            self.context_id,
            self.request_id,
            why.as_str()
        );
        self.phase = Phase::Answered(404);
        self.route = RouteLabel::Unrouted;
        self.drop_body();
        self.debug.clear();
        vec![
            Effect::Metric(MetricUpdate::Add(Metric::LocalAnswers(why), 1)),
            models::not_found(&requested, &self.request_id),
        ]
    }
}

/// Whether an error answer's body says the indexer holds no such body base.
fn base_unknown(body: &[u8]) -> bool {
    serde_json::from_slice::<ErrorBody>(body)
        .is_ok_and(|e| e.error.reason.as_deref() == Some(BASE_UNKNOWN))
}

#[cfg(test)]
#[path = "tests/flow.rs"]
mod tests;

#[cfg(test)]
#[path = "tests/flow_models.rs"]
mod model_tests;

#[cfg(test)]
#[path = "tests/flow_usage.rs"]
mod usage_tests;

#[cfg(test)]
#[path = "tests/flow_picker.rs"]
mod picker_tests;
