//! The router-overhead part of the run: one stack, one Envoy with a kvmesh (wasm), an ext_proc
//! and a plain listener, interleaved latency samples, then closed-loop requests/s rounds.
//!
//! 1. Start the stack through the harness (vllm-sim workers at a very large `--speedup`, the
//!    indexer in precise mode serving the endpoint picker too, Envoy), then replace its Envoy by
//!    one started from the kvmesh bootstrap extended by `overhead::gateway::add_plain_path` and
//!    `add_ext_proc_path` (same ports, same filter configuration), so every path is one Envoy
//!    process.
//! 2. Warm up every path until the filter and the picker route through the indexer (they have
//!    their fleet).
//! 3. Prime the continuation bases and the shared prefixes through kvmesh, in steps, as
//!    conversations grow (the picker shares the indexer, so its continuations find them too).
//! 4. Latency: for sample n of every case in turn, one request per path, one at a time, the
//!    order rotating with n — drift and background work hit every path alike.
//!    `max_tokens: 1`, so the engine's part is tokenizing the prompt plus one step.
//! 5. Join Envoy's access log (gateway time per request), write `<dir>/samples.jsonl`.
//! 6. Requests/s: per case, `rounds` × (one round per path), order rotating, against the canned
//!    route (nothing forwarded; the filter, the picker and the indexer still do all their work).
//!    Around each round (for kvmesh paths until the indexer is idle again) Envoy's, the
//!    indexer's and the client's CPU time and the indexer's answered routes are read: CPU per
//!    request per process, route throughput per indexer core.
//! 7. The indexer hung (issue 14.3, last: it disturbs the stack): SIGSTOP, requests until the
//!    filter's breaker is seen open, interleaved latency samples as in step 4, a concurrent burst;
//!    Envoy's connections to the indexer sampled throughout; SIGCONT (also on any error: the
//!    guard's drop), then the time until a request is routed by the indexer again.

pub mod command;
mod envoy;
mod indexer_hung;
mod measure;
mod notes;
mod prime;

use envoy::*;
use indexer_hung::*;
use measure::*;
use notes::*;
use prime::*;

use crate::run::Fleet;
use anyhow::{bail, Context, Result};
use kvmesh_bench::chat::History;
use kvmesh_bench::client::{build_client, discover_model};
use kvmesh_bench::manifest::{ExtraSection, OverheadCase};
use kvmesh_bench::overhead::cases::{
    base_conversation, base_seed, cases, cold_request, cold_seed, cold_template, next_turn,
    shared_prefix_request, shared_prefix_seed, Case, Kind, Shape, Size,
};
use kvmesh_bench::overhead::drive::cpu_ticks;
use kvmesh_bench::overhead::drive::{
    closed_loop, indexer_timers, join_access_log, settle, settle_cpu, tagged,
};
use kvmesh_bench::overhead::gateway::{add_ext_proc_path, add_plain_path};
use kvmesh_bench::overhead::hung::{
    self, hung_route, open_streak, Burst, HungIndexer, HungRoute, HUNG_CASE, HUNG_PROMPT_TOKENS,
    OPEN_STREAK,
};
use kvmesh_bench::overhead::summary::{
    order, routed_without_indexer, summarize, IndexerTimers, Path as Way, Rate, Sample, PICKER_PIN,
};
use kvmesh_bench::policy::Policy;
use kvmesh_e2e::envoy_config::{render_bootstrap, BootstrapVars, BootstrapWorker};
use kvmesh_e2e::procs::{free_port, Paused, Proc};
use kvmesh_e2e::stack::{envoy_binary, wasm_path, Edge, EnvoyPolicy, Stack, StackSpec};
use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Settings of the overhead part.
#[derive(Debug, Clone)]
pub struct OverheadSettings {
    pub sizes: Vec<Size>,
    /// Shared-prefix sizes (one shared-prefix case each; may be empty).
    pub shared_prefixes: Vec<Size>,
    /// Latency samples per case and path.
    pub samples: usize,
    /// Continuation bases per size (samples cycle through them); also the conversations
    /// interleaved on each shared prefix.
    pub bases: usize,
    pub sim_speedup: f64,
    pub rps_seconds: f64,
    pub rps_rounds: usize,
    pub rps_concurrency: usize,
    /// The filter's `indexer_timeout_ms` (None: the filter's default).
    pub indexer_timeout_ms: Option<u64>,
    /// The filter's `local_route_max_body_bytes` (None: the filter's default, off).
    pub local_route_max_body_bytes: Option<usize>,
    /// Whether step 7 (the indexer hung) runs.
    pub hung_case: bool,
    /// Whether the ext_proc path (Envoy's ext_proc filter calling the indexer's picker) is
    /// measured beside the wasm filter.
    pub ext_proc: bool,
    /// Where under `--out` the run writes its samples and stack (`overhead`; the local-route run
    /// `local-route/overhead`); the notes name its samples file by it.
    pub dir: &'static str,
    pub seed: u64,
}

/// What the part produced.
pub struct OverheadRun {
    pub cases: Vec<OverheadCase>,
    pub notes: String,
    /// Report sections of their own (the hung-indexer case).
    pub sections: Vec<ExtraSection>,
}

/// Deadline of one latency sample or priming request.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(60);
/// Deadline of one closed-loop request.
const RPS_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for one sample's tokenization to be recorded.
const SETTLE_SAMPLE: Duration = Duration::from_secs(5);
/// Longest wait for the indexer to go idle after a requests/s round.
const SETTLE_ROUND: Duration = Duration::from_secs(120);
/// "Idle": at most this many CPU ticks (1/100 s) in a 250 ms window, i.e. ≤ 8% of a core.
const IDLE_TICKS: u64 = 2;
/// Warm-up requests per path.
const WARMUP: usize = 16;
/// Envoy's worker threads (`--concurrency`): one filter breaker and one connection pool to the
/// indexer each.
const ENVOY_CONCURRENCY: u32 = 2;
/// Seed phase of the hung-indexer case's requests (the latency phase is 0, warm-up 9, the
/// requests/s rounds from [`RPS_PHASE`]).
const HUNG_PHASE: u64 = 1 << 20;
/// Seed phase of the first requests/s round (round r on path p: `RPS_PHASE + 3r + p.index()`).
const RPS_PHASE: u64 = 16;
/// Closed-loop clients of the burst while the indexer hangs (the concurrency).
const HUNG_BURST_CONCURRENCY: usize = 50;
/// Longest burst while the indexer hangs (the requests/s round length when shorter).
const HUNG_BURST: Duration = Duration::from_secs(2);
/// How often Envoy's connections to the indexer are read during the hang.
const CX_EVERY: Duration = Duration::from_millis(20);
/// Between resume probes after SIGCONT.
const RESUME_EVERY: Duration = Duration::from_millis(10);

/// Runs the overhead part; writes `<out>/<args.dir>/{samples.jsonl,stack/}`.
pub async fn run_overhead(
    args: &OverheadSettings,
    fleet: &Fleet,
    out: &Path,
) -> Result<OverheadRun> {
    let dir = out.join(args.dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let shape = Shape::default();
    let all_cases = cases(&args.sizes, &args.shared_prefixes);

    tracing::info!(cases = all_cases.len(), samples = args.samples, "overhead: starting the stack");
    let Started { stack, access_log, urls, client, model } = start(args, fleet, &dir).await?;
    let pids = Pids {
        envoy: stack.envoy.as_ref().map(Proc::pid),
        indexer: stack.indexer.as_ref().map(Proc::pid),
    };
    let (texts, prime_fallbacks) = prime_texts(&client, &urls, &model, args, &shape).await?;

    let metrics_url = stack.indexer_url("/metrics");
    let phase = Phase {
        args,
        client: &client,
        urls: &urls,
        model: &model,
        shape: &shape,
        texts: &texts,
        metrics_url: &metrics_url,
    };
    let (mut samples, latency_start) = latency_samples(&phase, &all_cases).await;
    let missing_log =
        join_access_log(&access_log, &mut samples, kvmesh_e2e::poll::patience()).await;
    write_jsonl(&dir.join("samples.jsonl"), &samples)?;
    let latency_s = latency_start.elapsed().as_secs_f64();

    let rates = rps_rounds(&phase, &all_cases, pids).await;
    let mut sections = Vec::new();
    if args.hung_case {
        let hung = hung_indexer(&stack, &client, &urls, &model, args, &access_log, &shape).await;
        sections.push(ExtraSection {
            title: "Router overhead with the indexer hung (SIGSTOP)".into(),
            markdown: hung_section(&dir, hung)?,
        });
    }
    drop(stack);

    let (out_cases, missing) = case_summaries(&all_cases, &urls.ways(), &samples, &rates);
    let mut notes = setup_notes(args, fleet, &shape, prime_fallbacks, latency_s, &rates);
    notes.push_str(&missing_notes(missing_log, &missing));
    Ok(OverheadRun { cases: out_cases, notes, sections })
}

/// The started stack (its Envoy swapped for the two-listener one) and what talks to it.
struct Started {
    stack: Stack,
    access_log: std::path::PathBuf,
    urls: Urls,
    client: reqwest::Client,
    model: String,
}

/// The processes whose CPU time the requests/s rounds read (the client is this process).
#[derive(Debug, Clone, Copy)]
struct Pids {
    envoy: Option<u32>,
    indexer: Option<u32>,
}

/// Step 1: starts the stack, swaps its Envoy, finds the model.
async fn start(args: &OverheadSettings, fleet: &Fleet, dir: &Path) -> Result<Started> {
    let mut stack =
        Stack::start(spec(args, fleet, dir)).await.context("starting the overhead stack")?;
    let Swapped { plain_port, ext_proc_port, access_log } =
        swap_envoy(&mut stack, args.ext_proc).await?;
    let local = |port: u16| format!("http://127.0.0.1:{port}/v1/chat/completions");
    let urls = Urls {
        kvmesh: stack.gateway("/v1/chat/completions"),
        plain: local(plain_port),
        ext_proc: ext_proc_port.map(local),
    };
    let client = build_client(Duration::from_secs(5), 1024)?;
    let model = match &fleet.model {
        Some(m) => m.clone(),
        None => discover_model(&client, &stack.gateway(""), Duration::from_secs(30))
            .await
            .map_err(anyhow::Error::msg)?,
    };
    Ok(Started { stack, access_log, urls, client, model })
}
