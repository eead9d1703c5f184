//! The replay drivers and the report on a real loopback socket.
//!
//! The server here is a scripted OpenAI-style SSE endpoint, not a stand-in for `vllm-sim`: it
//! produces the wire edge cases the client must survive (a stalled stream, a 503, a stream cut
//! before `[DONE]`, an error event) on demand, which a real engine does not do reliably. The
//! behaviour is chosen by `max_tokens`. End-to-end runs against the real simulator belong to the
//! orchestrator's smoke run.

// An integration-test crate: a panic is how a helper fails the test, as in #[test] bodies.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kvmesh_bench::chat::ChatConfig;
use kvmesh_bench::chat_run::{run_chat, ChatRunConfig};
use kvmesh_bench::client::{build_client, discover_model};
use kvmesh_bench::record::{read_all, RequestRecord};
use kvmesh_bench::replay::{run_trace, ReplayConfig};
use kvmesh_bench::sink::Sink;
use kvmesh_bench::trace::{Indexed, TraceRecord};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const STALL: u32 = 88;
const UNAVAILABLE: u32 = 77;
const CUT: u32 = 99;
const ERROR_EVENT: u32 = 66;

#[derive(Clone, Default)]
struct Seen {
    bodies: Arc<Mutex<Vec<(HeaderMap, Value)>>>,
}

fn sse(events: Vec<String>, stall_first: bool) -> Body {
    let stream =
        futures::stream::unfold((events.into_iter(), stall_first), |(mut it, stall)| async move {
            if stall {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
            let ev = it.next()?;
            Some((Ok::<_, Infallible>(Bytes::from(ev)), (it, false)))
        });
    Body::from_stream(stream)
}

fn stream_response(n_prompt: usize, max_tokens: u32, reply: &str, worker: &str) -> Response {
    let mut events = Vec::new();
    let chat = reply.starts_with("reply");
    if chat {
        events.push(format!(
            "data: {}\n\n",
            json!({"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]})
        ));
    }
    let mut cut = false;
    let mut stall = false;
    match max_tokens {
        UNAVAILABLE => {
            return (StatusCode::SERVICE_UNAVAILABLE, [("x-sim-worker", worker)], "overloaded")
                .into_response()
        }
        STALL => stall = true,
        CUT => cut = true,
        ERROR_EVENT => events
            .push(format!("data: {}\n\n", json!({"error":{"message":"engine died","code":500}}))),
        _ => {}
    }
    let piece = |t: &str| {
        if chat {
            json!({"choices":[{"index":0,"delta":{"content":t}}]})
        } else {
            json!({"choices":[{"index":0,"text":t}]})
        }
    };
    events.push(format!("data: {}\n\n", piece(reply)));
    if !cut {
        events.push(format!(
            "data: {}\n\n",
            json!({"choices":[],"usage":{"prompt_tokens":n_prompt,"completion_tokens":max_tokens,"prompt_tokens_details":{"cached_tokens":n_prompt / 2}}})
        ));
        events.push("data: [DONE]\n\n".to_string());
    }
    Response::builder()
        .header("content-type", "text/event-stream")
        .header("x-sim-worker", worker)
        .header("x-kvmesh-decision-mode", "aggregate")
        .header("x-kvmesh-overlap-blocks", "1")
        .header("x-kvmesh-isl-blocks", "2")
        .body(sse(events, stall))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn completions(
    State(seen): State<Seen>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Response {
    let n = body["prompt"].as_array().map(Vec::len).unwrap_or(0);
    let max = body["max_tokens"].as_u64().unwrap_or(1) as u32;
    let worker = if n % 2 == 0 { "w0" } else { "w1" };
    seen.bodies.lock().unwrap().push((headers, body));
    stream_response(n, max, "tok ", worker)
}

async fn chat(State(seen): State<Seen>, headers: HeaderMap, Json(body): Json<Value>) -> Response {
    let n = body["messages"].as_array().map(Vec::len).unwrap_or(0);
    let max = body["max_tokens"].as_u64().unwrap_or(1) as u32;
    seen.bodies.lock().unwrap().push((headers, body));
    stream_response(n * 10, max, &format!("reply-{n}"), "w0")
}

async fn serve() -> (String, Seen) {
    let seen = Seen::default();
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat))
        .route(
            "/v1/models",
            get(|| async {
                Json(json!({"object":"list","data":[{"id":"sim-model","object":"model"}]}))
            }),
        )
        .with_state(seen.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}"), seen)
}

fn req(index: usize, ts: f64, input: u32, output: u32, ids: &[u64]) -> Indexed {
    Indexed {
        index,
        record: TraceRecord {
            timestamp: ts,
            input_length: input,
            output_length: output,
            hash_ids: ids.to_vec(),
        },
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trace_replay_records_every_request_including_failures() {
    let (url, seen) = serve().await;
    let client = build_client(Duration::from_secs(2), 16).unwrap();
    assert_eq!(discover_model(&client, &url, Duration::from_secs(5)).await.unwrap(), "sim-model");
    let selected = vec![
        req(0, 0.0, 1024, 5, &[0, 1]),
        req(1, 10.0, 1500, 5, &[0, 1, 2]),
        req(2, 20.0, 600, STALL, &[0, 3]),
        req(3, 30.0, 600, UNAVAILABLE, &[0, 4]),
        req(4, 40.0, 600, CUT, &[0, 5]),
        req(5, 50.0, 600, ERROR_EVENT, &[0, 6]),
    ];
    let cfg = ReplayConfig {
        base_url: url.clone(),
        model: "sim-model".into(),
        speedup: 10.0,
        max_concurrency: 2,
        request_timeout: Duration::from_millis(800),
        session_header: Some("x-session-id".into()),
        anchor_block: 1,
        token_seed: 0,
        ignore_eos: true,
    };
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-test-{}", std::process::id()));
    let out = dir.join("trace.jsonl");
    let sink = Sink::create(&out, 0).unwrap();
    let wall = run_trace(client, cfg, selected, sink.sender()).await;
    let stats = sink.close().await.unwrap();
    assert_eq!((stats.written, stats.failed), (6, 4));
    assert!(wall < Duration::from_secs(10), "bounded by the deadline: {wall:?}");

    let mut recs = read_all(std::io::BufReader::new(std::fs::File::open(&out).unwrap())).unwrap();
    recs.sort_by_key(|r| r.index);
    let ok = &recs[0];
    assert!(ok.ok(), "{ok:?}");
    assert_eq!(ok.worker.as_deref(), Some("w0"));
    assert_eq!(
        (ok.prompt_tokens, ok.cached_tokens, ok.output_tokens),
        (Some(1024), Some(512), Some(5))
    );
    assert_eq!((ok.input_tokens, ok.max_tokens), (Some(1024), 5));
    assert_eq!(ok.session.as_deref(), Some("conv-1"));
    assert_eq!(
        (ok.overlap_blocks, ok.isl_blocks, ok.decision_mode.as_deref()),
        (Some(1), Some(2), Some("aggregate"))
    );
    assert!(ok.ttft_ms.unwrap() <= ok.e2e_ms);
    assert_eq!(recs[1].worker.as_deref(), Some("w0"));
    assert!(recs[2].error.as_deref().unwrap().starts_with("timeout after"), "{:?}", recs[2]);
    assert_eq!(recs[2].status, Some(200));
    assert_eq!(recs[3].status, Some(503));
    assert_eq!(recs[3].error.as_deref(), Some("HTTP 503: overloaded"));
    assert_eq!(recs[4].error.as_deref(), Some("stream ended before [DONE]"));
    assert_eq!(recs[5].error.as_deref(), Some("engine died"));
    assert!(recs.windows(2).all(|w| w[0].scheduled_ms <= w[1].scheduled_ms));

    // Both conversation-1 requests carried the same session header and the shared token prefix.
    let bodies = seen.bodies.lock().unwrap().clone();
    let conv1: Vec<&(HeaderMap, Value)> = bodies
        .iter()
        .filter(|(h, _)| h.get("x-session-id").is_some_and(|v| v == "conv-1"))
        .collect();
    assert_eq!(conv1.len(), 2);
    let p0 = conv1[0].1["prompt"].as_array().unwrap();
    let p1 = conv1[1].1["prompt"].as_array().unwrap();
    assert_eq!(p0[..1024], p1[..1024]);
    assert_eq!(conv1[0].1["stream_options"], json!({"include_usage": true}));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_sessions_append_the_streamed_reply() {
    let (url, seen) = serve().await;
    let client = build_client(Duration::from_secs(2), 16).unwrap();
    let cfg = ChatConfig {
        seed: 7,
        sessions: 3,
        concurrent_sessions: 2,
        turns_min: 3,
        turns_max: 3,
        system_prompts: 2,
        system_prompt_words: 40,
        user_words: 5,
        think_time_ms: 5.0,
        start_stagger_ms: 5.0,
        max_tokens: 4,
    };
    let run = ChatRunConfig {
        base_url: url,
        model: "sim-model".into(),
        request_timeout: Duration::from_secs(5),
        session_header: Some("x-session-id".into()),
        ignore_eos: false,
    };
    let dir = std::env::temp_dir().join(format!("kvmesh-bench-chat-{}", std::process::id()));
    let out = dir.join("chat.jsonl");
    let sink = Sink::create(&out, 0).unwrap();
    run_chat(client, run, cfg, sink.sender()).await;
    let stats = sink.close().await.unwrap();
    assert_eq!((stats.written, stats.failed), (9, 0));
    let recs: Vec<RequestRecord> =
        read_all(std::io::BufReader::new(std::fs::File::open(&out).unwrap())).unwrap();
    assert!(recs.iter().all(|r| r.ok() && r.ttft_ms.is_some() && r.session.is_some()));
    let mut indices: Vec<u64> = recs.iter().map(|r| r.index).collect();
    indices.sort_unstable();
    assert_eq!(indices, (0..9).collect::<Vec<u64>>());

    let bodies = seen.bodies.lock().unwrap().clone();
    let session0: Vec<&Value> = bodies
        .iter()
        .filter(|(h, _)| h.get("x-session-id").is_some_and(|v| v == "chat-7-0"))
        .map(|(_, b)| b)
        .collect();
    assert_eq!(session0.len(), 3);
    let last = session0[2]["messages"].as_array().unwrap();
    // system, user, assistant, user, assistant, user
    assert_eq!(last.len(), 6);
    assert_eq!(last[2], json!({"role": "assistant", "content": "reply-2"}));
    assert_eq!(last[4], json!({"role": "assistant", "content": "reply-4"}));
    assert_eq!(last[0], session0[0]["messages"][0], "system prompt is stable within a session");
    let _ = std::fs::remove_dir_all(&dir);
}
