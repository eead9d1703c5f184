//! Unit tests of `crate::shared`: the done queue, the fleet cache, and the breaker and endpoint
//! ledger as seen through metrics.

use std::rc::Rc;

use kvmesh_core::api::{FleetWorker, Outcome, Role, WorkerLoad};

use super::*;
use crate::host_api::fake::FakeHost;
use crate::metrics::FleetResult;

fn report(id: &str) -> DoneReport {
    DoneReport {
        request_id: id.into(),
        endpoint: None,
        outcome: Outcome::Aborted,
        status: None,
        booking_id: Some("bk-7".into()),
        usage: None,
    }
}

fn queue() -> Rc<RefCell<DoneQueue>> {
    Rc::new(RefCell::new(DoneQueue::new(16, 1)))
}

fn shared_with(host: &Rc<FakeHost>, json: &str, done: Rc<RefCell<DoneQueue>>) -> Shared {
    let config = Rc::new(FilterConfig::from_bytes(Some(json.as_bytes())).unwrap());
    let dyn_host: Rc<dyn Host> = Rc::clone(host) as Rc<dyn Host>;
    let metrics = Rc::new(MetricIds::define(Rc::clone(&dyn_host), 16));
    Shared::new(dyn_host, config, metrics, done)
}

fn fleet(n: usize, generation: u64) -> Vec<u8> {
    let workers = (0..n)
        .map(|i| FleetWorker {
            id: format!("w{i}"),
            endpoint: format!("10.0.0.{i}:8000"),
            role: Role::Decode,
            model: String::new(),
            healthy: true,
            load: WorkerLoad::default(),
        })
        .collect();
    serde_json::to_vec(&FleetSnapshot { generation, block_size: 16, models: Vec::new(), workers })
        .unwrap()
}

#[test]
fn the_done_queue_is_bounded_and_counts_drops() {
    let host = Rc::new(FakeHost::new());
    let queue = Rc::new(RefCell::new(DoneQueue::new(2, 1)));
    let shared = shared_with(&host, "{}", Rc::clone(&queue));
    for id in ["a", "b", "c"] {
        shared.queue_done(report(id));
    }
    assert_eq!(queue.borrow().pending(), 2);
    assert_eq!(host.value(Metric::DoneReports(DoneResult::Dropped)), 1);
}

#[test]
fn fleet_cache_parses_again_only_when_the_cas_changes() {
    let host = Rc::new(FakeHost::new());
    let shared = shared_with(&host, "{}", queue());
    assert!(shared.fleet().is_none(), "nothing stored");
    host.set_shared_data(FLEET_KEY, &fleet(2, 1)).unwrap();
    let first = shared.fleet().unwrap();
    let again = shared.fleet().unwrap();
    assert!(Rc::ptr_eq(&first, &again), "same CAS: the cached snapshot");
    host.set_shared_data(FLEET_KEY, &fleet(3, 2)).unwrap();
    let newer = shared.fleet().unwrap();
    assert_eq!((newer.generation, newer.workers.len()), (2, 3));
    assert!(!Rc::ptr_eq(&first, &newer));

    host.set_shared_data(FLEET_KEY, b"not a fleet").unwrap();
    assert!(shared.fleet().is_none());
    assert_eq!(host.value(Metric::InternalErrors(InternalError::BadFleetData)), 1);
    assert_eq!(
        host.value(Metric::FleetRefreshes(FleetResult::Failed)),
        0,
        "reading is not polling"
    );
}

#[test]
fn breaker_transitions_and_ejections_are_counted() {
    use crate::metrics::BreakerState;
    let host = Rc::new(FakeHost::new());
    let json = r#"{"breaker_failures": 2, "breaker_open_ms": 100, "endpoint_failures": 2, "endpoint_ejection_ms": 1000}"#;
    let shared = shared_with(&host, json, queue());
    let now = host.now_ns();
    assert_eq!(shared.admit_route_call(now), Admit::Call);
    shared.record_route_call(CallHealth::Failed, now);
    shared.record_route_call(CallHealth::Failed, now);
    assert_eq!(host.value(Metric::BreakerTransitions(BreakerState::Open)), 1);
    assert_eq!(shared.admit_route_call(now), Admit::Skip);
    let later = now + 100 * 1_000_000;
    assert_eq!(shared.admit_route_call(later), Admit::Probe);
    assert_eq!(host.value(Metric::BreakerTransitions(BreakerState::HalfOpen)), 1);
    shared.record_route_call(CallHealth::Answered, later);
    assert_eq!(host.value(Metric::BreakerTransitions(BreakerState::Closed)), 1);

    shared.record_endpoint("10.0.0.1:8000", false, now);
    shared.record_endpoint("10.0.0.1:8000", false, now);
    assert_eq!(host.value(Metric::EndpointEjections), 1);
    assert_eq!(
        shared.reorder_endpoints("10.0.0.1:8000,10.0.0.2:8000"),
        ("10.0.0.2:8000,10.0.0.1:8000".to_owned(), 1)
    );
    host.advance_ms(1000);
    assert_eq!(
        shared.reorder_endpoints("10.0.0.1:8000,10.0.0.2:8000").1,
        0,
        "the host's clock ends the ejection"
    );
}
