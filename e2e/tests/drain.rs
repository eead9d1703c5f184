//! Rollouts must not cut streams. Envoy exits at once on SIGTERM, so the gateway drains first:
//! `kvmesh-stack` on SIGTERM (and the Kubernetes preStop hook) asks Envoy for a graceful listener
//! drain, waits until no request is active (bounded), then stops it. 20 long streaming requests
//! in flight when the drain starts all complete.

use std::time::Duration;

use futures::StreamExt;
use kvmesh_e2e::client::filler;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const STREAMS: u64 = 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_lets_every_stream_finish() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    // Real-time decoding: 80 tokens at 20 ms each keep every stream open well into the drain.
    spec.sim_args = vec!["--itl-ms".into(), "20".into(), "--speedup".into(), "1".into()];
    let mut stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/completions");

    let (started_tx, mut started_rx) = tokio::sync::mpsc::channel::<()>(STREAMS as usize);
    let mut streams = Vec::new();
    for i in 0..STREAMS {
        // A client per stream: a connection per stream, as separate clients of a gateway have.
        let c = reqwest::Client::new();
        let (url, started) = (url.clone(), started_tx.clone());
        let body = json!({"model": "deepseek-v4", "prompt": filler(3000 + i, 60), "max_tokens": 80, "stream": true});
        streams.push(tokio::spawn(async move {
            let resp = c.post(&url).json(&body).send().await?;
            anyhow::ensure!(resp.status() == 200, "stream {i}: status {}", resp.status());
            let mut text = Vec::new();
            let mut chunks = resp.bytes_stream();
            let mut first = true;
            while let Some(chunk) = chunks.next().await {
                text.extend_from_slice(&chunk?);
                if std::mem::take(&mut first) {
                    let _ = started.send(()).await;
                }
            }
            Ok::<String, anyhow::Error>(String::from_utf8(text)?)
        }));
    }
    for _ in 0..STREAMS {
        started_rx
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("a stream ended before its first chunk"))?;
    }

    // Every stream is mid-flight: drain (what SIGTERM to kvmesh-stack runs).
    let still_active = stack.drain_envoy(Duration::from_secs(60)).await?;
    assert_eq!(still_active, 0, "the drain gave up with requests still active");
    for (i, s) in streams.into_iter().enumerate() {
        let text = s.await??;
        assert!(
            text.trim_end().ends_with("data: [DONE]"),
            "stream {i} was cut:\n{}",
            &text[text.len().saturating_sub(300)..]
        );
    }
    // The gateway is gone afterwards: no new request is accepted.
    let after = reqwest::Client::new()
        .post(&url)
        .json(&json!({"prompt": "x", "max_tokens": 1}))
        .send()
        .await;
    assert!(
        after.is_err(),
        "Envoy still accepts requests after the drain: {:?}",
        after.map(|r| r.status())
    );
    Ok(())
}
