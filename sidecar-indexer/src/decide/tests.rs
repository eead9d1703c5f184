use super::*;
use crate::config::{KvMigration, SessionPlacement};
use crate::predict::{AdapterCost, WorkerAdapters, WorkerTiming};
use crate::scrape::LoraInfo;
use kvmesh_core::api::{FleetSnapshot, FleetWorker, Mode, ReasonCode, Role, WorkerLoad};
use kvmesh_core::rendezvous;
use kvmesh_core::session::{SessionKey, SessionSource};
use proptest::prelude::*;
use rand::{rngs::StdRng, SeedableRng};

/// Prefill throughput of the test workers: 10k tokens/s, so 10 tokens = 1 ms.
pub(crate) const TPS: f64 = 10_000.0;

/// A decode worker holding `overlap` leading blocks with `queued` prefill tokens ahead, no decode batch.
pub(crate) fn view(id: &'static str, overlap: u32, queued: u64) -> WorkerView<'static> {
    WorkerView {
        id,
        endpoint: Box::leak(
            format!("10.0.0.{}:8000", id.trim_start_matches(|c: char| c.is_ascii_alphabetic()))
                .into_boxed_str(),
        ),
        role: Role::Decode,
        healthy: true,
        overlap_blocks: overlap,
        speculative_blocks: 0,
        tier_blocks: Default::default(),
        active_blocks: queued / 16,
        active_requests: 0,
        waiting_requests: 0,
        timing: WorkerTiming {
            queued_tokens: queued as f64,
            decode_batch: 0,
            prefill_tokens_per_s: TPS,
            decode_step_s: 0.02,
            ..WorkerTiming::default()
        },
        recent_tokens_per_s: 0.0,
        adapters: None,
    }
}

/// 640 tokens = 40 full blocks of 16 (at most 39 cached: the last token is computed).
fn input(tokens: usize) -> RouteInput<'static> {
    RouteInput {
        isl_tokens: tokens,
        block_size: 16,
        session: None,
        override_worker: None,
        override_mode: None,
        continuation: false,
        kv_home: None,
        opens_conversation: false,
        adapter: None,
    }
}

fn session(tokens: usize, kv_home: Option<&'static str>) -> RouteInput<'static> {
    RouteInput { session: Some((SessionKey(42), SessionSource::Header)), kv_home, ..input(tokens) }
}

fn rng() -> StdRng {
    StdRng::seed_from_u64(1)
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn predicted_ttft_table() {
    let cfg = RoutingConfig::default();
    // (tokens, overlap, speculative, queued, decode batch, want ms)
    let cases = [
        (640, 0, 0, 0, 0, 64.0),             // cold: 640 tokens at 10k/s
        (640, 31, 0, 0, 0, 14.4),            // 144 uncached tokens
        (640, 31, 0, 1000, 0, 114.4),        // queued prefill first
        (640, 40, 0, 0, 0, 1.6), // an exact multiple: the last block is computed (16 tokens)
        (650, 40, 0, 0, 0, 1.0), // 10 tokens past 40 blocks
        (640, 0, 31, 0, 0, 14.4), // speculative holdings count like real ones
        (640, 10, 31, 0, 0, 14.4), // the larger of the two
        (640, 0, 0, 0, 5, 64.0 + 20.0), // one step of a 5-sequence decode batch
        (20_000, 0, 0, 0, 1, 2000.0 + 60.0), // 20k tokens = 3 steps of 8192
    ];
    for (tokens, overlap, spec, queued, batch, want) in cases {
        let mut w = view("w1", overlap, queued);
        w.speculative_blocks = spec;
        w.timing.decode_batch = batch;
        let plan = decide(&input(tokens), &[w], &cfg, &mut rng()).unwrap();
        assert!(
            close(plan.predicted_ttft_ms, want),
            "{tokens} {overlap} {spec} {queued} {batch}: {} != {want}",
            plan.predicted_ttft_ms
        );
        assert_eq!(
            plan.into_decision().predicted_ttft_ms.map(|x| (x * 1e6).round() / 1e6),
            Some(want)
        );
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
        Case {
            workers: vec![view("w1", 0, 0), view("w2", 31, 0)],
            want: "w2",
            basis: Basis::BestOverlap,
            reason: "best overlap 31/40 blocks, predicted 14.4 ms; next w1 64.0 ms",
        },
        Case {
            workers: vec![view("w1", 10, 0), view("w2", 31, 10_000)],
            want: "w1",
            basis: Basis::LowestCost,
            reason:
                "overlap 10/40 blocks (best elsewhere 31), predicted 48.0 ms; next w2 1014.4 ms",
        },
        Case {
            workers: vec![view("w1", 0, 700), view("w2", 0, 300)],
            want: "w2",
            basis: Basis::LowestCost,
            reason: "nothing cached, predicted 94.0 ms after 300 queued tokens; next w1 134.0 ms",
        },
    ];
    for c in cases {
        let plan = decide(&input(640), &c.workers, &cfg, &mut rng()).unwrap();
        assert_eq!(
            (plan.worker.as_str(), plan.basis, plan.reason.as_str()),
            (c.want, c.basis, c.reason)
        );
        assert_eq!(plan.reason_codes, [c.basis]);
        assert_eq!(plan.mode, Mode::Aggregate);
        assert_eq!(plan.isl_blocks, 40);
        assert!(!plan.fallbacks.contains(&plan.endpoint));
        // The wire answer carries the codes beside the prose.
        let d = plan.clone().into_decision();
        assert_eq!(
            (d.reason.as_str(), d.reason_codes.as_slice()),
            (plan.reason.as_str(), plan.reason_codes.as_slice())
        );
    }
}

#[test]
fn overlap_is_capped_by_the_last_block_rule_everywhere() {
    let cfg = RoutingConfig {
        kv_migration: KvMigration::Dry,
        kv_migration_min_tokens: 16,
        ..RoutingConfig::default()
    };
    // (tokens, held, want overlap)
    for (tokens, held, want) in
        [(640, 40, 39), (641, 40, 40), (639, 40, 39), (16, 1, 0), (2048, 128, 127)]
    {
        let workers = [view("w1", held, 0), view("w2", 0, 100_000)];
        let plan = decide(&input(tokens), &workers, &cfg, &mut rng()).unwrap();
        assert_eq!((plan.worker.as_str(), plan.overlap_blocks), ("w1", want), "{tokens} tokens");
        assert_eq!(plan.best_overlap, (want > 0).then(|| ("w1".to_owned(), want)));
        assert_eq!(plan.uncached_tokens, tokens as u64 - u64::from(want) * 16);
    }
    // A migration opportunity counts capped blocks too.
    let workers = [view("w1", 40, 100_000), view("w2", 0, 0)];
    let plan = decide(&input(640), &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w2");
    assert_eq!(plan.opportunity.map(|o| o.source_blocks), Some(39));
}

#[test]
fn unhealthy_and_prefill_only_workers_get_no_traffic() {
    let cfg = RoutingConfig::default();
    let mut sick = view("w1", 39, 0);
    sick.healthy = false;
    let mut prefill = view("w2", 39, 0);
    prefill.role = Role::Prefill;
    let workers = vec![sick, prefill, view("w3", 0, 5000)];
    for _ in 0..20 {
        let plan = decide(&input(640), &workers, &cfg, &mut rng()).unwrap();
        assert_eq!(plan.worker, "w3");
        assert!(plan.fallbacks.is_empty());
    }
    let none = vec![workers[0].clone(), workers[1].clone()];
    assert_eq!(decide(&input(640), &none, &cfg, &mut rng()), Err(DecideError::NoDecodeWorker));
}

#[test]
fn near_ties_are_broken_at_random_and_temperature_spreads() {
    let cfg = RoutingConfig::default();
    // w1 and w2 within 2 % of each other (near tie), w3 20 ms behind.
    let workers = vec![view("w1", 0, 0), view("w2", 0, 1), view("w3", 0, 200)];
    let mut r = rng();
    let mut seen = std::collections::BTreeMap::new();
    for _ in 0..200 {
        *seen.entry(decide(&input(64), &workers, &cfg, &mut r).unwrap().worker).or_insert(0) += 1;
    }
    assert_eq!(
        seen.keys().cloned().collect::<Vec<_>>(),
        vec!["w1".to_owned(), "w2".to_owned()],
        "{seen:?}"
    );
    assert!(seen.values().all(|n| *n > 50), "{seen:?}");
    // No band: the fastest always.
    let strict = RoutingConfig { near_tie_ms: 0.0, near_tie_fraction: 0.0, ..cfg.clone() };
    assert!((0..50).all(|_| decide(&input(64), &workers, &strict, &mut r).unwrap().worker == "w1"));
    // With temperature, the clearly best worker wins most but not all of the time.
    let hot = RoutingConfig { temperature: 0.5, ..cfg };
    let workers = vec![view("w1", 39, 0), view("w2", 0, 0)];
    let wins = (0..1000)
        .filter(|_| decide(&input(640), &workers, &hot, &mut r).unwrap().worker == "w1")
        .count();
    assert!((700..1000).contains(&wins), "{wins}");
}

#[test]
fn a_burst_spreads_by_the_booked_backlog() {
    // Each decision adds its prefill to the chosen worker's queue (what the route plan's placement record does):
    // 16 cold requests of 1000 tokens over 4 idle workers end 4 per worker.
    let cfg = RoutingConfig::default();
    let mut workers: Vec<WorkerView<'static>> =
        ["w1", "w2", "w3", "w4"].iter().map(|id| view(id, 0, 0)).collect();
    let mut per = std::collections::BTreeMap::new();
    let mut r = rng();
    for _ in 0..16 {
        let plan = decide(&input(1000), &workers, &cfg, &mut r).unwrap();
        let w = workers.iter_mut().find(|w| w.id == plan.worker).unwrap();
        w.timing.queued_tokens += plan.uncached_tokens as f64;
        *per.entry(plan.worker).or_insert(0) += 1;
    }
    assert!(per.values().all(|n| *n == 4), "{per:?}");
}

#[test]
fn near_ties_have_no_deterministic_preference_but_a_new_session_takes_its_rendezvous_worker() {
    let cfg = RoutingConfig::default();
    // Speculation and engine truth predict the same time: both win (replicas sharing the index
    // would otherwise all pick the truth holder).
    let mut guess = view("w1", 0, 0);
    guess.speculative_blocks = 39;
    let workers = [guess, view("w2", 39, 0)];
    let mut r = rng();
    let w1 = (0..200)
        .filter(|_| decide(&input(640), &workers, &cfg, &mut r).unwrap().worker == "w1")
        .count();
    assert!((50..150).contains(&w1), "{w1} of 200");
    // A new session among idle workers: always its rendezvous worker, the filter fallback's pin.
    let idle = [view("w1", 0, 0), view("w2", 0, 0), view("w3", 0, 0)];
    for k in 0..50u64 {
        let key = SessionKey(k.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let want = rendezvous::pick(key.0, idle.iter().map(|w| w.id)).unwrap();
        let session = RouteInput { session: Some((key, SessionSource::Prefix)), ..input(640) };
        assert_eq!(decide(&session, &idle, &cfg, &mut r).unwrap().worker, want);
    }
}

fn fleet(workers: &[WorkerView<'_>]) -> FleetSnapshot {
    FleetSnapshot {
        generation: 1,
        block_size: 16,
        models: Vec::new(),
        workers: workers
            .iter()
            .map(|w| FleetWorker {
                id: w.id.into(),
                endpoint: w.endpoint.into(),
                role: w.role,
                model: String::new(),
                healthy: w.healthy,
                load: WorkerLoad::default(),
            })
            .collect(),
    }
}

#[test]
fn sessions_stay_home_until_another_worker_is_faster_by_the_margin() {
    let cfg = RoutingConfig::default(); // margin: 50 ms and 25 % of the home's time
                                        // (home queued tokens, other queued tokens, want basis, want worker)
    let cases = [
        (0, 0, Basis::SessionPin, "w1"),
        (400, 0, Basis::SessionPin, "w1"), // home 104 ms vs 64: 40 ms < 50 ms margin
        (600, 0, Basis::SessionMoved, "w2"), // home 124 ms vs 64: 60 ms > max(50, 31) ms
        (5000, 3800, Basis::SessionPin, "w1"), // 564 vs 444: 120 ms < 25 % of 564
        (5000, 2000, Basis::SessionMoved, "w2"),
    ];
    for (home_q, other_q, basis, want) in cases {
        let workers = [view("w1", 0, home_q), view("w2", 0, other_q)];
        let plan = decide(&session(640, Some("w1")), &workers, &cfg, &mut rng()).unwrap();
        assert_eq!(
            (plan.basis, plan.worker.as_str()),
            (basis, want),
            "{home_q} {other_q}: {}",
            plan.reason
        );
        assert_eq!(plan.reason_codes, [basis], "{}", plan.reason);
    }
}

#[test]
fn a_session_weighs_recomputing_its_history_or_migrating_it() {
    // A 16k-token conversation whose history (999 blocks) is cached on w1, 300 ms of work queued there.
    let workers = [view("w1", 999, 3000), view("w2", 0, 0)];
    let req = session(16_000, Some("w1"));
    let plan = decide(&req, &workers, &RoutingConfig::default(), &mut rng()).unwrap();
    assert_eq!(
        (plan.worker.as_str(), plan.basis),
        ("w1", Basis::SessionPin),
        "recomputing 16k tokens elsewhere takes 1.6 s: {}",
        plan.reason
    );
    // With migration on, w2 pulls the 999 blocks instead: 1.6 ms there, so it moves (and migrates).
    let on = RoutingConfig { kv_migration: KvMigration::On, ..RoutingConfig::default() };
    let plan = decide(&req, &workers, &on, &mut rng()).unwrap();
    assert_eq!(
        (plan.worker.as_str(), plan.basis, plan.mode),
        ("w2", Basis::SessionMoved, Mode::Migrate),
        "{}",
        plan.reason
    );
    assert!(
        plan.reason.contains("999 blocks migrated") || plan.reason.contains("migrating 999 blocks"),
        "{}",
        plan.reason
    );
    assert!(close(plan.predicted_ttft_ms, 1.6), "{}", plan.predicted_ttft_ms);
    assert_eq!(plan.uncached_tokens, 16, "the target computes only the tail");
}

#[test]
fn new_sessions_go_where_predicted_fastest() {
    let cfg = RoutingConfig::default();
    let workers = vec![view("w1", 0, 5000), view("w2", 0, 0), view("w3", 0, 9000)];
    // No home yet, or a home that left / is unhealthy: placed by prediction.
    for home in [None, Some("w9")] {
        let plan = decide(&session(640, home), &workers, &cfg, &mut rng()).unwrap();
        assert_chose(&plan, "w2", &[ReasonCode::NewSession, ReasonCode::LowestCost]);
    }
    // A deprecated `sticky` behaves the same.
    let sticky = RoutingConfig { session_placement: SessionPlacement::Sticky, ..cfg };
    assert_eq!(decide(&session(640, None), &workers, &sticky, &mut rng()).unwrap().worker, "w2");
}

/// Asserts the plan's worker and reason codes (the last one its basis), with its reason in the
/// message.
fn assert_chose(plan: &Plan, worker: &str, codes: &[ReasonCode]) {
    let got = (plan.worker.as_str(), plan.reason_codes.as_slice());
    assert_eq!(got, (worker, codes), "{}", plan.reason);
    assert_eq!(Some(&plan.basis), codes.last(), "{}", plan.reason);
}

#[test]
fn a_conversation_opening_is_placed_by_cost_not_pinned_to_a_shared_prefix() {
    // w1 holds 30 of 40 blocks — a system prompt other conversations share — and has 800 tokens
    // queued: 96 ms; w2 holds nothing and is idle: 64 ms. A later turn of the session stays on w1
    // (32 ms faster elsewhere is within the 50 ms margin); a first turn has no history anywhere
    // and goes where it is cheapest.
    let cfg = RoutingConfig::default();
    let workers = vec![view("w1", 30, 800), view("w2", 0, 0)];
    assert_chose(
        &decide(&session(640, None), &workers, &cfg, &mut rng()).unwrap(),
        "w1",
        &[ReasonCode::SessionPin],
    );
    let first = RouteInput { opens_conversation: true, ..session(640, None) };
    let plan = decide(&first, &workers, &cfg, &mut rng()).unwrap();
    assert_chose(&plan, "w2", &[ReasonCode::NewSession, ReasonCode::LowestCost]);
    // A retried first turn goes back to where it was served (its own `kv_home`).
    let retried = RouteInput { kv_home: Some("w1"), ..first };
    assert_chose(
        &decide(&retried, &workers, &cfg, &mut rng()).unwrap(),
        "w1",
        &[ReasonCode::SessionPin],
    );
}

#[test]
fn cost_prices_recompute_by_the_requests_behind_it() {
    // (w1 queue, w2 queue, arrivals/s per worker, want); w1 holds 30 of 40 blocks, w2 nothing.
    // 640 tokens, TPS 10k: recomputing the prompt is 64 ms of prefill.
    let cases = [
        // Idle fleet: w2 (64 ms) beats w1 (70 ms queue + 16 ms own).
        (700, 0, 0.0, "w2"),
        // 20 arrivals/s: w2's 64 ms recompute delays 20 × 0.064 = 1.3 requests by 64 ms (cost
        // 146 ms); w1 computes 16 ms for the 1.7 behind it (cost 86 + 27.5 ms): the holder wins.
        (700, 0, 20.0, "w1"),
        // A long queue on the holder still loses: 2,000 queued tokens (216 + 69 ms) vs 146 ms.
        (2000, 0, 20.0, "w2"),
    ];
    let cfg = RoutingConfig::default();
    for (q1, q2, rate, want) in cases {
        let mut w1 = view("w1", 30, q1);
        let mut w2 = view("w2", 0, q2);
        w1.timing.arrivals_per_s = rate;
        w2.timing.arrivals_per_s = rate;
        let plan = decide(&input(640), &[w1, w2], &cfg, &mut rng()).unwrap();
        assert_eq!(plan.worker, want, "{q1} {q2} {rate}: {}", plan.reason);
    }
    // The work charge off (0): back to this request's TTFT alone.
    let off = RoutingConfig { work_charge: 0.0, ..cfg };
    let mut w1 = view("w1", 30, 700);
    let mut w2 = view("w2", 0, 0);
    w1.timing.arrivals_per_s = 20.0;
    w2.timing.arrivals_per_s = 20.0;
    assert_eq!(decide(&input(640), &[w1, w2], &off, &mut rng()).unwrap().worker, "w2");
}

#[test]
fn a_conversation_opening_stays_off_workers_over_their_share_of_the_load() {
    // w1 holds the shared system prompt (30 blocks) and was routed 3,000 prompt tokens/s
    // recently, w2 and w3 1,000: mean 1,667, w1 1.8x. Share 1.1 keeps an opener off w1.
    let mut w1 = view("w1", 30, 0);
    w1.recent_tokens_per_s = 3000.0;
    let mut w2 = view("w2", 0, 0);
    w2.recent_tokens_per_s = 1000.0;
    let mut w3 = view("w3", 0, 0);
    w3.recent_tokens_per_s = 1000.0;
    let workers = [w1, w2, w3];
    let cfg = RoutingConfig::default();
    let opener = RouteInput { opens_conversation: true, ..session(640, None) };
    let plan = decide(&opener, &workers, &cfg, &mut rng()).unwrap();
    assert_ne!(plan.worker, "w1", "{}", plan.reason);
    assert_eq!(
        plan.reason_codes,
        [ReasonCode::NewSession, ReasonCode::Balanced, ReasonCode::LowestCost],
        "{}",
        plan.reason
    );
    assert!(plan.reason.contains("balanced (w1 1.80x mean)"), "{}", plan.reason);
    // A later turn of a session: the load share is not read.
    let plan = decide(&session(640, None), &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w1", "{}", plan.reason);
    assert!(!plan.reason_codes.contains(&ReasonCode::Balanced));
    // Off (0): by cost.
    let off = RoutingConfig { session_balance: 0.0, ..cfg.clone() };
    assert_eq!(decide(&opener, &workers, &off, &mut rng()).unwrap().worker, "w1");
    // w2 and w3 busy (1,000 tokens queued, 164 ms): w1 is fastest even holding nothing (64 ms),
    // so its share is not what draws the opener, and sending it elsewhere would only make it wait.
    let mut busy = workers.clone();
    for w in &mut busy[1..] {
        w.timing.queued_tokens = 1000.0;
    }
    let plan = decide(&opener, &busy, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w1", "{}", plan.reason);
    assert!(!plan.reason_codes.contains(&ReasonCode::Balanced));
}

#[test]
fn a_request_without_a_session_follows_its_prefix_until_that_busy_worker_is_over_its_share() {
    // Four workers; w1 holds the burst's prefix (30 of 40 blocks), so it is cheapest by far, and
    // serves `in_flight` of this replica's requests, the others none. Rates are prompt tokens/s
    // over the 10 s window: one 640-token request = 64 tokens/s.
    let fleet = |rates: [f64; 4], in_flight: u64| -> Vec<WorkerView<'static>> {
        ["w1", "w2", "w3", "w4"]
            .into_iter()
            .zip(rates)
            .map(|(id, r)| {
                let mut w = view(id, if id == "w1" { 30 } else { 0 }, 0);
                w.recent_tokens_per_s = r;
                if id == "w1" {
                    w.active_requests = in_flight;
                }
                w
            })
            .collect()
    };
    let cfg = RoutingConfig::default();
    // The first sibling after the burst's first request follows it: w1 is 4x the mean, but
    // within the slack of two such requests above the least routed.
    let plan = decide(&input(640), &fleet([64.0, 0.0, 0.0, 0.0], 2), &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w1", "{}", plan.reason);
    assert!(!plan.reason_codes.contains(&ReasonCode::Balanced));
    // Six of the burst's nine so far on w1, four still in flight there: 384 tokens/s, over 1.25 x
    // the mean 144 and more than 128 (two requests) above the least routed, 64. The rest go
    // elsewhere until w1 is back within its share.
    let piled = fleet([384.0, 64.0, 64.0, 64.0], 4);
    let plan = decide(&input(640), &piled, &cfg, &mut rng()).unwrap();
    assert_ne!(plan.worker, "w1", "{}", plan.reason);
    assert_eq!(
        plan.reason_codes,
        [ReasonCode::Balanced, ReasonCode::LowestCost],
        "{}",
        plan.reason
    );
    assert!(plan.reason.contains("balanced (w1 2.67x mean)"), "{}", plan.reason);
    // Off, a slack wider than w1's lead over the least routed (320 tokens/s = 5 requests), or w1
    // serving one request (a prompt repeated one at a time, the last one's `/v1/done` not yet in:
    // nothing to balance now, and its cache is there): by cost.
    let off = RoutingConfig { request_balance: 0.0, ..cfg.clone() };
    let wide = RoutingConfig { request_balance_slack: 6.0, ..cfg.clone() };
    let idle = fleet([384.0, 64.0, 64.0, 64.0], 1);
    for (workers, cfg) in [(&piled, &off), (&piled, &wide), (&idle, &cfg)] {
        let plan = decide(&input(640), workers, cfg, &mut rng()).unwrap();
        assert_eq!(plan.worker, "w1", "{}", plan.reason);
    }
}

#[test]
fn the_request_balance_yields_to_a_holder_that_saves_more_than_the_yield() {
    // A 12,800-token prompt (800 blocks), 780 of them on w1: 320 tokens there (32 ms at 10k/s)
    // against 1,280 ms anywhere else. w1 is over its share as in the burst above (six such
    // requests' rate against one on each other worker, four in flight), but keeping this one off
    // it would make it wait 1.2 s longer: the bound yields.
    let piled: Vec<WorkerView<'static>> = ["w1", "w2", "w3", "w4"]
        .into_iter()
        .map(|id| {
            let w1 = id == "w1";
            let mut w = view(id, if w1 { 780 } else { 0 }, 0);
            w.recent_tokens_per_s = if w1 { 7680.0 } else { 1280.0 };
            w.active_requests = if w1 { 4 } else { 0 };
            w
        })
        .collect();
    let cfg = RoutingConfig::default();
    let plan = decide(&input(12_800), &piled, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w1", "{}", plan.reason);
    assert!(!plan.reason_codes.contains(&ReasonCode::Balanced));
    assert!(
        plan.reason
            .starts_with("balance yields (w1 2.67x mean saves 1248 ms): best overlap 780/800"),
        "{}",
        plan.reason
    );
    // With a yield above the saving the bound holds, as for the short prefix above.
    let strict = RoutingConfig { request_balance_yield_ms: 2000.0, ..cfg };
    let plan = decide(&input(12_800), &piled, &strict, &mut rng()).unwrap();
    assert_ne!(plan.worker, "w1", "{}", plan.reason);
    assert!(plan.reason.contains("balanced (w1 2.67x mean)"), "{}", plan.reason);
}

#[test]
fn rendezvous_homes_agree_with_the_fleet_snapshot_pin() {
    let cfg = RoutingConfig {
        session_placement: SessionPlacement::Rendezvous,
        ..RoutingConfig::default()
    };
    let mut workers: Vec<WorkerView<'static>> =
        ["w1", "w2", "w3", "w4", "w5"].iter().map(|id| view(id, 0, 0)).collect();
    workers[1].healthy = false;
    workers[3].role = Role::Prefill;
    workers[4].role = Role::Both;
    let snapshot = fleet(&workers);
    for k in 0..500u64 {
        let key = SessionKey(kvmesh_core::hashing::xxh3(&k.to_le_bytes(), 0));
        let req = RouteInput { session: Some((key, SessionSource::Prefix)), ..input(640) };
        let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
        assert_eq!(Some(plan.worker.as_str()), snapshot.pin(key.0, "").map(|w| w.id.as_str()));
        assert_eq!(plan.basis, Basis::SessionPin);
        assert_eq!(plan.reason_codes, [ReasonCode::SessionPin], "{}", plan.reason);
        assert!(plan.reason.contains("(source=prefix)"), "{}", plan.reason);
    }
}

#[test]
fn removing_a_worker_moves_only_its_rendezvous_sessions() {
    let cfg = RoutingConfig {
        session_placement: SessionPlacement::Rendezvous,
        ..RoutingConfig::default()
    };
    let all: Vec<WorkerView<'static>> =
        ["w1", "w2", "w3", "w4"].iter().map(|id| view(id, 0, 0)).collect();
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
fn an_overloaded_home_is_left_and_says_why() {
    let cfg = RoutingConfig { overload_waiting_requests: 8, ..RoutingConfig::default() };
    // w1 is home (it holds most of the prompt, and served it last), over the guard, and queued:
    // 116 ms there against w3's 32 ms.
    let mut workers: Vec<WorkerView<'static>> =
        vec![view("w1", 30, 1000), view("w2", 0, 0), view("w3", 20, 0)];
    workers[0].waiting_requests = 9;
    let req = session(640, Some("w1"));
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w3", Basis::PinOverloaded));
    assert_eq!(plan.reason_codes, [ReasonCode::PinOverloaded], "{}", plan.reason);
    // The prose says which guard: the debug header is where an operator reads it.
    assert!(
        plan.reason.starts_with(
            "home w1 overloaded (waiting 9 >= 8); chose w3: best overlap 20/40 blocks, predicted 32.0 ms"
        ),
        "{}",
        plan.reason
    );
    // The guard holds for sessionless requests too, unless every worker is over it.
    let plan = decide(
        &input(640),
        &[view("w3", 39, 0), {
            let mut w = view("w1", 39, 0);
            w.waiting_requests = 9;
            w
        }],
        &cfg,
        &mut rng(),
    )
    .unwrap();
    assert_eq!(plan.worker, "w3");
    // Every worker over the guard: the guard decides nothing, the home stays within the margin.
    for w in &mut workers {
        w.waiting_requests = 100;
    }
    workers[0].timing.queued_tokens = 0.0;
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w1", Basis::SessionPin));
}

#[test]
fn an_overloaded_home_stays_when_every_other_worker_costs_more() {
    // A saturated pool: the home is over the guard, but leaving recomputes the history elsewhere
    // (w3 holds 20 of its 30 blocks: 32 ms against 16 ms at home). It stays, and says so.
    let cfg = RoutingConfig { overload_waiting_requests: 8, ..RoutingConfig::default() };
    let mut workers: Vec<WorkerView<'static>> =
        vec![view("w1", 30, 0), view("w2", 0, 0), view("w3", 20, 0)];
    workers[0].waiting_requests = 9;
    let req = session(640, Some("w1"));
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w1", Basis::SessionPin), "{}", plan.reason);
    assert_eq!(plan.reason_codes, [ReasonCode::SessionPin], "{}", plan.reason);
    assert_eq!(
        plan.reason,
        "session pin w1 (source=header, overloaded (waiting 9 >= 8) but cheapest): overlap 30/40 \
         blocks, predicted 16.0 ms (best other w3 32.0 ms)"
    );
    // No margin once over the guard: a home 1 ms costlier than the best other is left, where a
    // home within the guards stays until another worker is cheaper by the move margin (50 ms).
    workers[0].timing.queued_tokens = 170.0; // 33 ms
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w3", Basis::PinOverloaded), "{}", plan.reason);
    workers[0].waiting_requests = 0;
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w1", Basis::SessionPin), "{}", plan.reason);
    // The active guards are capacity limits the cost does not price: a home over one is left.
    let cfg_active = RoutingConfig { overload_active_requests: 2, ..cfg.clone() };
    workers[0].waiting_requests = 0;
    workers[0].timing.queued_tokens = 0.0;
    workers[0].active_requests = 2;
    let plan = decide(&req, &workers, &cfg_active, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w3", Basis::PinOverloaded), "{}", plan.reason);
    workers[0].active_requests = 0;
    // Sessionless requests and new sessions keep off a worker over the guard whatever it holds.
    workers[0].waiting_requests = 9;
    workers[0].timing.queued_tokens = 0.0;
    let plan = decide(&input(640), &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w3", "{}", plan.reason);
}

#[test]
fn overrides() {
    let cfg = RoutingConfig::default();
    let mut workers = vec![view("w1", 39, 0), view("w2", 0, 0)];
    let req = RouteInput { override_worker: Some("w2"), ..input(640) };
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w2", Basis::Override));
    assert_eq!(plan.reason_codes, [ReasonCode::Override], "{}", plan.reason);
    assert_eq!(plan.best_overlap, Some(("w1".into(), 39)));
    let bad = RouteInput { override_worker: Some("w9"), ..input(640) };
    assert_eq!(
        decide(&bad, &workers, &cfg, &mut rng()),
        Err(DecideError::UnknownOverrideWorker("w9".into()))
    );
    workers[1].healthy = false;
    let plan = decide(&req, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w1");
    assert_eq!(
        plan.reason_codes,
        [ReasonCode::OverrideIgnored, ReasonCode::BestOverlap],
        "{}",
        plan.reason
    );
    let mode = RouteInput { override_mode: Some(Mode::Disagg), ..input(640) };
    let plan = decide(&mode, &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.mode, Mode::Aggregate);
    assert_eq!(
        plan.reason_codes,
        [ReasonCode::BestOverlap, ReasonCode::ModeRequestIgnored],
        "{}",
        plan.reason
    );
}

#[test]
fn decision_carries_best_overlap_block_counts_and_speculation_apart() {
    let cfg = RoutingConfig::default();
    let mut w2 = view("w2", 2, 0);
    w2.speculative_blocks = 10;
    let workers = vec![view("w1", 30, 100_000), w2];
    let plan = decide(&input(650), &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w2");
    assert_eq!((plan.isl_blocks, plan.request_blocks), (40, 41));
    assert_eq!(
        (plan.overlap_blocks, plan.speculative_extra_blocks),
        (2, 8),
        "speculation is never index overlap"
    );
    assert!(
        plan.reason.contains("overlap 10/40 blocks (best elsewhere 30) (+8 speculative)"),
        "{}",
        plan.reason
    );
    let d = plan.into_decision();
    assert_eq!(d.best_overlap_worker.as_deref(), Some("w1"));
    assert_eq!(d.best_overlap_blocks, 30);
    assert_eq!(d.overlap_blocks, 2);
    assert_eq!(d.fallbacks, vec!["10.0.0.1:8000".to_owned()]);
}

proptest! {
    #[test]
    fn a_session_moves_only_past_the_margin(home_q in 0u64..50_000, other_q in 0u64..50_000, home_overlap in 0u32..40, margin_ms in 0.0f64..500.0, rel in 0.0f64..1.0) {
        let cfg = RoutingConfig { session_move_margin_ms: margin_ms, session_move_margin: rel, ..RoutingConfig::default() };
        let workers = [view("w1", home_overlap, home_q), view("w2", 0, other_q)];
        let plan = decide(&session(640, Some("w1")), &workers, &cfg, &mut rng()).unwrap();
        let cap = home_overlap.min(39);
        let home_s = (home_q as f64 + 640.0 - f64::from(cap) * 16.0) / TPS;
        let other_s = (other_q as f64 + 640.0) / TPS;
        let gain = home_s - other_s;
        let moved = plan.worker == "w2";
        prop_assert!(BASES.contains(&plan.basis) && plan.reason_codes.contains(&plan.basis), "{:?} {:?}", plan.basis, plan.reason_codes);
        let margin = (margin_ms / 1000.0).max(rel * home_s);
        if (gain - margin).abs() > 1e-9 {
            prop_assert_eq!(moved, gain > margin, "gain {} margin {}: {}", gain, margin, plan.reason);
        }
    }

    #[test]
    fn the_choice_is_within_the_near_tie_band_of_the_cheapest(queues in proptest::collection::vec(0u64..20_000, 1..8), overlaps in proptest::collection::vec(0u32..45, 8), rate in 0.0f64..50.0, seed in 0u64..1000) {
        let ids = ["w1", "w2", "w3", "w4", "w5", "w6", "w7", "w8"];
        let workers: Vec<WorkerView<'static>> = queues.iter().enumerate().map(|(i, q)| {
            let mut w = view(ids[i], overlaps[i], *q);
            w.timing.arrivals_per_s = rate;
            w
        }).collect();
        let cfg = RoutingConfig::default();
        let plan = decide(&input(640), &workers, &cfg, &mut StdRng::seed_from_u64(seed)).unwrap();
        // cost = ttft + rate × ttft × own prefill (no batch, no opener): computed here independently.
        let cost = |w: &WorkerView<'_>| {
            let own = 640.0 - f64::from(w.overlap_blocks.min(39)) * 16.0;
            let ttft = (w.timing.queued_tokens + own) / TPS;
            (ttft + rate * ttft * own / TPS) * 1000.0
        };
        let cheapest = workers.iter().map(cost).fold(f64::INFINITY, f64::min);
        let chosen = workers.iter().find(|w| w.id == plan.worker).map(cost).unwrap();
        prop_assert!(chosen <= cheapest + cfg.near_tie_ms.max(cfg.near_tie_fraction * cheapest) + 1e-6, "{} vs {}", chosen, cheapest);
        prop_assert!(BASES.contains(&plan.basis) && plan.reason_codes == [plan.basis], "{:?} {:?}", plan.basis, plan.reason_codes);
    }
}

#[test]
fn a_session_home_is_where_the_shared_index_says_its_kv_is() {
    // This replica served the session on w1 last, but another replica has served it on w2 since:
    // the index (fed by the same events on every replica) says w2 holds its history.
    let cfg = RoutingConfig::default();
    let workers = [view("w1", 5, 0), view("w2", 30, 0), view("w3", 0, 0)];
    let plan = decide(&session(640, Some("w1")), &workers, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w2", Basis::SessionPin), "{}", plan.reason);
    // When the index does not tell workers apart, this replica's memory decides.
    let even = [view("w1", 30, 0), view("w2", 30, 0), view("w3", 30, 0)];
    let plan = decide(&session(640, Some("w3")), &even, &cfg, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.basis), ("w3", Basis::SessionPin), "{}", plan.reason);
}

/// Drift guard: the README's "Decision reasons" table names every reason code.
#[test]
fn readme_documents_every_reason_code() {
    let readme = include_str!("../../README.md");
    for c in ReasonCode::ALL {
        assert!(
            readme.contains(&format!("`{}`", c.as_str())),
            "README misses reason code {}",
            c.as_str()
        );
    }
}

/// `view` whose engine reports `running` and `waiting` adapters and `max_lora` slots, with
/// `booked` adapters just routed there and a slot wait of 2 s.
fn lora_view(
    id: &'static str,
    overlap: u32,
    running: &[&str],
    waiting: &[&str],
    max_lora: u32,
    booked: &[&str],
) -> WorkerView<'static> {
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect();
    let engine = Box::leak(Box::new(LoraInfo {
        max_lora: Some(max_lora),
        running: names(running),
        waiting: names(waiting),
    }));
    WorkerView {
        adapters: Some(WorkerAdapters {
            engine,
            booked: booked.iter().map(|b| std::sync::Arc::from(*b)).collect(),
            slot_wait_s: 2.0,
        }),
        ..view(id, overlap, 0)
    }
}

/// 640 tokens (64 ms cold) under adapter `a`; `routing.adapter_load_ms` is 250 ms by default.
fn for_adapter(tokens: usize) -> RouteInput<'static> {
    RouteInput { adapter: Some("a"), ..input(tokens) }
}

#[test]
fn an_adapter_request_prefers_a_worker_with_its_adapter_running_waiting_or_just_routed() {
    let cfg = RoutingConfig::default();
    for resident in [
        lora_view("w2", 0, &["a"], &[], 2, &[]),
        lora_view("w2", 0, &[], &["a"], 2, &[]),
        lora_view("w2", 0, &["b"], &[], 2, &["a"]),
    ] {
        let workers = [lora_view("w1", 0, &["b"], &[], 2, &[]), resident.clone()];
        for seed in 0..20 {
            let plan = decide(&for_adapter(640), &workers, &cfg, &mut StdRng::seed_from_u64(seed))
                .unwrap();
            assert_eq!(plan.worker, "w2", "{resident:?}");
            assert_eq!(plan.adapter, AdapterCost::default());
            assert!(close(plan.predicted_ttft_ms, 64.0), "{}", plan.predicted_ttft_ms);
        }
        // On w1 alone it pays the load: 64 + 250 ms.
        let plan = decide(&for_adapter(640), &workers[..1], &cfg, &mut rng()).unwrap();
        assert_eq!(plan.adapter, AdapterCost { load: true, wait_slot: false });
        assert!(close(plan.predicted_ttft_ms, 314.0), "{}", plan.predicted_ttft_ms);
    }
}

#[test]
fn an_adapter_load_is_paid_where_the_cache_saves_more() {
    let cfg = RoutingConfig::default();
    // 6,400 tokens: 640 ms cold. w1 holds 399 of its blocks (under the adapter) but must load
    // it: 1.6 ms + 250 ms. w2 runs the adapter and holds nothing: 640 ms.
    let workers = [lora_view("w1", 399, &[], &[], 2, &[]), lora_view("w2", 0, &["a"], &[], 2, &[])];
    let plan = decide(&for_adapter(6400), &workers, &cfg, &mut rng()).unwrap();
    assert_eq!(plan.worker, "w1");
    assert_eq!(plan.adapter, AdapterCost { load: true, wait_slot: false });
    assert!(close(plan.predicted_ttft_ms, 251.6), "{}", plan.predicted_ttft_ms);
    // A slower load (1 s) tips it the other way.
    let slow = RoutingConfig { adapter_load_ms: 1000.0, ..cfg };
    let plan = decide(&for_adapter(6400), &workers, &slow, &mut rng()).unwrap();
    assert_eq!((plan.worker.as_str(), plan.adapter), ("w2", AdapterCost::default()));
}

#[test]
fn a_worker_whose_slots_other_adapters_hold_loses_to_one_with_a_free_slot() {
    let cfg = RoutingConfig::default();
    // Both must load `a`; w1's one slot is held by running `b` (and w3's by `c`, just routed
    // there): they also wait for it (2 s). w2 has a free slot.
    let workers = [
        lora_view("w1", 10, &["b"], &[], 1, &[]),
        lora_view("w2", 0, &["b"], &[], 2, &[]),
        lora_view("w3", 10, &[], &[], 1, &["c"]),
    ];
    for seed in 0..20 {
        let plan =
            decide(&for_adapter(640), &workers, &cfg, &mut StdRng::seed_from_u64(seed)).unwrap();
        assert_eq!(plan.worker, "w2");
        assert_eq!(plan.adapter, AdapterCost { load: true, wait_slot: false });
    }
    let plan = decide(&for_adapter(640), &workers[..1], &cfg, &mut rng()).unwrap();
    assert_eq!(plan.adapter, AdapterCost { load: true, wait_slot: true });
    // 480 uncached tokens (48 ms) + 250 ms load + 2 s wait.
    assert!(close(plan.predicted_ttft_ms, 2298.0), "{}", plan.predicted_ttft_ms);
    // Waiting for a slot without loading: `a` is queued on w1 behind running `b`.
    let queued = lora_view("w1", 0, &["b"], &["a"], 1, &[]);
    let plan = decide(&for_adapter(640), &[queued], &cfg, &mut rng()).unwrap();
    assert_eq!(plan.adapter, AdapterCost { load: false, wait_slot: true });
    assert!(close(plan.predicted_ttft_ms, 2064.0), "{}", plan.predicted_ttft_ms);
}

#[test]
fn an_engine_without_lora_info_charges_nothing() {
    // An engine that does not export `vllm:lora_requests_info`: unknown, no cost.
    let cfg = RoutingConfig::default();
    let plan = decide(&for_adapter(640), &[view("w1", 0, 0)], &cfg, &mut rng()).unwrap();
    assert_eq!(plan.adapter, AdapterCost::default());
    assert!(close(plan.predicted_ttft_ms, 64.0));
}

proptest! {
    /// A base-model request (no adapter) is decided exactly as before: the workers' adapter
    /// state changes nothing.
    #[test]
    fn without_an_adapter_the_adapter_state_changes_nothing(
        workers in proptest::collection::vec((0u32..40, 0u64..5000, 0usize..3, 0usize..3, 1u32..3, 0usize..3), 1..5),
        tokens in 16usize..2000,
        seed in 0u64..1000,
    ) {
        let cfg = RoutingConfig::default();
        let ids = ["w0", "w1", "w2", "w3", "w4"];
        let names = ["a", "b", "c"];
        let plain: Vec<WorkerView<'static>> =
            workers.iter().enumerate().map(|(i, &(o, q, ..))| view(ids[i], o, q)).collect();
        let with: Vec<WorkerView<'static>> = workers
            .iter()
            .enumerate()
            .map(|(i, &(o, _, r, w, max, b))| WorkerView {
                timing: plain[i].timing,
                active_blocks: plain[i].active_blocks,
                ..lora_view(ids[i], o, &names[..r], &names[..w], max, &names[..b])
            })
            .collect();
        let a = decide(&input(tokens), &plain, &cfg, &mut StdRng::seed_from_u64(seed)).unwrap();
        let b = decide(&input(tokens), &with, &cfg, &mut StdRng::seed_from_u64(seed)).unwrap();
        prop_assert_eq!(a, b);
    }
}
