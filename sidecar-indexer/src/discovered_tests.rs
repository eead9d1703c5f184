use std::time::{Duration, Instant};

use kvmesh_core::api::Role;
use kvmesh_discovery::{Membership, Observed, View};

use super::*;
use crate::config::{ConfigError, MapEnv};

const FILE: &str = r#"
listen = "127.0.0.1:9100"
[model]
name = "m"
block_size = 16
"#;

fn file(statics: &[(&str, &str)]) -> Config {
    let mut text = FILE.to_owned();
    for (id, endpoint) in statics {
        text.push_str(&format!(
            "[[workers]]\nid = \"{id}\"\nrole = \"decode\"\nendpoint = \"{endpoint}\"\n"
        ));
    }
    Config::from_toml_str(&text, &MapEnv::default()).unwrap()
}

fn worker(id: &str, ip: &str) -> DiscoveredWorker {
    DiscoveredWorker {
        id: id.into(),
        model: None,
        role: Role::Decode,
        endpoint: format!("{ip}:8000"),
        kv_events: format!("tcp://{ip}:5557"),
        kv_replay: Some(format!("tcp://{ip}:5558")),
    }
}

/// `status`: `r` routable, `n` not ready, `d` draining.
fn member(id: &str, ip: &str, status: char) -> MemberStatus {
    let drop_at = (status == 'd').then(|| Instant::now() + Duration::from_secs(30));
    MemberStatus { worker: worker(id, ip), routable: status == 'r', drop_at }
}

fn fleet(members: Vec<MemberStatus>, skipped: Vec<Skipped>) -> DiscoveredFleet {
    let mut f = DiscoveredFleet::default();
    f.apply(MembershipUpdate { generation: 1, changes: Vec::new(), workers: members, skipped });
    f
}

fn ids_and_endpoints(c: &Config) -> Vec<(String, String)> {
    c.workers.iter().map(|w| (w.id.clone(), w.endpoint.clone())).collect()
}

fn pairs(v: &[(&str, &str)]) -> Vec<(String, String)> {
    v.iter().map(|(a, b)| ((*a).to_owned(), (*b).to_owned())).collect()
}

struct Case {
    name: &'static str,
    statics: Vec<(&'static str, &'static str)>,
    members: Vec<MemberStatus>,
    skipped: Vec<Skipped>,
    want_workers: Vec<(&'static str, &'static str)>,
    want_unroutable: Vec<&'static str>,
    want_left_out: Vec<(&'static str, &'static str)>,
    /// (routable, not_ready, draining)
    want_statuses: (usize, usize, usize),
    want_skipped: Vec<(&'static str, usize)>,
}

#[test]
fn merge_table() {
    let mut bad = member("bad-0", "10.0.0.9", 'r');
    bad.worker.endpoint = "not-an-address".into();
    let cases = vec![
        Case {
            name: "nothing discovered: the file's fleet as it is",
            statics: vec![("s0", "127.0.0.1:1")],
            members: vec![],
            skipped: vec![],
            want_workers: vec![("s0", "127.0.0.1:1")],
            want_unroutable: vec![],
            want_left_out: vec![],
            want_statuses: (0, 0, 0),
            want_skipped: vec![],
        },
        Case {
            name:
                "discovered workers follow the static ones; not ready and draining get no traffic",
            statics: vec![("s0", "127.0.0.1:1")],
            members: vec![
                member("a", "10.0.0.1", 'r'),
                member("b", "10.0.0.2", 'n'),
                member("c", "10.0.0.3", 'd'),
            ],
            skipped: vec![],
            want_workers: vec![
                ("s0", "127.0.0.1:1"),
                ("a", "10.0.0.1:8000"),
                ("b", "10.0.0.2:8000"),
                ("c", "10.0.0.3:8000"),
            ],
            want_unroutable: vec!["b", "c"],
            want_left_out: vec![],
            want_statuses: (1, 1, 1),
            want_skipped: vec![],
        },
        Case {
            name: "a static id wins over a discovered one, even a draining one",
            statics: vec![("a", "127.0.0.1:1"), ("c", "127.0.0.1:3")],
            members: vec![
                member("a", "10.0.0.1", 'r'),
                member("b", "10.0.0.2", 'r'),
                member("c", "10.0.0.3", 'd'),
            ],
            skipped: vec![],
            want_workers: vec![("a", "127.0.0.1:1"), ("c", "127.0.0.1:3"), ("b", "10.0.0.2:8000")],
            want_unroutable: vec![],
            want_left_out: vec![("a", LEFT_OUT_STATIC_ID), ("c", LEFT_OUT_STATIC_ID)],
            want_statuses: (1, 0, 0),
            want_skipped: vec![(LEFT_OUT_STATIC_ID, 2)],
        },
        Case {
            name: "a worker the fleet validation refuses is left out alone",
            statics: vec![],
            members: vec![member("a", "10.0.0.1", 'r'), bad],
            skipped: vec![],
            want_workers: vec![("a", "10.0.0.1:8000")],
            want_unroutable: vec![],
            want_left_out: vec![("bad-0", LEFT_OUT_INVALID)],
            want_statuses: (1, 0, 0),
            want_skipped: vec![(LEFT_OUT_INVALID, 1)],
        },
        Case {
            name: "discovery's own skips are counted by reason",
            statics: vec![],
            members: vec![member("a", "10.0.0.1", 'n')],
            skipped: vec![
                Skipped { target: "x".into(), reason: SkipReason::NoHttpPort },
                Skipped { target: "y".into(), reason: SkipReason::NoHttpPort },
                Skipped { target: "z".into(), reason: SkipReason::BadRole },
            ],
            want_workers: vec![("a", "10.0.0.1:8000")],
            want_unroutable: vec!["a"],
            want_left_out: vec![],
            want_statuses: (0, 1, 0),
            want_skipped: vec![("no_http_port", 2), ("bad_role", 1)],
        },
    ];
    for c in cases {
        let f = file(&c.statics);
        let m = merge(&f, &fleet(c.members, c.skipped));
        assert_eq!(ids_and_endpoints(&m.config), pairs(&c.want_workers), "{}: workers", c.name);
        m.config.validate().unwrap_or_else(|e| panic!("{}: merged config invalid: {e}", c.name));
        let unroutable: Vec<&str> = m.unroutable.iter().map(String::as_str).collect();
        assert_eq!(unroutable, c.want_unroutable, "{}: unroutable", c.name);
        let left: Vec<(&str, &str)> =
            m.left_out.iter().map(|l| (l.id.as_str(), l.reason)).collect();
        assert_eq!(left, c.want_left_out, "{}: left out", c.name);
        let (r, n, d) = c.want_statuses;
        assert_eq!(
            (m.statuses["routable"], m.statuses["not_ready"], m.statuses["draining"]),
            (r, n, d),
            "{}: statuses",
            c.name
        );
        assert_eq!(m.discovered(), r + n + d, "{}", c.name);
        for reason in skip_reasons() {
            let want = c.want_skipped.iter().find(|(k, _)| *k == reason).map_or(0, |(_, n)| *n);
            assert_eq!(m.skipped.get(reason), Some(&want), "{}: skipped {reason}", c.name);
        }
        // Everything but the workers is the file's.
        assert_eq!(Config { workers: f.workers.clone(), ..m.config.clone() }, f, "{}", c.name);
    }
}

#[test]
fn discovered_entries_are_fleet_file_entries() {
    let w = worker_config(&worker("vllm-decode-0", "10.244.1.17"));
    assert_eq!(w.events_endpoint(0).as_deref(), Some("tcp://10.244.1.17:5557"));
    assert_eq!(w.replay_endpoint(0).as_deref(), Some("tcp://10.244.1.17:5558"));
    assert_eq!((w.dp_ranks, w.kv_events_bind, w.kv_topic.as_str()), (1, false, ""));
    let v6 = DiscoveredWorker {
        endpoint: "[fd00::17]:8000".into(),
        kv_events: "tcp://[fd00::17]:5557".into(),
        kv_replay: None,
        ..worker("v6", "x")
    };
    let m = merge(
        &file(&[]),
        &fleet(vec![MemberStatus { worker: v6.clone(), routable: true, drop_at: None }], vec![]),
    );
    assert!(m.left_out.is_empty(), "{:?}", m.left_out);
    assert_eq!(
        m.config.workers,
        vec![worker_config(&v6)],
        "IPv6 endpoints pass the fleet validation"
    );
}

/// The real membership state machine drives the merge through a flap within the grace period and
/// a departure past it: the effective fleet changes only on join and leave; routability in between.
#[test]
fn membership_sequences_become_fleet_changes() {
    type Step = (
        u64,
        Option<Vec<(&'static str, &'static str, bool)>>,
        &'static [&'static str],
        &'static [&'static str],
        &'static [&'static str],
    );
    // (seconds, view (None = clock only), change kinds, workers in the fleet, unroutable)
    let steps: Vec<Step> = vec![
        (
            0,
            Some(vec![("a", "10.0.0.1", true), ("b", "10.0.0.2", true)]),
            &["joined", "joined"],
            &["s0", "a", "b"],
            &[],
        ),
        (5, Some(vec![("a", "10.0.0.1", true)]), &["unroutable"], &["s0", "a", "b"], &["b"]),
        (
            10,
            Some(vec![("a", "10.0.0.1", true), ("b", "10.0.0.2", true)]),
            &["routable"],
            &["s0", "a", "b"],
            &[],
        ),
        (
            11,
            Some(vec![("a", "10.0.0.1", true), ("b", "10.0.0.2", false)]),
            &["unroutable"],
            &["s0", "a", "b"],
            &["b"],
        ),
        (12, Some(vec![("a", "10.0.0.1", true)]), &["unroutable"], &["s0", "a", "b"], &["b"]),
        (41, None, &[], &["s0", "a", "b"], &["b"]),
        (42, None, &["left"], &["s0", "a"], &[]),
        (50, Some(vec![("a", "10.0.0.7", true)]), &["left", "joined"], &["s0", "a"], &[]),
    ];
    let start = Instant::now();
    let f = file(&[("s0", "127.0.0.1:1")]);
    let mut membership = Membership::new(Duration::from_secs(30));
    let mut discovered = DiscoveredFleet::default();
    for (generation, (at, view, kinds, workers, unroutable)) in steps.into_iter().enumerate() {
        let now = start + Duration::from_secs(at);
        let changes = match view {
            Some(entries) => {
                let mut v = View::default();
                for (id, ip, ready) in entries {
                    v.workers.insert(id.into(), Observed { worker: worker(id, ip), ready });
                }
                membership.observe(&v, now)
            }
            None => membership.expire(now),
        };
        let update = MembershipUpdate {
            generation: generation as u64 + 1,
            changes,
            workers: membership.members().cloned().collect(),
            skipped: vec![],
        };
        let got: Vec<&str> = discovered.apply(update).iter().map(change_kind).collect();
        assert_eq!(got, kinds, "t={at}: changes");
        let m = merge(&f, &discovered);
        let ids: Vec<&str> = m.config.workers.iter().map(|w| w.id.as_str()).collect();
        assert_eq!(ids, workers, "t={at}: fleet");
        let un: Vec<&str> = m.unroutable.iter().map(String::as_str).collect();
        assert_eq!(un, unroutable, "t={at}: unroutable");
    }
    assert!(discovered.synced());
    let a = merge(&f, &discovered).config.workers.into_iter().find(|w| w.id == "a").unwrap();
    assert_eq!(a.endpoint, "10.0.0.7:8000", "a new address is a new worker entry");
}

#[test]
fn labels_cover_every_variant() {
    assert_eq!(skip_reasons().count(), SkipReason::ALL.len() + 2);
    let statuses: Vec<&str> =
        ['r', 'n', 'd'].iter().map(|s| status_of(&member("a", "10.0.0.1", *s))).collect();
    assert_eq!(statuses, STATUSES);
}

// === the `[discovery.kubernetes]` table of the fleet file ===

const TABLE: &str = r#"
[discovery.kubernetes]
namespace = "llm"
service = "vllm"
pod_selector = "app.kubernetes.io/name=vllm"
kv_events_port = "kv-events"
grace_period_ms = 500
"#;

#[test]
fn the_table_parses_into_the_discovery_config() {
    let c = Config::from_toml_str(&format!("{FILE}{TABLE}"), &MapEnv::default()).unwrap();
    let k = c.discovery.kubernetes.as_ref().unwrap();
    assert_eq!((k.namespace.as_str(), k.service.as_str(), k.grace_period_ms), ("llm", "vllm", 500));
    assert_eq!(k.kv_events_port, kvmesh_discovery::PortRef::Name("kv-events".into()));
    assert_eq!(k.role_label, "kvmesh.io/role", "defaults filled in");
    assert!(Config::from_toml_str(FILE, &MapEnv::default()).unwrap().discovery.is_empty());
}

#[test]
fn bad_tables_are_config_errors_naming_the_field() {
    let cases: &[(&str, &str, &str)] = &[
        (
            "grace_period_ms = 500",
            "grace_period_ms = 3600001",
            "discovery.kubernetes.grace_period_ms",
        ),
        ("service = \"vllm\"", "service = \"Not_A_Service\"", "discovery.kubernetes.service"),
        ("service = \"vllm\"", "", "discovery.kubernetes.service"),
        (
            "grace_period_ms = 500",
            "grace_period_ms = 500\nmax_workers = 0",
            "discovery.kubernetes.max_workers",
        ),
    ];
    for (from, to, field) in cases {
        let text = format!("{FILE}{}", TABLE.replacen(from, to, 1));
        match Config::from_toml_str(&text, &MapEnv::default()) {
            Err(ConfigError::InvalidValue { field: f, .. }) => assert_eq!(&f, field, "{to}"),
            other => panic!("{to}: expected InvalidValue, got {other:?}"),
        }
    }
    for (text, key) in [
        (TABLE.replace("grace_period_ms", "grace_ms"), "grace_ms"),
        (TABLE.replace("[discovery.kubernetes]", "[discovery.consul]"), "consul"),
        (format!("{TABLE}default_role = \"turbo\"\n"), "turbo"),
    ] {
        match Config::from_toml_str(&format!("{FILE}{text}"), &MapEnv::default()) {
            Err(ConfigError::Parse(msg)) => assert!(msg.contains(key), "{key}: {msg}"),
            other => panic!("{key}: expected a parse error, got {other:?}"),
        }
    }
}

#[test]
fn the_normalised_config_reads_back_the_same() {
    let text = format!("{FILE}{TABLE}default_role = \"none\"\nkv_replay_port = \"none\"\n");
    let c = Config::from_toml_str(&text, &MapEnv::default()).unwrap();
    let k = c.discovery.kubernetes.as_ref().unwrap();
    assert_eq!((k.default_role, k.kv_replay_port.clone()), (None, None));
    let printed = toml::to_string_pretty(&c).unwrap();
    assert!(printed.contains("[discovery.kubernetes]"), "{printed}");
    assert_eq!(Config::from_toml_str(&printed, &MapEnv::default()).unwrap(), c, "{printed}");
}

#[test]
fn a_pods_model_label_names_its_model_and_an_unknown_one_is_left_out() {
    let text = "listen = \"127.0.0.1:9100\"\n[[models]]\nname = \"a\"\nblock_size = 16\n[[models]]\nname = \"b\"\nblock_size = 32\n";
    let file = Config::from_toml_str(text, &MapEnv::default()).unwrap();
    let labelled = |id: &str, ip: &str, model: Option<&str>| MemberStatus {
        worker: DiscoveredWorker { model: model.map(str::to_owned), ..worker(id, ip) },
        routable: true,
        drop_at: None,
    };
    let m = merge(
        &file,
        &fleet(
            vec![
                labelled("p0", "10.0.0.1", Some("b")),
                labelled("p1", "10.0.0.2", None),
                labelled("p2", "10.0.0.3", Some("gpt-4")),
            ],
            vec![],
        ),
    );
    let served: Vec<_> =
        m.config.workers.iter().map(|w| (w.id.as_str(), m.config.worker_model(w))).collect();
    assert_eq!(served, vec![("p0", "b"), ("p1", "a")]);
    assert_eq!(m.left_out.len(), 1);
    assert_eq!((m.left_out[0].id.as_str(), m.left_out[0].reason), ("p2", LEFT_OUT_INVALID));
    assert!(m.left_out[0].detail.contains("workers[0].model"), "{}", m.left_out[0].detail);
}

#[test]
fn a_model_learned_from_the_engine_moves_only_an_unlabelled_pod() {
    let text = "listen = \"127.0.0.1:9100\"\n[[models]]\nname = \"a\"\nblock_size = 16\n[[models]]\nname = \"b\"\nblock_size = 32\n";
    let file = Config::from_toml_str(text, &MapEnv::default()).unwrap();
    let member = |id: &str, ip: &str, model: Option<&str>| MemberStatus {
        worker: DiscoveredWorker { model: model.map(str::to_owned), ..worker(id, ip) },
        routable: true,
        drop_at: None,
    };
    let mut f =
        fleet(vec![member("p0", "10.0.0.1", None), member("p1", "10.0.0.2", Some("a"))], vec![]);
    assert!(f.learn("p0", "b"));
    assert!(!f.learn("p0", "b"), "nothing new");
    assert!(!f.learn("p1", "b"), "the label wins");
    assert!(!f.learn("static", "b"), "not a member");
    let m = merge(&file, &f);
    let served: Vec<_> =
        m.config.workers.iter().map(|w| (w.id.as_str(), m.config.worker_model(w))).collect();
    assert_eq!(served, vec![("p0", "b"), ("p1", "a")]);
    // A member that left forgets what was learned.
    f.apply(MembershipUpdate {
        generation: 2,
        changes: Vec::new(),
        workers: vec![member("p1", "10.0.0.2", Some("a"))],
        skipped: Vec::new(),
    });
    assert_eq!(f.learned("p0"), None);
}
