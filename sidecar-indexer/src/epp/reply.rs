//! The endpoint picker's messages to the gateway (pure): the destination as a header mutation and
//! as `envoy.lb` dynamic metadata, the body re-sent in chunks, the pass-through answers, and the
//! immediate (local) responses.

use std::collections::BTreeMap;

use kvmesh_core::headers;
use prost::bytes::Bytes;
use prost_types::value::Kind;
use prost_types::{Struct, Value};

use super::head::{LB_NAMESPACE, SERVED_KEY, SUBSET_KEY};
use super::wire::{
    BodyMutation, BodyResponse, CommonResponse, HeaderAppendAction, HeaderMutation, HeaderValue,
    HeaderValueOption, HeadersResponse, HttpStatus, ImmediateResponse, Mutation,
    ProcessingResponse, Response, StreamedBodyResponse, TrailersResponse,
};

/// Largest body chunk re-sent in FULL_DUPLEX_STREAMED mode: Envoy asks for chunks of at most
/// 64 KiB; 62,000 bytes leaves room for the message's framing (Dynamo's EPP uses the same).
pub const MAX_CHUNK_BYTES: usize = 62_000;

/// Request headers a client must not set for the gateway: the destination and the picker's own
/// control headers. Removed from every request the picker answers.
pub const REMOVED_REQUEST_HEADERS: [&str; 7] = [
    headers::OVERRIDE_SECRET,
    headers::OVERRIDE_WORKER,
    headers::OVERRIDE_MODE,
    headers::KVMESH_SESSION,
    SERVED_KEY,
    SUBSET_KEY,
    headers::KVMESH_BODY_BASE,
];

/// Where the request goes: the header and metadata value (`primary[,fallback…]`), headers to set
/// besides it, and the body to send when it changed.
#[derive(Debug, Clone, PartialEq)]
pub struct Destination {
    /// `ip:port[,ip:port…]`, primary first.
    pub endpoints: String,
    /// Extra request headers to set (overwriting).
    pub set: Vec<(String, String)>,
    /// The new body, when the picker changed it (`kv_transfer_params` spliced in); None = as sent.
    pub body: Option<Bytes>,
}

fn header(name: &str, value: &str) -> HeaderValueOption {
    HeaderValueOption {
        header: Some(HeaderValue {
            key: name.to_owned(),
            value: String::new(),
            raw_value: value.as_bytes().to_vec(),
        }),
        append_action: HeaderAppendAction::OverwriteIfExistsOrAdd as i32,
    }
}

/// The header mutation that routes to `dest` (and removes the client's control headers).
pub fn route_mutation(dest: &Destination, body_len: Option<usize>) -> HeaderMutation {
    let mut set = vec![header(headers::DESTINATION_ENDPOINT, &dest.endpoints)];
    set.extend(dest.set.iter().map(|(k, v)| header(k, v)));
    if let Some(len) = body_len {
        set.push(header("content-length", &len.to_string()));
    }
    let remove = REMOVED_REQUEST_HEADERS.iter().map(|&h| h.to_owned()).collect();
    HeaderMutation { set_headers: set, remove_headers: remove }
}

/// `{"envoy.lb": {"x-gateway-destination-endpoint": endpoints}}`: the same value as the header.
pub fn destination_metadata(endpoints: &str) -> Struct {
    let inner = Struct {
        fields: BTreeMap::from([(
            headers::DESTINATION_ENDPOINT.to_owned(),
            Value { kind: Some(Kind::StringValue(endpoints.to_owned())) },
        )]),
    };
    Struct {
        fields: BTreeMap::from([(
            LB_NAMESPACE.to_owned(),
            Value { kind: Some(Kind::StructValue(inner)) },
        )]),
    }
}

fn common(mutation: Option<HeaderMutation>, body: Option<Mutation>, clear: bool) -> CommonResponse {
    CommonResponse {
        status: 0,
        header_mutation: mutation,
        body_mutation: body.map(|m| BodyMutation { mutation: Some(m) }),
        clear_route_cache: clear,
    }
}

/// FULL_DUPLEX_STREAMED, at the end of the request: the deferred headers answer with the
/// destination, then the body in chunks of at most [`MAX_CHUNK_BYTES`], the last one ending the
/// stream when `ends` (the request had no trailers).
pub fn streamed_route(dest: &Destination, original: &Bytes, ends: bool) -> Vec<ProcessingResponse> {
    let body = dest.body.as_ref().unwrap_or(original);
    let headers = ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            // Envoy drops content-length from a streamed request; the body goes chunked.
            response: Some(common(Some(route_mutation(dest, None)), None, true)),
        })),
        dynamic_metadata: Some(destination_metadata(&dest.endpoints)),
    };
    let mut out = vec![headers];
    out.extend(streamed_chunks(body, ends).map(|chunk| ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse { response: Some(chunk) })),
        dynamic_metadata: None,
    }));
    out
}

/// `body` as FULL_DUPLEX_STREAMED chunks (views of it, not copies); an empty body still sends one
/// (empty) chunk so the end of stream is said.
fn streamed_chunks(body: &Bytes, ends: bool) -> impl Iterator<Item = CommonResponse> + '_ {
    let n = body.len().div_ceil(MAX_CHUNK_BYTES).max(1);
    (0..n).map(move |i| {
        let chunk = body.slice(
            (i * MAX_CHUNK_BYTES).min(body.len())..((i + 1) * MAX_CHUNK_BYTES).min(body.len()),
        );
        let last = i + 1 == n;
        common(
            None,
            Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body: chunk,
                end_of_stream: last && ends,
            })),
            false,
        )
    })
}

/// BUFFERED: the body answer that routes (the headers are still held, so the mutation applies),
/// replacing the body when the picker changed it.
pub fn buffered_route(dest: &Destination) -> ProcessingResponse {
    let len = dest.body.as_ref().map(Bytes::len);
    ProcessingResponse {
        response: Some(Response::RequestBody(BodyResponse {
            response: Some(common(
                Some(route_mutation(dest, len)),
                dest.body.clone().map(Mutation::Body),
                true,
            )),
        })),
        dynamic_metadata: Some(destination_metadata(&dest.endpoints)),
    }
}

/// STREAMED with the body sent before the headers' answer: the deferred headers answer with the
/// destination, then one answer per body chunk, in order — unchanged, or, when the picker
/// changed the body, the first chunk replaced by the whole new body and the others cleared
/// (Envoy sends a STREAMED body chunked: no content-length to fix).
pub fn held_chunks_route(dest: &Destination, chunks: usize) -> Vec<ProcessingResponse> {
    let mut out = vec![headers_route(dest)];
    out.extend((0..chunks).map(|i| {
        let mutation = dest.body.as_ref().map(|b| {
            if i == 0 {
                Mutation::Body(b.clone())
            } else {
                Mutation::ClearBody(true)
            }
        });
        ProcessingResponse {
            response: Some(Response::RequestBody(BodyResponse {
                response: Some(common(None, mutation, false)),
            })),
            dynamic_metadata: None,
        }
    }));
    out
}

/// The headers answer that routes at once (a request without a body, or a body the picker is not
/// sent): the destination and its metadata.
pub fn headers_route(dest: &Destination) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::RequestHeaders(HeadersResponse {
            response: Some(common(Some(route_mutation(dest, None)), None, true)),
        })),
        dynamic_metadata: Some(destination_metadata(&dest.endpoints)),
    }
}

/// Which message a pass-through answer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    RequestHeaders,
    RequestBody,
    RequestTrailers,
    ResponseHeaders,
    ResponseBody,
    ResponseTrailers,
}

/// "Continue unchanged" for `phase`, setting `set` headers (response headers: the debug and
/// conformance echoes).
pub fn pass(phase: Phase, set: &[(String, String)]) -> ProcessingResponse {
    let mutation = (!set.is_empty()).then(|| HeaderMutation {
        set_headers: set.iter().map(|(k, v)| header(k, v)).collect(),
        remove_headers: vec![],
    });
    let response = match phase {
        Phase::RequestHeaders => Response::RequestHeaders(HeadersResponse {
            response: Some(common(mutation, None, false)),
        }),
        Phase::ResponseHeaders => Response::ResponseHeaders(HeadersResponse {
            response: Some(common(mutation, None, false)),
        }),
        Phase::RequestBody => {
            Response::RequestBody(BodyResponse { response: Some(common(None, None, false)) })
        }
        Phase::ResponseBody => {
            Response::ResponseBody(BodyResponse { response: Some(common(None, None, false)) })
        }
        Phase::RequestTrailers => {
            Response::RequestTrailers(TrailersResponse { header_mutation: None })
        }
        Phase::ResponseTrailers => {
            Response::ResponseTrailers(TrailersResponse { header_mutation: None })
        }
    };
    ProcessingResponse { response: Some(response), dynamic_metadata: None }
}

/// FULL_DUPLEX_STREAMED response body: the chunk re-sent unchanged.
pub fn echo_response_chunk(chunk: Bytes, end_of_stream: bool) -> ProcessingResponse {
    ProcessingResponse {
        response: Some(Response::ResponseBody(BodyResponse {
            response: Some(common(
                None,
                Some(Mutation::StreamedResponse(StreamedBodyResponse {
                    body: chunk,
                    end_of_stream,
                })),
                false,
            )),
        })),
        dynamic_metadata: None,
    }
}

/// A local answer: `status`, a JSON `body`, and `headers` (e.g. `retry-after`); `details` is
/// Envoy's response-code details (its access log).
pub fn immediate(
    status: u16,
    body: Vec<u8>,
    headers: &[(&str, String)],
    details: &str,
) -> ProcessingResponse {
    let mut set: Vec<HeaderValueOption> = vec![header("content-type", "application/json")];
    set.extend(headers.iter().map(|(k, v)| header(k, v)));
    ProcessingResponse {
        response: Some(Response::ImmediateResponse(ImmediateResponse {
            status: Some(HttpStatus { code: i32::from(status) }),
            headers: Some(HeaderMutation { set_headers: set, remove_headers: vec![] }),
            body,
            details: details.to_owned(),
        })),
        dynamic_metadata: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dest(body: Option<&str>) -> Destination {
        Destination {
            endpoints: "10.0.0.1:8000,10.0.0.2:8000".into(),
            set: vec![],
            body: body.map(|b| Bytes::copy_from_slice(b.as_bytes())),
        }
    }

    fn set_value<'a>(m: &'a HeaderMutation, name: &str) -> Option<&'a [u8]> {
        m.set_headers
            .iter()
            .filter_map(|o| o.header.as_ref())
            .find(|h| h.key == name)
            .map(|h| h.raw_value.as_slice())
    }

    fn lb_value(s: &Struct) -> Option<&str> {
        match &s.fields.get(LB_NAMESPACE)?.kind {
            Some(Kind::StructValue(inner)) => {
                match &inner.fields.get(headers::DESTINATION_ENDPOINT)?.kind {
                    Some(Kind::StringValue(v)) => Some(v),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    #[test]
    fn header_and_metadata_say_the_same() {
        let out = streamed_route(&dest(None), &Bytes::from_static(b"{}"), true);
        let Some(Response::RequestHeaders(h)) = &out[0].response else { panic!("headers first") };
        let c = h.response.as_ref().unwrap();
        assert!(c.clear_route_cache);
        let m = c.header_mutation.as_ref().unwrap();
        assert_eq!(
            set_value(m, headers::DESTINATION_ENDPOINT),
            Some(&b"10.0.0.1:8000,10.0.0.2:8000"[..])
        );
        assert_eq!(
            lb_value(out[0].dynamic_metadata.as_ref().unwrap()),
            Some("10.0.0.1:8000,10.0.0.2:8000")
        );
        assert!(m.remove_headers.iter().any(|h| h == headers::OVERRIDE_SECRET));
        assert_eq!(set_value(m, "content-length"), None, "streamed: Envoy sends the body chunked");
    }

    #[test]
    fn body_is_resent_in_bounded_chunks_ending_the_stream() {
        let body = Bytes::from(vec![b'x'; MAX_CHUNK_BYTES * 2 + 5]);
        let out = streamed_route(&dest(None), &body, true);
        assert_eq!(out.len(), 4, "headers + three chunks");
        let chunks: Vec<&StreamedBodyResponse> = out[1..]
            .iter()
            .map(|r| match &r.response {
                Some(Response::RequestBody(b)) => {
                    match &b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation {
                        Some(Mutation::StreamedResponse(s)) => s,
                        other => panic!("{other:?}"),
                    }
                }
                other => panic!("{other:?}"),
            })
            .collect();
        assert!(chunks.iter().all(|c| c.body.len() <= MAX_CHUNK_BYTES));
        assert_eq!(chunks.iter().map(|c| c.body.len()).sum::<usize>(), body.len());
        assert_eq!(chunks.iter().filter(|c| c.end_of_stream).count(), 1);
        assert!(chunks[2].end_of_stream);
        let with_trailers = streamed_route(&dest(None), &body, false);
        assert!(with_trailers[1..]
            .iter()
            .all(|r| !format!("{r:?}").contains("end_of_stream: true")));
    }

    #[test]
    fn a_changed_body_replaces_the_original() {
        let out = streamed_route(&dest(Some("{\"a\":1}")), &Bytes::from_static(b"{}"), true);
        let Some(Response::RequestBody(b)) = &out[1].response else { panic!() };
        assert_eq!(
            b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation,
            Some(Mutation::StreamedResponse(StreamedBodyResponse {
                body: Bytes::from_static(b"{\"a\":1}"),
                end_of_stream: true
            }))
        );
        let one = buffered_route(&dest(Some("{\"a\":1}")));
        let Some(Response::RequestBody(b)) = &one.response else { panic!() };
        let c = b.response.as_ref().unwrap();
        assert_eq!(
            set_value(c.header_mutation.as_ref().unwrap(), "content-length"),
            Some(&b"7"[..])
        );
        assert_eq!(
            c.body_mutation.as_ref().unwrap().mutation,
            Some(Mutation::Body(Bytes::from_static(b"{\"a\":1}")))
        );
        let same = buffered_route(&dest(None));
        let Some(Response::RequestBody(b)) = &same.response else { panic!() };
        assert_eq!(b.response.as_ref().unwrap().body_mutation, None, "unchanged body: no mutation");
    }

    #[test]
    fn held_chunks_are_answered_in_order() {
        let out = held_chunks_route(&dest(None), 2);
        assert_eq!(out.len(), 3, "headers + one answer per chunk");
        assert!(matches!(out[0].response, Some(Response::RequestHeaders(_))));
        assert_eq!(
            lb_value(out[0].dynamic_metadata.as_ref().unwrap()),
            Some("10.0.0.1:8000,10.0.0.2:8000")
        );
        let mutation = |r: &ProcessingResponse| match &r.response {
            Some(Response::RequestBody(b)) => {
                b.response.as_ref().unwrap().body_mutation.as_ref().and_then(|m| m.mutation.clone())
            }
            other => panic!("{other:?}"),
        };
        assert_eq!((mutation(&out[1]), mutation(&out[2])), (None, None), "unchanged");
        let spliced = held_chunks_route(&dest(Some("{\"a\":1}")), 2);
        assert_eq!(mutation(&spliced[1]), Some(Mutation::Body(Bytes::from_static(b"{\"a\":1}"))));
        assert_eq!(mutation(&spliced[2]), Some(Mutation::ClearBody(true)));
    }

    #[test]
    fn an_empty_body_still_ends_the_stream() {
        let out = streamed_route(&dest(None), &Bytes::new(), true);
        assert_eq!(out.len(), 2);
        assert!(format!("{:?}", out[1]).contains("end_of_stream: true"));
    }

    #[test]
    fn immediate_answers() {
        let r = immediate(429, b"{}".to_vec(), &[("retry-after", "1".into())], "kvmesh_shed");
        let Some(Response::ImmediateResponse(i)) = r.response else { panic!() };
        assert_eq!(i.status, Some(HttpStatus { code: 429 }));
        assert_eq!(set_value(i.headers.as_ref().unwrap(), "retry-after"), Some(&b"1"[..]));
    }
}
