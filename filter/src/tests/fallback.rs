//! Unit tests of `crate::fallback`.

use super::*;
use kvmesh_core::api::{FleetWorker, Role, WorkerLoad};

fn worker(id: &str, endpoint: &str, role: Role, healthy: bool) -> FleetWorker {
    FleetWorker { id: id.into(), endpoint: endpoint.into(), role, healthy, load: WorkerLoad::default() }
}

fn fleet(workers: Vec<FleetWorker>) -> FleetSnapshot {
    FleetSnapshot { generation: 1, block_size: 16, workers }
}

#[test]
fn unrouted_reasons() {
    let f = fleet(vec![worker("p", "10.0.0.9:1", Role::Prefill, true), worker("d", "10.0.0.1:1", Role::Decode, false)]);
    assert_eq!(pick(None, Some(&f)), FallbackPick::Unrouted(FallbackRoute::NoSession));
    assert_eq!(pick(Some(SessionKey(1)), None), FallbackPick::Unrouted(FallbackRoute::NoFleet));
    assert_eq!(pick(Some(SessionKey(1)), Some(&f)), FallbackPick::Unrouted(FallbackRoute::NoWorker));
    let bad = fleet(vec![worker("d", "not-an-ip", Role::Decode, true)]);
    assert_eq!(pick(Some(SessionKey(1)), Some(&bad)), FallbackPick::Unrouted(FallbackRoute::NoWorker));
}

#[test]
fn pin_agrees_with_the_indexer_and_lists_ranked_fallbacks() {
    let f = fleet(
        (0..6)
            .map(|i| worker(&format!("w{i}"), &format!("10.0.0.{i}:8000"), if i == 5 { Role::Prefill } else { Role::Decode }, i != 4))
            .collect(),
    );
    for key in 0..300u64 {
        let FallbackPick::Pinned { worker, header } = pick(Some(SessionKey(key)), Some(&f)) else { panic!() };
        let indexer_pin = f.pin(key).unwrap();
        assert_eq!(worker, indexer_pin.id);
        let parts: Vec<&str> = header.split(',').collect();
        assert_eq!(parts.len(), 1 + PIN_FALLBACKS);
        assert_eq!(parts[0], indexer_pin.endpoint);
        let ranked = rendezvous::rank(key, f.decode_candidates().map(|w| w.id.as_str()));
        let want: Vec<String> = ranked.iter().take(3).map(|id| format!("10.0.0.{}:8000", &id[1..])).collect();
        assert_eq!(parts, want.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(!header.contains("10.0.0.4") && !header.contains("10.0.0.5"), "unhealthy / prefill-only excluded");
    }
}

#[test]
fn single_worker_has_no_fallbacks() {
    let f = fleet(vec![worker("only", "127.0.0.1:9", Role::Both, true)]);
    assert_eq!(pick(Some(SessionKey(7)), Some(&f)), FallbackPick::Pinned { worker: "only".into(), header: "127.0.0.1:9".into() });
}
