//! Unit tests of `crate::tasks`: the fleet poll and the done dispatcher against the test host.

use std::cell::RefCell;
use std::rc::Rc;

use kvmesh_core::api::{DoneReport, Outcome, DONE_PATH, FLEET_PATH, MAX_DONE_BATCH};

use super::*;
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
    let metrics = Rc::new(MetricIds::define(Rc::clone(&dyn_host)));
    let done = Rc::new(RefCell::new(DoneQueue::new(config.done_queue_capacity, config.done_max_in_flight)));
    let tasks = BackgroundTasks::new(dyn_host, config, metrics, Rc::clone(&done), true);
    Rig { host, done, tasks }
}

fn report(id: &str) -> DoneReport {
    DoneReport { request_id: id.into(), endpoint: Some("10.0.0.1:8000".into()), outcome: Outcome::Success, status: Some(200), booking_id: Some("bk-1".into()) }
}

#[test]
fn fleet_answers_that_are_not_stored() {
    let big = vec![b' '; MAX_FLEET_BYTES + 1];
    // (status, body, counts as)
    let cases: [(Option<u16>, &[u8]); 4] = [(None, b""), (Some(503), b"{}"), (Some(200), b"[1,2]"), (Some(200), &big)];
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
    r.host.answer(None, b"");
    r.tasks.on_http_call_response(sent[1], 0, 0);
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Sent)), 1, "counted per report");
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Failed)), 3);
    assert_eq!((r.done.borrow().pending(), r.done.borrow().in_flight()), (0, 0));
}

#[test]
fn done_calls_stay_within_max_in_flight() {
    let mut r = rig(r#"{"done_max_in_flight": 2, "done_queue_capacity": 1000, "fleet_refresh_ms": 0}"#);
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
    assert_eq!(r.host.tokens_to(DONE_PATH).len(), 3, "an answer frees a slot and sends the next batch");
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Sent)), MAX_DONE_BATCH as i64);
    assert_eq!((r.done.borrow().pending(), r.done.borrow().in_flight()), (MAX_DONE_BATCH, 2));
}

#[test]
fn a_failed_done_dispatch_frees_its_slot() {
    let mut r = rig(r#"{"done_max_in_flight": 1, "fleet_refresh_ms": 0}"#);
    r.done.borrow_mut().offer(report("a"));
    r.done.borrow_mut().offer(report("b"));
    r.host.set_failing(Fail::Dispatch, true);
    r.tasks.on_tick();
    assert_eq!(r.host.value(Metric::DoneReports(DoneResult::Failed)), 2, "both tried, both failed");
    assert_eq!(r.done.borrow().in_flight(), 0);
}
