//! The filter's per-request work on one body, natively or in V8, for instruction counts and
//! timings:
//!
//! * callgrind: `valgrind --tool=callgrind target/wasm/examples/body_path [tokens] [requests]`
//!   (build: `cargo build -p kvmesh-filter --example body_path --profile wasm`); instructions per
//!   request = (total at `requests` − total at 1) ÷ (`requests` − 1).
//! * V8, the engine Envoy runs the filter in (TurboFan only, as proxy-wasm's V8 host sets it):
//!   `cargo build -p kvmesh-filter --example body_path --profile wasm --target wasm32-wasip1`, then
//!   `node --no-liftoff filter/examples/wasi_run.mjs target/wasm32-wasip1/wasm/examples/body_path.wasm 8000 3000`
//!   (Node ≥ 20; the proxy-wasm host functions are stubs: only pure code runs).
//!
//! Drives a request's whole life through [`RequestFlow`] — headers, body, the indexer's decision
//! (an answer the release indexer gave), the end — as Envoy does, for a chat continuation of about
//! `tokens` tokens (default 8000), `requests` times (default 20), and prints the mean time per
//! request of the body read (`on_body`) and of the answer (`on_route_answer`). The body is copied
//! in as the host read copies it (outside the timed part).

use std::rc::Rc;
use std::time::{Duration, Instant};

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

/// A chat continuation shaped like the overhead bench's (`kvmesh_bench::overhead::cases::Shape`):
/// a 250-word system prompt, then user (120 words) and assistant (200 words) turns until about
/// `tokens` tokens (1.1 per word), ending with a user message; ~6 bytes per word of text.
fn chat_body(tokens: usize) -> Vec<u8> {
    let words = [
        "kv", "cache", "routing", "prefix", "engine", "token", "block", "worker", "envoy", "filter",
    ];
    let text = |n: usize, seed: usize| {
        (0..n).map(|i| words[(i * 7 + seed) % words.len()]).collect::<Vec<_>>().join(" ")
    };
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
    serde_json::to_vec(
        &serde_json::json!({"model": "m", "messages": messages, "stream": true, "max_tokens": 16}),
    )
    .unwrap_or_default()
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
    let answer = br#"{"endpoint":"127.0.0.1:38137","fallbacks":["127.0.0.1:37649"],"worker":"w0","mode":"aggregate","overlap_blocks":0,"isl_blocks":468,"kv_transfer_params":null,"reason":"overlap 0/468 blocks (best elsewhere 23), predicted 374.8 ms, cost 381.8 ms; next w1 704.7 ms, cost 717.7 ms","reason_codes":["lowest_cost"],"best_overlap_worker":null,"best_overlap_blocks":0,"peer_worker":null,"predicted_ttft_ms":374.75,"booking_id":"kvb-71d7f707-2"}"#;
    let mut calls = 0;
    let (mut on_body, mut on_answer) = (Duration::ZERO, Duration::ZERO);
    for i in 0..requests {
        let mut flow = RequestFlow::new(config.clone(), i);
        flow.on_request_headers(&headers, false, 1);
        flow.on_request_body(body.len(), true);
        // The host's read: Envoy's buffer copied into the VM.
        let copy = body.clone();
        let t = Instant::now();
        let step = flow.on_body(Some(copy), 2, &NoFleet);
        on_body += t.elapsed();
        if let Next::Call(call) = step.next {
            calls += usize::from(call.body.is_some());
        }
        let t = Instant::now();
        flow.on_route_answer(Some(200), answer, 3, &NoFleet);
        on_answer += t.elapsed();
        flow.on_response_headers(Some(200), false);
        flow.on_response_data(10, 4);
        flow.on_response_body(true);
        flow.finish(Some(200));
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / f64::from(requests.max(1));
    println!("{requests} requests of {} body bytes, {calls} route calls", body.len());
    println!(
        "per request: on_body {:.1} µs, on_route_answer {:.1} µs",
        per(on_body),
        per(on_answer)
    );
}
