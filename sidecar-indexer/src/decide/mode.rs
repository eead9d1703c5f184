//! Which mode a request runs in once its decode worker is chosen: `aggregate`, conditional `disagg`
//! (a prefill leg on a prefill worker) or `migrate` (the decode worker pulls the blocks another
//! decode worker holds). Pure: the async shell ([`crate::legs`]) runs the leg the plan names and
//! turns failures into `decode_fallback` or recompute.
//!
//! The rules, in order (README "Modes"):
//! 1. `x-kvmesh-mode: aggregate` → aggregate. `disagg` / `migrate` force that mode when it is
//!    possible at all (a prefill worker exists / some other decode worker holds more blocks and
//!    migration is `on`); otherwise the reason says why not.
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

use kvmesh_core::api::{Mode, ReasonCode};
use rand::Rng;

use super::pick::{pick, score};
use super::plan::{Leg, Opportunity, WorkerView};
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
#[derive(Debug, Clone, PartialEq)]
pub struct ModeChoice {
    pub mode: Mode,
    pub leg: Option<Leg>,
    pub opportunity: Option<Opportunity>,
    /// A continuation kept local although it was at or above `min_remote_prefill_tokens`.
    pub local_continuation: bool,
    /// Prompt tokens the decode worker does not cache.
    pub uncached_tokens: u64,
    pub reason: String,
    /// One code per clause of `reason`, in order.
    pub codes: Vec<ReasonCode>,
}

/// Chooses the mode for a request whose decode worker is `decode`; `best` is the decode-capable
/// worker holding most of the prompt (from the index), if any holds block 0.
pub fn choose_mode<R: Rng + ?Sized>(
    input: &ModeInput<'_>,
    decode: &WorkerView<'_>,
    workers: &[WorkerView<'_>],
    best: Option<(&str, u32)>,
    cfg: &RoutingConfig,
    rng: &mut R,
) -> ModeChoice {
    let f = Facts::new(input, decode, cfg);
    if input.override_mode == Some(Mode::Aggregate) {
        return f.aggregate(
            ("x-kvmesh-mode aggregate".to_owned(), vec![ReasonCode::AggregateRequested]),
            None,
            false,
        );
    }
    // Every note says why an `x-kvmesh-mode` request was not honoured.
    let mut notes: Vec<String> = Vec::new();
    if input.override_mode == Some(Mode::DecodeFallback) {
        notes.push(
            "x-kvmesh-mode decode_fallback is an outcome, not a mode to ask for; ignored"
                .to_owned(),
        );
    }
    let opportunity = migration_opportunity(input, decode, workers, best, cfg, &f, &mut notes);
    let prefill = if f.t > 0 || f.forced_disagg {
        prefill_worker(input, decode, workers, f.full_blocks, cfg, rng)
    } else {
        None
    };
    if f.forced_disagg && prefill.is_none() {
        notes.push("x-kvmesh-mode disagg: no healthy prefill worker".to_owned());
    }
    if let Some(choice) = migrate_choice(input, &f, cfg, &opportunity, prefill.is_some(), &notes) {
        return choice;
    }
    if let Some(p) = prefill.filter(|_| f.forced_disagg || (f.needs_remote(f.uncached) && !f.local))
    {
        return disagg_choice(&f, decode, p, opportunity, &notes);
    }
    aggregate_choice(&f, decode, cfg, opportunity, notes)
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
        let cached = (u64::from(decode.cached_blocks()) * bs).min(input.isl_tokens);
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

    /// An aggregate choice with this reason.
    fn aggregate(
        &self,
        (reason, codes): (String, Vec<ReasonCode>),
        opportunity: Option<Opportunity>,
        local_continuation: bool,
    ) -> ModeChoice {
        ModeChoice {
            mode: Mode::Aggregate,
            leg: None,
            opportunity,
            local_continuation,
            uncached_tokens: self.uncached,
            reason,
            codes,
        }
    }
}

/// `reason` and `code`, followed by every note (each coded `ModeRequestIgnored`).
fn with_notes(notes: &[String], reason: String, code: ReasonCode) -> (String, Vec<ReasonCode>) {
    let mut codes = vec![code];
    codes.extend(notes.iter().map(|_| ReasonCode::ModeRequestIgnored));
    if notes.is_empty() {
        (reason, codes)
    } else {
        (format!("{reason}; {}", notes.join("; ")), codes)
    }
}

/// The migration opportunity worth counting (none while migration is `off`), with a note when a
/// forced `migrate` cannot be honoured.
fn migration_opportunity(
    input: &ModeInput<'_>,
    decode: &WorkerView<'_>,
    workers: &[WorkerView<'_>],
    best: Option<(&str, u32)>,
    cfg: &RoutingConfig,
    f: &Facts,
    notes: &mut Vec<String>,
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
            KvMigration::On => {
                "x-kvmesh-mode migrate: no other decode worker holds more of the prompt".to_owned()
            }
            m => format!("x-kvmesh-mode migrate: kv_migration is {}", m.as_str()),
        });
    }
    opportunity
}

/// A `migrate` choice when migration is `on`, there is an opportunity, and neither a forced
/// `disagg` nor a disaggregation of what stays uncached after the move serves better.
fn migrate_choice(
    input: &ModeInput<'_>,
    f: &Facts,
    cfg: &RoutingConfig,
    opportunity: &Option<Opportunity>,
    has_prefill: bool,
    notes: &[String],
) -> Option<ModeChoice> {
    let (Some(o), KvMigration::On) = (opportunity, cfg.kv_migration) else {
        return None;
    };
    let left = input.isl_tokens.saturating_sub(u64::from(o.source_blocks) * f.bs);
    let disagg_serves_better = !f.forced_migrate && has_prefill && !f.local && f.needs_remote(left);
    if disagg_serves_better || f.forced_disagg {
        return None;
    }
    let reason = format!(
        "migrate: {} holds {}/{} blocks{}, {} holds {}; {} pulls {} blocks instead of recomputing",
        o.source,
        o.source_blocks,
        f.full_blocks,
        if o.from_kv_home { " (session's kv_home)" } else { "" },
        o.target,
        o.target_blocks,
        o.target,
        o.blocks_to_move()
    );
    let (reason, codes) = with_notes(notes, reason, ReasonCode::Migrate);
    Some(ModeChoice {
        mode: Mode::Migrate,
        leg: Some(Leg::MigrateFrom {
            worker: o.source.clone(),
            endpoint: o.source_endpoint.clone(),
        }),
        opportunity: opportunity.clone(),
        local_continuation: false,
        // The target computes only what the source does not hand over.
        uncached_tokens: left.min(f.uncached),
        reason,
        codes,
    })
}

/// A `disagg` choice: the prompt prefilled on `p`, decoded on `decode`.
fn disagg_choice(
    f: &Facts,
    decode: &WorkerView<'_>,
    p: &WorkerView<'_>,
    opportunity: Option<Opportunity>,
    notes: &[String],
) -> ModeChoice {
    let (why, code) = if f.forced_disagg {
        ("x-kvmesh-mode disagg".to_owned(), ReasonCode::DisaggRequested)
    } else {
        (
            format!("{} uncached tokens >= min_remote_prefill_tokens {}", f.uncached, f.t),
            ReasonCode::DisaggUncached,
        )
    };
    let reason = format!(
        "disagg: {why}; prefill on {} (overlap {}/{} blocks), decode on {}",
        p.id, p.overlap_blocks, f.full_blocks, decode.id
    );
    let (reason, codes) = with_notes(notes, reason, code);
    ModeChoice {
        mode: Mode::Disagg,
        leg: Some(Leg::PrefillOn { worker: p.id.to_owned(), endpoint: p.endpoint.to_owned() }),
        opportunity,
        local_continuation: false,
        uncached_tokens: f.uncached,
        reason,
        codes,
    }
}

/// The aggregate choice when nothing moves: why not disagg (when disaggregation is on), a `dry`
/// migration's opportunity, then the notes. A plain aggregate fleet adds nothing to the decode
/// choice's reason.
fn aggregate_choice(
    f: &Facts,
    decode: &WorkerView<'_>,
    cfg: &RoutingConfig,
    opportunity: Option<Opportunity>,
    mut notes: Vec<String>,
) -> ModeChoice {
    let (t, uncached) = (f.t, f.uncached);
    let mut parts: Vec<String> = Vec::new();
    let mut codes: Vec<ReasonCode> = Vec::new();
    if t > 0 {
        let (part, code) = if f.needs_remote(uncached) && f.local {
            (
                format!(
                    "aggregate: local continuation, {uncached} uncached tokens >= {t} stay on {}",
                    decode.id
                ),
                ReasonCode::LocalContinuation,
            )
        } else if f.needs_remote(uncached) {
            ("aggregate: no healthy prefill worker".to_owned(), ReasonCode::NoPrefillWorker)
        } else {
            (
                format!("aggregate: {uncached} uncached tokens < min_remote_prefill_tokens {t}"),
                ReasonCode::BelowPrefillThreshold,
            )
        };
        parts.push(part);
        codes.push(code);
    }
    if let (Some(o), KvMigration::Dry) = (&opportunity, cfg.kv_migration) {
        parts.push(format!(
            "dry-run migration {}->{} of {} blocks",
            o.source,
            o.target,
            o.blocks_to_move()
        ));
        codes.push(ReasonCode::MigrateDryRun);
    }
    codes.extend(notes.iter().map(|_| ReasonCode::ModeRequestIgnored));
    parts.append(&mut notes);
    let local_continuation = f.local && f.needs_remote(uncached);
    f.aggregate((parts.join("; "), codes), opportunity, local_continuation)
}

/// The migration source for `decode`, if another healthy decode worker holds more of the prompt
/// (by the index) or is the session's remembered home while the index shows nothing better.
fn migration_source(
    input: &ModeInput<'_>,
    decode: &WorkerView<'_>,
    workers: &[WorkerView<'_>],
    best: Option<(&str, u32)>,
    full_blocks: u32,
) -> Option<Opportunity> {
    let healthy_decoder =
        |id: &str| workers.iter().find(|w| w.id == id && w.healthy && w.role.decodes());
    let make = |w: &WorkerView<'_>, source_blocks: u32, from_kv_home: bool| Opportunity {
        source: w.id.to_owned(),
        source_endpoint: w.endpoint.to_owned(),
        target: decode.id.to_owned(),
        source_blocks,
        target_blocks: decode.overlap_blocks,
        from_kv_home,
    };
    if let Some((id, blocks)) =
        best.filter(|(id, blocks)| *id != decode.id && *blocks > decode.overlap_blocks)
    {
        return healthy_decoder(id).map(|w| make(w, blocks, false));
    }
    let home = healthy_decoder(input.kv_home.filter(|h| *h != decode.id)?)?;
    (home.overlap_blocks <= decode.overlap_blocks).then(|| make(home, full_blocks, true))
}

/// The prefill worker for a remote prefill: the healthy prefill-capable worker other than the
/// decode worker with the lowest predicted prefill time, as for decode choices (its overlap, the
/// legs queued on it, its throughput; near ties at random).
fn prefill_worker<'a, 'b, R: Rng + ?Sized>(
    input: &ModeInput<'_>,
    decode: &WorkerView<'_>,
    workers: &'b [WorkerView<'a>],
    full_blocks: u32,
    cfg: &RoutingConfig,
    rng: &mut R,
) -> Option<&'b WorkerView<'a>> {
    let set: Vec<_> = workers
        .iter()
        .filter(|w| w.healthy && w.role.prefills() && w.id != decode.id)
        .map(|w| score(w, input.isl_tokens, input.block_size, 0, cfg))
        .collect();
    if set.is_empty() {
        return None;
    }
    Some(pick(&set, full_blocks, None, cfg, rng).0.w)
}

#[cfg(test)]
#[path = "mode_tests.rs"]
mod tests;
