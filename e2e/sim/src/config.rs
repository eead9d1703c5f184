//! Command-line configuration: one clap struct, validated once, from which every part's
//! settings are derived (never a second copy of the same knobs).
//!
//! Defaults follow vLLM where vLLM has the knob (`--block-size 16`, `--max-num-seqs 256`,
//! `--max-num-batched-tokens 8192`, KV-event buffer 10 000 steps and HWM 100 000,
//! `kv_load_failure_policy` `fail`, a 30 s KV lease); the timing defaults are in the range of an
//! 8B model on one H100 (llm-d-inference-sim's profiles).

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args as ClapArgs, Parser, ValueEnum};

use crate::faults::{FaultError, FaultPatch, Faults, SeqRange};
use crate::lora::{LoraModule, Registry, MAX_ADAPTERS};
use crate::publisher::PublisherConfig;
use crate::sched::{KvLoadFailurePolicy, SchedulerConfig};
use crate::timing::TimingModel;
use crate::window::SlidingWindow;
use crate::wire::{Layout, ReplayFraming};

/// The DeepSeek BOS token the built-in template writes.
pub const DEEPSEEK_BOS: &str = "<｜begin▁of▁sentence｜>";

/// What the worker is in a disaggregated fleet (informational: any worker serves any request,
/// as vLLM's NIXL `kv_both` does; the role is reported by `GET /admin/info`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill worker.
    Prefill,
    /// Decode worker.
    Decode,
    /// Both.
    Both,
}

/// `vllm-sim`: a vLLM-compatible engine simulator for testing and benchmarking routers.
///
/// Once every socket is bound it prints one line to stdout:
/// `READY id=<id> http=<ip:port> kv_events=<tcp://ip:port> replay=<tcp://ip:port>`
/// (kv_events and replay only when enabled). Logs go to stderr (RUST_LOG, default info).
#[derive(Debug, Clone, Parser)]
#[command(name = "vllm-sim", version, about, long_about)]
pub struct Args {
    /// HTTP listen address.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// HTTP port; 0 picks a free one (read it from the READY line).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Host given to NIXL consumers as `remote_host` [default: --host, or 127.0.0.1 if unspecified].
    #[arg(long)]
    pub advertise_host: Option<String>,
    /// Worker id: `x-sim-worker` header, `remote_engine_id`, logs [default: sim-<http port>].
    #[arg(long)]
    pub id: Option<String>,
    /// Served model name(s), as vLLM: a request's `model` must be one of them or a loaded LoRA
    /// adapter (else 404); the first names responses and the `model_name` metric label.
    /// `--model` is accepted as an alias.
    #[arg(long = "served-model-name", alias = "model", num_args = 1.., default_value = "deepseek-v4")]
    pub served_model_name: Vec<String>,
    /// Serve LoRA adapters (`--lora-modules`, `POST /v1/load_lora_adapter`, `max_loras` slots).
    #[arg(long)]
    pub enable_lora: bool,
    /// Adapters loaded at start: `name=path` or vLLM's JSON `{"name","path","base_model_name"}`
    /// (needs --enable-lora).
    #[arg(long, num_args = 1.., value_name = "NAME=PATH|JSON")]
    pub lora_modules: Vec<LoraModule>,
    /// Distinct adapters one batch may run (GPU adapter slots).
    #[arg(long, default_value_t = 1)]
    pub max_loras: usize,
    /// Adapters kept in CPU memory (informational; vLLM requires ≥ --max-loras) [default: --max-loras].
    #[arg(long)]
    pub max_cpu_loras: Option<usize>,
    /// Largest adapter rank (accepted, and ignored, for vLLM command-line parity).
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: usize,
    /// Time to load one adapter into a GPU slot when a step needs it, milliseconds (divided by --speedup).
    #[arg(long, default_value_t = 20.0)]
    pub lora_load_ms: f64,
    /// Hugging Face tokenizer.json [default: $KVMESH_TOKENIZER, else <repo>/.tools/tokenizer/tokenizer.json].
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Jinja2 chat template file [default: the built-in DeepSeek template].
    #[arg(long)]
    pub chat_template: Option<PathBuf>,
    /// BOS token given to a --chat-template file as `bos_token`.
    #[arg(long, default_value = DEEPSEEK_BOS)]
    pub bos_token: String,
    /// Tokens per KV block.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV cache capacity in blocks.
    #[arg(long, default_value_t = 8192)]
    pub num_gpu_blocks: u32,
    /// Longest prompt + completion accepted [default: num_gpu_blocks × block_size].
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Most requests in the running batch.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,
    /// Token budget of one engine step (chunked prefill beyond it).
    #[arg(long, default_value_t = 8192)]
    pub max_num_batched_tokens: usize,
    /// Bound of the waiting queue; beyond it requests get 503.
    #[arg(long, default_value_t = 4096)]
    pub max_waiting_requests: usize,
    /// Uncached prompt tokens computed per second.
    #[arg(long, default_value_t = 20_000.0)]
    pub prefill_tokens_per_s: f64,
    /// Blocks of the CPU offload tier that blocks evicted from the GPU go to (LRU); 0 = none.
    #[arg(long, default_value_t = 0)]
    pub cpu_offload_blocks: usize,
    /// Prompt tokens per second loaded from the CPU offload tier into GPU blocks.
    #[arg(long, default_value_t = 100_000.0)]
    pub cpu_load_tokens_per_s: f64,
    /// Serve a hybrid model: a second KV cache group of sliding-window attention over this many
    /// tokens (group 1 in the events; `src/window.rs`).
    #[arg(long)]
    pub sliding_window: Option<usize>,
    /// Blocks of the sliding-window group's pool [default: --num-gpu-blocks].
    #[arg(long)]
    pub sliding_window_blocks: Option<u32>,
    /// Inter-token latency of a batch of one, milliseconds.
    #[arg(long, default_value_t = 20.0)]
    pub itl_ms: f64,
    /// Extra fraction of ITL at a full batch (ITL × (1 + contention × (batch-1)/(max_num_seqs-1))).
    #[arg(long, default_value_t = 1.0)]
    pub contention: f64,
    /// Divides every modelled duration (prefill, decode, NIXL transfer); large for fast replays.
    #[arg(long, default_value_t = 1.0)]
    pub speedup: f64,
    /// Replies to requests without max_tokens stop after a seeded length in 1..=this.
    #[arg(long, default_value_t = 64)]
    pub default_max_tokens: u32,
    /// Plain words replies are drawn from (scanned from the tokenizer at start).
    #[arg(long, default_value_t = 2048)]
    pub output_vocab_size: usize,
    /// Role in a disaggregated fleet (informational; reported by GET /admin/info).
    #[arg(long, value_enum, default_value_t = Role::Both)]
    pub role: Role,
    /// ZMQ PUB endpoint for KV events, bound (e.g. tcp://127.0.0.1:* for a free port) [default: events off].
    #[arg(long)]
    pub kv_events_endpoint: Option<String>,
    /// ZMQ ROUTER endpoint serving replay of buffered batches, bound (needs --kv-events-endpoint).
    #[arg(long)]
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic frame of every KV event message.
    #[arg(long, default_value = "")]
    pub kv_events_topic: String,
    /// Event encoding: maps with a "type" key (current) or tagged arrays (legacy).
    #[arg(long, value_enum, default_value_t = Layout::Current)]
    pub kv_events_layout: Layout,
    /// Replay reply framing: [topic, seq, payload] (topic), [seq, payload] (plain), or by layout (auto).
    #[arg(long, value_enum, default_value_t = ReplayFraming::Auto)]
    pub kv_events_replay_framing: ReplayFraming,
    /// Batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_buffer_steps: usize,
    /// PUB socket send high-water mark (messages).
    #[arg(long, default_value_t = 100_000)]
    pub kv_events_hwm: i32,
    /// PUB socket's kernel send buffer (`ZMQ_SNDBUF`), bytes; 0 = the OS default (loopback TCP
    /// autotunes it to megabytes). A small one makes a stalled subscriber lose events after a
    /// known amount instead of after the kernel's buffers (the bench's `--lose-events stall`).
    #[arg(long, default_value_t = 0)]
    pub kv_events_sndbuf: i32,
    /// Batches queued between the engine and the PUB thread (overflow is left to replay).
    #[arg(long, default_value_t = 10_000)]
    pub kv_events_queue: usize,
    /// Data-parallel rank: the third element of every event batch and the `engine` metric label.
    #[arg(long, default_value_t = 0)]
    pub dp_rank: u32,
    /// What a consumer does when its NIXL pull fails: compute locally or fail the request (500).
    #[arg(long, value_enum, default_value_t = KvLoadFailurePolicy::Fail)]
    pub kv_load_failure_policy: KvLoadFailurePolicy,
    /// How long a producer holds blocks nobody pulls, seconds (real time, not sped up).
    #[arg(long, default_value_t = 30.0)]
    pub kv_transfer_timeout_s: f64,
    /// Modelled NIXL transfer cost per pulled block, microseconds (divided by --speedup).
    #[arg(long, default_value_t = 50.0)]
    pub nixl_us_per_block: f64,
    /// Deadline of a consumer's pull from the producer, milliseconds.
    #[arg(long, default_value_t = 5000)]
    pub nixl_pull_timeout_ms: u64,
    /// Largest request body accepted, bytes.
    #[arg(long, default_value_t = 32 << 20)]
    pub max_body_bytes: usize,
    /// Bound of the engine's command queue.
    #[arg(long, default_value_t = 4096)]
    pub engine_queue: usize,
    /// Tokio worker threads (HTTP and the engine loop share them).
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Faults in force from the start (same fields as POST /admin/faults).
    #[command(flatten)]
    pub faults: FaultArgs,
}

/// Start-up faults; the same knobs as `POST /admin/faults`.
#[derive(Debug, Clone, ClapArgs)]
pub struct FaultArgs {
    /// Fail prefill-leg requests (kv_transfer_params.do_remote_decode) with this status (e.g. 500, 503, 429).
    #[arg(long)]
    pub fail_prefill_status: Option<u16>,
    /// Fail migration-source requests (kv_migration_source) with this status.
    #[arg(long)]
    pub fail_migration_source_status: Option<u16>,
    /// Fail the next N OpenAI requests…
    #[arg(long, default_value_t = 0)]
    pub fail_next_count: u64,
    /// …with this status.
    #[arg(long, default_value_t = 500)]
    pub fail_next_status: u16,
    /// Delay every OpenAI request by this many (real) milliseconds before queueing it.
    #[arg(long, default_value_t = 0)]
    pub extra_latency_ms: u64,
    /// Start with KV event publishing paused (events discarded, not replayable).
    #[arg(long)]
    pub pause_events: bool,
    /// Sequence numbers START..END (half-open) kept for replay but not sent on PUB.
    #[arg(long, value_name = "START..END")]
    pub drop_seqs: Option<SeqRange>,
    /// Right after READY, close the HTTP listener for this many ms, then listen again.
    #[arg(long)]
    pub vanish_ms: Option<u64>,
}

/// An invalid flag combination or value.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A value out of range.
    #[error("--{field} {value}: {reason}")]
    InvalidValue {
        /// Flag name.
        field: &'static str,
        /// Its value.
        value: String,
        /// Why it is wrong.
        reason: &'static str,
    },
    /// A fault flag.
    #[error(transparent)]
    Fault(#[from] FaultError),
    /// A `--lora-modules` entry that cannot be loaded (e.g. a duplicate name).
    #[error("--lora-modules: {0}")]
    Lora(String),
}

fn invalid(field: &'static str, value: impl ToString, reason: &'static str) -> ConfigError {
    ConfigError::InvalidValue { field, value: value.to_string(), reason }
}

impl Args {
    /// Checks every value once; the derived configs below assume it passed.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !(1..=4096).contains(&self.block_size) {
            return Err(invalid("block-size", self.block_size, "must be in 1..=4096"));
        }
        if self.num_gpu_blocks == 0 {
            return Err(invalid("num-gpu-blocks", 0, "must be positive"));
        }
        let capacity = self.capacity_tokens();
        match self.max_model_len {
            Some(0) => return Err(invalid("max-model-len", 0, "must be positive")),
            Some(n) if n > capacity => {
                return Err(invalid(
                    "max-model-len",
                    n,
                    "exceeds the KV cache (num_gpu_blocks × block_size)",
                ));
            }
            _ => {}
        }
        for (field, v) in [
            ("max-num-seqs", self.max_num_seqs),
            ("max-num-batched-tokens", self.max_num_batched_tokens),
            ("max-waiting-requests", self.max_waiting_requests),
            ("threads", self.threads),
            ("engine-queue", self.engine_queue),
            ("kv-events-buffer-steps", self.kv_events_buffer_steps),
            ("kv-events-queue", self.kv_events_queue),
            ("default-max-tokens", self.default_max_tokens as usize),
        ] {
            if v == 0 {
                return Err(invalid(field, v, "must be positive"));
            }
        }
        for (field, v) in [
            ("prefill-tokens-per-s", self.prefill_tokens_per_s),
            ("speedup", self.speedup),
            ("cpu-load-tokens-per-s", self.cpu_load_tokens_per_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(field, v, "must be a positive number"));
            }
        }
        for (field, v) in [
            ("itl-ms", self.itl_ms),
            ("contention", self.contention),
            ("kv-transfer-timeout-s", self.kv_transfer_timeout_s),
            ("nixl-us-per-block", self.nixl_us_per_block),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(invalid(field, v, "must be a non-negative number"));
            }
        }
        if self.served_model_name.iter().any(String::is_empty) {
            return Err(invalid("served-model-name", "\"\"", "must not be empty"));
        }
        if !self.lora_modules.is_empty() && !self.enable_lora {
            return Err(invalid("lora-modules", "set", "needs --enable-lora"));
        }
        if self.max_loras == 0 {
            return Err(invalid("max-loras", 0, "must be positive"));
        }
        if let Some(n) = self.max_cpu_loras.filter(|&n| n < self.max_loras) {
            return Err(invalid("max-cpu-loras", n, "must be at least --max-loras"));
        }
        if !(self.lora_load_ms.is_finite() && self.lora_load_ms >= 0.0) {
            return Err(invalid(
                "lora-load-ms",
                self.lora_load_ms,
                "must be a non-negative number",
            ));
        }
        self.validate_window()?;
        self.registry().map_err(|e| ConfigError::Lora(e.to_string()))?;
        if self.kv_events_replay_endpoint.is_some() && self.kv_events_endpoint.is_none() {
            return Err(invalid("kv-events-replay-endpoint", "set", "needs --kv-events-endpoint"));
        }
        self.initial_faults()?;
        Ok(())
    }

    /// `--sliding-window` and its pool: a window of at least one token, a pool a request's window
    /// and one step's chunk fit in, and no CPU offload tier beside it (not modelled together).
    fn validate_window(&self) -> Result<(), ConfigError> {
        let Some(tokens) = self.sliding_window else {
            if let Some(blocks) = self.sliding_window_blocks {
                return Err(invalid("sliding-window-blocks", blocks, "needs --sliding-window"));
            }
            return Ok(());
        };
        if tokens == 0 {
            return Err(invalid("sliding-window", 0, "must be positive"));
        }
        if self.cpu_offload_blocks > 0 {
            return Err(invalid(
                "sliding-window",
                tokens,
                "is not modelled with --cpu-offload-blocks",
            ));
        }
        let min = SlidingWindow::min_blocks(tokens, self.block_size, self.max_num_batched_tokens);
        let blocks = self.sliding_window_blocks.unwrap_or(self.num_gpu_blocks);
        if (blocks as usize) < min {
            return Err(invalid(
                "sliding-window-blocks",
                blocks,
                "must hold a request's window and one step's chunk (window/block_size + max_num_batched_tokens/block_size + 2)",
            ));
        }
        Ok(())
    }

    fn capacity_tokens(&self) -> usize {
        self.num_gpu_blocks as usize * self.block_size
    }

    /// The faults in force at start.
    pub fn initial_faults(&self) -> Result<Faults, FaultError> {
        let f = &self.faults;
        let patch = FaultPatch {
            clear: true,
            fail_prefill_status: Some(f.fail_prefill_status),
            fail_migration_source_status: Some(f.fail_migration_source_status),
            fail_next_count: Some(f.fail_next_count),
            fail_next_status: Some(f.fail_next_status),
            extra_latency_ms: Some(f.extra_latency_ms),
            pause_events: Some(f.pause_events),
            drop_seqs: Some(f.drop_seqs),
            vanish_ms: None,
            ..FaultPatch::default()
        };
        let mut faults = Faults::default();
        faults.apply(&patch)?;
        Ok(faults)
    }

    /// `--max-model-len` or the cache capacity.
    pub fn max_model_len(&self) -> usize {
        self.max_model_len.unwrap_or_else(|| self.capacity_tokens())
    }

    /// The step-duration model.
    pub fn timing(&self) -> TimingModel {
        TimingModel {
            prefill_tokens_per_s: self.prefill_tokens_per_s,
            itl_s: self.itl_ms / 1000.0,
            contention: self.contention,
            max_num_seqs: u32::try_from(self.max_num_seqs).unwrap_or(u32::MAX),
            speedup: self.speedup,
        }
    }

    /// The scheduler's limits.
    pub fn scheduler_config(&self) -> SchedulerConfig {
        SchedulerConfig {
            block_size: self.block_size,
            num_gpu_blocks: self.num_gpu_blocks,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_waiting: self.max_waiting_requests,
            max_model_len: self.max_model_len(),
            timing: self.timing(),
            kv_load_failure_policy: self.kv_load_failure_policy,
            kv_transfer_timeout: Duration::from_secs_f64(self.kv_transfer_timeout_s),
            max_loras: self.enable_lora.then_some(self.max_loras),
            lora_load_ms: self.lora_load_ms,
            cpu_offload_blocks: self.cpu_offload_blocks,
            cpu_load_tokens_per_s: self.cpu_load_tokens_per_s,
            sliding_window: self.sliding_window.map(|tokens| SlidingWindow {
                tokens,
                blocks: self.sliding_window_blocks.unwrap_or(self.num_gpu_blocks),
            }),
        }
    }

    /// The served models with the `--lora-modules` loaded in order (as vLLM's `init_static_loras`).
    pub fn registry(&self) -> Result<Registry, crate::lora::LoraError> {
        let mut r = Registry::new(self.served_model_name.clone(), MAX_ADAPTERS);
        for m in &self.lora_modules {
            r.load(&m.name, &m.path, m.base_model_name.as_deref(), false)?;
        }
        Ok(r)
    }

    /// The first served name (responses' `model`, the metrics' `model_name`).
    pub fn model_name(&self) -> &str {
        self.served_model_name.first().map_or("", String::as_str)
    }

    /// `--max-cpu-loras` or its default, `--max-loras`.
    pub fn max_cpu_loras(&self) -> usize {
        self.max_cpu_loras.unwrap_or(self.max_loras)
    }

    /// The publisher's settings, when events are enabled.
    pub fn publisher_config(&self) -> Option<PublisherConfig> {
        Some(PublisherConfig {
            endpoint: self.kv_events_endpoint.clone()?,
            replay_endpoint: self.kv_events_replay_endpoint.clone(),
            topic: self.kv_events_topic.clone(),
            layout: self.kv_events_layout,
            framing: self.kv_events_replay_framing,
            buffer_steps: self.kv_events_buffer_steps,
            hwm: self.kv_events_hwm,
            sndbuf: self.kv_events_sndbuf,
            queue: self.kv_events_queue,
            dp_rank: self.dp_rank,
        })
    }

    /// `remote_host` for NIXL consumers.
    pub fn advertise_host(&self) -> String {
        match &self.advertise_host {
            Some(h) => h.clone(),
            None if self.host.is_unspecified() => "127.0.0.1".to_owned(),
            None => self.host.to_string(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("vllm-sim").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn defaults_follow_vllm() {
        let a = parse(&[]);
        a.validate().unwrap();
        assert_eq!((a.block_size, a.max_num_seqs, a.max_num_batched_tokens), (16, 256, 8192));
        assert_eq!((a.kv_events_buffer_steps, a.kv_events_hwm), (10_000, 100_000));
        assert_eq!(a.kv_load_failure_policy, KvLoadFailurePolicy::Fail);
        assert_eq!(a.max_model_len(), 8192 * 16);
        assert_eq!(a.advertise_host(), "127.0.0.1");
        assert!(a.publisher_config().is_none());
        assert_eq!(parse(&["--host", "0.0.0.0"]).advertise_host(), "127.0.0.1");
    }

    #[test]
    fn invalid_values_are_refused() {
        for args in [
            &["--block-size", "0"][..],
            &["--num-gpu-blocks", "4", "--max-model-len", "100"],
            &["--speedup", "0"],
            &["--itl-ms=-1"],
            &["--kv-events-replay-endpoint", "tcp://127.0.0.1:*"],
            &["--fail-prefill-status", "200"],
            &["--max-num-seqs", "0"],
            &["--lora-modules", "a=/p"],
            &["--enable-lora", "--lora-modules", "a=/p", "a=/q"],
            &["--enable-lora", "--max-loras", "0"],
            &["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
            &["--lora-load-ms=-1"],
            &["--sliding-window", "0"],
            &["--sliding-window-blocks", "64"],
            &["--sliding-window", "64", "--cpu-offload-blocks", "8"],
            // 64 tokens = 4 blocks, a chunk of 8192 tokens = 512 blocks, + 2.
            &["--sliding-window", "64", "--sliding-window-blocks", "517"],
        ] {
            assert!(parse(args).validate().is_err(), "{args:?}");
        }
        assert!(Args::try_parse_from(["vllm-sim", "--drop-seqs", "5..1"]).is_err());
    }

    #[test]
    fn a_sliding_window_makes_a_hybrid_model() {
        assert_eq!(parse(&[]).scheduler_config().sliding_window, None);
        let a = parse(&["--sliding-window", "64", "--sliding-window-blocks", "518"]);
        a.validate().unwrap();
        let w = a.scheduler_config().sliding_window;
        assert_eq!(w, Some(SlidingWindow { tokens: 64, blocks: 518 }));
        let a = parse(&["--sliding-window", "4096"]);
        a.validate().unwrap();
        assert_eq!(a.scheduler_config().sliding_window.map(|w| w.blocks), Some(8192));
    }

    #[test]
    fn served_names_and_lora_modules() {
        let a = parse(&[]);
        assert_eq!((a.model_name(), a.enable_lora, a.max_loras), ("deepseek-v4", false, 1));
        assert_eq!(a.scheduler_config().max_loras, None);
        let a = parse(&[
            "--served-model-name",
            "ds4",
            "deepseek-v4",
            "--enable-lora",
            "--lora-modules",
            "sql=/a/sql",
            r#"{"name":"chat","path":"/a/chat","base_model_name":"deepseek-v4"}"#,
            "--max-loras",
            "2",
        ]);
        a.validate().unwrap();
        assert_eq!(a.served_model_name, ["ds4", "deepseek-v4"]);
        assert_eq!((a.scheduler_config().max_loras, a.max_cpu_loras()), (Some(2), 2));
        let r = a.registry().unwrap();
        let rows: Vec<(&str, u32, &str)> = r
            .adapters()
            .iter()
            .map(|e| (&*e.adapter.name, e.adapter.id, e.parent.as_str()))
            .collect();
        assert_eq!(rows, [("sql", 1, "ds4"), ("chat", 2, "deepseek-v4")]);
        // `--model` still names the served model.
        assert_eq!(parse(&["--model", "m"]).model_name(), "m");
    }

    #[test]
    fn fault_flags_build_the_initial_faults() {
        let a = parse(&[
            "--fail-prefill-status",
            "503",
            "--drop-seqs",
            "2..4",
            "--pause-events",
            "--fail-next-count",
            "3",
        ]);
        let f = a.initial_faults().unwrap();
        assert_eq!(f.fail_prefill_status, Some(503));
        assert_eq!(f.drop_seqs, Some(SeqRange { start: 2, end: 4 }));
        assert!(f.pause_events);
        assert_eq!((f.fail_next_count, f.fail_next_status), (3, 500));
    }
}
