//! The indexer's side of "fail open, fail soft" (issue 14) through real Envoy, the filter, the
//! indexer and `vllm-sim` workers: load booked for a request is released exactly once on every
//! path — a client that goes away while its prefill leg runs, a filter that gives up on the
//! indexer (its call is reset), and ten clients that send one `x-request-id`.

use kvmesh_core::api::FleetSnapshot;
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

fn chat(words: usize, seed: u64) -> Value {
    json!({"model": "deepseek-v4", "messages": [{"role": "user", "content": filler(seed, words)}], "max_tokens": 4})
}

async fn fleet(stack: &Stack) -> Option<FleetSnapshot> {
    stack.client().get(stack.indexer_url("/v1/fleet")).send().await.ok()?.json().await.ok()
}

/// `(worker, booked active requests)` for every worker, from the indexer's fleet.
async fn active(stack: &Stack) -> Option<Vec<(String, u64)>> {
    Some(fleet(stack).await?.workers.into_iter().map(|w| (w.id, w.load.active_requests)).collect())
}

async fn until_idle(stack: &Stack, what: &str) -> anyhow::Result<()> {
    poll::until(what, || async { active(stack).await.filter(|a| a.iter().all(|(_, n)| *n == 0)) })
        .await
        .map(|_| ())
}

async fn indexer_metric(stack: &Stack, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
    Ok(stack.scrape(&stack.indexer_url("/metrics")).await?.sum(name, labels))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bookings_are_released_when_the_caller_goes_away() -> anyhow::Result<()> {
    let mut spec = StackSpec::disaggregated(1, 2);
    // The filter waits 1.5 s for the indexer; the prefill leg takes 4 s (slow prefill worker).
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": 1500});
    spec.routing_toml = "min_remote_prefill_tokens = 256\nprefill_timeout_ms = 8000\nunhealthy_after_failures = 0\n".into();
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/chat/completions");
    let faults = stack.worker("p0")?.url("/admin/faults");
    c.post(&faults).json(&json!({"extra_latency_ms": 4000})).send().await?.error_for_status()?;
    until_idle(&stack, "an idle fleet at start").await?;

    // 1. The client goes away while the prefill leg runs: Envoy resets the filter's indexer call,
    //    the route call is dropped, and its bookings (decode worker and prefill leg) are released.
    let pending = {
        let (c, url) = (c.clone(), url.clone());
        tokio::spawn(async move { post_json(&c, &url, &chat(600, 1), &[]).await })
    };
    poll::until("the prefill leg's booking", || async {
        active(&stack).await.filter(|a| a.iter().any(|(w, n)| w == "p0" && *n == 1))
    })
    .await?;
    pending.abort();
    let _ = pending.await;
    until_idle(&stack, "every booking released after the client left").await?;
    assert!(
        indexer_metric(&stack, "kvmesh_route_cancelled_total", &[("stage", "booked")]).await?
            >= 1.0
    );

    // 2. The filter gives up on the indexer (1.5 s < the 4 s leg) and routes without it: the
    //    client is served, and the abandoned route call leaves nothing booked.
    let r = post_json(&c, &url, &chat(600, 2), &[]).await?;
    assert_eq!(r.status, 200, "{}", r.text);
    until_idle(&stack, "every booking released after the filter's timeout").await?;
    assert!(
        indexer_metric(&stack, "kvmesh_route_cancelled_total", &[("stage", "booked")]).await?
            >= 2.0
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_clients_with_one_request_id_book_and_release_ten_times() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");
    let calls: Vec<_> = (0..10u64)
        .map(|i| {
            let (c, url) = (stack.client().clone(), url.clone());
            tokio::spawn(async move {
                post_json(&c, &url, &chat(200, 100 + i), &[("x-request-id", "the-same-id")]).await
            })
        })
        .collect();
    for call in calls {
        let r = call.await??;
        assert_eq!(r.status, 200, "{}", r.text);
    }
    // Ten decisions, ten bookings, ten matched done reports, nothing left booked.
    until_idle(&stack, "all ten bookings released").await?;
    let matched = poll::until("ten matched done reports", || async {
        let n = indexer_metric(&stack, "kvmesh_done_reports_total", &[("matched", "true")])
            .await
            .ok()?;
        (n >= 10.0).then_some(n)
    })
    .await?;
    assert_eq!(matched, 10.0);
    assert_eq!(
        indexer_metric(&stack, "kvmesh_done_reports_total", &[("matched", "false")]).await?,
        0.0
    );
    assert_eq!(indexer_metric(&stack, "kvmesh_decisions_total", &[]).await?, 10.0);
    Ok(())
}

fn tokens_prompt(tokens: &[u32]) -> Value {
    json!({"model": "deepseek-v4", "prompt": tokens, "max_tokens": 1})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_indexer_restart_a_prefix_older_than_the_replay_buffer_is_learned_back(
) -> anyhow::Result<()> {
    // One worker whose replay buffer keeps only 4 batches.
    let mut spec = StackSpec::aggregate(1);
    spec.filter_config = json!({"debug_headers": true});
    spec.sim_args = vec!["--kv-events-buffer-steps".into(), "4".into()];
    let mut stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/completions");
    // A warmed 64-block prefix (block size 16).
    let prefix: Vec<u32> = (0..1024).map(|i| 1000 + i).collect();
    let r = post_json(&c, &url, &tokens_prompt(&prefix), &[]).await?;
    assert_eq!(r.status, 200, "{}", r.text);
    // Unrelated traffic until the prefix's batch has left the replay buffer.
    for i in 0..12u32 {
        let other: Vec<u32> = (0..64).map(|t| 50_000 + i * 100 + t).collect();
        assert_eq!(post_json(&c, &url, &tokens_prompt(&other), &[]).await?.status, 200);
    }
    stack.restart_indexer().await?;

    // Continuations of the prefix: the first is blind (its prefix is unknown after the restart);
    // the engine stores its new blocks chained to the unknown block 63, and the indexer learns the
    // chain from the continuation it routed.
    let mut overlaps = Vec::new();
    for i in 0..10u32 {
        let mut tokens = prefix.clone();
        tokens.extend((0..32).map(|t| 90_000 + i * 100 + t));
        let r = post_json(&c, &url, &tokens_prompt(&tokens), &[]).await?;
        assert_eq!(r.status, 200, "{}", r.text);
        overlaps.push(r.overlap_blocks().unwrap_or(0));
    }
    assert_eq!(overlaps[0], 0, "the first continuation is blind after the restart: {overlaps:?}");
    assert!(
        overlaps.iter().any(|o| *o >= 64),
        "overlap never recovered within 10 continuations: {overlaps:?}"
    );
    assert!(indexer_metric(&stack, "kvmesh_kv_orphan_recovered_total", &[]).await? >= 1.0);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_template_calling_python_string_methods_is_routed_by_the_indexer(
) -> anyhow::Result<()> {
    // The DeepSeek template with `.strip()` on every message, as many Hugging Face templates do;
    // the engines render with the same file.
    let dir = tempfile::tempdir()?;
    let template = dir.path().join("strip.jinja");
    let source = include_str!("../../tokens/templates/deepseek.jinja")
        .replace("{{ m.content }}", "{{ m.content.strip() }}");
    anyhow::ensure!(source.contains(".strip()"), "the template changed shape");
    std::fs::write(&template, source)?;
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    spec.model_toml = format!("chat_template = {:?}\n", template.display().to_string());
    spec.sim_args = vec!["--chat-template".into(), template.display().to_string()];
    let stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");
    let turn = |n: usize| {
        let mut msgs = vec![
            json!({"role": "system", "content": format!("  {}  ", filler(7, 300))}),
            json!({"role": "user", "content": filler(8, 40)}),
        ];
        for i in 0..n {
            msgs.push(json!({"role": "assistant", "content": filler(20 + i as u64, 20)}));
            msgs.push(json!({"role": "user", "content": filler(40 + i as u64, 20)}));
        }
        json!({"model": "deepseek-v4", "messages": msgs, "max_tokens": 4})
    };
    let first = post_json(stack.client(), &url, &turn(0), &[]).await?;
    assert_eq!(first.status, 200, "{}", first.text);
    assert!(
        first.header("x-kvmesh-fallback").is_none(),
        "the filter fell back: {:?}",
        first.header("x-kvmesh-fallback")
    );
    assert_eq!(first.mode(), Some("aggregate"));
    // The next turn: the indexer's rendering agrees with the engine's, so it predicts the reuse.
    poll::until("the first turn's blocks in the index", || async {
        let r = post_json(stack.client(), &url, &turn(1), &[]).await.ok()?;
        (r.status == 200 && r.overlap_blocks().unwrap_or(0) > 0).then_some(())
    })
    .await?;
    assert_eq!(
        indexer_metric(&stack, "kvmesh_route_errors_total", &[("reason", "tokenizer")]).await?,
        0.0
    );
    Ok(())
}
