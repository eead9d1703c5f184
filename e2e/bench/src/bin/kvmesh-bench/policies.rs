//! `kvmesh-bench policies`: one replay of one workload (the Mooncake trace or the chat sessions)
//! under every policy, each on a fresh stack of its own (`run.rs`), recorded side by side.

use crate::common::{Common, TraceSource};
use crate::run::{failed_policy, run_policy, Fleet, Workload};
use anyhow::{bail, Result};
use clap::Args;
use kvmesh_bench::ceiling::intrinsic;
use kvmesh_bench::chat::ChatConfig;
use kvmesh_bench::manifest::RunManifest;
use kvmesh_bench::parts::SIDE_BY_SIDE_TITLE;
use kvmesh_bench::policy::Policy;
use kvmesh_bench::trace::Selection;
use std::path::Path;

/// `kvmesh-bench policies` flags.
#[derive(Args, Debug, Clone)]
pub struct PoliciesArgs {
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
    /// KV capacity per worker, blocks (default 65536 × 16 = 1M tokens: the first 10 minutes hold
    /// ~17.8M distinct tokens, so the fleet must evict).
    #[arg(long, default_value_t = 65_536)]
    num_gpu_blocks: u64,
    /// vllm-sim --speedup (default: the replay's --speedup, so load and service time scale together).
    #[arg(long)]
    sim_speedup: Option<f64>,

    #[command(flatten)]
    trace: TraceSource,
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
}

/// Runs every policy on the workload; returns the manifest of this part alone and the policies
/// that ran (a failed one is recorded as failed).
pub async fn run(common: &Common, a: &PoliciesArgs) -> Result<(RunManifest, usize)> {
    common.require_sim("policies")?;
    if !(a.speedup.is_finite() && a.speedup > 0.0) {
        bail!("--speedup must be > 0");
    }
    let policies = Policy::parse_list(&a.policies).map_err(anyhow::Error::msg)?;
    let fleet = common.fleet(a.workers, a.num_gpu_blocks, a.sim_speedup.unwrap_or(a.speedup))?;
    let mut manifest = RunManifest {
        title: Some(SIDE_BY_SIDE_TITLE.into()),
        speedup: Some(a.speedup),
        cache_capacity_blocks: Some(a.num_gpu_blocks),
        engine_block_size: Some(common.block_size),
        ..Default::default()
    };
    let workload = workload(a, &mut manifest)?;
    let ran = policies_part(policies, &fleet, &workload, &common.out, &mut manifest).await?;
    Ok((manifest, ran))
}

/// The workload (`--workload`), described in the manifest.
fn workload(a: &PoliciesArgs, manifest: &mut RunManifest) -> Result<Workload> {
    Ok(match a.workload.as_str() {
        "trace" => {
            let (path, records) = a.trace.read()?;
            let sel = Selection {
                window_start_ms: a.trace.window_start_ms,
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
            Workload::Trace {
                selected,
                speedup: a.speedup,
                max_concurrency: a.max_concurrency,
                token_seed: a.trace.token_seed,
                anchor_block: a.trace.anchor_block,
            }
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
            Workload::Chat(chat)
        }
        other => bail!("unknown --workload {other:?} (trace, chat)"),
    })
}

/// Runs every policy on `workload` and records each (a failed one as failed); returns the
/// policies that ran.
async fn policies_part(
    policies: Vec<Policy>,
    fleet: &Fleet,
    workload: &Workload,
    out: &Path,
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
