//! Scenario tests of [`super::RequestFlow`] with several models (issue 44): the unknown-model 404
//! with and without the indexer, the fallback within the model's workers, `GET /v1/models`, the
//! `model` label.

use super::tests::{counted, flow, Fleet};
use super::*;
use crate::metrics::FallbackRoute;
use crate::models::tests::two_models;
use kvmesh_core::api::ErrorBody;

fn fleet() -> Fleet {
    Fleet(Some(Rc::new(two_models())))
}

fn headers(method: &str, path: &str) -> Vec<(String, Vec<u8>)> {
    [(":method", method), (":path", path), ("x-request-id", "rid-1"), ("x-session-id", "s-1")]
        .iter()
        .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
        .collect()
}

fn chat(model: Option<&str>) -> Vec<u8> {
    let mut body = serde_json::json!({"messages": [{"role": "user", "content": "hello"}]});
    if let Some(m) = model {
        body["model"] = m.into();
    }
    serde_json::to_vec(&body).unwrap()
}

/// The local reply among `effects`: status and body.
fn reply(effects: &[Effect]) -> Option<(u16, Vec<u8>)> {
    effects.iter().find_map(|e| match e {
        Effect::SendResponse { status, body, .. } => Some((*status, body.clone())),
        _ => None,
    })
}

fn destination(effects: &[Effect]) -> Option<String> {
    effects.iter().find_map(|e| match e {
        Effect::SetRequestHeader(n, v) if *n == headers::DESTINATION_ENDPOINT => Some(v.clone()),
        _ => None,
    })
}

/// A chat request for `model` driven to its body; the body step.
fn read(config: FilterConfig, model: Option<&str>, fleet: &Fleet) -> (RequestFlow, Step) {
    let mut f = flow(config);
    let body = chat(model);
    assert_eq!(
        f.on_request_headers(&headers("POST", "/v1/chat/completions"), false, 1_000_000).next,
        Next::Pause
    );
    assert_eq!(f.on_request_body(body.len(), true).next, Next::ReadBody(body.len()));
    let step = f.on_body(Some(body), 2_000_000, fleet);
    (f, step)
}

fn assert_vllm_404(effects: &[Effect], model: &str) {
    let (status, body) = reply(effects).expect("a local 404");
    assert_eq!(status, 404);
    let sent: ErrorBody = serde_json::from_slice(&body).unwrap();
    assert_eq!(sent, kvmesh_core::models::not_found(model));
    assert!(!effects.contains(&Effect::ResumeRequest), "never forwarded");
    assert_eq!(destination(effects), None);
}

#[test]
fn the_indexers_unknown_model_is_answered_here_and_never_forwarded() {
    let (mut f, step) = read(FilterConfig::default(), Some("gpt-4"), &fleet());
    assert!(matches!(step.next, Next::Call(_)), "the indexer decides while it answers");
    assert_eq!(f.model(), None, "not served: labelled unknown");
    let answer = serde_json::to_vec(&kvmesh_core::models::not_found("gpt-4")).unwrap();
    let step = f.on_route_answer(Some(404), &answer, 2_500_000, &fleet());
    assert_vllm_404(&step.effects, "gpt-4");
    assert_eq!(counted(&step.effects, Metric::LocalAnswers(LocalAnswer::UnknownModel)), 1);
    assert!(step.effects.contains(&Effect::IndexerHealth(CallHealth::Answered)));
    assert!(
        !step
            .effects
            .iter()
            .any(|e| matches!(e, Effect::Metric(MetricUpdate::Add(Metric::Fallbacks(_), _)))),
        "not a fallback"
    );
    assert_eq!(f.release_marker(), None, "answered: nothing to release");
    assert!(f.on_response_headers(Some(404), false).is_empty());
    let done = f.finish(Some(404));
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Error)), 1);
    assert!(!done.iter().any(|e| matches!(e, Effect::QueueDone(_))), "nothing was booked");
}

#[test]
fn without_the_indexer_an_unknown_model_is_answered_from_the_snapshot() {
    // The indexer down (503), the call never dispatched, the breaker open: the same 404.
    let (mut f, _) = read(FilterConfig::default(), Some("gpt-4"), &fleet());
    let step = f.on_route_answer(Some(503), b"no healthy upstream", 2_500_000, &fleet());
    assert_vllm_404(&step.effects, "gpt-4");
    assert_eq!(counted(&step.effects, Metric::LocalAnswers(LocalAnswer::UnknownModelLocal)), 1);
    assert_eq!(counted(&step.effects, Metric::FallbackRoutes(FallbackRoute::UnknownModel)), 1);
    assert_eq!(counted(&step.effects, Metric::Fallbacks(FallbackReason::Unavailable)), 1);
    let done = f.finish(Some(404));
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Error)), 1);

    let (mut f, _) = read(FilterConfig::default(), Some("gpt-4"), &fleet());
    let step = f.on_dispatch_failed(&fleet());
    assert_vllm_404(&step.effects, "gpt-4");
    assert_eq!(step.next, Next::Pause, "a local reply in a stream callback stops the request");

    let (mut f, _) = read(FilterConfig::default(), Some("gpt-4"), &fleet());
    let step = f.on_call_skipped(&fleet());
    assert_vllm_404(&step.effects, "gpt-4");
    assert_eq!(step.next, Next::Pause);

    // A short body routed locally: the same.
    let local = FilterConfig { local_route_max_body_bytes: 4096, ..FilterConfig::default() };
    let (mut f, step) = read(local, Some("gpt-4"), &fleet());
    assert_vllm_404(&step.effects, "gpt-4");
    assert_eq!(step.next, Next::Pause);
    assert_eq!(counted(&step.effects, Metric::LocalRoutes(FallbackRoute::UnknownModel)), 1);
    assert_eq!(f.release_marker(), None);
}

#[test]
fn without_a_snapshot_an_unknown_model_goes_to_envoys_lb() {
    let (mut f, _) = read(FilterConfig::default(), Some("gpt-4"), &Fleet(None));
    let step = f.on_route_answer(Some(503), b"", 2_500_000, &Fleet(None));
    assert_eq!(reply(&step.effects), None);
    assert!(step.effects.contains(&Effect::ResumeRequest));
    assert_eq!(counted(&step.effects, Metric::FallbackRoutes(FallbackRoute::NoFleet)), 1);
}

#[test]
fn the_fallback_pins_within_the_requests_base_model() {
    let snapshot = two_models();
    for (model, base) in [
        (Some("base-b"), "base-b"),
        (Some("b-code"), "base-b"),
        (Some("a"), "base-a"),
        (None, "base-a"),
    ] {
        let (mut f, _) = read(FilterConfig::default(), model, &fleet());
        assert_eq!(f.model(), Some(base), "{model:?}");
        let step = f.on_route_answer(Some(503), b"", 2_500_000, &fleet());
        assert!(step.effects.contains(&Effect::ResumeRequest));
        let header = destination(&step.effects).expect("pinned");
        for endpoint in header.split(',') {
            let w = snapshot.workers.iter().find(|w| w.endpoint == endpoint).unwrap();
            assert_eq!(w.model, base, "{model:?}: {header}");
        }
        let key = f.session.map(|(k, _)| k.0).unwrap();
        assert_eq!(
            header.split(',').next(),
            Some(snapshot.pin(key, base).unwrap().endpoint.as_str())
        );
    }
}

#[test]
fn get_v1_models_is_answered_from_the_snapshot() {
    for path in ["/v1/models", "/v1/models?x=1"] {
        let mut f = flow(FilterConfig::default());
        let step = f.on_request_headers(&headers("GET", path), true, 1);
        assert_eq!(step.next, Next::ListModels);
        let step = f.on_models_list(&fleet(), 1_700_000_000_500_000_000);
        assert_eq!(step.next, Next::Pause);
        let (status, body) = reply(&step.effects).unwrap();
        assert_eq!(status, 200);
        let list: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(list, kvmesh_core::models::models_list(&two_models().models, 1_700_000_000));
        assert_eq!(counted(&step.effects, Metric::LocalAnswers(LocalAnswer::ModelsList)), 1);
        assert_eq!(f.release_marker(), None);
        assert!(f.on_response_data(100, 2).is_empty());
        let done = f.finish(Some(200));
        assert_eq!(
            counted(&done, Metric::Requests(RouteLabel::Unrouted, OutcomeLabel::Success)),
            1
        );
    }
    // Anything else on that path, or no snapshot: to an engine, as before.
    let mut f = flow(FilterConfig::default());
    let step = f.on_request_headers(&headers("POST", "/v1/models"), false, 1);
    assert_eq!(step.next, Next::Continue);
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&headers("GET", "/v1/models"), true, 1);
    let step = f.on_models_list(&Fleet(None), 2);
    assert_eq!((step.next, reply(&step.effects)), (Next::Continue, None));
    assert_eq!(counted(&step.effects, Metric::Unroutable(UnroutableReason::UnknownPath)), 1);
    let mut old = two_models();
    old.models.clear();
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&headers("GET", "/v1/models"), true, 1);
    let step = f.on_models_list(&Fleet(Some(Rc::new(old))), 2);
    assert_eq!(reply(&step.effects), None, "a snapshot without models lists nothing");
    // Asked twice (never in practice): answered once.
    assert_eq!(f.on_models_list(&fleet(), 3), Step::just(Next::Continue));
}

#[test]
fn a_routed_request_is_labelled_with_its_base_model() {
    let (mut f, _) = read(FilterConfig::default(), Some("a-sql"), &fleet());
    assert_eq!(f.model(), Some("base-a"));
    let decision = serde_json::to_vec(&serde_json::json!({
        "endpoint": "10.0.0.3:8000", "fallbacks": [], "worker": "w3", "mode": "aggregate",
        "overlap_blocks": 1, "isl_blocks": 2, "reason": "overlap"
    }))
    .unwrap();
    let step = f.on_route_answer(Some(200), &decision, 2_500_000, &fleet());
    assert_eq!(destination(&step.effects).as_deref(), Some("10.0.0.3:8000"));
    assert_eq!(f.model(), Some("base-a"));
    // Before the body is read, and without a snapshot: unknown.
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&headers("POST", "/v1/chat/completions"), false, 1);
    assert_eq!(f.model(), None);
    let (f, _) = read(FilterConfig::default(), Some("base-b"), &Fleet(None));
    assert_eq!(f.model(), None);
    // Past the fleet's first `max_model_labels` models: `other`.
    let one = FilterConfig { max_model_labels: 1, ..FilterConfig::default() };
    let (f, _) = read(one.clone(), Some("b-code"), &fleet());
    assert_eq!(f.model(), Some("other"));
    let (f, _) = read(one, Some("a"), &fleet());
    assert_eq!(f.model(), Some("base-a"));
}

#[test]
fn a_request_without_a_session_stays_within_its_model_on_the_fallback() {
    let snapshot = two_models();
    for rid in ["r-1", "r-2", "r-3", "r-4"] {
        let mut f = flow(FilterConfig::default());
        let head: Vec<(String, Vec<u8>)> =
            [(":method", "POST"), (":path", "/v1/completions"), ("x-request-id", rid)]
                .iter()
                .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
                .collect();
        let body = br#"{"model":"b-code","prompt":[1,2,3]}"#.to_vec();
        f.on_request_headers(&head, false, 1);
        f.on_request_body(body.len(), true);
        f.on_body(Some(body), 2, &fleet());
        assert_eq!(f.session, None, "completions derive no session key");
        let step = f.on_route_answer(None, b"", 3, &fleet());
        assert_eq!(counted(&step.effects, Metric::FallbackRoutes(FallbackRoute::Spread)), 1);
        let header = destination(&step.effects).expect("pinned within base-b");
        assert_eq!(header, "10.0.0.2:8000", "base-b's one worker, never base-a's");
        assert!(snapshot.workers.iter().any(|w| w.endpoint == header && w.model == "base-b"));
    }
}

#[test]
fn a_body_over_the_held_budget_in_a_fleet_of_several_models_is_a_503_not_a_guess() {
    use crate::body_budget::BodyBudget;
    // Room for nothing: the body is not read, so its `model` is unknown.
    let budget = BodyBudget::new(0);
    let body = chat(Some("model-b"));
    let mut f = flow(FilterConfig::default()).with_body_budget(Rc::clone(&budget));
    f.on_request_headers(&headers("POST", "/v1/chat/completions"), false, 0);
    let Next::LeaveBody(refused) = f.on_request_body(body.len(), true).next else {
        panic!("the body should stay unread")
    };
    let step = f.on_body_left(refused, &fleet());
    assert_eq!(step.next, Next::Pause);
    let (status, answer) = reply(&step.effects).expect("a local answer");
    assert_eq!(status, 503);
    let error: ErrorBody = serde_json::from_slice(&answer).unwrap();
    assert_eq!(error.error.reason.as_deref(), Some(crate::models::BODY_BUDGET_REASON));
    assert!(step.effects.iter().any(|e| matches!(e,
        Effect::SendResponse { headers, .. } if headers.iter().any(|(n, v)| *n == "retry-after" && v == "1"))));
    assert_eq!(destination(&step.effects), None, "no worker guessed");
    assert_eq!(counted(&step.effects, Metric::LocalAnswers(LocalAnswer::BodyBudget)), 1);
    assert_eq!(counted(&step.effects, Metric::Fallbacks(FallbackReason::BodyBudget)), 1);
    assert_eq!(budget.held(), 0);
}
