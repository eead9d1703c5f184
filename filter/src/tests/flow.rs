//! Scenario tests of [`super::RequestFlow`]: a request's whole life, callback by callback.

use super::*;
use crate::metrics::OverrideRefusal;
use kvmesh_core::api::{ErrorBody, FleetWorker, Role, WorkerLoad};
use kvmesh_core::openai;
use kvmesh_core::session;
use serde_json::{json, Value};

pub(super) struct Fleet(pub(super) Option<Rc<FleetSnapshot>>);

impl FleetSource for Fleet {
    fn fleet(&self) -> Option<Rc<FleetSnapshot>> {
        self.0.clone()
    }
}

fn fleet() -> Fleet {
    let workers = (1..=3)
        .map(|i| FleetWorker {
            id: format!("w{i}"),
            endpoint: format!("10.0.0.{i}:8000"),
            role: Role::Decode,
            model: String::new(),
            healthy: true,
            load: WorkerLoad::default(),
        })
        .collect();
    Fleet(Some(Rc::new(FleetSnapshot {
        generation: 1,
        block_size: 16,
        models: Vec::new(),
        workers,
    })))
}

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":true}"#;

fn headers(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter().map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec())).collect()
}

fn chat_headers() -> Vec<(String, Vec<u8>)> {
    headers(&[
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("x-request-id", "rid-1"),
        ("content-length", "70"),
    ])
}

pub(super) fn flow(config: FilterConfig) -> RequestFlow {
    RequestFlow::new(Rc::new(config), 7)
}

pub(super) fn counted(effects: &[Effect], metric: Metric) -> u64 {
    effects
        .iter()
        .map(|e| match e {
            Effect::Metric(MetricUpdate::Add(m, n)) if *m == metric => *n,
            _ => 0,
        })
        .sum()
}

fn recorded(effects: &[Effect], metric: Metric) -> Vec<u64> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::Metric(MetricUpdate::Record(m, v)) if *m == metric => Some(*v),
            _ => None,
        })
        .collect()
}

fn header_set(effects: &[Effect], name: &str) -> Option<String> {
    effects.iter().find_map(|e| match e {
        Effect::SetRequestHeader(n, v) if *n == name => Some(v.clone()),
        _ => None,
    })
}

/// Drives a chat request up to the route call; returns the flow and the call.
fn to_route_call(config: FilterConfig, body: &str) -> (RequestFlow, request::HttpCall) {
    let mut f = flow(config);
    assert_eq!(f.on_request_headers(&chat_headers(), false, 1_000_000).next, Next::Pause);
    assert_eq!(f.on_request_body(10, false).next, Next::Pause);
    assert_eq!(f.on_request_body(body.len(), true).next, Next::ReadBody(body.len()));
    let step = f.on_body(Some(body.as_bytes().to_vec()), 2_000_000, &fleet());
    let Next::Call(call) = step.next else { panic!("expected a route call, got {:?}", step.next) };
    (f, call)
}

fn decision(kv: Value) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "endpoint": "10.0.0.2:8000", "fallbacks": ["10.0.0.3:8000"], "worker": "w2", "mode": "disagg",
        "overlap_blocks": 3, "isl_blocks": 4, "kv_transfer_params": kv, "reason": "overlap"
    }))
    .unwrap()
}

#[test]
fn routed_disagg_request_end_to_end() {
    let config = FilterConfig { debug_headers: true, ..FilterConfig::default() };
    let (mut f, call) = to_route_call(config, CHAT);
    assert_eq!(call.body(), Some(CHAT.as_bytes()), "the original body goes to the indexer");
    assert!(
        call.body.as_ref().is_some_and(|b| Rc::ptr_eq(b, &f.body)),
        "the flow keeps the call's body for the splice: shared, not copied"
    );
    assert_eq!(call.header("x-request-id"), Some("rid-1"));
    assert!(
        call.header("x-kvmesh-session").is_some_and(|v| v.ends_with(";source=prefix")),
        "derived keys are on by default"
    );

    let kv = json!({"do_remote_prefill": true, "remote_engine_id": "p1"});
    // Called at 2 ms (`to_route_call`), answered 0.75 ms later: recorded in microseconds, since a
    // whole-millisecond sample would be 0.
    let step = f.on_route_answer(Some(200), &decision(kv.clone()), 2_750_000, &fleet());
    let e = &step.effects;
    assert_eq!(
        header_set(e, "x-gateway-destination-endpoint").as_deref(),
        Some("10.0.0.2:8000,10.0.0.3:8000")
    );
    let Some(Effect::ReplaceRequestBody { original_len, body }) =
        e.iter().find(|e| matches!(e, Effect::ReplaceRequestBody { .. }))
    else {
        panic!("no body replacement: {e:?}")
    };
    assert_eq!(*original_len, CHAT.len());
    let sent: Value = serde_json::from_slice(body).unwrap();
    assert_eq!(sent["kv_transfer_params"], kv);
    assert_eq!(sent["messages"][0]["content"], "hello");
    assert!(body.ends_with(&CHAT.as_bytes()[1..]), "the rest of the body is byte-identical");
    assert_eq!(header_set(e, "content-length"), Some(body.len().to_string()));
    assert_eq!(header_set(e, "x-envoy-max-retries").as_deref(), Some("0"), "no retry re-pulls KV");
    assert_eq!(counted(e, Metric::OverlapBlocks), 3);
    assert_eq!(counted(e, Metric::IslBlocks), 4);
    assert_eq!(recorded(e, Metric::HitRate), vec![750]);
    assert_eq!(recorded(e, Metric::RouteLatency), vec![750]);
    assert_eq!(e.last(), Some(&Effect::ResumeRequest));

    let debug = f.on_response_headers(Some(200), false);
    assert!(debug.contains(&Effect::AddResponseHeader(headers::DEBUG_MODE, "disagg".into())));
    assert!(debug.contains(&Effect::AddResponseHeader(headers::DEBUG_WORKER, "w2".into())));
    f.on_response_body(false);
    f.on_response_body(true);
    assert!(!f.is_finished());
    let done = f.finish(None);
    assert!(f.is_finished(), "the second stream end reads nothing from the host");
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Disagg, OutcomeLabel::Success)), 1);
    assert!(done.contains(&Effect::QueueDone(DoneReport {
        request_id: "rid-1".into(),
        endpoint: Some("10.0.0.2:8000".into()),
        outcome: Outcome::Success,
        status: Some(200),
        booking_id: None,
        usage: None
    })));
    assert!(f.finish(None).is_empty(), "finish books once");
}

#[test]
fn aggregate_decision_leaves_the_body_alone() {
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let step = f.on_route_answer(Some(200), &decision(Value::Null), 3_000_000, &fleet());
    assert!(!step.effects.iter().any(|e| matches!(
        e,
        Effect::ReplaceRequestBody { .. }
            | Effect::SetRequestHeader("content-length" | "x-envoy-max-retries", _)
    )));
    assert!(f.on_response_headers(Some(200), true).is_empty(), "debug headers off by default");
    let done = f.finish(None);
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Disagg, OutcomeLabel::Success)), 1);
}

#[test]
fn client_destination_is_stripped_and_overrides_follow_config() {
    let mut h = chat_headers();
    h.extend(headers(&[
        ("x-gateway-destination-endpoint", "6.6.6.6:1"),
        ("x-kvmesh-worker", "w3"),
    ]));
    let mut f = flow(FilterConfig::default());
    let step = f.on_request_headers(&h, false, 0);
    for name in [headers::DESTINATION_ENDPOINT, headers::OVERRIDE_WORKER, headers::OVERRIDE_MODE] {
        assert!(step.effects.contains(&Effect::RemoveRequestHeader(name)), "{name}");
    }
    assert_eq!(counted(&step.effects, Metric::OverridesRefused(OverrideRefusal::Disabled)), 1);
}

const SECRET: &str = "0123456789abcdef-ops";

/// Headers, body and route call of a chat request sending `x-kvmesh-worker: w3` (and the secret
/// header with `secret`, when given) through a filter with overrides on.
fn override_request(secret: Option<&str>) -> (Step, request::HttpCall) {
    let mut h = chat_headers();
    h.extend(headers(&[("x-kvmesh-worker", "w3")]));
    if let Some(s) = secret {
        h.extend(headers(&[(headers::OVERRIDE_SECRET, s)]));
    }
    let mut f = flow(FilterConfig {
        allow_overrides: true,
        override_secret: SECRET.into(),
        ..FilterConfig::default()
    });
    let step = f.on_request_headers(&h, false, 0);
    f.on_request_body(CHAT.len(), true);
    let Next::Call(call) = f.on_body(Some(CHAT.as_bytes().to_vec()), 0, &fleet()).next else {
        panic!("no route call")
    };
    (step, call)
}

#[test]
fn overrides_are_honoured_only_with_the_secret() {
    // (secret sent, honoured, refusal counted)
    let cases: &[(Option<&str>, bool, Option<OverrideRefusal>)] = &[
        (Some(SECRET), true, None),
        (None, false, Some(OverrideRefusal::NoSecret)),
        (Some("0123456789abcdef-opz"), false, Some(OverrideRefusal::BadSecret)),
        (Some(""), false, Some(OverrideRefusal::BadSecret)),
    ];
    for (secret, honoured, refusal) in cases {
        let (step, call) = override_request(*secret);
        assert_eq!(call.header("x-kvmesh-worker"), honoured.then_some("w3"), "{secret:?}");
        assert_eq!(
            call.header(headers::OVERRIDE_SECRET),
            None,
            "the secret never reaches the indexer"
        );
        let stripped =
            step.effects.contains(&Effect::RemoveRequestHeader(headers::OVERRIDE_WORKER));
        assert_eq!(stripped, !honoured, "{secret:?}");
        assert_eq!(
            step.effects.contains(&Effect::RemoveRequestHeader(headers::OVERRIDE_SECRET)),
            secret.is_some(),
            "{secret:?}"
        );
        for r in OverrideRefusal::ALL {
            assert_eq!(
                counted(&step.effects, Metric::OverridesRefused(*r)),
                u64::from(Some(*r) == *refusal),
                "{secret:?} {r:?}"
            );
        }
    }
}

#[test]
fn unroutable_requests_pass_through_counted() {
    let post = |path: &str| headers(&[(":method", "POST"), (":path", path), ("x-request-id", "r")]);
    // (headers, end_of_stream at headers, body) → reason
    type Case<'a> = (Vec<(String, Vec<u8>)>, bool, Option<&'a str>, UnroutableReason);
    let cases: Vec<Case> = vec![
        (post("/v1/models"), false, None, UnroutableReason::UnknownPath),
        (
            headers(&[(":method", "GET"), (":path", "/v1/completions")]),
            true,
            None,
            UnroutableReason::Method,
        ),
        (post("/v1/completions"), true, None, UnroutableReason::NoBody),
        (post("/v1/completions"), false, Some("not json"), UnroutableReason::NotJson),
        (post("/v1/completions"), false, Some("[1]"), UnroutableReason::NotAnObject),
        (post("/v1/completions"), false, Some(r#"{"model":"m"}"#), UnroutableReason::MissingField),
        (post("/v1/completions"), false, Some(r#"{"prompt":7}"#), UnroutableReason::WrongType),
        (
            post("/v1/completions"),
            false,
            Some(r#"{"prompt":["a","b"]}"#),
            UnroutableReason::BatchPrompt,
        ),
        (
            post("/v1/chat/completions"),
            false,
            Some(r#"{"messages":[{"role":"user","content":"x"}"#),
            UnroutableReason::NotJson,
        ),
    ];
    for (h, eos, body, reason) in cases {
        let mut f = flow(FilterConfig::default());
        let mut effects = f.on_request_headers(&h, eos, 0).effects;
        if let Some(body) = body {
            assert_eq!(f.on_request_body(body.len(), true).next, Next::ReadBody(body.len()));
            let step = f.on_body(Some(body.as_bytes().to_vec()), 0, &fleet());
            assert_eq!(step.next, Next::Continue, "{reason:?}");
            effects.extend(step.effects);
        }
        assert_eq!(counted(&effects, Metric::Unroutable(reason)), 1, "{reason:?}");
        assert!(header_set(&effects, headers::DESTINATION_ENDPOINT).is_none());
        f.on_response_headers(Some(400), false);
        let done = f.finish(None);
        assert_eq!(counted(&done, Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Error)), 1);
        assert!(
            !done.iter().any(|e| matches!(e, Effect::QueueDone(_))),
            "the indexer never saw it"
        );
    }
}

#[test]
fn oversized_body_passes_through() {
    let mut f = flow(FilterConfig { max_body_bytes: 16, ..FilterConfig::default() });
    f.on_request_headers(&chat_headers(), false, 0);
    assert_eq!(f.on_request_body(10, false).next, Next::Pause);
    let step = f.on_request_body(17, false);
    assert_eq!(step.next, Next::Continue);
    assert_eq!(counted(&step.effects, Metric::Unroutable(UnroutableReason::BodyTooLarge)), 1);
    assert_eq!(f.on_request_body(40, true).next, Next::Continue, "later chunks stream through");
}

#[test]
fn stream_ending_mid_body_is_counted() {
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&chat_headers(), false, 0);
    f.on_request_body(10, false);
    f.on_response_headers(Some(413), true);
    let done = f.finish(None);
    assert_eq!(counted(&done, Metric::Unroutable(UnroutableReason::IncompleteBody)), 1);
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Error)), 1);
}

#[test]
fn trailers_end_the_body() {
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&chat_headers(), false, 0);
    f.on_request_body(CHAT.len(), false);
    assert_eq!(f.on_request_trailers().next, Next::ReadBody(CHAT.len()));
}

#[test]
fn fallbacks_pin_by_session_over_the_fleet() {
    let config = FilterConfig {
        session_header: "x-session-id".into(),
        debug_headers: true,
        ..FilterConfig::default()
    };
    let key = session::from_header_value("conv-9");
    let expected_pin = fleet().0.unwrap().pin(key.0, "").unwrap().endpoint.clone();
    let no_worker = serde_json::to_vec(&ErrorBody::with_reason(
        503,
        "service_unavailable",
        "no_decode_worker",
        "no healthy decode worker",
    ))
    .unwrap();
    let template = serde_json::to_vec(&ErrorBody::with_reason(
        503,
        "service_unavailable",
        "tokenizer",
        "chat template: unknown method strip",
    ))
    .unwrap();
    let booked_json = br#"{"endpoint":"nowhere","booking_id":"b-9"}"#;
    // (status, body, reason, debug header, health, done report's booking id if one is due)
    type Case<'a> =
        (Option<u16>, &'a [u8], FallbackReason, &'a str, CallHealth, Option<Option<&'a str>>);
    let answers: Vec<Case> = vec![
        (None, b"", FallbackReason::Reset, "reset", CallHealth::Failed, Some(None)),
        (
            Some(504),
            b"upstream request timeout",
            FallbackReason::Timeout,
            "timeout",
            CallHealth::Failed,
            Some(None),
        ),
        (
            Some(503),
            b"",
            FallbackReason::Unavailable,
            "unavailable",
            CallHealth::Failed,
            Some(None),
        ),
        (
            Some(503),
            b"no healthy upstream",
            FallbackReason::Unavailable,
            "unavailable",
            CallHealth::Failed,
            None,
        ),
        (
            Some(500),
            b"boom",
            FallbackReason::ServerError,
            "server_error",
            CallHealth::Answered,
            Some(None),
        ),
        (Some(404), b"", FallbackReason::BadStatus, "bad_status", CallHealth::Answered, Some(None)),
        (
            Some(200),
            booked_json,
            FallbackReason::BadResponse,
            "bad_response",
            CallHealth::Answered,
            Some(Some("b-9")),
        ),
        (
            Some(503),
            &no_worker,
            FallbackReason::IndexerError,
            "indexer_error; code=no_decode_worker",
            CallHealth::Answered,
            None,
        ),
        (
            Some(503),
            &template,
            FallbackReason::IndexerError,
            "indexer_error; code=tokenizer",
            CallHealth::Answered,
            None,
        ),
    ];
    for (status, body, reason, debug_value, health, done_booking) in answers {
        let mut f = flow(config.clone());
        let mut h = chat_headers();
        h.extend(headers(&[("x-session-id", "conv-9")]));
        f.on_request_headers(&h, false, 0);
        f.on_request_body(CHAT.len(), true);
        let Next::Call(call) = f.on_body(Some(CHAT.as_bytes().to_vec()), 0, &fleet()).next else {
            panic!()
        };
        assert_eq!(
            call.header("x-kvmesh-session"),
            Some(session::encode_header(key, SessionSource::Header).as_str())
        );
        let step = f.on_route_answer(status, body, 100_000_000, &fleet());
        assert_eq!(counted(&step.effects, Metric::Fallbacks(reason)), 1, "{reason:?}");
        assert!(step.effects.contains(&Effect::IndexerHealth(health)), "{reason:?}");
        assert_eq!(
            counted(&step.effects, Metric::FallbackRoutes(crate::metrics::FallbackRoute::Pinned)),
            1
        );
        let header = header_set(&step.effects, headers::DESTINATION_ENDPOINT).unwrap();
        assert!(header.starts_with(&expected_pin), "{header}");
        assert_eq!(step.effects.last(), Some(&Effect::ResumeRequest));
        assert_eq!(recorded(&step.effects, Metric::RouteLatency), vec![100_000]);
        let debug = f.on_response_headers(Some(200), true);
        assert!(
            debug.contains(&Effect::AddResponseHeader(headers::DEBUG_FALLBACK, debug_value.into())),
            "{debug:?}"
        );
        let done = f.finish(None);
        assert_eq!(counted(&done, Metric::Requests(RouteLabel::Pinned, OutcomeLabel::Success)), 1);
        let reports: Vec<&DoneReport> = done
            .iter()
            .filter_map(|e| if let Effect::QueueDone(r) = e { Some(r) } else { None })
            .collect();
        match done_booking {
            None => assert!(
                reports.is_empty(),
                "{reason:?}: the indexer answered an error, it booked nothing"
            ),
            Some(booking) => {
                assert_eq!(reports.len(), 1, "{reason:?}: the indexer may have booked it");
                assert_eq!(
                    reports[0].endpoint.as_deref(),
                    Some(expected_pin.as_str()),
                    "{reason:?}"
                );
                assert_eq!((reports[0].outcome, reports[0].status), (Outcome::Success, Some(200)));
                assert_eq!(reports[0].booking_id.as_deref(), booking, "{reason:?}");
            }
        }
    }
}

#[test]
fn fallback_without_session_or_fleet_leaves_the_header_unset() {
    use crate::metrics::FallbackRoute;
    let (mut f, _) =
        to_route_call(FilterConfig { derive_session_keys: false, ..FilterConfig::default() }, CHAT);
    let step = f.on_route_answer(Some(503), b"down", 0, &fleet());
    assert_eq!(counted(&step.effects, Metric::FallbackRoutes(FallbackRoute::NoSession)), 1);
    assert!(header_set(&step.effects, headers::DESTINATION_ENDPOINT).is_none());

    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let step = f.on_route_answer(Some(503), b"down", 0, &Fleet(None));
    assert_eq!(counted(&step.effects, Metric::FallbackRoutes(FallbackRoute::NoFleet)), 1);
    assert_eq!(step.effects.last(), Some(&Effect::ResumeRequest));
    f.on_response_headers(Some(200), true);
    assert_eq!(
        counted(&f.finish(None), Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Success)),
        1
    );
}

#[test]
fn prefix_session_reaches_the_indexer_and_the_pin() {
    let (mut f, call) = to_route_call(FilterConfig::default(), CHAT);
    let req = openai::parse(Endpoint::ChatCompletions, CHAT.as_bytes()).unwrap();
    let key = session::derived_key(&req).unwrap();
    assert_eq!(
        call.header("x-kvmesh-session"),
        Some(session::encode_header(key, SessionSource::Prefix).as_str())
    );
    let Some(Effect::SetRequestHeader(_, header)) = f
        .on_dispatch_failed(&fleet())
        .effects
        .into_iter()
        .find(|e| matches!(e, Effect::SetRequestHeader(..)))
    else {
        panic!()
    };
    assert!(header.starts_with(&fleet().0.unwrap().pin(key.0, "").unwrap().endpoint));
}

#[test]
fn skipped_call_falls_back_without_resuming_or_done() {
    let config = FilterConfig { debug_headers: true, ..FilterConfig::default() };
    let (mut f, _) = to_route_call(config, CHAT);
    let step = f.on_call_skipped(&fleet());
    assert_eq!(step.next, Next::Continue);
    assert_eq!(counted(&step.effects, Metric::Fallbacks(FallbackReason::BreakerOpen)), 1);
    assert!(
        !step.effects.iter().any(|e| matches!(e, Effect::ResumeRequest | Effect::IndexerHealth(_))),
        "no call, no news for the breaker"
    );
    assert!(
        header_set(&step.effects, headers::DESTINATION_ENDPOINT).is_some(),
        "pinned by the prefix key"
    );
    let debug = f.on_response_headers(Some(200), true);
    assert!(
        debug.contains(&Effect::AddResponseHeader(headers::DEBUG_FALLBACK, "breaker_open".into()))
    );
    assert!(
        !f.finish(None).iter().any(|e| matches!(e, Effect::QueueDone(_))),
        "the indexer never saw it"
    );
}

#[test]
fn decided_request_echoes_the_booking_id() {
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let mut d: Value = serde_json::from_slice(&decision(Value::Null)).unwrap();
    d["booking_id"] = json!("bk-42");
    let step = f.on_route_answer(Some(200), &serde_json::to_vec(&d).unwrap(), 0, &fleet());
    assert!(step.effects.contains(&Effect::IndexerHealth(CallHealth::Answered)));
    f.on_response_headers(Some(500), true);
    let done = f.finish(None);
    assert!(done.contains(&Effect::QueueDone(DoneReport {
        request_id: "rid-1".into(),
        endpoint: Some("10.0.0.2:8000".into()),
        outcome: Outcome::Error,
        status: Some(500),
        booking_id: Some("bk-42".into()),
        usage: None
    })));
}

#[test]
fn dispatch_failure_falls_back_without_resuming() {
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let step = f.on_dispatch_failed(&fleet());
    assert_eq!(step.next, Next::Continue);
    assert!(step.effects.contains(&Effect::IndexerHealth(CallHealth::Failed)));
    assert_eq!(counted(&step.effects, Metric::Fallbacks(FallbackReason::DispatchFailed)), 1);
    assert!(!step.effects.contains(&Effect::ResumeRequest), "the host has not paused yet");
    assert!(recorded(&step.effects, Metric::RouteLatency).is_empty());
}

#[test]
fn indexer_rejection_goes_to_the_client() {
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let body = serde_json::to_vec(&ErrorBody::new(
        429,
        "rate_limit_exceeded",
        "prefill capacity exhausted",
    ))
    .unwrap();
    let step = f.on_route_answer(Some(429), &body, 0, &fleet());
    let Some(Effect::SendResponse { status, body: sent, headers: h }) =
        step.effects.iter().find(|e| matches!(e, Effect::SendResponse { .. }))
    else {
        panic!("{:?}", step.effects)
    };
    assert_eq!(
        (*status, sent),
        (429, &decision::rejection_body(429)),
        "the client gets the stable body"
    );
    assert!(
        !String::from_utf8_lossy(sent).contains("prefill capacity exhausted"),
        "the indexer's text stays in the log"
    );
    assert!(h.contains(&("content-type", "application/json".to_owned())));
    assert!(h.contains(&(ERROR_REASON_HEADER, "prefill_overloaded".to_owned())));
    assert!(!step.effects.contains(&Effect::ResumeRequest));
    f.on_response_headers(Some(429), true);
    let done = f.finish(None);
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Rejected)), 1);
    assert!(done.contains(&Effect::QueueDone(DoneReport {
        request_id: "rid-1".into(),
        endpoint: None,
        outcome: Outcome::Error,
        status: Some(429),
        booking_id: None,
        usage: None
    })));
}

#[test]
fn outcomes() {
    // (response status, complete) → outcome
    let cases = [
        (Some(200), true, OutcomeLabel::Success, Outcome::Success),
        (Some(200), false, OutcomeLabel::Aborted, Outcome::Aborted),
        (Some(500), true, OutcomeLabel::Error, Outcome::Error),
        (Some(400), false, OutcomeLabel::Error, Outcome::Error),
        (None, false, OutcomeLabel::Aborted, Outcome::Aborted),
    ];
    for (status, complete, label, outcome) in cases {
        let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
        f.on_route_answer(Some(200), &decision(Value::Null), 0, &fleet());
        if let Some(s) = status {
            f.on_response_headers(Some(s), false);
            f.on_response_body(complete);
        }
        let done = f.finish(None);
        assert_eq!(
            counted(&done, Metric::Requests(RouteLabel::Disagg, label)),
            1,
            "{status:?} {complete}"
        );
        assert!(done.iter().any(
            |e| matches!(e, Effect::QueueDone(r) if r.outcome == outcome && r.status == status)
        ));
    }
}

#[test]
fn abort_while_waiting_for_the_indexer_still_reports_done() {
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let done = f.finish(None);
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Aborted)), 1);
    assert!(done.iter().any(|e| matches!(e, Effect::QueueDone(r) if r.endpoint.is_none() && r.outcome == Outcome::Aborted)));
    assert_eq!(
        f.on_route_answer(Some(200), &decision(Value::Null), 0, &fleet()).effects,
        vec![],
        "late answers are ignored"
    );
}

#[test]
fn missing_request_id_is_generated_once_and_used_everywhere() {
    let mut f = flow(FilterConfig::default());
    let step = f.on_request_headers(
        &headers(&[(":method", "POST"), (":path", "/v1/completions")]),
        false,
        0xabc,
    );
    let id = header_set(&step.effects, headers::REQUEST_ID).unwrap();
    assert_eq!(id, "kvmesh-7-abc");
    assert_eq!(f.request_id(), id);
    f.on_request_body(14, true);
    let Next::Call(call) = f.on_body(Some(br#"{"prompt":"x"}"#.to_vec()), 0, &fleet()).next else {
        panic!()
    };
    assert_eq!(call.header("x-request-id"), Some(id.as_str()));
}

#[test]
fn oversized_indexer_answer_is_a_bad_response() {
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let huge = vec![b' '; decision::MAX_ANSWER_BYTES + 1];
    let step = f.on_route_answer(Some(200), &huge, 0, &fleet());
    assert_eq!(counted(&step.effects, Metric::Fallbacks(FallbackReason::BadResponse)), 1);
}

#[test]
fn a_local_reply_the_filter_never_saw_counts_as_an_error() {
    let mut f = flow(FilterConfig::default());
    let done = f.finish(Some(413));
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Error)), 1);
    let mut f = flow(FilterConfig::default());
    assert_eq!(
        counted(&f.finish(Some(0)), Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Aborted)),
        1
    );
}

#[test]
fn ttft_is_measured_at_the_first_streamed_byte_against_the_prediction() {
    let config = FilterConfig { debug_headers: true, ..FilterConfig::default() };
    // Headers arrive at 1 ms; CHAT asks for a stream.
    let (mut f, _) = to_route_call(config, CHAT);
    let mut answer: Value = serde_json::from_slice(&decision(Value::Null)).unwrap();
    answer["predicted_ttft_ms"] = json!(20.0);
    f.on_route_answer(Some(200), &serde_json::to_vec(&answer).unwrap(), 3_000_000, &fleet());
    let debug = f.on_response_headers(Some(200), false);
    assert!(
        debug.contains(&Effect::AddResponseHeader(headers::DEBUG_PREDICTED_TTFT, "20.0".into())),
        "{debug:?}"
    );
    assert!(f.on_response_data(0, 10_000_000).is_empty(), "no bytes, no token");
    assert!(f.awaits_first_byte(), "the first byte is still to come");
    let first = f.on_response_data(64, 31_000_000);
    assert!(!f.awaits_first_byte(), "after the first byte the host need not read its clock");
    assert_eq!(recorded(&first, Metric::Ttft), vec![30]);
    assert_eq!(recorded(&first, Metric::TtftPredicted), vec![20]);
    assert_eq!(recorded(&first, Metric::TtftRatio), vec![1500]);
    assert!(f.on_response_data(64, 40_000_000).is_empty(), "once per request");

    // Without a prediction: no debug header, only the measured TTFT.
    let (mut f, _) =
        to_route_call(FilterConfig { debug_headers: true, ..FilterConfig::default() }, CHAT);
    f.on_route_answer(Some(200), &decision(Value::Null), 3_000_000, &fleet());
    let debug = f.on_response_headers(Some(200), false);
    assert!(!debug.iter().any(
        |e| matches!(e, Effect::AddResponseHeader(n, _) if *n == headers::DEBUG_PREDICTED_TTFT)
    ));
    let first = f.on_response_data(1, 5_000_000);
    assert_eq!(recorded(&first, Metric::Ttft), vec![4]);
    assert!(recorded(&first, Metric::TtftRatio).is_empty());
}

/// A fleet whose endpoint ledger has ejected one endpoint.
struct Ejecting(Fleet, &'static str);

impl FleetSource for Ejecting {
    fn fleet(&self) -> Option<Rc<FleetSnapshot>> {
        self.0.fleet()
    }
    fn reorder_endpoints(&self, list: &str) -> (String, usize) {
        let (ok, bad): (Vec<&str>, Vec<&str>) = list.split(',').partition(|e| *e != self.1);
        (ok.into_iter().chain(bad.iter().copied()).collect::<Vec<_>>().join(","), bad.len())
    }
}

#[test]
fn ejected_endpoints_go_last_and_attempts_are_reported() {
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let step = f.on_route_answer(
        Some(200),
        &decision(Value::Null),
        0,
        &Ejecting(fleet(), "10.0.0.2:8000"),
    );
    assert_eq!(
        header_set(&step.effects, headers::DESTINATION_ENDPOINT).as_deref(),
        Some("10.0.0.3:8000,10.0.0.2:8000")
    );
    f.on_response_headers(Some(200), false);
    f.on_response_body(true);
    // Envoy served it on the primary: one good attempt.
    let done = f.finish_upstream(None, Some("10.0.0.3:8000"));
    assert!(done.contains(&Effect::EndpointOutcome { endpoint: "10.0.0.3:8000".into(), ok: true }));
    assert_eq!(done.iter().filter(|e| matches!(e, Effect::EndpointOutcome { .. })).count(), 1);
    assert!(f.finish_upstream(None, Some("10.0.0.3:8000")).is_empty(), "once");

    // A retry moved it off the primary: the primary failed, the served host did fine.
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    f.on_route_answer(Some(200), &decision(Value::Null), 0, &fleet());
    f.on_response_headers(Some(200), true);
    let done = f.finish_upstream(None, Some("10.0.0.3:8000"));
    assert!(done.contains(&Effect::EndpointOutcome { endpoint: "10.0.0.2:8000".into(), ok: false }));
    assert!(done.contains(&Effect::EndpointOutcome { endpoint: "10.0.0.3:8000".into(), ok: true }));
}

#[test]
fn done_report_names_the_host_that_served_after_a_retry() {
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let mut d: Value = serde_json::from_slice(&decision(Value::Null)).unwrap();
    d["booking_id"] = json!("bk-9");
    f.on_route_answer(Some(200), &serde_json::to_vec(&d).unwrap(), 0, &fleet());
    f.on_response_headers(Some(200), false);
    f.on_response_body(true);
    // Decided 10.0.0.2:8000; Envoy's retry went to 10.0.0.3:8000 (`upstream.address`).
    let done = f.finish_upstream(None, Some("10.0.0.3:8000"));
    assert!(
        done.contains(&Effect::QueueDone(DoneReport {
            request_id: "rid-1".into(),
            endpoint: Some("10.0.0.3:8000".into()),
            outcome: Outcome::Success,
            status: Some(200),
            booking_id: Some("bk-9".into()),
            usage: None
        })),
        "{done:?}"
    );
}

/// A fleet whose placement memory is a map, as the shared-data table is for one process.
struct Remembering(Fleet, std::cell::RefCell<std::collections::HashMap<u64, String>>);

impl FleetSource for Remembering {
    fn fleet(&self) -> Option<Rc<FleetSnapshot>> {
        self.0.fleet()
    }
    fn placed(&self, key: SessionKey) -> Option<String> {
        self.1.borrow().get(&key.0).cloned()
    }
}

#[test]
fn a_fallback_sends_the_session_where_the_indexer_last_placed_it() {
    use crate::metrics::FallbackRoute;
    let fleet = Remembering(fleet(), Default::default());
    let key_of = |f: &RequestFlow| f.session.map(|(k, _)| k).unwrap();
    // Turn 1: the indexer places the conversation on w2 (not necessarily its rendezvous pin).
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let key = key_of(&f);
    let step = f.on_route_answer(Some(200), &decision(Value::Null), 0, &fleet);
    let remembered: Vec<_> =
        step.effects.iter().filter(|e| matches!(e, Effect::RememberPlacement { .. })).collect();
    assert_eq!(remembered, vec![&Effect::RememberPlacement { key, worker: "w2".into() }]);
    fleet.1.borrow_mut().insert(key.0, "w2".into());
    // Turn 2: the route call times out; the fallback keeps the conversation on w2, whatever the pin.
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let step = f.on_route_answer(Some(504), b"upstream request timeout", 100_000_000, &fleet);
    assert_eq!(counted(&step.effects, Metric::FallbackRoutes(FallbackRoute::Remembered)), 1);
    assert!(header_set(&step.effects, headers::DESTINATION_ENDPOINT)
        .is_some_and(|h| h.starts_with("10.0.0.2:8000,")));
    // Off: nothing remembered, nothing read; the fallback pins by rendezvous.
    let off = FilterConfig { placement_memory_slots: 0, ..FilterConfig::default() };
    let (mut f, _) = to_route_call(off.clone(), CHAT);
    let step = f.on_route_answer(Some(200), &decision(Value::Null), 0, &fleet);
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::RememberPlacement { .. })));
    let (mut f, _) = to_route_call(off, CHAT);
    let step = f.on_route_answer(Some(504), b"upstream request timeout", 100_000_000, &fleet);
    assert_eq!(counted(&step.effects, Metric::FallbackRoutes(FallbackRoute::Pinned)), 1);
    let pin = fleet.0 .0.as_ref().unwrap().pin(key.0, "").unwrap().endpoint.clone();
    assert!(header_set(&step.effects, headers::DESTINATION_ENDPOINT)
        .is_some_and(|h| h.starts_with(&pin)));
}

#[test]
fn a_short_body_is_routed_locally_without_the_indexer() {
    use crate::metrics::FallbackRoute;
    let fleet = Remembering(fleet(), Default::default());
    let local = FilterConfig {
        local_route_max_body_bytes: CHAT.len(),
        debug_headers: true,
        ..FilterConfig::default()
    };
    let start = |config: &FilterConfig, extra: &[(&str, &str)]| {
        let mut f = flow(config.clone());
        let mut h = chat_headers();
        h.extend(headers(extra));
        f.on_request_headers(&h, false, 0);
        f.on_request_body(CHAT.len(), true);
        let step = f.on_body(Some(CHAT.as_bytes().to_vec()), 0, &fleet);
        (f, step)
    };
    // At the bound: no call; the conversation's rendezvous pin, counted as a local route, no done report.
    let (mut f, step) = start(&local, &[]);
    assert_eq!(step.next, Next::Continue, "no route call, nothing to wait for");
    let key = f.session.map(|(k, _)| k).expect("a derived key");
    let pin = fleet.0 .0.as_ref().unwrap().pin(key.0, "").unwrap().endpoint.clone();
    assert!(header_set(&step.effects, headers::DESTINATION_ENDPOINT)
        .is_some_and(|h| h.starts_with(&pin)));
    assert_eq!(counted(&step.effects, Metric::LocalRoutes(FallbackRoute::Pinned)), 1);
    assert!(
        !step
            .effects
            .iter()
            .any(|e| matches!(e, Effect::Metric(MetricUpdate::Add(Metric::Fallbacks(_), _)))),
        "not a fallback: no alert"
    );
    let debug = f.on_response_headers(Some(200), true);
    assert!(
        debug.contains(&Effect::AddResponseHeader(
            headers::DEBUG_REASON,
            headers::LOCAL_ROUTE_REASON.into()
        )),
        "{debug:?}"
    );
    let done = f.finish(None);
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Pinned, OutcomeLabel::Success)), 1);
    assert!(!done.iter().any(|e| matches!(e, Effect::QueueDone(_))), "the indexer booked nothing");
    // A session the indexer placed earlier (its body was longer then, or the knob was off) stays there.
    fleet.1.borrow_mut().insert(key.0, "w2".into());
    let (_, step) = start(&local, &[]);
    assert_eq!(counted(&step.effects, Metric::LocalRoutes(FallbackRoute::Remembered)), 1);
    assert!(header_set(&step.effects, headers::DESTINATION_ENDPOINT)
        .is_some_and(|h| h.starts_with("10.0.0.2:8000")));
    // One byte over the bound, or off (the default): the indexer decides.
    let over = FilterConfig { local_route_max_body_bytes: CHAT.len() - 1, ..local.clone() };
    assert!(matches!(start(&over, &[]).1.next, Next::Call(_)));
    assert!(matches!(start(&FilterConfig::default(), &[]).1.next, Next::Call(_)));
    // A trusted operator override is the indexer's to apply, whatever the size.
    let trusted = FilterConfig { allow_overrides: true, override_secret: SECRET.into(), ..local };
    let (_, step) =
        start(&trusted, &[("x-kvmesh-worker", "w3"), (headers::OVERRIDE_SECRET, SECRET)]);
    assert!(matches!(step.next, Next::Call(_)));
}

/// Remembers body bases as the shared table would (one list per session key).
struct Bases(Fleet, std::cell::RefCell<std::collections::HashMap<u64, Vec<Remembered>>>);

impl FleetSource for Bases {
    fn fleet(&self) -> Option<Rc<FleetSnapshot>> {
        self.0.fleet()
    }
    fn body_bases(&self, key: SessionKey) -> Vec<Remembered> {
        self.1.borrow().get(&key.0).cloned().unwrap_or_default()
    }
}

impl Bases {
    fn apply(&self, effects: &[Effect]) {
        for e in effects {
            if let Effect::RememberBodyBase { key, new, used } = e {
                let old = self.body_bases(*key);
                self.1.borrow_mut().insert(key.0, body_bases::remember(old, *new, *used));
            }
        }
    }
}

/// A chat body after `turns` turns on a long system prompt, and the length of its prefix through
/// the last message (what the indexer's base covers).
fn long_chat(turns: usize) -> (String, usize) {
    let mut messages = vec![json!({"role": "system", "content": "s".repeat(10_000)})];
    messages.extend((0..turns).map(|t| json!({"role": "user", "content": format!("turn {t}")})));
    let body = serde_json::to_string(&json!({"messages": messages, "stream": true})).unwrap();
    let end = body.rfind(']').unwrap();
    (body, end)
}

fn start_with(fleet: &dyn FleetSource, config: &FilterConfig, body: &str) -> (RequestFlow, Step) {
    let mut f = flow(config.clone());
    let mut h = chat_headers();
    h.push(("x-session-id".into(), b"conversation-1".to_vec()));
    f.on_request_headers(&h, false, 0);
    f.on_request_body(body.len(), true);
    let step = f.on_body(Some(body.as_bytes().to_vec()), 0, fleet);
    (f, step)
}

fn answer_naming(base: Option<BodyBase>) -> Vec<u8> {
    let mut d: Value = serde_json::from_slice(&decision(Value::Null)).unwrap();
    d["mode"] = json!("aggregate");
    if let Some(b) = base {
        d["body_base"] = json!(b.to_string());
    }
    serde_json::to_vec(&d).unwrap()
}

#[test]
fn a_long_conversations_next_turn_is_sent_after_the_base_the_indexer_named() {
    let fleet = Bases(fleet(), Default::default());
    let config = FilterConfig::default();
    // Turn 1: sent whole; the answer names the body's prefix the indexer kept.
    let (turn1, end1) = long_chat(1);
    let (mut f, step) = start_with(&fleet, &config, &turn1);
    let Next::Call(call) = step.next else { panic!("a route call") };
    assert_eq!(
        (call.body(), call.header(headers::KVMESH_BODY_BASE)),
        (Some(turn1.as_bytes()), None)
    );
    assert_eq!(counted(&step.effects, Metric::RouteBodies(RouteBody::Whole)), 1);
    let base1 = BodyBase::of(42, &turn1.as_bytes()[..end1]);
    let step = f.on_route_answer(Some(200), &answer_naming(Some(base1)), 1_000_000, &fleet);
    fleet.apply(&step.effects);
    assert!(step.effects.contains(&Effect::ResumeRequest));
    // Turn 2: only the bytes after the base, which it names; its answer's base replaces it.
    let (turn2, end2) = long_chat(2);
    let (mut f, step) = start_with(&fleet, &config, &turn2);
    let Next::Call(call) = step.next else { panic!("a route call") };
    assert_eq!(call.body(), Some(&turn2.as_bytes()[end1..]));
    assert_eq!(call.header(headers::KVMESH_BODY_BASE), Some(base1.to_string().as_str()));
    assert_eq!(counted(&step.effects, Metric::RouteBodies(RouteBody::Delta)), 1);
    let base2 = BodyBase::of(42, &turn2.as_bytes()[..end2]);
    fleet.apply(
        &f.on_route_answer(Some(200), &answer_naming(Some(base2)), 1_000_000, &fleet).effects,
    );
    assert_eq!(
        fleet.body_bases(f.session.unwrap().0).iter().map(|r| r.base).collect::<Vec<_>>(),
        vec![base2]
    );
    // Turn 3: the indexer lost the base (restarted): 409, and the same call goes again, whole; the
    // indexer was healthy, and the base is forgotten.
    let (turn3, _) = long_chat(3);
    let (mut f, step) = start_with(&fleet, &config, &turn3);
    let Next::Call(call) = step.next else { panic!("a route call") };
    assert_eq!(call.body(), Some(&turn3.as_bytes()[end2..]));
    let lost = serde_json::to_vec(&ErrorBody::with_reason(
        409,
        "invalid_request_error",
        BASE_UNKNOWN,
        "gone",
    ))
    .unwrap();
    let step = f.on_route_answer(Some(409), &lost, 1_000_000, &fleet);
    fleet.apply(&step.effects);
    let Next::Call(again) = step.next else { panic!("the call again, got {:?}", step.next) };
    assert_eq!(
        (again.body(), again.header(headers::KVMESH_BODY_BASE)),
        (Some(turn3.as_bytes()), None)
    );
    assert_eq!(counted(&step.effects, Metric::RouteBodies(RouteBody::Resent)), 1);
    assert!(step.effects.contains(&Effect::IndexerHealth(CallHealth::Answered)));
    assert!(!step.effects.contains(&Effect::ResumeRequest), "still waiting for the answer");
    assert!(fleet.body_bases(f.session.unwrap().0).is_empty());
    let step = f.on_route_answer(Some(200), &answer_naming(None), 2_000_000, &fleet);
    assert!(step.effects.contains(&Effect::ResumeRequest));
    // The resent call never goes out (breaker open, dispatch refused): the request resumes, routed
    // locally — the answer callback's returned action means nothing.
    for skipped in [true, false] {
        let (mut f, _) = start_with(&fleet, &config, &turn3);
        fleet.apply(&[Effect::RememberBodyBase {
            key: f.session.unwrap().0,
            new: Remembered::new(base2, turn2.as_bytes()),
            used: None,
        }]);
        let (mut f2, step) = start_with(&fleet, &config, &turn3);
        assert!(
            matches!(step.next, Next::Call(ref c) if c.header(headers::KVMESH_BODY_BASE).is_some())
        );
        let step = f2.on_route_answer(Some(409), &lost, 1_000_000, &fleet);
        assert!(matches!(step.next, Next::Call(_)));
        let step = if skipped { f2.on_call_skipped(&fleet) } else { f2.on_dispatch_failed(&fleet) };
        assert!(step.effects.contains(&Effect::ResumeRequest), "skipped: {skipped}");
        // In the body callback nothing changes: `Continue` goes on.
        let step = if skipped { f.on_call_skipped(&fleet) } else { f.on_dispatch_failed(&fleet) };
        assert!(!step.effects.contains(&Effect::ResumeRequest));
    }
    // A 409 to a whole body is an answer like any other error: the request falls back.
    fleet.1.borrow_mut().clear();
    let (mut f, _) = start_with(&fleet, &config, &turn3);
    let step = f.on_route_answer(Some(409), &lost, 1_000_000, &fleet);
    assert_eq!(step.next, Next::Continue);
    assert!(step.effects.contains(&Effect::ResumeRequest));
    // Off: nothing read, nothing remembered.
    let off = FilterConfig { body_base_slots: 0, ..config };
    fleet.apply(&[Effect::RememberBodyBase {
        key: f.session.unwrap().0,
        new: Remembered::new(base2, turn2.as_bytes()),
        used: None,
    }]);
    let (mut f, step) = start_with(&fleet, &off, &turn3);
    let Next::Call(call) = step.next else { panic!("a route call") };
    assert_eq!(call.body(), Some(turn3.as_bytes()));
    let step = f.on_route_answer(Some(200), &answer_naming(Some(base2)), 1_000_000, &fleet);
    assert!(!step.effects.iter().any(|e| matches!(e, Effect::RememberBodyBase { .. })));
}

#[test]
fn the_release_marker_comes_once_when_the_filter_lets_the_request_go() {
    let released = Effect::SetRequestHeader(headers::RELEASED, "1".to_owned());
    // Routed: nothing while the request is held (buffering, waiting for the indexer), once after.
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&chat_headers(), false, 1_000_000);
    assert_eq!(f.release_marker(), None, "held while buffering");
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    assert_eq!(f.release_marker(), None, "held while the route call is out");
    f.on_route_answer(Some(200), &decision(json!(null)), 2_500_000, &fleet());
    assert_eq!(f.release_marker(), Some(released.clone()));
    assert_eq!(f.release_marker(), None, "once");
    // Fallen back (the indexer failed): released too.
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    f.on_route_answer(Some(503), b"", 2_500_000, &fleet());
    assert_eq!(f.release_marker(), Some(released.clone()));
    // A body the filter cannot read, and a request it never routes (GET), go on released.
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&chat_headers(), false, 1_000_000);
    f.on_body(Some(b"{not json".to_vec()), 2_000_000, &fleet());
    assert_eq!(f.release_marker(), Some(released.clone()));
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&headers(&[(":method", "GET"), (":path", "/health")]), true, 1);
    assert_eq!(f.release_marker(), Some(released.clone()));
    // `GET /v1/models` without a fleet snapshot goes to an engine, released.
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&headers(&[(":method", "GET"), (":path", "/v1/models")]), true, 1);
    assert_eq!(f.release_marker(), None, "held until the fleet is asked");
    f.on_models_list(&Fleet(None), 2);
    assert_eq!(f.release_marker(), Some(released));
    // Answered here (the indexer's designed rejection): nothing to release.
    let (mut f, _) = to_route_call(FilterConfig::default(), CHAT);
    let body = serde_json::to_vec(&ErrorBody::new(429, "rate_limit_exceeded", "full")).unwrap();
    f.on_route_answer(Some(429), &body, 2_500_000, &fleet());
    assert_eq!(f.release_marker(), None);
}

#[test]
fn the_route_call_says_when_the_filter_stops_waiting() {
    let config = FilterConfig { indexer_timeout_ms: 250, ..FilterConfig::default() };
    // Sent at 2 ms past the epoch on the host's wall clock (`to_route_call`).
    let (_, call) = to_route_call(config, CHAT);
    assert_eq!(call.header(headers::KVMESH_ROUTE_DEADLINE), Some("252"));
}

/// Drives a chat request to its route call with its body reserved in `budget`.
fn held_in(budget: &Rc<BodyBudget>, body: &str) -> RequestFlow {
    let mut f = flow(FilterConfig::default()).with_body_budget(Rc::clone(budget));
    f.on_request_headers(&chat_headers(), false, 1_000_000);
    assert_eq!(f.on_request_body(body.len(), true).next, Next::ReadBody(body.len()));
    let step = f.on_body(Some(body.as_bytes().to_vec()), 2_000_000, &fleet());
    assert!(matches!(step.next, Next::Call(_)), "{:?}", step.next);
    f
}

#[test]
fn a_body_over_the_held_budget_is_not_read_and_is_routed_without_the_indexer() {
    use crate::metrics::FallbackRoute;
    let budget = BodyBudget::new(CHAT.len() + 10);
    let mut first = held_in(&budget, CHAT);
    assert_eq!(budget.held(), CHAT.len());

    // With a session header: pinned by the header's key, no call, nothing booked.
    let config = FilterConfig { debug_headers: true, ..FilterConfig::default() };
    let mut f = flow(config).with_body_budget(Rc::clone(&budget));
    let mut with_session = chat_headers();
    with_session.push(("x-session-id".into(), b"conv-9".to_vec()));
    f.on_request_headers(&with_session, false, 0);
    let Next::LeaveBody(refused) = f.on_request_body(CHAT.len(), true).next else {
        panic!("the body should stay unread")
    };
    assert_eq!((refused.wanted, refused.held, refused.nth), (CHAT.len(), CHAT.len(), 1));
    let step = f.on_body_left(refused, &fleet());
    assert_eq!(step.next, Next::Continue);
    let e = &step.effects;
    assert_eq!(counted(e, Metric::Fallbacks(FallbackReason::BodyBudget)), 1);
    assert_eq!(counted(e, Metric::FallbackRoutes(FallbackRoute::Pinned)), 1);
    let key = session::from_header_value("conv-9");
    let pin = fleet().0.unwrap().pin(key.0, "").unwrap().endpoint.clone();
    assert!(header_set(e, headers::DESTINATION_ENDPOINT).is_some_and(|h| h.starts_with(&pin)));
    assert!(!e.iter().any(|e| matches!(e, Effect::IndexerHealth(_) | Effect::ResumeRequest)));
    assert_eq!(f.release_marker(), Some(Effect::SetRequestHeader(headers::RELEASED, "1".into())));
    let debug = f.on_response_headers(Some(200), true);
    assert!(
        debug.contains(&Effect::AddResponseHeader(headers::DEBUG_FALLBACK, "body_budget".into()))
    );
    assert!(!f.finish(None).iter().any(|e| matches!(e, Effect::QueueDone(_))), "never booked");
    assert_eq!(budget.held(), CHAT.len(), "a refusal holds nothing");

    // Without one (its derived key would need the body): Envoy's LB chooses.
    let mut f = flow(FilterConfig::default()).with_body_budget(Rc::clone(&budget));
    f.on_request_headers(&chat_headers(), false, 0);
    let Next::LeaveBody(refused) = f.on_request_body(CHAT.len(), true).next else { panic!() };
    assert_eq!(refused.nth, 2);
    let step = f.on_body_left(refused, &fleet());
    assert_eq!(counted(&step.effects, Metric::FallbackRoutes(FallbackRoute::NoSession)), 1);
    assert!(header_set(&step.effects, headers::DESTINATION_ENDPOINT).is_none());
    assert_eq!(f.on_body_left(refused, &fleet()).effects, vec![], "once only");

    // The first answer gives its bytes back: the next body fits again.
    first.on_route_answer(Some(200), &decision(Value::Null), 3_000_000, &fleet());
    assert_eq!(budget.held(), 0);
    let _next = held_in(&budget, CHAT);
    assert_eq!(budget.held(), CHAT.len());
}

#[test]
fn the_held_body_is_given_back_on_every_path() {
    let budget = BodyBudget::new(1 << 20);
    let reject = serde_json::to_vec(&ErrorBody::new(429, "rate_limit_exceeded", "full")).unwrap();
    type End = Box<dyn Fn(&mut RequestFlow)>;
    let paths: Vec<(&str, End)> = vec![
        (
            "answer",
            Box::new(|f| {
                drop(f.on_route_answer(Some(200), &decision(json!({"a": 1})), 0, &fleet()))
            }),
        ),
        ("timeout", Box::new(|f| drop(f.on_route_answer(Some(504), b"", 0, &fleet())))),
        ("reset", Box::new(|f| drop(f.on_route_answer(None, b"", 0, &fleet())))),
        ("rejection", Box::new(move |f| drop(f.on_route_answer(Some(429), &reject, 0, &fleet())))),
        ("dispatch failure", Box::new(|f| drop(f.on_dispatch_failed(&fleet())))),
        ("breaker open", Box::new(|f| drop(f.on_call_skipped(&fleet())))),
        ("stream reset", Box::new(|f| drop(f.finish(None)))),
    ];
    for (path, end) in &paths {
        let mut f = held_in(&budget, CHAT);
        assert_eq!(budget.held(), CHAT.len(), "{path}: held while the call is out");
        end(&mut f);
        assert_eq!(budget.held(), 0, "{path}");
        f.finish(Some(200));
        drop(f);
        assert_eq!(budget.held(), 0, "{path}: given back once");
    }

    // The context destroyed with the call out.
    drop(held_in(&budget, CHAT));
    assert_eq!(budget.held(), 0, "destroyed");

    // Bodies read but never held: unroutable, routed locally.
    let mut f = flow(FilterConfig::default()).with_body_budget(Rc::clone(&budget));
    f.on_request_headers(&chat_headers(), false, 0);
    f.on_request_body(8, true);
    f.on_body(Some(b"not json".to_vec()), 0, &fleet());
    assert_eq!(budget.held(), 0, "unroutable");
    let local = FilterConfig { local_route_max_body_bytes: 4096, ..FilterConfig::default() };
    let mut f = flow(local).with_body_budget(Rc::clone(&budget));
    f.on_request_headers(&chat_headers(), false, 0);
    f.on_request_body(CHAT.len(), true);
    f.on_body(Some(CHAT.as_bytes().to_vec()), 0, &fleet());
    assert_eq!(budget.held(), 0, "routed locally");
    // Envoy had no body to give.
    let mut f = flow(FilterConfig::default()).with_body_budget(Rc::clone(&budget));
    f.on_request_headers(&chat_headers(), false, 0);
    f.on_request_body(CHAT.len(), true);
    f.on_body(None, 0, &fleet());
    assert_eq!(budget.held(), 0, "no body");
}
