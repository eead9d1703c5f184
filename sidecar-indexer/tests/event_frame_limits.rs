//! A publisher that sends one KV event frame above `routing.event_max_frame_bytes` and then goes on
//! with valid batches, against the real indexer binary over real ZeroMQ TCP (issue 43, T6): libzmq
//! closes a connection that sends such a frame and, on the indexer's connecting socket, never
//! dials again. The indexer must notice, resync the worker (counted) and index the later batches;
//! the same when the engine's replay socket answers with such a frame.

// Test helpers fail by panicking; the production lints on panics and unwraps do not apply.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{indexer_binary, patience, Proc};
use rmpv::Value as Mp;
use serde_json::Value;

const BLOCK: u32 = 16;
/// The frame bound the indexer runs with, and the size of the frame that breaks it.
const MAX_FRAME: usize = 4096;
const OVERSIZED: usize = 64 * 1024;

/// `[ts, [["BlockStored", [n], nil, tokens, 16]]]`: batch `n` stores one block (engine hash `n`).
fn store(n: u64) -> Vec<u8> {
    let first = u32::try_from(n).unwrap() * BLOCK;
    let tokens = (first..first + BLOCK).map(Mp::from).collect();
    let event = Mp::Array(vec![
        Mp::from("BlockStored"),
        Mp::Array(vec![Mp::from(n)]),
        Mp::Nil,
        Mp::Array(tokens),
        Mp::from(BLOCK),
    ]);
    let batch = Mp::Array(vec![Mp::F64(1.0), Mp::Array(vec![event])]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

/// Batches a publisher sent, by number (what its replay socket answers from).
type Published = Mutex<Vec<(u64, Vec<u8>)>>;

/// A batch over the frame bound (its content never reaches anyone: libzmq refuses the frame).
fn oversized() -> Vec<u8> {
    vec![0xc0; OVERSIZED]
}

fn publish(publisher: &zmq::Socket, seq: u64, payload: &[u8]) {
    publisher.send_multipart([&b"kv"[..], &seq.to_be_bytes()[..], payload], 0).unwrap();
}

fn start_indexer(dir: &std::path::Path, events: &str, replay: Option<&str>) -> (Proc, String) {
    let replay = replay.map(|r| format!("kv_replay = \"{r}\"\n")).unwrap_or_default();
    let toml = format!(
        "listen = \"127.0.0.1:0\"\n[model]\nname = \"m\"\nblock_size = {BLOCK}\n[routing]\n\
         unhealthy_after_failures = 0\nscrape_interval_ms = 1000\nscrape_timeout_ms = 100\n\
         event_max_frame_bytes = {MAX_FRAME}\nreplay_max_bytes = {MAX_FRAME}\nreplay_timeout_ms = 1000\n\
         [[workers]]\nid = \"w0\"\nrole = \"both\"\nendpoint = \"127.0.0.1:9\"\nkv_events = \"{events}\"\n{replay}"
    );
    let path = dir.join("fleet.toml");
    std::fs::write(&path, toml).unwrap();
    let mut cmd = Command::new(indexer_binary());
    cmd.arg("--config").arg(&path);
    let p = Proc::start("indexer", cmd, dir);
    let ix = p.field("http");
    (p, ix)
}

/// `/debug/workers` for w0's rank 0.
async fn rank(http: &reqwest::Client, ix: &str) -> Value {
    let v: Value =
        http.get(format!("http://{ix}/debug/workers")).send().await.unwrap().json().await.unwrap();
    v[0]["ranks"][0].clone()
}

/// The value of the sample `name{labels}` in the indexer's `/metrics` (0 when absent).
async fn metric(http: &reqwest::Client, ix: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = http.get(format!("http://{ix}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}

/// Publishes batch `n`, `n + 1`, … every 50 ms (keeping `log` of them) until the indexer has
/// applied one numbered at least `from`; returns how long that took and the last number sent.
async fn publish_until_indexed(
    http: &reqwest::Client,
    ix: &str,
    publisher: &zmq::Socket,
    log: &Published,
    mut n: u64,
    from: u64,
) -> (Duration, u64) {
    let start = Instant::now();
    let deadline = start + patience();
    loop {
        let payload = store(n);
        log.lock().unwrap().push((n, payload.clone()));
        publish(publisher, n, &payload);
        let r = rank(http, ix).await;
        if r["last_seq"].as_u64().is_some_and(|s| s >= from) && r["blocks_held"].as_u64() > Some(0)
        {
            return (start.elapsed(), n);
        }
        assert!(
            Instant::now() < deadline,
            "nothing from batch {from} on indexed within {:?}: {r}",
            patience()
        );
        n += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_frame_over_the_limit_resyncs_the_worker_and_later_batches_are_indexed() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    let (_ix_proc, ix) = start_indexer(dir.path(), &endpoint, None);
    let http = reqwest::Client::new();
    let log = Mutex::new(Vec::new());

    // Joined: batches flow and are indexed.
    let (_, last) = publish_until_indexed(&http, &ix, &publisher, &log, 0, 0).await;
    publish(&publisher, last + 1, &oversized());
    let (took, _) = publish_until_indexed(&http, &ix, &publisher, &log, last + 2, last + 2).await;
    eprintln!("observed: batches after the oversized frame indexed {took:?} after it");

    let w0 = [("worker", "w0"), ("reason", "frame_too_large")];
    assert_eq!(metric(&http, &ix, "kvmesh_kv_event_limits_total", &w0).await, 1.0);
    assert_eq!(metric(&http, &ix, "kvmesh_kv_resyncs_total", &w0).await, 1.0);
}

/// A ROUTER answering every replay request from `log` (from the asked number on), then the end
/// marker, until `stop`.
fn replay_server(
    ctx: zmq::Context,
    log: Arc<Published>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> (String, std::thread::JoinHandle<usize>) {
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = router.get_last_endpoint().unwrap().unwrap();
    let thread = std::thread::spawn(move || {
        let mut requests = 0;
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if router.poll(zmq::POLLIN, 50).unwrap() == 0 {
                continue;
            }
            let request = router.recv_multipart(0).unwrap();
            requests += 1;
            let id = request[0].clone();
            let start = <[u8; 8]>::try_from(request.last().unwrap().as_slice())
                .map_or(0, u64::from_be_bytes);
            let batches: Vec<(u64, Vec<u8>)> =
                log.lock().unwrap().iter().filter(|(n, _)| *n >= start).cloned().collect();
            for (n, b) in batches {
                router
                    .send_multipart([&id[..], &b""[..], &n.to_be_bytes()[..], &b[..]], 0)
                    .unwrap();
            }
            router.send_multipart([&id[..], &b""[..], &[0xff; 8][..], &b""[..]], 0).unwrap();
        }
        requests
    });
    (endpoint, thread)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_frame_over_the_limit_is_counted_and_later_batches_are_indexed() {
    let dir = tempfile::tempdir().unwrap();
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    // The engine's ring: batch 0, then a batch over the frame bound, before the indexer starts.
    let log = Arc::new(Mutex::new(vec![(0, store(0)), (1, oversized())]));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (replay, server) = replay_server(ctx.clone(), log.clone(), stop.clone());
    let (_ix_proc, ix) = start_indexer(dir.path(), &endpoint, Some(&replay));
    let http = reqwest::Client::new();

    let (took, _) = publish_until_indexed(&http, &ix, &publisher, &log, 2, 2).await;
    eprintln!("observed: live batches after a replay with an oversized frame indexed {took:?} after the first was published");
    let limits = [("worker", "w0"), ("reason", "replay_frame_too_large")];
    assert!(
        metric(&http, &ix, "kvmesh_kv_event_limits_total", &limits).await >= 1.0,
        "the refused replay frame is counted"
    );
    let resyncs = rank(&http, &ix).await["resyncs"].as_u64().unwrap();
    assert!(resyncs >= 1, "the gap the refused batch left resynced the worker");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let requests = server.join().unwrap();
    eprintln!("observed: {requests} replay requests, {resyncs} resyncs");
}
