//! The legs a plan runs before its decision is answered: the prefill leg of a disaggregated
//! request, and the producer handshake of a KV migration. Both speak vLLM's NIXL protocol (the
//! toy proxy's, `reference/engines.md` §3): the client's body cut to one step, sent with the same
//! `X-Request-Id`, and the answer's top-level `kv_transfer_params` handed to the decode worker.
//!
//! [`leg_body`] and [`classify_answer`] are pure; [`run`] is the one function with I/O. Every way a
//! leg can end is a [`LegResult`]: the producer's params, an overload the client must see (429, or
//! a 503 that says so), or a [`LegFailure`] the shell turns into `decode_fallback` (prefill) or a
//! recompute (migration). A 503 counts as overload when the engine says so — a `Retry-After`
//! header, or an error body about capacity, queues, overload or rate limits — and as a failure
//! otherwise (a mesh proxy's "upstream connect error", an engine that is shutting down).

use std::borrow::Cow;
use std::time::Duration;

use kvmesh_core::json_edit::{self, Edit};
use serde_json::Value;

/// Which leg: decides the body's one-step shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegKind {
    /// `kv_transfer_params: {do_remote_decode: true, …}` on a prefill worker.
    Prefill,
    /// `kv_migration_source: true` on the decode worker that holds the blocks.
    Migration,
}

/// Largest leg answer read (a one-token completion is a few hundred bytes).
pub const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Why a leg produced no usable `kv_transfer_params`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegFailure {
    /// Connection refused or unreachable.
    Refused,
    /// No complete answer within the deadline.
    Timeout,
    /// The connection broke after it was made.
    Reset,
    /// A 5xx other than overload.
    Http5xx,
    /// A 4xx other than 429 (the decode worker will answer the client's request on its own terms).
    Http4xx,
    /// A 2xx answer without a `kv_transfer_params` object (engine without the NIXL connector).
    NoKvTransferParams,
    /// An answer that is not JSON, or too large.
    BadResponse,
    /// The client's body is not a JSON object, so no one-step body can be made from it.
    BadRequestBody,
    /// The worker left the fleet (or became unhealthy) while the leg ran.
    WorkerGone,
}

impl LegFailure {
    /// The metric label.
    pub fn reason(self) -> &'static str {
        match self {
            Self::Refused => "refused",
            Self::Timeout => "timeout",
            Self::Reset => "reset",
            Self::Http5xx => "http_5xx",
            Self::Http4xx => "http_4xx",
            Self::NoKvTransferParams => "no_kv_transfer_params",
            Self::BadResponse => "bad_response",
            Self::BadRequestBody => "bad_request_body",
            Self::WorkerGone => "worker_gone",
        }
    }

    /// Every label, for creating the series at zero.
    pub const ALL: [Self; 9] = [
        Self::Refused,
        Self::Timeout,
        Self::Reset,
        Self::Http5xx,
        Self::Http4xx,
        Self::NoKvTransferParams,
        Self::BadResponse,
        Self::BadRequestBody,
        Self::WorkerGone,
    ];
}

/// How a leg ended.
#[derive(Debug, Clone, PartialEq)]
pub enum LegResult {
    /// The producer's `kv_transfer_params`, for the decode worker.
    Params(Value),
    /// The worker is out of capacity: the client gets this status and message, and backs off.
    Overloaded { status: u16, message: String },
    /// Anything else; `detail` is for the log line.
    Failed { failure: LegFailure, detail: String },
}

impl LegResult {
    fn failed(failure: LegFailure, detail: impl Into<String>) -> Self {
        Self::Failed { failure, detail: detail.into() }
    }
}

/// `kv_transfer_params` of a prefill leg: produce the KV for a remote decode (the toy proxy's).
const PREFILL_PARAMS: &str = r#"{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}"#;

/// The one-step body for `kind` made from the client's body: `max_tokens` (and
/// `max_completion_tokens` when present) 1, not streamed, no `stream_options`, no minimum lengths;
/// the prefill leg asks to produce for a remote decode, the migration leg to act as migration source.
/// Edited in place by the core's JSON editor: every other byte is the client's (the prompt is
/// copied, never re-serialised).
pub fn leg_body(kind: LegKind, client_body: &[u8]) -> Result<Vec<u8>, LegFailure> {
    let b = Cow::Borrowed;
    let mut edits = vec![
        Edit::Set { key: "max_tokens", value: b("1") },
        Edit::Replace { key: "max_completion_tokens", value: b("1") },
        Edit::Set { key: "stream", value: b("false") },
        Edit::Remove { key: "stream_options" },
        Edit::Remove { key: "min_tokens" },
        Edit::Remove { key: "min_completion_tokens" },
    ];
    match kind {
        LegKind::Prefill => {
            edits.push(Edit::Remove { key: "kv_migration_source" });
            edits.push(Edit::Set { key: "kv_transfer_params", value: b(PREFILL_PARAMS) });
        }
        LegKind::Migration => {
            edits.push(Edit::Remove { key: "kv_transfer_params" });
            edits.push(Edit::Set { key: "kv_migration_source", value: b("true") });
        }
    }
    json_edit::edit(client_body, &edits).map_err(|_| LegFailure::BadRequestBody)
}

/// Words an engine uses when a 503 means "come back later" rather than "I am broken".
const OVERLOAD_WORDS: [&str; 8] =
    ["overload", "capacity", "busy", "queue", "too many", "rate limit", "exhausted", "retry"];

/// Classifies a complete HTTP answer.
pub fn classify_answer(status: u16, retry_after: bool, body: &[u8]) -> LegResult {
    let message = || error_message(body);
    match status {
        200..=299 => match serde_json::from_slice::<Value>(body) {
            Ok(Value::Object(mut o)) => match o.remove("kv_transfer_params") {
                Some(p @ Value::Object(_)) => LegResult::Params(p),
                _ => LegResult::failed(
                    LegFailure::NoKvTransferParams,
                    "answer has no kv_transfer_params object",
                ),
            },
            _ => LegResult::failed(LegFailure::BadResponse, "answer is not a JSON object"),
        },
        429 => LegResult::Overloaded { status, message: message() },
        503 => {
            let m = message();
            let lower = m.to_lowercase();
            if retry_after || OVERLOAD_WORDS.iter().any(|w| lower.contains(w)) {
                LegResult::Overloaded { status, message: m }
            } else {
                LegResult::failed(LegFailure::Http5xx, format!("HTTP 503: {m}"))
            }
        }
        500..=599 => {
            LegResult::failed(LegFailure::Http5xx, format!("HTTP {status}: {}", message()))
        }
        _ => LegResult::failed(LegFailure::Http4xx, format!("HTTP {status}: {}", message())),
    }
}

/// The error message of an OpenAI-style error body, else the body's first 200 characters.
fn error_message(body: &[u8]) -> String {
    let parsed: Option<String> = serde_json::from_slice::<Value>(body).ok().and_then(|v| {
        let e = v.get("error")?;
        e.get("message").and_then(Value::as_str).or_else(|| e.as_str()).map(str::to_owned)
    });
    parsed.unwrap_or_else(|| String::from_utf8_lossy(body).chars().take(200).collect())
}

/// Sends the `kind` leg for the client's `body` to `http://{endpoint}{path}` with `request_id`,
/// and classifies the answer; the whole exchange (connect, prefill, read) is bounded by `deadline`.
pub async fn run(
    client: &reqwest::Client,
    kind: LegKind,
    endpoint: &str,
    path: &str,
    request_id: &str,
    body: &[u8],
    deadline: Duration,
) -> LegResult {
    let leg = match leg_body(kind, body) {
        Ok(b) => b,
        Err(f) => return LegResult::failed(f, "the client's body is not a JSON object"),
    };
    let exchange = async {
        let resp = client
            .post(format!("http://{endpoint}{path}"))
            .header("content-type", "application/json")
            .header(kvmesh_core::headers::REQUEST_ID, request_id)
            .body(leg)
            .send()
            .await
            .map_err(|e| transport(&e))?;
        let status = resp.status().as_u16();
        let retry_after = resp.headers().contains_key("retry-after");
        let mut resp = resp;
        let mut answer = Vec::new();
        while let Some(chunk) = resp.chunk().await.map_err(|e| transport(&e))? {
            if answer.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(LegResult::failed(
                    LegFailure::BadResponse,
                    format!("answer larger than {MAX_ANSWER_BYTES} bytes"),
                ));
            }
            answer.extend_from_slice(&chunk);
        }
        Ok(classify_answer(status, retry_after, &answer))
    };
    match tokio::time::timeout(deadline, exchange).await {
        Ok(Ok(r) | Err(r)) => r,
        Err(_) => LegResult::failed(
            LegFailure::Timeout,
            format!("no answer within {} ms", deadline.as_millis()),
        ),
    }
}

fn transport(e: &reqwest::Error) -> LegResult {
    let failure = if e.is_timeout() {
        LegFailure::Timeout
    } else if e.is_connect() {
        LegFailure::Refused
    } else {
        LegFailure::Reset
    };
    LegResult::failed(failure, e.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    fn body(kind: LegKind, v: Value) -> Value {
        serde_json::from_slice(&leg_body(kind, v.to_string().as_bytes()).unwrap()).unwrap()
    }

    #[test]
    fn prefill_body_is_the_toy_proxys() {
        let client = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": 300, "max_completion_tokens": 300, "min_tokens": 5,
            "kv_migration_source": true, "temperature": 0.2});
        let b = body(LegKind::Prefill, client);
        assert_eq!(
            b,
            json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": false, "max_tokens": 1,
                "max_completion_tokens": 1, "temperature": 0.2,
                "kv_transfer_params": {"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
                    "remote_block_ids": null, "remote_host": null, "remote_port": null}})
        );
    }

    #[test]
    fn migration_body_asks_for_a_producer_step() {
        let b = body(
            LegKind::Migration,
            json!({"prompt": [1, 2, 3], "kv_transfer_params": {"do_remote_prefill": true}}),
        );
        assert_eq!(
            b,
            json!({"prompt": [1, 2, 3], "max_tokens": 1, "stream": false, "kv_migration_source": true})
        );
        assert_eq!(leg_body(LegKind::Migration, b"[1]"), Err(LegFailure::BadRequestBody));
        assert_eq!(leg_body(LegKind::Prefill, b"{"), Err(LegFailure::BadRequestBody));
    }

    #[test]
    fn the_prompt_reaches_the_leg_as_the_client_wrote_it() {
        // Number spellings and escapes a Value round trip would change, in the part the leg keeps.
        let client = br#"{"prompt": [1, 2, 3], "temperature": 1.0e0, "seed": 123456789012345678901234567890, "stop": ["\u00e9"], "stream": true, "max_tokens": 9}"#;
        let leg = leg_body(LegKind::Migration, client).unwrap();
        let text = String::from_utf8(leg).unwrap();
        assert_eq!(
            text,
            r#"{"kv_migration_source":true,"prompt": [1, 2, 3], "temperature": 1.0e0, "seed": 123456789012345678901234567890, "stop": ["\u00e9"], "stream": false, "max_tokens": 1}"#
        );
    }

    #[test]
    fn answers_are_classified() {
        let params = json!({"do_remote_prefill": true, "remote_block_ids": [1]});
        let ok = json!({"id": "x", "kv_transfer_params": params}).to_string();
        assert_eq!(classify_answer(200, false, ok.as_bytes()), LegResult::Params(params));
        let err = |m: &str| {
            json!({"error": {"message": m, "type": "ServiceUnavailableError", "code": 503}})
                .to_string()
        };
        let fails = |r: LegResult| match r {
            LegResult::Failed { failure, .. } => Some(failure),
            _ => None,
        };
        let cases: [(u16, bool, String, Option<LegFailure>); 9] = [
            (200, false, json!({"id": "x"}).to_string(), Some(LegFailure::NoKvTransferParams)),
            (
                200,
                false,
                json!({"kv_transfer_params": null}).to_string(),
                Some(LegFailure::NoKvTransferParams),
            ),
            (200, false, "not json".into(), Some(LegFailure::BadResponse)),
            (500, false, err("boom"), Some(LegFailure::Http5xx)),
            (
                503,
                false,
                "upstream connect error or disconnect/reset before headers".into(),
                Some(LegFailure::Http5xx),
            ),
            (503, false, err("engine is shutting down"), Some(LegFailure::Http5xx)),
            (400, false, err("bad"), Some(LegFailure::Http4xx)),
            (503, true, err("engine is shutting down"), None),
            (503, false, err("waiting queue is full"), None),
        ];
        for (status, retry_after, body, want) in cases {
            assert_eq!(
                fails(classify_answer(status, retry_after, body.as_bytes())),
                want,
                "{status} {body}"
            );
        }
        assert_eq!(
            classify_answer(429, false, err("slow down").as_bytes()),
            LegResult::Overloaded { status: 429, message: "slow down".into() }
        );
    }

    /// A worker that accepts connections and never answers (a slow prefill, a hung handshake).
    pub(crate) async fn silent_worker() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let hold = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = silent.accept().await {
                held.push(s);
            }
        });
        (addr, hold)
    }

    #[tokio::test]
    async fn transport_failures_are_classified() {
        let client = reqwest::Client::new();
        // A port nobody listens on: bind one, learn it, close it.
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let r = run(
            &client,
            LegKind::Prefill,
            &format!("127.0.0.1:{port}"),
            "/v1/completions",
            "r1",
            b"{}",
            Duration::from_secs(2),
        )
        .await;
        assert!(matches!(r, LegResult::Failed { failure: LegFailure::Refused, .. }), "{r:?}");
        let (addr, hold) = silent_worker().await;
        let r = run(
            &client,
            LegKind::Prefill,
            &addr.to_string(),
            "/v1/completions",
            "r1",
            b"{}",
            Duration::from_millis(200),
        )
        .await;
        assert!(matches!(r, LegResult::Failed { failure: LegFailure::Timeout, .. }), "{r:?}");
        hold.abort();
    }
}
