//! `kvmesh-bench aiperf`: NVIDIA's aiperf as an independent client of each policy's gateway.
//!
//! Per policy: a fresh stack with caches reset, the engines' and the gateway's counters scraped,
//! aiperf run to completion (its own process group, killed if it overruns its deadline or the
//! bench stops), the counters scraped again, aiperf's summary export read. The machine's CPU is
//! sampled over the run and judged by the sweep's rules (on real engines: the CPU outside them).

use crate::common::{vllm_fleet, Common};
use crate::run::{counters, one_line, prepare_stack, scrape_all, Fleet, Prepared};
use crate::sweep::{cpu_s_between, group_ticks};
use anyhow::{bail, Context, Result};
use kvmesh_bench::aiperf::{parse_summary, render, AiperfRow, AiperfWorkload, SUMMARY_FILE, TITLE};
use kvmesh_bench::cpu::Sampler;
use kvmesh_bench::manifest::{ExtraSection, RunManifest};
use kvmesh_bench::policy::Policy;
use kvmesh_bench::sweep::{cpu_invalid_reason, cpu_invalid_reason_real_engines};
use kvmesh_e2e::procs::Proc;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Beyond the workload's duration and grace period: aiperf's own start-up (its services and the
/// tokenizer load) and its export.
const STARTUP_AND_EXPORT: Duration = Duration::from_secs(180);

/// The part's settings.
pub(crate) struct AiperfSettings {
    pub bin: PathBuf,
    pub tokenizer_dir: PathBuf,
    pub policies: Vec<Policy>,
    pub workload: AiperfWorkload,
}

/// The tokenizer aiperf counts with: the directory of the indexer's `tokenizer.json`
/// (`KVMESH_TOKENIZER`, else `.tools/tokenizer/`, which also holds `tokenizer_config.json`).
pub(crate) fn default_tokenizer_dir() -> PathBuf {
    match std::env::var_os("KVMESH_TOKENIZER").map(PathBuf::from) {
        Some(file) if !file.as_os_str().is_empty() => {
            file.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf)
        }
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.tools/tokenizer"),
    }
}

/// Runs every policy under aiperf; returns the report section (a policy that failed is a row
/// saying why) and how many policies aiperf measured.
pub(crate) async fn run_aiperf(
    args: &AiperfSettings,
    fleet: &Fleet,
    fleet_note: &str,
    out: &Path,
) -> Result<(ExtraSection, usize)> {
    args.workload.validate().map_err(anyhow::Error::msg)?;
    if !args.bin.is_file() {
        bail!("aiperf not found at {} (`scripts/setup-aiperf.sh` installs it; `make bench-aiperf` runs it)", args.bin.display());
    }
    let version = aiperf_version(&args.bin);
    let mut rows = Vec::new();
    for &policy in &args.policies {
        let row = match run_one(args, policy, fleet, out).await {
            Ok(row) => row,
            Err(e) => {
                tracing::error!(
                    policy = policy.name(),
                    error = format!("{e:#}"),
                    "aiperf run failed"
                );
                AiperfRow {
                    policy: policy.name().into(),
                    error: Some(one_line(&format!("{e:#}"), 300)),
                    ..AiperfRow::default()
                }
            }
        };
        rows.push(row);
    }
    let path = out.join("aiperf").join("rows.json");
    std::fs::write(&path, serde_json::to_string_pretty(&rows)?)
        .with_context(|| format!("writing {}", path.display()))?;
    let measured = rows.iter().filter(|r| r.summary.is_some()).count();
    Ok((
        ExtraSection {
            title: TITLE.into(),
            markdown: render(&rows, &args.workload, fleet_note, &version),
        },
        measured,
    ))
}

async fn run_one(
    args: &AiperfSettings,
    policy: Policy,
    fleet: &Fleet,
    out: &Path,
) -> Result<AiperfRow> {
    let dir = out.join("aiperf").join(policy.name());
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let Prepared { stack, client, base, model, .. } = prepare_stack(policy, fleet, &dir).await?;
    // As in the sweep: ring_hash and kvmesh_precise_session get the session header, the others
    // run as shipped (aiperf's own `X-Correlation-ID` is read by none).
    let session_header = policy.uses_session_header().then_some(fleet.session_header.as_str());
    let export_dir = dir.join("export");
    let aiperf_args = args.workload.args(
        &base,
        &model,
        &args.tokenizer_dir.to_string_lossy(),
        &export_dir.to_string_lossy(),
        session_header,
    );
    let before = scrape_all(&stack, &client, policy.is_kvmesh()).await?;
    let engine_ticks_before = group_ticks(&fleet.engine_groups);
    let started = Instant::now();
    let sampler = Sampler::start(Duration::from_millis(500));
    tracing::info!(policy = policy.name(), "running aiperf");
    let mut cmd = Command::new(&args.bin);
    // Not `HF_HUB_OFFLINE=1`: with it aiperf 0.13 resolves a local tokenizer directory as a hub
    // snapshot and refuses it.
    cmd.args(&aiperf_args).env("TOKENIZERS_PARALLELISM", "false");
    let mut proc = Proc::spawn_group("aiperf", cmd, &dir)?;
    let deadline = Instant::now()
        + Duration::from_secs_f64(args.workload.duration_s + args.workload.grace_s)
        + STARTUP_AND_EXPORT;
    while proc.is_running() {
        if Instant::now() > deadline {
            proc.kill();
            bail!("aiperf overran its deadline; log {}", proc.log_path().display());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (cpu_mean, _) = sampler.finish();
    let invalid: Vec<String> = if fleet.engine_groups.is_empty() {
        cpu_invalid_reason(cpu_mean).into_iter().collect()
    } else {
        // Real engines are the CPU load: bound everything else, as the sweep does.
        let engine_cpu_s = cpu_s_between(engine_ticks_before, group_ticks(&fleet.engine_groups));
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        cpu_invalid_reason_real_engines(
            cpu_mean,
            engine_cpu_s,
            started.elapsed().as_secs_f64(),
            cores,
        )
        .into_iter()
        .collect()
    };
    let after = scrape_all(&stack, &client, policy.is_kvmesh()).await?;
    let c = counters(&stack, &before, &after, policy.is_kvmesh());
    std::fs::write(dir.join("counters.json"), serde_json::to_string_pretty(&c)?)?;
    drop(stack);
    let summary_path = export_dir.join(SUMMARY_FILE);
    let text = std::fs::read_to_string(&summary_path).with_context(|| {
        format!(
            "reading {} (aiperf log: {}):\n{}",
            summary_path.display(),
            proc.log_path().display(),
            proc.log_tail(20)
        )
    })?;
    let summary = parse_summary(&text).map_err(anyhow::Error::msg)?;
    tracing::info!(
        policy = policy.name(),
        ttft_p90_ms = summary.ttft_p90_ms,
        engine_hit_rate = c.engine_hit_rate().unwrap_or(f64::NAN),
        "aiperf done"
    );
    Ok(AiperfRow {
        policy: policy.name().into(),
        summary: Some(summary),
        engine_hit_rate: c.engine_hit_rate(),
        load_max_over_mean: c.load_max_over_mean(),
        cpu_mean,
        invalid,
        error: None,
    })
}

/// `aiperf --version`'s answer, or "(version unknown)".
fn aiperf_version(bin: &Path) -> String {
    Command::new(bin)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().rev().find(|l| !l.trim().is_empty()).map(|l| l.trim().to_string()))
        .unwrap_or_else(|| "(version unknown)".into())
}

/// `kvmesh-bench aiperf` flags.
#[derive(clap::Args, Debug, Clone)]
pub struct AiperfArgs {
    /// aiperf's executable (`scripts/setup-aiperf.sh` installs it there).
    #[arg(long, default_value = ".tools/aiperf/venv/bin/aiperf")]
    bin: PathBuf,
    /// Policies, comma-separated.
    #[arg(
        long,
        default_value = "round_robin,least_request,ring_hash,kvmesh_approximate,kvmesh_precise"
    )]
    policies: String,
    /// Requests per second.
    #[arg(long, default_value_t = AiperfWorkload::default().request_rate)]
    rate: f64,
    /// Seconds of sending.
    #[arg(long, default_value_t = AiperfWorkload::default().duration_s)]
    duration_s: f64,
    /// Workers (simulated, or real engines with `--engines vllm`).
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// KV capacity per simulated worker, blocks.
    #[arg(long, default_value_t = 16_384)]
    num_gpu_blocks: u64,
    /// The simulators' modelled prefill throughput, tokens/s per worker (`--speedup 1`).
    #[arg(long, default_value_t = 5000.0)]
    prefill_tokens_per_s: f64,
    /// Seed of aiperf's generated conversations.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Multiplies every token length of the workload (system prompt, context, turns, output),
    /// e.g. 0.5 for real CPU engines, whose prefill is slow.
    #[arg(long)]
    scale: Option<f64>,
}

/// Runs the aiperf part on its fleet — simulators at `--prefill-tokens-per-s`, or real vLLM
/// engines started once for all policies (`--engines vllm`); returns the manifest of this part
/// alone and the policies aiperf measured.
pub(crate) async fn run(common: &Common, a: &AiperfArgs) -> Result<(RunManifest, usize)> {
    let mut aiperf_fleet = common.fleet(a.workers, a.num_gpu_blocks, 1.0)?;
    // Real engines live until the part returns.
    let (_engines, fleet_note) = match common.vllm_options()? {
        None => {
            let timing = kvmesh_bench::sweep::FleetTiming::new(1.0, a.prefill_tokens_per_s)
                .map_err(anyhow::Error::msg)?;
            aiperf_fleet = crate::sweep::workload_fleet(&aiperf_fleet, &timing);
            let note = format!(
                "{} vllm-sim workers × {} blocks of {} tokens, {}",
                aiperf_fleet.workers,
                aiperf_fleet.num_gpu_blocks,
                aiperf_fleet.block_size,
                timing.describe()
            );
            (Vec::new(), note)
        }
        Some(opts) => {
            let engines = crate::sweep::start_real_engines(
                &mut aiperf_fleet,
                &opts,
                &common.out.join("aiperf").join("engines"),
            )
            .await?;
            (
                engines,
                format!(
                    "{}; started once, prefix caches reset before every policy",
                    vllm_fleet(aiperf_fleet.workers, aiperf_fleet.block_size, &opts)
                ),
            )
        }
    };
    let mut workload = AiperfWorkload {
        request_rate: a.rate,
        duration_s: a.duration_s,
        seed: a.seed,
        ..AiperfWorkload::default()
    };
    if let Some(scale) = a.scale {
        workload = workload.scaled(scale).map_err(anyhow::Error::msg)?;
    }
    let settings = AiperfSettings {
        bin: a.bin.clone(),
        tokenizer_dir: default_tokenizer_dir(),
        policies: Policy::parse_list(&a.policies).map_err(anyhow::Error::msg)?,
        workload,
    };
    let (section, ran) = run_aiperf(&settings, &aiperf_fleet, &fleet_note, &common.out).await?;
    let manifest = RunManifest {
        title: Some("kvmesh under aiperf".into()),
        workload: Some("aiperf: see its section".into()),
        window: Some("aiperf's benchmark duration".into()),
        workers: (0..a.workers).map(|i| format!("w{i}")).collect(),
        cache_capacity_blocks: Some(a.num_gpu_blocks),
        engine_block_size: Some(common.block_size),
        extra_sections: vec![section],
        ..Default::default()
    };
    Ok((manifest, ran))
}
