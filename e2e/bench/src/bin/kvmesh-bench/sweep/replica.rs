//! Gateway replicas of a sweep point (I/O): the other replicas started over the first stack's
//! engines (`Stack::replica_spec`, as the two-gateway e2e tests do), and the lost-events fault on
//! the last replica's indexer — SIGSTOP then SIGCONT, or a restart — with its indexer's counters.

use anyhow::{Context, Result};
use kvmesh_bench::sweep::lost_events::{Fault, FaultTimes};
use kvmesh_e2e::procs::Paused;
use kvmesh_e2e::stack::Stack;
use std::path::Path;
use std::time::{Duration, Instant};

/// A lost-events point's fault: what, when (s after the window opens), how long a stall lasts, and
/// the recovery's bin width.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FaultPlan {
    pub fault: Fault,
    pub at_s: f64,
    pub stall_s: f64,
    pub bin_s: f64,
}

/// The faulted indexer's counters the report shows (`kvmesh_kv_<name>_total`).
const INDEXER_COUNTERS: [&str; 5] =
    ["gaps", "replays", "resyncs", "orphan_stores", "orphan_recovered"];

/// Starts `count − 1` more gateway replicas over `primary`'s engines, each in
/// `<dir>/stack-replica<i>` (`attempts` tries each: a loaded machine can miss a deadline once).
pub async fn start_replicas(
    primary: &Stack,
    count: usize,
    dir: &Path,
    attempts: u32,
) -> Result<Vec<Stack>> {
    let mut out = Vec::with_capacity(count.saturating_sub(1));
    for i in 1..count {
        let mut attempt = 1;
        let stack = loop {
            let mut spec = primary.replica_spec();
            spec.work_dir = Some(dir.join(format!("stack-replica{i}")));
            match Stack::start(spec).await {
                Ok(s) => break s,
                Err(e) if attempt < attempts.max(1) => {
                    tracing::warn!(
                        replica = i,
                        attempt,
                        error = format!("{e:#}"),
                        "replica did not start; retrying"
                    );
                    attempt += 1;
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                Err(e) => return Err(e.context(format!("starting gateway replica {i}"))),
            }
        };
        out.push(stack);
    }
    Ok(out)
}

/// The faulted indexer's counters now (`None` for one that does not answer).
async fn indexer_counters(stack: &Stack) -> Option<Vec<(String, f64)>> {
    let m = stack.scrape(&stack.indexer_url("/metrics")).await.ok()?;
    Some(
        INDEXER_COUNTERS
            .iter()
            .map(|c| ((*c).to_owned(), m.sum(&format!("kvmesh_kv_{c}_total"), &[])))
            .collect(),
    )
}

/// Waits until `at` (run clock), then faults `stack`'s indexer; returns when it happened on the run
/// clock (ms since `run_started`) and its counters just before.
pub async fn inject(
    stack: &mut Stack,
    plan: FaultPlan,
    run_started: Instant,
    at: Duration,
) -> Result<(FaultTimes, Option<Vec<(String, f64)>>)> {
    tokio::time::sleep_until(tokio::time::Instant::from_std(run_started + at)).await;
    let before = indexer_counters(stack).await;
    let ms = || run_started.elapsed().as_secs_f64() * 1000.0;
    let start_ms = ms();
    match plan.fault {
        Fault::Stall => {
            let pid = stack.indexer.as_ref().context("the replica runs no indexer")?.pid();
            eprintln!("[bench] lost events: SIGSTOP indexer {pid} for {} s", plan.stall_s);
            let paused = Paused::stop(pid)?;
            tokio::time::sleep(Duration::from_secs_f64(plan.stall_s)).await;
            paused.resume();
        }
        Fault::Restart => {
            eprintln!("[bench] lost events: restarting the replica's indexer");
            stack.restart_indexer().await.context("restarting the faulted replica's indexer")?;
        }
    }
    let end_ms = ms();
    eprintln!("[bench] lost events: fault over after {:.1} s", (end_ms - start_ms) / 1000.0);
    Ok((FaultTimes { start_ms, end_ms }, before))
}

/// The faulted indexer's counters over the point: after − before for a stall, the new process's
/// own for a restart (its counters started again at 0).
pub async fn counters_since(
    stack: &Stack,
    fault: Fault,
    before: Option<Vec<(String, f64)>>,
) -> Vec<(String, f64)> {
    let Some(after) = indexer_counters(stack).await else { return Vec::new() };
    match (fault, before) {
        (Fault::Stall, Some(before)) => {
            after.into_iter().zip(before).map(|((name, a), (_, b))| (name, a - b)).collect()
        }
        _ => after,
    }
}
