use super::*;
use kvmesh_core::api::{FleetSnapshot, FleetWorker, WorkerLoad};
use rand::{rngs::StdRng, SeedableRng};

pub(crate) fn view(id: &'static str, overlap: u32, load: u64) -> WorkerView<'static> {
    WorkerView {
        id,
        endpoint: Box::leak(format!("10.0.0.{}:8000", id.trim_start_matches('w')).into_boxed_str()),
        role: Role::Decode,
        healthy: true,
        overlap_blocks: overlap,
        active_blocks: load,
        active_requests: 0,
        waiting_requests: 0,
    }
}

fn input(tokens: usize) -> RouteInput<'static> {
    RouteInput { isl_tokens: tokens, block_size: 16, session: None, override_worker: None, override_mode: None, continuation: false, kv_home: None }
}

fn rng() -> StdRng {
    StdRng::seed_from_u64(1)
}

#[test]
fn cost_table() {
    let cfg = RoutingConfig::default();
    // (overlap, load, request_blocks, credit, scale, want)
    let cases = [(0, 0, 40, 1.0, 1.0, 40.0), (31, 0, 40, 1.0, 1.0, 9.0), (31, 100, 40, 1.0, 1.0, 109.0), (40, 5, 40, 2.0, 1.0, 5.0), (10, 0, 40, 1.0, 0.5, 15.0)];
    for (overlap, load, rb, credit, scale, want) in cases {
        let c = RoutingConfig { overlap_credit: credit, prefill_load_scale: scale, ..cfg.clone() };
        assert_eq!(cost(&view("w1", overlap, load), rb, &c), want, "{overlap} {load} {rb} {credit} {scale}");
    }
}

#[test]
fn choices_and_reasons() {
    let cfg = RoutingConfig::default();
    struct Case {
        workers: Vec<WorkerView<'static>>,
        want: &'static str,
        basis: Basis,
        reason: &'static str,
    }
    let cases = vec![
        Case { workers: vec![view("w1", 0, 0), view("w2", 31, 0)], want: "w2", basis: Basis::BestOverlap, reason: "best overlap 31/40 blocks" },
        Case {
            workers: vec![view("w1", 10, 0), view("w2", 31, 100)],
            want: "w1",
            basis: Basis::LowestCost,
            reason: "lowest cost: overlap 10/40 blocks, load 0 blocks (best overlap w2 31/40, load 100)",
        },
        Case { workers: vec![view("w1", 0, 7), view("w2", 0, 3)], want: "w2", basis: Basis::LowestCost, reason: "no cached prefix anywhere; least loaded (load 3 blocks)" },
    ];
    for c in cases {
        let plan = decide(&input(640), &c.workers, &cfg, &mut rng()).unwrap();
        assert_eq!((plan.worker.as_str(), plan.basis, plan.reason.as_str()), (c.want, c.basis, c.reason));
        assert_eq!(plan.mode, Mode::Aggregate);
        assert_eq!(plan.isl_blocks, 40);
        assert!(!plan.fallbacks.contains(&plan.endpoint));
    }
}

#[test]
fn unhealthy_and_prefill_only_workers_get_no_traffic() {
    let cfg = RoutingConfig::default();
    let mut sick = view("w1", 40, 0);
    sick.healthy = false;
    let mut prefill = view("w2", 40, 0);
    prefill.role = Role::Prefill;
    let workers = vec![sick, prefill, view("w3", 0, 50)];
    for _ in 0..20 {
        let plan = decide(&input(640), &workers, &cfg, &mut rng()).unwrap();
        assert_eq!(plan.worker, "w3");
        assert!(plan.fallbacks.is_empty());
    }
    let none = vec![workers[0].clone(), workers[1].clone()];
    assert_eq!(decide(&input(640), &none, &cfg, &mut rng()), Err(DecideError::NoDecodeWorker));
}

#[test]
fn ties_are_broken_at_random_and_temperature_spreads() {
    let cfg = RoutingConfig::default();
    let workers = vec![view("w1", 0, 0), view("w2", 0, 0), view("w3", 0, 0)];
    let mut r = rng();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..100 {
        seen.insert(decide(&input(64), &workers, &cfg, &mut r).unwrap().worker);
    }
    assert_eq!(seen.len(), 3);
    // With temperature, the clearly best worker wins most but not all of the time.
    let hot = RoutingConfig { temperature: 0.5, ..cfg };
    let workers = vec![view("w1", 40, 0), view("w2", 0, 0)];
    let wins = (0..1000).filter(|_| decide(&input(640), &workers, &hot, &mut r).unwrap().worker == "w1").count();
    assert!((700..1000).contains(&wins), "{wins}");
}

fn fleet(workers: &[WorkerView<'_>]) -> FleetSnapshot {
    FleetSnapshot {
        generation: 1,
        block_size: 16,
        workers: workers
            .iter()
            .map(|w| FleetWorker { id: w.id.into(), endpoint: w.endpoint.into(), role: w.role, healthy: w.healthy, load: WorkerLoad::default() })
            .collect(),
    }
}

#[test]
fn session_pin_agrees_with_the_fleet_snapshot_pin() {
    let cfg = RoutingConfig::default();
    let mut workers: Vec<WorkerView<'static>> = ["w1", "w2", "w3", "w4", "w5"].iter().map(|id| view(id, 0, 0)).collect();
    workers[1].healthy = false;
    workers[3].role = Role::Prefill;
    workers[4].role = Role::Both;
    let snapshot = fleet(&workers);
    for k in 0..500u64 {
        let key = SessionKey(kvmesh_core::hashing::xxh3(&k.to_le_bytes(), 0));
        let req = RouteInput { session: Some((key, SessionSource::Prefix)), ..input(640) };
        let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
        assert_eq!(Some(plan.worker.as_str()), snapshot.pin(key.0).map(|w| w.id.as_str()));
        assert_eq!(plan.basis, Basis::SessionPin);
        assert!(plan.reason.starts_with(&format!("session pin {} (source=prefix)", plan.worker)), "{}", plan.reason);
    }
}

#[test]
fn sticky_sessions_start_by_cost_and_stay_where_they_were_served() {
    let cfg = RoutingConfig { session_placement: SessionPlacement::Sticky, ..RoutingConfig::default() };
    let workers = vec![view("w1", 0, 500), view("w2", 0, 0), view("w3", 0, 900)];
    let key = SessionKey(kvmesh_core::hashing::xxh3(b"s", 0));
    // No home yet: placed by cost (the least loaded), whatever its rendezvous worker.
    let first = RouteInput { session: Some((key, SessionSource::Header)), ..input(640) };
    let plan = decide(&first, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w2", Basis::LowestCost), "{}", plan.reason);
    // With a home: pinned there although another worker is less loaded.
    let later = RouteInput { kv_home: Some("w3"), ..first.clone() };
    let plan = decide(&later, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w3", Basis::SessionPin), "{}", plan.reason);
    // A home that is gone or unhealthy is no pin.
    let gone = RouteInput { kv_home: Some("w9"), ..first.clone() };
    assert_eq!(decide(&gone, &workers, &cfg, &mut rng()).unwrap().worker, "w2");
    // The default (rendezvous) ignores kv_home for placement.
    let rendezvous = decide(&later, &workers, &RoutingConfig::default(), &mut rng()).unwrap();
    assert_eq!(Some(rendezvous.worker.as_str()), fleet(&workers).pin(key.0).map(|w| w.id.as_str()));
}

#[test]
fn removing_a_worker_moves_only_its_sessions() {
    let cfg = RoutingConfig::default();
    let all: Vec<WorkerView<'static>> = ["w1", "w2", "w3", "w4"].iter().map(|id| view(id, 0, 0)).collect();
    let without: Vec<WorkerView<'static>> = all.iter().filter(|w| w.id != "w3").cloned().collect();
    let mut moved = 0;
    for k in 0..2000u64 {
        let key = SessionKey(kvmesh_core::hashing::xxh3(&k.to_le_bytes(), 9));
        let req = RouteInput { session: Some((key, SessionSource::Header)), ..input(64) };
        let before = decide(&req, &all, &cfg, &mut rng()).unwrap().worker;
        let after = decide(&req, &without, &cfg, &mut rng()).unwrap().worker;
        if before != "w3" {
            assert_eq!(before, after, "session {k} moved although its worker stayed");
        } else {
            moved += 1;
        }
    }
    assert!((350..650).contains(&moved), "{moved}");
}

#[test]
fn an_overloaded_pin_is_overridden_and_says_why() {
    let cfg = RoutingConfig { overload_waiting_requests: 8, ..RoutingConfig::default() };
    let mut workers: Vec<WorkerView<'static>> = vec![view("w1", 0, 0), view("w2", 0, 0), view("w3", 0, 0)];
    let key = SessionKey(42);
    let req = RouteInput { session: Some((key, SessionSource::Header)), ..input(640) };
    let pinned = decide(&req, &workers, &cfg, &mut rng()).unwrap().worker;
    let i = workers.iter().position(|w| w.id == pinned).unwrap();
    workers[i].waiting_requests = 9;
    let other = (i + 1) % 3;
    workers[other].overlap_blocks = 20;
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.basis, Basis::PinOverloaded);
    assert_eq!(plan.worker, workers[other].id);
    assert_eq!(plan.reason, format!("pinned {pinned} overloaded (waiting 9 >= 8); chose {}: best overlap 20/40 blocks", workers[other].id));
    // Everyone overloaded: the pin stays.
    for w in &mut workers {
        w.waiting_requests = 100;
    }
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), (pinned.as_str(), Basis::SessionPin));
}

#[test]
fn overrides() {
    let cfg = RoutingConfig::default();
    let mut workers = vec![view("w1", 40, 0), view("w2", 0, 0)];
    let req = RouteInput { override_worker: Some("w2"), ..input(640) };
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w2", Basis::Override));
    assert_eq!(plan.best_overlap, Some(("w1".into(), 40)));
    let bad = RouteInput { override_worker: Some("w9"), ..input(640) };
    assert_eq!(decide(&bad, &workers, &cfg, &mut rng()), Err(DecideError::UnknownOverrideWorker("w9".into())));
    workers[1].healthy = false;
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w1");
    assert!(plan.reason.starts_with("override w2 ignored (unhealthy); best overlap"), "{}", plan.reason);
    let mode = RouteInput { override_mode: Some(Mode::Disagg), ..input(640) };
    let plan = decide(&mode, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.mode, Mode::Aggregate);
    assert!(plan.reason.ends_with("x-kvmesh-mode disagg: no healthy prefill worker"), "{}", plan.reason);
}

#[test]
fn decision_carries_best_overlap_and_block_counts() {
    let cfg = RoutingConfig::default();
    let workers = vec![view("w1", 30, 1000), view("w2", 2, 0)];
    let plan = decide(&input(650), &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w2");
    assert_eq!((plan.isl_blocks, plan.request_blocks), (40, 41));
    let d = plan.into_decision();
    assert_eq!(d.best_overlap_worker.as_deref(), Some("w1"));
    assert_eq!(d.best_overlap_blocks, 30);
    assert_eq!(d.fallbacks, vec!["10.0.0.1:8000".to_owned()]);
}
