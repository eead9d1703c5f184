//! Throughput of one `vllm-sim` over loopback HTTP: requests per second of 8k-token token-id
//! prompts at a very large `--speedup`, so the simulator's own cost (HTTP, JSON, hashing, cache,
//! events) is what is measured — it must never be the bottleneck of a trace replay.
//!
//! The simulator runs with one tokio worker thread, pinned to CPU 0 with `taskset` when
//! available; its CPU time is read from `/proc` so the figure is also given per CPU-second.
//! KV events are on (with a SUB consumer) so their encoding and publishing are counted.
//! Reports, never asserts. Knobs (env): `KVMESH_BENCH_SECS` (default 8), `KVMESH_BENCH_CONCURRENCY`
//! (64), `KVMESH_BENCH_PROMPT_TOKENS` (8192), `KVMESH_BENCH_SCENARIOS` (comma list, default all).
//!
//! Scenarios: `miss` — 256 distinct prompts cycled through a 16-prompt cache, every request a
//! full miss that evicts 512 blocks and stores 512; `hit` — one prompt, every request a full
//! hit; `mixed` — a 6k-token shared prefix plus a distinct 2k suffix per prompt, 16 output tokens.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

struct Scenario {
    name: &'static str,
    prompts: Vec<Vec<u32>>,
    max_tokens: u32,
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Deterministic pseudo-random token ids in the ordinary-vocabulary range.
fn ids(seed: u64, n: usize) -> Vec<u32> {
    let mut s = seed;
    (0..n).map(|_| 1000 + (kvmesh_sim::output::splitmix64(&mut s) % 90_000) as u32).collect()
}

fn scenarios(len: usize) -> Vec<Scenario> {
    let shared = ids(7, len * 3 / 4);
    vec![
        Scenario {
            name: "miss",
            prompts: (0..256).map(|i| ids(1000 + i, len)).collect(),
            max_tokens: 1,
        },
        Scenario { name: "hit", prompts: vec![ids(1, len)], max_tokens: 1 },
        Scenario {
            name: "mixed",
            prompts: (0..256)
                .map(|i| shared.iter().copied().chain(ids(5000 + i, len - shared.len())).collect())
                .collect(),
            max_tokens: 16,
        },
    ]
}

struct Proc {
    child: std::process::Child,
    http: String,
    kv_events: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_sim() -> anyhow::Result<(Proc, bool)> {
    let exe = env!("CARGO_BIN_EXE_vllm-sim");
    let args = [
        "--speedup",
        "1000000",
        "--threads",
        "1",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:*",
        "--max-waiting-requests",
        "100000",
    ];
    let pinned = Command::new("taskset")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let mut cmd = if pinned {
        let mut c = Command::new("taskset");
        c.args(["-c", "0", exe]);
        c
    } else {
        Command::new(exe)
    };
    let mut child = cmd
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("spawn vllm-sim")?;
    let stdout = child.stdout.take().context("stdout")?;
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line)?;
    let field =
        |k: &str| line.split_whitespace().find_map(|kv| kv.strip_prefix(k)).map(str::to_owned);
    let (Some(http), Some(kv_events)) = (field("http="), field("kv_events=")) else {
        let _ = child.kill();
        bail!("no READY line: {line:?}");
    };
    Ok((Proc { child, http, kv_events }, pinned))
}

/// utime + stime of `pid`, seconds.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = stat.rsplit_once(')')?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0) // USER_HZ is 100 on Linux
}

struct Outcome {
    ok: u64,
    errors: u64,
    secs: f64,
    cpu: Option<f64>,
    mean_latency_ms: f64,
    batches: u64,
}

async fn load(
    url: String,
    bodies: Arc<Vec<bytes::Bytes>>,
    concurrency: usize,
    warmup: Duration,
    window: Duration,
    pid: u32,
) -> anyhow::Result<Outcome> {
    let client = reqwest::Client::builder().pool_max_idle_per_host(concurrency).build()?;
    let measuring = Arc::new(AtomicBool::new(false));
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, errors, latency_us) =
        (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for t in 0..concurrency {
        let (client, url, bodies) = (client.clone(), url.clone(), bodies.clone());
        let (measuring, stop, ok, errors, latency_us) =
            (measuring.clone(), stop.clone(), ok.clone(), errors.clone(), latency_us.clone());
        tasks.push(tokio::spawn(async move {
            let mut i = t;
            while !stop.load(Ordering::Relaxed) {
                let body = bodies[i % bodies.len()].clone();
                i += concurrency;
                let start = Instant::now();
                let res = client
                    .post(&url)
                    .header("content-type", "application/json")
                    .body(body)
                    .send()
                    .await;
                let good = match res {
                    Ok(r) => r.status().is_success() && r.bytes().await.is_ok(),
                    Err(_) => false,
                };
                if measuring.load(Ordering::Relaxed) {
                    if good {
                        ok.fetch_add(1, Ordering::Relaxed);
                        latency_us.fetch_add(start.elapsed().as_micros() as u64, Ordering::Relaxed);
                    } else {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    tokio::time::sleep(warmup).await;
    let cpu0 = cpu_seconds(pid);
    let t0 = Instant::now();
    measuring.store(true, Ordering::Relaxed);
    tokio::time::sleep(window).await;
    measuring.store(false, Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    let cpu = cpu_seconds(pid).zip(cpu0).map(|(b, a)| (b - a) / secs);
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        let _ = t.await;
    }
    let ok = ok.load(Ordering::Relaxed);
    let mean_latency_ms =
        if ok > 0 { latency_us.load(Ordering::Relaxed) as f64 / ok as f64 / 1000.0 } else { 0.0 };
    Ok(Outcome {
        ok,
        errors: errors.load(Ordering::Relaxed),
        secs,
        cpu,
        mean_latency_ms,
        batches: 0,
    })
}

fn main() -> anyhow::Result<()> {
    // `cargo bench` passes `--bench`; nothing to parse.
    let secs = env_num("KVMESH_BENCH_SECS", 8);
    let concurrency = env_num("KVMESH_BENCH_CONCURRENCY", 64) as usize;
    let len = env_num("KVMESH_BENCH_PROMPT_TOKENS", 8192) as usize;
    let runtime =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    println!("vllm-sim throughput: {len}-token token-id prompts, {concurrency} concurrent keep-alive connections, {secs} s per scenario");
    println!("| scenario | output tokens | req/s | sim CPU (cores) | req/s per sim CPU-second | mean latency ms | errors | event batches |");
    println!("|---|---|---|---|---|---|---|---|");
    let only = std::env::var("KVMESH_BENCH_SCENARIOS").ok();
    for sc in scenarios(len)
        .into_iter()
        .filter(|s| only.as_deref().is_none_or(|o| o.split(',').any(|n| n == s.name)))
    {
        let bodies: Vec<bytes::Bytes> = sc
            .prompts
            .iter()
            .map(|p| {
                serde_json::to_vec(&serde_json::json!({"prompt": p, "max_tokens": sc.max_tokens}))
                    .map(bytes::Bytes::from)
            })
            .collect::<Result<_, _>>()?;
        let (sim, pinned) = spawn_sim()?;
        eprintln!("scenario {}: vllm-sim pid {}", sc.name, sim.child.id());
        // Count published batches on a SUB socket so publishing is real work.
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB)?;
        sub.set_subscribe(b"")?;
        sub.set_rcvtimeo(200)?;
        sub.connect(&sim.kv_events)?;
        let counting = Arc::new(AtomicBool::new(true));
        let batches = Arc::new(AtomicU64::new(0));
        let counter = {
            let (counting, batches) = (counting.clone(), batches.clone());
            std::thread::spawn(move || {
                while counting.load(Ordering::Relaxed) {
                    if sub.recv_multipart(0).is_ok() {
                        batches.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let url = format!("http://{}/v1/completions", sim.http);
        let out = runtime.block_on(load(
            url,
            Arc::new(bodies),
            concurrency,
            Duration::from_secs(2),
            Duration::from_secs(secs),
            sim.child.id(),
        ))?;
        counting.store(false, Ordering::Relaxed);
        let _ = counter.join();
        let out = Outcome { batches: batches.load(Ordering::Relaxed), ..out };
        let rps = out.ok as f64 / out.secs;
        let (cpu, per_cpu) = match out.cpu {
            Some(c) if c > 0.0 => (
                format!("{c:.2}{}", if pinned { " (pinned to CPU 0)" } else { "" }),
                format!("{:.0}", rps / c),
            ),
            _ => ("n/a".into(), "n/a".into()),
        };
        println!(
            "| {} | {} | {rps:.0} | {cpu} | {per_cpu} | {:.1} | {} | {} |",
            sc.name, sc.max_tokens, out.mean_latency_ms, out.errors, out.batches
        );
        drop(sim);
    }
    Ok(())
}
