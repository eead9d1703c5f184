//! Streaming responses pass through chunk by chunk, and `/v1/done` reaches the indexer both for
//! finished and for client-aborted streams, so the load it booked returns to zero.

use futures::StreamExt;
use kvmesh_core::api::FleetSnapshot;
use kvmesh_e2e::client::{filler, SIM_WORKER};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_pass_through_and_load_is_released() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    // Real-time decoding (20 ms per token) so a stream is observably incremental.
    spec.sim_args = vec!["--itl-ms".into(), "20".into(), "--speedup".into(), "1".into()];
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let body =
        json!({"model": "deepseek-v4", "prompt": filler(7, 100), "max_tokens": 12, "stream": true});

    // Through the gateway.
    let resp = c.post(stack.gateway("/v1/completions")).json(&body).send().await?;
    assert_eq!(resp.status(), 200);
    let worker =
        resp.headers().get(SIM_WORKER).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let mut pieces = 0;
    let mut via_gateway = Vec::new();
    let mut stream = resp.bytes_stream();
    while let Some(chunk) = stream.next().await {
        via_gateway.extend_from_slice(&chunk?);
        pieces += 1;
    }
    let text = String::from_utf8(via_gateway)?;
    assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
    assert!(pieces >= 6, "the stream arrived in {pieces} pieces: buffered, not streamed");

    // The same request straight to that worker gives the same events (ids and timestamps aside).
    let direct = c
        .post(stack.worker(&worker)?.url("/v1/completions"))
        .json(&body)
        .send()
        .await?
        .text()
        .await?;
    assert_eq!(sse_texts(&text), sse_texts(&direct), "the gateway changed the stream");

    // A client that goes away mid-stream.
    let long = json!({"model": "deepseek-v4", "prompt": filler(8, 100), "max_tokens": 2000, "stream": true});
    let resp = c.post(stack.gateway("/v1/completions")).json(&long).send().await?;
    let mut stream = resp.bytes_stream();
    let _first = stream.next().await;
    drop(stream);

    let fleet_url = stack.indexer_url("/v1/fleet");
    poll::until("indexer load back to zero", || {
        let c = c.clone();
        let url = fleet_url.clone();
        async move {
            let f: FleetSnapshot = c.get(&url).send().await.ok()?.json().await.ok()?;
            f.workers.iter().all(|w| w.load.active_requests == 0).then_some(())
        }
    })
    .await?;
    let m = stack.scrape(&stack.indexer_url("/metrics")).await?;
    assert!(
        m.sum("kvmesh_done_reports_total", &[("outcome", "success")]) >= 1.0,
        "finished stream not reported"
    );
    assert!(
        m.sum("kvmesh_done_reports_total", &[("outcome", "aborted")]) >= 1.0,
        "aborted stream not reported"
    );
    Ok(())
}

/// The generated text of each SSE event, in order.
fn sse_texts(body: &str) -> Vec<String> {
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .map(|v| {
            v.pointer("/choices/0/text").and_then(|t| t.as_str()).unwrap_or_default().to_owned()
        })
        .collect()
}
