//! Hybrid attention groups end to end (issue 46.2): workers serving a hybrid model (vllm-sim
//! `--sliding-window`: a full-attention group and a sliding-window group of 64 tokens, whose events
//! carry `group_idx = 1`, `kv_cache_spec_kind = "sliding_window"` and the window, as vLLM's), and
//! the overlap the indexer predicts for a prompt equals what the engine then serves from cache —
//! also when the full-attention group alone would claim more: the window group evicted the blocks
//! the prompt's last window needs.

use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json, Reply};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const SECRET: &str = "e2e-override-secret-hybrid-groups-01";
const BS: u64 = 16;
/// The window group's pool: the smallest `--sliding-window-blocks` a window of 64 tokens and
/// steps of 1024 tokens allow (4 + 64 + 2 blocks), plus 2. Two prompts of ~40 blocks do not fit
/// together, so the second evicts the first one's blocks from the window group (the full-attention
/// group, 8192 blocks, keeps them).
const WINDOW_BLOCKS: u64 = 72;

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

/// Waits until the indexer applied every event batch worker `id` published, so a prediction can
/// be compared with the engine's hit exactly.
async fn settle(stack: &Stack, id: &str) -> anyhow::Result<()> {
    let engine = stack.worker(id)?.url("/metrics");
    let indexer = stack.indexer_url("/metrics");
    poll::until(&format!("the indexer applied every batch {id} published"), || async {
        let published = stack
            .scrape(&engine)
            .await
            .ok()?
            .sum("kvmesh_sim_kv_event_batches_total", &[("outcome", "published")]);
        let applied =
            stack.scrape(&indexer).await.ok()?.sum("kvmesh_kv_batches_total", &[("worker", id)]);
        (published > 0.0 && applied >= published).then_some(())
    })
    .await
}

/// Routes `prompt` (no override) and checks the prediction against the engine: routed to
/// `holder`, predicted overlap == the engine's `cached_tokens`. Returns the predicted blocks.
async fn predicted_equals_served(stack: &Stack, prompt: &str, holder: &str) -> anyhow::Result<u64> {
    settle(stack, holder).await?;
    // The holder idle in the indexer's view (no booking left, a scrape since the engine
    // finished), so nothing but the cache decides.
    let debug = stack.indexer_url("/debug/workers");
    poll::until("the holder idle in the indexer's view", || async {
        let all: serde_json::Value =
            stack.client().get(&debug).send().await.ok()?.json().await.ok()?;
        let w = all.as_array()?.iter().find(|w| w["id"] == holder)?;
        let idle = w["load"]["active_requests"] == 0
            && w["engine_running"].as_f64() == Some(0.0)
            && w["engine_waiting"].as_f64() == Some(0.0);
        idle.then_some(())
    })
    .await?;
    let r = complete(stack, prompt, None).await?;
    let reason = r.reason().unwrap_or_default().to_owned();
    assert_eq!(r.worker(), Some(holder), "not routed to its holder: {reason}");
    let predicted = r.overlap_blocks().unwrap_or(0);
    assert_eq!(
        r.cached_tokens(),
        Some(predicted * BS),
        "predicted {predicted} blocks, the engine served otherwise: {reason}"
    );
    Ok(predicted)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hybrid_models_predicted_overlap_is_what_its_engine_serves() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({
        "debug_headers": true,
        "allow_overrides": true,
        "override_secret": SECRET,
        "indexer_timeout_ms": 5000,
    });
    spec.sim_args = [
        "--sliding-window",
        "64",
        "--sliding-window-blocks",
        &WINDOW_BLOCKS.to_string(),
        "--max-num-batched-tokens",
        "1024",
    ]
    .map(str::to_owned)
    .to_vec();
    // No speculative holdings: the prompt's earlier decision would otherwise count as held.
    spec.routing_toml = "speculative_ttl_ms = 0\n".to_owned();
    let stack = Stack::start(spec).await?;
    let holder = stack.workers[0].id.clone();

    // A on the holder: ~40 blocks computed in one step, cached in both groups, then freed tail
    // first (a finished request's blocks).
    let words = 560;
    let a = filler(4800, words);
    let first = complete(&stack, &a, Some(&holder)).await?;
    let a_tokens = first.prompt_tokens().unwrap_or(0);
    anyhow::ensure!((24 * BS..60 * BS).contains(&a_tokens), "{a_tokens} prompt tokens");
    // E on the holder: the window group's unused blocks, A's partial block, then ~8 of A's
    // blocks from its tail (the window A's next hit needs).
    let unused = WINDOW_BLOCKS - a_tokens.div_ceil(BS);
    let per_word = a_tokens as f64 / words as f64;
    let e_words = ((unused + 1 + 8) * BS - BS / 2) as f64 / per_word;
    let e = filler(4900, e_words as usize);
    let evicting = complete(&stack, &e, Some(&holder)).await?;
    let e_tokens = evicting.prompt_tokens().unwrap_or(0);
    anyhow::ensure!(e_tokens < 1024, "{e_tokens} tokens: one step");

    // A again: the full-attention group holds all of it, the window group lost its tail, so
    // the engine serves less than A's leading match — and the indexer predicts exactly that.
    let full_attention_alone = (a_tokens - 1) / BS;
    let predicted = predicted_equals_served(&stack, &a, &holder).await?;
    let m = stack.scrape(&stack.indexer_url("/metrics")).await?;
    let group_removed = m.sum("kvmesh_kv_blocks_total", &[("op", "group_removed")]);
    assert!(
        predicted > 0 && predicted < full_attention_alone,
        "predicted {predicted} blocks of A, its full-attention match {full_attention_alone} ({group_removed} window blocks removed)"
    );
    assert!(group_removed > 0.0, "the window group's removals reached the indexer");
    assert_eq!(m.sum("kvmesh_kv_unknown_group_kind_events_total", &[]), 0.0);

    eprintln!(
        "A ({a_tokens} tokens): predicted = served = {predicted} blocks, full attention alone {full_attention_alone}"
    );
    // E again: both groups hold its last window: the whole leading match.
    let predicted = predicted_equals_served(&stack, &e, &holder).await?;
    assert_eq!(predicted, (e_tokens - 1) / BS);
    eprintln!("E ({e_tokens} tokens): predicted = served = {predicted} blocks");
    Ok(())
}
