//! The endpoint picker over real gRPC on loopback, driven by a tonic client as a gateway would
//! (headers, body chunks, response phases): destinations, body modes, the subset hint, the
//! conformance hooks, immediate answers, booking release, health.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use kvmesh_core::headers;
use prost::bytes::Bytes;
use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Value};
use tokio::sync::mpsc;
use tonic::transport::Channel;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use super::head::{LB_NAMESPACE, SERVED_KEY, SUBSET_HINT_NAMESPACE, SUBSET_KEY};
use super::wire::*;
use crate::config::{Config, MapEnv};
use crate::service::Service;
use crate::tokenize::PromptTokenizer;

const W0: &str = "127.0.0.1:1";
const W1: &str = "127.0.0.1:2";

fn fleet_toml(extra: &str) -> String {
    format!(
        r#"
listen = "127.0.0.1:0"
{extra}
[model]
name = "m"
block_size = 4
[routing]
scrape_interval_ms = 1000
[[workers]]
id = "w0"
role = "decode"
endpoint = "{W0}"
[[workers]]
id = "w1"
role = "decode"
endpoint = "{W1}"
"#
    )
}

fn tokenizer() -> PromptTokenizer {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(kvmesh_tokens::default_tokenizer_path);
    PromptTokenizer::load(path, None, "<｜begin▁of▁sentence｜>", 1 << 20).unwrap()
}

struct Picker {
    svc: Arc<Service>,
    channel: Channel,
    health: Channel,
}

async fn picker(extra: &str) -> Picker {
    picker_until(extra, std::future::pending()).await
}

/// A picker that shuts down (as on SIGTERM) when `shutdown` resolves.
async fn picker_until(
    extra: &str,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Picker {
    let config = Config::from_toml_str(&fleet_toml(extra), &MapEnv::default()).unwrap();
    let svc = Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tokenizer())
        .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let health = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (addr, health_addr) = (listener.local_addr().unwrap(), health.local_addr().unwrap());
    tokio::spawn(super::serve(svc.state.clone(), listener, Some(health), shutdown));
    let connect = |a: std::net::SocketAddr| async move {
        Channel::from_shared(format!("http://{a}")).unwrap().connect().await.unwrap()
    };
    Picker { svc, channel: connect(addr).await, health: connect(health_addr).await }
}

fn header_map(pairs: &[(&str, &str)]) -> HeaderMap {
    HeaderMap {
        headers: pairs
            .iter()
            .map(|(k, v)| HeaderValue {
                key: (*k).into(),
                value: String::new(),
                raw_value: v.as_bytes().to_vec(),
            })
            .collect(),
    }
}

fn request_headers(path: &str, extra: &[(&str, &str)], eos: bool) -> ProcessingRequest {
    let mut pairs = vec![(":method", if eos { "GET" } else { "POST" }), (":path", path)];
    pairs.extend_from_slice(extra);
    ProcessingRequest {
        request: Some(Request::RequestHeaders(HttpHeaders {
            headers: Some(header_map(&pairs)),
            end_of_stream: eos,
        })),
        metadata_context: None,
        protocol_config: None,
    }
}

fn with_mode(mut r: ProcessingRequest, mode: BodySendMode) -> ProcessingRequest {
    r.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: mode as i32,
        response_body_mode: mode as i32,
        send_body_without_waiting_for_header_response: false,
    });
    r
}

fn with_subset(mut r: ProcessingRequest, entries: &[&str]) -> ProcessingRequest {
    let list = Value {
        kind: Some(Kind::ListValue(ListValue {
            values: entries
                .iter()
                .map(|e| Value { kind: Some(Kind::StringValue((*e).into())) })
                .collect(),
        })),
    };
    let ns = Struct { fields: [(SUBSET_KEY.to_owned(), list)].into() };
    r.metadata_context =
        Some(Metadata { filter_metadata: [(SUBSET_HINT_NAMESPACE.to_owned(), ns)].into() });
    r
}

fn request_body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::RequestBody(HttpBody {
            body: Bytes::copy_from_slice(bytes),
            end_of_stream: eos,
        })),
        metadata_context: None,
        protocol_config: None,
    }
}

fn response_headers(status: &str, served: Option<&str>) -> ProcessingRequest {
    let metadata = served.map(|s| {
        let lb = Struct {
            fields: [(SERVED_KEY.to_owned(), Value { kind: Some(Kind::StringValue(s.into())) })]
                .into(),
        };
        Metadata { filter_metadata: [(LB_NAMESPACE.to_owned(), lb)].into() }
    });
    ProcessingRequest {
        request: Some(Request::ResponseHeaders(HttpHeaders {
            headers: Some(header_map(&[(":status", status)])),
            end_of_stream: false,
        })),
        metadata_context: metadata,
        protocol_config: None,
    }
}

fn response_body(bytes: &[u8], eos: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(Request::ResponseBody(HttpBody {
            body: Bytes::copy_from_slice(bytes),
            end_of_stream: eos,
        })),
        metadata_context: None,
        protocol_config: None,
    }
}

/// A gateway's side of one stream: send messages, read answers.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: tonic::Streaming<ProcessingResponse>,
}

impl Stream {
    async fn open(p: &Picker) -> Self {
        let (tx, rx) = mpsc::channel(16);
        let requests =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
        let rx = super::grpc::process(p.channel.clone(), requests).await.unwrap();
        Self { tx, rx }
    }

    async fn send(&self, m: ProcessingRequest) {
        self.tx.send(m).await.unwrap();
    }

    async fn next(&mut self) -> ProcessingResponse {
        tokio::time::timeout(Duration::from_secs(10), self.rx.message())
            .await
            .expect("an answer within 10 s")
            .expect("no gRPC error")
            .expect("an answer, not the end of the stream")
    }

    /// No answer arrives within a short wait (the picker holds the headers answer).
    async fn quiet(&mut self) {
        let r = tokio::time::timeout(Duration::from_millis(200), self.rx.message()).await;
        assert!(r.is_err(), "expected no answer yet, got {r:?}");
    }
}

fn mutation_value(m: &HeaderMutation, name: &str) -> Option<String> {
    m.set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == name)
        .map(|h| String::from_utf8_lossy(h.bytes()).into_owned())
}

fn lb_destination(r: &ProcessingResponse) -> Option<String> {
    match &r.dynamic_metadata.as_ref()?.fields.get(LB_NAMESPACE)?.kind {
        Some(Kind::StructValue(s)) => match &s.fields.get(headers::DESTINATION_ENDPOINT)?.kind {
            Some(Kind::StringValue(v)) => Some(v.clone()),
            _ => None,
        },
        _ => None,
    }
}

/// The destination of a headers (or buffered body) answer: the header's value, checked equal to
/// the metadata's, and that the route cache is cleared.
fn destination(r: &ProcessingResponse) -> String {
    let common = match &r.response {
        Some(Response::RequestHeaders(h)) => h.response.clone(),
        Some(Response::RequestBody(b)) => b.response.clone(),
        other => panic!("not a routing answer: {other:?}"),
    }
    .expect("a common response");
    assert!(common.clear_route_cache, "the route cache must be cleared to re-pick the host");
    let header =
        mutation_value(common.header_mutation.as_ref().unwrap(), headers::DESTINATION_ENDPOINT)
            .expect("the destination header");
    assert_eq!(lb_destination(r).as_deref(), Some(header.as_str()), "header and metadata differ");
    header
}

fn streamed_chunk(r: &ProcessingResponse) -> (Vec<u8>, bool) {
    let (Some(Response::RequestBody(b)) | Some(Response::ResponseBody(b))) = &r.response else {
        panic!("not a body answer: {r:?}")
    };
    match &b.response.as_ref().unwrap().body_mutation.as_ref().unwrap().mutation {
        Some(Mutation::StreamedResponse(s)) => (s.body.to_vec(), s.end_of_stream),
        other => panic!("not a streamed body: {other:?}"),
    }
}

fn immediate_status(r: &ProcessingResponse) -> (i32, serde_json::Value) {
    match &r.response {
        Some(Response::ImmediateResponse(i)) => (
            i.status.unwrap().code,
            serde_json::from_slice(&i.body).unwrap_or(serde_json::Value::Null),
        ),
        other => panic!("not an immediate response: {other:?}"),
    }
}

fn chat(user: &str) -> String {
    serde_json::json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a careful assistant. ".repeat(20)},
            {"role": "user", "content": user},
        ],
    })
    .to_string()
}

fn active(p: &Picker) -> u64 {
    p.svc.state.snapshot().workers.iter().map(|w| w.load.active_requests).sum()
}

async fn until(what: &str, mut f: impl FnMut() -> bool) {
    for _ in 0..200 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test]
async fn full_duplex_routes_after_the_body_and_resends_it_in_order() {
    let p = picker("").await;
    let mut s = Stream::open(&p).await;
    let body = chat("hello there");
    let len = body.len().to_string();
    s.send(with_mode(
        request_headers("/v1/chat/completions", &[("content-length", &len)], false),
        BodySendMode::FullDuplexStreamed,
    ))
    .await;
    let (a, b) = body.as_bytes().split_at(body.len() / 2);
    s.send(request_body(a, false)).await;
    s.quiet().await;
    s.send(request_body(b, true)).await;
    let dest = destination(&s.next().await);
    let primary = dest.split(',').next().unwrap().to_owned();
    assert!(primary == W0 || primary == W1, "{dest}");
    let mut resent = Vec::new();
    loop {
        let (chunk, eos) = streamed_chunk(&s.next().await);
        resent.extend(chunk);
        if eos {
            break;
        }
    }
    assert_eq!(resent, body.as_bytes(), "the body goes on as the client sent it");
    assert_eq!(active(&p), 1, "the pick is booked");
    s.send(response_headers("200", Some(&primary))).await;
    assert!(matches!(s.next().await.response, Some(Response::ResponseHeaders(_))));
    s.send(response_body(b"data: {}\n\n", false)).await;
    assert_eq!(streamed_chunk(&s.next().await), (b"data: {}\n\n".to_vec(), false));
    s.send(response_body(b"data: [DONE]\n\n", true)).await;
    assert!(streamed_chunk(&s.next().await).1, "the last chunk ends the stream");
    until("the booking released at the end of the response", || active(&p) == 0).await;
}

#[tokio::test]
async fn buffered_answers_the_headers_then_routes_in_the_body_answer() {
    let p = picker("").await;
    let mut s = Stream::open(&p).await;
    s.send(with_mode(request_headers("/v1/chat/completions", &[], false), BodySendMode::Buffered))
        .await;
    assert!(matches!(s.next().await.response, Some(Response::RequestHeaders(_))));
    s.send(request_body(chat("buffered").as_bytes(), true)).await;
    let answer = s.next().await;
    let dest = destination(&answer);
    assert!(dest.starts_with(W0) || dest.starts_with(W1), "{dest}");
}

#[tokio::test]
async fn streamed_with_the_body_first_holds_the_headers_then_answers_each_chunk() {
    let p = picker("").await;
    let mut s = Stream::open(&p).await;
    let mut headers = request_headers("/v1/chat/completions", &[], false);
    headers.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Streamed as i32,
        response_body_mode: BodySendMode::Streamed as i32,
        send_body_without_waiting_for_header_response: true,
    });
    s.send(headers).await;
    let body = chat("held headers");
    let (a, b) = body.as_bytes().split_at(body.len() / 2);
    s.send(request_body(a, false)).await;
    s.quiet().await;
    s.send(request_body(b, true)).await;
    let dest = destination(&s.next().await);
    assert!(dest.starts_with(W0) || dest.starts_with(W1), "{dest}");
    for chunk in 0..2 {
        match s.next().await.response {
            Some(Response::RequestBody(r)) => {
                assert_eq!(r.response.unwrap().body_mutation, None, "chunk {chunk} unchanged")
            }
            other => panic!("chunk {chunk}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_conversation_keeps_its_worker() {
    let p = picker("").await;
    let mut primaries = Vec::new();
    for turn in 0..3 {
        let mut s = Stream::open(&p).await;
        s.send(request_headers("/v1/chat/completions", &[], false)).await;
        let mut body: serde_json::Value = serde_json::from_str(&chat("my own question")).unwrap();
        for t in 0..turn {
            let msgs = body["messages"].as_array_mut().unwrap();
            msgs.push(serde_json::json!({"role": "assistant", "content": format!("answer {t}")}));
            msgs.push(serde_json::json!({"role": "user", "content": format!("follow-up {t}")}));
        }
        s.send(request_body(body.to_string().as_bytes(), true)).await;
        let dest = destination(&s.next().await);
        primaries.push(dest.split(',').next().unwrap().to_owned());
    }
    assert!(
        primaries.windows(2).all(|w| w[0] == w[1]),
        "one conversation, one worker: {primaries:?}"
    );
}

#[tokio::test]
async fn the_subset_hint_is_honoured() {
    let p = picker("").await;
    for _ in 0..4 {
        let mut s = Stream::open(&p).await;
        s.send(with_subset(request_headers("/v1/chat/completions", &[], false), &[W1])).await;
        s.send(request_body(chat(&format!("subset {}", rand::random::<u32>())).as_bytes(), true))
            .await;
        assert_eq!(destination(&s.next().await), W1, "only the hinted endpoint");
    }
    // A bare host allows its every port.
    let mut s = Stream::open(&p).await;
    s.send(with_subset(request_headers("/v1/chat/completions", &[], false), &["127.0.0.1"])).await;
    s.send(request_body(chat("bare").as_bytes(), true)).await;
    let dest = destination(&s.next().await);
    assert!(dest.starts_with("127.0.0.1:"), "{dest}");
    // A hint naming nothing of the pool: 503, nothing forwarded.
    let mut s = Stream::open(&p).await;
    s.send(with_subset(request_headers("/v1/chat/completions", &[], false), &["10.9.9.9:80"]))
        .await;
    s.send(request_body(chat("nowhere").as_bytes(), true)).await;
    assert_eq!(immediate_status(&s.next().await).0, 503);
}

#[tokio::test]
async fn conformance_selection_and_served_echo_only_when_asked() {
    let p = picker("[epp]\nconformance = true").await;
    let mut s = Stream::open(&p).await;
    s.send(request_headers("/v1/chat/completions", &[("test-epp-endpoint-selection", W0)], false))
        .await;
    s.send(request_body(chat("pick w0").as_bytes(), true)).await;
    assert_eq!(destination(&s.next().await), W0);
    while !streamed_chunk(&s.next().await).1 {}
    s.send(response_headers("200", Some(W0))).await;
    let Some(Response::ResponseHeaders(h)) = s.next().await.response else { panic!() };
    let m = h.response.unwrap().header_mutation.unwrap();
    assert_eq!(mutation_value(&m, "x-conformance-test-served-endpoint").as_deref(), Some(W0));

    let p = picker("").await;
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..12 {
        let mut s = Stream::open(&p).await;
        s.send(request_headers(
            "/v1/chat/completions",
            &[("test-epp-endpoint-selection", W0)],
            false,
        ))
        .await;
        s.send(request_body(chat(&format!("conversation {i}")).as_bytes(), true)).await;
        seen.insert(destination(&s.next().await).split(',').next().unwrap().to_owned());
    }
    assert!(seen.contains(W1), "without conformance mode a client cannot choose: {seen:?}");
}

#[tokio::test]
async fn immediate_answers_for_what_the_engine_would_refuse() {
    let p = picker("").await;
    // A model nobody serves: vLLM's 404, naming the parameter.
    let mut s = Stream::open(&p).await;
    s.send(request_headers("/v1/completions", &[], false)).await;
    s.send(request_body(br#"{"model":"nope","prompt":"hi"}"#, true)).await;
    let (status, json) = immediate_status(&s.next().await);
    assert_eq!(status, 404);
    assert_eq!(json["error"]["param"], "model");
    // Unreadable JSON: 400.
    let mut s = Stream::open(&p).await;
    s.send(request_headers("/v1/chat/completions", &[], false)).await;
    s.send(request_body(b"{not json", true)).await;
    assert_eq!(immediate_status(&s.next().await).0, 400);
    // GET /v1/models: the catalog, from the picker.
    let mut s = Stream::open(&p).await;
    s.send(request_headers("/v1/models", &[], true)).await;
    let (status, json) = immediate_status(&s.next().await);
    assert_eq!(status, 200);
    assert_eq!(json["data"][0]["id"], "m");
    // Any other path: a worker of the default model, at the headers.
    let mut s = Stream::open(&p).await;
    s.send(request_headers("/health", &[], true)).await;
    let dest = destination(&s.next().await);
    assert!(dest.starts_with(W0) || dest.starts_with(W1), "{dest}");
}

#[tokio::test]
async fn a_body_over_the_bound_is_refused_before_it_is_held() {
    let p = picker("").await;
    let max = p.svc.state.config().routing.max_body_bytes;
    let mut s = Stream::open(&p).await;
    s.send(request_headers("/v1/chat/completions", &[], false)).await;
    let chunk = vec![b' '; 1 << 20];
    let mut sent = 0;
    let answer = loop {
        s.send(request_body(&chunk, false)).await;
        sent += chunk.len();
        if sent > max {
            break s.next().await;
        }
    };
    assert_eq!(immediate_status(&answer).0, 413);
}

#[tokio::test]
async fn a_stream_that_ends_early_releases_its_booking() {
    let p = picker("").await;
    let mut s = Stream::open(&p).await;
    s.send(request_headers("/v1/chat/completions", &[], false)).await;
    s.send(request_body(chat("then gone").as_bytes(), true)).await;
    destination(&s.next().await);
    assert_eq!(active(&p), 1);
    drop(s);
    until("the booking released when the stream ended", || active(&p) == 0).await;
}

#[tokio::test]
async fn health_under_every_name_gie_probes() {
    let p = picker("").await;
    for channel in [p.health.clone(), p.channel.clone()] {
        let mut client = HealthClient::new(channel);
        for name in ["", "liveness", "readiness", "inference-extension", SERVICE_NAME] {
            let mut status = None;
            for _ in 0..100 {
                let r = client.check(HealthCheckRequest { service: name.into() }).await;
                status = r.ok().map(|r| r.into_inner().status());
                if status == Some(ServingStatus::Serving) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(status, Some(ServingStatus::Serving), "{name:?}");
        }
    }
}

/// The status `client` reports for `name`, once it is `want` (polled: health is re-read every
/// 500 ms); what it last said otherwise.
async fn health_becomes(
    client: &mut HealthClient<Channel>,
    name: &str,
    want: ServingStatus,
) -> Option<ServingStatus> {
    let mut status = None;
    for _ in 0..150 {
        let r = client.check(HealthCheckRequest { service: name.into() }).await;
        status = r.ok().map(|r| r.into_inner().status());
        if status == Some(want) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    status
}

#[tokio::test]
async fn a_draining_picker_is_not_serving_while_it_finishes_its_streams() {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let p = picker_until("", async move {
        let _ = stopped.await;
    })
    .await;
    let mut health = HealthClient::new(p.health.clone());
    assert_eq!(
        health_becomes(&mut health, "readiness", ServingStatus::Serving).await,
        Some(ServingStatus::Serving)
    );
    // A request in flight (its body still coming) keeps the picker draining.
    let mut s = Stream::open(&p).await;
    s.send(request_headers("/v1/chat/completions", &[], false)).await;
    stop.send(()).unwrap();
    for name in ["", "readiness", "inference-extension", SERVICE_NAME] {
        assert_eq!(
            health_becomes(&mut health, name, ServingStatus::NotServing).await,
            Some(ServingStatus::NotServing),
            "{name:?}"
        );
    }
    assert_eq!(
        health_becomes(&mut health, "liveness", ServingStatus::Serving).await,
        Some(ServingStatus::Serving),
        "the process still serves"
    );
    // The stream in flight is still answered.
    s.send(request_body(chat("during the drain").as_bytes(), true)).await;
    destination(&s.next().await);
}
