//! `kvmesh-bench`: every routing policy, the same fleet and workload, one run, one report.
//!
//! For each policy (default: round_robin, least_request, ring_hash, kvmesh_approximate,
//! kvmesh_precise) it starts the stack through the `kvmesh-e2e` harness (vllm-sim workers, the
//! indexer for kvmesh policies, Envoy), resets the caches, replays the workload, scrapes the
//! engine and gateway counters, and stops the stack. Then it measures the router overhead
//! (kvmesh against the same Envoy without the filter, `overhead.rs`), adds the indexer's
//! microbenchmark figures when given (`--indexer-figures`), writes `run.json` and renders
//! `report.md` with the plots into `--out`. Defaults reproduce the setup: the first
//! 10 minutes of the conversation trace on 8 workers whose KV capacity forces eviction.
//! `--only policies` or `--only overhead` runs one part.

mod aiperf;
mod overhead;
mod run;
mod sweep;

use anyhow::{bail, Context, Result};
use clap::Parser;
use kvmesh_bench::aiperf::AiperfWorkload;
use kvmesh_bench::ceiling::intrinsic;
use kvmesh_bench::chat::ChatConfig;
use kvmesh_bench::conversation::DEFAULT_ANCHOR_BLOCK;
use kvmesh_bench::manifest::RunManifest;
use kvmesh_bench::micro;
use kvmesh_bench::overhead::plan::{parse_optional_sizes, parse_sizes};
use kvmesh_bench::policy::{shell_quote, Policy, SessionHeaderMode};
use kvmesh_bench::report::{generate, plots};
use kvmesh_bench::trace::{self, default_trace_path, Selection, TRACE_ENV};
use kvmesh_e2e::vllm::VllmOptions;
use overhead::{run_overhead, OverheadArgs};
use run::{failed_policy, run_policy, Fleet, Workload};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "kvmesh-bench",
    version,
    about = "Replay one workload through every routing policy and write a report"
)]
struct Args {
    /// Output directory (results, counters, stack logs, run.json, report.md, plots).
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Policies to run, comma-separated, in report order.
    #[arg(
        long,
        default_value = "round_robin,least_request,ring_hash,kvmesh_approximate,kvmesh_precise"
    )]
    policies: String,
    /// Workload: `trace` (Mooncake replay) or `chat` (multi-turn text sessions).
    #[arg(long, default_value = "trace")]
    workload: String,

    /// Simulated workers in the fleet.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Engine KV block size, tokens.
    #[arg(long, default_value_t = 16)]
    block_size: u32,
    /// KV capacity per worker, blocks (default 65536 × 16 = 1M tokens: the first 10 minutes hold
    /// ~17.8M distinct tokens, so the fleet must evict).
    #[arg(long, default_value_t = 65_536)]
    num_gpu_blocks: u64,
    /// vllm-sim --speedup (default: the replay's --speedup, so load and service time scale together).
    #[arg(long)]
    sim_speedup: Option<f64>,
    /// Extra vllm-sim flag for every worker (repeatable), e.g. `--sim-arg=--prefill-tokens-per-s=40000`.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    sim_args: Vec<String>,
    /// Use target/release stack binaries (default: the profile this binary was built with).
    #[arg(long)]
    release_binaries: Option<bool>,
    /// Session header name (Envoy ring_hash hashes it; kvmesh reads it as the explicit session).
    #[arg(long, default_value = kvmesh_core::headers::DEFAULT_SESSION_HEADER)]
    session_header: String,
    /// Which policies get the session header: all, ring-hash, none.
    #[arg(long, default_value = "all")]
    session_header_mode: String,
    /// Model name (default: asked from the gateway's /v1/models).
    #[arg(long)]
    model: Option<String>,
    /// Deadline per request, seconds.
    #[arg(long, default_value_t = 300.0)]
    request_timeout_s: f64,
    /// Attempts to start each policy's stack before the policy is reported as not run.
    #[arg(long, default_value_t = 2)]
    start_attempts: u32,
    /// TTF font for plot text.
    #[arg(long, env = plots::FONT_ENV, default_value = plots::DEFAULT_FONT)]
    font: PathBuf,

    /// Trace file (default: $KVMESH_TRACE, else <repo>/../shared/traces/mooncake_conversation_trace.jsonl).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Skip requests before this trace time, ms.
    #[arg(long)]
    window_start_ms: Option<f64>,
    /// Window length, ms (0 = to the end of the trace).
    #[arg(long, default_value_t = 600_000.0)]
    window_ms: f64,
    /// Keep at most the first N requests of the window.
    #[arg(long)]
    first: Option<usize>,
    /// Trace time divided by this.
    #[arg(long, default_value_t = 10.0)]
    speedup: f64,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 256)]
    max_concurrency: usize,
    /// Seed of the hash id → tokens mapping.
    #[arg(long, default_value_t = 0)]
    token_seed: u64,
    /// Conversation key position in hash_ids.
    #[arg(long, default_value_t = DEFAULT_ANCHOR_BLOCK)]
    anchor_block: usize,

    /// Chat workload: seed.
    #[arg(long, default_value_t = 0)]
    chat_seed: u64,
    /// Chat workload: sessions in total.
    #[arg(long, default_value_t = 64)]
    chat_sessions: usize,
    /// Chat workload: sessions at once.
    #[arg(long, default_value_t = 16)]
    chat_concurrent_sessions: usize,
    /// Chat workload: most turns per session (fewest: 3 or this, whichever is smaller).
    #[arg(long, default_value_t = 8)]
    chat_turns_max: u32,
    /// Chat workload: words per shared system prompt.
    #[arg(long, default_value_t = 1500)]
    chat_system_prompt_words: usize,

    /// Parts to run, comma-separated: `sweep` (the load sweep: every workload × policy × rate),
    /// `policies` (one replay under every policy, `--workload`), `overhead`, `aiperf` (NVIDIA's
    /// aiperf as the client of every policy's gateway; `make bench-aiperf`).
    #[arg(long, default_value = "policies,overhead")]
    only: String,

    /// aiperf: its executable (`scripts/setup-aiperf.sh` installs it there).
    #[arg(long, default_value = ".tools/aiperf/venv/bin/aiperf")]
    aiperf_bin: PathBuf,
    /// aiperf: policies, comma-separated.
    #[arg(
        long,
        default_value = "round_robin,least_request,ring_hash,kvmesh_approximate,kvmesh_precise"
    )]
    aiperf_policies: String,
    /// aiperf: requests per second.
    #[arg(long, default_value_t = AiperfWorkload::default().request_rate)]
    aiperf_rate: f64,
    /// aiperf: seconds of sending.
    #[arg(long, default_value_t = AiperfWorkload::default().duration_s)]
    aiperf_duration_s: f64,
    /// aiperf: the simulators' modelled prefill throughput, tokens/s per worker (`--speedup 1`,
    /// the sweep's workers and cache size).
    #[arg(long, default_value_t = 5000.0)]
    aiperf_prefill_tokens_per_s: f64,
    /// aiperf: seed of its generated conversations.
    #[arg(long, default_value_t = 0)]
    aiperf_seed: u64,
    /// aiperf: multiplies every token length of the workload (system prompt, context, turns,
    /// output), e.g. 0.5 for real CPU engines, whose prefill is slow.
    #[arg(long)]
    aiperf_scale: Option<f64>,

    /// Sweep: workloads, comma-separated (trace, agentic, siblings, paced, cold).
    #[arg(long, default_value = "trace,agentic,siblings,paced,cold")]
    sweep_workloads: String,
    /// Sweep: policies, comma-separated; round_robin always runs (its ladder finds the saturation).
    /// kvmesh_precise_local_short runs only when named.
    #[arg(
        long,
        default_value = "round_robin,least_request,ring_hash,kvmesh_approximate,kvmesh_precise,kvmesh_precise_session"
    )]
    sweep_policies: String,
    /// Sweep: the measured window of one point, s. Single-turn and trace points: arrivals span it
    /// (turns stop at 1.5 × it). agentic and paced: sessions arrive from the warm-up's start,
    /// only requests scheduled in the window count, no turn is sent after it.
    #[arg(long, default_value_t = 30.0)]
    sweep_duration_s: f64,
    /// Sweep: warm-up of the agentic and paced points before their window, s (default: the
    /// workload's mean session length in wall-clock time, `sweep::default_warmup_s`; 0 on real
    /// engines).
    #[arg(long)]
    sweep_warmup_s: Option<f64>,
    /// Sweep: the measured window of every policy's load-point run, s (default `--sweep-duration-s`,
    /// the window the saturation search used; see `SweepArgs::load_point_window_s` before changing it).
    /// With `--sweep-rates`, every fixed rate is measured with this window (one load point re-run alone).
    #[arg(long)]
    sweep_load_point_window_s: Option<f64>,
    /// Sweep: round_robin's ladder multiplies the rate by this per step.
    #[arg(long, default_value_t = 2.0)]
    sweep_factor: f64,
    /// Sweep: ladder steps at most.
    #[arg(long, default_value_t = 6)]
    sweep_max_steps: usize,
    /// Sweep: rates of every policy as fractions of the saturation rate (must hold 0.8, the load point).
    #[arg(long, default_value = "0.4,0.8,1.0,1.3")]
    sweep_fractions: String,
    /// Sweep: first ladder rate (default: 0.3 × a rough estimate from the fleet's prefill throughput).
    #[arg(long)]
    sweep_start_rate: Option<f64>,
    /// Sweep: seed of the generated workloads.
    #[arg(long, default_value_t = 0)]
    sweep_seed: u64,
    /// Sweep: simulated workers (few, so the engines' modelled time dominates on 2 cores).
    #[arg(long, default_value_t = 4)]
    sweep_workers: usize,
    /// Sweep: vllm-sim --speedup for every workload (default: per workload, 1 except paced's 8;
    /// modelled engine time and think times are both divided by it).
    #[arg(long)]
    sweep_sim_speedup: Option<f64>,
    /// Sweep: vllm-sim --prefill-tokens-per-s (modelled) for every workload (default: per
    /// workload, 20000 except agentic 4000 and paced 1000); the step budget follows it.
    #[arg(long)]
    sweep_prefill_tokens_per_s: Option<f64>,
    /// Sweep: KV capacity per worker, blocks.
    #[arg(long, default_value_t = 16_384)]
    sweep_num_gpu_blocks: u64,
    /// Sweep: requests in flight at most (a due request waiting for a slot is sent late).
    #[arg(long, default_value_t = 512)]
    sweep_max_in_flight: usize,
    /// Sweep: trace time every trace point replays (compressed into --sweep-duration-s, thinned by
    /// conversation to the rate), ms. 300000 at 30-s points compresses 10×, like the old replay.
    #[arg(long, default_value_t = 300_000.0)]
    sweep_trace_window_ms: f64,
    /// Sweep: measure every policy at exactly these rates, comma-separated (no ladder, no
    /// saturation search): for real engines, whose servable rates are known beforehand.
    #[arg(long)]
    sweep_rates: Option<String>,
    /// Sweep engines: `sim` (vllm-sim, fresh per point) or `vllm` (real vLLM CPU engines, started
    /// once with the bench's larger dummy model, one per core, caches reset before every point).
    #[arg(long, default_value = "sim")]
    engines: String,
    /// Real engines: `VLLM_CPU_KVCACHE_SPACE` per engine, GiB.
    #[arg(long, default_value_t = 2)]
    vllm_kv_cache_gib: u32,
    /// Real engines: `--max-model-len`.
    #[arg(long, default_value_t = 32_768)]
    vllm_max_model_len: u32,
    /// Sweep: trace requests' max_tokens = min(output_length, this).
    #[arg(long, default_value_t = 128)]
    sweep_max_output_tokens: u32,
    /// Overhead: chat prompt sizes in tokens (`k` = 1024), each measured cold and as a continuation.
    #[arg(long, default_value = "1k,8k,32k")]
    overhead_sizes: String,
    /// Overhead: shared-prefix sizes (`k` = 1024), one `chat_<size>_shared_prefix` case each
    /// (many conversations growing turn by turn on one long prefix); `none` for no such case.
    #[arg(long, default_value = "8k,48k")]
    overhead_shared_prefixes: String,
    /// Overhead: latency samples per case and path (kvmesh, plain).
    #[arg(long, default_value_t = 200)]
    overhead_samples: usize,
    /// Overhead: continuation conversations per size (samples cycle through them).
    #[arg(long, default_value_t = 4)]
    overhead_bases: usize,
    /// Overhead: vllm-sim --speedup (large: the engine's modelled time vanishes).
    #[arg(long, default_value_t = 1_000_000.0)]
    overhead_sim_speedup: f64,
    /// Overhead: seconds per requests/s round (0 skips the requests/s phase).
    #[arg(long, default_value_t = 3.0)]
    overhead_rps_seconds: f64,
    /// Overhead: requests/s rounds per path and case (paths alternate).
    #[arg(long, default_value_t = 2)]
    overhead_rps_rounds: usize,
    /// Overhead: concurrent closed-loop clients in the requests/s phase.
    #[arg(long, default_value_t = 8)]
    overhead_rps_concurrency: usize,
    /// Overhead: the filter's indexer_timeout_ms (default: the filter's own default).
    #[arg(long)]
    overhead_indexer_timeout_ms: Option<u64>,
    /// Overhead: sizes measured again, after the main run, on a stack whose filter routes bodies
    /// of at most --overhead-local-route-max-body-bytes alone (cases `<case>_local_route`);
    /// `none` = skip.
    #[arg(long, default_value = "1k")]
    overhead_local_sizes: String,
    /// Overhead: the filter's local_route_max_body_bytes in the `_local_route` run (the main run
    /// keeps the filter's default, off).
    #[arg(long, default_value_t = kvmesh_bench::policy::LOCAL_ROUTE_SHORT_BODY_BYTES)]
    overhead_local_route_max_body_bytes: usize,
    /// Overhead: seed of the generated conversations.
    #[arg(long, default_value_t = 0)]
    overhead_seed: u64,
    /// JSON-lines figures from `cargo bench -p kvmesh-indexer` (KVMESH_BENCH_FIGURES), rendered
    /// as the report's "Indexer microbenchmarks" section (`make bench` passes it).
    #[arg(long)]
    indexer_figures: Option<PathBuf>,
}

/// The parts of a run `--only` selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Parts {
    sweep: bool,
    policies: bool,
    overhead: bool,
    aiperf: bool,
}

impl Parts {
    fn parse(s: &str) -> Result<Self> {
        let mut p = Parts { sweep: false, policies: false, overhead: false, aiperf: false };
        for part in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            match part {
                "sweep" => p.sweep = true,
                "policies" => p.policies = true,
                "overhead" => p.overhead = true,
                "aiperf" => p.aiperf = true,
                other => bail!("unknown --only part {other:?} (sweep, policies, overhead, aiperf)"),
            }
        }
        if !(p.sweep || p.policies || p.overhead || p.aiperf) {
            bail!("--only selects nothing");
        }
        Ok(p)
    }
}

/// The real engines' options for `--engines vllm` (`None` for simulators).
fn vllm_options(a: &Args) -> Result<Option<VllmOptions>> {
    match a.engines.as_str() {
        "sim" => Ok(None),
        "vllm" => {
            if !a.block_size.is_multiple_of(32) {
                bail!("--engines vllm: vLLM's CPU attention needs --block-size a multiple of 32 (got {})", a.block_size);
            }
            let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
            Ok(Some(VllmOptions {
                kv_cache_gib: a.vllm_kv_cache_gib.max(1),
                max_model_len: a.vllm_max_model_len,
                cores: (0..cores).collect(),
                model: Some(kvmesh_e2e::vllm::bench_model_dir()?),
                dev_mode: true,
                ..VllmOptions::default()
            }))
        }
        other => bail!("unknown --engines {other:?} (sim, vllm)"),
    }
}

/// The real engines of `opts`, for a report's fleet line.
fn vllm_fleet(workers: usize, block_size: u32, opts: &VllmOptions) -> String {
    format!(
        "{workers} real vLLM CPU engines (`vllm-cpu` 0.32.0, dummy weights, bench model {:?}), block size {block_size}, `VLLM_CPU_KVCACHE_SPACE={}`, `--max-model-len {}`, engine i pinned to core i mod {}",
        kvmesh_e2e::vllm::BENCH_MODEL_SHAPE, opts.kv_cache_gib, opts.max_model_len, opts.cores.len()
    )
}

/// The sweep's fleet (its own defaults: few workers, low speed-up, long modelled prefill) and plan.
fn sweep_setup(a: &Args, fleet: &Fleet) -> Result<(Fleet, sweep::SweepArgs)> {
    use kvmesh_bench::workload::{trace::TraceConfig, WorkloadKind};
    if !(a.sweep_sim_speedup.is_none_or(|x| x > 0.0)
        && a.sweep_prefill_tokens_per_s.is_none_or(|x| x > 0.0)
        && a.sweep_duration_s > 0.0
        && a.sweep_trace_window_ms > 0.0)
    {
        bail!("--sweep-sim-speedup, --sweep-prefill-tokens-per-s, --sweep-duration-s and --sweep-trace-window-ms must be > 0");
    }
    if !a.sweep_warmup_s.is_none_or(|w| w >= 0.0 && w.is_finite()) {
        bail!("--sweep-warmup-s must be >= 0");
    }
    if !a.sweep_load_point_window_s.is_none_or(|w| w > 0.0 && w.is_finite()) {
        bail!("--sweep-load-point-window-s must be > 0");
    }
    let workloads = WorkloadKind::parse_list(&a.sweep_workloads).map_err(anyhow::Error::msg)?;
    let mut policies = Policy::parse_list(&a.sweep_policies).map_err(anyhow::Error::msg)?;
    policies.retain(|p| *p != Policy::RoundRobin);
    policies.insert(0, Policy::RoundRobin);
    let fractions = a
        .sweep_fractions
        .split(',')
        .filter(|x| !x.trim().is_empty())
        .map(|x| x.trim().parse::<f64>().with_context(|| format!("--sweep-fractions: {x:?}")))
        .collect::<Result<Vec<f64>>>()?;
    // Each workload's timing flags are added per workload (`sweep::run_sweep`); real engines run
    // at wall-clock speed unless told otherwise.
    let sweep_fleet = Fleet {
        workers: a.sweep_workers,
        num_gpu_blocks: a.sweep_num_gpu_blocks,
        sim_speedup: a.sweep_sim_speedup.unwrap_or(1.0),
        sim_args: a.sim_args.clone(),
        ..fleet.clone()
    };
    let trace_records = if workloads.contains(&WorkloadKind::Trace) {
        let path =
            a.trace.clone().unwrap_or_else(|| default_trace_path(std::env::var(TRACE_ENV).ok()));
        let file = std::fs::File::open(&path)
            .with_context(|| format!("opening trace {}", path.display()))?;
        let all = trace::parse(std::io::BufReader::new(file))?;
        let start = a.window_start_ms.unwrap_or(f64::NEG_INFINITY);
        all.into_iter().filter(|r| r.timestamp >= start).collect()
    } else {
        Vec::new()
    };
    let fixed_rates = match &a.sweep_rates {
        None => Vec::new(),
        Some(list) => list
            .split(',')
            .filter(|x| !x.trim().is_empty())
            .map(|x| match x.trim().parse::<f64>() {
                Ok(r) if r > 0.0 && r.is_finite() => Ok(r),
                _ => bail!("--sweep-rates: {x:?} is not a rate > 0"),
            })
            .collect::<Result<Vec<f64>>>()?,
    };
    let vllm = vllm_options(a)?;
    if vllm.is_some() && fixed_rates.is_empty() {
        bail!("--engines vllm needs --sweep-rates (a CPU engine serves a fraction of a request per second: choose the rates, no ladder)");
    }
    let fleet_line = match &vllm {
        None => format!(
            "fleet: {} vllm-sim workers × {} blocks of {} tokens, extra sim flags {:?}; timing per workload (each workload's section): {}",
            a.sweep_workers,
            a.sweep_num_gpu_blocks,
            a.block_size,
            a.sim_args,
            workloads
                .iter()
                .map(|&k| kvmesh_bench::sweep::timing_for(k, a.sweep_sim_speedup, a.sweep_prefill_tokens_per_s).map(|t| format!(
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
            vllm_fleet(a.sweep_workers, a.block_size, o)
        ),
    };
    let validity = if vllm.is_some() {
        format!(
            "a point is **invalid** when the CPU of everything but the engines (machine busy − engines' process groups, `/proc`) is above {:.0}% of the machine, or the client's lateness (sent − scheduled) p90 is above {} ms; the engines themselves may use all of their cores",
            kvmesh_bench::sweep::MAX_OTHER_CPU_BUSY * 100.0,
            kvmesh_bench::sweep::MAX_LATENESS_P90_MS
        )
    } else {
        "a point is **invalid** when the machine's CPU use (`/proc/stat`, mean over the point) is above 85% or the client's lateness (sent − scheduled) p90 is above 10 ms; the headline uses valid points only".into()
    };
    let rates_line = if fixed_rates.is_empty() {
        format!(
            "ladder: round_robin from the first rate × {} per step, at most {} steps, until its TTFT p90 > 3 × its light-load value; then every policy at {} × the saturation rate; the load point (0.8 ×) measures {}",
            a.sweep_factor,
            a.sweep_max_steps,
            a.sweep_fractions,
            match a.sweep_load_point_window_s {
                Some(w) => format!("a {w}-s window (`--sweep-load-point-window-s`)"),
                None => format!(
                    "the sweep's window, the trace's {} s (more requests of its heavy-tailed prompts), replaying {} s of trace time at the ladder's compression",
                    a.sweep_duration_s.max(sweep::TRACE_LOAD_POINT_WINDOW_S),
                    a.sweep_trace_window_ms / 1000.0 * a.sweep_duration_s.max(sweep::TRACE_LOAD_POINT_WINDOW_S) / a.sweep_duration_s
                ),
            }
        )
    } else {
        let window = match a.sweep_load_point_window_s {
            Some(w) => {
                format!(", each a {w}-s window as a load point (`--sweep-load-point-window-s`)")
            }
            None => String::new(),
        };
        format!("rates: every policy at {fixed_rates:?} (`--sweep-rates`; no ladder, no saturation search, no load point){window}")
    };
    let mut settings = vec![
        fleet_line,
        format!(
            "each point: a fresh stack, caches reset, at most {} requests in flight, seed {}; trace, siblings, cold: arrivals over {} s, turns stop at {} s, every request counted; agentic, paced (steady state): sessions arrive at the rate from the start of a warm-up ({}), then a measured window of {} s — only requests *scheduled* in the window count (TTFT, hit rates from `cached_tokens`, load), engine counters, CPU and simulator CPU are deltas over the window, no turn due after it is sent (cut, counted), and the ceiling counts the window's requests with everything sent before as history; their rate is sessions/s, turns/s stated per point",
            a.sweep_max_in_flight,
            a.sweep_seed,
            a.sweep_duration_s,
            a.sweep_duration_s * 1.5,
            match a.sweep_warmup_s {
                Some(w) => format!("{w} s, `--sweep-warmup-s`"),
                None => "the workload's mean session length in wall-clock time, each workload's section".into(),
            },
            a.sweep_duration_s
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
    if policies.contains(&Policy::KvmeshPreciseLocalShort) {
        settings.push(format!(
            "{}: {} (not judged)",
            Policy::KvmeshPreciseLocalShort.name(),
            Policy::KvmeshPreciseLocalShort.describe()
        ));
    }
    let args = sweep::SweepArgs {
        workloads,
        policies,
        ladder_factor: a.sweep_factor,
        ladder_max_steps: a.sweep_max_steps,
        fractions,
        start_rate: a.sweep_start_rate,
        duration_s: a.sweep_duration_s,
        warmup_s: a.sweep_warmup_s,
        load_point_window_s: a.sweep_load_point_window_s,
        seed: a.sweep_seed,
        sim_speedup: a.sweep_sim_speedup,
        prefill_tokens_per_s: a.sweep_prefill_tokens_per_s,
        max_in_flight: a.sweep_max_in_flight.max(1),
        trace_records,
        fixed_rates,
        vllm,
        trace_cfg: TraceConfig {
            duration_s: a.sweep_duration_s,
            token_seed: a.token_seed,
            anchor_block: a.anchor_block,
            max_output_tokens: a.sweep_max_output_tokens,
            window_ms: a.sweep_trace_window_ms,
            block_size: a.block_size as usize,
        },
        settings,
    };
    Ok((sweep_fleet, args))
}

fn command_line() -> String {
    std::env::args().map(|a| shell_quote(&a)).collect::<Vec<_>>().join(" ")
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    // On Ctrl-C or SIGTERM the run future is dropped, which drops the running stack and so kills
    // every process it started (a plain signal death would orphan them).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = bench(a) => r,
        _ = tokio::signal::ctrl_c() => bail!("interrupted; stack stopped"),
        _ = term.recv() => bail!("terminated; stack stopped"),
    }
}

async fn bench(a: Args) -> Result<()> {
    let parts = Parts::parse(&a.only)?;
    if a.engines != "sim" && (parts.policies || parts.overhead) {
        bail!(
            "--engines {} runs the load sweep and aiperf only: pass --only sweep or --only aiperf",
            a.engines
        );
    }
    let policies = if parts.policies {
        Policy::parse_list(&a.policies).map_err(anyhow::Error::msg)?
    } else {
        Vec::new()
    };
    let overhead_args = overhead_args(&a)?;
    let fleet = fleet(&a)?;

    let mut manifest = RunManifest {
        title: Some("kvmesh routing policies, side by side".into()),
        speedup: Some(a.speedup),
        cache_capacity_blocks: Some(a.num_gpu_blocks),
        engine_block_size: Some(a.block_size),
        commands: vec!["make bench".into(), command_line()],
        ..Default::default()
    };
    let workload = if parts.policies { workload(&a, &mut manifest)? } else { None };

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut ran = 0usize;
    if parts.sweep {
        ran += sweep_part(&a, &fleet, parts, &mut manifest).await?;
    }
    if let Some(workload) = &workload {
        ran += policies_part(policies, &fleet, workload, &a.out, &mut manifest).await?;
    }
    if parts.overhead {
        ran += overhead_part(&a, &overhead_args, &fleet, parts, &mut manifest).await;
    }
    if parts.aiperf {
        ran += aiperf_part(&a, &fleet, parts, &mut manifest).await?;
    }
    if let Some(path) = &a.indexer_figures {
        manifest.extra_sections.push(indexer_figures(path));
    }
    write_report(&a, &manifest, ran)
}

/// The overhead part's settings from the flags.
fn overhead_args(a: &Args) -> Result<OverheadArgs> {
    let overhead_args = OverheadArgs {
        sizes: parse_sizes(&a.overhead_sizes).map_err(anyhow::Error::msg)?,
        shared_prefixes: parse_optional_sizes(&a.overhead_shared_prefixes)
            .map_err(anyhow::Error::msg)?,
        samples: a.overhead_samples.max(1),
        bases: a.overhead_bases.max(1),
        sim_speedup: a.overhead_sim_speedup,
        rps_seconds: a.overhead_rps_seconds,
        rps_rounds: a.overhead_rps_rounds,
        rps_concurrency: a.overhead_rps_concurrency.max(1),
        indexer_timeout_ms: a.overhead_indexer_timeout_ms,
        local_route_max_body_bytes: None,
        hung_case: true,
        dir: "overhead",
        seed: a.overhead_seed,
    };
    if !(a.overhead_sim_speedup.is_finite()
        && a.overhead_sim_speedup > 0.0
        && a.overhead_rps_seconds >= 0.0)
    {
        bail!("--overhead-sim-speedup must be > 0 and --overhead-rps-seconds >= 0");
    }
    Ok(overhead_args)
}

/// The fleet of the policies and overhead parts from the flags.
fn fleet(a: &Args) -> Result<Fleet> {
    let session_mode =
        SessionHeaderMode::parse(&a.session_header_mode).map_err(anyhow::Error::msg)?;
    if !(a.speedup.is_finite() && a.speedup > 0.0 && a.request_timeout_s > 0.0) {
        bail!("--speedup and --request-timeout-s must be > 0");
    }
    Ok(Fleet {
        workers: a.workers,
        block_size: a.block_size,
        num_gpu_blocks: a.num_gpu_blocks,
        sim_speedup: a.sim_speedup.unwrap_or(a.speedup),
        sim_args: a.sim_args.clone(),
        release: a.release_binaries.unwrap_or(!cfg!(debug_assertions)),
        session_header: a.session_header.clone(),
        session_mode,
        model: a.model.clone(),
        request_timeout: Duration::from_secs_f64(a.request_timeout_s),
        start_attempts: a.start_attempts,
        external: Vec::new(),
        engine_groups: Vec::new(),
    })
}

/// The policies part's workload (`--workload`), described in the manifest.
fn workload(a: &Args, manifest: &mut RunManifest) -> Result<Option<Workload>> {
    Ok(match a.workload.as_str() {
        "trace" => {
            let path = a
                .trace
                .clone()
                .unwrap_or_else(|| default_trace_path(std::env::var(TRACE_ENV).ok()));
            let file = std::fs::File::open(&path)
                .with_context(|| format!("opening trace {}", path.display()))?;
            let records = trace::parse(std::io::BufReader::new(file))?;
            let sel = Selection {
                window_start_ms: a.window_start_ms,
                window_ms: (a.window_ms > 0.0).then_some(a.window_ms),
                first: a.first,
            };
            let selected = sel.apply(&records);
            if selected.is_empty() {
                bail!("the selection ({}) holds no request", sel.describe());
            }
            let c = intrinsic(selected.iter().map(|s| &s.record));
            manifest.workload = Some(format!("Mooncake trace {}", path.display()));
            manifest.window = Some(format!("{} — {} requests", sel.describe(), selected.len()));
            manifest.ceiling = Some(c);
            Some(Workload::Trace {
                selected,
                speedup: a.speedup,
                max_concurrency: a.max_concurrency,
                token_seed: a.token_seed,
                anchor_block: a.anchor_block,
            })
        }
        "chat" => {
            let chat = ChatConfig {
                seed: a.chat_seed,
                sessions: a.chat_sessions,
                concurrent_sessions: a.chat_concurrent_sessions,
                turns_min: a.chat_turns_max.min(3),
                turns_max: a.chat_turns_max,
                system_prompt_words: a.chat_system_prompt_words,
                ..ChatConfig::default()
            };
            chat.validate().map_err(anyhow::Error::msg)?;
            manifest.workload = Some(chat.describe());
            manifest.window = Some("all sessions".into());
            Some(Workload::Chat(chat))
        }
        other => bail!("unknown --workload {other:?} (trace, chat)"),
    })
}

/// Runs the load sweep and adds its section (a sweep-only run's manifest describes the sweep);
/// returns the points that ran.
async fn sweep_part(
    a: &Args,
    fleet: &Fleet,
    parts: Parts,
    manifest: &mut RunManifest,
) -> Result<usize> {
    let (sweep_fleet, sweep_args) = sweep_setup(a, fleet)?;
    let report = sweep::run_sweep(&sweep_args, &sweep_fleet, &a.out).await?;
    let ran = report
        .workloads
        .iter()
        .map(|w| w.points.iter().filter(|p| p.error.is_none()).count())
        .sum::<usize>();
    let plots_ok = match plots::register_font(&a.font)
        .map_err(|e| e.to_string())
        .and_then(|()| sweep::draw(&report, &a.out))
    {
        Ok(_) => true,
        Err(e) => {
            eprintln!("sweep plots: {e}");
            false
        }
    };
    manifest.extra_sections.push(kvmesh_bench::manifest::ExtraSection {
        title: "Load sweep".into(),
        markdown: kvmesh_bench::report::sweep::render(&report, plots_ok),
    });
    if !parts.policies {
        manifest.title = Some("kvmesh load sweep".into());
        manifest.workload = Some(format!("load sweep: {}", a.sweep_workloads));
        manifest.window = Some("per point: see the sweep section".into());
        manifest.speedup = None;
        manifest.workers = (0..a.sweep_workers).map(|i| format!("w{i}")).collect();
        manifest.cache_capacity_blocks = Some(a.sweep_num_gpu_blocks);
    }
    Ok(ran)
}

/// Runs every policy on `workload` and records each (a failed one as failed); returns the
/// policies that ran.
async fn policies_part(
    policies: Vec<Policy>,
    fleet: &Fleet,
    workload: &Workload,
    out: &std::path::Path,
    manifest: &mut RunManifest,
) -> Result<usize> {
    let mut ran = 0usize;
    for policy in policies {
        match run_policy(policy, fleet, workload, out).await {
            Ok(r) => {
                ran += 1;
                if manifest.workers.is_empty() {
                    manifest.workers = r.worker_ids;
                }
                tracing::info!(
                    policy = policy.name(),
                    requests = r.requests,
                    failed = r.failed,
                    "recorded"
                );
                manifest.policies.push(r.entry);
            }
            Err(e) => {
                tracing::error!(
                    policy = policy.name(),
                    error = format!("{e:#}"),
                    "policy did not run"
                );
                manifest.policies.push(failed_policy(policy, out, &e)?);
            }
        }
    }
    Ok(ran)
}

/// Runs the overhead part and records it (or why it did not run); returns 1 when it produced
/// a case.
async fn overhead_part(
    a: &Args,
    overhead_args: &OverheadArgs,
    fleet: &Fleet,
    parts: Parts,
    manifest: &mut RunManifest,
) -> usize {
    let mut ran = 0usize;
    match run_overhead(overhead_args, fleet, &a.out).await {
        Ok(r) => {
            ran += usize::from(!r.cases.is_empty());
            manifest.overhead = r.cases;
            manifest.overhead_notes = Some(r.notes);
            manifest.extra_sections.extend(r.sections);
        }
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "overhead did not run");
            manifest.overhead_notes =
                Some(format!("**did not run**: {}", run::one_line(&format!("{e:#}"), 600)));
        }
    }
    ran += local_route_part(a, overhead_args, fleet, manifest).await;
    if manifest.workers.is_empty() {
        manifest.workers = (0..a.workers).map(|i| format!("w{i}")).collect();
    }
    if !parts.policies {
        manifest.title = Some("kvmesh router overhead".into());
        manifest.workload = Some(format!(
            "router overhead only: chat prompts of {} tokens, cold and continuation; shared prefixes of {} tokens",
            a.overhead_sizes, a.overhead_shared_prefixes
        ));
        manifest.window = Some("no trace replay".into());
        manifest.speedup = None;
    }
    ran
}

/// The overhead of `--overhead-local-sizes` again with the filter routing bodies of at most
/// `--overhead-local-route-max-body-bytes` alone: its cases, named `<case>_local_route`, join the
/// overhead table, its notes the overhead notes. Returns 1 when it produced a case.
async fn local_route_part(
    a: &Args,
    overhead_args: &OverheadArgs,
    fleet: &Fleet,
    manifest: &mut RunManifest,
) -> usize {
    let sizes = match parse_optional_sizes(&a.overhead_local_sizes) {
        Ok(sizes) if !sizes.is_empty() => sizes,
        Ok(_) => return 0,
        Err(e) => {
            tracing::error!(error = %e, "--overhead-local-sizes: the local-route overhead did not run");
            return 0;
        }
    };
    let args = OverheadArgs {
        sizes,
        shared_prefixes: Vec::new(),
        local_route_max_body_bytes: Some(a.overhead_local_route_max_body_bytes),
        hung_case: false,
        dir: "local-route/overhead",
        ..overhead_args.clone()
    };
    let heading = format!(
        "\n\n**`_local_route` cases**: the same cases on a fresh stack whose filter has `local_route_max_body_bytes: {}`, \
         so it routes these bodies alone (the session's remembered worker, else its rendezvous pin) without the `/v1/route` \
         call: not KV-aware routing, an operator's choice for short prompts (filter README, \"Routing short requests \
         locally\"). ",
        a.overhead_local_route_max_body_bytes
    );
    let notes = manifest.overhead_notes.get_or_insert_with(String::new);
    match run_overhead(&args, fleet, &a.out).await {
        Ok(r) => {
            notes.push_str(&heading);
            notes.push_str(&r.notes);
            let produced = usize::from(!r.cases.is_empty());
            manifest.overhead.extend(r.cases.into_iter().map(|mut c| {
                c.name.push_str("_local_route");
                c.local_route_max_body_bytes = args.local_route_max_body_bytes;
                c
            }));
            produced
        }
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "the local-route overhead did not run");
            notes.push_str(&format!(
                "{heading}**did not run**: {}",
                run::one_line(&format!("{e:#}"), 600)
            ));
            0
        }
    }
}

/// Runs the aiperf part on the sweep's fleet (workers, cache) — simulators at
/// `--aiperf-prefill-tokens-per-s`, or real vLLM engines started once for all policies
/// (`--engines vllm`) — and adds its section; returns the policies aiperf measured.
async fn aiperf_part(
    a: &Args,
    fleet: &Fleet,
    parts: Parts,
    manifest: &mut RunManifest,
) -> Result<usize> {
    let mut aiperf_fleet =
        Fleet { workers: a.sweep_workers, num_gpu_blocks: a.sweep_num_gpu_blocks, ..fleet.clone() };
    // Real engines live until the part returns.
    let (_engines, fleet_note) = match vllm_options(a)? {
        None => {
            let timing = kvmesh_bench::sweep::FleetTiming::new(1.0, a.aiperf_prefill_tokens_per_s)
                .map_err(anyhow::Error::msg)?;
            aiperf_fleet = sweep::workload_fleet(&aiperf_fleet, &timing);
            let note = format!(
                "{} vllm-sim workers × {} blocks of {} tokens, {}",
                aiperf_fleet.workers,
                aiperf_fleet.num_gpu_blocks,
                aiperf_fleet.block_size,
                timing.describe()
            );
            (Vec::new(), note)
        }
        Some(opts) => {
            let engines = sweep::start_real_engines(
                &mut aiperf_fleet,
                &opts,
                &a.out.join("aiperf").join("engines"),
            )
            .await?;
            (
                engines,
                format!(
                    "{}; started once, prefix caches reset before every policy",
                    vllm_fleet(aiperf_fleet.workers, aiperf_fleet.block_size, &opts)
                ),
            )
        }
    };
    let mut workload = AiperfWorkload {
        request_rate: a.aiperf_rate,
        duration_s: a.aiperf_duration_s,
        seed: a.aiperf_seed,
        ..AiperfWorkload::default()
    };
    if let Some(scale) = a.aiperf_scale {
        workload = workload.scaled(scale).map_err(anyhow::Error::msg)?;
    }
    let args = aiperf::AiperfArgs {
        bin: a.aiperf_bin.clone(),
        tokenizer_dir: aiperf::default_tokenizer_dir(),
        policies: Policy::parse_list(&a.aiperf_policies).map_err(anyhow::Error::msg)?,
        workload,
    };
    let (section, ran) = aiperf::run_aiperf(&args, &aiperf_fleet, &fleet_note, &a.out).await?;
    manifest.extra_sections.push(section);
    if !(parts.policies || parts.sweep || parts.overhead) {
        manifest.title = Some("kvmesh under aiperf".into());
        manifest.workload = Some("aiperf: see its section".into());
        manifest.window = Some("aiperf's benchmark duration".into());
        manifest.speedup = None;
        manifest.workers = (0..a.sweep_workers).map(|i| format!("w{i}")).collect();
        manifest.cache_capacity_blocks = Some(a.sweep_num_gpu_blocks);
    }
    Ok(ran)
}

/// The indexer's microbenchmark section from `--indexer-figures`. Unreadable figures must not
/// cost the run its report: the section says what happened.
fn indexer_figures(path: &std::path::Path) -> kvmesh_bench::manifest::ExtraSection {
    match std::fs::read_to_string(path) {
        Ok(text) => micro::section(&micro::parse(&text), &path.display().to_string()),
        Err(e) => kvmesh_bench::manifest::ExtraSection {
            title: micro::TITLE.into(),
            markdown: format!("Not available: reading `{}`: {e}.", path.display()),
        },
    }
}

/// Writes `run.json`, renders the report and prints its path; an error when nothing ran.
fn write_report(a: &Args, manifest: &RunManifest, ran: usize) -> Result<()> {
    let manifest_path = a.out.join("run.json");
    std::fs::write(&manifest_path, serde_json::to_string_pretty(manifest)?)
        .with_context(|| format!("writing {}", manifest_path.display()))?;
    let written = generate(&manifest_path, &a.out, &a.font)?;
    println!("{}", written.markdown.display());
    if let Some(note) = &written.plot_note {
        eprintln!("plots: {note}");
    }
    if ran == 0 {
        bail!("nothing ran (no policy, no overhead case); see {}", written.markdown.display());
    }
    Ok(())
}
