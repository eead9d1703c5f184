//! The run manifest: everything `kvmesh-report` needs to know about one benchmark run.
//!
//! The orchestrator (or an operator by hand) writes `run.json` next to the per-policy files:
//!
//! ```text
//! bench-out/
//!   run.json                      RunManifest (this module)
//!   <policy>/results.jsonl        RequestRecord per line (crate::record)
//!   <policy>/counters.json        PolicyCounters (crate::counters), optional
//! ```
//!
//! Paths inside the manifest are relative to the manifest's directory (absolute paths work too),
//! so a whole `bench-out/` can be moved and re-rendered. Only `policies` is required; every
//! header field the report cannot know from the data defaults to "not stated".

use crate::ceiling::Ceiling;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One policy's inputs.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PolicyEntry {
    /// Policy name; the targets look for `round_robin`, `kvmesh_approximate`, `kvmesh_precise`.
    pub name: String,
    /// Results JSONL (one `RequestRecord` per line).
    pub results: PathBuf,
    /// Counters JSON (`PolicyCounters`), when scraped.
    #[serde(default)]
    pub counters: Option<PathBuf>,
    /// Free text shown under the policy (e.g. how the stack was configured).
    #[serde(default)]
    pub notes: Option<String>,
}

/// One router-overhead measurement: latency added by kvmesh against plain Envoy.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OverheadCase {
    /// Case name; the target reads `chat_8k_continuation`.
    pub name: String,
    /// p50 added latency, ms.
    pub p50_added_ms: f64,
    /// p99 added latency, ms.
    #[serde(default)]
    pub p99_added_ms: Option<f64>,
    /// Requests/s one gateway sustained with kvmesh, when measured.
    #[serde(default)]
    pub rps_kvmesh: Option<f64>,
    /// Requests/s the same gateway sustained without the filter.
    #[serde(default)]
    pub rps_plain: Option<f64>,
    /// Share of the kvmesh requests/s requests the filter routed without the indexer (its timeout
    /// under load): a rate bought by giving up KV-aware routing.
    #[serde(default)]
    pub rps_kvmesh_fallback_share: Option<f64>,
    /// Route throughput per indexer core during the kvmesh requests/s rounds: routes the indexer
    /// answered ÷ its CPU-seconds (`/proc/<pid>/stat`).
    #[serde(default)]
    pub routes_per_indexer_core: Option<f64>,
    /// Mean indexer CPU cores busy over those rounds.
    #[serde(default)]
    pub indexer_cores: Option<f64>,
    /// Samples per path (kvmesh and plain each) behind the percentiles.
    #[serde(default)]
    pub samples: Option<u64>,
    /// Mean prompt tokens of the measured requests (the engines' `usage.prompt_tokens`).
    #[serde(default)]
    pub prompt_tokens: Option<f64>,
    /// Gateway time with kvmesh (Envoy's own timestamps: request held + response held), p50 ms.
    #[serde(default)]
    pub kvmesh_p50_ms: Option<f64>,
    /// Same, p99 ms.
    #[serde(default)]
    pub kvmesh_p99_ms: Option<f64>,
    /// Gateway time without the filter, p50 ms.
    #[serde(default)]
    pub plain_p50_ms: Option<f64>,
    /// Same, p99 ms.
    #[serde(default)]
    pub plain_p99_ms: Option<f64>,
    /// Client-observed TTFT, kvmesh p50 − plain p50, ms (engine time included on both sides).
    #[serde(default)]
    pub client_p50_added_ms: Option<f64>,
    /// Client-observed TTFT, kvmesh p99 − plain p99, ms.
    #[serde(default)]
    pub client_p99_added_ms: Option<f64>,
    /// Of the kvmesh gateway time: the indexer answering `/v1/route` (its own timer), p50 ms.
    #[serde(default)]
    pub indexer_p50_ms: Option<f64>,
    /// Of that: tokenization (the indexer's timer), p50 ms.
    #[serde(default)]
    pub tokenize_p50_ms: Option<f64>,
    /// Of that: `find_matches` (the indexer's timer), p50 ms.
    #[serde(default)]
    pub match_p50_ms: Option<f64>,
    /// Of that: scoring — views, decide, booking (the indexer's timer), p50 ms.
    #[serde(default)]
    pub score_p50_ms: Option<f64>,
    /// kvmesh samples the filter routed without the indexer (`x-kvmesh-fallback`), e.g. timeouts.
    #[serde(default)]
    pub fallbacks: Option<u64>,
    /// Failed samples (both paths), left out of the percentiles.
    #[serde(default)]
    pub failed: Option<u64>,
    /// The filter's `local_route_max_body_bytes` when the case ran with it (its requests routed
    /// by the filter alone, not KV-aware): reported, never judged against the target.
    #[serde(default)]
    pub local_route_max_body_bytes: Option<usize>,
    /// The way through kvmesh this row measured (its `kvmesh_*` and `rps_kvmesh` fields):
    /// absent = the wasm filter; `ext_proc` = Envoy's ext_proc filter calling the indexer's
    /// endpoint picker (rows named `<case>_ext_proc`).
    #[serde(default)]
    pub edge: Option<String>,
    /// CPU-ms per request of this row's path in the requests/s rounds, by process.
    #[serde(default)]
    pub cpu_ms_per_request: Option<ProcessCpu>,
    /// The same for plain Envoy, in the same rounds.
    #[serde(default)]
    pub plain_cpu_ms_per_request: Option<ProcessCpu>,
}

/// CPU time per request by process (user + system from `/proc/<pid>/stat`, over closed-loop
/// rounds, ÷ the rounds' requests), ms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ProcessCpu {
    /// Envoy.
    pub envoy_ms: f64,
    /// The indexer (for plain Envoy: its background work only).
    pub indexer_ms: f64,
    /// The bench's closed-loop client.
    pub client_ms: f64,
}

/// An extra Markdown section appended verbatim (e.g. indexer microbenchmarks).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExtraSection {
    /// Section heading.
    pub title: String,
    /// Markdown body.
    pub markdown: String,
}

/// `run.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RunManifest {
    /// Report title.
    #[serde(default)]
    pub title: Option<String>,
    /// Workload description: the trace file, or the chat generator's parameters.
    #[serde(default)]
    pub workload: Option<String>,
    /// The window replayed (`Selection::describe`).
    #[serde(default)]
    pub window: Option<String>,
    /// Speed-up factor of the replay.
    #[serde(default)]
    pub speedup: Option<f64>,
    /// Worker ids of the fleet (idle workers count in the load balance).
    #[serde(default)]
    pub workers: Vec<String>,
    /// KV capacity per worker, in engine blocks.
    #[serde(default)]
    pub cache_capacity_blocks: Option<u64>,
    /// Engine block size, in tokens.
    #[serde(default)]
    pub engine_block_size: Option<u32>,
    /// The window's intrinsic reuse (trace workload).
    #[serde(default)]
    pub ceiling: Option<Ceiling>,
    /// Commands that reproduce the run, shown verbatim.
    #[serde(default)]
    pub commands: Vec<String>,
    /// The policies, in report order.
    pub policies: Vec<PolicyEntry>,
    /// Router overhead cases, when measured.
    #[serde(default)]
    pub overhead: Vec<OverheadCase>,
    /// How the overhead was measured (setup, samples, what did not run), shown above its table.
    #[serde(default)]
    pub overhead_notes: Option<String>,
    /// Extra sections appended at the end.
    #[serde(default)]
    pub extra_sections: Vec<ExtraSection>,
}

/// Why a manifest could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    /// Reading failed.
    #[error("reading {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Not valid JSON of the expected shape.
    #[error("parsing {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The error.
        source: serde_json::Error,
    },
}

impl RunManifest {
    /// Reads a manifest file.
    pub fn load(path: &Path) -> Result<Self, ManifestError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ManifestError::Io { path: path.to_path_buf(), source })?;
        serde_json::from_str(&text)
            .map_err(|source| ManifestError::Json { path: path.to_path_buf(), source })
    }
}

/// Resolves a manifest path against the manifest's directory.
pub fn resolve(base_dir: &Path, p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        base_dir.join(p)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minimal_manifest_parses_with_defaults() {
        let m: RunManifest = serde_json::from_str(
            r#"{"policies":[{"name":"round_robin","results":"rr/results.jsonl"}]}"#,
        )
        .unwrap();
        assert_eq!(m.policies.len(), 1);
        assert_eq!(m.policies[0].counters, None);
        assert!(m.workers.is_empty() && m.commands.is_empty() && m.overhead.is_empty());
    }

    #[test]
    fn resolve_keeps_absolute_paths() {
        let base = Path::new("/out");
        assert_eq!(resolve(base, Path::new("a/b")), PathBuf::from("/out/a/b"));
        assert_eq!(resolve(base, Path::new("/x")), PathBuf::from("/x"));
    }

    #[test]
    fn round_trip() {
        let m = RunManifest {
            title: Some("t".into()),
            speedup: Some(4.0),
            ceiling: Some(Ceiling {
                requests: 1,
                blocks_total: 2,
                blocks_reused: 1,
                tokens_total: 3,
                tokens_reused: 1,
            }),
            policies: vec![PolicyEntry {
                name: "p".into(),
                results: "p.jsonl".into(),
                ..Default::default()
            }],
            ..Default::default()
        };
        let back: RunManifest = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
    }
}
