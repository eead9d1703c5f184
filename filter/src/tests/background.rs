//! Unit tests of `crate::background`.

use super::*;
use kvmesh_core::api::Outcome;

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

#[test]
fn done_queue_bounds_pending_and_in_flight() {
    let mut q = DoneQueue::new(3, 2);
    assert!(q.offer(report("a")) && q.offer(report("b")) && q.offer(report("c")));
    assert!(!q.offer(report("d")), "full queue drops");
    let ids = |b: Vec<QueuedDone>| b.into_iter().map(|q| q.report.request_id).collect::<Vec<_>>();
    assert_eq!(
        ids(q.next_batch(0)),
        ["a", "b", "c"],
        "nothing out: everything waiting goes in one call"
    );
    assert_eq!(q.in_flight(), 1);
    assert!(q.next_batch(0).is_empty(), "nothing waits");
    assert!(q.offer(report("e")));
    assert!(
        q.next_batch(0).is_empty(),
        "a call is out and the batch is not full: e waits for its answer"
    );
    q.call_finished();
    assert_eq!(ids(q.next_batch(0)), ["e"]);
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
    let first = q.next_batch(0);
    assert_eq!(
        (first.len(), first[0].report.request_id.as_str()),
        (MAX_DONE_BATCH, "0"),
        "a batch is bounded, oldest first"
    );
    let second = q.next_batch(0);
    assert_eq!(
        (second.len(), second[0].report.request_id.as_str()),
        (MAX_DONE_BATCH, "64"),
        "a full batch does not wait for the answer"
    );
    assert!(q.next_batch(0).is_empty(), "max_in_flight calls out");
    q.call_finished();
    assert_eq!(q.next_batch(0).len(), MAX_DONE_BATCH);
    assert!(q.next_batch(0).is_empty());
    q.call_finished();
    q.call_finished();
    assert_eq!(q.next_batch(0).len(), 1, "the rest once no call is out");
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
    assert_eq!(
        parse_fleet_answer(Some(200), &huge),
        Err(FleetError::TooLarge(MAX_FLEET_BYTES + 1))
    );
}

#[test]
fn a_batch_is_what_the_indexer_reads() {
    let queued = |r: DoneReport| QueuedDone { report: r, failed_attempts: 1 };
    let batch = vec![report("x"), report("y")];
    let body = encode_done_batch(&batch.iter().cloned().map(queued).collect::<Vec<_>>()).unwrap();
    assert!(body.starts_with(b"["), "more than one report: an array");
    assert_eq!(kvmesh_core::api::parse_done_body(&body).unwrap(), batch, "what the indexer reads");
    let lone = vec![report("z")];
    let body = encode_done_batch(&[queued(lone[0].clone())]).unwrap();
    assert_eq!(
        serde_json::from_slice::<DoneReport>(&body).unwrap(),
        lone[0],
        "a lone report is the bare object older indexers read"
    );
    assert_eq!(kvmesh_core::api::parse_done_body(&body).unwrap(), lone);
}

fn ids_of(q: &mut DoneQueue, now_ns: u64) -> Vec<String> {
    q.next_batch(now_ns).into_iter().map(|q| q.report.request_id).collect()
}

#[test]
fn a_failed_batch_goes_back_to_the_front_after_a_hold() {
    let mut q = DoneQueue::new(8, 1);
    assert!(q.offer(report("a")) && q.offer(report("b")));
    let batch = q.next_batch(0);
    assert!(q.offer(report("c")));
    q.call_finished();
    let r = q.requeue(batch, 100, 50);
    assert_eq!(r, Requeued { retried: 2, given_up: 0, dropped: 0 });
    assert!(q.next_batch(149).is_empty(), "held after a failure");
    assert_eq!(
        ids_of(&mut q, 150),
        ["a", "b", "c"],
        "the retried reports are the oldest: they go first, with what waited"
    );
}

#[test]
fn requeue_caps_attempts_and_keeps_the_bound() {
    // (capacity, reports in the failed batch, reports waiting meanwhile, failed calls before this one,
    //  expected Requeued, pending after)
    let cases = [
        (8, 2, 0, 0, Requeued { retried: 2, given_up: 0, dropped: 0 }, 2),
        (8, 2, 0, MAX_DONE_ATTEMPTS - 2, Requeued { retried: 2, given_up: 0, dropped: 0 }, 2),
        (8, 2, 1, MAX_DONE_ATTEMPTS - 1, Requeued { retried: 0, given_up: 2, dropped: 0 }, 1),
        (4, 3, 3, 0, Requeued { retried: 1, given_up: 0, dropped: 2 }, 4),
        (2, 2, 2, 0, Requeued { retried: 0, given_up: 0, dropped: 2 }, 2),
    ];
    for (capacity, sent, waiting, before, want, pending) in cases {
        let mut q = DoneQueue::new(capacity, 1);
        let batch: Vec<QueuedDone> = (0..sent)
            .map(|i| QueuedDone { report: report(&format!("old{i}")), failed_attempts: before })
            .collect();
        for i in 0..waiting {
            assert!(q.offer(report(&format!("new{i}"))));
        }
        let got = q.requeue(batch, 0, 0);
        assert_eq!(
            got, want,
            "capacity {capacity}, {sent} failed + {waiting} waiting, {before} attempts before"
        );
        assert_eq!(q.pending(), pending, "capacity {capacity}");
        assert!(q.pending() <= capacity, "the bound holds");
        let ids = ids_of(&mut q, 0);
        assert!(
            ids.iter().rev().take(waiting.min(capacity)).all(|id| id.starts_with("new")),
            "the oldest go first: {ids:?}"
        );
    }
}

#[test]
fn a_report_is_retried_until_the_attempts_cap() {
    let mut q = DoneQueue::new(8, 1);
    assert!(q.offer(report("a")));
    let mut counted = Requeued::default();
    for call in 0..u64::from(MAX_DONE_ATTEMPTS) {
        let batch = q.next_batch(call);
        assert_eq!(batch.len(), 1, "call {call} carries the report");
        q.call_finished();
        let r = q.requeue(batch, call, 0);
        counted.retried += r.retried;
        counted.given_up += r.given_up;
    }
    assert_eq!(
        counted,
        Requeued { retried: u64::from(MAX_DONE_ATTEMPTS) - 1, given_up: 1, dropped: 0 }
    );
    assert_eq!(q.pending(), 0, "given up, not looping");
}
