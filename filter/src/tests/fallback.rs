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
    assert_eq!(
        pick(None, Some(&f), None, None, 0),
        FallbackPick::Unrouted(FallbackRoute::NoSession)
    );
    assert_eq!(
        pick(Some(SessionKey(1)), None, None, None, 0),
        FallbackPick::Unrouted(FallbackRoute::NoFleet)
    );
    assert_eq!(
        pick(Some(SessionKey(1)), Some(&f), None, None, 0),
        FallbackPick::Unrouted(FallbackRoute::NoWorker)
    );
    let bad = fleet(vec![worker("d", "not-an-ip", Role::Decode, true)]);
    assert_eq!(
        pick(Some(SessionKey(1)), Some(&bad), None, None, 0),
        FallbackPick::Unrouted(FallbackRoute::NoWorker)
    );
}

#[test]
fn pin_agrees_with_the_indexer_and_lists_ranked_fallbacks() {
    let f = ranked_fleet(6);
    for key in 0..300u64 {
        let FallbackPick::Pinned { worker, header, how: FallbackRoute::Pinned } =
            pick(Some(SessionKey(key)), Some(&f), None, None, 0)
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
        pick(Some(SessionKey(7)), Some(&f), None, None, 0),
        FallbackPick::Pinned {
            worker: "only".into(),
            header: "127.0.0.1:9".into(),
            how: FallbackRoute::Pinned
        }
    );
}

#[test]
fn the_remembered_worker_comes_first_while_it_is_a_healthy_decode_candidate() {
    let f = ranked_fleet(5);
    for key in 0..100u64 {
        let pin = f.pin(key, "").unwrap().id.clone();
        let other = ["w0", "w1", "w2"].into_iter().find(|w| *w != pin).unwrap();
        let FallbackPick::Pinned { worker, header, how: FallbackRoute::Remembered } =
            pick(Some(SessionKey(key)), Some(&f), Some(other), None, 0)
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
                pick(Some(SessionKey(key)), Some(&f), Some(stale), None, 0),
                pick(Some(SessionKey(key)), Some(&f), None, None, 0),
                "{stale}"
            );
        }
    }
    assert_eq!(
        pick(Some(SessionKey(1)), Some(&f), Some("w1"), None, 0).label(),
        FallbackRoute::Remembered
    );
    assert_eq!(pick(Some(SessionKey(1)), Some(&f), None, None, 0).label(), FallbackRoute::Pinned);
}

#[test]
fn the_pin_and_its_fallbacks_stay_within_the_requests_base_model() {
    // Six workers of two models, interleaved, one of each model unhealthy.
    let mut f = crate::models::tests::two_models();
    f.workers = (0..8)
        .map(|i| {
            let mut w = worker(&format!("w{i}"), &format!("10.0.0.{i}:8000"), Role::Both, i < 6);
            w.model = if i % 2 == 0 { "base-a" } else { "base-b" }.into();
            w
        })
        .collect();
    let serves = |endpoint: &str, base: &str| {
        f.workers.iter().any(|w| w.endpoint == endpoint && w.model == base && w.healthy)
    };
    for key in 0..300u64 {
        for (requested, base) in [
            (Some("base-a"), "base-a"),
            (Some("a"), "base-a"),
            (Some("a-sql"), "base-a"),
            (None, "base-a"),
            (Some("b-code"), "base-b"),
            (Some("base-b"), "base-b"),
        ] {
            let FallbackPick::Pinned { worker, header, .. } =
                pick(Some(SessionKey(key)), Some(&f), None, requested, 0)
            else {
                panic!("{requested:?}")
            };
            assert_eq!(worker, f.pin(key, base).unwrap().id, "the indexer's pin within {base}");
            let parts: Vec<&str> = header.split(',').collect();
            assert_eq!(parts.len(), 1 + PIN_FALLBACKS, "three healthy workers of {base}");
            assert!(parts.iter().all(|e| serves(e, base)), "{header} outside {base}");
        }
    }
}

#[test]
fn a_remembered_worker_of_another_model_is_not_followed() {
    let mut f = crate::models::tests::two_models();
    for w in &mut f.workers {
        w.role = Role::Decode;
    }
    // w2 serves base-b: a base-a request remembered there pins within base-a instead.
    let pinned = pick(Some(SessionKey(5)), Some(&f), Some("w2"), Some("base-a"), 0);
    assert_eq!(pinned, pick(Some(SessionKey(5)), Some(&f), None, Some("base-a"), 0));
    assert_eq!(pinned.label(), FallbackRoute::Pinned);
    let remembered = pick(Some(SessionKey(5)), Some(&f), Some("w2"), Some("b-code"), 0);
    assert_eq!(remembered.label(), FallbackRoute::Remembered);
}

#[test]
fn an_unknown_model_is_refused_with_or_without_a_session_but_not_without_a_fleet() {
    let f = crate::models::tests::two_models();
    for session in [None, Some(SessionKey(3))] {
        let p = pick(session, Some(&f), None, Some("gpt-4"), 0);
        assert_eq!(p, FallbackPick::UnknownModel("gpt-4".into()));
        assert_eq!(p.label(), FallbackRoute::UnknownModel);
    }
    // No snapshot yet: nothing to resolve against; Envoy's LB, as before.
    assert_eq!(
        pick(Some(SessionKey(3)), None, None, Some("gpt-4"), 0),
        FallbackPick::Unrouted(FallbackRoute::NoFleet)
    );
    // A model whose workers are all unhealthy: pinned among them (stale health is better than
    // another model's worker), not a 404; with none at all, Envoy's LB (its engines answer 404).
    let mut down = f.clone();
    for w in &mut down.workers {
        w.healthy = w.model != "base-b";
    }
    let p = pick(Some(SessionKey(3)), Some(&down), None, Some("b-code"), 0);
    assert_eq!(
        p,
        FallbackPick::Pinned {
            worker: "w2".into(),
            header: "10.0.0.2:8000".into(),
            how: FallbackRoute::Pinned
        }
    );
    down.workers.retain(|w| w.model != "base-b");
    assert_eq!(
        pick(Some(SessionKey(3)), Some(&down), None, Some("b-code"), 0),
        FallbackPick::Unrouted(FallbackRoute::NoWorker)
    );
}

#[test]
fn without_a_session_a_request_is_spread_within_its_model_when_envoy_could_pick_another() {
    let f = crate::models::tests::two_models();
    let mut seen = std::collections::BTreeSet::new();
    for request_key in 0..64u64 {
        let p = pick(None, Some(&f), None, Some("a-sql"), request_key);
        assert_eq!(p.label(), FallbackRoute::Spread);
        let FallbackPick::Pinned { worker, header, .. } = p else { panic!() };
        assert_eq!(worker, rendezvous::pick(request_key, ["w1", "w3"]).unwrap());
        assert!(!header.contains("10.0.0.2:8000"), "base-b's worker never listed: {header}");
        seen.insert(worker);
    }
    assert_eq!(seen.len(), 2, "spread over the model's workers");
    // A remembered worker needs a session: none here.
    assert_eq!(pick(None, Some(&f), Some("w3"), None, 1).label(), FallbackRoute::Spread);
    // Every healthy worker serves the model (one model, or the others down): Envoy's LB, as before.
    let mut one = f.clone();
    one.workers.retain(|w| w.model == "base-a");
    assert_eq!(
        pick(None, Some(&one), None, Some("a"), 1),
        FallbackPick::Unrouted(FallbackRoute::NoSession)
    );
    assert_eq!(
        pick(None, None, None, Some("a"), 1),
        FallbackPick::Unrouted(FallbackRoute::NoSession)
    );
}
