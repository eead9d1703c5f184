//! Chat workload driver: runs the planned sessions against `/v1/chat/completions`.
//!
//! At most `concurrent_sessions` sessions are active (a semaphore); a new session starts when
//! one ends, until `sessions` have run. Inside a session the turns are sequential: wait the
//! planned think time, send the history plus the new user message, append the streamed reply.
//! A failed turn is recorded and ends its session (its history would no longer be what a real
//! client holds). Every request has the deadline; think times are capped at
//! [`MAX_THINK_FACTOR`] × their mean, so the run is bounded.

use crate::chat::{script_session, system_prompts, ChatConfig, History};
use crate::client::send_streaming;
use crate::record::RequestRecord;
use crate::replay::{to_record, MAX_CONCURRENCY};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, Semaphore};

/// An exponential think time is cut at this multiple of its mean.
pub const MAX_THINK_FACTOR: f64 = 20.0;

/// How to reach the gateway.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRunConfig {
    /// Base URL of the gateway.
    pub base_url: String,
    /// `model` field.
    pub model: String,
    /// Deadline per request.
    pub request_timeout: Duration,
    /// Send the session id in this header, when set.
    pub session_header: Option<String>,
    /// Send `ignore_eos: true`.
    pub ignore_eos: bool,
}

/// Runs the chat workload; one record per turn goes to `sink`. Returns the wall time.
pub async fn run_chat(
    client: reqwest::Client,
    run: ChatRunConfig,
    cfg: ChatConfig,
    sink: mpsc::Sender<RequestRecord>,
) -> Duration {
    let prompts = Arc::new(system_prompts(&cfg));
    let permits = cfg.concurrent_sessions.clamp(1, MAX_CONCURRENCY);
    let slots = Arc::new(Semaphore::new(permits));
    let seq = Arc::new(AtomicU64::new(0));
    let url = Arc::new(format!("{}/v1/chat/completions", run.base_url.trim_end_matches('/')));
    let run = Arc::new(run);
    let cfg = Arc::new(cfg);
    let t0 = Instant::now();
    for id in 0..cfg.sessions {
        let Ok(permit) = slots.clone().acquire_owned().await else { break };
        let (client, run, cfg, prompts, seq, url, sink) = (
            client.clone(),
            run.clone(),
            cfg.clone(),
            prompts.clone(),
            seq.clone(),
            url.clone(),
            sink.clone(),
        );
        tokio::spawn(async move {
            let script = script_session(&cfg, id);
            let system = prompts.get(script.system_prompt).map(String::as_str).unwrap_or_default();
            let mut history = History::new(system);
            for (turn, tp) in script.turns.iter().enumerate() {
                let cap = |mean: f64| mean * MAX_THINK_FACTOR;
                let mean = if turn == 0 { cfg.start_stagger_ms } else { cfg.think_time_ms };
                tokio::time::sleep(Duration::from_secs_f64(
                    tp.delay_ms.min(cap(mean)).max(0.0) / 1000.0,
                ))
                .await;
                history.push_user(&tp.user);
                let scheduled_ms = t0.elapsed().as_secs_f64() * 1000.0;
                let index = seq.fetch_add(1, Ordering::Relaxed);
                let extra: Vec<(String, String)> = run
                    .session_header
                    .iter()
                    .map(|h| (h.clone(), script.session_id.clone()))
                    .collect();
                let body = history.body(&run.model, cfg.max_tokens, run.ignore_eos);
                let (record, reply) = match serde_json::to_vec(&body) {
                    Ok(bytes) => {
                        let mut o =
                            send_streaming(&client, &url, bytes, &extra, run.request_timeout).await;
                        let reply = std::mem::take(&mut o.text);
                        (
                            to_record(
                                index,
                                scheduled_ms,
                                scheduled_ms,
                                u64::from(cfg.max_tokens),
                                o,
                            ),
                            reply,
                        )
                    }
                    Err(e) => (
                        RequestRecord {
                            index,
                            scheduled_ms,
                            sent_ms: scheduled_ms,
                            error: Some(format!("encoding body: {e}")),
                            ..Default::default()
                        },
                        String::new(),
                    ),
                };
                let ok = record.ok();
                let record = RequestRecord {
                    session: Some(script.session_id.clone()),
                    turn: Some(turn as u32),
                    ..record
                };
                // A closed sink means the run is being torn down.
                let _ = sink.send(record).await;
                if !ok {
                    break;
                }
                history.push_assistant(&reply);
            }
            drop(permit);
        });
    }
    let _ = slots.acquire_many(permits as u32).await;
    t0.elapsed()
}
