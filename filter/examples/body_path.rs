//! The filter's per-request work on one body, natively, for instruction counting:
//! `valgrind --tool=callgrind target/wasm/examples/body_path [tokens] [requests]`
//! (build: `cargo build -p kvmesh-filter --example body_path --profile wasm`).
//!
//! Drives a request's whole life through [`RequestFlow`] — headers, body, the indexer's canned
//! decision, the end — as Envoy does, for a chat continuation of about `tokens` tokens (default
//! 8000), `requests` times (default 20). The body is copied in as the host read copies it.
//! Instructions per request = callgrind's total ÷ `requests` (minus the one-off setup).

use std::rc::Rc;

use kvmesh_core::api::FleetSnapshot;
use kvmesh_filter::effects::Next;
use kvmesh_filter::flow::{FleetSource, RequestFlow};
use kvmesh_filter::FilterConfig;

struct NoFleet;

impl FleetSource for NoFleet {
    fn fleet(&self) -> Option<Rc<FleetSnapshot>> {
        None
    }
}

/// A chat continuation shaped like the overhead bench's (`kvmesh_bench::overhead::plan::Shape`):
/// a 250-word system prompt, then user (120 words) and assistant (200 words) turns until about
/// `tokens` tokens (1.1 per word), ending with a user message; ~6 bytes per word of text.
fn chat_body(tokens: usize) -> Vec<u8> {
    let words = ["kv", "cache", "routing", "prefix", "engine", "token", "block", "worker", "envoy", "filter"];
    let text = |n: usize, seed: usize| (0..n).map(|i| words[(i * 7 + seed) % words.len()]).collect::<Vec<_>>().join(" ");
    let mut messages = vec![serde_json::json!({"role": "system", "content": text(250, 1)})];
    let (mut total, mut t) = (250, 0);
    while (total as f64) * 1.1 < tokens as f64 {
        let (role, n) = if t % 2 == 0 { ("user", 120) } else { ("assistant", 200) };
        messages.push(serde_json::json!({"role": role, "content": text(n, t)}));
        total += n;
        t += 1;
    }
    if t % 2 == 0 {
        messages.push(serde_json::json!({"role": "user", "content": "and now?"}));
    }
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages, "stream": true, "max_tokens": 16})).unwrap_or_default()
}

fn main() {
    let mut args = std::env::args().skip(1);
    let tokens = args.next().and_then(|a| a.parse().ok()).unwrap_or(8000);
    let requests: u32 = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    let body = chat_body(tokens);
    let config = Rc::new(FilterConfig::default());
    let headers: Vec<(String, Vec<u8>)> = vec![
        (":method".into(), b"POST".to_vec()),
        (":path".into(), b"/v1/chat/completions".to_vec()),
        ("x-request-id".into(), b"rid-1".to_vec()),
        ("content-length".into(), body.len().to_string().into_bytes()),
    ];
    let answer = br#"{"endpoint":"127.0.0.1:8001","fallbacks":["127.0.0.1:8002"],"worker":"w1","mode":"aggregate","overlap_blocks":480,"isl_blocks":500,"reason":"overlap","booking_id":"b1"}"#;
    let mut calls = 0;
    for i in 0..requests {
        let mut flow = RequestFlow::new(config.clone(), i);
        flow.on_request_headers(&headers, false, 1);
        flow.on_request_body(body.len(), true);
        // The host's read: Envoy's buffer copied into the VM.
        let step = flow.on_body(Some(body.clone()), 2);
        if let Next::Call(call) = step.next {
            calls += usize::from(call.body.is_some());
        }
        flow.on_route_answer(Some(200), answer, 3, &NoFleet);
        flow.on_response_headers(Some(200), false);
        flow.on_response_data(10, 4);
        flow.on_response_body(true);
        flow.finish(Some(200));
    }
    println!("{requests} requests of {} body bytes, {calls} route calls", body.len());
}
