//! The HTTP accept loop, able to vanish and come back on the same port.
//!
//! `axum::serve` cannot drop live connections, and a vanished worker must look like a dead
//! one: the listener closes (new connections are refused) and every open connection is cut.
//! So connections are served one task each with hyper's HTTP/1 builder, and a vanish request
//! drops the listener, tells every connection task to drop its connection (a `watch` epoch),
//! waits, and binds the same address again.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

/// How long to keep trying to bind the port again after a vanish.
const REBIND_PATIENCE: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` until `shutdown` resolves; each `vanish` message closes the
/// listener and all connections for that long.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    mut vanish: mpsc::UnboundedReceiver<Duration>,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    let mut listener = Some(listener);
    let (cut_tx, _) = watch::channel(0u64);
    let mut epoch = 0u64;
    tokio::pin!(shutdown);
    loop {
        let Some(l) = listener.as_ref() else {
            listener = Some(rebind(addr).await?);
            continue;
        };
        tokio::select! {
            accepted = l.accept() => match accepted {
                Ok((stream, _peer)) => spawn_connection(stream, app.clone(), cut_tx.subscribe()),
                Err(e) => {
                    // Typically EMFILE: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
            Some(d) = vanish.recv() => {
                tracing::warn!(ms = d.as_millis() as u64, %addr, "fault: vanishing");
                drop(listener.take());
                epoch += 1;
                let _ = cut_tx.send(epoch);
                tokio::time::sleep(d).await;
                listener = Some(rebind(addr).await?);
                tracing::warn!(%addr, "fault: back");
            }
            () = &mut shutdown => return Ok(()),
        }
    }
}

async fn rebind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let deadline = tokio::time::Instant::now() + REBIND_PATIENCE;
    loop {
        match TcpListener::bind(addr).await {
            Ok(l) => return Ok(l),
            Err(e) if tokio::time::Instant::now() < deadline => {
                tracing::warn!(error = %e, %addr, "rebinding; retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => return Err(e),
        }
    }
}

fn spawn_connection(stream: TcpStream, app: Router, mut cut: watch::Receiver<u64>) {
    tokio::spawn(async move {
        let _ = stream.set_nodelay(true);
        let conn = hyper::server::conn::http1::Builder::new()
            .keep_alive(true)
            .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
        tokio::select! {
            r = conn => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
            }
            _ = cut.changed() => {} // vanish: dropping the connection closes the socket
        }
    });
}
