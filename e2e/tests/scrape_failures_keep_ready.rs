//! Scrapes failing on every worker (slow `/metrics` at peak, an mTLS change) make every worker
//! unhealthy in the indexer's eyes, so its route calls answer 503 `no_decode_worker` — yet the
//! engines serve and the filter's fallback routes every request. Readiness must say "this gateway
//! can route", not "every engine is healthy": otherwise every gateway replica leaves its Service at
//! once. The probes checked are the ones `envoy/k8s/deployment.yaml` gives its containers.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use kvmesh_core::headers;
use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::manifests::probe_path;
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const CHATS: u64 = 50;
const CONCURRENCY: usize = 5;

/// The readiness probes the manifests use, as URLs of this stack: Envoy's on its admin port, the
/// indexer's on its listener.
fn readiness_urls(stack: &Stack) -> anyhow::Result<Vec<String>> {
    Ok(vec![
        stack.admin(&probe_path("envoy", "readinessProbe")?),
        stack.indexer_url(&probe_path("indexer", "readinessProbe")?),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_scrapes_on_every_worker_keep_the_gateway_ready_and_serving() -> anyhow::Result<()>
{
    let mut spec = StackSpec::aggregate(3);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let probes = readiness_urls(&stack)?;
    for url in &probes {
        let r = c.get(url).send().await?;
        assert_eq!(r.status(), 200, "{url} before the fault: {}", r.text().await?);
    }

    for w in &stack.workers {
        let r = c
            .post(w.url("/admin/faults"))
            .json(&json!({"fail_metrics_status": 503}))
            .send()
            .await?;
        assert!(r.status().is_success(), "{}: {}", w.id, r.text().await?);
    }
    // The indexer sees every worker unhealthy.
    poll::until("every worker unhealthy in /v1/fleet", || {
        let (c, url) = (c.clone(), stack.indexer_url("/v1/fleet"));
        async move {
            let fleet: serde_json::Value = c.get(&url).send().await.ok()?.json().await.ok()?;
            let workers = fleet["workers"].as_array()?;
            (!workers.is_empty() && workers.iter().all(|w| w["healthy"] == false)).then_some(())
        }
    })
    .await?;

    // Probe as the kubelet does, all along the chats.
    let (stop, not_ready) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
    let probes_seen = Arc::new(AtomicU64::new(0));
    let prober = {
        let (c, stop, not_ready, seen, probes) =
            (c.clone(), stop.clone(), not_ready.clone(), probes_seen.clone(), probes.clone());
        tokio::spawn(async move {
            let mut last_failure = None;
            while !stop.load(Ordering::Relaxed) {
                for url in &probes {
                    let status = c.get(url).send().await.map(|r| r.status().as_u16()).unwrap_or(0);
                    seen.fetch_add(1, Ordering::Relaxed);
                    if status != 200 {
                        not_ready.fetch_add(1, Ordering::Relaxed);
                        last_failure = Some(format!("{url}: {status}"));
                    }
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            last_failure
        })
    };

    let url = stack.gateway("/v1/chat/completions");
    let replies: Vec<_> = futures::stream::iter(0..CHATS)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            let body = chat_body(&[("user".into(), filler(7000 + i, 40))], 4);
            async move { post_json(&c, &url, &body, &[]).await }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    stop.store(true, Ordering::Relaxed);
    let last_failure = prober.await?;

    let mut served = 0;
    let mut fallbacks = 0;
    for r in replies {
        let r = r?;
        assert_eq!(r.status, 200, "{}", r.text);
        if r.worker().is_some() {
            served += 1;
        }
        if r.header(headers::DEBUG_FALLBACK).is_some_and(|f| f.contains("no_decode_worker")) {
            fallbacks += 1;
        }
    }
    let (not_ready, seen) =
        (not_ready.load(Ordering::Relaxed), probes_seen.load(Ordering::Relaxed));
    eprintln!(
        "{served}/{CHATS} chats answered by an engine ({fallbacks} routed by the filter's \
         fallback after no_decode_worker); readiness probes: {not_ready} of {seen} not ready"
    );
    assert_eq!(served, CHATS, "every chat must be answered by an engine");
    assert!(fallbacks > 0, "the fault did not reach the route calls: nothing fell back");
    assert_eq!(
        not_ready, 0,
        "a readiness probe failed while the gateway could route: {last_failure:?}"
    );
    Ok(())
}
