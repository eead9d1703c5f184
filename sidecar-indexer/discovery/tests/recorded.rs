//! The pure tracker driven by recorded API responses (tests/fixtures) and a synthetic clock.
//!
//! A list response becomes `ListStart, Listed.., ListDone` and a watch line `Applied`/`Deleted` —
//! what kube-runtime's watcher makes of them (`tests/watcher.rs` runs the real watcher on the
//! same recordings). An `ERROR` line (410 Gone) makes no event: the re-list that follows does.

// Test code: a broken fixture or a failed expectation must fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::type_complexity)]

use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::List;
use kvmesh_core::api::Role;
use kvmesh_discovery::{
    Change, DiscoveryConfig, MembershipUpdate, ObjectEvent, PortRef, SkipReason, Tracker,
};
use serde::de::DeserializeOwned;

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn list<K>(name: &str) -> Vec<ObjectEvent<K>>
where
    K: k8s_openapi::ListableResource + DeserializeOwned + Clone,
{
    let list: List<K> =
        serde_json::from_str(&fixture(name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut events = vec![ObjectEvent::ListStart];
    events.extend(list.items.into_iter().map(ObjectEvent::Listed));
    events.push(ObjectEvent::ListDone);
    events
}

fn watch(name: &str) -> Vec<ObjectEvent<EndpointSlice>> {
    fixture(name)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .filter_map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let obj = || serde_json::from_value::<EndpointSlice>(v["object"].clone()).unwrap();
            match v["type"].as_str() {
                Some("ADDED" | "MODIFIED") => Some(ObjectEvent::Applied(obj())),
                Some("DELETED") => Some(ObjectEvent::Deleted(obj())),
                Some("ERROR") => {
                    assert_eq!(v["object"]["code"], 410, "only 410 Gone is recorded");
                    None
                }
                other => panic!("unexpected watch event type {other:?}"),
            }
        })
        .collect()
}

fn cfg() -> DiscoveryConfig {
    DiscoveryConfig {
        namespace: "llm".into(),
        service: "vllm".into(),
        ..DiscoveryConfig::default()
    }
    .validated()
    .unwrap()
}

/// Feeds slice events at `now`, collecting every update.
fn feed_slices(
    t: &mut Tracker,
    events: Vec<ObjectEvent<EndpointSlice>>,
    now: Instant,
    out: &mut Vec<MembershipUpdate>,
) {
    for ev in events {
        out.extend(t.on_slice(ev, now));
    }
}

fn started(now: Instant) -> (Tracker, Vec<MembershipUpdate>) {
    let mut t = Tracker::new(cfg());
    let mut out = Vec::new();
    for ev in list::<Pod>("pods-list.json") {
        out.extend(t.on_pod(ev, now));
    }
    assert!(out.is_empty(), "nothing is announced before the slices are listed too");
    feed_slices(&mut t, list("slices-list-1.json"), now, &mut out);
    (t, out)
}

fn changes(updates: &[MembershipUpdate]) -> Vec<Change> {
    updates.iter().flat_map(|u| u.changes.clone()).collect()
}

#[test]
fn initial_list_announces_every_pod_with_its_role() {
    let t0 = Instant::now();
    let (_, out) = started(t0);
    assert_eq!(out.len(), 1);
    let u = &out[0];
    assert_eq!(u.generation, 1);
    assert!(u.skipped.is_empty(), "{:?}", u.skipped);
    let got: Vec<(&str, Role, &str, &str, Option<&str>, bool)> = u
        .workers
        .iter()
        .map(|m| {
            (
                m.worker.id.as_str(),
                m.worker.role,
                m.worker.endpoint.as_str(),
                m.worker.kv_events.as_str(),
                m.worker.kv_replay.as_deref(),
                m.routable,
            )
        })
        .collect();
    assert_eq!(
        got,
        vec![
            (
                "vllm-decode-0",
                Role::Decode,
                "10.244.1.17:8000",
                "tcp://10.244.1.17:5557",
                Some("tcp://10.244.1.17:5558"),
                true
            ),
            (
                "vllm-decode-1",
                Role::Decode,
                "10.244.2.23:8000",
                "tcp://10.244.2.23:5557",
                Some("tcp://10.244.2.23:5558"),
                true
            ),
            (
                "vllm-prefill-0",
                Role::Prefill,
                "10.244.3.9:8000",
                "tcp://10.244.3.9:5557",
                Some("tcp://10.244.3.9:5558"),
                true
            ),
        ]
    );
    assert_eq!(u.changes.len(), 3);
    assert!(u.changes.iter().all(|c| matches!(c, Change::Joined { routable: true, .. })));
}

/// The flap: a re-list misses `vllm-decode-1`, the next watch event brings it back within the grace
/// period. It is unroutable in between, and it never leaves (its blocks are never dropped).
#[test]
fn relist_that_briefly_drops_a_pod_loses_nothing() {
    let t0 = Instant::now();
    let (mut t, mut out) = started(t0);
    out.clear();
    feed_slices(&mut t, watch("slices-watch-1.jsonl"), t0 + Duration::from_secs(1), &mut out);
    assert!(changes(&out).is_empty(), "a no-op update changes nothing: {out:?}");

    let relist_at = t0 + Duration::from_secs(2);
    feed_slices(&mut t, list("slices-list-2.json"), relist_at, &mut out);
    assert_eq!(
        changes(&out),
        vec![Change::Unroutable {
            id: "vllm-decode-1".into(),
            drop_at: Some(relist_at + Duration::from_secs(30))
        }]
    );
    let member = t.membership().get("vllm-decode-1").unwrap();
    assert!(!member.routable);

    // Time passes, but less than the grace period.
    out.clear();
    out.extend(t.on_tick(relist_at + Duration::from_secs(29)));
    assert!(changes(&out).is_empty());

    feed_slices(
        &mut t,
        watch("slices-watch-2.jsonl"),
        relist_at + Duration::from_secs(29),
        &mut out,
    );
    assert_eq!(changes(&out), vec![Change::Routable { id: "vllm-decode-1".into() }]);
    assert_eq!(t.next_deadline(), None);

    out.clear();
    out.extend(t.on_tick(relist_at + Duration::from_secs(3600)));
    assert!(out.is_empty(), "nothing left to expire");
    assert!(t.membership().members().all(|m| m.routable));
}

#[test]
fn pod_gone_past_the_grace_period_leaves() {
    let t0 = Instant::now();
    let (mut t, mut out) = started(t0);
    out.clear();
    feed_slices(&mut t, watch("slices-watch-1.jsonl"), t0, &mut out);
    feed_slices(&mut t, list("slices-list-2.json"), t0, &mut out);
    assert_eq!(t.next_deadline(), Some(t0 + Duration::from_secs(30)));
    out.clear();
    out.extend(t.on_tick(t0 + Duration::from_secs(30)));
    assert_eq!(changes(&out), vec![Change::Left { id: "vllm-decode-1".into() }]);
    assert_eq!(out[0].workers.len(), 2);
    // It comes back later: a new member whose blocks will be rebuilt from its events.
    out.clear();
    feed_slices(&mut t, watch("slices-watch-2.jsonl"), t0 + Duration::from_secs(31), &mut out);
    assert!(
        matches!(changes(&out).as_slice(), [Change::Joined { worker, routable: true }] if worker.id == "vllm-decode-1")
    );
}

#[test]
fn a_deleted_slice_makes_its_pods_unroutable() {
    let t0 = Instant::now();
    let (mut t, mut out) = started(t0);
    let slice =
        serde_json::from_str::<k8s_openapi::List<EndpointSlice>>(&fixture("slices-list-1.json"))
            .unwrap()
            .items
            .remove(0);
    out.clear();
    out.extend(t.on_slice(ObjectEvent::Deleted(slice), t0));
    let ch = changes(&out);
    assert_eq!(ch.len(), 3);
    assert!(ch.iter().all(|c| matches!(c, Change::Unroutable { drop_at: Some(_), .. })));
}

#[test]
fn edge_cases_from_a_recorded_mixed_list() {
    let cases: Vec<(
        &str,
        DiscoveryConfig,
        Vec<(&str, Role, &str, bool)>,
        Vec<(&str, SkipReason)>,
    )> = vec![
        (
            "defaults",
            cfg(),
            vec![
                ("10.244.7.7", Role::Both, "10.244.7.7:8000", true),
                ("vllm-decode-0", Role::Decode, "10.244.1.17:8000", true),
                ("vllm-decode-1", Role::Decode, "10.244.2.23:8000", false),
                ("vllm-plain-0", Role::Both, "10.244.4.8:8000", true),
                ("vllm-prefill-0", Role::Prefill, "10.244.3.9:8000", true),
                ("vllm-v6-0", Role::Both, "[fd00:10:244::17]:8000", true),
            ],
            vec![
                ("vllm-nohttp-0", SkipReason::NoHttpPort),
                ("vllm-ghost-0", SkipReason::UnknownPod),
                ("vllm-odd-0", SkipReason::BadRole),
            ],
        ),
        (
            "no default role",
            DiscoveryConfig { default_role: None, ..cfg() },
            vec![
                ("vllm-decode-0", Role::Decode, "10.244.1.17:8000", true),
                ("vllm-decode-1", Role::Decode, "10.244.2.23:8000", false),
                ("vllm-prefill-0", Role::Prefill, "10.244.3.9:8000", true),
                ("vllm-v6-0", Role::Both, "[fd00:10:244::17]:8000", true),
            ],
            vec![
                ("vllm-nohttp-0", SkipReason::NoHttpPort),
                ("vllm-ghost-0", SkipReason::UnknownPod),
                ("10.244.7.7", SkipReason::NoRole),
                ("vllm-plain-0", SkipReason::NoRole),
                ("vllm-odd-0", SkipReason::BadRole),
            ],
        ),
        (
            "replay port by a name the Service does not expose",
            DiscoveryConfig { kv_replay_port: Some(PortRef::Name("kv-replay".into())), ..cfg() },
            vec![],
            vec![
                ("vllm-nohttp-0", SkipReason::NoHttpPort),
                ("10.244.7.7", SkipReason::NoKvPort),
                ("vllm-decode-0", SkipReason::NoKvPort),
                ("vllm-decode-1", SkipReason::NoKvPort),
                ("vllm-ghost-0", SkipReason::NoKvPort),
                ("vllm-odd-0", SkipReason::NoKvPort),
                ("vllm-plain-0", SkipReason::NoKvPort),
                ("vllm-prefill-0", SkipReason::NoKvPort),
                ("vllm-v6-0", SkipReason::NoKvPort),
            ],
        ),
        (
            "capped at two workers",
            DiscoveryConfig { max_workers: 2, ..cfg() },
            vec![
                ("vllm-decode-0", Role::Decode, "10.244.1.17:8000", true),
                ("vllm-decode-1", Role::Decode, "10.244.2.23:8000", false),
            ],
            vec![
                ("vllm-nohttp-0", SkipReason::NoHttpPort),
                ("vllm-ghost-0", SkipReason::UnknownPod),
                ("vllm-odd-0", SkipReason::BadRole),
                ("10.244.7.7", SkipReason::TooManyWorkers),
                ("vllm-plain-0", SkipReason::TooManyWorkers),
                ("vllm-prefill-0", SkipReason::TooManyWorkers),
                ("vllm-v6-0", SkipReason::TooManyWorkers),
            ],
        ),
    ];
    for (name, cfg, workers, skipped) in cases {
        let now = Instant::now();
        let mut t = Tracker::new(cfg.validated().unwrap());
        let mut out = Vec::new();
        for ev in list::<Pod>("pods-list-mixed.json") {
            out.extend(t.on_pod(ev, now));
        }
        feed_slices(&mut t, list("slices-list-mixed.json"), now, &mut out);
        let u = out.last().unwrap_or_else(|| panic!("{name}: no update"));
        let got: Vec<(&str, Role, &str, bool)> = u
            .workers
            .iter()
            .map(|m| (m.worker.id.as_str(), m.worker.role, m.worker.endpoint.as_str(), m.routable))
            .collect();
        assert_eq!(got, workers, "{name}: workers");
        let got: Vec<(&str, SkipReason)> =
            u.skipped.iter().map(|s| (s.target.as_str(), s.reason)).collect();
        assert_eq!(got, skipped, "{name}: skipped");
    }
}

#[test]
fn kv_endpoints_follow_named_ports_and_ipv6() {
    let now = Instant::now();
    let cfg = DiscoveryConfig {
        kv_events_port: PortRef::Name("kv-events".into()),
        kv_replay_port: None,
        ..cfg()
    };
    let mut t = Tracker::new(cfg.validated().unwrap());
    for ev in list::<Pod>("pods-list-mixed.json") {
        t.on_pod(ev, now);
    }
    let mut out = Vec::new();
    feed_slices(&mut t, list("slices-list-mixed.json"), now, &mut out);
    let v6 = t.membership().get("vllm-v6-0").unwrap();
    assert_eq!(v6.worker.kv_events, "tcp://[fd00:10:244::17]:5557");
    assert_eq!(v6.worker.kv_replay, None);
}

#[test]
fn a_pod_relabelled_to_another_role_is_updated_in_place() {
    let t0 = Instant::now();
    let (mut t, _) = started(t0);
    let mut pod = serde_json::from_str::<k8s_openapi::List<Pod>>(&fixture("pods-list.json"))
        .unwrap()
        .items
        .remove(2);
    pod.metadata.labels.get_or_insert_default().insert("kvmesh.io/role".into(), "both".into());
    let out: Vec<MembershipUpdate> = t.on_pod(ObjectEvent::Applied(pod), t0).into_iter().collect();
    assert!(
        matches!(changes(&out).as_slice(), [Change::Updated { worker }] if worker.id == "vllm-prefill-0" && worker.role == Role::Both)
    );
}
