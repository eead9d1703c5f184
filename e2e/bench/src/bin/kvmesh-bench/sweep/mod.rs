//! The load sweep (issue 12): per workload, round_robin's ladder to its saturation, then every
//! policy at fractions of that rate (the load point 0.8 × included), each point on a fresh stack.
//!
//! A point: generate the workload's schedule at the rate (pure, `workload`), start the policy's
//! stack, reset the caches, scrape, start the CPU sampler and read the simulators' CPU ticks, run
//! the schedule (`schedule_run`) while a ticker prints progress, scrape again, stop the stack, write
//! `<out>/sweep/<workload>/<policy>/r<rate>/{results.jsonl,counters.json}` and summarise it
//! (`sweep::summarize_point`). After every point `sweep.json` is rewritten, so an interrupted run
//! keeps what it measured. The decisions (next ladder rate, saturation, which rates) are the
//! pure functions of `kvmesh_bench::sweep`.
//!
//! Gateway replicas (issue 47): with `--replicas` naming counts above 1, after a workload's points
//! every policy is measured again behind each such count of gateway replicas, per spread, at the
//! load point (or at each `--rates` rate) — the replica curve, `WorkloadSweep::replica_points`.
//! `--lose-events` runs lost-events points instead of the sweep (`curve.rs`).

pub mod command;
mod curve;
mod point;
mod replica;

use point::{fmt_elapsed, measure, PointSpec, Progress};

use crate::run::{Fleet, MultiModel};
use anyhow::{Context, Result};
use kvmesh_bench::policy::Policy;
use kvmesh_bench::report::sweep::{plot_files, SweepReport, WorkloadSweep};
use kvmesh_bench::sweep::replicas::{ReplicaSetup, Spread};
use kvmesh_bench::sweep::{
    default_start_rate, next_ladder_rate, policy_rates, timing_for, window_for, FleetTiming,
    LadderStep, PointResult, RatePoint, SweepConfig,
};
use kvmesh_bench::trace::TraceRecord;
use kvmesh_bench::workload::models::MODEL_MIX;
use kvmesh_bench::workload::tiers;
use kvmesh_bench::workload::{trace as wtrace, WorkloadKind};
use kvmesh_e2e::stack::{ModelSpec, StackSpec, Worker};
use kvmesh_e2e::vllm::VllmOptions;
use replica::FaultPlan;
use std::path::Path;
use std::time::{Duration, Instant};

/// Linux user-space clock ticks per second (`/proc/<pid>/stat` units).
const TICKS_PER_S: f64 = 100.0;
/// CPU sampling interval during a point.
const CPU_SAMPLE_EVERY: Duration = Duration::from_millis(500);
/// Progress line interval.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// What the sweep runs.
pub struct SweepSettings {
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
    /// `--warmup-s`: the steady-state workloads' warm-up (`None`: `sweep::default_warmup_s`).
    pub warmup_s: Option<f64>,
    /// `--load-point-window-s`: the load point's window (`None`: `duration_s`, the window the
    /// saturation search measured with, except the trace's: at least [`TRACE_LOAD_POINT_WINDOW_S`]),
    /// and when given, every `fixed_rates` point's.
    pub load_point_window_s: Option<f64>,
    pub seed: u64,
    /// `--sim-speedup` / `--prefill-tokens-per-s` for every workload; `None`: each
    /// workload's default timing (`sweep::default_timing`).
    pub sim_speedup: Option<f64>,
    pub prefill_tokens_per_s: Option<f64>,
    pub max_in_flight: usize,
    pub trace_records: Vec<TraceRecord>,
    /// Rates every policy runs at (`--rates`): non-empty skips the ladder.
    pub fixed_rates: Vec<f64>,
    /// Real vLLM engines, started once for the whole sweep (`--engines vllm`); `None`: vllm-sim.
    pub vllm: Option<VllmOptions>,
    pub trace_cfg: wtrace::TraceConfig,
    pub settings: Vec<String>,
    /// `--replicas`: gateway replica counts; counts above 1 add the replica curve.
    pub replicas: Vec<usize>,
    /// `--replica-spread`: how the client spreads requests over replicas.
    pub spreads: Vec<Spread>,
    /// `--lose-events`: lost-events points instead of the sweep (faults, each its own points).
    pub lose_events: Vec<FaultPlan>,
}

/// The trace's load point runs at least this long, s. Its prompt sizes are heavy-tailed (mean 12k,
/// max 126k tokens): a 20-s window at its load point holds ~80 requests, and load max/mean is then
/// mostly which window was drawn (over random 81-request windows of the trace, round robin's median
/// is 1.27 and even least-tokens-first placement's p90 1.18; over 240 requests 1.15 and 1.06). The
/// longer window replays proportionally more trace time (`schedule_for`), so the traffic is the
/// ladder's: measured 2026-12-02 at the 20-s ladder's load point (3.50 requests/s), round_robin's
/// TTFT p90 was 2.59 s over 60 s against 2.50 s over 20 s. (Without that scaling, 60 s replaying
/// the ladder's 300 s of trace, it was 9.6 s: a third of the compression, another workload.)
pub const TRACE_LOAD_POINT_WINDOW_S: f64 = 60.0;

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

/// Adapter slots of each simulator of the `models` fleet (`--max-loras`): fewer than the most
/// names a base model serves (4), so a policy that scatters a model's adapters pays swaps.
pub(crate) const MODELS_MAX_LORAS: u32 = 2;

/// The `models` fleet's `--lora-load-ms` (the simulator's default; modelled time).
pub(crate) const MODELS_LORA_LOAD_MS: f64 = 20.0;

/// The several models of the `models` workload's fleet (`workload::models::MODEL_MIX`), each at
/// the fleet's block size with its adapters and [`MODELS_MAX_LORAS`] slots.
pub(crate) fn models_multi(block_size: u32) -> MultiModel {
    let models = MODEL_MIX
        .iter()
        .map(|b| ModelSpec {
            max_loras: Some(MODELS_MAX_LORAS),
            ..ModelSpec::new(b.name, block_size).adapters(b.adapters)
        })
        .collect();
    MultiModel { models, lora_load_ms: MODELS_LORA_LOAD_MS }
}

/// The fleet of `kind`'s points: several models for the `models` workload (`workers` split
/// between them), a small GPU cache with a CPU offload tier for `tiers`, else `fleet` unchanged.
/// Real engines serve one model and are started without a tier: refused for both.
pub(crate) fn fleet_for_kind(fleet: Fleet, kind: WorkloadKind) -> Result<Fleet> {
    if kind == WorkloadKind::Tiers {
        if !fleet.external.is_empty() {
            anyhow::bail!("the tiers workload runs on simulators only (--engines sim)");
        }
        let mut sim_args = fleet.sim_args.clone();
        sim_args.extend(tiers::sim_args());
        return Ok(Fleet { num_gpu_blocks: tiers::GPU_BLOCKS, sim_args, ..fleet });
    }
    if kind != WorkloadKind::Models {
        return Ok(fleet);
    }
    if !fleet.external.is_empty() {
        anyhow::bail!("the models workload runs on simulators only (--engines sim)");
    }
    let multi = models_multi(fleet.block_size);
    if fleet.workers < multi.models.len() {
        anyhow::bail!(
            "the models workload needs at least {} workers (one per base model), got {}",
            multi.models.len(),
            fleet.workers
        );
    }
    let workers = multi.per_model(fleet.workers) * multi.models.len();
    Ok(Fleet { workers, multi: Some(multi), ..fleet })
}

/// Whether `policy` runs on `kind`: the policies that hash or read the session header need a
/// workload with sessions (nothing to hash otherwise); round_robin always runs (the ladder).
fn runs_on(kind: WorkloadKind, policy: Policy) -> bool {
    kind.has_sessions() || !policy.uses_session_header() || policy == Policy::RoundRobin
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
pub async fn run_sweep(a: &SweepSettings, fleet: &Fleet, out: &Path) -> Result<SweepReport> {
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
        let fleet = fleet_for_kind(fleet, kind)?;
        let fleet_note = match &fleet.multi {
            Some(m) => format!(
                "{fleet_note}; {} workers per base model, --max-loras {MODELS_MAX_LORAS}, --lora-load-ms {}",
                m.per_model(fleet.workers),
                m.lora_load_ms
            ),
            None if kind == WorkloadKind::Tiers => format!(
                "{fleet_note}; --num-gpu-blocks {} --cpu-offload-blocks {} --cpu-load-tokens-per-s {} (routing.kv_tiers as configured: KVMESH_ROUTING_KV_TIERS=false for kvmesh without tiers)",
                fleet.num_gpu_blocks,
                tiers::CPU_BLOCKS,
                tiers::CPU_LOAD_TOKENS_PER_S
            ),
            None => fleet_note,
        };
        let window = window_for(kind, &timing, a.seed, a.duration_s, a.warmup_s, a.vllm.is_some());
        let spec = PointSpec {
            fleet: &fleet,
            window,
            sim_timing: a.vllm.is_none().then_some(timing),
            replicas: ReplicaSetup::default(),
            fault: None,
        };
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
        if !a.lose_events.is_empty() {
            report.workloads[wi].note =
                "lost-events points only (`--lose-events`): no ladder, no one-gateway point".into();
            let spec = spec.with_window_s(a.load_point_window_s.unwrap_or(window.window_s));
            curve::run_lost_events(a, &spec, kind, &out, &mut progress, &mut report, wi).await?;
            continue;
        }
        if !a.fixed_rates.is_empty() {
            report.workloads[wi].note = format!(
                "fixed rates {:?} (`--rates`): no ladder, no saturation search, no load point",
                a.fixed_rates
            );
            // `--load-point-window-s` with fixed rates: measure them as a load point, so
            // one `make bench` point can be re-run alone (same compression, same window).
            let fixed_spec = spec.with_window_s(a.load_point_window_s.unwrap_or(window.window_s));
            for &policy in a.policies.iter().filter(|&&p| runs_on(kind, p)) {
                for &rate in &a.fixed_rates {
                    let p = measure(a, &fixed_spec, kind, policy, rate, &out, &mut progress).await;
                    report.workloads[wi].points.push(p);
                    save(&report, &out)?;
                }
            }
            let rates = a.fixed_rates.clone();
            curve::run_replica_curve(
                a,
                &fixed_spec,
                kind,
                &rates,
                &out,
                &mut progress,
                &mut report,
                wi,
            )
            .await?;
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
        // unless `--load-point-window-s` sets one.
        let load_point = sat.map(|s| s.load_point());
        let default_window_s = match kind {
            WorkloadKind::Trace => a.duration_s.max(TRACE_LOAD_POINT_WINDOW_S),
            _ => a.duration_s,
        };
        let load_point_spec = spec.with_window_s(a.load_point_window_s.unwrap_or(default_window_s));
        for &policy in a.policies.iter().filter(|&&p| runs_on(kind, p)) {
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
        // 3. The replica curve at the load point.
        match load_point {
            Some(lp) => {
                curve::run_replica_curve(
                    a,
                    &load_point_spec,
                    kind,
                    &[lp],
                    &out,
                    &mut progress,
                    &mut report,
                    wi,
                )
                .await?
            }
            None if a.replicas.iter().any(|&n| n > 1) => {
                report.workloads[wi].note.push_str("; no load point, so no replica curve");
            }
            None => {}
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
        if w.replica_points.iter().any(|p| p.lost_events.is_none()) {
            written.extend(curve::draw_replicas(w, out)?);
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::run::spec_for;
    use kvmesh_bench::policy::SessionHeaderMode;

    fn fleet(workers: usize) -> Fleet {
        Fleet {
            workers,
            block_size: 16,
            num_gpu_blocks: 1000,
            sim_speedup: 4.0,
            sim_args: vec!["--x".into()],
            release: false,
            session_header: "x-session-id".into(),
            session_mode: SessionHeaderMode::All,
            model: None,
            request_timeout: Duration::from_secs(1),
            start_attempts: 1,
            external: Vec::new(),
            engine_groups: Vec::new(),
            multi: None,
        }
    }

    #[test]
    fn the_models_workload_gets_a_fleet_of_several_models() {
        let one = fleet_for_kind(fleet(4), WorkloadKind::Agentic).unwrap();
        assert!(one.multi.is_none());
        let dir = Path::new("/tmp/x");
        assert!(spec_for(Policy::KvmeshPrecise, &one, dir).models.is_empty());
        // 5 workers split between 2 models: 2 each.
        let f = fleet_for_kind(fleet(5), WorkloadKind::Models).unwrap();
        assert_eq!(f.workers, 4);
        for policy in [Policy::KvmeshPrecise, Policy::RoundRobin] {
            let spec = spec_for(policy, &f, dir);
            let names: Vec<&str> = spec.models.iter().map(|m| m.name.as_str()).collect();
            assert_eq!(names, MODEL_MIX.map(|b| b.name));
            assert!(spec.models.iter().all(|m| m.max_loras == Some(MODELS_MAX_LORAS)));
            assert_eq!(spec.models[1].adapters, MODEL_MIX[1].adapters);
            let per: Vec<Option<&str>> = spec.workers.iter().map(|w| w.model.as_deref()).collect();
            assert_eq!(
                per,
                vec![
                    Some("deepseek-v4"),
                    Some("deepseek-v4"),
                    Some("deepseek-v4-mini"),
                    Some("deepseek-v4-mini")
                ]
            );
            let args = spec.sim_args.join(" ");
            assert!(args.contains("--lora-load-ms 20 --x"), "{args}");
            // The router's adapter cost is the simulators' load time on the wall clock (÷ 4).
            assert!(spec.routing_toml.contains("adapter_load_ms = 5.000"), "{}", spec.routing_toml);
        }
        assert!(spec_for(Policy::KvmeshPrecise, &f, dir).routing_toml.starts_with("mode = "));
        assert!(fleet_for_kind(fleet(1), WorkloadKind::Models).is_err());
        let mut real = fleet(4);
        real.external = StackSpec::aggregate(1).workers;
        assert!(fleet_for_kind(real, WorkloadKind::Models).is_err());
    }

    #[test]
    fn the_tiers_workload_gets_a_small_gpu_cache_and_a_cpu_tier() {
        let f = fleet_for_kind(fleet(4), WorkloadKind::Tiers).unwrap();
        assert_eq!((f.workers, f.num_gpu_blocks), (4, tiers::GPU_BLOCKS));
        let args = spec_for(Policy::KvmeshPrecise, &f, Path::new("/tmp/x")).sim_args.join(" ");
        assert!(args.starts_with(&format!("--num-gpu-blocks {}", tiers::GPU_BLOCKS)), "{args}");
        assert!(
            args.ends_with("--x --cpu-offload-blocks 4096 --cpu-load-tokens-per-s 100000"),
            "{args}"
        );
        let mut real = fleet(4);
        real.external = StackSpec::aggregate(1).workers;
        assert!(fleet_for_kind(real, WorkloadKind::Tiers).is_err());
    }

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
