//! A multi-turn chat conversation (history resent every turn) stays on one worker, the indexer
//! predicts the reuse, and the engine's own prefix-cache counters confirm it.

use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::json;

const BLOCK: u64 = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_turn_chat_lands_on_one_worker_and_reuses_its_cache() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(4);
    spec.filter_config = json!({"debug_headers": true, "session_prefix_units": 4096});
    let stack = Stack::start(spec).await?;
    let url = stack.gateway("/v1/chat/completions");

    let mut history = vec![("system".to_owned(), filler(1, 300)), ("user".to_owned(), filler(2, 120))];
    let mut home: Option<String> = None;
    let mut previous_isl = 0u64;
    for turn in 0..10 {
        let hits_before = match &home {
            Some(w) => stack.scrape(&stack.worker(w)?.url("/metrics")).await?.sum("vllm:prefix_cache_hits_total", &[]),
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
                let hits = stack.scrape(&stack.worker(h)?.url("/metrics")).await?.sum("vllm:prefix_cache_hits_total", &[]);
                let engine_hit_tokens = (hits - hits_before) as u64;
                assert!(
                    engine_hit_tokens * 10 >= previous_isl * BLOCK * 9,
                    "turn {turn}: engine hit {engine_hit_tokens} tokens, previous turn had {} block tokens",
                    previous_isl * BLOCK
                );
                assert_eq!(reply.cached_tokens(), Some(engine_hit_tokens), "usage.cached_tokens agrees with the counter");
            }
        }
        previous_isl = isl;
        history.push(("assistant".to_owned(), reply.chat_content().unwrap_or_default()));
        history.push(("user".to_owned(), filler(100 + turn, 40)));
    }
    Ok(())
}
