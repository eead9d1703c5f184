//! One policy's run: start the stack, reset caches, scrape, replay, scrape, write files, stop.
//!
//! Each policy gets a freshly started stack from the `kvmesh-e2e` harness with the identical
//! fleet specification (same worker ids, cache capacity, block size, timing flags) — equivalent
//! to one fleet with caches reset, without leftovers such as queued work, an indexer's learned
//! state or Envoy's connection pools leaking from one policy into the next. Caches are also
//! reset explicitly before the replay. Counters are the difference of scrapes taken right
//! before and right after the replay.

use anyhow::{Context, Result};
use kvmesh_bench::chat::ChatConfig;
use kvmesh_bench::chat_run::{run_chat, ChatRunConfig};
use kvmesh_bench::client::{build_client, discover_model};
use kvmesh_bench::counters::{attribution_delta, engine_delta, router_delta, PolicyCounters};
use kvmesh_bench::manifest::PolicyEntry;
use kvmesh_bench::policy::{Policy, SessionHeaderMode};
use kvmesh_bench::prom::{self, Sample};
use kvmesh_bench::replay::{run_trace, ReplayConfig};
use kvmesh_bench::sink::Sink;
use kvmesh_bench::trace::Indexed;
use kvmesh_e2e::stack::{EnvoyPolicy, ModelSpec, Stack, StackSpec, WorkerSpec};
use kvmesh_e2e::vllm::Engines;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Deadline of one metrics scrape.
const SCRAPE_TIMEOUT: Duration = Duration::from_secs(10);

/// What to replay.
#[derive(Debug, Clone)]
pub enum Workload {
    /// Trace requests (already selected) and how to send them.
    Trace {
        /// The selected requests.
        selected: Vec<Indexed>,
        /// Trace time divided by this.
        speedup: f64,
        /// Requests in flight at most.
        max_concurrency: usize,
        /// Block → tokens seed.
        token_seed: u64,
        /// Conversation anchor block.
        anchor_block: usize,
    },
    /// Chat sessions.
    Chat(ChatConfig),
}

/// Fleet and run settings shared by every policy.
#[derive(Debug, Clone)]
pub struct Fleet {
    pub workers: usize,
    pub block_size: u32,
    pub num_gpu_blocks: u64,
    pub sim_speedup: f64,
    pub sim_args: Vec<String>,
    pub release: bool,
    pub session_header: String,
    pub session_mode: SessionHeaderMode,
    pub model: Option<String>,
    pub request_timeout: Duration,
    /// Tries to start each policy's stack.
    pub start_attempts: u32,
    /// Engines already running (real vLLM, started once for the sweep): when non-empty, every
    /// stack runs over these as external engines instead of starting simulators.
    pub external: Vec<WorkerSpec>,
    /// The external engines' process groups (their CPU is the engines' CPU).
    pub engine_groups: Vec<u32>,
    /// Several models (the `models` workload): the fleet serves these, `workers` split evenly
    /// between them; `None`: one model.
    pub multi: Option<MultiModel>,
}

/// A fleet of several models and their LoRA adapters (simulators only).
#[derive(Debug, Clone, PartialEq)]
pub struct MultiModel {
    /// The base models, the default first, each with its adapters and `--max-loras`.
    pub models: Vec<ModelSpec>,
    /// The simulators' `--lora-load-ms` (modelled time: ÷ their speed-up on the wall clock).
    pub lora_load_ms: f64,
}

impl MultiModel {
    /// Workers per base model when the fleet has `workers` in all (at least one each).
    pub fn per_model(&self, workers: usize) -> usize {
        (workers / self.models.len().max(1)).max(1)
    }

    /// The indexer's `[routing]` line for the adapter load cost: the simulators' load time on the
    /// wall clock (`--lora-load-ms` ÷ `speedup`), the time the router's predicted TTFT is in.
    pub fn routing_toml(&self, speedup: f64) -> String {
        format!("adapter_load_ms = {:.3}", self.lora_load_ms / speedup.max(1e-9))
    }
}

/// What one policy's run produced.
pub struct PolicyRun {
    pub entry: PolicyEntry,
    pub worker_ids: Vec<String>,
    pub requests: u64,
    pub failed: u64,
}

pub(crate) fn spec_for(policy: Policy, fleet: &Fleet, dir: &Path) -> StackSpec {
    let mut spec = match &fleet.multi {
        Some(m) => StackSpec::multi_model(m.models.clone(), m.per_model(fleet.workers)),
        None => StackSpec::aggregate(fleet.workers),
    };
    if !fleet.external.is_empty() {
        spec.workers = fleet.external.clone();
        spec.engines = Engines::External;
    }
    spec.policy = match policy {
        Policy::RoundRobin => EnvoyPolicy::RoundRobin,
        Policy::LeastRequest => EnvoyPolicy::LeastRequest,
        Policy::RingHash => EnvoyPolicy::RingHash,
        _ => EnvoyPolicy::Kvmesh,
    };
    spec.block_size = fleet.block_size;
    spec.sim_args = vec![
        "--num-gpu-blocks".into(),
        fleet.num_gpu_blocks.to_string(),
        "--speedup".into(),
        fleet.sim_speedup.to_string(),
    ];
    let mut routing = vec![policy.routing_toml().to_string()];
    if let Some(m) = &fleet.multi {
        spec.sim_args.extend(["--lora-load-ms".into(), m.lora_load_ms.to_string()]);
        routing.push(m.routing_toml(fleet.sim_speedup));
    }
    spec.sim_args.extend(fleet.sim_args.iter().cloned());
    spec.kv_events = policy.kv_events();
    spec.routing_toml =
        routing.into_iter().filter(|l| !l.is_empty()).collect::<Vec<_>>().join("\n");
    spec.filter_config = policy.filter_config();
    spec.session_header = fleet.session_header.clone();
    spec.release = fleet.release;
    spec.work_dir = Some(dir.join("stack"));
    spec
}

async fn scrape(client: &reqwest::Client, url: &str) -> Result<Vec<Sample>> {
    let text = tokio::time::timeout(SCRAPE_TIMEOUT, async {
        client.get(url).send().await?.error_for_status()?.text().await
    })
    .await
    .with_context(|| format!("scraping {url}: timeout"))?
    .with_context(|| format!("scraping {url}"))?;
    prom::parse(&text).with_context(|| format!("parsing {url}"))
}

/// Scrapes of every engine, Envoy, and (for kvmesh) the indexer.
pub(crate) struct Scrape {
    engines: Vec<Vec<Sample>>,
    envoy: Vec<Sample>,
    indexer: Vec<Sample>,
}

pub(crate) async fn scrape_all(
    stack: &Stack,
    client: &reqwest::Client,
    kvmesh: bool,
) -> Result<Scrape> {
    let mut engines = Vec::with_capacity(stack.workers.len());
    for w in &stack.workers {
        engines.push(scrape(client, &w.url("/metrics")).await?);
    }
    let envoy = scrape(client, &stack.admin("/stats/prometheus")).await?;
    let indexer =
        if kvmesh { scrape(client, &stack.indexer_url("/metrics")).await? } else { Vec::new() };
    Ok(Scrape { engines, envoy, indexer })
}

/// [`scrape_all`] of the first stack, with every other gateway replica's Envoy (and indexer)
/// scrape added: the counters' sums are then the whole set of replicas' (the engines are shared).
pub(crate) async fn scrape_gateways(
    stacks: &[Stack],
    client: &reqwest::Client,
    kvmesh: bool,
) -> Result<Scrape> {
    let (first, rest) = stacks.split_first().context("no gateway to scrape")?;
    let mut all = scrape_all(first, client, kvmesh).await?;
    for s in rest {
        all.envoy.extend(scrape(client, &s.admin("/stats/prometheus")).await?);
        if kvmesh {
            all.indexer.extend(scrape(client, &s.indexer_url("/metrics")).await?);
        }
    }
    Ok(all)
}

pub(crate) fn counters(
    stack: &Stack,
    before: &Scrape,
    after: &Scrape,
    kvmesh: bool,
) -> PolicyCounters {
    let engines = stack
        .workers
        .iter()
        .zip(before.engines.iter().zip(&after.engines))
        .map(|(w, (b, a))| engine_delta(&w.id, Some(&w.http), b, a))
        .collect();
    // The gateway's view first (what the filter predicted per request); the indexer's export of
    // the same metrics is the fallback.
    // Both record `router_kv_hit_rate` per mille (kvmesh_core::router_metrics).
    let scale = kvmesh_core::router_metrics::HIT_RATE_SCALE as f64;
    let router = if kvmesh {
        router_delta(&before.envoy, &after.envoy, scale)
            .or_else(|| router_delta(&before.indexer, &after.indexer, scale))
            .map(|r| kvmesh_bench::counters::RouterCounters {
                attribution: attribution_delta(&before.indexer, &after.indexer),
                ..r
            })
    } else {
        None
    };
    PolicyCounters { engines, router }
}

/// Starts the policy's stack, retrying a failed start (`Fleet::start_attempts` in all): on a
/// shared, loaded machine a worker can miss its readiness deadline once.
pub(crate) async fn start_stack(policy: Policy, fleet: &Fleet, dir: &Path) -> Result<Stack> {
    let attempts = fleet.start_attempts.max(1);
    let mut attempt = 1;
    loop {
        tracing::info!(policy = policy.name(), attempt, "starting stack");
        match Stack::start(spec_for(policy, fleet, dir)).await {
            Ok(stack) => return Ok(stack),
            Err(e) if attempt < attempts => {
                tracing::warn!(
                    policy = policy.name(),
                    attempt,
                    error = format!("{e:#}"),
                    "stack did not start; retrying"
                );
                attempt += 1;
                tokio::time::sleep(Duration::from_secs(2)).await;
            }
            Err(e) => {
                return Err(
                    e.context(format!("starting the {} stack ({attempt} attempts)", policy.name()))
                )
            }
        }
    }
}

/// A started stack with clean prefix caches, a client for it and the model it serves.
pub(crate) struct Prepared {
    pub stack: Stack,
    pub worker_ids: Vec<String>,
    pub client: reqwest::Client,
    pub base: String,
    pub model: String,
}

/// Starts `policy`'s stack in `dir`, resets every worker's prefix cache and finds the model name.
pub(crate) async fn prepare_stack(policy: Policy, fleet: &Fleet, dir: &Path) -> Result<Prepared> {
    let client = build_client(Duration::from_secs(5), 1024)?;
    if !fleet.external.is_empty() {
        // Real engines outlive the stack: reset them before it starts. vLLM publishes the reset's
        // AllBlocksCleared only with its next scheduler step, so a sub-block request to each
        // engine flushes it now — else a new indexer keeps the last point's blocks (replayed)
        // until the point's first request, and routes that on a stale index.
        flush_reset(&client, &fleet.external).await?;
    }
    let stack = start_stack(policy, fleet, dir).await?;
    let worker_ids: Vec<String> = stack.workers.iter().map(|w| w.id.clone()).collect();
    if fleet.external.is_empty() {
        stack.reset_caches().await.context("resetting prefix caches")?;
    }
    let base = stack.gateway("");
    let model = match &fleet.model {
        Some(m) => m.clone(),
        None => discover_model(&client, &base, Duration::from_secs(30))
            .await
            .map_err(anyhow::Error::msg)?,
    };
    Ok(Prepared { stack, worker_ids, client, base, model })
}

/// Resets every external engine's prefix cache and sends each a one-token request (shorter than a
/// block, so nothing new is cached) so that the engine publishes the reset's event.
async fn flush_reset(client: &reqwest::Client, engines: &[WorkerSpec]) -> Result<()> {
    for w in engines {
        let base = w
            .endpoint
            .as_deref()
            .with_context(|| format!("external engine {} without endpoint", w.id))?;
        let url = |path: &str| format!("http://{base}{path}");
        client
            .post(url("/reset_prefix_cache"))
            .send()
            .await?
            .error_for_status()
            .with_context(|| format!("resetting {}", w.id))?;
        let body = serde_json::json!({ "model": kvmesh_e2e::vllm::MODEL_NAME, "prompt": "x", "max_tokens": 1 });
        tokio::time::timeout(
            Duration::from_secs(60),
            client.post(url("/v1/completions")).json(&body).send(),
        )
        .await
        .with_context(|| format!("flush request to {}: timeout", w.id))??
        .error_for_status()
        .with_context(|| format!("flush request to {}", w.id))?;
    }
    Ok(())
}

/// Runs one policy and writes `<out>/<policy>/{results.jsonl,counters.json}`.
pub async fn run_policy(
    policy: Policy,
    fleet: &Fleet,
    workload: &Workload,
    out: &Path,
) -> Result<PolicyRun> {
    let dir = out.join(policy.name());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let results = dir.join("results.jsonl");
    let counters_path = dir.join("counters.json");
    let Prepared { stack, worker_ids, client, base, model } =
        prepare_stack(policy, fleet, &dir).await?;
    let session_header = fleet.session_mode.sends(policy).then(|| fleet.session_header.clone());
    let before = scrape_all(&stack, &client, policy.is_kvmesh()).await?;

    let sink = Sink::create(&results, 500)?;
    let wall = match workload {
        Workload::Trace { selected, speedup, max_concurrency, token_seed, anchor_block } => {
            let cfg = ReplayConfig {
                base_url: base.clone(),
                model,
                speedup: *speedup,
                max_concurrency: *max_concurrency,
                request_timeout: fleet.request_timeout,
                session_header,
                anchor_block: *anchor_block,
                token_seed: *token_seed,
                ignore_eos: true,
            };
            run_trace(client.clone(), cfg, selected.clone(), sink.sender()).await
        }
        Workload::Chat(chat) => {
            let run = ChatRunConfig {
                base_url: base.clone(),
                model,
                request_timeout: fleet.request_timeout,
                session_header,
                ignore_eos: true,
            };
            run_chat(client.clone(), run, chat.clone(), sink.sender()).await
        }
    };
    let stats = sink.close().await?;
    let after = scrape_all(&stack, &client, policy.is_kvmesh()).await?;
    let c = counters(&stack, &before, &after, policy.is_kvmesh());
    std::fs::write(&counters_path, serde_json::to_string_pretty(&c)?)
        .with_context(|| format!("writing {}", counters_path.display()))?;
    tracing::info!(
        policy = policy.name(),
        requests = stats.written,
        failed = stats.failed,
        wall_s = wall.as_secs_f64(),
        engine_hit_rate = c.engine_hit_rate().unwrap_or(f64::NAN),
        "policy done"
    );
    drop(stack);
    Ok(PolicyRun {
        entry: PolicyEntry {
            name: policy.name().to_string(),
            results: rel(policy, "results.jsonl"),
            counters: Some(rel(policy, "counters.json")),
            notes: Some(format!(
                "{}; replay wall time {:.1} s",
                policy.describe(),
                wall.as_secs_f64()
            )),
        },
        worker_ids,
        requests: stats.written,
        failed: stats.failed,
    })
}

/// A policy whose stack could not run: an empty results file and the reason in the notes, so
/// the report still shows the other policies and says what happened to this one.
pub fn failed_policy(policy: Policy, out: &Path, err: &anyhow::Error) -> Result<PolicyEntry> {
    let dir = out.join(policy.name());
    std::fs::create_dir_all(&dir)?;
    std::fs::write(dir.join("results.jsonl"), "")?;
    Ok(PolicyEntry {
        name: policy.name().to_string(),
        results: rel(policy, "results.jsonl"),
        counters: None,
        notes: Some(format!("**did not run**: {}", one_line(&format!("{err:#}"), 600))),
    })
}

/// `text` on one line, cut to at most `max` characters (error chains carry process log tails).
pub fn one_line(text: &str, max: usize) -> String {
    let flat = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if flat.chars().count() <= max {
        flat
    } else {
        format!("{}…", flat.chars().take(max).collect::<String>())
    }
}

fn rel(policy: Policy, file: &str) -> PathBuf {
    PathBuf::from(policy.name()).join(file)
}
