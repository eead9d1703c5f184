//! A worker that answers every request with 500 while its `/metrics` stays fine looks idle to a
//! load-aware router (it releases its load at once), so without passive health it attracts
//! traffic. One of four simulators fails everything; 200 requests at concurrency 8: after the
//! first few failures it gets at most 5 % of the attempts and at least 95 % of the requests
//! succeed (Envoy retries a 5xx on the next candidate; the failing host is taken out).

use futures::StreamExt;
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const REQUESTS: u64 = 200;
const CONCURRENCY: usize = 8;

/// Upstream attempts Envoy sent to `endpoint` (`/clusters`: `engines::<ip:port>::rq_total::N`).
async fn attempts(stack: &Stack, endpoint: &str) -> anyhow::Result<u64> {
    let text = stack.client().get(stack.admin("/clusters")).send().await?.text().await?;
    let key = format!("engines::{endpoint}::rq_total::");
    Ok(text.lines().find_map(|l| l.strip_prefix(&key)?.trim().parse().ok()).unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fast_failing_worker_stops_attracting_traffic() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(4);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let bad = stack.worker("w3")?;
    let bad_endpoint = bad.http.clone();
    let r = c
        .post(bad.url("/admin/faults"))
        .json(&json!({"fail_next_count": 1_000_000, "fail_next_status": 500}))
        .send()
        .await?;
    assert!(r.status().is_success(), "{}", r.text().await?);
    // Its metrics still answer: the indexer keeps it healthy.
    assert!(c.get(bad.url("/metrics")).send().await?.status().is_success());

    let url = stack.gateway("/v1/completions");
    let statuses: Vec<u16> = futures::stream::iter(0..REQUESTS)
        .map(|i| {
            let (c, url) = (c.clone(), url.clone());
            let body =
                json!({"model": "deepseek-v4", "prompt": filler(500 + i, 80), "max_tokens": 2});
            async move { post_json(&c, &url, &body, &[]).await.map(|r| r.status).unwrap_or(0) }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let ok = statuses.iter().filter(|s| **s == 200).count() as u64;
    let to_bad = attempts(&stack, &bad_endpoint).await?;
    let mut total = 0;
    for w in &stack.workers {
        total += attempts(&stack, &w.http).await?;
    }
    eprintln!(
        "{ok}/{REQUESTS} succeeded; the failing worker got {to_bad} of {total} upstream attempts"
    );
    assert!(ok * 100 >= REQUESTS * 95, "only {ok} of {REQUESTS} requests succeeded");
    assert!(
        to_bad * 100 <= REQUESTS * 5,
        "the failing worker got {to_bad} attempts (> 5 % of {REQUESTS})"
    );
    let ejections = stack.envoy_metrics().await?.sum("kvmesh_filter_endpoint_ejections_total", &[]);
    assert!(ejections >= 1.0, "the filter never ejected the failing endpoint");
    Ok(())
}
