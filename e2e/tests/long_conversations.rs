//! A long conversation through real Envoy: after its first turn, each route call carries only the
//! turn's new bytes, after the body base the indexer named (`kvmesh_core::body_base`; the filter
//! remembers it in Envoy's shared data, whichever worker thread takes the turn), and routes as the
//! whole body would. A restarted indexer holds no base: the filter's delta is answered 409 and it
//! sends the whole body again, and the turn is still routed by the indexer, not the fallback.

use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_conversations_turns_send_only_their_new_bytes() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    let mut stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");
    let c = stack.client().clone();
    let session = [(headers::DEFAULT_SESSION_HEADER, "long-conversation")];
    let mut messages: Vec<Value> = vec![json!({"role": "system", "content": filler(1, 2500)})];
    let turn = |messages: &mut Vec<Value>, t: usize| {
        messages.push(json!({"role": "user", "content": filler(100 + t as u64, 20)}));
        json!({"model": "deepseek-v4", "messages": messages.clone(), "max_tokens": 2})
    };
    for t in 0..4 {
        let body = turn(&mut messages, t);
        let r = post_json(&c, &url, &body, &session).await?;
        assert_eq!(r.status, 200, "turn {t}: {}", r.text);
        assert!(r.header(headers::DEBUG_FALLBACK).is_none(), "turn {t} routed by the indexer");
        if t > 0 {
            assert!(
                r.overlap_blocks().unwrap_or(0) > 0,
                "turn {t} found its history: {:?}",
                r.reason()
            );
        }
        messages.push(json!({"role": "assistant", "content": filler(200 + t as u64, 10)}));
    }
    let envoy = stack.envoy_metrics().await?;
    let bodies = |m: &kvmesh_e2e::prom::Metrics, result: &str| {
        m.sum("kvmesh_filter_route_bodies_total", &[("result", result)])
    };
    assert_eq!(
        (bodies(&envoy, "whole"), bodies(&envoy, "delta")),
        (1.0, 3.0),
        "turns 2-4 sent after a base"
    );
    let indexer = stack.scrape(&stack.indexer_url("/metrics")).await?;
    assert_eq!(indexer.sum("kvmesh_body_memo_total", &[("result", "base_hit")]), 3.0);

    // The indexer restarts and holds no base: the next turn's delta is refused, sent again whole,
    // and routed by the indexer once it is back (a turn that met it down fell back, as ever).
    stack.restart_indexer().await?;
    let body = turn(&mut messages, 4);
    let r = poll::until("a turn routed by the restarted indexer", || {
        let (c, url, body) = (c.clone(), url.clone(), body.clone());
        async move {
            let r = post_json(
                &c,
                &url,
                &body,
                &[(headers::DEFAULT_SESSION_HEADER, "long-conversation")],
            )
            .await
            .ok()?;
            assert_eq!(r.status, 200, "{}", r.text);
            r.header(headers::DEBUG_FALLBACK).is_none().then_some(r)
        }
    })
    .await?;
    assert!(r.worker().is_some());
    let envoy = stack.envoy_metrics().await?;
    assert!(bodies(&envoy, "resent") >= 1.0, "the refused delta was sent again whole");
    let indexer = stack.scrape(&stack.indexer_url("/metrics")).await?;
    assert!(indexer.sum("kvmesh_body_memo_total", &[("result", "base_unknown")]) >= 1.0);
    Ok(())
}
