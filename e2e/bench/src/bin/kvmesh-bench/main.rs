//! `kvmesh-bench`: every routing policy, the same fleet and workload, one report.
//!
//! One subcommand per part of a benchmark run, each with its own flags and the shared group
//! (`common.rs`: output directory, engines, block size, the stack's settings):
//! - `sweep`: the load sweep, every workload × policy × rate, each point on a fresh stack
//!   (`sweep/`);
//! - `policies`: one replay of the Mooncake trace (or the chat workload) under every policy —
//!   by default round_robin, least_request, ring_hash, kvmesh_approximate, kvmesh_precise on 8
//!   workers whose KV capacity forces eviction (`policies.rs`, `run.rs`);
//! - `overhead`: the router overhead, kvmesh against the same Envoy without the filter
//!   (`overhead/`);
//! - `aiperf`: NVIDIA's aiperf as the client of every policy's gateway (`aiperf.rs`);
//! - `report`: one report from the parts already run into the same `--out` (`make bench` runs
//!   `sweep`, then `overhead`, then `report --parts sweep,overhead`);
//! - `scale`: a thousand workers, one indexer — a synthetic fleet's KV events against a real
//!   indexer (`kvmesh_bench::scale`; `make bench-scale`); its own `scale.json` and `scale.md`,
//!   not a part of the report.
//!
//! A part writes what it would report alone to `<out>/parts/<part>.json`, then `run.json` and
//! `report.md` with the plots for itself; how parts compose is `kvmesh_bench::parts`.

mod aiperf;
mod common;
mod overhead;
mod policies;
mod run;
mod sweep;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use common::Common;
use kvmesh_bench::manifest::{ExtraSection, RunManifest};
use kvmesh_bench::micro;
use kvmesh_bench::parts::{compose, Part, PartResult};
use kvmesh_bench::policy::shell_quote;
use kvmesh_bench::report::generate;
use std::path::Path;

#[derive(Parser, Debug)]
#[command(
    name = "kvmesh-bench",
    version,
    about = "Benchmark kvmesh's routing against Envoy's policies: one part per subcommand, one report"
)]
struct Cli {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The load sweep: per workload, round_robin's ladder to its saturation, then every policy
    /// at fractions of that rate (`make bench-quick`, `make bench-vllm`).
    Sweep(sweep::command::SweepArgs),
    /// One replay of one workload (the Mooncake trace or chat sessions) under every policy.
    Policies(policies::PoliciesArgs),
    /// The latency and requests/s kvmesh adds against the same Envoy without the filter.
    Overhead(overhead::command::OverheadArgs),
    /// NVIDIA's aiperf as the client of every policy's gateway (`make bench-aiperf`).
    Aiperf(aiperf::AiperfArgs),
    /// One report from parts already run into the same `--out` (`make bench`: sweep, overhead).
    Report(ReportArgs),
    /// A thousand workers, one indexer: memory, apply throughput, routes, subscriptions and the
    /// replay storm over a synthetic fleet (`make bench-scale`) → <out>/scale.md.
    Scale(kvmesh_bench::scale::run::ScaleArgs),
}

/// `kvmesh-bench report` flags.
#[derive(clap::Args, Debug)]
struct ReportArgs {
    /// Parts to put in the report, comma-separated (sweep, policies, overhead, aiperf): each
    /// read from `<out>/parts/<part>.json`; the report orders them so.
    #[arg(long)]
    parts: String,
}

fn command_line() -> String {
    std::env::args().map(|a| shell_quote(&a)).collect::<Vec<_>>().join(" ")
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
    // On Ctrl-C or SIGTERM the run future is dropped, which drops the running stack and so kills
    // every process it started (a plain signal death would orphan them).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        r = bench(cli) => r,
        _ = tokio::signal::ctrl_c() => bail!("interrupted; stack stopped"),
        _ = term.recv() => bail!("terminated; stack stopped"),
    }
}

async fn bench(cli: Cli) -> Result<()> {
    let common = &cli.common;
    if let Command::Report(r) = &cli.command {
        let parts = Part::parse_list(&r.parts).map_err(anyhow::Error::msg)?;
        let results = parts
            .into_iter()
            .map(|p| read_part(&p.path(&common.out)))
            .collect::<Result<Vec<PartResult>>>()?;
        return write_report(common, &results);
    }
    if let Command::Scale(a) = &cli.command {
        return scale(common, a).await;
    }
    std::fs::create_dir_all(&common.out)
        .with_context(|| format!("creating {}", common.out.display()))?;
    let (part, (manifest, ran)) = match &cli.command {
        Command::Sweep(a) => (Part::Sweep, sweep::command::run(common, a).await?),
        Command::Policies(a) => (Part::Policies, policies::run(common, a).await?),
        Command::Overhead(a) => (Part::Overhead, overhead::command::run(common, a).await?),
        Command::Aiperf(a) => (Part::Aiperf, aiperf::run(common, a).await?),
        Command::Report(_) | Command::Scale(_) => bail!("handled above"),
    };
    let result = PartResult { part, ran, command: command_line(), manifest };
    let path = part.path(&common.out);
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    std::fs::write(&path, serde_json::to_string_pretty(&result)?)
        .with_context(|| format!("writing {}", path.display()))?;
    write_report(common, std::slice::from_ref(&result))
}

/// `kvmesh-bench scale`: writes `<out>/scale.json` and `<out>/scale.md`, prints the latter's path.
async fn scale(common: &Common, args: &kvmesh_bench::scale::run::ScaleArgs) -> Result<()> {
    std::fs::create_dir_all(&common.out)
        .with_context(|| format!("creating {}", common.out.display()))?;
    let release = common.release_binaries.unwrap_or(!cfg!(debug_assertions));
    let report =
        kvmesh_bench::scale::run::run(args, common.block_size, release, &common.out).await?;
    std::fs::write(common.out.join("scale.json"), serde_json::to_string_pretty(&report)?)?;
    let md = common.out.join("scale.md");
    std::fs::write(&md, report.markdown())?;
    println!("{}", md.display());
    Ok(())
}

/// A part file written by an earlier subcommand.
fn read_part(path: &Path) -> Result<PartResult> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!("reading {} (run that part into the same --out first)", path.display())
    })?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The indexer's microbenchmark section from `--indexer-figures`. Unreadable figures must not
/// cost the run its report: the section says what happened.
fn indexer_figures(path: &Path) -> ExtraSection {
    match std::fs::read_to_string(path) {
        Ok(text) => micro::section(&micro::parse(&text), &path.display().to_string()),
        Err(e) => ExtraSection {
            title: micro::TITLE.into(),
            markdown: format!("Not available: reading `{}`: {e}.", path.display()),
        },
    }
}

/// Composes `parts` into `run.json` (plus `--indexer-figures`), renders the report and prints
/// its path; an error when nothing ran.
fn write_report(common: &Common, parts: &[PartResult]) -> Result<()> {
    let (mut manifest, ran): (RunManifest, usize) = compose(parts);
    if let Some(path) = &common.indexer_figures {
        manifest.extra_sections.push(indexer_figures(path));
    }
    std::fs::create_dir_all(&common.out)
        .with_context(|| format!("creating {}", common.out.display()))?;
    let manifest_path = common.out.join("run.json");
    std::fs::write(&manifest_path, serde_json::to_string_pretty(&manifest)?)
        .with_context(|| format!("writing {}", manifest_path.display()))?;
    let written = generate(&manifest_path, &common.out, &common.font)?;
    println!("{}", written.markdown.display());
    if let Some(note) = &written.plot_note {
        eprintln!("plots: {note}");
    }
    if ran == 0 {
        bail!(
            "nothing ran (no policy, no point, no overhead case); see {}",
            written.markdown.display()
        );
    }
    Ok(())
}
