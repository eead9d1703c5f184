//! A client's `x-request-id` that is not visible ASCII (UTF-8 from a client that puts a user name
//! in it) must not cost that client its KV routing. The indexer reads its headers as visible ASCII
//! and answered such a route call 400, so every request of that client fell back. The filter now
//! names the request by the id's percent-encoding in its logs, the route call and the done report
//! (counted as `kvmesh_filter_request_ids_encoded_total`); the engine gets the client's header.

use kvmesh_core::headers;
use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const IDS: [&str; 3] = ["café-7", "ユーザー-42", "plain-ascii-id"];
/// How many of [`IDS`] are not visible ASCII.
const ENCODED: f64 = 2.0;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_id_that_is_not_ascii_is_still_routed_by_kv() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    let stack = &Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");
    for (i, id) in IDS.iter().enumerate() {
        let body = chat_body(&[("user".to_owned(), filler(40 + i as u64, 60))], 2);
        let r = post_json(stack.client(), &url, &body, &[(headers::REQUEST_ID, id)]).await?;
        eprintln!(
            "x-request-id {id:?}: {} mode={:?} fallback={:?}",
            r.status,
            r.mode(),
            r.header(headers::DEBUG_FALLBACK)
        );
        assert_eq!(r.status, 200, "{id:?}: {}", r.text);
        assert!(
            r.mode().is_some() && r.header(headers::DEBUG_FALLBACK).is_none(),
            "{id:?}: not routed by the indexer (fallback {:?})",
            r.header(headers::DEBUG_FALLBACK)
        );
    }
    let indexer = stack.scrape(&stack.indexer_url("/metrics")).await?;
    assert_eq!(indexer.sum("kvmesh_decisions_total", &[]), IDS.len() as f64);
    assert_eq!(indexer.sum("kvmesh_bad_requests_total", &[]), 0.0);
    poll::until("the filter's count of encoded request ids", || async move {
        let m = stack.envoy_metrics().await.ok()?;
        let n = m.sum("kvmesh_filter_request_ids_encoded_total", &[]);
        (n == ENCODED).then_some(())
    })
    .await?;
    // The done reports carry the same names: every booking is released.
    poll::until("every booking released", || async move {
        let m = stack.scrape(&stack.indexer_url("/metrics")).await.ok()?;
        (m.sum("kvmesh_worker_active_requests", &[]) == 0.0).then_some(())
    })
    .await?;
    Ok(())
}
