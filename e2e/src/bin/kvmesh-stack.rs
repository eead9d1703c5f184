//! `make run`: a KV-aware gateway on this machine, over simulated or real workers.
//!
//! Starts one engine per worker of the fleet (4 aggregate workers by default, or the workers of
//! `--fleet FILE`) — a `vllm-sim` (`--engines sim`, the default) or a real vLLM CPU engine
//! (`--engines vllm`: 2 workers by default, one per core, installed on first use) — or, with
//! `--engines external`, none: the fleet file's addresses are engines that already run. Then the
//! indexer and Envoy with the kvmesh filter — or, with `--edge ext_proc`, Envoy calling the
//! indexer's endpoint picker over ext_proc (GIE's endpoint-picker protocol, no wasm), or both;
//! prints where everything is and a ready-to-paste `curl`, and stops every process it started on
//! Ctrl-C or SIGTERM. With
//! `--prometheus`, a Prometheus scrapes the stack every second with the shipped rules, and the
//! operator's queries from envoy/README.md are printed ready to paste.

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use kvmesh_e2e::prometheus::{self, Prometheus, OPERATOR_QUERIES};
use kvmesh_e2e::stack::{Edge, Ports, Stack, StackSpec};
use kvmesh_e2e::vllm::{Engines, VllmOptions};

/// What serves the workers.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum EngineKind {
    /// One vllm-sim per worker.
    Sim,
    /// One real vLLM CPU engine per worker (`scripts/setup-vllm.sh` installs it on first use).
    Vllm,
    /// Engines already running at the fleet file's addresses; nothing is started.
    External,
}

/// Which front door picks the worker.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum EdgeKind {
    /// The kvmesh wasm filter (calls the indexer's /v1/route).
    Wasm,
    /// Envoy's ext_proc filter calling the indexer's endpoint picker; no wasm.
    #[value(name = "ext_proc")]
    ExtProc,
    /// ext_proc picks, the wasm filter is the fallback when the picker set no destination.
    Both,
}

#[derive(Parser, Debug)]
#[command(about = "Run a local kvmesh gateway over simulated, real or external vLLM workers")]
struct Args {
    /// Fleet description (the indexer's config file). Its workers, roles, block size, `[routing]`,
    /// `[filter]` and `[gateway]` settings are used; worker addresses are replaced by the engines
    /// started here (kept as they are with `--engines external`).
    #[arg(long)]
    fleet: Option<PathBuf>,
    /// What serves the workers.
    #[arg(long, value_enum, env = "KVMESH_ENGINES", default_value = "sim")]
    engines: EngineKind,
    /// Number of aggregate workers when no fleet file is given [default: 4 simulators, 2 vLLM engines].
    #[arg(long)]
    workers: Option<usize>,
    /// `VLLM_CPU_KVCACHE_SPACE` (GiB) of each real engine.
    #[arg(long, default_value_t = 1)]
    vllm_kv_cache_gib: u32,
    /// Extra flags passed to every real vLLM engine (repeatable), e.g. `--vllm-arg=--max-num-seqs=16`.
    #[arg(long = "vllm-arg", allow_hyphen_values = true)]
    vllm_args: Vec<String>,
    /// Gateway (Envoy listener) port.
    #[arg(long, env = "KVMESH_GATEWAY_PORT", default_value_t = 8080)]
    gateway_port: u16,
    /// Envoy admin port.
    #[arg(long, env = "KVMESH_ADMIN_PORT", default_value_t = 9901)]
    admin_port: u16,
    /// Indexer HTTP port.
    #[arg(long, env = "KVMESH_INDEXER_PORT", default_value_t = 9100)]
    indexer_port: u16,
    /// Which front door picks: the wasm filter, the endpoint picker over ext_proc, or both.
    #[arg(long, value_enum, env = "KVMESH_EDGE", default_value = "wasm")]
    edge: EdgeKind,
    /// The endpoint picker's ext_proc port (`--edge ext_proc|both`; GIE's convention is 9002).
    #[arg(long, env = "KVMESH_EPP_PORT", default_value_t = 9002)]
    epp_port: u16,
    /// ext_proc `failure_mode_allow`: requests go on unpicked (Envoy's fallback load balancer) when
    /// the picker cannot be reached, instead of failing (GIE's FailOpen; its default is FailClose).
    #[arg(long)]
    epp_fail_open: bool,
    /// Also start Prometheus (Debian's `prometheus`, installed by `make setup`) scraping the stack.
    #[arg(long)]
    prometheus: bool,
    /// Prometheus port (with `--prometheus`).
    #[arg(long, env = "KVMESH_PROMETHEUS_PORT", default_value_t = 9090)]
    prometheus_port: u16,
    /// Extra flags passed to every vllm-sim (repeatable), e.g. `--sim-arg=--num-gpu-blocks=4096`.
    #[arg(long = "sim-arg", allow_hyphen_values = true)]
    sim_args: Vec<String>,
    /// Use release binaries.
    #[arg(long)]
    release: bool,
    /// Where logs and generated configs go.
    #[arg(long, default_value = ".tools/run")]
    work_dir: PathBuf,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.prometheus {
        // Fail before starting anything when the binary is missing.
        prometheus::binary()?;
    }
    let default_workers = if args.engines == EngineKind::Vllm { 2 } else { 4 };
    let mut spec = StackSpec::aggregate(args.workers.unwrap_or(default_workers));
    spec.filter_config = serde_json::json!({"debug_headers": true});
    match args.engines {
        EngineKind::Sim => {}
        EngineKind::Vllm => {
            // vLLM's CPU attention needs a block size that is a multiple of 32.
            spec.block_size = 32;
            spec.engines = Engines::Vllm(VllmOptions {
                kv_cache_gib: args.vllm_kv_cache_gib,
                args: args.vllm_args.clone(),
                ..VllmOptions::default()
            });
        }
        EngineKind::External => {
            if args.fleet.is_none() {
                anyhow::bail!("--engines external needs --fleet FILE with the engines' addresses");
            }
            spec.engines = Engines::External;
        }
    }
    if let Some(path) = &args.fleet {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        spec.apply_fleet_file(&text).with_context(|| format!("fleet file {}", path.display()))?;
    }
    spec.sim_args.extend(args.sim_args.iter().cloned());
    spec.ports = Ports {
        gateway: Some(args.gateway_port),
        admin: Some(args.admin_port),
        indexer: Some(args.indexer_port),
        epp: Some(args.epp_port),
    };
    spec.edge = match args.edge {
        EdgeKind::Wasm => Edge::Wasm,
        EdgeKind::ExtProc => Edge::ExtProc { failure_mode_allow: args.epp_fail_open },
        EdgeKind::Both => Edge::Both { failure_mode_allow: args.epp_fail_open },
    };
    spec.release = args.release;
    spec.work_dir = Some(args.work_dir.clone());
    // Signals are watched from the start: a Ctrl-C while the workers are still starting must stop
    // the ones already running (dropping the start task drops, and so kills, their processes).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut start = tokio::spawn(Stack::start(spec));
    let stack = tokio::select! {
        started = &mut start => started??,
        _ = tokio::signal::ctrl_c() => return stop_while_starting(start).await,
        _ = term.recv() => return stop_while_starting(start).await,
    };
    let prom = if args.prometheus {
        Some(
            Prometheus::start(
                &stack,
                prometheus::Options { port: Some(args.prometheus_port), fast_rules: false },
            )
            .await?,
        )
    } else {
        None
    };

    println!("kvmesh is up.");
    println!("  gateway (OpenAI API)  {}", stack.gateway(""));
    println!("  envoy admin           {}", stack.admin(""));
    println!(
        "  indexer               {}   (/v1/fleet, /metrics, /debug/workers)",
        stack.indexer_url("")
    );
    for w in &stack.workers {
        let engine = match args.engines {
            EngineKind::Sim => "vllm-sim",
            EngineKind::Vllm => "vLLM",
            EngineKind::External => "external",
        };
        let model = match stack.spec.model(w.model.as_deref()) {
            Some(m) if m.adapters.is_empty() => format!("  model {}", m.name),
            Some(m) => format!("  model {} + adapters {}", m.name, m.adapters.join(", ")),
            None => String::new(),
        };
        println!(
            "  worker {:<6} {:<8} {engine:<8} http://{}  events {}{model}",
            w.id,
            w.role.as_str(),
            w.http,
            w.kv_events.as_deref().unwrap_or("-")
        );
    }
    if let Some(epp) = &stack.epp_addr {
        let front = match stack.spec.edge {
            Edge::Both { .. } => "picks; the wasm filter is the fallback",
            _ => "picks; no wasm filter",
        };
        let open = if stack.spec.edge.failure_mode_allow() { "open" } else { "closed" };
        println!(
            "  endpoint picker       grpc://{epp}   (ext_proc, GIE's protocol: {front}; fail-{open})"
        );
    }
    println!("  fleet file            {}", stack.fleet_path.display());
    println!("  logs                  {}", stack.dir().display());
    if let Some(prom) = &prom {
        println!(
            "  prometheus            {}   (1 s scrapes, rules {}, data {})",
            prom.url(""),
            prometheus::RULES_PATH,
            prom.storage().display()
        );
    }
    println!();
    println!("Try:");
    if stack.epp_addr.is_some() {
        println!("  # the endpoint picker chooses the worker over ext_proc: its decision in the x-kvmesh-decision-* headers, the engine's x-sim-worker");
    }
    if stack.spec.has_model_catalog() {
        print_model_curls(&stack);
    } else {
        println!("  {}", chat_curl(&stack, "deepseek-v4", "Hello!"));
    }
    if stack.workers.iter().any(|w| w.role == kvmesh_core::api::Role::Prefill) {
        println!("  # a long prompt: disaggregated (prefill leg on a prefill worker, x-kvmesh-decision-mode: disagg);");
        println!("  # send it again with the answer appended and a new question: a local continuation on the same decode worker");
        println!(
            "  python3 -c 'import json; print(json.dumps({{\"model\":\"deepseek-v4\",\"messages\":[{{\"role\":\"user\",\"content\":\"the kv cache routes \" * 800}}],\"max_tokens\":16}}))' | curl -s {} -H 'content-type: application/json' -H 'x-session-id: demo-1' -d @- -D - ",
            stack.gateway("/v1/chat/completions")
        );
    }
    if stack.epp_addr.is_some() {
        println!("  # what the endpoint picker answered, by result (routed, fallback, models_list, unknown_model, …)");
        println!("  curl -s {} | grep kvmesh_epp_requests_total", stack.indexer_url("/metrics"));
    }
    if let Some(prom) = &prom {
        print_queries(prom);
    }
    println!();
    println!("Ctrl-C stops everything.");

    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    println!("stopping…");
    if let Some(prom) = prom {
        prom.stop(std::time::Duration::from_secs(5));
    }
    // A rollout must not cut streams: drain Envoy (bounded) before stopping the rest.
    let mut stack = stack;
    match stack.drain_envoy(std::time::Duration::from_secs(DRAIN_BOUND_S)).await {
        Ok(0) => println!("envoy drained"),
        Ok(active) => {
            println!("envoy stopped after {DRAIN_BOUND_S} s with {active} requests still active")
        }
        Err(e) => println!("envoy drain failed ({e}); stopping it"),
    }
    drop(stack);
    Ok(())
}

/// A chat request for `model` through the gateway, ready to paste (`-D -` shows the headers: the
/// engine's `x-sim-worker` and the kvmesh decision headers).
fn chat_curl(stack: &Stack, model: &str, content: &str) -> String {
    format!(
        "curl -s {} -H 'content-type: application/json' -d '{{\"model\":\"{model}\",\"messages\":[{{\"role\":\"user\",\"content\":\"{content}\"}}],\"max_tokens\":16}}' -D - ",
        stack.gateway("/v1/chat/completions")
    )
}

/// One `curl` for each kind of request a fleet with several models (or adapters) answers: each
/// base model, an alias, an adapter (its base model's workers, its own KV), a model nobody serves
/// (the gateway's 404, no engine sees it), and the gateway's `GET /v1/models`.
fn print_model_curls(stack: &Stack) {
    let models = &stack.spec.models;
    for m in models {
        let workers: Vec<&str> = stack.workers_of(&m.name).iter().map(|w| w.id.as_str()).collect();
        println!(
            "  # base model {} (block size {}): served by {}",
            m.name,
            m.block_size,
            workers.join(", ")
        );
        println!("  {}", chat_curl(stack, &m.name, "Hello!"));
    }
    if let Some((m, alias)) = models.iter().find_map(|m| Some((m, m.aliases.first()?))) {
        println!("  # alias {alias}: the same workers and cache as {}", m.name);
        println!("  {}", chat_curl(stack, alias, "Hello!"));
    }
    if let Some((m, adapter)) = models.iter().find_map(|m| Some((m, m.adapters.first()?))) {
        println!("  # LoRA adapter {adapter}: on {}'s workers; its KV blocks are its own (send it twice: the second is a hit)", m.name);
        println!("  {}", chat_curl(stack, adapter, "You are a SQL assistant for a sales database with the tables customers, orders and products. Write a query that counts the orders of each customer in 2025, sorted by that count."));
    }
    println!("  # a model nobody serves: 404 from the gateway in vLLM's shape; no engine sees it");
    println!("  {}", chat_curl(stack, "no-such-model", "Hello!"));
    println!("  # every base model, alias and adapter (adapters with their parent), answered by the gateway");
    println!("  curl -s {}", stack.gateway("/v1/models"));
}

/// Longest wait for in-flight requests when stopping on SIGTERM / Ctrl-C (Kubernetes gives the
/// gateway pod 45 s; its preStop drains for 25 s).
const DRAIN_BOUND_S: u64 = 30;

/// The operator's queries, each as PromQL (for the web UI) and as a `curl` against the HTTP API.
fn print_queries(prom: &Prometheus) {
    println!();
    println!(
        "Query the metrics (in the web UI at {}, or with curl), after some traffic:",
        prom.url("")
    );
    for (what, expr) in OPERATOR_QUERIES {
        println!("  # {what}");
        println!("  {expr}");
        println!("  curl -sG {} --data-urlencode 'query={expr}'", prom.url("/api/v1/query"));
    }
}

/// Aborts a stack that is still starting; its processes die with the task.
async fn stop_while_starting(
    start: tokio::task::JoinHandle<anyhow::Result<Stack>>,
) -> anyhow::Result<()> {
    println!("stopping while starting…");
    start.abort();
    // A start blocked on a READY line notices the abort at its next await; either way the stack
    // it built so far is dropped here.
    drop(start.await);
    Ok(())
}
