//! `kvmesh-replay`: send a workload through a gateway and record every request.
//!
//! Subcommands: `trace` (Mooncake JSONL replay with token-id prompts), `chat` (multi-turn text
//! sessions), `analyze` (the trace's ceiling and conversation statistics, no requests).
//! Results go to a JSONL file, one `RequestRecord` per request (see the crate README).

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use kvmesh_bench::ceiling::intrinsic;
use kvmesh_bench::chat::ChatConfig;
use kvmesh_bench::chat_run::{run_chat, ChatRunConfig};
use kvmesh_bench::client::{build_client, discover_model};
use kvmesh_bench::conversation::{analyze, DEFAULT_ANCHOR_BLOCK};
use kvmesh_bench::replay::{run_trace, ReplayConfig};
use kvmesh_bench::sink::Sink;
use kvmesh_bench::trace::{self, default_trace_path, Selection, TRACE_ENV};
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Parser, Debug)]
#[command(
    name = "kvmesh-replay",
    version,
    about = "Replay a Mooncake trace or a chat workload through a gateway"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Replay a Mooncake-format trace (token-id prompts to /v1/completions).
    Trace(TraceArgs),
    /// Run multi-turn chat sessions as text (/v1/chat/completions).
    Chat(ChatArgs),
    /// Print the selected window's intrinsic ceiling and conversation statistics as JSON.
    Analyze(AnalyzeArgs),
}

#[derive(Args, Debug)]
struct WindowArgs {
    /// Trace file (default: $KVMESH_TRACE, else <repo>/../shared/traces/mooncake_conversation_trace.jsonl).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Skip requests before this trace time (ms).
    #[arg(long)]
    window_start_ms: Option<f64>,
    /// Keep requests with timestamp < window start + this (ms).
    #[arg(long)]
    window_ms: Option<f64>,
    /// Keep at most the first N requests (after the window).
    #[arg(long)]
    first: Option<usize>,
    /// Conversation key = hash_ids[anchor] (1 = the first block after the global block 0).
    #[arg(long, default_value_t = DEFAULT_ANCHOR_BLOCK)]
    anchor_block: usize,
}

#[derive(Args, Debug)]
struct Common {
    /// Gateway base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Results file (JSONL, truncated).
    #[arg(long, default_value = "bench-out/results.jsonl")]
    out: PathBuf,
    /// Model name (default: the first id of GET <url>/v1/models).
    #[arg(long, env = "KVMESH_MODEL")]
    model: Option<String>,
    /// Deadline per request, seconds (connect + whole stream).
    #[arg(long, default_value_t = 300.0)]
    request_timeout_s: f64,
    /// TCP connect timeout, seconds.
    #[arg(long, default_value_t = 5.0)]
    connect_timeout_s: f64,
    /// Send a session id in this header (flag alone: x-session-id).
    #[arg(long, num_args = 0..=1, default_missing_value = kvmesh_core::headers::DEFAULT_SESSION_HEADER)]
    session_header: Option<String>,
    /// Do not send `ignore_eos: true` (then engines may stop before max_tokens).
    #[arg(long)]
    no_ignore_eos: bool,
}

#[derive(Args, Debug)]
struct TraceArgs {
    #[command(flatten)]
    window: WindowArgs,
    #[command(flatten)]
    common: Common,
    /// Divide trace time by this.
    #[arg(long, default_value_t = 1.0)]
    speedup: f64,
    /// Requests in flight at most; later ones wait (and are recorded as sent late).
    #[arg(long, default_value_t = 256)]
    max_concurrency: usize,
    /// Seed of the hash id → tokens mapping.
    #[arg(long, default_value_t = 0)]
    token_seed: u64,
}

#[derive(Args, Debug)]
struct ChatArgs {
    #[command(flatten)]
    common: Common,
    /// Seed of everything random in the workload.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sessions to run in total.
    #[arg(long, default_value_t = 64)]
    sessions: usize,
    /// Sessions active at once.
    #[arg(long, default_value_t = 16)]
    concurrent_sessions: usize,
    /// Fewest turns per session.
    #[arg(long, default_value_t = 3)]
    turns_min: u32,
    /// Most turns per session.
    #[arg(long, default_value_t = 8)]
    turns_max: u32,
    /// Distinct shared system prompts.
    #[arg(long, default_value_t = 4)]
    system_prompts: usize,
    /// Words per system prompt (~1.3 tokens per word).
    #[arg(long, default_value_t = 1500)]
    system_prompt_words: usize,
    /// Words per user message.
    #[arg(long, default_value_t = 60)]
    user_words: usize,
    /// Mean think time between turns, ms (exponential, capped at 20× the mean).
    #[arg(long, default_value_t = 500.0)]
    think_time_ms: f64,
    /// Mean delay before a session's first turn, ms.
    #[arg(long, default_value_t = 200.0)]
    start_stagger_ms: f64,
    /// max_tokens per turn.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
}

#[derive(Args, Debug)]
struct AnalyzeArgs {
    #[command(flatten)]
    window: WindowArgs,
}

fn load_window(w: &WindowArgs) -> Result<(PathBuf, Vec<trace::Indexed>, Selection)> {
    let path = w.trace.clone().unwrap_or_else(|| default_trace_path(std::env::var(TRACE_ENV).ok()));
    let file =
        std::fs::File::open(&path).with_context(|| format!("opening trace {}", path.display()))?;
    let records = trace::parse(std::io::BufReader::new(file))
        .with_context(|| format!("trace {}", path.display()))?;
    let sel =
        Selection { window_start_ms: w.window_start_ms, window_ms: w.window_ms, first: w.first };
    let selected = sel.apply(&records);
    Ok((path, selected, sel))
}

async fn client_and_model(c: &Common) -> Result<(reqwest::Client, String)> {
    if !(c.request_timeout_s > 0.0 && c.connect_timeout_s > 0.0) {
        bail!("timeouts must be > 0");
    }
    let client = build_client(Duration::from_secs_f64(c.connect_timeout_s), 1024)?;
    let model = match &c.model {
        Some(m) => m.clone(),
        None => {
            discover_model(&client, &c.url, Duration::from_secs_f64(c.request_timeout_s.min(30.0)))
                .await
                .map_err(|e| anyhow::anyhow!("no --model given and discovery failed: {e}"))?
        }
    };
    Ok((client, model))
}

fn print_summary(out: &Path, stats: kvmesh_bench::sink::SinkStats, wall: Duration) {
    println!(
        "{}",
        serde_json::json!({
            "results": out.display().to_string(),
            "requests": stats.written,
            "failed": stats.failed,
            "wall_s": wall.as_secs_f64(),
        })
    );
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Analyze(a) => {
            let (path, selected, sel) = load_window(&a.window)?;
            let recs: Vec<_> = selected.iter().map(|s| &s.record).collect();
            let c = intrinsic(recs.iter().copied());
            let conv = analyze(recs.iter().copied(), a.window.anchor_block);
            let doc = serde_json::json!({
                "trace": path.display().to_string(),
                "window": sel.describe(),
                "ceiling": c,
                "block_rate": c.block_rate(),
                "token_rate": c.token_rate(),
                "conversations": conv,
            });
            println!("{}", serde_json::to_string_pretty(&doc)?);
        }
        Cmd::Trace(a) => {
            if !(a.speedup.is_finite() && a.speedup > 0.0) {
                bail!("--speedup must be > 0");
            }
            let (path, selected, sel) = load_window(&a.window)?;
            let c = intrinsic(selected.iter().map(|s| &s.record));
            tracing::info!(
                trace = %path.display(), window = %sel.describe(), requests = selected.len(),
                ceiling_block = c.block_rate(), ceiling_token = c.token_rate(), "replaying"
            );
            let (client, model) = client_and_model(&a.common).await?;
            let cfg = ReplayConfig {
                base_url: a.common.url.clone(),
                model,
                speedup: a.speedup,
                max_concurrency: a.max_concurrency,
                request_timeout: Duration::from_secs_f64(a.common.request_timeout_s),
                session_header: a.common.session_header.clone(),
                anchor_block: a.window.anchor_block,
                token_seed: a.token_seed,
                ignore_eos: !a.common.no_ignore_eos,
            };
            let sink = Sink::create(&a.common.out, 500)?;
            let wall = run_trace(client, cfg, selected, sink.sender()).await;
            let stats = sink.close().await?;
            print_summary(&a.common.out, stats, wall);
        }
        Cmd::Chat(a) => {
            let cfg = ChatConfig {
                seed: a.seed,
                sessions: a.sessions,
                concurrent_sessions: a.concurrent_sessions,
                turns_min: a.turns_min,
                turns_max: a.turns_max,
                system_prompts: a.system_prompts,
                system_prompt_words: a.system_prompt_words,
                user_words: a.user_words,
                think_time_ms: a.think_time_ms,
                start_stagger_ms: a.start_stagger_ms,
                max_tokens: a.max_tokens,
            };
            cfg.validate().map_err(anyhow::Error::msg)?;
            tracing::info!(workload = %cfg.describe(), "running chat sessions");
            let (client, model) = client_and_model(&a.common).await?;
            let run = ChatRunConfig {
                base_url: a.common.url.clone(),
                model,
                request_timeout: Duration::from_secs_f64(a.common.request_timeout_s),
                session_header: a.common.session_header.clone(),
                ignore_eos: !a.common.no_ignore_eos,
            };
            let sink = Sink::create(&a.common.out, 100)?;
            let wall = run_chat(client, run, cfg, sink.sender()).await;
            let stats = sink.close().await?;
            print_summary(&a.common.out, stats, wall);
        }
    }
    Ok(())
}
