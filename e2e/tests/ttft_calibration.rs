//! The filter measures every streamed request's time to first token and sets it beside the
//! indexer's prediction, in real Envoy: each streamed answer carries the prediction as a debug
//! header, each lands once in the measured, predicted and ratio histograms on
//! `/stats/prometheus`, and non-streamed answers (whose first byte follows their last token) land
//! in none of them. Counts only: how fast anything was is the benchmark's business.

use kvmesh_core::headers;
use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const STREAMED: usize = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_requests_record_measured_and_predicted_ttft() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    // Every streamed request must carry the indexer's prediction, so none may fall back on the
    // route deadline: a debug indexer on a loaded 2-core CI machine can exceed the default 100 ms.
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": 5000});
    let stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");
    let counts = |m: &kvmesh_e2e::prom::Metrics| {
        [
            "kvmesh_filter_ttft_milliseconds_count",
            "kvmesh_filter_ttft_predicted_milliseconds_count",
            "kvmesh_filter_ttft_ratio_permille_count",
        ]
        .map(|name| m.sum(name, &[]))
    };
    let before = counts(&stack.envoy_metrics().await?);

    for i in 0..STREAMED as u64 {
        let mut body = chat_body(
            &[("system".into(), filler(1, 200)), ("user".into(), filler(100 + i, 40))],
            4,
        );
        body["stream"] = json!(true);
        let r = post_json(stack.client(), &url, &body, &[]).await?;
        assert_eq!(r.status, 200, "{}", r.text);
        let predicted: f64 =
            r.header(headers::DEBUG_PREDICTED_TTFT).unwrap_or_default().parse().map_err(|e| {
                anyhow::anyhow!(
                    "request {i}: no usable {} header: {e}",
                    headers::DEBUG_PREDICTED_TTFT
                )
            })?;
        assert!(predicted.is_finite() && predicted >= 0.0, "request {i}: predicted {predicted}");
    }
    // Not streamed: no sample.
    let r =
        post_json(stack.client(), &url, &chat_body(&[("user".into(), filler(999, 40))], 4), &[])
            .await?;
    assert_eq!(r.status, 200, "{}", r.text);

    // Samples are recorded by the Envoy worker threads; the admin endpoint sees them on its next flush.
    let want = STREAMED as f64;
    let admin = stack.admin("/stats/prometheus");
    let got = poll::until("one TTFT sample per streamed request", || {
        let (client, admin) = (stack.client().clone(), admin.clone());
        async move {
            let text = client.get(&admin).send().await.ok()?.text().await.ok()?;
            let after = counts(&kvmesh_e2e::prom::Metrics::parse(&text).ok()?);
            let delta = [after[0] - before[0], after[1] - before[1], after[2] - before[2]];
            (delta[0] >= want).then_some(delta)
        }
    })
    .await?;
    assert_eq!(
        got, [want; 3],
        "measured, predicted and ratio samples: one each per streamed request, none for the rest"
    );
    Ok(())
}
