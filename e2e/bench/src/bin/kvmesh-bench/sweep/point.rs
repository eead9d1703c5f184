//! One sweep point: its schedule at the rate (pure, `workload`), a fresh stack, caches reset,
//! counters scraped around the run, the machine's and the engines' CPU sampled, the schedule
//! run (`schedule_run`) while a ticker prints progress, the files written and the point
//! summarised (`sweep::summarize_point`). Behind several gateway replicas the other replicas start
//! over the first one's engines (`replica.rs`), the client spreads requests over them, the
//! routers' counters are summed over them; a lost-events point faults the last replica's indexer
//! in the window and measures its recovery (`sweep::lost_events`).

use super::replica::{counters_since, inject, start_replicas, FaultPlan};
use super::{cpu_s_between, group_ticks, SweepSettings, CPU_SAMPLE_EVERY, PROGRESS_EVERY};

use crate::run::{counters, prepare_stack, scrape_gateways, Fleet, Prepared};
use anyhow::{Context, Result};
use kvmesh_bench::cpu::Sampler;
use kvmesh_bench::overhead::drive::cpu_ticks;
use kvmesh_bench::policy::Policy;
use kvmesh_bench::record::read_all;
use kvmesh_bench::schedule_run::{run_schedule, ScheduleRunConfig};
use kvmesh_bench::sink::Sink;
use kvmesh_bench::sweep::lost_events::{recovery, Fault};
use kvmesh_bench::sweep::models::{cross_model, model_points, FleetModelShare};
use kvmesh_bench::sweep::replicas::{replica_for, ReplicaSetup};
use kvmesh_bench::sweep::{
    invalid_reasons_real_engines, point_ceiling, point_fleet_lru, point_ttft_floor_p90_ms,
    summarize_point, window_records, FleetTiming, MachineSample, MeasureWindow, PointResult,
};
use kvmesh_bench::workload::{gen, models, trace as wtrace, Schedule, WorkloadKind};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn schedule_for(
    a: &SweepSettings,
    fleet: &Fleet,
    kind: WorkloadKind,
    rate: f64,
    window: &MeasureWindow,
) -> Schedule {
    let g = gen::GenConfig {
        seed: a.seed,
        duration_s: window.arrivals_s(),
        think_divisor: fleet.sim_speedup,
        block_size: fleet.block_size as usize,
    };
    match kind {
        // A longer window replays proportionally more trace time: the ladder's compression, so the
        // load point is 0.8 × the saturation rate of the same traffic.
        WorkloadKind::Trace => wtrace::schedule(
            &a.trace_records,
            &wtrace::TraceConfig {
                duration_s: window.arrivals_s(),
                window_ms: a.trace_cfg.window_ms * window.arrivals_s() / a.duration_s,
                block_size: fleet.block_size as usize,
                ..a.trace_cfg
            },
            rate,
        ),
        WorkloadKind::Agentic => gen::agentic(&g, rate),
        WorkloadKind::Siblings => gen::siblings(&g, rate),
        WorkloadKind::Paced => gen::paced(&g, rate),
        WorkloadKind::Cold => gen::cold(&g, rate),
        WorkloadKind::Models => models::models(&g, rate),
        WorkloadKind::Tiers => kvmesh_bench::workload::tiers::tiers(&g, rate),
    }
}

/// Progress shared with the ticker.
pub(super) struct Progress {
    pub(super) started: Instant,
    pub(super) point: usize,
}

pub(super) fn fmt_elapsed(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}m{:02}s", s / 60, s % 60)
}

/// One workload's point settings: its fleet, its window and the simulators' timing (`None` on
/// real engines, which keep their own).
pub(super) struct PointSpec<'a> {
    pub(super) fleet: &'a Fleet,
    pub(super) window: MeasureWindow,
    pub(super) sim_timing: Option<FleetTiming>,
    /// The gateway replicas and the client's spread (one gateway by default).
    pub(super) replicas: ReplicaSetup,
    /// A lost-events point's fault on the last replica's indexer.
    pub(super) fault: Option<FaultPlan>,
}

impl PointSpec<'_> {
    /// The same point measured over `window_s` (a load point's window).
    pub(super) fn with_window_s(&self, window_s: f64) -> Self {
        PointSpec { window: MeasureWindow { window_s, ..self.window }, ..*self }
    }

    /// The same point behind `replicas`, with `fault` (a lost-events point) or none.
    pub(super) fn behind(&self, replicas: ReplicaSetup, fault: Option<FaultPlan>) -> Self {
        PointSpec { replicas, fault, ..*self }
    }
}

pub(super) async fn measure(
    a: &SweepSettings,
    spec: &PointSpec<'_>,
    kind: WorkloadKind,
    policy: Policy,
    rate: f64,
    out: &Path,
    progress: &mut Progress,
) -> PointResult {
    progress.point += 1;
    let replicas = match (spec.replicas.dir_part(), &spec.fault) {
        (Some(part), Some(f)) => format!("/lost-{}-{part}", f.fault.name()),
        (Some(part), None) => format!("/{part}"),
        (None, _) => String::new(),
    };
    let dir_rel = format!("{}/{}{replicas}/r{:.4}", kind.name(), policy.name(), rate);
    let dir = out.join(&dir_rel);
    let schedule = Arc::new(schedule_for(a, spec.fleet, kind, rate, &spec.window));
    let warm = if spec.window.warmup_s > 0.0 {
        format!(" | warm-up {:.0} s, window {:.0} s", spec.window.warmup_s, spec.window.window_s)
    } else {
        String::new()
    };
    let behind = match spec.replicas.dir_part() {
        Some(part) => format!(" | {part}"),
        None => String::new(),
    };
    eprintln!(
        "[bench] point {} | {} | {}{behind} | {:.3} {} | {} requests planned{warm} | elapsed {}",
        progress.point,
        kind.name(),
        policy.name(),
        rate,
        kind.rate_unit(),
        schedule.requests(),
        fmt_elapsed(progress.started.elapsed())
    );
    match measure_inner(
        a,
        spec,
        kind,
        policy,
        schedule,
        &dir,
        &dir_rel,
        progress.started,
        progress.point,
    )
    .await
    {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(
                workload = kind.name(),
                policy = policy.name(),
                rate,
                error = format!("{e:#}"),
                "point did not run"
            );
            PointResult {
                workload: kind.name().into(),
                policy: policy.name().into(),
                rate,
                dir: dir_rel,
                error: Some(crate::run::one_line(&format!("{e:#}"), 300)),
                window: spec.window,
                replicas: spec.replicas,
                ..Default::default()
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn measure_inner(
    a: &SweepSettings,
    spec: &PointSpec<'_>,
    kind: WorkloadKind,
    policy: Policy,
    schedule: Arc<Schedule>,
    dir: &Path,
    dir_rel: &str,
    started: Instant,
    point: usize,
) -> Result<PointResult> {
    let (fleet, window) = (spec.fleet, spec.window);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let Prepared { stack, worker_ids, client, base: _, model } =
        prepare_stack(policy, fleet, dir).await?;
    let replicas = start_replicas(&stack, spec.replicas.count, dir, fleet.start_attempts).await?;
    let mut gateways = vec![stack];
    gateways.extend(replicas);
    let header =
        (policy.uses_session_header() && kind.has_sessions()).then(|| fleet.session_header.clone());
    let kvmesh = policy.is_kvmesh();
    let before = scrape_gateways(&gateways, &client, kvmesh).await?;
    let pids: Vec<u32> =
        gateways[0].workers.iter().filter_map(|w| w.proc.as_ref().map(|p| p.pid())).collect();
    // Simulators: one process each. Real engines: every process of each engine's group.
    let ticks = |pids: &[u32]| {
        if fleet.engine_groups.is_empty() {
            pids.iter().map(|&p| cpu_ticks(p)).sum::<Option<u64>>()
        } else {
            group_ticks(&fleet.engine_groups)
        }
    };
    let ticks_before = ticks(&pids);
    let results = dir.join("results.jsonl");
    let sink = Sink::create(&results, 1_000_000)?;
    let done = Arc::new(AtomicU64::new(0));
    let total = schedule.requests();
    let pol = match spec.replicas.dir_part() {
        Some(part) => format!("{} | {part}", policy.name()),
        None => policy.name().to_owned(),
    };
    let (d, p_start, name, rate, unit) =
        (done.clone(), Instant::now(), kind.name(), schedule.rate, kind.rate_unit());
    let ticker = tokio::spawn(async move {
        loop {
            tokio::time::sleep(PROGRESS_EVERY).await;
            eprintln!(
                "[bench] point {point} | {name} | {pol} | {rate:.3} {unit} | {}/{total} requests | point {} | elapsed {}",
                d.load(Ordering::Relaxed),
                fmt_elapsed(p_start.elapsed()),
                fmt_elapsed(started.elapsed())
            );
        }
    });
    let cfg = ScheduleRunConfig {
        gateways: gateways.iter().map(|g| g.gateway("")).collect(),
        spread: spec.replicas.spread,
        model,
        session_header: header,
        request_timeout: fleet.request_timeout,
        max_in_flight: a.max_in_flight,
        turn_deadline: Duration::from_secs_f64(window.turn_deadline_s()),
    };
    let run_started = Instant::now();
    // The window opens after the warm-up: the engines' counters, the machine's CPU and the
    // simulators' ticks are taken from there (immediately when there is no warm-up). No turn is
    // due after the window's end, so the scrape after the run closes it.
    // A lost-events point's fault comes after the window opened (its scrape is taken first).
    let side = async {
        let opened = if window.has_warmup() {
            tokio::time::sleep_until(
                tokio::time::Instant::from_std(run_started)
                    + Duration::from_secs_f64(window.warmup_s),
            )
            .await;
            let opened = Instant::now();
            let scrape = scrape_gateways(&gateways, &client, kvmesh).await;
            (Some(scrape), Sampler::start(CPU_SAMPLE_EVERY), ticks(&pids), opened)
        } else {
            (None, Sampler::start(CPU_SAMPLE_EVERY), ticks_before, run_started)
        };
        let fault = match (spec.fault, gateways.last_mut()) {
            (Some(plan), Some(faulted)) => {
                let at = Duration::from_secs_f64(window.warmup_s + plan.at_s);
                Some((plan, inject(faulted, plan, run_started, at).await))
            }
            _ => None,
        };
        (opened, fault)
    };
    let (stats, ((at_window, sampler, ticks_before, opened), fault)) = tokio::join!(
        run_schedule(client.clone(), cfg, schedule.clone(), sink.sender(), done),
        side
    );
    let (cpu_mean, cpu_max) = sampler.finish();
    let run_wall_s = opened.elapsed().as_secs_f64();
    ticker.abort();
    let ticks_after = ticks(&pids);
    let sunk = sink.close().await?;
    let fault = match fault {
        Some((plan, injected)) => {
            let (times, before) = injected.context("injecting the lost-events fault")?;
            let faulted = gateways.last().context("no gateway")?;
            Some((plan, times, counters_since(faulted, plan.fault, before).await))
        }
        None => None,
    };
    let after = scrape_gateways(&gateways, &client, kvmesh).await?;
    let before = match at_window {
        Some(scrape) => scrape.context("scraping the counters at the window's start")?,
        None => before,
    };
    let stack = &gateways[0];
    let c = counters(stack, &before, &after, kvmesh);
    // Several models: each base model's workers, read from the stack that ran them.
    let model_workers: Vec<(String, Vec<String>)> = fleet
        .multi
        .iter()
        .flat_map(|m| &m.models)
        .map(|m| (m.name.clone(), stack.workers_of(&m.name).iter().map(|w| w.id.clone()).collect()))
        .collect();
    drop(gateways);
    std::fs::write(dir.join("counters.json"), serde_json::to_string_pretty(&c)?)?;
    let all_records = read_all(std::io::BufReader::new(std::fs::File::open(&results)?))?;
    let (records, warmup_requests) = window_records(&all_records, &window);
    let (ceiling_rate, ceiling, skipped) =
        point_ceiling(&schedule, &all_records, &window, fleet.block_size as usize);
    if skipped > 0 {
        tracing::warn!(skipped, "records naming no planned turn left out of the ceiling");
    }
    let machine = MachineSample {
        cpu_busy_mean: cpu_mean,
        cpu_busy_max: cpu_max,
        sim_cpu_s: cpu_s_between(ticks_before, ticks_after),
    };
    let mut p = summarize_point(
        kind.name(),
        policy.name(),
        schedule.rate,
        dir_rel,
        &records,
        Some(&c),
        Some((ceiling_rate, ceiling)),
        machine,
        &worker_ids,
    )
    .with_window(window, warmup_requests, stats.cut_turns);
    p.replicas = spec.replicas;
    if let Some((plan, times, indexer)) = fault {
        // The replica each record went to, by the rule the client used.
        let position: std::collections::HashMap<&str, usize> =
            schedule.sessions.iter().enumerate().map(|(i, s)| (s.id.as_str(), i)).collect();
        let replica_of: Vec<usize> = all_records
            .iter()
            .map(|r| {
                let pos = r.session.as_deref().and_then(|s| position.get(s)).copied().unwrap_or(0);
                replica_for(spec.replicas.spread, pos, r.index, spec.replicas.count)
            })
            .collect();
        let from_ms = window.warmup_s * 1000.0;
        let mut lost = recovery(
            plan.fault,
            &all_records,
            &replica_of,
            spec.replicas.count - 1,
            times,
            from_ms,
            from_ms + window.window_s * 1000.0,
            plan.bin_s * 1000.0,
        );
        lost.indexer = indexer;
        if plan.fault == Fault::Restart {
            // The restarted indexer's counters began again at 0: its attribution delta is not one.
            p.attribution = None;
        }
        p.lost_events = Some(lost);
    }
    if !model_workers.is_empty() {
        let block_size = fleet.block_size as usize;
        let shares: Vec<FleetModelShare> = model_workers
            .into_iter()
            .map(|(model, workers)| {
                // Models share no prefix: a model's ceiling is its own sessions' (the records of
                // the others name sessions outside them and are left out).
                let own = models::model_schedule(&schedule, &model, block_size);
                let (rate, _, _) = point_ceiling(&own, &all_records, &window, block_size);
                FleetModelShare { model, workers, ceiling: Some(rate) }
            })
            .collect();
        p.per_model = model_points(&records, Some(&c), &shares, models::base_of);
        // Every request sent counts here, the warm-up's too: none may reach a wrong worker.
        p.cross_model = Some(all_records.iter().filter(|r| cross_model(r)).count());
    }
    if let Some(t) = &spec.sim_timing {
        // Real engines size their own caches and prefill at their own speed; the simulators have
        // exactly `num_gpu_blocks` and the modelled throughput.
        let capacity_tokens =
            fleet.workers as u64 * fleet.num_gpu_blocks * u64::from(fleet.block_size);
        let block_size = fleet.block_size as usize;
        p.fleet_lru =
            point_fleet_lru(&schedule, &all_records, &window, block_size, capacity_tokens);
        p.ttft_floor_p90_ms =
            point_ttft_floor_p90_ms(&schedule, &all_records, &window, block_size, t);
    }
    if !fleet.engine_groups.is_empty() {
        // The engines are the CPU load here: bound everything else instead (see the lib's rule).
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        p.invalid = invalid_reasons_real_engines(
            cpu_mean,
            machine.sim_cpu_s,
            run_wall_s,
            cores,
            p.lateness_p90_ms,
        );
        // Real vLLM names no worker in its responses, so Envoy-routed records carry none: load is
        // what each engine's counters say it was asked to prefill (prompt tokens queried), the same
        // measure for every policy.
        p.load_max_over_mean = kvmesh_bench::stats::balance(
            c.engines.iter().map(|e| (e.worker.as_str(), e.prefix_cache_queries)),
            &worker_ids,
        )
        .max_over_mean();
    }
    tracing::info!(
        workload = kind.name(),
        policy = policy.name(),
        rate = schedule.rate,
        requests = sunk.written,
        window_requests = p.requests,
        warmup_requests,
        cut_turns = stats.cut_turns,
        turns_per_s = p.turns_per_s.unwrap_or(f64::NAN),
        ceiling = ceiling_rate,
        fleet_lru = p.fleet_lru.unwrap_or(f64::NAN),
        ttft_floor_p90_ms = p.ttft_floor_p90_ms.unwrap_or(f64::NAN),
        wall_s = stats.wall.as_secs_f64(),
        ttft_p90_ms = p.ttft_p90_ms.unwrap_or(f64::NAN),
        engine_hit_rate = p.engine_hit_rate.unwrap_or(f64::NAN),
        valid = p.valid(),
        "point done"
    );
    Ok(p)
}
