//! A flood of near-8 MiB bodies beside a trickle of small chats. Bodies are buffered whole (the
//! filter reads them), so concurrency × body size is memory: without a bound, some tens of large
//! requests take Envoy past its container limit and an OOM kill cuts every stream on the replica.
//! Every shipped Envoy config has an overload manager (a fixed heap budget: reset the streams
//! holding the most buffer from 80 %, shrink the heap past 90 %, answer new requests 503 at once
//! past 95 %). 64 clients send bodies of 8 MiB − 2 KiB (one
//! in eight starts with one just over the limit: 413) for `FLOOD` while a client sends a small chat
//! every 100 ms: Envoy's RSS (sampled from /proc) stays below its limit (budget and limit scaled
//! down for this machine, see `ENVOY_LIMIT`), the indexer's below its Kubernetes limit, neither
//! restarts, ≥ 99 % of the small chats succeed, and every flood request ends in 200, 413 or 503 —
//! none hangs (each has a client deadline).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvmesh_e2e::client::{chat_body, filler, post_raw};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

/// The figures: 64 concurrent clients for 30 s.
const CLIENTS: usize = 64;
const FLOOD: Duration = Duration::from_secs(30);
/// Bounds the work whatever the machine's speed: at most this many requests per flood client.
const MAX_PER_CLIENT: u64 = 12;
/// A flood request that takes longer than this hangs.
const HANG: Duration = Duration::from_secs(60);
const MAX_BODY: usize = 8 << 20;
/// Envoy's memory limit in this test and the heap budget it runs with. Shipped: a 768 MiB budget
/// for a 1 GiB container. This 2-core machine gets through far fewer large bodies at a time than a
/// gateway node (about 470 MiB peak RSS without an overload manager, well under 1 GiB), so budget
/// and limit are scaled down until the flood would cross the limit without one.
const ENVOY_LIMIT: u64 = 384 << 20;
const ENVOY_HEAP_BUDGET: u64 = 160 << 20;
/// The indexer's Kubernetes limit (envoy/k8s/deployment.yaml).
const INDEXER_LIMIT: u64 = 4 << 30;

fn rss_bytes(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// A completions body of exactly `len` bytes: a short prompt, the bulk in the OpenAI `user` field.
fn large_body(i: u64, len: usize) -> Vec<u8> {
    let head =
        json!({"model": "deepseek-v4", "prompt": filler(i, 20), "max_tokens": 1, "user": ""})
            .to_string();
    let pad = len.saturating_sub(head.len());
    let mut body = head.into_bytes();
    body.truncate(body.len() - 2); // `"}` of the empty user
    body.extend(std::iter::repeat_n(b'u', pad));
    body.extend_from_slice(b"\"}");
    body
}

// Not in `make test` yet (issue 43 T2 stays open): on a loaded 2-core machine one run peaked at
// 457 MiB RSS against the 384 MiB limit with 6 of 222 small chats answered 503. The heap monitor
// does not see the wasm VMs' linear memory, which grows with the bodies a VM holds and never
// shrinks, and `stop_accepting_requests` turns small chats away with the flood. Run it with
// `cargo test -p kvmesh-e2e --test body_flood -- --ignored`.
#[ignore = "issue 43 T2: Envoy's RSS is not bounded by the heap budget alone (wasm VM memory)"]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_large_bodies_stays_within_memory_limits() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    spec.envoy_limits.max_heap_bytes = ENVOY_HEAP_BUDGET;
    let mut stack = Stack::start(spec).await?;
    let envoy_pid =
        stack.envoy.as_ref().map(|p| p.pid()).ok_or_else(|| anyhow::anyhow!("no envoy"))?;
    let indexer_pid =
        stack.indexer.as_ref().map(|p| p.pid()).ok_or_else(|| anyhow::anyhow!("no indexer"))?;

    let stop = Arc::new(AtomicBool::new(false));
    let (envoy_peak, indexer_peak) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let sampler = {
        let (stop, ep, ip) = (stop.clone(), envoy_peak.clone(), indexer_peak.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                ep.fetch_max(rss_bytes(envoy_pid).unwrap_or(0), Ordering::Relaxed);
                ip.fetch_max(rss_bytes(indexer_pid).unwrap_or(0), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };

    let url = stack.gateway("/v1/completions");
    let chat_url = stack.gateway("/v1/chat/completions");
    let started = Instant::now();
    let trickle = {
        let (stop, url) = (stop.clone(), chat_url.clone());
        tokio::spawn(async move {
            let c = reqwest::Client::builder().timeout(HANG).build()?;
            let (mut ok, mut sent, mut failures) = (0u64, 0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let body = serde_json::to_vec(&chat_body(
                    &[("user".into(), filler(50_000 + sent, 30))],
                    2,
                ))?;
                sent += 1;
                match post_raw(&c, &url, body, &[]).await {
                    Ok(r) if r.status == 200 => ok += 1,
                    Ok(r) => failures.push(r.status.to_string()),
                    Err(e) => failures.push(e.to_string()),
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok::<_, anyhow::Error>((ok, sent, failures))
        })
    };

    let flood: Vec<(u16, Duration)> = futures::stream::iter(0..CLIENTS as u64)
        .map(|client| {
            let url = url.clone();
            async move {
                let c = reqwest::Client::builder().timeout(HANG).build().ok();
                let mut out = Vec::new();
                for n in 0..MAX_PER_CLIENT {
                    if started.elapsed() >= FLOOD {
                        break;
                    }
                    // One client in eight starts with a body just over the limit.
                    let len =
                        if client % 8 == 7 && n == 0 { MAX_BODY + 1 } else { MAX_BODY - 2048 };
                    let t = Instant::now();
                    let status = match &c {
                        Some(c) => post_raw(c, &url, large_body(client * 100 + n, len), &[])
                            .await
                            .map(|r| r.status)
                            .unwrap_or(0),
                        None => 0,
                    };
                    out.push((status, t.elapsed()));
                }
                out
            }
        })
        .buffer_unordered(CLIENTS)
        .flat_map(futures::stream::iter)
        .collect()
        .await;
    stop.store(true, Ordering::Relaxed);
    let (ok, sent, failures) = trickle.await??;
    sampler.await?;

    let mut by_status = std::collections::BTreeMap::<u16, (u64, Duration)>::new();
    for (s, d) in &flood {
        let e = by_status.entry(*s).or_default();
        e.0 += 1;
        e.1 = e.1.max(*d);
    }
    let (ep, ip) = (envoy_peak.load(Ordering::Relaxed), indexer_peak.load(Ordering::Relaxed));
    eprintln!(
        "flood: {} requests in {:?}, by status (count, slowest): {by_status:?}; small chats {ok}/{sent} ok \
         (failures {failures:?}); peak RSS envoy {} MiB, indexer {} MiB",
        flood.len(),
        started.elapsed(),
        ep >> 20,
        ip >> 20
    );
    let envoy = stack.envoy.as_mut().ok_or_else(|| anyhow::anyhow!("no envoy"))?;
    assert!(
        envoy.is_running() && envoy.pid() == envoy_pid,
        "Envoy restarted or died:\n{}",
        envoy.log_tail(40)
    );
    let indexer = stack.indexer.as_mut().ok_or_else(|| anyhow::anyhow!("no indexer"))?;
    assert!(indexer.is_running(), "the indexer died:\n{}", indexer.log_tail(40));
    assert!(
        ep < ENVOY_LIMIT,
        "Envoy's RSS peaked at {} MiB, over its {} MiB limit",
        ep >> 20,
        ENVOY_LIMIT >> 20
    );
    assert!(ip < INDEXER_LIMIT, "the indexer's RSS peaked at {} MiB", ip >> 20);
    assert!(ok * 100 >= sent * 99, "only {ok} of {sent} small chats succeeded: {failures:?}");
    let bad: Vec<_> = by_status.keys().filter(|s| ![200, 413, 503].contains(*s)).collect();
    assert!(bad.is_empty(), "flood requests ended otherwise (0 = hung or reset): {by_status:?}");
    Ok(())
}
