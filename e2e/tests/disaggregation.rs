//! Conditional disaggregation through real Envoy, the indexer and `vllm-sim` prefill and decode
//! workers: short prompts stay aggregate, long cold ones get a prefill leg whose KV the decode
//! worker pulls, continuations stay local, and every way a prefill leg can fail either falls back
//! to the decode worker or — for overload — reaches the client as 429.

use std::collections::BTreeMap;

use kvmesh_core::api::{FleetSnapshot, ReasonCode};
use kvmesh_core::headers::DEFAULT_SESSION_HEADER;
use kvmesh_e2e::client::{filler, post_json, Reply};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

/// Tokens per block in these fleets.
const BS: u64 = 16;

fn chat(messages: &[(&str, String)], stream: bool) -> Value {
    let msgs: Vec<Value> = messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
    let mut body =
        json!({"model": "deepseek-v4", "messages": msgs, "max_tokens": 6, "stream": stream});
    if stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    body
}

/// Per worker id, the sum of `name` on its `/metrics` (with `labels`).
async fn per_worker(
    stack: &Stack,
    name: &str,
    labels: &[(&str, &str)],
) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for w in &stack.workers {
        out.insert(w.id.clone(), stack.scrape(&w.url("/metrics")).await?.sum(name, labels));
    }
    Ok(out)
}

fn delta(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0)))
        .filter(|(_, d)| *d != 0.0)
        .collect()
}

fn mode(r: &Reply) -> &str {
    r.mode().unwrap_or("-")
}

/// What the other decode worker answers for the same body, served aggregate: the reference text.
async fn direct_text(stack: &Stack, not: &str, body: &Value) -> anyhow::Result<String> {
    let other = stack
        .workers
        .iter()
        .find(|w| w.role.decodes() && w.id != not)
        .map(|w| w.url("/v1/chat/completions"));
    let mut b = body.clone();
    b["stream"] = json!(false);
    b.as_object_mut().map(|o| o.remove("stream_options"));
    let r = post_json(stack.client(), &other.unwrap_or_default(), &b, &[]).await?;
    anyhow::ensure!(r.status == 200, "direct request failed: {}", r.text);
    Ok(r.chat_content().unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_are_disaggregated_and_continuations_stay_local() -> anyhow::Result<()> {
    let mut spec = StackSpec::disaggregated(2, 2);
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": 8000});
    spec.routing_toml =
        "min_remote_prefill_tokens = 1024\nprefill_timeout_ms = 5000\nlocal_continuations = true\n"
            .into();
    let mut stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/chat/completions");

    // A short prompt: aggregate on a decode worker, no prefill traffic.
    let prompts_before = per_worker(&stack, "vllm:prompt_tokens_total", &[]).await?;
    let r = post_json(
        &c,
        &url,
        &chat(&[("user", filler(1, 40))], true),
        &[(DEFAULT_SESSION_HEADER, "short")],
    )
    .await?;
    assert_eq!((r.status, mode(&r)), (200, "aggregate"), "{} {:?}", r.text, r.reason());
    assert!(r.worker().is_some_and(|w| w.starts_with('d')), "served by {:?}", r.worker());
    let served =
        delta(&per_worker(&stack, "vllm:prompt_tokens_total", &[]).await?, &prompts_before);
    assert!(
        served.keys().all(|w| w.starts_with('d')),
        "a prefill worker saw the short prompt: {served:?}"
    );

    // A long cold conversation: disagg. One prefill worker serves one token, the decode worker pulls.
    let transfers0 =
        per_worker(&stack, "kvmesh_sim_nixl_transfers_total", &[("outcome", "served")]).await?;
    let gen0 = per_worker(&stack, "vllm:generation_tokens_total", &[]).await?;
    let hits0 = per_worker(&stack, "vllm:prefix_cache_hits_total", &[]).await?;
    let system = filler(2, 1500);
    let turn1 = vec![("system", system.clone()), ("user", filler(3, 60))];
    let body1 = chat(&turn1, true);
    let r1 = post_json(&c, &url, &body1, &[(DEFAULT_SESSION_HEADER, "chat-1")]).await?;
    assert_eq!((r1.status, mode(&r1)), (200, "disagg"), "{} {:?}", r1.text, r1.reason());
    let home = r1.worker().unwrap_or_default().to_owned();
    assert!(home.starts_with('d'), "disagg served by {home}");
    let reason = r1.reason().unwrap_or_default();
    assert!(r1.reason_codes().contains(&ReasonCode::DisaggUncached), "{reason}");
    let producers = delta(
        &per_worker(&stack, "kvmesh_sim_nixl_transfers_total", &[("outcome", "served")]).await?,
        &transfers0,
    );
    assert_eq!(producers.len(), 1, "one prefill worker produced: {producers:?}");
    let producer = producers.keys().next().cloned().unwrap_or_default();
    assert!(
        producer.starts_with('p') && reason.contains(&format!("prefill on {producer}")),
        "{producer}: {reason}"
    );
    let generated = delta(&per_worker(&stack, "vllm:generation_tokens_total", &[]).await?, &gen0);
    assert_eq!(
        generated.get(&producer),
        Some(&1.0),
        "the prefill worker generates one token: {generated:?}"
    );
    let pulls = stack
        .scrape(&stack.worker(&home)?.url("/metrics"))
        .await?
        .sum("kvmesh_sim_nixl_pulls_total", &[("outcome", "ok")]);
    assert_eq!(pulls, 1.0, "{home} pulled the prompt's KV");
    let isl_blocks = r1.isl_blocks().unwrap_or(0);
    assert!(isl_blocks * BS >= 1024, "{isl_blocks} blocks");
    let cached = r1.stream_cached_tokens().unwrap_or(0);
    assert!(
        cached >= (isl_blocks - 1) * BS,
        "the decode worker reports {cached} cached tokens of {isl_blocks} blocks"
    );
    let hits = delta(&per_worker(&stack, "vllm:prefix_cache_hits_total", &[]).await?, &hits0);
    assert!(
        hits.get(&home).copied().unwrap_or(0.0) >= ((isl_blocks - 1) * BS) as f64,
        "prefix hits {hits:?}"
    );
    assert_eq!(
        r1.stream_text(),
        direct_text(&stack, &home, &body1).await?,
        "disagg changed the answer"
    );
    // The decode worker's events put the pulled blocks in the index.
    let blocks_url = stack.indexer_url(&format!("/debug/blocks?worker={home}"));
    poll::until("the decode worker's events show the pulled blocks", || {
        let (c, u) = (c.clone(), blocks_url.clone());
        async move {
            let ranks: Vec<Value> = c.get(&u).send().await.ok()?.json().await.ok()?;
            let held =
                ranks.iter().filter_map(|r| r["blocks"].as_array()).map(Vec::len).sum::<usize>()
                    as u64;
            (held >= isl_blocks).then_some(())
        }
    })
    .await?;

    // Turn 2 adds more than the threshold of new text: still local, on the same worker.
    let reply1 = r1.stream_text();
    let turn2 =
        [turn1.clone(), vec![("assistant", reply1.clone()), ("user", filler(4, 1500))]].concat();
    let r2 =
        post_json(&c, &url, &chat(&turn2, true), &[(DEFAULT_SESSION_HEADER, "chat-1")]).await?;
    assert_eq!(
        (r2.status, mode(&r2), r2.worker()),
        (200, "aggregate", Some(home.as_str())),
        "{:?}",
        r2.reason()
    );
    assert!(r2.reason_codes().contains(&ReasonCode::LocalContinuation), "{:?}", r2.reason());
    assert!(
        r2.stream_cached_tokens().unwrap_or(0) >= (isl_blocks - 1) * BS,
        "turn 2 reused the history"
    );

    // The indexer restarts between turns: the recently-seen set is gone, the index is rebuilt from
    // the engines' replay, and the session stays home (its tail is small).
    stack.restart_indexer().await?;
    let turn3 =
        [turn2.clone(), vec![("assistant", r2.stream_text()), ("user", filler(5, 30))]].concat();
    let r3 =
        post_json(&c, &url, &chat(&turn3, true), &[(DEFAULT_SESSION_HEADER, "chat-1")]).await?;
    assert_eq!(
        (r3.status, mode(&r3), r3.worker()),
        (200, "aggregate", Some(home.as_str())),
        "{:?}",
        r3.reason()
    );
    assert!(
        r3.overlap_blocks().unwrap_or(0) > isl_blocks,
        "the rebuilt index knows the history: {:?}",
        r3.reason()
    );
    // And a new long conversation is disaggregated by the restarted indexer.
    let fresh = chat(&[("system", filler(6, 1500)), ("user", filler(7, 40))], true);
    let r4 = post_json(&c, &url, &fresh, &[(DEFAULT_SESSION_HEADER, "chat-2")]).await?;
    assert_eq!((r4.status, mode(&r4)), (200, "disagg"), "{:?}", r4.reason());

    let envoy = stack.envoy_metrics().await?;
    assert_eq!(envoy.sum("kvmesh_filter_requests_total", &[("mode", "disagg")]), 2.0);
    let m = stack.scrape(&stack.indexer_url("/metrics")).await?;
    assert_eq!(
        m.sum("kvmesh_prefill_legs_total", &[("outcome", "ok")]),
        1.0,
        "the restarted indexer ran one leg"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_prefill_legs_fall_back_to_decode_and_overload_reaches_the_client(
) -> anyhow::Result<()> {
    let mut spec = StackSpec::disaggregated(1, 2);
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": 8000});
    // Prefill failures must not mark the worker unhealthy here: each leg has to reach it.
    let routing = "min_remote_prefill_tokens = 256\nprefill_timeout_ms = 2500\nunhealthy_after_failures = 0\nreload_poll_ms = 100\n";
    spec.routing_toml = routing.into();
    let mut stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/chat/completions");
    let faults = stack.worker("p0")?.url("/admin/faults");
    let mut n = 0u64;
    let mut cold = || {
        n += 1;
        chat(&[("user", filler(100 + n, 500))], n.is_multiple_of(2))
    };
    let set = |patch: Value| {
        let (c, faults) = (c.clone(), faults.clone());
        async move { c.post(&faults).json(&patch).send().await?.error_for_status().map(|_| ()) }
    };

    let r = post_json(&c, &url, &cold(), &[]).await?;
    assert_eq!((r.status, mode(&r)), (200, "disagg"), "{:?}", r.reason());

    // (fault, expected fallback reason in the decision)
    let cases = [
        (json!({"fail_prefill_status": 500}), "http_5xx"),
        (json!({"clear": true, "fail_prefill_status": 503}), "http_5xx"),
        (json!({"clear": true, "extra_latency_ms": 4000}), "timeout"),
    ];
    for (patch, why) in cases {
        set(patch.clone()).await?;
        let r = post_json(&c, &url, &cold(), &[]).await?;
        assert_eq!(
            (r.status, mode(&r)),
            (200, "decode_fallback"),
            "{patch}: {} {:?}",
            r.text,
            r.reason()
        );
        assert_eq!(
            r.reason_codes().last(),
            Some(&ReasonCode::PrefillLegFailed),
            "{patch}: {:?}",
            r.reason()
        );
        // The failure kind is the leg's stable label, quoted in the prose.
        assert!(
            r.reason().is_some_and(|m| m.contains(&format!("failed ({why})"))),
            "{patch}: {:?}",
            r.reason()
        );
        assert!(
            r.worker().is_some_and(|w| w.starts_with('d')),
            "{patch}: served by {:?}",
            r.worker()
        );
    }

    // 429: the client is told to back off.
    set(json!({"clear": true, "fail_prefill_status": 429})).await?;
    let r = post_json(&c, &url, &cold(), &[]).await?;
    assert_eq!(r.status, 429, "{}", r.text);
    // A stable code and message for the client; the indexer's details (worker, engine text) stay
    // in the gateway's logs and metrics.
    assert_eq!(r.header("x-kvmesh-error"), Some("prefill_overloaded"), "{}", r.text);
    assert!(
        r.text.contains("prefill_overloaded") && !r.text.contains("out of capacity"),
        "{}",
        r.text
    );

    // Removed from the fleet while its leg runs: the answer is not trusted.
    // The leg takes 1.8 s (under its 2.5 s deadline); the reload lands well within it.
    set(json!({"clear": true, "extra_latency_ms": 1800})).await?;
    let in_flight = tokio::spawn({
        let (c, url, body) = (c.clone(), url.clone(), cold());
        async move { post_json(&c, &url, &body, &[]).await }
    });
    let fleet_url = stack.indexer_url("/v1/fleet");
    poll::until("the prefill leg is in flight", || {
        let (c, u) = (c.clone(), fleet_url.clone());
        async move {
            let f: FleetSnapshot = c.get(&u).send().await.ok()?.json().await.ok()?;
            f.workers.iter().any(|w| w.id == "p0" && w.load.active_requests > 0).then_some(())
        }
    })
    .await?;
    stack.rewrite_fleet(|w| w.id != "p0", routing).await?;
    let r = in_flight.await??;
    assert_eq!((r.status, mode(&r)), (200, "decode_fallback"), "{:?}", r.reason());
    assert_eq!(r.reason_codes().last(), Some(&ReasonCode::PrefillLegFailed), "{:?}", r.reason());
    assert!(r.reason().is_some_and(|m| m.contains("failed (worker_gone)")), "{:?}", r.reason());
    stack.rewrite_fleet(|_| true, routing).await?;

    // Vanished: nothing listens on its port.
    set(json!({"clear": true, "vanish_ms": 4000})).await?;
    let r = post_json(&c, &url, &cold(), &[]).await?;
    assert_eq!((r.status, mode(&r)), (200, "decode_fallback"), "{:?}", r.reason());
    assert_eq!(r.reason_codes().last(), Some(&ReasonCode::PrefillLegFailed), "{:?}", r.reason());
    assert!(
        r.reason().is_some_and(|m| m.contains("failed (refused)") || m.contains("failed (reset)")),
        "{:?}",
        r.reason()
    );

    let m = stack.scrape(&stack.indexer_url("/metrics")).await?;
    let fallbacks = |reason: &str| m.sum("kvmesh_prefill_fallbacks_total", &[("reason", reason)]);
    assert_eq!(
        (fallbacks("http_5xx"), fallbacks("timeout"), fallbacks("worker_gone")),
        (2.0, 1.0, 1.0)
    );
    assert_eq!(fallbacks("refused") + fallbacks("reset"), 1.0);
    let legs = |o: &str| m.sum("kvmesh_prefill_legs_total", &[("outcome", o)]);
    assert_eq!((legs("ok"), legs("fallback"), legs("overloaded")), (1.0, 5.0, 1.0));
    let envoy = stack.envoy_metrics().await?;
    assert_eq!(envoy.sum("kvmesh_filter_requests_total", &[("mode", "decode_fallback")]), 5.0);
    // Prefill errors never turn the gateway's health red.
    for path in ["/healthz", "/readyz"] {
        assert!(c.get(stack.indexer_url(path)).send().await?.status().is_success(), "{path}");
    }
    Ok(())
}
