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
    assert_eq!(q.next_to_send().unwrap().request_id, "a");
    assert_eq!(q.next_to_send().unwrap().request_id, "b");
    assert_eq!(q.next_to_send(), None, "two in flight");
    assert!(q.offer(report("e")));
    q.call_finished();
    assert_eq!(q.next_to_send().unwrap().request_id, "c");
    q.call_finished();
    q.call_finished();
    q.call_finished();
    assert_eq!(q.in_flight(), 0);
    assert_eq!(q.next_to_send().unwrap().request_id, "e");
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
fn done_round_trip() {
    let r = report("x");
    assert_eq!(decode_done(&encode_done(&r).unwrap()), Some(r));
    assert_eq!(decode_done(b"{"), None);
}
