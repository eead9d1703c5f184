//! A gateway replica that loses part of its event stream gets its index back (issue 47, point 2).
//!
//! Two replicas over the same two workers (`Stack::replica_spec`: each its own Envoy, filter and
//! indexer, both indexers subscribed to every worker's KV events). Replica B's indexer loses events
//! while replica A keeps serving traffic that stores and evicts blocks:
//! - **stall**: SIGSTOP past the engines' PUB high-water mark (`--kv-events-hwm 8`; the kernel's
//!   socket buffers hold less than the ~30 MB of events sent meanwhile), then SIGCONT. The
//!   engines drop B's share of what did not fit; B must see the gap (`kvmesh_kv_gaps_total`, else
//!   the test lost nothing and says so) and replay it.
//! - **restart**: traffic through both replicas, B's indexer killed mid-run and started again
//!   while it goes on; its start-up replay (the engines' replay rings hold every batch here) must
//!   rebuild what it missed.
//!
//! Either way, once the traffic stops, B's index must equal every engine's cache exactly: the same
//! engine block hashes (`/debug/blocks` against the simulator's `/admin/cache`), every block
//! indexed — and A's too, the control. No timing is asserted: recovery time under load is the
//! bench's (`kvmesh-bench sweep --lose-events`).

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::Context;
use futures::future::join_all;
use kvmesh_e2e::client::post_json;
use kvmesh_e2e::poll;
use kvmesh_e2e::procs::Paused;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

const WORKERS: usize = 2;
/// Tokens of each request's unique prompt (256 blocks of 16: ~20 KB of `BlockStored` a request).
const PROMPT_TOKENS: u32 = 4096;
/// The stalled replica's prompts: 1,024 blocks, ~80 KB of `BlockStored` each, and as much again
/// of `BlockRemoved` once the cache is full. Loopback TCP buffers grow to megabytes (`tcp_wmem`
/// up to 4 MB here, `tcp_rmem` up to 32 MB): only tens of megabytes of events overflow them.
const STALL_PROMPT_TOKENS: u32 = 16_384;

/// Two workers with fast modelled time and a small PUB queue, and replica A over them.
async fn replica_a(hwm: Option<u32>) -> anyhow::Result<Stack> {
    let mut spec = StackSpec::aggregate(WORKERS);
    spec.filter_config = json!({"debug_headers": true});
    spec.sim_args = vec!["--speedup".into(), "50".into()];
    if let Some(hwm) = hwm {
        spec.sim_args.extend(["--kv-events-hwm".into(), hwm.to_string()]);
    }
    Stack::start(spec).await
}

/// `n` unique prompts of `tokens` (request `first + i`), `concurrency` at a time, through
/// `gateways` in turn.
async fn traffic(
    gateways: &[&Stack],
    first: u32,
    n: u32,
    tokens: u32,
    concurrency: usize,
) -> anyhow::Result<()> {
    let ids: Vec<u32> = (first..first + n).collect();
    for chunk in ids.chunks(concurrency.max(1)) {
        let sends = chunk.iter().map(|&i| {
            let gw = gateways[i as usize % gateways.len()];
            let prompt: Vec<u32> =
                (0..tokens).map(|t| 1_000 + (i * 7_919 + t * 31) % 60_000).collect();
            let body = json!({"model": "deepseek-v4", "prompt": prompt, "max_tokens": 1});
            async move {
                let r = post_json(gw.client(), &gw.gateway("/v1/completions"), &body, &[]).await?;
                anyhow::ensure!(r.status == 200, "request {i}: {} {}", r.status, r.text);
                Ok(())
            }
        });
        join_all(sends).await.into_iter().collect::<anyhow::Result<Vec<()>>>()?;
    }
    Ok(())
}

/// Engine block hashes `stack`'s indexer holds for worker `id`, or `None` when one of them is not
/// in the index itself (a memory-bound eviction) or the indexer does not answer.
async fn indexed(stack: &Stack, id: &str) -> Option<BTreeSet<u64>> {
    let url = stack.indexer_url(&format!("/debug/blocks?worker={id}"));
    let ranks: Value = stack.client().get(&url).send().await.ok()?.json().await.ok()?;
    let mut out = BTreeSet::new();
    for b in ranks.as_array()?.iter().flat_map(|r| r["blocks"].as_array().into_iter().flatten()) {
        if b["indexed"] != json!(true) {
            return None;
        }
        out.insert(b["engine_hash"].as_u64()?);
    }
    Some(out)
}

/// Block hashes worker `id`'s engine caches (`/admin/cache`).
async fn cached(stack: &Stack, id: &str) -> Option<BTreeSet<u64>> {
    let url = stack.worker(id).ok()?.url("/admin/cache");
    let dump: Value = stack.client().get(&url).send().await.ok()?.json().await.ok()?;
    dump["blocks"].as_array()?.iter().map(|b| b["block_hash"].as_u64()).collect()
}

/// Waits until `replica`'s index equals every engine's cache of `engines`; returns the blocks
/// cached in all.
async fn index_equals_engines(
    replica: &Stack,
    engines: &Stack,
    name: &str,
) -> anyhow::Result<usize> {
    let ids: Vec<String> = engines.workers.iter().map(|w| w.id.clone()).collect();
    poll::until(&format!("replica {name}'s index equals every engine's cache"), || {
        let ids = ids.clone();
        async move {
            let mut total = 0;
            for id in &ids {
                let (want, have) = (cached(engines, id).await?, indexed(replica, id).await?);
                if want != have {
                    return None;
                }
                total += want.len();
            }
            Some(total)
        }
    })
    .await
}

/// One of `stack`'s indexer counters, summed over its labels.
async fn indexer_counter(stack: &Stack, name: &str) -> anyhow::Result<f64> {
    Ok(stack.scrape(&stack.indexer_url("/metrics")).await?.sum(name, &[]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_stalled_past_the_high_water_mark_replays_the_gap_and_matches_the_engines(
) -> anyhow::Result<()> {
    let a = replica_a(Some(8)).await?;
    let b = Stack::start(a.replica_spec()).await?;
    // Both indexers have every engine's (empty) state before the stall.
    traffic(&[&a, &b], 0, 4, PROMPT_TOKENS, 4).await?;
    index_equals_engines(&b, &a, "B").await?;
    let gaps_before = indexer_counter(&b, "kvmesh_kv_gaps_total").await?;

    let pid = b.indexer.as_ref().map(|p| p.pid()).context("replica B runs no indexer")?;
    let paused = Paused::stop(pid)?;
    // ~200 × 80 KB of BlockStored, and the removals of a cache that overflows, while B reads
    // nothing.
    let sent = traffic(&[&a], 100, 200, STALL_PROMPT_TOKENS, 8).await;
    paused.resume();
    sent?;
    // A gap shows with the next live batch after the hole: two more requests publish one.
    traffic(&[&a], 400, 2, PROMPT_TOKENS, 2).await?;

    let blocks = index_equals_engines(&b, &a, "B").await?;
    index_equals_engines(&a, &a, "A").await?;
    let gaps = indexer_counter(&b, "kvmesh_kv_gaps_total").await? - gaps_before;
    let replays = indexer_counter(&b, "kvmesh_kv_replays_total").await?;
    eprintln!(
        "stalled replica: {gaps} gaps, {replays} replays; {blocks} blocks cached and indexed"
    );
    assert!(
        gaps >= 1.0,
        "replica B saw no sequence gap: the stall did not overflow the engines' PUB queue, so this test lost no event"
    );
    assert!(blocks > 0, "the engines cache nothing: nothing was compared");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_restarted_mid_run_rebuilds_its_index_from_the_engines() -> anyhow::Result<()> {
    let a = replica_a(None).await?;
    let mut b = Stack::start(a.replica_spec()).await?;
    let (a_url, b_url) = (a.gateway(""), b.gateway(""));
    // Traffic through both replicas in turn while B's indexer dies and comes back: B's Envoy
    // routes without it meanwhile (the filter's fallback), and the engines keep storing.
    let load = async {
        traffic(&[&a], 0, 40, PROMPT_TOKENS, 4).await?;
        // Through B as well, by URL (B itself is being restarted).
        let client = a.client().clone();
        for i in 40..80u32 {
            let url = if i % 2 == 0 { &a_url } else { &b_url };
            let prompt: Vec<u32> =
                (0..PROMPT_TOKENS).map(|t| 1_000 + (i * 7_919 + t * 31) % 60_000).collect();
            let body = json!({"model": "deepseek-v4", "prompt": prompt, "max_tokens": 1});
            let r = post_json(&client, &format!("{url}/v1/completions"), &body, &[]).await?;
            anyhow::ensure!(r.status == 200, "request {i}: {} {}", r.status, r.text);
        }
        anyhow::Ok(())
    };
    let fault = async {
        tokio::time::sleep(Duration::from_millis(300)).await;
        b.kill_indexer();
        tokio::time::sleep(Duration::from_secs(1)).await;
        b.restart_indexer().await
    };
    let (load, restarted) = tokio::join!(load, fault);
    load?;
    restarted?;

    let blocks = index_equals_engines(&b, &a, "B").await?;
    index_equals_engines(&a, &a, "A").await?;
    eprintln!("restarted replica: {blocks} blocks cached and indexed");
    assert!(blocks > 0, "the engines cache nothing: nothing was compared");
    Ok(())
}
