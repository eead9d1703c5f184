//! Unit tests of `crate::endpoints`.

use super::*;

const MS: u64 = 1_000_000;

#[test]
fn consecutive_failures_eject_for_a_window() {
    let mut h = EndpointHealth::new(2, 1000);
    assert_eq!(h.record("a:1", false, 0), None);
    assert_eq!(h.record("a:1", true, MS), None, "a success clears the count");
    assert_eq!(h.record("a:1", false, 2 * MS), None);
    assert_eq!(h.record("a:1", false, 3 * MS), Some(HealthEvent::Ejected));
    assert!(h.is_ejected("a:1", 4 * MS) && !h.is_ejected("b:1", 4 * MS));
    assert_eq!(
        h.record("a:1", false, 5 * MS),
        None,
        "failures of attempts already under way are no news"
    );
    assert!(!h.is_ejected("a:1", 1003 * MS), "the window ended");
    assert_eq!(
        h.record("a:1", false, 1004 * MS),
        Some(HealthEvent::Ejected),
        "one more failure after the window ejects again"
    );
    assert!(h.record("a:1", true, 2100 * MS).is_none() && !h.is_ejected("a:1", 2100 * MS));
    assert_eq!(h.record("a:1", false, 2200 * MS), None, "a success reset the streak");
}

#[test]
fn threshold_zero_never_ejects() {
    let mut h = EndpointHealth::new(0, 1000);
    for t in 0..10 {
        assert_eq!(h.record("a:1", false, t), None);
    }
    assert!(!h.is_ejected("a:1", 10));
}

#[test]
fn reorder_moves_ejected_endpoints_last() {
    let mut h = EndpointHealth::new(1, 1000);
    h.record("b:2", false, 0);
    let cases = [
        ("a:1,b:2,c:3", "a:1,c:3,b:2", 1),
        ("b:2,c:3", "c:3,b:2", 1),
        ("b:2", "b:2", 0),
        ("a:1,c:3", "a:1,c:3", 0),
    ];
    for (list, want, moved) in cases {
        assert_eq!(h.reorder(list, MS), (want.to_owned(), moved), "{list}");
    }
    assert_eq!(h.reorder("b:2,c:3", 1000 * MS), ("b:2,c:3".to_owned(), 0), "after the window");
}

#[test]
fn the_ledger_is_bounded() {
    let mut h = EndpointHealth::new(3, 1000);
    for i in 0..(MAX_TRACKED + 100) {
        h.record(&format!("10.0.{}.{}:1", i / 256, i % 256), false, 0);
    }
    assert!(h.entries.len() <= MAX_TRACKED);
}

#[test]
fn attempt_outcomes_table() {
    type Case<'a> = (Option<&'a str>, Option<&'a str>, Option<u16>, Vec<(&'a str, bool)>);
    let cases: Vec<Case> = vec![
        (Some("a:1"), Some("a:1"), Some(200), vec![("a:1", true)]),
        (Some("a:1"), Some("a:1"), Some(500), vec![("a:1", false)]),
        (Some("a:1"), Some("b:2"), Some(200), vec![("b:2", true), ("a:1", false)]),
        (Some("a:1"), Some("b:2"), Some(503), vec![("b:2", false), ("a:1", false)]),
        (None, Some("b:2"), Some(502), vec![("b:2", false)]),
        (Some("a:1"), Some("a:1"), Some(404), vec![]),
        (Some("a:1"), None, Some(503), vec![]),
        (Some("a:1"), Some("a:1"), None, vec![]),
    ];
    for (primary, served, status, want) in cases {
        let want: Vec<(String, bool)> =
            want.into_iter().map(|(e, ok)| (e.to_owned(), ok)).collect();
        assert_eq!(
            attempt_outcomes(primary, served, status),
            want,
            "{primary:?} {served:?} {status:?}"
        );
    }
}
