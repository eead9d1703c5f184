//! `kvmesh-bench overhead`: its flags, the main run and the `_local_route` run after it, and
//! the manifest of the part alone.

use super::{run_overhead, OverheadSettings};
use crate::common::Common;
use crate::run::{self, Fleet};
use anyhow::{bail, Result};
use clap::Args;
use kvmesh_bench::manifest::RunManifest;
use kvmesh_bench::overhead::cases::{parse_optional_sizes, parse_sizes};

/// `kvmesh-bench overhead` flags.
#[derive(Args, Debug, Clone)]
pub struct OverheadArgs {
    /// Chat prompt sizes in tokens (`k` = 1024), each measured cold and as a continuation.
    #[arg(long, default_value = "1k,8k,32k,100k")]
    sizes: String,
    /// Shared-prefix sizes (`k` = 1024), one `chat_<size>_shared_prefix` case each (many
    /// conversations growing turn by turn on one long prefix); `none` for no such case.
    #[arg(long, default_value = "8k,48k")]
    shared_prefixes: String,
    /// Latency samples per case and path (kvmesh, ext_proc, plain).
    #[arg(long, default_value_t = 200)]
    samples: usize,
    /// Continuation conversations per size (samples cycle through them).
    #[arg(long, default_value_t = 4)]
    bases: usize,
    /// Simulated workers behind the gateway.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// KV capacity per worker, blocks.
    #[arg(long, default_value_t = 65_536)]
    num_gpu_blocks: u64,
    /// vllm-sim --speedup (large: the engine's modelled time vanishes).
    #[arg(long, default_value_t = 1_000_000.0)]
    sim_speedup: f64,
    /// Seconds per requests/s round (0 skips the requests/s phase).
    #[arg(long, default_value_t = 3.0)]
    rps_seconds: f64,
    /// Requests/s rounds per path and case (paths alternate).
    #[arg(long, default_value_t = 2)]
    rps_rounds: usize,
    /// Concurrent closed-loop clients in the requests/s phase.
    #[arg(long, default_value_t = 8)]
    rps_concurrency: usize,
    /// The filter's indexer_timeout_ms (default: the filter's own default).
    #[arg(long)]
    indexer_timeout_ms: Option<u64>,
    /// Sizes measured again, after the main run, on a stack whose filter routes bodies of at
    /// most --local-route-max-body-bytes alone (cases `<case>_local_route`); `none` = skip.
    #[arg(long, default_value = "1k")]
    local_sizes: String,
    /// The filter's local_route_max_body_bytes in the `_local_route` run (the main run keeps the
    /// filter's default, off).
    #[arg(long, default_value_t = kvmesh_bench::policy::LOCAL_ROUTE_SHORT_BODY_BYTES)]
    local_route_max_body_bytes: usize,
    /// Measure the ext_proc path too (Envoy's ext_proc filter calling the indexer's endpoint
    /// picker, no wasm; rows `<case>_ext_proc`) beside the wasm filter and plain Envoy.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    ext_proc: bool,
    /// Seed of the generated conversations.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl OverheadArgs {
    /// The main run's settings from the flags.
    fn settings(&self) -> Result<OverheadSettings> {
        if !(self.sim_speedup.is_finite() && self.sim_speedup > 0.0 && self.rps_seconds >= 0.0) {
            bail!("--sim-speedup must be > 0 and --rps-seconds >= 0");
        }
        Ok(OverheadSettings {
            sizes: parse_sizes(&self.sizes).map_err(anyhow::Error::msg)?,
            shared_prefixes: parse_optional_sizes(&self.shared_prefixes)
                .map_err(anyhow::Error::msg)?,
            samples: self.samples.max(1),
            bases: self.bases.max(1),
            sim_speedup: self.sim_speedup,
            rps_seconds: self.rps_seconds,
            rps_rounds: self.rps_rounds,
            rps_concurrency: self.rps_concurrency.max(1),
            indexer_timeout_ms: self.indexer_timeout_ms,
            local_route_max_body_bytes: None,
            hung_case: true,
            ext_proc: self.ext_proc,
            dir: "overhead",
            seed: self.seed,
        })
    }
}

/// Runs the overhead part and records it (or why it did not run); returns the manifest of this
/// part alone and 1 per run (main, local-route) that produced a case.
pub async fn run(common: &Common, a: &OverheadArgs) -> Result<(RunManifest, usize)> {
    common.require_sim("overhead")?;
    let settings = a.settings()?;
    // The engines' modelled time is the overhead run's own (`--sim-speedup`), not a replay's.
    let fleet = common.fleet(a.workers, a.num_gpu_blocks, a.sim_speedup)?;
    let mut manifest = RunManifest {
        title: Some("kvmesh router overhead".into()),
        workload: Some(format!(
            "router overhead only{}: chat prompts of {} tokens, cold and continuation; shared prefixes of {} tokens",
            if a.ext_proc { " (wasm filter, ext_proc picker, plain Envoy)" } else { "" },
            a.sizes,
            a.shared_prefixes
        )),
        window: Some("no trace replay".into()),
        cache_capacity_blocks: Some(a.num_gpu_blocks),
        engine_block_size: Some(common.block_size),
        ..Default::default()
    };
    let mut ran = 0usize;
    match run_overhead(&settings, &fleet, &common.out).await {
        Ok(r) => {
            ran += usize::from(!r.cases.is_empty());
            manifest.overhead = r.cases;
            manifest.overhead_notes = Some(r.notes);
            manifest.extra_sections.extend(r.sections);
        }
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "overhead did not run");
            manifest.overhead_notes =
                Some(format!("**did not run**: {}", run::one_line(&format!("{e:#}"), 600)));
        }
    }
    ran += local_route_part(a, &settings, &fleet, common, &mut manifest).await;
    manifest.workers = (0..a.workers).map(|i| format!("w{i}")).collect();
    Ok((manifest, ran))
}

/// The overhead of `--local-sizes` again with the filter routing bodies of at most
/// `--local-route-max-body-bytes` alone: its cases, named `<case>_local_route`, join the overhead
/// table, its notes the overhead notes. Returns 1 when it produced a case.
async fn local_route_part(
    a: &OverheadArgs,
    settings: &OverheadSettings,
    fleet: &Fleet,
    common: &Common,
    manifest: &mut RunManifest,
) -> usize {
    let sizes = match parse_optional_sizes(&a.local_sizes) {
        Ok(sizes) if !sizes.is_empty() => sizes,
        Ok(_) => return 0,
        Err(e) => {
            tracing::error!(error = %e, "--local-sizes: the local-route overhead did not run");
            return 0;
        }
    };
    let local = OverheadSettings {
        sizes,
        shared_prefixes: Vec::new(),
        local_route_max_body_bytes: Some(a.local_route_max_body_bytes),
        hung_case: false,
        // A filter setting: the picker has nothing to compare here.
        ext_proc: false,
        dir: "local-route/overhead",
        ..settings.clone()
    };
    let heading = format!(
        "\n\n**`_local_route` cases**: the same cases on a fresh stack whose filter has `local_route_max_body_bytes: {}`, \
         so it routes these bodies alone (the session's remembered worker, else its rendezvous pin) without the `/v1/route` \
         call: not KV-aware routing, an operator's choice for short prompts (filter README, \"Routing short requests \
         locally\"). ",
        a.local_route_max_body_bytes
    );
    let notes = manifest.overhead_notes.get_or_insert_with(String::new);
    match run_overhead(&local, fleet, &common.out).await {
        Ok(r) => {
            notes.push_str(&heading);
            notes.push_str(&r.notes);
            let produced = usize::from(!r.cases.is_empty());
            manifest.overhead.extend(r.cases.into_iter().map(|mut c| {
                c.name.push_str("_local_route");
                c.local_route_max_body_bytes = local.local_route_max_body_bytes;
                c
            }));
            produced
        }
        Err(e) => {
            tracing::error!(error = format!("{e:#}"), "the local-route overhead did not run");
            notes.push_str(&format!(
                "{heading}**did not run**: {}",
                run::one_line(&format!("{e:#}"), 600)
            ));
            0
        }
    }
}
