//! Unit tests of `crate::tasks`: the fleet poll and the done dispatcher against the test host.

use std::cell::RefCell;
use std::rc::Rc;

use kvmesh_core::api::{DoneReport, Outcome, DONE_PATH, FLEET_PATH, MAX_DONE_BATCH};

use super::*;
use crate::breaker::CallHealth;
use crate::host_api::fake::{Fail, FakeHost};
use crate::metrics::InternalError;
use crate::request::HttpCall;

struct Rig {
    host: Rc<FakeHost>,
    done: Rc<RefCell<DoneQueue>>,
    tasks: BackgroundTasks,
}

fn rig(json: &str) -> Rig {
    let host = Rc::new(FakeHost::new());
    let config = Rc::new(FilterConfig::from_bytes(Some(json.as_bytes())).unwrap());
    let dyn_host: Rc<dyn Host> = Rc::clone(&host) as Rc<dyn Host>;
    let metrics = Rc::new(MetricIds::define(Rc::clone(&dyn_host), 16));
    let done = Rc::new(RefCell::new(DoneQueue::new(
        config.done_queue_capacity,
        config.done_max_in_flight,
    )));
    let tasks = BackgroundTasks::new(dyn_host, config, metrics, Rc::clone(&done), true);
    Rig { host, done, tasks }
}

fn report(id: &str) -> DoneReport {
    DoneReport {
        request_id: id.into(),
        endpoint: Some("10.0.0.1:8000".into()),
        outcome: Outcome::Success,
        status: Some(200),
        booking_id: Some("bk-1".into()),
        usage: None,
    }
}

#[test]
fn fleet_answers_that_are_not_stored() {
    let big = vec![b' '; MAX_FLEET_BYTES + 1];
    // (status, body, counts as)
    let cases: [(Option<u16>, &[u8]); 4] =
        [(None, b""), (Some(503), b"{}"), (Some(200), b"[1,2]"), (Some(200), &big)];
    for (status, body) in cases {
        let mut r = rig(r#"{"fleet_refresh_ms": 100}"#);
        r.tasks.on_tick();
        let token = r.host.tokens_to(FLEET_PATH)[0];
        r.host.answer(status, body);
        r.tasks.on_http_call_response(token, usize::from(status.is_some()), body.len());
        assert!(r.host.shared_data(FLEET_KEY).is_none(), "{status:?} stored");
        assert_eq!(r.host.value(Metric::FleetRefreshes(FleetResult::Failed)), 1, "{status:?}");
        assert_eq!(r.host.value(Metric::FleetRefreshes(FleetResult::Ok)), 0);
    }
}

#[test]
fn one_poll_in_flight_and_a_failed_dispatch_waits_a_period() {
    let mut r = rig(r#"{"fleet_refresh_ms": 100}"#);
    r.tasks.on_tick();
    r.host.advance_ms(500);
    r.tasks.on_tick();
    assert_eq!(r.host.tokens_to(FLEET_PATH).len(), 1, "never two at once");
    let token = r.host.tokens_to(FLEET_PATH)[0];
    r.host.answer(None, b"");
    r.tasks.on_http_call_response(token, 0, 0);
    r.host.set_failing(Fail::Dispatch, true);
    r.tasks.on_tick();
    assert_eq!(r.host.value(Metric::FleetRefreshes(FleetResult::Failed)), 2);
    assert_eq!(r.host.value(Metric::InternalErrors(InternalError::HostCall)), 1);
    r.host.set_failing(Fail::Dispatch, false);
    r.tasks.on_tick();
    assert_eq!(r.host.tokens_to(FLEET_PATH).len(), 1, "retried only after a period");
    r.host.advance_ms(100);
    r.tasks.on_tick();
    assert_eq!(r.host.tokens_to(FLEET_PATH).len(), 2);
}

#[test]
fn a_fleet_that_cannot_be_stored_counts_as_failed() {
    let mut r = rig(r#"{}"#);
    r.tasks.on_tick();
    let token = r.host.tokens_to(FLEET_PATH)[0];
    r.host.set_failing(Fail::SetSharedData, true);
    let body = br#"{"generation": 1, "block_size": 16, "workers": []}"#;
    r.host.answer(Some(200), body);
    r.tasks.on_http_call_response(token, 1, body.len());
    assert_eq!(r.host.value(Metric::FleetRefreshes(FleetResult::Failed)), 1);
    assert_eq!(r.host.value(Metric::InternalErrors(InternalError::HostCall)), 1);
}

#[test]
fn never_polls_when_refresh_is_off() {
    let mut r = rig(r#"{"fleet_refresh_ms": 0}"#);
    r.tasks.on_tick();
    r.host.advance_ms(60_000);
    r.tasks.on_tick();
    assert!(r.host.calls().is_empty());
}

/// (reports waiting, calls out).
fn queued(r: &Rig) -> (usize, usize) {
    (r.done.borrow().pending(), r.done.borrow().in_flight())
}

fn batch_of(call: &HttpCall) -> Vec<String> {
    let reports = kvmesh_core::api::parse_done_body(call.body().unwrap()).unwrap();
    reports.into_iter().map(|r| r.request_id).collect()
}

#[test]
fn done_reports_that_wait_for_an_answer_go_as_one_call() {
    let mut r = rig(r#"{"done_max_in_flight": 2, "fleet_refresh_ms": 0}"#);
    r.done.borrow_mut().offer(report("a"));
    r.tasks.on_tick();
    let sent = r.host.tokens_to(DONE_PATH);
    assert_eq!(sent.len(), 1, "a lone report goes at once");
    let first = &r.host.calls()[0].1;
    assert_eq!(first.upstream, "kvmesh_indexer");
    assert_eq!(batch_of(first), ["a"]);
    for id in ["b", "c", "d"] {
        r.done.borrow_mut().offer(report(id));
        r.tasks.on_tick();
    }
    assert_eq!(r.host.tokens_to(DONE_PATH).len(), 1, "they wait for the call out");
    r.host.answer(Some(200), br#"{"released":true}"#);
    r.tasks.on_http_call_response(sent[0], 1, 0);
    let sent = r.host.tokens_to(DONE_PATH);
    assert_eq!(sent.len(), 2, "the answer sends what waited");
    assert_eq!(batch_of(&r.host.calls()[1].1), ["b", "c", "d"]);
    r.tasks.on_http_call_response(9999, 1, 0);
    assert_eq!(r.host.tokens_to(DONE_PATH).len(), 2, "unknown tokens are ignored");
    r.host.answer(Some(200), b"{}");
    r.tasks.on_http_call_response(sent[1], 1, 0);
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Sent)), 4, "counted per report");
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Failed)), 0);
    assert_eq!(queued(&r), (0, 0), "(pending, in flight)");
}

#[test]
fn done_calls_stay_within_max_in_flight() {
    let mut r =
        rig(r#"{"done_max_in_flight": 2, "done_queue_capacity": 1000, "fleet_refresh_ms": 0}"#);
    let n = 4 * MAX_DONE_BATCH;
    for i in 0..n {
        assert!(r.done.borrow_mut().offer(report(&i.to_string())));
    }
    r.tasks.on_tick();
    let sent = r.host.tokens_to(DONE_PATH);
    assert_eq!(sent.len(), 2, "two slots, a full batch each");
    assert!(r.host.calls().iter().all(|(_, c)| batch_of(c).len() == MAX_DONE_BATCH));
    r.host.answer(Some(200), b"{}");
    r.tasks.on_http_call_response(sent[0], 1, 0);
    assert_eq!(
        r.host.tokens_to(DONE_PATH).len(),
        3,
        "an answer frees a slot and sends the next batch"
    );
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Sent)), MAX_DONE_BATCH as i64);
    assert_eq!(queued(&r), (MAX_DONE_BATCH, 2), "(pending, in flight)");
}

#[test]
fn a_failed_done_dispatch_frees_its_slot() {
    let mut r = rig(r#"{"done_max_in_flight": 1, "fleet_refresh_ms": 0}"#);
    r.done.borrow_mut().offer(report("a"));
    r.done.borrow_mut().offer(report("b"));
    r.host.set_failing(Fail::Dispatch, true);
    r.tasks.on_tick();
    assert_eq!(
        r.host.value(Metric::DoneReports(DoneResult::Retried)),
        2,
        "both tried, both back in the queue"
    );
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Failed)), 0);
    assert_eq!(r.done.borrow().in_flight(), 0);
    assert_eq!(r.done.borrow().pending(), 2);
    r.tasks.on_tick();
    assert_eq!(
        r.host.value(Metric::DoneReports(DoneResult::Retried)),
        2,
        "held: no retry before breaker_open_ms"
    );
    r.host.set_failing(Fail::Dispatch, false);
    r.host.advance_ms(1000);
    r.tasks.on_tick();
    let sent = r.host.tokens_to(DONE_PATH);
    assert_eq!(sent.len(), 1);
    assert_eq!(batch_of(&r.host.calls()[0].1), ["a", "b"], "dispatched once the hold ends");
}

/// Answers the one `/v1/done` call out with `status` (None: no response).
fn answer_done(r: &mut Rig, status: Option<u16>) {
    let token = *r.host.tokens_to(DONE_PATH).last().unwrap();
    r.host.answer(status, b"");
    r.tasks.on_http_call_response(token, usize::from(status.is_some()), 0);
}

#[test]
fn how_a_done_answer_is_counted_and_whether_it_is_retried() {
    // (answer, counted as, sent again in the next batch)
    let cases = [
        (Some(200), DoneResult::Sent, false),
        (Some(204), DoneResult::Sent, false),
        (None, DoneResult::Retried, true),
        (Some(503), DoneResult::Retried, true),
        (Some(500), DoneResult::Retried, true),
        (Some(400), DoneResult::Failed, false),
        (Some(413), DoneResult::Failed, false),
    ];
    for (status, counted, retried) in cases {
        let mut r = rig(r#"{"fleet_refresh_ms": 0, "breaker_open_ms": 100}"#);
        r.done.borrow_mut().offer(report("a"));
        r.done.borrow_mut().offer(report("b"));
        r.tasks.on_tick();
        answer_done(&mut r, status);
        assert_eq!(r.host.value(Metric::DoneReports(counted)), 2, "{status:?}");
        let others: i64 = DoneResult::ALL
            .iter()
            .filter(|&&d| d != counted)
            .map(|&d| r.host.value(Metric::DoneReports(d)))
            .sum();
        assert_eq!(others, 0, "{status:?} counted once");
        r.done.borrow_mut().offer(report("c"));
        r.tasks.on_tick();
        assert_eq!(
            r.host.tokens_to(DONE_PATH).len(),
            usize::from(!retried) + 1,
            "{status:?}: a retry waits for the hold"
        );
        r.host.advance_ms(100);
        r.tasks.on_tick();
        let calls = r.host.calls();
        assert_eq!(calls.len(), 2, "{status:?}");
        let want: &[&str] = if retried { &["a", "b", "c"] } else { &["c"] };
        assert_eq!(batch_of(&calls[1].1), want, "{status:?}");
        assert_eq!(r.done.borrow().in_flight(), 1);
    }
}

#[test]
fn a_report_that_keeps_failing_is_given_up_at_the_attempts_cap() {
    let mut r = rig(r#"{"fleet_refresh_ms": 0, "breaker_open_ms": 100}"#);
    r.done.borrow_mut().offer(report("a"));
    for attempt in 1..=crate::background::MAX_DONE_ATTEMPTS {
        r.tasks.on_tick();
        assert_eq!(
            r.host.tokens_to(DONE_PATH).len(),
            usize::from(attempt),
            "attempt {attempt} sent"
        );
        answer_done(&mut r, if attempt % 2 == 0 { Some(502) } else { None });
        r.host.advance_ms(100);
    }
    r.tasks.on_tick();
    assert_eq!(
        r.host.tokens_to(DONE_PATH).len(),
        usize::from(crate::background::MAX_DONE_ATTEMPTS),
        "not sent again"
    );
    assert_eq!(
        r.host.value(Metric::DoneReports(DoneResult::Retried)),
        i64::from(crate::background::MAX_DONE_ATTEMPTS) - 1
    );
    assert_eq!(
        r.host.value(Metric::DoneReports(DoneResult::Failed)),
        1,
        "counted failed once, when given up"
    );
    assert_eq!(queued(&r), (0, 0), "(pending, in flight)");
}

#[test]
fn retried_reports_keep_the_queue_bound() {
    let mut r =
        rig(r#"{"fleet_refresh_ms": 0, "done_queue_capacity": 4, "done_max_in_flight": 1}"#);
    for id in ["a", "b", "c"] {
        r.done.borrow_mut().offer(report(id));
    }
    r.tasks.on_tick();
    for id in ["d", "e", "f"] {
        assert!(r.done.borrow_mut().offer(report(id)));
    }
    answer_done(&mut r, None);
    assert_eq!(r.done.borrow().pending(), 4, "capacity holds with the retried reports back");
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Dropped)), 2, "the oldest dropped");
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Retried)), 1);
    r.host.advance_ms(1000);
    r.tasks.on_tick();
    assert_eq!(batch_of(&r.host.calls()[1].1), ["c", "d", "e", "f"]);
}

#[test]
fn the_done_flush_holds_while_the_route_breaker_is_open() {
    let host = Rc::new(FakeHost::new());
    let config = Rc::new(
        FilterConfig::from_bytes(Some(
            br#"{"fleet_refresh_ms": 0, "breaker_failures": 2, "breaker_open_ms": 100}"#,
        ))
        .unwrap(),
    );
    let dyn_host: Rc<dyn Host> = Rc::clone(&host) as Rc<dyn Host>;
    let metrics = Rc::new(MetricIds::define(Rc::clone(&dyn_host), 16));
    let done = Rc::new(RefCell::new(DoneQueue::new(
        config.done_queue_capacity,
        config.done_max_in_flight,
    )));
    let shared = Rc::new(Shared::new(
        Rc::clone(&dyn_host),
        Rc::clone(&config),
        Rc::clone(&metrics),
        Rc::clone(&done),
    ));
    let mut tasks = BackgroundTasks::new(dyn_host, config, metrics, Rc::clone(&done), false)
        .gated_by(Rc::clone(&shared));
    for _ in 0..2 {
        shared.record_route_call(CallHealth::Failed, host.now_ns());
    }
    shared.queue_done(report("a"));
    for _ in 0..4 {
        host.advance_ms(20);
        tasks.on_tick();
    }
    assert!(
        host.tokens_to(DONE_PATH).is_empty(),
        "nothing sent to an indexer the breaker says is down"
    );
    assert_eq!(done.borrow().pending(), 1, "the report waits, not failed");
    assert_eq!(host.value(Metric::DoneReports(DoneResult::Failed)), 0);
    host.advance_ms(30);
    let probe = shared.admit_route_call(host.now_ns());
    assert_eq!(probe, crate::breaker::Admit::Probe);
    tasks.on_tick();
    assert!(host.tokens_to(DONE_PATH).is_empty(), "half-open: still held while the probe is out");
    shared.record_route_call(CallHealth::Answered, host.now_ns());
    tasks.on_tick();
    assert_eq!(host.tokens_to(DONE_PATH).len(), 1, "closed again: the report goes");
    // Open again, and no route call comes to this thread after the hang: once the open window has
    // passed the reports go anyway (else their bookings would stay until they expire).
    let token = *host.tokens_to(DONE_PATH).last().unwrap();
    host.answer(Some(200), b"");
    tasks.on_http_call_response(token, 1, 0);
    for _ in 0..2 {
        shared.record_route_call(CallHealth::Failed, host.now_ns());
    }
    shared.queue_done(report("b"));
    host.advance_ms(50);
    tasks.on_tick();
    assert_eq!(host.tokens_to(DONE_PATH).len(), 1, "inside the window: held");
    host.advance_ms(60);
    tasks.on_tick();
    assert_eq!(host.tokens_to(DONE_PATH).len(), 2, "past the window with no probe: sent");
}
