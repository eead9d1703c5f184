//! Unit tests of `crate::roles`: every cell of the role matrix, and done reports and fleet
//! snapshots travelling between roots of one Envoy (one [`FakeHost`]).

use std::rc::Rc;

use kvmesh_core::api::{
    DoneReport, FleetSnapshot, FleetWorker, Outcome, Role, WorkerLoad, DONE_PATH, FLEET_PATH,
};

use super::*;
use crate::background::FLEET_KEY;
use crate::flow::FleetSource;
use crate::host_api::fake::{Fail, FakeHost};
use crate::metrics::{DoneResult, FleetResult, Metric};

const VM: &str = "kvmesh";

fn config(json: &str) -> FilterConfig {
    FilterConfig::from_bytes(Some(json.as_bytes())).unwrap()
}

fn root(host: &Rc<FakeHost>, root_id: &str, json: &str) -> RootState {
    configure_root(Rc::clone(host) as Rc<dyn Host>, config(json), 1, root_id, VM)
}

fn report(id: &str) -> DoneReport {
    DoneReport {
        request_id: id.into(),
        endpoint: Some("10.0.0.1:8000".into()),
        outcome: Outcome::Success,
        status: Some(200),
        booking_id: None,
        usage: None,
    }
}

fn fleet_json(workers: usize) -> Vec<u8> {
    let workers = (0..workers)
        .map(|i| FleetWorker {
            id: format!("w{i}"),
            endpoint: format!("10.0.0.{i}:8000"),
            role: Role::Both,
            model: String::new(),
            healthy: true,
            load: WorkerLoad::default(),
        })
        .collect();
    serde_json::to_vec(&FleetSnapshot {
        generation: 1,
        block_size: 16,
        models: Vec::new(),
        workers,
    })
    .unwrap()
}

#[test]
fn the_role_matrix() {
    use crate::config::Background::{PerWorker, Singleton};
    let cases = [
        (crate::SERVICE_ROOT_ID, Singleton, RootRole::Service),
        (crate::SERVICE_ROOT_ID, PerWorker, RootRole::IdleService),
        ("kvmesh", Singleton, RootRole::Filter),
        ("", PerWorker, RootRole::FilterWithBackground),
    ];
    for (root_id, mode, role) in cases {
        assert_eq!(RootRole::of(root_id, mode), role, "{root_id:?} {mode:?}");
        assert_eq!(role.is_filter(), root_id != crate::SERVICE_ROOT_ID);
    }
}

#[test]
fn what_each_role_configures() {
    // (root_id, config, role, shares with HTTP contexts, runs background, tick)
    let cases = [
        // The tick is capped (MAX_TICK_MS) so a slower fleet period still polls promptly.
        (
            crate::SERVICE_ROOT_ID,
            r#"{}"#,
            RootRole::Service,
            false,
            true,
            Some(crate::config::MAX_TICK_MS),
        ),
        (
            crate::SERVICE_ROOT_ID,
            r#"{"fleet_refresh_ms": 100}"#,
            RootRole::Service,
            false,
            true,
            Some(100),
        ),
        (
            crate::SERVICE_ROOT_ID,
            r#"{"fleet_refresh_ms": 0}"#,
            RootRole::Service,
            false,
            true,
            None,
        ),
        (
            crate::SERVICE_ROOT_ID,
            r#"{"background": "per_worker"}"#,
            RootRole::IdleService,
            false,
            false,
            None,
        ),
        // A filter root flushes its own done reports in both modes.
        ("filter", r#"{}"#, RootRole::Filter, true, true, Some(20)),
        (
            "filter",
            r#"{"done_flush_ms": 5, "fleet_refresh_ms": 100}"#,
            RootRole::Filter,
            true,
            true,
            Some(5),
        ),
        (
            "filter",
            r#"{"background": "per_worker"}"#,
            RootRole::FilterWithBackground,
            true,
            true,
            Some(20),
        ),
        (
            "filter",
            r#"{"background": "per_worker", "fleet_refresh_ms": 0, "done_flush_ms": 50}"#,
            RootRole::FilterWithBackground,
            true,
            true,
            Some(50),
        ),
    ];
    for (root_id, json, role, shares, background, tick) in cases {
        let host = Rc::new(FakeHost::new());
        let state = root(&host, root_id, json);
        assert_eq!(state.role, role, "{root_id} {json}");
        assert_eq!(state.shared.is_some(), shares, "{root_id} {json}: shared");
        assert_eq!(state.tasks.is_some(), background, "{root_id} {json}: background");
        assert_eq!(state.tick_ms, tick, "{root_id} {json}: tick");
        assert_eq!(host.tick_ms(), tick, "{root_id} {json}: tick period set on the host");
        assert_eq!(host.stat_count(), Metric::all().len(), "every metric defined at configuration");
    }
}

#[test]
fn refused_configuration_configures_nothing() {
    let host = Rc::new(FakeHost::new());
    assert!(configure_from_bytes(
        Rc::clone(&host) as Rc<dyn Host>,
        Some(br#"{"no_such_field": 1}"#),
        1,
        "filter",
        VM
    )
    .is_none());
    assert_eq!(host.stat_count(), 0);
    let state =
        configure_from_bytes(Rc::clone(&host) as Rc<dyn Host>, None, 1, "filter", VM).unwrap();
    assert_eq!(state.role, RootRole::Filter, "no configuration is all defaults");
}

#[test]
fn a_tick_that_cannot_be_set_is_not_fatal() {
    let host = Rc::new(FakeHost::new());
    host.set_failing(Fail::SetTick, true);
    let mut service = root(&host, crate::SERVICE_ROOT_ID, "{}");
    assert_eq!(host.tick_ms(), None);
    // Without its tick the service still polls the fleet when ticked.
    service.tasks.as_mut().unwrap().on_tick();
    assert_eq!(host.tokens_to(FLEET_PATH).len(), 1);
}

#[test]
fn singleton_mode_filter_roots_send_their_own_reports_and_the_singleton_polls() {
    let host = Rc::new(FakeHost::new());
    let mut service = root(&host, crate::SERVICE_ROOT_ID, "{}");
    let mut filter = root(&host, "filter", "{}");
    let shared = Rc::clone(filter.shared.as_ref().unwrap());
    shared.queue_done(report("a"));
    shared.queue_done(report("b"));
    service.tasks.as_mut().unwrap().on_tick();
    assert!(host.tokens_to(DONE_PATH).is_empty(), "the singleton sends no reports");
    assert_eq!(host.tokens_to(FLEET_PATH).len(), 1, "the singleton polls the fleet");
    let tasks = filter.tasks.as_mut().unwrap();
    tasks.on_tick();
    assert_eq!(
        host.tokens_to(FLEET_PATH).len(),
        1,
        "a filter root does not poll in singleton mode"
    );
    let done = host.tokens_to(DONE_PATH);
    assert_eq!(done.len(), 1, "what waited since the last tick goes as one batch");
    let bodies = |token: u32| -> Vec<DoneReport> {
        let calls = host.calls();
        let call = calls.iter().find(|(t, _)| *t == token).map(|(_, c)| c.clone()).unwrap();
        kvmesh_core::api::parse_done_body(call.body().unwrap()).unwrap()
    };
    assert_eq!(bodies(done[0]), vec![report("a"), report("b")]);
    host.answer(Some(200), b"");
    tasks.on_http_call_response(done[0], 1, 0);
    shared.queue_done(report("c"));
    tasks.on_tick();
    let done = host.tokens_to(DONE_PATH);
    assert_eq!(bodies(done[1]), vec![report("c")]);
    host.answer(Some(500), b"");
    tasks.on_http_call_response(done[1], 1, 0);
    assert_eq!(host.value(Metric::DoneReports(DoneResult::Sent)), 2);
    assert_eq!(host.value(Metric::DoneReports(DoneResult::Retried)), 1, "a 5xx re-queues");
    assert_eq!(host.value(Metric::DoneReports(DoneResult::Failed)), 0);
    assert_eq!(host.value(Metric::DoneReports(DoneResult::Dropped)), 0);
}

#[test]
fn per_worker_mode_each_filter_root_polls_and_flushes_its_own_queue() {
    let json = r#"{"background": "per_worker", "fleet_refresh_ms": 100}"#;
    let host = Rc::new(FakeHost::new());
    let service = root(&host, crate::SERVICE_ROOT_ID, json);
    assert!(service.tasks.is_none() && service.tick_ms.is_none(), "idle singleton");
    let mut a = root(&host, "filter", json);
    let mut b = root(&host, "filter", json);
    let (shared_a, shared_b) =
        (Rc::clone(a.shared.as_ref().unwrap()), Rc::clone(b.shared.as_ref().unwrap()));

    // A report waits in its own thread's queue until that root's tick.
    shared_a.queue_done(report("from-a"));
    assert!(host.tokens_to(DONE_PATH).is_empty());
    b.tasks.as_mut().unwrap().on_tick();
    assert!(host.tokens_to(DONE_PATH).is_empty(), "b does not send a's reports");
    a.tasks.as_mut().unwrap().on_tick();
    assert_eq!(host.tokens_to(DONE_PATH).len(), 1);
    assert_eq!(host.value(Metric::DoneReports(DoneResult::Dropped)), 0);

    // Both polled the fleet on their first tick; a's answer is stored and b's contexts read it.
    let polls = host.tokens_to(FLEET_PATH);
    assert_eq!(polls.len(), 2);
    assert!(shared_b.fleet().is_none(), "nothing stored yet");
    host.answer(Some(200), &fleet_json(3));
    // b ticked first: polls[0] is b's call, polls[1] a's.
    a.tasks.as_mut().unwrap().on_http_call_response(polls[0], 1, fleet_json(3).len());
    assert!(host.shared_data(FLEET_KEY).is_none(), "b's token is not a's poll");
    a.tasks.as_mut().unwrap().on_http_call_response(polls[1], 1, fleet_json(3).len());
    assert_eq!(shared_b.fleet().unwrap().workers.len(), 3);
    assert_eq!(host.value(Metric::FleetRefreshes(FleetResult::Ok)), 1);
    assert_eq!(host.value(Metric::FleetDecodeWorkers), 3);

    // The next poll waits for the period.
    a.tasks.as_mut().unwrap().on_tick();
    assert_eq!(host.tokens_to(FLEET_PATH).len(), 2);
    host.advance_ms(100);
    a.tasks.as_mut().unwrap().on_tick();
    assert_eq!(host.tokens_to(FLEET_PATH).len(), 3);
}

#[test]
fn a_filter_root_holds_its_done_reports_while_its_route_breaker_is_open() {
    for mode in ["singleton", "per_worker"] {
        let host = Rc::new(FakeHost::new());
        let json =
            format!(r#"{{"background": "{mode}", "fleet_refresh_ms": 0, "breaker_failures": 1}}"#);
        let mut filter = root(&host, "filter", &json);
        let shared = Rc::clone(filter.shared.as_ref().unwrap());
        shared.record_route_call(crate::breaker::CallHealth::Failed, host.now_ns());
        shared.queue_done(report("a"));
        let tasks = filter.tasks.as_mut().unwrap();
        tasks.on_tick();
        assert!(
            host.tokens_to(DONE_PATH).is_empty(),
            "{mode}: the root's own breaker gates its flush"
        );
        shared.record_route_call(crate::breaker::CallHealth::Answered, host.now_ns());
        tasks.on_tick();
        assert_eq!(host.tokens_to(DONE_PATH).len(), 1, "{mode}");
    }
}
