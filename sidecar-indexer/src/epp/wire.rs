//! The ext_proc messages the endpoint picker reads and writes, declared by hand with `prost`.
//!
//! Only the fields kvmesh uses are declared; protobuf decoders skip unknown fields, so Envoy's
//! newer fields (flow control, observability mode, attributes) pass harmlessly. Field numbers and
//! types are those of Envoy's API (`envoy/service/ext_proc/v3/external_processor.proto`,
//! `envoy/config/core/v3/base.proto`, `envoy/type/v3/http_status.proto`,
//! `envoy/extensions/filters/http/ext_proc/v3/processing_mode.proto`, as published in the
//! `envoy-types` 0.7.7 crate); the end-to-end tests on real Envoy 1.40 check them on the wire.
//! Why not that crate: it generates all of Envoy's API (398 files, 8.2 MB of Rust) and would be
//! compiled on every CI run for the dozen messages used here (the epp README, "Crates").
//!
//! Bodies are `Bytes`: a chunk decoded from the gRPC frame is a view of the frame's buffer, not a
//! copy, and the chunks re-sent to the proxy are views of the one body the picker holds.

use std::collections::HashMap;

use prost::bytes::Bytes;

/// `envoy.service.ext_proc.v3.ExternalProcessor`, the gRPC service name.
pub const SERVICE_NAME: &str = "envoy.service.ext_proc.v3.ExternalProcessor";
/// Its one method: a bidirectional stream per HTTP request.
pub const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// `ProcessingRequest`: one message from the proxy.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "Request", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<Request>,
    /// `envoy.config.core.v3.Metadata`: the subset hint and the served endpoint arrive here.
    #[prost(message, optional, tag = "8")]
    pub metadata_context: Option<Metadata>,
    /// Only on the first message of a stream.
    #[prost(message, optional, tag = "11")]
    pub protocol_config: Option<ProtocolConfiguration>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Request {
    #[prost(message, tag = "2")]
    RequestHeaders(HttpHeaders),
    #[prost(message, tag = "3")]
    ResponseHeaders(HttpHeaders),
    #[prost(message, tag = "4")]
    RequestBody(HttpBody),
    #[prost(message, tag = "5")]
    ResponseBody(HttpBody),
    #[prost(message, tag = "6")]
    RequestTrailers(HttpTrailers),
    #[prost(message, tag = "7")]
    ResponseTrailers(HttpTrailers),
}

/// `ProtocolConfiguration`: the body modes the proxy was configured with.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct ProtocolConfiguration {
    #[prost(enumeration = "BodySendMode", tag = "1")]
    pub request_body_mode: i32,
    #[prost(enumeration = "BodySendMode", tag = "2")]
    pub response_body_mode: i32,
    #[prost(bool, tag = "3")]
    pub send_body_without_waiting_for_header_response: bool,
}

/// `ProcessingMode.BodySendMode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum BodySendMode {
    None = 0,
    Streamed = 1,
    Buffered = 2,
    BufferedPartial = 3,
    FullDuplexStreamed = 4,
    Grpc = 5,
}

/// `HttpHeaders`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpHeaders {
    #[prost(message, optional, tag = "1")]
    pub headers: Option<HeaderMap>,
    #[prost(bool, tag = "3")]
    pub end_of_stream: bool,
}

/// `HttpBody`: one chunk (or, buffered, the whole body).
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `HttpTrailers`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpTrailers {
    #[prost(message, optional, tag = "1")]
    pub trailers: Option<HeaderMap>,
}

/// `envoy.config.core.v3.HeaderMap`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMap {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<HeaderValue>,
}

/// `envoy.config.core.v3.HeaderValue`: Envoy sends `raw_value`; some clients (agentgateway's
/// pseudo-headers) send `value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

impl HeaderValue {
    /// The value's bytes, from whichever field carries it.
    pub fn bytes(&self) -> &[u8] {
        if self.raw_value.is_empty() {
            self.value.as_bytes()
        } else {
            &self.raw_value
        }
    }
}

/// `envoy.config.core.v3.HeaderValueOption`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
    #[prost(enumeration = "HeaderAppendAction", tag = "3")]
    pub append_action: i32,
}

/// `HeaderValueOption.HeaderAppendAction`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, prost::Enumeration)]
#[repr(i32)]
pub enum HeaderAppendAction {
    AppendIfExistsOrAdd = 0,
    AddIfAbsent = 1,
    OverwriteIfExistsOrAdd = 2,
    OverwriteIfExists = 3,
}

/// `envoy.config.core.v3.Metadata`: per filter namespace, a `google.protobuf.Struct`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Metadata {
    #[prost(map = "string, message", tag = "1")]
    pub filter_metadata: HashMap<String, prost_types::Struct>,
}

/// `ProcessingResponse`: one message to the proxy.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "Response", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub response: Option<Response>,
    /// Dynamic metadata for the proxy's namespaces: `envoy.lb` carries the destination.
    #[prost(message, optional, tag = "8")]
    pub dynamic_metadata: Option<prost_types::Struct>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Response {
    #[prost(message, tag = "1")]
    RequestHeaders(HeadersResponse),
    #[prost(message, tag = "2")]
    ResponseHeaders(HeadersResponse),
    #[prost(message, tag = "3")]
    RequestBody(BodyResponse),
    #[prost(message, tag = "4")]
    ResponseBody(BodyResponse),
    #[prost(message, tag = "5")]
    RequestTrailers(TrailersResponse),
    #[prost(message, tag = "6")]
    ResponseTrailers(TrailersResponse),
    #[prost(message, tag = "7")]
    ImmediateResponse(ImmediateResponse),
}

/// `HeadersResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `BodyResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `TrailersResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrailersResponse {
    #[prost(message, optional, tag = "1")]
    pub header_mutation: Option<HeaderMutation>,
}

/// `CommonResponse` (status CONTINUE = 0 unless said).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    #[prost(int32, tag = "1")]
    pub status: i32,
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
    #[prost(message, optional, tag = "3")]
    pub body_mutation: Option<BodyMutation>,
    #[prost(bool, tag = "5")]
    pub clear_route_cache: bool,
}

/// `HeaderMutation`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
    #[prost(string, repeated, tag = "2")]
    pub remove_headers: Vec<String>,
}

/// `BodyMutation`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyMutation {
    #[prost(oneof = "Mutation", tags = "1, 2, 3")]
    pub mutation: Option<Mutation>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum Mutation {
    /// The whole new body (buffered modes).
    #[prost(bytes = "bytes", tag = "1")]
    Body(Bytes),
    #[prost(bool, tag = "2")]
    ClearBody(bool),
    /// One chunk (FULL_DUPLEX_STREAMED).
    #[prost(message, tag = "3")]
    StreamedResponse(StreamedBodyResponse),
}

/// `StreamedBodyResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamedBodyResponse {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `ImmediateResponse`: a local answer to the client; nothing is forwarded.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImmediateResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<HttpStatus>,
    #[prost(message, optional, tag = "2")]
    pub headers: Option<HeaderMutation>,
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
    #[prost(string, tag = "5")]
    pub details: String,
}

/// `envoy.type.v3.HttpStatus` (the code is the HTTP status number).
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct HttpStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
}
