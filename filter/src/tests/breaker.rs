//! Unit tests of `crate::breaker`: a scripted timeline per case.

use super::*;

const MS: u64 = 1_000_000;

/// One step of a timeline: at `t_ms`, either ask for admission or record an outcome; expect the
/// admission (for asks) and the transition.
enum Op {
    Admit(u64, Admit, Option<BreakerState>),
    Record(u64, CallHealth, Option<BreakerState>),
}

fn run(name: &str, threshold: u32, open_ms: u64, ops: &[Op]) {
    let mut b = Breaker::new(threshold, open_ms);
    for (i, op) in ops.iter().enumerate() {
        match op {
            Op::Admit(t, want, transition) => assert_eq!(
                b.admit(t * MS),
                (*want, *transition),
                "{name}: step {i} (admit at {t} ms)"
            ),
            Op::Record(t, health, transition) => assert_eq!(
                b.record(*health, t * MS),
                *transition,
                "{name}: step {i} (record {health:?} at {t} ms)"
            ),
        }
    }
}

#[test]
fn timelines() {
    use Admit::*;
    use CallHealth::*;
    use Op::{Admit as A, Record as R};
    let open = Some(BreakerState::Open);
    let half = Some(BreakerState::HalfOpen);
    let closed = Some(BreakerState::Closed);
    run(
        "answers keep it closed",
        3,
        1000,
        &[
            R(0, Failed, None),
            R(1, Failed, None),
            R(2, Answered, None),
            R(3, Failed, None),
            R(4, Failed, None),
            A(5, Call, None),
        ],
    );
    run(
        "k failures open it; skip until the window ends; a good probe closes it",
        3,
        1000,
        &[
            R(0, Failed, None),
            R(1, Failed, None),
            R(2, Failed, open),
            A(3, Skip, None),
            A(1001, Skip, None),
            A(1002, Probe, half),
            A(1003, Skip, None),
            R(1010, Answered, closed),
            A(1011, Call, None),
        ],
    );
    run(
        "a failed probe reopens for another window",
        2,
        500,
        &[
            R(0, Failed, None),
            R(0, Failed, open),
            A(500, Probe, half),
            R(600, Failed, open),
            A(1099, Skip, None),
            A(1100, Probe, half),
        ],
    );
    run(
        "a probe that never reports stops blocking after a window",
        1,
        100,
        &[
            R(0, Failed, open),
            A(100, Probe, half),
            A(150, Skip, None),
            A(200, Probe, None),
            R(210, Answered, closed),
        ],
    );
    run(
        "threshold 0 never opens",
        0,
        100,
        &[R(0, Failed, None), R(1, Failed, None), R(2, Failed, None), A(3, Call, None)],
    );
    run(
        "a late answer from before the opening closes it; a late failure changes nothing",
        2,
        1000,
        &[
            R(0, Failed, None),
            R(1, Failed, open),
            R(2, Failed, None),
            A(3, Skip, None),
            R(4, Answered, closed),
            A(5, Call, None),
        ],
    );
}

#[test]
fn is_open_follows_the_state() {
    let mut b = Breaker::new(1, 10);
    assert!(!b.is_open());
    b.record(CallHealth::Failed, 0);
    assert!(b.is_open());
    assert_eq!(b.admit(10 * MS).0, Admit::Probe);
    assert!(b.is_open(), "half-open still skips other calls");
    b.record(CallHealth::Answered, 11 * MS);
    assert!(!b.is_open());
}
