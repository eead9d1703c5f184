//! The indexer with Kubernetes discovery: the real `kvmesh-discovery` watcher (kube-rs) against a
//! fake API server on loopback that replays kvmesh-discovery's recorded responses
//! (`discovery/tests/fixtures`), feeding the real `Service` — its reload, index and `/v1/route`.
//! Both sources: a Service's EndpointSlices, and an InferencePool (its selector's pods × its
//! target ports, a selector change, the pool deleted).
//!
//! The fake server's watches are held open and fed by the test, so each step (the re-list that
//! drops `vllm-decode-1`, the watch event that brings it back) happens when the test says. Plus the
//! binary without any cluster: it logs, counts and keeps serving its static workers.

// Test helpers fail by panicking; the production lints on panics and unwraps do not apply.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::routing::get;
use axum::Router;
use common::{eventually, indexer_binary, Proc};
use http_body_util::BodyExt;
use kvmesh_core::api::{RouteDecision, DONE_PATH, ROUTE_PATH};
use kvmesh_core::headers;
use kvmesh_indexer::config::{Config, MapEnv};
use kvmesh_indexer::events::applier::ApplierMsg;
use kvmesh_indexer::events::decode::{EventBatch, KvEvent};
use kvmesh_indexer::service::Service;
use kvmesh_indexer::tokenize::PromptTokenizer;
use tokio::sync::mpsc;
use tower::ServiceExt;

fn fixture(name: &str) -> String {
    let path = format!("{}/discovery/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    text.lines().filter(|l| !l.trim().is_empty()).map(|l| format!("{l}\n")).collect()
}

/// One collection of the fake API server: lists served in order (the last repeats); each watch
/// streams what the test sends on its channel, and stays open (idle) once the script is used up.
struct Collection {
    lists: Mutex<VecDeque<String>>,
    last: Mutex<String>,
    watches: Mutex<VecDeque<mpsc::UnboundedReceiver<String>>>,
    /// Every request's query string, in order.
    queries: Mutex<Vec<String>>,
}

impl Collection {
    fn new(lists: &[&str], watches: Vec<mpsc::UnboundedReceiver<String>>) -> Arc<Self> {
        Arc::new(Self {
            lists: Mutex::new(lists.iter().map(|f| fixture(f)).collect()),
            last: Mutex::new(String::new()),
            watches: Mutex::new(watches.into()),
            queries: Mutex::new(Vec::new()),
        })
    }

    fn respond(&self, query: Option<String>) -> Body {
        let query = query.unwrap_or_default();
        self.queries.lock().unwrap().push(query.clone());
        if !query.split('&').any(|kv| kv == "watch=true" || kv == "watch=1") {
            let mut last = self.last.lock().unwrap();
            if let Some(next) = self.lists.lock().unwrap().pop_front() {
                *last = next;
            }
            return Body::from(last.clone());
        }
        match self.watches.lock().unwrap().pop_front() {
            Some(rx) => Body::from_stream(futures::stream::unfold(rx, |mut rx| async move {
                rx.recv().await.map(|text| (Ok::<_, Infallible>(Bytes::from(text)), rx))
            })),
            None => Body::from_stream(futures::stream::pending::<Result<Bytes, Infallible>>()),
        }
    }
}

/// Serves the three collections discovery reads in namespace `llm`: EndpointSlices, pods and
/// InferencePools.
async fn fake_api(
    slices: Arc<Collection>,
    pods: Arc<Collection>,
    pools: Arc<Collection>,
) -> std::net::SocketAddr {
    type S = State<(Arc<Collection>, Arc<Collection>, Arc<Collection>)>;
    async fn slices_h(State(s): S, RawQuery(q): RawQuery) -> Body {
        s.0.respond(q)
    }
    async fn pods_h(State(s): S, RawQuery(q): RawQuery) -> Body {
        s.1.respond(q)
    }
    async fn pools_h(State(s): S, RawQuery(q): RawQuery) -> Body {
        s.2.respond(q)
    }
    let app = Router::new()
        .route("/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices", get(slices_h))
        .route("/api/v1/namespaces/llm/pods", get(pods_h))
        .route("/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools", get(pools_h))
        .with_state((slices, pods, pools));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    addr
}

fn tokenizer() -> PromptTokenizer {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(kvmesh_tokens::default_tokenizer_path);
    PromptTokenizer::load(path, None, "<｜begin▁of▁sentence｜>", 1 << 20).unwrap()
}

/// A static decode worker `s0`, and a static `vllm-prefill-0` whose id the discovered pod of that
/// name collides with (the static entry wins). `extra` adds static workers.
fn fleet_file(grace_ms: u64, extra: &str) -> String {
    format!(
        r#"
listen = "127.0.0.1:0"
[model]
name = "m"
block_size = 4
[routing]
replay_timeout_ms = 200
# These workers are not engines: nothing a route records as speculative would ever be stored.
speculative_ttl_ms = 0
[[workers]]
id = "s0"
role = "decode"
endpoint = "127.0.0.1:1"
[[workers]]
id = "vllm-prefill-0"
role = "prefill"
endpoint = "127.0.0.1:2"
{extra}
[discovery.kubernetes]
namespace = "llm"
service = "vllm"
pod_selector = "app.kubernetes.io/name=vllm"
grace_period_ms = {grace_ms}
"#
    )
}

struct Harness {
    svc: Arc<Service>,
    /// Feeds the slice watches, in the order kube opens them.
    watches: Vec<mpsc::UnboundedSender<String>>,
    path: PathBuf,
    _dir: tempfile::TempDir,
}

/// Service from the fleet file; discovery follows the fake API server (lists: all three pods, then
/// a re-list without `vllm-decode-1`).
async fn start(grace_ms: u64, slice_watches: usize) -> Harness {
    let (txs, rxs): (Vec<_>, Vec<_>) =
        (0..slice_watches).map(|_| mpsc::unbounded_channel()).unzip();
    let addr = fake_api(
        Collection::new(&["slices-list-1.json", "slices-list-2.json"], rxs),
        Collection::new(&["pods-list.json"], vec![]),
        Collection::new(&[], vec![]),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, fleet_file(grace_ms, "")).unwrap();
    let config = Config::load(&path, &MapEnv::default()).unwrap();
    let discovery = config.discovery.kubernetes.clone().unwrap();
    let svc = Service::start_with_tokenizer(
        config,
        Some(path.clone()),
        Arc::new(MapEnv::default()),
        tokenizer(),
    )
    .unwrap();
    follow_fake_api(&svc, addr, discovery);
    Harness { svc, watches: txs, path, _dir: dir }
}

/// Discovery for `svc` from the fake API server at `addr`, through the indexer's own wiring
/// (`service::discovery::watch`: problems counted in its metrics).
fn follow_fake_api(
    svc: &Arc<Service>,
    addr: std::net::SocketAddr,
    discovery: kvmesh_discovery::DiscoveryConfig,
) {
    let client =
        kube::Client::try_from(kube::Config::new(format!("http://{addr}").parse().unwrap()))
            .unwrap();
    let rx = kvmesh_indexer::service::discovery::watch(svc, client, discovery).unwrap();
    tokio::spawn(kvmesh_indexer::service::discovery::follow(svc.clone(), rx));
}

/// (id, endpoint, gets traffic) per worker of `/v1/fleet`.
fn fleet(svc: &Service) -> Vec<(String, String, bool)> {
    svc.state.snapshot().workers.into_iter().map(|w| (w.id, w.endpoint, w.healthy)).collect()
}

fn slot(svc: &Service, id: &str) -> Option<u32> {
    svc.state.fleet.read().workers.iter().find(|w| w.cfg.id == id).map(|w| w.ranks[0].slot)
}

fn metric(svc: &Service, line: &str) -> bool {
    svc.state.metrics.render().lines().any(|l| l == line)
}

/// Waits until discovery joined its workers and their start-up replays are over.
async fn joined(svc: &Arc<Service>) {
    let want = ["s0", "vllm-prefill-0", "vllm-decode-0", "vllm-decode-1"];
    eventually("discovered workers joined and synced", || {
        let svc = svc.clone();
        async move {
            let ids: Vec<String> = fleet(&svc).into_iter().map(|w| w.0).collect();
            let syncing = svc.state.not_ready();
            if ids == want && syncing.is_empty() {
                Ok(())
            } else {
                Err(format!("fleet {ids:?}, syncing {syncing:?}"))
            }
        }
    })
    .await;
    let f = fleet(svc);
    assert_eq!(
        f[1],
        ("vllm-prefill-0".into(), "127.0.0.1:2".into(), true),
        "the static entry keeps its id"
    );
    assert_eq!(f[3], ("vllm-decode-1".into(), "10.244.2.23:8000".into(), true));
    assert!(metric(svc, r#"kvmesh_discovery_skipped_endpoints{reason="static_id"} 1"#));
    assert!(metric(svc, r#"kvmesh_discovery_workers{status="routable"} 2"#));
}

/// `vllm-decode-1` caches the first two blocks of [`prompt`].
fn cache_on_decode_1(svc: &Service) {
    let batch = EventBatch {
        ts: 1.0,
        events: vec![KvEvent::Stored {
            block_hashes: vec![11, 12],
            parent: None,
            token_ids: (1000..1008).collect(),
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            medium: None,
            group_idx: None,
            spec_kind: None,
            sliding_window: None,
            extra_terms: vec![],
        }],
        dp_rank: None,
    };
    svc.state
        .applier
        .send(ApplierMsg::Batch { slot: slot(svc, "vllm-decode-1").unwrap(), seq: 0, batch })
        .unwrap();
    svc.barrier();
}

fn blocks_of(svc: &Service, slot: u32) -> usize {
    svc.barrier();
    svc.state.index.read().worker_blocks(slot)
}

async fn call(svc: &Service, req: axum::http::Request<Body>) -> Bytes {
    let resp = kvmesh_indexer::http::router(svc.state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(status.is_success(), "{status}: {}", String::from_utf8_lossy(&body));
    body
}

/// Routes a 10-token prompt whose first 8 tokens `vllm-decode-1` may cache, then reports it done
/// (so booked load does not weigh on the next decision).
async fn route(svc: &Service) -> RouteDecision {
    let ids: Vec<String> = (1000..1010).map(|i: u32| i.to_string()).collect();
    let req = axum::http::Request::post(ROUTE_PATH)
        .header(headers::KVMESH_PATH, "/v1/completions")
        .header(headers::REQUEST_ID, "r")
        .body(Body::from(format!(r#"{{"model":"m","prompt":[{}]}}"#, ids.join(","))))
        .unwrap();
    let d: RouteDecision = serde_json::from_slice(&call(svc, req).await).unwrap();
    let done = format!(
        r#"{{"request_id":"r","endpoint":"{}","outcome":"success","status":200,"booking_id":"{}"}}"#,
        d.endpoint,
        d.booking_id.as_deref().unwrap()
    );
    call(svc, axum::http::Request::post(DONE_PATH).body(Body::from(done)).unwrap()).await;
    d
}

async fn decode_1_gets_traffic(svc: &Arc<Service>, want: bool) {
    eventually(&format!("vllm-decode-1 gets traffic = {want}"), || {
        let svc = svc.clone();
        async move {
            match fleet(&svc).into_iter().find(|w| w.0 == "vllm-decode-1") {
                Some(w) if w.2 == want => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flap_within_the_grace_period_keeps_the_index_and_skips_routing_meanwhile() {
    let h = start(60_000, 2).await;
    let svc = &h.svc;
    joined(svc).await;
    cache_on_decode_1(svc);
    let slot = slot(svc, "vllm-decode-1").unwrap();
    let d = route(svc).await;
    assert_eq!((d.worker.as_str(), d.overlap_blocks), ("vllm-decode-1", 2), "{}", d.reason);

    // The re-list after a 410 misses vllm-decode-1: unroutable at once, blocks kept.
    h.watches[0].send(fixture("slices-watch-1.jsonl")).unwrap();
    decode_1_gets_traffic(svc, false).await;
    assert_eq!(slot_of_decode_1(svc), Some(slot), "still in the fleet, same index slot");
    assert_eq!(blocks_of(svc, slot), 2, "its blocks stay indexed");
    let d = route(svc).await;
    assert_ne!(d.worker, "vllm-decode-1", "no traffic while it is out");
    assert_eq!(d.overlap_blocks, 0, "{}", d.reason);
    assert!(svc
        .state
        .debug_workers()
        .iter()
        .any(|w| w.id == "vllm-decode-1" && !w.routable && w.healthy));
    assert!(metric(svc, r#"kvmesh_discovery_workers{status="draining"} 1"#));
    assert!(metric(svc, r#"kvmesh_discovery_changes_total{kind="unroutable"} 1"#));
    svc.state.refresh_gauges();
    assert!(
        metric(svc, r#"kvmesh_worker_healthy{worker="vllm-decode-1"} 0"#),
        "the traffic gauge says no traffic"
    );

    // A file reload meanwhile keeps the discovered workers, and vllm-decode-1 still out.
    std::fs::write(
        &h.path,
        fleet_file(
            60_000,
            "[[workers]]\nid = \"s1\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:3\"\n",
        ),
    )
    .unwrap();
    assert!(svc.reload_from_file().await.unwrap());
    let ids: Vec<String> = fleet(svc).into_iter().map(|w| w.0).collect();
    assert_eq!(ids, ["s0", "vllm-prefill-0", "s1", "vllm-decode-0", "vllm-decode-1"]);
    assert!(!fleet(svc)[4].2, "a file reload does not make it routable");
    assert_eq!((slot_of_decode_1(svc), blocks_of(svc, slot)), (Some(slot), 2));

    // The next watch event lists it again within the grace period: routable, nothing lost.
    h.watches[1].send(fixture("slices-watch-2.jsonl")).unwrap();
    decode_1_gets_traffic(svc, true).await;
    let d = route(svc).await;
    assert_eq!((d.worker.as_str(), d.overlap_blocks), ("vllm-decode-1", 2), "{}", d.reason);
    assert_eq!(slot_of_decode_1(svc), Some(slot));
    assert!(metric(svc, r#"kvmesh_discovery_changes_total{kind="routable"} 1"#));
    assert!(metric(svc, r#"kvmesh_discovery_changes_total{kind="left"} 0"#));
    assert!(metric(svc, r#"kvmesh_discovery_workers{status="routable"} 2"#));
    assert!(metric(svc, "kvmesh_discovery_synced 1"));
}

fn slot_of_decode_1(svc: &Service) -> Option<u32> {
    slot(svc, "vllm-decode-1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_gone_past_the_grace_period_leaves_with_its_blocks() {
    let h = start(300, 1).await;
    let svc = &h.svc;
    joined(svc).await;
    cache_on_decode_1(svc);
    let slot = slot(svc, "vllm-decode-1").unwrap();
    assert_eq!(blocks_of(svc, slot), 2);

    h.watches[0].send(fixture("slices-watch-1.jsonl")).unwrap();
    eventually("vllm-decode-1 left the fleet", || {
        let svc = svc.clone();
        async move {
            let ids: Vec<String> = fleet(&svc).into_iter().map(|w| w.0).collect();
            if ids == ["s0", "vllm-prefill-0", "vllm-decode-0"] {
                Ok(())
            } else {
                Err(format!("{ids:?}"))
            }
        }
    })
    .await;
    // The fleet drops it first; its listener is stopped, then its blocks leave the index.
    eventually("its blocks left the index", || {
        let svc = svc.clone();
        async move {
            match (blocks_of(&svc, slot), svc.state.index.read().blocks()) {
                (0, 0) => Ok(()),
                other => Err(format!("(its blocks, all blocks) = {other:?}")),
            }
        }
    })
    .await;
    assert!(svc.state.debug_blocks("vllm-decode-1").is_none());
    let d = route(svc).await;
    assert_eq!(d.overlap_blocks, 0, "{}", d.reason);
    for line in [
        r#"kvmesh_discovery_changes_total{kind="unroutable"} 1"#,
        r#"kvmesh_discovery_changes_total{kind="left"} 1"#,
        r#"kvmesh_discovery_workers{status="draining"} 0"#,
        r#"kvmesh_discovery_workers{status="routable"} 1"#,
    ] {
        assert!(metric(svc, line), "missing {line}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_cluster_the_binary_counts_the_error_and_serves_its_static_workers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, fleet_file(30_000, "")).unwrap();

    let out =
        Command::new(indexer_binary()).arg("--config").arg(&path).arg("--check").output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let printed = String::from_utf8_lossy(&out.stdout);
    assert!(
        printed.contains("[discovery.kubernetes]") && printed.contains("grace_period_ms = 30000"),
        "{printed}"
    );

    // No in-cluster service account, no kubeconfig: kube cannot build a client.
    let mut cmd = Command::new(indexer_binary());
    cmd.arg("--config").arg(&path).args(["--listen", "127.0.0.1:0"]);
    cmd.env("KUBECONFIG", dir.path().join("no-such-kubeconfig")).env("HOME", dir.path());
    cmd.env_remove("KUBERNETES_SERVICE_HOST").env_remove("KUBERNETES_SERVICE_PORT");
    let p = Proc::start("indexer", cmd, dir.path());
    let ix = p.field("http");
    let http = reqwest::Client::new();
    eventually("the client error is counted", || {
        let (http, ix) = (http.clone(), ix.clone());
        async move {
            let text = http
                .get(format!("http://{ix}/metrics"))
                .send()
                .await
                .map_err(|e| e.to_string())?
                .text()
                .await
                .map_err(|e| e.to_string())?;
            if text.contains("kvmesh_discovery_errors_total{reason=\"client\"} 1") {
                Ok(())
            } else {
                Err("not yet".into())
            }
        }
    })
    .await;
    let log = std::fs::read_to_string(&p.log).unwrap();
    assert!(log.contains("kubernetes discovery disabled"), "{log}");
    let d: RouteDecision = common::route(&http, &ix, r#"{"prompt":[1,2,3,4,5,6,7,8]}"#).await;
    assert_eq!(d.worker, "s0", "the static decode worker serves");
    assert!(http.get(format!("http://{ix}/readyz")).send().await.unwrap().status().is_success());
}

/// Pool mode: the static `s0` beside the InferencePool `vllm`'s workers. Rank i's replay port is
/// 5600 + i, so two ranks' event (5557 + i) and replay ports never meet.
const POOL_FLEET: &str = r#"
listen = "127.0.0.1:0"
[model]
name = "m"
block_size = 4
[routing]
replay_timeout_ms = 200
speculative_ttl_ms = 0
[[workers]]
id = "s0"
role = "decode"
endpoint = "127.0.0.1:1"
[discovery.kubernetes]
namespace = "llm"
inference_pool = "vllm"
kv_replay_port = 5600
grace_period_ms = 300
"#;

async fn sorted_fleet_is(svc: &Arc<Service>, want: &[&str]) {
    eventually(&format!("fleet {want:?}"), || {
        let svc = svc.clone();
        async move {
            let mut ids: Vec<String> = fleet(&svc).into_iter().map(|w| w.0).collect();
            ids.sort();
            if ids == want {
                Ok(())
            } else {
                Err(format!("{ids:?}"))
            }
        }
    })
    .await;
}

/// Waits until the metrics show every one of `lines` (they follow the fleet's reload closely).
async fn metrics_show(svc: &Arc<Service>, lines: &[&str]) {
    let lines: Vec<String> = lines.iter().map(|l| (*l).to_owned()).collect();
    eventually(&format!("metrics {lines:?}"), || {
        let (svc, lines) = (svc.clone(), lines.clone());
        async move {
            match lines.iter().find(|l| !metric(&svc, l)) {
                None => Ok(()),
                Some(l) => Err(format!("missing {l}")),
            }
        }
    })
    .await;
}

/// (endpoint, kv_events, kv_replay) of worker `id` in the effective config.
fn sockets(svc: &Service, id: &str) -> (String, Option<String>, Option<String>) {
    let cfg = svc.state.config();
    let w = cfg.workers.iter().find(|w| w.id == id).unwrap_or_else(|| panic!("no worker {id}"));
    (w.endpoint.clone(), w.kv_events.clone(), w.kv_replay.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inference_pool_gives_a_worker_per_pod_and_target_port_and_its_changes_move_the_fleet() {
    let (pool_tx, pool_rx) = mpsc::unbounded_channel();
    let pods = Collection::new(&["pods-list.json"], vec![]);
    let pools = Collection::new(&["pool-list.json"], vec![pool_rx]);
    let addr = fake_api(Collection::new(&[], vec![]), pods.clone(), pools.clone()).await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, POOL_FLEET).unwrap();
    let config = Config::load(&path, &MapEnv::default()).unwrap();
    let discovery = config.discovery.kubernetes.clone().unwrap();
    assert!(discovery.pool_mode());
    let svc =
        Service::start_with_tokenizer(config, Some(path), Arc::new(MapEnv::default()), tokenizer())
            .unwrap();
    follow_fake_api(&svc, addr, discovery);

    // Target ports 8000 and 8001: every selected Ready pod is two workers (its data-parallel
    // ranks), rank i's KV sockets at the configured ports + i.
    sorted_fleet_is(
        &svc,
        &[
            "s0",
            "vllm-decode-0-rank-0",
            "vllm-decode-0-rank-1",
            "vllm-decode-1-rank-0",
            "vllm-decode-1-rank-1",
            "vllm-prefill-0-rank-0",
            "vllm-prefill-0-rank-1",
        ],
    )
    .await;
    assert_eq!(
        sockets(&svc, "vllm-decode-1-rank-1"),
        (
            "10.244.2.23:8001".into(),
            Some("tcp://10.244.2.23:5558".into()),
            Some("tcp://10.244.2.23:5601".into())
        )
    );
    assert!(fleet(&svc).iter().all(|w| w.2), "every Ready pod's ranks get traffic");
    metrics_show(&svc, &[r#"kvmesh_discovery_workers{status="routable"} 6"#]).await;
    // The pool is read by name; its pods by its selector.
    let pool_queries = pools.queries.lock().unwrap().clone();
    assert!(
        !pool_queries.is_empty()
            && pool_queries.iter().all(|q| q.contains("fieldSelector=metadata.name%3Dvllm")),
        "{pool_queries:?}"
    );
    let pod_queries = pods.queries.lock().unwrap().clone();
    assert!(
        pod_queries.iter().all(|q| q.contains("labelSelector=app.kubernetes.io%2Fname%3Dvllm")),
        "{pod_queries:?}"
    );

    // The pool's selector narrows to the decode pods on port 8000 alone: the pod watch restarts
    // with the new selector, the rank workers leave (after the grace period), the decode pods
    // join under their own names.
    let lines: Vec<String> =
        fixture("pool-watch.jsonl").lines().map(|l| format!("{l}\n")).collect();
    pool_tx.send(lines[0].clone()).unwrap();
    sorted_fleet_is(&svc, &["s0", "vllm-decode-0", "vllm-decode-1"]).await;
    assert_eq!(
        sockets(&svc, "vllm-decode-0"),
        (
            "10.244.1.17:8000".into(),
            Some("tcp://10.244.1.17:5557".into()),
            Some("tcp://10.244.1.17:5600".into())
        )
    );
    let pod_queries = pods.queries.lock().unwrap().clone();
    assert!(
        pod_queries.iter().any(|q| q.contains("kvmesh.io%2Frole%3Ddecode")),
        "the pod watch follows the new selector: {pod_queries:?}"
    );

    // The pool is deleted: it describes no workers; they leave after the grace period, the
    // static worker stays, and the missing pool is counted.
    pool_tx.send(lines[1].clone()).unwrap();
    sorted_fleet_is(&svc, &["s0"]).await;
    metrics_show(
        &svc,
        &[
            r#"kvmesh_discovery_errors_total{reason="pool_missing"} 1"#,
            r#"kvmesh_discovery_errors_total{reason="pool_invalid"} 0"#,
            r#"kvmesh_discovery_changes_total{kind="joined"} 8"#,
            r#"kvmesh_discovery_changes_total{kind="left"} 8"#,
            r#"kvmesh_discovery_workers{status="routable"} 0"#,
            "kvmesh_discovery_synced 1",
        ],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_that_does_not_exist_syncs_empty_and_an_unreachable_api_is_counted() {
    let pools = Collection::new(&["pool-list-empty.json"], vec![]);
    let addr =
        fake_api(Collection::new(&[], vec![]), Collection::new(&["pods-list.json"], vec![]), pools)
            .await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("fleet.toml");
    std::fs::write(&path, POOL_FLEET).unwrap();
    let config = Config::load(&path, &MapEnv::default()).unwrap();
    let discovery = config.discovery.kubernetes.clone().unwrap();
    let svc =
        Service::start_with_tokenizer(config, Some(path), Arc::new(MapEnv::default()), tokenizer())
            .unwrap();
    follow_fake_api(&svc, addr, discovery.clone());
    metrics_show(
        &svc,
        &[r#"kvmesh_discovery_errors_total{reason="pool_missing"} 1"#, "kvmesh_discovery_synced 1"],
    )
    .await;
    let ids: Vec<String> = fleet(&svc).into_iter().map(|w| w.0).collect();
    assert_eq!(ids, ["s0"], "only the static worker");

    // An API server nobody answers: the failed lists are counted as watch errors.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let dead: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    follow_fake_api(&svc, dead, discovery);
    eventually("watch errors counted", || {
        let svc = svc.clone();
        async move {
            let text = svc.state.metrics.render();
            match text
                .lines()
                .find(|l| l.starts_with(r#"kvmesh_discovery_errors_total{reason="watch"}"#))
            {
                Some(l) if !l.ends_with(" 0") => Ok(()),
                other => Err(format!("{other:?}")),
            }
        }
    })
    .await;
}
