//! Session affinity from derived keys (the filter's default configuration, no session header):
//! a multi-turn chat conversation (history resent every turn) stays on one worker, the indexer
//! predicts the reuse, and the engine's own prefix-cache counters confirm it; conversations that
//! only share a long system prompt are not collapsed onto one worker.

use std::collections::BTreeMap;

use futures::future::join_all;
use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const BLOCK: u64 = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_turn_chat_lands_on_one_worker_and_reuses_its_cache() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(4);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");

    let mut history =
        vec![("system".to_owned(), filler(1, 300)), ("user".to_owned(), filler(2, 120))];
    let mut home: Option<String> = None;
    let mut previous_isl = 0u64;
    for turn in 0..10 {
        let hits_before = match &home {
            Some(w) => stack
                .scrape(&stack.worker(w)?.url("/metrics"))
                .await?
                .sum("vllm:prefix_cache_hits_total", &[]),
            None => 0.0,
        };
        let reply = post_json(stack.client(), &url, &chat_body(&history, 24), &[]).await?;
        assert_eq!(reply.status, 200, "turn {turn}: {}", reply.text);
        let worker = reply.worker().expect("x-sim-worker").to_owned();
        let overlap = reply.overlap_blocks().expect("overlap header");
        let isl = reply.isl_blocks().expect("isl header");
        match &home {
            None => home = Some(worker.clone()),
            Some(h) => {
                assert_eq!(&worker, h, "turn {turn} moved off its worker ({:?})", reply.reason());
                assert!(
                    overlap * 10 >= previous_isl * 9,
                    "turn {turn}: predicted overlap {overlap} blocks < 90% of previous turn's {previous_isl}"
                );
                let hits = stack
                    .scrape(&stack.worker(h)?.url("/metrics"))
                    .await?
                    .sum("vllm:prefix_cache_hits_total", &[]);
                let engine_hit_tokens = (hits - hits_before) as u64;
                assert!(
                    engine_hit_tokens * 10 >= previous_isl * BLOCK * 9,
                    "turn {turn}: engine hit {engine_hit_tokens} tokens, previous turn had {} block tokens",
                    previous_isl * BLOCK
                );
                assert_eq!(
                    reply.cached_tokens(),
                    Some(engine_hit_tokens),
                    "usage.cached_tokens agrees with the counter"
                );
            }
        }
        previous_isl = isl;
        history.push(("assistant".to_owned(), reply.chat_content().unwrap_or_default()));
        history.push(("user".to_owned(), filler(100 + turn, 40)));
    }
    Ok(())
}

/// The collapse issue 11 measured: 8 conversations behind one 6 KB system prompt, each with its
/// own first user message, all went to one of two workers under a key cut at 4096 bytes. With the
/// conversation's whole anchor in the key, concurrent conversations spread over both workers and
/// each keeps its worker on its next turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversations_sharing_a_system_prompt_are_not_collapsed() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");
    let system = filler(9_000, 1_000);
    assert!(system.len() >= 6_000);
    let conversations = (0..8u64).map(|c| {
        let (system, url, stack) = (system.clone(), url.clone(), &stack);
        async move {
            let mut history =
                vec![("system".to_owned(), system), ("user".to_owned(), filler(9_100 + c, 60))];
            let mut workers = Vec::new();
            for turn in 0..2u64 {
                let reply = post_json(stack.client(), &url, &chat_body(&history, 16), &[]).await?;
                anyhow::ensure!(
                    reply.status == 200,
                    "conversation {c} turn {turn}: {}",
                    reply.text
                );
                workers.push(reply.worker().unwrap_or("?").to_owned());
                history.push(("assistant".to_owned(), reply.chat_content().unwrap_or_default()));
                history.push(("user".to_owned(), filler(9_200 + c * 2 + turn, 30)));
            }
            Ok::<_, anyhow::Error>(workers)
        }
    });
    let served: Vec<Vec<String>> =
        join_all(conversations).await.into_iter().collect::<anyhow::Result<_>>()?;
    let mut first_turns: BTreeMap<&str, usize> = BTreeMap::new();
    for w in &served {
        *first_turns.entry(w[0].as_str()).or_default() += 1;
    }
    assert_eq!(first_turns.len(), 2, "every conversation on one worker: {served:?}");
    let stayed = served.iter().filter(|w| w[0] == w[1]).count();
    assert!(
        stayed >= 7,
        "only {stayed} of 8 conversations kept their worker on turn 2: {served:?}"
    );
    Ok(())
}
