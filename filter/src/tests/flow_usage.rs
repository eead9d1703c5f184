//! The response-side usage scan of [`super::RequestFlow`]: the engine's `usage` read from the last
//! bytes of the response chunks, as `host::http` feeds them, into the done report.

use super::tests::{flow, Fleet};
use super::*;
use kvmesh_core::api::EngineUsage;
use kvmesh_core::usage::USAGE_TAIL_BYTES;
use serde_json::{json, Value};

const CHAT: &str = r#"{"model":"m","messages":[{"role":"user","content":"hello"}],"stream":true}"#;

fn headers() -> Vec<(String, Vec<u8>)> {
    [(":method", "POST"), (":path", "/v1/chat/completions"), ("x-request-id", "rid-u")]
        .iter()
        .map(|(n, v)| ((*n).to_owned(), v.as_bytes().to_vec()))
        .collect()
}

/// A flow routed by the indexer (booking id `booking`, when given), response headers `status`.
fn routed(booking: Option<&str>, status: u16) -> RequestFlow {
    let fleet = Fleet(None);
    let mut f = flow(FilterConfig::default());
    f.on_request_headers(&headers(), false, 1);
    f.on_request_body(CHAT.len(), true);
    let step = f.on_body(Some(CHAT.as_bytes().to_vec()), 2, &fleet);
    assert!(matches!(step.next, Next::Call(_)), "{:?}", step.next);
    let mut d = json!({"endpoint": "10.0.0.1:8000", "worker": "w1", "mode": "aggregate",
        "overlap_blocks": 2, "isl_blocks": 4, "reason": "r"});
    if let Some(b) = booking {
        d["booking_id"] = Value::from(b);
    }
    f.on_route_answer(Some(200), &serde_json::to_vec(&d).unwrap(), 3, &fleet);
    f.on_response_headers(Some(status), false);
    f
}

/// Feeds `body` in chunks of `size` as the host does; returns the most bytes read of one chunk.
fn feed(f: &mut RequestFlow, body: &[u8], size: usize) -> usize {
    let mut most = 0;
    for chunk in body.chunks(size) {
        let want = f.response_tail_wanted(chunk.len());
        most = most.max(want);
        if want > 0 {
            f.on_response_tail(&chunk[chunk.len() - want..], chunk.len());
        }
        f.on_response_body(false);
    }
    f.on_response_body(true);
    most
}

fn usage_of(done: &[Effect]) -> Option<Option<EngineUsage>> {
    done.iter().find_map(|e| match e {
        Effect::QueueDone(r) => Some(r.usage),
        _ => None,
    })
}

fn stream(tokens: usize, usage: bool) -> String {
    let mut s = String::new();
    for i in 0..tokens {
        s.push_str(&format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" w{i}\"}}}}]}}\n\n"
        ));
    }
    if usage {
        s.push_str("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":64,\"completion_tokens\":9,\"total_tokens\":73,\"prompt_tokens_details\":{\"cached_tokens\":48}}}\n\n");
    }
    s.push_str("data: [DONE]\n\n");
    s
}

const USAGE: EngineUsage =
    EngineUsage { prompt_tokens: 64, completion_tokens: 9, cached_tokens: Some(48) };

#[test]
fn a_booked_streamed_response_reports_its_usage_whatever_the_chunking() {
    for size in [1, 5, 80, 1 << 20] {
        let mut f = routed(Some("bk-1"), 200);
        feed(&mut f, stream(40, true).as_bytes(), size);
        assert_eq!(usage_of(&f.finish(Some(200))), Some(Some(USAGE)), "chunks of {size}");
    }
}

#[test]
fn a_non_streamed_body_reports_its_usage() {
    let mut f = routed(Some("bk-1"), 200);
    let body = r#"{"id":"c","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":{"prompt_tokens":64,"completion_tokens":9,"prompt_tokens_details":{"cached_tokens":48}},"kv_transfer_params":null}"#;
    feed(&mut f, body.as_bytes(), 33);
    assert_eq!(usage_of(&f.finish(Some(200))), Some(Some(USAGE)));
}

#[test]
fn no_usage_no_booking_an_error_or_an_abort_report_none_and_read_nothing_needless() {
    // The stream did not ask for usage.
    let mut f = routed(Some("bk-1"), 200);
    feed(&mut f, stream(10, false).as_bytes(), 64);
    assert_eq!(usage_of(&f.finish(Some(200))), Some(None));
    // No booking id: nothing to attribute, nothing read.
    let mut f = routed(None, 200);
    assert_eq!(f.response_tail_wanted(1000), 0);
    let done = f.finish(Some(200));
    assert_eq!(usage_of(&done), Some(None));
    // An error status: nothing read.
    let mut f = routed(Some("bk-1"), 503);
    assert_eq!(f.response_tail_wanted(1000), 0);
    assert_eq!(usage_of(&f.finish(Some(503))), Some(None));
    // Aborted before the end: a usage seen is not reported (the response is not whole).
    let mut f = routed(Some("bk-1"), 200);
    let body = stream(3, true);
    for chunk in body.as_bytes().chunks(16) {
        let want = f.response_tail_wanted(chunk.len());
        f.on_response_tail(&chunk[chunk.len() - want..], chunk.len());
    }
    assert_eq!(usage_of(&f.finish(None)), Some(None));
}

#[test]
fn a_huge_response_is_read_only_in_bounded_tails() {
    let mut f = routed(Some("bk-1"), 200);
    let body = stream(200_000, true);
    assert!(body.len() > 8 << 20);
    let most = feed(&mut f, body.as_bytes(), 1 << 20);
    assert!(most <= USAGE_TAIL_BYTES, "read {most} bytes of one chunk");
    assert_eq!(usage_of(&f.finish(Some(200))), Some(Some(USAGE)));
}
