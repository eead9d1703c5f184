//! The router-overhead part of the run: one stack, one Envoy with a kvmesh and a plain listener,
//! interleaved latency samples, then closed-loop requests/s rounds.
//!
//! 1. Start the stack through the harness (vllm-sim workers at a very large `--speedup`, the
//!    indexer in precise mode, Envoy), then replace its Envoy by one started from the same
//!    rendered bootstrap extended by `overhead::gateway::add_plain_path` (same ports, same
//!    filter configuration), so both paths are one Envoy process.
//! 2. Warm up both paths until the filter routes through the indexer (it has its fleet).
//! 3. Prime the continuation bases and the shared prefixes through kvmesh, in steps, as
//!    conversations grow.
//! 4. Latency: for sample n of every case in turn, one kvmesh and one plain request, one at a
//!    time, the order alternating with n — drift and background work hit both paths alike.
//!    `max_tokens: 1`, so the engine's part is tokenizing the prompt plus one step.
//! 5. Join Envoy's access log (gateway time per request), write `<dir>/samples.jsonl`.
//! 6. Requests/s: per case, `rounds` × (kvmesh round, plain round), order alternating, against
//!    the canned route (nothing forwarded; the filter and indexer still do all their work). Around
//!    each kvmesh round (until the indexer is idle again) the indexer's CPU time and answered
//!    routes are read: route throughput per indexer core.
//! 7. The indexer hung (issue 14.3, last: it disturbs the stack): SIGSTOP, requests until the
//!    filter's breaker is seen open, interleaved latency samples as in step 4, a concurrent burst;
//!    Envoy's connections to the indexer sampled throughout; SIGCONT (also on any error: the
//!    guard's drop), then the time until a request is routed by the indexer again.

use crate::run::Fleet;
use anyhow::{bail, Context, Result};
use kvmesh_bench::chat::History;
use kvmesh_bench::client::{build_client, discover_model};
use kvmesh_bench::manifest::{ExtraSection, OverheadCase};
use kvmesh_bench::overhead::drive::cpu_ticks;
use kvmesh_bench::overhead::drive::{
    closed_loop, indexer_timers, join_access_log, settle, settle_cpu, tagged,
};
use kvmesh_bench::overhead::gateway::add_plain_path;
use kvmesh_bench::overhead::hung::{
    self, hung_route, open_streak, Burst, HungIndexer, HungRoute, HUNG_CASE, HUNG_PROMPT_TOKENS,
    OPEN_STREAK,
};
use kvmesh_bench::overhead::plan::{
    base_conversation, base_seed, cases, cold_request, cold_seed, cold_template, next_turn,
    shared_prefix_request, shared_prefix_seed, Case, Kind, Shape, Size,
};
use kvmesh_bench::overhead::summary::{summarize, IndexerTimers, Path as Way, Rate, Sample};
use kvmesh_bench::policy::Policy;
use kvmesh_e2e::envoy_config::{render_bootstrap, BootstrapVars, BootstrapWorker};
use kvmesh_e2e::procs::{free_port, Paused, Proc};
use kvmesh_e2e::stack::{envoy_binary, wasm_path, EnvoyPolicy, Stack, StackSpec};
use std::collections::HashMap;
use std::io::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Settings of the overhead part.
#[derive(Debug, Clone)]
pub struct OverheadArgs {
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
/// requests/s rounds 1 + 2 × round + path).
const HUNG_PHASE: u64 = 1 << 20;
/// Closed-loop clients of the burst while the indexer hangs (the concurrency).
const HUNG_BURST_CONCURRENCY: usize = 50;
/// Longest burst while the indexer hangs (the requests/s round length when shorter).
const HUNG_BURST: Duration = Duration::from_secs(2);
/// How often Envoy's connections to the indexer are read during the hang.
const CX_EVERY: Duration = Duration::from_millis(20);
/// Between resume probes after SIGCONT.
const RESUME_EVERY: Duration = Duration::from_millis(10);

fn spec(args: &OverheadArgs, fleet: &Fleet, dir: &Path) -> StackSpec {
    let mut spec = StackSpec::aggregate(fleet.workers);
    spec.policy = EnvoyPolicy::Kvmesh;
    spec.block_size = fleet.block_size;
    spec.sim_args = vec![
        "--num-gpu-blocks".into(),
        fleet.num_gpu_blocks.to_string(),
        "--speedup".into(),
        args.sim_speedup.to_string(),
    ];
    spec.sim_args.extend(fleet.sim_args.iter().cloned());
    spec.kv_events = true;
    spec.routing_toml = Policy::KvmeshPrecise.routing_toml().to_string();
    let mut filter = serde_json::json!({ "debug_headers": true });
    if let Some(t) = args.indexer_timeout_ms {
        filter["indexer_timeout_ms"] = t.into();
    }
    if let Some(b) = args.local_route_max_body_bytes {
        filter["local_route_max_body_bytes"] = b.into();
    }
    spec.filter_config = filter;
    spec.session_header = fleet.session_header.clone();
    spec.release = fleet.release;
    spec.work_dir = Some(dir.join("stack"));
    spec
}

/// Replaces the stack's Envoy by one with the plain twin listener; returns the plain port and
/// the access log path.
async fn swap_envoy(stack: &mut Stack) -> Result<(u16, std::path::PathBuf)> {
    let vars = BootstrapVars {
        listen_host: "127.0.0.1".into(),
        listen_port: stack.gateway_port,
        admin_port: stack.admin_port,
        indexer_host: "127.0.0.1".into(),
        indexer_port: stack.indexer_port,
        wasm_path: wasm_path()?.display().to_string(),
        filter_config_json: stack.filter_config().to_string(),
        workers: stack
            .workers
            .iter()
            .filter(|w| w.role.decodes())
            .map(|w| {
                let (host, port) =
                    w.http.rsplit_once(':').with_context(|| format!("bad address {}", w.http))?;
                Ok(BootstrapWorker {
                    id: w.id.clone(),
                    host: host.to_string(),
                    port: port.parse()?,
                })
            })
            .collect::<Result<_>>()?,
        max_body_bytes: stack.spec.max_body_bytes,
        policy: "kvmesh".into(),
        session_header: stack.spec.session_header.clone(),
        upstream_timeout_s: 300,
        indexer_max_connections: kvmesh_e2e::envoy_config::DEFAULT_INDEXER_MAX_CONNECTIONS,
        wasm_failure_policy: kvmesh_e2e::envoy_config::DEFAULT_WASM_FAILURE_POLICY.into(),
    };
    let rendered: serde_json::Value = serde_yaml::from_str(&render_bootstrap(&vars)?)
        .context("parsing the rendered bootstrap")?;
    let plain_port = free_port()?;
    let dir = stack.dir().to_path_buf();
    let log = dir.join("overhead-access.jsonl");
    let _ = std::fs::remove_file(&log);
    let bootstrap = add_plain_path(&rendered, plain_port, &log.display().to_string())?;
    let path = dir.join("envoy-overhead.yaml");
    std::fs::write(&path, bootstrap.to_string())?;

    if let Some(mut old) = stack.envoy.take() {
        old.kill();
    }
    let mut cmd = std::process::Command::new(envoy_binary()?);
    cmd.arg("-c")
        .arg(&path)
        .args(["--disable-hot-restart", "--concurrency"])
        .arg(ENVOY_CONCURRENCY.to_string())
        .args(["-l", "info"]);
    cmd.args(["--file-flush-interval-msec", "100"])
        .arg("--log-path")
        .arg(dir.join("envoy-overhead-app.log"));
    let mut proc = Proc::spawn("envoy-overhead", cmd, &dir)?;
    let client = stack.client().clone();
    let ready = stack.admin("/ready");
    let deadline = Instant::now() + kvmesh_e2e::poll::patience();
    loop {
        if matches!(client.get(&ready).send().await, Ok(r) if r.status().is_success()) {
            break;
        }
        if !proc.is_running() {
            bail!("envoy (overhead bootstrap) exited before it was ready:\n{}", proc.log_tail(60));
        }
        if Instant::now() > deadline {
            bail!("envoy (overhead bootstrap) not ready in time:\n{}", proc.log_tail(60));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stack.envoy = Some(proc);
    Ok((plain_port, log))
}

fn body(h: &History, model: &str) -> Vec<u8> {
    h.body(model, 1, true).to_string().into_bytes()
}

struct Urls {
    kvmesh: String,
    plain: String,
}

impl Urls {
    fn of(&self, way: Way) -> &str {
        match way {
            Way::Kvmesh => &self.kvmesh,
            Way::Plain => &self.plain,
        }
    }
}

/// Warm both paths (connections, the filter's fleet snapshot); fails when the filter never
/// routes through the indexer (or, for bodies it routes locally, never names a worker).
async fn warm_up(
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    template: &History,
    seed: u64,
) -> Result<()> {
    let deadline = Instant::now() + kvmesh_e2e::poll::patience();
    let mut routed = false;
    let mut n = 0u64;
    while n < WARMUP as u64 || !routed {
        if Instant::now() > deadline {
            bail!("warm-up: the filter did not route through the indexer in time");
        }
        let h = cold_request(template, cold_seed(seed, 9, 0, n));
        for way in [Way::Kvmesh, Way::Plain] {
            let o = tagged(
                client,
                urls.of(way),
                body(&h, model),
                &format!("warm-{n}-{}", way.tag()),
                SAMPLE_TIMEOUT,
            )
            .await;
            if let Some(e) = &o.error {
                tracing::warn!(path = way.tag(), error = %e, "warm-up request failed");
            } else if way == Way::Kvmesh
                && o.fallback.is_none()
                && (o.decision_mode.is_some() || o.decision_worker.is_some())
            {
                // A decision, or a local route (`local_route_max_body_bytes`) that found a worker:
                // either way the filter has its fleet.
                routed = true;
            }
        }
        n += 1;
    }
    Ok(())
}

/// Sends one base's priming requests through kvmesh; returns how many were routed without the
/// indexer.
async fn prime_one(
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    base: &kvmesh_bench::overhead::plan::Base,
    what: &str,
) -> u64 {
    let mut fallbacks = 0;
    for (i, h) in base.primes.iter().enumerate() {
        let o = tagged(
            client,
            &urls.kvmesh,
            body(h, model),
            &format!("prime-{what}-{i}"),
            SAMPLE_TIMEOUT,
        )
        .await;
        fallbacks += u64::from(o.fallback.is_some());
        if let Some(e) = o.error {
            tracing::warn!(base = what, step = i, error = %e, "priming request failed");
        }
    }
    fallbacks
}

/// Primes every continuation base and every shared prefix through kvmesh; returns the bases per
/// size, the shared prefixes, and how many priming requests were routed without the indexer.
async fn prime(
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    args: &OverheadArgs,
    shape: &Shape,
) -> (Vec<Vec<History>>, Vec<History>, u64) {
    let mut all = Vec::new();
    let mut fallbacks = 0;
    for (si, size) in args.sizes.iter().enumerate() {
        let mut bases = Vec::new();
        for b in 0..args.bases.max(1) {
            let base = base_conversation(base_seed(args.seed, si, b), size.tokens, shape);
            fallbacks +=
                prime_one(client, urls, model, &base, &format!("{}-{b}", size.label)).await;
            bases.push(base.base);
        }
        all.push(bases);
    }
    let mut shared = Vec::new();
    for (si, size) in args.shared_prefixes.iter().enumerate() {
        let base = base_conversation(shared_prefix_seed(args.seed, si), size.tokens, shape);
        fallbacks += prime_one(client, urls, model, &base, &format!("shared-{}", size.label)).await;
        shared.push(base.base);
    }
    (all, shared, fallbacks)
}

/// The conversations requests are made from, per size: cold templates and continuation bases;
/// per shared-prefix size: the prefix.
struct Texts {
    cold: Vec<History>,
    bases: Vec<Vec<History>>,
    shared: Vec<History>,
}

fn request_for(
    case: &Case,
    size_index: usize,
    texts: &Texts,
    n: u64,
    way: Way,
    args: &OverheadArgs,
    shape: &Shape,
) -> History {
    let bases = &texts.bases;
    match case.kind {
        // Distinct content per request and path: neither path's request warms the other's.
        Kind::Cold => cold_request(
            &texts.cold[size_index],
            cold_seed(args.seed, 0, size_index, 2 * n + u64::from(way == Way::Plain)),
        ),
        Kind::Continuation => {
            let list = &bases[size_index];
            next_turn(
                &list[(n as usize) % list.len()],
                (n << 1) | u64::from(way == Way::Plain),
                shape,
            )
        }
        Kind::SharedPrefix => {
            shared_prefix_request(
                &texts.shared[size_index],
                args.bases,
                n,
                u64::from(way == Way::Plain),
                shape,
            )
            .0
        }
    }
}

/// Peak `upstream_cx_active` of Envoy's indexer cluster, read every [`CX_EVERY`] until `stop`.
fn sample_indexer_connections(
    client: reqwest::Client,
    admin: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Option<u64>> {
    let url =
        format!("{admin}/stats/prometheus?filter=^cluster\\.kvmesh_indexer\\.upstream_cx_active$");
    tokio::spawn(async move {
        let peak = AtomicU64::new(0);
        let mut read = false;
        while !stop.load(Ordering::Relaxed) {
            let text = async { client.get(&url).send().await.ok()?.text().await.ok() };
            let n = tokio::time::timeout(Duration::from_secs(2), text)
                .await
                .ok()
                .flatten()
                .and_then(|t| kvmesh_e2e::prom::Metrics::parse(&t).ok())
                .and_then(|m| {
                    m.select(
                        "envoy_cluster_upstream_cx_active",
                        &[("envoy_cluster_name", "kvmesh_indexer")],
                    )
                    .next()
                    .map(|s| s.value)
                });
            if let Some(n) = n.filter(|n| n.is_finite() && *n >= 0.0) {
                read = true;
                peak.fetch_max(n as u64, Ordering::Relaxed);
            }
            tokio::time::sleep(CX_EVERY).await;
        }
        read.then(|| peak.load(Ordering::Relaxed))
    })
}

/// The hung-indexer case (step 7): returns the measurements and the case's samples.
async fn hung_indexer(
    stack: &Stack,
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    args: &OverheadArgs,
    access_log: &Path,
    shape: &Shape,
) -> Result<(HungIndexer, Vec<Sample>)> {
    let pid = stack.indexer.as_ref().map(Proc::pid).context("the stack has no indexer")?;
    let template = cold_template(HUNG_PROMPT_TOKENS, shape);
    let request = |phase: u64, n: u64| {
        body(&cold_request(&template, cold_seed(args.seed, phase, 0, n)), model)
    };
    let mut h = HungIndexer {
        indexer_timeout_ms: args
            .indexer_timeout_ms
            .unwrap_or(kvmesh_core::filter_config::DEFAULT_INDEXER_TIMEOUT_MS),
        connection_bound: u64::from(
            kvmesh_e2e::envoy_config::DEFAULT_INDEXER_MAX_CONNECTIONS + ENVOY_CONCURRENCY,
        ),
        ..Default::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let paused = Paused::stop(pid)?;
    let sampler = sample_indexer_connections(client.clone(), stack.admin(""), Arc::clone(&stop));
    tracing::info!(pid, "overhead: indexer stopped (SIGSTOP)");

    // Until the breaker is seen open: every call before waits for the deadline.
    let hung_at = Instant::now();
    let deadline = hung_at + kvmesh_e2e::poll::patience();
    let mut streak = 0;
    while streak < OPEN_STREAK && Instant::now() < deadline {
        let id = format!("hung-open-{}", h.opening_requests);
        let o = tagged(
            client,
            &urls.kvmesh,
            request(HUNG_PHASE, h.opening_requests),
            &id,
            SAMPLE_TIMEOUT,
        )
        .await;
        h.opening_requests += 1;
        streak = open_streak(streak, o.fallback.as_deref());
    }
    h.opening_ms = (streak >= OPEN_STREAK).then(|| hung_at.elapsed().as_secs_f64() * 1e3);

    // With the breaker open: interleaved samples as in the latency phase.
    let mut samples = Vec::new();
    if h.opening_ms.is_some() {
        for n in 0..args.samples as u64 {
            let order =
                if n % 2 == 0 { [Way::Kvmesh, Way::Plain] } else { [Way::Plain, Way::Kvmesh] };
            for way in order {
                let id = format!("{HUNG_CASE}-{n}-{}", way.tag());
                let b = request(HUNG_PHASE + 1, 2 * n + u64::from(way == Way::Plain));
                let o = tagged(client, urls.of(way), b, &id, SAMPLE_TIMEOUT).await;
                if way == Way::Kvmesh {
                    match hung_route(o.fallback.as_deref()) {
                        HungRoute::Skipped => h.skipped += 1,
                        HungRoute::Waited => h.waited += 1,
                        HungRoute::Other => {}
                    }
                }
                samples.push(Sample::measured(HUNG_CASE.to_string(), way, n, id, o));
            }
        }
    }

    // Concurrency against the hung indexer: the connections must stay bounded.
    if args.rps_seconds > 0.0 {
        let make = {
            let (template, model, seed) = (template.clone(), model.to_string(), args.seed);
            Arc::new(move |n: u64| {
                body(&cold_request(&template, cold_seed(seed, HUNG_PHASE + 2, 0, n)), &model)
            })
        };
        let length = HUNG_BURST.min(Duration::from_secs_f64(args.rps_seconds));
        let r =
            closed_loop(client, &urls.kvmesh, HUNG_BURST_CONCURRENCY, length, RPS_TIMEOUT, make)
                .await;
        h.burst = Some(Burst {
            concurrency: HUNG_BURST_CONCURRENCY as u64,
            ok: r.ok,
            failed: r.failed,
            fallbacks: r.fallbacks,
            seconds: r.seconds,
        });
    }

    // SIGCONT, then the first request the indexer routes.
    paused.resume();
    let resumed = Instant::now();
    let mut n = 0u64;
    while resumed.elapsed() < kvmesh_e2e::poll::patience() {
        let o = tagged(
            client,
            &urls.kvmesh,
            request(HUNG_PHASE + 3, n),
            &format!("hung-resume-{n}"),
            SAMPLE_TIMEOUT,
        )
        .await;
        n += 1;
        if o.error.is_none() && o.fallback.is_none() && o.decision_mode.is_some() {
            h.resume_ms = Some(resumed.elapsed().as_secs_f64() * 1e3);
            break;
        }
        tokio::time::sleep(RESUME_EVERY).await;
    }
    stop.store(true, Ordering::Relaxed);
    h.max_indexer_connections = sampler.await.ok().flatten();
    tracing::info!(
        opening_requests = h.opening_requests,
        opening_ms = h.opening_ms,
        skipped = h.skipped,
        waited = h.waited,
        max_indexer_connections = h.max_indexer_connections,
        resume_ms = h.resume_ms,
        "overhead: indexer hang measured"
    );

    join_access_log(access_log, &mut samples, kvmesh_e2e::poll::patience()).await;
    h.latency = summarize(HUNG_CASE, &samples, None, None);
    Ok((h, samples))
}

/// Runs the overhead part; writes `<out>/<args.dir>/{samples.jsonl,stack/}`.
pub async fn run_overhead(args: &OverheadArgs, fleet: &Fleet, out: &Path) -> Result<OverheadRun> {
    let dir = out.join(args.dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let shape = Shape::default();
    let all_cases = cases(&args.sizes, &args.shared_prefixes);

    tracing::info!(cases = all_cases.len(), samples = args.samples, "overhead: starting the stack");
    let Started { stack, access_log, urls, client, model } = start(args, fleet, &dir).await?;
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

    let rates = rps_rounds(&phase, &all_cases, stack.indexer.as_ref().map(Proc::pid)).await;
    let mut sections = Vec::new();
    if args.hung_case {
        let hung = hung_indexer(&stack, &client, &urls, &model, args, &access_log, &shape).await;
        sections.push(ExtraSection {
            title: "Router overhead with the indexer hung (SIGSTOP)".into(),
            markdown: hung_section(&dir, hung)?,
        });
    }
    drop(stack);

    let (out_cases, missing) = case_summaries(&all_cases, &samples, &rates);
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

/// Step 1: starts the stack, swaps its Envoy, finds the model.
async fn start(args: &OverheadArgs, fleet: &Fleet, dir: &Path) -> Result<Started> {
    let mut stack =
        Stack::start(spec(args, fleet, dir)).await.context("starting the overhead stack")?;
    let (plain_port, access_log) = swap_envoy(&mut stack).await?;
    let urls = Urls {
        kvmesh: stack.gateway("/v1/chat/completions"),
        plain: format!("http://127.0.0.1:{plain_port}/v1/chat/completions"),
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

/// Steps 2 and 3: warms both paths up, primes the bases and shared prefixes; the texts and the
/// priming requests routed without the indexer.
async fn prime_texts(
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    args: &OverheadArgs,
    shape: &Shape,
) -> Result<(Arc<Texts>, u64)> {
    let cold: Vec<History> = args.sizes.iter().map(|s| cold_template(s.tokens, shape)).collect();
    warm_up(client, urls, model, &cold_template(512, shape), args.seed).await?;
    let started = Instant::now();
    let (bases, shared, prime_fallbacks) = prime(client, urls, model, args, shape).await;
    let texts = Arc::new(Texts { cold, bases, shared });
    tracing::info!(
        prime_s = started.elapsed().as_secs_f64(),
        prime_fallbacks,
        "overhead: bases primed"
    );
    Ok((texts, prime_fallbacks))
}

/// What the latency and requests/s phases share.
struct Phase<'a> {
    args: &'a OverheadArgs,
    client: &'a reqwest::Client,
    urls: &'a Urls,
    model: &'a str,
    shape: &'a Shape,
    texts: &'a Arc<Texts>,
    metrics_url: &'a str,
}

impl Phase<'_> {
    /// The index of `c`'s size in its list (the shared-prefix sizes or the sizes).
    fn size_index(&self, c: &Case) -> usize {
        let list = if c.kind == Kind::SharedPrefix {
            &self.args.shared_prefixes
        } else {
            &self.args.sizes
        };
        list.iter().position(|s| *s == c.size).unwrap_or(0)
    }
}

/// The paths in the order sample or round `n` takes them (alternating).
fn order(n: u64) -> [Way; 2] {
    if n.is_multiple_of(2) {
        [Way::Kvmesh, Way::Plain]
    } else {
        [Way::Plain, Way::Kvmesh]
    }
}

/// Step 4: the interleaved latency samples, and when the sampling started.
async fn latency_samples(p: &Phase<'_>, all_cases: &[Case]) -> (Vec<Sample>, Instant) {
    let mut samples: Vec<Sample> = Vec::new();
    let mut timers = indexer_timers(p.client, p.metrics_url).await;
    let latency_start = Instant::now();
    for n in 0..p.args.samples as u64 {
        for case in all_cases {
            for way in order(n) {
                samples.push(latency_sample(p, case, n, way, &mut timers).await);
            }
        }
        if (n + 1) % 25 == 0 {
            tracing::info!(
                done = n + 1,
                of = p.args.samples,
                elapsed_s = latency_start.elapsed().as_secs_f64(),
                "overhead: latency samples"
            );
        }
    }
    (samples, latency_start)
}

/// One latency sample; a kvmesh one with its share of the indexer's timers (`timers`: the last
/// reading, updated).
async fn latency_sample(
    p: &Phase<'_>,
    case: &Case,
    n: u64,
    way: Way,
    timers: &mut Option<IndexerTimers>,
) -> Sample {
    let h = request_for(case, p.size_index(case), p.texts, n, way, p.args, p.shape);
    let id = format!("{}-{n}-{}", case.name(), way.tag());
    let o = tagged(p.client, p.urls.of(way), body(&h, p.model), &id, SAMPLE_TIMEOUT).await;
    // Between samples, never during one: this request's share of the indexer's timers.
    let mut share = None;
    let local = o.decision_reason.as_deref() == Some(kvmesh_core::headers::LOCAL_ROUTE_REASON);
    if way == Way::Kvmesh && !local {
        // Wait for this request's tokenization to finish even when the filter gave up (a request
        // the filter routed locally never reached the indexer: nothing to wait for).
        let want = timers.map_or(0.0, |t| t.tokenizations + 1.0);
        let now =
            settle(p.client, p.metrics_url, want, Duration::from_millis(5), SETTLE_SAMPLE).await;
        share = now.zip(*timers).and_then(|(n, b)| n.one_route_since(&b));
        *timers = now;
    }
    Sample {
        indexer_ms: share.map(|s| s.route_ms),
        tokenize_ms: share.and_then(|s| s.tokenize_ms),
        match_ms: share.and_then(|s| s.match_ms),
        score_ms: share.and_then(|s| s.score_ms),
        ..Sample::measured(case.name(), way, n, id, o)
    }
}

/// Step 6: the requests/s rounds (none when `rps_seconds` or `rps_rounds` is 0), by case and path.
async fn rps_rounds(
    p: &Phase<'_>,
    all_cases: &[Case],
    indexer_pid: Option<u32>,
) -> HashMap<(String, &'static str), Rate> {
    let mut rates: HashMap<(String, &'static str), Rate> = HashMap::new();
    if p.args.rps_seconds > 0.0 && p.args.rps_rounds > 0 {
        for case in all_cases {
            for round in 0..p.args.rps_rounds {
                for way in order(round as u64) {
                    let r = rps_round(p, case, round, way, indexer_pid).await;
                    rates.entry((case.name(), way.tag())).or_default().add(r);
                }
            }
        }
    }
    rates
}

/// The request bodies of one requests/s round: new conversations (or new content) per round
/// and path.
fn rps_bodies(
    p: &Phase<'_>,
    case: &Case,
    round: usize,
    way: Way,
) -> Arc<impl Fn(u64) -> Vec<u8> + Send + Sync + 'static> {
    let (c, si, m, shape2, seed, k) = (
        case.clone(),
        p.size_index(case),
        p.model.to_string(),
        p.shape.clone(),
        p.args.seed,
        p.args.bases,
    );
    let texts = p.texts.clone();
    let phase = 1 + round as u64 * 2 + u64::from(way == Way::Plain);
    Arc::new(move |n: u64| {
        let h = match c.kind {
            Kind::Cold => cold_request(&texts.cold[si], cold_seed(seed, phase, si, n)),
            Kind::Continuation => {
                let list = &texts.bases[si];
                next_turn(&list[(n as usize) % list.len()], (phase << 40) | n, &shape2)
            }
            // Salts 0 and 1 are the latency phase's; every round starts new conversations.
            Kind::SharedPrefix => {
                shared_prefix_request(&texts.shared[si], k, n, phase << 1, &shape2).0
            }
        };
        h.body(&m, 1, true).to_string().into_bytes()
    })
}

/// One closed-loop round on one path; a kvmesh round with the indexer's routes and CPU time
/// around it (until the indexer is idle again).
async fn rps_round(
    p: &Phase<'_>,
    case: &Case,
    round: usize,
    way: Way,
    indexer_pid: Option<u32>,
) -> Rate {
    let make = rps_bodies(p, case, round, way);
    let before = match (way, indexer_pid) {
        (Way::Kvmesh, Some(pid)) => {
            indexer_timers(p.client, p.metrics_url).await.zip(cpu_ticks(pid))
        }
        _ => None,
    };
    let mut r = closed_loop(
        p.client,
        p.urls.of(way),
        p.args.rps_concurrency,
        Duration::from_secs_f64(p.args.rps_seconds),
        RPS_TIMEOUT,
        make,
    )
    .await;
    // Abandoned tokenizations (filter timeouts) must not run into the next round.
    let settled = match (way, indexer_pid) {
        (Way::Kvmesh, Some(pid)) => {
            settle_cpu(pid, Duration::from_millis(250), IDLE_TICKS, SETTLE_ROUND).await
        }
        _ => Duration::ZERO,
    };
    // The round's indexer work, the tokenizations finished while settling included.
    if let (Some((t0, c0)), Some(pid)) = (before, indexer_pid) {
        if let Some((t1, c1)) = indexer_timers(p.client, p.metrics_url).await.zip(cpu_ticks(pid)) {
            r.indexer_routes = t1.routes - t0.routes;
            r.indexer_cpu_s = c1.saturating_sub(c0) as f64 / 100.0;
        }
    }
    tracing::info!(
        case = %case.name(), path = way.tag(), round, ok = r.ok, failed = r.failed, fallbacks = r.fallbacks,
        rps = r.per_second().unwrap_or(0.0), settle_s = settled.as_secs_f64(), indexer_routes = r.indexer_routes,
        indexer_cpu_s = r.indexer_cpu_s, "overhead: requests/s round"
    );
    r
}

/// Step 7's report section; writes `overhead/{hung-samples.jsonl,hung.json}` when the case ran.
fn hung_section(dir: &Path, hung: Result<(HungIndexer, Vec<Sample>)>) -> Result<String> {
    Ok(match hung {
        Ok((h, hung_samples)) => {
            write_jsonl(&dir.join("hung-samples.jsonl"), &hung_samples)?;
            std::fs::write(dir.join("hung.json"), serde_json::to_string_pretty(&h)?)?;
            hung::render(&h) + "\nPer-request samples: `overhead/hung-samples.jsonl`; figures: `overhead/hung.json`."
        }
        Err(e) => {
            tracing::error!(
                error = format!("{e:#}"),
                "overhead: the hung-indexer case did not run"
            );
            format!("**did not run**: {e:#}")
        }
    })
}

/// Every case's summary, and the names of the cases without usable samples.
fn case_summaries(
    all_cases: &[Case],
    samples: &[Sample],
    rates: &HashMap<(String, &'static str), Rate>,
) -> (Vec<OverheadCase>, Vec<String>) {
    let mut out_cases = Vec::new();
    let mut missing = Vec::new();
    for case in all_cases {
        let name = case.name();
        let k = rates.get(&(name.clone(), Way::Kvmesh.tag())).copied();
        let p = rates.get(&(name.clone(), Way::Plain.tag())).copied();
        match summarize(&name, samples, k, p) {
            Some(c) => out_cases.push(c),
            None => missing.push(name),
        }
    }
    (out_cases, missing)
}

/// The report's notes on the setup: the stack, the latency and requests/s phases, the shared
/// prefixes.
fn setup_notes(
    args: &OverheadArgs,
    fleet: &Fleet,
    shape: &Shape,
    prime_fallbacks: u64,
    latency_s: f64,
    rates: &HashMap<(String, &'static str), Rate>,
) -> String {
    let rps_fallbacks: u64 =
        rates.iter().filter(|((_, w), _)| *w == Way::Kvmesh.tag()).map(|(_, r)| r.fallbacks).sum();
    let rps_failed: u64 = rates.values().map(|r| r.failed).sum();
    let mut notes = format!(
        "{} vllm-sim workers (`--speedup {}`, KV capacity {} blocks, KV events on), the indexer in precise mode, one Envoy \
         (`--concurrency 2`) with two listeners: kvmesh (the filter with `debug_headers: true`{}) and the same listener \
         without the filter, routing to the same workers with least_request. Requests: streaming chat, `max_tokens: 1`, no \
         session header. Latency: {} samples per case and path, one request at a time, kvmesh and plain interleaved \
         (order alternating), {} continuation bases per size primed through kvmesh in steps of ≤ {} tokens ({} priming \
         requests routed without the indexer); {:.0} s. Requests/s: {} closed-loop clients, {} round(s) × {} s per path \
         and case, alternating, against a canned-response route (nothing forwarded, so the engines do not cap the rate; the \
         filter and the indexer do all their work){}. Per-request samples: `{}/samples.jsonl`.",
        fleet.workers,
        args.sim_speedup,
        fleet.num_gpu_blocks,
        args.indexer_timeout_ms.map_or(", default `indexer_timeout_ms`".to_string(), |t| format!(", `indexer_timeout_ms: {t}`"))
            + &args.local_route_max_body_bytes.map_or(String::new(), |b| format!(", `local_route_max_body_bytes: {b}`")),
        args.samples,
        args.bases.max(1),
        shape.prime_step_tokens,
        prime_fallbacks,
        latency_s,
        args.rps_concurrency,
        args.rps_rounds,
        args.rps_seconds,
        if rps_fallbacks + rps_failed > 0 {
            format!(" ({rps_fallbacks} kvmesh requests routed without the indexer, {rps_failed} failed)")
        } else {
            String::new()
        },
        args.dir,
    );
    if !args.shared_prefixes.is_empty() {
        notes.push_str(&format!(
            " Shared prefix (`chat_<size>_shared_prefix`): one prefix per size (a conversation primed like a base), shared \
             by {} interleaved conversations, each growing on it by one turn per request (a reply and a new user message, \
             ≈ {:.0} tokens) for {} turns, then a new set starts; every request's last turn is new text. Route throughput \
             per indexer core = routes the indexer answered ÷ its CPU-seconds (`/proc/<pid>/stat`), read around each kvmesh \
             requests/s round until the indexer was idle again.",
            args.bases.max(1),
            shape.tail_tokens(),
            shape.shared_turns,
        ));
    }
    notes
}

/// The report's notes on samples left out.
fn missing_notes(missing_log: usize, missing: &[String]) -> String {
    let mut notes = String::new();
    if missing_log > 0 {
        notes
            .push_str(&format!(" {missing_log} samples had no access-log line and were left out."));
    }
    if !missing.is_empty() {
        notes.push_str(&format!(" No usable samples for: {}.", missing.join(", ")));
    }
    notes
}

/// Writes one JSON line per sample.
fn write_jsonl(path: &Path, samples: &[Sample]) -> Result<()> {
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?,
    );
    for s in samples {
        writeln!(f, "{}", serde_json::to_string(s)?)?;
    }
    f.flush()?;
    Ok(())
}
