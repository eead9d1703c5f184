//! Reading an engine's Prometheus `/metrics`: the load and prefix-cache counters routing needs.
//!
//! Pure parsing of the text exposition (sums over label sets, so a DP engine's per-rank series add
//! up), plus the counter mirror that turns successive raw engine counter values into increments that
//! survive engine restarts (a value going down is a reset: the new value is the increment), and the
//! [`PrefillMeter`] that turns successive samples into the worker's measured prefill throughput and
//! decode step time (the inputs of [`crate::predict`]), and the engine's LoRA adapters
//! ([`LoraInfo`], from `vllm:lora_requests_info`: the adapter part of the cost). Reading the answer
//! within `routing.scrape_max_body_bytes` is [`body`]'s, the one part with I/O.

pub mod body;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What one scrape says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineSample {
    pub running: f64,
    pub waiting: f64,
    /// `vllm:prefix_cache_hits_total` (tokens), when exported.
    pub hits: Option<f64>,
    /// `vllm:prefix_cache_queries_total` (tokens), when exported.
    pub queries: Option<f64>,
    pub kv_usage: Option<f64>,
    /// `vllm:prompt_tokens_total` (all prompt tokens, cached ones included).
    pub prompt_tokens: Option<f64>,
    /// `vllm:prompt_tokens_cached_total` (of those, not computed: local and external cache hits).
    pub prompt_tokens_cached: Option<f64>,
    /// `vllm:request_prefill_kv_computed_tokens` histogram `_sum` (prompt tokens requests computed).
    pub kv_computed_sum: Option<f64>,
    /// `vllm:request_prefill_time_seconds` histogram `_sum` (scheduled → first token, per request).
    pub prefill_time_sum: Option<f64>,
    /// `vllm:request_queue_time_seconds` histogram `_sum` (arrival → scheduled).
    pub queue_time_sum: Option<f64>,
    /// `vllm:time_to_first_token_seconds` histogram `_sum` (used when the prefill-time one is absent).
    pub ttft_sum: Option<f64>,
    /// `vllm:inter_token_latency_seconds` (or older `vllm:time_per_output_token_seconds`) `_sum` and `_count`.
    pub itl_sum: Option<f64>,
    pub itl_count: Option<f64>,
    /// `vllm:request_inference_time_seconds` histogram `_sum` and `_count` (scheduled → last
    /// token, per finished request): how long before its finish a request's prefill may have run.
    pub inference_time_sum: Option<f64>,
    pub inference_count: Option<f64>,
    /// `vllm:lora_requests_info`: the engine's LoRA adapters; None when it does not export it (no
    /// `--enable-lora`, or not vLLM): the adapter cost is then unknown and nothing is charged.
    pub lora: Option<LoraInfo>,
}

/// The engine's LoRA adapters as `vllm:lora_requests_info` says, as of its newest series.
///
/// vLLM sets that gauge to the current time under labels naming the adapters, so every change of
/// state leaves a new series behind and the old ones stay (a scrape holds one per state seen):
/// `vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"}
/// 1.78e9`. The series with the largest value is the current state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoraInfo {
    /// `max_lora` (`--max-loras`): adapters the running batch may hold at once (GPU slots); None
    /// when the label is missing or not a number (the slot part of the cost is then off).
    pub max_lora: Option<u32>,
    /// Adapters with requests in the running batch (each holds a slot), at most [`MAX_LORA_NAMES`].
    pub running: Vec<String>,
    /// Adapters with requests waiting to be scheduled, at most [`MAX_LORA_NAMES`].
    pub waiting: Vec<String>,
}

/// Adapter names kept per list of [`LoraInfo`] (the rest are dropped): the text comes from the
/// engine, bounded only by `routing.scrape_max_body_bytes`, and `--max-loras` is single digits
/// in practice.
pub const MAX_LORA_NAMES: usize = 256;

impl LoraInfo {
    /// Whether `adapter` has requests running or waiting (loaded, or being loaded for them).
    pub fn holds(&self, adapter: &str) -> bool {
        self.running.iter().chain(&self.waiting).any(|a| a == adapter)
    }

    /// The current state from the labels of the newest `vllm:lora_requests_info` series.
    /// vLLM v0 exported `max_lora="0"` without LoRA: that is no LoRA (None), not zero slots.
    fn from_labels(sample: &kvmesh_core::prom::Sample) -> Option<Self> {
        let names = |key: &str| -> Vec<String> {
            let mut out: Vec<String> = Vec::new();
            for name in sample.label(key).unwrap_or("").split(',').map(str::trim) {
                if !name.is_empty() && out.len() < MAX_LORA_NAMES && !out.iter().any(|n| n == name)
                {
                    out.push(name.to_owned());
                }
            }
            out
        };
        let max_lora = sample.label("max_lora").and_then(|v| v.trim().parse::<u32>().ok());
        (max_lora != Some(0)).then(|| Self {
            max_lora,
            running: names("running_lora_adapters"),
            waiting: names("waiting_lora_adapters"),
        })
    }
}

/// Parses the metrics routing reads from a vLLM-compatible exposition (with the project's one
/// parser, [`kvmesh_core::prom::parse_lossy_where`]: a line that is not a sample is skipped, never
/// guessed; non-finite values are ignored). Histogram buckets and `_created` lines, most of the
/// text and read by nothing here, are passed over unparsed: during a burst of decisions the
/// indexer scrapes every worker every `scrape_burst_min_interval_ms`.
pub fn parse_engine_metrics(text: &str) -> EngineSample {
    let mut s = EngineSample::default();
    let mut old_hits = None;
    // The newest `vllm:lora_requests_info` series: its value is when vLLM last set it.
    let mut lora: Option<(f64, &kvmesh_core::prom::Sample)> = None;
    let mut old_queries = None;
    let (mut old_itl_sum, mut old_itl_count) = (None, None);
    let (samples, _skipped) = kvmesh_core::prom::parse_lossy_where(text, |name| {
        !name.ends_with("_bucket") && !name.ends_with("_created")
    });
    for sample in &samples {
        let value = sample.value;
        if !value.is_finite() {
            continue;
        }
        let add = |slot: &mut Option<f64>| *slot = Some(slot.unwrap_or(0.0) + value);
        match sample.name.as_str() {
            "vllm:num_requests_running" => s.running += value,
            "vllm:num_requests_waiting" => s.waiting += value,
            "vllm:prefix_cache_hits_total" => add(&mut s.hits),
            "vllm:prefix_cache_queries_total" => add(&mut s.queries),
            "vllm:gpu_prefix_cache_hits_total" => add(&mut old_hits),
            "vllm:gpu_prefix_cache_queries_total" => add(&mut old_queries),
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                s.kv_usage = Some(s.kv_usage.unwrap_or(0.0).max(value))
            }
            "vllm:prompt_tokens_total" => add(&mut s.prompt_tokens),
            "vllm:prompt_tokens_cached_total" => add(&mut s.prompt_tokens_cached),
            "vllm:request_prefill_kv_computed_tokens_sum" => add(&mut s.kv_computed_sum),
            "vllm:request_prefill_time_seconds_sum" => add(&mut s.prefill_time_sum),
            "vllm:request_queue_time_seconds_sum" => add(&mut s.queue_time_sum),
            "vllm:time_to_first_token_seconds_sum" => add(&mut s.ttft_sum),
            "vllm:inter_token_latency_seconds_sum" => add(&mut s.itl_sum),
            "vllm:inter_token_latency_seconds_count" => add(&mut s.itl_count),
            "vllm:request_inference_time_seconds_sum" => add(&mut s.inference_time_sum),
            "vllm:request_inference_time_seconds_count" => add(&mut s.inference_count),
            "vllm:time_per_output_token_seconds_sum" => add(&mut old_itl_sum),
            "vllm:time_per_output_token_seconds_count" => add(&mut old_itl_count),
            "vllm:lora_requests_info" if lora.is_none_or(|(newest, _)| value > newest) => {
                lora = Some((value, sample));
            }
            _ => {}
        }
    }
    s.lora = lora.and_then(|(_, sample)| LoraInfo::from_labels(sample));
    if s.itl_sum.is_none() {
        (s.itl_sum, s.itl_count) = (old_itl_sum, old_itl_count);
    }
    if s.hits.is_none() {
        s.hits = old_hits;
    }
    if s.queries.is_none() {
        s.queries = old_queries;
    }
    s
}

/// Turns raw engine counter values into increments since the first scrape.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CounterMirror {
    last: Option<f64>,
}

impl CounterMirror {
    /// The increment since the previous value (0 on the first, the whole value after a reset).
    pub fn advance(&mut self, value: f64) -> f64 {
        let inc = match self.last {
            None => 0.0,
            Some(prev) if value >= prev => value - prev,
            Some(_) => value,
        };
        self.last = Some(value);
        inc
    }
}

/// Scrape-to-scrape increments the meter keeps (a sliding window).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Delta {
    /// Prompt tokens computed (prompt − prefix-cache hits).
    tokens: f64,
    /// The summed per-request prefill time of the requests those tokens belong to.
    busy_s: f64,
    /// Wall time between the two scrapes (0 when the interval measured nothing).
    wall_s: f64,
    /// Summed scheduled → last-token time of the requests that finished, and their count.
    lifetime_s: f64,
    finished: f64,
    itl_sum: f64,
    itl_count: f64,
}

/// A worker's measured prefill throughput and decode step time, from successive engine samples.
///
/// Throughput = Σ computed prompt tokens / Σ prefill busy time over the last `WINDOW` scrapes (or
/// more, up to `MAX_WINDOW`, while those hold fewer than `min_tokens`), where
/// computed tokens = Δ`vllm:request_prefill_kv_computed_tokens_sum` (else Δ`vllm:prompt_tokens_total`
/// − Δ`vllm:prompt_tokens_cached_total`, else − Δ`vllm:prefix_cache_hits_total`) and busy time =
/// min(Σ wall time + the mean Δ`vllm:request_inference_time_seconds` of the requests that finished
/// in the window, Σ Δ`vllm:request_prefill_time_seconds_sum`) over the window (or, for engines
/// without that histogram, Δ`time_to_first_token` − Δ`request_queue_time`): overlapping prefills
/// of one batch are not counted twice, a request whose prefill straddles scrapes (its time is
/// recorded at once) is not cut, and the prefills of requests finishing in the window, which ran
/// partly before it, are not squeezed into its wall time (see `window_rate`). It is trusted once the
/// window holds `min_tokens` computed tokens (before that, a window of [`FIRST_READING_MIN_TOKENS`]
/// stands in). Every error of a window reading is an under-read:
/// the per-request prefill time of requests batched into one step overlaps (each counts the whole
/// step), and a step that also decodes the running batch is longer than its prefill tokens cost
/// (the predictor adds that decode part separately). So the meter reports the **highest** reading
/// of the last `hold` (a peak hold): a busy worker whose prefills overlap keeps the throughput it
/// showed when they did not, instead of looking several times slower than an idle one — which
/// pushed sessions off the worker holding their KV. At saturation the time bound makes a reading
/// nearly exact. vLLM records the prefill histogram and the computed tokens when a request
/// finishes, so single intervals disagree; the window evens that out.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PrefillMeter {
    last: Option<(EngineSample, Instant)>,
    window: VecDeque<Delta>,
    /// Qualifying window readings of the last [`MeterHold::hold`] (at most [`MAX_HELD`]).
    readings: VecDeque<(Instant, f64)>,
    /// The last trusted measurements: kept while the window holds too little (an idle engine).
    rate: Option<f64>,
    step: Option<f64>,
    /// The last trusted mean request lifetime (scheduled → last token), seconds.
    lifetime: Option<f64>,
    /// Whether `rate` came from a full reading (`min_tokens`), not a [`FIRST_READING_MIN_TOKENS`] one.
    rate_is_full: bool,
}

/// How the meter turns window readings into the throughput it reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MeterHold {
    /// Computed prompt tokens a window must hold before its reading counts.
    pub min_tokens: f64,
    /// The reported throughput is the highest reading of this long (`prefill_measure_hold_s`).
    pub hold: Duration,
}

/// Window readings the peak hold keeps at most (a 500 ms scrape over a 60 s hold needs 120).
const MAX_HELD: usize = 1024;

/// Decode tokens the window must hold before its mean inter-token latency is trusted.
pub const MIN_ITL_SAMPLES: f64 = 64.0;

/// Finished requests the window must hold before their mean lifetime is trusted.
pub const MIN_LIFETIME_SAMPLES: f64 = 4.0;

/// Scrape intervals the meter averages over (16 × the 500 ms default: 8 s) at least …
const WINDOW: usize = 16;
/// … and at most: a window reaches back, beyond [`WINDOW`], until it holds `min_tokens` computed
/// tokens, so a worker that computes few tokens per 8 s (a slow engine, a light load of cached
/// turns) is measured too instead of keeping the configured default. On two real vLLM CPU engines
/// at 1 request/s the 8-s window never held 8,192 tokens: the default 20,000 tokens/s stood for
/// engines ~7× slower, and predictions were 4–31× short (median 12×). 240 × 500 ms: 2 minutes.
const MAX_WINDOW: usize = 240;

/// Until a window holds `min_tokens`, a window holding this many computed tokens (one prompt of a
/// typical size) gives a first reading, replaced by the first full one. Without it a fresh indexer
/// predicted on the configured default for as long as the first `min_tokens` took: on two real
/// vLLM CPU engines (~3,000 tokens/s against the 20,000 default) that was the first 20 s under
/// aiperf, in which the fluid FIFO drained each booked prefill ~7× too fast, so three new
/// conversations arriving within 0.15 s all saw the same worker idle and queued there (TTFT 1.5–1.7
/// s, predicted 65 ms). A first reading is mostly an under-read (one request's warm-up, or two
/// overlapping), which spreads load rather than piling it.
pub const FIRST_READING_MIN_TOKENS: f64 = 1024.0;

impl PrefillMeter {
    /// Takes one scrape's sample; the throughput is trusted once the window holds `min_tokens`
    /// computed tokens, and then kept until a newer window qualifies. Before the first such
    /// window, one holding [`FIRST_READING_MIN_TOKENS`] gives a first reading.
    pub fn observe(&mut self, s: &EngineSample, now: Instant, hold: MeterHold) {
        if let Some((prev, at)) = self.last.replace((s.clone(), now)) {
            let inc = |new: Option<f64>, old: Option<f64>| match (new, old) {
                (Some(n), Some(o)) if n >= o => Some(n - o),
                _ => None, // absent, or a reset: this interval says nothing
            };
            let wall = now.saturating_duration_since(at).as_secs_f64();
            // Tokens computed: per request beside its prefill time when the engine says so, else
            // prompt tokens minus cached ones (both counted at the first token), else minus the
            // prefix-cache hits (counted at scheduling).
            let prompt = inc(s.prompt_tokens, prev.prompt_tokens);
            let computed = inc(s.kv_computed_sum, prev.kv_computed_sum).or_else(|| {
                let p = prompt?;
                let cached = inc(s.prompt_tokens_cached, prev.prompt_tokens_cached)
                    .or_else(|| inc(s.hits, prev.hits));
                match cached {
                    Some(c) => Some((p - c).max(0.0)),
                    None if s.hits.is_none() && s.prompt_tokens_cached.is_none() => Some(p),
                    None => None,
                }
            });
            let busy = inc(s.prefill_time_sum, prev.prefill_time_sum).or_else(|| {
                let ttft = inc(s.ttft_sum, prev.ttft_sum)?;
                Some((ttft - inc(s.queue_time_sum, prev.queue_time_sum).unwrap_or(0.0)).max(0.0))
            });
            let mut d = Delta::default();
            if let (Some(tokens), Some(busy)) = (computed, busy) {
                (d.tokens, d.busy_s, d.wall_s) = (tokens, busy, wall);
                if let (Some(sum), Some(count)) = (
                    inc(s.inference_time_sum, prev.inference_time_sum),
                    inc(s.inference_count, prev.inference_count),
                ) {
                    (d.lifetime_s, d.finished) = (sum, count);
                }
            }
            if let (Some(sum), Some(count)) =
                (inc(s.itl_sum, prev.itl_sum), inc(s.itl_count, prev.itl_count))
            {
                (d.itl_sum, d.itl_count) = (sum, count);
            }
            self.window.push_back(d);
            while self.window.len() > MAX_WINDOW {
                self.window.pop_front();
            }
            if let Some(r) = self.window_rate(hold.min_tokens) {
                self.readings.push_back((now, r));
                if self.readings.len() > MAX_HELD {
                    self.readings.pop_front();
                }
            }
            while self
                .readings
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) > hold.hold)
            {
                self.readings.pop_front();
            }
            if let Some(peak) = self.readings.iter().map(|(_, r)| *r).reduce(f64::max) {
                (self.rate, self.rate_is_full) = (Some(peak), true);
            } else if !self.rate_is_full {
                if let Some(r) = self.window_rate(hold.min_tokens.min(FIRST_READING_MIN_TOKENS)) {
                    self.rate = Some(r);
                }
            }
            if let Some(t) = self.window_step(MIN_ITL_SAMPLES) {
                self.step = Some(t);
            }
            if let Some(l) = self.window_lifetime(MIN_LIFETIME_SAMPLES) {
                self.lifetime = Some(l);
            }
        }
    }

    /// Measured prefill tokens per second (the last window that held enough), if any.
    pub fn prefill_tokens_per_s(&self) -> Option<f64> {
        self.rate
    }

    /// Measured mean inter-token latency in seconds (the last window that held enough), if any.
    pub fn decode_step_s(&self) -> Option<f64> {
        self.step
    }

    /// Measured mean request lifetime in seconds, scheduled → last token
    /// (`vllm:request_inference_time_seconds`, the last window that held enough), if any: how long
    /// a running request keeps its LoRA slot ([`crate::predict::slot_wait_s`]).
    pub fn request_lifetime_s(&self) -> Option<f64> {
        self.lifetime
    }

    /// The window's prefill tokens per second, when it holds at least `min_tokens` computed tokens
    /// with some busy time. The window is the last [`WINDOW`] intervals, reaching further back
    /// (up to [`MAX_WINDOW`]) only while it holds fewer than `min_tokens`.
    ///
    /// The busy time is bounded by the time the window's requests can have prefilled in: its wall
    /// time plus their mean scheduled → last-token time, as the engine records both tokens and
    /// prefill time when a request finishes, so the prefills of requests finishing in the window
    /// ran partly before it. Bounding by the wall time alone over-read a trace replay's windows by
    /// up to 1.4×, and the peak hold kept each worker's luckiest over-read (measured 23–24.5k
    /// tokens/s on simulators running at 20k), so the model steered new conversations to the
    /// worker it believed fastest and its load grew to 1.37× the mean.
    fn window_rate(&self, min_tokens: f64) -> Option<f64> {
        let min_tokens = min_tokens.max(1.0);
        let (mut tokens, mut busy, mut wall, mut finished, mut lifetime) =
            (0.0, 0.0, 0.0, 0.0, 0.0);
        for (k, d) in self.window.iter().rev().enumerate() {
            if k >= WINDOW && tokens >= min_tokens {
                break;
            }
            (tokens, busy, wall, finished, lifetime) = (
                tokens + d.tokens,
                busy + d.busy_s,
                wall + d.wall_s,
                finished + d.finished,
                lifetime + d.lifetime_s,
            );
        }
        let lag = if finished > 0.0 { lifetime / finished } else { 0.0 };
        let busy = busy.min(wall + lag);
        (tokens >= min_tokens && busy > 0.0).then(|| tokens / busy)
    }

    /// The window's mean request lifetime (seconds), when at least `min_finished` requests
    /// finished in its last [`WINDOW`] intervals.
    fn window_lifetime(&self, min_finished: f64) -> Option<f64> {
        let recent = || self.window.iter().rev().take(WINDOW);
        let finished: f64 = recent().map(|d| d.finished).sum();
        let sum: f64 = recent().map(|d| d.lifetime_s).sum();
        (finished >= min_finished.max(1.0)).then(|| sum / finished)
    }

    /// The window's mean inter-token latency (seconds), when it holds `min_tokens` decode tokens.
    fn window_step(&self, min_tokens: f64) -> Option<f64> {
        let count: f64 = self.window.iter().rev().take(WINDOW).map(|d| d.itl_count).sum();
        let sum: f64 = self.window.iter().rev().take(WINDOW).map(|d| d.itl_sum).sum();
        (count >= min_tokens.max(1.0)).then(|| sum / count)
    }
}

#[cfg(test)]
mod tests;
