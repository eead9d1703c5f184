//! The whole discovery state machine: slice (or InferencePool) and pod events in, membership updates
//! out. No I/O.
//!
//! [`Tracker`] owns the watched collections and the [`Membership`]. The watcher feeds it events
//! and clock ticks; tests feed it recorded API responses and a synthetic clock. Nothing is announced
//! until the collections have completed their first list — before that, an empty view would look
//! like every worker leaving. After that, an update goes out whenever membership or the set of
//! skipped endpoints changes.
//!
//! In InferencePool mode the pod collection depends on the pool: its selector is the pod watch's
//! ([`Tracker::pod_selector`]), so first sync = the pool listed and, if it exists, its pods listed.
//! A pool that is missing (never created, or deleted) describes no workers: its members go through
//! the grace period like vanished pods. A pool whose spec cannot be read keeps the last readable
//! spec ([`PoolState::Invalid`]): a bad edit is reported, not taken for every worker leaving.

use std::time::Instant;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::core::DynamicObject;

use crate::config::DiscoveryConfig;
use crate::membership::{Change, MemberStatus, Membership};
use crate::objects::{ObjectEvent, ObjectSet};
use crate::pool::{observe_pool, parse_pool, PoolSpec};
use crate::view::{observe, Skipped};

/// What the tracker knows of its InferencePool (InferencePool mode only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolState {
    /// The first list has not completed (or Service mode).
    Unlisted,
    /// No pool of that name in the namespace: no workers.
    Missing,
    /// The pool's spec cannot be followed (the reason); the last readable spec stays in use.
    Invalid(String),
    /// The pool is followed.
    Valid,
}

/// What the indexer receives: the deltas to apply, and the full state for those who prefer it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MembershipUpdate {
    /// Increases by one per update; the first update (generation 1) means "initial sync done".
    pub generation: u64,
    /// Changes since the previous update, in order.
    pub changes: Vec<Change>,
    /// Every member (routable or in grace), sorted by id.
    pub workers: Vec<MemberStatus>,
    /// Endpoints of the Service (pods of the pool) that are not workers, with reasons (sorted,
    /// current view).
    pub skipped: Vec<Skipped>,
}

/// Slices + pods + membership.
#[derive(Debug, Clone)]
pub struct Tracker {
    cfg: DiscoveryConfig,
    slices: ObjectSet<EndpointSlice>,
    pools: ObjectSet<DynamicObject>,
    /// The pool spec in use (the last readable one; none while the pool is missing).
    pool: Option<PoolSpec>,
    pool_state: PoolState,
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
            pools: ObjectSet::default(),
            pool: None,
            pool_state: PoolState::Unlisted,
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

    /// An InferencePool event at `now` (the watch is limited to the configured pool's name).
    pub fn on_pool(
        &mut self,
        event: ObjectEvent<DynamicObject>,
        now: Instant,
    ) -> Option<MembershipUpdate> {
        let changed = self.pools.apply(event);
        if self.pools.synced() {
            match self.pools.get(&self.cfg.inference_pool).map(parse_pool) {
                None => {
                    self.pool = None;
                    self.pool_state = PoolState::Missing;
                }
                Some(Ok(spec)) => {
                    self.pool = Some(spec);
                    self.pool_state = PoolState::Valid;
                }
                Some(Err(reason)) => self.pool_state = PoolState::Invalid(reason),
            }
        }
        self.reconcile(changed, now)
    }

    /// The pool as last seen (InferencePool mode).
    pub fn pool_state(&self) -> &PoolState {
        &self.pool_state
    }

    /// The label selector the pod watch must use: the pool's (InferencePool mode, once the pool is
    /// known), else the configured `pod_selector`. `None`: no pod watch is needed yet.
    pub fn pod_selector(&self) -> Option<String> {
        if self.cfg.pool_mode() {
            self.pool.as_ref().map(PoolSpec::label_selector)
        } else {
            Some(self.cfg.pod_selector.clone())
        }
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

    /// Whether the collections completed their first list: slices and pods, or the pool and (when
    /// it exists) its pods.
    pub fn synced(&self) -> bool {
        if self.cfg.pool_mode() {
            self.pools.synced() && (self.pool.is_none() || self.pods.synced())
        } else {
            self.slices.synced() && self.pods.synced()
        }
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
        let view = if self.cfg.pool_mode() {
            observe_pool(self.pool.as_ref(), &self.pods, &self.cfg)
        } else {
            observe(&self.slices, &self.pods, &self.cfg)
        };
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pool::api_resource;
    use serde_json::{json, Value};

    fn pool(labels: Value, ports: &[u16]) -> DynamicObject {
        let ports: Vec<Value> = ports.iter().map(|p| json!({ "number": p })).collect();
        DynamicObject::new("vllm", &api_resource()).within("llm").data(
            json!({ "spec": { "selector": { "matchLabels": labels }, "targetPorts": ports } }),
        )
    }

    fn pod(name: &str, ip: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": { "name": name, "labels": { "app": "vllm" } },
            "status": { "podIP": ip, "conditions": [{ "type": "Ready", "status": "True" }] },
        }))
        .unwrap()
    }

    #[test]
    fn pool_mode_syncs_on_the_pool_then_its_pods_and_keeps_the_last_readable_spec() {
        let t0 = Instant::now();
        let cfg = DiscoveryConfig {
            inference_pool: "vllm".into(),
            kv_replay_port: None,
            ..DiscoveryConfig::default()
        };
        let mut t = Tracker::new(cfg);
        assert_eq!((t.pod_selector(), t.pool_state()), (None, &PoolState::Unlisted));

        // Listed without the pool: synced, and the first update says so (no workers).
        assert!(t.on_pool(ObjectEvent::ListStart, t0).is_none());
        let first = t.on_pool(ObjectEvent::ListDone, t0).unwrap();
        assert_eq!((first.generation, first.workers.len()), (1, 0));
        assert_eq!(t.pool_state(), &PoolState::Missing);

        // The pool appears: nothing is announced before its pods are listed.
        assert!(t
            .on_pool(ObjectEvent::Applied(pool(json!({ "app": "vllm" }), &[8000])), t0)
            .is_none());
        assert_eq!(t.pod_selector().as_deref(), Some("app=vllm"));
        assert!(!t.synced());
        t.on_pod(ObjectEvent::ListStart, t0);
        t.on_pod(ObjectEvent::Listed(pod("a", "10.0.0.1")), t0);
        let joined = t.on_pod(ObjectEvent::ListDone, t0).unwrap();
        assert!(
            matches!(&joined.changes[..], [Change::Joined { worker, routable: true }] if worker.endpoint == "10.0.0.1:8000")
        );

        // An unreadable edit changes nothing: the last readable spec stays.
        assert!(t.on_pool(ObjectEvent::Applied(pool(json!({}), &[8000])), t0).is_none());
        assert!(matches!(t.pool_state(), PoolState::Invalid(_)));
        assert_eq!(t.pod_selector().as_deref(), Some("app=vllm"));

        // A second port: the pod is two ranks now (new ids), the old id waits out its grace.
        let dp = t.on_pool(ObjectEvent::Applied(pool(json!({ "app": "vllm" }), &[8000, 8001])), t0);
        let ids: Vec<String> = dp.unwrap().workers.iter().map(|w| w.worker.id.clone()).collect();
        assert_eq!(ids, ["a", "a-rank-0", "a-rank-1"]);

        // Deleted: every worker is unroutable and will leave.
        let gone =
            t.on_pool(ObjectEvent::Deleted(pool(json!({ "app": "vllm" }), &[8000])), t0).unwrap();
        assert_eq!(t.pool_state(), &PoolState::Missing);
        assert!(gone.workers.iter().all(|w| !w.routable && w.drop_at.is_some()));
    }
}
