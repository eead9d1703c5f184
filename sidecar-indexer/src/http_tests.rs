use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::body::Body;
use axum::http::Request;
use http_body_util::BodyExt;
use kvmesh_core::api::{FleetSnapshot, Mode, ReasonCode, RouteDecision};
use kvmesh_core::hashing::XXH3_SEED;
use kvmesh_core::{headers, session};
use tower::ServiceExt;

use super::*;
use crate::config::{Config, MapEnv};
use crate::events::applier::ApplierMsg;
use crate::events::decode::{EventBatch, KvEvent};
use crate::service::Service;
use crate::tokenize::PromptTokenizer;

fn fleet_toml(extra_routing: &str) -> String {
    format!(
        r#"
listen = "127.0.0.1:0"
[model]
name = "m"
block_size = 4
[routing]
scrape_interval_ms = 1000
{extra_routing}
[[workers]]
id = "w0"
role = "decode"
endpoint = "127.0.0.1:1"
[[workers]]
id = "w1"
role = "both"
endpoint = "127.0.0.1:2"
[[workers]]
id = "p0"
role = "prefill"
endpoint = "127.0.0.1:3"
"#
    )
}

fn tokenizer() -> PromptTokenizer {
    // Loading the 6 MB tokenizer.json once per test is slow: share the parts' source, build fresh.
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(kvmesh_tokens::default_tokenizer_path);
    PromptTokenizer::load(path, None, "<｜begin▁of▁sentence｜>", 1 << 20).unwrap()
}

fn service(extra_routing: &str) -> Arc<Service> {
    let config = Config::from_toml_str(&fleet_toml(extra_routing), &MapEnv::default()).unwrap();
    Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tokenizer()).unwrap()
}

async fn call(svc: &Arc<Service>, req: Request<Body>) -> (StatusCode, Vec<u8>) {
    let resp = router(svc.state.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, body)
}

fn route_req(path: &str, body: &str, extra: &[(&str, &str)]) -> Request<Body> {
    let mut b = Request::post(ROUTE_PATH).header(headers::KVMESH_PATH, path);
    for (k, v) in extra {
        b = b.header(*k, *v);
    }
    b.body(Body::from(body.to_owned())).unwrap()
}

async fn route_ok(
    svc: &Arc<Service>,
    path: &str,
    body: &str,
    extra: &[(&str, &str)],
) -> RouteDecision {
    let (status, bytes) = call(svc, route_req(path, body, extra)).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&bytes));
    serde_json::from_slice(&bytes).unwrap()
}

fn tokens_body(n: u32) -> String {
    let ids: Vec<String> = (0..n).map(|i| (1000 + i).to_string()).collect();
    format!(r#"{{"model":"m","prompt":[{}]}}"#, ids.join(","))
}

fn slot_of(svc: &Service, worker: &str) -> u32 {
    let fleet = svc.state.fleet.read();
    fleet.workers.iter().find(|w| w.cfg.id == worker).unwrap().ranks[0].slot
}

#[tokio::test]
async fn routes_to_the_worker_holding_the_prefix() {
    let svc = service("");
    // Tell the index that w1 holds the first two blocks of the prompt.
    let tokens: Vec<u32> = (1000..1008).collect();
    let batch = EventBatch {
        ts: 1.0,
        events: vec![KvEvent::Stored {
            block_hashes: vec![11, 12],
            parent: None,
            token_ids: tokens,
            block_size: 4,
            lora_name: None,
            cache_salt: None,
            medium: None,
            group_idx: None,
            spec_kind: None,
            sliding_window: None,
            extra_terms: vec![],
        }],
        dp_rank: None,
    };
    svc.state.applier.send(ApplierMsg::Batch { slot: slot_of(&svc, "w1"), seq: 0, batch }).unwrap();
    svc.barrier();
    let d =
        route_ok(&svc, "/v1/completions", &tokens_body(10), &[(headers::REQUEST_ID, "r1")]).await;
    assert_eq!(d.worker, "w1");
    assert_eq!(d.endpoint, "127.0.0.1:2");
    assert_eq!((d.overlap_blocks, d.isl_blocks), (2, 2));
    assert_eq!(d.mode, Mode::Aggregate);
    assert_eq!(d.reason_codes, [ReasonCode::BestOverlap], "{}", d.reason);
    assert_eq!(
        d.fallbacks,
        vec!["127.0.0.1:1".to_owned()],
        "prefill-only workers are never fallbacks"
    );
    assert_eq!(d.best_overlap_worker.as_deref(), Some("w1"));
    // The booked load shows in the fleet snapshot and leaves with /v1/done.
    let fleet: FleetSnapshot = serde_json::from_slice(
        &call(&svc, Request::get(FLEET_PATH).body(Body::empty()).unwrap()).await.1,
    )
    .unwrap();
    let w1 = fleet.workers.iter().find(|w| w.id == "w1").unwrap();
    assert_eq!((w1.load.active_requests, w1.load.active_blocks), (1, 3));
    let done = Request::post(DONE_PATH)
        .body(Body::from(format!(
            r#"{{"request_id":"r1","endpoint":"127.0.0.1:2","outcome":"success","status":200,"booking_id":"{}"}}"#,
            d.booking_id.as_deref().unwrap()
        )))
        .unwrap();
    let (status, body) = call(&svc, done).await;
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (StatusCode::OK, r#"{"released":true}"#)
    );
    assert_eq!(svc.state.snapshot().workers[1].load.active_requests, 0);
    let text = String::from_utf8(
        call(&svc, Request::get("/metrics").body(Body::empty()).unwrap()).await.1,
    )
    .unwrap();
    assert!(text.contains(r#"router_kv_overlap_blocks_total{model="m"} 2"#), "{text}");
    // Full blocks (10 tokens of 4: 2), as the filter counts them; the booked load above counts 3.
    assert!(text.contains(r#"router_kv_isl_blocks_total{model="m"} 2"#), "{text}");
    assert!(
        text.contains(
            r#"kvmesh_decisions_total{basis="best_overlap",mode="aggregate",model="m"} 1"#
        ),
        "{text}"
    );
}

#[tokio::test]
async fn chat_requests_are_rendered_and_tokenized() {
    let svc = service("");
    let body = r#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":"Hello there, how are you today?"}]}"#;
    let d = route_ok(&svc, "/v1/chat/completions", body, &[]).await;
    let tok = tokenizer();
    let text =
        "<｜begin▁of▁sentence｜>be brief<｜User｜>Hello there, how are you today?<｜Assistant｜>";
    assert_eq!(d.isl_blocks as usize, tok.tokenizer().encode(text).unwrap().len() / 4);
    assert_eq!(d.overlap_blocks, 0);
}

/// A long conversation routed turn by turn: each later turn's body is read from where the last
/// ended (the body memo) and routes as a whole read does (same blocks); a bad body still gets the
/// whole read's 400. Approximate mode tokenizes prompts whole, so `isl_blocks` is exact on both
/// services (a prompt no worker holds is otherwise estimated past its first blocks, and how far
/// depends on the background completions' timing).
#[tokio::test]
async fn a_long_conversations_next_turn_is_read_from_the_last() {
    let memo =
        |svc: &Arc<Service>, r: &str| svc.state.metrics.body_memo.with_label_values(&[r]).get();
    let (svc, off) =
        (service("mode = \"approximate\""), service("mode = \"approximate\"\nbody_memo_bytes = 0"));
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You answer questions about the long document below. ".repeat(200)}),
    ];
    for turn in 0..4 {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {turn}: what does part {turn} say?")}));
        let body =
            serde_json::json!({"model": "m", "messages": messages, "stream": true}).to_string();
        let (d, whole) = (
            route_ok(&svc, "/v1/chat/completions", &body, &[]).await,
            route_ok(&off, "/v1/chat/completions", &body, &[]).await,
        );
        assert_eq!(d.isl_blocks, whole.isl_blocks, "turn {turn}");
        assert_eq!((memo(&svc, "hit"), memo(&svc, "miss")), (turn, 1), "turn {turn}");
        messages.push(
            serde_json::json!({"role": "assistant", "content": format!("part {turn} says {turn}")}),
        );
    }
    assert_eq!(memo(&off, "hit") + memo(&off, "miss"), 0, "off: not looked up");
    assert!(svc.state.body_memo.lock().bytes() > 0);
    let body = serde_json::json!({"model": "m", "messages": messages, "stream": true}).to_string();
    let broken = body.replace(r#""stream":true"#, r#""stream":"yes""#);
    let (status, bytes) = call(&svc, route_req("/v1/chat/completions", &broken, &[])).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{}", String::from_utf8_lossy(&bytes));
    assert_eq!(
        bytes,
        call(&off, route_req("/v1/chat/completions", &broken, &[])).await.1,
        "the whole read's error"
    );
}

#[tokio::test]
async fn a_turn_sent_after_the_body_base_its_last_answer_named_routes_as_if_sent_whole() {
    use kvmesh_core::body_base::BodyBase;
    let memo =
        |svc: &Arc<Service>, r: &str| svc.state.metrics.body_memo.with_label_values(&[r]).get();
    let (svc, whole) = (service("mode = \"approximate\""), service("mode = \"approximate\""));
    let session = [(headers::KVMESH_SESSION, "00000000000000aa;source=header")];
    let mut messages = vec![
        serde_json::json!({"role": "system", "content": "You answer questions about the long document below. ".repeat(200)}),
    ];
    let mut named: Option<BodyBase> = None;
    for turn in 0..4u64 {
        messages.push(serde_json::json!({"role": "user", "content": format!("question {turn}: what does part {turn} say?")}));
        let body =
            serde_json::json!({"model": "m", "messages": messages, "stream": true}).to_string();
        let d = match named {
            // The bytes after the base only, naming it.
            Some(base) => {
                let v = base.to_string();
                let mut extra = session.to_vec();
                extra.push((headers::KVMESH_BODY_BASE, v.as_str()));
                route_ok(&svc, "/v1/chat/completions", &body[base.len..], &extra).await
            }
            None => route_ok(&svc, "/v1/chat/completions", &body, &session).await,
        };
        let w = route_ok(&whole, "/v1/chat/completions", &body, &session).await;
        assert_eq!((d.isl_blocks, &d.worker), (w.isl_blocks, &w.worker), "turn {turn}");
        let base = d
            .body_base
            .unwrap_or_else(|| panic!("turn {turn}: the answer names the body's kept prefix"));
        assert_eq!(
            Some(base.len),
            body.rfind(']'),
            "turn {turn}: the body through its last message"
        );
        assert_eq!(base, BodyBase::of(base.memo_key, &body.as_bytes()[..base.len]));
        assert_eq!(memo(&svc, "base_hit"), turn, "turn {turn}");
        named = Some(base);
        messages.push(
            serde_json::json!({"role": "assistant", "content": format!("part {turn} says {turn}")}),
        );
    }
    // A base the indexer does not hold (another length; evicted; a restarted indexer): 409 with
    // its reason, counted, not a bad request.
    let Some(base) = named else { panic!("named") };
    for unknown in
        [BodyBase { len: base.len - 1, ..base }, BodyBase { hash: base.hash ^ 1, ..base }]
    {
        let v = unknown.to_string();
        let (status, bytes) = call(
            &svc,
            route_req(
                "/v1/chat/completions",
                r#"{"role":"user","content":"x"}]}"#,
                &[(headers::KVMESH_BODY_BASE, v.as_str())],
            ),
        )
        .await;
        assert_eq!(status, StatusCode::CONFLICT, "{}", String::from_utf8_lossy(&bytes));
        let err: kvmesh_core::api::ErrorBody = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(err.error.reason.as_deref(), Some(kvmesh_core::body_base::BASE_UNKNOWN));
    }
    assert_eq!(memo(&svc, "base_unknown"), 2);
    assert_eq!(
        svc.state
            .metrics
            .bad_requests
            .with_label_values(&["route", kvmesh_core::body_base::BASE_UNKNOWN])
            .get(),
        0
    );
    // A malformed name is a bad request.
    let (status, _) =
        call(&svc, route_req("/v1/chat/completions", "{}", &[(headers::KVMESH_BODY_BASE, "nope")]))
            .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    // The memo off: no base named, and a named one is unknown.
    let off = service("mode = \"approximate\"\nbody_memo_bytes = 0");
    let body = serde_json::json!({"model": "m", "messages": messages, "stream": true}).to_string();
    assert_eq!(route_ok(&off, "/v1/chat/completions", &body, &session).await.body_base, None);
    let v = base.to_string();
    let (status, _) = call(
        &off,
        route_req(
            "/v1/chat/completions",
            &body[base.len..],
            &[(headers::KVMESH_BODY_BASE, v.as_str())],
        ),
    )
    .await;
    assert_eq!(status, StatusCode::CONFLICT);
}

#[tokio::test]
async fn malformed_requests_get_400_and_a_metric() {
    let svc = service("");
    let cases: Vec<(Request<Body>, StatusCode, &str)> = vec![
        (route_req("/v1/completions", "{not json", &[]), StatusCode::BAD_REQUEST, "not_json"),
        (
            route_req("/v1/completions", r#"{"prompt":["a","b"]}"#, &[]),
            StatusCode::BAD_REQUEST,
            "batch_prompt",
        ),
        (route_req("/v1/models", "{}", &[]), StatusCode::BAD_REQUEST, "bad_path"),
        (
            Request::post(ROUTE_PATH).body(Body::from("{}")).unwrap(),
            StatusCode::BAD_REQUEST,
            "missing_path",
        ),
        (
            route_req(
                "/v1/completions",
                &tokens_body(8),
                &[(headers::KVMESH_SESSION, "zz;source=x")],
            ),
            StatusCode::BAD_REQUEST,
            "bad_session",
        ),
        (
            route_req("/v1/completions", &tokens_body(8), &[(headers::OVERRIDE_MODE, "fast")]),
            StatusCode::BAD_REQUEST,
            "bad_mode",
        ),
        (
            route_req("/v1/completions", &tokens_body(8), &[(headers::OVERRIDE_WORKER, "nobody")]),
            StatusCode::BAD_REQUEST,
            "unknown_override_worker",
        ),
    ];
    for (req, want, reason) in cases {
        let (status, body) = call(&svc, req).await;
        assert_eq!(status, want, "{reason}: {}", String::from_utf8_lossy(&body));
        let err: kvmesh_core::api::ErrorBody = serde_json::from_slice(&body).unwrap();
        assert!(!err.error.message.is_empty());
        let text = svc.state.metrics.render();
        assert!(
            text.contains(&format!(
                r#"kvmesh_bad_requests_total{{endpoint="route",reason="{reason}"}} 1"#
            )),
            "{reason}: {text}"
        );
    }
    let (status, _) = call(
        &svc,
        // A batch is an array of reports: one that is not a report makes it malformed.
        Request::post(DONE_PATH).body(Body::from("[1]")).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn bodies_are_bounded() {
    let svc = service("max_body_bytes = 64");
    let (status, _) = call(&svc, route_req("/v1/completions", &tokens_body(100), &[])).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(svc.state.metrics.render().contains(r#"reason="body_too_large""#));
}

#[tokio::test]
async fn session_pin_matches_the_fleet_snapshot_and_override_wins() {
    // Rendezvous homes agree with the filter's fallback pin (the default places sessions by prediction).
    let svc = service("session_placement = \"rendezvous\"");
    let snapshot = svc.state.snapshot();
    let model = snapshot.models[0].name.clone();
    for i in 0..50u64 {
        let key = kvmesh_core::session::from_header_value(&format!("conversation-{i}"));
        let header = session::encode_header(key, session::SessionSource::Header);
        let d = route_ok(
            &svc,
            "/v1/completions",
            &tokens_body(8),
            &[(headers::KVMESH_SESSION, &header)],
        )
        .await;
        assert_eq!(Some(d.worker.as_str()), snapshot.pin(key.0, &model).map(|w| w.id.as_str()));
        assert_eq!(d.reason_codes, [ReasonCode::SessionPin], "{}", d.reason);
    }
    let d = route_ok(&svc, "/v1/completions", &tokens_body(8), &[(headers::OVERRIDE_WORKER, "w0")])
        .await;
    assert_eq!(d.worker, "w0");
    assert_eq!(d.reason_codes, [ReasonCode::Override], "{}", d.reason);
}

#[tokio::test]
async fn approximate_mode_learns_from_its_own_decisions() {
    let svc = service("mode = \"approximate\"");
    let first =
        route_ok(&svc, "/v1/completions", &tokens_body(12), &[(headers::REQUEST_ID, "first")])
            .await;
    assert_eq!(first.overlap_blocks, 0);
    svc.barrier();
    let mut previous = first.clone();
    for i in 0..5 {
        // Release each request's load so only the overlap tells the workers apart.
        let done = format!(
            r#"{{"request_id":"{}","outcome":"success","booking_id":"{}"}}"#,
            if i == 0 { "first".to_owned() } else { format!("r{}", i - 1) },
            previous.booking_id.as_deref().unwrap()
        );
        assert_eq!(
            call(&svc, Request::post(DONE_PATH).body(Body::from(done)).unwrap()).await.0,
            StatusCode::OK
        );
        let id = format!("r{i}");
        let again =
            route_ok(&svc, "/v1/completions", &tokens_body(16), &[(headers::REQUEST_ID, &id)])
                .await;
        svc.barrier();
        previous = again.clone();
        // The first repeat finds the 3 blocks learned from the 12-token prompt; later ones hold all 4,
        // but a 16-token prompt can hit at most 3 (the engine computes the last token).
        assert_eq!((again.worker.as_str(), again.overlap_blocks), (first.worker.as_str(), 3));
    }
    assert_eq!(
        svc.state
            .index
            .read()
            .find_matches(&kvmesh_core::hashing::sequence_hashes(
                &(1000..1016).collect::<Vec<_>>(),
                4,
                XXH3_SEED
            ))
            .len(),
        1
    );
}

#[tokio::test]
async fn probes_and_debug() {
    let svc = service("");
    assert_eq!(
        call(&svc, Request::get("/healthz").body(Body::empty()).unwrap()).await.0,
        StatusCode::OK
    );
    assert_eq!(
        call(&svc, Request::get("/readyz").body(Body::empty()).unwrap()).await.0,
        StatusCode::OK
    );
    let (status, body) =
        call(&svc, Request::get("/debug/workers").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(3));
    for (uri, want) in [
        ("/debug/blocks?worker=w0", StatusCode::OK),
        ("/debug/blocks?worker=zz", StatusCode::NOT_FOUND),
        ("/debug/blocks", StatusCode::BAD_REQUEST),
    ] {
        let got = call(&svc, Request::get(uri).body(Body::empty()).unwrap()).await.0;
        assert_eq!(got, want, "{uri}");
    }
}

#[tokio::test]
async fn no_decode_worker_is_a_503() {
    let svc = service("");
    {
        let mut fleet = svc.state.fleet.write();
        for w in &mut fleet.workers {
            w.healthy = false;
        }
    }
    let resp = router(svc.state.clone())
        .oneshot(route_req("/v1/completions", &tokens_body(8), &[]))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    // The reason is machine-readable twice: a header and the body's error.reason.
    assert_eq!(
        resp.headers().get(kvmesh_core::api::ERROR_REASON_HEADER).and_then(|v| v.to_str().ok()),
        Some("no_decode_worker")
    );
    let err: kvmesh_core::api::ErrorBody =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(err.error.reason.as_deref(), Some("no_decode_worker"));
    assert!(svc
        .state
        .metrics
        .render()
        .contains(r#"kvmesh_route_errors_total{model="m",reason="no_decode_worker"} 1"#));
    // The gateway stays ready: the filter's fallback routes while no worker is healthy.
    let (status, body) = call(&svc, Request::get("/readyz").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        String::from_utf8_lossy(&body).starts_with("degraded"),
        "{}",
        String::from_utf8_lossy(&body)
    );
}

#[tokio::test]
async fn an_empty_fleet_is_not_ready() {
    let config = Config::from_toml_str(
        "listen = \"127.0.0.1:0\"\n[model]\nname = \"m\"\nblock_size = 4\n",
        &MapEnv::default(),
    )
    .unwrap();
    let svc = Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tokenizer())
        .unwrap();
    let (status, body) = call(&svc, Request::get("/readyz").body(Body::empty()).unwrap()).await;
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (StatusCode::SERVICE_UNAVAILABLE, "no_decode_worker: the fleet is empty\n")
    );
}

fn done_req(request_id: &str, booking_id: Option<&str>) -> Request<Body> {
    let report = kvmesh_core::api::DoneReport {
        request_id: request_id.into(),
        endpoint: None,
        outcome: kvmesh_core::api::Outcome::Success,
        status: Some(200),
        booking_id: booking_id.map(str::to_owned),
        usage: None,
    };
    Request::post(DONE_PATH).body(Body::from(serde_json::to_vec(&report).unwrap())).unwrap()
}

#[tokio::test]
async fn done_from_another_host_releases_the_booked_workers_load() {
    let svc = service("");
    let d = route_ok(&svc, "/v1/completions", &tokens_body(8), &[(headers::REQUEST_ID, "retried")])
        .await;
    let other = svc
        .state
        .snapshot()
        .workers
        .into_iter()
        .find(|w| w.id != d.worker)
        .map(|w| w.endpoint)
        .unwrap();
    // What the filter sends after Envoy retried on `other`: the served host and the booking's id.
    let report = kvmesh_core::api::DoneReport {
        request_id: "retried".into(),
        endpoint: Some(other),
        outcome: kvmesh_core::api::Outcome::Success,
        status: Some(200),
        booking_id: d.booking_id.clone(),
        usage: None,
    };
    let req =
        Request::post(DONE_PATH).body(Body::from(serde_json::to_vec(&report).unwrap())).unwrap();
    let (status, body) = call(&svc, req).await;
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (StatusCode::OK, r#"{"released":true}"#)
    );
    assert!(all_idle(&svc), "the booked worker's load is released: {:?}", active(&svc));
}

#[tokio::test]
async fn a_retry_served_elsewhere_moves_the_sessions_kv_home() {
    let svc = service("");
    let key = kvmesh_core::session::from_header_value("retried-conversation");
    let header = session::encode_header(key, session::SessionSource::Header);
    let home = |svc: &Service| {
        svc.state.sessions.lock().kv_home.get(key.0, crate::clock::now()).map(|w| w.to_string())
    };
    let moves = |svc: &Service| svc.state.metrics.kv_home_moves.get();
    let workers = svc.state.snapshot().workers;
    let endpoint =
        |id: &str| workers.iter().find(|w| w.id == id).map(|w| w.endpoint.clone()).unwrap();
    let turn = |n: u32| {
        let (svc, header, body) = (&svc, &header, tokens_body(8 + n));
        async move {
            route_ok(svc, "/v1/completions", &body, &[(headers::KVMESH_SESSION, header)]).await
        }
    };
    let report = |d: &RouteDecision, endpoint: String, outcome| kvmesh_core::api::DoneReport {
        request_id: "r".into(),
        endpoint: Some(endpoint),
        outcome,
        status: Some(200),
        booking_id: d.booking_id.clone(),
        usage: None,
    };
    let send = |r: kvmesh_core::api::DoneReport| {
        Request::post(DONE_PATH).body(Body::from(serde_json::to_vec(&r).unwrap())).unwrap()
    };

    // (served by: the booked worker, the other decode worker, the prefill-only worker, an unknown
    // host; outcome) → the home after the report.
    for (n, (served, outcome, moved)) in (0u32..).zip([
        ("booked", kvmesh_core::api::Outcome::Success, false),
        ("p0", kvmesh_core::api::Outcome::Success, false),
        ("unknown", kvmesh_core::api::Outcome::Success, false),
        ("other", kvmesh_core::api::Outcome::Error, false),
        ("other", kvmesh_core::api::Outcome::Success, true),
    ]) {
        let d = turn(n).await;
        assert_eq!(
            home(&svc).as_deref(),
            Some(d.worker.as_str()),
            "settling records the booked worker"
        );
        let other = if d.worker == "w0" { "w1" } else { "w0" };
        let at = match served {
            "booked" => endpoint(&d.worker),
            "other" => endpoint(other),
            "unknown" => "127.0.0.1:9".into(),
            id => endpoint(id),
        };
        let before = moves(&svc);
        let (status, body) = call(&svc, send(report(&d, at, outcome))).await;
        assert_eq!(
            (status, String::from_utf8_lossy(&body).as_ref()),
            (StatusCode::OK, r#"{"released":true}"#),
            "{served}"
        );
        let want = if moved { other } else { d.worker.as_str() };
        assert_eq!(home(&svc).as_deref(), Some(want), "served by {served}, {outcome:?}");
        assert_eq!(moves(&svc) - before, u64::from(moved), "{served}");
    }
    assert!(svc.state.metrics.render().contains("kvmesh_kv_home_moves_total 1"));
    assert!(all_idle(&svc), "{:?}", active(&svc));
}

fn active(svc: &Service) -> Vec<(String, u64)> {
    svc.state.snapshot().workers.into_iter().map(|w| (w.id, w.load.active_requests)).collect()
}

fn all_idle(svc: &Service) -> bool {
    active(svc).iter().all(|(_, n)| *n == 0) && svc.state.load.lock().is_empty()
}

#[tokio::test]
async fn one_client_request_id_ten_bookings_ten_releases() {
    let svc = service("");
    let calls = (0..10).map(|i| {
        let svc = svc.clone();
        tokio::spawn(async move {
            route_ok(
                &svc,
                "/v1/completions",
                &tokens_body(8 + i),
                &[(headers::REQUEST_ID, "same-id")],
            )
            .await
        })
    });
    let mut ids = Vec::new();
    for c in calls {
        ids.push(c.await.unwrap().booking_id.unwrap());
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 10, "one booking per call: {ids:?}");
    assert_eq!(active(&svc).iter().map(|(_, n)| n).sum::<u64>(), 10);
    for id in &ids {
        let (status, body) = call(&svc, done_req("same-id", Some(id))).await;
        assert_eq!(
            (status, String::from_utf8_lossy(&body).as_ref()),
            (StatusCode::OK, r#"{"released":true}"#)
        );
    }
    assert!(all_idle(&svc), "{:?}", active(&svc));
    // Each id releases once; an id from another process (or made up) releases nothing.
    assert_eq!(call(&svc, done_req("same-id", Some(&ids[0]))).await.1, br#"{"released":false}"#);
    assert_eq!(
        call(&svc, done_req("same-id", Some("kvb-00000000-1"))).await.1,
        br#"{"released":false}"#
    );
    assert!(svc
        .state
        .metrics
        .render()
        .contains(r#"kvmesh_done_reports_total{matched="true",outcome="success"} 10"#));
}

#[tokio::test]
async fn a_done_report_without_a_booking_id_releases_nothing_even_under_a_live_request_id() {
    // Clients may reuse an `x-request-id`: a report naming only it must not release a booking
    // (DESIGN.md), not the live one under that id nor, as an early report, the next one.
    let svc = service("");
    let d = route_ok(&svc, "/v1/completions", &tokens_body(8), &[(headers::REQUEST_ID, "reused")])
        .await;
    assert_eq!(call(&svc, done_req("reused", None)).await.1, br#"{"released":false}"#);
    assert_eq!(active(&svc).iter().map(|(_, n)| n).sum::<u64>(), 1, "still booked");
    // A report that comes first does not wait to release the next booking under its id.
    assert_eq!(call(&svc, done_req("early", None)).await.1, br#"{"released":false}"#);
    let next =
        route_ok(&svc, "/v1/completions", &tokens_body(8), &[(headers::REQUEST_ID, "early")]).await;
    assert_eq!(active(&svc).iter().map(|(_, n)| n).sum::<u64>(), 2, "both booked");
    let text = svc.state.metrics.render();
    assert!(text.contains("kvmesh_done_without_booking_id_total 2"), "{text}");
    for b in [&d, &next] {
        let (_, body) = call(&svc, done_req("any", b.booking_id.as_deref())).await;
        assert_eq!(body, br#"{"released":true}"#);
    }
    assert!(all_idle(&svc), "{:?}", active(&svc));
}

use crate::legs::tests::silent_worker;

async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(std::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_call_dropped_during_its_prefill_leg_leaks_no_booking() {
    let (addr, hold) = silent_worker().await;
    let text = fleet_toml("min_remote_prefill_tokens = 1\nprefill_timeout_ms = 9000")
        .replace("127.0.0.1:3", &addr.to_string())
        // Only p0 prefills (a `both` w1 could take the leg, refuse it and fall back at once).
        .replace("role = \"both\"", "role = \"decode\"");
    let config = Config::from_toml_str(&text, &MapEnv::default()).unwrap();
    let svc = Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tokenizer())
        .unwrap();
    let pending = {
        let svc = svc.clone();
        tokio::spawn(async move {
            call(
                &svc,
                route_req("/v1/completions", &tokens_body(64), &[(headers::REQUEST_ID, "gone")]),
            )
            .await
        })
    };
    // Both bookings exist while the leg waits: the decode worker's and the prefill leg's.
    until("the leg's booking", || svc.state.load.lock().len() == 2).await;
    assert_eq!(active(&svc).iter().find(|(id, _)| id == "p0").map(|(_, n)| *n), Some(1));
    pending.abort();
    let _ = pending.await;
    until("every booking released", || all_idle(&svc)).await;
    assert!(svc
        .state
        .metrics
        .render()
        .contains(r#"kvmesh_route_cancelled_total{stage="booked"} 1"#));
    hold.abort();
}

#[tokio::test]
async fn the_request_deadline_releases_a_stuck_leg_and_says_why() {
    let (addr, hold) = silent_worker().await;
    let text = fleet_toml(
        "min_remote_prefill_tokens = 1\nprefill_timeout_ms = 5000\nrequest_timeout_ms = 300",
    )
    .replace("127.0.0.1:3", &addr.to_string())
    // Only p0 prefills (a `both` w1 could take the leg, refuse it and fall back at once).
    .replace("role = \"both\"", "role = \"decode\"");
    // prefill_timeout_ms must be below request_timeout_ms; bypass validation by building the config directly.
    let mut config = Config::from_toml_str(
        &text.replace("request_timeout_ms = 300", "request_timeout_ms = 6000"),
        &MapEnv::default(),
    )
    .unwrap();
    config.routing.request_timeout_ms = 300;
    let svc = Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tokenizer())
        .unwrap();
    let resp = router(svc.state.clone())
        .oneshot(route_req("/v1/completions", &tokens_body(64), &[]))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        resp.headers().get(kvmesh_core::api::ERROR_REASON_HEADER).and_then(|v| v.to_str().ok()),
        Some("request_timeout")
    );
    assert!(all_idle(&svc), "{:?}", active(&svc));
    hold.abort();
}

#[tokio::test]
async fn short_prompts_tokenize_inline_long_ones_on_the_pool_with_exact_counts() {
    let svc = service("");
    for n in [8u32, 20_000] {
        let body = tokens_body(n);
        let inline = body.len() <= crate::route::prompt::INLINE_TOKENIZE_MAX_BODY_BYTES;
        assert_eq!(inline, n == 8, "{} bytes", body.len());
        let d = route_ok(&svc, "/v1/completions", &body, &[]).await;
        assert_eq!(d.isl_blocks, n / 4, "{n} tokens");
    }
}

#[tokio::test]
async fn a_continued_long_conversation_tokenizes_inline_unless_the_memo_lost_its_prefix() {
    let moved = |svc: &Arc<Service>| svc.state.metrics.tokenize_moved_to_pool.get();
    let session = [(headers::KVMESH_SESSION, "00000000000000ab;source=header")];
    let mut answers = Vec::new();
    // Approximate mode tokenizes every prompt whole: turn 1 leaves all of its text in the memo.
    for (memo, moved_on_turn_two) in [(crate::tokenize::DEFAULT_MEMO_BYTES, 0), (0, 1)] {
        let config =
            Config::from_toml_str(&fleet_toml("mode = \"approximate\""), &MapEnv::default())
                .unwrap();
        let svc = Service::start_with_tokenizer(
            config,
            None,
            Arc::new(MapEnv::default()),
            tokenizer().with_memo_bytes(memo),
        )
        .unwrap();
        // ~100 KB: past the inline bound, so turn 1 goes to the pool; turn 2 continues it.
        let mut messages = vec![
            serde_json::json!({"role": "system", "content": "A long document about the mesh. ".repeat(3_000)}),
        ];
        messages.push(serde_json::json!({"role": "user", "content": "What does it say?"}));
        let mut turns = Vec::new();
        for turn in 0..2 {
            let body =
                serde_json::json!({"model": "m", "messages": messages, "stream": true}).to_string();
            assert!(body.len() > crate::route::prompt::INLINE_TOKENIZE_MAX_BODY_BYTES);
            turns.push(route_ok(&svc, "/v1/chat/completions", &body, &session).await.isl_blocks);
            let continued = svc.state.metrics.body_memo.with_label_values(&["hit"]).get();
            assert_eq!(
                (continued, moved(&svc)),
                (turn, if turn == 0 { 0 } else { moved_on_turn_two }),
                "memo {memo} B, turn {turn}: read continued, moved to the pool"
            );
            messages.push(
                serde_json::json!({"role": "assistant", "content": "It says the mesh routes."}),
            );
            messages.push(serde_json::json!({"role": "user", "content": "And then?"}));
        }
        answers.push(turns);
    }
    // Moved or not, the prompt was tokenized whole and exactly.
    assert_eq!(answers[0], answers[1]);
}

#[tokio::test]
async fn calls_beyond_the_concurrency_bound_are_shed_fast() {
    let svc = service("max_concurrent_routes = 2");
    let state = &svc.state;
    let held: Vec<_> = (0..2)
        .map(|_| crate::route::admission::admit(&state.route_inflight, 2, &state.metrics).unwrap())
        .collect();
    let resp = router(state.clone())
        .oneshot(route_req("/v1/completions", &tokens_body(8), &[]))
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        resp.headers().get(kvmesh_core::api::ERROR_REASON_HEADER).and_then(|v| v.to_str().ok()),
        Some("overloaded_shed")
    );
    assert!(state
        .metrics
        .render()
        .contains(r#"kvmesh_route_errors_total{model="m",reason="overloaded_shed"} 1"#));
    assert!(state.load.lock().is_empty(), "a shed call books nothing");
    drop(held);
    route_ok(&svc, "/v1/completions", &tokens_body(8), &[]).await;
}

#[tokio::test]
async fn reload_keeps_unchanged_workers_and_drops_removed_ones() {
    let svc = service("");
    let stored = |svc: &Arc<Service>, worker: &str| {
        let tokens: Vec<u32> = (1000..1004).collect();
        let batch = EventBatch {
            ts: 1.0,
            events: vec![KvEvent::Stored {
                block_hashes: vec![1],
                parent: None,
                token_ids: tokens,
                block_size: 4,
                lora_name: None,
                cache_salt: None,
                medium: None,
                group_idx: None,
                spec_kind: None,
                sliding_window: None,
                extra_terms: vec![],
            }],
            dp_rank: None,
        };
        svc.state
            .applier
            .send(ApplierMsg::Batch { slot: slot_of(svc, worker), seq: 0, batch })
            .unwrap();
    };
    stored(&svc, "w0");
    stored(&svc, "w1");
    svc.barrier();
    let gen = svc.state.snapshot().generation;
    // Remove w1, move w0's HTTP endpoint, add w2.
    let text = fleet_toml("")
        .replace(
            "[[workers]]\nid = \"w1\"\nrole = \"both\"\nendpoint = \"127.0.0.1:2\"\n",
            "[[workers]]\nid = \"w2\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:4\"\n",
        )
        .replace("127.0.0.1:1", "127.0.0.1:5");
    let new = Config::from_toml_str(&text, &MapEnv::default()).unwrap();
    assert!(svc.reload(new.clone()).await.unwrap());
    svc.barrier();
    let ids: Vec<String> = svc.state.snapshot().workers.iter().map(|w| w.id.clone()).collect();
    assert_eq!(ids, vec!["w0", "w2", "p0"]);
    assert!(svc.state.snapshot().generation > gen);
    let chains =
        kvmesh_core::hashing::sequence_hashes(&(1000..1004).collect::<Vec<_>>(), 4, XXH3_SEED);
    let m = svc.state.index.read().find_matches(&chains);
    assert_eq!(m, vec![(slot_of(&svc, "w0"), 1)], "w0 kept its blocks; w1's left with it");
    assert!(!svc.reload(new).await.unwrap(), "same config: nothing to do");
}

/// The filter sends the done reports that waited while a call was out as one array.
#[tokio::test]
async fn a_batch_of_done_reports_releases_each_booking() {
    let svc = service("");
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(
            route_ok(&svc, "/v1/completions", &tokens_body(8 + i), &[]).await.booking_id.unwrap(),
        );
    }
    assert_eq!(active(&svc).iter().map(|(_, n)| n).sum::<u64>(), 3);
    let report = |id: &str| kvmesh_core::api::DoneReport {
        request_id: "r".into(),
        endpoint: None,
        outcome: kvmesh_core::api::Outcome::Success,
        status: Some(200),
        booking_id: Some(id.to_owned()),
        usage: None,
    };
    // Two of the three, and one made up: two released.
    let batch = vec![report(&ids[0]), report("kvb-00000000-1"), report(&ids[2])];
    let post = |body: Vec<u8>| Request::post(DONE_PATH).body(Body::from(body)).unwrap();
    let (status, body) = call(&svc, post(serde_json::to_vec(&batch).unwrap())).await;
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (StatusCode::OK, r#"{"released":2}"#)
    );
    assert_eq!(active(&svc).iter().map(|(_, n)| n).sum::<u64>(), 1);
    let (status, body) =
        call(&svc, post(serde_json::to_vec(&vec![report(&ids[1])]).unwrap())).await;
    assert_eq!(
        (status, String::from_utf8_lossy(&body).as_ref()),
        (StatusCode::OK, r#"{"released":1}"#)
    );
    assert!(all_idle(&svc), "{:?}", active(&svc));
    // Bounded: a batch past MAX_DONE_BATCH, or one unreadable report, is refused whole.
    let too_many = vec![report(&ids[0]); kvmesh_core::api::MAX_DONE_BATCH + 1];
    assert_eq!(
        call(&svc, post(serde_json::to_vec(&too_many).unwrap())).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        call(&svc, post(br#"[{"request_id":"r","outcome":"success"},{}]"#.to_vec())).await.0,
        StatusCode::BAD_REQUEST
    );
    assert!(svc
        .state
        .metrics
        .render()
        .contains(r#"kvmesh_done_reports_total{matched="true",outcome="success"} 3"#));
}

#[tokio::test]
async fn a_call_started_past_its_callers_deadline_books_nothing() {
    let svc = service("");
    let now_ms =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis()
            as u64;
    // The filter's caller stopped waiting a second ago (its call timed out, or its VM trapped):
    // refused, nothing booked.
    let past = (now_ms - 1000).to_string();
    let (status, bytes) = call(
        &svc,
        route_req(
            "/v1/completions",
            &tokens_body(64),
            &[(headers::KVMESH_ROUTE_DEADLINE, past.as_str())],
        ),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{}", String::from_utf8_lossy(&bytes));
    assert!(String::from_utf8_lossy(&bytes).contains(crate::route::request::CALLER_GONE));
    assert!(all_idle(&svc), "a refused call booked: {:?}", active(&svc));
    assert!(svc
        .state
        .metrics
        .render()
        .contains("kvmesh_route_errors_total{model=\"\",reason=\"caller_gone\"} 1"));
    // A caller still waiting (and one that sends no deadline) is routed and booked as before.
    let future = (now_ms + 60_000).to_string();
    let d = route_ok(
        &svc,
        "/v1/completions",
        &tokens_body(64),
        &[(headers::KVMESH_ROUTE_DEADLINE, future.as_str())],
    )
    .await;
    assert!(d.booking_id.is_some());
    route_ok(&svc, "/v1/completions", &tokens_body(64), &[]).await;
    assert_eq!(svc.state.load.lock().len(), 2);
}

/// A `/v1/done` report of decision `d`, served by its worker, with the engine's usage.
fn done_with_usage(
    d: &RouteDecision,
    usage: Option<kvmesh_core::api::EngineUsage>,
) -> Request<Body> {
    let report = kvmesh_core::api::DoneReport {
        request_id: "r".into(),
        endpoint: Some(d.endpoint.clone()),
        outcome: kvmesh_core::api::Outcome::Success,
        status: Some(200),
        booking_id: d.booking_id.clone(),
        usage,
    };
    Request::post(DONE_PATH).body(Body::from(serde_json::to_vec(&report).unwrap())).unwrap()
}

fn usage(prompt: u64, completion: u64, cached: u64) -> Option<kvmesh_core::api::EngineUsage> {
    Some(kvmesh_core::api::EngineUsage {
        prompt_tokens: prompt,
        completion_tokens: completion,
        cached_tokens: Some(cached),
    })
}

#[tokio::test]
async fn done_attributes_the_hit_and_the_answer_credits_the_next_turn() {
    let svc = service("");
    let m = &svc.state.metrics;
    let tokens = |name: &str| match name {
        "prompt" => m.attribution_prompt_tokens.with_label_values(&["m"]).get(),
        "available" => m.attribution_available_tokens.with_label_values(&["m"]).get(),
        "captured" => m.attribution_captured_tokens.with_label_values(&["m"]).get(),
        "delivered" => m.attribution_delivered_tokens.with_label_values(&["m"]).get(),
        "unpredicted" => m.attribution_unpredicted_tokens.with_label_values(&["m"]).get(),
        cause => m.attribution_lost_tokens.with_label_values(&["m", cause]).get(),
    };
    let requests = |result: &str| m.attribution_requests.with_label_values(&["m", result]).get();
    let session = [(headers::KVMESH_SESSION, "00000000000000c1;source=header")];
    let ids = |r: std::ops::Range<u32>| r.map(|i| i.to_string()).collect::<Vec<_>>();
    let body = |ids: Vec<String>| format!(r#"{{"model":"m","prompt":[{}]}}"#, ids.join(","));

    // Turn 1: 40 tokens (10 blocks of 4), nothing cached anywhere; the engine says so.
    let turn1 = ids(1000..1040);
    let d1 = route_ok(&svc, "/v1/completions", &body(turn1.clone()), &session).await;
    let (status, _) = call(&svc, done_with_usage(&d1, usage(40, 9, 0))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(requests("attributed"), 1);
    assert_eq!(
        ["prompt", "available", "captured", "delivered", "workload"].map(tokens),
        [40, 0, 0, 0, 40],
        "a cold prompt: all of it lost to the workload"
    );
    assert_eq!(m.answer_credits.with_label_values(&["m"]).get(), 1);

    // Turn 2 right after: turn 1, the 9 generated tokens, and 20 new ones. The engine computed
    // 40 + 9 - 1 = 48 tokens of turn 1 (12 full blocks): credited on the worker that answered
    // before any event says so, and predicted as captured there.
    let turn2: Vec<String> =
        turn1.into_iter().chain(ids(5000..5009)).chain(ids(7000..7020)).collect();
    let d2 = route_ok(&svc, "/v1/completions", &body(turn2), &session).await;
    assert_eq!(d2.worker, d1.worker, "{}", d2.reason);
    assert_eq!(d2.overlap_blocks, 0, "the decision's overlap is the index's alone");
    let (status, _) = call(&svc, done_with_usage(&d2, usage(69, 5, 48))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(requests("attributed"), 2);
    assert_eq!(
        ["captured", "delivered", "not_delivered", "unpredicted"].map(tokens),
        [48, 48, 0, 0],
        "delivered == captured on a back-to-back turn"
    );
    assert_eq!(
        tokens("prompt") - tokens("delivered"),
        tokens("workload") + tokens("routing") + tokens("not_delivered") - tokens("unpredicted")
    );

    // Reports that cannot be attributed say why.
    let d3 = route_ok(&svc, "/v1/completions", &tokens_body(30), &[]).await;
    call(&svc, done_with_usage(&d3, None)).await;
    assert_eq!(requests("no_usage"), 1);
    let d4 = route_ok(&svc, "/v1/completions", &tokens_body(31), &[]).await;
    let mut no_cached = usage(31, 1, 0);
    if let Some(u) = no_cached.as_mut() {
        u.cached_tokens = None;
    }
    call(&svc, done_with_usage(&d4, no_cached)).await;
    assert_eq!(requests("no_cached_tokens"), 1);
    assert!(all_idle(&svc), "{:?}", active(&svc));
    let text = m.render();
    assert!(
        text.contains(r#"kvmesh_attribution_lost_tokens_total{cause="workload",model="m"} 61"#),
        "{text}"
    );
}
