//! `background: "per_worker"` — the mode for deployments without Envoy's bootstrap extension (Istio's
//! `WasmPlugin`): the singleton service stays idle and every filter root (one per Envoy worker
//! thread; the harness runs `--concurrency 2`) polls `/v1/fleet` itself and flushes its own bounded
//! done queue on its tick. Checked on real Envoy: the roles configured as the matrix says
//! (`filter/src/roles.rs`), requests are routed by the indexer's decisions, every booking is
//! released by a matched done report sent from the filter roots, and with the indexer gone the
//! fleet those roots polled pins sessions locally.

use kvmesh_core::headers;
use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const REQUESTS: u64 = 12;

async fn indexer_metric(stack: &Stack, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    Ok(stack.scrape(&stack.indexer_url("/metrics")).await?.sum(name, labels))
}

async fn filter_metric(stack: &Stack, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    Ok(stack.envoy_metrics().await?.sum(name, labels))
}

/// Envoy's log (its `--log-path` file and the process output), where the filter's roots log their role.
fn envoy_log(stack: &Stack) -> String {
    let mut text =
        std::fs::read_to_string(stack.dir().join("envoy-access.log")).unwrap_or_default();
    if let Some(p) = stack.envoy.as_ref() {
        text.push_str(&std::fs::read_to_string(p.log_path()).unwrap_or_default());
    }
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_worker_background_routes_reports_done_and_pins_from_its_own_fleet(
) -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config =
        json!({"debug_headers": true, "background": "per_worker", "fleet_refresh_ms": 100});
    let mut stack = Stack::start(spec).await?;

    // The singleton is idle and the filter roots run the background work themselves.
    let log = poll::until("the filter's roots logged their roles", || async {
        let log = envoy_log(&stack);
        (log.contains("role=service (idle: background is per_worker)")
            && log.contains("role=filter"))
        .then_some(log)
    })
    .await?;
    assert!(
        log.lines()
            .filter(|l| l.contains("role=filter"))
            .all(|l| l.contains("background=PerWorker")),
        "a filter root configured another mode"
    );
    // Polls come from the filter roots (the singleton is idle): they keep coming every period.
    let polled = poll::until("filter roots polled /v1/fleet", || async {
        let ok = filter_metric(&stack, "kvmesh_filter_fleet_refreshes_total", &[("result", "ok")])
            .await
            .ok()?;
        (ok >= 3.0).then_some(ok)
    })
    .await?;
    assert!(polled >= 3.0);
    assert_eq!(filter_metric(&stack, "kvmesh_filter_fleet_decode_workers", &[]).await?, 2.0);

    // Routed by the indexer: no fallback, served where the decision said.
    let url = stack.gateway("/v1/chat/completions");
    for i in 0..REQUESTS {
        let session = format!("per-worker-{i}");
        let body = chat_body(&[("user".into(), filler(300 + i, 60))], 4);
        let r = post_json(
            stack.client(),
            &url,
            &body,
            &[(headers::DEFAULT_SESSION_HEADER, session.as_str())],
        )
        .await?;
        assert_eq!(r.status, 200, "request {i}: {}", r.text);
        assert_eq!(r.header(headers::DEBUG_FALLBACK), None, "request {i} fell back");
        let decided = r.header(headers::DEBUG_WORKER).expect("decision worker header").to_owned();
        assert_eq!(
            r.worker(),
            Some(decided.as_str()),
            "request {i} served by {:?}, decided {decided}",
            r.worker()
        );
    }

    // Every decision's booking is released by a matched done report, sent by the filter roots.
    let matched = poll::until("a matched done report per request", || async {
        let n = indexer_metric(&stack, "kvmesh_done_reports_total", &[("matched", "true")])
            .await
            .ok()?;
        (n >= REQUESTS as f64).then_some(n)
    })
    .await?;
    assert_eq!(matched, REQUESTS as f64);
    assert_eq!(
        indexer_metric(&stack, "kvmesh_done_reports_total", &[("matched", "false")]).await?,
        0.0
    );
    assert_eq!(indexer_metric(&stack, "kvmesh_decisions_total", &[]).await?, REQUESTS as f64);
    let sent =
        filter_metric(&stack, "kvmesh_filter_done_reports_total", &[("result", "sent")]).await?;
    assert_eq!(sent, REQUESTS as f64, "done reports sent by the filter roots");
    assert_eq!(
        filter_metric(&stack, "kvmesh_filter_done_reports_total", &[("result", "dropped")]).await?,
        0.0
    );
    assert_eq!(
        filter_metric(&stack, "kvmesh_filter_done_reports_total", &[("result", "failed")]).await?,
        0.0
    );

    // Without the indexer, a session is pinned over the fleet the filter roots stored, the same
    // worker on every request (whichever worker thread takes it: the snapshot is shared data).
    stack.kill_indexer();
    let mut pinned_to = None;
    for i in 0..6 {
        let body = chat_body(&[("user".into(), filler(900 + i, 30))], 2);
        let r = post_json(
            stack.client(),
            &url,
            &body,
            &[(headers::DEFAULT_SESSION_HEADER, "pinned-session")],
        )
        .await?;
        assert_eq!(r.status, 200, "pinned request {i}: {}", r.text);
        assert!(
            r.header(headers::DEBUG_FALLBACK).is_some(),
            "request {i}: no fallback with the indexer gone"
        );
        let pin =
            r.header(headers::DEBUG_WORKER).expect("pinned requests name their worker").to_owned();
        assert_eq!(r.worker(), Some(pin.as_str()), "pinned request {i} served elsewhere");
        assert_eq!(pinned_to.get_or_insert_with(|| pin.clone()), &pin, "the pin moved");
    }
    assert!(
        filter_metric(&stack, "kvmesh_filter_fallback_routes_total", &[("result", "pinned")])
            .await?
            >= 6.0
    );
    assert_eq!(
        filter_metric(&stack, "kvmesh_filter_fallback_routes_total", &[("result", "no_fleet")])
            .await?,
        0.0
    );
    Ok(())
}
