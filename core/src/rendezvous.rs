//! Rendezvous (highest-random-weight) hashing of session keys onto workers.
//!
//! Each (key, worker id) pair gets a pseudo-random weight; the worker with the highest weight wins.
//! Removing a worker moves only the keys it owned, adding one takes an even share from every other,
//! and the answer depends only on the key and the set of ids — never on their order — so the filter
//! (from its last fleet snapshot) and the indexer (from its live fleet) pin a session to the same
//! worker without talking to each other.

use crate::hashing::xxh3;

const RENDEZVOUS_SEED: u64 = 0x6b76_6d65_7368_0001; // "kvmesh" 1

/// The weight of `worker_id` for `key`. Higher wins.
pub fn weight(key: u64, worker_id: &str) -> u64 {
    // Hash the id first, then mix with the key, so the per-worker part can be reused by callers that
    // score many keys against one worker set.
    let id_hash = xxh3(worker_id.as_bytes(), RENDEZVOUS_SEED);
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&key.to_le_bytes());
    bytes[8..].copy_from_slice(&id_hash.to_le_bytes());
    xxh3(&bytes, RENDEZVOUS_SEED)
}

/// The worker `key` pins to among `candidates` (ids), or None when there are none.
/// Ties (astronomically rare) go to the smaller id so the result never depends on input order.
pub fn pick<'a, I>(key: u64, candidates: I) -> Option<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    candidates
        .into_iter()
        .map(|id| (weight(key, id), id))
        .max_by(|a, b| a.0.cmp(&b.0).then_with(|| b.1.cmp(a.1)))
        .map(|(_, id)| id)
}

/// All candidates in preference order for `key` (the pick first). Used for fallback lists.
pub fn rank<'a, I>(key: u64, candidates: I) -> Vec<&'a str>
where
    I: IntoIterator<Item = &'a str>,
{
    let mut scored: Vec<(u64, &str)> =
        candidates.into_iter().map(|id| (weight(key, id), id)).collect();
    scored.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(b.1)));
    scored.into_iter().map(|(_, id)| id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ids(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("worker-{i}")).collect()
    }

    #[test]
    fn empty_has_no_pick() {
        assert_eq!(pick(7, std::iter::empty()), None);
    }

    #[test]
    fn order_does_not_matter() {
        let w = ids(8);
        let mut rev = w.clone();
        rev.reverse();
        for key in 0..1000u64 {
            assert_eq!(
                pick(key, w.iter().map(String::as_str)),
                pick(key, rev.iter().map(String::as_str))
            );
        }
    }

    #[test]
    fn rank_starts_with_pick() {
        let w = ids(5);
        for key in 0..200u64 {
            let r = rank(key, w.iter().map(String::as_str));
            assert_eq!(r.len(), 5);
            assert_eq!(Some(r[0]), pick(key, w.iter().map(String::as_str)));
        }
    }

    #[test]
    fn spread_is_even() {
        let w = ids(8);
        let mut counts = std::collections::HashMap::new();
        let n = 80_000u64;
        for key in 0..n {
            let k = crate::hashing::xxh3(&key.to_le_bytes(), 0);
            *counts.entry(pick(k, w.iter().map(String::as_str)).unwrap_or("")).or_insert(0u64) += 1;
        }
        let mean = n as f64 / 8.0;
        for (id, c) in counts {
            let dev = (c as f64 - mean).abs() / mean;
            assert!(dev < 0.05, "{id} got {c}, {dev:.3} off the mean");
        }
    }

    proptest! {
        // Removing one worker moves exactly the keys it owned; every other key keeps its worker.
        #[test]
        fn removal_moves_only_the_removed_workers_keys(n in 2usize..16, gone in 0usize..16, keys in proptest::collection::vec(any::<u64>(), 1..200)) {
            let w = ids(n);
            let gone = gone % n;
            let rest: Vec<&str> = w.iter().enumerate().filter(|(i, _)| *i != gone).map(|(_, s)| s.as_str()).collect();
            for key in keys {
                let before = pick(key, w.iter().map(String::as_str));
                let after = pick(key, rest.iter().copied());
                if before != Some(w[gone].as_str()) {
                    prop_assert_eq!(before, after);
                }
            }
        }
    }
}
