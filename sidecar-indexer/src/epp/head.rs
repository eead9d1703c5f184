//! What the endpoint picker reads from a gateway's messages (pure): the client's request headers,
//! the subset hint and the served endpoint in the proxy's metadata, the response status.

use kvmesh_core::filter_config::FilterConfig;
use kvmesh_core::headers;
use prost_types::value::Kind;

use super::wire::{HeaderMap, Metadata};
use crate::route::Eligible;

/// The metadata namespace of Envoy's subset load balancer: the subset hint arrives under it and
/// the destination is written to it (GIE's endpoint-picker protocol).
pub const LB_NAMESPACE: &str = "envoy.lb";
/// The subset hint's namespace (proxy → picker).
pub const SUBSET_HINT_NAMESPACE: &str = "envoy.lb.subset_hint";
/// The subset hint's key: the endpoints the pick must be one of.
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
/// The endpoint that served the request (proxy → picker, response path).
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// The conformance suite's request header naming the endpoints the picker must choose from
/// (honoured only with `epp.conformance`).
pub const CONFORMANCE_SELECTION: &str = "test-epp-endpoint-selection";
/// The conformance suite's response header echoing the served endpoint (only with
/// `epp.conformance`).
pub const CONFORMANCE_SERVED: &str = "x-conformance-test-served-endpoint";
/// Longest header value read (session ids, overrides, request ids); longer ones count as absent,
/// as in the filter.
pub const MAX_VALUE_BYTES: usize = 256;
/// Longest conformance selection read (a list of endpoints).
const MAX_SELECTION_BYTES: usize = 16 * 1024;

/// The client's request as the picker sees it in the request headers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestHead {
    pub method: String,
    /// The path without its query.
    pub path: String,
    pub request_id: Option<String>,
    pub session_id: Option<String>,
    pub override_worker: Option<String>,
    pub override_mode: Option<String>,
    /// Whether the request's overrides are trusted (`[filter] allow_overrides` and the secret).
    pub overrides_trusted: bool,
    /// `test-epp-endpoint-selection`, when the client sent it.
    pub conformance_selection: Option<String>,
}

impl RequestHead {
    /// Reads `map` (names are lowercase from Envoy; compared case-insensitively anyway), with the
    /// session header and the override rule of `filter` (the filter's settings: one definition).
    pub fn read(map: &HeaderMap, filter: &FilterConfig) -> Self {
        let mut head = Self::default();
        let mut secret: Option<&[u8]> = None;
        for h in &map.headers {
            let name = h.key.to_ascii_lowercase();
            let value = h.bytes();
            match name.as_str() {
                ":method" => head.method = text(value, usize::MAX).unwrap_or_default(),
                ":path" => {
                    let path = text(value, usize::MAX).unwrap_or_default();
                    head.path = path.split_once('?').map_or(path.as_str(), |(p, _)| p).to_owned();
                }
                headers::REQUEST_ID => head.request_id = text(value, MAX_VALUE_BYTES),
                headers::OVERRIDE_WORKER => head.override_worker = text(value, MAX_VALUE_BYTES),
                headers::OVERRIDE_MODE => head.override_mode = text(value, MAX_VALUE_BYTES),
                headers::OVERRIDE_SECRET => secret = Some(value),
                CONFORMANCE_SELECTION => {
                    head.conformance_selection = text(value, MAX_SELECTION_BYTES)
                }
                n if n == filter.session_header => head.session_id = text(value, MAX_VALUE_BYTES),
                _ => {}
            }
        }
        head.overrides_trusted = filter.overrides_trusted(secret);
        head
    }
}

/// Trimmed, non-empty, at most `max` bytes, valid UTF-8 (lossily); else None.
fn text(value: &[u8], max: usize) -> Option<String> {
    let s = String::from_utf8_lossy(value);
    let s = s.trim();
    (!s.is_empty() && s.len() <= max).then(|| s.to_owned())
}

/// The `:status` of a response's headers.
pub fn status(map: &HeaderMap) -> Option<u16> {
    map.headers
        .iter()
        .find(|h| h.key == ":status")
        .and_then(|h| std::str::from_utf8(h.bytes()).ok()?.trim().parse().ok())
}

/// The subset hint in the proxy's metadata: None when the proxy sent none (pick from the whole
/// pool); an empty set when it sent one that names nothing (nothing is eligible: 503). A list of
/// strings or one comma-separated string, entries `ip:port` or bare `ip`.
pub fn subset_hint(metadata: Option<&Metadata>) -> Option<Eligible> {
    let value = metadata?.filter_metadata.get(SUBSET_HINT_NAMESPACE)?.fields.get(SUBSET_KEY)?;
    Some(match &value.kind {
        Some(Kind::StringValue(s)) => Eligible::from_comma_list(s),
        Some(Kind::ListValue(list)) => {
            Eligible::new(list.values.iter().filter_map(|v| match &v.kind {
                Some(Kind::StringValue(s)) => Some(s.as_str()),
                _ => None,
            }))
        }
        _ => Eligible::new([]),
    })
}

/// The endpoint that served the request, from the proxy's metadata on the response path.
pub fn served(metadata: Option<&Metadata>) -> Option<String> {
    let value = metadata?.filter_metadata.get(LB_NAMESPACE)?.fields.get(SERVED_KEY)?;
    match &value.kind {
        Some(Kind::StringValue(s)) if !s.trim().is_empty() && s.len() <= MAX_VALUE_BYTES => {
            Some(s.trim().to_owned())
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use prost_types::{ListValue, Struct, Value};

    use super::super::wire::HeaderValue;
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: (*k).to_owned(),
                    value: String::new(),
                    raw_value: v.as_bytes().to_vec(),
                })
                .collect(),
        }
    }

    fn metadata(ns: &str, key: &str, value: Kind) -> Metadata {
        let fields = BTreeMap::from([(key.to_owned(), Value { kind: Some(value) })]);
        Metadata { filter_metadata: [(ns.to_owned(), Struct { fields })].into() }
    }

    #[test]
    fn reads_the_request_head() {
        let cfg = FilterConfig::default();
        let head = RequestHead::read(
            &map(&[
                (":method", "POST"),
                (":path", "/v1/chat/completions?x=1"),
                ("x-request-id", " r1 "),
                ("x-session-id", "s-9"),
                ("content-length", "42"),
                ("x-kvmesh-worker", "w1"),
            ]),
            &cfg,
        );
        assert_eq!(head.method, "POST");
        assert_eq!(head.path, "/v1/chat/completions", "the query is not part of the path");
        assert_eq!(head.request_id.as_deref(), Some("r1"));
        assert_eq!(head.session_id.as_deref(), Some("s-9"));
        assert_eq!(head.override_worker.as_deref(), Some("w1"));
        assert!(!head.overrides_trusted, "overrides are off by default");
    }

    #[test]
    fn value_or_raw_value() {
        let m = HeaderMap {
            headers: vec![HeaderValue {
                key: ":path".into(),
                value: "/v1/completions".into(),
                raw_value: vec![],
            }],
        };
        assert_eq!(RequestHead::read(&m, &FilterConfig::default()).path, "/v1/completions");
    }

    #[test]
    fn overrides_need_the_secret() {
        let cfg = FilterConfig {
            allow_overrides: true,
            override_secret: "s3cret-s3cret-s3cret".into(),
            ..FilterConfig::default()
        };
        let with = |secret: &str| {
            RequestHead::read(
                &map(&[("x-kvmesh-worker", "w1"), ("x-kvmesh-override-secret", secret)]),
                &cfg,
            )
        };
        assert!(with("s3cret-s3cret-s3cret").overrides_trusted);
        assert!(!with("wrong").overrides_trusted);
        assert!(!RequestHead::read(&map(&[("x-kvmesh-worker", "w1")]), &cfg).overrides_trusted);
    }

    #[test]
    fn long_values_are_absent() {
        let long = "x".repeat(MAX_VALUE_BYTES + 1);
        let head = RequestHead::read(&map(&[("x-session-id", &long)]), &FilterConfig::default());
        assert_eq!(head.session_id, None);
    }

    #[test]
    fn subset_hint_as_list_or_string() {
        let list = Kind::ListValue(ListValue {
            values: ["10.0.0.1:8000", "10.0.0.2"]
                .iter()
                .map(|s| Value { kind: Some(Kind::StringValue((*s).into())) })
                .collect(),
        });
        let e = subset_hint(Some(&metadata(SUBSET_HINT_NAMESPACE, SUBSET_KEY, list))).unwrap();
        assert!(e.allows("10.0.0.1:8000") && e.allows("10.0.0.2:1") && !e.allows("10.0.0.3:1"));
        let s = Kind::StringValue("10.0.0.3:8000, 10.0.0.4:8000".into());
        let e = subset_hint(Some(&metadata(SUBSET_HINT_NAMESPACE, SUBSET_KEY, s))).unwrap();
        assert!(e.allows("10.0.0.4:8000") && !e.allows("10.0.0.1:8000"));
        assert_eq!(subset_hint(None), None, "no hint: the whole pool");
        let odd = Kind::NumberValue(1.0);
        let e = subset_hint(Some(&metadata(SUBSET_HINT_NAMESPACE, SUBSET_KEY, odd))).unwrap();
        assert!(e.is_empty(), "a hint we cannot read allows nothing: never widen a subset");
    }

    #[test]
    fn served_endpoint_and_status() {
        let m = metadata(LB_NAMESPACE, SERVED_KEY, Kind::StringValue("10.0.0.1:8000".into()));
        assert_eq!(served(Some(&m)).as_deref(), Some("10.0.0.1:8000"));
        assert_eq!(served(None), None);
        assert_eq!(status(&map(&[(":status", "429")])), Some(429));
        assert_eq!(status(&map(&[])), None);
    }
}
