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

mod overhead;
mod run;

use anyhow::{bail, Context, Result};
use clap::Parser;
use kvmesh_bench::ceiling::intrinsic;
use kvmesh_bench::chat::ChatConfig;
use kvmesh_bench::conversation::DEFAULT_ANCHOR_BLOCK;
use kvmesh_bench::manifest::RunManifest;
use kvmesh_bench::micro;
use kvmesh_bench::overhead::plan::parse_sizes;
use kvmesh_bench::policy::{shell_quote, Policy, SessionHeaderMode};
use kvmesh_bench::report::{generate, plots};
use kvmesh_bench::trace::{self, default_trace_path, Selection, TRACE_ENV};
use overhead::{run_overhead, OverheadArgs};
use run::{failed_policy, run_policy, Fleet, Workload};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(name = "kvmesh-bench", version, about = "Replay one workload through every routing policy and write a report")]
struct Args {
    /// Output directory (results, counters, stack logs, run.json, report.md, plots).
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Policies to run, comma-separated, in report order.
    #[arg(long, default_value = "round_robin,least_request,ring_hash,kvmesh_approximate,kvmesh_precise")]
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

    /// Parts to run, comma-separated: `policies` (the replay under every policy), `overhead`.
    #[arg(long, default_value = "policies,overhead")]
    only: String,
    /// Overhead: chat prompt sizes in tokens (`k` = 1024), each measured cold and as a continuation.
    #[arg(long, default_value = "1k,8k,32k")]
    overhead_sizes: String,
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
    policies: bool,
    overhead: bool,
}

impl Parts {
    fn parse(s: &str) -> Result<Self> {
        let mut p = Parts { policies: false, overhead: false };
        for part in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            match part {
                "policies" => p.policies = true,
                "overhead" => p.overhead = true,
                other => bail!("unknown --only part {other:?} (policies, overhead)"),
            }
        }
        if !(p.policies || p.overhead) {
            bail!("--only selects nothing");
        }
        Ok(p)
    }
}

fn command_line() -> String {
    std::env::args().map(|a| shell_quote(&a)).collect::<Vec<_>>().join(" ")
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
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
    let policies = if parts.policies { Policy::parse_list(&a.policies).map_err(anyhow::Error::msg)? } else { Vec::new() };
    let overhead_args = OverheadArgs {
        sizes: parse_sizes(&a.overhead_sizes).map_err(anyhow::Error::msg)?,
        samples: a.overhead_samples.max(1),
        bases: a.overhead_bases.max(1),
        sim_speedup: a.overhead_sim_speedup,
        rps_seconds: a.overhead_rps_seconds,
        rps_rounds: a.overhead_rps_rounds,
        rps_concurrency: a.overhead_rps_concurrency.max(1),
        indexer_timeout_ms: a.overhead_indexer_timeout_ms,
        seed: a.overhead_seed,
    };
    if !(a.overhead_sim_speedup.is_finite() && a.overhead_sim_speedup > 0.0 && a.overhead_rps_seconds >= 0.0) {
        bail!("--overhead-sim-speedup must be > 0 and --overhead-rps-seconds >= 0");
    }
    let session_mode = SessionHeaderMode::parse(&a.session_header_mode).map_err(anyhow::Error::msg)?;
    if !(a.speedup.is_finite() && a.speedup > 0.0 && a.request_timeout_s > 0.0) {
        bail!("--speedup and --request-timeout-s must be > 0");
    }
    let fleet = Fleet {
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
    };

    let mut manifest = RunManifest {
        title: Some("kvmesh routing policies, side by side".into()),
        speedup: Some(a.speedup),
        cache_capacity_blocks: Some(a.num_gpu_blocks),
        engine_block_size: Some(a.block_size),
        commands: vec!["make bench".into(), command_line()],
        ..Default::default()
    };
    let workload = match a.workload.as_str() {
        _ if !parts.policies => None,
        "trace" => {
            let path = a.trace.clone().unwrap_or_else(|| default_trace_path(std::env::var(TRACE_ENV).ok()));
            let file = std::fs::File::open(&path).with_context(|| format!("opening trace {}", path.display()))?;
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
    };

    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let mut ran = 0usize;
    for policy in policies {
        let Some(workload) = &workload else { break };
        match run_policy(policy, &fleet, workload, &a.out).await {
            Ok(r) => {
                ran += 1;
                if manifest.workers.is_empty() {
                    manifest.workers = r.worker_ids;
                }
                tracing::info!(policy = policy.name(), requests = r.requests, failed = r.failed, "recorded");
                manifest.policies.push(r.entry);
            }
            Err(e) => {
                tracing::error!(policy = policy.name(), error = format!("{e:#}"), "policy did not run");
                manifest.policies.push(failed_policy(policy, &a.out, &e)?);
            }
        }
    }
    if parts.overhead {
        match run_overhead(&overhead_args, &fleet, &a.out).await {
            Ok(r) => {
                ran += usize::from(!r.cases.is_empty());
                manifest.overhead = r.cases;
                manifest.overhead_notes = Some(r.notes);
            }
            Err(e) => {
                tracing::error!(error = format!("{e:#}"), "overhead did not run");
                manifest.overhead_notes = Some(format!("**did not run**: {}", run::one_line(&format!("{e:#}"), 600)));
            }
        }
        if manifest.workers.is_empty() {
            manifest.workers = (0..a.workers).map(|i| format!("w{i}")).collect();
        }
        if !parts.policies {
            manifest.title = Some("kvmesh router overhead".into());
            manifest.workload = Some(format!("router overhead only: chat prompts of {} tokens, cold and continuation", a.overhead_sizes));
            manifest.window = Some("no trace replay".into());
            manifest.speedup = None;
        }
    }
    if let Some(path) = &a.indexer_figures {
        // Unreadable figures must not cost the run its report: the section says what happened.
        let section = match std::fs::read_to_string(path) {
            Ok(text) => micro::section(&micro::parse(&text), &path.display().to_string()),
            Err(e) => kvmesh_bench::manifest::ExtraSection {
                title: micro::TITLE.into(),
                markdown: format!("Not available: reading `{}`: {e}.", path.display()),
            },
        };
        manifest.extra_sections.push(section);
    }
    let manifest_path = a.out.join("run.json");
    std::fs::write(&manifest_path, serde_json::to_string_pretty(&manifest)?)
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
