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
//! Bounded in bytes ([`EventLimits`]): every socket has `ZMQ_MAXMSGSIZE`, payloads are checked
//! again before decoding (transports without the ZMQ check, a reload that lowered the limit), a
//! replay holds at most `replay_max_bytes`, and each decoded batch takes its size from the queue's
//! byte budget before it is queued. libzmq meets a frame above `ZMQ_MAXMSGSIZE` by closing the
//! connection and, on a connecting socket, never dialling again ([`super::watch`]): the listener
//! watches its sockets' monitors and, when that happens to the live SUB, counts it
//! (`kvmesh_kv_event_limits_total` and `kvmesh_kv_resyncs_total`, `reason="frame_too_large"`),
//! logs it at warn, clears the worker and reopens the socket; the next live batch applies
//! whatever its number (the refused batch cannot be replayed: a replay would carry it too). A
//! frame over the limit that passed libzmq (the check before decoding) is handled the same way
//! without the reconnect. A replay whose reply libzmq refused fails at once
//! (`reason="replay_frame_too_large"`) and its socket is reopened for the next replay; the gap
//! then resyncs the worker as any unrecoverable gap. A SUB that binds (the engine dials) needs no
//! watch: the engine redials after the close and the lost batches show as a gap.
//!
//! Split by concept: this file runs the live stream; [`replay`] asks and reads replays.

mod replay;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use super::applier::ApplierMsg;
use super::budget::{self, Acquired, EventLimits};
use super::decode::decode_batch;
use super::frames::split_frames;
use super::sequencer::{Sequencer, Verdict};
/// The counters live in [`super::stats`] (shared with the applier); re-exported for the callers
/// that start listeners.
pub use super::stats::ListenerStats;
use super::watch::Watch;
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

/// Receive high-water mark (messages) of the SUB and replay DEALER sockets. On the DEALER it is
/// what lets a whole replay buffer (vLLM keeps 10,000 batches by default) be queued here: a ROUTER
/// whose queue to us is full drops replies silently (the replay then has holes, see
/// [`plan_round`]); libzmq's default of 1,000 made most long replays lose batches.
const RCVHWM: i32 = 100_000;

/// Worker slots whose listeners share one ZMQ context. libzmq caps a context at 1,023 sockets
/// (`ZMQ_MAX_SOCKETS`, which the `zmq` crate cannot raise) and a listener holds up to six (the SUB
/// and the replay DEALER, each with its monitor socket and the PAIR reading it, [`Watch`]): with one
/// context for all, the listeners past ~170 workers could open no socket (`kvmesh-bench scale`,
/// e2e/bench/HISTORY.md). 128 × 6 = 768 leaves room for sockets libzmq is still closing.
pub const SLOTS_PER_CONTEXT: usize = 128;

/// The listeners' ZMQ contexts, one per [`SLOTS_PER_CONTEXT`] worker slots (slots are small dense
/// numbers, reused), each made when first needed; a context costs libzmq an I/O and a reaper thread.
#[derive(Default)]
pub struct Contexts(parking_lot::Mutex<Vec<zmq::Context>>);

impl Contexts {
    /// The context for worker slot `slot`'s listener.
    pub fn for_slot(&self, slot: WorkerSlot) -> zmq::Context {
        let i = slot as usize / SLOTS_PER_CONTEXT;
        let mut list = self.0.lock();
        while list.len() <= i {
            list.push(zmq::Context::new());
        }
        list[i].clone()
    }
}

/// A running listener; stop it with [`ListenerHandle::stop`].
pub struct ListenerHandle {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ListenerHandle {
    /// Asks the thread to stop without waiting: stopping many listeners at once asks them all
    /// first, so their poll intervals overlap instead of adding up.
    pub fn ask_to_stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Asks the thread to stop and waits for it (at most one poll interval plus a replay deadline).
    pub fn stop(mut self) {
        self.ask_to_stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long one poll of the live socket waits (the stop flag is read between polls).
const POLL: Duration = Duration::from_millis(100);

/// A duration as a `zmq::poll` timeout in milliseconds (at least 1: 0 would not wait).
fn poll_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

/// The live SUB socket and, when it connects, the [`Watch`] that tells when libzmq gave it up.
struct Live {
    sub: zmq::Socket,
    watch: Option<Watch>,
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
    dealer: Option<replay::Dealer>,
}

impl Listener {
    fn run(&mut self) {
        let Some(mut live) = self.open_live() else { return };
        tracing::info!(worker = %self.spec.worker, rank = self.spec.rank, endpoint = %self.spec.events_endpoint, replay = ?self.spec.replay_endpoint, "subscribed to KV events");
        if self.spec.replay_endpoint.is_some() {
            // Learn what the engine cached before we started. Nothing to clear on truncation.
            self.replay(0, false);
        }
        self.stats.synced.store(true, Ordering::Relaxed);
        while !self.stopped() {
            let readable = {
                let wait = live.watch.as_ref().map_or(POLL, |w| w.wait(crate::clock::now(), POLL));
                let mut items = vec![live.sub.as_poll_item(zmq::POLLIN)];
                items.extend(live.watch.as_ref().map(Watch::poll_item));
                match zmq::poll(&mut items, poll_ms(wait)) {
                    Ok(_) => items[0].is_readable(),
                    Err(e) => {
                        tracing::warn!(worker = %self.spec.worker, error = %e, "poll failed");
                        std::thread::sleep(POLL);
                        false
                    }
                }
            };
            if live.watch.as_mut().is_some_and(|w| w.given_up(crate::clock::now())) {
                self.on_connection_given_up();
                drop(live);
                match self.open_live() {
                    Some(l) => live = l,
                    None => return,
                }
                continue;
            }
            if !readable {
                continue;
            }
            let frames = match live.sub.recv_multipart(zmq::DONTWAIT) {
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

    /// Opens the live socket, retrying every second; None once asked to stop.
    fn open_live(&self) -> Option<Live> {
        loop {
            if self.stopped() {
                return None;
            }
            match self.open_sub() {
                Ok(s) => return Some(s),
                Err(e) => {
                    tracing::error!(worker = %self.spec.worker, rank = self.spec.rank, endpoint = %self.spec.events_endpoint, error = %e, "cannot open KV events socket; retrying");
                    std::thread::sleep(Duration::from_secs(1));
                }
            }
        }
    }

    fn open_sub(&self) -> Result<Live, zmq::Error> {
        let sub = self.ctx.socket(zmq::SUB)?;
        sub.set_linger(0)?;
        sub.set_rcvhwm(RCVHWM)?;
        sub.set_maxmsgsize(zmq_limit(self.limits.max_frame()))?;
        sub.set_subscribe(self.spec.topic.as_bytes())?;
        if self.spec.bind {
            // Accepted connections are the engine's to dial again: nothing to watch.
            sub.bind(&self.spec.events_endpoint)?;
            return Ok(Live { sub, watch: None });
        }
        let watch = Watch::on(&self.ctx, &sub)?;
        sub.connect(&self.spec.events_endpoint)?;
        Ok(Live { sub, watch: Some(watch) })
    }

    /// libzmq closed the live connection and will not dial again ([`super::watch`]): the
    /// publisher sent a frame above `ZMQ_MAXMSGSIZE` (`routing.event_max_frame_bytes`) or bytes
    /// libzmq could not decode. That batch and the ones until the new connection are lost, and a
    /// replay would carry the refused batch again: the worker is cleared and goes on from the next
    /// live batch, whatever its number.
    fn on_connection_given_up(&mut self) {
        self.limit_hit("frame_too_large");
        tracing::warn!(
            worker = %self.spec.worker,
            rank = self.spec.rank,
            endpoint = %self.spec.events_endpoint,
            limit = self.limits.max_frame(),
            last_seq = ?self.seq.last(),
            "libzmq closed the KV events connection and will not reconnect (a frame above routing.event_max_frame_bytes, or one it could not decode): clearing the worker and reopening the socket"
        );
        self.resync("frame_too_large");
        self.seq.resume_at_next_live();
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
                // A failed replay sent nothing: `after_recovery` then finds the gap still open
                // and clears the worker, once (clearing here as well counted every such gap twice).
                self.replay(from, true);
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
}

/// A byte limit as `ZMQ_MAXMSGSIZE` (i64; -1 would mean none, so huge values saturate).
fn zmq_limit(bytes: usize) -> i64 {
    i64::try_from(bytes).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests;
