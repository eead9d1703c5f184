//! `kvmesh-report`: render `report.md` and PNG plots from a run manifest (see the crate README
//! for the manifest, results and counters shapes).

use anyhow::Result;
use clap::Parser;
use kvmesh_bench::report::{generate, plots};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "kvmesh-report",
    version,
    about = "Render the benchmark report from a run manifest"
)]
struct Cli {
    /// The run manifest (run.json); paths inside it are relative to its directory.
    #[arg(long, default_value = "bench-out/run.json")]
    manifest: PathBuf,
    /// Output directory for report.md and the plots (default: the manifest's directory).
    #[arg(long)]
    out: Option<PathBuf>,
    /// TTF font for plot text.
    #[arg(long, env = plots::FONT_ENV, default_value = plots::DEFAULT_FONT)]
    font: PathBuf,
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let out = cli.out.clone().unwrap_or_else(|| {
        cli.manifest.parent().map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."))
    });
    let written = generate(&cli.manifest, &out, &cli.font)?;
    println!("{}", written.markdown.display());
    for p in &written.plots {
        println!("{}", p.display());
    }
    if let Some(note) = written.plot_note {
        eprintln!("plots: {note}");
    }
    Ok(())
}
