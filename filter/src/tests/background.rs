//! Unit tests of `crate::background`.

use super::*;
use kvmesh_core::api::Outcome;

fn report(id: &str) -> DoneReport {
    DoneReport { request_id: id.into(), endpoint: Some("10.0.0.1:8000".into()), outcome: Outcome::Success, status: Some(200), booking_id: None }
}

#[test]
fn done_queue_bounds_pending_and_in_flight() {
    let mut q = DoneQueue::new(3, 2);
    assert!(q.offer(report("a")) && q.offer(report("b")) && q.offer(report("c")));
    assert!(!q.offer(report("d")), "full queue drops");
    let ids = |b: Vec<DoneReport>| b.into_iter().map(|r| r.request_id).collect::<Vec<_>>();
    assert_eq!(ids(q.next_batch()), ["a", "b", "c"], "nothing out: everything waiting goes in one call");
    assert_eq!(q.in_flight(), 1);
    assert!(q.next_batch().is_empty(), "nothing waits");
    assert!(q.offer(report("e")));
    assert!(q.next_batch().is_empty(), "a call is out and the batch is not full: e waits for its answer");
    q.call_finished();
    assert_eq!(ids(q.next_batch()), ["e"]);
    q.call_finished();
    q.call_finished();
    assert_eq!(q.in_flight(), 0, "never below zero");
    assert_eq!(q.pending(), 0);
}

#[test]
fn full_batches_go_out_up_to_max_in_flight() {
    let n = 3 * MAX_DONE_BATCH + 1;
    let mut q = DoneQueue::new(n, 2);
    for i in 0..n {
        assert!(q.offer(report(&i.to_string())));
    }
    let first = q.next_batch();
    assert_eq!((first.len(), first[0].request_id.as_str()), (MAX_DONE_BATCH, "0"), "a batch is bounded, oldest first");
    let second = q.next_batch();
    assert_eq!((second.len(), second[0].request_id.as_str()), (MAX_DONE_BATCH, "64"), "a full batch does not wait for the answer");
    assert!(q.next_batch().is_empty(), "max_in_flight calls out");
    q.call_finished();
    assert_eq!(q.next_batch().len(), MAX_DONE_BATCH);
    assert!(q.next_batch().is_empty());
    q.call_finished();
    q.call_finished();
    assert_eq!(q.next_batch().len(), 1, "the rest once no call is out");
    assert_eq!(q.pending(), 0);
}

#[test]
fn fleet_schedule() {
    let ms = 1_000_000;
    let mut s = FleetSchedule::new(1000);
    assert!(s.due(0));
    s.started(0, 7);
    assert!(!s.due(5000 * ms), "one poll at a time");
    assert!(!s.take_answer(8));
    assert!(s.take_answer(7));
    assert!(!s.due(999 * ms));
    assert!(s.due(1000 * ms));
    s.failed_to_start(1000 * ms);
    assert!(!s.due(1500 * ms));
    assert!(s.due(2000 * ms));
    assert!(!FleetSchedule::new(0).due(0));
}

#[test]
fn fleet_answers() {
    let good = br#"{"generation":3,"block_size":16,"workers":[{"id":"w","endpoint":"10.0.0.1:8000","role":"decode","healthy":true}]}"#;
    assert_eq!(parse_fleet_answer(Some(200), good).unwrap().workers.len(), 1);
    assert_eq!(parse_fleet_answer(None, good), Err(FleetError::NoResponse));
    assert_eq!(parse_fleet_answer(Some(503), good), Err(FleetError::Status(503)));
    assert!(matches!(parse_fleet_answer(Some(200), b"nope"), Err(FleetError::Invalid(_))));
    let huge = vec![b' '; MAX_FLEET_BYTES + 1];
    assert_eq!(parse_fleet_answer(Some(200), &huge), Err(FleetError::TooLarge(MAX_FLEET_BYTES + 1)));
}

#[test]
fn a_batch_is_what_the_indexer_reads() {
    let batch = vec![report("x"), report("y")];
    let body = encode_done_batch(&batch).unwrap();
    assert!(body.starts_with(b"["), "more than one report: an array");
    assert_eq!(kvmesh_core::api::parse_done_body(&body).unwrap(), batch, "what the indexer reads");
    let lone = vec![report("z")];
    let body = encode_done_batch(&lone).unwrap();
    assert_eq!(serde_json::from_slice::<DoneReport>(&body).unwrap(), lone[0], "a lone report is the bare object older indexers read");
    assert_eq!(kvmesh_core::api::parse_done_body(&body).unwrap(), lone);
}
