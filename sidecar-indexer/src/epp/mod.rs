//! The Gateway API Inference Extension endpoint picker: a second front door to the route
//! pipeline, for gateways that speak Envoy's `ext_proc` (Istio, agentgateway, Envoy AI Gateway,
//! NGINX Gateway Fabric) instead of loading the wasm filter.
//!
//! One pipeline, two front doors: a stream's request is read here ([`head`]), routed by
//! [`crate::route::route`] exactly as a filter's `/v1/route` call is (same parsing, tokenizing,
//! scoring, booking), and answered per GIE's endpoint-picker protocol ([`reply`]): the destination
//! as the `x-gateway-destination-endpoint` header and as `envoy.lb` dynamic metadata (primary,
//! then fallbacks), the body re-sent (with `kv_transfer_params` spliced in for disaggregation and
//! migration), errors as immediate responses. The response phase releases the booking.
//!
//! - [`wire`]: the ext_proc messages (hand-declared prost types).
//! - [`grpc`]: the `Process` service and its client.
//! - [`stream`]: one stream's life (the only part that awaits).
//! - [`head`], [`reply`], [`body`]: pure reading and writing of the messages, the body held.
//! - [`health`]: `grpc.health.v1` under the names GIE probes.

pub mod body;
pub mod grpc;
pub mod head;
pub mod health;
pub mod reply;
mod stream;
pub mod wire;

use std::future::Future;
use std::sync::Arc;

use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;

use crate::state::AppState;

/// Serves the picker (and gRPC health) on `listener`, and gRPC health alone on `health`, until
/// `shutdown` resolves; then health says NOT_SERVING ([`health::draining`]) before the picker
/// stops accepting and drains its streams. TCP_NODELAY on every connection: an answer is several small messages
/// (headers, then body chunks), and Nagle's algorithm against the proxy's delayed ACKs held each
/// request ~40 ms (measured by the overhead bench; tonic's builder setting does not reach a
/// listener passed in).
pub async fn serve(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
    health: Option<tokio::net::TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    let tracker = tokio::spawn(health::track(state.clone(), reporter.clone()));
    let drain = async move {
        shutdown.await;
        // Stopped (and awaited) first, so that it cannot report SERVING again after this.
        tracker.abort();
        let _ = tracker.await;
        health::draining(&reporter).await;
    };
    if let Some(h) = health {
        let svc = health_service.clone();
        tokio::spawn(async move {
            if let Err(e) = Server::builder()
                .add_service(svc)
                .serve_with_incoming(TcpIncoming::from(h).with_nodelay(Some(true)))
                .await
            {
                tracing::error!(error = %e, "endpoint picker health listener failed");
            }
        });
    }
    Server::builder()
        .add_service(health_service)
        .add_service(grpc::ExtProcServer::new(state))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener).with_nodelay(Some(true)), drain)
        .await
}

#[cfg(test)]
mod tests;
