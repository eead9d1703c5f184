//! Why a decision came out as it did: the typed reason every stage returns, and [`render`], the
//! one place those become the wire's `reason` prose and `reason_codes`.
//!
//! Each clause's text and its code come from the same match arm, so the prose and the codes cannot
//! drift apart; the README's "Decision reasons" table lists every clause (a test checks that it
//! names every code). The prose is short and ASCII: it travels in a 256-byte debug header.

use kvmesh_core::api::ReasonCode;
use kvmesh_core::session::SessionSource;

use super::plan::{Basis, Opportunity, WorkerView};
use super::score::{Overload, Scored};
use crate::config::KvMigration;

/// Why the decode worker was chosen: the qualifiers in the order they applied, then the choice.
pub(crate) struct WorkerReason<'v, 'a> {
    /// `x-kvmesh-worker` named a worker that gets no traffic.
    pub override_ignored: Option<IgnoredOverride<'a>>,
    /// The request has a session but no home (new, forgotten, or its home left the fleet).
    pub new_session: bool,
    /// The balance stage kept workers off, or yielded to them.
    pub balance: Option<BalanceNote<'a>>,
    pub choice: Choice<'v, 'a>,
}

/// An `x-kvmesh-worker` that was not honoured, and why.
pub(crate) struct IgnoredOverride<'a> {
    pub worker: &'a str,
    /// Healthy, but its role does not decode.
    pub healthy: bool,
}

/// The choice itself: one variant per [`Basis`].
pub(crate) enum Choice<'v, 'a> {
    /// `x-kvmesh-worker` named a candidate.
    Override(Scored<'v, 'a>),
    /// The session stayed home; the best other worker it was weighed against, if any, and the
    /// guard home is over when it stayed because every worker within the guards costs more.
    SessionPin {
        home: Scored<'v, 'a>,
        source: SessionSource,
        best_other: Option<Scored<'v, 'a>>,
        overload: Option<Overload>,
    },
    /// Another worker was cheaper than the session's home by more than the margin.
    SessionMoved { home: Scored<'v, 'a>, to: Scored<'v, 'a>, source: SessionSource, margin_s: f64 },
    /// The session's home is over a guard and the draw among the others is cheaper.
    PinOverloaded { home: &'v WorkerView<'a>, overload: Option<Overload>, draw: Draw<'v, 'a> },
    /// The draw's worker holds the most of the prompt.
    BestOverlap(Draw<'v, 'a>),
    /// The draw's worker is the cheapest without holding the most.
    LowestCost(Draw<'v, 'a>),
}

impl<'v, 'a> Choice<'v, 'a> {
    /// The chosen worker.
    pub(crate) fn chosen(&self) -> Scored<'v, 'a> {
        match self {
            Self::Override(s) | Self::SessionPin { home: s, .. } => *s,
            Self::SessionMoved { to, .. } => *to,
            Self::PinOverloaded { draw, .. } | Self::BestOverlap(draw) | Self::LowestCost(draw) => {
                draw.chosen
            }
        }
    }

    /// The `basis` label and reason code of this choice.
    pub(crate) fn basis(&self) -> Basis {
        match self {
            Self::Override(_) => ReasonCode::Override,
            Self::SessionPin { .. } => ReasonCode::SessionPin,
            Self::SessionMoved { .. } => ReasonCode::SessionMoved,
            Self::PinOverloaded { .. } => ReasonCode::PinOverloaded,
            Self::BestOverlap(_) => ReasonCode::BestOverlap,
            Self::LowestCost(_) => ReasonCode::LowestCost,
        }
    }
}

/// What the near-tie draw ([`super::pick::pick`]) chose and what it saw.
#[derive(Clone, Copy)]
pub(crate) struct Draw<'v, 'a> {
    pub chosen: Scored<'v, 'a>,
    /// `Some(temperature)` when the worker was sampled rather than drawn from the near-tie band.
    pub sampled_at: Option<f64>,
    pub holding: Holding,
    /// The cheapest other worker of the set (the reason's `; next …`).
    pub runner_up: Option<Scored<'v, 'a>>,
}

/// What the chosen worker holds of the prompt, against the best of the set it was drawn from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Holding {
    /// It would pull this many blocks by KV migration.
    Migrating(u32),
    /// No worker of the set holds block 0.
    NothingCached,
    /// It holds the most (this many blocks).
    BestOverlap(u32),
    /// It holds `cached`, another worker `best_elsewhere`.
    Overlap { cached: u32, best_elsewhere: u32 },
}

/// What the balance stage did: workers kept off, and workers over their share that stayed because
/// keeping the request off them would cost more than the yield.
pub(crate) struct BalanceNote<'a> {
    pub kept_off: Vec<Share<'a>>,
    pub yielded: Vec<(Share<'a>, f64)>,
}

/// A worker's recent load as a multiple of the fleet's mean.
pub(crate) struct Share<'a> {
    pub worker: &'a str,
    pub of_mean: f64,
}

/// Why the mode is what it is.
pub(crate) enum ModeReason<'v, 'a> {
    /// `x-kvmesh-mode: aggregate`.
    AggregateRequested,
    /// The decode worker pulls the blocks the opportunity's source holds.
    Migrate(Opportunity),
    /// A prefill leg on `prefill`; `requested` by `x-kvmesh-mode: disagg`, else by the threshold.
    Disagg {
        requested: bool,
        uncached: u64,
        threshold: u64,
        prefill: &'v WorkerView<'a>,
        decode: &'v WorkerView<'a>,
    },
    /// Nothing moves: why not disaggregated (when disaggregation is on), and a dry-run migration.
    Aggregate { threshold: Option<Threshold<'a>>, dry_run: Option<Opportunity> },
}

/// Why an aggregate request with disaggregation on has no prefill leg.
pub(crate) enum Threshold<'a> {
    /// A recent session stays on its decode worker whatever its length.
    LocalContinuation { uncached: u64, threshold: u64, decode: &'a str },
    /// Above the threshold, but no prefill worker.
    NoPrefillWorker,
    /// Below the threshold.
    Below { uncached: u64, threshold: u64 },
}

/// Why an `x-kvmesh-mode` request was not honoured (code `mode_request_ignored` each).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ModeNote {
    /// `decode_fallback` is an outcome, not a mode.
    DecodeFallbackAsked,
    /// `migrate` asked for, but `kv_migration` is not `on`.
    MigrationNotOn(KvMigration),
    /// `migrate` asked for, but no other decode worker holds more of the prompt.
    NothingToMigrate,
    /// `disagg` asked for, but no healthy prefill worker.
    NoPrefillWorker,
}

/// The wire `reason` and `reason_codes` of a decision for a prompt of `full_blocks` blocks: the
/// worker's clauses, then the mode's (a plain aggregate fleet adds none), then its notes.
pub(crate) fn render(
    full_blocks: u32,
    worker: &WorkerReason<'_, '_>,
    mode: &ModeReason<'_, '_>,
    notes: &[ModeNote],
) -> (String, Vec<ReasonCode>) {
    let (mut text, mut codes) = worker_clauses(full_blocks, worker);
    let (mode_text, mode_codes) = mode_clauses(full_blocks, mode, notes);
    if !mode_text.is_empty() {
        text = format!("{text}; {mode_text}");
    }
    codes.extend(mode_codes);
    (text, codes)
}

/// The worker part: `override w2 ignored (unhealthy); new session: balanced (…): <choice>`.
fn worker_clauses(full_blocks: u32, r: &WorkerReason<'_, '_>) -> (String, Vec<ReasonCode>) {
    let mut prefix = String::new();
    let mut codes = Vec::new();
    if let Some(o) = &r.override_ignored {
        let why = if o.healthy { "cannot decode" } else { "unhealthy" };
        prefix = format!("override {} ignored ({why}); ", o.worker);
        codes.push(ReasonCode::OverrideIgnored);
    }
    if r.new_session {
        prefix.push_str("new session: ");
        codes.push(ReasonCode::NewSession);
    }
    if let Some(b) = &r.balance {
        if !b.kept_off.is_empty() {
            codes.push(ReasonCode::Balanced);
        }
        prefix = format!("{prefix}{}: ", balance_note(b));
    }
    codes.push(r.choice.basis());
    (format!("{prefix}{}", choice_clause(full_blocks, &r.choice)), codes)
}

fn choice_clause(isl: u32, choice: &Choice<'_, '_>) -> String {
    match choice {
        Choice::Override(s) => format!(
            "override x-kvmesh-worker {}: overlap {}/{isl} blocks{}, predicted {:.1} ms",
            s.w.id,
            s.w.overlap_blocks,
            tier_note(s),
            s.ms()
        ),
        Choice::SessionPin { home, source, best_other, overload } => {
            let other = best_other.map_or(String::new(), |o| {
                format!(" (best other {} {:.1} ms{})", o.w.id, o.ms(), cost_note(&o))
            });
            let over = overload.map_or(String::new(), |o| format!(", overloaded ({o}) but cheapest"));
            format!(
                "session pin {} (source={}{over}): overlap {}/{isl} blocks{}, predicted {:.1} ms{}{other}",
                home.w.id,
                source.as_str(),
                home.w.overlap_blocks,
                tier_note(home),
                home.ms(),
                cost_note(home)
            )
        }
        Choice::SessionMoved { home, to, source, margin_s } => format!(
            "session moved from {} (source={}): predicted {:.1} ms there{} {}, {} {:.1} ms{} (margin {:.1} ms); overlap {}/{isl} blocks{}",
            home.w.id,
            source.as_str(),
            home.ms(),
            cost_note(home),
            load_note(home),
            to.w.id,
            to.ms(),
            cost_note(to),
            margin_s * 1000.0,
            to.w.overlap_blocks,
            migrated_note(to)
        ),
        Choice::PinOverloaded { home, overload, draw } => format!(
            "home {} overloaded ({}); chose {}: {}",
            home.id,
            overload.map_or(String::new(), |o| o.to_string()),
            draw.chosen.w.id,
            draw_clause(isl, draw)
        ),
        Choice::BestOverlap(draw) | Choice::LowestCost(draw) => {
            let next = draw.runner_up.map_or(String::new(), |o| {
                format!("; next {} {:.1} ms{}", o.w.id, o.ms(), cost_note(&o))
            });
            format!("{}{next}", draw_clause(isl, draw))
        }
    }
}

/// `sampled at temperature 0.5: best overlap 31/40 blocks (+2 speculative), predicted 14.4 ms
/// after 300 queued tokens, cost 20.1 ms`.
/// ` (+12 from cpu) (+3 from disk)`: the blocks `s` loads from lower KV tiers, if any.
fn tier_note(s: &Scored<'_, '_>) -> String {
    [(s.loaded.cpu, "cpu"), (s.loaded.disk, "disk")]
        .into_iter()
        .filter(|(blocks, _)| *blocks > 0)
        .map(|(blocks, tier)| format!(" (+{blocks} from {tier})"))
        .collect()
}

fn draw_clause(isl: u32, d: &Draw<'_, '_>) -> String {
    let s = &d.chosen;
    let temp = d.sampled_at.map_or(String::new(), |t| format!("sampled at temperature {t}: "));
    let what = match d.holding {
        Holding::Migrating(blocks) => format!("migrating {blocks} blocks"),
        Holding::NothingCached => "nothing cached".to_owned(),
        Holding::BestOverlap(cached) => format!("best overlap {cached}/{isl} blocks"),
        Holding::Overlap { cached, best_elsewhere } => {
            format!("overlap {cached}/{isl} blocks (best elsewhere {best_elsewhere})")
        }
    };
    let spec = if s.w.speculative_blocks > s.w.overlap_blocks {
        format!(" (+{} speculative)", s.w.speculative_blocks - s.w.overlap_blocks)
    } else {
        String::new()
    };
    let spec = format!("{spec}{}", tier_note(s));
    let queued = s.w.timing.queued_tokens.round();
    let queued =
        if queued > 0.0 { format!(" after {queued} queued tokens") } else { String::new() };
    format!("{temp}{what}{spec}, predicted {:.1} ms{queued}{}", s.ms(), cost_note(s))
}

/// `balanced (w1 1.42x mean)`, `balance yields (w2 1.31x mean saves 812 ms)`, or both.
fn balance_note(b: &BalanceNote<'_>) -> String {
    let share = |s: &Share<'_>| format!("{} {:.2}x mean", s.worker, s.of_mean);
    let mut notes = Vec::new();
    if !b.kept_off.is_empty() {
        let off: Vec<String> = b.kept_off.iter().map(share).collect();
        notes.push(format!("balanced ({})", off.join(", ")));
    }
    if !b.yielded.is_empty() {
        let yielded: Vec<String> = b
            .yielded
            .iter()
            .map(|(s, saving_s)| format!("{} saves {:.0} ms", share(s), saving_s * 1000.0))
            .collect();
        notes.push(format!("balance yields ({})", yielded.join(", ")));
    }
    notes.join(", ")
}

/// `, cost 812.0 ms` when the cost is above the predicted TTFT by what one decimal shows.
fn cost_note(s: &Scored<'_, '_>) -> String {
    let cost_ms = s.cost_s * 1000.0;
    if cost_ms - s.ms() >= 0.05 {
        format!(", cost {cost_ms:.1} ms")
    } else {
        String::new()
    }
}

/// What a prediction rests on, compactly.
fn load_note(s: &Scored<'_, '_>) -> String {
    let t = &s.w.timing;
    format!(
        "[{:.0} queued + {} own tokens at {:.0} tok/s, batch {}]",
        t.queued_tokens, s.own_tokens, t.prefill_tokens_per_s, t.decode_batch
    )
}

fn migrated_note(s: &Scored<'_, '_>) -> String {
    if s.migrated_blocks > 0 {
        format!(", {} blocks migrated", s.migrated_blocks)
    } else {
        String::new()
    }
}

/// The mode part, clauses joined by `; ` (empty for a plain aggregate fleet), one code each.
pub(crate) fn mode_clauses(
    full_blocks: u32,
    mode: &ModeReason<'_, '_>,
    notes: &[ModeNote],
) -> (String, Vec<ReasonCode>) {
    let mut clauses: Vec<(String, ReasonCode)> = Vec::new();
    match mode {
        ModeReason::AggregateRequested => {
            clauses.push(("x-kvmesh-mode aggregate".to_owned(), ReasonCode::AggregateRequested));
        }
        ModeReason::Migrate(o) => {
            clauses.push((migrate_clause(full_blocks, o), ReasonCode::Migrate))
        }
        ModeReason::Disagg { requested, uncached, threshold, prefill, decode } => {
            let (why, code) = if *requested {
                ("x-kvmesh-mode disagg".to_owned(), ReasonCode::DisaggRequested)
            } else {
                (
                    format!("{uncached} uncached tokens >= min_remote_prefill_tokens {threshold}"),
                    ReasonCode::DisaggUncached,
                )
            };
            let text = format!(
                "disagg: {why}; prefill on {} (overlap {}/{full_blocks} blocks), decode on {}",
                prefill.id, prefill.overlap_blocks, decode.id
            );
            clauses.push((text, code));
        }
        ModeReason::Aggregate { threshold, dry_run } => {
            clauses.extend(threshold.as_ref().map(threshold_clause));
            clauses.extend(dry_run.as_ref().map(|o| {
                let text = format!(
                    "dry-run migration {}->{} of {} blocks",
                    o.source,
                    o.target,
                    o.blocks_to_move()
                );
                (text, ReasonCode::MigrateDryRun)
            }));
        }
    }
    clauses.extend(notes.iter().map(|n| (note_clause(*n), ReasonCode::ModeRequestIgnored)));
    let text: Vec<&str> = clauses.iter().map(|(t, _)| t.as_str()).collect();
    (text.join("; "), clauses.iter().map(|(_, c)| *c).collect())
}

fn migrate_clause(full_blocks: u32, o: &Opportunity) -> String {
    format!(
        "migrate: {} holds {}/{full_blocks} blocks{}, {} holds {}; {} pulls {} blocks instead of recomputing",
        o.source,
        o.source_blocks,
        if o.from_kv_home { " (session's kv_home)" } else { "" },
        o.target,
        o.target_blocks,
        o.target,
        o.blocks_to_move()
    )
}

fn threshold_clause(t: &Threshold<'_>) -> (String, ReasonCode) {
    match t {
        Threshold::LocalContinuation { uncached, threshold, decode } => (
            format!(
                "aggregate: local continuation, {uncached} uncached tokens >= {threshold} stay on {decode}"
            ),
            ReasonCode::LocalContinuation,
        ),
        Threshold::NoPrefillWorker => {
            ("aggregate: no healthy prefill worker".to_owned(), ReasonCode::NoPrefillWorker)
        }
        Threshold::Below { uncached, threshold } => (
            format!("aggregate: {uncached} uncached tokens < min_remote_prefill_tokens {threshold}"),
            ReasonCode::BelowPrefillThreshold,
        ),
    }
}

fn note_clause(note: ModeNote) -> String {
    match note {
        ModeNote::DecodeFallbackAsked => {
            "x-kvmesh-mode decode_fallback is an outcome, not a mode to ask for; ignored".to_owned()
        }
        ModeNote::MigrationNotOn(m) => {
            format!("x-kvmesh-mode migrate: kv_migration is {}", m.as_str())
        }
        ModeNote::NothingToMigrate => {
            "x-kvmesh-mode migrate: no other decode worker holds more of the prompt".to_owned()
        }
        ModeNote::NoPrefillWorker => "x-kvmesh-mode disagg: no healthy prefill worker".to_owned(),
    }
}
