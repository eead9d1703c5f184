use super::super::reason::mode_clauses;
use super::*;
use crate::decide::tests::view;
use kvmesh_core::api::{ReasonCode, Role};
use rand::{rngs::StdRng, SeedableRng};

/// 40 full blocks of 16 tokens.
const ISL: u64 = 640;

fn prefill(id: &'static str, overlap: u32, load: u64) -> WorkerView<'static> {
    WorkerView { role: Role::Prefill, ..view(id, overlap, load) }
}

fn input() -> ModeInput<'static> {
    ModeInput {
        isl_tokens: ISL,
        block_size: 16,
        continuation: false,
        kv_home: None,
        override_mode: None,
    }
}

fn disagg_cfg(t: u64) -> RoutingConfig {
    RoutingConfig { min_remote_prefill_tokens: t, ..RoutingConfig::default() }
}

fn migration_cfg(mode: KvMigration, min_tokens: u64) -> RoutingConfig {
    RoutingConfig {
        kv_migration: mode,
        kv_migration_min_tokens: min_tokens,
        ..RoutingConfig::default()
    }
}

/// A mode choice as the tests read it: the stage's outcome with its reason rendered.
struct Rendered {
    mode: Mode,
    leg: Option<Leg>,
    opportunity: Option<Opportunity>,
    local_continuation: bool,
    reason: String,
    codes: Vec<ReasonCode>,
}

fn run(
    input: &ModeInput<'_>,
    decode: &str,
    workers: &[WorkerView<'_>],
    best: Option<(&str, u32)>,
    cfg: &RoutingConfig,
) -> Rendered {
    let at = |id: &str| workers.iter().position(|w| w.id == id).unwrap();
    let best = best.map(|(id, blocks)| (at(id), blocks));
    let c =
        choose_mode(input, at(decode), workers, best, cfg, &mut StdRng::seed_from_u64(7)).unwrap();
    let full_blocks =
        kvmesh_core::router_metrics::isl_blocks(input.isl_tokens as usize, input.block_size);
    let (reason, codes) = mode_clauses(full_blocks, &c.reason, &c.notes);
    Rendered {
        mode: c.mode,
        leg: c.leg,
        opportunity: c.opportunity,
        local_continuation: c.local_continuation,
        reason,
        codes,
    }
}

fn leg_worker(c: &Rendered) -> Option<&str> {
    match &c.leg {
        Some(Leg::PrefillOn { worker, .. } | Leg::MigrateFrom { worker, .. }) => Some(worker),
        None => None,
    }
}

#[test]
fn conditional_disaggregation_by_uncached_tokens() {
    let workers = [view("w1", 0, 0), view("w2", 30, 0), prefill("w8", 0, 0)];
    // (threshold, decode worker, want mode, want prefill worker, want reason codes)
    let below = ReasonCode::BelowPrefillThreshold;
    let cases = [
        (0, "w1", Mode::Aggregate, None, vec![]),
        (320, "w1", Mode::Disagg, Some("w8"), vec![ReasonCode::DisaggUncached]),
        (640, "w1", Mode::Disagg, Some("w8"), vec![ReasonCode::DisaggUncached]),
        (641, "w1", Mode::Aggregate, None, vec![below]),
        (320, "w2", Mode::Aggregate, None, vec![below]),
    ];
    for (t, decode, mode, leg, codes) in cases {
        let c = run(&input(), decode, &workers, None, &disagg_cfg(t));
        assert_eq!((c.mode, leg_worker(&c)), (mode, leg), "T={t} on {decode}: {}", c.reason);
        assert_eq!(c.codes, codes, "T={t}: {:?}", c.reason);
        assert!(c.opportunity.is_none());
    }
}

#[test]
fn no_healthy_prefill_worker_means_aggregate() {
    let mut sick = prefill("w8", 0, 0);
    sick.healthy = false;
    for workers in [vec![view("w1", 0, 0), view("w2", 0, 0)], vec![view("w1", 0, 0), sick]] {
        let c = run(&input(), "w1", &workers, None, &disagg_cfg(16));
        assert_eq!(c.mode, Mode::Aggregate);
        assert_eq!(c.codes, [ReasonCode::NoPrefillWorker], "{}", c.reason);
    }
}

#[test]
fn the_prefill_worker_is_chosen_by_overlap_and_load() {
    let workers =
        [view("w1", 0, 0), prefill("p1", 0, 0), prefill("p2", 35, 0), prefill("p3", 40, 500)];
    let c = run(&input(), "w1", &workers, None, &disagg_cfg(16));
    assert_eq!(leg_worker(&c), Some("p2"), "{}", c.reason);
    assert!(
        c.reason.contains("prefill on p2 (overlap 35/40 blocks), decode on w1"),
        "{}",
        c.reason
    );
    // A `both` worker prefills for others, never for itself.
    let both = [
        WorkerView { role: Role::Both, ..view("w1", 0, 0) },
        WorkerView { role: Role::Both, ..view("w2", 0, 0) },
    ];
    assert_eq!(leg_worker(&run(&input(), "w1", &both, None, &disagg_cfg(16))), Some("w2"));
}

#[test]
fn local_continuations_stay_on_their_decode_worker() {
    let workers = [view("w1", 0, 0), prefill("w8", 0, 0)];
    let cont = ModeInput { continuation: true, ..input() };
    let on = RoutingConfig { local_continuations: true, ..disagg_cfg(320) };
    let c = run(&cont, "w1", &workers, None, &on);
    assert_eq!((c.mode, c.local_continuation), (Mode::Aggregate, true));
    assert_eq!(c.codes, [ReasonCode::LocalContinuation], "{}", c.reason);
    // Off: the same continuation is disaggregated; on, a first turn is too.
    assert_eq!(run(&cont, "w1", &workers, None, &disagg_cfg(320)).mode, Mode::Disagg);
    assert_eq!(run(&input(), "w1", &workers, None, &on).mode, Mode::Disagg);
    // Below the threshold it is not counted as a continuation kept local.
    let short = ModeInput { isl_tokens: 100, ..cont };
    assert!(!run(&short, "w1", &workers, None, &on).local_continuation);
}

#[test]
fn migration_by_mode_and_minimum() {
    let workers = [view("w1", 30, 0), view("w2", 4, 0)];
    // (mode, min tokens, want mode, want leg, want opportunity)
    let cases = [
        (KvMigration::Off, 0, Mode::Aggregate, None, false),
        (KvMigration::Dry, 256, Mode::Aggregate, None, true),
        (KvMigration::On, 256, Mode::Migrate, Some("w1"), true),
        (KvMigration::On, 416, Mode::Migrate, Some("w1"), true),
        (KvMigration::On, 417, Mode::Aggregate, None, false),
    ];
    for (mode, min, want, leg, opportunity) in cases {
        let c = run(&input(), "w2", &workers, Some(("w1", 30)), &migration_cfg(mode, min));
        assert_eq!(
            (c.mode, leg_worker(&c), c.opportunity.is_some()),
            (want, leg, opportunity),
            "{mode:?} {min}: {}",
            c.reason
        );
        if let Some(o) = &c.opportunity {
            assert_eq!(
                (o.source.as_str(), o.target.as_str(), o.blocks_to_move(), o.from_kv_home),
                ("w1", "w2", 26, false)
            );
        }
    }
    let dry = run(&input(), "w2", &workers, Some(("w1", 30)), &migration_cfg(KvMigration::Dry, 0));
    assert_eq!(dry.codes, [ReasonCode::MigrateDryRun], "{}", dry.reason);
    let on = run(&input(), "w2", &workers, Some(("w1", 30)), &migration_cfg(KvMigration::On, 0));
    assert_eq!(on.codes, [ReasonCode::Migrate], "{}", on.reason);
    // The prose names what moves (humans read it in the debug header).
    assert_eq!(
        on.reason,
        "migrate: w1 holds 30/40 blocks, w2 holds 4; w2 pulls 26 blocks instead of recomputing"
    );
    // The chosen worker already holds the most: nothing to move.
    assert!(run(&input(), "w1", &workers, Some(("w1", 30)), &migration_cfg(KvMigration::On, 0))
        .opportunity
        .is_none());
}

#[test]
fn kv_home_is_the_source_when_the_index_knows_nothing_better() {
    let workers = [view("w1", 0, 0), view("w2", 0, 0)];
    let homed = ModeInput { kv_home: Some("w1"), ..input() };
    let c = run(&homed, "w2", &workers, None, &migration_cfg(KvMigration::On, 0));
    assert_eq!((c.mode, leg_worker(&c)), (Mode::Migrate, Some("w1")));
    let o = c.opportunity.unwrap();
    assert!(o.from_kv_home);
    assert_eq!(o.blocks_to_move(), 40);
    // A home that is unhealthy, or the chosen worker itself, is no source.
    let mut sick = workers.clone();
    sick[0].healthy = false;
    assert!(run(&homed, "w2", &sick, None, &migration_cfg(KvMigration::On, 0))
        .opportunity
        .is_none());
    assert!(run(&homed, "w1", &workers, None, &migration_cfg(KvMigration::On, 0))
        .opportunity
        .is_none());
}

#[test]
fn disaggregation_wins_when_migration_leaves_too_much_to_prefill() {
    let workers = [view("w1", 10, 0), view("w2", 0, 0), prefill("w8", 0, 0)];
    let cfg = RoutingConfig {
        kv_migration: KvMigration::On,
        kv_migration_min_tokens: 16,
        ..disagg_cfg(320)
    };
    // w1 holds 160 tokens: 480 stay uncached after a move, above T.
    let c = run(&input(), "w2", &workers, Some(("w1", 10)), &cfg);
    assert_eq!((c.mode, leg_worker(&c)), (Mode::Disagg, Some("w8")), "{}", c.reason);
    assert!(c.opportunity.is_some(), "the opportunity is still counted");
    // w1 holds 30 blocks: 160 tokens stay, below T: migrate.
    let workers = [view("w1", 30, 0), view("w2", 0, 0), prefill("w8", 0, 0)];
    assert_eq!(run(&input(), "w2", &workers, Some(("w1", 30)), &cfg).mode, Mode::Migrate);
}

#[test]
fn operator_overrides() {
    let workers = [view("w1", 30, 0), view("w2", 0, 0), prefill("w8", 0, 0)];
    let with = |m: Mode| ModeInput { override_mode: Some(m), ..input() };
    let all_on = RoutingConfig { kv_migration: KvMigration::On, ..disagg_cfg(16) };
    let c = run(&with(Mode::Aggregate), "w2", &workers, Some(("w1", 30)), &all_on);
    assert_eq!(
        (c.mode, c.opportunity.is_none(), c.codes.as_slice()),
        (Mode::Aggregate, true, [ReasonCode::AggregateRequested].as_slice())
    );
    let plain = run(&input(), "w2", &workers, None, &RoutingConfig::default());
    assert_eq!(
        (plain.reason.as_str(), plain.codes.as_slice()),
        ("", [].as_slice()),
        "a plain aggregate fleet adds no reason"
    );
    // Disagg forced below the threshold and with T = 0.
    for cfg in [disagg_cfg(0), disagg_cfg(100_000)] {
        assert_eq!(run(&with(Mode::Disagg), "w2", &workers, None, &cfg).mode, Mode::Disagg);
    }
    // Migrate forced below the minimum, but only with migration on.
    let c = run(
        &with(Mode::Migrate),
        "w2",
        &workers,
        Some(("w1", 30)),
        &migration_cfg(KvMigration::On, 100_000),
    );
    assert_eq!(c.mode, Mode::Migrate);
    let c = run(
        &with(Mode::Migrate),
        "w2",
        &workers,
        Some(("w1", 30)),
        &migration_cfg(KvMigration::Dry, 0),
    );
    assert_eq!(c.mode, Mode::Aggregate);
    assert_eq!(c.codes.last(), Some(&ReasonCode::ModeRequestIgnored), "{}", c.reason);
    assert!(c.reason.ends_with("x-kvmesh-mode migrate: kv_migration is dry"), "{}", c.reason);
    let c = run(&with(Mode::DecodeFallback), "w2", &workers, None, &RoutingConfig::default());
    assert_eq!(c.codes, [ReasonCode::ModeRequestIgnored], "{}", c.reason);
}
