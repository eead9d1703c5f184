//! kvmesh in front of two real vLLM CPU engines (`make test-vllm`; needs `scripts/setup-vllm.sh`).
//!
//! One stack (real Envoy + filter + indexer + 2 vLLM engines, one per core) serves every check, in
//! order, each against what the engine itself reports:
//! 1. tokenization and chat template: the indexer's token count == the engine's `prompt_tokens`
//!    over 200 generated conversations (unicode, whitespace runs, special-token text);
//! 2. calibration: every continuation turn's predicted overlap × block size == `cached_tokens`,
//!    and the indexer's attribution delivers exactly the engine's `cached_tokens` on every request;
//! 3. KV events, replay and metric names: no decode errors or gaps; an indexer restart rebuilds the
//!    same index from the engines' replay; every `vllm:` series vllm-sim exports exists on the real
//!    engine with the same labels (`engine="0"`, `model_name`, bucket bounds, finish reasons);
//! 4. streaming through Envoy with the official `openai` client, and a context overflow answered
//!    with vLLM's own 400;
//! 5. an engine killed with SIGKILL and restarted: requests meanwhile go to the other engine, its
//!    blocks leave the index and come back from its new event stream.

mod vllm_common;

use std::collections::{BTreeMap, BTreeSet};

use kvmesh_core::headers;
use kvmesh_core::openai::{parse, Endpoint};
use kvmesh_e2e::client::{post_json, Reply};
use kvmesh_e2e::poll;
use kvmesh_e2e::procs::repo_root;
use kvmesh_e2e::stack::Stack;
use kvmesh_e2e::vllm::{VllmOptions, MODEL_NAME};
use serde_json::{json, Value};
use vllm_common::{
    attributed_past, awkward_conversation, awkward_text, index_overlap, index_view, settle, start,
    usage, EventWatch, Rng, BLOCK,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvmesh_on_real_vllm_engines() -> anyhow::Result<()> {
    let mut stack = start(VllmOptions::default()).await?;
    let w0 = EventWatch::start(stack.workers[0].kv_events.as_deref().unwrap_or_default())?;
    let w1 = EventWatch::start(stack.workers[1].kv_events.as_deref().unwrap_or_default())?;

    tokenization_matches_the_engine(&stack).await?;
    calibration(&stack, &[("w0", &w0), ("w1", &w1)]).await?;
    events_replay_and_metrics(&mut stack, &[("w0", &w0), ("w1", &w1)]).await?;
    streaming_and_errors(&stack).await?;
    drop((w0, w1));
    engine_killed_and_restarted(&mut stack).await?;
    Ok(())
}

/// 1. The indexer's tokenizer (its own `PromptTokenizer`, the built-in template) against the
///    engine's `usage.prompt_tokens`, chat and completions.
async fn tokenization_matches_the_engine(stack: &Stack) -> anyhow::Result<()> {
    let tok = kvmesh_indexer::tokenize::PromptTokenizer::load(
        &kvmesh_tokens::default_tokenizer_path(),
        None,
        "<｜begin▁of▁sentence｜>",
        1 << 20,
    )?;
    let url_chat = stack.workers[0].url("/v1/chat/completions");
    let url_comp = stack.workers[0].url("/v1/completions");
    let mut rng = Rng::new(2026);
    let (mut same, mut diffs) = (0, Vec::new());
    for i in 0..200 {
        let (url, endpoint, body) = if i % 10 == 9 {
            (
                &url_comp,
                Endpoint::Completions,
                json!({"model": MODEL_NAME, "prompt": awkward_text(&mut rng, 40, 1), "max_tokens": 1}),
            )
        } else {
            (
                &url_chat,
                Endpoint::ChatCompletions,
                json!({"model": MODEL_NAME, "messages": awkward_conversation(&mut rng), "max_tokens": 1}),
            )
        };
        let ours = tok
            .tokens(&parse(endpoint, &serde_json::to_vec(&body)?)?.input, &mut Default::default())?
            .len() as u64;
        let r = post_json(stack.client(), url, &body, &[]).await?;
        anyhow::ensure!(
            r.status == 200,
            "engine refused conversation {i}: {} {}",
            r.status,
            r.text
        );
        let (theirs, _) =
            usage(&r.json()).ok_or_else(|| anyhow::anyhow!("no usage in {}", r.text))?;
        if ours == theirs {
            same += 1;
        } else {
            diffs.push((i, ours, theirs, body));
        }
    }
    eprintln!("tokenization: {same}/200 conversations with the engine's prompt_tokens");
    for (i, ours, theirs, body) in diffs.iter().take(5) {
        eprintln!("  #{i}: indexer {ours}, engine {theirs}: {body}");
    }
    assert!(diffs.is_empty(), "{} of 200 token counts differ", diffs.len());
    Ok(())
}

/// 2. Multi-turn conversations through the gateway: each continuation's predicted overlap × block
///    size is the engine's `cached_tokens`, and a conversation stays on its worker.
async fn calibration(stack: &Stack, watches: &[(&str, &EventWatch)]) -> anyhow::Result<()> {
    let url = stack.gateway("/v1/chat/completions");
    let mut rng = Rng::new(7);
    let mut turns = Vec::new();
    // Attribution (issue 46): the delivered tokens the indexer books per request, from the usage
    // the filter reads off the response's end, against the engine's own `cached_tokens`.
    let mut attributed = attributed_past(stack, -1.0).await?;
    let mut delivered = Vec::new();
    for conv in 0..4 {
        let session = format!("calibration-{conv}");
        let mut msgs = vec![json!({"role": "system", "content": awkward_text(&mut rng, 120, 1)})];
        let mut worker = None;
        for turn in 0..4 {
            msgs.push(json!({"role": "user", "content": format!("turn {turn}: {}", awkward_text(&mut rng, 30, 40))}));
            settle(stack, watches).await?;
            let body =
                json!({"model": MODEL_NAME, "messages": msgs, "max_tokens": 8 + rng.below(24)});
            let r = post_json(
                stack.client(),
                &url,
                &body,
                &[(headers::DEFAULT_SESSION_HEADER, &session)],
            )
            .await?;
            anyhow::ensure!(r.status == 200, "{} {}", r.status, r.text);
            let (prompt, cached) = usage(&r.json()).unwrap_or_default();
            let now = attributed_past(stack, attributed.requests).await?;
            delivered.push((now.delivered - attributed.delivered, cached as f64));
            attributed = now;
            let overlap = r.overlap_blocks().unwrap_or(u64::MAX);
            let w = r.header(headers::DEBUG_WORKER).unwrap_or("?").to_owned();
            if turn > 0 {
                turns.push((conv, turn, overlap * BLOCK, cached, prompt));
                assert_eq!(
                    worker.as_deref(),
                    Some(w.as_str()),
                    "conversation {conv} moved at turn {turn}"
                );
            }
            worker = Some(w);
            msgs.push(
                json!({"role": "assistant", "content": r.chat_content().unwrap_or_default()}),
            );
        }
    }
    let equal = turns.iter().filter(|(_, _, p, c, _)| p == c).count();
    eprintln!("calibration: {equal}/{} continuation turns with predicted overlap x {BLOCK} == cached_tokens", turns.len());
    for (conv, turn, predicted, cached, prompt) in &turns {
        eprintln!("  conversation {conv} turn {turn}: predicted {predicted}, cached {cached}, prompt {prompt}");
    }
    assert_eq!(equal, turns.len());
    assert!(turns.iter().all(|t| t.3 > 0), "every continuation hits its history");
    let same = delivered.iter().filter(|(d, c)| d == c).count();
    eprintln!("attribution: {same}/{} requests with delivered == cached_tokens", delivered.len());
    assert_eq!(same, delivered.len(), "delivered vs cached_tokens per request: {delivered:?}");
    Ok(())
}

/// 3. The indexer consumed both engines' streams cleanly; after an indexer restart its replay
///    rebuilds exactly the same index; the real engine exports every `vllm:` series vllm-sim does,
///    labelled alike.
async fn events_replay_and_metrics(
    stack: &mut Stack,
    watches: &[(&str, &EventWatch)],
) -> anyhow::Result<()> {
    settle(stack, watches).await?;
    let mut before = BTreeMap::new();
    for (id, watch) in watches {
        let v = index_view(stack, id).await?;
        eprintln!(
            "events {id}: engine published {} batches (last seq {:?}); indexer {v:?}",
            watch.batches(),
            watch.last_seq()
        );
        assert_eq!((v.decode_errors, v.gaps), (0, 0), "{id}: {v:?}");
        before.insert(id.to_string(), v.blocks_held);
    }
    assert!(before.values().sum::<u64>() > 0, "the workload stored blocks");
    stack.restart_indexer().await?;
    for (id, _) in watches {
        let v = index_view(stack, id).await?;
        eprintln!(
            "replay {id}: {} blocks before the indexer restart, {} after ({} replays)",
            before[*id], v.blocks_held, v.replays
        );
        assert_eq!(v.blocks_held, before[*id], "{id}: replay rebuilt another index");
    }

    // Metric names and labels: every `vllm:` series of the simulator, on the real engine.
    let real_text =
        stack.client().get(stack.workers[0].url("/metrics")).send().await?.text().await?;
    let real = kvmesh_e2e::prom::parse(&real_text)?;
    let sim = kvmesh_e2e::prom::parse(
        &kvmesh_sim::metrics::Metrics::new(MODEL_NAME, 0, BLOCK as usize, 64, 8192).render(),
    )?;
    let key = |s: &kvmesh_e2e::prom::Sample| -> (String, BTreeSet<(String, String)>) {
        let labels = s
            .labels
            .iter()
            .filter(|(k, _)| {
                s.name != "vllm:cache_config_info"
                    || ["engine", "block_size", "enable_prefix_caching"].contains(&k.as_str())
            })
            .cloned()
            .collect();
        (s.name.clone(), labels)
    };
    let real_keys: BTreeSet<_> = real
        .iter()
        .map(|s| {
            let (name, labels) = key(s);
            (
                name,
                labels.into_iter().filter(|(k, _)| k != "num_gpu_blocks").collect::<BTreeSet<_>>(),
            )
        })
        .collect();
    let mut missing = Vec::new();
    let mut checked = 0;
    for s in sim.iter().filter(|s| s.name.starts_with("vllm:")) {
        let (name, labels) = key(s);
        let labels: BTreeSet<_> =
            labels.into_iter().filter(|(k, _)| k != "num_gpu_blocks").collect();
        checked += 1;
        if !real_keys.contains(&(name.clone(), labels.clone())) {
            missing.push(format!("{name}{labels:?}"));
        }
    }
    let real_names: BTreeSet<&str> =
        real.iter().map(|s| s.name.as_str()).filter(|n| n.starts_with("vllm:")).collect();
    eprintln!("metrics: {checked} vllm-sim series checked against the real engine's {} vllm: series names; {} missing", real_names.len(), missing.len());
    for m in &missing {
        eprintln!("  not on the real engine: {m}");
    }
    assert!(real
        .iter()
        .any(|s| s.name == "vllm:prefix_cache_queries_total" && s.label("engine") == Some("0")));
    assert!(missing.is_empty(), "{} simulator series differ from vLLM's", missing.len());
    Ok(())
}

/// 4. The official `openai` client (streaming and not) through Envoy, and a prompt beyond
///    `max_model_len` answered with vLLM's 400 through the gateway, shaped as vllm-sim shapes it.
async fn streaming_and_errors(stack: &Stack) -> anyhow::Result<()> {
    let python = repo_root().join(".tools/venv/bin/python");
    let out = tokio::process::Command::new(python)
        .arg(repo_root().join("e2e/tests/openai_client.py"))
        .arg(stack.gateway(""))
        .output()
        .await?;
    assert!(
        out.status.success(),
        "openai client failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("openai client through Envoy: {}", String::from_utf8_lossy(&out.stdout).trim());

    let long = "the kv cache routes ".repeat(3000);
    let r: Reply = post_json(
        stack.client(),
        &stack.gateway("/v1/chat/completions"),
        &json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": long}], "max_tokens": 16}),
        &[],
    )
    .await?;
    let err: Value = r.json();
    eprintln!(
        "context overflow through the gateway: {} {}",
        r.status,
        r.text.chars().take(300).collect::<String>()
    );
    assert_eq!(r.status, 400);
    assert!(
        err.pointer("/error/message")
            .and_then(Value::as_str)
            .is_some_and(|m| m.contains("maximum context length")
                || m.contains("max_model_len")
                || m.contains("context")),
        "{err}"
    );
    assert_eq!(err.pointer("/error/code").and_then(Value::as_u64), Some(400), "{err}");
    assert!(err.pointer("/error/type").and_then(Value::as_str).is_some(), "{err}");
    // vllm-sim answers the same prompt with the same message and param.
    let tok = kvmesh_tokens::Tokenizer::from_file(kvmesh_tokens::default_tokenizer_path())?;
    let rendered = kvmesh_tokens::ChatTemplate::deepseek()?.render(
        &[kvmesh_core::openai::ChatMessage { role: "user".into(), content: long.clone().into() }],
        true,
    )?;
    let n = tok.encode(&rendered)?.len();
    let sim = kvmesh_sim::api::request::fit_context(
        8192,
        n,
        true,
        16,
        kvmesh_sim::sched::FinishReason::Length,
    )
    .err()
    .map(|e| (e.message, e.param));
    assert_eq!(
        sim.as_ref().map(|(m, p)| (m.as_str(), *p)),
        err.pointer("/error/message")
            .and_then(Value::as_str)
            .map(|m| (m, err.pointer("/error/param").and_then(Value::as_str))),
        "vllm-sim's 400 differs"
    );

    // Prompt + max_tokens beyond the context: vLLM clamps max_tokens (no error), and so does vllm-sim.
    let prompt: Vec<u32> = (0..8190).map(|i| 1000 + i % 5000).collect();
    let r = post_json(
        stack.client(),
        &stack.workers[0].url("/v1/completions"),
        &json!({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 40}),
        &[],
    )
    .await?;
    let v = r.json();
    let got = (
        r.status,
        v.pointer("/usage/completion_tokens").and_then(Value::as_u64),
        v.pointer("/choices/0/finish_reason").and_then(Value::as_str).map(str::to_owned),
    );
    eprintln!("prompt 8190 + max_tokens 40 on max_model_len 8192: {got:?}");
    let sim = kvmesh_sim::api::request::fit_context(
        8192,
        8190,
        false,
        40,
        kvmesh_sim::sched::FinishReason::Length,
    )
    .map_err(|e| anyhow::anyhow!(e.message))?;
    assert_eq!(got, (200, Some(u64::from(sim.0)), Some("length".to_owned())));
    Ok(())
}

/// 5. SIGKILL one engine mid-run, then start it again on the same ports.
async fn engine_killed_and_restarted(stack: &mut Stack) -> anyhow::Result<()> {
    let url = stack.gateway("/v1/chat/completions");
    // A conversation that lives on w1.
    let mut session = None;
    for i in 0..40 {
        let s = format!("doomed-{i}");
        let body = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": format!("{s}: {}", "history ".repeat(200))}], "max_tokens": 4});
        let r = post_json(stack.client(), &url, &body, &[(headers::DEFAULT_SESSION_HEADER, &s)])
            .await?;
        if r.status == 200 && r.header(headers::DEBUG_WORKER) == Some("w1") {
            session = Some((s, body));
            break;
        }
    }
    let (session, body) = session.ok_or_else(|| anyhow::anyhow!("no session landed on w1"))?;
    let held = poll::until("w1's blocks in the index", || async {
        index_view(stack, "w1").await.ok().filter(|v| v.blocks_held > 0)
    })
    .await?;
    eprintln!(
        "kill: w1 holds {} blocks in the index; SIGKILL to its process group",
        held.blocks_held
    );
    stack.kill_worker("w1")?;

    // Meanwhile every request is served: until a scrape marks w1 down the indexer may still decide
    // w1, and Envoy retries the refused connection on w0. The header is the decision, not the host.
    let mut decided = BTreeMap::<String, u32>::new();
    for i in 0..8 {
        let s = if i % 2 == 0 { session.clone() } else { format!("other-{i}") };
        let r = post_json(stack.client(), &url, &body, &[(headers::DEFAULT_SESSION_HEADER, &s)])
            .await?;
        assert_eq!(r.status, 200, "request {i} while w1 is down: {}", r.text);
        *decided
            .entry(
                r.header(headers::DEBUG_WORKER)
                    .or(r.header(headers::DEBUG_FALLBACK))
                    .unwrap_or("?")
                    .to_owned(),
            )
            .or_default() += 1;
    }
    eprintln!("while w1 is down: 8/8 answered 200; decided (or fallback) {decided:?}");
    let down = poll::until("the indexer marks w1 unhealthy", || async {
        index_view(stack, "w1").await.ok().filter(|v| !v.healthy)
    })
    .await?;
    eprintln!("w1 down: indexer says {down:?}");
    let r = post_json(stack.client(), &url, &body, &[(headers::DEFAULT_SESSION_HEADER, &session)])
        .await?;
    assert_eq!(
        (r.status, r.header(headers::DEBUG_WORKER)),
        (200, Some("w0")),
        "w1's session goes to w0 once w1 is known down"
    );

    stack.restart_vllm_worker("w1").await?;
    poll::until("the indexer sees w1 healthy again", || async {
        index_view(stack, "w1").await.ok().filter(|v| v.healthy)
    })
    .await?;
    let stale = index_view(stack, "w1").await?;
    let watch = EventWatch::start(stack.workers[1].kv_events.as_deref().unwrap_or_default())?;
    // Until the restarted engine publishes, the index still holds its old blocks (nothing tells
    // the indexer the cache is empty): the prediction for the old prompt on w1 is stale.
    let stale_overlap = index_overlap(stack, "w1", "/v1/chat/completions", &body).await.ok();
    let fresh_body = json!({"model": MODEL_NAME, "messages": [{"role": "user", "content": format!("after the restart: {}", "fresh ".repeat(300))}], "max_tokens": 4});
    // Its first batch (sequence 0 again) tells the indexer the engine restarted: the old blocks go
    // (resync "engine_restart") and the new stream's come in.
    let first =
        post_json(stack.client(), &stack.workers[1].url("/v1/chat/completions"), &fresh_body, &[])
            .await?;
    assert_eq!(first.status, 200, "{}", first.text);
    let fresh = poll::until("w1's old blocks replaced by its new stream's", || async {
        index_view(stack, "w1").await.ok().filter(|v| {
            v.resyncs > stale.resyncs && v.blocks_held > 0 && v.last_seq < stale.last_seq
        })
    })
    .await?;
    eprintln!(
        "w1 restarted: {} stale blocks until its first batch (probe overlap {stale_overlap:?}); then resyncs {} -> {}, {} blocks from its new event stream",
        stale.blocks_held, stale.resyncs, fresh.resyncs, fresh.blocks_held
    );
    assert!(fresh.blocks_held < stale.blocks_held, "only the new engine's blocks remain");
    // And the index is calibrated again: the fresh prompt goes to w1, predicted == cached.
    settle(stack, &[("w1", &watch)]).await?;
    let again = post_json(
        stack.client(),
        &url,
        &fresh_body,
        &[(headers::DEFAULT_SESSION_HEADER, "after-restart")],
    )
    .await?;
    let (_, cached) = usage(&again.json()).unwrap_or_default();
    let predicted = again.overlap_blocks().unwrap_or(u64::MAX) * BLOCK;
    eprintln!(
        "w1 after restart: decision {:?}, predicted {predicted}, cached {cached}",
        again.header(headers::DEBUG_WORKER)
    );
    assert_eq!((again.header(headers::DEBUG_WORKER), predicted), (Some("w1"), cached));
    assert!(cached > 0);
    Ok(())
}
