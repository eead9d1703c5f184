//! The indexer dies mid-run: every request still succeeds and sessions keep the worker the indexer
//! placed them on, through the filter's placement memory (Envoy shared data) and its last fleet
//! snapshot. The indexer comes back, rebuilds its index from the workers' event replay, and precise
//! routing resumes.

use kvmesh_core::{headers, rendezvous, session};
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;
use std::collections::HashMap;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_survive_the_indexer_and_precise_routing_resumes() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(4);
    spec.filter_config = json!({"debug_headers": true});
    let mut stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/completions");
    let c = stack.client().clone();
    let ids: Vec<String> = stack.workers.iter().map(|w| w.id.clone()).collect();
    let body = |session: u64, turn: u64| json!({"model": "deepseek-v4", "prompt": format!("{} {}", filler(session, 400), filler(9000 + turn, 30 * turn as usize)), "max_tokens": 3});

    // Turn 1 with the indexer up: each session goes where the indexer predicts it fastest.
    let mut home = HashMap::new();
    let mut off_pin = 0;
    for s in 0..8u64 {
        let sid = format!("session-{s}");
        let r =
            post_json(&c, &url, &body(s, 1), &[(headers::DEFAULT_SESSION_HEADER, sid.as_str())])
                .await?;
        assert_eq!(r.status, 200, "{}", r.text);
        let pin =
            rendezvous::pick(session::from_header_value(&sid).0, ids.iter().map(String::as_str))
                .map(str::to_owned);
        off_pin += usize::from(r.worker().map(str::to_owned) != pin);
        home.insert(s, r.worker().unwrap_or_default().to_owned());
    }
    // Otherwise the rendezvous fallback alone would pass what follows.
    assert!(off_pin > 0, "every session placed on its rendezvous pin: {home:?}");

    stack.kill_indexer();

    // Indexer down: everything still succeeds, and sessions stay home.
    for s in 0..8u64 {
        let sid = format!("session-{s}");
        let r =
            post_json(&c, &url, &body(s, 2), &[(headers::DEFAULT_SESSION_HEADER, sid.as_str())])
                .await?;
        assert_eq!(r.status, 200, "indexer down: {}", r.text);
        assert_eq!(
            r.worker(),
            Some(home[&s].as_str()),
            "session {sid} lost its worker while the indexer was down"
        );
        assert!(
            r.header(headers::DEBUG_FALLBACK).is_some(),
            "expected the fallback header while the indexer is down"
        );
    }
    for i in 0..6u64 {
        let r =
            post_json(&c, &url, &json!({"prompt": filler(70_000 + i, 50), "max_tokens": 2}), &[])
                .await?;
        assert_eq!(r.status, 200, "sessionless request with the indexer down: {}", r.text);
    }
    let fallbacks = stack.envoy_metrics().await?;
    assert!(fallbacks.sum("kvmesh_filter_fallbacks_total", &[]) >= 14.0, "fallbacks not counted");
    assert_eq!(
        fallbacks.sum("kvmesh_filter_fallback_routes_total", &[("result", "remembered")]),
        8.0,
        "each session's turn 2 followed its remembered placement"
    );

    // Back up: it rebuilds from replay, so a prefix served only before the restart is found again.
    stack.restart_indexer().await?;
    // Ask the indexer directly (so probing does not warm any cache) until its rebuilt index knows
    // the prefix. Every probe's booking is reported done, so none is left as load on a worker.
    let route = stack.indexer_url(kvmesh_core::api::ROUTE_PATH);
    let done_url = stack.indexer_url(kvmesh_core::api::DONE_PATH);
    let decision = poll::until("index rebuilt from replay", || {
        let (c, route, done_url) = (c.clone(), route.clone(), done_url.clone());
        let b = body(3, 1);
        async move {
            let r = c
                .post(&route)
                .header(headers::KVMESH_PATH, "/v1/completions")
                .header(headers::REQUEST_ID, "probe")
                .json(&b)
                .send()
                .await
                .ok()?;
            let d: kvmesh_core::api::RouteDecision = r.json().await.ok()?;
            let done = kvmesh_core::api::DoneReport {
                request_id: "probe".into(),
                endpoint: Some(d.endpoint.clone()),
                outcome: kvmesh_core::api::Outcome::Success,
                status: Some(200),
                booking_id: d.booking_id.clone(),
                usage: None,
            };
            c.post(&done_url).json(&done).send().await.ok()?.error_for_status().ok()?;
            (d.overlap_blocks > 0).then_some(d)
        }
    })
    .await?;
    assert_eq!(
        decision.worker, home[&3],
        "the rebuilt index should send session 3's prefix home: {}",
        decision.reason
    );

    // And through the gateway, without the fallback. Each Envoy worker thread has its own breaker,
    // and one that opened during the outage skips the indexer until its open window ends and a
    // probe is answered; which thread takes a request is Envoy's choice. So session 3 asks until
    // an answer comes through the indexer: a fallback answer goes home too (its remembered
    // placement), so asking again puts its prefix nowhere else. The restarted indexer never saw
    // session 3: only its rebuilt index can send it home.
    let r = poll::until("session 3 routed through the indexer again", || {
        let (c, url, b) = (c.clone(), url.clone(), body(3, 1));
        async move {
            let r = post_json(&c, &url, &b, &[(headers::DEFAULT_SESSION_HEADER, "session-3")])
                .await
                .ok()?;
            (r.status == 200 && r.header(headers::DEBUG_FALLBACK).is_none()).then_some(r)
        }
    })
    .await?;
    assert_eq!(r.worker(), Some(home[&3].as_str()), "{:?}", r.reason());
    assert!(r.overlap_blocks().unwrap_or(0) > 0, "{:?}", r.reason());
    Ok(())
}
