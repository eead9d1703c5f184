//! `kvmesh-bench scale` (the thin I/O shell): one real `kvmesh-indexer` over the synthetic fleet
//! ([`super::publish`], [`super::engines`]), measured in steps — start-up and idle subscriptions,
//! fill stages (memory slope), prepared blasts (apply throughput), route probes, then the replay
//! storm of fresh replicas — into a [`ScaleReport`] (`<out>/scale.json`, `<out>/scale.md`).

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use kvmesh_core::api::RouteDecision;
use kvmesh_e2e::procs::{binary, Proc};
use kvmesh_e2e::prom::Metrics;
use kvmesh_sim::events::{EventBatch, KvEvent};

use super::engines;
use super::model::ModelParams;
use super::probe::{self, Probes};
use super::procfs::{self, ProcSample};
use super::publish::{Endpoints, Fleet};
use super::report::{
    quantile, Blast, Buckets, Idle, Routes, ScaleReport, Stage, Startup, Storm, TICKS_PER_S,
};

const MODEL: &str = "deepseek-v4";

/// `kvmesh-bench scale` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct ScaleArgs {
    /// Workers (engines) in the synthetic fleet.
    #[arg(long, default_value_t = 1000)]
    pub workers: u32,
    /// Blocks one worker's cache holds when full.
    #[arg(long, default_value_t = 65_536)]
    pub blocks_per_worker: u32,
    /// Fill stages as fractions of `--blocks-per-worker`, comma-separated (the memory slope's points).
    #[arg(long, default_value = "0.25,0.5,1")]
    pub stages: String,
    /// Threads driving the fleet's sockets.
    #[arg(long, default_value_t = 4)]
    pub publisher_threads: usize,
    /// Batches each worker keeps for replay (vLLM keeps 10,000; the bench holds workers × this).
    #[arg(long, default_value_t = 128)]
    pub ring_batches: usize,
    /// Fill: batches the fleet may send ahead of what the indexer applied.
    #[arg(long, default_value_t = 50_000)]
    pub window_batches: u64,
    /// Requests per worker in each throughput blast (prepared, then sent at once).
    #[arg(long, default_value_t = 50)]
    pub blast_requests: u32,
    /// Route calls per route case.
    #[arg(long, default_value_t = 300)]
    pub route_samples: usize,
    /// Probe conversations, and their length in tokens.
    #[arg(long, default_value_t = 8)]
    pub probes: usize,
    #[arg(long, default_value_t = 8_000)]
    pub probe_tokens: usize,
    /// Seconds of idle CPU measurement at start and after each stage.
    #[arg(long, default_value_t = 10)]
    pub idle_s: u64,
    /// Replica counts of the replay storm, comma-separated (fresh indexers started at once after
    /// the main one stops); empty: no storm.
    #[arg(long, default_value = "1,4")]
    pub storm: String,
    /// Size of each worker's `/metrics` answer, bytes (a real vLLM's is hundreds of kB).
    #[arg(long, default_value_t = 0)]
    pub metrics_body_bytes: usize,
    /// Seed of the workload model.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Seconds an indexer may take to be ready (every listener replayed) before the run fails.
    #[arg(long, default_value_t = 900)]
    pub ready_patience_s: u64,
    /// The indexer binary (default: the workspace's, of the bench's profile).
    #[arg(long)]
    pub indexer: Option<PathBuf>,
    /// What else ran on the machine during the run (repeatable; goes to the report's notes).
    #[arg(long = "note")]
    pub notes: Vec<String>,
}

/// Parses a comma-separated list (pure).
pub fn parse_list<T: std::str::FromStr>(s: &str) -> anyhow::Result<Vec<T>> {
    s.split(',')
        .map(str::trim)
        .filter(|x| !x.is_empty())
        .map(|x| x.parse().map_err(|_| anyhow!("not a number: {x}")))
        .collect()
}

/// The indexer's fleet file for the synthetic fleet (pure).
pub fn fleet_toml(
    params: &ModelParams,
    tokenizer: &Path,
    max_entries: u64,
    workers: &[(String, Endpoints)],
) -> String {
    let mut s = format!(
        "listen = \"127.0.0.1:0\"\n[model]\nname = \"{MODEL}\"\nblock_size = {}\ntokenizer = \"{}\"\n[routing]\nindex_max_entries = {max_entries}\n# The bench's engines answer every scrape, but may answer late under load: keep them routable.\nunhealthy_after_failures = 0\nserved_models_poll_ms = 0\n",
        params.block_size,
        tokenizer.display(),
    );
    for (i, (endpoint, e)) in workers.iter().enumerate() {
        s.push_str(&format!(
            "[[workers]]\nid = \"w{i}\"\nrole = \"both\"\nendpoint = \"{endpoint}\"\nkv_events = \"{}\"\nkv_replay = \"{}\"\n",
            e.events, e.replay
        ));
    }
    s
}

/// A started indexer and its API address.
struct Indexer {
    proc: Proc,
    http: String,
}

fn spawn_indexer(bin: &Path, config: &Path, dir: &Path, name: &str) -> anyhow::Result<Proc> {
    let mut cmd = std::process::Command::new(bin);
    cmd.arg("--config").arg(config);
    Proc::spawn(name, cmd, dir)
}

fn ready(mut proc: Proc) -> anyhow::Result<Indexer> {
    tokio::task::block_in_place(|| proc.wait_ready())?;
    let http = proc.ready_field("http").context("READY line without http=")?.to_owned();
    Ok(Indexer { proc, http })
}

async fn wait_readyz(client: &reqwest::Client, http: &str, patience: Duration) -> Option<f64> {
    let start = Instant::now();
    while start.elapsed() < patience {
        if let Ok(r) = client.get(format!("http://{http}/readyz")).send().await {
            if r.status().is_success() {
                return Some(start.elapsed().as_secs_f64());
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

async fn metrics(client: &reqwest::Client, http: &str) -> anyhow::Result<(Metrics, usize)> {
    let text = client.get(format!("http://{http}/metrics")).send().await?.text().await?;
    let m = Metrics::parse(&text).map_err(|e| anyhow!("indexer /metrics: {e:?}"))?;
    Ok((m, text.len()))
}

fn buckets(m: &Metrics, name: &str) -> Buckets {
    let bucket = format!("{name}_bucket");
    let mut v: Vec<(f64, f64)> = m
        .select(&bucket, &[])
        .filter_map(|s| Some((s.label("le")?.parse::<f64>().ok()?, s.value)))
        .collect();
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    v
}

const BATCHES: &str = "kvmesh_kv_batches_total";

fn sample(pid: u32) -> ProcSample {
    procfs::sample(pid).unwrap_or_default()
}

fn secs(ticks: u64) -> f64 {
    ticks as f64 / TICKS_PER_S
}

/// Waits until the indexer has applied `until` batches in all; a note when it stops progressing
/// for `stall` (lost batches) — an error when `fatal` (the fill's flow control would wait for ever).
async fn applied_until(
    client: &reqwest::Client,
    http: &str,
    until: impl Fn() -> Option<u64>,
    mut on_reading: impl FnMut(u64),
    stall: Duration,
    every: Duration,
) -> anyhow::Result<Option<String>> {
    let mut progress = (Instant::now(), 0u64);
    loop {
        let applied = metrics(client, http).await?.0.sum(BATCHES, &[]) as u64;
        on_reading(applied);
        if until().is_some_and(|u| applied >= u) {
            return Ok(None);
        }
        if applied > progress.1 {
            progress = (Instant::now(), applied);
        } else if progress.0.elapsed() > stall {
            return Ok(Some(format!(
                "the indexer applied no batch for {stall:?} ({applied} applied, {:?} expected)",
                until()
            )));
        }
        tokio::time::sleep(every).await;
    }
}

/// Makes the applier publish its gauges (the byte estimate is refreshed at most every 10 s, on a
/// batch): a removal of a block nobody holds on worker 0.
fn nudge(fleet: &Fleet) -> anyhow::Result<()> {
    fleet.inject(
        0,
        vec![EventBatch { ts: 0.0, events: vec![KvEvent::BlockRemoved { block_hashes: vec![2] }] }],
    )
}

/// CPU of `pid` over `seconds` of no traffic.
async fn idle(
    client: &reqwest::Client,
    http: &str,
    pid: u32,
    seconds: u64,
) -> anyhow::Result<Idle> {
    let a = sample(pid);
    let t = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let b = sample(pid);
    let wall = t.elapsed().as_secs_f64();
    let metrics_bytes = metrics(client, http).await?.1;
    let cores = |x: u64, y: u64| secs(y.saturating_sub(x)) / wall;
    Ok(Idle {
        seconds: wall,
        cpu_cores: cores(a.cpu_ticks, b.cpu_ticks),
        listener_cores: cores(a.listener_ticks, b.listener_ticks),
        applier_cores: cores(a.applier_ticks, b.applier_ticks),
        sample: b,
        metrics_bytes,
    })
}

/// The whole run.
pub async fn run(
    args: &ScaleArgs,
    block_size: u32,
    release: bool,
    out: &Path,
) -> anyhow::Result<ScaleReport> {
    let dir = out.join("scale");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let params = ModelParams::new(block_size, args.blocks_per_worker);
    let stages: Vec<f64> = parse_list(&args.stages)?;
    let storm: Vec<usize> = parse_list(&args.storm)?;
    let bin = match &args.indexer {
        Some(p) => p.clone(),
        None => binary("kvmesh-indexer", release)?,
    };
    let mut report = ScaleReport {
        workers: args.workers,
        params: Some(params),
        ring_batches: args.ring_batches,
        metrics_body_bytes: args.metrics_body_bytes,
        indexer: bin.display().to_string(),
        notes: args.notes.clone(),
        ..Default::default()
    };
    report.notes.push(format!(
        "machine: {} CPUs; the bench (generator, {} publisher threads) runs on the same cores",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        args.publisher_threads
    ));

    // The probes' token ids, as the indexer and the engines compute them.
    let tokenizer_path = kvmesh_tokens::default_tokenizer_path();
    let tokenizer = kvmesh_tokens::Tokenizer::from_file(&tokenizer_path)?;
    let template = kvmesh_tokens::ChatTemplate::deepseek()?;
    let probes = probe::build(args.probes, args.probe_tokens, block_size as usize, |m| {
        Ok(tokenizer.encode(&template.render(m, true)?)?)
    })?;
    tracing::info!(
        probes = probes.probes.len(),
        shared_blocks = probes.shared_blocks,
        "route probes built"
    );

    let body = engines::metrics_body(MODEL, args.metrics_body_bytes);
    let engines = engines::start(args.workers, &body).await?;
    let fleet =
        Fleet::start(args.workers, args.publisher_threads, args.ring_batches, params, args.seed)?;
    for (worker, batch) in probes.holdings(args.workers, params.prefill_chunk_blocks as usize) {
        fleet.inject(worker, vec![batch])?;
    }
    let workers: Vec<(String, Endpoints)> =
        engines.addrs.iter().map(|a| a.to_string()).zip(fleet.endpoints.iter().cloned()).collect();
    let probe_blocks: u64 = (0..probes.probes.len()).map(|p| probes.blocks(p) as u64).sum();
    let max_entries = u64::from(args.workers) * u64::from(args.blocks_per_worker) * 5 / 4
        + probe_blocks * 2
        + (u64::from(args.workers) / 4 + 1) * probes.shared_blocks as u64
        + 1_000_000;
    let config = dir.join("fleet.toml");
    std::fs::write(&config, fleet_toml(&params, &tokenizer_path, max_entries, &workers))?;

    let client = reqwest::Client::builder().timeout(Duration::from_secs(60)).build()?;
    let patience = Duration::from_secs(args.ready_patience_s);
    let t0 = Instant::now();
    let mut main = ready(spawn_indexer(&bin, &config, &dir, "indexer")?)?;
    let pid = main.proc.pid();
    wait_readyz(&client, &main.http, patience)
        .await
        .ok_or_else(|| anyhow!("the indexer was not ready within {patience:?}"))?;
    report.startup = Startup { ready_s: t0.elapsed().as_secs_f64(), at_ready: sample(pid) };
    tracing::info!(ready_s = report.startup.ready_s, "indexer ready");
    report.idle = idle(&client, &main.http, pid, args.idle_s).await?;

    // Fill stages: the memory slope, and the fill's own throughput.
    let counters = fleet.counters.clone();
    for frac in stages {
        let target = ((f64::from(args.blocks_per_worker) * frac) as u32).max(1);
        let (ops0, cpu0, t) =
            (counters.sent_block_ops.load(Ordering::Relaxed), sample(pid), Instant::now());
        fleet.fill(target);
        let c = counters.clone();
        let w = u64::from(args.workers);
        let window = args.window_batches;
        let lost = applied_until(
            &client,
            &main.http,
            || {
                let done = c.filled_workers.load(Ordering::Relaxed) >= w;
                done.then(|| c.sent_batches.load(Ordering::Relaxed))
            },
            |applied| counters.allowed_batches.store(applied + window, Ordering::Relaxed),
            Duration::from_secs(120),
            Duration::from_millis(500),
        )
        .await?;
        if let Some(note) = lost {
            if counters.filled_workers.load(Ordering::Relaxed) < w {
                bail!("fill to {target} blocks per worker stalled: {note}");
            }
            report.notes.push(format!("fill to {target}: {note}"));
        }
        let fill_s = t.elapsed().as_secs_f64();
        let cpu1 = sample(pid);
        let block_ops = counters.sent_block_ops.load(Ordering::Relaxed) - ops0;
        tokio::time::sleep(Duration::from_secs(11)).await;
        nudge(&fleet)?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let (m, _) = metrics(&client, &main.http).await?;
        let stage = Stage {
            target_blocks: target,
            entries: m.sum("kvmesh_index_entries", &[]),
            blocks: m.sum("kvmesh_index_blocks", &[]),
            index_bytes: m.sum("kvmesh_index_bytes", &[]),
            sample: sample(pid),
            fill_s,
            block_ops,
            cpu_s: secs(cpu1.cpu_ticks.saturating_sub(cpu0.cpu_ticks)),
        };
        tracing::info!(
            per_worker = target,
            entries = stage.entries,
            rss = stage.sample.rss_bytes,
            fill_s,
            "stage filled"
        );
        report.stages.push(stage);
        std::fs::write(out.join("scale.json"), serde_json::to_string_pretty(&report)?)?;
    }

    // Apply throughput, decoding included: prepared batches sent at once.
    report.blasts.push(
        blast("idle fleet", &fleet, args.blast_requests, &client, &main.http, pid, None).await?,
    );

    // Routes over the loaded index, idle and while a blast is applied.
    for p in 0..probes.probes.len() {
        route_once(&client, &main.http, &serde_json::to_vec(&probes.history_body(p, MODEL))?)
            .await?;
    }
    report.routes.push(routes("idle", &probes, &client, &main.http, args.route_samples, 0).await?);
    let r = args.route_samples;
    let during = blast(
        "during routes",
        &fleet,
        args.blast_requests,
        &client,
        &main.http,
        pid,
        Some((&probes, r, &mut report.routes)),
    )
    .await?;
    report.blasts.push(during);
    std::fs::write(out.join("scale.json"), serde_json::to_string_pretty(&report)?)?;

    // The replay storm: fresh replicas started at once on the same publishers.
    main.proc.terminate(Duration::from_secs(5));
    drop(main);
    for r in storm {
        report.storms.push(replay_storm(r, &bin, &config, &dir, &client, &fleet, patience).await?);
    }
    drop(engines);
    Ok(report)
}

async fn route_once(
    client: &reqwest::Client,
    http: &str,
    body: &[u8],
) -> anyhow::Result<RouteDecision> {
    let r = client
        .post(format!("http://{http}/v1/route"))
        .header("x-kvmesh-path", "/v1/chat/completions")
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await?;
    let status = r.status();
    let bytes = r.bytes().await?;
    if !status.is_success() {
        bail!("route answered {status}: {}", String::from_utf8_lossy(&bytes));
    }
    Ok(serde_json::from_slice(&bytes)?)
}

/// `samples` continuations of the probes (numbered from `offset`), timed one at a time.
async fn routes(
    name: &str,
    probes: &Probes,
    client: &reqwest::Client,
    http: &str,
    samples: usize,
    offset: u64,
) -> anyhow::Result<Routes> {
    let n = probes.probes.len().max(1);
    let bodies: Vec<(usize, Vec<u8>)> = (0..samples)
        .map(|i| {
            let p = i % n;
            serde_json::to_vec(&probes.continuation(p, offset + i as u64, MODEL)).map(|b| (p, b))
        })
        .collect::<Result<_, _>>()?;
    let (before, _) = metrics(client, http).await?;
    let mut times = Vec::with_capacity(samples);
    let mut matched = 0;
    for (p, body) in &bodies {
        let t = Instant::now();
        let d = route_once(client, http, body).await?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        if d.best_overlap_blocks as usize >= probes.blocks(*p) {
            matched += 1;
        }
    }
    let (after, _) = metrics(client, http).await?;
    times.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        times
            .get(((times.len() as f64 * q) as usize).min(times.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    let q = |name: &str, at: f64, scale: f64| {
        quantile(&buckets(&before, name), &buckets(&after, name), at).map(|x| x * scale)
    };
    Ok(Routes {
        name: name.into(),
        samples,
        p50_ms: pct(0.5),
        p99_ms: pct(0.99),
        matched,
        history_blocks_min: (0..probes.probes.len()).map(|p| probes.blocks(p)).min().unwrap_or(0),
        match_p50_us: q("kvmesh_match_duration_seconds", 0.5, 1e6),
        match_p99_us: q("kvmesh_match_duration_seconds", 0.99, 1e6),
        route_p50_ms: q("kvmesh_route_duration_seconds", 0.5, 1e3),
        route_p99_ms: q("kvmesh_route_duration_seconds", 0.99, 1e3),
    })
}

/// Prepares `requests` per worker, sends them at once and times the indexer applying them; with
/// `during`, route calls run meanwhile and their figures are pushed there.
async fn blast(
    name: &str,
    fleet: &Fleet,
    requests: u32,
    client: &reqwest::Client,
    http: &str,
    pid: u32,
    during: Option<(&Probes, usize, &mut Vec<Routes>)>,
) -> anyhow::Result<Blast> {
    let (batches, block_ops) = tokio::task::block_in_place(|| fleet.prepare(requests))?;
    let base = metrics(client, http).await?.0.sum(BATCHES, &[]) as u64;
    let bytes0 = fleet.counters.sent_bytes.load(Ordering::Relaxed);
    let (a, t) = (sample(pid), Instant::now());
    fleet.blast();
    if let Some((probes, samples, out)) = during {
        out.push(routes("during a blast", probes, client, http, samples, 1 << 32).await?);
    }
    let note = applied_until(
        client,
        http,
        || Some(base + batches),
        |_| {},
        Duration::from_secs(60),
        Duration::from_millis(250),
    )
    .await?;
    let wall_s = t.elapsed().as_secs_f64();
    let b = sample(pid);
    if let Some(n) = note {
        tracing::warn!(blast = name, "{n}");
    }
    Ok(Blast {
        name: name.into(),
        batches,
        block_ops,
        bytes: fleet.counters.sent_bytes.load(Ordering::Relaxed) - bytes0,
        wall_s,
        cpu_s: secs(b.cpu_ticks.saturating_sub(a.cpu_ticks)),
        applier_s: secs(b.applier_ticks.saturating_sub(a.applier_ticks)),
        listener_s: secs(b.listener_ticks.saturating_sub(a.listener_ticks)),
    })
}

/// `replicas` fresh indexers started at once: each replays every worker's ring from 0.
async fn replay_storm(
    replicas: usize,
    bin: &Path,
    config: &Path,
    dir: &Path,
    client: &reqwest::Client,
    fleet: &Fleet,
    patience: Duration,
) -> anyhow::Result<Storm> {
    let c = &fleet.counters;
    let before = (
        c.replay_requests.load(Ordering::Relaxed),
        c.replayed_batches.load(Ordering::Relaxed),
        c.replayed_bytes.load(Ordering::Relaxed),
    );
    let t0 = Instant::now();
    let procs: Vec<Proc> = (0..replicas)
        .map(|i| spawn_indexer(bin, config, dir, &format!("storm-{replicas}-{i}")))
        .collect::<anyhow::Result<_>>()?;
    let mut indexers = Vec::with_capacity(replicas);
    for p in procs {
        indexers.push(ready(p)?);
    }
    let mut ready_s: Vec<Option<f64>> = vec![None; replicas];
    let mut peak = 0u64;
    while ready_s.iter().any(Option::is_none) && t0.elapsed() < patience {
        for (i, ix) in indexers.iter().enumerate() {
            peak = peak.max(sample(ix.proc.pid()).rss_bytes);
            if ready_s[i].is_some() {
                continue;
            }
            if let Ok(r) = client.get(format!("http://{}/readyz", ix.http)).send().await {
                if r.status().is_success() {
                    ready_s[i] = Some(t0.elapsed().as_secs_f64());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut storm = Storm { replicas, ready_s, peak_rss_bytes: peak, ..Default::default() };
    for ix in &indexers {
        let (m, _) = metrics(client, &ix.http).await?;
        let outcome = |o: &str| m.sum("kvmesh_kv_replays_total", &[("outcome", o)]);
        storm.replays_complete += outcome("complete");
        storm.replays_truncated += outcome("truncated");
        storm.replays_failed += outcome("failed");
        storm.rounds_again += m.sum("kvmesh_kv_replay_rounds_total", &[]);
    }
    storm.replay_requests = c.replay_requests.load(Ordering::Relaxed) - before.0;
    storm.replayed_batches = c.replayed_batches.load(Ordering::Relaxed) - before.1;
    storm.replayed_bytes = c.replayed_bytes.load(Ordering::Relaxed) - before.2;
    for mut ix in indexers {
        ix.proc.terminate(Duration::from_secs(5));
    }
    tracing::info!(replicas, ready = ?storm.ready_s, "replay storm done");
    Ok(storm)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fleet_file_lists_every_worker_with_its_sockets() {
        let p = ModelParams::new(16, 1024);
        let w = vec![
            (
                "127.0.0.1:1".to_string(),
                Endpoints { events: "tcp://a:1".into(), replay: "tcp://a:2".into() },
            ),
            (
                "127.0.0.1:2".to_string(),
                Endpoints { events: "tcp://a:3".into(), replay: "tcp://a:4".into() },
            ),
        ];
        let toml = fleet_toml(&p, Path::new("/t.json"), 99, &w);
        assert!(toml.contains("index_max_entries = 99\n"));
        assert!(toml.contains("[[workers]]\nid = \"w1\"\nrole = \"both\"\nendpoint = \"127.0.0.1:2\"\nkv_events = \"tcp://a:3\"\nkv_replay = \"tcp://a:4\"\n"));
        assert!(toml.contains("block_size = 16\n"));
        assert_eq!(parse_list::<f64>("0.25, 1,").unwrap(), vec![0.25, 1.0]);
        assert!(parse_list::<usize>("x").is_err());
    }
}
