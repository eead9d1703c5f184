//! Placement through the real service (`router(state).oneshot`): the views `AppState` builds, the
//! backlog and speculative holdings `AppState::placed` records, and the decisions they lead to.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use kvmesh_core::api::{DoneReport, Outcome, RouteDecision, DONE_PATH, ROUTE_PATH};
use kvmesh_core::headers;
use tower::ServiceExt;

use crate::config::{Config, MapEnv};
use crate::http::router;
use crate::scrape::EngineSample;
use crate::service::Service;
use crate::tokenize::PromptTokenizer;

fn tokenizer() -> PromptTokenizer {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(kvmesh_tokens::default_tokenizer_path);
    PromptTokenizer::load(path, None, "<｜begin▁of▁sentence｜>", 1 << 20).unwrap()
}

/// Two decode-capable workers (nothing listens on their ports; scrapes fail slowly enough).
fn service(extra_routing: &str) -> Arc<Service> {
    let text = format!(
        "listen = \"127.0.0.1:0\"\n[model]\nname = \"m\"\nblock_size = 4\n[routing]\nscrape_interval_ms = 60000\nscrape_timeout_ms = 1000\n{extra_routing}\n\
         [[workers]]\nid = \"w0\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:1\"\n[[workers]]\nid = \"w1\"\nrole = \"both\"\nendpoint = \"127.0.0.1:2\"\n"
    );
    let config = Config::from_toml_str(&text, &MapEnv::default()).unwrap();
    Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tokenizer()).unwrap()
}

fn body(ids: impl Iterator<Item = u32>) -> String {
    let ids: Vec<String> = ids.map(|i| i.to_string()).collect();
    format!(r#"{{"model":"m","prompt":[{}]}}"#, ids.join(","))
}

async fn route(svc: &Arc<Service>, body: String) -> RouteDecision {
    let req = Request::post(ROUTE_PATH)
        .header(headers::KVMESH_PATH, "/v1/completions")
        .body(Body::from(body))
        .unwrap();
    let resp = router(svc.state.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

async fn done(svc: &Arc<Service>, d: &RouteDecision) {
    let report = DoneReport {
        request_id: "r".into(),
        endpoint: None,
        outcome: Outcome::Success,
        status: Some(200),
        booking_id: d.booking_id.clone(),
    };
    let req = Request::post(DONE_PATH)
        .body(Body::from(serde_json::to_vec(&report).unwrap()))
        .unwrap();
    assert_eq!(
        router(svc.state.clone())
            .oneshot(req)
            .await
            .unwrap()
            .status(),
        StatusCode::OK
    );
}

fn metric(svc: &Service, line: &str) -> bool {
    svc.state.metrics.render().lines().any(|l| l == line)
}

#[tokio::test]
async fn a_sibling_follows_the_speculative_holdings_of_its_prefix() {
    let svc = service("");
    // A new 400-token prefix, then a sibling sharing it (its own 20-token tail) before any event.
    let first = route(&svc, body(1000..1400)).await;
    assert_eq!(first.overlap_blocks, 0);
    done(&svc, &first).await; // served: nothing queued any more, only the blocks are fresh
    let sibling = route(&svc, body((1000..1400).chain(5000..5020))).await;
    assert_eq!(sibling.worker, first.worker, "{}", sibling.reason);
    assert_eq!(
        sibling.overlap_blocks, 0,
        "speculation is never reported as index overlap"
    );
    assert!(
        sibling.reason.contains("(+100 speculative)"),
        "{}",
        sibling.reason
    );
    assert!(
        sibling.predicted_ttft_ms.is_some_and(|ms| ms < 5.0),
        "{:?}",
        sibling.predicted_ttft_ms
    );
    assert!(metric(&svc, "kvmesh_speculative_overlap_blocks_total 100"));
    assert!(
        metric(&svc, "router_kv_overlap_blocks_total 0"),
        "engine-truth counter untouched"
    );
    assert!(metric(&svc, "kvmesh_predicted_ttft_seconds_count 2"));
}

#[tokio::test]
async fn without_speculation_the_sibling_sees_nothing() {
    let svc = service("speculative_ttl_ms = 0");
    let first = route(&svc, body(1000..1400)).await;
    done(&svc, &first).await;
    let sibling = route(&svc, body((1000..1400).chain(5000..5020))).await;
    assert!(
        sibling.reason.starts_with("nothing cached"),
        "{}",
        sibling.reason
    );
    assert!(metric(&svc, "kvmesh_speculative_overlap_blocks_total 0"));
}

#[tokio::test]
async fn booked_prefill_spreads_a_cold_burst_and_done_drains_it() {
    let svc = service("");
    let mut per = BTreeMap::new();
    let mut decisions = Vec::new();
    for i in 0..10u32 {
        // Distinct 2000-token prompts: 100 ms of prefill each at the default 20k tokens/s.
        let d = route(&svc, body(i * 10_000..i * 10_000 + 2000)).await;
        *per.entry(d.worker.clone()).or_insert(0) += 1;
        decisions.push(d);
    }
    // Each booking queues its prefill on its worker, so the next one goes to the other (give or
    // take a near tie while the first drains).
    assert!(
        per.len() == 2 && per.values().all(|n| (4..=6).contains(n)),
        "{per:?}"
    );
    assert!(
        decisions
            .iter()
            .skip(1)
            .any(|d| d.reason.contains("queued tokens")),
        "{:?}",
        decisions.last().map(|d| &d.reason)
    );
    for d in &decisions {
        done(&svc, d).await;
    }
    // Released bookings leave nothing queued, whatever the drain model still holds.
    let d = route(&svc, body(900_000..902_000)).await;
    assert!(!d.reason.contains("queued"), "{}", d.reason);
}

#[tokio::test]
async fn engine_requests_this_replica_did_not_book_count_as_queued_work() {
    let svc = service("");
    // Another gateway's traffic: w0's engine reports 6 waiting requests this indexer never routed.
    {
        let mut fleet = svc.state.fleet.write();
        let w0 = fleet.workers.iter_mut().find(|w| w.cfg.id == "w0").unwrap();
        w0.engine = Some(EngineSample {
            waiting: 6.0,
            running: 2.0,
            ..EngineSample::default()
        });
    }
    for i in 0..6u32 {
        let d = route(&svc, body(i * 10_000..i * 10_000 + 400)).await;
        assert_eq!(d.worker, "w1", "{}", d.reason);
        // 6 × unknown_request_blocks (64) × block_size (4) tokens ahead on w0.
        assert!(d.reason.contains("next w0 "), "{}", d.reason);
        done(&svc, &d).await;
    }
}
