use super::*;
use std::collections::BTreeSet;

fn holders(word: u64, b: &Bitmaps) -> BTreeSet<WorkerSlot> {
    let mut s = BTreeSet::new();
    Holders::of(word, b).for_each(|x| {
        s.insert(x);
    });
    s
}

#[test]
fn grows_to_a_bitmap_and_back_keeping_the_age() {
    let mut b = Bitmaps::default();
    b.ensure_slots(1000);
    let mut word = single(5, 2);
    let mut model = BTreeSet::from([5]);
    let ops: &[(bool, u32)] = &[
        (true, 1),
        (true, 5),
        (true, 900),
        (true, 64),
        (false, 1),
        (true, 2),
        (false, 900),
        (false, 64),
        (false, 7),
        (true, 0),
        (true, 999),
        (false, 5),
        (false, 2),
        (false, 999),
    ];
    for &(add, slot) in ops {
        let changed =
            if add { insert(&mut word, slot, &mut b) } else { remove(&mut word, slot, &mut b) };
        let model_changed = if add { model.insert(slot) } else { model.remove(&slot) };
        assert_eq!(changed, model_changed, "{add} {slot}");
        assert_eq!(holders(word, &b), model, "{add} {slot}");
        assert_eq!(count(word), model.len());
        assert_eq!((word & AGE_MASK) >> AGE_SHIFT, 2, "age kept");
        assert_ne!(word, 0, "an occupied word is never 0");
        assert_eq!(word & BITMAP != 0, model.len() > 3);
        for s in [0, 1, 2, 5, 7, 64, 900, 999] {
            assert_eq!(Holders::of(word, &b).contains(s), model.contains(&s));
        }
    }
    // Back to inline: the arena gave its bitmap back.
    assert_eq!(model.len(), 1);
    assert_eq!(b.bytes(), 0);
}

#[test]
fn the_last_holder_leaves_an_empty_inline_word() {
    let mut b = Bitmaps::default();
    let mut word = single(0, 1);
    assert!(remove(&mut word, 0, &mut b));
    assert_eq!(count(word), 0);
    assert!(!remove(&mut word, 0, &mut b));
}

#[test]
fn arena_restride_keeps_bitmaps() {
    let mut b = Bitmaps::default();
    b.ensure_slots(64);
    let mut word = single(1, 0);
    for s in [2, 3, 60] {
        insert(&mut word, s, &mut b);
    }
    b.ensure_slots(300);
    assert!(insert(&mut word, 299, &mut b));
    assert_eq!(holders(word, &b), BTreeSet::from([1, 2, 3, 60, 299]));
}

#[test]
fn active_set_intersects_and_reports_drops() {
    let mut b = Bitmaps::default();
    b.ensure_slots(100);
    let mut big = single(0, 0);
    for s in 1..100 {
        insert(&mut big, s, &mut b);
    }
    let mut smaller = single(1, 0);
    for s in (3..100).step_by(2) {
        insert(&mut smaller, s, &mut b);
    }
    let mut active = Active::from_holders(&Holders::of(big, &b));
    assert_eq!(active.len(), 100);
    let mut dropped = Vec::new();
    active.intersect(&Holders::of(big, &b), |s| dropped.push(s));
    assert!(dropped.is_empty());
    assert!(active.subset_of(&Holders::of(big, &b)));
    assert!(!active.subset_of(&Holders::of(smaller, &b)));
    active.intersect(&Holders::of(smaller, &b), |s| dropped.push(s));
    assert_eq!(dropped, (0..100).step_by(2).collect::<Vec<_>>());
    dropped.clear();
    let mut few = single(3, 0);
    insert(&mut few, 4, &mut b);
    active.intersect(&Holders::of(few, &b), |s| dropped.push(s));
    let mut left = Vec::new();
    active.for_each(|s| left.push(s));
    assert_eq!(left, vec![3]);
    assert_eq!(dropped.len(), 49);
    assert!(active.subset_of(&Holders::of(few, &b)));
    assert!(active.any_in(&[1 << 3]));
    assert!(!active.any_in(&[1 << 4]));
}
