//! The synthetic fleet's KV-event sockets (thin I/O over [`super::model`]): per worker a PUB
//! socket (live batches, `[topic, seq, payload]`) and a ROUTER socket answering replays as vLLM
//! and `vllm-sim` do (the simulator's replay ring and framing: `[id, "", topic, seq, payload]`,
//! then the end marker; libzmq's default send high-water mark of 1,000, no `ROUTER_MANDATORY`, so
//! a replay its queue cannot take loses batches as a real engine's does). Batches are encoded by
//! the simulator's encoder (`kvmesh_sim::wire`, vLLM's current layout).
//!
//! A few threads drive the fleet, each owning its share of the workers' sockets (ZMQ sockets are
//! not thread-safe) and [`WorkerCache`]s, and its own ZMQ context (libzmq caps a context at 1,023
//! sockets). Commands arrive on a channel: fill each cache up to a size (flow-controlled by
//! [`Counters::allowed_batches`], which the caller raises as the indexer applies), prepare requests
//! encoded ahead and send them all at once (the throughput measurement, without the generator's
//! cost inside it), or send given batches (the route probes' stores). Between commands a thread
//! answers replays. The PUB sockets have no high-water mark (a slow subscriber makes the queue grow
//! instead of losing batches): fill's flow control and the prepared amount bound it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Context as _};
use bytes::Bytes;
use kvmesh_sim::events::EventBatch;
use kvmesh_sim::publisher::{ReplayRing, REPLAY_SNDHWM};
use kvmesh_sim::wire::{encode_batch, Layout, END_SEQ};

use super::model::{block_ops, ModelParams, WorkerCache};

/// Where one worker's sockets listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoints {
    pub events: String,
    pub replay: String,
}

/// What the fleet has done (read by the orchestrator while the threads run).
#[derive(Debug, Default)]
pub struct Counters {
    pub sent_batches: AtomicU64,
    pub sent_block_ops: AtomicU64,
    pub sent_bytes: AtomicU64,
    /// Fill sends while `sent_batches` is below this (the caller's flow control).
    pub allowed_batches: AtomicU64,
    /// Workers that reached the current fill target.
    pub filled_workers: AtomicU64,
    pub replay_requests: AtomicU64,
    pub replayed_batches: AtomicU64,
    pub replayed_bytes: AtomicU64,
}

enum Cmd {
    Fill { target: u32 },
    Prepare { requests: u32, done: Sender<(u64, u64)> },
    Blast,
    Inject { worker: u32, batches: Vec<EventBatch> },
}

/// The fleet's sockets and threads; stopped when dropped.
pub struct Fleet {
    pub endpoints: Vec<Endpoints>,
    pub counters: Arc<Counters>,
    cmds: Vec<Sender<Cmd>>,
    threads: Vec<JoinHandle<()>>,
    per_thread: usize,
}

struct Worker {
    index: u32,
    publisher: zmq::Socket,
    router: zmq::Socket,
    seq: u64,
    ring: ReplayRing,
    cache: WorkerCache,
    prepared: VecDeque<Bytes>,
    reached: bool,
}

struct Group {
    /// Their sockets (each keeps its context alive).
    workers: Vec<Worker>,
    params: ModelParams,
    counters: Arc<Counters>,
    scratch: Vec<EventBatch>,
}

fn zerr(what: &'static str) -> impl FnOnce(zmq::Error) -> anyhow::Error {
    move |e| anyhow!("zmq {what}: {e}")
}

fn bound(s: &zmq::Socket) -> anyhow::Result<String> {
    s.get_last_endpoint()
        .map_err(zerr("last endpoint"))?
        .map_err(|_| anyhow!("zmq endpoint is not UTF-8"))
}

impl Fleet {
    /// Binds `workers` workers' sockets on loopback and starts `threads` threads driving them.
    pub fn start(
        workers: u32,
        threads: usize,
        ring_batches: usize,
        params: ModelParams,
        seed: u64,
    ) -> anyhow::Result<Self> {
        let threads = threads.max(1);
        let per_thread = (workers as usize).div_ceil(threads).max(1);
        let counters = Arc::new(Counters::default());
        let mut endpoints = Vec::with_capacity(workers as usize);
        let (mut cmds, mut handles) = (Vec::new(), Vec::new());
        for (t, chunk) in (0..workers).collect::<Vec<_>>().chunks(per_thread).enumerate() {
            let ctx = zmq::Context::new();
            let mut group = Vec::with_capacity(chunk.len());
            for &index in chunk {
                let publisher = ctx.socket(zmq::PUB).map_err(zerr("PUB"))?;
                publisher.set_sndhwm(0).map_err(zerr("sndhwm"))?;
                publisher.set_linger(0).map_err(zerr("linger"))?;
                publisher.bind("tcp://127.0.0.1:*").map_err(zerr("bind PUB"))?;
                let router = ctx.socket(zmq::ROUTER).map_err(zerr("ROUTER"))?;
                router.set_sndhwm(REPLAY_SNDHWM).map_err(zerr("sndhwm"))?;
                router.set_linger(0).map_err(zerr("linger"))?;
                router.bind("tcp://127.0.0.1:*").map_err(zerr("bind ROUTER"))?;
                endpoints.push(Endpoints { events: bound(&publisher)?, replay: bound(&router)? });
                group.push(Worker {
                    index,
                    publisher,
                    router,
                    seq: 0,
                    ring: ReplayRing::new(ring_batches),
                    cache: WorkerCache::new(index, seed),
                    prepared: VecDeque::new(),
                    reached: false,
                });
            }
            let g =
                Group { workers: group, params, counters: counters.clone(), scratch: Vec::new() };
            let (tx, rx) = channel();
            let handle = std::thread::Builder::new()
                .name(format!("scale-pub-{t}"))
                .spawn(move || g.run(rx))
                .context("spawning a publisher thread")?;
            cmds.push(tx);
            handles.push(handle);
        }
        Ok(Self { endpoints, counters, cmds, threads: handles, per_thread })
    }

    /// Generates traffic until every worker holds `target` blocks (flow-controlled); progress in
    /// [`Counters::filled_workers`] (reset here).
    pub fn fill(&self, target: u32) {
        self.counters.filled_workers.store(0, Ordering::Relaxed);
        for tx in &self.cmds {
            let _ = tx.send(Cmd::Fill { target });
        }
    }

    /// Generates and encodes `requests` requests per worker without sending them; returns the
    /// batches and block-ops prepared.
    pub fn prepare(&self, requests: u32) -> anyhow::Result<(u64, u64)> {
        let (tx, rx) = channel();
        for c in &self.cmds {
            c.send(Cmd::Prepare { requests, done: tx.clone() })
                .map_err(|_| anyhow!("a publisher thread is gone"))?;
        }
        drop(tx);
        let (mut batches, mut ops) = (0, 0);
        for (b, o) in rx {
            batches += b;
            ops += o;
        }
        Ok((batches, ops))
    }

    /// Sends everything prepared, round robin over the workers, as fast as the sockets take it.
    pub fn blast(&self) {
        for tx in &self.cmds {
            let _ = tx.send(Cmd::Blast);
        }
    }

    /// Sends `batches` on `worker`'s stream, after what it sent before.
    pub fn inject(&self, worker: u32, batches: Vec<EventBatch>) -> anyhow::Result<()> {
        let t = worker as usize / self.per_thread;
        self.cmds
            .get(t)
            .ok_or_else(|| anyhow!("no worker {worker}"))?
            .send(Cmd::Inject { worker, batches })
            .map_err(|_| anyhow!("a publisher thread is gone"))
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        // The threads end when their command channel closes.
        self.cmds.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn now_s() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

fn encode(batch: &EventBatch) -> Option<Bytes> {
    match encode_batch(batch, 0, Layout::Current) {
        Ok(b) => Some(Bytes::from(b)),
        Err(e) => {
            tracing::error!(error = %e, "cannot encode a KV event batch");
            None
        }
    }
}

impl Group {
    fn run(mut self, rx: Receiver<Cmd>) {
        let mut fill: Option<u32> = None;
        let mut blasting = false;
        loop {
            loop {
                match rx.try_recv() {
                    Ok(Cmd::Fill { target }) => {
                        for w in &mut self.workers {
                            w.reached = false;
                        }
                        fill = Some(target);
                    }
                    Ok(Cmd::Prepare { requests, done }) => {
                        let _ = done.send(self.prepare(requests));
                    }
                    Ok(Cmd::Blast) => blasting = true,
                    Ok(Cmd::Inject { worker, batches }) => self.inject(worker, &batches),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            let mut busy = false;
            if let Some(target) = fill {
                let (progress, done) = self.fill_step(target);
                busy |= progress;
                if done {
                    fill = None;
                }
            }
            if blasting {
                let sent = self.blast_step();
                busy |= sent;
                blasting = sent;
            }
            self.serve_replays(if busy { 0 } else { 20 });
        }
    }

    fn send(&mut self, at: usize, payload: Bytes, ops: u64) {
        let c = &self.counters;
        let w = &mut self.workers[at];
        let seq = w.seq;
        w.seq += 1;
        w.ring.push(seq, payload.clone());
        let frames: [&[u8]; 3] = [b"", &seq.to_be_bytes(), &payload];
        if let Err(e) = w.publisher.send_multipart(frames, 0) {
            tracing::warn!(worker = w.index, seq, error = %e, "KV event publish failed");
        }
        c.sent_batches.fetch_add(1, Ordering::Relaxed);
        c.sent_block_ops.fetch_add(ops, Ordering::Relaxed);
        c.sent_bytes.fetch_add(payload.len() as u64, Ordering::Relaxed);
    }

    /// One request for every worker below `target`, while the flow control allows; (any sent,
    /// all reached).
    fn fill_step(&mut self, target: u32) -> (bool, bool) {
        let mut progress = false;
        let mut all = true;
        for at in 0..self.workers.len() {
            if self.workers[at].reached {
                continue;
            }
            all = false;
            let c = &self.counters;
            if c.sent_batches.load(Ordering::Relaxed) >= c.allowed_batches.load(Ordering::Relaxed) {
                return (progress, false);
            }
            let mut out = std::mem::take(&mut self.scratch);
            out.clear();
            self.workers[at].cache.request(&self.params, now_s(), &mut out);
            for b in &out {
                let ops = block_ops(std::slice::from_ref(b));
                if let Some(payload) = encode(b) {
                    self.send(at, payload, ops);
                }
            }
            self.scratch = out;
            progress = true;
            if self.workers[at].cache.held() >= u64::from(target) {
                self.workers[at].reached = true;
                self.counters.filled_workers.fetch_add(1, Ordering::Relaxed);
            }
        }
        (progress, all)
    }

    fn prepare(&mut self, requests: u32) -> (u64, u64) {
        let (mut batches, mut ops) = (0, 0);
        let ts = now_s();
        for w in &mut self.workers {
            let mut out = Vec::new();
            for _ in 0..requests {
                w.cache.request(&self.params, ts, &mut out);
            }
            for b in &out {
                if let Some(payload) = encode(b) {
                    batches += 1;
                    ops += block_ops(std::slice::from_ref(b));
                    w.prepared.push_back(payload);
                }
            }
        }
        (batches, ops)
    }

    /// One prepared batch per worker that has one left; whether any was sent.
    fn blast_step(&mut self) -> bool {
        let mut sent = false;
        for at in 0..self.workers.len() {
            if let Some(payload) = self.workers[at].prepared.pop_front() {
                // Block-ops of prepared batches were counted by `prepare`; bytes and batches here.
                self.send(at, payload, 0);
                sent = true;
            }
        }
        sent
    }

    fn inject(&mut self, worker: u32, batches: &[EventBatch]) {
        let Some(at) = self.workers.iter().position(|w| w.index == worker) else { return };
        for b in batches {
            if let Some(payload) = encode(b) {
                self.send(at, payload, block_ops(std::slice::from_ref(b)));
            }
        }
    }

    /// Answers the replay requests waiting (waits up to `timeout_ms` for one).
    fn serve_replays(&mut self, timeout_ms: i64) {
        let ready: Vec<usize> = {
            let mut items: Vec<zmq::PollItem<'_>> =
                self.workers.iter().map(|w| w.router.as_poll_item(zmq::POLLIN)).collect();
            if zmq::poll(&mut items, timeout_ms).is_err() {
                std::thread::sleep(Duration::from_millis(timeout_ms.max(1) as u64));
                return;
            }
            items.iter().enumerate().filter(|(_, i)| i.is_readable()).map(|(n, _)| n).collect()
        };
        for at in ready {
            while let Ok(msg) = self.workers[at].router.recv_multipart(zmq::DONTWAIT) {
                self.serve(at, &msg);
            }
        }
    }

    /// One replay request (`[id, "", start]` or `[id, start]`), answered from the ring.
    fn serve(&mut self, at: usize, msg: &[Vec<u8>]) {
        let (identity, delimited, start) = match msg {
            [id, empty, start] if empty.is_empty() => (id, true, start),
            [id, start] => (id, false, start),
            _ => return,
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
            return;
        };
        let w = &self.workers[at];
        let batches = w.ring.from(start);
        let c = &self.counters;
        c.replay_requests.fetch_add(1, Ordering::Relaxed);
        let send = |seq: &[u8], payload: &[u8]| {
            let mut frames: Vec<&[u8]> = vec![identity];
            if delimited {
                frames.push(b"");
            }
            // Topic framing (vLLM ≥ 0.26): the topic (here "") before the sequence number.
            frames.push(b"");
            frames.push(seq);
            frames.push(payload);
            w.router.send_multipart(frames, zmq::DONTWAIT)
        };
        for (seq, payload) in &batches {
            if send(&seq.to_be_bytes(), payload).is_err() {
                break;
            }
            c.replayed_batches.fetch_add(1, Ordering::Relaxed);
            c.replayed_bytes.fetch_add(payload.len() as u64, Ordering::Relaxed);
        }
        let _ = send(&END_SEQ, b"");
    }
}
