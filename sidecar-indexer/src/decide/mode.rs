//! Stage: the mode, once the decode worker is chosen: `aggregate`, conditional `disagg` (a prefill
//! leg on a prefill worker) or `migrate` (the decode worker pulls the blocks another decode worker
//! holds). Pure: the async shell ([`crate::legs`]) runs the leg the plan names and turns failures
//! into `decode_fallback` or recompute. Returns a typed [`ModeReason`] and the notes on any
//! `x-kvmesh-mode` it could not honour; [`super::reason::render`] words them.
//!
//! The rules, in order (README "Modes"):
//! 1. `x-kvmesh-mode: aggregate` → aggregate. `disagg` / `migrate` force that mode when it is
//!    possible at all (a prefill worker exists / some other decode worker holds more blocks and
//!    migration is `on`); otherwise a note says why not.
//! 2. Migration opportunity: the worker holding most of the prompt (`best_overlap_worker`), or the
//!    session's last home when the index knows nothing better (`kv_home`, the index may lag), is
//!    not the chosen worker and the blocks to move reach `kv_migration_min_tokens`. `dry` counts it
//!    and sends nothing. `on` migrates, unless what stays uncached after the move still needs a
//!    remote prefill: then disaggregation (which recomputes the whole prompt on the prefill worker,
//!    KV-aware) serves better, and migration only counts the opportunity.
//! 3. Disaggregation: `min_remote_prefill_tokens = T > 0`, a healthy prefill-capable worker other
//!    than the decode worker, uncached tokens on the decode worker ≥ T, and not a local
//!    continuation (a session seen recently stays on its decode worker whatever its length).
//! 4. Otherwise aggregate.

use kvmesh_core::api::Mode;
use rand::Rng;

use super::pick::pick;
use super::plan::{Leg, Opportunity, WorkerView};
use super::reason::{ModeNote, ModeReason, Threshold};
use super::score::score;
use crate::config::{KvMigration, RoutingConfig};

/// What the mode choice needs besides the workers.
#[derive(Debug, Clone, PartialEq)]
pub struct ModeInput<'a> {
    pub isl_tokens: u64,
    pub block_size: u32,
    /// The session was routed within the local-continuation TTL.
    pub continuation: bool,
    /// The session's last decode worker, if remembered.
    pub kv_home: Option<&'a str>,
    pub override_mode: Option<Mode>,
}

/// The mode part of a plan.
pub(crate) struct ModeChoice<'v, 'a> {
    pub mode: Mode,
    pub leg: Option<Leg>,
    pub opportunity: Option<Opportunity>,
    /// A continuation kept local although it was at or above `min_remote_prefill_tokens`.
    pub local_continuation: bool,
    /// Prompt tokens the decode worker does not cache.
    pub uncached_tokens: u64,
    pub reason: ModeReason<'v, 'a>,
    /// Why an `x-kvmesh-mode` request was not honoured, in the order found.
    pub notes: Vec<ModeNote>,
}

/// Chooses the mode for a request whose decode worker is view `decode` of `workers`; `best` is the
/// view index and blocks of the decode-capable worker holding most of the prompt (by the index),
/// if any holds block 0.
pub(crate) fn choose_mode<'v, 'a, R: Rng + ?Sized>(
    input: &ModeInput<'_>,
    decode: usize,
    workers: &'v [WorkerView<'a>],
    best: Option<(usize, u32)>,
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Option<ModeChoice<'v, 'a>> {
    let d = workers.get(decode)?;
    let f = Facts::new(input, d, cfg);
    if input.override_mode == Some(Mode::Aggregate) {
        return Some(f.aggregate(ModeReason::AggregateRequested, None, false, Vec::new()));
    }
    let mut notes: Vec<ModeNote> = Vec::new();
    if input.override_mode == Some(Mode::DecodeFallback) {
        notes.push(ModeNote::DecodeFallbackAsked);
    }
    let opportunity = migration_opportunity(input, decode, workers, best, cfg, &f, &mut notes);
    let prefill = if f.t > 0 || f.forced_disagg {
        prefill_worker(input, decode, workers, cfg, rng)
    } else {
        None
    };
    if f.forced_disagg && prefill.is_none() {
        notes.push(ModeNote::NoPrefillWorker);
    }
    if let Some(choice) = migrate_choice(input, &f, cfg, &opportunity, prefill.is_some(), &notes) {
        return Some(choice);
    }
    if let Some(p) = prefill.filter(|_| f.forced_disagg || (f.needs_remote(f.uncached) && !f.local))
    {
        return Some(disagg_choice(&f, d, p, opportunity, notes));
    }
    Some(aggregate_choice(&f, d, cfg, opportunity, notes))
}

/// What every step of the mode choice reads: the prompt's size against the decode worker's cache,
/// the disaggregation threshold and the request's overrides.
struct Facts {
    /// Tokens per block (at least 1).
    bs: u64,
    /// Prompt tokens the decode worker does not cache.
    uncached: u64,
    /// The prompt's full blocks.
    full_blocks: u32,
    /// `min_remote_prefill_tokens` (0: disaggregation off).
    t: u64,
    /// A continuation that stays on its decode worker.
    local: bool,
    forced_migrate: bool,
    forced_disagg: bool,
}

impl Facts {
    fn new(input: &ModeInput<'_>, decode: &WorkerView<'_>, cfg: &RoutingConfig) -> Self {
        let bs = u64::from(input.block_size.max(1));
        // Blocks loaded from a lower tier are not computed either.
        let gpu = decode.cached_blocks();
        let local =
            u64::from(gpu) + u64::from(super::score::loaded_blocks(decode, gpu, cfg).total());
        let cached = (local * bs).min(input.isl_tokens);
        Facts {
            bs,
            uncached: input.isl_tokens - cached,
            full_blocks: kvmesh_core::router_metrics::isl_blocks(
                usize::try_from(input.isl_tokens).unwrap_or(usize::MAX),
                input.block_size,
            ),
            t: cfg.min_remote_prefill_tokens,
            local: cfg.local_continuations && input.continuation,
            forced_migrate: input.override_mode == Some(Mode::Migrate),
            forced_disagg: input.override_mode == Some(Mode::Disagg),
        }
    }

    /// Whether `uncached` tokens reach the remote-prefill threshold.
    fn needs_remote(&self, uncached: u64) -> bool {
        self.t > 0 && uncached >= self.t
    }

    /// An aggregate choice for this reason.
    fn aggregate<'v, 'a>(
        &self,
        reason: ModeReason<'v, 'a>,
        opportunity: Option<Opportunity>,
        local_continuation: bool,
        notes: Vec<ModeNote>,
    ) -> ModeChoice<'v, 'a> {
        ModeChoice {
            mode: Mode::Aggregate,
            leg: None,
            opportunity,
            local_continuation,
            uncached_tokens: self.uncached,
            reason,
            notes,
        }
    }
}

/// The migration opportunity worth counting (none while migration is `off`), with a note when a
/// forced `migrate` cannot be honoured.
fn migration_opportunity(
    input: &ModeInput<'_>,
    decode: usize,
    workers: &[WorkerView<'_>],
    best: Option<(usize, u32)>,
    cfg: &RoutingConfig,
    f: &Facts,
    notes: &mut Vec<ModeNote>,
) -> Option<Opportunity> {
    let opportunity = (cfg.kv_migration != KvMigration::Off)
        .then(|| migration_source(input, decode, workers, best, f.full_blocks))
        .flatten();
    let worth_moving =
        |o: &Opportunity| u64::from(o.blocks_to_move()) * f.bs >= cfg.kv_migration_min_tokens;
    let opportunity =
        opportunity.filter(|o| o.blocks_to_move() > 0 && (f.forced_migrate || worth_moving(o)));
    if f.forced_migrate && (cfg.kv_migration != KvMigration::On || opportunity.is_none()) {
        notes.push(match cfg.kv_migration {
            KvMigration::On => ModeNote::NothingToMigrate,
            m => ModeNote::MigrationNotOn(m),
        });
    }
    opportunity
}

/// A `migrate` choice when migration is `on`, there is an opportunity, and neither a forced
/// `disagg` nor a disaggregation of what stays uncached after the move serves better.
fn migrate_choice<'v, 'a>(
    input: &ModeInput<'_>,
    f: &Facts,
    cfg: &RoutingConfig,
    opportunity: &Option<Opportunity>,
    has_prefill: bool,
    notes: &[ModeNote],
) -> Option<ModeChoice<'v, 'a>> {
    let (Some(o), KvMigration::On) = (opportunity, cfg.kv_migration) else {
        return None;
    };
    let left = input.isl_tokens.saturating_sub(u64::from(o.source_blocks) * f.bs);
    let disagg_serves_better = !f.forced_migrate && has_prefill && !f.local && f.needs_remote(left);
    if disagg_serves_better || f.forced_disagg {
        return None;
    }
    Some(ModeChoice {
        mode: Mode::Migrate,
        leg: Some(Leg::MigrateFrom {
            worker: o.source.clone(),
            endpoint: o.source_endpoint.clone(),
        }),
        opportunity: Some(o.clone()),
        local_continuation: false,
        // The target computes only what the source does not hand over.
        uncached_tokens: left.min(f.uncached),
        reason: ModeReason::Migrate(o.clone()),
        notes: notes.to_vec(),
    })
}

/// A `disagg` choice: the prompt prefilled on `p`, decoded on `decode`.
fn disagg_choice<'v, 'a>(
    f: &Facts,
    decode: &'v WorkerView<'a>,
    p: &'v WorkerView<'a>,
    opportunity: Option<Opportunity>,
    notes: Vec<ModeNote>,
) -> ModeChoice<'v, 'a> {
    ModeChoice {
        mode: Mode::Disagg,
        leg: Some(Leg::PrefillOn { worker: p.id.to_owned(), endpoint: p.endpoint.to_owned() }),
        opportunity,
        local_continuation: false,
        uncached_tokens: f.uncached,
        reason: ModeReason::Disagg {
            requested: f.forced_disagg,
            uncached: f.uncached,
            threshold: f.t,
            prefill: p,
            decode,
        },
        notes,
    }
}

/// The aggregate choice when nothing moves: why not disagg (when disaggregation is on) and a `dry`
/// migration's opportunity. A plain aggregate fleet adds nothing to the decode choice's reason.
fn aggregate_choice<'v, 'a>(
    f: &Facts,
    decode: &'v WorkerView<'a>,
    cfg: &RoutingConfig,
    opportunity: Option<Opportunity>,
    notes: Vec<ModeNote>,
) -> ModeChoice<'v, 'a> {
    let (t, uncached) = (f.t, f.uncached);
    let threshold = (t > 0).then(|| {
        if f.needs_remote(uncached) && f.local {
            Threshold::LocalContinuation { uncached, threshold: t, decode: decode.id }
        } else if f.needs_remote(uncached) {
            Threshold::NoPrefillWorker
        } else {
            Threshold::Below { uncached, threshold: t }
        }
    });
    let dry_run = opportunity.clone().filter(|_| cfg.kv_migration == KvMigration::Dry);
    let local_continuation = f.local && f.needs_remote(uncached);
    f.aggregate(
        ModeReason::Aggregate { threshold, dry_run },
        opportunity,
        local_continuation,
        notes,
    )
}

/// The migration source for view `decode`, if another healthy decode worker holds more of the
/// prompt (by the index) or is the session's remembered home while the index shows nothing better.
fn migration_source(
    input: &ModeInput<'_>,
    decode: usize,
    workers: &[WorkerView<'_>],
    best: Option<(usize, u32)>,
    full_blocks: u32,
) -> Option<Opportunity> {
    let d = workers.get(decode)?;
    let healthy_decoder = |w: &&WorkerView<'_>| w.healthy && w.role.decodes();
    let make = |w: &WorkerView<'_>, source_blocks: u32, from_kv_home: bool| Opportunity {
        source: w.id.to_owned(),
        source_endpoint: w.endpoint.to_owned(),
        target: d.id.to_owned(),
        source_blocks,
        target_blocks: d.overlap_blocks,
        from_kv_home,
    };
    if let Some((at, blocks)) =
        best.filter(|&(at, blocks)| at != decode && blocks > d.overlap_blocks)
    {
        return workers.get(at).filter(healthy_decoder).map(|w| make(w, blocks, false));
    }
    // `kv_home` is an id this replica remembered: the one lookup by id, from outside the views.
    let home_id = input.kv_home.filter(|h| *h != d.id)?;
    let home = workers.iter().filter(healthy_decoder).find(|w| w.id == home_id)?;
    (home.overlap_blocks <= d.overlap_blocks).then(|| make(home, full_blocks, true))
}

/// The prefill worker for a remote prefill: the healthy prefill-capable worker other than the
/// decode worker with the lowest predicted prefill time, as for decode choices (its overlap, the
/// legs queued on it, its throughput; near ties at random).
fn prefill_worker<'v, 'a, R: Rng + ?Sized>(
    input: &ModeInput<'_>,
    decode: usize,
    workers: &'v [WorkerView<'a>],
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Option<&'v WorkerView<'a>> {
    let set: Vec<_> = workers
        .iter()
        .enumerate()
        .filter(|&(at, w)| w.healthy && w.role.prefills() && at != decode)
        .map(|(at, w)| score(at, w, input.isl_tokens, input.block_size, 0, cfg))
        .collect();
    if set.is_empty() {
        return None;
    }
    Some(pick(&set, None, cfg, rng).chosen.w)
}

#[cfg(test)]
#[path = "mode_tests.rs"]
mod tests;
