//! Every metric `vllm-sim` exports, declared once, rendered as Prometheus text.
//!
//! Engine metrics carry vLLM's names and labels (`model_name`, `engine` = the DP rank), so a
//! router or dashboard built for vLLM reads the simulator unchanged; counters end in `_total`
//! as `prometheus_client` exposes vLLM's. Scheduler counters are mirrored from the engine's
//! cumulative [`SchedStats`] after every step (one short lock); latency histograms and the
//! simulator's own `kvmesh_sim_*` counters are atomics written where things happen.
//!
//! Over 600 lines: every vLLM metric the simulator exports is declared and rendered here, in one
//! place, so that its names and labels can be checked against vLLM's in one read.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use parking_lot::Mutex;

use crate::sched::SchedStats;

/// `vllm:num_requests_running` (gauge).
pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
/// `vllm:num_requests_waiting` (gauge).
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
/// `vllm:kv_cache_usage_perc` (gauge, 0..1).
pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
/// `vllm:prefix_cache_queries_total` (counter, tokens).
pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";
/// `vllm:prefix_cache_hits_total` (counter, tokens; includes NIXL-pulled tokens).
pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";
/// `vllm:external_prefix_cache_queries_total` (counter, tokens asked of a NIXL producer).
pub const EXTERNAL_PREFIX_CACHE_QUERIES: &str = "vllm:external_prefix_cache_queries_total";
/// `vllm:external_prefix_cache_hits_total` (counter, tokens pulled from a NIXL producer).
pub const EXTERNAL_PREFIX_CACHE_HITS: &str = "vllm:external_prefix_cache_hits_total";
/// `vllm:prompt_tokens_total` (counter; counted when a request's prefill yields its first token).
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
/// `vllm:prompt_tokens_cached_total` (counter): of those, tokens not computed (local + external).
pub const PROMPT_TOKENS_CACHED: &str = "vllm:prompt_tokens_cached_total";
/// `vllm:prompt_tokens_by_source_total{source}` (counter): `local_compute`, `local_cache_hit`,
/// `external_kv_transfer`; the three add up to `vllm:prompt_tokens_total`.
pub const PROMPT_TOKENS_BY_SOURCE: &str = "vllm:prompt_tokens_by_source_total";
/// `vllm:generation_tokens_total` (counter).
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
/// `vllm:request_success_total{finished_reason}` (counter).
pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";
/// `vllm:num_preemptions_total` (counter).
pub const NUM_PREEMPTIONS: &str = "vllm:num_preemptions_total";
/// `vllm:time_to_first_token_seconds` (histogram).
pub const TIME_TO_FIRST_TOKEN: &str = "vllm:time_to_first_token_seconds";
/// `vllm:e2e_request_latency_seconds` (histogram).
pub const E2E_REQUEST_LATENCY: &str = "vllm:e2e_request_latency_seconds";
/// `vllm:request_queue_time_seconds` (histogram): arrival → first scheduled.
pub const REQUEST_QUEUE_TIME: &str = "vllm:request_queue_time_seconds";
/// `vllm:request_prefill_time_seconds` (histogram): first scheduled → first token.
pub const REQUEST_PREFILL_TIME: &str = "vllm:request_prefill_time_seconds";
/// `vllm:request_decode_time_seconds` (histogram): first token → last token.
pub const REQUEST_DECODE_TIME: &str = "vllm:request_decode_time_seconds";
/// `vllm:request_inference_time_seconds` (histogram): first scheduled → last token.
pub const REQUEST_INFERENCE_TIME: &str = "vllm:request_inference_time_seconds";
/// `vllm:request_prefill_kv_computed_tokens` (histogram): prompt tokens a request computed.
pub const REQUEST_PREFILL_KV_COMPUTED: &str = "vllm:request_prefill_kv_computed_tokens";
/// `vllm:iteration_tokens_total` (histogram, despite the name): tokens per engine step.
pub const ITERATION_TOKENS: &str = "vllm:iteration_tokens_total";
/// `vllm:cache_config_info` (gauge 1; labels `block_size`, `num_gpu_blocks`, …).
pub const CACHE_CONFIG_INFO: &str = "vllm:cache_config_info";
/// `vllm:lora_requests_info` (gauge, LoRA only): one series per distinct
/// `{max_lora, waiting_lora_adapters, running_lora_adapters}` label set, valued with the wall-clock
/// time it was last seen (vLLM's `set_to_current_time()`); the newest series is the current state.
pub const LORA_REQUESTS_INFO: &str = "vllm:lora_requests_info";
/// `kvmesh_sim_lora_loads_total` (counter): adapters loaded into a GPU slot by a step.
pub const LORA_LOADS: &str = "kvmesh_sim_lora_loads_total";
/// `kvmesh_sim_requests_aborted_total` (counter): requests cancelled because the client left.
pub const REQUESTS_ABORTED: &str = "kvmesh_sim_requests_aborted_total";
/// `kvmesh_sim_requests_rejected_total{reason}` (counter): requests answered with an error.
pub const REQUESTS_REJECTED: &str = "kvmesh_sim_requests_rejected_total";
/// `kvmesh_sim_faults_injected_total{fault}` (counter).
pub const FAULTS_INJECTED: &str = "kvmesh_sim_faults_injected_total";
/// `kvmesh_sim_kv_event_batches_total{outcome}` (counter): `published`, `dropped_fault`,
/// `dropped_queue_full` (both still replayable), `paused` (lost), `encode_error`.
pub const KV_EVENT_BATCHES: &str = "kvmesh_sim_kv_event_batches_total";
/// `kvmesh_sim_kv_replay_requests_total` (counter): replay requests served.
pub const KV_REPLAY_REQUESTS: &str = "kvmesh_sim_kv_replay_requests_total";
/// `kvmesh_sim_nixl_pulls_total{outcome}` (counter, consumer side): `ok`, `failed`.
pub const NIXL_PULLS: &str = "kvmesh_sim_nixl_pulls_total";
/// `kvmesh_sim_nixl_transfers_total{outcome}` (counter, producer side): `served`, `expired`.
pub const NIXL_TRANSFERS: &str = "kvmesh_sim_nixl_transfers_total";
/// `kvmesh_sim_kv_load_failures_total` (counter): pulls that failed or returned other tokens.
pub const KV_LOAD_FAILURES: &str = "kvmesh_sim_kv_load_failures_total";
/// `kvmesh_sim_engine_steps_total` (counter).
pub const ENGINE_STEPS: &str = "kvmesh_sim_engine_steps_total";
/// `kvmesh_sim_prefix_cache_preempted_requests_total` (counter): re-admissions of preempted
/// requests. vLLM keeps these in `PrefixCacheStats.preempted_*` and exports no metric for them.
pub const PREEMPTED_REQUESTS: &str = "kvmesh_sim_prefix_cache_preempted_requests_total";
/// `kvmesh_sim_prefix_cache_preempted_queries_total` (counter, tokens): what they looked up.
pub const PREEMPTED_QUERIES: &str = "kvmesh_sim_prefix_cache_preempted_queries_total";
/// `kvmesh_sim_prefix_cache_preempted_hits_total` (counter, tokens): what they hit.
pub const PREEMPTED_HITS: &str = "kvmesh_sim_prefix_cache_preempted_hits_total";

/// Every metric name, for the README drift test.
pub const ALL: &[&str] = &[
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    KV_CACHE_USAGE_PERC,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    EXTERNAL_PREFIX_CACHE_QUERIES,
    EXTERNAL_PREFIX_CACHE_HITS,
    PROMPT_TOKENS,
    PROMPT_TOKENS_CACHED,
    PROMPT_TOKENS_BY_SOURCE,
    GENERATION_TOKENS,
    REQUEST_SUCCESS,
    NUM_PREEMPTIONS,
    TIME_TO_FIRST_TOKEN,
    E2E_REQUEST_LATENCY,
    REQUEST_QUEUE_TIME,
    REQUEST_PREFILL_TIME,
    REQUEST_DECODE_TIME,
    REQUEST_INFERENCE_TIME,
    REQUEST_PREFILL_KV_COMPUTED,
    ITERATION_TOKENS,
    CACHE_CONFIG_INFO,
    LORA_REQUESTS_INFO,
    LORA_LOADS,
    REQUESTS_ABORTED,
    REQUESTS_REJECTED,
    FAULTS_INJECTED,
    KV_EVENT_BATCHES,
    KV_REPLAY_REQUESTS,
    NIXL_PULLS,
    NIXL_TRANSFERS,
    KV_LOAD_FAILURES,
    ENGINE_STEPS,
    PREEMPTED_REQUESTS,
    PREEMPTED_QUERIES,
    PREEMPTED_HITS,
];

/// vLLM's TTFT buckets (seconds; `vllm/v1/metrics/buckets.py`).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's request-latency buckets (seconds), shared by the e2e, queue, prefill, decode and
/// inference histograms.
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// vLLM's tokens-per-step buckets.
const ITERATION_TOKENS_BUCKETS: &[f64] =
    &[1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];

/// vLLM's `request_tokens` buckets: 1, 2, 5, 10, 20, 50, … up to `max` (`build_1_2_5_buckets`).
pub fn buckets_1_2_5(max: usize) -> Vec<f64> {
    let mut out = Vec::new();
    let mut scale: usize = 1;
    loop {
        for m in [1, 2, 5] {
            match scale.checked_mul(m) {
                Some(v) if v <= max => out.push(v as f64),
                _ => return out,
            }
        }
        match scale.checked_mul(10) {
            Some(s) => scale = s,
            None => return out,
        }
    }
}

/// A bucket bound as Python's `prometheus_client` writes it (`floatToGoString`): integral values
/// keep a `.0` (`le="1.0"`, `le="2560.0"`), so label values match a real vLLM's exactly.
pub fn le_label(b: f64) -> String {
    if b.is_finite() && b.fract() == 0.0 && b.abs() < 1e16 {
        format!("{b:.1}")
    } else {
        format!("{b}")
    }
}

/// A fixed-bucket histogram (seconds or tokens).
#[derive(Debug)]
pub struct Histogram {
    bounds: Vec<f64>,
    counts: Vec<AtomicU64>,
    /// Sum in nano-units (ns for seconds), so it stays an atomic integer.
    sum_nano: AtomicU64,
}

impl Histogram {
    fn new(bounds: &[f64]) -> Self {
        Self {
            bounds: bounds.to_vec(),
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nano: AtomicU64::new(0),
        }
    }

    /// Records one observation.
    pub fn observe(&self, v: f64) {
        let i = self.bounds.iter().position(|&b| v <= b).unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get(i) {
            c.fetch_add(1, Relaxed);
        }
        self.sum_nano.fetch_add((v.max(0.0) * 1e9) as u64, Relaxed);
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Relaxed)).sum()
    }

    /// Sum of the observations.
    pub fn sum(&self) -> f64 {
        self.sum_nano.load(Relaxed) as f64 / 1e9
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let mut cum = 0;
        for (i, b) in self.bounds.iter().enumerate() {
            cum += self.counts[i].load(Relaxed);
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{}\"}} {cum}", le_label(*b));
        }
        cum += self.counts[self.bounds.len()].load(Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {cum}");
        let _ = writeln!(out, "{name}_sum{{{labels}}} {}", self.sum());
        let _ = writeln!(out, "{name}_count{{{labels}}} {cum}");
    }
}

/// Label values of a counter family with a fixed label set.
#[derive(Debug)]
pub struct LabeledCounter {
    label: &'static str,
    values: &'static [&'static str],
    counts: Vec<AtomicU64>,
}

impl LabeledCounter {
    fn new(label: &'static str, values: &'static [&'static str]) -> Self {
        Self { label, values, counts: values.iter().map(|_| AtomicU64::new(0)).collect() }
    }

    /// Adds one to the series `value` (unknown values are counted under the last one).
    pub fn inc(&self, value: &str) {
        let i = self.values.iter().position(|v| *v == value).unwrap_or(self.values.len() - 1);
        self.counts[i].fetch_add(1, Relaxed);
    }

    /// The count of series `value`.
    pub fn get(&self, value: &str) -> u64 {
        self.values.iter().position(|v| *v == value).map_or(0, |i| self.counts[i].load(Relaxed))
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        for (v, c) in self.values.iter().zip(&self.counts) {
            let _ = writeln!(out, "{name}{{{labels},{}=\"{v}\"}} {}", self.label, c.load(Relaxed));
        }
    }
}

/// Most `vllm:lora_requests_info` series kept (vLLM keeps every label set it ever saw); past it
/// the series seen longest ago is dropped.
pub const MAX_LORA_INFO_SERIES: usize = 64;

/// A float as Python's `prometheus_client` writes it (`floatToGoString`): `repr`, switched to an
/// exponent above 1e6 (`1.733591234567e+09`), so a sample reads exactly like a real vLLM's.
pub fn go_float(v: f64) -> String {
    let mut s = format!("{v}");
    if v.is_finite() && !s.contains(['.', 'e']) {
        s.push_str(".0");
    }
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 && !s.contains('e') => {
            let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
            let mantissa = format!("{}.{digits}", &s[..1]);
            format!("{}e+0{}", mantissa.trim_end_matches(['0', '.']), dot - 1)
        }
        _ => s,
    }
}

/// The `vllm:lora_requests_info` series: `(running, waiting, last seen)` in first-seen order.
#[derive(Debug)]
struct LoraInfo {
    max_lora: usize,
    series: Mutex<Vec<(String, String, f64)>>,
}

/// A label value escaped for the text exposition.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Gauges and counters of one simulator.
#[derive(Debug)]
pub struct Metrics {
    labels: String,
    lora: Option<LoraInfo>,
    cache_info: String,
    sched: Mutex<SchedStats>,
    running: AtomicU64,
    waiting: AtomicU64,
    kv_usage_bits: AtomicU64,
    /// Time to first token, from request arrival.
    pub ttft: Histogram,
    /// Request latency, from arrival to the last token.
    pub e2e: Histogram,
    /// Queue time (arrival → first scheduled).
    pub queue_time: Histogram,
    /// Prefill time (first scheduled → first token).
    pub prefill_time: Histogram,
    /// Decode time (first token → last token).
    pub decode_time: Histogram,
    /// Inference time (first scheduled → last token).
    pub inference_time: Histogram,
    /// Prompt tokens each request computed (prompt − cached).
    pub prefill_kv_computed: Histogram,
    /// Tokens per engine step.
    pub iteration_tokens: Histogram,
    /// Requests answered with an error, by reason.
    pub rejected: LabeledCounter,
    /// Faults injected, by kind.
    pub faults: LabeledCounter,
    /// Event batches by outcome.
    pub event_batches: LabeledCounter,
    /// Replay requests served.
    pub replays: AtomicU64,
    /// Consumer pulls by outcome.
    pub pulls: LabeledCounter,
}

impl Metrics {
    /// Metrics for model `model_name`, engine (DP rank) `engine`, cache geometry for
    /// `cache_config_info`, `max_model_len` for the token-count buckets.
    pub fn new(
        model_name: &str,
        engine: u32,
        block_size: usize,
        num_gpu_blocks: u32,
        max_model_len: usize,
    ) -> Self {
        let model = model_name.replace('\\', "\\\\").replace('"', "\\\"");
        Self {
            labels: format!("model_name=\"{model}\",engine=\"{engine}\""),
            lora: None,
            cache_info: format!(
                "block_size=\"{block_size}\",num_gpu_blocks=\"{num_gpu_blocks}\",num_cpu_blocks=\"0\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"{engine}\""
            ),
            sched: Mutex::new(SchedStats::default()),
            running: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            kv_usage_bits: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            queue_time: Histogram::new(E2E_BUCKETS),
            prefill_time: Histogram::new(E2E_BUCKETS),
            decode_time: Histogram::new(E2E_BUCKETS),
            inference_time: Histogram::new(E2E_BUCKETS),
            prefill_kv_computed: Histogram::new(&buckets_1_2_5(max_model_len)),
            iteration_tokens: Histogram::new(ITERATION_TOKENS_BUCKETS),
            rejected: LabeledCounter::new(
                "reason",
                &["bad_request", "model_not_found", "too_long", "queue_full", "kv_load_failed", "fault", "engine_gone", "other"],
            ),
            faults: LabeledCounter::new("fault", &["fail_prefill", "fail_migration_source", "fail_next", "extra_latency", "vanish", "fail_metrics", "fail_after_pull"]),
            event_batches: LabeledCounter::new("outcome", &["published", "dropped_fault", "dropped_queue_full", "paused", "encode_error"]),
            replays: AtomicU64::new(0),
            pulls: LabeledCounter::new("outcome", &["ok", "failed"]),
        }
    }

    /// Exports `vllm:lora_requests_info` with `max_lora` = `max_loras` (LoRA enabled).
    pub fn with_lora(mut self, max_loras: usize) -> Self {
        self.lora = Some(LoraInfo { max_lora: max_loras, series: Mutex::new(Vec::new()) });
        self
    }

    /// True when `vllm:lora_requests_info` is exported.
    pub fn lora_enabled(&self) -> bool {
        self.lora.is_some()
    }

    /// Marks the series of the adapters now running and waiting (comma-separated names) as seen
    /// at `ts` (seconds since the epoch), as vLLM does after each step.
    pub fn set_lora_info(&self, running: &str, waiting: &str, ts: f64) {
        let Some(info) = &self.lora else { return };
        let mut series = info.series.lock();
        if let Some(s) = series.iter_mut().find(|(r, w, _)| r == running && w == waiting) {
            s.2 = ts;
            return;
        }
        if series.len() >= MAX_LORA_INFO_SERIES {
            let oldest =
                series.iter().enumerate().min_by(|a, b| a.1 .2.total_cmp(&b.1 .2)).map(|(i, _)| i);
            if let Some(i) = oldest {
                series.remove(i);
            }
        }
        series.push((running.to_owned(), waiting.to_owned(), ts));
    }

    /// Mirrors the engine's state after a step.
    pub fn update_engine(&self, stats: SchedStats, running: usize, waiting: usize, kv_usage: f64) {
        *self.sched.lock() = stats;
        self.running.store(running as u64, Relaxed);
        self.waiting.store(waiting as u64, Relaxed);
        self.kv_usage_bits.store(kv_usage.to_bits(), Relaxed);
    }

    /// The engine's cumulative counters as last mirrored.
    pub fn sched(&self) -> SchedStats {
        *self.sched.lock()
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let s = self.sched();
        let l = &self.labels;
        let mut o = String::with_capacity(8192);
        let gauge = |o: &mut String, name: &str, help: &str, v: f64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{l}}} {v}");
        };
        gauge(
            &mut o,
            NUM_REQUESTS_RUNNING,
            "Number of requests in model execution batches.",
            self.running.load(Relaxed) as f64,
        );
        gauge(
            &mut o,
            NUM_REQUESTS_WAITING,
            "Number of requests waiting to be processed.",
            self.waiting.load(Relaxed) as f64,
        );
        gauge(
            &mut o,
            KV_CACHE_USAGE_PERC,
            "KV-cache usage. 1 means 100 percent usage.",
            f64::from_bits(self.kv_usage_bits.load(Relaxed)),
        );
        let counter = |o: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{l}}} {v}");
        };
        counter(
            &mut o,
            PREFIX_CACHE_QUERIES,
            "Prefix cache queries, in terms of number of queried tokens.",
            s.prefix_queries,
        );
        counter(
            &mut o,
            PREFIX_CACHE_HITS,
            "Prefix cache hits, in terms of number of cached tokens.",
            s.prefix_hits,
        );
        counter(
            &mut o,
            EXTERNAL_PREFIX_CACHE_QUERIES,
            "External prefix cache queries from KV connector (tokens).",
            s.external_queries,
        );
        counter(
            &mut o,
            EXTERNAL_PREFIX_CACHE_HITS,
            "External prefix cache hits from KV connector (tokens).",
            s.external_hits,
        );
        counter(&mut o, PROMPT_TOKENS, "Number of prefill tokens processed.", s.prompt_tokens);
        counter(
            &mut o,
            PROMPT_TOKENS_CACHED,
            "Number of cached prompt tokens (local + external).",
            s.prompt_tokens_cached,
        );
        let _ = writeln!(o, "# HELP {PROMPT_TOKENS_BY_SOURCE} Number of prompt tokens by source.\n# TYPE {PROMPT_TOKENS_BY_SOURCE} counter");
        let local_hit = s.prompt_tokens_cached.saturating_sub(s.prompt_tokens_external);
        for (source, v) in [
            ("local_compute", s.prompt_tokens.saturating_sub(s.prompt_tokens_cached)),
            ("local_cache_hit", local_hit),
            ("external_kv_transfer", s.prompt_tokens_external),
        ] {
            let _ = writeln!(o, "{PROMPT_TOKENS_BY_SOURCE}{{{l},source=\"{source}\"}} {v}");
        }
        counter(
            &mut o,
            GENERATION_TOKENS,
            "Number of generation tokens processed.",
            s.generation_tokens,
        );
        counter(
            &mut o,
            NUM_PREEMPTIONS,
            "Cumulative number of preemption from the engine.",
            s.preemptions,
        );
        let _ = writeln!(o, "# HELP {REQUEST_SUCCESS} Count of successfully processed requests.\n# TYPE {REQUEST_SUCCESS} counter");
        let _ = writeln!(
            o,
            "{REQUEST_SUCCESS}{{{l},finished_reason=\"length\"}} {}",
            s.finished_length
        );
        let _ =
            writeln!(o, "{REQUEST_SUCCESS}{{{l},finished_reason=\"stop\"}} {}", s.finished_stop);
        // vLLM creates a series per FinishReason. Client disconnects are not counted (vLLM's
        // output processor drops aborted requests without stats); no model, so no repetition.
        let _ = writeln!(o, "{REQUEST_SUCCESS}{{{l},finished_reason=\"abort\"}} 0");
        let _ =
            writeln!(o, "{REQUEST_SUCCESS}{{{l},finished_reason=\"error\"}} {}", s.finished_error);
        let _ = writeln!(o, "{REQUEST_SUCCESS}{{{l},finished_reason=\"repetition\"}} 0");
        let _ = writeln!(o, "# HELP {TIME_TO_FIRST_TOKEN} Histogram of time to first token in seconds.\n# TYPE {TIME_TO_FIRST_TOKEN} histogram");
        self.ttft.render(&mut o, TIME_TO_FIRST_TOKEN, l);
        let histogram = |o: &mut String, name: &str, help: &str, h: &Histogram| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} histogram");
            h.render(o, name, l);
        };
        histogram(
            &mut o,
            E2E_REQUEST_LATENCY,
            "Histogram of e2e request latency in seconds.",
            &self.e2e,
        );
        histogram(
            &mut o,
            REQUEST_QUEUE_TIME,
            "Histogram of time spent in WAITING phase for request.",
            &self.queue_time,
        );
        histogram(
            &mut o,
            REQUEST_INFERENCE_TIME,
            "Histogram of time spent in RUNNING phase for request.",
            &self.inference_time,
        );
        histogram(
            &mut o,
            REQUEST_PREFILL_TIME,
            "Histogram of time spent in PREFILL phase for request.",
            &self.prefill_time,
        );
        histogram(
            &mut o,
            REQUEST_DECODE_TIME,
            "Histogram of time spent in DECODE phase for request.",
            &self.decode_time,
        );
        histogram(
            &mut o,
            REQUEST_PREFILL_KV_COMPUTED,
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            &self.prefill_kv_computed,
        );
        histogram(
            &mut o,
            ITERATION_TOKENS,
            "Histogram of number of tokens per engine_step.",
            &self.iteration_tokens,
        );
        let _ = writeln!(o, "# HELP {CACHE_CONFIG_INFO} Information of the LLMEngine CacheConfig\n# TYPE {CACHE_CONFIG_INFO} gauge");
        let _ = writeln!(o, "{CACHE_CONFIG_INFO}{{{}}} 1", self.cache_info);
        if let Some(info) = &self.lora {
            // vLLM declares the labels max_lora, waiting_lora_adapters, running_lora_adapters
            // (no model_name / engine: LoRA is refused with data parallelism).
            let _ = writeln!(o, "# HELP {LORA_REQUESTS_INFO} Running stats on lora requests.\n# TYPE {LORA_REQUESTS_INFO} gauge");
            for (running, waiting, ts) in info.series.lock().iter() {
                let _ = writeln!(
                    o,
                    "{LORA_REQUESTS_INFO}{{max_lora=\"{}\",waiting_lora_adapters=\"{}\",running_lora_adapters=\"{}\"}} {}",
                    info.max_lora,
                    escape(waiting),
                    escape(running),
                    go_float(*ts)
                );
            }
        }
        counter(
            &mut o,
            LORA_LOADS,
            "LoRA adapters loaded into a GPU slot by a step.",
            s.lora_loads,
        );

        counter(
            &mut o,
            REQUESTS_ABORTED,
            "Requests cancelled because the client went away.",
            s.aborted,
        );
        counter(
            &mut o,
            KV_LOAD_FAILURES,
            "NIXL pulls that failed or returned other tokens.",
            s.kv_load_failures,
        );
        counter(&mut o, ENGINE_STEPS, "Engine steps executed.", s.steps);
        counter(
            &mut o,
            KV_REPLAY_REQUESTS,
            "KV-event replay requests served.",
            self.replays.load(Relaxed),
        );
        counter(
            &mut o,
            PREEMPTED_REQUESTS,
            "Re-admissions of preempted requests (vLLM PrefixCacheStats.preempted_requests).",
            s.preempted_admissions,
        );
        counter(&mut o, PREEMPTED_QUERIES, "Prompt tokens re-admitted preempted requests looked up (not in vllm:prefix_cache_queries).", s.preempted_queries);
        counter(
            &mut o,
            PREEMPTED_HITS,
            "Prompt tokens re-admitted preempted requests hit (not in vllm:prefix_cache_hits).",
            s.preempted_hits,
        );
        let family = |o: &mut String, name: &str, help: &str, c: &LabeledCounter| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter");
            c.render(o, name, l);
        };
        family(
            &mut o,
            REQUESTS_REJECTED,
            "Requests answered with an error, by reason.",
            &self.rejected,
        );
        family(&mut o, FAULTS_INJECTED, "Faults injected, by kind.", &self.faults);
        family(&mut o, KV_EVENT_BATCHES, "KV event batches by outcome.", &self.event_batches);
        family(&mut o, NIXL_PULLS, "NIXL pulls made as a consumer, by outcome.", &self.pulls);
        let _ = writeln!(o, "# HELP {NIXL_TRANSFERS} NIXL holds as a producer, by outcome.\n# TYPE {NIXL_TRANSFERS} counter");
        let _ = writeln!(o, "{NIXL_TRANSFERS}{{{l},outcome=\"served\"}} {}", s.transfers_served);
        let _ = writeln!(o, "{NIXL_TRANSFERS}{{{l},outcome=\"expired\"}} {}", s.transfers_expired);
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_every_metric_with_vllm_labels() {
        let m = Metrics::new("deepseek-v4", 0, 16, 100, 1600).with_lora(2);
        m.set_lora_info("a1", "", 1_733_591_234.5);
        m.update_engine(
            SchedStats { prefix_queries: 32, prefix_hits: 16, ..SchedStats::default() },
            2,
            1,
            0.25,
        );
        m.ttft.observe(0.003);
        m.rejected.inc("bad_request");
        let text = m.render();
        for name in ALL {
            assert!(text.contains(&format!("# TYPE {name} ")), "{name} missing");
        }
        assert!(text.contains(
            "vllm:prefix_cache_hits_total{model_name=\"deepseek-v4\",engine=\"0\"} 16\n"
        ));
        assert!(text.contains("vllm:prompt_tokens_by_source_total{model_name=\"deepseek-v4\",engine=\"0\",source=\"local_compute\"} 0\n"));
        assert!(
            text.contains("vllm:num_requests_running{model_name=\"deepseek-v4\",engine=\"0\"} 2\n")
        );
        assert!(text
            .contains("vllm:kv_cache_usage_perc{model_name=\"deepseek-v4\",engine=\"0\"} 0.25\n"));
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"deepseek-v4\",engine=\"0\",le=\"0.005\"} 1\n"));
        assert!(text.contains(
            "vllm:time_to_first_token_seconds_count{model_name=\"deepseek-v4\",engine=\"0\"} 1\n"
        ));
        assert!(text.contains("kvmesh_sim_requests_rejected_total{model_name=\"deepseek-v4\",engine=\"0\",reason=\"bad_request\"} 1\n"));
        assert!(text.contains("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\""));
        // Integral bounds as prometheus_client writes them.
        assert!(text.contains("vllm:time_to_first_token_seconds_bucket{model_name=\"deepseek-v4\",engine=\"0\",le=\"1.0\"} 1\n"));
        assert!(text.contains("vllm:request_prefill_kv_computed_tokens_bucket{model_name=\"deepseek-v4\",engine=\"0\",le=\"1000.0\"} 0\n"));
        assert!(text.contains("vllm:lora_requests_info{max_lora=\"2\",waiting_lora_adapters=\"\",running_lora_adapters=\"a1\"} 1.7335912345e+09\n"));
        assert!(!Metrics::new("m", 0, 16, 100, 1600).render().contains(LORA_REQUESTS_INFO));
    }

    #[test]
    fn lora_info_keeps_one_series_per_label_set_valued_by_when_it_was_last_seen() {
        let m = Metrics::new("m", 0, 16, 100, 1600).with_lora(1);
        m.set_lora_info("", "", 10.0);
        m.set_lora_info("a", "b", 11.0);
        m.set_lora_info("", "", 12.0);
        let text = m.render();
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with(LORA_REQUESTS_INFO)).collect();
        assert_eq!(
            rows,
            [
                "vllm:lora_requests_info{max_lora=\"1\",waiting_lora_adapters=\"\",running_lora_adapters=\"\"} 12.0",
                "vllm:lora_requests_info{max_lora=\"1\",waiting_lora_adapters=\"b\",running_lora_adapters=\"a\"} 11.0",
            ]
        );
        for i in 0..(MAX_LORA_INFO_SERIES + 5) {
            m.set_lora_info(&format!("r{i}"), "", 100.0 + i as f64);
        }
        let text = m.render();
        let n = text.lines().filter(|l| l.starts_with(LORA_REQUESTS_INFO)).count();
        assert_eq!(n, MAX_LORA_INFO_SERIES, "bounded; the oldest go first");
        assert!(!text.contains("running_lora_adapters=\"r0\""));
        assert!(text.contains(&format!("running_lora_adapters=\"r{}\"", MAX_LORA_INFO_SERIES + 4)));
    }

    #[test]
    fn floats_read_like_prometheus_client() {
        for (v, want) in [
            (1_733_591_234.567, "1.733591234567e+09"),
            (1_733_591_234.0, "1.733591234e+09"),
            (12.0, "12.0"),
            (0.25, "0.25"),
            (123_456.5, "123456.5"),
        ] {
            assert_eq!(go_float(v), want, "{v}");
        }
    }

    #[test]
    fn bucket_series_match_vllms() {
        let table: &[(usize, &[f64])] = &[
            (0, &[]),
            (1, &[1.0]),
            (100, &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0]),
            (4096, &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]),
        ];
        for (max, want) in table {
            assert_eq!(buckets_1_2_5(*max), *want, "max {max}");
        }
        let huge = buckets_1_2_5(usize::MAX);
        assert!(
            huge.windows(2).all(|w| w[0] < w[1]) && huge.len() > 50,
            "terminates without overflow, increasing"
        );
        for (b, want) in
            [(1.0, "1.0"), (0.005, "0.005"), (2560.0, "2560.0"), (0.3, "0.3"), (16384.0, "16384.0")]
        {
            assert_eq!(le_label(b), want);
        }
    }

    /// The README's metrics table lists exactly the exported names: a row per metric, by its whole
    /// name (not a substring of another row), and no row for a metric that is gone.
    #[test]
    fn readme_table_is_exactly_the_exported_metrics() {
        let readme = include_str!("../README.md");
        let section = readme.split("\n## Metrics\n").nth(1).expect("README has a Metrics section");
        let section = section.split("\n## ").next().unwrap_or(section);
        let rows: std::collections::BTreeSet<&str> = section
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split('`').next())
            .collect();
        let exported: std::collections::BTreeSet<&str> = ALL.iter().copied().collect();
        assert_eq!(rows, exported, "README.md metrics table vs metrics::ALL");
    }
}
