//! `kvmesh-bench sweep`: its flags, the sweep's fleet and settings (the report's settings lines
//! included), and the manifest of the part alone.

use super::replica::FaultPlan;
use super::{run_sweep, SweepSettings, TRACE_LOAD_POINT_WINDOW_S};
use crate::common::{vllm_fleet, Common, TraceSource};
use crate::run::Fleet;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_bench::manifest::{ExtraSection, RunManifest};
use kvmesh_bench::policy::Policy;
use kvmesh_bench::report::plots;
use kvmesh_bench::sweep::lost_events::Fault;
use kvmesh_bench::sweep::replicas::{parse_replica_counts, Spread};
use kvmesh_bench::sweep::{timing_for, MAX_LATENESS_P90_MS, MAX_OTHER_CPU_BUSY};
use kvmesh_bench::workload::{trace::TraceConfig, WorkloadKind};

/// `kvmesh-bench sweep` flags.
#[derive(Args, Debug, Clone)]
pub struct SweepArgs {
    /// Workloads, comma-separated (trace, agentic, siblings, paced, cold; and models, several
    /// models on `--workers` split between them, and tiers, a CPU offload tier, only when named).
    #[arg(long, default_value = "trace,agentic,siblings,paced,cold")]
    workloads: String,
    /// Policies, comma-separated; round_robin always runs (its ladder finds the saturation).
    /// kvmesh_precise_local_short runs only when named.
    #[arg(
        long,
        default_value = "round_robin,least_request,ring_hash,kvmesh_approximate,kvmesh_precise,kvmesh_precise_session"
    )]
    policies: String,
    /// The measured window of one point, s. Single-turn and trace points: arrivals span it
    /// (turns stop at 1.5 × it). agentic and paced: sessions arrive from the warm-up's start,
    /// only requests scheduled in the window count, no turn is sent after it.
    #[arg(long, default_value_t = 30.0)]
    duration_s: f64,
    /// Warm-up of the agentic and paced points before their window, s (default: the workload's
    /// mean session length in wall-clock time, `sweep::default_warmup_s`; 0 on real engines).
    #[arg(long)]
    warmup_s: Option<f64>,
    /// The measured window of every policy's load-point run, s (default `--duration-s`, the
    /// window the saturation search used; see `SweepSettings::load_point_window_s` before
    /// changing it). With `--rates`, every fixed rate is measured with this window (one load
    /// point re-run alone).
    #[arg(long)]
    load_point_window_s: Option<f64>,
    /// round_robin's ladder multiplies the rate by this per step.
    #[arg(long, default_value_t = 2.0)]
    factor: f64,
    /// Ladder steps at most.
    #[arg(long, default_value_t = 6)]
    max_steps: usize,
    /// Rates of every policy as fractions of the saturation rate (must hold 0.8, the load point).
    #[arg(long, default_value = "0.4,0.8,1.0,1.3")]
    fractions: String,
    /// First ladder rate (default: 0.3 × a rough estimate from the fleet's prefill throughput).
    #[arg(long)]
    start_rate: Option<f64>,
    /// Measure every policy at exactly these rates, comma-separated (no ladder, no saturation
    /// search): for real engines, whose servable rates are known beforehand.
    #[arg(long)]
    rates: Option<String>,
    /// Seed of the generated workloads.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Simulated workers (few, so the engines' modelled time dominates on 2 cores).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// vllm-sim --speedup for every workload (default: per workload, 1 except paced's 8;
    /// modelled engine time and think times are both divided by it).
    #[arg(long)]
    sim_speedup: Option<f64>,
    /// vllm-sim --prefill-tokens-per-s (modelled) for every workload (default: per workload,
    /// 20000 except agentic 4000 and paced 1000); the step budget follows it.
    #[arg(long)]
    prefill_tokens_per_s: Option<f64>,
    /// KV capacity per worker, blocks.
    #[arg(long, default_value_t = 16_384)]
    num_gpu_blocks: u64,
    /// Requests in flight at most (a due request waiting for a slot is sent late).
    #[arg(long, default_value_t = 512)]
    max_in_flight: usize,
    #[command(flatten)]
    trace: TraceSource,
    /// Trace time every trace point replays (compressed into --duration-s, thinned by
    /// conversation to the rate), ms. 300000 at 30-s points compresses 10×, like the old replay.
    #[arg(long, default_value_t = 300_000.0)]
    trace_window_ms: f64,
    /// Trace requests' max_tokens = min(output_length, this).
    #[arg(long, default_value_t = 128)]
    max_output_tokens: u32,
    /// Gateway replica counts, comma-separated (e.g. 1,2,4,8). The sweep runs at one gateway as
    /// always; every count above 1 adds the replica curve: every policy again behind that many
    /// gateways (each its own Envoy, filter and indexer over the same engines) at the load point,
    /// or at each `--rates` rate.
    #[arg(long, default_value = "1")]
    replicas: String,
    /// How the client spreads requests over replicas, comma-separated: per-connection (every turn
    /// of a session to one replica, sessions round robin), per-request (round robin per request).
    /// The baselines run under the first only.
    #[arg(long, default_value = "per-connection")]
    replica_spread: String,
    /// Lost events instead of the sweep, comma-separated faults: stall (SIGSTOP the last
    /// replica's indexer for `--stall-s`, past the engines' PUB high-water mark, then SIGCONT),
    /// restart (kill it and start a new one). Needs `--rates`; runs the kvmesh policies behind the
    /// largest `--replicas` count (at least 2).
    #[arg(long)]
    lose_events: Option<String>,
    /// Lost events: the fault starts this long after the window opens, s (default: a quarter of
    /// the window).
    #[arg(long)]
    fault_at_s: Option<f64>,
    /// Lost events: how long a stall lasts, s.
    #[arg(long, default_value_t = 20.0)]
    stall_s: f64,
    /// Lost events: the recovery's bin width, s.
    #[arg(long, default_value_t = 5.0)]
    recovery_bin_s: f64,
    /// Lost events: the simulators' PUB send high-water mark (`vllm-sim --kv-events-hwm`, default
    /// there 100,000 batches), low so that a stall overflows it once the connection's socket
    /// buffers (megabytes on loopback, README "Gateway replicas") are full.
    #[arg(long, default_value_t = 100)]
    lose_events_hwm: u32,
    /// Lost events: the simulators' PUB kernel send buffer, bytes (`vllm-sim --kv-events-sndbuf`;
    /// 0 = the OS default, megabytes on loopback): small, so that a stall overflows the PUB queue
    /// after a known amount of events instead of after the kernel's autotuned buffers.
    #[arg(long, default_value_t = 65_536)]
    lose_events_sndbuf: u32,
}

/// Runs the load sweep; returns the manifest of this part alone and the points that ran.
pub async fn run(common: &Common, a: &SweepArgs) -> Result<(RunManifest, usize)> {
    let (sweep_fleet, settings) = setup(common, a)?;
    let report = run_sweep(&settings, &sweep_fleet, &common.out).await?;
    let ran_replicas = report
        .workloads
        .iter()
        .flat_map(|w| &w.replica_points)
        .filter(|p| p.error.is_none())
        .count();
    let ran = report
        .workloads
        .iter()
        .map(|w| w.points.iter().filter(|p| p.error.is_none()).count())
        .sum::<usize>()
        + ran_replicas;
    let plots_ok = match plots::register_font(&common.font)
        .map_err(|e| e.to_string())
        .and_then(|()| super::draw(&report, &common.out))
    {
        Ok(_) => true,
        Err(e) => {
            eprintln!("sweep plots: {e}");
            false
        }
    };
    let manifest = RunManifest {
        title: Some("kvmesh load sweep".into()),
        workload: Some(format!("load sweep: {}", a.workloads)),
        window: Some("per point: see the sweep section".into()),
        workers: (0..a.workers).map(|i| format!("w{i}")).collect(),
        cache_capacity_blocks: Some(a.num_gpu_blocks),
        engine_block_size: Some(common.block_size),
        extra_sections: vec![ExtraSection {
            title: "Load sweep".into(),
            markdown: kvmesh_bench::report::sweep::render(&report, plots_ok)
                + &kvmesh_bench::report::replicas::render(&report, plots_ok),
        }],
        ..Default::default()
    };
    Ok((manifest, ran))
}

/// The lost-events faults of `--lose-events` (empty without it), checked against the rest: fixed
/// rates, simulators, a fault inside the window with room to recover after it.
fn fault_plans(a: &SweepArgs, fixed_rates: &[f64], real_engines: bool) -> Result<Vec<FaultPlan>> {
    let Some(list) = &a.lose_events else { return Ok(Vec::new()) };
    if fixed_rates.is_empty() {
        bail!("--lose-events needs --rates (the load point's rate: no ladder runs)");
    }
    if real_engines {
        bail!(
            "--lose-events runs on simulators (--engines sim): it lowers their PUB high-water mark"
        );
    }
    let window = a.load_point_window_s.unwrap_or(a.duration_s);
    let at_s = a.fault_at_s.unwrap_or(window / 4.0);
    if !(at_s >= 1.0 && a.stall_s > 0.0 && a.recovery_bin_s > 0.0) {
        bail!("--fault-at-s must be >= 1 s (after the window's first scrape), --stall-s and --recovery-bin-s > 0");
    }
    let mut out = Vec::new();
    for name in list.split(',').filter(|x| !x.trim().is_empty()) {
        let fault = Fault::parse(name).map_err(anyhow::Error::msg)?;
        let busy = if fault == Fault::Stall { a.stall_s } else { 0.0 };
        if at_s + busy + 2.0 * a.recovery_bin_s > window {
            bail!(
                "--lose-events {}: the fault at {at_s} s (+ {busy} s) leaves less than two {} s bins of the {window}-s window to recover in",
                fault.name(),
                a.recovery_bin_s
            );
        }
        if !out.iter().any(|p: &FaultPlan| p.fault == fault) {
            out.push(FaultPlan { fault, at_s, stall_s: a.stall_s, bin_s: a.recovery_bin_s });
        }
    }
    if out.is_empty() {
        bail!("--lose-events: no fault named (stall, restart)");
    }
    Ok(out)
}

/// Parses a comma-separated list of rates, each > 0 (`flag` names it in errors).
fn parse_rates(flag: &str, list: &str) -> Result<Vec<f64>> {
    list.split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| match x.trim().parse::<f64>() {
            Ok(r) if r > 0.0 && r.is_finite() => Ok(r),
            _ => bail!("{flag}: {x:?} is not a rate > 0"),
        })
        .collect()
}

/// The sweep's fleet (its own defaults: few workers, low speed-up, long modelled prefill) and
/// settings.
fn setup(common: &Common, a: &SweepArgs) -> Result<(Fleet, SweepSettings)> {
    if !(a.sim_speedup.is_none_or(|x| x > 0.0)
        && a.prefill_tokens_per_s.is_none_or(|x| x > 0.0)
        && a.duration_s > 0.0
        && a.trace_window_ms > 0.0)
    {
        bail!(
            "--sim-speedup, --prefill-tokens-per-s, --duration-s and --trace-window-ms must be > 0"
        );
    }
    if !a.warmup_s.is_none_or(|w| w >= 0.0 && w.is_finite()) {
        bail!("--warmup-s must be >= 0");
    }
    if !a.load_point_window_s.is_none_or(|w| w > 0.0 && w.is_finite()) {
        bail!("--load-point-window-s must be > 0");
    }
    let workloads = WorkloadKind::parse_list(&a.workloads).map_err(anyhow::Error::msg)?;
    let replicas = parse_replica_counts(&a.replicas).map_err(anyhow::Error::msg)?;
    let spreads = Spread::parse_list(&a.replica_spread).map_err(anyhow::Error::msg)?;
    let mut policies = Policy::parse_list(&a.policies).map_err(anyhow::Error::msg)?;
    policies.retain(|p| *p != Policy::RoundRobin);
    policies.insert(0, Policy::RoundRobin);
    let fractions = a
        .fractions
        .split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| x.trim().parse::<f64>().with_context(|| format!("--fractions: {x:?}")))
        .collect::<Result<Vec<f64>>>()?;
    // Each workload's timing flags are added per workload (`sweep::run_sweep`); real engines run
    // at wall-clock speed unless told otherwise.
    let mut sweep_fleet =
        common.fleet(a.workers, a.num_gpu_blocks, a.sim_speedup.unwrap_or(1.0))?;
    let trace_records = if workloads.contains(&WorkloadKind::Trace) {
        let (_, all) = a.trace.read()?;
        let start = a.trace.window_start_ms.unwrap_or(f64::NEG_INFINITY);
        all.into_iter().filter(|r| r.timestamp >= start).collect()
    } else {
        Vec::new()
    };
    let fixed_rates = match &a.rates {
        None => Vec::new(),
        Some(list) => parse_rates("--rates", list)?,
    };
    let vllm = common.vllm_options()?;
    let lose_events = fault_plans(a, &fixed_rates, vllm.is_some())?;
    if !lose_events.is_empty() {
        // A PUB queue that a stall of seconds overflows (the simulators' own default holds
        // 100,000 batches).
        sweep_fleet.sim_args.push(format!("--kv-events-hwm={}", a.lose_events_hwm));
        sweep_fleet.sim_args.push(format!("--kv-events-sndbuf={}", a.lose_events_sndbuf));
    }
    if vllm.is_some() && fixed_rates.is_empty() {
        bail!("--engines vllm needs --rates (a CPU engine serves a fraction of a request per second: choose the rates, no ladder)");
    }
    let fleet_line = match &vllm {
        None => format!(
            "fleet: {} vllm-sim workers × {} blocks of {} tokens, extra sim flags {:?}; timing per workload (each workload's section): {}",
            a.workers,
            a.num_gpu_blocks,
            common.block_size,
            common.sim_args,
            workloads
                .iter()
                .map(|&k| timing_for(k, a.sim_speedup, a.prefill_tokens_per_s).map(|t| format!(
                    "{} `--speedup {}` `--prefill-tokens-per-s {}`",
                    k.name(),
                    t.sim_speedup,
                    t.prefill_tokens_per_s
                )))
                .collect::<Result<Vec<String>, String>>()
                .map_err(anyhow::Error::msg)?
                .join(", ")
        ),
        Some(o) => format!(
            "fleet: {} under `nice -n 19`; started once, prefix caches reset (`/reset_prefix_cache`) before every point",
            vllm_fleet(a.workers, common.block_size, o)
        ),
    };
    let validity = if vllm.is_some() {
        format!(
            "a point is **invalid** when the CPU of everything but the engines (machine busy − engines' process groups, `/proc`) is above {:.0}% of the machine, or the client's lateness (sent − scheduled) p90 is above {} ms; the engines themselves may use all of their cores",
            MAX_OTHER_CPU_BUSY * 100.0,
            MAX_LATENESS_P90_MS
        )
    } else {
        "a point is **invalid** when the machine's CPU use (`/proc/stat`, mean over the point) is above 85% or the client's lateness (sent − scheduled) p90 is above 10 ms; the headline uses valid points only".into()
    };
    let rates_line = if fixed_rates.is_empty() {
        format!(
            "ladder: round_robin from the first rate × {} per step, at most {} steps, until its TTFT p90 > 3 × its light-load value; then every policy at {} × the saturation rate; the load point (0.8 ×) measures {}",
            a.factor,
            a.max_steps,
            a.fractions,
            match a.load_point_window_s {
                Some(w) => format!("a {w}-s window (`--load-point-window-s`)"),
                None => format!(
                    "the sweep's window, the trace's {} s (more requests of its heavy-tailed prompts), replaying {} s of trace time at the ladder's compression",
                    a.duration_s.max(TRACE_LOAD_POINT_WINDOW_S),
                    a.trace_window_ms / 1000.0 * a.duration_s.max(TRACE_LOAD_POINT_WINDOW_S) / a.duration_s
                ),
            }
        )
    } else {
        let window = match a.load_point_window_s {
            Some(w) => format!(", each a {w}-s window as a load point (`--load-point-window-s`)"),
            None => String::new(),
        };
        format!("rates: every policy at {fixed_rates:?} (`--rates`; no ladder, no saturation search, no load point){window}")
    };
    let mut settings = vec![
        fleet_line,
        format!(
            "each point: a fresh stack, caches reset, at most {} requests in flight, seed {}; trace, siblings, cold: arrivals over {} s, turns stop at {} s, every request counted; agentic, paced (steady state): sessions arrive at the rate from the start of a warm-up ({}), then a measured window of {} s — only requests *scheduled* in the window count (TTFT, hit rates from `cached_tokens`, load), engine counters, CPU and simulator CPU are deltas over the window, no turn due after it is sent (cut, counted), and the ceiling counts the window's requests with everything sent before as history; their rate is sessions/s, turns/s stated per point",
            a.max_in_flight,
            a.seed,
            a.duration_s,
            a.duration_s * 1.5,
            match a.warmup_s {
                Some(w) => format!("{w} s, `--warmup-s`"),
                None => "the workload's mean session length in wall-clock time, each workload's section".into(),
            },
            a.duration_s
        ),
        rates_line,
        validity,
        if vllm.is_some() {
            "sim CPU-s / 1k req: here the real engines' CPU (user + system of each engine's process group: API server, engine core, worker) per 1,000 requests".into()
        } else {
            "sim CPU-s / 1k req: user + system CPU of the vllm-sim processes during the point (`/proc/<pid>/stat`) per 1,000 requests".into()
        },
        "policies: round_robin, least_request (Envoy); ring_hash and kvmesh_precise_session get the workload's session header (trace, agentic, paced only); kvmesh_approximate and kvmesh_precise run as shipped (default configuration, no header)".into(),
    ];
    if replicas.iter().any(|&n| n > 1) && lose_events.is_empty() {
        settings.push(format!(
            "gateway replicas {:?} (`--replicas`), spread {} (`--replica-spread`): each replica its own Envoy + filter + indexer over the same engines, every indexer subscribed to every engine's KV events and scraping every engine; the replica curve measures every policy behind each count above 1 at the load point (or each `--rates` rate), kvmesh per spread, the baselines under the first spread; the routers' counters are summed over the replicas; the client's CPU and every replica's count in the machine's CPU (the validity rule)",
            replicas,
            spreads.iter().map(|s| s.name()).collect::<Vec<_>>().join(", ")
        ));
    }
    if let Some(first) = lose_events.first() {
        settings.push(format!(
            "lost events (`--lose-events`): the kvmesh policies behind {} gateway replicas (spread {}), the last replica's indexer faulted {:.0} s after the window opens — stall: SIGSTOP for {} s, then SIGCONT; restart: SIGKILL and a new process (its start-up replay) — with the simulators' PUB high-water mark at {} batches (`--kv-events-hwm`); recovery in {} s bins",
            replicas.iter().copied().max().unwrap_or(2).max(2),
            spreads.iter().map(|s| s.name()).collect::<Vec<_>>().join(", "),
            first.at_s,
            a.stall_s,
            a.lose_events_hwm,
            a.recovery_bin_s
        ));
    }
    if policies.contains(&Policy::KvmeshPreciseLocalShort) {
        settings.push(format!(
            "{}: {} (not judged)",
            Policy::KvmeshPreciseLocalShort.name(),
            Policy::KvmeshPreciseLocalShort.describe()
        ));
    }
    let settings = SweepSettings {
        workloads,
        policies,
        ladder_factor: a.factor,
        ladder_max_steps: a.max_steps,
        fractions,
        start_rate: a.start_rate,
        duration_s: a.duration_s,
        warmup_s: a.warmup_s,
        load_point_window_s: a.load_point_window_s,
        seed: a.seed,
        sim_speedup: a.sim_speedup,
        prefill_tokens_per_s: a.prefill_tokens_per_s,
        max_in_flight: a.max_in_flight.max(1),
        trace_records,
        fixed_rates,
        vllm,
        replicas,
        spreads,
        lose_events,
        trace_cfg: TraceConfig {
            duration_s: a.duration_s,
            token_seed: a.trace.token_seed,
            anchor_block: a.trace.anchor_block,
            max_output_tokens: a.max_output_tokens,
            window_ms: a.trace_window_ms,
            block_size: common.block_size as usize,
        },
        settings,
    };
    Ok((sweep_fleet, settings))
}
