//! A hung indexer (SIGSTOP: it holds its socket and never answers) must not slow every request by
//! the route deadline nor pile up connections. The filter's per-thread breaker opens after a few
//! unanswered calls and requests skip the call (counted as `breaker_open` fallbacks); Envoy's
//! circuit breaker on `kvmesh_indexer` bounds the connections; after SIGCONT the half-open probe
//! closes the breaker and precise routing resumes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::procs::Paused;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const REQUESTS: u64 = 300;
const CONCURRENCY: usize = 50;
/// Envoy's bound on connections (and pending calls) to the indexer in this test: below the
/// concurrency, so an unbounded cluster would show more.
const MAX_INDEXER_CONNECTIONS: u32 = 16;
/// Envoy's documented bound on `upstream_cx_active` under a max_connections breaker: the limit plus
/// one connection per endpoint and connection pool (one pool per worker thread; the harness runs
/// Envoy with `--concurrency 2` and the indexer cluster has one endpoint).
const ENVOY_CX_BOUND: u32 = MAX_INDEXER_CONNECTIONS + 2;

/// `cluster.kvmesh_indexer.<stat>` from Envoy's admin `/stats`.
async fn indexer_cluster_stat(c: &reqwest::Client, admin: &str, stat: &str) -> Option<u64> {
    let text = c
        .get(format!("{admin}/stats?filter=^cluster\\.kvmesh_indexer\\.{stat}$"))
        .send()
        .await
        .ok()?
        .text()
        .await
        .ok()?;
    text.lines().find_map(|l| l.split_once(": ").and_then(|(_, v)| v.trim().parse().ok()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_indexer_trips_the_breaker_and_routing_resumes() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(3);
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": 100, "breaker_failures": 5, "breaker_open_ms": 500});
    spec.indexer_max_connections = MAX_INDEXER_CONNECTIONS;
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/completions");
    let admin = stack.admin("");
    let body = |i: u64| json!({"model": "deepseek-v4", "prompt": filler(i, 60), "max_tokens": 2});

    // Routed by the indexer while it is well.
    let r = post_json(&c, &url, &body(0), &[]).await?;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(
        r.header(headers::DEBUG_FALLBACK).is_none(),
        "fallback before the hang: {:?}",
        r.header(headers::DEBUG_FALLBACK)
    );

    let pid =
        stack.indexer.as_ref().map(|p| p.pid()).ok_or_else(|| anyhow::anyhow!("no indexer"))?;
    // Resumed when dropped, so a failing test still tears down cleanly.
    let paused = Paused::stop(pid)?;

    // Sample the connections to the indexer while the burst runs.
    let max_active = Arc::new(AtomicU64::new(0));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (c, admin, max_active, done) =
            (c.clone(), admin.clone(), Arc::clone(&max_active), Arc::clone(&done));
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Some(n) = indexer_cluster_stat(&c, &admin, "upstream_cx_active").await {
                    max_active.fetch_max(n, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    let statuses: Vec<anyhow::Result<u16>> = futures::stream::iter(1..=REQUESTS)
        .map(|i| {
            let (c, url, b) = (c.clone(), url.clone(), body(i));
            async move { Ok(post_json(&c, &url, &b, &[]).await?.status) }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    done.store(true, Ordering::Relaxed);
    sampler.await?;
    let failed: Vec<String> = statuses
        .iter()
        .filter_map(|s| match s {
            Ok(200) => None,
            Ok(s) => Some(s.to_string()),
            Err(e) => Some(e.to_string()),
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} of {REQUESTS} requests failed with the indexer hung: {failed:?}",
        failed.len()
    );

    let m = stack.envoy_metrics().await?;
    let opened = m.sum("kvmesh_filter_breaker_transitions_total", &[("state", "open")]);
    let skipped = m.sum("kvmesh_filter_fallbacks_total", &[("reason", "breaker_open")]);
    let waited = m.sum("kvmesh_filter_fallbacks_total", &[("reason", "timeout")])
        + m.sum("kvmesh_filter_fallbacks_total", &[("reason", "reset")]);
    eprintln!("breaker openings {opened}, calls skipped {skipped}, calls that waited for the deadline {waited}, max indexer connections {}", max_active.load(Ordering::Relaxed));
    assert!(opened >= 1.0, "the breaker never opened");
    assert!(
        skipped >= (REQUESTS / 2) as f64,
        "only {skipped} of {REQUESTS} requests skipped the hung indexer"
    );
    let max_active = max_active.load(Ordering::Relaxed);
    assert!(
        max_active <= u64::from(ENVOY_CX_BOUND),
        "{max_active} connections to the hung indexer (breaker {MAX_INDEXER_CONNECTIONS}, Envoy's bound {ENVOY_CX_BOUND})"
    );

    // Resumed: within about one open window a probe closes the breaker and the indexer routes again.
    paused.resume();
    let resumed = Instant::now();
    let mut i = 10_000;
    poll::until("routing by the indexer resumes after SIGCONT", || {
        i += 1;
        let (c, url, b) = (c.clone(), url.clone(), body(i));
        async move {
            let r = post_json(&c, &url, &b, &[]).await.ok()?;
            (r.status == 200 && r.header(headers::DEBUG_FALLBACK).is_none()).then_some(())
        }
    })
    .await?;
    eprintln!("routing resumed {:?} after SIGCONT", resumed.elapsed());
    let m = stack.envoy_metrics().await?;
    assert!(
        m.sum("kvmesh_filter_breaker_transitions_total", &[("state", "closed")]) >= 1.0,
        "the breaker never closed"
    );

    // Nothing booked during the hang stays booked.
    let fleet_url = stack.indexer_url(kvmesh_core::api::FLEET_PATH);
    poll::until("every worker's active_requests back to 0 after the hang", || {
        let (c, url) = (c.clone(), fleet_url.clone());
        async move {
            let f: kvmesh_core::api::FleetSnapshot =
                c.get(&url).send().await.ok()?.json().await.ok()?;
            f.workers.iter().all(|w| w.load.active_requests == 0).then_some(())
        }
    })
    .await?;
    Ok(())
}
