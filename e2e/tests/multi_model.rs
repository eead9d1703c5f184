//! Several models and LoRA adapters behind one gateway, through real Envoy (issue 44): two base
//! models (`deepseek-v4`, block 16, alias `ds4`, adapters `ds4-sql` and `ds4-chat`, on w0 and w1;
//! `deepseek-v4-mini`, block 32, adapter `mini-code`, on w2 and w3), each simulator serving its
//! worker's model and adapters as vLLM does (a model it does not serve is its 404).
//!
//! - Every request — each base model, the alias, each adapter; chat and completions; streaming and
//!   not — is served (200) by a worker of its model, the indexer's decisions per model count them,
//!   and the engines' own request counters per pool agree.
//! - An adapter conversation's continuation turns hit, and the indexer predicted exactly the
//!   engine's hit (overlap × block size == `cached_tokens`); a prompt cached under the base model is
//!   a miss under an adapter, on the engine and in the prediction, and one adapter's blocks are a
//!   miss under another.
//! - A model nobody serves is vLLM's 404 from the gateway and reaches no engine; `GET /v1/models`
//!   through the gateway lists every base model, alias and adapter (adapters with their parent).
//! - With the indexer killed, requests are still served, each within its model's workers, the
//!   unknown model is still a 404 and `/v1/models` still answers, from the filter's last snapshot.

use std::collections::{BTreeMap, BTreeSet};

use kvmesh_core::models::{self, FleetModel};
use kvmesh_core::{api, headers};
use kvmesh_e2e::client::{filler, post_json, Reply};
use kvmesh_e2e::poll;
use kvmesh_e2e::stack::{ModelSpec, Stack, StackSpec};
use serde_json::{json, Value};

const A: &str = "deepseek-v4";
const B: &str = "deepseek-v4-mini";
const SECRET: &str = "multi-model-e2e-override";

/// Every name a request may use, with its base model.
const NAMES: [(&str, &str); 6] =
    [(A, A), ("ds4", A), ("ds4-sql", A), ("ds4-chat", A), (B, B), ("mini-code", B)];

fn models() -> Vec<ModelSpec> {
    vec![
        ModelSpec::new(A, 16).aliases(&["ds4"]).adapters(&["ds4-sql", "ds4-chat"]),
        ModelSpec::new(B, 32).adapters(&["mini-code"]),
    ]
}

fn spec() -> StackSpec {
    let mut spec = StackSpec::multi_model(models(), 2);
    // Overrides place a request on a chosen worker, to compare one engine's cache across models.
    spec.filter_config =
        json!({"debug_headers": true, "allow_overrides": true, "override_secret": SECRET});
    spec
}

fn block_size(base: &str) -> u64 {
    models().iter().find(|m| m.name == base).map_or(0, |m| u64::from(m.block_size))
}

/// A request for `model`: chat or completions, streaming (with the usage chunk) or not.
fn request(model: &str, chat: bool, stream: bool, text: &str) -> (&'static str, Value) {
    let mut body = if chat {
        json!({"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 3})
    } else {
        json!({"model": model, "prompt": text, "max_tokens": 3})
    };
    if stream {
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
    }
    (if chat { "/v1/chat/completions" } else { "/v1/completions" }, body)
}

/// `usage.prompt_tokens_details.cached_tokens`, streamed or not.
fn cached(r: &Reply, stream: bool) -> Option<u64> {
    if stream {
        r.stream_cached_tokens()
    } else {
        r.cached_tokens()
    }
}

/// The workers of base model `base`.
fn pool(stack: &Stack, base: &str) -> BTreeSet<String> {
    stack.workers_of(base).iter().map(|w| w.id.clone()).collect()
}

/// Sends `body` to the gateway and checks it was served by a worker of `base` — the engine's own
/// `x-sim-worker` — and that kvmesh's decision names the same worker.
async fn served_within(
    stack: &Stack,
    path: &str,
    body: &Value,
    base: &str,
    extra: &[(&str, &str)],
) -> anyhow::Result<Reply> {
    let r = post_json(stack.client(), &stack.gateway(path), body, extra).await?;
    anyhow::ensure!(r.status == 200, "{} on {path}: {} {}", body["model"], r.status, r.text);
    let worker = r.worker().unwrap_or_default().to_owned();
    let want = pool(stack, base);
    anyhow::ensure!(
        want.contains(&worker),
        "{} (base {base}) was served by {worker:?}, not by one of {want:?}",
        body["model"]
    );
    if let Some(decided) = r.header(headers::DEBUG_WORKER) {
        anyhow::ensure!(decided == worker, "decided {decided}, served by {worker}");
    }
    if body["stream"] == json!(true) {
        anyhow::ensure!(
            r.text.trim_end().ends_with("data: [DONE]"),
            "unfinished stream: {}",
            r.text
        );
    }
    Ok(r)
}

/// Requests Envoy sent to the engines' cluster so far.
async fn engine_upstream_requests(stack: &Stack) -> anyhow::Result<u64> {
    let text = stack
        .client()
        .get(stack.admin("/stats?filter=^cluster\\.engines\\.upstream_rq_total$"))
        .send()
        .await?
        .error_for_status()?
        .text()
        .await?;
    text.lines()
        .find_map(|l| l.split_once(": ")?.1.trim().parse().ok())
        .ok_or_else(|| anyhow::anyhow!("no cluster.engines.upstream_rq_total in {text:?}"))
}

/// Successful requests each worker's engine counted (`vllm:request_success_total`).
async fn engine_successes(stack: &Stack) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for w in &stack.workers {
        let m = stack.scrape(&w.url("/metrics")).await?;
        out.insert(w.id.clone(), m.sum("vllm:request_success_total", &[]));
    }
    Ok(out)
}

/// Waits until the indexer holds every block worker `id`'s engine holds (its KV events are all
/// applied), so a prediction can be compared with the engine's hit exactly.
async fn settle(stack: &Stack, id: &str) -> anyhow::Result<()> {
    let engine_url = stack.worker(id)?.url("/admin/cache");
    let debug_url = stack.indexer_url("/debug/workers");
    let c = stack.client().clone();
    poll::until(&format!("the indexer caught up with {id}'s cache"), || {
        let (c, engine_url, debug_url) = (c.clone(), engine_url.clone(), debug_url.clone());
        async move {
            let engine: Value = c.get(&engine_url).send().await.ok()?.json().await.ok()?;
            let held = engine["blocks"].as_array()?.len() as u64;
            let all: Value = c.get(&debug_url).send().await.ok()?.json().await.ok()?;
            let w = all.as_array()?.iter().find(|w| w["id"] == id)?;
            let indexed: u64 =
                w["ranks"].as_array()?.iter().filter_map(|r| r["blocks_held"].as_u64()).sum();
            (indexed == held).then_some(())
        }
    })
    .await
}

/// The overlap the indexer predicts for `body` on worker `id` (asked directly, with an override;
/// the booking is released, nothing is sent to the engine).
async fn predicted_overlap(
    stack: &Stack,
    id: &str,
    path: &str,
    body: &Value,
) -> anyhow::Result<u64> {
    let r = stack
        .client()
        .post(stack.indexer_url(api::ROUTE_PATH))
        .header(headers::KVMESH_PATH, path)
        .header(headers::OVERRIDE_WORKER, id)
        .json(body)
        .send()
        .await?;
    anyhow::ensure!(r.status().is_success(), "route call: {}", r.text().await.unwrap_or_default());
    let d: api::RouteDecision = r.json().await?;
    anyhow::ensure!(d.worker == id, "override ignored: {d:?}");
    let done = api::DoneReport {
        request_id: "probe".into(),
        endpoint: None,
        outcome: api::Outcome::Aborted,
        status: None,
        booking_id: d.booking_id.clone(),
        usage: None,
    };
    stack.client().post(stack.indexer_url(api::DONE_PATH)).json(&done).send().await?;
    Ok(u64::from(d.overlap_blocks))
}

/// What `GET /v1/models` through the gateway must list: (id, parent) of every base model, alias
/// and adapter — the fleet's own rendering, `models::models_list`.
fn expected_models() -> BTreeSet<(String, Option<String>)> {
    let fleet: Vec<FleetModel> = models().iter().map(ModelSpec::fleet_model).collect();
    model_ids(&models::models_list(&fleet, 0))
}

fn model_ids(list: &Value) -> BTreeSet<(String, Option<String>)> {
    list["data"]
        .as_array()
        .map(|d| {
            d.iter()
                .filter_map(|e| {
                    Some((e["id"].as_str()?.to_owned(), e["parent"].as_str().map(str::to_owned)))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// `GET /v1/models` through the gateway lists the whole fleet, answered by the gateway (no engine
/// header: an engine lists only its own model). Polls: until the filter's first fleet snapshot,
/// the request passes to an engine.
async fn gateway_lists_every_model(stack: &Stack) -> anyhow::Result<()> {
    let want = expected_models();
    let url = stack.gateway("/v1/models");
    let c = stack.client().clone();
    let listed = poll::until("the gateway's /v1/models lists the whole fleet", || {
        let (c, url, want) = (c.clone(), url.clone(), want.clone());
        async move {
            let r = c.get(&url).send().await.ok()?;
            let from_engine = r.headers().contains_key(kvmesh_e2e::client::SIM_WORKER);
            let body: Value = r.json().await.ok()?;
            (!from_engine && model_ids(&body) == want).then_some(body)
        }
    })
    .await;
    let listed = match listed {
        Ok(listed) => listed,
        Err(e) => {
            let last = c.get(&url).send().await?.text().await?;
            anyhow::bail!("{e}; the last answer: {last}");
        }
    };
    assert_eq!(listed["object"], "list");
    Ok(())
}

/// A model nobody serves: vLLM's 404 from the gateway (`models::not_found`), and no engine sees
/// the request. Returns how many such requests it sent.
async fn unknown_models_are_404_from_the_gateway(stack: &Stack) -> anyhow::Result<usize> {
    let before = engine_upstream_requests(stack).await?;
    let unknown = [("gpt-4o", true, false), ("no-such-adapter", false, true)];
    for (name, chat, stream) in unknown {
        let (path, body) = request(name, chat, stream, &filler(77, 40));
        let r = post_json(stack.client(), &stack.gateway(path), &body, &[]).await?;
        assert_eq!(r.status, 404, "{name} on {path}: {}", r.text);
        assert_eq!(r.worker(), None, "{name} reached an engine");
        assert_eq!(r.json(), serde_json::to_value(models::not_found(name))?, "{name}: {}", r.text);
    }
    assert_eq!(
        engine_upstream_requests(stack).await?,
        before,
        "an unknown model reached an engine"
    );
    Ok(unknown.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_stays_within_its_model_and_adapters_hit_exactly() -> anyhow::Result<()> {
    let stack = Stack::start(spec()).await?;
    assert_eq!(pool(&stack, A), BTreeSet::from(["w0".to_owned(), "w1".to_owned()]));
    assert_eq!(pool(&stack, B), BTreeSet::from(["w2".to_owned(), "w3".to_owned()]));
    gateway_lists_every_model(&stack).await?;

    // 1. Every name, chat and completions, streaming and not: served within its model's pool.
    let decisions = |m: &kvmesh_e2e::prom::Metrics, base: &str| {
        m.sum("kvmesh_decisions_total", &[("model", base)])
    };
    let indexer_before = stack.scrape(&stack.indexer_url("/metrics")).await?;
    let engines_before = engine_successes(&stack).await?;
    let mut sent: BTreeMap<&str, f64> = BTreeMap::new();
    let mut seed = 0;
    for (name, base) in NAMES {
        for chat in [false, true] {
            for stream in [false, true] {
                seed += 1;
                let (path, body) = request(name, chat, stream, &filler(seed, 120));
                served_within(&stack, path, &body, base, &[]).await?;
                *sent.entry(base).or_default() += 1.0;
            }
        }
    }
    let indexer_after = stack.scrape(&stack.indexer_url("/metrics")).await?;
    // An engine counts a request when it finishes it, which may be just after its last byte.
    let total: f64 = sent.values().sum();
    let engines_after = poll::until("the engines counted every request", || async {
        let now = engine_successes(&stack).await.ok()?;
        let counted: f64 = now.iter().map(|(w, n)| n - engines_before[w]).sum();
        (counted >= total).then_some(now)
    })
    .await?;
    for base in [A, B] {
        assert_eq!(
            decisions(&indexer_after, base) - decisions(&indexer_before, base),
            sent[base],
            "the indexer's decisions for {base}"
        );
        let served: f64 =
            pool(&stack, base).iter().map(|w| engines_after[w] - engines_before[w]).sum();
        assert_eq!(served, sent[base], "{base}'s engines counted {served} requests");
    }

    // 2. Adapter conversations: every continuation turn hits, exactly as predicted.
    for (adapter, base) in [("ds4-sql", A), ("mini-code", B)] {
        for stream in [false, true] {
            let session = format!("{adapter}-{stream}");
            let mut messages = vec![
                json!({"role": "system", "content": filler(500 + seed, 400)}),
                json!({"role": "user", "content": filler(600 + seed, 40)}),
            ];
            seed += 1;
            for turn in 0..3 {
                for w in pool(&stack, base) {
                    settle(&stack, &w).await?;
                }
                let mut body = json!({"model": adapter, "messages": messages, "max_tokens": 8});
                if stream {
                    body["stream"] = json!(true);
                    body["stream_options"] = json!({"include_usage": true});
                }
                let r = served_within(
                    &stack,
                    "/v1/chat/completions",
                    &body,
                    base,
                    &[(headers::DEFAULT_SESSION_HEADER, session.as_str())],
                )
                .await?;
                let (hit, overlap) = (cached(&r, stream).unwrap_or(0), r.overlap_blocks());
                if turn > 0 {
                    assert!(
                        hit > 0,
                        "{session} turn {turn} missed on the engine: {:?}",
                        r.reason()
                    );
                    assert_eq!(
                        overlap.map(|o| o * block_size(base)),
                        Some(hit),
                        "{session} turn {turn}: predicted overlap × {} vs the engine's cached_tokens ({:?})",
                        block_size(base),
                        r.reason()
                    );
                }
                let answer =
                    if stream { r.stream_text() } else { r.chat_content().unwrap_or_default() };
                messages.push(json!({"role": "assistant", "content": answer}));
                messages.push(json!({"role": "user", "content": filler(700 + turn, 30)}));
            }
        }
    }

    // 3. A prompt cached under the base model is a miss under an adapter (engine and prediction),
    //    and one adapter's blocks are a miss under another; the same adapter again is a hit.
    let forced =
        |id: &'static str| [(headers::OVERRIDE_WORKER, id), (headers::OVERRIDE_SECRET, SECRET)];
    for (worker, base, adapters) in
        [("w0", A, vec!["ds4-sql", "ds4-chat"]), ("w2", B, vec!["mini-code"])]
    {
        let prompt = filler(900 + block_size(base), 500);
        let (path, base_body) = request(base, false, false, &prompt);
        let r = served_within(&stack, path, &base_body, base, &forced(worker)).await?;
        assert_eq!(r.worker(), Some(worker), "the override was not honoured");
        settle(&stack, worker).await?;
        assert!(
            predicted_overlap(&stack, worker, path, &base_body).await? > 0,
            "the index does not know {base}'s prompt on {worker}: the misses below would prove nothing"
        );
        for adapter in &adapters {
            let (_, body) = request(adapter, false, false, &prompt);
            assert_eq!(
                predicted_overlap(&stack, worker, path, &body).await?,
                0,
                "{adapter} predicted to hit blocks cached under {base} or another adapter"
            );
            let r = served_within(&stack, path, &body, base, &forced(worker)).await?;
            assert_eq!(r.worker(), Some(worker));
            assert_eq!(
                (r.cached_tokens(), r.overlap_blocks()),
                (Some(0), Some(0)),
                "{adapter} on {worker} after {base} (and the adapters before it) cached the prompt"
            );
            settle(&stack, worker).await?;
            let again = served_within(&stack, path, &body, base, &forced(worker)).await?;
            let hit = again.cached_tokens().unwrap_or(0);
            assert!(hit > 0, "{adapter}'s own prompt again missed");
            assert_eq!(
                again.overlap_blocks().map(|o| o * block_size(base)),
                Some(hit),
                "{adapter} again"
            );
            settle(&stack, worker).await?;
        }
    }

    // 4. A model nobody serves.
    let errors = |m: &kvmesh_e2e::prom::Metrics| {
        m.sum("kvmesh_route_errors_total", &[("reason", models::UNKNOWN_MODEL_REASON)])
    };
    let before = errors(&stack.scrape(&stack.indexer_url("/metrics")).await?);
    let sent = unknown_models_are_404_from_the_gateway(&stack).await?;
    let after = errors(&stack.scrape(&stack.indexer_url("/metrics")).await?);
    assert_eq!(after - before, sent as f64, "the indexer counts each unknown model it answered");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_indexer_down_each_model_stays_on_its_workers() -> anyhow::Result<()> {
    let mut stack = Stack::start(spec()).await?;
    // The filter's snapshot holds the models once the gateway lists them.
    gateway_lists_every_model(&stack).await?;
    // Turn 1 of some sessions with the indexer up.
    for (i, (name, base)) in NAMES.into_iter().enumerate() {
        let sid = format!("down-{i}");
        let (path, body) = request(name, true, false, &filler(3000 + i as u64, 150));
        served_within(
            &stack,
            path,
            &body,
            base,
            &[(headers::DEFAULT_SESSION_HEADER, sid.as_str())],
        )
        .await?;
    }

    stack.kill_indexer();

    let mut seed = 4000;
    for (i, (name, base)) in NAMES.into_iter().enumerate() {
        let sid = format!("down-{i}");
        for chat in [false, true] {
            for stream in [false, true] {
                // With a session (the one placed above, or a new one) and without.
                let new_sid = format!("down-new-{seed}");
                let sessions: [Option<&str>; 3] = [Some(&sid), Some(&new_sid), None];
                for s in sessions {
                    seed += 1;
                    let (path, body) = request(name, chat, stream, &filler(seed, 120));
                    let extra: Vec<(&str, &str)> =
                        s.map(|s| (headers::DEFAULT_SESSION_HEADER, s)).into_iter().collect();
                    let r = served_within(&stack, path, &body, base, &extra).await?;
                    assert!(
                        r.header(headers::DEBUG_FALLBACK).is_some(),
                        "{name}: no fallback header with the indexer down"
                    );
                }
            }
        }
    }
    let envoy = stack.envoy_metrics().await?;
    assert!(envoy.sum("kvmesh_filter_fallbacks_total", &[]) >= 72.0, "fallbacks not counted");

    unknown_models_are_404_from_the_gateway(&stack).await?;
    gateway_lists_every_model(&stack).await?;
    Ok(())
}
