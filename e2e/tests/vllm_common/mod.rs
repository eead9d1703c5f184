//! Shared by the real-vLLM tests (`make test-vllm`): a stack over real engines, a watcher of each
//! engine's own KV-event stream (to know when the indexer has caught up), the indexer's view of a
//! worker, and a seeded generator of awkward conversations.

#![allow(dead_code)] // each test file uses a different subset

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use kvmesh_core::api::{DoneReport, Outcome, RouteDecision, DONE_PATH, ROUTE_PATH};
use kvmesh_core::headers;
use kvmesh_e2e::stack::{Stack, StackSpec};
use kvmesh_e2e::vllm::{Engines, VllmOptions};
use serde_json::{json, Value};

/// The block size every real engine runs with (vLLM's CPU attention needs a multiple of 32).
pub const BLOCK: u64 = 32;

/// Two aggregate real engines (one per core) behind the gateway, with the filter's debug headers.
pub async fn start(opts: VllmOptions) -> anyhow::Result<Stack> {
    let mut spec = StackSpec::aggregate(2);
    spec.block_size = BLOCK as u32;
    spec.engines = Engines::Vllm(opts);
    spec.filter_config = json!({"debug_headers": true});
    let started = Instant::now();
    let stack = Stack::start(spec).await?;
    eprintln!(
        "real-vLLM stack up in {:.0} s (logs in {})",
        started.elapsed().as_secs_f64(),
        stack.dir().display()
    );
    Ok(stack)
}

/// The indexer's `/debug/workers` entry of one worker, rank 0.
#[derive(Debug, Clone)]
pub struct IndexView {
    pub healthy: bool,
    pub blocks_held: u64,
    pub last_seq: Option<i64>,
    pub decode_errors: u64,
    pub gaps: u64,
    pub replays: u64,
    pub resyncs: u64,
}

/// What the indexer reports about worker `id`.
pub async fn index_view(stack: &Stack, id: &str) -> anyhow::Result<IndexView> {
    let all: Value = stack
        .client()
        .get(stack.indexer_url("/debug/workers"))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    let w = all
        .as_array()
        .and_then(|ws| ws.iter().find(|w| w["id"] == id))
        .with_context(|| format!("indexer does not list {id}: {all}"))?;
    let r = &w["ranks"][0];
    let n = |v: &Value| v.as_u64().unwrap_or(0);
    Ok(IndexView {
        healthy: w["healthy"].as_bool().unwrap_or(false),
        blocks_held: n(&r["blocks_held"]),
        last_seq: r["last_seq"].as_i64(),
        decode_errors: n(&r["decode_errors"]),
        gaps: n(&r["gaps"]),
        replays: n(&r["replays"]),
        resyncs: n(&r["resyncs"]),
    })
}

/// The index's overlap for `worker` on a request to `path` (a route call with an operator override).
pub async fn index_overlap(
    stack: &Stack,
    worker: &str,
    path: &str,
    body: &Value,
) -> anyhow::Result<u64> {
    let r = stack
        .client()
        .post(stack.indexer_url(ROUTE_PATH))
        .header(headers::KVMESH_PATH, path)
        .header(headers::OVERRIDE_WORKER, worker)
        .header("content-type", "application/json")
        .body(serde_json::to_vec(body)?)
        .send()
        .await?;
    anyhow::ensure!(
        r.status().is_success(),
        "route call failed: {}",
        r.text().await.unwrap_or_default()
    );
    let d: RouteDecision = r.json().await?;
    anyhow::ensure!(d.worker == worker, "override ignored: {d:?}");
    // Nothing is sent for this decision: release the load it booked.
    let done = DoneReport {
        request_id: "probe".into(),
        endpoint: None,
        outcome: Outcome::Aborted,
        status: None,
        booking_id: d.booking_id.clone(),
        usage: None,
    };
    stack.client().post(stack.indexer_url(DONE_PATH)).json(&done).send().await?;
    Ok(u64::from(d.overlap_blocks))
}

/// A SUB socket on one engine's PUB endpoint, on its own thread: the last sequence number the
/// engine published and when it arrived. Independent of the indexer, so a test can wait until
/// the indexer has applied everything the engine said.
pub struct EventWatch {
    last_seq: Arc<AtomicI64>,
    last_at_ms: Arc<AtomicU64>,
    batches: Arc<AtomicU64>,
    epoch: Instant,
    stop: Arc<std::sync::atomic::AtomicBool>,
}

impl EventWatch {
    pub fn start(endpoint: &str) -> anyhow::Result<Self> {
        let ctx = zmq::Context::new();
        let sub = ctx.socket(zmq::SUB)?;
        sub.set_subscribe(b"")?;
        sub.set_rcvtimeo(100)?;
        sub.connect(endpoint)?;
        let (last_seq, last_at_ms, batches) = (
            Arc::new(AtomicI64::new(-1)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let epoch = Instant::now();
        let (s, a, b, st) = (last_seq.clone(), last_at_ms.clone(), batches.clone(), stop.clone());
        std::thread::spawn(move || {
            let _ctx = ctx;
            while !st.load(Ordering::Relaxed) {
                let Ok(frames) = sub.recv_multipart(0) else { continue };
                if let Some(seq) =
                    frames.get(1).and_then(|f| <[u8; 8]>::try_from(f.as_slice()).ok())
                {
                    s.store(i64::from_be_bytes(seq), Ordering::Relaxed);
                    a.store(epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
                    b.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        Ok(Self { last_seq, last_at_ms, batches, epoch, stop })
    }

    /// The last sequence number seen (None before the first batch).
    pub fn last_seq(&self) -> Option<i64> {
        Some(self.last_seq.load(Ordering::Relaxed)).filter(|s| *s >= 0)
    }

    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::Relaxed)
    }

    /// Time since the last batch arrived (since the start when none has).
    pub fn quiet_for(&self) -> Duration {
        self.epoch
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_at_ms.load(Ordering::Relaxed)))
    }
}

impl Drop for EventWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// How long an engine's stream must be silent before the index is taken as settled: vLLM publishes
/// a step's batch from a background thread right after the step, so a response can reach the
/// client a little before its batch reaches any subscriber.
pub const QUIET: Duration = Duration::from_millis(300);

/// Waits until every watched engine has been silent for [`QUIET`] and the indexer has applied its
/// last batch (its `last_seq` equals the one the engine published last).
pub async fn settle(stack: &Stack, watches: &[(&str, &EventWatch)]) -> anyhow::Result<()> {
    kvmesh_e2e::poll::until("the indexer caught up with every engine's event stream", || async {
        for (id, w) in watches {
            if w.quiet_for() < QUIET {
                return None;
            }
            let v = index_view(stack, id).await.ok()?;
            if w.last_seq().is_some() && v.last_seq != w.last_seq() {
                return None;
            }
        }
        Some(())
    })
    .await
}

/// A small seeded generator (xorshift64*).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
    pub fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

/// Pieces of text a tokenizer and a chat template can get wrong: unicode of several scripts,
/// combining marks, emoji with joiners, runs of spaces, tabs and newlines, and the literal text of
/// the model's special tokens.
const PIECES: &[&str] = &[
    "the router",
    "caches",
    "a prefix",
    "of blocks",
    "Hello",
    "world.",
    "42",
    "3.14159",
    "x=y+1;",
    "fn main() {}",
    "naïve café",
    "日本語のテキスト",
    "中文分词测试",
    "مرحبا بالعالم",
    "Привет, мир",
    "e\u{301}",
    "🦀",
    "👩‍💻",
    "🇫🇷",
    "ß",
    "ﬁ",
    "   ",
    "\t\t",
    "\n\n\n",
    " \n ",
    "  \t \n",
    "\r\n",
    "\u{a0}",
    "\u{200b}",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>",
    "<think>",
    "</think>",
    "<|im_start|>",
];

/// Text of `min..min + spread` pieces joined by single spaces or by nothing.
pub fn awkward_text(rng: &mut Rng, min: usize, spread: u64) -> String {
    let words = min + rng.below(spread.max(1)) as usize;
    let mut s = String::new();
    for i in 0..words {
        if i > 0 && rng.below(3) > 0 {
            s.push(' ');
        }
        s.push_str(rng.pick(PIECES));
    }
    s
}

/// A conversation: an optional system prompt, then alternating user/assistant turns ending with
/// a user turn.
pub fn awkward_conversation(rng: &mut Rng) -> Vec<Value> {
    let mut msgs = Vec::new();
    if rng.below(2) == 0 {
        msgs.push(json!({"role": "system", "content": awkward_text(rng, 4, 20)}));
    }
    let turns = 1 + rng.below(4);
    for t in 0..turns {
        msgs.push(json!({"role": "user", "content": awkward_text(rng, 1, 30)}));
        if t + 1 < turns {
            msgs.push(json!({"role": "assistant", "content": awkward_text(rng, 1, 20)}));
        }
    }
    msgs
}

/// `usage` of a JSON answer as (prompt_tokens, cached_tokens).
pub fn usage(body: &Value) -> Option<(u64, u64)> {
    let u = body.get("usage")?;
    Some((
        u["prompt_tokens"].as_u64()?,
        u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64).unwrap_or(0),
    ))
}

/// The indexer's attribution counters (issue 46): (requests attributed, tokens delivered).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Attributed {
    pub requests: f64,
    pub delivered: f64,
}

/// The attribution once more than `after` requests are attributed: the filter reports the
/// engine's usage with its done report, after the response has reached the client.
pub async fn attributed_past(stack: &Stack, after: f64) -> anyhow::Result<Attributed> {
    kvmesh_e2e::poll::until(&format!("more than {after} requests attributed"), || async {
        let m = stack.scrape(&stack.indexer_url("/metrics")).await.ok()?;
        let a = Attributed {
            requests: m.sum("kvmesh_attribution_requests_total", &[("result", "attributed")]),
            delivered: m.sum("kvmesh_attribution_delivered_tokens_total", &[]),
        };
        (a.requests > after).then_some(a)
    })
    .await
}
