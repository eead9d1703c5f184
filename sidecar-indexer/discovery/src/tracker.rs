//! The whole discovery state machine: slice and pod events in, membership updates out. No I/O.
//!
//! [`Tracker`] owns the two watched collections and the [`Membership`]. The watcher feeds it events
//! and clock ticks; tests feed it recorded API responses and a synthetic clock. Nothing is announced
//! until both collections have completed their first list — before that, an empty view would look
//! like every worker leaving. After that, an update goes out whenever membership or the set of
//! skipped endpoints changes.

use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;

use crate::config::DiscoveryConfig;
use crate::membership::{Change, MemberStatus, Membership};
use crate::objects::{ObjectEvent, ObjectSet};
use crate::view::{observe, Skipped};

/// What the indexer receives: the deltas to apply, and the full state for those who prefer it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipUpdate {
    /// Increases by one per update; the first update (generation 1) means "initial sync done".
    pub generation: u64,
    /// Changes since the previous update, in order.
    pub changes: Vec<Change>,
    /// Every member (routable or in grace), sorted by id.
    pub workers: Vec<MemberStatus>,
    /// Endpoints of the Service that are not workers, with reasons (sorted, current view).
    pub skipped: Vec<Skipped>,
}

/// Slices + pods + membership.
#[derive(Debug, Clone)]
pub struct Tracker {
    cfg: DiscoveryConfig,
    slices: ObjectSet<EndpointSlice>,
    pods: ObjectSet<Pod>,
    membership: Membership,
    generation: u64,
    skipped: Vec<Skipped>,
}

impl Tracker {
    /// A tracker for a validated configuration.
    pub fn new(cfg: DiscoveryConfig) -> Self {
        let membership = Membership::new(cfg.grace());
        Self {
            cfg,
            slices: ObjectSet::default(),
            pods: ObjectSet::default(),
            membership,
            generation: 0,
            skipped: Vec::new(),
        }
    }

    /// An EndpointSlice event at `now`.
    pub fn on_slice(
        &mut self,
        event: ObjectEvent<EndpointSlice>,
        now: Instant,
    ) -> Option<MembershipUpdate> {
        let changed = self.slices.apply(event);
        self.reconcile(changed, now)
    }

    /// A pod event at `now`.
    pub fn on_pod(&mut self, event: ObjectEvent<Pod>, now: Instant) -> Option<MembershipUpdate> {
        let changed = self.pods.apply(event);
        self.reconcile(changed, now)
    }

    /// The clock moved: expire workers whose grace period ended.
    pub fn on_tick(&mut self, now: Instant) -> Option<MembershipUpdate> {
        if self.generation == 0 {
            return None;
        }
        let changes = self.membership.expire(now);
        self.publish(changes, false)
    }

    /// When [`Self::on_tick`] next has work.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.membership.next_deadline()
    }

    /// Whether both collections completed their first list.
    pub fn synced(&self) -> bool {
        self.slices.synced() && self.pods.synced()
    }

    /// The membership (for inspection and tests).
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    fn reconcile(&mut self, changed: bool, now: Instant) -> Option<MembershipUpdate> {
        if !self.synced() {
            return None;
        }
        let first = self.generation == 0;
        if !changed && !first {
            return None;
        }
        let view = observe(&self.slices, &self.pods, &self.cfg);
        let changes = self.membership.observe(&view, now);
        let skipped_changed = view.skipped != self.skipped;
        self.skipped = view.skipped;
        self.publish(changes, first || skipped_changed)
    }

    fn publish(&mut self, changes: Vec<Change>, force: bool) -> Option<MembershipUpdate> {
        if changes.is_empty() && !force {
            return None;
        }
        self.generation += 1;
        Some(MembershipUpdate {
            generation: self.generation,
            changes,
            workers: self.membership.members().cloned().collect(),
            skipped: self.skipped.clone(),
        })
    }
}
