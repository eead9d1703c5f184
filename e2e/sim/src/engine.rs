//! The engine task: the one owner of the scheduler, driven by a real clock.
//!
//! Handlers talk to it through a bounded command queue ([`EngineHandle`]); each request gets
//! its own stream of [`ReqEvent`]s back (unbounded, but bounded in practice by the request's
//! `max_tokens` ≤ `max_model_len`). The loop drains commands, calls `Scheduler::step` with the
//! time since start, publishes the step's events before delivering its tokens, mirrors the
//! counters into `/metrics`, and sleeps until the next step ends or a command arrives.
//!
//! Timer resolution is about a millisecond, far coarser than a sped-up step. A step due within
//! [`SLACK`] is completed at its *modelled* end rather than slept for, so the engine never runs
//! more than `SLACK` ahead of the model and, when it is CPU-bound, simply falls behind it.
//! NIXL pulls run as separate tasks that report back with `Command::PullDone`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::events::{EventBatch, EventSink};
use crate::metrics::Metrics;
use crate::nixl::PullClient;
use crate::pool::{CachedBlock, InUse};
use crate::sched::{
    Emit, Finished, NewRequest, PullError, ReqId, RequestError, Scheduler, StepOutput,
};

/// How early a step may be completed instead of slept for.
pub const SLACK: Duration = Duration::from_millis(1);

/// Steps completed back to back before commands (new requests, cancels) are read again, so a
/// long sped-up generation cannot starve arrivals.
const MAX_CATCH_UP_STEPS: usize = 64;

/// What a request hears from the engine. Streaming requests get `Token`… then `Last`;
/// non-streaming ones one `Done` with every token (one wake-up per request, not per token).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReqEvent {
    /// A generated token; more follow (streaming).
    Token(u32),
    /// The last generated token and the request's summary (streaming).
    Last(u32, Finished),
    /// Every generated token and the summary (non-streaming).
    Done(Vec<u32>, Finished),
    /// Finished without a further token (not produced by the current scheduler; handled anyway).
    Finished(Finished),
    /// The request failed.
    Failed(RequestError),
}

/// Engine commands.
#[derive(Debug)]
pub enum Command {
    /// Queue a request; its events go to the client (boxed: far larger than the other commands).
    Submit(Box<NewRequest>, Client),
    /// The client went away.
    Cancel(ReqId),
    /// `POST /reset_prefix_cache`.
    Reset(oneshot::Sender<Result<(), InUse>>),
    /// `GET /admin/cache`.
    Dump(oneshot::Sender<CacheDump>),
    /// A consumer pulls a hold of ours.
    ServePull {
        transfer_id: String,
        block_ids: Vec<u32>,
        reply: oneshot::Sender<Result<Vec<Vec<u32>>, PullError>>,
    },
    /// One of our pulls finished.
    PullDone { id: ReqId, result: Result<Vec<Vec<u32>>, String> },
    /// A LoRA adapter was loaded (true: it takes a GPU slot) or unloaded (false: it leaves it).
    Adapter { id: u32, loaded: bool },
}

/// Where a request's events go, and what the engine measures for it.
#[derive(Debug)]
pub struct Client {
    tx: mpsc::UnboundedSender<ReqEvent>,
    stream: bool,
    arrived: std::time::Instant,
    first_token: bool,
    tokens: Vec<u32>,
}

/// The cache as `GET /admin/cache` reports it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct CacheDump {
    /// Tokens per block.
    pub block_size: usize,
    /// Total blocks.
    pub num_gpu_blocks: usize,
    /// Blocks in the free queue (cached or not).
    pub num_free_blocks: usize,
    /// Producer holds not yet pulled.
    pub num_transfer_holds: usize,
    /// Every cached block, by chain position then hash.
    pub blocks: Vec<CachedBlock>,
    /// Ids (`lora_id`) of the LoRA adapters in a GPU slot (empty without LoRA).
    pub lora_slots: Vec<u32>,
}

/// The engine is gone (its task ended).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the engine has stopped")]
pub struct EngineGone;

/// A cloneable handle to the engine task.
#[derive(Debug, Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    next_id: Arc<AtomicU64>,
}

/// A submitted request's event stream. Dropping it before the end cancels the request.
#[derive(Debug)]
pub struct RequestStream {
    /// The engine's id for the request.
    pub id: ReqId,
    rx: mpsc::UnboundedReceiver<ReqEvent>,
    tx: mpsc::Sender<Command>,
    done: bool,
}

impl RequestStream {
    /// The next event; `None` if the engine went away.
    pub async fn next(&mut self) -> Option<ReqEvent> {
        let ev = self.rx.recv().await;
        if !matches!(ev, Some(ReqEvent::Token(_))) {
            self.done = true;
        }
        ev
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            // Best effort: if the queue is full, the engine notices the closed stream on its
            // next token for this request and cancels then.
            let _ = self.tx.try_send(Command::Cancel(self.id));
        }
    }
}

impl EngineHandle {
    /// A fresh request id (unique per process).
    pub fn next_id(&self) -> ReqId {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Queues `req` (its `id` from [`next_id`](Self::next_id)); `arrived` starts its TTFT and
    /// latency clocks.
    pub async fn submit(
        &self,
        req: NewRequest,
        stream: bool,
        arrived: std::time::Instant,
    ) -> Result<RequestStream, EngineGone> {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = req.id;
        let client = Client { tx, stream, arrived, first_token: false, tokens: Vec::new() };
        self.tx.send(Command::Submit(Box::new(req), client)).await.map_err(|_| EngineGone)?;
        Ok(RequestStream { id, rx, tx: self.tx.clone(), done: false })
    }

    /// Resets the prefix cache.
    pub async fn reset(&self) -> Result<Result<(), InUse>, EngineGone> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Reset(tx)).await.map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }

    /// A snapshot of the cache.
    pub async fn dump(&self) -> Result<CacheDump, EngineGone> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Dump(tx)).await.map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }

    /// Tells the engine an adapter was loaded (`true`) or unloaded (`false`).
    pub async fn adapter(&self, id: u32, loaded: bool) -> Result<(), EngineGone> {
        self.tx.send(Command::Adapter { id, loaded }).await.map_err(|_| EngineGone)
    }

    /// Serves a consumer's pull of one of our holds.
    pub async fn serve_pull(
        &self,
        transfer_id: String,
        block_ids: Vec<u32>,
    ) -> Result<Result<Vec<Vec<u32>>, PullError>, EngineGone> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Command::ServePull { transfer_id, block_ids, reply })
            .await
            .map_err(|_| EngineGone)?;
        rx.await.map_err(|_| EngineGone)
    }
}

/// What the driver needs besides the scheduler.
pub struct EngineParts {
    /// Event destination.
    pub sink: Box<dyn EventSink>,
    /// Mirrors of the engine's counters.
    pub metrics: Arc<Metrics>,
    /// Consumer-side pulls.
    pub pull_client: PullClient,
    /// Cost of one pulled block, microseconds (before speedup).
    pub nixl_us_per_block: f64,
    /// Bound of the command queue.
    pub queue: usize,
}

/// Spawns the engine task on the current runtime.
pub fn spawn(sched: Scheduler, parts: EngineParts) -> EngineHandle {
    let (tx, rx) = mpsc::channel(parts.queue.max(1));
    let handle = EngineHandle { tx: tx.clone(), next_id: Arc::new(AtomicU64::new(1)) };
    let driver = Driver { sched, parts, clients: HashMap::new(), tx, start: Instant::now() };
    tokio::spawn(driver.run(rx));
    handle
}

struct Driver {
    sched: Scheduler,
    parts: EngineParts,
    clients: HashMap<ReqId, Client>,
    tx: mpsc::Sender<Command>,
    start: Instant,
}

impl Driver {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>) {
        loop {
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => return,
                }
            }
            let real = self.start.elapsed();
            let mut out = StepOutput::default();
            let mut wake = self.sched.step(real, &mut out);
            // Complete steps that end within the slack at their modelled end.
            for _ in 0..MAX_CATCH_UP_STEPS {
                let Some(w) = wake.filter(|&w| w > real && w - real <= SLACK) else { break };
                self.dispatch(std::mem::take(&mut out));
                wake = self.sched.step(w, &mut out);
            }
            self.dispatch(out);
            self.mirror();
            match wake {
                // Due (or within the slack, after a capped catch-up): read commands, go on.
                Some(w) if w <= self.start.elapsed() + SLACK => tokio::task::yield_now().await,
                Some(w) => {
                    tokio::select! {
                        _ = tokio::time::sleep_until(self.start + w) => {}
                        cmd = rx.recv() => match cmd {
                            Some(cmd) => self.handle(cmd),
                            None => return,
                        },
                    }
                }
                None => match rx.recv().await {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                },
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(req, client) => {
                let id = req.id;
                match self.sched.submit_at(*req, self.start.elapsed()) {
                    Ok(()) => {
                        self.clients.insert(id, client);
                    }
                    Err(e) => {
                        let _ = client.tx.send(ReqEvent::Failed(e));
                    }
                }
            }
            Command::Cancel(id) => {
                if self.clients.remove(&id).is_some() {
                    tracing::debug!(request = id, "request cancelled");
                    self.sched.cancel(id);
                }
            }
            Command::Reset(reply) => {
                let mut out = StepOutput::default();
                let result = self.sched.reset_prefix_cache(&mut out);
                self.dispatch(out);
                let _ = reply.send(result);
            }
            Command::Dump(reply) => {
                let _ = reply.send(CacheDump {
                    block_size: self.sched.config().block_size,
                    num_gpu_blocks: self.sched.config().num_gpu_blocks as usize,
                    num_free_blocks: self.sched.num_free_blocks(),
                    num_transfer_holds: self.sched.num_holds(),
                    blocks: self.sched.dump_cache(),
                    lora_slots: self.sched.resident_adapters(),
                });
            }
            Command::ServePull { transfer_id, block_ids, reply } => {
                let _ = reply.send(self.sched.serve_pull(&transfer_id, &block_ids));
            }
            Command::PullDone { id, result } => {
                self.parts.metrics.pulls.inc(if result.is_ok() { "ok" } else { "failed" });
                if let Err(e) = &result {
                    tracing::warn!(request = id, error = %e, "NIXL pull failed");
                }
                let mut out = StepOutput::default();
                self.sched.pull_done(id, result, &mut out);
                self.dispatch(out);
            }
            Command::Adapter { id, loaded: true } => self.sched.adapter_loaded(id),
            Command::Adapter { id, loaded: false } => self.sched.adapter_unloaded(id),
        }
        self.mirror();
    }

    fn dispatch(&mut self, out: StepOutput) {
        let m = &self.parts.metrics;
        if let Some(n) = out.iteration_tokens {
            m.iteration_tokens.observe(n as f64);
        }
        for emit in &out.emits {
            if let Emit::Finished { done, .. } = emit {
                let p = done.phases;
                m.queue_time.observe(p.queued.as_secs_f64());
                m.prefill_time.observe(p.prefill.as_secs_f64());
                m.prefill_kv_computed.observe(f64::from(done.prefill_computed_tokens));
                m.decode_time.observe(p.decode.as_secs_f64());
                m.inference_time.observe(p.inference.as_secs_f64());
            }
        }
        if !out.events.is_empty() {
            let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            self.parts.sink.publish(EventBatch { ts, events: out.events });
        }
        let mut emits = out.emits.into_iter().peekable();
        while let Some(emit) = emits.next() {
            match emit {
                Emit::Token { id, token } => {
                    // A token followed by its request's end travels as one event.
                    let last = match emits.peek() {
                        Some(Emit::Finished { id: next, .. }) if *next == id => {
                            match emits.next() {
                                Some(Emit::Finished { done, .. }) => Some(done),
                                _ => None,
                            }
                        }
                        _ => None,
                    };
                    self.token(id, token, last);
                }
                Emit::Finished { id, done } => {
                    if let Some(c) = self.clients.remove(&id) {
                        self.parts.metrics.e2e.observe(c.arrived.elapsed().as_secs_f64());
                        let ev = if c.stream {
                            ReqEvent::Finished(done)
                        } else {
                            ReqEvent::Done(c.tokens, done)
                        };
                        let _ = c.tx.send(ev);
                    }
                }
                Emit::Failed { id, error } => self.finish(id, ReqEvent::Failed(error)),
                Emit::Pull { id, source, first_block, block_ids } => {
                    tracing::debug!(request = id, first_block, blocks = block_ids.len(), producer = %source.request_id, "NIXL pull");
                    let client = self.parts.pull_client.clone();
                    let tx = self.tx.clone();
                    let cost = self
                        .sched
                        .config()
                        .timing
                        .transfer(block_ids.len(), self.parts.nixl_us_per_block);
                    tokio::spawn(async move {
                        let result = client.pull(&source, &block_ids).await;
                        if result.is_ok() {
                            tokio::time::sleep(cost).await;
                        }
                        let _ = tx.send(Command::PullDone { id, result }).await;
                    });
                }
            }
        }
    }

    /// Delivers a token (streaming: now; otherwise buffered until the end).
    fn token(&mut self, id: ReqId, token: u32, last: Option<Finished>) {
        let Some(c) = self.clients.get_mut(&id) else { return };
        if !c.first_token {
            c.first_token = true;
            self.parts.metrics.ttft.observe(c.arrived.elapsed().as_secs_f64());
        }
        if let Some(done) = last {
            if let Some(c) = self.clients.remove(&id) {
                self.parts.metrics.e2e.observe(c.arrived.elapsed().as_secs_f64());
                let ev = if c.stream {
                    ReqEvent::Last(token, done)
                } else {
                    let mut tokens = c.tokens;
                    tokens.push(token);
                    ReqEvent::Done(tokens, done)
                };
                let _ = c.tx.send(ev);
            }
            return;
        }
        let gone = if c.stream {
            c.tx.send(ReqEvent::Token(token)).is_err()
        } else {
            c.tokens.push(token);
            c.tx.is_closed()
        };
        if gone {
            // The client dropped its stream: stop computing for it.
            self.clients.remove(&id);
            self.sched.cancel(id);
        }
    }

    fn finish(&mut self, id: ReqId, ev: ReqEvent) {
        if let Some(c) = self.clients.remove(&id) {
            let _ = c.tx.send(ev);
        }
    }

    fn mirror(&self) {
        let m = &self.parts.metrics;
        m.update_engine(
            self.sched.stats(),
            self.sched.num_running(),
            self.sched.num_waiting(),
            self.sched.kv_usage(),
        );
        if m.lora_enabled() {
            let (running, waiting) = self.sched.lora_adapters();
            let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
            m.set_lora_info(&running.join(","), &waiting.join(","), ts);
        }
    }
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;
