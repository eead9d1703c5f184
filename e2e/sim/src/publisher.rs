//! The ZeroMQ KV-event publisher: vLLM's `ZmqEventPublisher`, with libzmq sockets on their own
//! threads.
//!
//! The engine-side [`ZmqSink`] encodes each batch, gives it the next sequence number (from 0),
//! stores it in the replay ring (the last `buffer_steps` batches) and hands it to the PUB thread
//! through a bounded queue. Numbering and buffering happen before anything can be dropped, so
//! every loss on the PUB path — a full queue, the `drop_seqs` fault, the PUB high-water mark —
//! shows up to a subscriber as a sequence gap that replay repairs. Only the `pause_events`
//! fault loses events for good (they are never numbered), which is its purpose.
//!
//! Sockets always bind (a `*` port picks a free one); the bound endpoints are reported so the
//! READY line can print them. The replay ROUTER answers `[id, "", start_seq]` (or `[id,
//! start_seq]`) with every buffered batch from `start_seq` (from the oldest kept, if older), then
//! the end marker (`seq = -1`, empty payload), framed per [`ReplayFraming`].
//!
//! Like vLLM's (`vllm/distributed/kv_events.py`: a plain `zmq.ROUTER`, no options set, the whole
//! replay sent in one loop), the replay ROUTER has libzmq's default send high-water mark of 1,000
//! messages ([`REPLAY_SNDHWM`], set explicitly so the two cannot drift) and no
//! `ZMQ_ROUTER_MANDATORY`: a reply its queue to the requester cannot take is dropped without an
//! error — replayed batches and the end marker alike — so a replay longer than the queue can hold
//! arrives with holes or unterminated, as from a real engine (the indexer asks again).

use std::collections::VecDeque;
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;

use crate::events::{EventBatch, EventSink};
use crate::faults::FaultState;
use crate::metrics::Metrics;
use crate::wire::{encode_batch, Layout, ReplayFraming, END_SEQ};

/// The replay ROUTER's send high-water mark: libzmq's default, which vLLM's replay socket keeps.
pub const REPLAY_SNDHWM: i32 = 1_000;

/// Publisher settings (from the CLI).
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// PUB endpoint to bind, e.g. `tcp://127.0.0.1:*`.
    pub endpoint: String,
    /// ROUTER replay endpoint to bind, if any.
    pub replay_endpoint: Option<String>,
    /// Topic frame.
    pub topic: String,
    /// Event encoding.
    pub layout: Layout,
    /// Replay reply framing (resolved against the layout).
    pub framing: ReplayFraming,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// PUB send high-water mark (messages).
    pub hwm: i32,
    /// PUB kernel send buffer, bytes (`ZMQ_SNDBUF`; 0 = the OS default).
    pub sndbuf: i32,
    /// Batches queued between the engine and the PUB thread.
    pub queue: usize,
    /// The batch's `data_parallel_rank`.
    pub dp_rank: u32,
}

/// Where the sockets ended up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoundEndpoints {
    /// PUB, e.g. `tcp://127.0.0.1:40123`.
    pub pub_endpoint: String,
    /// ROUTER, if enabled.
    pub replay_endpoint: Option<String>,
}

/// Binding failed.
#[derive(Debug, thiserror::Error)]
pub enum PublisherError {
    /// A socket could not be created, configured or bound.
    #[error("zmq {what} {endpoint}: {source}")]
    Zmq {
        /// Which step.
        what: &'static str,
        /// The endpoint.
        endpoint: String,
        /// libzmq's error.
        source: zmq::Error,
    },
    /// A thread could not be spawned.
    #[error("spawning the {0} thread: {1}")]
    Thread(&'static str, std::io::Error),
}

/// The last `cap` published batches, by sequence number (consecutive).
#[derive(Debug)]
pub struct ReplayRing {
    cap: usize,
    batches: VecDeque<(u64, Bytes)>,
}

impl ReplayRing {
    /// An empty ring keeping `cap` batches.
    pub fn new(cap: usize) -> Self {
        Self { cap: cap.max(1), batches: VecDeque::with_capacity(cap.clamp(1, 1 << 16)) }
    }

    /// Appends a batch, dropping the oldest beyond capacity.
    pub fn push(&mut self, seq: u64, payload: Bytes) {
        if self.batches.len() == self.cap {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// Every kept batch with `seq >= start` (from the oldest kept if `start` is older).
    pub fn from(&self, start: u64) -> Vec<(u64, Bytes)> {
        let Some(&(first, _)) = self.batches.front() else {
            return Vec::new();
        };
        let skip = usize::try_from(start.saturating_sub(first)).unwrap_or(usize::MAX);
        self.batches.iter().skip(skip).cloned().collect()
    }
}

/// The engine-side end: numbers, buffers and queues batches. Never blocks.
pub struct ZmqSink {
    layout: Layout,
    dp_rank: u32,
    next_seq: u64,
    ring: Arc<Mutex<ReplayRing>>,
    tx: SyncSender<(u64, Bytes)>,
    faults: Arc<FaultState>,
    metrics: Arc<Metrics>,
}

impl EventSink for ZmqSink {
    fn publish(&mut self, batch: EventBatch) {
        let (paused, drop) = self.faults.events_view();
        if paused {
            self.metrics.event_batches.inc("paused");
            return;
        }
        let payload = match encode_batch(&batch, self.dp_rank, self.layout) {
            Ok(p) => Bytes::from(p),
            Err(e) => {
                tracing::error!(error = %e, "cannot encode a KV event batch");
                self.metrics.event_batches.inc("encode_error");
                return;
            }
        };
        let seq = self.next_seq;
        self.next_seq += 1;
        self.ring.lock().push(seq, payload.clone());
        if drop.is_some_and(|r| r.contains(seq)) {
            tracing::info!(seq, "fault: KV event batch kept for replay but not published");
            self.metrics.event_batches.inc("dropped_fault");
            return;
        }
        match self.tx.try_send((seq, payload)) {
            Ok(()) => self.metrics.event_batches.inc("published"),
            Err(TrySendError::Full(_)) => {
                tracing::warn!(seq, "KV event queue full: batch left to replay");
                self.metrics.event_batches.inc("dropped_queue_full");
            }
            Err(TrySendError::Disconnected(_)) => {
                self.metrics.event_batches.inc("dropped_queue_full")
            }
        }
    }
}

fn zerr<'a>(
    what: &'static str,
    endpoint: &'a str,
) -> impl FnOnce(zmq::Error) -> PublisherError + 'a {
    move |source| PublisherError::Zmq { what, endpoint: endpoint.to_owned(), source }
}

/// Binds the sockets, starts the PUB and replay threads, returns the sink and where it bound.
pub fn start(
    cfg: &PublisherConfig,
    faults: Arc<FaultState>,
    metrics: Arc<Metrics>,
) -> Result<(ZmqSink, BoundEndpoints), PublisherError> {
    let ctx = zmq::Context::new();
    let publisher = ctx.socket(zmq::PUB).map_err(zerr("socket", &cfg.endpoint))?;
    publisher.set_sndhwm(cfg.hwm).map_err(zerr("sndhwm", &cfg.endpoint))?;
    if cfg.sndbuf > 0 {
        publisher.set_sndbuf(cfg.sndbuf).map_err(zerr("sndbuf", &cfg.endpoint))?;
    }
    publisher.set_linger(0).map_err(zerr("linger", &cfg.endpoint))?;
    publisher.bind(&cfg.endpoint).map_err(zerr("bind", &cfg.endpoint))?;
    let pub_endpoint = last_endpoint(&publisher).unwrap_or_else(|| cfg.endpoint.clone());

    let ring = Arc::new(Mutex::new(ReplayRing::new(cfg.buffer_steps)));
    let mut replay_endpoint = None;
    if let Some(ep) = &cfg.replay_endpoint {
        let router = ctx.socket(zmq::ROUTER).map_err(zerr("socket", ep))?;
        router.set_linger(0).map_err(zerr("linger", ep))?;
        router.set_sndhwm(REPLAY_SNDHWM).map_err(zerr("sndhwm", ep))?;
        router.bind(ep).map_err(zerr("bind", ep))?;
        replay_endpoint = Some(last_endpoint(&router).unwrap_or_else(|| ep.clone()));
        let ring = ring.clone();
        let topic = cfg.topic.clone().into_bytes();
        let framing = cfg.framing.resolve(cfg.layout);
        let metrics = metrics.clone();
        std::thread::Builder::new()
            .name("kv-replay".into())
            .spawn(move || replay_loop(router, ring, topic, framing, metrics))
            .map_err(|e| PublisherError::Thread("replay", e))?;
    }

    let (tx, rx) = sync_channel(cfg.queue.max(1));
    let topic = cfg.topic.clone().into_bytes();
    std::thread::Builder::new()
        .name("kv-pub".into())
        .spawn(move || pub_loop(publisher, rx, topic))
        .map_err(|e| PublisherError::Thread("pub", e))?;

    let sink = ZmqSink {
        layout: cfg.layout,
        dp_rank: cfg.dp_rank,
        next_seq: 0,
        ring,
        tx,
        faults,
        metrics,
    };
    Ok((sink, BoundEndpoints { pub_endpoint, replay_endpoint }))
}

fn last_endpoint(s: &zmq::Socket) -> Option<String> {
    s.get_last_endpoint().ok()?.ok()
}

fn pub_loop(socket: zmq::Socket, rx: Receiver<(u64, Bytes)>, topic: Vec<u8>) {
    // Ends when the sink (engine) is dropped.
    for (seq, payload) in rx {
        let frames: [&[u8]; 3] = [&topic, &seq.to_be_bytes(), &payload];
        if let Err(e) = socket.send_multipart(frames, 0) {
            tracing::warn!(seq, error = %e, "KV event publish failed");
        }
    }
}

fn replay_loop(
    socket: zmq::Socket,
    ring: Arc<Mutex<ReplayRing>>,
    topic: Vec<u8>,
    framing: ReplayFraming,
    metrics: Arc<Metrics>,
) {
    loop {
        let msg = match socket.recv_multipart(0) {
            Ok(m) => m,
            Err(zmq::Error::ETERM) => return,
            Err(e) => {
                tracing::warn!(error = %e, "replay receive failed");
                continue;
            }
        };
        // [identity, "", start] from REQ/DEALER-with-delimiter, or [identity, start].
        let (identity, delimited, start) = match msg.as_slice() {
            [id, empty, start] if empty.is_empty() => (id, true, start),
            [id, start] => (id, false, start),
            _ => {
                tracing::warn!(frames = msg.len(), "malformed replay request ignored");
                continue;
            }
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()).map(u64::from_be_bytes) else {
            tracing::warn!(len = start.len(), "replay request without an 8-byte sequence ignored");
            continue;
        };
        metrics.replays.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let batches = ring.lock().from(start);
        tracing::info!(start, batches = batches.len(), "serving KV event replay");
        let send = |seq: &[u8], payload: &[u8]| -> Result<(), zmq::Error> {
            let mut frames: Vec<&[u8]> = vec![identity];
            if delimited {
                frames.push(b"");
            }
            if framing == ReplayFraming::Topic {
                frames.push(if payload.is_empty() { b"" } else { &topic });
            }
            frames.push(seq);
            frames.push(payload);
            socket.send_multipart(frames, 0)
        };
        for (seq, payload) in &batches {
            if let Err(e) = send(&seq.to_be_bytes(), payload) {
                tracing::warn!(error = %e, "replay send failed");
                break;
            }
        }
        if let Err(e) = send(&END_SEQ, b"") {
            tracing::warn!(error = %e, "replay end marker send failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_keeps_the_last_batches_and_replays_from_a_sequence() {
        let mut r = ReplayRing::new(3);
        for seq in 0..5 {
            r.push(seq, Bytes::from(vec![seq as u8]));
        }
        let seqs = |v: Vec<(u64, Bytes)>| v.into_iter().map(|(s, _)| s).collect::<Vec<_>>();
        assert_eq!(seqs(r.from(3)), [3, 4]);
        assert_eq!(seqs(r.from(0)), [2, 3, 4], "older than kept: from the oldest");
        assert!(r.from(9).is_empty());
        assert!(ReplayRing::new(2).from(0).is_empty());
    }
}
