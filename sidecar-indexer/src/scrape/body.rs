//! Fetching an engine's `/metrics` within `routing.scrape_max_body_bytes`.
//!
//! A vLLM exposition runs to hundreds of kilobytes; nothing bounded what the indexer read, so an
//! engine (or whatever answers at its address) sending an endless or huge body made every scrape
//! round buffer all of it — once per worker, every `scrape_interval_ms` (issue 43, point 6). The
//! body is read chunk by chunk and refused as soon as it passes the bound (a `Content-Length`
//! above it is refused before reading): a failed scrape, counted in
//! `kvmesh_engine_scrape_too_large_total` and logged at warn. As for any failed scrape, the worker
//! keeps its last sample until `unhealthy_after_failures` failures in a row mark it unhealthy.

use std::time::Duration;

use crate::metrics::Metrics;

/// Why a scrape failed.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// Connecting, the status, the timeout, or reading the body.
    #[error("{0}")]
    Http(#[from] reqwest::Error),
    /// The body (read or announced) is above `routing.scrape_max_body_bytes`.
    #[error("/metrics body above routing.scrape_max_body_bytes ({limit} bytes): at least {seen}")]
    TooLarge { seen: u64, limit: usize },
}

/// `GET http://{endpoint}/metrics` within `timeout`, its body as text (invalid UTF-8 replaced, as
/// `reqwest`'s `text` does), at most `max_bytes` long. A body over the bound is counted for
/// `worker` and logged.
pub async fn fetch_metrics(
    client: &reqwest::Client,
    endpoint: &str,
    timeout: Duration,
    max_bytes: usize,
    worker: &str,
    metrics: &Metrics,
) -> Result<String, ScrapeError> {
    let res = read_bounded(client, endpoint, timeout, max_bytes).await;
    if let Err(ScrapeError::TooLarge { seen, limit }) = &res {
        metrics.engine_scrape_too_large.with_label_values(&[worker]).inc();
        tracing::warn!(worker, endpoint, bytes_at_least = seen, limit, "engine /metrics body above routing.scrape_max_body_bytes; scrape refused (the worker keeps its last sample until it counts as unreachable)");
    }
    res
}

async fn read_bounded(
    client: &reqwest::Client,
    endpoint: &str,
    timeout: Duration,
    max_bytes: usize,
) -> Result<String, ScrapeError> {
    let mut resp = client
        .get(format!("http://{endpoint}/metrics"))
        .timeout(timeout)
        .send()
        .await?
        .error_for_status()?;
    let limit = max_bytes;
    if let Some(len) = resp.content_length().filter(|&l| l > limit as u64) {
        return Err(ScrapeError::TooLarge { seen: len, limit });
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        let seen = body.len().saturating_add(chunk.len());
        if seen > limit {
            return Err(ScrapeError::TooLarge { seen: seen as u64, limit });
        }
        body.extend_from_slice(&chunk);
    }
    Ok(String::from_utf8_lossy(&body).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A one-connection-at-a-time HTTP server answering every request with `head` + `body`.
    async fn serve(head: String, body: Vec<u8>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let _ = conn.write_all(head.as_bytes()).await;
                let _ = conn.write_all(&body).await;
                let _ = conn.shutdown().await;
            }
        });
        addr
    }

    #[tokio::test]
    async fn a_body_above_the_bound_is_refused_and_counted_announced_or_not() {
        let metrics = Metrics::new().unwrap();
        let client = reqwest::Client::new();
        let body = b"vllm:num_requests_running 1\n".repeat(100); // 2,800 bytes
        let t = Duration::from_secs(10);
        // With a Content-Length, and without one (read until the connection closes).
        let sized = serve(
            format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            ),
            body.clone(),
        )
        .await;
        let streamed =
            serve("HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n".into(), body.clone()).await;
        for (i, addr) in [sized, streamed].iter().enumerate() {
            let ok = fetch_metrics(&client, addr, t, 4096, "w", &metrics).await.unwrap();
            assert_eq!(ok.len(), body.len(), "within the bound: read whole");
            let refused = fetch_metrics(&client, addr, t, 1000, "w", &metrics).await;
            assert!(
                matches!(refused, Err(ScrapeError::TooLarge { limit: 1000, .. })),
                "case {i}: {refused:?}"
            );
        }
        assert_eq!(metrics.engine_scrape_too_large.with_label_values(&["w"]).get(), 2);
    }
}
