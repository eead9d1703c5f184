use super::*;

#[test]
fn visible_ascii_ids_are_sent_as_they_are() {
    for id in ["abc-123", "f81d4fae-7dec-11d0-a765-00a0c91e6bf6", "a b\tc", "100%", "~!\"#"] {
        assert_eq!(encoded_for_indexer(id), None, "{id:?}");
    }
}

#[test]
fn other_bytes_are_percent_encoded_and_the_rest_kept() {
    let cases = [
        ("café-7", "caf%C3%A9-7"),
        ("日本", "%E6%97%A5%E6%9C%AC"),
        // Once encoding, `%` and spaces are encoded too, so the form can be undone unambiguously.
        ("é 100%", "%C3%A9%20100%25"),
        ("\u{7f}x", "%7Fx"),
        ("a\u{1}b", "a%01b"),
    ];
    for (id, want) in cases {
        assert_eq!(encoded_for_indexer(id).as_deref(), Some(want), "{id:?}");
    }
}

#[test]
fn an_encoded_id_is_header_text_and_decodes_back() {
    let ids = ["ünïcödé", "mixed-ascii-ß-∑ 5%", "\u{fffd}\u{0}", "%C3é"];
    for id in ids {
        let encoded = encoded_for_indexer(id).unwrap();
        assert!(encoded.bytes().all(|b| b.is_ascii_graphic()), "{encoded:?}");
        let mut decoded = Vec::new();
        let mut bytes = encoded.bytes();
        while let Some(b) = bytes.next() {
            if b == b'%' {
                let hex: String = bytes.by_ref().take(2).map(char::from).collect();
                decoded.push(u8::from_str_radix(&hex, 16).unwrap());
            } else {
                decoded.push(b);
            }
        }
        assert_eq!(String::from_utf8(decoded).unwrap(), id);
    }
}

/// The flow names a request with a non-ASCII id by its encoding — in the route call, counted —
/// and leaves the client's header alone (no effect on `x-request-id`).
#[test]
fn the_route_call_carries_the_encoded_id_and_the_client_header_is_untouched() {
    use std::rc::Rc;

    use kvmesh_core::api::FleetSnapshot;

    use crate::config::FilterConfig;
    use crate::effects::{Effect, Next};
    use crate::flow::{FleetSource, RequestFlow};
    use crate::metrics::{Metric, MetricUpdate};

    struct NoFleet;
    impl FleetSource for NoFleet {
        fn fleet(&self) -> Option<Rc<FleetSnapshot>> {
            None
        }
    }

    let cases: [(&[u8], &str, u64); 3] = [
        ("café-7".as_bytes(), "caf%C3%A9-7", 1),
        // Not UTF-8 at all: read lossily, then encoded.
        (b"id-\xff", "id-%EF%BF%BD", 1),
        (b"plain-id", "plain-id", 0),
    ];
    for (raw, want, count) in cases {
        let mut f = RequestFlow::new(Rc::new(FilterConfig::default()), 7);
        let pairs = vec![
            (":method".to_owned(), b"POST".to_vec()),
            (":path".to_owned(), b"/v1/completions".to_vec()),
            ("x-request-id".to_owned(), raw.to_vec()),
        ];
        let step = f.on_request_headers(&pairs, false, 1);
        let encoded_count: u64 = step
            .effects
            .iter()
            .map(|e| match e {
                Effect::Metric(MetricUpdate::Add(Metric::RequestIdsEncoded, n)) => *n,
                _ => 0,
            })
            .sum();
        assert_eq!(encoded_count, count, "{want}");
        assert!(
            !step.effects.iter().any(|e| matches!(
                e,
                Effect::SetRequestHeader(n, _) | Effect::RemoveRequestHeader(n)
                    if *n == kvmesh_core::headers::REQUEST_ID
            )),
            "the client's x-request-id reaches the engine unchanged"
        );
        assert_eq!(f.request_id(), want);
        f.on_request_body(14, true);
        let Next::Call(call) = f.on_body(Some(br#"{"prompt":"x"}"#.to_vec()), 0, &NoFleet).next
        else {
            panic!("no route call for {want}")
        };
        assert_eq!(call.header("x-request-id"), Some(want));
    }
}
