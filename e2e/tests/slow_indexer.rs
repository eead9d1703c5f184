//! A slow but answering indexer: every answer (route, fleet, done) arrives after 80 % of the
//! filter's `indexer_timeout_ms`. Each route call is bounded by that deadline (Envoy cancels the
//! call at `indexer_timeout_ms`; an answer after it is a `timeout` fallback), so a request's added
//! latency is at most the deadline. The breaker counts only calls without an answer: slow answers
//! keep it closed (a wedged indexer is `hung_indexer.rs`), so every request pays the slow answer —
//! the operator's signal is the route-latency histogram, not fallbacks (filter/README.md). 60
//! requests at concurrency 6 are all served, decided by the indexer, the breaker never opens.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::procs::free_port;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const REQUESTS: u64 = 60;
const CONCURRENCY: usize = 6;
const TIMEOUT_MS: u64 = 500;
/// 80 % of the deadline.
const DELAY: Duration = Duration::from_millis(TIMEOUT_MS * 8 / 10);

/// A TCP relay that holds every chunk the indexer sends for `DELAY` before passing it on: each
/// answer arrives `DELAY` late, requests go through at once.
async fn slow_relay(listener: TcpListener, upstream: String, delayed: Arc<AtomicU64>) {
    while let Ok((client, _)) = listener.accept().await {
        let (upstream, delayed) = (upstream.clone(), delayed.clone());
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(&upstream).await else { return };
            let (mut cr, mut cw) = client.into_split();
            let (mut sr, mut sw) = server.into_split();
            let up = tokio::spawn(async move { tokio::io::copy(&mut cr, &mut sw).await });
            let mut buf = vec![0u8; 64 << 10];
            while let Ok(n) = sr.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                tokio::time::sleep(DELAY).await;
                delayed.fetch_add(1, Ordering::Relaxed);
                if cw.write_all(&buf[..n]).await.is_err() {
                    break;
                }
            }
            up.abort();
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_indexer_bounds_each_request_and_keeps_the_breaker_closed() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(3);
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": TIMEOUT_MS, "breaker_failures": 5, "breaker_open_ms": 500});
    let mut stack = Stack::start(spec).await?;
    // Envoy keeps calling the indexer's port; the relay takes it over and the indexer moves.
    let envoy_side = stack.indexer_port;
    stack.kill_indexer();
    let listener = TcpListener::bind(("127.0.0.1", envoy_side)).await?;
    stack.indexer_port = free_port()?;
    stack.start_indexer().await?;
    let delayed = Arc::new(AtomicU64::new(0));
    let relay = tokio::spawn(slow_relay(
        listener,
        format!("127.0.0.1:{}", stack.indexer_port),
        delayed.clone(),
    ));

    let c = stack.client().clone();
    let url = stack.gateway("/v1/completions");
    let replies: Vec<_> = futures::stream::iter(0..REQUESTS)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            let body =
                json!({"model": "deepseek-v4", "prompt": filler(900 + i, 60), "max_tokens": 2});
            async move { post_json(&c, &url, &body, &[]).await }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    relay.abort();
    let mut decided = 0;
    let mut fallbacks = Vec::new();
    for r in replies {
        let r = r?;
        assert_eq!(r.status, 200, "{}", r.text);
        match r.header(headers::DEBUG_FALLBACK) {
            None => decided += 1,
            Some(f) => fallbacks.push(f.to_owned()),
        }
    }
    let m = stack.envoy_metrics().await?;
    let opened = m.sum("kvmesh_filter_breaker_transitions_total", &[("state", "open")]);
    let delayed = delayed.load(Ordering::Relaxed);
    let timeouts = m.sum("kvmesh_filter_fallbacks_total", &[("reason", "timeout")]);
    eprintln!(
        "{decided}/{REQUESTS} decided by the indexer, fallbacks {fallbacks:?}; breaker openings \
         {opened}; {delayed} indexer answers held {DELAY:?}; timeout fallbacks {timeouts}"
    );
    assert!(
        delayed >= decided,
        "the relay did not slow the answers: {delayed} held for {decided} decided requests"
    );
    assert_eq!(opened, 0.0, "slow answers opened the breaker");
    assert!(
        decided * 10 >= REQUESTS * 9,
        "only {decided} of {REQUESTS} decided by a slow (in-deadline) indexer: {fallbacks:?}"
    );
    Ok(())
}
