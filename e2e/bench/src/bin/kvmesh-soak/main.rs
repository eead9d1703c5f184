//! `kvmesh-soak` (`make soak`): a steady mixed workload through a real stack (Envoy + the wasm
//! filter, the indexer, vllm-sim workers with a small KV cache) with churn, sampling memory and
//! every bounded map the indexer exports, to show memory flat after warm-up.
//!
//! Churn: a worker leaves and comes back by fleet-file rewrites (the indexer reloads the file),
//! sessions start and end (each client runs sessions of 1–6 turns; `--long-fraction` of them are
//! long conversations of 8–16 turns over a system prompt longer than a body base's minimum, so
//! their turns after the first send only what follows the body base), the small `--num-gpu-blocks`
//! makes the engines evict, the indexer is SIGKILLed and restarted, and a fraction of requests
//! stream and are dropped after the first chunk. Kubernetes discovery is not exercised (it needs an
//! API server). Pure parts (schedule, tally, `/proc` parsing, slope, verdict, report) are in
//! `plan.rs`; this file only drives processes, HTTP and files. Output in `--out`: `report.md`,
//! `samples.csv`, `soak_memory.png`, `soak_gauges.png`. Exits non-zero when the verdict fails.
//!
//! Over 600 lines: the driver is one sequence (load, churn, sampling, output) that reads best
//! in one place; everything that can be unit-tested is in `plan.rs`.

mod plan;

use anyhow::{Context, Result};
use clap::Parser;
use kvmesh_bench::report::plots::{register_font, vs_rate, RateSeries, DEFAULT_FONT, FONT_ENV};
use kvmesh_bench::rng::{mix, SplitMix64};
use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::stack::{Stack, StackSpec};
use plan::{Bound, Churn, Outcome, Series, Summary, Tally};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(name = "kvmesh-soak", about = "Soak a kvmesh stack under churn and judge its memory")]
struct Args {
    /// Length of the run in minutes.
    #[arg(long, default_value_t = 30.0)]
    minutes: f64,
    /// Seconds between samples.
    #[arg(long, default_value_t = 60.0)]
    sample_s: f64,
    /// Seconds between worker churn steps (a leave, then the join back).
    #[arg(long, default_value_t = 60.0)]
    churn_s: f64,
    /// The index's size series (entries, blocks, bytes, summed worker blocks) are fitted only on
    /// samples with the whole fleet listed and no churn step in the last this many seconds.
    #[arg(long, default_value_t = 20.0)]
    settle_s: f64,
    /// Indexer restarts at these fractions of the run.
    #[arg(long, value_delimiter = ',', default_value = "0.15,0.4")]
    restarts: Vec<f64>,
    /// Fraction of the run (of the indexer's last lifetime for its series) left out of the fit.
    #[arg(long, default_value_t = 0.2)]
    warmup_fraction: f64,
    /// Memory slope bound, MiB per 10 minutes, after warm-up.
    #[arg(long, default_value_t = 1.0)]
    bound_mib_per_10min: f64,
    /// Count-gauge slope bound, fraction of the window mean per 10 minutes (plus 50).
    #[arg(long, default_value_t = 0.05)]
    bound_count_fraction: f64,
    /// Simulated workers.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// KV blocks per worker (small: evictions all the time).
    #[arg(long, default_value_t = 256)]
    gpu_blocks: u32,
    /// Concurrent client loops (each one session at a time).
    #[arg(long, default_value_t = 6)]
    clients: u64,
    /// Pause between a client's requests, ms.
    #[arg(long, default_value_t = 100)]
    think_ms: u64,
    /// Fraction of requests streamed and dropped after the first chunk.
    #[arg(long, default_value_t = 0.1)]
    abort_fraction: f64,
    /// The indexer's `kv_home_ttl_secs`: short, so sessions' homes expire within the run.
    #[arg(long, default_value_t = 60)]
    kv_home_ttl_s: u64,
    /// The indexer's `local_continuation_max_sessions`: small, so the LRU cap is hit within the run.
    #[arg(long, default_value_t = 300)]
    continuation_cap: usize,
    /// The indexer's `tokenize_cache_bytes`, MiB: small, so the tokenization cache reaches its
    /// bound within warm-up (the default 64 MiB fills in hours at this load).
    #[arg(long, default_value_t = 2)]
    tokenize_cache_mib: usize,
    /// The indexer's `tokenize_memo_bytes` (the prefix memo of tokenized prompts), MiB: small, so
    /// the memo reaches its bound within warm-up (charged ~100 KB/s at this load, it fills 2 MiB
    /// in ~20 s; the default 64 MiB would take ~11 min).
    #[arg(long, default_value_t = 2)]
    tokenize_memo_mib: usize,
    /// The indexer's `body_memo_bytes` (long chat bodies held as body bases), MiB: small, so the
    /// memo reaches its bound within warm-up.
    #[arg(long, default_value_t = 2)]
    body_memo_mib: usize,
    /// Fraction of sessions that are long conversations: a system prompt of ~12 KiB (above the
    /// body base minimum, `kvmesh_core::body_base::MIN_BODY_BYTES`) and 8–16 turns.
    #[arg(long, default_value_t = 0.25)]
    long_fraction: f64,
    /// The indexer's `recovery_max_blocks` (orphan recovery's routed prompts): small, so it reaches
    /// its bound within warm-up.
    #[arg(long, default_value_t = 16_384)]
    recovery_blocks: usize,
    /// The simulators' `--kv-events-buffer-steps` (each engine's replay ring, vLLM's
    /// `buffer_steps`, default 10,000): small, so the replays a restarted indexer or a rejoining
    /// worker asks for reach their largest within warm-up. At 10,000 the rings fill for ~25 min at
    /// this load, each replay is larger than the one before, and each raised the indexer's
    /// transient peak (the 18:32 run at e8b1b92: a 10,005-batch replay at 24 min, +10 MiB).
    #[arg(long, default_value_t = 1_000)]
    replay_steps: usize,
    /// Also trace the indexer every this many seconds (0 = off) into `trace.csv`, not judged: its
    /// RSS, anonymous and file-backed resident bytes (`/proc/<pid>/smaps_rollup`), every gauge the
    /// samples take and the event counters (`TRACE_COUNTERS`), and each churn step (`churn`
    /// series: 1 leave, 2 join, 3 indexer restart) — to see what a step in RSS coincides with.
    #[arg(long, default_value_t = 0.0)]
    trace_s: f64,
    /// Output directory.
    #[arg(long, default_value = "bench-out/soak")]
    out: PathBuf,
    /// TTF font for the plots (default $KVMESH_FONT, else DejaVu Sans).
    #[arg(long)]
    font: Option<PathBuf>,
    /// Seed of the clients' prompts and session lengths.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Run the stack's `target/release` binaries.
    #[arg(long)]
    release: bool,
}

/// Series names. Bytes series end in `_bytes` (the report shows them in MiB).
const ENVOY_RSS: &str = "envoy_rss_bytes";
const ENVOY_HEAP: &str = "envoy_heap_allocated_bytes";
const WASM_RSS: &str = "wasm_vm_rss_bytes";
const WASM_SIZE: &str = "wasm_vm_memory_size_bytes";
const INDEXER_RSS: &str = "indexer_rss_bytes";
const INDEXER_ANON: &str = "indexer_anon_bytes";
const INDEXER_FILE: &str = "indexer_file_bytes";
/// An indexer gauge the soak samples: series name, metric, label filter.
struct Gauge(&'static str, &'static str, Option<(&'static str, &'static str)>);
/// The indexer's gauges of bounded maps (and the in-flight bookings).
const INDEXER_GAUGES: &[Gauge] = &[
    Gauge("index_bytes", "kvmesh_index_bytes", None),
    Gauge("index_entries", "kvmesh_index_entries", None),
    Gauge("index_blocks", "kvmesh_index_blocks", None),
    // Summed over the listed workers: above it, `index_entries` holds entries no listed worker owns.
    Gauge("worker_blocks", "kvmesh_worker_blocks", None),
    Gauge("sessions_continuations", "kvmesh_sessions_tracked", Some(("set", "continuations"))),
    Gauge("sessions_kv_home", "kvmesh_sessions_tracked", Some(("set", "kv_home"))),
    Gauge("speculative_blocks", "kvmesh_speculative_blocks", None),
    Gauge("tokenize_cache_bytes", "kvmesh_tokenize_cache_bytes", None),
    Gauge("tokenize_memo_bytes", "kvmesh_tokenize_memo_bytes", None),
    Gauge("body_memo_bytes", "kvmesh_body_memo_bytes", None),
    Gauge("recovery_blocks", "kvmesh_recovery_blocks", None),
    Gauge("worker_active_requests", "kvmesh_worker_active_requests", None),
];

/// Counters the trace (`--trace-s`) takes besides [`INDEXER_GAUGES`]: what arrives on the event
/// sockets and replays.
const TRACE_COUNTERS: &[Gauge] = &[
    Gauge("kv_batches_total", "kvmesh_kv_batches_total", None),
    Gauge("kv_events_total", "kvmesh_kv_events_total", None),
    Gauge("kv_replays_total", "kvmesh_kv_replays_total", None),
    Gauge("kv_orphan_stores_total", "kvmesh_kv_orphan_stores_total", None),
    Gauge("kv_event_limits_total", "kvmesh_kv_event_limits_total", None),
    Gauge("route_inflight", "kvmesh_route_inflight", None),
];

/// The series that are the fleet's cache contents: judged on settled whole-fleet samples only
/// (`plan::index_settled`).
const INDEX_SIZE: &[&str] = &["index_bytes", "index_entries", "index_blocks", "worker_blocks"];

fn is_bytes(name: &str) -> bool {
    name.ends_with("_bytes")
}

// === the load ===

struct Load {
    gateway: String,
    session_header: String,
    client: reqwest::Client,
    tally: Mutex<Tally>,
    stop: AtomicBool,
    abort_fraction: f64,
    long_fraction: f64,
    think: Duration,
}

impl Load {
    fn add(&self, o: Outcome) {
        if let Ok(mut t) = self.tally.lock() {
            t.add(o);
        }
    }
}

/// Words of a long conversation's system prompt: ~12 KiB of filler, above the body base minimum.
const LONG_SYSTEM_WORDS: usize = 1_800;

/// One client: sessions one after the other, 1–6 turns each over 8 shared system prompts, or
/// (`long_fraction` of them) 8–16 turns over one of 4 long ones.
async fn client_loop(load: Arc<Load>, id: u64, seed: u64) {
    let mut rng = SplitMix64::new(mix(seed, id));
    let mut n = 0u64;
    while !load.stop.load(Ordering::Relaxed) {
        n += 1;
        let session = format!("soak-{id}-{n}");
        let long = rng.next_f64() < load.long_fraction;
        let (turns, system) = if long {
            (rng.range_u64(8, 17), filler(100 + rng.range_u64(0, 4), LONG_SYSTEM_WORDS))
        } else {
            (rng.range_u64(1, 7), filler(rng.range_u64(0, 8), 120))
        };
        let mut msgs = vec![("system".to_owned(), system)];
        for _ in 0..turns {
            if load.stop.load(Ordering::Relaxed) {
                return;
            }
            msgs.push(("user".to_owned(), filler(rng.next_u64(), rng.range_u64(20, 80) as usize)));
            let body = chat_body(&msgs, 16);
            let headers = [(load.session_header.as_str(), session.as_str())];
            let answer = if rng.next_f64() < load.abort_fraction {
                load.add(aborted_stream(&load, body, &headers).await);
                None
            } else {
                match post_json(&load.client, &load.gateway, &body, &headers).await {
                    Ok(r) => {
                        load.add(Outcome::Status(r.status));
                        r.chat_content()
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "request without an answer");
                        load.add(Outcome::Transport);
                        None
                    }
                }
            };
            msgs.push(("assistant".to_owned(), answer.unwrap_or_else(|| "ok".to_owned())));
            tokio::time::sleep(load.think).await;
        }
    }
}

/// A streamed request dropped after its first chunk.
async fn aborted_stream(
    load: &Load,
    mut body: serde_json::Value,
    headers: &[(&str, &str)],
) -> Outcome {
    if let Some(o) = body.as_object_mut() {
        o.insert("stream".into(), serde_json::Value::Bool(true));
    }
    let mut req = load.client.post(&load.gateway).json(&body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    match req.send().await {
        Ok(mut resp) if resp.status().is_success() => match resp.chunk().await {
            Ok(_) => Outcome::AbortedByUs,
            Err(_) => Outcome::Transport,
        },
        Ok(resp) => Outcome::Status(resp.status().as_u16()),
        Err(_) => Outcome::Transport,
    }
}

// === sampling ===

fn read_proc(pid: u32, file: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/{file}")).ok()
}

/// `name: value` from Envoy's admin `/stats` text.
fn admin_stat(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(": ")?.trim().parse().ok())
}

async fn sample(stack: &Stack, t: f64, out: &mut BTreeMap<String, Vec<(f64, f64)>>) {
    let mut put = |name: &str, v: Option<f64>| {
        if let Some(v) = v {
            out.entry(name.to_owned()).or_default().push((t, v));
        }
    };
    if let Some(pid) = stack.envoy.as_ref().map(|p| p.pid()) {
        put(
            ENVOY_RSS,
            read_proc(pid, "status").as_deref().and_then(plan::status_rss_bytes).map(|b| b as f64),
        );
        let wasm = read_proc(pid, "smaps")
            .map(|s| plan::wasm_memories(&s, plan::V8_RESERVATION_MIN_BYTES))
            .unwrap_or_default();
        put(WASM_RSS, (wasm.count > 0).then_some(wasm.rss as f64));
        put(WASM_SIZE, (wasm.count > 0).then_some(wasm.size as f64));
        put("wasm_vms", (wasm.count > 0).then_some(wasm.count as f64));
    }
    if let Ok(r) =
        stack.client().get(stack.admin("/stats?filter=^server\\.memory_allocated$")).send().await
    {
        if let Ok(text) = r.text().await {
            put(ENVOY_HEAP, admin_stat(&text, "server.memory_allocated"));
        }
    }
    sample_indexer(stack, t, out, &[INDEXER_GAUGES], false).await;
}

/// The indexer's RSS (with `rollup`, its anonymous and file-backed parts too) and `gauges`.
async fn sample_indexer(
    stack: &Stack,
    t: f64,
    out: &mut BTreeMap<String, Vec<(f64, f64)>>,
    gauges: &[&[Gauge]],
    rollup: bool,
) {
    let mut put = |name: &str, v: Option<f64>| {
        if let Some(v) = v {
            out.entry(name.to_owned()).or_default().push((t, v));
        }
    };
    if let Some(pid) = stack.indexer.as_ref().map(|p| p.pid()) {
        put(
            INDEXER_RSS,
            read_proc(pid, "status").as_deref().and_then(plan::status_rss_bytes).map(|b| b as f64),
        );
        if rollup {
            let split =
                read_proc(pid, "smaps_rollup").as_deref().and_then(plan::rollup_anon_file_bytes);
            put(INDEXER_ANON, split.map(|(anon, _)| anon as f64));
            put(INDEXER_FILE, split.map(|(_, file)| file as f64));
        }
    }
    if let Ok(m) = stack.scrape(&stack.indexer_url("/metrics")).await {
        for Gauge(name, metric, label) in gauges.iter().flat_map(|g| g.iter()) {
            let matching: Vec<(&str, &str)> = label.iter().copied().collect();
            if m.select(metric, &matching).next().is_some() {
                put(name, Some(m.sum(metric, &matching)));
            }
        }
    }
}

/// What the body bases did over the run: the filter's route calls by the body they sent
/// (`kvmesh_filter_route_bodies_total{result}`) and the indexer's memo reads
/// (`kvmesh_body_memo_total{result}`, since its last restart).
async fn body_bases(stack: &Stack) -> plan::BodyBases {
    let mut out = plan::BodyBases::default();
    if let Ok(m) = stack.envoy_metrics().await {
        for (k, v) in
            [("whole", &mut out.whole), ("delta", &mut out.delta), ("resent", &mut out.resent)]
        {
            *v = m.sum("kvmesh_filter_route_bodies_total", &[("result", k)]);
        }
    }
    if let Ok(m) = stack.scrape(&stack.indexer_url("/metrics")).await {
        for (k, v) in [
            ("hit", &mut out.memo_hit),
            ("miss", &mut out.memo_miss),
            ("base_unknown", &mut out.base_unknown),
        ] {
            *v = m.sum("kvmesh_body_memo_total", &[("result", k)]);
        }
    }
    out
}

/// Wasm VM reloads (traps) so far.
async fn vm_reloads(stack: &Stack) -> f64 {
    let Ok(r) = stack.client().get(stack.admin("/stats?filter=vm_reload")).send().await else {
        return 0.0;
    };
    let text = r.text().await.unwrap_or_default();
    admin_stat(&text, "wasm.kvmesh.vm_reload_success").unwrap_or(0.0)
        + admin_stat(&text, "wasm.kvmesh.vm_reload_failure").unwrap_or(0.0)
}

/// Names of processes that died without us killing them.
fn dead(stack: &mut Stack) -> Vec<String> {
    let mut out = Vec::new();
    if !stack.envoy.as_mut().is_some_and(|p| p.is_running()) {
        out.push("envoy".to_owned());
    }
    if !stack.indexer.as_mut().is_some_and(|p| p.is_running()) {
        out.push("indexer".to_owned());
    }
    for w in &mut stack.workers {
        if !w.proc.as_mut().is_some_and(|p| p.is_running()) {
            out.push(format!("worker {}", w.id));
        }
    }
    out
}

// === churn ===

async fn churn(stack: &mut Stack, step: Churn, out: &mut BTreeSet<String>) -> Result<String> {
    let routing = stack.spec.routing_toml.clone();
    match step {
        Churn::WorkerLeave(i) | Churn::WorkerJoin(i) => {
            let id = stack.workers.get(i).map(|w| w.id.clone()).context("no such worker")?;
            let leave = matches!(step, Churn::WorkerLeave(_));
            if leave {
                out.insert(id.clone());
            } else {
                out.remove(&id);
            }
            let keep = out.clone();
            stack.rewrite_fleet(|w| !keep.contains(&w.id), &routing).await?;
            Ok(format!(
                "worker {id} {} (fleet file reloaded)",
                if leave { "left" } else { "joined" }
            ))
        }
        Churn::IndexerRestart => {
            stack.restart_indexer().await?;
            Ok("indexer SIGKILLed and restarted (replay done)".to_owned())
        }
    }
}

/// A churn step in the trace: series `churn`, 1 leave, 2 join, 3 indexer restart.
fn trace_step(trace: &mut BTreeMap<String, Vec<(f64, f64)>>, t: f64, step: Churn) {
    let code = match step {
        Churn::WorkerLeave(_) => 1.0,
        Churn::WorkerJoin(_) => 2.0,
        Churn::IndexerRestart => 3.0,
    };
    trace.entry("churn".to_owned()).or_default().push((t, code));
}

// === output ===

fn write_csv(path: &Path, series: &BTreeMap<String, Vec<(f64, f64)>>) -> Result<()> {
    let mut text = String::from("series,seconds,value\n");
    for (name, pts) in series {
        for (t, v) in pts {
            text.push_str(&format!("{name},{t:.1},{v}\n"));
        }
    }
    std::fs::write(path, text).with_context(|| format!("write {}", path.display()))
}

fn plots(
    out: &Path,
    series: &BTreeMap<String, Vec<(f64, f64)>>,
    font: &Path,
) -> Result<Vec<PathBuf>> {
    register_font(font)?;
    let lines = |bytes: bool| -> Vec<RateSeries> {
        series
            .iter()
            .filter(|(n, _)| is_bytes(n) == bytes)
            .map(|(n, pts)| RateSeries {
                label: n.clone(),
                points: pts
                    .iter()
                    .map(|(t, v)| (t / 60.0, if bytes { v / plan::MIB } else { *v }, true))
                    .collect(),
            })
            .collect()
    };
    let mem = out.join("soak_memory.png");
    vs_rate(&mem, "kvmesh soak: memory", "minutes", "MiB", &lines(true), false, None)?;
    let gauges = out.join("soak_gauges.png");
    vs_rate(
        &gauges,
        "kvmesh soak: bounded maps and VMs",
        "minutes",
        "count",
        &lines(false),
        false,
        None,
    )?;
    Ok(vec![mem, gauges])
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
    let duration_s = a.minutes * 60.0;
    std::fs::create_dir_all(&a.out)?;
    let mut spec = StackSpec::aggregate(a.workers);
    spec.sim_args = vec![
        "--num-gpu-blocks".into(),
        a.gpu_blocks.to_string(),
        "--kv-events-buffer-steps".into(),
        a.replay_steps.to_string(),
    ];
    spec.release = a.release;
    spec.routing_toml = format!(
        "kv_home_ttl_secs = {}\nlocal_continuation_max_sessions = {}\ntokenize_cache_bytes = {}\ntokenize_memo_bytes = {}\nbody_memo_bytes = {}\nrecovery_max_blocks = {}\n",
        a.kv_home_ttl_s,
        a.continuation_cap,
        a.tokenize_cache_mib << 20,
        a.tokenize_memo_mib << 20,
        a.body_memo_mib << 20,
        a.recovery_blocks
    );
    spec.work_dir = Some(std::path::absolute(a.out.join("stack"))?);
    let mut stack = Stack::start(spec).await?;
    tracing::info!(dir = %stack.dir().display(), minutes = a.minutes, "stack up; soaking");

    let load = Arc::new(Load {
        gateway: stack.gateway("/v1/chat/completions"),
        session_header: stack.spec.session_header.clone(),
        client: reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?,
        tally: Mutex::new(Tally::default()),
        stop: AtomicBool::new(false),
        abort_fraction: a.abort_fraction,
        long_fraction: a.long_fraction,
        think: Duration::from_millis(a.think_ms),
    });
    let clients: Vec<_> =
        (0..a.clients).map(|i| tokio::spawn(client_loop(load.clone(), i, a.seed))).collect();

    let steps = plan::schedule(duration_s, a.churn_s, a.workers, &a.restarts);
    let sample_offset = plan::sample_offset_s(a.sample_s, a.churn_s);
    let (mut next_step, mut next_sample) = (0usize, 0u64);
    // When the last churn step (or an unasked indexer restart) ended; the samples fit to judge
    // the index's size.
    let (mut last_churn_end, mut settled_at) = (f64::NEG_INFINITY, Vec::new());
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let (mut done, mut failed, mut crashes) = (Vec::new(), Vec::new(), Vec::new());
    let mut out_workers = BTreeSet::new();
    let mut last_restart = 0.0f64;
    let (mut trace, mut next_trace) = (BTreeMap::new(), 0.0f64);
    let trace_path = a.out.join("trace.csv");
    let start = Instant::now();
    loop {
        let t = start.elapsed().as_secs_f64();
        while next_step < steps.len() && steps[next_step].0 <= t {
            let step = steps[next_step].1;
            next_step += 1;
            match churn(&mut stack, step, &mut out_workers).await {
                Ok(what) => {
                    tracing::info!(t_s = t, "{what}");
                    trace_step(&mut trace, t, step);
                    done.push((t, what));
                }
                Err(e) => {
                    tracing::warn!(t_s = t, error = %e, "churn step failed");
                    failed.push(format!("{step:?} at {:.1} min: {e:#}", t / 60.0));
                }
            }
            last_churn_end = start.elapsed().as_secs_f64();
            if step == Churn::IndexerRestart {
                last_restart = last_churn_end;
            }
        }
        let t = start.elapsed().as_secs_f64();
        if t >= plan::sample_time_s(next_sample, a.sample_s, sample_offset) || t >= duration_s {
            for name in dead(&mut stack) {
                tracing::warn!(t_s = t, "{name} died");
                crashes.push(format!("{name} exited at {:.1} min", t / 60.0));
                if name == "indexer" {
                    stack.start_indexer().await?;
                    last_restart = start.elapsed().as_secs_f64();
                    last_churn_end = last_restart;
                } else if name == "envoy" {
                    break;
                }
            }
            let settled = plan::index_settled(
                a.workers.saturating_sub(out_workers.len()),
                a.workers,
                t - last_churn_end,
                a.settle_s,
            );
            if settled {
                settled_at.push(t);
            }
            sample(&stack, t, &mut series).await;
            let sent = load.tally.lock().map(|x| x.total()).unwrap_or(0);
            tracing::info!(t_s = t.round(), requests = sent, settled, "sample");
            next_sample += 1;
        }
        if a.trace_s > 0.0 && t >= next_trace {
            sample_indexer(&stack, t, &mut trace, &[INDEXER_GAUGES, TRACE_COUNTERS], true).await;
            next_trace = t + a.trace_s;
            // Written as it goes: a run stopped early keeps its trace.
            if let Err(e) = write_csv(&trace_path, &trace) {
                tracing::warn!(error = %e, "trace not written");
            }
        }
        if t >= duration_s || crashes.iter().any(|c: &String| c.starts_with("envoy")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    load.stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.await;
    }
    let bases = body_bases(&stack).await;
    let reloads = vm_reloads(&stack).await;
    if reloads > 0.0 {
        crashes.push(format!("{reloads} wasm VM reloads (filter traps)"));
    }

    let warm = duration_s * a.warmup_fraction;
    let indexer_from = warm.max(last_restart + (duration_s - last_restart) * a.warmup_fraction);
    let fits = series
        .iter()
        .map(|(name, pts)| {
            let bound = if is_bytes(name) {
                Bound::MibPer10Min(a.bound_mib_per_10min)
            } else {
                Bound::RelativePer10Min { fraction: a.bound_count_fraction, floor: 50.0 }
            };
            let from = if name.starts_with("envoy") || name.starts_with("wasm") {
                warm
            } else {
                indexer_from
            };
            plan::fit(&Series {
                name: name.clone(),
                points: if INDEX_SIZE.contains(&name.as_str()) {
                    plan::at_times(pts, &settled_at)
                } else {
                    pts.clone()
                },
                bound,
                fit_from_s: from,
            })
        })
        .collect();
    let tally = load.tally.lock().map(|t| t.clone()).unwrap_or_default();
    let summary = Summary {
        minutes: start.elapsed().as_secs_f64() / 60.0,
        sample_s: a.sample_s,
        warmup_fraction: a.warmup_fraction,
        fits,
        tally,
        crashes,
        churn_done: done,
        churn_failed: failed,
    };
    let mut report = plan::render(&summary, is_bytes);
    report.push_str(&format!(
        "\nSetup: {} vllm-sim workers with {} KV blocks each; the indexer's `kv_home_ttl_secs = {}`, `local_continuation_max_sessions = {}`, `tokenize_cache_bytes = {} MiB`, `tokenize_memo_bytes = {} MiB`, `body_memo_bytes = {} MiB` and `recovery_max_blocks = {}` (so the session maps, the tokenization cache, prefix memo and body memo and orphan recovery's routed prompts reach their bounds); {} clients (think {} ms), {:.0} % of requests streamed and aborted, {:.0} % of sessions long conversations (8–16 turns over a ~12 KiB system prompt: body bases); Envoy has no wasm memory stat: `{WASM_RSS}` and `{WASM_SIZE}` are the resident and committed bytes, summed over the VMs (`wasm_vms`), of the wasm linear memories found in Envoy's `/proc/<pid>/smaps` (each an anonymous read-write mapping directly below V8's ≥ 1 GiB inaccessible guard reservation); `{ENVOY_HEAP}` is Envoy's `server.memory_allocated`. Samples at 0 and then every {:.0} s from {:.0} s (between churn steps); the index's size series ({}) are fitted only on the {} samples taken with the whole fleet listed and no churn step in the {:.0} s before. Indexer series fitted from {:.1} min (its last restart at {:.1} min).\n",
        a.workers,
        a.gpu_blocks,
        a.kv_home_ttl_s,
        a.continuation_cap,
        a.tokenize_cache_mib,
        a.tokenize_memo_mib,
        a.body_memo_mib,
        a.recovery_blocks,
        a.clients,
        a.think_ms,
        a.abort_fraction * 100.0,
        a.long_fraction * 100.0,
        a.sample_s,
        plan::sample_time_s(1, a.sample_s, sample_offset),
        INDEX_SIZE.join(", "),
        settled_at.len(),
        a.settle_s,
        indexer_from / 60.0,
        last_restart / 60.0
    ));
    report.push_str(&plan::render_body_bases(&bases, series.get("body_memo_bytes")));
    write_csv(&a.out.join("samples.csv"), &series)?;
    let font = a
        .font
        .clone()
        .or_else(|| std::env::var_os(FONT_ENV).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(DEFAULT_FONT));
    match plots(&a.out, &series, &font) {
        Ok(files) => {
            for f in files {
                report.push_str(&format!(
                    "\n![{}]({})\n",
                    f.display(),
                    f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()
                ));
            }
        }
        Err(e) => report.push_str(&format!("\nNo plots: {e:#}\n")),
    }
    let path = a.out.join("report.md");
    std::fs::write(&path, &report)?;
    println!("{report}");
    eprintln!("report: {}", path.display());
    drop(stack);
    if summary.pass() {
        Ok(())
    } else {
        anyhow::bail!("soak failed its verdict (see {})", path.display())
    }
}
