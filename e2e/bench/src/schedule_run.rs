//! Sweep-point driver: runs a [`Schedule`] against the gateway, one record per request (thin I/O).
//!
//! Each session is a task that sleeps until its start, then runs its turns closed loop: turn
//! `k + 1` is due `think_ms` after turn `k` completed. At most `max_in_flight` requests are in
//! flight (a semaphore); a due request waiting for a slot is sent late, and `scheduled_ms` /
//! `sent_ms` record both, so the validity rule on lateness sees it. No turn starts after
//! `turn_deadline` (sessions are cut there and the cut is counted), and every request has its
//! deadline, so a point always ends. `done` counts finished requests for the progress line. A
//! session naming its own model also sends it in `x-gateway-model-name` (the baselines route by it).
//! Behind several gateway replicas each request goes to the one `sweep::replicas::replica_for`
//! names (a session's position in the schedule and the request's number in send order).

use crate::client::send_streaming;
use crate::record::RequestRecord;
use crate::replay::{to_record, MAX_CONCURRENCY};
use crate::sweep::replicas::{replica_for, Spread};
use crate::workload::{Content, Schedule};
use kvmesh_e2e::envoy_config::MODEL_HEADER;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Semaphore};

/// How to run a schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct ScheduleRunConfig {
    /// Base URL of each gateway replica (one for a single gateway).
    pub gateways: Vec<String>,
    /// How requests are spread over `gateways`.
    pub spread: Spread,
    /// `model` of every request.
    pub model: String,
    /// Send each session's id in this header, when set.
    pub session_header: Option<String>,
    /// Deadline per request.
    pub request_timeout: Duration,
    /// Requests in flight at most.
    pub max_in_flight: usize,
    /// No turn is sent later than this after the start.
    pub turn_deadline: Duration,
}

/// What a run did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScheduleRunStats {
    /// Wall time.
    pub wall: Duration,
    /// Turns not sent because `turn_deadline` passed.
    pub cut_turns: u64,
}

/// Runs `schedule`; records go to `sink`, `done` is incremented per finished request.
pub async fn run_schedule(
    client: reqwest::Client,
    cfg: ScheduleRunConfig,
    schedule: Arc<Schedule>,
    sink: mpsc::Sender<RequestRecord>,
    done: Arc<AtomicU64>,
) -> ScheduleRunStats {
    let slots = Arc::new(Semaphore::new(cfg.max_in_flight.clamp(1, MAX_CONCURRENCY)));
    let seq = Arc::new(AtomicU64::new(0));
    let cut = Arc::new(AtomicU64::new(0));
    let cfg = Arc::new(cfg);
    let t0 = Instant::now();
    let t0_tokio = tokio::time::Instant::from_std(t0);
    let mut tasks = Vec::with_capacity(schedule.sessions.len());
    for i in 0..schedule.sessions.len() {
        let (client, cfg, schedule, sink, done, slots, seq, cut) = (
            client.clone(),
            cfg.clone(),
            schedule.clone(),
            sink.clone(),
            done.clone(),
            slots.clone(),
            seq.clone(),
            cut.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let Some(s) = schedule.sessions.get(i) else { return };
            let mut due = t0_tokio + Duration::from_secs_f64(s.start_ms.max(0.0) / 1000.0);
            for (t, turn) in s.turns.iter().enumerate() {
                if t > 0 {
                    due = tokio::time::Instant::now()
                        + Duration::from_secs_f64(turn.think_ms.max(0.0) / 1000.0);
                }
                if due.duration_since(t0_tokio) > cfg.turn_deadline {
                    cut.fetch_add((s.turns.len() - t) as u64, Ordering::Relaxed);
                    break;
                }
                tokio::time::sleep_until(due).await;
                let scheduled_ms = due.duration_since(t0_tokio).as_secs_f64() * 1000.0;
                let Ok(permit) = slots.acquire().await else { break };
                let sent_ms = t0.elapsed().as_secs_f64() * 1000.0;
                let index = seq.fetch_add(1, Ordering::Relaxed);
                let gateway = replica_for(cfg.spread, i, index, cfg.gateways.len());
                let base = cfg.gateways.get(gateway).map_or("", |g| g.trim_end_matches('/'));
                let url = format!("{base}{}", s.path());
                let mut extra: Vec<(String, String)> =
                    cfg.session_header.iter().map(|h| (h.clone(), s.id.clone())).collect();
                // A session naming its model says so in a header too: Envoy's baseline policies
                // cannot read the body and route by it on a fleet of several models.
                if let Some(m) = &s.model {
                    extra.push((MODEL_HEADER.to_owned(), m.clone()));
                }
                let body = s.body(t, &cfg.model).map(|b| serde_json::to_vec(&b));
                let record = match body {
                    Some(Ok(bytes)) => {
                        let o =
                            send_streaming(&client, &url, bytes, &extra, cfg.request_timeout).await;
                        to_record(
                            index,
                            scheduled_ms,
                            sent_ms,
                            u64::from(turn.max_tokens.max(1)),
                            o,
                        )
                    }
                    other => RequestRecord {
                        index,
                        scheduled_ms,
                        sent_ms,
                        error: Some(format!(
                            "encoding body: {:?}",
                            other.map(|r| r.err().map(|e| e.to_string()))
                        )),
                        ..Default::default()
                    },
                };
                drop(permit);
                let ok = record.ok();
                let input_tokens = match &s.content {
                    Content::Tokens(_) => Some(turn.upto as u64),
                    Content::Chat(_) => None,
                };
                let record = RequestRecord {
                    session: Some(s.id.clone()),
                    turn: Some(t as u32),
                    model: s.model.clone(),
                    input_tokens,
                    ..record
                };
                done.fetch_add(1, Ordering::Relaxed);
                // A closed sink means the run is being torn down.
                let _ = sink.send(record).await;
                if !ok {
                    // The conversation a real client holds ends with a failed turn.
                    cut.fetch_add((s.turns.len() - t - 1) as u64, Ordering::Relaxed);
                    break;
                }
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
    ScheduleRunStats { wall: t0.elapsed(), cut_turns: cut.load(Ordering::Relaxed) }
}
