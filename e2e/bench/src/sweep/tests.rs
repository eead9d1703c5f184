//! Unit tests of the sweep's decisions and numbers (a simulated fleet, no I/O).

use super::*;
use crate::ceiling::Ceiling;
use crate::counters::{EngineCounters, PolicyCounters};
use crate::record::RequestRecord;
use crate::stats::percentile;
use crate::workload::WorkloadKind;

fn pt(rate: f64, p90: f64, valid: bool) -> RatePoint {
    RatePoint { rate, p90_ms: Some(p90), valid }
}

fn cfg() -> SweepConfig {
    SweepConfig { start_rate: 1.0, factor: 2.0, max_steps: 5, fractions: vec![0.4, 0.8, 1.0, 1.3] }
}

#[test]
fn saturation_table() {
    type Case = (&'static str, Vec<RatePoint>, Option<(f64, bool)>);
    let cases: Vec<Case> = vec![
        (
            "never crosses",
            vec![pt(1.0, 100.0, true), pt(2.0, 150.0, true), pt(4.0, 290.0, true)],
            None,
        ),
        // Threshold 300: between 2 (150) and 4 (450) → 2 + 2 × 150/300 = 3.
        (
            "interpolated",
            vec![pt(1.0, 100.0, true), pt(2.0, 150.0, true), pt(4.0, 450.0, true)],
            Some((3.0, false)),
        ),
        (
            "order does not matter",
            vec![pt(4.0, 450.0, true), pt(1.0, 100.0, true), pt(2.0, 150.0, true)],
            Some((3.0, false)),
        ),
        (
            "first crossing wins",
            vec![pt(1.0, 100.0, true), pt(2.0, 400.0, true), pt(4.0, 200.0, true)],
            Some((1.0 + 200.0 / 300.0, false)),
        ),
        // The invalid point is skipped: 1 → 4 gives 1 + 3 × 200/350.
        (
            "invalid points skipped",
            vec![pt(1.0, 100.0, true), pt(2.0, 9999.0, false), pt(4.0, 450.0, true)],
            Some((1.0 + 3.0 * 200.0 / 350.0, false)),
        ),
        (
            "fallback to invalid points",
            vec![pt(1.0, 100.0, false), pt(2.0, 400.0, false)],
            Some((1.0 + 200.0 / 300.0, true)),
        ),
        ("single point", vec![pt(1.0, 100.0, true)], None),
    ];
    for (name, pts, want) in cases {
        let got = saturation_rate(&pts).map(|s| (s.rate, s.from_invalid_points));
        match (got, want) {
            (Some((r, inv)), Some((wr, winv))) => {
                assert!((r - wr).abs() < 1e-9 && inv == winv, "{name}: {r} {inv}")
            }
            (g, w) => assert_eq!(g.is_some(), w.is_some(), "{name}: {g:?}"),
        }
    }
    // Nothing succeeded at the second rate: saturated there.
    let s = saturation_rate(&[
        pt(1.0, 100.0, true),
        RatePoint { rate: 2.0, p90_ms: None, valid: true },
    ])
    .unwrap();
    assert_eq!(s.rate, 2.0);
    assert!((s.load_point() - 1.6).abs() < 1e-12);
}

#[test]
fn ladder_drives_until_saturated_or_bounded() {
    let c = cfg();
    assert_eq!(next_ladder_rate(&c, &[]), LadderStep::Measure(1.0));
    assert_eq!(next_ladder_rate(&c, &[pt(1.0, 100.0, true)]), LadderStep::Measure(2.0));
    assert_eq!(
        next_ladder_rate(&c, &[pt(1.0, 100.0, true), pt(2.0, 120.0, true)]),
        LadderStep::Measure(4.0)
    );
    match next_ladder_rate(&c, &[pt(1.0, 100.0, true), pt(2.0, 120.0, true), pt(4.0, 600.0, true)])
    {
        LadderStep::Saturated(s) => {
            assert!((s.rate - (2.0 + 2.0 * 180.0 / 480.0)).abs() < 1e-9)
        }
        other => panic!("{other:?}"),
    }
    let flat: Vec<RatePoint> = (0..5).map(|i| pt(f64::from(1 << i), 100.0, true)).collect();
    assert_eq!(next_ladder_rate(&c, &flat), LadderStep::GaveUp);
    // A whole simulated sweep: a fleet whose p90 explodes past 5 rate units.
    let fleet = |r: f64| if r < 5.0 { 100.0 + 10.0 * r } else { 2000.0 };
    let mut pts = Vec::new();
    let sat = loop {
        match next_ladder_rate(&c, &pts) {
            LadderStep::Measure(r) => pts.push(pt(r, fleet(r), true)),
            LadderStep::Saturated(s) => break s,
            LadderStep::GaveUp => panic!("should saturate"),
        }
    };
    assert_eq!(pts.len(), 4, "1, 2, 4, 8");
    assert!(sat.rate > 4.0 && sat.rate < 8.0, "{}", sat.rate);
    let rates = policy_rates(&c, &sat);
    assert_eq!(rates.len(), 4);
    assert!(
        rates.iter().any(|r| (r - sat.load_point()).abs() < 1e-9),
        "the load point is measured"
    );
    assert!(
        rates[0] < sat.rate && *rates.last().unwrap() > sat.rate,
        "light load to past saturation"
    );
}

#[test]
fn fleet_timing_table() {
    for kind in WorkloadKind::ALL {
        let t = default_timing(kind);
        // One full chunk costs the simulator default's modelled time (0.41 s) at any prefill.
        let chunk_s = t.max_num_batched_tokens as f64 / t.prefill_tokens_per_s;
        assert!((chunk_s - 8192.0 / 20_000.0).abs() < 0.002, "{kind:?}: {chunk_s}");
        // Engine time dominates: round_robin is estimated to saturate at a rate whose
        // arrivals the client and the machine serve validly (measured at 20-s points:
        // agentic ≤ 19 sessions/s, paced ≤ 55 sessions/s valid; the others saturated).
        let sat = estimated_saturation(kind, &t, 4);
        let start = default_start_rate(kind, &t, 4);
        assert!((start - START_FRACTION * sat).abs() < 1e-12);
        match kind {
            WorkloadKind::Agentic | WorkloadKind::Models => {
                assert!((0.5..=4.0).contains(&sat), "agentic {sat}");
                // At steady state a session sends its ~17.5 turns: the light point's 20-s
                // window holds ≥ 100 requests.
                assert!(start * 20.0 * 17.5 >= 100.0, "agentic light point {start}");
                assert_eq!(t.sim_speedup, 4.0);
            }
            WorkloadKind::Paced => assert!((6.0..=20.0).contains(&sat), "paced {sat}"),
            _ => assert_eq!(
                (t.sim_speedup, t.prefill_tokens_per_s),
                (1.0, 20_000.0),
                "{kind:?} unchanged"
            ),
        }
    }
    // The multi-turn workloads' wall-clock throughput is below the default: mostly cache
    // hits, they would otherwise saturate the machine before the engines.
    assert!(default_timing(WorkloadKind::Agentic).real_prefill_tps() < 20_000.0);
    assert!(default_timing(WorkloadKind::Paced).real_prefill_tps() < 20_000.0);
    // Paced's think times are compressed by its speed-up; its engine time with them.
    let p = default_timing(WorkloadKind::Paced);
    assert_eq!(p.sim_speedup, 8.0);
    assert_eq!(p.real_prefill_tps(), 8_000.0);
    assert_eq!(FleetTiming::new(1.0, 20_000.0).map(|t| t.max_num_batched_tokens), Ok(8192));
    assert_eq!(FleetTiming::new(1.0, 5_000.0).map(|t| t.max_num_batched_tokens), Ok(2048));
    assert_eq!(default_timing(WorkloadKind::Agentic).max_num_batched_tokens, 819);
    assert_eq!(FleetTiming::new(1.0, 10.0).map(|t| t.max_num_batched_tokens), Ok(16), "floor");
    for (s, p) in [(0.0, 1.0), (1.0, 0.0), (f64::NAN, 1.0), (1.0, f64::INFINITY)] {
        assert!(FleetTiming::new(s, p).is_err(), "{s} {p}");
    }
    assert!(p.describe().contains("÷ 8") && p.describe().contains("--max-num-batched-tokens 410"));
    assert!(default_timing(WorkloadKind::Trace).describe().contains("wall-clock time"));
    // Overrides apply field by field; the chunk follows the prefill.
    assert_eq!(timing_for(WorkloadKind::Paced, None, None), Ok(p));
    let o = timing_for(WorkloadKind::Paced, Some(1.0), None).unwrap();
    assert_eq!((o.sim_speedup, o.prefill_tokens_per_s), (1.0, 1_000.0));
    let o = timing_for(WorkloadKind::Agentic, None, Some(20_000.0)).unwrap();
    assert_eq!((o.sim_speedup, o.max_num_batched_tokens), (4.0, 8192));
    assert!(timing_for(WorkloadKind::Cold, Some(-1.0), None).is_err());
}

#[test]
fn measure_window_table() {
    let agentic = default_timing(WorkloadKind::Agentic);
    let paced = default_timing(WorkloadKind::Paced);
    // The default warm-up: 90 % of the steady-state population live, longer than the mean
    // session (agentic 17.5 turns × (0.64 s decode + ~3 s ÷ 4 think) ≈ 24 s, paced 5.5 ×
    // 0.32 s + 4.5 × 35 s ÷ 8 ≈ 21 s) and shorter than the longest.
    let wa = default_warmup_s(WorkloadKind::Agentic, &agentic, 0);
    let wp = default_warmup_s(WorkloadKind::Paced, &paced, 0);
    assert!((25.0..=40.0).contains(&wa), "agentic warm-up {wa}");
    assert!((22.0..=36.0).contains(&wp), "paced warm-up {wp}");
    assert_eq!(wa.fract(), 0.0);
    for (kind, t, w) in [(WorkloadKind::Agentic, agentic, wa), (WorkloadKind::Paced, paced, wp)] {
        let g = crate::workload::gen::GenConfig {
            seed: 0,
            duration_s: 256.0,
            think_divisor: t.sim_speedup,
            block_size: 16,
        };
        let schedule = match kind {
            WorkloadKind::Agentic => crate::workload::gen::agentic(&g, 1.0),
            _ => crate::workload::gen::paced(&g, 1.0),
        };
        let share = crate::workload::population_share_at(
            &schedule.sessions,
            SIM_DEFAULT_ITL_MS / t.sim_speedup,
            w * 1000.0,
        );
        let before = crate::workload::population_share_at(
            &schedule.sessions,
            SIM_DEFAULT_ITL_MS / t.sim_speedup,
            (w - 1.0) * 1000.0,
        );
        assert!(
            share >= WARMUP_POPULATION_SHARE && before < WARMUP_POPULATION_SHARE,
            "{kind:?}: {before} {share}"
        );
        let mean = crate::workload::mean_session_span_ms(
            &schedule.sessions,
            SIM_DEFAULT_ITL_MS / t.sim_speedup,
        ) / 1000.0;
        assert!(w > mean, "{kind:?}: warm-up {w} s, mean session {mean} s");
    }
    // (kind, override, real engines) → (warm-up, arrivals, turn deadline, steady)
    type Case = (WorkloadKind, Option<f64>, bool, (f64, f64, f64, bool));
    let cases: Vec<Case> = vec![
        (WorkloadKind::Trace, None, false, (0.0, 20.0, 30.0, false)),
        (WorkloadKind::Cold, Some(50.0), false, (0.0, 20.0, 30.0, false)),
        (WorkloadKind::Siblings, None, true, (0.0, 20.0, 30.0, false)),
        (WorkloadKind::Agentic, None, false, (wa, wa + 20.0, wa + 20.0, true)),
        (WorkloadKind::Agentic, Some(40.0), false, (40.0, 60.0, 60.0, true)),
        (WorkloadKind::Agentic, Some(-1.0), false, (0.0, 20.0, 30.0, true)),
        // Without a warm-up: the plain point (the ceiling still over the prompts sent).
        (WorkloadKind::Agentic, None, true, (0.0, 20.0, 30.0, true)),
        (WorkloadKind::Paced, Some(60.0), true, (60.0, 80.0, 80.0, true)),
    ];
    for (kind, over, real, (warm, arr, dl, steady)) in cases {
        let t = default_timing(kind);
        let w = window_for(kind, &t, 0, 20.0, over, real);
        assert_eq!(
            (w.warmup_s, w.arrivals_s(), w.turn_deadline_s(), w.steady),
            (warm, arr, dl, steady),
            "{kind:?} {over:?} {real}"
        );
    }
    // Which records count: scheduled inside the window (steady), everything (otherwise).
    let rec = |scheduled_ms: f64| RequestRecord { scheduled_ms, ..Default::default() };
    let recs: Vec<RequestRecord> = [0.0, 9_999.0, 10_000.0, 15_000.0, 29_999.0].map(rec).to_vec();
    let steady = MeasureWindow { warmup_s: 10.0, window_s: 20.0, steady: true };
    let (counted, warm) = window_records(&recs, &steady);
    assert_eq!(
        (counted.iter().map(|r| r.scheduled_ms).collect::<Vec<_>>(), warm),
        (vec![10_000.0, 15_000.0, 29_999.0], 2)
    );
    let plain = MeasureWindow { steady: false, ..steady };
    assert_eq!(window_records(&recs, &plain).0.len(), 5);
    // turns/s is the counted requests over the window.
    let p = PointResult { requests: 3, ..Default::default() }.with_window(steady, 2, 7);
    assert_eq!((p.turns_per_s, p.warmup_requests, p.cut_turns), (Some(0.15), 2, 7));
    assert_eq!(
        PointResult::default().with_window(MeasureWindow::default(), 0, 0).turns_per_s,
        None
    );
}

#[test]
fn point_ceiling_counts_the_window_against_its_history() {
    let g = crate::workload::gen::GenConfig {
        seed: 3,
        duration_s: 20.0,
        think_divisor: 4.0,
        block_size: 16,
    };
    let schedule = crate::workload::gen::agentic(&g, 1.0);
    // Every planned turn sent at its planned time.
    let every: Vec<RequestRecord> = schedule
        .sessions
        .iter()
        .flat_map(|s| {
            s.scheduled_times_ms().into_iter().enumerate().map(move |(t, at)| RequestRecord {
                session: Some(s.id.clone()),
                turn: Some(t as u32),
                scheduled_ms: at,
                sent_ms: at,
                ..Default::default()
            })
        })
        .collect();
    // The window [10 s, 30 s) and its history.
    let recs: Vec<RequestRecord> =
        every.iter().filter(|r| r.scheduled_ms < 30_000.0).cloned().collect();
    let w = MeasureWindow { warmup_s: 10.0, window_s: 20.0, steady: true };
    let (rate, c, skipped) = point_ceiling(&schedule, &recs, &w, 16);
    let counted = recs.iter().filter(|r| r.scheduled_ms >= 10_000.0).count() as u64;
    assert_eq!((c.requests, skipped), (counted, 0));
    assert!(rate > 0.0 && rate == c.token_rate());
    // Without its history the same window's ceiling is lower: the warm-up's prompts (shared
    // system prompts, earlier turns) are what the window reuses.
    let window_only: Vec<RequestRecord> =
        recs.iter().filter(|r| r.scheduled_ms >= 10_000.0).cloned().collect();
    let (alone, _, _) = point_ceiling(&schedule, &window_only, &w, 16);
    assert!(alone < rate, "{alone} < {rate}");
    // All sent, none in a warm-up: the schedule's own ceiling over the same prompts.
    let all = MeasureWindow { warmup_s: 0.0, ..w };
    assert_eq!(point_ceiling(&schedule, &every, &all, 16).1, schedule.ceiling);
    // A record without a session is skipped and counted; a plain point uses the schedule's.
    let (_, _, skipped) = point_ceiling(&schedule, &[RequestRecord::default()], &w, 16);
    assert_eq!(skipped, 1);
    let plain = MeasureWindow { steady: false, ..w };
    assert_eq!(
        point_ceiling(&schedule, &[], &plain, 16),
        (schedule.ceiling_rate(), schedule.ceiling, 0)
    );
}

#[test]
fn fleet_lru_is_the_ceiling_with_room_for_everything_and_the_floor_is_uncached_prefill_alone() {
    let rec = |ts: f64, input: u32, ids: &[u64]| crate::trace::TraceRecord {
        timestamp: ts,
        input_length: input,
        output_length: 4,
        hash_ids: ids.to_vec(),
    };
    // Conversation 1's second turn comes back after conversation 2's prompt.
    let records = [
        rec(0.0, 1024, &[0, 1, 2]),
        rec(1000.0, 1024, &[0, 5, 6]),
        rec(2000.0, 1536, &[0, 1, 2, 3]),
    ];
    let cfg = crate::workload::trace::TraceConfig::default();
    let schedule = crate::workload::trace::schedule(&records, &cfg, 1000.0);
    assert_eq!(schedule.sessions.len(), 3);
    let plain = MeasureWindow::default();
    assert!(!plain.steady);
    let lru = |capacity| point_fleet_lru(&schedule, &[], &plain, 16, capacity);
    let unbounded = lru(u64::MAX).unwrap();
    assert!(
        unbounded > 0.0 && (unbounded - schedule.ceiling_rate()).abs() < 1e-12,
        "{unbounded} vs {}",
        schedule.ceiling_rate()
    );
    // Room for one prompt: conversation 2 pushes out turn 1's second block; its first (shared) hits.
    let tight = lru(1024).unwrap();
    assert!(0.0 < tight && tight < unbounded, "{tight} < {unbounded}");
    assert_eq!(lru(0), Some(0.0));
    // TTFT floor: uncached 1024, 512 (block 0 shared), 512 (turn 1's 1024 reused) tokens at
    // 1,000 tokens/s, halved by a speed-up of 2.
    let t = FleetTiming::new(1.0, 1000.0).unwrap();
    let floor = point_ttft_floor_p90_ms(&schedule, &[], &plain, 16, &t);
    assert_eq!(floor, percentile(&[1024.0, 512.0, 512.0], 90.0));
    let fast = FleetTiming::new(2.0, 1000.0).unwrap();
    assert_eq!(point_ttft_floor_p90_ms(&schedule, &[], &plain, 16, &fast), floor.map(|x| x / 2.0));
    // Chat schedules weigh messages by bytes: neither applies.
    let g = crate::workload::gen::GenConfig {
        seed: 3,
        duration_s: 20.0,
        think_divisor: 4.0,
        block_size: 16,
    };
    let chat = crate::workload::gen::agentic(&g, 1.0);
    assert_eq!(point_fleet_lru(&chat, &[], &plain, 16, u64::MAX), None);
    assert_eq!(point_ttft_floor_p90_ms(&chat, &[], &plain, 16, &t), None);
}

#[test]
fn config_validation() {
    assert!(cfg().validate().is_ok());
    for bad in [
        SweepConfig { start_rate: 0.0, ..cfg() },
        SweepConfig { factor: 1.0, ..cfg() },
        SweepConfig { max_steps: 1, ..cfg() },
        SweepConfig { fractions: vec![0.5, 1.0], ..cfg() },
        SweepConfig { fractions: vec![0.8, -1.0], ..cfg() },
    ] {
        assert!(bad.validate().is_err(), "{bad:?}");
    }
}

#[test]
fn validity_rules() {
    let cases = [
        (Some(0.50), Some(2.0), 0),
        (Some(0.85), Some(10.0), 0),
        (Some(0.86), Some(2.0), 1),
        (Some(0.50), Some(10.5), 1),
        (Some(0.99), Some(50.0), 2),
        (None, Some(1.0), 1),
        (Some(0.1), None, 1),
    ];
    for (cpu, late, n) in cases {
        assert_eq!(invalid_reasons(cpu, late).len(), n, "{cpu:?} {late:?}");
    }
    assert!(invalid_reasons(Some(0.9), None)[0].contains("CPU 90%"));
}

#[test]
fn validity_rules_on_real_engines() {
    // (machine busy, engine CPU-s, wall s, cores, lateness p90, reasons)
    let cases = [
        ("engines take the whole machine: valid", Some(1.0), Some(200.0), 100.0, 2, Some(1.0), 0),
        ("rest = 0.60 − 100/200 = 0.10", Some(0.60), Some(100.0), 100.0, 2, Some(1.0), 0),
        ("rest exactly at the bound", Some(0.75), Some(100.0), 100.0, 2, Some(10.0), 0),
        ("rest 0.30 > 0.25", Some(0.80), Some(100.0), 100.0, 2, Some(1.0), 1),
        ("idle engines, busy machine", Some(0.90), Some(0.0), 100.0, 2, Some(1.0), 1),
        (
            "engine ticks above the sampled busy share floor at 0",
            Some(0.40),
            Some(190.0),
            100.0,
            2,
            Some(1.0),
            0,
        ),
        ("late client", Some(0.50), Some(100.0), 100.0, 2, Some(10.5), 1),
        ("both", Some(0.99), Some(10.0), 100.0, 2, Some(50.0), 2),
        ("no CPU sample", None, Some(10.0), 100.0, 2, Some(1.0), 1),
        ("no engine CPU", Some(0.5), None, 100.0, 2, Some(1.0), 1),
        ("no wall time", Some(0.5), Some(1.0), 0.0, 2, Some(1.0), 1),
        ("nothing sent", Some(0.5), Some(100.0), 100.0, 2, None, 1),
    ];
    for (name, busy, eng, wall, cores, late, n) in cases {
        assert_eq!(invalid_reasons_real_engines(busy, eng, wall, cores, late).len(), n, "{name}");
    }
    // The machine rule alone would call the first case invalid; this one must not.
    assert_eq!(invalid_reasons(Some(1.0), Some(1.0)).len(), 1);
    let why = invalid_reasons_real_engines(Some(0.80), Some(100.0), 100.0, 2, Some(1.0));
    assert!(why[0].contains("outside the engines 30%"), "{why:?}");
}

#[test]
fn point_summary() {
    let rec = |i: u64, w: &str, ttft: f64, late: f64, status: u16| RequestRecord {
        index: i,
        scheduled_ms: i as f64 * 100.0,
        sent_ms: i as f64 * 100.0 + late,
        ttft_ms: Some(ttft),
        e2e_ms: ttft + 90.0,
        status: Some(status),
        worker: Some(w.into()),
        max_tokens: 10,
        prompt_tokens: Some(1000),
        cached_tokens: Some(250),
        output_tokens: Some(10),
        error: (status != 200).then(|| format!("HTTP {status}")),
        ..Default::default()
    };
    let recs = vec![
        rec(0, "w0", 10.0, 1.0, 200),
        rec(1, "w0", 20.0, 2.0, 200),
        rec(2, "w1", 30.0, 3.0, 200),
        rec(3, "w1", 0.0, 30.0, 503),
        rec(4, "w1", 0.0, 0.0, 500),
    ];
    let counters = PolicyCounters {
        engines: vec![EngineCounters {
            worker: "w0".into(),
            endpoint: None,
            prefix_cache_hits: 200.0,
            prefix_cache_queries: 1000.0,
            preemptions: 0.0,
        }],
        router: None,
    };
    let fleet: Vec<String> = ["w0", "w1", "w2"].iter().map(|s| s.to_string()).collect();
    let ceil = Ceiling {
        requests: 5,
        blocks_total: 10,
        blocks_reused: 4,
        tokens_total: 10,
        tokens_reused: 4,
    };
    let m =
        MachineSample { cpu_busy_mean: Some(0.5), cpu_busy_max: Some(0.7), sim_cpu_s: Some(2.0) };
    let p = summarize_point(
        "trace",
        "round_robin",
        2.0,
        "d",
        &recs,
        Some(&counters),
        Some((0.4, ceil)),
        m,
        &fleet,
    );
    assert_eq!((p.requests, p.ok, p.rejected, p.failed), (5, 3, 1, 1));
    assert_eq!((p.ttft_p50_ms, p.ttft_p90_ms), (Some(20.0), Some(30.0)));
    assert_eq!(p.itl_p50_ms, Some(10.0));
    assert_eq!(p.engine_hit_rate, Some(0.2));
    assert_eq!(p.usage_hit_rate, Some(0.25));
    assert!((p.hit_over_ceiling().unwrap() - 0.5).abs() < 1e-12);
    // 2000 / 1000 / 0 prompt tokens over three workers: max/mean = 2000 / 1000.
    assert_eq!(p.load_max_over_mean, Some(2.0));
    assert_eq!(p.lateness_p90_ms, Some(30.0));
    assert_eq!(p.sim_cpu_s_per_1k, Some(400.0));
    assert!(!p.valid() && p.invalid.iter().any(|r| r.contains("lateness")), "{:?}", p.invalid);
}
