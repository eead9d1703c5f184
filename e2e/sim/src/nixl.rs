//! NIXL at the edges: `kv_transfer_params` in requests and responses, and the side channel
//! that stands in for the NIXL read.
//!
//! vLLM's consumer handshakes with the producer's side channel at `remote_host:remote_port` and
//! reads `remote_block_ids` over RDMA. Here the side channel is the producer's own HTTP server:
//! the consumer `POST`s [`PullRequest`] to [`PULL_PATH`] and gets the blocks' token ids back
//! ([`PullResponse`]), then waits `--nixl-us-per-block` per block (sped up) to stand for the
//! transfer. The producer releases the hold when it serves the pull.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::sched::{RemoteSource, TransferOut};

/// The producer endpoint a consumer pulls from.
pub const PULL_PATH: &str = "/internal/nixl/pull";

/// What the consumer asks the producer for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullRequest {
    /// The producer's transfer id (its `remote_request_id`).
    pub remote_request_id: String,
    /// Producer block ids to read, in prompt order (may be empty: release only).
    pub remote_block_ids: Vec<u32>,
    /// The producer's engine id, as the consumer was told (checked).
    #[serde(default)]
    pub remote_engine_id: Option<String>,
}

/// The producer's answer: the token ids of each requested block.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PullResponse {
    /// The producer's block size (must equal the consumer's).
    pub block_size: usize,
    /// One entry per requested block (a partial tail block holds fewer ids).
    pub blocks: Vec<Vec<u32>>,
}

/// What a request's `kv_transfer_params` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransferRequest {
    /// No transfer (absent, null, or both flags false).
    None,
    /// `do_remote_decode: true`: act as the producer.
    Produce,
    /// `do_remote_prefill: true`: pull from the producer first.
    Consume(RemoteSource),
}

/// `kv_transfer_params` that cannot be acted on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("kv_transfer_params: {0}")]
pub struct TransferParamsError(String);

/// Reads a request's `kv_transfer_params`.
pub fn parse_params(params: Option<&Value>) -> Result<TransferRequest, TransferParamsError> {
    let obj = match params {
        None | Some(Value::Null) => return Ok(TransferRequest::None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(TransferParamsError("must be an object".into())),
    };
    let flag = |k: &str| match obj.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(TransferParamsError(format!("`{k}` must be a boolean"))),
    };
    let (decode, prefill) = (flag("do_remote_decode")?, flag("do_remote_prefill")?);
    match (decode, prefill) {
        (true, true) => {
            Err(TransferParamsError("do_remote_decode and do_remote_prefill are both true".into()))
        }
        (true, false) => Ok(TransferRequest::Produce),
        (false, false) => Ok(TransferRequest::None),
        (false, true) => {
            let text = |k: &str| {
                obj.get(k)
                    .and_then(Value::as_str)
                    .map(str::to_owned)
                    .ok_or_else(|| TransferParamsError(format!("`{k}` must be a string")))
            };
            let port = obj
                .get("remote_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| TransferParamsError("`remote_port` must be a port number".into()))?;
            let block_ids = obj
                .get("remote_block_ids")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    TransferParamsError("`remote_block_ids` must be a list of block ids".into())
                })?
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    TransferParamsError("`remote_block_ids` must be a list of block ids".into())
                })?;
            Ok(TransferRequest::Consume(RemoteSource {
                host: text("remote_host")?,
                port,
                engine_id: obj
                    .get("remote_engine_id")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
                request_id: text("remote_request_id")?,
                block_ids,
            }))
        }
    }
}

/// The producer's response `kv_transfer_params` (vLLM `NixlConnectorScheduler.request_finished`).
pub fn response_params(t: &TransferOut, engine_id: &str, host: &str, port: u16) -> Value {
    json!({
        "do_remote_prefill": true,
        "do_remote_decode": false,
        "remote_block_ids": t.block_ids,
        "remote_engine_id": engine_id,
        "remote_request_id": t.transfer_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
    })
}

/// The consumer side of the side channel.
#[derive(Debug, Clone)]
pub struct PullClient {
    http: reqwest::Client,
    block_size: usize,
}

impl PullClient {
    /// A client whose pulls time out after `timeout`.
    pub fn new(timeout: Duration, block_size: usize) -> Result<Self, reqwest::Error> {
        let http = reqwest::Client::builder().timeout(timeout).pool_max_idle_per_host(4).build()?;
        Ok(Self { http, block_size })
    }

    /// Reads `block_ids` from `source` (and so releases its hold). Errors are reasons for logs.
    pub async fn pull(
        &self,
        source: &RemoteSource,
        block_ids: &[u32],
    ) -> Result<Vec<Vec<u32>>, String> {
        let host = if source.host.contains(':') && !source.host.starts_with('[') {
            format!("[{}]", source.host)
        } else {
            source.host.clone()
        };
        let url = format!("http://{host}:{}{PULL_PATH}", source.port);
        let body = PullRequest {
            remote_request_id: source.request_id.clone(),
            remote_block_ids: block_ids.to_vec(),
            remote_engine_id: Some(source.engine_id.clone()).filter(|s| !s.is_empty()),
        };
        let resp =
            self.http.post(&url).json(&body).send().await.map_err(|e| format!("{url}: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(format!(
                "{url}: HTTP {status}: {}",
                text.chars().take(200).collect::<String>()
            ));
        }
        let got: PullResponse =
            resp.json().await.map_err(|e| format!("{url}: bad pull response: {e}"))?;
        if got.block_size != self.block_size {
            return Err(format!(
                "producer block size {} != ours {}",
                got.block_size, self.block_size
            ));
        }
        if got.blocks.len() != block_ids.len() {
            return Err(format!("asked for {} blocks, got {}", block_ids.len(), got.blocks.len()));
        }
        Ok(got.blocks)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params() {
        let ok = |v: Value| parse_params(Some(&v)).unwrap();
        assert_eq!(parse_params(None).unwrap(), TransferRequest::None);
        assert_eq!(ok(Value::Null), TransferRequest::None);
        // The toy proxy's prefill-leg shape.
        assert_eq!(
            ok(
                json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null, "remote_block_ids": null, "remote_host": null, "remote_port": null})
            ),
            TransferRequest::Produce
        );
        let consume = ok(
            json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [3, 4], "remote_engine_id": "p",
            "remote_request_id": "x", "remote_host": "127.0.0.1", "remote_port": 8000, "tp_size": 1}),
        );
        assert_eq!(
            consume,
            TransferRequest::Consume(RemoteSource {
                host: "127.0.0.1".into(),
                port: 8000,
                engine_id: "p".into(),
                request_id: "x".into(),
                block_ids: vec![3, 4]
            })
        );
        for bad in [
            json!(1),
            json!({"do_remote_decode": "yes"}),
            json!({"do_remote_decode": true, "do_remote_prefill": true}),
            json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 1, "remote_request_id": "x"}),
            json!({"do_remote_prefill": true, "remote_host": "h", "remote_port": 70000, "remote_request_id": "x", "remote_block_ids": []}),
        ] {
            assert!(parse_params(Some(&bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn response_shape() {
        let t =
            TransferOut { transfer_id: "sim-1-7".into(), block_ids: vec![1, 2], num_tokens: 20 };
        let v = response_params(&t, "sim-1", "127.0.0.1", 9000);
        assert_eq!(
            v,
            json!({"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [1, 2], "remote_engine_id": "sim-1",
                "remote_request_id": "sim-1-7", "remote_host": "127.0.0.1", "remote_port": 9000, "tp_size": 1})
        );
        // What we emit, we accept.
        assert!(matches!(parse_params(Some(&v)), Ok(TransferRequest::Consume(_))));
    }
}
