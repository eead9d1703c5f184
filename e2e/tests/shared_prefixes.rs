//! Long shared prefixes used by many requests in random order: after the first request of a
//! prefix, every request goes to a worker that already holds that prefix — or the decision
//! reason says why the load term overrode it.

use kvmesh_core::api::ReasonCode;
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;
use std::collections::{HashMap, HashSet};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_follow_their_prefix() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(4);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/completions");
    let prefixes: Vec<String> = (0..4).map(|i| filler(1000 + i, 1500)).collect();

    // A fixed shuffled order of (prefix, suffix) pairs: 40 requests, 10 per prefix.
    let mut order: Vec<(usize, u64)> = (0..40u64).map(|i| ((i % 4) as usize, i)).collect();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        order.swap(i, (x % (i as u64 + 1)) as usize);
    }

    let mut holders: HashMap<usize, HashSet<String>> = HashMap::new();
    let mut overridden = 0;
    for (n, (p, suffix)) in order.into_iter().enumerate() {
        let prompt = format!("{} {}", prefixes[p], filler(suffix, 20));
        let reply = post_json(
            stack.client(),
            &url,
            &json!({"model": "deepseek-v4", "prompt": prompt, "max_tokens": 4}),
            &[],
        )
        .await?;
        assert_eq!(reply.status, 200, "{}", reply.text);
        let worker = reply.worker().expect("x-sim-worker").to_owned();
        let seen = holders.entry(p).or_default();
        if !seen.is_empty() && !seen.contains(&worker) {
            let reason = reply.reason().unwrap_or_default().to_owned();
            let by_load = reply
                .reason_codes()
                .iter()
                .any(|c| matches!(c, ReasonCode::LowestCost | ReasonCode::PinOverloaded));
            assert!(
                by_load,
                "request {n} (prefix {p}) went to {worker}, holders {seen:?}, reason {reason:?}"
            );
            overridden += 1;
        }
        if !seen.is_empty() && seen.contains(&worker) {
            let overlap = reply.overlap_blocks().unwrap_or(0);
            assert!(overlap > 0, "request {n} went to a holder but predicted no overlap");
        }
        seen.insert(worker);
    }
    // Sequential requests leave no load imbalance big enough to override the cache.
    assert_eq!(overridden, 0);
    Ok(())
}
