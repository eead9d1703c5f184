//! Scenario tests of [`super::RequestFlow`] behind a GIE endpoint picker (`defer_to_picker`, the
//! `both` edge): a destination the picker set is let go untouched, a request without one is
//! routed by the filter as ever, and with the flag off nothing changes.

use super::tests::{counted, flow, Fleet};
use super::*;

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hello"}]}"#;
const PICKED: &str = "10.0.0.2:8000,10.0.0.3:8000";

fn headers(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
    list.iter().map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec())).collect()
}

/// A chat POST's headers, with the picker's destination when `picked` is given.
fn chat_headers(picked: Option<&str>) -> Vec<(String, Vec<u8>)> {
    let mut h = headers(&[
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("x-request-id", "rid-1"),
        ("content-length", "62"),
    ]);
    if let Some(p) = picked {
        h.extend(headers(&[(headers::DESTINATION_ENDPOINT, p)]));
    }
    h
}

fn deferring() -> FilterConfig {
    FilterConfig { defer_to_picker: true, ..FilterConfig::default() }
}

fn touches_destination(effects: &[Effect]) -> bool {
    effects.iter().any(|e| {
        matches!(e, Effect::SetRequestHeader(n, _) | Effect::RemoveRequestHeader(n)
            if *n == headers::DESTINATION_ENDPOINT)
    })
}

const DEFERRED: Metric = Metric::PickerDestinations(PickerDestination::Deferred);
const ABSENT: Metric = Metric::PickerDestinations(PickerDestination::Absent);

#[test]
fn a_destination_the_picker_set_goes_on_untouched() {
    let mut f = flow(deferring());
    let step = f.on_request_headers(&chat_headers(Some(PICKED)), false, 1_000_000);
    assert_eq!(step.next, Next::Continue, "not paused: the body is not read");
    assert_eq!(step.effects, vec![Effect::Metric(MetricUpdate::Add(DEFERRED, 1))]);
    assert_eq!(f.request_id(), "rid-1");
    // Let go: the marker that puts it on the normal route, once.
    assert_eq!(
        f.release_marker(),
        Some(Effect::SetRequestHeader(headers::RELEASED, "1".to_owned()))
    );
    assert_eq!(f.release_marker(), None);
    // The body streams through: no read, no call.
    assert_eq!(f.on_request_body(20, false), Step::just(Next::Continue));
    assert_eq!(f.on_request_body(CHAT.len(), true), Step::just(Next::Continue));
    assert_eq!(f.on_request_trailers(), Step::just(Next::Continue));
    assert!(f.on_response_headers(Some(200), false).is_empty(), "no decision to describe");
    f.on_response_body(true);
    // Envoy's retry moved it to the picker's fallback: the ledger hears of both endpoints, and
    // no done report goes out (the picker releases its own booking).
    let done = f.finish_upstream(None, Some("10.0.0.3:8000"));
    assert!(done.contains(&Effect::EndpointOutcome { endpoint: "10.0.0.2:8000".into(), ok: false }));
    assert!(done.contains(&Effect::EndpointOutcome { endpoint: "10.0.0.3:8000".into(), ok: true }));
    assert!(!done.iter().any(|e| matches!(e, Effect::QueueDone(_))), "{done:?}");
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Picker, OutcomeLabel::Success)), 1);
    assert_eq!(f.model(), None, "the body was never read: model=\"unknown\"");
    assert!(f.finish(None).is_empty(), "booked once");
}

#[test]
fn any_request_the_picker_routed_is_deferred_not_only_completions() {
    // The picker pins other paths (a GET, `/tokenize`) at their headers.
    let mut f = flow(deferring());
    let h = headers(&[
        (":method", "GET"),
        (":path", "/health"),
        (headers::DESTINATION_ENDPOINT, "10.0.0.1:8000"),
    ]);
    let step = f.on_request_headers(&h, true, 0);
    assert_eq!(step.next, Next::Continue);
    assert_eq!(counted(&step.effects, DEFERRED), 1);
    assert!(!touches_destination(&step.effects));
    let done = f.finish(Some(503));
    assert_eq!(counted(&done, Metric::Requests(RouteLabel::Picker, OutcomeLabel::Error)), 1);
}

#[test]
fn without_the_pickers_destination_the_filter_routes_and_counts_it_absent() {
    let mut f = flow(deferring());
    let step = f.on_request_headers(&chat_headers(None), false, 1_000_000);
    assert_eq!(step.next, Next::Pause, "buffered for the filter's own route call");
    assert_eq!(counted(&step.effects, ABSENT), 1);
    assert_eq!(counted(&step.effects, DEFERRED), 0);
    assert_eq!(f.on_request_body(CHAT.len(), true).next, Next::ReadBody(CHAT.len()));
    let step = f.on_body(Some(CHAT.as_bytes().to_vec()), 2_000_000, &Fleet(None));
    assert!(matches!(step.next, Next::Call(_)), "{:?}", step.next);
}

#[test]
fn with_the_flag_off_a_present_destination_is_the_clients_and_stripped() {
    for config in [FilterConfig::default(), FilterConfig { defer_to_picker: false, ..deferring() }]
    {
        let mut f = flow(config);
        let step = f.on_request_headers(&chat_headers(Some(PICKED)), false, 0);
        assert_eq!(step.next, Next::Pause);
        assert!(step.effects.contains(&Effect::RemoveRequestHeader(headers::DESTINATION_ENDPOINT)));
        assert_eq!(counted(&step.effects, DEFERRED) + counted(&step.effects, ABSENT), 0);
    }
}

#[test]
fn an_overlong_destination_is_still_deferred_and_judged_by_no_endpoint() {
    let long = vec!["10.0.0.1:8000"; 30].join(",");
    let mut f = flow(deferring());
    let step = f.on_request_headers(&chat_headers(Some(&long)), false, 0);
    assert_eq!(step.next, Next::Continue);
    assert_eq!(counted(&step.effects, DEFERRED), 1);
    let done = f.finish_upstream(Some(200), Some("10.0.0.1:8000"));
    // Only the served host (what Envoy reports), no primary read from the header.
    let judged: Vec<&Effect> =
        done.iter().filter(|e| matches!(e, Effect::EndpointOutcome { .. })).collect();
    assert_eq!(
        judged,
        vec![&Effect::EndpointOutcome { endpoint: "10.0.0.1:8000".into(), ok: true }]
    );
}
