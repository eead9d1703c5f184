//! The synthetic fleet's HTTP side: one loopback listener per worker answering the indexer's
//! `GET /metrics` scrapes with a small vLLM exposition (idle engine, cache 90 % used), padded
//! with histogram bucket lines — which the indexer passes over unparsed, as in a real vLLM
//! exposition — up to a chosen size. HTTP/1.1 keep-alive, written by hand: every answer is the
//! same bytes, whatever the path.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The exposition every worker answers, at least `pad_to` bytes (pure).
pub fn metrics_body(model: &str, pad_to: usize) -> String {
    let mut s = String::new();
    for (name, kind, value) in [
        ("vllm:num_requests_running", "gauge", "0"),
        ("vllm:num_requests_waiting", "gauge", "0"),
        ("vllm:kv_cache_usage_perc", "gauge", "0.9"),
        ("vllm:prefix_cache_queries_total", "counter", "1000"),
        ("vllm:prefix_cache_hits_total", "counter", "500"),
    ] {
        s.push_str(&format!("# TYPE {name} {kind}\n{name}{{model_name=\"{model}\"}} {value}\n"));
    }
    let mut le = 0.001f64;
    while s.len() < pad_to {
        s.push_str(&format!(
            "vllm:e2e_request_latency_seconds_bucket{{le=\"{le:.3}\",model_name=\"{model}\"}} 0\n"
        ));
        le *= 1.5;
    }
    s
}

/// The answer to any request, with `body`.
fn response(body: &str) -> Arc<[u8]> {
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body.as_bytes());
    bytes.into()
}

/// The listeners; they stop when this is dropped.
pub struct Engines {
    pub addrs: Vec<SocketAddr>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for Engines {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// Binds `workers` listeners on 127.0.0.1 (ports chosen by the kernel, held from the start).
pub async fn start(workers: u32, body: &str) -> anyhow::Result<Engines> {
    let answer = response(body);
    let (mut addrs, mut tasks) = (Vec::new(), Vec::new());
    for _ in 0..workers {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        addrs.push(l.local_addr()?);
        tasks.push(tokio::spawn(accept(l, answer.clone())));
    }
    Ok(Engines { addrs, tasks })
}

async fn accept(l: TcpListener, answer: Arc<[u8]>) {
    loop {
        match l.accept().await {
            Ok((s, _)) => {
                tokio::spawn(serve(s, answer.clone()));
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
}

/// Requests are read up to their blank line (GETs have no body); one answer each.
async fn serve(mut s: TcpStream, answer: Arc<[u8]>) {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        let n = match s.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            buf.drain(..end + 4);
            if s.write_all(&answer).await.is_err() {
                return;
            }
        }
        if buf.len() > 64 * 1024 {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_body_reads_as_an_idle_engine_and_is_padded() {
        let b = metrics_body("m", 0);
        assert!(b.contains("vllm:num_requests_waiting{model_name=\"m\"} 0\n"));
        let padded = metrics_body("m", 10_000);
        assert!(padded.len() >= 10_000 && padded.starts_with(&b));
    }
}
