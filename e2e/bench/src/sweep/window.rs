//! When a point's requests count (the steady-state warm-up and window) and the figures counted
//! over them: the ceiling with history, the fleet-LRU estimate, the TTFT floor.

use super::timing::FleetTiming;
use crate::ceiling::Ceiling;
use crate::record::RequestRecord;
use crate::stats::percentile;
use crate::workload::{
    ceiling_with_history, fleet_lru, per_prompt_ceiling, scheduled_prompts, sent_prompts, Content,
    Schedule, Segments, SentPrompt, WorkloadKind,
};
use serde::{Deserialize, Serialize};

/// vllm-sim's default inter-token latency (`--itl-ms`), modelled ms per decode step at a small batch.
pub const SIM_DEFAULT_ITL_MS: f64 = 20.0;
/// Sessions of the reference schedule [`default_warmup_s`] measures (arrivals at 1/s over this many s).
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
/// engines by default, `--warmup-s 0`), keep the plain point: arrivals over `window_s`,
/// every request counted, turns until 1.5 × `window_s`; `steady` still has the ceiling counted
/// over the prompts actually sent ([`point_ceiling`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MeasureWindow {
    /// Arrivals before the window, s (0: none).
    pub warmup_s: f64,
    /// The measured window, s (`--duration-s`).
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
/// planned turn are skipped and counted). Otherwise the schedule's own ceiling.
pub fn point_ceiling(
    schedule: &Schedule,
    records: &[RequestRecord],
    w: &MeasureWindow,
    block_size: usize,
) -> (f64, Ceiling, usize) {
    if !w.steady {
        return (schedule.ceiling_rate(), schedule.ceiling, 0);
    }
    let (sent, skipped) = sent_of(records, w);
    let (c, unknown) = ceiling_with_history(&schedule.sessions, &sent, block_size);
    (c.token_rate(), c, skipped + unknown)
}

/// The point's fleet-LRU reference, token-weighted (`workload::fleet_lru`): the same prompts as
/// [`point_ceiling`]'s, in the same order, through one LRU cache of `capacity_tokens` (the fleet's
/// blocks × block size). `None` for chat schedules and for an empty point.
pub fn point_fleet_lru(
    schedule: &Schedule,
    records: &[RequestRecord],
    w: &MeasureWindow,
    block_size: usize,
    capacity_tokens: u64,
) -> Option<f64> {
    let prompts = token_prompts(schedule, records, w, block_size)?;
    let c = fleet_lru(prompts.iter().map(|(p, counted)| (p, *counted)), capacity_tokens);
    (c.tokens_total > 0).then(|| c.token_rate())
}

/// The point's TTFT floor, p90 in wall-clock ms: each counted prompt's uncached tokens on an engine
/// holding everything the ceiling counts as reused (`workload::per_prompt_ceiling`), prefilled
/// alone at `t.prefill_tokens_per_s` and divided by the speed-up — no queue, no other request's
/// prefill, so no router can give the point's p90 less. `None` for chat schedules and an empty point.
pub fn point_ttft_floor_p90_ms(
    schedule: &Schedule,
    records: &[RequestRecord],
    w: &MeasureWindow,
    block_size: usize,
    t: &FleetTiming,
) -> Option<f64> {
    let prompts = token_prompts(schedule, records, w, block_size)?;
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
pub(super) fn token_prompts(
    schedule: &Schedule,
    records: &[RequestRecord],
    w: &MeasureWindow,
    block_size: usize,
) -> Option<Vec<(Segments, bool)>> {
    if !schedule.sessions.iter().all(|s| matches!(s.content, Content::Tokens(_))) {
        return None;
    }
    Some(if w.steady {
        sent_prompts(&schedule.sessions, &sent_of(records, w).0, block_size).0
    } else {
        scheduled_prompts(&schedule.sessions, block_size).into_iter().map(|p| (p, true)).collect()
    })
}

/// The records as sent prompts (counted when scheduled in the window), and how many name no
/// session or turn.
pub(super) fn sent_of<'a>(
    records: &'a [RequestRecord],
    w: &MeasureWindow,
) -> (Vec<SentPrompt<'a>>, usize) {
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
/// time of a reference schedule (think times ÷ the speed-up, plus each turn's `max_tokens` decode
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
    let schedule = match kind {
        WorkloadKind::Agentic => crate::workload::gen::agentic(&g, 1.0),
        WorkloadKind::Models => crate::workload::models::models(&g, 1.0),
        _ => crate::workload::gen::paced(&g, 1.0),
    };
    let per_token = SIM_DEFAULT_ITL_MS / t.sim_speedup;
    let mut w = 0.0;
    while w < MAX_WARMUP_S
        && crate::workload::population_share_at(&schedule.sessions, per_token, w * 1000.0)
            < WARMUP_POPULATION_SHARE
    {
        w += 1.0;
    }
    w
}

/// A point's window: `--warmup-s` (`warmup_override`) or [`default_warmup_s`] for the
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
