//! The simulated engines' timing per workload and the ladder's first rate: what one arrival
//! costs round_robin in uncached prefill, and the fleet's real-time prefill throughput.

use crate::workload::WorkloadKind;
use serde::{Deserialize, Serialize};

/// vllm-sim's default prefill throughput, uncached prompt tokens per modelled second.
pub const SIM_DEFAULT_PREFILL_TPS: f64 = 20_000.0;
/// vllm-sim's default token budget of one step (`--max-num-batched-tokens`).
pub const SIM_DEFAULT_BATCHED_TOKENS: usize = 8192;
/// The ladder starts at this fraction of [`estimated_saturation`] ([`default_start_rate`]).
pub const START_FRACTION: f64 = 0.3;

/// The simulated engines' timing for one workload's points.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FleetTiming {
    /// vllm-sim `--speedup`: every modelled duration (engine time) and the workload's think
    /// times are divided by it in wall-clock time.
    pub sim_speedup: f64,
    /// vllm-sim `--prefill-tokens-per-s`: uncached prompt tokens per modelled second.
    pub prefill_tokens_per_s: f64,
    /// vllm-sim `--max-num-batched-tokens`: [`SIM_DEFAULT_BATCHED_TOKENS`] scaled by
    /// `prefill_tokens_per_s / SIM_DEFAULT_PREFILL_TPS` (a full chunk costs the same modelled
    /// time at any prefill throughput), at least 16.
    pub max_num_batched_tokens: usize,
}

impl FleetTiming {
    /// The timing for a speed-up and a modelled prefill throughput (both > 0, finite).
    pub fn new(sim_speedup: f64, prefill_tokens_per_s: f64) -> Result<Self, String> {
        if !(sim_speedup > 0.0 && sim_speedup.is_finite()) {
            return Err("--sim-speedup must be > 0".into());
        }
        if !(prefill_tokens_per_s > 0.0 && prefill_tokens_per_s.is_finite()) {
            return Err("--prefill-tokens-per-s must be > 0".into());
        }
        Ok(Self::scaled(sim_speedup, prefill_tokens_per_s))
    }

    /// The chunk scaled to the prefill throughput (inputs already checked).
    fn scaled(sim_speedup: f64, prefill_tokens_per_s: f64) -> Self {
        let chunk = (SIM_DEFAULT_BATCHED_TOKENS as f64 * prefill_tokens_per_s
            / SIM_DEFAULT_PREFILL_TPS)
            .round();
        Self { sim_speedup, prefill_tokens_per_s, max_num_batched_tokens: (chunk as usize).max(16) }
    }

    /// One worker's prefill throughput in wall-clock time: modelled tokens/s × speed-up.
    pub fn real_prefill_tps(&self) -> f64 {
        self.prefill_tokens_per_s * self.sim_speedup
    }

    /// One line for the report.
    pub fn describe(&self) -> String {
        let scale = if self.sim_speedup == 1.0 {
            "modelled time is wall-clock time".to_string()
        } else {
            format!(
                "modelled time runs {0}× faster: think times and engine time ÷ {0}, so TTFT, ITL and rates here are wall-clock (modelled TTFT = {0} × these, modelled rate = these ÷ {0})",
                self.sim_speedup
            )
        };
        format!(
            "vllm-sim `--speedup {}` `--prefill-tokens-per-s {}` `--max-num-batched-tokens {}` ({:.0} prefill tokens per wall-clock second per worker; {scale})",
            self.sim_speedup,
            self.prefill_tokens_per_s,
            self.max_num_batched_tokens,
            self.real_prefill_tps()
        )
    }
}

/// Each workload's default timing (README "Why these defaults"): the trace, siblings and cold
/// saturate on prefill at the simulator's default throughput well before the machine does;
/// agentic and paced are mostly cache hits, so at 20,000 tokens/s the client's in-flight bound
/// and the CPU gave out first. Both run modelled time faster, so that a whole session fits in a
/// point's warm-up + window ([`MeasureWindow`]) — agentic 4× (its think times of 0.3–8 s and
/// 128-token decodes at 20 ms a step shrink 4×: a session lasts ~24 s instead of ~95 s), paced 8×
/// (10–60 s think times become 1.25–7.5 s) — with a slower modelled prefill: agentic 2,000
/// tokens/s (8,000 per wall-clock second per worker, chunk 819), paced 1,000 (8,000, chunk 410).
pub fn default_timing(kind: WorkloadKind) -> FleetTiming {
    let (speedup, prefill) = match kind {
        // Tiers: single-turn, timed as cold (its CPU load rate is the indexer's default at 1×).
        WorkloadKind::Trace | WorkloadKind::Siblings | WorkloadKind::Cold | WorkloadKind::Tiers => {
            (1.0, SIM_DEFAULT_PREFILL_TPS)
        }
        // Models: agentic turns, timed as agentic.
        WorkloadKind::Agentic | WorkloadKind::Models => (4.0, 2_000.0),
        WorkloadKind::Paced => (8.0, 1_000.0),
    };
    FleetTiming::scaled(speedup, prefill)
}

/// `kind`'s timing with the command line's overrides (`--sim-speedup`,
/// `--prefill-tokens-per-s`, each for every workload) over [`default_timing`].
pub fn timing_for(
    kind: WorkloadKind,
    sim_speedup: Option<f64>,
    prefill_tokens_per_s: Option<f64>,
) -> Result<FleetTiming, String> {
    let d = default_timing(kind);
    FleetTiming::new(
        sim_speedup.unwrap_or(d.sim_speedup),
        prefill_tokens_per_s.unwrap_or(d.prefill_tokens_per_s),
    )
}

/// Uncached prompt tokens one arrival (a request, a session, a burst) costs round_robin over a
/// 20-s point, roughly, from the workload's token mix (README "Why these defaults"). For the
/// multi-turn workloads, measured at steady state after a warm-up, it is a whole session's cost
/// (every turn of a session is sent at steady state).
pub fn arrival_cost_tokens(kind: WorkloadKind) -> f64 {
    match kind {
        // ~12k-token prompts, < 10 % reused under round_robin (measured 11–13k).
        WorkloadKind::Trace => 11_000.0,
        // Mean of 4–16k tokens, nothing cached.
        WorkloadKind::Cold => 10_000.0,
        // 4–8 × 2–8k tokens; round_robin spreads a burst, hitting ~40 %.
        WorkloadKind::Siblings => 30_000.0,
        // 17.5 turns a session; each adds ~2.4 KB (60 % tool turns of 1–6 KB), and a turn
        // round_robin sends to a worker that did not serve the session's previous turn (3 of 4)
        // misses the history since the last turn it did serve (~3.3 turns on average over a
        // session, the task message too when it served none): ~140 KB ≈ 26k tokens a session
        // counted; measured 22k a session at 0.4 sessions/s and 15k at 1.2 (the closed loop
        // throttles), 20k assumed.
        WorkloadKind::Agentic => 20_000.0,
        // Agentic sessions; its (model, system prompt) pairs (14) are more than agentic's 3, so a
        // policy blind to them misses more first prompts: assumed as agentic until measured.
        WorkloadKind::Models => 20_000.0,
        // ~4.2k tokens a request; a worker's GPU + CPU holds ~38 % of the documents, round_robin
        // shows each worker all of them (uniform draws: ~38 % hit, CPU loads not computed):
        // ~2.7k computed tokens, 3,000 assumed until measured.
        WorkloadKind::Tiers => 3_000.0,
        // 5.5 turns a session, ~1 KB added a turn after a 200–600-word first message, the same
        // round_robin misses: ~16 KB ≈ 3,000 tokens a session (at 3 turns the same count gives
        // 1,700; 1,500 was measured for ~3 turns a session at 15-s points without warm-up).
        WorkloadKind::Paced => 3_000.0,
    }
}

/// Rough round_robin saturation rate of `workers` engines timed by `t`: their wall-clock prefill
/// throughput ÷ [`arrival_cost_tokens`]. Measured saturation came out at ~0.7 × this (cold,
/// trace: queueing of variable-size prompts saturates p90 before the mean fills the engines).
pub fn estimated_saturation(kind: WorkloadKind, t: &FleetTiming, workers: usize) -> f64 {
    workers as f64 * t.real_prefill_tps() / arrival_cost_tokens(kind)
}

/// The ladder's first rate: [`START_FRACTION`] × [`estimated_saturation`]. (Agentic started at
/// 0.6 × before the warm-up: without one, its light point's TTFT p90 was the system prompts' cold
/// misses; they now fall in the warm-up.)
pub fn default_start_rate(kind: WorkloadKind, t: &FleetTiming, workers: usize) -> f64 {
    START_FRACTION * estimated_saturation(kind, t, workers)
}
