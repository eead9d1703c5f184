//! Attribution of the prefix-cache hit (issue 46), through real Envoy: the filter reads the
//! engine's `usage` from the end of every response (streamed with `include_usage`, or not) and
//! reports it with `/v1/done`; the indexer's `delivered` tokens then equal the engines' own
//! `vllm:prefix_cache_hits_total`, its split sums to what the prompts did not get from cache,
//! captured ≥ delivered holds for every request, and a conversation's next turn sent right after
//! the answer is predicted with the answer's blocks (delivered == captured, turn by turn).

use kvmesh_e2e::client::{chat_body, filler, post_json, Reply};
use kvmesh_e2e::poll;
use kvmesh_e2e::prom::Metrics;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

const MODEL: &str = "deepseek-v4";

/// The indexer's attribution counters, summed over models.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Attribution {
    attributed: f64,
    prompt: f64,
    available: f64,
    captured: f64,
    delivered: f64,
    workload: f64,
    routing: f64,
    not_delivered: f64,
    unpredicted: f64,
}

impl Attribution {
    fn of(m: &Metrics) -> Self {
        let lost = |cause| m.sum("kvmesh_attribution_lost_tokens_total", &[("cause", cause)]);
        Self {
            attributed: m.sum("kvmesh_attribution_requests_total", &[("result", "attributed")]),
            prompt: m.sum("kvmesh_attribution_prompt_tokens_total", &[]),
            available: m.sum("kvmesh_attribution_available_tokens_total", &[]),
            captured: m.sum("kvmesh_attribution_captured_tokens_total", &[]),
            delivered: m.sum("kvmesh_attribution_delivered_tokens_total", &[]),
            workload: lost("workload"),
            routing: lost("routing"),
            not_delivered: lost("not_delivered"),
            unpredicted: m.sum("kvmesh_attribution_unpredicted_tokens_total", &[]),
        }
    }
}

/// The attribution once `n` requests are attributed (done reports are sent in the background).
async fn attributed(stack: &Stack, n: usize) -> anyhow::Result<Attribution> {
    poll::until(&format!("{n} requests attributed"), || async {
        let m = stack.scrape(&stack.indexer_url("/metrics")).await.ok()?;
        let a = Attribution::of(&m);
        (a.attributed >= n as f64).then_some(a)
    })
    .await
}

fn cached(r: &Reply, streamed: bool) -> Option<u64> {
    if streamed {
        r.stream_cached_tokens()
    } else {
        r.cached_tokens()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivered_equals_the_engines_counters_and_the_split_sums() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(3);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let completions = stack.gateway("/v1/completions");
    let chat = stack.gateway("/v1/chat/completions");
    let shared = filler(7, 1200);
    let mut sent = 0usize;
    let mut engine_cached = 0u64;
    // Completions, half streamed with usage: long prompts sharing a prefix, short unique ones.
    for i in 0..24u64 {
        let streamed = i % 2 == 0;
        let prompt =
            if i % 3 == 0 { filler(900 + i, 80) } else { format!("{shared} {}", filler(i, 30)) };
        let mut body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 3});
        if streamed {
            body["stream"] = json!(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let r = post_json(&c, &completions, &body, &[]).await?;
        assert_eq!(r.status, 200, "{}", r.text);
        engine_cached += cached(&r, streamed).unwrap_or_default();
        sent += 1;
    }
    // Three conversations, turns interleaved.
    let mut talks: Vec<Vec<(String, String)>> =
        (0..3).map(|k| vec![("system".to_owned(), filler(50 + k, 400))]).collect();
    for turn in 0..4u64 {
        for (k, talk) in talks.iter_mut().enumerate() {
            talk.push(("user".into(), filler(1000 * k as u64 + turn, 25)));
            let r = post_json(&c, &chat, &chat_body(talk, 12), &[]).await?;
            assert_eq!(r.status, 200, "{}", r.text);
            engine_cached += r.cached_tokens().unwrap_or_default();
            talk.push(("assistant".into(), r.chat_content().unwrap_or_default()));
            sent += 1;
        }
    }

    let a = attributed(&stack, sent).await?;
    let hits = stack.engine_sum("vllm:prefix_cache_hits_total").await?;
    let queries = stack.engine_sum("vllm:prefix_cache_queries_total").await?;
    eprintln!("{a:?}; engines: hits {hits}, queries {queries}; clients saw {engine_cached} cached");
    assert_eq!(a.attributed, sent as f64, "every request attributed");
    assert_eq!(a.delivered, hits, "delivered is the engines' own prefix-cache hits");
    assert_eq!(a.delivered, engine_cached as f64, "and what the clients read in usage");
    assert_eq!(a.prompt, queries, "over the engines' own prompt tokens");
    assert!(a.available >= a.captured && a.prompt >= a.available, "{a:?}");
    assert_eq!(a.unpredicted, 0.0, "captured >= delivered on every request: {a:?}");
    assert_eq!(
        a.prompt - a.delivered,
        a.workload + a.routing + a.not_delivered - a.unpredicted,
        "the split sums"
    );
    assert!(a.delivered > 0.0 && a.workload > 0.0, "both hits and cold prompts: {a:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn back_to_back_turns_are_predicted_with_the_answers_blocks() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/chat/completions");
    let mut messages: Vec<Value> = vec![json!({"role": "system", "content": filler(3, 300)})];
    let mut before = attributed(&stack, 0).await?;
    for turn in 0..6u64 {
        messages.push(json!({"role": "user", "content": filler(40 + turn, 12)}));
        // Long answers: most of the answer's blocks fill while it is generated; the last ones
        // are what the next turn, sent at once, needs credited.
        let body = json!({"model": MODEL, "messages": messages, "max_tokens": 40,
            "stream": true, "stream_options": {"include_usage": true}});
        let r = post_json(&c, &url, &body, &[]).await?;
        assert_eq!(r.status, 200, "{}", r.text);
        let now = attributed(&stack, turn as usize + 1).await?;
        let (captured, delivered) =
            (now.captured - before.captured, now.delivered - before.delivered);
        eprintln!("turn {turn}: captured {captured}, delivered {delivered}");
        if turn > 0 {
            assert!(delivered > 0.0, "turn {turn} found its history");
            assert_eq!(captured, delivered, "turn {turn}: delivered == captured");
        }
        before = now;
        messages.push(json!({"role": "assistant", "content": r.stream_text()}));
    }
    let m = stack.scrape(&stack.indexer_url("/metrics")).await?;
    assert!(m.sum("kvmesh_speculative_answer_credits_total", &[]) >= 5.0);
    Ok(())
}
