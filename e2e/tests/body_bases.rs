//! Body bases at their edges (issue 43.4), through real Envoy, the indexer and `vllm-sim` prefill
//! and decode workers: a long conversation sent as deltas (each route call carries only the bytes
//! after the body base the indexer named) goes on across an indexer restart, which drops every
//! base — the filter's delta is answered 409 and it sends the whole body again (memo churn,
//! counted) — and every body an engine receives, prefill legs included, is the client's own, field
//! for field byte-identical but for what kvmesh documents it edits. A base named under another
//! session than the one it was kept for is a 409 `body_base_unknown`, never joined.
//!
//! What the engines receive is recorded by a small HTTP/1.1 proxy in front of each simulator (the
//! gateway's stack lists the proxies as its external engines), so both Envoy's upstream requests
//! and the indexer's legs are seen as they leave kvmesh.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvmesh_core::api::{RouteDecision, ROUTE_PATH};
use kvmesh_core::body_base::{BASE_UNKNOWN, BASE_UNKNOWN_STATUS};
use kvmesh_core::headers;
use kvmesh_core::session::{self, SessionSource};
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{EnvoyPolicy, Stack, StackSpec, WorkerSpec};
use kvmesh_e2e::vllm::Engines;
use serde_json::value::RawValue;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A request body an engine received: which worker, and its bytes.
#[derive(Debug, Clone)]
struct Received {
    worker: String,
    body: Vec<u8>,
}

type Log = Arc<Mutex<Vec<Received>>>;

/// Forwards loopback connections to `upstream` and records the body of every POST passing
/// through. Runs until the test's runtime ends.
async fn recording_proxy(worker: String, upstream: String, log: Log) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    tokio::spawn(async move {
        while let Ok((client, _)) = listener.accept().await {
            let (worker, upstream, log) = (worker.clone(), upstream.clone(), log.clone());
            tokio::spawn(async move {
                let Ok(server) = TcpStream::connect(&upstream).await else { return };
                let (mut cr, mut cw) = client.into_split();
                let (mut sr, mut sw) = server.into_split();
                tokio::spawn(async move { tokio::io::copy(&mut sr, &mut cw).await });
                let (mut buf, mut pending) = (vec![0u8; 64 * 1024], Vec::new());
                while let Ok(n) = cr.read(&mut buf).await {
                    if n == 0 || sw.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                    pending.extend_from_slice(&buf[..n]);
                    while let Some((method, body)) = take_request(&mut pending) {
                        if method == "POST" {
                            let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                            log.push(Received { worker: worker.clone(), body });
                        }
                    }
                }
            });
        }
    });
    Ok(addr)
}

/// The first whole HTTP/1.1 request in `buf` (removed from it): its method and body, the body
/// framed by `content-length` or chunked; `None` until it is all there.
fn take_request(buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let method = head.split(' ').next().unwrap_or_default().to_ascii_uppercase();
    let header = |name: &str| {
        head.lines().find_map(|l| l.strip_prefix(name).map(|v| v.trim_start_matches(':').trim()))
    };
    if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        let (mut at, mut body) = (head_end, Vec::new());
        loop {
            let line_end = buf[at..].windows(2).position(|w| w == b"\r\n")? + at;
            let size = std::str::from_utf8(&buf[at..line_end]).ok()?.split(';').next()?;
            let size = usize::from_str_radix(size.trim(), 16).ok()?;
            at = line_end + 2;
            if size == 0 {
                let trailer_end = buf[at..].windows(2).position(|w| w == b"\r\n")? + at;
                buf.drain(..trailer_end + 2);
                return Some((method, body));
            }
            body.extend_from_slice(buf.get(at..at + size)?);
            at += size + 2;
            buf.get(..at)?;
        }
    }
    let len: usize = header("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let body = buf.get(head_end..head_end + len)?.to_vec();
    buf.drain(..head_end + len);
    Some((method, body))
}

/// The top-level fields of a JSON object body, as their raw bytes (the last of a repeated key).
fn fields(body: &[u8]) -> HashMap<String, String> {
    serde_json::from_slice::<HashMap<String, Box<RawValue>>>(body)
        .map(|m| m.into_iter().map(|(k, v)| (k, v.get().to_owned())).collect())
        .unwrap_or_default()
}

/// The fields kvmesh may set, replace or remove in what an engine receives: the filter's
/// `kv_transfer_params` splice on the decode request, and the prefill leg's one-step cut
/// (`sidecar-indexer/src/legs.rs`). Every other field reaches the engine byte for byte.
const EDITED: [&str; 8] = [
    "kv_transfer_params",
    "kv_migration_source",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "min_tokens",
    "min_completion_tokens",
];

/// The client body `received` is (its `messages` bytes name it), if every field of it but the
/// edited ones reached the engine byte-identical and nothing else was added.
fn client_body_of<'c>(received: &[u8], sent: &'c [Vec<u8>]) -> Result<&'c [u8], String> {
    let got = fields(received);
    let messages = got.get("messages").ok_or("no messages")?;
    let client = sent
        .iter()
        .find(|c| fields(c).get("messages") == Some(messages))
        .ok_or("its messages are no client body's, byte for byte")?;
    let want = fields(client);
    for (key, value) in &want {
        if !EDITED.contains(&key.as_str()) && got.get(key) != Some(value) {
            return Err(format!("field {key}: sent {value}, received {:?}", got.get(key)));
        }
    }
    match got.keys().find(|k| !want.contains_key(*k) && !EDITED.contains(&k.as_str())) {
        Some(k) => Err(format!("field {k} added")),
        None => Ok(client),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deltas_across_an_indexer_restart_reach_every_engine_as_the_client_sent_them(
) -> anyhow::Result<()> {
    // The simulators, behind recording proxies; their own stack routes nothing.
    let mut engines_spec = StackSpec::disaggregated(1, 2);
    engines_spec.policy = EnvoyPolicy::RoundRobin;
    let engines = Stack::start(engines_spec).await?;
    let log: Log = Arc::default();
    let mut workers = Vec::new();
    for w in &engines.workers {
        let proxy = recording_proxy(w.id.clone(), w.http.clone(), log.clone()).await?;
        workers.push(WorkerSpec { endpoint: Some(proxy), ..w.external_spec() });
    }
    let mut spec = StackSpec::disaggregated(0, 0);
    spec.workers = workers;
    spec.engines = Engines::External;
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": 8000});
    // Every turn's new text is long enough for a prefill leg: the legs are built from the bodies
    // the indexer joined to its bases.
    spec.routing_toml = "min_remote_prefill_tokens = 64\nprefill_timeout_ms = 5000\n\
                         local_continuations = false\n"
        .into();
    let mut stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");
    let c = stack.client().clone();
    let session = [(headers::DEFAULT_SESSION_HEADER, "deltas")];

    let mut messages: Vec<Value> = vec![json!({"role": "system", "content": filler(1, 2500)})];
    let mut sent: Vec<Vec<u8>> = Vec::new();
    let mut modes = Vec::new();
    for t in 0..6 {
        if t == 3 {
            stack.restart_indexer().await?;
        }
        messages.push(json!({"role": "user", "content": filler(100 + t, 300)}));
        let body = json!({"model": "deepseek-v4", "messages": messages, "max_tokens": 2,
                          "stream": t % 2 == 0, "temperature": 0.5});
        sent.push(serde_json::to_vec(&body)?);
        // A turn that met the restarted indexer before it was back fell back; send it again.
        let r = poll::until("a turn routed by the indexer", || {
            let (c, url, body) = (c.clone(), url.clone(), body.clone());
            async move {
                let r = post_json(&c, &url, &body, &session).await.ok()?;
                assert_eq!(r.status, 200, "turn {t}: {}", r.text);
                r.header(headers::DEBUG_FALLBACK).is_none().then_some(r)
            }
        })
        .await?;
        modes.push(r.mode().unwrap_or("-").to_owned());
        messages.push(json!({"role": "assistant", "content": filler(200 + t, 20)}));
    }
    assert!(modes.iter().any(|m| m == "disagg"), "prefill legs ran: {modes:?}");
    let envoy = stack.envoy_metrics().await?;
    let bodies =
        |result: &str| envoy.sum("kvmesh_filter_route_bodies_total", &[("result", result)]);
    assert!(bodies("delta") >= 4.0, "turns sent as deltas: {}", bodies("delta"));
    assert!(bodies("resent") >= 1.0, "the delta after the restart was refused and resent whole");
    let indexer = stack.scrape(&stack.indexer_url("/metrics")).await?;
    assert!(indexer.sum("kvmesh_body_memo_total", &[("result", "base_unknown")]) >= 1.0);
    assert!(indexer.sum("kvmesh_body_memo_total", &[("result", "base_hit")]) >= 1.0);

    // Every body an engine received is a client's, and every client body reached a decode worker.
    let received = log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let mut reached = vec![(0usize, 0usize); sent.len()];
    for r in &received {
        let client = client_body_of(&r.body, &sent).map_err(|e| {
            anyhow::anyhow!("{} received a body that is not the client's: {e}", r.worker)
        })?;
        let turn = sent.iter().position(|s| s.as_slice() == client).unwrap_or_default();
        if r.worker.starts_with('p') {
            reached[turn].0 += 1;
        } else {
            reached[turn].1 += 1;
        }
    }
    for (t, (legs, decodes)) in reached.iter().enumerate() {
        assert!(*decodes >= 1, "turn {t} reached no decode worker");
        if modes[t] == "disagg" {
            assert!(*legs >= 1, "turn {t} was disagg without a prefill leg on record");
        }
    }
    assert!(reached[3..].iter().any(|(legs, _)| *legs > 0), "legs after the restart: {modes:?}");

    // A base belongs to the session it was kept for: named under another, it is unknown.
    let route = |session_key: &str, body: Vec<u8>, base: Option<String>| {
        let (c, url) = (c.clone(), stack.indexer_url(ROUTE_PATH));
        let key = session::from_header_value(session_key);
        async move {
            let mut req = c
                .post(url)
                .header(headers::KVMESH_PATH, "/v1/chat/completions")
                .header(headers::KVMESH_SESSION, session::encode_header(key, SessionSource::Header))
                .header("content-type", "application/json");
            if let Some(base) = base {
                req = req.header(headers::KVMESH_BODY_BASE, base);
            }
            let r = req.body(body).send().await?;
            anyhow::Ok((r.status().as_u16(), r.bytes().await?.to_vec()))
        }
    };
    let long = |turns: usize| {
        let mut m = vec![json!({"role": "system", "content": filler(7, 2500)})];
        for t in 0..turns {
            m.push(json!({"role": "user", "content": filler(300 + t as u64, 30)}));
        }
        serde_json::to_vec(&json!({"model": "deepseek-v4", "messages": m, "max_tokens": 2}))
    };
    let (first, second) = (long(1)?, long(2)?);
    let (status, answer) = route("alice", first, None).await?;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    let base = serde_json::from_slice::<RouteDecision>(&answer)?.body_base.expect("a base named");
    let delta = second.get(base.len..).unwrap_or_default().to_vec();
    let before = indexer_memo(&stack, "base_other_session").await?;
    let (status, answer) = route("mallory", delta.clone(), Some(base.to_string())).await?;
    assert_eq!(status, BASE_UNKNOWN_STATUS, "{}", String::from_utf8_lossy(&answer));
    let err: kvmesh_core::api::ErrorBody = serde_json::from_slice(&answer)?;
    assert_eq!(err.error.reason.as_deref(), Some(BASE_UNKNOWN));
    assert_eq!(indexer_memo(&stack, "base_other_session").await? - before, 1.0);
    // Its own session still continues it (the refusal left it held).
    let (status, answer) = route("alice", delta, Some(base.to_string())).await?;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&answer));
    drop(engines);
    Ok(())
}

async fn indexer_memo(stack: &Stack, result: &str) -> anyhow::Result<f64> {
    let m = stack.scrape(&stack.indexer_url("/metrics")).await?;
    Ok(m.sum("kvmesh_body_memo_total", &[("result", result)]))
}
