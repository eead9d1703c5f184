//! Unit tests of `crate::decision`.

use super::*;
use kvmesh_core::headers;
use serde_json::json;

fn decision_json(endpoint: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "endpoint": endpoint, "fallbacks": ["10.0.0.2:8000", "bogus", "[::1]:9"], "worker": "w1",
        "mode": "disagg", "overlap_blocks": 3, "isl_blocks": 4, "reason": "best overlap\r\nx",
        "reason_codes": ["best_overlap", "disagg_uncached", "from_a_newer_indexer"],
        "kv_transfer_params": {"do_remote_prefill": true}, "unknown_field": 1
    }))
    .unwrap()
}

fn err(status: u16, kind: &str, reason: Option<&str>) -> Vec<u8> {
    let body = match reason {
        Some(r) => ErrorBody::with_reason(status, kind, r, "message"),
        None => ErrorBody::new(status, kind, "message"),
    };
    serde_json::to_vec(&body).unwrap()
}

fn label(answer: IndexerAnswer, body: &[u8]) -> String {
    match answer {
        IndexerAnswer::Route(_) => "route".to_owned(),
        IndexerAnswer::Reject { status, body: b, detail } => {
            assert_eq!(
                b,
                rejection_body(status),
                "a rejection sends the stable body, not the indexer's"
            );
            let sent: ErrorBody = serde_json::from_slice(&b).unwrap();
            assert_eq!(
                (sent.error.code, sent.error.reason.as_deref()),
                (status, Some(PREFILL_OVERLOADED))
            );
            assert_eq!(sent.error.message, REJECTION_MESSAGE);
            assert_eq!(detail, "message", "the indexer's message is kept for the log");
            assert!(!body.is_empty());
            format!("reject:{status}")
        }
        IndexerAnswer::UnknownModel => "unknown_model".to_owned(),
        IndexerAnswer::Fallback(fb) => format!("fallback:{}", fb.header_value()),
    }
}

#[test]
fn classification_table() {
    let cases: Vec<(Option<u16>, Vec<u8>, &str)> = vec![
        (None, vec![], "fallback:reset"),
        (Some(200), decision_json("10.0.0.1:8000"), "route"),
        (Some(200), decision_json("worker-1"), "fallback:bad_response"),
        (Some(200), decision_json(""), "fallback:bad_response"),
        (Some(200), b"{\"endpoint\":1}".to_vec(), "fallback:bad_response"),
        (Some(200), b"garbage".to_vec(), "fallback:bad_response"),
        // The one designed client-facing answer: prefill overload.
        (Some(429), err(429, "rate_limit_exceeded", Some("prefill_overloaded")), "reject:429"),
        (Some(503), err(503, "service_unavailable", Some("prefill_overloaded")), "reject:503"),
        (Some(429), err(429, "rate_limit_exceeded", None), "reject:429"),
        // Every other indexer error fails open, with the indexer's code.
        (
            Some(503),
            err(503, "service_unavailable", Some("no_decode_worker")),
            "fallback:indexer_error; code=no_decode_worker",
        ),
        (
            Some(503),
            err(503, "service_unavailable", Some("tokenizer")),
            "fallback:indexer_error; code=tokenizer",
        ),
        (
            Some(503),
            err(503, "service_unavailable", Some("overloaded_shed")),
            "fallback:indexer_error; code=overloaded_shed",
        ),
        (
            Some(429),
            err(429, "rate_limit_exceeded", Some("overloaded_shed")),
            "fallback:indexer_error; code=overloaded_shed",
        ),
        (
            Some(503),
            err(503, "service_unavailable", None),
            "fallback:indexer_error; code=service_unavailable",
        ),
        (
            Some(400),
            err(400, "invalid_request_error", Some("bad_session")),
            "fallback:indexer_error; code=bad_session",
        ),
        (
            Some(500),
            err(500, "internal", Some("Weird Code\r\n")),
            "fallback:indexer_error; code=weird_code",
        ),
        // A model nobody serves: the indexer's 404 `unknown_model` (vLLM's body) is answered.
        (
            Some(404),
            serde_json::to_vec(&kvmesh_core::models::not_found("gpt-4")).unwrap(),
            "unknown_model",
        ),
        // Only as a 404 with that reason: anything else is an indexer error, a plain 404 a bad status.
        (
            Some(400),
            serde_json::to_vec(&kvmesh_core::models::not_found("gpt-4")).unwrap(),
            "fallback:indexer_error; code=unknown_model",
        ),
        (
            Some(404),
            err(404, "NotFoundError", Some("no_such_route")),
            "fallback:indexer_error; code=no_such_route",
        ),
        (Some(404), b"not found".to_vec(), "fallback:bad_status"),
        // Envoy speaking for an absent indexer.
        (Some(429), b"slow down".to_vec(), "fallback:bad_status"),
        (Some(503), b"no healthy upstream".to_vec(), "fallback:unavailable"),
        (Some(503), vec![], "fallback:unavailable"),
        (
            Some(503),
            b"upstream connect error or disconnect/reset before headers".to_vec(),
            "fallback:unavailable",
        ),
        (Some(504), b"upstream request timeout".to_vec(), "fallback:timeout"),
        (Some(502), vec![], "fallback:server_error"),
        (Some(404), vec![], "fallback:bad_status"),
        (Some(204), vec![], "fallback:bad_status"),
        (Some(200), err(200, "odd", Some("x")), "fallback:bad_response"),
    ];
    for (status, body, want) in cases {
        assert_eq!(
            label(classify(status, &body), &body),
            want,
            "{status:?} {}",
            String::from_utf8_lossy(&body)
        );
    }
}

#[test]
fn booking_and_breaker_semantics_per_reason() {
    use crate::breaker::CallHealth::{Answered, Failed};
    let cases = [
        (FallbackReason::DispatchFailed, false, Some(Failed)),
        (FallbackReason::Reset, true, Some(Failed)),
        (FallbackReason::Timeout, true, Some(Failed)),
        (FallbackReason::Unavailable, true, Some(Failed)),
        (FallbackReason::ServerError, true, Some(Answered)),
        (FallbackReason::BadStatus, true, Some(Answered)),
        (FallbackReason::BadResponse, true, Some(Answered)),
        (FallbackReason::IndexerError, false, Some(Answered)),
        (FallbackReason::BreakerOpen, false, None),
        (FallbackReason::BodyBudget, false, None),
    ];
    assert_eq!(cases.len(), FallbackReason::ALL.len(), "every reason has a row");
    for (reason, booked, health) in cases {
        assert_eq!(reason.may_be_booked(), booked, "{reason:?}");
        assert_eq!(reason.health(), health, "{reason:?}");
    }
}

#[test]
fn calls_that_never_reached_the_indexer_need_no_done() {
    let cases: [(&[u8], bool); 5] = [
        (b"no healthy upstream", false),
        (b"upstream connect error or disconnect/reset before headers. reset reason: connection failure, transport failure reason: delayed connect error: Connection refused", false),
        (b"upstream connect error or disconnect/reset before headers. reset reason: overflow", false),
        (b"upstream connect error or disconnect/reset before headers. reset reason: connection termination", true),
        (b"", true),
    ];
    for (body, needs_done) in cases {
        let IndexerAnswer::Fallback(fb) = classify(Some(503), body) else { panic!() };
        assert_eq!(
            (fb.reason, fb.needs_done()),
            (FallbackReason::Unavailable, needs_done),
            "{}",
            String::from_utf8_lossy(body)
        );
    }
}

#[test]
fn an_unusable_decision_keeps_its_booking_id() {
    let body = serde_json::to_vec(&json!({"endpoint": "not-an-endpoint", "worker": "w", "mode": "aggregate", "overlap_blocks": 0, "isl_blocks": 0, "reason": "", "booking_id": "b-17"})).unwrap();
    let IndexerAnswer::Fallback(fb) = classify(Some(200), &body) else { panic!() };
    assert_eq!((fb.reason, fb.booking_id.as_deref()), (FallbackReason::BadResponse, Some("b-17")));
}

#[test]
fn destination_drops_invalid_fallbacks() {
    let IndexerAnswer::Route(d) = classify(Some(200), &decision_json("10.0.0.1:8000")) else {
        panic!()
    };
    assert_eq!(destination(&d), ("10.0.0.1:8000,10.0.0.2:8000,[::1]:9".to_owned(), 1));
    assert_eq!(route_label(d.mode), RouteLabel::Disagg);
}

#[test]
fn debug_headers_are_safe() {
    let IndexerAnswer::Route(d) = classify(Some(200), &decision_json("10.0.0.1:8000")) else {
        panic!()
    };
    let h = debug_headers(&d);
    assert!(h.contains(&(headers::DEBUG_REASON, "best overlap??x".to_owned())));
    assert!(
        h.contains(&(headers::DEBUG_REASON_CODES, "best_overlap,disagg_uncached,other".to_owned()))
    );
    assert!(h.contains(&(headers::DEBUG_OVERLAP_BLOCKS, "3".to_owned())));
    assert_eq!(header_safe(&"é".repeat(400)).len(), MAX_DEBUG_VALUE_BYTES);
}
