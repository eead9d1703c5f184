//! Tests of [`super::BodyBudget`]: reserve, release on drop, refusals, no underflow.

use super::*;

#[test]
fn reservations_fit_up_to_the_limit_and_drop_gives_them_back() {
    let budget = BodyBudget::new(100);
    let a = budget.reserve(60).expect("fits");
    let b = budget.reserve(40).expect("fits exactly");
    assert_eq!(budget.held(), 100);
    let refused = budget.reserve(1).expect_err("full");
    assert_eq!(refused, Refused { wanted: 1, held: 100, limit: 100, nth: 1 });
    drop(a);
    assert_eq!(budget.held(), 40);
    let c = budget.reserve(60).expect("fits again after the release");
    drop(b);
    drop(c);
    assert_eq!(budget.held(), 0);
}

#[test]
fn a_body_over_the_whole_budget_is_refused_even_when_nothing_is_held() {
    let budget = BodyBudget::new(100);
    assert!(budget.reserve(101).is_err());
    assert_eq!(budget.held(), 0);
}

#[test]
fn a_refusal_holds_nothing_and_a_huge_size_does_not_overflow() {
    let budget = BodyBudget::new(100);
    let _a = budget.reserve(50).expect("fits");
    assert!(budget.reserve(usize::MAX).is_err());
    assert_eq!(budget.held(), 50);
}

#[test]
fn an_empty_reservation_is_free_and_released_twice_never_goes_below_zero() {
    let budget = BodyBudget::new(10);
    let zero = budget.reserve(0).expect("nothing to hold");
    assert_eq!(zero.bytes(), 0);
    drop(zero);
    assert_eq!(budget.held(), 0);
    // Should the count ever be lowered behind a reservation's back, its drop saturates at zero.
    let r = budget.reserve(10).expect("fits");
    budget.held.set(3);
    drop(r);
    assert_eq!(budget.held(), 0);
}

#[test]
fn refusals_are_logged_first_then_one_in_log_every() {
    let budget = BodyBudget::new(0);
    let logged: Vec<u64> = (0..(2 * LOG_EVERY + 1))
        .map(|_| budget.reserve(1).expect_err("never fits"))
        .filter(Refused::logged)
        .map(|r| r.nth)
        .collect();
    assert_eq!(logged, vec![1, LOG_EVERY + 1, 2 * LOG_EVERY + 1]);
}

#[test]
fn reservations_outlive_their_handle_on_the_budget() {
    // A flow may outlive the root's `Rc` (or the other way round): the reservation keeps the budget.
    let budget = BodyBudget::new(10);
    let r = budget.reserve(7).expect("fits");
    let weak = Rc::downgrade(&budget);
    drop(budget);
    assert_eq!(weak.upgrade().map(|b| b.held()), Some(7));
    drop(r);
    assert!(weak.upgrade().is_none());
}
