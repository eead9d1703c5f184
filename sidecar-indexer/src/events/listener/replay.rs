//! Replays from the engine's ROUTER socket (engines.md §1.3): asking, reading rounds within their
//! byte and time bounds, and asking again from the first missing batch.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{poll_ms, zmq_limit, Listener, RCVHWM};
use crate::events::frames::replay_frames;
use crate::events::sequencer::{plan_round, RoundNext, MAX_REPLAY_ROUNDS};
use crate::events::watch::Watch;

/// How a replay went.
pub(super) enum Replay {
    /// Every batch from the requested start was delivered (and sent on).
    Complete,
    /// Not everything from the start arrived: the engine no longer holds the start (the worker was
    /// cleared if asked), or the replay had holes; the usable part was sent.
    Truncated,
    /// No replay socket, or it failed: nothing was sent.
    Failed,
}

impl Listener {
    /// Replays from `from`; sends what arrives. `clear_on_truncation`: the worker's state predates
    /// the replayed window, so a truncated replay must clear it first. A round with a hole or
    /// without its end marker (the engine's ROUTER dropped replies) is asked again from the first
    /// missing number, at most [`MAX_REPLAY_ROUNDS`] rounds ([`plan_round`]).
    pub(super) fn replay(&mut self, from: u64, clear_on_truncation: bool) -> Replay {
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
            let watch = Watch::on(&self.ctx, &d).map_err(|e| e.to_string())?;
            d.connect(&endpoint).map_err(|e| e.to_string())?;
            self.dealer = Some(Dealer { socket: d, watch });
        }
        let max_frame = self.limits.max_frame();
        let Some(Dealer { socket: dealer, watch }) = self.dealer.as_mut() else {
            return Err("no replay socket".into());
        };
        let start = from.to_be_bytes();
        // DONTWAIT: a DEALER whose connection libzmq gave up has no peer, and a blocking send
        // would wait for one for ever (a connecting one queues until it connects).
        dealer
            .send_multipart([&b""[..], &start[..]], zmq::DONTWAIT)
            .map_err(|e| format!("replay request not sent: {e}"))?;
        let deadline = crate::clock::now() + self.spec.replay_timeout;
        let mut out = Vec::new();
        let max_bytes = self.limits.replay_max();
        let mut held = 0usize;
        loop {
            let now = crate::clock::now();
            if watch.given_up(now) {
                // libzmq refused a reply (above `ZMQ_MAXMSGSIZE`) and closed the connection for
                // good ([`crate::events::watch`]): nothing more comes; the socket is reopened.
                self.metrics
                    .kv_event_limits
                    .with_label_values(&[&self.spec.worker, "replay_frame_too_large"])
                    .inc();
                return Err(format!(
                    "libzmq closed the replay connection and will not reconnect (a replayed batch above routing.event_max_frame_bytes {max_frame}, or one it could not decode)"
                ));
            }
            let left = deadline.saturating_duration_since(now);
            if left.is_zero() {
                if out.is_empty() {
                    return Err(format!("no reply within {:?}", self.spec.replay_timeout));
                }
                return Ok((out, false));
            }
            // Once replies flow, a pause of REPLAY_IDLE ends the round: the engine sends a replay
            // in one burst, so its end marker was dropped (asking again is always safe).
            let idle = if out.is_empty() { left } else { left.min(REPLAY_IDLE) };
            let wait = watch.wait(now, idle);
            let ready = {
                let mut items = [dealer.as_poll_item(zmq::POLLIN), watch.poll_item()];
                zmq::poll(&mut items, poll_ms(wait)).map_err(|e| e.to_string())?;
                items[0].is_readable()
            };
            if !ready {
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
                self.metrics
                    .kv_event_limits
                    .with_label_values(&[&self.spec.worker, "replay_frame_too_large"])
                    .inc();
                return Err(format!(
                    "replayed batch of {} bytes above routing.event_max_frame_bytes {max_frame}",
                    payload.len()
                ));
            }
            held += payload.len();
            if held > max_bytes {
                self.metrics
                    .kv_event_limits
                    .with_label_values(&[&self.spec.worker, "replay_too_large"])
                    .inc();
                return Err(format!("replay above routing.replay_max_bytes {max_bytes}"));
            }
            out.push((seq, payload.to_vec()));
            if out.len() > MAX_REPLAY_BATCHES {
                self.metrics
                    .kv_event_limits
                    .with_label_values(&[&self.spec.worker, "replay_too_large"])
                    .inc();
                return Err(format!("replay longer than {MAX_REPLAY_BATCHES} batches"));
            }
        }
    }
}

/// How long a replay round waits for the next reply once replies flow (the deadline still
/// bounds the round): beyond it the round ended without its end marker.
const REPLAY_IDLE: Duration = Duration::from_millis(250);

/// The replay DEALER socket and the [`Watch`] that tells when libzmq gave its connection up.
pub(super) struct Dealer {
    socket: zmq::Socket,
    watch: Watch,
}

/// A replayed batch: its sequence number and payload.
pub(super) type Numbered = (u64, Vec<u8>);

/// Most batches one replay may hold (besides `replay_max_bytes`).
const MAX_REPLAY_BATCHES: usize = 1_000_000;
