//! One HTTP context per request: reads plain data from Envoy, feeds [`RequestFlow`], executes the
//! effects it returns. No decisions are made here.

use std::rc::Rc;

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, BufferType, MapType};

use super::io;
use crate::breaker::Admit;
use crate::decision::MAX_ANSWER_BYTES;
use crate::effects::{Effect, Next, Step};
use crate::flow::RequestFlow;
use crate::shared::Shared;

/// Request header that makes a `test-trap` build trap (e2e only).
#[cfg(feature = "test-trap")]
pub const TEST_TRAP_HEADER: &str = "x-kvmesh-test-trap";

/// The filter's HTTP context.
pub struct HttpFilter {
    context_id: u32,
    shared: Rc<Shared>,
    flow: RequestFlow,
    route_token: Option<u32>,
}

impl HttpFilter {
    pub fn new(context_id: u32, shared: Rc<Shared>) -> Self {
        let flow = RequestFlow::new(Rc::clone(&shared.config), context_id)
            .with_body_budget(Rc::clone(&shared.body_budget));
        Self { context_id, shared, flow, route_token: None }
    }

    fn now_ns(&self) -> u64 {
        self.shared.host().now_ns()
    }

    /// Applies a step's effects, then follows its `next` until the flow waits or continues.
    fn run(&mut self, mut step: Step) -> Action {
        if let Some(marker) = self.flow.release_marker() {
            step.effects.insert(0, marker);
        }
        self.apply(step.effects);
        match step.next {
            Next::Continue => Action::Continue,
            Next::Pause => Action::Pause,
            Next::ReadBody(len) => {
                let body = io::read_buffer(BufferType::HttpRequestBody, len);
                let step = self.flow.on_body(body, self.now_ns(), self.shared.as_ref());
                self.run(step)
            }
            Next::ListModels => {
                let step = self.flow.on_models_list(self.shared.as_ref(), self.now_ns());
                self.run(step)
            }
            Next::LeaveBody(refused) => {
                let step = self.flow.on_body_left(refused, self.shared.as_ref());
                self.run(step)
            }
            Next::Call(call) => {
                if self.shared.admit_route_call(self.now_ns()) == Admit::Skip {
                    let step = self.flow.on_call_skipped(self.shared.as_ref());
                    return self.run(step);
                }
                match self.shared.host().dispatch(&call) {
                    Ok(token) => {
                        self.route_token = Some(token);
                        Action::Pause
                    }
                    Err(status) => {
                        self.shared
                            .metrics
                            .host_call_failed("dispatch_http_call(/v1/route)", &status);
                        let step = self.flow.on_dispatch_failed(self.shared.as_ref());
                        self.run(step)
                    }
                }
            }
        }
    }

    fn apply(&self, effects: Vec<Effect>) {
        for effect in effects {
            let (what, result) = match effect {
                Effect::RemoveRequestHeader(name) => (
                    "remove request header",
                    hostcalls::remove_map_value(MapType::HttpRequestHeaders, name),
                ),
                Effect::SetRequestHeader(name, value) => (
                    "set request header",
                    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, Some(&value)),
                ),
                Effect::ReplaceRequestBody { original_len, body } => (
                    "replace request body",
                    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, original_len, &body),
                ),
                Effect::SendResponse { status, headers, body } => {
                    let headers: Vec<(&str, &str)> =
                        headers.iter().map(|(n, v)| (*n, v.as_str())).collect();
                    (
                        "send response",
                        hostcalls::send_http_response(u32::from(status), headers, Some(&body)),
                    )
                }
                Effect::ResumeRequest => ("resume request", hostcalls::resume_http_request()),
                Effect::AddResponseHeader(name, value) => (
                    "add response header",
                    hostcalls::add_map_value(MapType::HttpResponseHeaders, name, &value),
                ),
                Effect::Metric(update) => {
                    self.shared.metrics.apply_for(update, self.flow.model());
                    continue;
                }
                Effect::QueueDone(report) => {
                    self.shared.queue_done(report);
                    continue;
                }
                Effect::IndexerHealth(health) => {
                    self.shared.record_route_call(health, self.now_ns());
                    continue;
                }
                Effect::EndpointOutcome { endpoint, ok } => {
                    self.shared.record_endpoint(&endpoint, ok, self.now_ns());
                    continue;
                }
                Effect::RememberPlacement { key, worker } => {
                    self.shared.remember_placement(key, &worker);
                    continue;
                }
                Effect::RememberBodyBase { key, new, used } => {
                    self.shared.remember_body_base(key, new, used);
                    continue;
                }
            };
            if let Err(status) = result {
                log::warn!(
                    "ctx={} request_id={} {what} failed",
                    self.context_id,
                    self.flow.request_id()
                );
                self.shared
                    .metrics
                    .host_call_failed(what, &crate::host_api::HostError(format!("{status:?}")));
            }
        }
    }

    fn finish(&mut self) {
        // `on_log` and `on_done` both end the stream; the second needs no property reads.
        if self.flow.is_finished() {
            return;
        }
        let final_status =
            io::property_u64(&["response", "code"]).and_then(|c| u16::try_from(c).ok());
        // The host of the last upstream attempt (after retries), e.g. `10.0.0.2:8000`.
        let served = io::property_text(&["upstream", "address"]);
        let effects = self.flow.finish_upstream(final_status, served.as_deref());
        self.apply(effects);
    }
}

impl Context for HttpFilter {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if self.route_token != Some(token_id) {
            return;
        }
        self.route_token = None;
        let status =
            if num_headers == 0 { None } else { io::status_of(MapType::HttpCallResponseHeaders) };
        let body = if body_size == 0 {
            Vec::new()
        } else {
            // One byte over the bound is enough for the flow to see "too large".
            io::read_buffer(BufferType::HttpCallResponseBody, body_size.min(MAX_ANSWER_BYTES + 1))
                .unwrap_or_default()
        };
        let step = self.flow.on_route_answer(status, &body, self.now_ns(), self.shared.as_ref());
        // Outside a stream callback the returned action means nothing; resuming is an effect.
        let _ = self.run(step);
    }

    fn on_done(&mut self) -> bool {
        self.finish();
        true
    }
}

impl HttpContext for HttpFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let pairs = io::header_pairs(MapType::HttpRequestHeaders);
        #[cfg(feature = "test-trap")]
        if pairs.iter().any(|(name, _)| name == TEST_TRAP_HEADER) {
            log::warn!(
                "ctx={} {TEST_TRAP_HEADER}: trapping the VM on purpose (test-trap build)",
                self.context_id
            );
            core::arch::wasm32::unreachable();
        }
        let step = self.flow.on_request_headers(&pairs, end_of_stream, self.now_ns());
        self.run(step)
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        let step = self.flow.on_request_body(body_size, end_of_stream);
        self.run(step)
    }

    fn on_http_request_trailers(&mut self, _num_trailers: usize) -> Action {
        let step = self.flow.on_request_trailers();
        self.run(step)
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let status = io::status_of(MapType::HttpResponseHeaders);
        let effects = self.flow.on_response_headers(status, end_of_stream);
        self.apply(effects);
        Action::Continue
    }

    fn on_http_response_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if self.flow.awaits_first_byte() {
            let effects = self.flow.on_response_data(body_size, self.now_ns());
            self.apply(effects);
        }
        // The engine's usage for the done report: only this chunk's last bytes are read (bounded
        // whatever the chunk's size); the chunk itself goes on unchanged.
        let want = self.flow.response_tail_wanted(body_size);
        if want > 0 {
            let tail = hostcalls::get_buffer(BufferType::HttpResponseBody, body_size - want, want)
                .ok()
                .flatten()
                .unwrap_or_default();
            self.flow.on_response_tail(&tail, body_size);
        }
        self.flow.on_response_body(end_of_stream);
        Action::Continue
    }

    fn on_http_response_trailers(&mut self, _num_trailers: usize) -> Action {
        self.flow.on_response_trailers();
        Action::Continue
    }

    fn on_log(&mut self) {
        self.finish();
    }
}
