//! Unit tests of `crate::decision`.

use super::*;
use serde_json::json;

fn decision_json(endpoint: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "endpoint": endpoint, "fallbacks": ["10.0.0.2:8000", "bogus", "[::1]:9"], "worker": "w1",
        "mode": "disagg", "overlap_blocks": 3, "isl_blocks": 4, "reason": "best overlap\r\nx",
        "kv_transfer_params": {"do_remote_prefill": true}, "unknown_field": 1
    }))
    .unwrap()
}

#[test]
fn classification_table() {
    let err = serde_json::to_vec(&ErrorBody::new(429, "rate_limit", "prefill pool exhausted")).unwrap();
    let cases: Vec<(Option<u16>, Vec<u8>, &str)> = vec![
        (None, vec![], "fallback:reset"),
        (Some(200), decision_json("10.0.0.1:8000"), "route"),
        (Some(200), decision_json("worker-1"), "fallback:bad_response"),
        (Some(200), decision_json(""), "fallback:bad_response"),
        (Some(200), b"{\"endpoint\":1}".to_vec(), "fallback:bad_response"),
        (Some(200), b"garbage".to_vec(), "fallback:bad_response"),
        (Some(429), err.clone(), "reject:429"),
        (Some(503), err.clone(), "reject:503"),
        (Some(429), b"slow down".to_vec(), "fallback:bad_status"),
        (Some(503), b"no healthy upstream".to_vec(), "fallback:unavailable"),
        (Some(503), b"upstream connect error or disconnect/reset before headers".to_vec(), "fallback:unavailable"),
        (Some(504), b"upstream request timeout".to_vec(), "fallback:timeout"),
        (Some(500), err.clone(), "fallback:server_error"),
        (Some(502), vec![], "fallback:server_error"),
        (Some(404), vec![], "fallback:bad_status"),
        (Some(204), vec![], "fallback:bad_status"),
    ];
    for (status, body, want) in cases {
        let got = match classify(status, &body) {
            IndexerAnswer::Route(_) => "route".to_owned(),
            IndexerAnswer::Reject { status, body: b } => {
                assert_eq!(b, body);
                format!("reject:{status}")
            }
            IndexerAnswer::Fallback(r) => format!("fallback:{}", r.as_str()),
        };
        assert_eq!(got, want, "{status:?} {}", String::from_utf8_lossy(&body));
    }
}

#[test]
fn destination_drops_invalid_fallbacks() {
    let IndexerAnswer::Route(d) = classify(Some(200), &decision_json("10.0.0.1:8000")) else { panic!() };
    assert_eq!(destination(&d), ("10.0.0.1:8000,10.0.0.2:8000,[::1]:9".to_owned(), 1));
    assert_eq!(route_label(d.mode), RouteLabel::Disagg);
}

#[test]
fn debug_headers_are_safe() {
    let IndexerAnswer::Route(d) = classify(Some(200), &decision_json("10.0.0.1:8000")) else { panic!() };
    let h = debug_headers(&d);
    assert!(h.contains(&(headers::DEBUG_REASON, "best overlap??x".to_owned())));
    assert!(h.contains(&(headers::DEBUG_OVERLAP_BLOCKS, "3".to_owned())));
    assert_eq!(header_safe(&"é".repeat(400)).len(), MAX_DEBUG_VALUE_BYTES);
}
