//! The load sweep (issue 12): per workload, round_robin's ladder to its saturation, then every
//! policy at fractions of that rate (the load point 0.8 × included), each point on a fresh stack.
//!
//! A point: generate the workload's plan at the rate (pure, `workload`), start the policy's
//! stack, reset the caches, scrape, start the CPU sampler and read the simulators' CPU ticks, run
//! the plan (`plan_run`) while a ticker prints progress, scrape again, stop the stack, write
//! `<out>/sweep/<workload>/<policy>/r<rate>/{results.jsonl,counters.json}` and summarise it
//! (`sweep::summarize_point`). After every point `sweep.json` is rewritten, so an interrupted run
//! keeps what it measured. The decisions (next ladder rate, saturation, which rates) are the
//! pure functions of `kvmesh_bench::sweep`.

use crate::run::{counters, prepare_stack, scrape_all, Fleet, Prepared};
use anyhow::{Context, Result};
use kvmesh_bench::cpu::Sampler;
use kvmesh_bench::overhead::drive::cpu_ticks;
use kvmesh_bench::plan_run::{run_plan, PlanRunConfig};
use kvmesh_bench::policy::Policy;
use kvmesh_bench::record::read_all;
use kvmesh_bench::report::sweep::{plot_files, SweepReport, WorkloadSweep};
use kvmesh_bench::sink::Sink;
use kvmesh_bench::sweep::{
    default_start_rate, invalid_reasons_real_engines, next_ladder_rate, point_ceiling,
    point_fleet_lru, point_ttft_floor_p90_ms, policy_rates, summarize_point, timing_for,
    window_for, window_records, FleetTiming, LadderStep, MachineSample, MeasureWindow, PointResult,
    RatePoint, SweepConfig,
};
use kvmesh_bench::trace::TraceRecord;
use kvmesh_bench::workload::{gen, trace as wtrace, Plan, WorkloadKind};
use kvmesh_e2e::stack::{StackSpec, Worker};
use kvmesh_e2e::vllm::VllmOptions;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Linux user-space clock ticks per second (`/proc/<pid>/stat` units).
const TICKS_PER_S: f64 = 100.0;
/// CPU sampling interval during a point.
const CPU_SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Progress line interval.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// What the sweep runs.
pub struct SweepArgs {
    pub workloads: Vec<WorkloadKind>,
    /// Policies; round_robin is always run first (the ladder).
    pub policies: Vec<Policy>,
    pub ladder_factor: f64,
    pub ladder_max_steps: usize,
    pub fractions: Vec<f64>,
    /// Overrides the estimated first ladder rate (all workloads).
    pub start_rate: Option<f64>,
    /// The measured window of a point, s: arrivals in `[0, duration)` for the plain workloads,
    /// in `[0, warm-up + duration)` for the steady-state ones (`sweep::MeasureWindow`).
    pub duration_s: f64,
    /// `--sweep-warmup-s`: the steady-state workloads' warm-up (`None`: `sweep::default_warmup_s`).
    pub warmup_s: Option<f64>,
    /// `--sweep-load-point-window-s`: the load point's window (`None`: `duration_s`, the window the
    /// saturation search measured with, except the trace's: at least [`TRACE_LOAD_POINT_WINDOW_S`]),
    /// and when given, every `fixed_rates` point's.
    pub load_point_window_s: Option<f64>,
    pub seed: u64,
    /// `--sweep-sim-speedup` / `--sweep-prefill-tokens-per-s` for every workload; `None`: each
    /// workload's default timing (`sweep::default_timing`).
    pub sim_speedup: Option<f64>,
    pub prefill_tokens_per_s: Option<f64>,
    pub max_in_flight: usize,
    pub trace_records: Vec<TraceRecord>,
    /// Rates every policy runs at (`--sweep-rates`): non-empty skips the ladder.
    pub fixed_rates: Vec<f64>,
    /// Real vLLM engines, started once for the whole sweep (`--engines vllm`); `None`: vllm-sim.
    pub vllm: Option<VllmOptions>,
    pub trace_cfg: wtrace::TraceConfig,
    pub settings: Vec<String>,
}

/// The trace's load point runs at least this long, s. Its prompt sizes are heavy-tailed (mean 12k,
/// max 126k tokens): a 20-s window at its load point holds ~80 requests, and load max/mean is then
/// mostly which window was drawn (over random 81-request windows of the trace, round robin's median
/// is 1.27 and even least-tokens-first placement's p90 1.18; over 240 requests 1.15 and 1.06). The
/// longer window replays proportionally more trace time (`plan_for`), so the traffic is the
/// ladder's: measured 2026-12-02 at the 20-s ladder's load point (3.50 requests/s), round_robin's
/// TTFT p90 was 2.59 s over 60 s against 2.50 s over 20 s. (Without that scaling, 60 s replaying
/// the ladder's 300 s of trace, it was 9.6 s: a third of the compression, another workload.)
pub const TRACE_LOAD_POINT_WINDOW_S: f64 = 60.0;

fn plan_for(
    a: &SweepArgs,
    fleet: &Fleet,
    kind: WorkloadKind,
    rate: f64,
    window: &MeasureWindow,
) -> Plan {
    let g = gen::GenConfig {
        seed: a.seed,
        duration_s: window.arrivals_s(),
        think_divisor: fleet.sim_speedup,
        block_size: fleet.block_size as usize,
    };
    match kind {
        // A longer window replays proportionally more trace time: the ladder's compression, so the
        // load point is 0.8 × the saturation rate of the same traffic.
        WorkloadKind::Trace => wtrace::plan(
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
    }
}

/// Progress shared with the ticker.
struct Progress {
    started: Instant,
    point: usize,
}

fn fmt_elapsed(d: Duration) -> String {
    let s = d.as_secs();
    format!("{}m{:02}s", s / 60, s % 60)
}

/// One workload's point settings: its fleet, its window and the simulators' timing (`None` on
/// real engines, which keep their own).
struct PointSpec<'a> {
    fleet: &'a Fleet,
    window: MeasureWindow,
    sim_timing: Option<FleetTiming>,
}

impl PointSpec<'_> {
    /// The same point measured over `window_s` (a load point's window).
    fn with_window_s(&self, window_s: f64) -> Self {
        PointSpec { window: MeasureWindow { window_s, ..self.window }, ..*self }
    }
}

async fn measure(
    a: &SweepArgs,
    spec: &PointSpec<'_>,
    kind: WorkloadKind,
    policy: Policy,
    rate: f64,
    out: &Path,
    progress: &mut Progress,
) -> PointResult {
    progress.point += 1;
    let dir_rel = format!("{}/{}/r{:.4}", kind.name(), policy.name(), rate);
    let dir = out.join(&dir_rel);
    let plan = Arc::new(plan_for(a, spec.fleet, kind, rate, &spec.window));
    let warm = if spec.window.warmup_s > 0.0 {
        format!(" | warm-up {:.0} s, window {:.0} s", spec.window.warmup_s, spec.window.window_s)
    } else {
        String::new()
    };
    eprintln!(
        "[bench] point {} | {} | {} | {:.3} {} | {} requests planned{warm} | elapsed {}",
        progress.point,
        kind.name(),
        policy.name(),
        rate,
        kind.rate_unit(),
        plan.requests(),
        fmt_elapsed(progress.started.elapsed())
    );
    match measure_inner(
        a,
        spec,
        kind,
        policy,
        plan,
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
                ..Default::default()
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn measure_inner(
    a: &SweepArgs,
    spec: &PointSpec<'_>,
    kind: WorkloadKind,
    policy: Policy,
    plan: Arc<Plan>,
    dir: &Path,
    dir_rel: &str,
    started: Instant,
    point: usize,
) -> Result<PointResult> {
    let (fleet, window) = (spec.fleet, spec.window);
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let Prepared { stack, worker_ids, client, base, model } =
        prepare_stack(policy, fleet, dir).await?;
    let header =
        (policy.uses_session_header() && kind.has_sessions()).then(|| fleet.session_header.clone());
    let before = scrape_all(&stack, &client, policy.is_kvmesh()).await?;
    let pids: Vec<u32> =
        stack.workers.iter().filter_map(|w| w.proc.as_ref().map(|p| p.pid())).collect();
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
    let total = plan.requests();
    let (d, p_start, name, pol, rate, unit) =
        (done.clone(), Instant::now(), kind.name(), policy.name(), plan.rate, kind.rate_unit());
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
    let cfg = PlanRunConfig {
        base_url: base,
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
    let window_open = async {
        if !window.has_warmup() {
            return (None, Sampler::start(CPU_SAMPLE_EVERY), ticks_before, run_started);
        }
        tokio::time::sleep_until(
            tokio::time::Instant::from_std(run_started) + Duration::from_secs_f64(window.warmup_s),
        )
        .await;
        let opened = Instant::now();
        let scrape = scrape_all(&stack, &client, policy.is_kvmesh()).await;
        (Some(scrape), Sampler::start(CPU_SAMPLE_EVERY), ticks(&pids), opened)
    };
    let (stats, (at_window, sampler, ticks_before, opened)) =
        tokio::join!(run_plan(client.clone(), cfg, plan.clone(), sink.sender(), done), window_open);
    let (cpu_mean, cpu_max) = sampler.finish();
    let run_wall_s = opened.elapsed().as_secs_f64();
    ticker.abort();
    let ticks_after = ticks(&pids);
    let sunk = sink.close().await?;
    let after = scrape_all(&stack, &client, policy.is_kvmesh()).await?;
    let before = match at_window {
        Some(scrape) => scrape.context("scraping the counters at the window's start")?,
        None => before,
    };
    let c = counters(&stack, &before, &after, policy.is_kvmesh());
    drop(stack);
    std::fs::write(dir.join("counters.json"), serde_json::to_string_pretty(&c)?)?;
    let all_records = read_all(std::io::BufReader::new(std::fs::File::open(&results)?))?;
    let (records, warmup_requests) = window_records(&all_records, &window);
    let (ceiling_rate, ceiling, skipped) =
        point_ceiling(&plan, &all_records, &window, fleet.block_size as usize);
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
        plan.rate,
        dir_rel,
        &records,
        Some(&c),
        Some((ceiling_rate, ceiling)),
        machine,
        &worker_ids,
    )
    .with_window(window, warmup_requests, stats.cut_turns);
    if let Some(t) = &spec.sim_timing {
        // Real engines size their own caches and prefill at their own speed; the simulators have
        // exactly `num_gpu_blocks` and the modelled throughput.
        let capacity_tokens =
            fleet.workers as u64 * fleet.num_gpu_blocks * u64::from(fleet.block_size);
        let block_size = fleet.block_size as usize;
        p.fleet_lru = point_fleet_lru(&plan, &all_records, &window, block_size, capacity_tokens);
        p.ttft_floor_p90_ms = point_ttft_floor_p90_ms(&plan, &all_records, &window, block_size, t);
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
        rate = plan.rate,
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

/// The fleet of one workload's simulated points: its timing's vllm-sim flags before the shared
/// extra flags (`--sim-arg`; one that sets `--max-num-batched-tokens` itself wins).
pub(crate) fn workload_fleet(base: &Fleet, t: &FleetTiming) -> Fleet {
    let mut sim_args =
        vec!["--prefill-tokens-per-s".to_string(), t.prefill_tokens_per_s.to_string()];
    if !base.sim_args.iter().any(|a| a.starts_with("--max-num-batched-tokens")) {
        sim_args
            .extend(["--max-num-batched-tokens".to_string(), t.max_num_batched_tokens.to_string()]);
    }
    sim_args.extend(base.sim_args.iter().cloned());
    Fleet { sim_speedup: t.sim_speedup, sim_args, ..base.clone() }
}

fn save(report: &SweepReport, out: &Path) -> Result<()> {
    let path = out.join("sweep.json");
    std::fs::write(&path, serde_json::to_string_pretty(report)?)
        .with_context(|| format!("writing {}", path.display()))
}

/// Starts `fleet.workers` real vLLM engines (logs in `dir`) and points `fleet` at them: every
/// stack started from it runs over them as external engines, and their process groups are the
/// engines' CPU. They stop when the returned workers are dropped.
pub(crate) async fn start_real_engines(
    fleet: &mut Fleet,
    opts: &VllmOptions,
    dir: &Path,
) -> Result<Vec<Worker>> {
    std::fs::create_dir_all(dir)?;
    let specs = StackSpec::aggregate(fleet.workers).workers;
    eprintln!("[bench] starting {} real vLLM engines (logs in {})", specs.len(), dir.display());
    let started = Instant::now();
    let engines = kvmesh_e2e::vllm::start_workers(&specs, opts, fleet.block_size, dir).await?;
    eprintln!("[bench] engines healthy after {}", fmt_elapsed(started.elapsed()));
    fleet.external = engines.iter().map(Worker::external_spec).collect();
    fleet.engine_groups = engines.iter().filter_map(|w| w.proc.as_ref().map(|p| p.pid())).collect();
    Ok(engines)
}

/// Runs the sweep into `<out>/sweep/` and returns its report.
pub async fn run_sweep(a: &SweepArgs, fleet: &Fleet, out: &Path) -> Result<SweepReport> {
    let out = out.join("sweep");
    std::fs::create_dir_all(&out)?;
    // Real engines start once (a minute each) and live until the sweep returns; every point's
    // stack runs over them as external engines, caches reset by `prepare_stack`.
    let mut fleet = fleet.clone();
    let _engines = match &a.vllm {
        None => Vec::new(),
        Some(opts) => start_real_engines(&mut fleet, opts, &out.join("engines")).await?,
    };
    let shared_fleet = fleet;
    let mut report = SweepReport { settings: a.settings.clone(), workloads: Vec::new() };
    let mut progress = Progress { started: Instant::now(), point: 0 };
    for &kind in &a.workloads {
        // Real engines keep their own timing (and think times run at wall-clock speed).
        let timing =
            timing_for(kind, a.sim_speedup, a.prefill_tokens_per_s).map_err(anyhow::Error::msg)?;
        let (fleet, fleet_note) = if a.vllm.is_some() {
            (shared_fleet.clone(), String::new())
        } else {
            (workload_fleet(&shared_fleet, &timing), timing.describe())
        };
        let window = window_for(kind, &timing, a.seed, a.duration_s, a.warmup_s, a.vllm.is_some());
        let spec =
            PointSpec { fleet: &fleet, window, sim_timing: a.vllm.is_none().then_some(timing) };
        let fleet = &fleet;
        let start_rate =
            a.start_rate.unwrap_or_else(|| default_start_rate(kind, &timing, fleet.workers));
        let cfg = SweepConfig {
            start_rate,
            factor: a.ladder_factor,
            max_steps: a.ladder_max_steps,
            fractions: a.fractions.clone(),
        };
        cfg.validate().map_err(anyhow::Error::msg)?;
        report.workloads.push(WorkloadSweep {
            workload: kind.name().into(),
            describe: kind.describe().into(),
            rate_unit: kind.rate_unit().into(),
            fleet: fleet_note,
            window,
            ..Default::default()
        });
        let wi = report.workloads.len() - 1;
        if !a.fixed_rates.is_empty() {
            report.workloads[wi].note = format!(
                "fixed rates {:?} (`--sweep-rates`): no ladder, no saturation search, no load point",
                a.fixed_rates
            );
            // `--sweep-load-point-window-s` with fixed rates: measure them as a load point, so
            // one `make bench` point can be re-run alone (same compression, same window).
            let fixed_spec = spec.with_window_s(a.load_point_window_s.unwrap_or(window.window_s));
            for &policy in &a.policies {
                if !kind.has_sessions()
                    && policy.uses_session_header()
                    && policy != Policy::RoundRobin
                {
                    continue;
                }
                for &rate in &a.fixed_rates {
                    let p = measure(a, &fixed_spec, kind, policy, rate, &out, &mut progress).await;
                    report.workloads[wi].points.push(p);
                    save(&report, &out)?;
                }
            }
            continue;
        }
        // 1. round_robin's ladder.
        let mut rr: Vec<RatePoint> = Vec::new();
        let sat = loop {
            match next_ladder_rate(&cfg, &rr) {
                LadderStep::Measure(rate) => {
                    let p = measure(a, &spec, kind, Policy::RoundRobin, rate, &out, &mut progress)
                        .await;
                    rr.push(RatePoint {
                        rate,
                        p90_ms: p.ttft_p90_ms.filter(|_| p.error.is_none()),
                        valid: p.valid(),
                    });
                    report.workloads[wi].points.push(p);
                    save(&report, &out)?;
                }
                LadderStep::Saturated(s) => break Some(s),
                LadderStep::GaveUp => break None,
            }
        };
        report.workloads[wi].saturation = sat;
        // 2. Every policy at the fractions of the saturation rate (or, without one, the ladder's rates).
        let rates = match &sat {
            Some(s) => policy_rates(&cfg, s),
            None => {
                report.workloads[wi].note = format!(
                    "round_robin's TTFT p90 stayed under 3 × its light-load value over {} ladder steps",
                    rr.len()
                );
                rr.iter().map(|p| p.rate).collect()
            }
        };
        // The headline's point: the sweep's window (the trace's at least TRACE_LOAD_POINT_WINDOW_S)
        // unless `--sweep-load-point-window-s` sets one.
        let load_point = sat.map(|s| s.load_point());
        let default_window_s = match kind {
            WorkloadKind::Trace => a.duration_s.max(TRACE_LOAD_POINT_WINDOW_S),
            _ => a.duration_s,
        };
        let load_point_spec = spec.with_window_s(a.load_point_window_s.unwrap_or(default_window_s));
        for &policy in &a.policies {
            if !kind.has_sessions() && policy.uses_session_header() && policy != Policy::RoundRobin
            {
                continue; // nothing to hash / no explicit session on this workload
            }
            let already: Vec<f64> = if policy == Policy::RoundRobin {
                rr.iter().map(|p| p.rate).collect()
            } else {
                Vec::new()
            };
            let mut todo: Vec<f64> = rates
                .iter()
                .copied()
                .filter(|r| !already.iter().any(|x| (x - r).abs() <= 1e-9 * r))
                .collect();
            if policy == Policy::RoundRobin && sat.is_some() {
                // The ladder already covers light load to past saturation; add the load point and,
                // if fewer than 4 rates in all, the other fractions.
                let lp = sat.map(|s| s.load_point()).unwrap_or_default();
                if already.len() + 1 >= 4 {
                    todo.retain(|r| (r - lp).abs() <= 1e-9 * lp);
                }
            }
            for rate in todo {
                let at_load_point = load_point.is_some_and(|lp| (rate - lp).abs() <= 1e-9 * lp);
                let spec = if at_load_point { &load_point_spec } else { &spec };
                let p = measure(a, spec, kind, policy, rate, &out, &mut progress).await;
                report.workloads[wi].points.push(p);
                save(&report, &out)?;
            }
        }
    }
    Ok(report)
}

/// CPU seconds between two tick readings (`None` when either is missing).
pub(crate) fn cpu_s_between(before: Option<u64>, after: Option<u64>) -> Option<f64> {
    Some(after?.saturating_sub(before?) as f64 / TICKS_PER_S)
}

/// User + system CPU ticks of every process whose process group is one of `groups` (`/proc`).
pub(crate) fn group_ticks(groups: &[u32]) -> Option<u64> {
    let mut total = 0u64;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(text) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((pgrp, ticks)) = parse_pid_stat(&text) {
            if groups.contains(&pgrp) {
                total += ticks;
            }
        }
    }
    Some(total)
}

/// `(process group, utime + stime)` of one `/proc/<pid>/stat` line (pure). The command name in
/// parentheses may hold spaces and parentheses, so fields are counted after the last `)`.
fn parse_pid_stat(text: &str) -> Option<(u32, u64)> {
    let rest = &text[text.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(3) ppid(4) pgrp(5) … utime(14) stime(15), 1-based over the whole line.
    let pgrp = f.get(2)?.parse().ok()?;
    let utime: u64 = f.get(11)?.parse().ok()?;
    let stime: u64 = f.get(12)?.parse().ok()?;
    Some((pgrp, utime + stime))
}

/// Draws the sweep's plots into `out` (TTFT p90 vs rate, engine hit rate vs rate, per workload);
/// returns the files written or why not.
pub fn draw(report: &SweepReport, out: &Path) -> Result<Vec<std::path::PathBuf>, String> {
    use kvmesh_bench::report::plots::{vs_rate, RateSeries};
    let mut written = Vec::new();
    for w in &report.workloads {
        let series = |value: &dyn Fn(&PointResult) -> Option<f64>| -> Vec<RateSeries> {
            w.policies()
                .into_iter()
                .map(|pol| RateSeries {
                    points: w
                        .points
                        .iter()
                        .filter(|p| p.policy == pol)
                        .filter_map(|p| value(p).map(|v| (p.rate, v, p.valid())))
                        .collect(),
                    label: pol,
                })
                .filter(|s| !s.points.is_empty())
                .collect()
        };
        let (ttft, hit) = plot_files(&w.workload);
        let x = format!("offered rate ({})", w.rate_unit);
        let t = out.join(&ttft);
        vs_rate(
            &t,
            &format!("{}: TTFT p90 vs rate (hollow = invalid point)", w.workload),
            &x,
            "TTFT p90 (ms)",
            &series(&|p| p.ttft_p90_ms),
            false,
            None,
        )
        .map_err(|e| e.to_string())?;
        written.push(t);
        let ceiling = w.points.iter().filter_map(|p| p.ceiling).reduce(f64::max);
        let h = out.join(&hit);
        vs_rate(
            &h,
            &format!("{}: engine hit rate (counters) vs rate", w.workload),
            &x,
            "engine hit rate",
            &series(&|p| p.engine_hit_rate),
            false,
            ceiling.map(|c| (c, "ceiling (largest over points)")),
        )
        .map_err(|e| e.to_string())?;
        written.push(h);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::parse_pid_stat;

    #[test]
    fn pid_stat_lines() {
        let line =
            "31657 (python) S 1 31657 31657 0 -1 4194560 9000 0 0 0 1234 56 0 0 39 19 20 0 1 0";
        assert_eq!(parse_pid_stat(line), Some((31657, 1290)));
        let odd = "26274 (VLLM::Engine (core) x) R 31657 31657 31657 0 -1 0 0 0 0 0 7 3 0 0 39 19 1 0 1 0";
        assert_eq!(parse_pid_stat(odd), Some((31657, 10)));
        for bad in ["", "12 (x)", "12 (x) S 1 abc 1 0 -1 0 0 0 0 0 1 2", "no paren S 1 2 3"] {
            assert_eq!(parse_pid_stat(bad), None, "{bad:?}");
        }
    }
}
