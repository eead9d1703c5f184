//! Multimodal keys end to end (issue 46.3): chats with images on vllm-sim, which places and keys
//! media as vLLM does (`kvmesh_sim::media`: a placeholder expanded to 32 tokens per image, every
//! block overlapping it keyed by `(identifier, offset)` in its hash and its event's
//! `extra_keys`). The indexer predicts exactly the blocks before the first image and never one
//! after: the same text with another image is served from cache only that far, and a text-only
//! prompt equal up to the image no further either — predicted overlap == the engine's
//! `cached_tokens` both times. The same image again is served from cache past it, which the
//! indexer does not claim (it cannot know the engine's placeholder tokens: README "Multimodal keys").

use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json, Reply};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

const SECRET: &str = "e2e-override-secret-mm-keys-012345";
const BS: u64 = 16;

fn chat_body(system: &str, text: &str, image: Option<(&str, &str)>) -> Value {
    let mut content = Vec::new();
    if let Some((url, uuid)) = image {
        content.push(json!({"type": "image_url", "image_url": {"url": url}, "uuid": uuid}));
    }
    content.push(json!({"type": "text", "text": text}));
    json!({
        "model": "deepseek-v4",
        "max_tokens": 1,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
    })
}

async fn chat(stack: &Stack, body: &Value, worker: Option<&str>) -> anyhow::Result<Reply> {
    let h: Vec<(&str, &str)> = match worker {
        Some(w) => vec![(headers::OVERRIDE_WORKER, w), (headers::OVERRIDE_SECRET, SECRET)],
        None => Vec::new(),
    };
    let r = post_json(stack.client(), &stack.gateway("/v1/chat/completions"), body, &h).await?;
    anyhow::ensure!(r.status == 200, "status {}: {}", r.status, r.text);
    Ok(r)
}

/// Waits until the holder is idle in the indexer's view (no booking left, a scrape since the
/// engine finished), so the next route is decided by the cache alone, not by load.
async fn holder_idle(stack: &Stack, holder: &str) -> anyhow::Result<()> {
    let debug = stack.indexer_url("/debug/workers");
    poll::until("the holder idle in the indexer's view", || async {
        let all: Value = stack.client().get(&debug).send().await.ok()?.json().await.ok()?;
        let w = all.as_array()?.iter().find(|w| w["id"] == holder)?;
        let idle = w["load"]["active_requests"] == 0
            && w["engine_running"].as_f64() == Some(0.0)
            && w["engine_waiting"].as_f64() == Some(0.0);
        idle.then_some(())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_key_their_blocks_and_the_prediction_stops_before_the_first_one(
) -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({
        "debug_headers": true,
        "allow_overrides": true,
        "override_secret": SECRET,
        "indexer_timeout_ms": 5000,
    });
    // The prediction from the engines' events only (no speculative holdings of earlier routes),
    // and each chat (a new conversation) placed by its cache alone, not kept off the worker that
    // served the last one (`session_balance` off).
    spec.routing_toml = "speculative_ttl_ms = 0\nsession_balance = 0.0\n".to_owned();
    let stack = Stack::start(spec).await?;
    let holder = stack.workers[0].id.clone();
    let system = filler(4800, 500);
    let text = filler(4801, 150);
    let image_x = Some(("https://images.invalid/x.png", "img-x"));
    let image_y = Some(("https://images.invalid/y.png", "img-y"));

    // The first chat, with image x, on the holder: every full block cached there.
    let first = chat(&stack, &chat_body(&system, &text, image_x), Some(&holder)).await?;
    let tokens = first.prompt_tokens().unwrap_or(0);
    anyhow::ensure!(tokens > 40 * BS, "{tokens} prompt tokens");
    let indexer = stack.indexer_url("/metrics");
    poll::until("the first chat's blocks indexed", || async {
        let m = stack.scrape(&indexer).await.ok()?;
        let stored = m.sum("kvmesh_kv_blocks_total", &[("op", "stored")]);
        (stored as u64 >= tokens / BS).then_some(())
    })
    .await?;
    // Its image blocks' keys were read and used (none unusable).
    let m = stack.scrape(&indexer).await?;
    assert_eq!(m.sum("kvmesh_kv_unusable_extra_keys_total", &[]), 0.0);
    holder_idle(&stack, &holder).await?;

    // The same text with image y: the engine serves the blocks before the image from cache, and
    // the indexer predicts exactly those.
    let other = chat(&stack, &chat_body(&system, &text, image_y), None).await?;
    let reason = other.reason().unwrap_or_default().to_owned();
    assert_eq!(other.worker(), Some(holder.as_str()), "{reason}");
    let known = other.overlap_blocks().unwrap_or(0);
    assert!(known >= 10, "the system prompt's blocks predicted: {known} ({reason})");
    assert_eq!(other.cached_tokens(), Some(known * BS), "predicted {known} blocks: {reason}");
    assert!(known * BS + 2 * BS < tokens, "{known} blocks of {tokens} tokens");

    holder_idle(&stack, &holder).await?;
    // Text only, equal up to where the image was: no further either.
    let plain = chat(&stack, &chat_body(&system, &text, None), None).await?;
    let reason = plain.reason().unwrap_or_default().to_owned();
    assert_eq!(plain.worker(), Some(holder.as_str()), "{reason}");
    assert_eq!(plain.overlap_blocks(), Some(known), "{reason}");
    assert_eq!(plain.cached_tokens(), Some(known * BS), "{reason}");

    holder_idle(&stack, &holder).await?;
    // Image x again: the engine's cache serves it past the image (its keys match); the indexer
    // still predicts only the blocks before it.
    let again = chat(&stack, &chat_body(&system, &text, image_x), None).await?;
    let reason = again.reason().unwrap_or_default().to_owned();
    assert_eq!(again.worker(), Some(holder.as_str()), "{reason}");
    assert_eq!(again.overlap_blocks(), Some(known), "{reason}");
    let served = again.cached_tokens().unwrap_or(0);
    assert!(served > known * BS + 2 * BS, "served {served} tokens from cache: {reason}");

    let m = stack.scrape(&indexer).await?;
    assert!(m.sum("kvmesh_route_media_cut_total", &[]) >= 2.0, "media routes not counted");
    Ok(())
}
