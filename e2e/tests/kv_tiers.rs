//! Offload tiers end to end (issue 46.1): a prompt's tail evicted from a worker's GPU cache to its
//! CPU tier (vllm-sim `--cpu-offload-blocks`, events with `medium = "CPU"` as vLLM's offloading
//! connector publishes them) is routed back to that worker, predicted at the tier's cost: its GPU
//! blocks free, its CPU blocks at `cpu_load_tokens_per_s`, the rest computed — and the engine
//! serves exactly that split from its cache.

use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json, Reply};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const SECRET: &str = "e2e-override-secret-kv-tiers-0123";
const BS: u64 = 16;
/// GPU blocks per worker: the prompt (~40 blocks) and the evicting one (~70) do not fit together.
const GPU_BLOCKS: u64 = 96;
/// Prefill and CPU-load rates, the same in the engines and the indexer (pinned: not measured).
const PREFILL_TPS: f64 = 20_000.0;
const CPU_LOAD_TPS: f64 = 100_000.0;

async fn complete(stack: &Stack, prompt: &str, worker: Option<&str>) -> anyhow::Result<Reply> {
    let body = json!({"model": "deepseek-v4", "prompt": prompt, "max_tokens": 1});
    let h: Vec<(&str, &str)> = match worker {
        Some(w) => vec![(headers::OVERRIDE_WORKER, w), (headers::OVERRIDE_SECRET, SECRET)],
        None => Vec::new(),
    };
    let r = post_json(stack.client(), &stack.gateway("/v1/completions"), &body, &h).await?;
    anyhow::ensure!(r.status == 200, "status {}: {}", r.status, r.text);
    Ok(r)
}

/// `N` of the decision reason's `(+N from cpu)`, 0 without one.
fn cpu_blocks(reason: &str) -> u64 {
    let Some(end) = reason.find(" from cpu)") else { return 0 };
    let start = reason[..end].rfind("(+").map_or(end, |i| i + 2);
    reason[start..end].parse().unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_evicted_to_the_cpu_tier_is_routed_to_its_holder_at_the_tiers_cost(
) -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({
        "debug_headers": true,
        "allow_overrides": true,
        "override_secret": SECRET,
        "indexer_timeout_ms": 5000,
    });
    spec.sim_args = [
        "--num-gpu-blocks",
        &GPU_BLOCKS.to_string(),
        "--cpu-offload-blocks",
        "512",
        "--cpu-load-tokens-per-s",
        &CPU_LOAD_TPS.to_string(),
        "--prefill-tokens-per-s",
        &PREFILL_TPS.to_string(),
    ]
    .map(str::to_owned)
    .to_vec();
    // The prediction uses the configured rates (the throughput clamp pins the measured one), and
    // no speculative holdings: the prompt's earlier decision would otherwise count as on the GPU.
    spec.routing_toml = format!(
        "prefill_tokens_per_s = {PREFILL_TPS:.1}\nprefill_tokens_per_s_min = {PREFILL_TPS:.1}\n\
         prefill_tokens_per_s_max = {PREFILL_TPS:.1}\ncpu_load_tokens_per_s = {CPU_LOAD_TPS:.1}\n\
         speculative_ttl_ms = 0\n"
    );
    let stack = Stack::start(spec).await?;
    let (holder, other) = (stack.workers[0].id.clone(), stack.workers[1].id.clone());

    // The prompt on the holder: ~40 blocks, all computed and cached on its GPU.
    // About 1.15 tokens a filler word.
    let words = 560;
    let prompt = filler(4600, words);
    let first = complete(&stack, &prompt, Some(&holder)).await?;
    let tokens = first.prompt_tokens().unwrap_or(0);
    anyhow::ensure!((24 * BS..64 * BS).contains(&tokens), "{tokens} prompt tokens");
    // Another prompt of ~70 blocks on the holder: its allocation takes the never-used blocks, then
    // the prompt's blocks from the tail, which go to the CPU tier.
    let per_word = tokens as f64 / words as f64;
    let evict_words = ((GPU_BLOCKS - tokens / BS + 14) * BS) as f64 / per_word;
    let evicting = complete(&stack, &filler(4700, evict_words as usize), Some(&holder)).await?;
    let evicting_tokens = evicting.prompt_tokens().unwrap_or(0);
    anyhow::ensure!(evicting_tokens < GPU_BLOCKS * BS, "{evicting_tokens} tokens fit the GPU");

    // The indexer has the CPU stores once its tier counter moves.
    let indexer = stack.indexer_url("/metrics");
    poll::until("the CPU tier's stores applied", || async {
        let m = stack.scrape(&indexer).await.ok()?;
        (m.sum("kvmesh_kv_blocks_total", &[("op", "tier_stored")]) > 0.0).then_some(())
    })
    .await?;
    // The holder idle in the indexer's view: no booking left (the predicted backlog is at most
    // the live bookings' tokens) and a scrape since the engine finished (its running requests
    // are the prediction's decode batch).
    let debug = stack.indexer_url("/debug/workers");
    poll::until("the holder idle in the indexer's view", || async {
        let all: serde_json::Value =
            stack.client().get(&debug).send().await.ok()?.json().await.ok()?;
        let w = all.as_array()?.iter().find(|w| w["id"] == holder.as_str())?;
        let idle = w["load"]["active_requests"] == 0
            && w["engine_running"].as_f64() == Some(0.0)
            && w["engine_waiting"].as_f64() == Some(0.0);
        idle.then_some(())
    })
    .await?;

    let again = complete(&stack, &prompt, None).await?;
    let reason = again.reason().unwrap_or_default().to_owned();
    assert_eq!(
        again.worker(),
        Some(holder.as_str()),
        "not routed to its holder ({other}): {reason}"
    );
    assert_eq!(again.header(headers::DEBUG_WORKER), Some(holder.as_str()), "{reason}");
    let gpu = again.overlap_blocks().unwrap_or(0);
    let cpu = cpu_blocks(&reason);
    assert!(gpu > 0 && cpu > 0, "GPU {gpu} and CPU {cpu} blocks predicted: {reason}");
    // The engine served from cache exactly the predicted GPU + CPU blocks.
    assert_eq!(
        again.cached_tokens(),
        Some((gpu + cpu) * BS),
        "predicted {gpu} GPU + {cpu} CPU blocks: {reason}"
    );
    // Predicted at the tier's cost: the CPU blocks at the load rate, the rest computed.
    let uncached = tokens - (gpu + cpu) * BS;
    let want_ms = 1000.0 * ((cpu * BS) as f64 / CPU_LOAD_TPS + uncached as f64 / PREFILL_TPS);
    let predicted: f64 = again
        .header(headers::DEBUG_PREDICTED_TTFT)
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no predicted TTFT header"))?;
    assert!(
        (predicted - want_ms).abs() < 0.5,
        "predicted {predicted} ms, want {want_ms:.3} ms ({cpu} CPU blocks at {CPU_LOAD_TPS} tokens/s, {uncached} tokens at {PREFILL_TPS}): {reason}"
    );
    // Dearer than the GPU, cheaper than recomputing the CPU blocks.
    let all_gpu = 1000.0 * uncached as f64 / PREFILL_TPS;
    let recompute = 1000.0 * (uncached + cpu * BS) as f64 / PREFILL_TPS;
    assert!(all_gpu < predicted && predicted < recompute, "{all_gpu} < {predicted} < {recompute}");
    Ok(())
}
