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
//! - [`head`], [`reply`]: pure reading and writing of the messages.
//! - [`health`]: `grpc.health.v1` under the names GIE probes.

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
/// `shutdown` resolves.
pub async fn serve(
    state: Arc<AppState>,
    listener: tokio::net::TcpListener,
    health: Option<tokio::net::TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), tonic::transport::Error> {
    let (reporter, health_service) = tonic_health::server::health_reporter();
    tokio::spawn(health::track(state.clone(), reporter));
    if let Some(h) = health {
        let svc = health_service.clone();
        tokio::spawn(async move {
            if let Err(e) =
                Server::builder().add_service(svc).serve_with_incoming(TcpIncoming::from(h)).await
            {
                tracing::error!(error = %e, "endpoint picker health listener failed");
            }
        });
    }
    Server::builder()
        .add_service(health_service)
        .add_service(grpc::ExtProcServer::new(state))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), shutdown)
        .await
}

#[cfg(test)]
mod tests;
