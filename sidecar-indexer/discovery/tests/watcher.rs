//! The real watcher (kube-rs client + runtime) against a fake API server on loopback that replays
//! the recorded responses in tests/fixtures: list, watch, `410 Gone`, re-list, watch.
//!
//! The fake server is not something kvmesh ships; the watcher, kube's list/watch/re-list
//! machinery and the tracker are, and they all run for real here.

// Test code: a broken fixture or a failed expectation must fail the test loudly.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::type_complexity)]

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use axum::body::{Body, Bytes};
use axum::extract::{RawQuery, State};
use axum::routing::get;
use axum::Router;
use kvmesh_discovery::{Change, DiscoveryConfig, MembershipUpdate};
use tokio::sync::mpsc;

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Scripted responses for one collection: lists in order (the last repeats), watches in order
/// (each streams its recorded lines, then ends or, when the script is exhausted, stays open idle).
#[derive(Default)]
struct Script {
    lists: Mutex<VecDeque<String>>,
    watches: Mutex<VecDeque<String>>,
    last_list: Mutex<String>,
    queries: Mutex<Vec<String>>,
}

impl Script {
    fn new(lists: &[&str], watches: &[&str]) -> Arc<Self> {
        Arc::new(Self {
            lists: Mutex::new(lists.iter().map(|f| fixture(f)).collect()),
            watches: Mutex::new(watches.iter().map(|f| fixture(f)).collect()),
            ..Self::default()
        })
    }

    fn respond(&self, query: Option<String>) -> Body {
        let query = query.unwrap_or_default();
        self.queries.lock().unwrap().push(query.clone());
        let is_watch = query.split('&').any(|kv| kv == "watch=true" || kv == "watch=1");
        if !is_watch {
            let mut last = self.last_list.lock().unwrap();
            if let Some(next) = self.lists.lock().unwrap().pop_front() {
                *last = next;
            }
            return Body::from(last.clone());
        }
        match self.watches.lock().unwrap().pop_front() {
            Some(text) => {
                let lines: Vec<Result<Bytes, Infallible>> =
                    text.lines().map(|l| Ok(Bytes::from(format!("{l}\n")))).collect();
                Body::from_stream(futures::stream::iter(lines))
            }
            // An idle watch: the connection stays open without events.
            None => Body::from_stream(futures::stream::pending::<Result<Bytes, Infallible>>()),
        }
    }
}

struct FakeApi {
    slices: Arc<Script>,
    pods: Arc<Script>,
    addr: std::net::SocketAddr,
    _server: tokio::task::JoinHandle<()>,
}

async fn fake_api(slices: Arc<Script>, pods: Arc<Script>) -> anyhow::Result<FakeApi> {
    async fn slices_h(State(s): State<(Arc<Script>, Arc<Script>)>, RawQuery(q): RawQuery) -> Body {
        s.0.respond(q)
    }
    async fn pods_h(State(s): State<(Arc<Script>, Arc<Script>)>, RawQuery(q): RawQuery) -> Body {
        s.1.respond(q)
    }
    let app = Router::new()
        .route("/apis/discovery.k8s.io/v1/namespaces/llm/endpointslices", get(slices_h))
        .route("/api/v1/namespaces/llm/pods", get(pods_h))
        .with_state((slices.clone(), pods.clone()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(FakeApi { slices, pods, addr, _server: server })
}

fn client(addr: std::net::SocketAddr) -> anyhow::Result<kube::Client> {
    let config = kube::Config::new(format!("http://{addr}").parse()?);
    Ok(kube::Client::try_from(config)?)
}

fn cfg(grace_ms: u64) -> DiscoveryConfig {
    DiscoveryConfig {
        namespace: "llm".into(),
        service: "vllm".into(),
        pod_selector: "app.kubernetes.io/name=vllm".into(),
        grace_period_ms: grace_ms,
        ..DiscoveryConfig::default()
    }
}

/// Receives updates until `done` holds for the changes seen so far, with a deadline.
async fn collect_until(
    rx: &mut mpsc::Receiver<MembershipUpdate>,
    done: impl Fn(&[Change]) -> bool,
) -> anyhow::Result<Vec<MembershipUpdate>> {
    let mut updates = Vec::new();
    let deadline = tokio::time::Instant::now() + kvmesh_e2e::poll::patience();
    loop {
        let all: Vec<Change> =
            updates.iter().flat_map(|u: &MembershipUpdate| u.changes.clone()).collect();
        if done(&all) {
            return Ok(updates);
        }
        let next = tokio::time::timeout_at(deadline, rx.recv())
            .await
            .context("timed out waiting for membership updates")?;
        updates.push(next.context("watcher ended")?);
    }
}

fn rendered(updates: &[MembershipUpdate]) -> Vec<String> {
    updates
        .iter()
        .flat_map(|u| u.changes.iter())
        .map(|c| match c {
            Change::Joined { worker, routable } => format!("joined {} {routable}", worker.id),
            Change::Updated { worker } => format!("updated {}", worker.id),
            Change::Unroutable { id, drop_at } => {
                format!("unroutable {id} drop={}", drop_at.is_some())
            }
            Change::Routable { id } => format!("routable {id}"),
            Change::Left { id } => format!("left {id}"),
        })
        .collect()
}

#[tokio::test]
async fn watcher_survives_a_flapping_relist() -> anyhow::Result<()> {
    let api = fake_api(
        Script::new(
            &["slices-list-1.json", "slices-list-2.json"],
            &["slices-watch-1.jsonl", "slices-watch-2.jsonl"],
        ),
        Script::new(&["pods-list.json"], &[]),
    )
    .await?;
    let mut rx = kvmesh_discovery::spawn(client(api.addr)?, cfg(60_000))?;
    let updates =
        collect_until(&mut rx, |c| c.contains(&Change::Routable { id: "vllm-decode-1".into() }))
            .await?;
    assert_eq!(
        rendered(&updates),
        [
            "joined vllm-decode-0 true",
            "joined vllm-decode-1 true",
            "joined vllm-prefill-0 true",
            "unroutable vllm-decode-1 drop=true",
            "routable vllm-decode-1",
        ]
    );
    assert_eq!(updates[0].generation, 1);
    let last = updates.last().context("no update")?;
    assert_eq!(last.workers.len(), 3);
    assert!(last.workers.iter().all(|w| w.routable && w.drop_at.is_none()));

    // The watcher asked for the Service's slices and the configured pods, and re-listed after 410.
    let slice_queries = api.slices.queries.lock().unwrap().clone();
    assert!(
        slice_queries
            .iter()
            .all(|q| q.contains("labelSelector=kubernetes.io%2Fservice-name%3Dvllm")),
        "{slice_queries:?}"
    );
    assert_eq!(
        slice_queries.iter().filter(|q| !q.contains("watch=")).count(),
        2,
        "list, then one re-list: {slice_queries:?}"
    );
    let pod_queries = api.pods.queries.lock().unwrap().clone();
    assert!(
        pod_queries.iter().all(|q| q.contains("labelSelector=app.kubernetes.io%2Fname%3Dvllm")),
        "{pod_queries:?}"
    );
    Ok(())
}

#[tokio::test]
async fn watcher_drops_a_pod_after_the_grace_period() -> anyhow::Result<()> {
    let api = fake_api(
        Script::new(&["slices-list-1.json", "slices-list-2.json"], &["slices-watch-1.jsonl"]),
        Script::new(&["pods-list.json"], &[]),
    )
    .await?;
    let started = std::time::Instant::now();
    let mut rx = kvmesh_discovery::spawn(client(api.addr)?, cfg(300))?;
    let updates =
        collect_until(&mut rx, |c| c.contains(&Change::Left { id: "vllm-decode-1".into() }))
            .await?;
    assert!(started.elapsed() >= Duration::from_millis(300), "left only after the grace period");
    assert_eq!(
        rendered(&updates)[3..],
        ["unroutable vllm-decode-1 drop=true".to_owned(), "left vllm-decode-1".to_owned()]
    );
    let last = updates.last().context("no update")?;
    let ids: Vec<&str> = last.workers.iter().map(|w| w.worker.id.as_str()).collect();
    assert_eq!(ids, ["vllm-decode-0", "vllm-prefill-0"]);
    Ok(())
}

#[tokio::test]
async fn an_unreachable_api_server_announces_nothing_and_ends_with_the_receiver(
) -> anyhow::Result<()> {
    // A port nobody listens on: every list fails, kube backs off, the tracker never syncs.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let mut rx = kvmesh_discovery::spawn(client(addr)?, cfg(1000))?;
    let got = tokio::time::timeout(Duration::from_millis(500), rx.recv()).await;
    assert!(got.is_err(), "no membership is invented while the API server is unreachable: {got:?}");
    drop(rx);
    Ok(())
}

#[test]
fn invalid_config_is_refused_before_spawning() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let client = client("127.0.0.1:1".parse().unwrap()).unwrap();
        let err = kvmesh_discovery::spawn(client, DiscoveryConfig::default()).unwrap_err();
        assert!(err.to_string().contains("discovery.service"), "{err}");
    });
    // Updates cross tasks in the indexer.
    fn is_send<T: Send>() {}
    is_send::<MembershipUpdate>();
}
