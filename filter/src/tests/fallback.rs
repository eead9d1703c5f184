//! Unit tests of `crate::fallback`.

use super::*;
use kvmesh_core::api::{FleetWorker, Role, WorkerLoad};

fn worker(id: &str, endpoint: &str, role: Role, healthy: bool) -> FleetWorker {
    FleetWorker {
        id: id.into(),
        endpoint: endpoint.into(),
        role,
        model: String::new(),
        healthy,
        load: WorkerLoad::default(),
    }
}

fn fleet(workers: Vec<FleetWorker>) -> FleetSnapshot {
    FleetSnapshot { generation: 1, block_size: 16, models: Vec::new(), workers }
}

/// `n` workers `w0..` at `10.0.0.<i>:8000`: the last prefill-only, the one before it unhealthy,
/// the others healthy decode workers.
fn ranked_fleet(n: usize) -> FleetSnapshot {
    fleet(
        (0..n)
            .map(|i| {
                worker(
                    &format!("w{i}"),
                    &format!("10.0.0.{i}:8000"),
                    if i == n - 1 { Role::Prefill } else { Role::Decode },
                    i != n - 2,
                )
            })
            .collect(),
    )
}

#[test]
fn unrouted_reasons() {
    let f = fleet(vec![
        worker("p", "10.0.0.9:1", Role::Prefill, true),
        worker("d", "10.0.0.1:1", Role::Decode, false),
    ]);
    assert_eq!(pick(None, Some(&f), None, None), FallbackPick::Unrouted(FallbackRoute::NoSession));
    assert_eq!(
        pick(Some(SessionKey(1)), None, None, None),
        FallbackPick::Unrouted(FallbackRoute::NoFleet)
    );
    assert_eq!(
        pick(Some(SessionKey(1)), Some(&f), None, None),
        FallbackPick::Unrouted(FallbackRoute::NoWorker)
    );
    let bad = fleet(vec![worker("d", "not-an-ip", Role::Decode, true)]);
    assert_eq!(
        pick(Some(SessionKey(1)), Some(&bad), None, None),
        FallbackPick::Unrouted(FallbackRoute::NoWorker)
    );
}

#[test]
fn pin_agrees_with_the_indexer_and_lists_ranked_fallbacks() {
    let f = ranked_fleet(6);
    for key in 0..300u64 {
        let FallbackPick::Pinned { worker, header, remembered: false } =
            pick(Some(SessionKey(key)), Some(&f), None, None)
        else {
            panic!()
        };
        let indexer_pin = f.pin(key, "").unwrap();
        assert_eq!(worker, indexer_pin.id);
        let parts: Vec<&str> = header.split(',').collect();
        assert_eq!(parts.len(), 1 + PIN_FALLBACKS);
        assert_eq!(parts[0], indexer_pin.endpoint);
        let ranked = rendezvous::rank(key, f.decode_candidates().map(|w| w.id.as_str()));
        let want: Vec<String> =
            ranked.iter().take(3).map(|id| format!("10.0.0.{}:8000", &id[1..])).collect();
        assert_eq!(parts, want.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(
            !header.contains("10.0.0.4") && !header.contains("10.0.0.5"),
            "unhealthy / prefill-only excluded"
        );
    }
}

#[test]
fn single_worker_has_no_fallbacks() {
    let f = fleet(vec![worker("only", "127.0.0.1:9", Role::Both, true)]);
    assert_eq!(
        pick(Some(SessionKey(7)), Some(&f), None, None),
        FallbackPick::Pinned {
            worker: "only".into(),
            header: "127.0.0.1:9".into(),
            remembered: false
        }
    );
}

#[test]
fn the_remembered_worker_comes_first_while_it_is_a_healthy_decode_candidate() {
    let f = ranked_fleet(5);
    for key in 0..100u64 {
        let pin = f.pin(key, "").unwrap().id.clone();
        let other = ["w0", "w1", "w2"].into_iter().find(|w| *w != pin).unwrap();
        let FallbackPick::Pinned { worker, header, remembered: true } =
            pick(Some(SessionKey(key)), Some(&f), Some(other), None)
        else {
            panic!()
        };
        assert_eq!(worker, other);
        let parts: Vec<&str> = header.split(',').collect();
        assert_eq!(parts[0], format!("10.0.0.{}:8000", &other[1..]));
        assert_eq!(
            parts.len(),
            1 + PIN_FALLBACKS,
            "the rendezvous ranking follows, without the primary"
        );
        assert!(!parts[1..].contains(&parts[0]));
        // Unhealthy, prefill-only or gone: the rendezvous pin, as without a memory.
        for stale in ["w3", "w4", "w9"] {
            assert_eq!(
                pick(Some(SessionKey(key)), Some(&f), Some(stale), None),
                pick(Some(SessionKey(key)), Some(&f), None, None),
                "{stale}"
            );
        }
    }
    assert_eq!(
        pick(Some(SessionKey(1)), Some(&f), Some("w1"), None).label(),
        FallbackRoute::Remembered
    );
    assert_eq!(pick(Some(SessionKey(1)), Some(&f), None, None).label(), FallbackRoute::Pinned);
}
