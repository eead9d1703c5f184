//! The load sweep's decisions and numbers (pure): which rates to measure, where round_robin
//! saturates, which points are valid, and one point's summary.
//!
//! - **Ladder.** round_robin is measured first, from a light rate upwards by a factor
//!   ([`next_ladder_rate`]) until its TTFT p90 exceeds [`SATURATION_FACTOR`] × its light-load
//!   value (the p90 at the lowest rate), or the ladder's step bound is reached.
//! - **Saturation.** [`saturation_rate`] finds the crossing on the measured points: the first
//!   rate whose p90 exceeds the threshold, linearly interpolated from the point before it. The
//!   **load point** is [`LOAD_POINT_FRACTION`] × that rate; every policy (round_robin too) is
//!   measured there, and at the other fractions of [`SweepConfig::fractions`], light load to
//!   past saturation.
//! - **Validity.** A point is invalid when the machine's CPU was busier than
//!   [`MAX_CPU_BUSY`] on average over the point, or the client sent late: p90 of
//!   `sent − scheduled` above [`MAX_LATENESS_P90_MS`]. Then the machine, not the router, shaped
//!   the numbers; the headline never uses such a point, and the saturation search prefers valid
//!   points (it falls back to all points, and says so, when fewer than two are valid).
//! - **Validity on real engines.** When the engines are real vLLM CPU engines, the engines ARE
//!   the CPU load, so a busy machine is the workload, not noise. There a point is invalid when
//!   the CPU of everything except the engines (machine busy − the engines' own CPU, as a fraction
//!   of the machine) is above [`MAX_OTHER_CPU_BUSY`] — the gateway, the indexer, the client or
//!   anything else took the engines' cores — or lateness p90 is above [`MAX_LATENESS_P90_MS`]
//!   ([`invalid_reasons_real_engines`]).
//! - **Fleet timing per workload.** Each workload gets the simulated engines' timing that makes
//!   engine time, not the machine's CPU or the client's in-flight bound, saturate round_robin
//!   ([`default_timing`]; `--sweep-sim-speedup` / `--sweep-prefill-tokens-per-s` override it for
//!   every workload). The step budget (`--max-num-batched-tokens`) follows the prefill throughput
//!   so that one full prefill chunk always costs the same modelled engine time as the
//!   simulator's defaults (8,192 tokens at 20,000 tokens/s: 0.41 s) — otherwise a slower engine
//!   would also stall every decode step for longer while it is backlogged. The ladder's first
//!   rate is [`START_FRACTION`] × [`estimated_saturation`]: the fleet's real-time prefill
//!   throughput ÷ the uncached tokens one arrival costs round_robin ([`arrival_cost_tokens`]).
//! - **Steady state.** Agentic and paced sessions live longer than a point's window; their points
//!   start sessions a warm-up earlier and count only the requests scheduled inside the window
//!   ([`MeasureWindow`], [`window_for`], [`window_records`]); the ceiling of such a point counts
//!   the window's requests with everything sent before as history
//!   (`workload::ceiling_with_history`).

use crate::ceiling::Ceiling;
use crate::counters::PolicyCounters;
use crate::record::RequestRecord;
use crate::stats::{balance, percentile};
use crate::workload::{
    ceiling_with_history, fleet_lru, per_prompt_ceiling, planned_prompts, sent_prompts, Content,
    Plan, Segments, SentPrompt, WorkloadKind,
};
use serde::{Deserialize, Serialize};

/// round_robin saturates where its TTFT p90 exceeds this multiple of its light-load p90.
pub const SATURATION_FACTOR: f64 = 3.0;
/// The headline's load point, as a fraction of round_robin's saturation rate.
pub const LOAD_POINT_FRACTION: f64 = 0.8;
/// A point is invalid when the machine's mean CPU use over it is above this (0..1).
pub const MAX_CPU_BUSY: f64 = 0.85;
/// A point is invalid when the client's lateness p90 is above this, ms.
pub const MAX_LATENESS_P90_MS: f64 = 10.0;
/// Real engines: a point is invalid when everything except the engines used more than this
/// fraction of the machine on average (0..1; 0.25 = half a core of two).
pub const MAX_OTHER_CPU_BUSY: f64 = 0.25;
/// HTTP statuses that mean "rejected for load" (engine queue full, rate limited).
pub const REJECT_STATUSES: [u16; 2] = [429, 503];

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
            return Err("--sweep-sim-speedup must be > 0".into());
        }
        if !(prefill_tokens_per_s > 0.0 && prefill_tokens_per_s.is_finite()) {
            return Err("--sweep-prefill-tokens-per-s must be > 0".into());
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
        WorkloadKind::Trace | WorkloadKind::Siblings | WorkloadKind::Cold => {
            (1.0, SIM_DEFAULT_PREFILL_TPS)
        }
        WorkloadKind::Agentic => (4.0, 2_000.0),
        WorkloadKind::Paced => (8.0, 1_000.0),
    };
    FleetTiming::scaled(speedup, prefill)
}

/// `kind`'s timing with the command line's overrides (`--sweep-sim-speedup`,
/// `--sweep-prefill-tokens-per-s`, each for every workload) over [`default_timing`].
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

/// vllm-sim's default inter-token latency (`--itl-ms`), modelled ms per decode step at a small batch.
pub const SIM_DEFAULT_ITL_MS: f64 = 20.0;
/// Sessions of the reference plan [`default_warmup_s`] measures (arrivals at 1/s over this many s).
const WARMUP_REFERENCE_SESSIONS: f64 = 256.0;
/// The default warm-up lasts until this share of the steady-state population of live sessions is
/// live ([`default_warmup_s`]).
pub const WARMUP_POPULATION_SHARE: f64 = 0.9;
/// The default warm-up is at most this long, s.
const MAX_WARMUP_S: f64 = 600.0;

/// When a point's requests count. Multi-turn workloads with long sessions (agentic, paced:
/// [`WorkloadKind::steady_state`]) get a **warm-up**: sessions start arriving at the point's rate
/// `warmup_s` before the measured window opens, so that when it opens the population of live
/// sessions and the engines' caches are near steady state; only requests *scheduled* inside
/// `[warmup_s, warmup_s + window_s)` count, and no turn due at or after the window's end is sent
/// (it is cut and counted). The other workloads, and a steady-state one without warm-up (real
/// engines by default, `--sweep-warmup-s 0`), keep the plain point: arrivals over `window_s`,
/// every request counted, turns until 1.5 × `window_s`; `steady` still has the ceiling counted
/// over the prompts actually sent ([`point_ceiling`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MeasureWindow {
    /// Arrivals before the window, s (0: none).
    pub warmup_s: f64,
    /// The measured window, s (`--sweep-duration-s`).
    pub window_s: f64,
    /// Whether the workload is a steady-state one (its ceiling counts the prompts sent).
    pub steady: bool,
}

impl MeasureWindow {
    /// Whether the point has a warm-up before its window (steady-state workloads only).
    pub fn has_warmup(&self) -> bool {
        self.steady && self.warmup_s > 0.0
    }

    /// Sessions start in `[0, arrivals_s)`.
    pub fn arrivals_s(&self) -> f64 {
        if self.has_warmup() {
            self.warmup_s + self.window_s
        } else {
            self.window_s
        }
    }

    /// No turn due later than this (s from the point's start) is sent.
    pub fn turn_deadline_s(&self) -> f64 {
        if self.has_warmup() {
            self.warmup_s + self.window_s
        } else {
            1.5 * self.window_s
        }
    }

    /// Whether a request scheduled at `scheduled_ms` counts in the point's statistics.
    pub fn counts(&self, scheduled_ms: f64) -> bool {
        !self.has_warmup() || scheduled_ms >= self.warmup_s * 1000.0
    }

    /// The time the counted requests were scheduled over, s (the turns/s denominator).
    pub fn counted_span_s(&self) -> f64 {
        self.window_s
    }
}

/// A point's records split by [`MeasureWindow::counts`]: the counted ones, and how many were
/// warm-up (sent, not counted).
pub fn window_records(records: &[RequestRecord], w: &MeasureWindow) -> (Vec<RequestRecord>, usize) {
    let (counted, warm): (Vec<&RequestRecord>, Vec<&RequestRecord>) =
        records.iter().partition(|r| w.counts(r.scheduled_ms));
    (counted.into_iter().cloned().collect(), warm.len())
}

/// The ceiling a point's hit rates are compared with, `(rate, counts, prompts skipped)`. With the
/// steady-state rules: the prompts actually sent, in send order, the counted ones (scheduled in
/// the window) measured against everything sent before them — warm-up included — as history
/// (`workload::ceiling_with_history`; turns never sent are not history, and records naming no
/// planned turn are skipped and counted). Otherwise the plan's own ceiling.
pub fn point_ceiling(
    plan: &Plan,
    records: &[RequestRecord],
    w: &MeasureWindow,
    block_size: usize,
) -> (f64, Ceiling, usize) {
    if !w.steady {
        return (plan.ceiling_rate(), plan.ceiling, 0);
    }
    let (sent, skipped) = sent_of(records, w);
    let (c, unknown) = ceiling_with_history(&plan.sessions, &sent, block_size);
    (c.token_rate(), c, skipped + unknown)
}

/// The point's fleet-LRU reference, token-weighted (`workload::fleet_lru`): the same prompts as
/// [`point_ceiling`]'s, in the same order, through one LRU cache of `capacity_tokens` (the fleet's
/// blocks × block size). `None` for chat plans and for an empty point.
pub fn point_fleet_lru(
    plan: &Plan,
    records: &[RequestRecord],
    w: &MeasureWindow,
    block_size: usize,
    capacity_tokens: u64,
) -> Option<f64> {
    let prompts = token_prompts(plan, records, w, block_size)?;
    let c = fleet_lru(prompts.iter().map(|(p, counted)| (p, *counted)), capacity_tokens);
    (c.tokens_total > 0).then(|| c.token_rate())
}

/// The point's TTFT floor, p90 in wall-clock ms: each counted prompt's uncached tokens on an engine
/// holding everything the ceiling counts as reused (`workload::per_prompt_ceiling`), prefilled
/// alone at `t.prefill_tokens_per_s` and divided by the speed-up — no queue, no other request's
/// prefill, so no router can give the point's p90 less. `None` for chat plans and an empty point.
pub fn point_ttft_floor_p90_ms(
    plan: &Plan,
    records: &[RequestRecord],
    w: &MeasureWindow,
    block_size: usize,
    t: &FleetTiming,
) -> Option<f64> {
    let prompts = token_prompts(plan, records, w, block_size)?;
    let ms: Vec<f64> = per_prompt_ceiling(prompts.iter().map(|(p, counted)| (p, *counted)))
        .iter()
        .map(|c| {
            (c.tokens_total - c.tokens_reused) as f64 / t.prefill_tokens_per_s * 1000.0
                / t.sim_speedup
        })
        .collect();
    percentile(&ms, 90.0)
}

/// The prompts [`point_ceiling`] counts, as `(segments, counted)` in send order (planned order for
/// a plain point): `None` unless every session is token content (chat segments weigh bytes).
fn token_prompts(
    plan: &Plan,
    records: &[RequestRecord],
    w: &MeasureWindow,
    block_size: usize,
) -> Option<Vec<(Segments, bool)>> {
    if !plan.sessions.iter().all(|s| matches!(s.content, Content::Tokens(_))) {
        return None;
    }
    Some(if w.steady {
        sent_prompts(&plan.sessions, &sent_of(records, w).0, block_size).0
    } else {
        planned_prompts(&plan.sessions, block_size).into_iter().map(|p| (p, true)).collect()
    })
}

/// The records as sent prompts (counted when scheduled in the window), and how many name no
/// session or turn.
fn sent_of<'a>(records: &'a [RequestRecord], w: &MeasureWindow) -> (Vec<SentPrompt<'a>>, usize) {
    let mut skipped = 0;
    let sent = records
        .iter()
        .filter_map(|r| match (r.session.as_deref(), r.turn) {
            (Some(session), Some(turn)) => Some(SentPrompt {
                session,
                turn: turn as usize,
                sent_ms: r.sent_ms,
                counted: w.counts(r.scheduled_ms),
            }),
            _ => {
                skipped += 1;
                None
            }
        })
        .collect();
    (sent, skipped)
}

/// The default warm-up of a workload, s: the first whole second at which sessions arriving at a
/// constant rate hold [`WARMUP_POPULATION_SHARE`] of their steady-state population
/// ([`crate::workload::population_share_at`]), from the planned session lengths in wall-clock
/// time of a reference plan (think times ÷ the speed-up, plus each turn's `max_tokens` decode
/// steps at [`SIM_DEFAULT_ITL_MS`] ÷ the speed-up; queueing and prefill left out). At one mean
/// session length the share is ~0.82 — the missing sessions are the longest, whose late turns
/// carry the longest histories — so the warm-up is longer than the mean. 0 for the workloads
/// without the steady-state rules.
pub fn default_warmup_s(kind: WorkloadKind, t: &FleetTiming, seed: u64) -> f64 {
    if !kind.steady_state() {
        return 0.0;
    }
    let g = crate::workload::gen::GenConfig {
        seed,
        duration_s: WARMUP_REFERENCE_SESSIONS,
        think_divisor: t.sim_speedup,
        block_size: 16,
    };
    let plan = match kind {
        WorkloadKind::Agentic => crate::workload::gen::agentic(&g, 1.0),
        _ => crate::workload::gen::paced(&g, 1.0),
    };
    let per_token = SIM_DEFAULT_ITL_MS / t.sim_speedup;
    let mut w = 0.0;
    while w < MAX_WARMUP_S
        && crate::workload::population_share_at(&plan.sessions, per_token, w * 1000.0)
            < WARMUP_POPULATION_SHARE
    {
        w += 1.0;
    }
    w
}

/// A point's window: `--sweep-warmup-s` (`warmup_override`) or [`default_warmup_s`] for the
/// steady-state workloads (on real engines, whose timing the sweep does not set, 0 unless given).
pub fn window_for(
    kind: WorkloadKind,
    t: &FleetTiming,
    seed: u64,
    window_s: f64,
    warmup_override: Option<f64>,
    real_engines: bool,
) -> MeasureWindow {
    let steady = kind.steady_state();
    let warmup_s = match (steady, warmup_override) {
        (false, _) => 0.0,
        (true, Some(w)) => w.max(0.0),
        (true, None) if real_engines => 0.0,
        (true, None) => default_warmup_s(kind, t, seed),
    };
    MeasureWindow { warmup_s, window_s, steady }
}

/// How a sweep chooses its rates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SweepConfig {
    /// First (light) rate of the round_robin ladder.
    pub start_rate: f64,
    /// Each ladder step multiplies the rate by this (> 1).
    pub factor: f64,
    /// Ladder steps at most (the light point included).
    pub max_steps: usize,
    /// Rates every policy is measured at, as fractions of the saturation rate; must contain
    /// [`LOAD_POINT_FRACTION`].
    pub fractions: Vec<f64>,
}

impl SweepConfig {
    /// Checks the bounds; the message names the offending setting.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.start_rate > 0.0 && self.start_rate.is_finite()) {
            return Err("--sweep-start-rate must be > 0".into());
        }
        if !(self.factor > 1.0 && self.factor.is_finite()) {
            return Err("--sweep-factor must be > 1".into());
        }
        if self.max_steps < 2 {
            return Err("--sweep-max-steps must be >= 2 (light load and one more)".into());
        }
        if !self.fractions.iter().any(|f| (f - LOAD_POINT_FRACTION).abs() < 1e-9) {
            return Err(format!(
                "--sweep-fractions must contain the load point {LOAD_POINT_FRACTION}"
            ));
        }
        if self.fractions.iter().any(|f| !(*f > 0.0 && f.is_finite())) {
            return Err("--sweep-fractions must be > 0".into());
        }
        Ok(())
    }
}

/// One measured `(rate, TTFT p90)` of round_robin, with its validity.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RatePoint {
    /// Offered rate.
    pub rate: f64,
    /// TTFT p90, ms (`None`: nothing succeeded — counts as saturated).
    pub p90_ms: Option<f64>,
    /// Whether the point is valid.
    pub valid: bool,
}

/// Where round_robin saturates.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Saturation {
    /// The interpolated saturation rate.
    pub rate: f64,
    /// The light-load TTFT p90 it is measured against, ms.
    pub light_p90_ms: f64,
    /// True when fewer than two valid points existed and invalid ones were used.
    pub from_invalid_points: bool,
}

impl Saturation {
    /// The load point, [`LOAD_POINT_FRACTION`] × the saturation rate.
    pub fn load_point(&self) -> f64 {
        self.rate * LOAD_POINT_FRACTION
    }
}

fn crossing(points: &[RatePoint]) -> Option<(f64, f64)> {
    let mut pts: Vec<RatePoint> = points.to_vec();
    pts.sort_by(|a, b| a.rate.total_cmp(&b.rate));
    let light = pts.first()?.p90_ms?;
    let threshold = SATURATION_FACTOR * light;
    for w in 1..pts.len() {
        let (prev, cur) = (pts[w - 1], pts[w]);
        let over = cur.p90_ms.is_none_or(|p| p > threshold);
        if over {
            // Linear between the last point under the threshold and this one; a point with no
            // successful request is treated as saturated at its rate.
            let rate = match (prev.p90_ms, cur.p90_ms) {
                (Some(a), Some(b)) if b > a => {
                    prev.rate + (cur.rate - prev.rate) * ((threshold - a) / (b - a)).clamp(0.0, 1.0)
                }
                _ => cur.rate,
            };
            return Some((rate, light));
        }
    }
    None
}

/// round_robin's saturation rate from its measured points, or `None` when no point crossed.
pub fn saturation_rate(points: &[RatePoint]) -> Option<Saturation> {
    let valid: Vec<RatePoint> = points.iter().copied().filter(|p| p.valid).collect();
    if valid.len() >= 2 {
        if let Some((rate, light)) = crossing(&valid) {
            return Some(Saturation { rate, light_p90_ms: light, from_invalid_points: false });
        }
        if valid.len() == points.len() {
            return None;
        }
    }
    crossing(points).map(|(rate, light)| Saturation {
        rate,
        light_p90_ms: light,
        from_invalid_points: true,
    })
}

/// What the ladder does next.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LadderStep {
    /// Measure round_robin at this rate.
    Measure(f64),
    /// Saturation found.
    Saturated(Saturation),
    /// The step bound was reached without crossing.
    GaveUp,
}

/// The next ladder step given round_robin's points so far (measured in ladder order).
pub fn next_ladder_rate(cfg: &SweepConfig, points: &[RatePoint]) -> LadderStep {
    if points.len() >= 2 {
        if let Some(s) = saturation_rate(points) {
            return LadderStep::Saturated(s);
        }
    }
    if points.len() >= cfg.max_steps {
        return LadderStep::GaveUp;
    }
    let last = points.iter().map(|p| p.rate).fold(0.0, f64::max);
    LadderStep::Measure(if points.is_empty() { cfg.start_rate } else { last * cfg.factor })
}

/// The rates every policy is measured at: the fractions of the saturation rate, ascending.
pub fn policy_rates(cfg: &SweepConfig, sat: &Saturation) -> Vec<f64> {
    let mut r: Vec<f64> = cfg.fractions.iter().map(|f| f * sat.rate).collect();
    r.sort_by(f64::total_cmp);
    r.dedup_by(|a, b| (*a - *b).abs() < 1e-9);
    r
}

/// Why a point is invalid (empty: valid).
pub fn invalid_reasons(cpu_busy_mean: Option<f64>, lateness_p90_ms: Option<f64>) -> Vec<String> {
    [cpu_invalid_reason(cpu_busy_mean), lateness_invalid_reason(lateness_p90_ms)]
        .into_iter()
        .flatten()
        .collect()
}

/// The machine-CPU rule of [`invalid_reasons`] (simulators: the whole machine's busy share).
pub fn cpu_invalid_reason(cpu_busy_mean: Option<f64>) -> Option<String> {
    match cpu_busy_mean {
        Some(c) if c > MAX_CPU_BUSY => {
            Some(format!("CPU {:.0}% > {:.0}%", c * 100.0, MAX_CPU_BUSY * 100.0))
        }
        None => Some("CPU not sampled".into()),
        _ => None,
    }
}

fn lateness_invalid_reason(lateness_p90_ms: Option<f64>) -> Option<String> {
    match lateness_p90_ms {
        Some(l) if l > MAX_LATENESS_P90_MS => {
            Some(format!("lateness p90 {l:.1} ms > {MAX_LATENESS_P90_MS} ms"))
        }
        None => Some("no request sent".into()),
        _ => None,
    }
}

/// Why a point over real engines is invalid (empty: valid). `engine_cpu_s`: CPU seconds of the
/// engines' processes over the point's `wall_s` on a machine of `cores` cores; the rest of the
/// machine's busy share (`cpu_busy_mean` − engines' share, floored at 0) is what the rule bounds.
pub fn invalid_reasons_real_engines(
    cpu_busy_mean: Option<f64>,
    engine_cpu_s: Option<f64>,
    wall_s: f64,
    cores: usize,
    lateness_p90_ms: Option<f64>,
) -> Vec<String> {
    [
        cpu_invalid_reason_real_engines(cpu_busy_mean, engine_cpu_s, wall_s, cores),
        lateness_invalid_reason(lateness_p90_ms),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// The machine-CPU rule of [`invalid_reasons_real_engines`]: the busy share outside the engines.
pub fn cpu_invalid_reason_real_engines(
    cpu_busy_mean: Option<f64>,
    engine_cpu_s: Option<f64>,
    wall_s: f64,
    cores: usize,
) -> Option<String> {
    let machine_s = wall_s * cores as f64;
    match (cpu_busy_mean, engine_cpu_s) {
        (Some(busy), Some(eng)) if machine_s > 0.0 => {
            let other = (busy - eng / machine_s).max(0.0);
            (other > MAX_OTHER_CPU_BUSY).then(|| {
                format!(
                    "CPU outside the engines {:.0}% > {:.0}%",
                    other * 100.0,
                    MAX_OTHER_CPU_BUSY * 100.0
                )
            })
        }
        (None, _) => Some("CPU not sampled".into()),
        _ => Some("engine CPU not measured".into()),
    }
}

/// Machine and process measurements taken during one point.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MachineSample {
    /// Mean machine CPU use over the point, 0..1 (`/proc/stat`).
    pub cpu_busy_mean: Option<f64>,
    /// Highest sampled interval, 0..1.
    pub cpu_busy_max: Option<f64>,
    /// CPU seconds the simulator processes used during the point (`/proc/<pid>/stat`).
    pub sim_cpu_s: Option<f64>,
}

/// One measured point.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct PointResult {
    /// Workload name.
    pub workload: String,
    /// Policy name.
    pub policy: String,
    /// Offered rate (the workload's unit).
    pub rate: f64,
    /// Where the point's files are, relative to the sweep directory.
    pub dir: String,
    /// Records.
    pub requests: usize,
    /// Successful records.
    pub ok: usize,
    /// Failed records other than rejections.
    pub failed: usize,
    /// Records rejected for load (HTTP 429 / 503).
    pub rejected: usize,
    /// TTFT p50 / p90 / p99 over successful requests, ms.
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p90_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Inter-token latency p50 / p90, ms: per request (e2e − TTFT) / (output tokens − 1).
    pub itl_p50_ms: Option<f64>,
    pub itl_p90_ms: Option<f64>,
    /// Output tokens per second over first send → last completion.
    pub output_tokens_per_s: f64,
    /// Engine hit rate from the engines' counters (Σ hits / Σ queries, tokens).
    pub engine_hit_rate: Option<f64>,
    /// Engine hit rate from the responses: Σ cached_tokens / Σ prompt_tokens.
    pub usage_hit_rate: Option<f64>,
    /// Engine preemptions during the point.
    pub preemptions: Option<f64>,
    /// The point's intrinsic ceiling (the rate the hit rates are compared with).
    pub ceiling: Option<f64>,
    /// The ceiling's counts.
    pub ceiling_counts: Option<Ceiling>,
    /// The fleet-LRU reference (token prompts only): what one LRU cache of the whole fleet's
    /// capacity would hit of the same prompts (`workload::fleet_lru`).
    #[serde(default)]
    pub fleet_lru: Option<f64>,
    /// The TTFT floor's p90, ms (token prompts on simulators, `point_ttft_floor_p90_ms`): no router
    /// gives the point's TTFT p90 less.
    #[serde(default)]
    pub ttft_floor_p90_ms: Option<f64>,
    /// Max / mean prompt tokens per worker (idle workers count as 0).
    pub load_max_over_mean: Option<f64>,
    /// Client lateness (sent − scheduled) p90, ms.
    pub lateness_p90_ms: Option<f64>,
    /// Machine measurements.
    pub machine: MachineSample,
    /// Simulator CPU seconds per 1,000 requests.
    pub sim_cpu_s_per_1k: Option<f64>,
    /// Why the point is invalid; empty when valid.
    pub invalid: Vec<String>,
    /// Requests the filter routed without the indexer.
    pub fallbacks: usize,
    /// Set when the point could not run (stack did not start …).
    #[serde(default)]
    pub error: Option<String>,
    /// The point's warm-up and measured window (everything above counts the window only).
    #[serde(default)]
    pub window: MeasureWindow,
    /// Requests sent in the warm-up: history for the caches and the ceiling, not counted.
    #[serde(default)]
    pub warmup_requests: usize,
    /// Turns not sent: due at or after the window's end, or after a failed turn of their session.
    #[serde(default)]
    pub cut_turns: u64,
    /// Counted requests per second of the window (turns/s; requests/s for single-turn workloads).
    #[serde(default)]
    pub turns_per_s: Option<f64>,
}

impl PointResult {
    /// Valid: ran, and neither the CPU nor the client's lateness shaped it.
    pub fn valid(&self) -> bool {
        self.error.is_none() && self.invalid.is_empty()
    }

    /// The engines reported more hits than the point's prompts can hold: above the token-weighted
    /// ceiling by more than half a point. Preemption re-admissions counted as hits do that (the
    /// simulator bug issue 12 names); the report flags it beside the point.
    pub fn above_ceiling(&self) -> bool {
        match (self.engine_hit_rate, self.ceiling_counts) {
            (Some(h), Some(c)) if c.tokens_total > 0 => h > c.token_rate() + 0.005,
            _ => false,
        }
    }

    /// Records the window this point was counted over, the warm-up requests and the cut turns,
    /// and derives turns/s (counted requests ÷ the window).
    pub fn with_window(
        self,
        window: MeasureWindow,
        warmup_requests: usize,
        cut_turns: u64,
    ) -> Self {
        let span = window.counted_span_s();
        Self {
            turns_per_s: (span > 0.0).then(|| self.requests as f64 / span),
            window,
            warmup_requests,
            cut_turns,
            ..self
        }
    }

    /// Engine hit rate ÷ ceiling.
    pub fn hit_over_ceiling(&self) -> Option<f64> {
        match (self.engine_hit_rate, self.ceiling) {
            (Some(h), Some(c)) if c > 0.0 => Some(h / c),
            _ => None,
        }
    }

    /// The engines' hit rate ÷ the fleet-LRU reference.
    pub fn hit_over_fleet_lru(&self) -> Option<f64> {
        match (self.engine_hit_rate, self.fleet_lru) {
            (Some(h), Some(c)) if c > 0.0 => Some(h / c),
            _ => None,
        }
    }
}

/// Whether a record was rejected for load.
pub fn rejected(r: &RequestRecord) -> bool {
    r.status.is_some_and(|s| REJECT_STATUSES.contains(&s))
}

/// Summarises one point from its records, counters and machine samples.
#[allow(clippy::too_many_arguments)]
pub fn summarize_point(
    workload: &str,
    policy: &str,
    rate: f64,
    dir: &str,
    records: &[RequestRecord],
    counters: Option<&PolicyCounters>,
    ceiling: Option<(f64, Ceiling)>,
    machine: MachineSample,
    fleet: &[String],
) -> PointResult {
    let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.ok()).collect();
    let rej = records.iter().filter(|r| rejected(r)).count();
    let ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_ms).collect();
    let itl: Vec<f64> = ok
        .iter()
        .filter_map(|r| match (r.ttft_ms, r.output_tokens) {
            (Some(t), Some(n)) if n > 1 => Some((r.e2e_ms - t).max(0.0) / (n - 1) as f64),
            _ => None,
        })
        .collect();
    let lateness: Vec<f64> =
        records.iter().map(|r| (r.sent_ms - r.scheduled_ms).max(0.0)).collect();
    let start = records.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let end = records.iter().map(|r| r.sent_ms + r.e2e_ms).fold(f64::NEG_INFINITY, f64::max);
    let span_s = if end > start { (end - start) / 1000.0 } else { 0.0 };
    let out_tokens: u64 = ok.iter().filter_map(|r| r.output_tokens).sum();
    let (mut cached, mut prompt) = (0u64, 0u64);
    for r in ok.iter().filter(|r| r.cached_tokens.is_some()) {
        cached += r.cached_tokens.unwrap_or(0);
        prompt += r.prompt_tokens.unwrap_or(0);
    }
    let load = balance(
        ok.iter().filter_map(|r| {
            r.worker.as_deref().map(|w| (w, r.prompt_tokens.or(r.input_tokens).unwrap_or(0) as f64))
        }),
        fleet,
    );
    let lateness_p90 = percentile(&lateness, 90.0);
    PointResult {
        workload: workload.into(),
        policy: policy.into(),
        rate,
        dir: dir.into(),
        requests: records.len(),
        ok: ok.len(),
        failed: records.len() - ok.len() - rej,
        rejected: rej,
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p90_ms: percentile(&ttft, 90.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        itl_p50_ms: percentile(&itl, 50.0),
        itl_p90_ms: percentile(&itl, 90.0),
        output_tokens_per_s: if span_s > 0.0 { out_tokens as f64 / span_s } else { 0.0 },
        engine_hit_rate: counters.and_then(PolicyCounters::engine_hit_rate),
        usage_hit_rate: (prompt > 0).then(|| cached as f64 / prompt as f64),
        preemptions: counters.map(PolicyCounters::preemptions),
        ceiling: ceiling.map(|c| c.0),
        ceiling_counts: ceiling.map(|c| c.1),
        load_max_over_mean: load.max_over_mean(),
        lateness_p90_ms: lateness_p90,
        machine,
        sim_cpu_s_per_1k: machine
            .sim_cpu_s
            .filter(|_| !records.is_empty())
            .map(|s| s * 1000.0 / records.len() as f64),
        invalid: invalid_reasons(machine.cpu_busy_mean, lateness_p90),
        fallbacks: records.iter().filter(|r| r.fallback.is_some()).count(),
        error: None,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::EngineCounters;

    fn pt(rate: f64, p90: f64, valid: bool) -> RatePoint {
        RatePoint { rate, p90_ms: Some(p90), valid }
    }

    fn cfg() -> SweepConfig {
        SweepConfig {
            start_rate: 1.0,
            factor: 2.0,
            max_steps: 5,
            fractions: vec![0.4, 0.8, 1.0, 1.3],
        }
    }

    #[test]
    fn saturation_table() {
        type Case = (&'static str, Vec<RatePoint>, Option<(f64, bool)>);
        let cases: Vec<Case> = vec![
            (
                "never crosses",
                vec![pt(1.0, 100.0, true), pt(2.0, 150.0, true), pt(4.0, 290.0, true)],
                None,
            ),
            // Threshold 300: between 2 (150) and 4 (450) → 2 + 2 × 150/300 = 3.
            (
                "interpolated",
                vec![pt(1.0, 100.0, true), pt(2.0, 150.0, true), pt(4.0, 450.0, true)],
                Some((3.0, false)),
            ),
            (
                "order does not matter",
                vec![pt(4.0, 450.0, true), pt(1.0, 100.0, true), pt(2.0, 150.0, true)],
                Some((3.0, false)),
            ),
            (
                "first crossing wins",
                vec![pt(1.0, 100.0, true), pt(2.0, 400.0, true), pt(4.0, 200.0, true)],
                Some((1.0 + 200.0 / 300.0, false)),
            ),
            // The invalid point is skipped: 1 → 4 gives 1 + 3 × 200/350.
            (
                "invalid points skipped",
                vec![pt(1.0, 100.0, true), pt(2.0, 9999.0, false), pt(4.0, 450.0, true)],
                Some((1.0 + 3.0 * 200.0 / 350.0, false)),
            ),
            (
                "fallback to invalid points",
                vec![pt(1.0, 100.0, false), pt(2.0, 400.0, false)],
                Some((1.0 + 200.0 / 300.0, true)),
            ),
            ("single point", vec![pt(1.0, 100.0, true)], None),
        ];
        for (name, pts, want) in cases {
            let got = saturation_rate(&pts).map(|s| (s.rate, s.from_invalid_points));
            match (got, want) {
                (Some((r, inv)), Some((wr, winv))) => {
                    assert!((r - wr).abs() < 1e-9 && inv == winv, "{name}: {r} {inv}")
                }
                (g, w) => assert_eq!(g.is_some(), w.is_some(), "{name}: {g:?}"),
            }
        }
        // Nothing succeeded at the second rate: saturated there.
        let s = saturation_rate(&[
            pt(1.0, 100.0, true),
            RatePoint { rate: 2.0, p90_ms: None, valid: true },
        ])
        .unwrap();
        assert_eq!(s.rate, 2.0);
        assert!((s.load_point() - 1.6).abs() < 1e-12);
    }

    #[test]
    fn ladder_drives_until_saturated_or_bounded() {
        let c = cfg();
        assert_eq!(next_ladder_rate(&c, &[]), LadderStep::Measure(1.0));
        assert_eq!(next_ladder_rate(&c, &[pt(1.0, 100.0, true)]), LadderStep::Measure(2.0));
        assert_eq!(
            next_ladder_rate(&c, &[pt(1.0, 100.0, true), pt(2.0, 120.0, true)]),
            LadderStep::Measure(4.0)
        );
        match next_ladder_rate(
            &c,
            &[pt(1.0, 100.0, true), pt(2.0, 120.0, true), pt(4.0, 600.0, true)],
        ) {
            LadderStep::Saturated(s) => {
                assert!((s.rate - (2.0 + 2.0 * 180.0 / 480.0)).abs() < 1e-9)
            }
            other => panic!("{other:?}"),
        }
        let flat: Vec<RatePoint> = (0..5).map(|i| pt(f64::from(1 << i), 100.0, true)).collect();
        assert_eq!(next_ladder_rate(&c, &flat), LadderStep::GaveUp);
        // A whole simulated sweep: a fleet whose p90 explodes past 5 rate units.
        let fleet = |r: f64| if r < 5.0 { 100.0 + 10.0 * r } else { 2000.0 };
        let mut pts = Vec::new();
        let sat = loop {
            match next_ladder_rate(&c, &pts) {
                LadderStep::Measure(r) => pts.push(pt(r, fleet(r), true)),
                LadderStep::Saturated(s) => break s,
                LadderStep::GaveUp => panic!("should saturate"),
            }
        };
        assert_eq!(pts.len(), 4, "1, 2, 4, 8");
        assert!(sat.rate > 4.0 && sat.rate < 8.0, "{}", sat.rate);
        let rates = policy_rates(&c, &sat);
        assert_eq!(rates.len(), 4);
        assert!(
            rates.iter().any(|r| (r - sat.load_point()).abs() < 1e-9),
            "the load point is measured"
        );
        assert!(
            rates[0] < sat.rate && *rates.last().unwrap() > sat.rate,
            "light load to past saturation"
        );
    }

    #[test]
    fn fleet_timing_table() {
        for kind in WorkloadKind::ALL {
            let t = default_timing(kind);
            // One full chunk costs the simulator default's modelled time (0.41 s) at any prefill.
            let chunk_s = t.max_num_batched_tokens as f64 / t.prefill_tokens_per_s;
            assert!((chunk_s - 8192.0 / 20_000.0).abs() < 0.002, "{kind:?}: {chunk_s}");
            // Engine time dominates: round_robin is estimated to saturate at a rate whose
            // arrivals the client and the machine serve validly (measured at 20-s points:
            // agentic ≤ 19 sessions/s, paced ≤ 55 sessions/s valid; the others saturated).
            let sat = estimated_saturation(kind, &t, 4);
            let start = default_start_rate(kind, &t, 4);
            assert!((start - START_FRACTION * sat).abs() < 1e-12);
            match kind {
                WorkloadKind::Agentic => {
                    assert!((0.5..=4.0).contains(&sat), "agentic {sat}");
                    // At steady state a session sends its ~17.5 turns: the light point's 20-s
                    // window holds ≥ 100 requests.
                    assert!(start * 20.0 * 17.5 >= 100.0, "agentic light point {start}");
                    assert_eq!(t.sim_speedup, 4.0);
                }
                WorkloadKind::Paced => assert!((6.0..=20.0).contains(&sat), "paced {sat}"),
                _ => assert_eq!(
                    (t.sim_speedup, t.prefill_tokens_per_s),
                    (1.0, 20_000.0),
                    "{kind:?} unchanged"
                ),
            }
        }
        // The multi-turn workloads' wall-clock throughput is below the default: mostly cache
        // hits, they would otherwise saturate the machine before the engines.
        assert!(default_timing(WorkloadKind::Agentic).real_prefill_tps() < 20_000.0);
        assert!(default_timing(WorkloadKind::Paced).real_prefill_tps() < 20_000.0);
        // Paced's think times are compressed by its speed-up; its engine time with them.
        let p = default_timing(WorkloadKind::Paced);
        assert_eq!(p.sim_speedup, 8.0);
        assert_eq!(p.real_prefill_tps(), 8_000.0);
        assert_eq!(FleetTiming::new(1.0, 20_000.0).map(|t| t.max_num_batched_tokens), Ok(8192));
        assert_eq!(FleetTiming::new(1.0, 5_000.0).map(|t| t.max_num_batched_tokens), Ok(2048));
        assert_eq!(default_timing(WorkloadKind::Agentic).max_num_batched_tokens, 819);
        assert_eq!(FleetTiming::new(1.0, 10.0).map(|t| t.max_num_batched_tokens), Ok(16), "floor");
        for (s, p) in [(0.0, 1.0), (1.0, 0.0), (f64::NAN, 1.0), (1.0, f64::INFINITY)] {
            assert!(FleetTiming::new(s, p).is_err(), "{s} {p}");
        }
        assert!(
            p.describe().contains("÷ 8") && p.describe().contains("--max-num-batched-tokens 410")
        );
        assert!(default_timing(WorkloadKind::Trace).describe().contains("wall-clock time"));
        // Overrides apply field by field; the chunk follows the prefill.
        assert_eq!(timing_for(WorkloadKind::Paced, None, None), Ok(p));
        let o = timing_for(WorkloadKind::Paced, Some(1.0), None).unwrap();
        assert_eq!((o.sim_speedup, o.prefill_tokens_per_s), (1.0, 1_000.0));
        let o = timing_for(WorkloadKind::Agentic, None, Some(20_000.0)).unwrap();
        assert_eq!((o.sim_speedup, o.max_num_batched_tokens), (4.0, 8192));
        assert!(timing_for(WorkloadKind::Cold, Some(-1.0), None).is_err());
    }

    #[test]
    fn measure_window_table() {
        let agentic = default_timing(WorkloadKind::Agentic);
        let paced = default_timing(WorkloadKind::Paced);
        // The default warm-up: 90 % of the steady-state population live, longer than the mean
        // session (agentic 17.5 turns × (0.64 s decode + ~3 s ÷ 4 think) ≈ 24 s, paced 5.5 ×
        // 0.32 s + 4.5 × 35 s ÷ 8 ≈ 21 s) and shorter than the longest.
        let wa = default_warmup_s(WorkloadKind::Agentic, &agentic, 0);
        let wp = default_warmup_s(WorkloadKind::Paced, &paced, 0);
        assert!((25.0..=40.0).contains(&wa), "agentic warm-up {wa}");
        assert!((22.0..=36.0).contains(&wp), "paced warm-up {wp}");
        assert_eq!(wa.fract(), 0.0);
        for (kind, t, w) in [(WorkloadKind::Agentic, agentic, wa), (WorkloadKind::Paced, paced, wp)]
        {
            let g = crate::workload::gen::GenConfig {
                seed: 0,
                duration_s: 256.0,
                think_divisor: t.sim_speedup,
                block_size: 16,
            };
            let plan = match kind {
                WorkloadKind::Agentic => crate::workload::gen::agentic(&g, 1.0),
                _ => crate::workload::gen::paced(&g, 1.0),
            };
            let share = crate::workload::population_share_at(
                &plan.sessions,
                SIM_DEFAULT_ITL_MS / t.sim_speedup,
                w * 1000.0,
            );
            let before = crate::workload::population_share_at(
                &plan.sessions,
                SIM_DEFAULT_ITL_MS / t.sim_speedup,
                (w - 1.0) * 1000.0,
            );
            assert!(
                share >= WARMUP_POPULATION_SHARE && before < WARMUP_POPULATION_SHARE,
                "{kind:?}: {before} {share}"
            );
            let mean = crate::workload::mean_session_span_ms(
                &plan.sessions,
                SIM_DEFAULT_ITL_MS / t.sim_speedup,
            ) / 1000.0;
            assert!(w > mean, "{kind:?}: warm-up {w} s, mean session {mean} s");
        }
        // (kind, override, real engines) → (warm-up, arrivals, turn deadline, steady)
        type Case = (WorkloadKind, Option<f64>, bool, (f64, f64, f64, bool));
        let cases: Vec<Case> = vec![
            (WorkloadKind::Trace, None, false, (0.0, 20.0, 30.0, false)),
            (WorkloadKind::Cold, Some(50.0), false, (0.0, 20.0, 30.0, false)),
            (WorkloadKind::Siblings, None, true, (0.0, 20.0, 30.0, false)),
            (WorkloadKind::Agentic, None, false, (wa, wa + 20.0, wa + 20.0, true)),
            (WorkloadKind::Agentic, Some(40.0), false, (40.0, 60.0, 60.0, true)),
            (WorkloadKind::Agentic, Some(-1.0), false, (0.0, 20.0, 30.0, true)),
            // Without a warm-up: the plain point (the ceiling still over the prompts sent).
            (WorkloadKind::Agentic, None, true, (0.0, 20.0, 30.0, true)),
            (WorkloadKind::Paced, Some(60.0), true, (60.0, 80.0, 80.0, true)),
        ];
        for (kind, over, real, (warm, arr, dl, steady)) in cases {
            let t = default_timing(kind);
            let w = window_for(kind, &t, 0, 20.0, over, real);
            assert_eq!(
                (w.warmup_s, w.arrivals_s(), w.turn_deadline_s(), w.steady),
                (warm, arr, dl, steady),
                "{kind:?} {over:?} {real}"
            );
        }
        // Which records count: scheduled inside the window (steady), everything (otherwise).
        let rec = |scheduled_ms: f64| RequestRecord { scheduled_ms, ..Default::default() };
        let recs: Vec<RequestRecord> =
            [0.0, 9_999.0, 10_000.0, 15_000.0, 29_999.0].map(rec).to_vec();
        let steady = MeasureWindow { warmup_s: 10.0, window_s: 20.0, steady: true };
        let (counted, warm) = window_records(&recs, &steady);
        assert_eq!(
            (counted.iter().map(|r| r.scheduled_ms).collect::<Vec<_>>(), warm),
            (vec![10_000.0, 15_000.0, 29_999.0], 2)
        );
        let plain = MeasureWindow { steady: false, ..steady };
        assert_eq!(window_records(&recs, &plain).0.len(), 5);
        // turns/s is the counted requests over the window.
        let p = PointResult { requests: 3, ..Default::default() }.with_window(steady, 2, 7);
        assert_eq!((p.turns_per_s, p.warmup_requests, p.cut_turns), (Some(0.15), 2, 7));
        assert_eq!(
            PointResult::default().with_window(MeasureWindow::default(), 0, 0).turns_per_s,
            None
        );
    }

    #[test]
    fn point_ceiling_counts_the_window_against_its_history() {
        let g = crate::workload::gen::GenConfig {
            seed: 3,
            duration_s: 20.0,
            think_divisor: 4.0,
            block_size: 16,
        };
        let plan = crate::workload::gen::agentic(&g, 1.0);
        // Every planned turn sent at its planned time.
        let every: Vec<RequestRecord> = plan
            .sessions
            .iter()
            .flat_map(|s| {
                s.planned_times_ms().into_iter().enumerate().map(move |(t, at)| RequestRecord {
                    session: Some(s.id.clone()),
                    turn: Some(t as u32),
                    scheduled_ms: at,
                    sent_ms: at,
                    ..Default::default()
                })
            })
            .collect();
        // The window [10 s, 30 s) and its history.
        let recs: Vec<RequestRecord> =
            every.iter().filter(|r| r.scheduled_ms < 30_000.0).cloned().collect();
        let w = MeasureWindow { warmup_s: 10.0, window_s: 20.0, steady: true };
        let (rate, c, skipped) = point_ceiling(&plan, &recs, &w, 16);
        let counted = recs.iter().filter(|r| r.scheduled_ms >= 10_000.0).count() as u64;
        assert_eq!((c.requests, skipped), (counted, 0));
        assert!(rate > 0.0 && rate == c.token_rate());
        // Without its history the same window's ceiling is lower: the warm-up's prompts (shared
        // system prompts, earlier turns) are what the window reuses.
        let window_only: Vec<RequestRecord> =
            recs.iter().filter(|r| r.scheduled_ms >= 10_000.0).cloned().collect();
        let (alone, _, _) = point_ceiling(&plan, &window_only, &w, 16);
        assert!(alone < rate, "{alone} < {rate}");
        // All sent, none in a warm-up: the plan's own ceiling over the same prompts.
        let all = MeasureWindow { warmup_s: 0.0, ..w };
        assert_eq!(point_ceiling(&plan, &every, &all, 16).1, plan.ceiling);
        // A record without a session is skipped and counted; a plain point uses the plan's.
        let (_, _, skipped) = point_ceiling(&plan, &[RequestRecord::default()], &w, 16);
        assert_eq!(skipped, 1);
        let plain = MeasureWindow { steady: false, ..w };
        assert_eq!(point_ceiling(&plan, &[], &plain, 16), (plan.ceiling_rate(), plan.ceiling, 0));
    }

    #[test]
    fn fleet_lru_is_the_ceiling_with_room_for_everything_and_the_floor_is_uncached_prefill_alone() {
        let rec = |ts: f64, input: u32, ids: &[u64]| crate::trace::TraceRecord {
            timestamp: ts,
            input_length: input,
            output_length: 4,
            hash_ids: ids.to_vec(),
        };
        // Conversation 1's second turn comes back after conversation 2's prompt.
        let records = [
            rec(0.0, 1024, &[0, 1, 2]),
            rec(1000.0, 1024, &[0, 5, 6]),
            rec(2000.0, 1536, &[0, 1, 2, 3]),
        ];
        let cfg = crate::workload::trace::TraceConfig::default();
        let plan = crate::workload::trace::plan(&records, &cfg, 1000.0);
        assert_eq!(plan.sessions.len(), 3);
        let plain = MeasureWindow::default();
        assert!(!plain.steady);
        let lru = |capacity| point_fleet_lru(&plan, &[], &plain, 16, capacity);
        let unbounded = lru(u64::MAX).unwrap();
        assert!(
            unbounded > 0.0 && (unbounded - plan.ceiling_rate()).abs() < 1e-12,
            "{unbounded} vs {}",
            plan.ceiling_rate()
        );
        // Room for one prompt: conversation 2 pushes out turn 1's second block; its first (shared) hits.
        let tight = lru(1024).unwrap();
        assert!(0.0 < tight && tight < unbounded, "{tight} < {unbounded}");
        assert_eq!(lru(0), Some(0.0));
        // TTFT floor: uncached 1024, 512 (block 0 shared), 512 (turn 1's 1024 reused) tokens at
        // 1,000 tokens/s, halved by a speed-up of 2.
        let t = FleetTiming::new(1.0, 1000.0).unwrap();
        let floor = point_ttft_floor_p90_ms(&plan, &[], &plain, 16, &t);
        assert_eq!(floor, percentile(&[1024.0, 512.0, 512.0], 90.0));
        let fast = FleetTiming::new(2.0, 1000.0).unwrap();
        assert_eq!(point_ttft_floor_p90_ms(&plan, &[], &plain, 16, &fast), floor.map(|x| x / 2.0));
        // Chat plans weigh messages by bytes: neither applies.
        let g = crate::workload::gen::GenConfig {
            seed: 3,
            duration_s: 20.0,
            think_divisor: 4.0,
            block_size: 16,
        };
        let chat = crate::workload::gen::agentic(&g, 1.0);
        assert_eq!(point_fleet_lru(&chat, &[], &plain, 16, u64::MAX), None);
        assert_eq!(point_ttft_floor_p90_ms(&chat, &[], &plain, 16, &t), None);
    }

    #[test]
    fn config_validation() {
        assert!(cfg().validate().is_ok());
        for bad in [
            SweepConfig { start_rate: 0.0, ..cfg() },
            SweepConfig { factor: 1.0, ..cfg() },
            SweepConfig { max_steps: 1, ..cfg() },
            SweepConfig { fractions: vec![0.5, 1.0], ..cfg() },
            SweepConfig { fractions: vec![0.8, -1.0], ..cfg() },
        ] {
            assert!(bad.validate().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn validity_rules() {
        let cases = [
            (Some(0.50), Some(2.0), 0),
            (Some(0.85), Some(10.0), 0),
            (Some(0.86), Some(2.0), 1),
            (Some(0.50), Some(10.5), 1),
            (Some(0.99), Some(50.0), 2),
            (None, Some(1.0), 1),
            (Some(0.1), None, 1),
        ];
        for (cpu, late, n) in cases {
            assert_eq!(invalid_reasons(cpu, late).len(), n, "{cpu:?} {late:?}");
        }
        assert!(invalid_reasons(Some(0.9), None)[0].contains("CPU 90%"));
    }

    #[test]
    fn validity_rules_on_real_engines() {
        // (machine busy, engine CPU-s, wall s, cores, lateness p90, reasons)
        let cases = [
            (
                "engines take the whole machine: valid",
                Some(1.0),
                Some(200.0),
                100.0,
                2,
                Some(1.0),
                0,
            ),
            ("rest = 0.60 − 100/200 = 0.10", Some(0.60), Some(100.0), 100.0, 2, Some(1.0), 0),
            ("rest exactly at the bound", Some(0.75), Some(100.0), 100.0, 2, Some(10.0), 0),
            ("rest 0.30 > 0.25", Some(0.80), Some(100.0), 100.0, 2, Some(1.0), 1),
            ("idle engines, busy machine", Some(0.90), Some(0.0), 100.0, 2, Some(1.0), 1),
            (
                "engine ticks above the sampled busy share floor at 0",
                Some(0.40),
                Some(190.0),
                100.0,
                2,
                Some(1.0),
                0,
            ),
            ("late client", Some(0.50), Some(100.0), 100.0, 2, Some(10.5), 1),
            ("both", Some(0.99), Some(10.0), 100.0, 2, Some(50.0), 2),
            ("no CPU sample", None, Some(10.0), 100.0, 2, Some(1.0), 1),
            ("no engine CPU", Some(0.5), None, 100.0, 2, Some(1.0), 1),
            ("no wall time", Some(0.5), Some(1.0), 0.0, 2, Some(1.0), 1),
            ("nothing sent", Some(0.5), Some(100.0), 100.0, 2, None, 1),
        ];
        for (name, busy, eng, wall, cores, late, n) in cases {
            assert_eq!(
                invalid_reasons_real_engines(busy, eng, wall, cores, late).len(),
                n,
                "{name}"
            );
        }
        // The machine rule alone would call the first case invalid; this one must not.
        assert_eq!(invalid_reasons(Some(1.0), Some(1.0)).len(), 1);
        let why = invalid_reasons_real_engines(Some(0.80), Some(100.0), 100.0, 2, Some(1.0));
        assert!(why[0].contains("outside the engines 30%"), "{why:?}");
    }

    #[test]
    fn point_summary() {
        let rec = |i: u64, w: &str, ttft: f64, late: f64, status: u16| RequestRecord {
            index: i,
            scheduled_ms: i as f64 * 100.0,
            sent_ms: i as f64 * 100.0 + late,
            ttft_ms: Some(ttft),
            e2e_ms: ttft + 90.0,
            status: Some(status),
            worker: Some(w.into()),
            max_tokens: 10,
            prompt_tokens: Some(1000),
            cached_tokens: Some(250),
            output_tokens: Some(10),
            error: (status != 200).then(|| format!("HTTP {status}")),
            ..Default::default()
        };
        let recs = vec![
            rec(0, "w0", 10.0, 1.0, 200),
            rec(1, "w0", 20.0, 2.0, 200),
            rec(2, "w1", 30.0, 3.0, 200),
            rec(3, "w1", 0.0, 30.0, 503),
            rec(4, "w1", 0.0, 0.0, 500),
        ];
        let counters = PolicyCounters {
            engines: vec![EngineCounters {
                worker: "w0".into(),
                endpoint: None,
                prefix_cache_hits: 200.0,
                prefix_cache_queries: 1000.0,
                preemptions: 0.0,
            }],
            router: None,
        };
        let fleet: Vec<String> = ["w0", "w1", "w2"].iter().map(|s| s.to_string()).collect();
        let ceil = Ceiling {
            requests: 5,
            blocks_total: 10,
            blocks_reused: 4,
            tokens_total: 10,
            tokens_reused: 4,
        };
        let m = MachineSample {
            cpu_busy_mean: Some(0.5),
            cpu_busy_max: Some(0.7),
            sim_cpu_s: Some(2.0),
        };
        let p = summarize_point(
            "trace",
            "round_robin",
            2.0,
            "d",
            &recs,
            Some(&counters),
            Some((0.4, ceil)),
            m,
            &fleet,
        );
        assert_eq!((p.requests, p.ok, p.rejected, p.failed), (5, 3, 1, 1));
        assert_eq!((p.ttft_p50_ms, p.ttft_p90_ms), (Some(20.0), Some(30.0)));
        assert_eq!(p.itl_p50_ms, Some(10.0));
        assert_eq!(p.engine_hit_rate, Some(0.2));
        assert_eq!(p.usage_hit_rate, Some(0.25));
        assert!((p.hit_over_ceiling().unwrap() - 0.5).abs() < 1e-12);
        // 2000 / 1000 / 0 prompt tokens over three workers: max/mean = 2000 / 1000.
        assert_eq!(p.load_max_over_mean, Some(2.0));
        assert_eq!(p.lateness_p90_ms, Some(30.0));
        assert_eq!(p.sim_cpu_s_per_1k, Some(400.0));
        assert!(!p.valid() && p.invalid.iter().any(|r| r.contains("lateness")), "{:?}", p.invalid);
    }
}
