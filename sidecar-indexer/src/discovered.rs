//! Discovered workers → the indexer's effective fleet: pure, no I/O, no clock.
//!
//! The fleet file stays the source of the static `[[workers]]` and of every knob; Kubernetes
//! discovery (crate `kvmesh-discovery`) adds workers at run time. Rather than a second way of
//! mutating the fleet, the effective configuration is always recomputed as *file config +
//! discovered workers* ([`merge`]) and handed to the one reload path (`Service::reload`), which
//! already adds and removes workers, keeps the index of unchanged ones and drops removed ones'
//! blocks. So `Joined`, `Updated` and `Left` become a reload; `Unroutable` and `Routable` change no
//! configuration — the worker keeps its index, event subscription and booked load — and only flip
//! whether it gets traffic ([`Merged::unroutable`]). A file reload merges with the same discovered
//! set, so SIGHUP never forgets a discovered worker.
//!
//! The discovered state is the latest `MembershipUpdate::workers` (the full state, not a fold of
//! the deltas), so it cannot drift from the watcher; the deltas are only counted and logged.
//!
//! Conflicts are explicit: a static worker owns its id, so a discovered worker with the same id is
//! left out (`static_id`); a discovered worker the fleet validation refuses is left out (`invalid`).
//! Neither refuses the reload nor panics; both are reported with the reason.

use std::collections::{BTreeMap, BTreeSet};

use kvmesh_discovery::{
    Change, DiscoveredWorker, MemberStatus, MembershipUpdate, SkipReason, Skipped,
};

use crate::config::{Config, WorkerConfig};

/// `kvmesh_discovery_changes_total{kind}` labels, one per [`Change`] variant.
pub const CHANGE_KINDS: [&str; 5] = ["joined", "updated", "unroutable", "routable", "left"];

/// `kvmesh_discovery_workers{status}` labels: gets traffic; listed but not ready; vanished and
/// waiting out its grace period (its blocks are dropped when it ends).
pub const STATUSES: [&str; 3] = ["routable", "not_ready", "draining"];

/// A discovered worker whose id a static `[[workers]]` entry already uses.
pub const LEFT_OUT_STATIC_ID: &str = "static_id";
/// A discovered worker the fleet validation refuses.
pub const LEFT_OUT_INVALID: &str = "invalid";

/// `kvmesh_discovery_errors_total{reason}` labels: no Kubernetes client could be built; the watcher
/// could not start; applying a discovered fleet failed; the watch ended; then the watcher's own
/// (`kvmesh_discovery::Problem`): a list or watch failed; the InferencePool is missing; its spec
/// cannot be followed.
pub const ERROR_REASONS: [&str; 7] =
    ["client", "start", "apply", "ended", "watch", "pool_missing", "pool_invalid"];

/// `kvmesh_discovery_skipped_endpoints{reason}` labels: discovery's own reasons, then ours.
pub fn skip_reasons() -> impl Iterator<Item = &'static str> {
    SkipReason::ALL
        .into_iter()
        .map(SkipReason::as_str)
        .chain([LEFT_OUT_STATIC_ID, LEFT_OUT_INVALID])
}

/// The metric label of a change.
pub fn change_kind(change: &Change) -> &'static str {
    match change {
        Change::Joined { .. } => "joined",
        Change::Updated { .. } => "updated",
        Change::Unroutable { .. } => "unroutable",
        Change::Routable { .. } => "routable",
        Change::Left { .. } => "left",
    }
}

/// The status label of a member (one of [`STATUSES`]).
pub fn status_of(member: &MemberStatus) -> &'static str {
    match (member.routable, member.drop_at) {
        (true, _) => "routable",
        (false, None) => "not_ready",
        (false, Some(_)) => "draining",
    }
}

/// The fleet-file entry for a discovered worker: one dp rank, connected SUB, every topic, the
/// model of its pod's model label (validated like a file entry's by [`merge`]).
pub fn worker_config(w: &DiscoveredWorker) -> WorkerConfig {
    WorkerConfig {
        id: w.id.clone(),
        model: w.model.clone(),
        role: w.role,
        endpoint: w.endpoint.clone(),
        kv_events: Some(w.kv_events.clone()),
        kv_replay: w.kv_replay.clone(),
        dp_ranks: 1,
        kv_events_bind: false,
        kv_topic: String::new(),
    }
}

/// What discovery currently reports: the last update's full state.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiscoveredFleet {
    generation: u64,
    members: Vec<MemberStatus>,
    skipped: Vec<Skipped>,
    /// Base models learned from the engines' own `GET /v1/models` for members whose pod has no
    /// model label (`crate::service::served`); at most one per member, dropped when it leaves.
    learned: BTreeMap<String, String>,
}

impl DiscoveredFleet {
    /// Takes `update` as the current state; returns its changes (for counting and logging).
    pub fn apply(&mut self, update: MembershipUpdate) -> Vec<Change> {
        self.generation = update.generation;
        self.members = update.workers;
        self.skipped = update.skipped;
        let members = &self.members;
        self.learned.retain(|id, _| members.iter().any(|m| &m.worker.id == id));
        update.changes
    }

    /// Records that member `id`'s engine serves base model `model`. Only for a member whose pod
    /// has no model label (the label, like the file, is what the operator said); returns whether
    /// it changed what the member serves.
    pub fn learn(&mut self, id: &str, model: &str) -> bool {
        let unlabelled = self.members.iter().any(|m| m.worker.id == id && m.worker.model.is_none());
        if !unlabelled || self.learned.get(id).is_some_and(|m| m == model) {
            return false;
        }
        self.learned.insert(id.to_owned(), model.to_owned());
        true
    }

    /// The base model learned for member `id`, if any.
    pub fn learned(&self, id: &str) -> Option<&str> {
        self.learned.get(id).map(String::as_str)
    }

    /// Whether a first update arrived (discovery's initial lists completed).
    pub fn synced(&self) -> bool {
        self.generation > 0
    }

    /// The last update's generation (0 = none yet).
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Every member (routable, not ready or draining), sorted by id.
    pub fn members(&self) -> &[MemberStatus] {
        &self.members
    }

    /// Endpoints discovery itself could not turn into workers.
    pub fn skipped(&self) -> &[Skipped] {
        &self.skipped
    }
}

/// A discovered worker that is not in the fleet, and why.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct LeftOut {
    /// The worker id.
    pub id: String,
    /// [`LEFT_OUT_STATIC_ID`] or [`LEFT_OUT_INVALID`].
    pub reason: &'static str,
    /// The validation error, or the static worker's endpoint.
    pub detail: String,
}

/// The effective configuration and what it says about the discovered workers.
#[derive(Debug, Clone, PartialEq)]
pub struct Merged {
    /// The file's config with the discovered workers appended (after the static ones, by id).
    pub config: Config,
    /// Discovered workers in `config` that get no traffic (not ready, or draining).
    pub unroutable: BTreeSet<String>,
    /// Discovered workers not in `config`.
    pub left_out: Vec<LeftOut>,
    /// Discovered workers in `config` by status; every label of [`STATUSES`] is present.
    pub statuses: BTreeMap<&'static str, usize>,
    /// Discovered endpoints not in the fleet by reason (discovery's skips and [`Self::left_out`]);
    /// every label of [`skip_reasons`] is present.
    pub skipped: BTreeMap<&'static str, usize>,
}

impl Merged {
    /// Discovered workers in the fleet.
    pub fn discovered(&self) -> usize {
        self.statuses.values().sum()
    }
}

/// The effective fleet: `file` plus every discovered worker that fits (see the module docs).
pub fn merge(file: &Config, fleet: &DiscoveredFleet) -> Merged {
    let mut config = file.clone();
    let statics: BTreeMap<&str, &WorkerConfig> =
        file.workers.iter().map(|w| (w.id.as_str(), w)).collect();
    // Each discovered worker is checked by the same validation a file entry gets, alone beside the
    // file's settings, so one bad endpoint costs that worker only.
    let mut probe = Config { workers: Vec::with_capacity(1), ..file.clone() };
    let mut unroutable = BTreeSet::new();
    let mut left_out = Vec::new();
    let mut statuses: BTreeMap<&'static str, usize> = STATUSES.iter().map(|s| (*s, 0)).collect();
    for member in fleet.members() {
        let id = &member.worker.id;
        if let Some(s) = statics.get(id.as_str()) {
            left_out.push(LeftOut {
                id: id.clone(),
                reason: LEFT_OUT_STATIC_ID,
                detail: format!("static worker at {}", s.endpoint),
            });
            continue;
        }
        probe.workers.clear();
        let mut wc = worker_config(&member.worker);
        if wc.model.is_none() {
            wc.model = fleet.learned(id).map(str::to_owned);
        }
        probe.workers.push(wc);
        if let Err(e) = probe.validate() {
            left_out.push(LeftOut {
                id: id.clone(),
                reason: LEFT_OUT_INVALID,
                detail: e.to_string(),
            });
            continue;
        }
        config.workers.append(&mut probe.workers);
        if !member.routable {
            unroutable.insert(id.clone());
        }
        *statuses.entry(status_of(member)).or_default() += 1;
    }
    let mut skipped: BTreeMap<&'static str, usize> = skip_reasons().map(|r| (r, 0)).collect();
    for s in fleet.skipped() {
        *skipped.entry(s.reason.as_str()).or_default() += 1;
    }
    for l in &left_out {
        *skipped.entry(l.reason).or_default() += 1;
    }
    Merged { config, unroutable, left_out, statuses, skipped }
}

#[cfg(test)]
#[path = "discovered_tests.rs"]
mod tests;
