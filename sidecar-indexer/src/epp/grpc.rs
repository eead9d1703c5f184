//! The gRPC plumbing of `ExternalProcessor/Process`, written out instead of generated (the
//! messages are [`super::wire`]'s): the server side hands each stream to [`super::stream::run`];
//! the client side is what the tests and the benchmark drive the picker with.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use futures::Stream;
use tokio::sync::mpsc;
use tonic::codegen::{http, Body, BoxFuture, StdError};

use super::wire::{ProcessingRequest, ProcessingResponse, PROCESS_PATH, SERVICE_NAME};
use crate::state::AppState;

/// Answers queued per stream before the stream's task waits for the gateway to read them.
const STREAM_QUEUE: usize = 16;
/// Room above `routing.max_body_bytes` for one message's framing (a BUFFERED body is one message).
const MESSAGE_OVERHEAD_BYTES: usize = 64 * 1024;

type ResponseStream = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, tonic::Status>> + Send>>;

/// The `envoy.service.ext_proc.v3.ExternalProcessor` service over the indexer's state.
#[derive(Clone)]
pub struct ExtProcServer {
    state: Arc<AppState>,
    max_message_bytes: usize,
}

impl ExtProcServer {
    pub fn new(state: Arc<AppState>) -> Self {
        let max_message_bytes = state.config().routing.max_body_bytes + MESSAGE_OVERHEAD_BYTES;
        Self { state, max_message_bytes }
    }
}

impl tonic::server::NamedService for ExtProcServer {
    const NAME: &'static str = SERVICE_NAME;
}

impl<B> tonic::codegen::Service<http::Request<B>> for ExtProcServer
where
    B: Body + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        if req.uri().path() != PROCESS_PATH {
            return Box::pin(async { Ok(tonic::Status::unimplemented("").into_http()) });
        }
        let process = Process(self.state.clone());
        let limit = self.max_message_bytes;
        Box::pin(async move {
            let codec = tonic_prost::ProstCodec::default();
            let mut grpc =
                tonic::server::Grpc::new(codec).apply_max_message_size_config(Some(limit), None);
            Ok(grpc.streaming(process, req).await)
        })
    }
}

struct Process(Arc<AppState>);

impl tonic::server::StreamingService<ProcessingRequest> for Process {
    type Response = ProcessingResponse;
    type ResponseStream = ResponseStream;
    type Future = BoxFuture<tonic::Response<ResponseStream>, tonic::Status>;

    fn call(
        &mut self,
        request: tonic::Request<tonic::Streaming<ProcessingRequest>>,
    ) -> Self::Future {
        let state = self.0.clone();
        Box::pin(async move {
            let (tx, rx) = mpsc::channel(STREAM_QUEUE);
            tokio::spawn(super::stream::run(state, request.into_inner(), tx));
            let out =
                futures::stream::unfold(
                    rx,
                    |mut rx| async move { rx.recv().await.map(|m| (m, rx)) },
                );
            Ok(tonic::Response::new(Box::pin(out) as ResponseStream))
        })
    }
}

/// Opens a `Process` stream on `channel` sending `requests`; the answers as they come.
pub async fn process(
    channel: tonic::transport::Channel,
    requests: impl Stream<Item = ProcessingRequest> + Send + 'static,
) -> Result<tonic::Streaming<ProcessingResponse>, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let path = http::uri::PathAndQuery::from_static(PROCESS_PATH);
    let codec = tonic_prost::ProstCodec::default();
    grpc.streaming(tonic::Request::new(requests), path, codec)
        .await
        .map(tonic::Response::into_inner)
}
