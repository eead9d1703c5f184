//! One ZMQ listener thread per (worker, dp rank): SUB for live batches, DEALER for replay.
//!
//! The thread owns its sockets (ZMQ sockets are not thread-safe) and only moves bytes: it frames
//! and decodes batches, asks its [`Sequencer`] what each sequence number means, replays gaps from
//! the engine's ROUTER socket (engines.md §1.3: send `["", start_be_u64]`, read `[seq, payload]` or
//! `[topic, seq, payload]` until the `0xFF×8` end marker), and sends the results to the applier in
//! order. When a replay cannot cover a gap (the engine's ring buffer no longer holds the start, the
//! replay socket is missing or times out) the worker is cleared and rebuilt from what remains, with a
//! log line and a metric: the index may then miss blocks, but never claims blocks that are gone.
//! A replay is applied only up to its first hole ([`contiguous_run`](super::sequencer::contiguous_run):
//! a ROUTER drops replies it cannot queue without telling anyone, vLLM's with libzmq's default send
//! HWM of 1,000) and, when a round has a hole or lost its end marker, asked again from the first
//! missing number ([`plan_round`], at most [`MAX_REPLAY_ROUNDS`] rounds, each counted in
//! `kvmesh_kv_replay_rounds_total`); only then does the next live batch show the rest as a gap.
//! At start it replays from 0, so blocks cached before the indexer started are known too.
//!
//! Bounded in bytes ([`EventLimits`]): every socket has `ZMQ_MAXMSGSIZE` (libzmq drops a connection
//! whose peer sends a bigger frame: live, that shows as a gap; in a replay, as a failed replay),
//! payloads are checked again before decoding (transports without the ZMQ check, a reload that
//! lowered the limit), a replay holds at most `replay_max_bytes`, and each decoded batch takes its
//! size from the queue's byte budget before it is queued. An oversized live batch cannot be applied
//! nor replayed (the replay would carry it too), so the worker is cleared and continues after it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::applier::ApplierMsg;
use super::apply::ApplyReport;
use super::budget::{self, Acquired, EventLimits};
use super::decode::decode_batch;
use super::sequencer::{plan_round, RoundNext, Sequencer, Verdict, MAX_REPLAY_ROUNDS};
use crate::index::WorkerSlot;
use crate::metrics::Metrics;

/// Where one listener reads from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerSpec {
    pub worker: String,
    pub rank: u32,
    pub slot: WorkerSlot,
    pub events_endpoint: String,
    pub replay_endpoint: Option<String>,
    /// Bind the SUB socket (the engine connects) instead of connecting.
    pub bind: bool,
    pub topic: String,
    pub replay_timeout: Duration,
}

const NONE: u64 = u64::MAX;

/// Receive high-water mark (messages) of the SUB and replay DEALER sockets. On the DEALER it is
/// what lets a whole replay buffer (vLLM keeps 10,000 batches by default) be queued here: a ROUTER
/// whose queue to us is full drops replies silently (the replay then has holes, see
/// [`plan_round`]); libzmq's default of 1,000 made most long replays lose batches.
const RCVHWM: i32 = 100_000;

/// Per (worker, rank) counters shared with the API (`/debug/workers`, `/readyz`).
#[derive(Debug)]
pub struct ListenerStats {
    pub last_seq: AtomicU64,
    pub batches: AtomicU64,
    pub gaps: AtomicU64,
    pub replays: AtomicU64,
    pub resyncs: AtomicU64,
    pub orphan_stores: AtomicU64,
    pub decode_errors: AtomicU64,
    /// Engine timestamp (f64 bits) of the last applied batch.
    pub last_ts_bits: AtomicU64,
    /// The start-up replay finished (or there is no replay socket): the index reflects the engine.
    pub synced: AtomicBool,
}

impl Default for ListenerStats {
    fn default() -> Self {
        Self {
            last_seq: AtomicU64::new(NONE),
            batches: AtomicU64::new(0),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            resyncs: AtomicU64::new(0),
            orphan_stores: AtomicU64::new(0),
            decode_errors: AtomicU64::new(0),
            last_ts_bits: AtomicU64::new(0),
            synced: AtomicBool::new(false),
        }
    }
}

impl ListenerStats {
    /// Called by the applier after applying batch `seq`.
    pub fn record_applied(&self, seq: u64, ts: f64, r: &ApplyReport) {
        self.last_seq.store(seq, Ordering::Relaxed);
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.last_ts_bits.store(ts.to_bits(), Ordering::Relaxed);
        self.orphan_stores.fetch_add(r.orphan_stores, Ordering::Relaxed);
    }
    /// The last applied sequence number.
    pub fn last_seq(&self) -> Option<u64> {
        Some(self.last_seq.load(Ordering::Relaxed)).filter(|s| *s != NONE)
    }
    /// Engine timestamp of the last applied batch.
    pub fn last_ts(&self) -> Option<f64> {
        Some(f64::from_bits(self.last_ts_bits.load(Ordering::Relaxed))).filter(|t| *t > 0.0)
    }
}

/// A running listener; stop it with [`ListenerHandle::stop`].
pub struct ListenerHandle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ListenerHandle {
    /// Asks the thread to stop and waits for it (at most one poll interval plus a replay deadline).
    pub fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts the listener thread.
pub fn spawn(
    ctx: zmq::Context,
    spec: ListenerSpec,
    tx: SyncSender<ApplierMsg>,
    stats: Arc<ListenerStats>,
    metrics: Arc<Metrics>,
    limits: Arc<EventLimits>,
) -> std::io::Result<ListenerHandle> {
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let name = format!("kv-{}-{}", spec.worker, spec.rank);
    let thread = std::thread::Builder::new().name(name).spawn(move || {
        let mut l = Listener {
            ctx,
            spec,
            tx,
            stats,
            metrics,
            limits,
            stop: flag,
            seq: Sequencer::new(),
            dealer: None,
        };
        l.run();
    })?;
    Ok(ListenerHandle { stop, thread: Some(thread) })
}

struct Listener {
    ctx: zmq::Context,
    spec: ListenerSpec,
    tx: SyncSender<ApplierMsg>,
    stats: Arc<ListenerStats>,
    metrics: Arc<Metrics>,
    limits: Arc<EventLimits>,
    stop: Arc<AtomicBool>,
    seq: Sequencer,
    dealer: Option<zmq::Socket>,
}

/// How a replay went.
enum Replay {
    /// Every batch from the requested start was delivered (and sent on).
    Complete,
    /// Not everything from the start arrived: the engine no longer holds the start (the worker was
    /// cleared if asked), or the replay had holes; the usable part was sent.
    Truncated,
    /// No replay socket, or it failed: nothing was sent.
    Failed,
}

const END_SEQ: [u8; 8] = [0xff; 8];

impl Listener {
    fn run(&mut self) {
        let sub = loop {
            if self.stopped() {
                return;
            }
            match self.open_sub() {
                Ok(s) => break s,
                Err(e) => {
                    tracing::error!(worker = %self.spec.worker, rank = self.spec.rank, endpoint = %self.spec.events_endpoint, error = %e, "cannot open KV events socket; retrying");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        };
        tracing::info!(worker = %self.spec.worker, rank = self.spec.rank, endpoint = %self.spec.events_endpoint, replay = ?self.spec.replay_endpoint, "subscribed to KV events");
        if self.spec.replay_endpoint.is_some() {
            // Learn what the engine cached before we started. Nothing to clear on truncation.
            self.replay(0, false);
        }
        self.stats.synced.store(true, Ordering::Relaxed);
        while !self.stopped() {
            match sub.poll(zmq::POLLIN, 100) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(worker = %self.spec.worker, error = %e, "poll failed");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
            let frames = match sub.recv_multipart(zmq::DONTWAIT) {
                Ok(f) => f,
                Err(zmq::Error::EAGAIN) => continue,
                Err(e) => {
                    tracing::warn!(worker = %self.spec.worker, error = %e, "receive failed");
                    continue;
                }
            };
            match split_frames(&frames) {
                Some((seq, payload)) => self.on_live(seq, payload),
                None => self.decode_error("expected [topic, seq, payload] frames"),
            }
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Relaxed)
    }

    fn open_sub(&self) -> Result<zmq::Socket, zmq::Error> {
        let sub = self.ctx.socket(zmq::SUB)?;
        sub.set_linger(0)?;
        sub.set_rcvhwm(RCVHWM)?;
        sub.set_maxmsgsize(zmq_limit(self.limits.max_frame()))?;
        sub.set_subscribe(self.spec.topic.as_bytes())?;
        if self.spec.bind {
            sub.bind(&self.spec.events_endpoint)?;
        } else {
            sub.connect(&self.spec.events_endpoint)?;
        }
        Ok(sub)
    }

    fn on_live(&mut self, n: u64, payload: &[u8]) {
        let max = self.limits.max_frame();
        if payload.len() > max {
            self.limit_hit("frame_too_large");
            tracing::warn!(worker = %self.spec.worker, rank = self.spec.rank, seq = n, bytes = payload.len(), limit = max, "KV event batch above routing.event_max_frame_bytes; not applied");
            if self.seq.on_live(n) != Verdict::Duplicate {
                // Its events are lost (a replay would carry the same batch): clear, go on after it.
                self.resync("frame_too_large");
                self.seq.skip_to(n);
            }
            return;
        }
        match self.seq.on_live(n) {
            Verdict::Apply => self.send(n, payload),
            Verdict::Duplicate => {}
            Verdict::Gap { from, to } => {
                self.stats.gaps.fetch_add(1, Ordering::Relaxed);
                self.metrics.kv_gaps.with_label_values(&[&self.spec.worker]).inc();
                tracing::warn!(worker = %self.spec.worker, rank = self.spec.rank, missing_from = from, missing_to = to, "KV event sequence gap; replaying");
                match self.replay(from, true) {
                    Replay::Complete | Replay::Truncated => {}
                    Replay::Failed => self.resync("gap_unrecoverable"),
                }
                self.after_recovery(n, payload);
            }
            Verdict::Restart { seq } => {
                tracing::warn!(worker = %self.spec.worker, rank = self.spec.rank, seq, "KV event sequence went backwards: engine restarted");
                self.resync("engine_restart");
                self.seq = Sequencer::new();
                if seq > 0 && self.spec.replay_endpoint.is_some() {
                    self.replay(0, false);
                }
                self.after_recovery(n, payload);
            }
        }
    }

    /// The live batch that revealed a gap, once recovery is done: apply it unless a replay did.
    fn after_recovery(&mut self, n: u64, payload: &[u8]) {
        match self.seq.on_live(n) {
            Verdict::Apply => self.send(n, payload),
            Verdict::Duplicate => {}
            Verdict::Gap { .. } | Verdict::Restart { .. } => {
                // Recovery fell short of this batch: what is missing is lost; continue from here.
                self.resync("gap_unrecoverable");
                self.seq.skip_to(n);
                self.send(n, payload);
            }
        }
    }

    fn resync(&mut self, reason: &'static str) {
        self.stats.resyncs.fetch_add(1, Ordering::Relaxed);
        self.metrics.kv_resyncs.with_label_values(&[&self.spec.worker, reason]).inc();
        tracing::warn!(worker = %self.spec.worker, rank = self.spec.rank, reason, "clearing the worker's index state; it rebuilds from new events");
        let _ = self.tx.send(ApplierMsg::Clear { slot: self.spec.slot, reason });
    }

    fn send(&mut self, n: u64, payload: &[u8]) {
        match decode_batch(payload) {
            Ok(batch) => {
                let permit = match budget::acquire(&self.limits, batch.heap_bytes(), &self.stop) {
                    Acquired::Now(p) => p,
                    Acquired::AfterWait(p) => {
                        self.limit_hit("queue_bytes_full");
                        tracing::debug!(worker = %self.spec.worker, rank = self.spec.rank, bytes = p.bytes(), "waited for routing.event_queue_bytes");
                        p
                    }
                    Acquired::Stopped => return,
                };
                let msg = ApplierMsg::Batch { slot: self.spec.slot, seq: n, batch };
                let _ = self.tx.send(ApplierMsg::Permitted { permit, msg: Box::new(msg) });
            }
            Err(e) => self.decode_error(&e.to_string()),
        }
    }

    fn limit_hit(&self, reason: &'static str) {
        self.metrics.kv_event_limits.with_label_values(&[&self.spec.worker, reason]).inc();
    }

    fn decode_error(&self, why: &str) {
        self.stats.decode_errors.fetch_add(1, Ordering::Relaxed);
        self.metrics.kv_decode_errors.with_label_values(&[&self.spec.worker]).inc();
        tracing::warn!(worker = %self.spec.worker, rank = self.spec.rank, error = why, "undecodable KV event message skipped");
    }

    /// Replays from `from`; sends what arrives. `clear_on_truncation`: the worker's state predates
    /// the replayed window, so a truncated replay must clear it first. A round with a hole or
    /// without its end marker (the engine's ROUTER dropped replies) is asked again from the first
    /// missing number, at most [`MAX_REPLAY_ROUNDS`] rounds ([`plan_round`]).
    fn replay(&mut self, from: u64, clear_on_truncation: bool) -> Replay {
        let w = self.spec.worker.clone();
        let rank = self.spec.rank;
        let mut ask = from;
        let mut reached_back = true;
        let mut sent = 0usize;
        for round in 0..MAX_REPLAY_ROUNDS {
            let (mut batches, ended) = match self.fetch_replay(ask) {
                Err(e) => {
                    tracing::warn!(worker = %w, rank, from, ask, round, error = %e, "replay failed");
                    self.dealer = None; // stale replies must not leak into the next replay
                    self.metrics.kv_replays.with_label_values(&[&w, "failed"]).inc();
                    // Nothing of this round was sent; earlier rounds' batches were.
                    return if round == 0 { Replay::Failed } else { Replay::Truncated };
                }
                Ok(r) => r,
            };
            if !ended {
                self.dealer = None; // replies of this round may still be on their way
            }
            if round == 0 {
                self.stats.replays.fetch_add(1, Ordering::Relaxed);
            }
            batches.retain(|(n, _)| *n >= ask);
            if round == 0 {
                let first = batches.first().map(|b| b.0);
                let reaches = first == Some(from)
                    || (batches.is_empty()
                        && ended
                        && from == self.seq.next()
                        && !clear_on_truncation);
                if !reaches {
                    reached_back = false;
                    if clear_on_truncation {
                        tracing::warn!(worker = %w, rank, asked = from, got = ?first, "replay does not reach back to the gap");
                        self.resync("gap_unrecoverable");
                    } else {
                        // A first replay (start-up, join, engine restart): nothing to lose, the
                        // engine's ring just holds only its last `buffer_steps` batches.
                        tracing::info!(worker = %w, rank, asked = from, got = ?first, "the engine's replay ring starts after the asked batch: blocks it stored before are learnt only when stored again");
                    }
                    // The rest of the replay is judged from where the engine's ring starts.
                    ask = first.unwrap_or(from);
                }
            }
            let seqs: Vec<u64> = batches.iter().map(|(n, _)| *n).collect();
            let plan = plan_round(ask, &seqs, ended, round, MAX_REPLAY_ROUNDS);
            let mut last = None;
            for (n, payload) in &batches[..plan.apply] {
                self.send(*n, payload);
                last = Some(*n);
            }
            sent += plan.apply;
            self.seq.replayed(last);
            match plan.next {
                RoundNext::Done => {
                    let outcome = if reached_back { "complete" } else { "truncated" };
                    self.metrics.kv_replays.with_label_values(&[&w, outcome]).inc();
                    tracing::info!(worker = %w, rank, from, batches = sent, rounds = round + 1, complete = reached_back, "replay done");
                    return if reached_back { Replay::Complete } else { Replay::Truncated };
                }
                RoundNext::AskAgain { from: again } => {
                    let holes = plan.apply < seqs.len();
                    let reason = if holes { "holes" } else { "no_end_marker" };
                    self.metrics.kv_replay_rounds.with_label_values(&[&w, reason]).inc();
                    if holes {
                        tracing::warn!(
                            worker = %w,
                            rank,
                            from,
                            round,
                            received = seqs.len(),
                            applied = plan.apply,
                            ended,
                            ask_again = again,
                            reason,
                            "replay incomplete (the engine's replay socket dropped replies): asking again from the first missing batch"
                        );
                    } else {
                        // Every batch that came is applied; only the end marker is missing (the
                        // engine's ROUTER drops what its send queue, 1,000 by default, cannot
                        // hold: a full ring of 1,000 loses just the marker) or it came late.
                        tracing::info!(
                            worker = %w,
                            rank,
                            from,
                            round,
                            received = seqs.len(),
                            ask_again = again,
                            reason,
                            "replay round ended without the end marker, no batch missing: asking again from the next batch"
                        );
                    }
                    ask = again;
                }
                RoundNext::GiveUp => break,
            }
        }
        self.metrics.kv_replays.with_label_values(&[&w, "truncated"]).inc();
        tracing::warn!(worker = %w, rank, from, batches = sent, through = ?self.seq.last(), "replay still incomplete; the next live batch shows the rest as a gap");
        Replay::Truncated
    }

    /// One replay request from `from`: the batches that arrived and whether the end marker did.
    /// A deadline with nothing received is an error (the engine does not answer); with some
    /// batches received, it is a round without its end marker.
    fn fetch_replay(&mut self, from: u64) -> Result<(Vec<Numbered>, bool), String> {
        let Some(endpoint) = self.spec.replay_endpoint.clone() else {
            return Err("no replay endpoint".into());
        };
        if self.dealer.is_none() {
            let d = self.ctx.socket(zmq::DEALER).map_err(|e| e.to_string())?;
            d.set_linger(0).map_err(|e| e.to_string())?;
            d.set_rcvhwm(RCVHWM).map_err(|e| e.to_string())?;
            d.set_maxmsgsize(zmq_limit(self.limits.max_frame())).map_err(|e| e.to_string())?;
            d.connect(&endpoint).map_err(|e| e.to_string())?;
            self.dealer = Some(d);
        }
        let Some(dealer) = self.dealer.as_ref() else {
            return Err("no replay socket".into());
        };
        let start = from.to_be_bytes();
        dealer.send_multipart([&b""[..], &start[..]], 0).map_err(|e| e.to_string())?;
        let deadline = crate::clock::now() + self.spec.replay_timeout;
        let mut out = Vec::new();
        let (max_frame, max_bytes) = (self.limits.max_frame(), self.limits.replay_max());
        let mut held = 0usize;
        loop {
            let left = deadline.saturating_duration_since(crate::clock::now());
            if left.is_zero() {
                if out.is_empty() {
                    return Err(format!("no reply within {:?}", self.spec.replay_timeout));
                }
                return Ok((out, false));
            }
            // Once replies flow, a pause of REPLAY_IDLE ends the round: the engine sends a replay
            // in one burst, so its end marker was dropped (asking again is always safe).
            let wait = if out.is_empty() { left } else { left.min(REPLAY_IDLE) };
            let ready = dealer
                .poll(zmq::POLLIN, wait.as_millis().clamp(1, i64::MAX as u128) as i64)
                .map_err(|e| e.to_string())?;
            if ready == 0 {
                if !out.is_empty() && wait == REPLAY_IDLE {
                    return Ok((out, false));
                }
                continue;
            }
            let frames = dealer.recv_multipart(0).map_err(|e| e.to_string())?;
            let Some((seq, payload)) = replay_frames(&frames)? else {
                return Ok((out, true));
            };
            if payload.len() > max_frame {
                self.limit_hit("replay_frame_too_large");
                return Err(format!(
                    "replayed batch of {} bytes above routing.event_max_frame_bytes {max_frame}",
                    payload.len()
                ));
            }
            held += payload.len();
            if held > max_bytes {
                self.limit_hit("replay_too_large");
                return Err(format!("replay above routing.replay_max_bytes {max_bytes}"));
            }
            out.push((seq, payload.to_vec()));
            if out.len() > MAX_REPLAY_BATCHES {
                self.limit_hit("replay_too_large");
                return Err(format!("replay longer than {MAX_REPLAY_BATCHES} batches"));
            }
        }
    }
}

/// How long a replay round waits for the next reply once replies flow (the deadline still
/// bounds the round): beyond it the round ended without its end marker.
const REPLAY_IDLE: Duration = Duration::from_millis(250);

/// A replayed batch: its sequence number and payload.
type Numbered = (u64, Vec<u8>);

/// Most batches one replay may hold (besides `replay_max_bytes`).
const MAX_REPLAY_BATCHES: usize = 1_000_000;

/// A byte limit as `ZMQ_MAXMSGSIZE` (i64; -1 would mean none, so huge values saturate).
fn zmq_limit(bytes: usize) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

/// One replay reply → `(seq, payload)`, or None for the end marker. A ROUTER reply to a DEALER
/// starts with an empty delimiter (dropped); then `[seq, payload]`, `[topic, seq, payload]` or the
/// end marker `[0xFF×8]` (with or without a payload frame).
pub fn replay_frames(frames: &[Vec<u8>]) -> Result<Option<(u64, &[u8])>, String> {
    let frames: Vec<&[u8]> =
        frames.iter().map(Vec::as_slice).skip_while(|f| f.is_empty()).collect();
    let (seq_bytes, payload) = match frames.as_slice() {
        [seq, payload] => (*seq, *payload),
        [_topic, seq, payload] => (*seq, *payload),
        [seq] => (*seq, &b""[..]),
        _ => return Err(format!("unexpected replay frame count {}", frames.len())),
    };
    if seq_bytes == END_SEQ {
        return Ok(None);
    }
    let seq: [u8; 8] =
        seq_bytes.try_into().map_err(|_| "replay sequence is not 8 bytes".to_owned())?;
    Ok(Some((u64::from_be_bytes(seq), payload)))
}

/// `[topic, seq, payload]` (or `[seq, payload]`) → (seq, payload).
pub fn split_frames(frames: &[Vec<u8>]) -> Option<(u64, &[u8])> {
    let (seq, payload) = match frames {
        [_topic, seq, payload] => (seq, payload),
        [seq, payload] => (seq, payload),
        _ => return None,
    };
    let seq: [u8; 8] = seq.as_slice().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{sync_channel, Receiver};

    /// `[ts, [["AllBlocksCleared"] × n]]`: a valid batch of about 2 + 18 n bytes.
    fn batch(n: usize) -> Vec<u8> {
        let mut b = vec![0x92, 0x01];
        b.push(0xdc);
        b.extend((n as u16).to_be_bytes());
        for _ in 0..n {
            b.push(0x91);
            b.push(0xb0);
            b.extend(b"AllBlocksCleared");
        }
        b
    }

    struct Rig {
        pubsock: zmq::Socket,
        rx: Receiver<ApplierMsg>,
        metrics: Arc<Metrics>,
        limits: Arc<EventLimits>,
        handle: Option<ListenerHandle>,
    }

    impl Rig {
        /// A listener on an inproc PUB (no ZMQ-level size check there: the check before decoding acts).
        fn new(name: &str, max_frame: usize, queue_bytes: usize) -> Self {
            let ctx = zmq::Context::new();
            let pubsock = ctx.socket(zmq::PUB).unwrap();
            let endpoint = format!("inproc://{name}");
            pubsock.bind(&endpoint).unwrap();
            let (tx, rx) = sync_channel(16);
            let metrics = Arc::new(Metrics::new().unwrap());
            let limits = Arc::new(EventLimits::new(max_frame, max_frame, queue_bytes));
            let spec = ListenerSpec {
                worker: "w".into(),
                rank: 0,
                slot: 0,
                events_endpoint: endpoint,
                replay_endpoint: None,
                bind: false,
                topic: String::new(),
                replay_timeout: Duration::from_millis(100),
            };
            let handle = spawn(
                ctx,
                spec,
                tx,
                Arc::new(ListenerStats::default()),
                metrics.clone(),
                limits.clone(),
            )
            .unwrap();
            Self { pubsock, rx, metrics, limits, handle: Some(handle) }
        }

        fn publish(&self, seq: u64, payload: &[u8]) {
            self.pubsock.send_multipart([&b"t"[..], &seq.to_be_bytes()[..], payload], 0).unwrap();
        }

        /// Publishes batch 0 until the subscription is up and it arrives (the slow-joiner race).
        fn join(&self) {
            for _ in 0..500 {
                self.publish(0, &batch(1));
                if let Ok(m) = self.rx.recv_timeout(Duration::from_millis(20)) {
                    if matches!(unwrap_batch(m), Some((0, _))) {
                        return;
                    }
                }
            }
            panic!("the listener never received batch 0");
        }

        /// The next message that is not a copy of batch 0 or its restart-clear (from `join`).
        fn next(&self) -> ApplierMsg {
            loop {
                let m = self.rx.recv_timeout(Duration::from_secs(10)).expect("a message");
                match &m {
                    ApplierMsg::Clear { reason: "engine_restart", .. } => {}
                    ApplierMsg::Permitted { msg, .. }
                        if matches!(**msg, ApplierMsg::Batch { seq: 0, .. }) => {}
                    _ => return m,
                }
            }
        }

        fn limit_hits(&self, reason: &str) -> u64 {
            self.metrics.kv_event_limits.with_label_values(&["w", reason]).get()
        }
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            if let Some(h) = self.handle.take() {
                // A listener waiting for budget wakes on stop; one blocked on a full channel on recv.
                while self.rx.try_recv().is_ok() {}
                h.stop();
            }
        }
    }

    fn unwrap_batch(m: ApplierMsg) -> Option<(u64, usize)> {
        match m {
            ApplierMsg::Permitted { permit, msg } => match *msg {
                ApplierMsg::Batch { seq, .. } => Some((seq, permit.bytes())),
                _ => None,
            },
            _ => None,
        }
    }

    /// A replay server thread; joining it gives the start numbers it was asked for.
    type ReplayServer = std::thread::JoinHandle<Vec<u64>>;

    /// A ROUTER on inproc answering successive replay requests, the i-th with the numbered batches
    /// of `answers[i]` then, if its flag says so, the end marker (else it was "dropped"). Returns
    /// the requested start numbers (it stops waiting for a request after 10 s).
    fn replay_answers(
        ctx: &zmq::Context,
        endpoint: &str,
        answers: Vec<(Vec<Numbered>, bool)>,
    ) -> ReplayServer {
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.set_rcvtimeo(10_000).unwrap();
        router.bind(endpoint).unwrap();
        std::thread::spawn(move || {
            let mut starts = Vec::new();
            for (batches, end) in answers {
                let Ok(request) = router.recv_multipart(0) else {
                    break;
                };
                let id = request[0].clone();
                starts.push(
                    request
                        .last()
                        .and_then(|s| <[u8; 8]>::try_from(s.as_slice()).ok())
                        .map_or(u64::MAX, u64::from_be_bytes),
                );
                for (seq, b) in &batches {
                    router
                        .send_multipart([&id[..], &b""[..], &seq.to_be_bytes()[..], &b[..]], 0)
                        .unwrap();
                }
                if end {
                    router.send_multipart([&id[..], &b""[..], &END_SEQ[..], &b""[..]], 0).unwrap();
                }
            }
            starts
        })
    }

    /// A listener whose replay socket answers with [`replay_answers`], and its live PUB socket.
    struct ReplayRig {
        pubsock: zmq::Socket,
        metrics: Arc<Metrics>,
        stats: Arc<ListenerStats>,
        rx: Receiver<ApplierMsg>,
        handle: ListenerHandle,
        server: ReplayServer,
    }

    impl ReplayRig {
        fn new(
            name: &str,
            limits: EventLimits,
            answers: Vec<(Vec<Numbered>, bool)>,
            replay_timeout: Duration,
        ) -> Self {
            let ctx = zmq::Context::new();
            let pubsock = ctx.socket(zmq::PUB).unwrap();
            pubsock.bind(&format!("inproc://{name}")).unwrap();
            let server = replay_answers(&ctx, &format!("inproc://{name}-replay"), answers);
            let (tx, rx) = sync_channel(64);
            let metrics = Arc::new(Metrics::new().unwrap());
            let stats = Arc::new(ListenerStats::default());
            let spec = ListenerSpec {
                worker: "w".into(),
                rank: 0,
                slot: 0,
                events_endpoint: format!("inproc://{name}"),
                replay_endpoint: Some(format!("inproc://{name}-replay")),
                bind: false,
                topic: String::new(),
                replay_timeout,
            };
            let handle =
                spawn(ctx, spec, tx, stats.clone(), metrics.clone(), Arc::new(limits)).unwrap();
            Self { pubsock, metrics, stats, rx, handle, server }
        }

        /// Waits for the start-up replay; the batch numbers it sent on.
        fn synced(&self) -> Vec<u64> {
            while !self.stats.synced.load(Ordering::Relaxed) {
                std::thread::yield_now();
            }
            self.rx.try_iter().filter_map(unwrap_batch).map(|b| b.0).collect()
        }
    }

    fn replay_rig(
        name: &str,
        limits: EventLimits,
        batches: Vec<Vec<u8>>,
    ) -> (Arc<Metrics>, Arc<ListenerStats>, Receiver<ApplierMsg>, ListenerHandle, ReplayServer)
    {
        let numbered = batches.into_iter().enumerate().map(|(i, b)| (i as u64, b)).collect();
        let r = ReplayRig::new(name, limits, vec![(numbered, true)], Duration::from_secs(10));
        std::mem::forget(r.pubsock); // lives as long as the context the listener holds
        (r.metrics, r.stats, r.rx, r.handle, r.server)
    }

    #[test]
    fn a_replay_within_its_byte_bound_is_applied() {
        let (metrics, stats, rx, handle, server) = replay_rig(
            "replay-ok",
            EventLimits::new(1000, 1000, 1 << 20),
            vec![batch(2), batch(2), batch(2)],
        );
        while !stats.synced.load(Ordering::Relaxed) {
            std::thread::yield_now();
        }
        let seqs: Vec<u64> = rx.try_iter().filter_map(unwrap_batch).map(|b| b.0).collect();
        assert_eq!(seqs, vec![0, 1, 2]);
        assert_eq!(metrics.kv_replays.with_label_values(&["w", "complete"]).get(), 1);
        handle.stop();
        server.join().unwrap();
    }

    #[test]
    fn a_replay_with_a_hole_or_without_its_end_marker_is_asked_again_from_the_first_missing_batch()
    {
        // The soak (issue 15.3): a ROUTER drops replies its queue to us cannot take — batches and
        // the end marker alike (vLLM's keeps libzmq's default send HWM). Applying past a hole lost
        // the hole's removals for good; a lost end marker failed the replay and cleared the worker.
        // Here the start-up replay arrives as 0, 2 + end (1 dropped), the re-ask from 1 as 1, 2
        // without its end marker, the re-ask from 3 as 3 + end.
        let answers = vec![
            (vec![(0, batch(1)), (2, batch(1))], true),
            (vec![(1, batch(1)), (2, batch(1))], false),
            (vec![(3, batch(1))], true),
        ];
        let limits = EventLimits::new(1000, 1 << 20, 1 << 20);
        let rig = ReplayRig::new("replay-hole", limits, answers, Duration::from_millis(300));
        let seqs = rig.synced();
        assert_eq!(
            seqs,
            vec![0, 1, 2, 3],
            "every batch applied once, in order, nothing past a hole"
        );
        let m = &rig.metrics;
        let counts = [
            (&m.kv_replays, "complete", 1), // one replay, whole in the end
            (&m.kv_replays, "truncated", 0),
            (&m.kv_replay_rounds, "holes", 1),
            (&m.kv_replay_rounds, "no_end_marker", 1),
            (&m.kv_resyncs, "gap_unrecoverable", 0), // the worker is not cleared
        ];
        for (counter, label, want) in counts {
            assert_eq!(counter.with_label_values(&["w", label]).get(), want, "{label}");
        }
        // The next live batch (4; published until the subscription is up) is applied in order.
        let mut live = Vec::new();
        for _ in 0..500 {
            rig.pubsock
                .send_multipart([&b"t"[..], &4u64.to_be_bytes()[..], &batch(1)[..]], 0)
                .unwrap();
            if let Ok(m) = rig.rx.recv_timeout(Duration::from_millis(20)) {
                live.extend(unwrap_batch(m).map(|b| b.0));
                break;
            }
        }
        assert_eq!(live, vec![4]);
        rig.handle.stop();
        assert_eq!(
            rig.server.join().unwrap(),
            vec![0, 1, 3],
            "replayed from 0, then from each first missing batch"
        );
    }

    #[test]
    fn a_replay_above_replay_max_bytes_fails_and_applies_nothing() {
        // Three batches of ~38 bytes against a 100-byte replay bound.
        let (metrics, stats, rx, handle, server) = replay_rig(
            "replay-big",
            EventLimits::new(100, 100, 1 << 20),
            vec![batch(2), batch(2), batch(2)],
        );
        while !stats.synced.load(Ordering::Relaxed) {
            std::thread::yield_now();
        }
        assert_eq!(
            rx.try_iter().filter_map(unwrap_batch).count(),
            0,
            "nothing of a refused replay is applied"
        );
        assert_eq!(metrics.kv_event_limits.with_label_values(&["w", "replay_too_large"]).get(), 1);
        assert_eq!(metrics.kv_replays.with_label_values(&["w", "failed"]).get(), 1);
        handle.stop();
        server.join().unwrap();
    }

    #[test]
    fn a_replayed_frame_above_the_frame_bound_fails_the_replay() {
        let (metrics, stats, rx, handle, server) = replay_rig(
            "replay-frame",
            EventLimits::new(100, 10_000, 1 << 20),
            vec![batch(2), batch(20)],
        );
        while !stats.synced.load(Ordering::Relaxed) {
            std::thread::yield_now();
        }
        assert_eq!(rx.try_iter().filter_map(unwrap_batch).count(), 0);
        assert_eq!(
            metrics.kv_event_limits.with_label_values(&["w", "replay_frame_too_large"]).get(),
            1
        );
        handle.stop();
        server.join().unwrap();
    }

    #[test]
    fn an_oversized_live_frame_resyncs_the_worker_and_the_stream_goes_on() {
        let rig = Rig::new("oversized", 200, 1 << 20);
        rig.join();
        rig.publish(1, &batch(20)); // ~360 bytes > 200
        rig.publish(2, &batch(2));
        match rig.next() {
            ApplierMsg::Clear { reason, .. } => assert_eq!(reason, "frame_too_large"),
            _ => panic!("expected a clear"),
        }
        assert_eq!(
            unwrap_batch(rig.next()).map(|b| b.0),
            Some(2),
            "the batch after the oversized one applies"
        );
        assert_eq!(rig.limit_hits("frame_too_large"), 1);
        assert_eq!(rig.metrics.kv_resyncs.with_label_values(&["w", "frame_too_large"]).get(), 1);
    }

    #[test]
    fn a_full_byte_budget_holds_the_listener_until_the_applier_drops_a_batch() {
        // Budget of 1 byte: each batch is admitted only alone.
        let rig = Rig::new("budget", 1 << 20, 1);
        rig.join();
        rig.publish(1, &batch(3));
        rig.publish(2, &batch(3));
        let first = rig.next();
        while rig.limits.queue.waiting() == 0 {
            std::thread::yield_now();
        }
        assert!(rig.rx.try_recv().is_err(), "batch 2 waits while batch 1 holds the budget");
        let used = rig.limits.queue.used();
        assert_eq!(
            unwrap_batch(first).map(|b| (b.0, b.1)),
            Some((1, used)),
            "the permit holds the decoded size"
        );
        assert_eq!(unwrap_batch(rig.next()).map(|b| b.0), Some(2));
        assert_eq!(rig.limit_hits("queue_bytes_full"), 1);
    }

    #[test]
    fn frames() {
        let f = vec![b"topic".to_vec(), 7u64.to_be_bytes().to_vec(), vec![1, 2]];
        assert_eq!(split_frames(&f), Some((7, &[1u8, 2][..])));
        assert_eq!(split_frames(&f[1..]), Some((7, &[1u8, 2][..])));
        assert_eq!(split_frames(&[vec![1]]), None);
        assert_eq!(split_frames(&[vec![], vec![1, 2, 3], vec![]]), None);
    }
}
