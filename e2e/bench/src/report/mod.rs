//! The benchmark report: manifest + per-policy files in, `report.md` + PNG plots out.
//!
//! `summary`, `targets` and `markdown` are pure; `plots` draws files; [`generate`] is the thin
//! I/O shell that reads the inputs named by the manifest and writes the outputs. Used by the
//! `kvmesh-report` binary and by the orchestrator after its runs.

pub mod attribution;
pub mod markdown;
pub mod paths;
pub mod plots;
pub mod replicas;
pub mod summary;
pub mod sweep;
pub mod targets;

use crate::counters::PolicyCounters;
use crate::manifest::{resolve, ManifestError, RunManifest};
use crate::record::{read_all, RecordError};
use std::path::{Path, PathBuf};

/// Name of the Markdown file written into the output directory.
pub const REPORT_MD: &str = "report.md";

/// Why the report could not be produced.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// The manifest is unreadable.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// A results file could not be opened.
    #[error("opening results {path}: {source}")]
    ResultsOpen {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// A results file is malformed.
    #[error("results {path}: {source}")]
    Results {
        /// The file.
        path: PathBuf,
        /// The error.
        source: RecordError,
    },
    /// A counters file is unreadable or malformed.
    #[error("counters {path}: {reason}")]
    Counters {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// Writing the report failed.
    #[error("writing {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// What [`generate`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportOutput {
    /// The Markdown report.
    pub markdown: PathBuf,
    /// Plot files written.
    pub plots: Vec<PathBuf>,
    /// Why plots are missing, when some are.
    pub plot_note: Option<String>,
}

fn load_counters(path: &Path) -> Result<PolicyCounters, ReportError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ReportError::Counters { path: path.to_path_buf(), reason: e.to_string() })?;
    serde_json::from_str(&text)
        .map_err(|e| ReportError::Counters { path: path.to_path_buf(), reason: e.to_string() })
}

/// Reads the manifest at `manifest_path` and its inputs, writes `report.md` and the plots into
/// `out_dir`. `font` is the TTF for plot text; when it cannot be loaded the report is written
/// without plots and says so.
pub fn generate(
    manifest_path: &Path,
    out_dir: &Path,
    font: &Path,
) -> Result<ReportOutput, ReportError> {
    let manifest = RunManifest::load(manifest_path)?;
    let base = manifest_path.parent().unwrap_or(Path::new("."));
    let mut summaries = Vec::with_capacity(manifest.policies.len());
    for p in &manifest.policies {
        let results_path = resolve(base, &p.results);
        let file = std::fs::File::open(&results_path)
            .map_err(|source| ReportError::ResultsOpen { path: results_path.clone(), source })?;
        let records = read_all(std::io::BufReader::new(file))
            .map_err(|source| ReportError::Results { path: results_path.clone(), source })?;
        let counters = match &p.counters {
            Some(c) => Some(load_counters(&resolve(base, c))?),
            None => None,
        };
        summaries.push(summary::summarize(&p.name, &records, counters.as_ref(), &manifest.workers));
    }
    let targets = targets::evaluate(&summaries, manifest.ceiling.as_ref(), &manifest.overhead);

    std::fs::create_dir_all(out_dir)
        .map_err(|source| ReportError::Write { path: out_dir.to_path_buf(), source })?;
    let (links, plots, note) = draw_all(out_dir, &summaries, &manifest, font);
    let md = markdown::render(&manifest, &summaries, &targets, &links);
    let md_path = out_dir.join(REPORT_MD);
    std::fs::write(&md_path, md)
        .map_err(|source| ReportError::Write { path: md_path.clone(), source })?;
    Ok(ReportOutput { markdown: md_path, plots, plot_note: note })
}

fn draw_all(
    out_dir: &Path,
    summaries: &[summary::PolicySummary],
    manifest: &RunManifest,
    font: &Path,
) -> (markdown::PlotLinks, Vec<PathBuf>, Option<String>) {
    let mut links = markdown::PlotLinks::default();
    let mut written = Vec::new();
    if summaries.is_empty() {
        // Nothing to plot (`--only overhead`): no empty charts.
        return (links, written, None);
    }
    if let Err(e) = plots::register_font(font) {
        let note = format!("not drawn: {e}");
        tracing::warn!(error = %e, "plots skipped");
        links.note = Some(note.clone());
        return (links, written, Some(note));
    }
    let mut failures = Vec::new();
    let ceiling = manifest.ceiling.as_ref().map(|c| c.block_rate());
    let ttft = out_dir.join(plots::TTFT_CDF_PNG);
    match plots::ttft_cdf(&ttft, summaries) {
        Ok(()) => {
            links.ttft_cdf = Some(plots::TTFT_CDF_PNG.to_string());
            written.push(ttft);
        }
        Err(e) => failures.push(e.to_string()),
    }
    let hit = out_dir.join(plots::HIT_RATE_PNG);
    match plots::hit_rate(&hit, summaries, ceiling) {
        Ok(()) => {
            links.hit_rate = Some(plots::HIT_RATE_PNG.to_string());
            written.push(hit);
        }
        Err(e) => failures.push(e.to_string()),
    }
    let rpw = out_dir.join(plots::REQUESTS_PER_WORKER_PNG);
    match plots::requests_per_worker(&rpw, summaries) {
        Ok(()) => {
            links.requests_per_worker = Some(plots::REQUESTS_PER_WORKER_PNG.to_string());
            written.push(rpw);
        }
        Err(e) => failures.push(e.to_string()),
    }
    let note = (!failures.is_empty()).then(|| failures.join("; "));
    links.note = note.clone();
    (links, written, note)
}
