//! Worker membership over time: who is routable, who is in grace, who is gone — with an injected clock.
//!
//! Discovery flaps. A re-list can miss a pod for a moment, a readiness probe can blip, and the
//! production incident behind this crate was exactly that: a briefly dropped instance whose blocks
//! (and requests) were lost. So vanishing has two stages:
//!
//! 1. the moment a worker is missing from the [`View`] (or not ready), it stops being routable —
//!    no new request should go to an endpoint Kubernetes no longer lists;
//! 2. only when it has stayed *missing* for the grace period is it removed, and only then does the
//!    indexer drop its blocks and close its event socket. Coming back within the grace period
//!    restores it with its index intact.
//!
//! A worker that is listed but not ready never expires: it still exists, its engine still
//! publishes events, and its index stays true. A worker whose address changed is a new engine
//! process (a restarted pod keeps its name, not its cache): it leaves and joins again.
//!
//! Every function takes `now`; nothing here reads a clock.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::view::{DiscoveredWorker, View};

/// What changed, in the order the indexer should apply it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// A new worker: subscribe to its events; route to it when `routable`.
    Joined {
        /// The worker.
        worker: DiscoveredWorker,
        /// Whether it may receive requests now.
        routable: bool,
    },
    /// Same worker (id and addresses), new role: update routing, keep its index.
    Updated {
        /// The worker with its new role.
        worker: DiscoveredWorker,
    },
    /// Stop routing to it; keep its index and event subscription.
    Unroutable {
        /// Worker id.
        id: String,
        /// When it will be removed unless it comes back; `None` while it is listed but not ready.
        drop_at: Option<Instant>,
    },
    /// Routable again (ready again, or back within the grace period): nothing was lost.
    Routable {
        /// Worker id.
        id: String,
    },
    /// Gone for good: drop its blocks, close its event socket, forget its load.
    Left {
        /// Worker id.
        id: String,
    },
}

/// A member's current state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    /// The worker.
    pub worker: DiscoveredWorker,
    /// Whether requests may go to it.
    pub routable: bool,
    /// Set while it is missing from discovery: when its blocks will be dropped.
    pub drop_at: Option<Instant>,
}

/// The membership state machine.
#[derive(Debug, Clone)]
pub struct Membership {
    members: BTreeMap<String, MemberStatus>,
    grace: Duration,
}

impl Membership {
    /// An empty membership whose missing workers are kept for `grace`.
    pub fn new(grace: Duration) -> Self {
        Self { members: BTreeMap::new(), grace }
    }

    /// Reconciles with a complete view observed at `now`. Also expires what is due.
    pub fn observe(&mut self, view: &View, now: Instant) -> Vec<Change> {
        let mut changes = Vec::new();
        for (id, obs) in &view.workers {
            let Some(member) = self.members.get_mut(id) else {
                changes.push(Change::Joined { worker: obs.worker.clone(), routable: obs.ready });
                self.members.insert(
                    id.clone(),
                    MemberStatus { worker: obs.worker.clone(), routable: obs.ready, drop_at: None },
                );
                continue;
            };
            let moved = member.worker.endpoint != obs.worker.endpoint
                || member.worker.kv_events != obs.worker.kv_events
                || member.worker.kv_replay != obs.worker.kv_replay;
            if moved {
                changes.push(Change::Left { id: id.clone() });
                changes.push(Change::Joined { worker: obs.worker.clone(), routable: obs.ready });
                *member =
                    MemberStatus { worker: obs.worker.clone(), routable: obs.ready, drop_at: None };
                continue;
            }
            if member.worker.role != obs.worker.role {
                member.worker.role = obs.worker.role;
                changes.push(Change::Updated { worker: member.worker.clone() });
            }
            // Listed again: whatever the readiness, the removal clock stops.
            let was_pending_drop = member.drop_at.take().is_some();
            match (member.routable, obs.ready) {
                (false, true) => {
                    member.routable = true;
                    changes.push(Change::Routable { id: id.clone() });
                }
                (true, false) => {
                    member.routable = false;
                    changes.push(Change::Unroutable { id: id.clone(), drop_at: None });
                }
                (false, false) if was_pending_drop => {
                    changes.push(Change::Unroutable { id: id.clone(), drop_at: None })
                }
                _ => {}
            }
        }
        for (id, member) in &mut self.members {
            if view.workers.contains_key(id) || member.drop_at.is_some() {
                continue;
            }
            let drop_at = now + self.grace;
            member.routable = false;
            member.drop_at = Some(drop_at);
            changes.push(Change::Unroutable { id: id.clone(), drop_at: Some(drop_at) });
        }
        changes.extend(self.expire(now));
        changes
    }

    /// Removes the workers whose grace period has ended by `now`.
    pub fn expire(&mut self, now: Instant) -> Vec<Change> {
        let due: Vec<String> = self
            .members
            .iter()
            .filter(|(_, m)| m.drop_at.is_some_and(|t| t <= now))
            .map(|(id, _)| id.clone())
            .collect();
        for id in &due {
            self.members.remove(id);
        }
        due.into_iter().map(|id| Change::Left { id }).collect()
    }

    /// The earliest pending removal: when [`Self::expire`] has work next.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.members.values().filter_map(|m| m.drop_at).min()
    }

    /// Every member, sorted by id.
    pub fn members(&self) -> impl Iterator<Item = &MemberStatus> {
        self.members.values()
    }

    /// The member `id`.
    pub fn get(&self, id: &str) -> Option<&MemberStatus> {
        self.members.get(id)
    }

    /// Number of members (routable or in grace).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether there are no members.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::view::Observed;
    use kvmesh_core::api::Role;

    fn worker(id: &str, ip: &str) -> DiscoveredWorker {
        DiscoveredWorker {
            model: None,
            id: id.into(),
            role: Role::Both,
            endpoint: format!("{ip}:8000"),
            kv_events: format!("tcp://{ip}:5557"),
            kv_replay: None,
        }
    }

    fn view(entries: &[(&str, &str, bool)]) -> View {
        let mut v = View::default();
        for (id, ip, ready) in entries {
            v.workers.insert((*id).into(), Observed { worker: worker(id, ip), ready: *ready });
        }
        v
    }

    fn ids(m: &Membership, routable: bool) -> Vec<String> {
        m.members().filter(|s| s.routable == routable).map(|s| s.worker.id.clone()).collect()
    }

    const GRACE: Duration = Duration::from_secs(30);

    /// Table: a sequence of (seconds since start, view) steps and the changes each must produce.
    #[test]
    fn scenarios() {
        type Step = (u64, Option<Vec<(&'static str, &'static str, bool)>>, Vec<&'static str>);
        // `None` view = only the clock moves (expire). Changes rendered as short strings.
        let cases: Vec<(&str, Vec<Step>)> = vec![
            (
                "flap within grace loses nothing",
                vec![
                    (
                        0,
                        Some(vec![("a", "10.0.0.1", true), ("b", "10.0.0.2", true)]),
                        vec!["joined a true", "joined b true"],
                    ),
                    (5, Some(vec![("a", "10.0.0.1", true)]), vec!["unroutable b 35"]),
                    (20, None, vec![]),
                    (
                        21,
                        Some(vec![("a", "10.0.0.1", true), ("b", "10.0.0.2", true)]),
                        vec!["routable b"],
                    ),
                    (100, None, vec![]),
                ],
            ),
            (
                "gone past grace is removed once",
                vec![
                    (
                        0,
                        Some(vec![("a", "10.0.0.1", true), ("b", "10.0.0.2", true)]),
                        vec!["joined a true", "joined b true"],
                    ),
                    (5, Some(vec![("a", "10.0.0.1", true)]), vec!["unroutable b 35"]),
                    (10, Some(vec![("a", "10.0.0.1", true)]), vec![]),
                    (34, None, vec![]),
                    (35, None, vec!["left b"]),
                    (36, Some(vec![("a", "10.0.0.1", true)]), vec![]),
                    (
                        40,
                        Some(vec![("a", "10.0.0.1", true), ("b", "10.0.0.2", true)]),
                        vec!["joined b true"],
                    ),
                ],
            ),
            (
                "not ready is unroutable but never expires",
                vec![
                    (0, Some(vec![("a", "10.0.0.1", true)]), vec!["joined a true"]),
                    (1, Some(vec![("a", "10.0.0.1", false)]), vec!["unroutable a -"]),
                    (1000, Some(vec![("a", "10.0.0.1", false)]), vec![]),
                    (1001, Some(vec![("a", "10.0.0.1", true)]), vec!["routable a"]),
                ],
            ),
            (
                "missing after not ready starts the clock; listed again stops it",
                vec![
                    (0, Some(vec![("a", "10.0.0.1", false)]), vec!["joined a false"]),
                    (1, Some(vec![]), vec!["unroutable a 31"]),
                    (2, Some(vec![("a", "10.0.0.1", false)]), vec!["unroutable a -"]),
                    (100, None, vec![]),
                ],
            ),
            (
                "new address is a new engine",
                vec![
                    (0, Some(vec![("a", "10.0.0.1", true)]), vec!["joined a true"]),
                    (1, Some(vec![("a", "10.0.0.9", true)]), vec!["left a", "joined a true"]),
                ],
            ),
        ];
        for (name, steps) in cases {
            let start = Instant::now();
            let mut m = Membership::new(GRACE);
            for (at, v, expect) in steps {
                let now = start + Duration::from_secs(at);
                let changes = match v {
                    Some(entries) => m.observe(&view(&entries), now),
                    None => m.expire(now),
                };
                let got: Vec<String> = changes.iter().map(|c| render(c, start)).collect();
                assert_eq!(got, expect, "{name} at t={at}");
            }
        }
    }

    fn render(c: &Change, start: Instant) -> String {
        match c {
            Change::Joined { worker, routable } => format!("joined {} {routable}", worker.id),
            Change::Updated { worker } => format!("updated {} {}", worker.id, worker.role.as_str()),
            Change::Unroutable { id, drop_at } => {
                let at = drop_at
                    .map_or("-".to_owned(), |t| t.duration_since(start).as_secs().to_string());
                format!("unroutable {id} {at}")
            }
            Change::Routable { id } => format!("routable {id}"),
            Change::Left { id } => format!("left {id}"),
        }
    }

    #[test]
    fn role_change_keeps_the_index() {
        let now = Instant::now();
        let mut m = Membership::new(GRACE);
        m.observe(&view(&[("a", "10.0.0.1", true)]), now);
        let mut v = view(&[("a", "10.0.0.1", true)]);
        if let Some(o) = v.workers.get_mut("a") {
            o.worker.role = Role::Prefill;
        }
        let changes = m.observe(&v, now);
        assert_eq!(changes.len(), 1);
        assert!(matches!(&changes[0], Change::Updated { worker } if worker.role == Role::Prefill));
        assert_eq!(m.get("a").map(|s| s.worker.role), Some(Role::Prefill));
    }

    #[test]
    fn deadlines_and_state_are_visible() {
        let t0 = Instant::now();
        let mut m = Membership::new(GRACE);
        assert_eq!(m.next_deadline(), None);
        m.observe(&view(&[("a", "10.0.0.1", true), ("b", "10.0.0.2", true)]), t0);
        m.observe(&view(&[("a", "10.0.0.1", true)]), t0 + Duration::from_secs(1));
        assert_eq!(m.next_deadline(), Some(t0 + Duration::from_secs(31)));
        assert_eq!(ids(&m, true), ["a"]);
        assert_eq!(ids(&m, false), ["b"]);
        assert_eq!(m.len(), 2);
        assert!(m.expire(t0 + Duration::from_secs(31)).contains(&Change::Left { id: "b".into() }));
        assert_eq!(m.next_deadline(), None);
    }

    #[test]
    fn zero_grace_drops_at_once() {
        let t0 = Instant::now();
        let mut m = Membership::new(Duration::ZERO);
        m.observe(&view(&[("a", "10.0.0.1", true)]), t0);
        let changes = m.observe(&View::default(), t0);
        assert_eq!(
            changes,
            vec![
                Change::Unroutable { id: "a".into(), drop_at: Some(t0) },
                Change::Left { id: "a".into() }
            ]
        );
        assert!(m.is_empty());
    }
}
