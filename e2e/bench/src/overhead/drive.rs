//! The thin I/O layer of the overhead measurement: tagged requests, a closed loop, the access log.
//!
//! Latency samples are sent one at a time (nothing else in flight), so a sample's gateway time is
//! the gateway's own work, not queueing behind other samples. The requests/s phase runs
//! `concurrency` clients in a closed loop for a fixed time against the canned route; every
//! request has a deadline, so a round always ends.

use super::cases::{BENCH_ID_HEADER, UPSTREAM_HEADER, UPSTREAM_NONE};
use super::gateway::{parse_access_line, AccessEntry};
use super::summary::{routed_without_indexer, IndexerTimers, Path as Way, Rate, Sample};
use crate::client::{send_streaming, Outcome};
use futures::StreamExt;
use kvmesh_core::headers::{DEBUG_FALLBACK, DEBUG_MODE};
use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Sends one streaming request tagged with `id` and measures it.
pub async fn tagged(
    client: &reqwest::Client,
    url: &str,
    body: Vec<u8>,
    id: &str,
    deadline: Duration,
) -> Outcome {
    send_streaming(client, url, body, &[(BENCH_ID_HEADER.to_string(), id.to_string())], deadline)
        .await
}

/// One closed-loop request against the canned route on `way`: `(ok, routed without the indexer)`.
async fn canned(
    client: &reqwest::Client,
    url: &str,
    way: Way,
    body: Vec<u8>,
    deadline: Duration,
) -> (bool, bool) {
    let fut = async {
        let resp = client
            .post(url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .header(UPSTREAM_HEADER, UPSTREAM_NONE)
            .body(body)
            .send()
            .await
            .ok()?;
        let h = resp.headers();
        let fallback =
            routed_without_indexer(way, h.contains_key(DEBUG_FALLBACK), h.contains_key(DEBUG_MODE));
        let ok = resp.status().is_success();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            chunk.ok()?;
        }
        Some((ok, fallback))
    };
    tokio::time::timeout(deadline, fut).await.ok().flatten().unwrap_or((false, false))
}

/// Runs `concurrency` clients back to back against `url`'s canned route (on `way`) for
/// `duration`; request `n` carries `body(n)`. Counts completions over the wall time until the
/// last one ends (one round).
pub async fn closed_loop<F>(
    client: &reqwest::Client,
    url: &str,
    way: Way,
    concurrency: usize,
    duration: Duration,
    deadline: Duration,
    body: Arc<F>,
) -> Rate
where
    F: Fn(u64) -> Vec<u8> + Send + Sync + 'static,
{
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let stop_at = start + duration;
    let mut tasks = Vec::with_capacity(concurrency);
    for _ in 0..concurrency.max(1) {
        let (client, url, next, body) =
            (client.clone(), url.to_string(), next.clone(), body.clone());
        tasks.push(tokio::spawn(async move {
            let mut r = Rate::default();
            while Instant::now() < stop_at {
                let n = next.fetch_add(1, Ordering::Relaxed);
                let (ok, fallback) = canned(&client, &url, way, body(n), deadline).await;
                if ok {
                    r.ok += 1;
                } else {
                    r.failed += 1;
                }
                r.fallbacks += u64::from(fallback);
            }
            r
        }));
    }
    let mut total = Rate::default();
    for t in tasks {
        if let Ok(r) = t.await {
            total.add(r);
        }
    }
    total.seconds = start.elapsed().as_secs_f64();
    total.rounds = 1;
    total
}

/// Scrapes the indexer's route and tokenization timers (`None` when it does not answer).
pub async fn indexer_timers(client: &reqwest::Client, metrics_url: &str) -> Option<IndexerTimers> {
    let fut = async { client.get(metrics_url).send().await.ok()?.text().await.ok() };
    let text = tokio::time::timeout(Duration::from_secs(5), fut).await.ok().flatten()?;
    IndexerTimers::from_scrape(&crate::prom::parse(&text).ok()?)
}

/// Polls the indexer's timers until at least `tokenizations` tokenizations are recorded, or
/// `patience` runs out (then the last reading). A latency sample's tokenization runs to the end
/// on the indexer's blocking pool even when the filter gave up (its timeout); waiting for it
/// keeps one sample's leftovers out of the next.
pub async fn settle(
    client: &reqwest::Client,
    metrics_url: &str,
    tokenizations: f64,
    every: Duration,
    patience: Duration,
) -> Option<IndexerTimers> {
    let deadline = Instant::now() + patience;
    loop {
        let t = indexer_timers(client, metrics_url).await;
        if t.is_some_and(|t| t.tokenizations >= tokenizations) || Instant::now() >= deadline {
            return t;
        }
        tokio::time::sleep(every).await;
    }
}

/// User + system CPU time of process `pid` in clock ticks (`/proc/<pid>/stat`; Linux's user-space
/// tick is 1/100 s). `None` off Linux or when the process is gone.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    parse_stat_ticks(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// utime + stime from a `/proc/<pid>/stat` line (fields 14 and 15; the command name in
/// parentheses may contain spaces, so fields are counted after its closing parenthesis).
pub fn parse_stat_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// Waits until process `pid` is idle — at most `max_ticks` of CPU over one `window` — or
/// `patience` runs out; returns how long it waited. The filter gives up on the indexer after its
/// timeout, but the indexer finishes the tokenizations it started (on its blocking pool, all at
/// once); waiting keeps one requests/s round's leftovers out of the next round.
pub async fn settle_cpu(
    pid: u32,
    window: Duration,
    max_ticks: u64,
    patience: Duration,
) -> Duration {
    let start = Instant::now();
    while start.elapsed() < patience {
        let Some(before) = cpu_ticks(pid) else { break };
        tokio::time::sleep(window).await;
        let Some(after) = cpu_ticks(pid) else { break };
        if after.saturating_sub(before) <= max_ticks {
            break;
        }
    }
    start.elapsed()
}

/// Reads Envoy's access log until every id in `want` has a line (Envoy flushes the file
/// periodically) or `patience` runs out; returns what was found.
pub async fn access_entries(
    path: &Path,
    want: &HashSet<String>,
    patience: Duration,
) -> HashMap<String, AccessEntry> {
    let deadline = Instant::now() + patience;
    loop {
        let found: HashMap<String, AccessEntry> = std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(parse_access_line)
            .filter(|e| want.contains(&e.id))
            .map(|e| (e.id.clone(), e))
            .collect();
        if found.len() >= want.len() || Instant::now() >= deadline {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Fills each sample's gateway and request-side times from Envoy's access log (waiting up to
/// `patience` for its lines); returns how many samples had no line.
pub async fn join_access_log(path: &Path, samples: &mut [Sample], patience: Duration) -> usize {
    let want: HashSet<String> = samples.iter().map(|s| s.id.clone()).collect();
    let entries = access_entries(path, &want, patience).await;
    let mut missing = 0;
    for s in samples {
        match entries.get(&s.id) {
            Some(e) => {
                s.gateway_ms = e.gateway_ms();
                s.request_ms = e.req_us.map(|us| us / 1000.0);
            }
            None => missing += 1,
        }
    }
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_ticks_are_utime_plus_stime() {
        let line = "4242 (kvmesh indexer) S 1 4242 4242 0 -1 4194560 1234 0 0 0 150 37 0 0 20 0 9 0 12345 1000000 2000 18446744073709551615";
        assert_eq!(parse_stat_ticks(line), Some(187));
        assert_eq!(parse_stat_ticks("garbage"), None);
        assert_eq!(parse_stat_ticks("1 (x) S 1 2"), None);
        assert!(cpu_ticks(std::process::id()).is_some(), "this process has a /proc entry");
    }
}
