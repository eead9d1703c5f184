//! [`RoutingConfig`] (`[routing]`): every policy knob and bound, its documented defaults, and the
//! checks a value must pass; plus the enums its knobs take ([`IndexMode`], [`KvMigration`],
//! [`SessionPlacement`]).

use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError};

/// Where the index learns what each worker caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IndexMode {
    /// From the engines' KV events (exact, needs `kv_events`).
    Precise,
    /// From the indexer's own routing decisions, with a TTL and a size bound (engines without events).
    Approximate,
}

impl IndexMode {
    /// The wire / label name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Precise => "precise",
            Self::Approximate => "approximate",
        }
    }
}

/// `kv_migration`: whether decode-to-decode KV migration runs, is only counted, or is off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvMigration {
    /// Never migrate; no opportunity is counted.
    Off,
    /// Count and log (sampled) the would-migrate decisions; send nothing.
    Dry,
    /// Run the producer handshake on the source and let the target pull the blocks.
    On,
}

impl KvMigration {
    /// The config / label name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Off => "off",
            Self::Dry => "dry",
            Self::On => "on",
        }
    }
}

/// Where a session's home is (`session_placement`). Either way a session stays home while that is
/// the best or near-best choice by predicted TTFT and moves past `session_move_margin(_ms)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionPlacement {
    /// Home = where its KV is: the session's last decode worker (`kv_home`); a new session (or one
    /// whose home was forgotten) goes where it is predicted fastest.
    Predicted,
    /// Home = the rendezvous-hash worker of the key (what the filter's fallback pins to).
    Rendezvous,
    /// Deprecated alias of `predicted` (the old "first by cost, then where last served"); warns.
    Sticky,
}

/// Every policy knob and bound. Defaults are the documented ones (README, "Configuration").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RoutingConfig {
    /// `precise` (KV events) or `approximate` (learn from own decisions).
    pub mode: IndexMode,
    /// Deprecated, ignored (the block-count cost it weighted is gone; a value other than 1 warns).
    pub overlap_credit: f64,
    /// Deprecated, ignored (as `overlap_credit`).
    pub prefill_load_scale: f64,
    /// Softmax temperature over normalised costs; 0 = argmin with random tie-break.
    pub temperature: f64,
    /// Fallback endpoints returned with each decision (Envoy retries them in order).
    pub max_fallbacks: usize,
    /// A worker with at least this many active blocks is overloaded (0 = off).
    pub overload_active_blocks: u64,
    /// A worker with at least this many in-flight routed requests is overloaded (0 = off).
    pub overload_active_requests: u64,
    /// A worker whose engine reports at least this many waiting requests is overloaded (0 = off).
    pub overload_waiting_requests: u64,
    /// Load booked for a request is released after this long if `/v1/done` never comes.
    pub load_expiry_secs: u64,
    /// Most requests with booked load; the oldest is expired beyond it.
    pub max_bookings: usize,
    /// Blocks assumed per in-flight request the engine reports but the indexer did not route.
    pub unknown_request_blocks: u64,
    /// Most (block, worker) entries in the index; least recently used blocks go first beyond it.
    pub index_max_entries: usize,
    /// Most blocks one worker (dp rank) may claim; beyond it the worker is resynced (lost removals).
    pub max_blocks_per_worker: usize,
    /// Event batches queued between the ZMQ listeners and the index applier.
    pub event_queue_batches: usize,
    /// Decoded bytes of the batches queued between the listeners and the applier (a listener waits
    /// beyond it; one batch larger than the whole budget passes alone).
    pub event_queue_bytes: usize,
    /// Largest KV event payload frame, live or replayed (`ZMQ_MAXMSGSIZE` and a check before decoding).
    pub event_max_frame_bytes: usize,
    /// Most raw bytes one replay may hold; a longer replay fails (the worker is resynced).
    pub replay_max_bytes: usize,
    /// Deadline for one replay from an engine's ROUTER socket.
    pub replay_timeout_ms: u64,
    /// Engine `/metrics` scrape period, and its per-scrape timeout.
    pub scrape_interval_ms: u64,
    pub scrape_timeout_ms: u64,
    /// Largest engine `/metrics` body read; a bigger one fails the scrape
    /// ([`crate::scrape::body`]).
    pub scrape_max_body_bytes: usize,
    /// After this many decisions since a scrape round started, the next round starts early
    /// (0 = only at the interval): a burst is otherwise placed on one stale view of the engines.
    pub scrape_burst_decisions: u64,
    /// The earliest an early round starts after the previous one (ms).
    pub scrape_burst_min_interval_ms: u64,
    /// Consecutive failed scrapes after which a worker is unhealthy (0 = never mark unhealthy).
    pub unhealthy_after_failures: u32,
    /// Largest `/v1/route` or `/v1/done` body accepted.
    pub max_body_bytes: usize,
    /// Deadline for one API request inside the indexer.
    pub request_timeout_ms: u64,
    /// Memory bound of the incremental tokenization cache.
    pub tokenize_cache_bytes: usize,
    /// Memory bound of the tokenization prefix memo (0 = off; tokenize.rs "A warm route costs its new text").
    pub tokenize_memo_bytes: usize,
    /// Memory bound of the body memo: recent long chat bodies' read prefixes, so a conversation's
    /// next turn is read from where the last ended (0 = off; route/body_memo.rs).
    pub body_memo_bytes: usize,
    /// Approximate mode: how long a routed prompt's blocks count as cached on the chosen worker.
    pub approx_ttl_secs: u64,
    /// Approximate mode: most blocks remembered per worker (oldest forgotten first).
    pub approx_max_blocks_per_worker: usize,
    /// How often the config file is checked for changes (SIGHUP reloads at once).
    pub reload_poll_ms: u64,
    /// `predicted` (default), `rendezvous` or the deprecated `sticky` (see [`SessionPlacement`]).
    pub session_placement: SessionPlacement,
    /// A session leaves its home only when another worker is predicted faster by more than this
    /// (milliseconds) and by more than `session_move_margin` of the home's predicted TTFT.
    pub session_move_margin_ms: f64,
    /// Relative part of the move margin (fraction of the home's predicted TTFT).
    pub session_move_margin: f64,
    /// Weight of the delay a request's own prefill adds to the requests expected to queue behind it
    /// on the worker (`crate::predict::cost_s`); 0 scores by this request's predicted TTFT alone.
    pub work_charge: f64,
    /// A request opening a conversation is not placed on a worker that was routed more than this
    /// multiple of the fleet's mean prompt tokens per second recently, unless that worker is the
    /// fastest even holding none of the prompt (0 = off): its later turns follow it, and a shared
    /// system prompt held by one worker would otherwise draw every new conversation there.
    pub session_balance: f64,
    /// A request without a session (a completions prompt, or a chat the filter derived no key for)
    /// is not placed on a worker that is busy (more than one of this replica's requests in flight
    /// beyond the least busy worker) and was routed more than this multiple of the fleet's mean
    /// prompt tokens per second recently and more than `request_balance_slack` requests its size
    /// above the least routed worker, unless that worker is the fastest even holding none of the
    /// prompt (0 = off). Each gateway replica bounds its own share this way, so replicas that
    /// favour the same holder of a burst's prefix cannot add up to a pile there.
    pub request_balance: f64,
    /// The absolute part of `request_balance`, in requests of this one's prompt size within
    /// `load_outlook_window_s`, so a few siblings still follow the holder of their prefix.
    pub request_balance_slack: f64,
    /// `request_balance` yields when keeping a request off a worker over its share would make the
    /// request's predicted TTFT longer by more than this (milliseconds): what that worker holds of
    /// the prompt then saves more than the share is worth.
    pub request_balance_yield_ms: f64,
    /// Time constant (seconds) of the recent route rate, per-worker prefill utilization and
    /// prompt tokens per second the cost, `session_balance` and `request_balance` read.
    pub load_outlook_window_s: f64,
    /// Workers predicted within this many ms of the fastest (and `near_tie_fraction`) are a tie,
    /// broken at random, so gateway replicas with the same view do not herd onto one worker.
    pub near_tie_ms: f64,
    /// Relative part of the near-tie band (fraction of the fastest predicted TTFT).
    pub near_tie_fraction: f64,
    /// Prefill throughput (uncached tokens/s) assumed for a worker until it, or a worker of its
    /// role, is measured.
    pub prefill_tokens_per_s: f64,
    /// Clamp of the measured prefill throughput.
    pub prefill_tokens_per_s_min: f64,
    pub prefill_tokens_per_s_max: f64,
    /// Computed prompt tokens the measurement window must hold before its reading is trusted
    /// (until the first such window, one of `scrape::FIRST_READING_MIN_TOKENS` stands in).
    pub prefill_measure_min_tokens: u64,
    /// The measured throughput is the highest window reading of this many seconds (a peak hold:
    /// overlapping prefills and decode steps only ever lower a reading).
    pub prefill_measure_hold_s: u64,
    /// Decode part of one engine step (ms) assumed until the engine's inter-token latency is measured.
    pub decode_step_ms: f64,
    /// The engines' token budget per step (vLLM `max_num_batched_tokens`): prefill work of N tokens
    /// takes ⌈N / this⌉ steps, each also decoding the running batch.
    pub prefill_chunk_tokens: u64,
    /// Credit the prompt's blocks a worker holds in lower KV tiers (CPU memory, disk: vLLM's
    /// offloading connector, `medium` other than GPU) at their load cost in the predicted TTFT;
    /// false: route by GPU residency alone (lower-tier events are indexed either way).
    pub kv_tiers: bool,
    /// Load bandwidth of the CPU tier into GPU memory, prompt tokens per second (KV bytes/s over
    /// KV bytes per token: vLLM's `vllm:kv_offload_load_bytes` / `vllm:kv_offload_load_time`).
    pub cpu_load_tokens_per_s: f64,
    /// Load bandwidth of the disk tier (vLLM `STORAGE`), prompt tokens per second.
    pub disk_load_tokens_per_s: f64,
    /// Sibling bursts: how long a decision's blocks count as held by the chosen worker before its
    /// engine's events say so (0 = off).
    pub speculative_ttl_ms: u64,
    /// Speculative blocks remembered per worker (oldest forgotten first; ≈ 60 B each).
    pub speculative_max_blocks_per_worker: usize,
    /// Conditional disaggregation: prompts with at least this many tokens uncached on the chosen
    /// decode worker get a remote prefill leg; 0 = off (everything aggregate).
    pub min_remote_prefill_tokens: u64,
    /// Deadline of one prefill leg (connect, prefill, answer); beyond it the decode worker serves.
    pub prefill_timeout_ms: u64,
    /// A session seen within `local_continuation_ttl_secs` is served on its decode worker whatever
    /// its length (only its new tail needs prefill). Needs session keys from the filter.
    pub local_continuations: bool,
    pub local_continuation_ttl_secs: u64,
    /// Most sessions remembered for local continuations; least recently seen go first beyond it.
    pub local_continuation_max_sessions: usize,
    /// Decode-to-decode KV migration: `off`, `dry` (count and log only) or `on`.
    pub kv_migration: KvMigration,
    /// Smallest number of tokens (blocks to move × block size) worth a migration.
    pub kv_migration_min_tokens: u64,
    /// Deadline of the migration handshake on the source; beyond it the target recomputes.
    pub kv_migration_timeout_ms: u64,
    /// Dry mode logs one would-migrate decision in this many (1 = every one).
    pub kv_migration_log_every: u64,
    /// Each session's last decode worker (`kv_home`), the migration source when the index lags.
    pub kv_home_ttl_secs: u64,
    pub kv_home_max_sessions: usize,
    /// Most `/v1/route` calls worked on at once (tokenization included, until it really ends, even
    /// when its caller is gone); a call beyond it is shed at once with 503 `overloaded_shed`.
    pub max_concurrent_routes: usize,
    /// Blocks of recently routed prompts remembered to chain orphan stores (a prefix the index
    /// missed, e.g. after a restart); about 40 B each.
    pub recovery_max_blocks: usize,
    /// Time (ms) a worker takes to load a LoRA adapter it has no request for, added to a
    /// request's predicted TTFT there (`crate::predict::AdapterCost`). Set it to the engines'
    /// measured load time (`vllm-sim --lora-load-ms`).
    pub adapter_load_ms: f64,
    /// Wait (ms) for a free LoRA slot assumed on a worker whose `max_lora` slots are all held by
    /// other running adapters, until its request lifetime is measured (then half of it:
    /// `crate::predict::slot_wait_s`).
    pub adapter_slot_wait_ms: f64,
    /// How long an adapter this indexer routed to a worker counts as running there before the
    /// engine's `vllm:lora_requests_info` shows it (0 = off).
    pub adapter_booking_ttl_ms: u64,
    /// Distinct `adapter` label values of the per-adapter route metrics; adapters past it are
    /// counted under `other` (label sets stay bounded however many adapters engines load).
    pub max_adapter_labels: usize,
    /// How often each worker's `GET /v1/models` is polled for the adapters it serves
    /// (`crate::service::served`); 0 = never (only configured adapters are known).
    pub served_models_poll_ms: u64,
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            mode: IndexMode::Precise,
            overlap_credit: 1.0,
            prefill_load_scale: 1.0,
            temperature: 0.0,
            max_fallbacks: 2,
            overload_active_blocks: 0,
            overload_active_requests: 0,
            overload_waiting_requests: 8,
            load_expiry_secs: 600,
            max_bookings: 1_000_000,
            unknown_request_blocks: 64,
            index_max_entries: 16_000_000,
            max_blocks_per_worker: 4_000_000,
            event_queue_batches: 4096,
            event_queue_bytes: 256 * 1024 * 1024,
            event_max_frame_bytes: 16 * 1024 * 1024,
            replay_max_bytes: 256 * 1024 * 1024,
            replay_timeout_ms: 2000,
            scrape_interval_ms: 500,
            scrape_timeout_ms: 400,
            scrape_max_body_bytes: 8 * 1024 * 1024,
            scrape_burst_decisions: 8,
            scrape_burst_min_interval_ms: 50,
            unhealthy_after_failures: 3,
            max_body_bytes: 16 * 1024 * 1024,
            request_timeout_ms: 15_000,
            tokenize_cache_bytes: 64 * 1024 * 1024,
            tokenize_memo_bytes: crate::tokenize::DEFAULT_MEMO_BYTES,
            body_memo_bytes: crate::route::body_memo::DEFAULT_BODY_MEMO_BYTES,
            approx_ttl_secs: 120,
            approx_max_blocks_per_worker: 200_000,
            reload_poll_ms: 1000,
            session_placement: SessionPlacement::Predicted,
            session_move_margin_ms: 50.0,
            session_move_margin: 0.25,
            work_charge: 1.0,
            session_balance: 1.1,
            request_balance: 1.25,
            request_balance_slack: 2.0,
            request_balance_yield_ms: 250.0,
            load_outlook_window_s: 10.0,
            near_tie_ms: 0.0,
            near_tie_fraction: 0.02,
            prefill_tokens_per_s: 20_000.0,
            prefill_tokens_per_s_min: 100.0,
            prefill_tokens_per_s_max: 100_000_000.0,
            prefill_measure_min_tokens: 8192,
            prefill_measure_hold_s: 60,
            decode_step_ms: 20.0,
            prefill_chunk_tokens: 8192,
            kv_tiers: true,
            cpu_load_tokens_per_s: 100_000.0,
            disk_load_tokens_per_s: 25_000.0,
            speculative_ttl_ms: 2000,
            speculative_max_blocks_per_worker: 65_536,
            min_remote_prefill_tokens: 0,
            prefill_timeout_ms: 10_000,
            local_continuations: false,
            local_continuation_ttl_secs: 3600,
            local_continuation_max_sessions: 4_000_000,
            kv_migration: KvMigration::Off,
            kv_migration_min_tokens: 2048,
            kv_migration_timeout_ms: 1000,
            kv_migration_log_every: 16,
            kv_home_ttl_secs: 900,
            kv_home_max_sessions: 200_000,
            max_concurrent_routes: 32,
            recovery_max_blocks: 262_144,
            adapter_load_ms: 250.0,
            adapter_slot_wait_ms: 2000.0,
            adapter_booking_ttl_ms: 2000,
            max_adapter_labels: 32,
            served_models_poll_ms: 30_000,
        }
    }
}

impl RoutingConfig {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let non_negative = [
            ("routing.overlap_credit", self.overlap_credit),
            ("routing.prefill_load_scale", self.prefill_load_scale),
            ("routing.temperature", self.temperature),
            ("routing.session_move_margin_ms", self.session_move_margin_ms),
            ("routing.session_move_margin", self.session_move_margin),
            ("routing.work_charge", self.work_charge),
            ("routing.session_balance", self.session_balance),
            ("routing.request_balance", self.request_balance),
            ("routing.request_balance_slack", self.request_balance_slack),
            ("routing.request_balance_yield_ms", self.request_balance_yield_ms),
            ("routing.near_tie_ms", self.near_tie_ms),
            ("routing.near_tie_fraction", self.near_tie_fraction),
            ("routing.decode_step_ms", self.decode_step_ms),
            ("routing.adapter_load_ms", self.adapter_load_ms),
            ("routing.adapter_slot_wait_ms", self.adapter_slot_wait_ms),
        ];
        for (field, v) in non_negative {
            if !v.is_finite() || v < 0.0 {
                return Err(invalid(field, v, "must be a finite number >= 0"));
            }
        }
        let positive = [
            ("routing.load_expiry_secs", self.load_expiry_secs),
            ("routing.prefill_measure_hold_s", self.prefill_measure_hold_s),
            ("routing.max_bookings", self.max_bookings as u64),
            ("routing.index_max_entries", self.index_max_entries as u64),
            ("routing.max_blocks_per_worker", self.max_blocks_per_worker as u64),
            ("routing.event_queue_batches", self.event_queue_batches as u64),
            ("routing.event_queue_bytes", self.event_queue_bytes as u64),
            ("routing.event_max_frame_bytes", self.event_max_frame_bytes as u64),
            ("routing.replay_max_bytes", self.replay_max_bytes as u64),
            ("routing.replay_timeout_ms", self.replay_timeout_ms),
            ("routing.scrape_interval_ms", self.scrape_interval_ms),
            ("routing.scrape_timeout_ms", self.scrape_timeout_ms),
            ("routing.scrape_max_body_bytes", self.scrape_max_body_bytes as u64),
            ("routing.scrape_burst_min_interval_ms", self.scrape_burst_min_interval_ms),
            ("routing.max_body_bytes", self.max_body_bytes as u64),
            ("routing.request_timeout_ms", self.request_timeout_ms),
            ("routing.approx_ttl_secs", self.approx_ttl_secs),
            ("routing.approx_max_blocks_per_worker", self.approx_max_blocks_per_worker as u64),
            ("routing.reload_poll_ms", self.reload_poll_ms),
            ("routing.prefill_timeout_ms", self.prefill_timeout_ms),
            ("routing.local_continuation_ttl_secs", self.local_continuation_ttl_secs),
            (
                "routing.local_continuation_max_sessions",
                self.local_continuation_max_sessions as u64,
            ),
            ("routing.kv_migration_timeout_ms", self.kv_migration_timeout_ms),
            ("routing.kv_migration_log_every", self.kv_migration_log_every),
            ("routing.kv_home_ttl_secs", self.kv_home_ttl_secs),
            ("routing.kv_home_max_sessions", self.kv_home_max_sessions as u64),
            ("routing.max_concurrent_routes", self.max_concurrent_routes as u64),
            ("routing.prefill_chunk_tokens", self.prefill_chunk_tokens),
            (
                "routing.speculative_max_blocks_per_worker",
                self.speculative_max_blocks_per_worker as u64,
            ),
        ];
        for (field, v) in positive {
            if v == 0 {
                return Err(invalid(field, v, "must be > 0"));
            }
        }
        let rates = [
            ("routing.prefill_tokens_per_s_min", self.prefill_tokens_per_s_min),
            ("routing.prefill_tokens_per_s", self.prefill_tokens_per_s),
            ("routing.prefill_tokens_per_s_max", self.prefill_tokens_per_s_max),
            ("routing.load_outlook_window_s", self.load_outlook_window_s),
            ("routing.cpu_load_tokens_per_s", self.cpu_load_tokens_per_s),
            ("routing.disk_load_tokens_per_s", self.disk_load_tokens_per_s),
        ];
        for (field, v) in rates {
            if !v.is_finite() || v <= 0.0 {
                return Err(invalid(field, v, "must be a finite number > 0"));
            }
        }
        if !(self.prefill_tokens_per_s_min <= self.prefill_tokens_per_s
            && self.prefill_tokens_per_s <= self.prefill_tokens_per_s_max)
        {
            return Err(invalid(
                "routing.prefill_tokens_per_s",
                self.prefill_tokens_per_s,
                "must lie within routing.prefill_tokens_per_s_min ..= routing.prefill_tokens_per_s_max",
            ));
        }
        if self.served_models_poll_ms != 0 && self.served_models_poll_ms < 1000 {
            return Err(invalid(
                "routing.served_models_poll_ms",
                self.served_models_poll_ms,
                "must be 0 (off) or at least 1000",
            ));
        }
        if self.scrape_timeout_ms > self.scrape_interval_ms {
            return Err(invalid(
                "routing.scrape_timeout_ms",
                self.scrape_timeout_ms,
                "must not exceed routing.scrape_interval_ms",
            ));
        }
        if self.replay_max_bytes < self.event_max_frame_bytes {
            return Err(invalid(
                "routing.replay_max_bytes",
                self.replay_max_bytes,
                "must be at least routing.event_max_frame_bytes",
            ));
        }
        // A leg runs inside /v1/route: its deadline must leave the route call time to answer.
        if self.min_remote_prefill_tokens > 0 && self.prefill_timeout_ms >= self.request_timeout_ms
        {
            return Err(invalid(
                "routing.prefill_timeout_ms",
                self.prefill_timeout_ms,
                "must be below routing.request_timeout_ms",
            ));
        }
        if self.kv_migration == KvMigration::On
            && self.kv_migration_timeout_ms >= self.request_timeout_ms
        {
            return Err(invalid(
                "routing.kv_migration_timeout_ms",
                self.kv_migration_timeout_ms,
                "must be below routing.request_timeout_ms",
            ));
        }
        Ok(())
    }
}

impl RoutingConfig {
    /// What the prefill meter trusts and how long it holds its peak.
    pub fn meter_hold(&self) -> crate::scrape::MeterHold {
        crate::scrape::MeterHold {
            min_tokens: self.prefill_measure_min_tokens as f64,
            hold: std::time::Duration::from_secs(self.prefill_measure_hold_s),
        }
    }
}
